"""The stage contract every backend implements, and the one pipeline built from it.

A backend is four functions over ``[B, H, L, D]`` views (K/V may have ``Hk`` heads, GQA)::

    prepare(q, k, v, block_size, *, with_hdev=False, lean=False,
            query_block=None[, ws=None])                                    -> stats
    select(qmean, kmean, *, n_select, width, scale, hdev=None, keep=None,
           scratch_elems=None, repeat=1, n_q_blocks=None, n_keep_max=None
           [, ws=None])                                                     -> Selection
    attend(q, k, v, stats, selection, *, mode, scale, block_size,
           n_select=None, out_dtype=None, alpha=None[, out=None, lse=None,
           ws=None])                                                        -> (out, lse)
    deviation(k, v, stats, hbar, block_size)                                -> ||H_j − H̄||_F

A backend with a ``workspace(plan, q, k)`` function (the kernel backends) takes the bracketed
arguments: the buffers of a :class:`pisa_attn.PisaPlan`'s workspace, written instead of allocated,
so a planned run (:func:`run_planned`) allocates nothing but its output.

plus ``forward(q, k, v, plan, keep=None, n_keep_max=None, alpha=None) -> (out, lse)``, the whole call on one device (the
Triton backend wraps :func:`run_stages` in one registered op for ``torch.compile``),
``unsupported_reason(q, mode, block_size) -> str | None`` and ``score_scratch(q, k) -> int | None``
(the score buffer the backend budgets for selecting on one call; None: its default).

**alpha** is a ``[H]`` tensor on q's device (float32; float64 for float64 inputs): the weight of
the first-order tail term per query head, read by the kernels (one value per program), so it is
data, like the selection: another value neither recompiles nor breaks CUDA-graph capture. None
means weight 1 (the paper's term); modes without a first-order term ignore it. The public entry
points resolve the user's ``alpha`` (default :data:`pisa_attn.spec.DEFAULT_ALPHA`) with
:func:`pisa_attn.tail_weight.resolve`.

**Statistics** are a dataclass per backend with at least these fields:

* ``qmean`` ``[B, H, Nq', D]`` means of query blocks of ``query_block`` rows (``Nq' = Nq`` by
  default; each selects for ``query_block / block_size`` query blocks) and ``kmean``
  ``[B, Hk, Nk, D]`` key centroids
  (float32, float64 for float64 inputs): what selection reads;
* ``hbar`` ``[B, Hk, D, D]``: ``H̄ = (1/Nk) Σ_j H_j`` over the key blocks it was computed from;
* ``hdev`` ``[B, Hk, Nk]`` or None: ``||H_j − H̄||_F`` (covariance-aware selection);
* backend-specific tail terms (centroids and value sums in the form its ``attend`` reads).

and these methods: ``blocks(lo, hi)`` (the statistics of key blocks ``[lo, hi)`` only, for one
K/V shard), ``with_hbar(hbar)`` (the same statistics with another H̄, e.g. the global one of a
sharded sequence) and ``for_attend()`` (drops, in place, what only selection reads, so it can be
freed; returns the object).
The class attribute ``BLOCK_AXES`` names the per-key-block fields and their block axis (what a
sharded caller gathers or slices); ``SHARD_FIELDS`` names fields that describe a whole shard
(neither per block nor global) and travel with it. Which of them a backend's ``prepare`` writes
may depend on the key count; a sharded caller passes every rank the same
``Backend.shard_prepare(dtype, shard_lengths)`` keywords, so every rank's statistics hold the same
fields (the ranks gather them by a layout each computes from its own).

**Sharded keys.** ``attend`` sums over the key blocks of the K/V it is given. With the
statistics and the selection of one K/V shard (``stats.blocks(lo, hi).with_hbar(global_hbar)``,
``selection.blocks(lo, hi)``; shards start on block boundaries, so only the sequence's last block
can be ragged) it returns that shard's partial ``(out, lse)``; :func:`pisa_attn.ops.merge.merge`
of all shards' partials equals the unsharded call (up to rounding): the exact terms, the
zeroth-order tail and the first-order term ``(Σ_tail α)·s·q·H̄`` are all sums over key blocks.
A shard in which a row has no term at all (``drop`` mode, no exact block there) returns
``lse = -inf`` for that row and an unspecified output, which the merge ignores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from .. import spec
from .selection import Selection, keep_row_bound


@dataclass(frozen=True)
class Backend:
    """One implementation of the stage contract (see the module docstring)."""

    name: str
    prepare: Callable
    select: Callable[..., Selection]
    attend: Callable[..., tuple[Tensor, Tensor]]
    deviation: Callable[..., Tensor]
    forward: Callable[..., tuple[Tensor, Tensor]]
    unsupported_reason: Callable[[Tensor, str, int], "str | None"]
    score_scratch: Callable[[Tensor, Tensor], "int | None"]
    # workspace(plan, q, k) -> the buffers a planned run writes into (None: the backend allocates
    # per call, as the reference does).
    workspace: "Callable | None" = None
    # shard_prepare(dtype, key shard lengths) -> prepare's keywords for every rank of a sharded
    # sequence (None: none needed): fields written for some key counts only are then written on
    # every rank or on none.
    shard_prepare: "Callable[[object, list[int]], dict] | None" = None


def keep_count(plan, keep: Tensor | None, n_keep_max: int | None) -> int:
    """``n_keep_max``, the most kept blocks of any row of ``keep``; None: read from ``keep``
    (:func:`pisa_attn.ops.selection.keep_row_bound`: one host synchronisation, or every block
    while tracing or capturing). 0 without ``keep``."""
    if keep is None:
        return 0
    return keep_row_bound(keep, plan.n_kv_blocks) if n_keep_max is None else n_keep_max


def forward_width(plan, keep: Tensor | None, n_keep_max: int) -> int:
    """Index-list width of a single-device call: top-k plus the most kept blocks of any row."""
    return spec.selection_width(plan.n_kv_blocks, plan.n_select, n_keep_max if keep is not None else 0)


def keep_bound(plan, keep: Tensor | None, n_keep_max: int) -> int | None:
    """The ``n_keep_max`` a select call of ``plan`` passes on (None without ``keep``): the most
    kept blocks of a row, which the plan's width was sized for, at most every block."""
    return None if keep is None else min(n_keep_max, plan.n_kv_blocks)


