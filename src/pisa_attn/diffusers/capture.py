"""Capture post-norm, post-RoPE q/k/v of a real pipeline run into one ``.safetensors`` file.

``pisa-attn study --source FILE`` then runs the accuracy study on real activations::

    with capture_qkv(pipe, layers=[0, 10], steps=[0, 25], path="qkv.safetensors"):
        pipe(prompt, num_inference_steps=30)

The file format lives in :mod:`pisa_attn.qkv_file`.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import Tensor

from ..qkv_file import layout_to_json, trim_layout, write_qkv_file
from ..settings import as_int
from ..spec import is_int
from . import hooks
from .models import adapter_for, transformers_of
from .paths import check_output_path

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _index_set(name: str, value) -> frozenset[int] | None:
    if value is None:
        return None
    items = [value] if is_int(value) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{name} must be None, an int or an iterable of ints, got {type(value).__name__}") from None
    if not items or any(not is_int(i) or i < 0 for i in items):
        raise ValueError(f"{name} must be None or non-negative ints, got {value!r}")
    return frozenset(int(i) for i in items)


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
        batch = as_int("batch", batch, "a non-negative int (the batch row to record)")
        if batch < 0:
            raise ValueError(f"batch must be a non-negative int (the batch row to record), got {batch!r}")
        if dtype is not None and dtype not in _DTYPES.values():
            raise TypeError(f"dtype must be None, torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
        if max_bytes is not None:
            max_bytes = as_int("max_bytes", max_bytes, "None or a positive int")
            if max_bytes < 1:
                raise ValueError(f"max_bytes must be None or a positive int, got {max_bytes!r}")
        self.path = check_output_path(path, "path")
        self.batch, self.dtype, self.max_bytes = batch, dtype, max_bytes
        self.tensors: dict[str, Tensor] = {}
        self.entries: dict[str, dict] = {}
        self.nbytes = 0
        self.model = ""
        self._full = False
        self._pipe = pipe
        self._applied = []  # what this capture applied PISA to (the pipeline, or transformers)
        self._owned = []  # (transformer, the state this capture applied to it), removed on close
        self._removers = []
        self._closed = False
        found = _transformers(pipe)
        if self.layers is not None:
            _check_layers(self.layers, [tr for _, tr in found])
        # Capture needs the tiled, post-RoPE tensors only a managed model exposes. Every call runs
        # dense (the model's own exact attention): observers get the valid keys per row of dense
        # calls too, which is what drops padded text keys. Density 1 is what the entries record.
        exact = dict(density=1.0, dense_steps=sys.maxsize)
        if any(pisa_state(tr) is not None and pisa_state(tr).capture_owned for _, tr in found):
            # the open one would remove PISA on close, from under this one
            raise ValueError("another capture_qkv is open on this model: close it first, or apply_pisa "
                             "yourself and open the captures under it")
        if not isinstance(pipe, torch.nn.Module) and all(pisa_state(tr) is None for _, tr in found):
            self._applied.append(apply_pisa(pipe, **exact))  # one step tracker for both experts
        else:
            managed = [pisa_state(tr) for _, tr in found if pisa_state(tr) is not None]
            for _, tr in found:
                if pisa_state(tr) is None:
                    self._applied.append(apply_pisa(tr, **exact))
                    if managed:  # one count of denoising steps with the user's managed expert
                        pisa_state(tr).tracker = managed[0].tracker
        for _, tr in found:
            if pisa_state(tr) is not None and any(obj is tr or obj is pipe for obj in self._applied):
                pisa_state(tr).capture_owned = True
                self._owned.append((tr, pisa_state(tr)))
        for prefix, tr in found:
            self._removers.append(hooks.add_observer(tr, self._observer(prefix, tr)))

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def _observer(self, prefix: str, transformer):
        from .apply import pisa_state

        def observe(call: hooks.AttentionCall) -> None:
            if self._full or (self.layers is not None and call.layer not in self.layers):
                return
            if self.steps is not None and call.step not in self.steps:
                return
            name = f"{prefix}step{call.step}.layer{call.layer}"
            if name in self.entries:  # first call wins (Wan's cond before uncond, first generation)
                return
            # the capture's own PISA ran the call, not one the user applied since it opened
            self._record(name, call, any(pisa_state(transformer) is s for _, s in self._owned))

        return observe

    def _record(self, name: str, call: hooks.AttentionCall, applied: bool) -> None:
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
            # a copy: a contiguous view (one head) would keep the model's whole batch alive
            parts[p] = x.to(device="cpu", dtype=self.dtype or x.dtype, copy=True).contiguous()
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
            # the text tokens recorded: padded text keys trimmed off are not among them
            "text_len": layout.num_text_tokens if layout is not None else call.meta.get("text_len"),
            "image_range": [int(image[0]), min(int(image[1]), n)] if image is not None else None,
            "key_len": n, "batch_index": b, "shape": list(parts["q"].shape),
            "token_layout": layout_to_json(layout) if layout is not None else None,
            "pisa_applied_by_capture": applied,
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
        if self._owned:
            from .apply import pisa_state, remove_pisa

            for tr, state in self._owned:
                if pisa_state(tr) is state:  # PISA the user applied since the capture opened stays
                    remove_pisa(tr)
        self._removers, self._applied, self._owned = [], [], []


def _check_layers(layers: frozenset[int], transformers) -> None:
    """ValueError when a requested layer index is beyond every transformer's managed layers."""
    from .apply import _managed_modules, pisa_state

    counts = []
    for tr in transformers:
        state = pisa_state(tr)
        counts.append(len(state.blocks) if state is not None else len(_managed_modules(tr, adapter_for(tr))))
    bad = sorted(i for i in layers if i >= max(counts))
    if bad:
        raise ValueError(f"layers {bad} do not exist: the model has {max(counts)} managed attention layers "
                         f"(0..{max(counts) - 1})")


def capture_qkv(pipe, layers=None, steps=None, path: str = "qkv.safetensors", *, batch: int = 0,
                dtype: torch.dtype | None = None, max_bytes: int | None = None) -> QKVCapture:
    """Record post-norm, post-RoPE q/k/v (tiled order) of ``pipe``'s self-attention into ``path``.

    Attaches at once; run the pipeline, then :meth:`QKVCapture.close` (or use ``with``) writes
    the file. When PISA is not applied, it applies it for the capture (at density 1: every call runs
    dense attention, on tokens in tiled order, so the output matches the model's to float rounding,
    ~1e-6) and removes it on close; it captures in the tiles of the default block size, so to
    calibrate for another, apply PISA with that ``block_size`` first (the capture keeps it).

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
