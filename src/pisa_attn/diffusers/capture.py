"""Capture post-norm, post-RoPE q/k/v of a real pipeline run into one ``.safetensors`` file.

``pisa-attn study --source FILE`` then runs the accuracy study on real activations::

    with capture_qkv(pipe, layers=[0, 10], steps=[0, 25], path="qkv.safetensors"):
        pipe(prompt, num_inference_steps=30)

Tensors are named ``step{S}.layer{L}.q|k|v`` (``[1, H, L, D]``, tiled order as PISA sees them).
The file's metadata (str -> str) holds JSON: ``format``, ``version``, ``model``, ``dtype``, the
first entry's ``grid`` / ``text_len`` / ``tile`` / ``token_layout``, and ``entries`` with every
entry's step, layer, layout, image-query range, softmax ``scale`` and the PISA settings of the run.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from ..layout import Grid, Text, TokenLayout
from . import hooks
from .models import transformers_of

FORMAT = "pisa-attn-qkv"
VERSION = 1
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# --- token layout <-> JSON ---------------------------------------------------------------------
def layout_to_json(layout: TokenLayout) -> dict:
    segs = [{"text": s.n, "name": s.name} if isinstance(s, Text) else {"grid": list(s.shape)} for s in layout.segments]
    out = {"segments": segs, "tile": list(layout.tile) if layout.tile else None, "order": layout.order}
    if layout.offset:
        out["offset"] = layout.offset
    return out


def layout_from_json(d: dict) -> TokenLayout:
    try:
        segs = tuple(Text(int(s["text"]), s.get("name", "text")) if "text" in s else Grid(tuple(s["grid"]))
                     for s in d["segments"])
        tile = tuple(d["tile"]) if d.get("tile") else None
        return TokenLayout(segs, tile, d.get("order", "compact"), int(d.get("offset", 0)))
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed token layout description {d!r}: {e}") from None


def trim_layout(layout: TokenLayout, n: int) -> TokenLayout | None:
    """Layout of the first ``n`` tiled tokens when the rest are the tail of one text segment
    (masked padding text keys), else None."""
    length = layout.num_tokens
    if n >= length:
        return layout
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
    new = TokenLayout(tuple(segs), layout.tile, layout.order, layout.offset)
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
    def layout(self) -> TokenLayout | None:
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
    """Open a capture file (metadata now, tensors lazily)."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as e:
        raise RuntimeError("reading captures needs safetensors: pip install safetensors") from e
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
    if meta.get("version") != VERSION:
        raise ValueError(f"capture {str(path)!r} has format version {meta.get('version')!r}, "
                         f"this reader needs {VERSION}")
    entries = []
    for name, info in meta["entries"].items():
        missing = [p for p in "qkv" if f"{name}.{p}" not in keys]
        if missing:
            raise ValueError(f"capture {str(path)!r} lists entry {name!r} but lacks its tensors {missing}")
        entries.append(QKVEntry(name, str(path), info))
    return QKVFile(str(path), meta, entries)


def write_qkv_file(path: str, tensors: dict[str, Tensor], entries: dict[str, dict], model: str, dtype: str) -> None:
    from safetensors.torch import save_file

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
    save_file(tensors, str(path), metadata={k: v if k == "format" else json.dumps(v) for k, v in meta.items()})


# --- capture -----------------------------------------------------------------------------------
def _index_set(name: str, value) -> frozenset[int] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{name} must be None, an int or an iterable of ints, got {type(value).__name__}") from None
    if not items or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ValueError(f"{name} must be None or non-negative ints, got {value!r}")
    return frozenset(items)


def _transformers(obj) -> list[tuple[str, torch.nn.Module]]:
    """(entry-name prefix, transformer): ``transformer_2``'s entries are prefixed."""
    found, _ = transformers_of(obj)
    return [("" if n == "transformer" else n + ".", t) for n, t in found]