def run_stages(
    be: Backend,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    n_select: int,
    width: int,
    mode: str,
    scale: float,
    covariance_aware: bool = False,
    keep: Tensor | None = None,
    lean: bool = False,
    query_block: int | None = None,
    alpha: Tensor | None = None,
    n_keep_max: int | None = None,
):
    """prepare -> select -> attend on one device: returns ``(stats, selection, (out, lse))``.

    ``keep``: bool ``[B|1, H|1, Nk]`` on q's device, always-exact blocks (``width`` must cover
    ``n_select`` plus the most kept blocks of any row, ``n_keep_max``; None: select reads it from
    ``keep`` where the width needs it, one host synchronisation). ``lean``: only the output is wanted, so
    intermediates are freed as soon as the next stage no longer needs them (the returned stats
    then hold only what ``attend`` read). ``query_block``: tokens per selection row (see
    :func:`pisa_attn.spec.query_block_factor`); the selection has one row per ``block_size``
    query block all the same.
    """
    stats, sel = select_stages(be, q, k, v, block_size=block_size, n_select=n_select, width=width, scale=scale,
                               covariance_aware=covariance_aware, keep=keep, lean=lean, query_block=query_block,
                               n_keep_max=n_keep_max)
    if lean:
        stats = stats.for_attend()  # query means and selection-only terms die before attend allocates
    res = be.attend(q, k, v, stats, sel, mode=mode, scale=scale, block_size=block_size, n_select=n_select,
                    alpha=alpha)
    return stats, sel, res


def select_stages(be: Backend, q: Tensor, k: Tensor, v: Tensor, *, block_size: int, n_select: int, width: int,
                  scale: float, covariance_aware: bool = False, keep: Tensor | None = None, lean: bool = False,
                  query_block: int | None = None, n_keep_max: int | None = None):
    """:func:`run_stages`' prepare -> select, without attend: ``(stats, selection)``."""
    stats = be.prepare(q, k, v, block_size, with_hdev=covariance_aware, lean=lean, query_block=query_block)
    sel = be.select(stats.qmean, stats.kmean, n_select=n_select, width=width, scale=scale, hdev=stats.hdev,
                    keep=keep, scratch_elems=be.score_scratch(q, k),
                    repeat=spec.query_block_factor(query_block, block_size),
                    n_q_blocks=spec.num_blocks(q.shape[2], block_size), n_keep_max=n_keep_max)
    return stats, sel


