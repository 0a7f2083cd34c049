"""The whole call (prepare -> select -> attend) of a kernel backend as one registered op.

``torch.ops.pisa_attn.pisa_fwd`` is a ``torch.library.custom_op`` with a fake implementation, so
``torch.compile(fullgraph=True)`` treats a call as one opaque node, and a CUDA graph can capture it:
the implementation issues no host synchronisation and every shape is known from the arguments.
The weight of the first-order term is a ``[H]`` tensor argument (``alpha``), so another value
changes no compiled graph and no captured launch.
Outside tracing, :func:`forward` runs the stages directly: the op's dispatch costs more host time
than every launch of a short call together. When a compiled graph calls the op, its implementation
runs on a cached plan of the op's arguments and replays that plan's recorded launches
(:func:`set_planned`; :mod:`pisa_attn.attention` owns plans), as an eager planned run does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .stages import Backend, forward_width, keep_bound, keep_count, run_stages


# Kernel backends register themselves here when their module is imported (the op names one).
_REGISTRY: dict[str, Backend] = {}


def register(be: Backend) -> Backend:
    _REGISTRY[be.name] = be
    return be


# The planned implementation of the op (set by pisa_attn.attention; None: the stages, unplanned).
_PLANNED = None


def set_planned(fn) -> None:
    """``fn(be, q, k, v, keep, alpha, n_select, width, mode, scale, block_size, covariance_aware,
    query_block) -> (out, lse)`` serves the op's calls from now on (fresh ``out`` and ``lse``)."""
    global _PLANNED
    _PLANNED = fn


def _run(be: Backend, q, k, v, keep, alpha, n_select, width, mode, scale, block_size, covariance_aware, query_block,
         n_keep_max: int | None = None):
    if keep is not None and n_keep_max is None:
        # the op's width was sized for n_select plus the most kept blocks of a row (forward_width):
        # that room is the bound, read without a host synchronisation
        nk = -(-k.shape[2] // block_size)
        n_keep_max = min(nk, max(0, width - min(n_select, nk)))
    _, _, res = run_stages(be, q, k, v, block_size=block_size, n_select=n_select, width=width, mode=mode,
                           scale=scale, covariance_aware=covariance_aware, keep=keep, lean=True,
                           query_block=query_block, alpha=alpha, n_keep_max=n_keep_max)
    return res


@torch.library.custom_op("pisa_attn::pisa_fwd", mutates_args=())
def pisa_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Optional[Tensor],
    alpha: Optional[Tensor],
    n_select: int,
    width: int,
    mode: str,
    scale: float,
    block_size: int,
    covariance_aware: bool,
    query_block: int,
    backend: str,
) -> tuple[Tensor, Tensor]:
    if _PLANNED is not None:
        return _PLANNED(_REGISTRY[backend], q, k, v, keep, alpha, n_select, width, mode, scale, block_size,
                        covariance_aware, query_block)
    return _run(_REGISTRY[backend], q, k, v, keep, alpha, n_select, width, mode, scale, block_size, covariance_aware,
                query_block)


@pisa_fwd.register_fake
def _pisa_fwd_fake(q, k, v, keep, alpha, n_select, width, mode, scale, block_size, covariance_aware, query_block,
                   backend):
    b, h, lq, d = q.shape
    if q.stride(1) < q.stride(2):  # the kernels write the output in q's physical layout
        out = q.new_empty(b, lq, h, d).transpose(1, 2)
    else:
        out = q.new_empty(b, h, lq, d)
    return out, q.new_empty(b, h, lq, dtype=torch.float32)


def forward(be: Backend, q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None,
            n_keep_max: int | None = None, alpha: Tensor | None = None):
    """One call of backend ``be`` on one device: ``[B, H, L, D]`` views in, (out, lse) out
    (``alpha``: ``[H]`` weights of the first-order term, None for weight 1; ``n_keep_max``: the
    most kept blocks of a row of ``keep``, None to read it, see
    :func:`pisa_attn.ops.stages.keep_count`)."""
    n_keep_max = keep_count(plan, keep, n_keep_max)
    width = forward_width(plan, keep, n_keep_max)
    if torch.compiler.is_compiling():
        return torch.ops.pisa_attn.pisa_fwd(q, k, v, keep, alpha, plan.n_select, width, plan.mode, plan.scale,
                                            plan.block_size, plan.covariance_aware, plan.query_block, be.name)
    return _run(be, q, k, v, keep, alpha, plan.n_select, width, plan.mode, plan.scale, plan.block_size,
                plan.covariance_aware, plan.query_block, keep_bound(plan, keep, n_keep_max))
