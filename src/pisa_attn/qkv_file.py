"""The q/k/v capture file: post-norm, post-RoPE q/k/v of real attention calls in one
``.safetensors`` file, written by :func:`pisa_attn.diffusers.capture_qkv` and read by the accuracy
study (``pisa-attn study --source FILE``).

Tensors are named ``step{S}.layer{L}.q|k|v`` (``[1, H, L, D]``, in the token order PISA ran them,
described by the entry's token layout). The file's metadata (str -> str) holds JSON: ``format``,
``version``, ``model``, ``dtype``, the first entry's ``grid`` / ``text_len`` / ``tile`` /
``token_layout``, and ``entries`` with every entry's step, layer, layout, image-query range,
softmax ``scale`` and the PISA settings of the run. Reading needs ``safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from . import spec
from ._files import write_replacing
from .layout import Grid, Text, TokenOrder, _check_int

FORMAT = "pisa-attn-qkv"
VERSION = 1


# --- token layout <-> JSON ---------------------------------------------------------------------
def layout_to_json(layout: TokenOrder) -> dict:
    segs = [{"text": s.n, "name": s.name} if isinstance(s, Text) else {"grid": list(s.shape)} for s in layout.segments]
    out = {"segments": segs, "tile": list(layout.tile) if layout.tile else None, "order": layout.order}
    if layout.offset:
        out["offset"] = layout.offset
    return out


def _json_int(x, what: str) -> int:
    # a JSON number that is an integer: 64.7 or Infinity is a malformed file, not 64 or a crash
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{what} must be an integer, got {x!r}")
    return x


def _json_str(x, what: str) -> str:
    # a list or object would make the layout unhashable: a TypeError wherever it is first cached
    if not isinstance(x, str):
        raise TypeError(f"{what} must be a string, got {x!r}")
    return x


def layout_from_json(d: dict) -> TokenOrder:
    try:
        segs = tuple(Text(_json_int(s["text"], "text"), _json_str(s.get("name", "text"), "name")) if "text" in s
                     else Grid(tuple(_json_int(g, "grid") for g in s["grid"])) for s in d["segments"])
        tile = tuple(_json_int(t, "tile") for t in d["tile"]) if d.get("tile") else None
        return TokenOrder(segs, tile, d.get("order", "compact"), _json_int(d.get("offset", 0), "offset"))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed token layout description {d!r}: {e}") from None


def trim_layout(layout: TokenOrder, n: int) -> TokenOrder | None:
    """Layout of the first ``n`` tiled tokens when the rest are the tail of one text segment
    (masked padding text keys), else None (also for ``n = 0``: a layout holds at least one
    segment, so none describes an empty prefix)."""
    n = _check_int("n", n, 0)  # a negative n would slice from the end
    length = layout.num_tokens
    if n >= length:
        return layout
    if n == 0:
        return None
    seg_ids = layout.segment_ids(tiled=True)
    tail = seg_ids[n:]
    s = int(tail[0])
    if not bool((tail == s).all()) or not isinstance(layout.segments[s], Text):
        return None
    cut = length - n
    segs = list(layout.segments)
    if segs[s].n > cut:
        segs[s] = Text(segs[s].n - cut, segs[s].name)
    else:
        del segs[s]
    new = TokenOrder(tuple(segs), layout.tile, layout.order, layout.offset)
    same = torch.equal(new.coords(tiled=True), layout.coords(tiled=True)[:n]) and torch.equal(
        new.text_mask_tokens(), layout.text_mask_tokens()[:n]
    )
    return new if same else None


# --- file format -------------------------------------------------------------------------------
@dataclass
class QKVEntry:
    """One captured attention call; ``q``/``k``/``v`` load from the file on first access."""

    name: str
    path: str
    info: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def layer(self) -> int:
        return int(self.info["layer"])

    @cached_property
    def layout(self) -> TokenOrder | None:
        d = self.info.get("token_layout")
        return None if d is None else layout_from_json(d)

    def _load(self, part: str) -> Tensor:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(f"{self.name}.{part}")

    @cached_property
    def q(self) -> Tensor:
        return self._load("q")

    @cached_property
    def k(self) -> Tensor:
        return self._load("k")

    @cached_property
    def v(self) -> Tensor:
        return self._load("v")


@dataclass
class QKVFile:
    path: str
    meta: dict[str, Any]
    entries: list[QKVEntry] = field(default_factory=list)


def read_qkv_file(path: str) -> QKVFile:
    """Open a capture file (metadata now, tensors lazily; :func:`check_entry` checks them).
    ValueError naming the file or entry on a malformed one."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ModuleNotFoundError("reading captures needs safetensors: pip install safetensors") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
            keys = set(f.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"path {str(path)!r} is not a readable .safetensors file: {e}") from None
    if raw.get("format") != FORMAT:
        raise ValueError(f"path {str(path)!r} is not a pisa-attn q/k/v capture (metadata format={raw.get('format')!r})")
    try:
        meta = {k: v if k == "format" else json.loads(v) for k, v in raw.items()}
    except json.JSONDecodeError as e:
        raise ValueError(f"capture {str(path)!r} has malformed metadata: {e}") from None
    if type(meta.get("version")) is not int or meta.get("version") != VERSION:  # not 1.0 or true
        raise ValueError(f"capture {str(path)!r} has format version {meta.get('version')!r}, "
                         f"this reader needs {VERSION}")
    listed = meta.get("entries")
    if not isinstance(listed, dict):
        raise ValueError(f"capture {str(path)!r} needs metadata 'entries': an object of entry name -> info, "
                         f"got {type(listed).__name__}")
    entries = []
    for name, info in listed.items():
        missing = [p for p in "qkv" if f"{name}.{p}" not in keys]
        if missing:
            raise ValueError(f"capture {str(path)!r} lists entry {name!r} but lacks its tensors {missing}")
        if not isinstance(info, dict):
            raise ValueError(f"capture {str(path)!r}: entry {name!r} needs an info object, got {type(info).__name__}")
        for key in ("step", "layer"):
            x = info.get(key)
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"capture {str(path)!r}: entry {name!r} needs {key!r} (a non-negative int), got {x!r}")
        entries.append(QKVEntry(name, str(path), info))
    return QKVFile(str(path), meta, entries)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_entry(e: QKVEntry) -> None:
    """ValueError naming the entry unless its q/k/v are floating ``[B, H, L, D]`` tensors of one
    call (k and v of one shape, q's batch and head dim, heads a multiple of k's, a head dim PISA
    runs, finite values, an image range inside q's rows, a token layout of q's and k's length).
    Loads the tensors without keeping them."""
    where = f"capture {e.path!r}, entry {e.name!r}"
    q, k, v = (e._load(p) for p in "qkv")
    for part, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{where}: {part} must be a floating tensor, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{where}: {part} must have rank 4 [B, H, L, D], got shape {tuple(x.shape)}")
        if x.numel() == 0:
            raise ValueError(f"{where}: {part} is empty, shape {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{where}: {part} holds NaN or infinite values")
    shape = e.info.get("shape")
    if shape is not None and list(q.shape) != shape:  # e.g. a [B, L, H, D] file: it would load as 'L heads'
        raise ValueError(f"{where}: q has shape {tuple(q.shape)}, its entry records {shape!r}")
    if k.shape != v.shape:
        raise ValueError(f"{where}: k and v must have one shape (key lengths), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"{where}: q {tuple(q.shape)} does not fit k {tuple(k.shape)} (batch, heads, head dim)")
    if not spec.MIN_HEAD_DIM <= q.shape[3] <= spec.MAX_HEAD_DIM:
        raise ValueError(f"{where}: head dim must be in [{spec.MIN_HEAD_DIM}, {spec.MAX_HEAD_DIM}], got {q.shape[3]}")
    if e.info.get("token_layout") is not None:
        try:
            n = e.layout.num_tokens
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if n != k.shape[2] or n != q.shape[2]:
            raise ValueError(f"{where}: its token_layout holds {n} tokens, q {q.shape[2]} and k {k.shape[2]}")
    rng = e.info.get("image_range")
    if rng is not None:
        ok = isinstance(rng, (list, tuple)) and len(rng) == 2 and all(isinstance(x, int) for x in rng)
        if not ok or not 0 <= rng[0] < rng[1] <= q.shape[2]:
            raise ValueError(f"{where}: image_range must be [lo, hi) inside q's {q.shape[2]} rows, got {rng!r}")
    scale = e.info.get("scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
                              or scale == float("inf")):
        raise ValueError(f"{where}: scale must be a positive finite number, got {scale!r}")


def write_qkv_file(path: str, tensors: dict[str, Tensor], entries: dict[str, dict], model: str, dtype: str) -> None:
    import safetensors.torch

    first = next(iter(entries.values()), {})
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "dtype": dtype,
        "grid": first.get("grid"),
        "text_len": first.get("text_len"),
        "tile": (first.get("token_layout") or {}).get("tile"),
        "token_layout": first.get("token_layout"),
        "entries": entries,
    }
    # safetensors metadata is str -> str: every value is JSON (the "format" tag is a JSON-free str).
    text = {k: v if k == "format" else json.dumps(v) for k, v in meta.items()}
    # a write that fails part-way (a full disk) leaves no truncated capture where an earlier one was
    write_replacing(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata=text))