def select_plan(be: Backend, q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None,
                n_keep_max: int | None = None):
    """:func:`run_plan`'s prepare -> select, without attend: ``(stats, selection)``."""
    n_keep_max = keep_count(plan, keep, n_keep_max)
    return select_stages(be, q, k, v, block_size=plan.block_size, n_select=plan.n_select,
                         width=forward_width(plan, keep, n_keep_max), scale=plan.scale,
                         covariance_aware=plan.covariance_aware, keep=keep, query_block=plan.query_block,
                         n_keep_max=keep_bound(plan, keep, n_keep_max))


def run_plan(be: Backend, q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None,
             n_keep_max: int | None = None,
             *, lean: bool = False, alpha: Tensor | None = None):
    """:func:`run_stages` with the settings of a :class:`pisa_attn.PisaPlan` (``keep`` and
    ``n_keep_max`` as :func:`pisa_attn.attention.normalize_keep_blocks` returns them; ``alpha`` as
    :func:`pisa_attn.tail_weight.resolve` does; ``n_keep_max`` None: read from ``keep``, see
    :func:`keep_count`)."""
    n_keep_max = keep_count(plan, keep, n_keep_max)
    return run_stages(
        be, q, k, v, block_size=plan.block_size, n_select=plan.n_select, width=forward_width(plan, keep, n_keep_max),
        mode=plan.mode, scale=plan.scale, covariance_aware=plan.covariance_aware, keep=keep, lean=lean,
        query_block=plan.query_block, alpha=alpha, n_keep_max=keep_bound(plan, keep, n_keep_max),
    )  # fmt: skip


def run_planned(be: Backend, q: Tensor, k: Tensor, v: Tensor, plan, ws, *, keep: Tensor | None = None,
                alpha: Tensor | None = None, out: Tensor | None = None, lse: Tensor | None = None,
                selection: Selection | None = None, want_lse: bool = False):
    """A run of a :class:`pisa_attn.PisaPlan` on ``[B, H, L, D]`` views: ``(out, lse, selection)``.

    ``ws`` is the plan's workspace (from ``be.workspace``): prepare, select and attend then write
    into it and nothing is allocated but ``out`` (and ``lse`` when it is wanted and not given).
    ``ws=None`` (a backend without one, or while tracing) runs the stages with their own buffers.
    ``selection`` given: it is attended under and select is skipped.
    """
    bs = plan.block_size
    if ws is None:
        stats = be.prepare(q, k, v, bs, with_hdev=plan.covariance_aware and selection is None, lean=True,
                           query_block=plan.query_block)
        sel = selection if selection is not None else _select(be, stats, plan, keep, q, k, None)
        o, l_ = be.attend(q, k, v, stats.for_attend(), sel, mode=plan.mode, scale=plan.scale, block_size=bs,
                          n_select=plan.n_select, alpha=alpha)
        if out is not None:
            out.copy_(o)
            o = out
        if lse is not None:
            lse.copy_(l_)
            l_ = lse
        return o, l_, sel
    stats = be.prepare(q, k, v, bs, with_hdev=plan.covariance_aware and selection is None, lean=True,
                       query_block=plan.query_block, ws=ws.stats)
    sel = selection if selection is not None else _select(be, stats, plan, keep, q, k, ws.selection)
    if lse is None and not want_lse:
        lse = ws.lse  # written, never returned: the next run overwrites it
    return (*be.attend(q, k, v, stats, sel, mode=plan.mode, scale=plan.scale, block_size=bs, n_select=plan.n_select,
                       alpha=alpha, out=out, lse=lse, ws=ws), sel)


def _select(be: Backend, stats, plan, keep, q, k, ws):
    kw = {} if ws is None else {"ws": ws}
    return be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=plan.width, scale=plan.scale,
                     hdev=stats.hdev, keep=keep, scratch_elems=be.score_scratch(q, k), repeat=plan.query_block //
                     plan.block_size, n_q_blocks=plan.n_q_blocks, n_keep_max=keep_bound(plan, keep, plan.max_keep),
                     **kw)


def slice_blocks(stats, lo: int, hi: int):
    """``stats`` restricted to key blocks ``[lo, hi)`` (every field named in ``BLOCK_AXES``), as
    contiguous copies: kernels index statistics by their shape, not by strides."""
    cut = {}
    for name, axis in type(stats).BLOCK_AXES.items():
        x = getattr(stats, name)
        if x is not None:
            cut[name] = x.narrow(axis, lo, hi - lo).contiguous()
    return dataclasses.replace(stats, qmean=None, **cut)