class QKVCapture:
    """Records q/k/v of the chosen (layer, step) calls while attached; :meth:`close` writes the file.

    Usable as a context manager (closes on exit). See :func:`capture_qkv`.
    """

    def __init__(self, pipe, layers=None, steps=None, path: str = "qkv.safetensors", *, batch: int = 0,
                 dtype: torch.dtype | None = None, max_bytes: int | None = None):
        from .apply import apply_pisa, pisa_state

        self.layers, self.steps = _index_set("layers", layers), _index_set("steps", steps)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise ValueError(f"batch must be a non-negative int (the batch row to record), got {batch!r}")
        if dtype is not None and dtype not in _DTYPES.values():
            raise TypeError(f"dtype must be None, torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be None or a positive int, got {max_bytes!r}")
        if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
            raise TypeError(f"path must be a file path, got {type(path).__name__}")
        self.path, self.batch, self.dtype, self.max_bytes = str(path), batch, dtype, max_bytes
        self.tensors: dict[str, Tensor] = {}
        self.entries: dict[str, dict] = {}
        self.nbytes = 0
        self.model = ""
        self._full = False
        self._pipe = pipe
        self._applied = []  # what this capture applied PISA to (the pipeline, or transformers)
        self._removers = []
        self._closed = False
        found = _transformers(pipe)
        # Capture needs the tiled, post-RoPE tensors only a managed model exposes. Every call runs
        # dense (the model's own exact attention): observers get the valid keys per row of dense
        # calls too, which is what drops padded text keys. Density 1 is what the entries record.
        exact = dict(density=1.0, dense_steps=sys.maxsize)
        if not isinstance(pipe, torch.nn.Module) and all(pisa_state(tr) is None for _, tr in found):
            self._applied.append(apply_pisa(pipe, **exact))  # the pipeline hook marks generation starts
        else:
            for _, tr in found:
                if pisa_state(tr) is None:
                    self._applied.append(apply_pisa(tr, **exact))
        self._applied_any = bool(self._applied)
        for prefix, tr in found:
            self._removers.append(hooks.add_observer(tr, self._observer(prefix)))

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def _observer(self, prefix: str):
        def observe(call: hooks.AttentionCall) -> None:
            if self._full or (self.layers is not None and call.layer not in self.layers):
                return
            if self.steps is not None and call.step not in self.steps:
                return
            name = f"{prefix}step{call.step}.layer{call.layer}"
            if name in self.entries:  # first call wins (Wan's cond before uncond, first generation)
                return
            self._record(name, call)

        return observe

    def _record(self, name: str, call: hooks.AttentionCall) -> None:
        b = self.batch
        if b >= call.q.shape[0]:
            raise ValueError(f"capture batch={b} but the attention call has only {call.q.shape[0]} batch rows")
        lens = call.meta.get("key_lens")
        n = call.k.shape[2] if not lens else int(lens[b])
        layout = call.meta.get("token_layout")
        if layout is not None and n < layout.num_tokens:
            layout = trim_layout(layout, n)
        parts = {}
        for p, x in (("q", call.q), ("k", call.k), ("v", call.v)):
            x = x[b : b + 1, :, :n].detach()
            parts[p] = x.to(device="cpu", dtype=self.dtype or x.dtype).contiguous()
        size = sum(x.numel() * x.element_size() for x in parts.values())
        if self.max_bytes is not None and self.nbytes + size > self.max_bytes:
            self._full = True
            warnings.warn(f"capture_qkv: max_bytes={self.max_bytes} reached, {name} and later calls are not recorded",
                          RuntimeWarning, stacklevel=2)
            return
        self.nbytes += size
        for p, x in parts.items():
            self.tensors[f"{name}.{p}"] = x
        self.model = self.model or call.model
        image = call.meta.get("image_range")
        self.entries[name] = {
            "step": call.step, "layer": call.layer, "model": call.model, "dense": call.dense,
            "dense_reason": call.meta.get("dense_reason"), "density": call.density, "mode": call.mode,
            "covariance_aware": call.covariance_aware, "block_size": call.block_size, "scale": call.scale,
            "grid": list(call.meta["grid"]) if call.meta.get("grid") is not None else None,
            "text_len": call.meta.get("text_len"),
            "image_range": [int(image[0]), min(int(image[1]), n)] if image is not None else None,
            "key_len": n, "batch_index": b, "shape": list(parts["q"].shape),
            "token_layout": layout_to_json(layout) if layout is not None else None,
            "pisa_applied_by_capture": self._applied_any,
        }

    def close(self) -> str:
        """Detach, undo the ``apply_pisa`` this capture made, write the file; returns its path."""
        if self._closed:
            return self.path
        self._closed = True
        self._detach()
        if not self.entries:
            raise ValueError(
                f"capture_qkv recorded no attention call (layers={sorted(self.layers) if self.layers else None}, "
                f"steps={sorted(self.steps) if self.steps else None}): nothing written to {self.path}"
            )
        dtype = str(next(iter(self.tensors.values())).dtype).removeprefix("torch.")
        write_qkv_file(self.path, self.tensors, self.entries, self.model, dtype)
        return self.path

    def __enter__(self) -> QKVCapture:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the run failed: detach and undo, keep the exception, write nothing
            self._closed = True
            self._detach()

    def _detach(self) -> None:
        for remove in self._removers:
            remove()
        if self._applied:
            from .apply import remove_pisa

            for obj in self._applied:
                remove_pisa(obj)
        self._removers, self._applied = [], []


def capture_qkv(pipe, layers=None, steps=None, path: str = "qkv.safetensors", *, batch: int = 0,
                dtype: torch.dtype | None = None, max_bytes: int | None = None) -> QKVCapture:
    """Record post-norm, post-RoPE q/k/v (tiled order) of ``pipe``'s self-attention into ``path``.

    Attaches at once; run the pipeline, then :meth:`QKVCapture.close` (or use ``with``) writes
    the file. When PISA is not applied, it applies it for the capture (at density 1: the run stays
    exact: every call runs dense) and removes it on close.

    Args:
        pipe: a diffusers pipeline (``transformer`` / ``transformer_2``) or a transformer model.
        layers, steps: managed attention layers (forward order) and denoising steps (0-based) to
            record, as an int or iterable of ints; ``None`` records all.
        path: the ``.safetensors`` file to write.
        batch: the batch row to record (CFG batches hold cond/uncond rows).
        dtype: store as this dtype (float32/float16/bfloat16); ``None`` keeps the model's.
        max_bytes: stop recording (with a warning) once the tensors would exceed this size.
    """
    return QKVCapture(pipe, layers, steps, path, batch=batch, dtype=dtype, max_bytes=max_bytes)
