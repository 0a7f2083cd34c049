"""The one log-sum-exp merge of attention partials over disjoint key sets.

Each partial ``(out_r, lse_r)`` is a softmax-normalised output over its keys and the log of its
denominator. PISA's numerator and denominator are both sums over key blocks (exact blocks, tail
blocks and the first-order term alike, given one global H̄), so partials over disjoint key blocks
merge exactly::

    lse = log Σ_r exp(lse_r),    out = Σ_r exp(lse_r − lse) · out_r

A row with no term in a partial has ``lse_r = -inf``; its ``out_r`` is ignored (it may be NaN, as
a kernel's 0/0), and a row with no term anywhere comes out as ``(0, -inf)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def merge(parts: Sequence[tuple[Tensor, Tensor]], out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Merge ``[(out [.., L, D], lse [.., L]), ...]`` into one ``(out, lse)``.

    Computed in float32 (float64 if any output is float64); ``out`` is returned in ``out_dtype``
    (default: that computation dtype), ``lse`` in float32 (float64 if any lse is float64).
    CUDA partials of one layout run the one-pass Triton kernel (:mod:`pisa_attn.ops.triton.merge`,
    same arithmetic up to float32 rounding); everything else :func:`merge_torch`.
    """
    if not parts:
        raise ValueError("merge needs at least one (out, lse) partial")
    if parts[0][0].is_cuda and out_dtype != torch.float64:
        kernel = _kernel()
        if kernel is not None and kernel.supports(parts):
            return kernel.merge(parts, out_dtype)
    return merge_torch(parts, out_dtype)


def _kernel():
    try:
        from .triton import merge as kernel
    except ImportError:  # no Triton: the PyTorch merge
        return None
    return kernel


def merge_torch(parts: Sequence[tuple[Tensor, Tensor]], out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """:func:`merge` in PyTorch ops (the reference of the Triton merge)."""
    if not parts:
        raise ValueError("merge needs at least one (out, lse) partial")
    wide = torch.float64 if any(o.dtype == torch.float64 for o, _ in parts) else torch.float32
    lse_dtype = torch.float64 if any(l.dtype == torch.float64 for _, l in parts) else torch.float32
    lses = torch.stack([l.to(lse_dtype) for _, l in parts])
    lse = torch.logsumexp(lses, dim=0)
    # Rows with no term anywhere keep lse = -inf: shift by 0 there so the weights stay 0, not NaN.
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = None
    for (o, _), l in zip(parts, lses):
        w = torch.exp(l - shift).to(wide)[..., None]
        term = torch.where(w > 0, w * o.to(wide), torch.zeros((), dtype=wide, device=o.device))
        out = term if out is None else out + term
    return out.to(out_dtype or wide), lse
