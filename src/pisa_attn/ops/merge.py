"""The one log-sum-exp merge of attention partials over disjoint key sets.

Each partial ``(out_r, lse_r)`` is a softmax-normalised output over its keys and the log of its
denominator. PISA's numerator and denominator are both sums over key blocks (exact blocks, tail
blocks and the first-order term alike, given one global H̄), so partials over disjoint key blocks
merge exactly::

    lse = log Σ_r exp(lse_r),    out = Σ_r exp(lse_r − lse) · out_r

Both are computed against ``m = max_r lse_r`` (``w_r = exp(lse_r − m)``, ``out = Σ_r w_r·out_r / Σ_r w_r``,
``lse = m + log Σ_r w_r``), so the weights sum to 1 whatever the magnitude of the LSEs.
A row with no term in a partial has ``lse_r = -inf``; its ``out_r`` is ignored (it may be NaN, as
a kernel's 0/0), and a row with no term anywhere comes out as ``(0, -inf)``. A row where some
``lse_r = +inf`` (an overflowed partial) comes out as the mean of those partials' outputs, lse +inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def merge(parts: Sequence[tuple[Tensor, Tensor]], out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Merge ``[(out [.., L, D], lse [.., L]), ...]`` into one ``(out, lse)`` (every ``out`` of one
    shape, every ``lse`` that shape without ``D``: ValueError naming ``parts`` otherwise).

    Computed in float32 (float64 if any output is float64); ``out`` is returned in ``out_dtype``
    (default: that computation dtype), ``lse`` in float32 (float64 if any lse is float64).
    CUDA partials of one layout run the one-pass Triton kernel (:mod:`pisa_attn.ops.triton.merge`,
    same arithmetic up to float32 rounding); everything else :func:`merge_torch`.
    """
    _check(parts)
    if parts[0][0].is_cuda and out_dtype != torch.float64:
        kernel = _kernel()
        if kernel is not None and kernel.supports(parts):
            return kernel.merge(parts, out_dtype)
    return merge_torch(parts, out_dtype)


def _check(parts: Sequence[tuple[Tensor, Tensor]]) -> None:
    """ValueError naming ``parts`` unless every output has one shape and every lse is that shape
    without the head dim: the kernel indexes them so, and a broadcast would hide a wrong partial."""
    if not parts:
        raise ValueError("parts: merge needs at least one (out, lse) partial")
    shape = tuple(parts[0][0].shape)
    for i, (o, l) in enumerate(parts):
        if o.dim() < 1 or tuple(o.shape) != shape or tuple(l.shape) != shape[:-1]:
            raise ValueError(f"parts[{i}]: every out must have one shape {shape} and its lse that shape without "
                             f"the last dim {shape[:-1]}, got out {tuple(o.shape)} and lse {tuple(l.shape)}")


def _kernel():
    try:
        from .triton import merge as kernel
    except ImportError:  # no Triton: the PyTorch merge
        return None
    return kernel


def merge_torch(parts: Sequence[tuple[Tensor, Tensor]], out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """:func:`merge` in PyTorch ops (the reference of the Triton merge)."""
    _check(parts)
    wide = torch.float64 if any(o.dtype == torch.float64 for o, _ in parts) else torch.float32
    lse_dtype = torch.float64 if any(l.dtype == torch.float64 for _, l in parts) else torch.float32
    lses = torch.stack([l.to(lse_dtype) for _, l in parts])
    # Weights against the largest term, the output normalised by their own sum: taken against the
    # rounded log Σ exp instead, they stop summing to 1 as |lse| grows (float32 steps 1e-3 at 1e4).
    m = lses.amax(0)
    pos = torch.isposinf(m)
    # No term anywhere (m = -inf): shift by 0 so every weight is 0, not NaN. An overflowed partial
    # (m = +inf) outweighs every finite one: the +inf partials weigh 1 each, the rest 0.
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ws = torch.where(pos, (lses == m).to(lse_dtype), torch.exp(lses - shift))
    tot = ws.sum(0)
    lse = torch.where(torch.isfinite(m), shift + torch.log(tot), m)
    ws = ws.to(wide)
    acc = None
    for (o, _), w in zip(parts, ws):
        w = w[..., None]
        # a weightless partial's output may be NaN (a kernel's 0/0): it adds 0, not w·NaN
        term = torch.where(w > 0, w * o.to(wide), torch.zeros((), dtype=wide, device=o.device))
        acc = term if acc is None else acc + term
    tot = ws.sum(0)[..., None]
    out = torch.where(tot > 0, acc / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.zeros_like(acc))
    return out.to(out_dtype or wide), lse
