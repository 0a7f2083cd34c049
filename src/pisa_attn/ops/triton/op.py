"""The Triton backend of the stage contract (:mod:`pisa_attn.ops.stages`).

The portable kernels: any CUDA GPU Triton supports, and Triton's interpreter on the CPU. A whole
call goes through the registered op of :mod:`pisa_attn.ops.fused` when traced. The stages are also
callable one by one (tests, phase timing, sharded keys). Inference only: the kernels have no
backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import fused as _fused
from ..selection import Selection, check_selection
from ..kernel_constants import MAX_GRID_YZ
from ..stages import Backend
from . import attention as _attn
from ._common import interpreting
from .pairs import triple_width, union_width
from .prepare import Stats, deviation, prepare, stats_workspace
from .select import SelectionWorkspace, select, selection_workspace

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
    if q.shape[0] * q.shape[1] > MAX_GRID_YZ:
        return (f"batch x heads = {q.shape[0] * q.shape[1]} (the kernels launch one grid row per batch and head, "
                f"at most {MAX_GRID_YZ}; split the batch)")
    return None


# Selection's score buffer as a fraction of the bytes of q, k, v and o. Each chunk of query blocks
# it holds costs a score launch and a top-k launch: at B2-H16, 4 % holds the whole score matrix up
# to 32K tokens and two chunks at 64K (1 % took four and seven: 1.35x / 1.2x the selection's time
# on an H200).
SCORE_SCRATCH_FRACTION = 0.04


def score_scratch(q: Tensor, k: Tensor) -> int:
    """Selection's score buffer (fp32 elements): :data:`SCORE_SCRATCH_FRACTION` of the bytes of
    q, k, v and o."""
    qkvo = 2 * (q.numel() * q.element_size() + k.numel() * k.element_size())
    return max(1, int(qkvo * SCORE_SCRATCH_FRACTION) // 4)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    stats: Stats,
    selection: Selection,
    *,
    mode: str,
    scale: float,
    block_size: int,
    n_select: int | None = None,
    out_dtype: torch.dtype | None = None,
    alpha: Tensor | None = None,
    out: Tensor | None = None,
    lse: Tensor | None = None,
    ws: Workspace | None = None,
) -> tuple[Tensor, Tensor]:
    """The fused attention kernel under ``selection``: (out in ``out_dtype``, default q's, lse fp32).

    ``n_select`` (the top-k count; default the selection's width) only picks the tuned config.
    A float32 ``out_dtype`` keeps a shard's partial unrounded for the merge. ``alpha``: ``[H]``
    float32 weights of the first-order term (None: 1). ``out``/``lse``: buffers to write into;
    ``ws``: the plan's workspace (unused here: the kernel needs no buffer of its own).
    ``selection`` must be of q's batch, heads and query blocks and k's key blocks, int32 and
    contiguous on q's device (the kernel indexes it by those shapes): ValueError otherwise.
    """
    check_selection(selection, q.shape[0], q.shape[1], -(-q.shape[2] // block_size), -(-k.shape[2] // block_size),
                    q.device, contiguous=True)
    if out is None:
        out = _attn._alloc_like_layout(q, out_dtype)
    return _attn.attention(q, k, v, *stats.tail(), *selection, mode=mode, scale=scale, block_size=block_size,
                           n_select=selection.idx.shape[-1] if n_select is None else n_select, out=out, lse=lse,
                           alpha=alpha)


@dataclass
class Workspace:
    """The buffers of a planned call (:func:`pisa_attn.plan`): statistics, selection, the pair
    stream of the Hopper kernel (None for the Triton kernel) and an lse nobody asked for."""

    stats: Stats
    selection: SelectionWorkspace
    lse: Tensor
    pairs: tuple[Tensor, Tensor, Tensor] | None = None


def workspace(plan, q: Tensor, k: Tensor, *, pairs: int = 0, quant: str | None = None,
              kmax: bool = False) -> Workspace:
    """The workspace of ``plan`` (``q``/``k``: ``[B, H, L, D]`` tensors or stand-ins of its shapes);
    ``pairs``: the Hopper kernel's query blocks per CTA (2 or 3) to size its stream buffers for, 0
    for none; ``quant``: the low precision whose copies of K/V prepare writes (None: none);
    ``kmax``: room for the keys' per-channel maxima (the Hopper kernel's exact-score bound)."""
    b, h, lq = q.shape[:3]
    dev = q.device
    stats = stats_workspace(q.shape, k.shape, q.dtype, dev, block_size=plan.block_size,
                            query_block=plan.query_block, with_hdev=plan.covariance_aware, quant=quant,
                            with_kmax=kmax)
    sel = selection_workspace(b, h, plan.n_q_blocks, plan.n_kv_blocks, plan.width, dev,
                              n_q_rows=stats.qmean.shape[2], scratch_elems=score_scratch(q, k))
    pair_bufs = None
    if pairs:
        nq2 = -(-plan.n_q_blocks // 2)
        ng = -(-plan.n_q_blocks // pairs)
        w = (triple_width if pairs == 3 else union_width)(plan.n_kv_blocks, plan.width)
        pair_bufs = (torch.empty(b, h, ng, w, device=dev, dtype=torch.int32),
                     torch.empty(b, h, ng, device=dev, dtype=torch.int32),
                     torch.empty(b, h, nq2, 2, device=dev, dtype=torch.int32))
    return Workspace(stats, sel, torch.empty(b, h, lq, device=dev, dtype=torch.float32), pair_bufs)


def forward(q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None, n_keep_max: int | None = None,
            alpha: Tensor | None = None):
    """One call on one device (through the registered op when traced): (out, lse)."""
    return _fused.forward(BACKEND, q, k, v, plan, keep, n_keep_max, alpha)


BACKEND = _fused.register(
    Backend("triton", prepare, select, attend, deviation, forward, unsupported_reason, score_scratch, workspace))
