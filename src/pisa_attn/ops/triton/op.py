"""The Triton path behind :func:`pisa_attn.pisa_attention`: support check and the registered op.

``torch.ops.pisa_attn.pisa_fwd`` is a ``torch.library.custom_op`` with a fake implementation, so
``torch.compile(fullgraph=True)`` treats it as one opaque node, and a CUDA graph can capture it:
the implementation issues no host synchronisation and every shape is known from the arguments.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import attention as _attn
from . import prepare as _prep
from . import select as _sel
from ._common import interpreting

HEAD_DIMS = (16, 32, 64, 128)
BLOCK_SIZES = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16)


def unsupported_reason(q: Tensor, mode: str, block_size: int) -> str | None:
    """None when the kernels handle this call (``q`` a ``[B, H, L, D]`` view), else why not."""
    if mode == "first":
        return ("mode='first' (exact block-wise first order) needs every key token of every tail block, "
                "i.e. dense cost, so it runs on the PyTorch reference")
    if mode not in _attn.MODE_IDS:
        return f"unknown mode {mode!r}"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernels compute with float16/bfloat16 tensor-core inputs)"
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        return f"head dim {d} (kernels are built for head dims {HEAD_DIMS})"
    if block_size not in BLOCK_SIZES:
        return f"block_size {block_size} (kernels are built for block sizes {BLOCK_SIZES})"
    if not q.is_cuda and not interpreting():
        return "q is not a CUDA tensor"
    return None


def _score_scratch(q: Tensor, k: Tensor) -> int:
    """Selection's score buffer (fp32 elements): 1% of the bytes of q, k, v and o."""
    qkvo = 2 * (q.numel() * q.element_size() + k.numel() * k.element_size())
    return max(1, qkvo // 400)


def _out_like(q: Tensor) -> Tensor:
    return _attn._alloc_like_layout(q)


@torch.library.custom_op("pisa_attn::pisa_fwd", mutates_args=())
def pisa_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Optional[Tensor],
    n_select: int,
    width: int,
    mode: str,
    scale: float,
    block_size: int,
    covariance_aware: bool,
) -> tuple[Tensor, Tensor]:
    stats = _prep.prepare(q, k, v, block_size, with_hdev=covariance_aware, keep_hbar=False)
    if keep is not None:
        keep = keep.contiguous()
    idx, cnt, bits = _sel.select(stats.qmean, stats.kmean, stats.hdev, keep, n_select, width, scale,
                                 scratch_elems=_score_scratch(q, k))
    tail = stats.tail()
    del stats  # the means and ||H_j − H̄|| are dead: freed before the attention outputs exist
    return _attn.attention(q, k, v, *tail, idx, cnt, bits, mode=mode, scale=scale, block_size=block_size,
                           n_select=n_select)


@pisa_fwd.register_fake
def _pisa_fwd_fake(q, k, v, keep, n_select, width, mode, scale, block_size, covariance_aware):
    b, h, lq, _ = q.shape
    return _out_like(q), q.new_empty(b, h, lq, dtype=torch.float32)


def pisa_triton(q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None, n_keep_max: int) -> tuple[Tensor, Tensor]:
    """Contract with :func:`pisa_attn.attention.run`: ``[B, H, L, D]`` views in, (out, lse) out."""
    width = _sel.selection_width(plan.n_kv_blocks, plan.n_select, n_keep_max if keep is not None else 0)
    return torch.ops.pisa_attn.pisa_fwd(
        q, k, v, keep, plan.n_select, width, plan.mode, plan.scale, plan.block_size, plan.covariance_aware
    )


def run_stages(q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None, n_keep_max: int = 0):
    """The three stages separately (tests and phase timing): returns (stats, (idx, cnt, bits), (out, lse))."""
    width = _sel.selection_width(plan.n_kv_blocks, plan.n_select, n_keep_max if keep is not None else 0)
    stats = _prep.prepare(q, k, v, plan.block_size, with_hdev=plan.covariance_aware)
    if keep is not None:
        keep = keep.contiguous()
    sel = _sel.select(stats.qmean, stats.kmean, stats.hdev, keep, plan.n_select, width, plan.scale,
                      scratch_elems=_score_scratch(q, k))
    res = _attn.attention(
        q, k, v, *stats.tail(), *sel,
        mode=plan.mode, scale=plan.scale, block_size=plan.block_size, n_select=plan.n_select,
    )
    return stats, sel, res
