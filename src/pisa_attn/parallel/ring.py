"""PISA under ring (sequence) parallelism, exact in its semantics.

Every rank holds a contiguous slice of the sequence. PISA's selection is global (top-k over all key
blocks) and its tail terms need the global ``H̄``, but both are built from cheap per-block
statistics, so:

1. each rank runs the backend's prepare stage on its shard; the per-block statistics are
   all-gathered, and the global ``H̄`` is the all-reduced sum ``Σ_r N_r·H̄_r`` over ``N``;
2. each rank selects, for its own query blocks, the global top-k key blocks;
3. key/value shards travel round the ring; each step attends to that shard (its selected blocks
   exactly, its other blocks through the tail) with the global ``H̄``;
4. the partials merge through their log-sum-exp (:func:`pisa_attn.ops.merge.merge`), since
   numerator and denominator are sums over key blocks.

The steps use only the stage contract (:mod:`pisa_attn.ops.stages`), so the backend is one
argument of :func:`_ring_aligned`; the public entry runs the PyTorch reference.

The result equals single-process :func:`pisa_attn.pisa_attention` on the whole sequence (same
selection, float tolerance; the reference returns float32 LSEs, so float64 inputs agree to about
1e-7, not to float64 round-off). Global blocks must not straddle ranks: when the shards are not block
aligned (or a token permutation is asked for), tokens are first redistributed to block-aligned
shards with one all-to-all, and the output is sent back the same way.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from .. import spec
from ..attention import get_backend, normalize_keep_blocks
from ..ops.merge import merge
from ..ops.stages import Backend
from .comm import (
    RingExchange,
    Redistribution,
    all_gather_var,
    balanced_block_bounds,
    bounds_of,
    check_permutation,
)
from .common import check_inputs, to_layout


def ring_pisa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    density: float = 0.125,
    block_size: int = 64,
    mode: str = "hybrid",
    covariance_aware: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    keep_blocks: Tensor | None = None,
    perm: Tensor | None = None,
    q_perm: Tensor | None = None,
    return_lse: bool = False,
    seq_lens: list[int] | None = None,
):
    """Ring-parallel PISA: this rank's slice of ``pisa_attention`` over the global sequence.

    Args:
        q, k, v: this rank's contiguous slice of the global sequence, ``layout`` as in
            :func:`pisa_attn.pisa_attention`; the global sequence is the concatenation of the
            slices in rank order. Slices may have different lengths (a ragged last one included).
        group: the process group of the ring (``None``: the default group).
        perm: optional CPU int tensor, a permutation of the global sequence: PISA then runs on the
            sequence ``x[perm]`` (its blocks follow that order, e.g. 2D/3D tiles) and the output is
            returned in the input order. The same on every rank.
        q_perm: optional CPU int tensor, the query sequence PISA runs on, as distinct global query
            positions (default: ``perm``, or all queries in order). A subset is allowed: its query
            blocks are blocks of ``x[q_perm]`` (e.g. image queries only); this rank's queries that
            it does not name are returned as 0 (lse ``-inf``).
        keep_blocks: as in ``pisa_attention``, indexed by global key block (of the permuted order).
        density, block_size, mode, covariance_aware, scale, layout, return_lse: as in
            :func:`pisa_attn.pisa_attention`.
        seq_lens: per-rank local lengths (q and k/v alike), when known to every rank: saves the
            all-gather of the shard shapes (a host sync). Default: gathered and checked.

    Returns:
        ``out`` for this rank's queries (shape/layout of ``q``), plus its ``lse`` [B, H, Lq] fp32
        when ``return_lse``. Inference only; runs the PyTorch reference stages per ring step.
    """
    qh, kh, vh, sh = check_inputs(
        q, k, v, group=group, density=density, block_size=block_size, mode=mode, scale=scale, layout=layout,
        backend="reference", what="ring_pisa_attention", covariance_aware=covariance_aware, return_lse=return_lse,
        seq_lens=seq_lens,
    )  # fmt: skip
    scale = float(sh.head_dim**-0.5 if scale is None else scale)
    q_src, k_src = bounds_of(sh.q_lens), bounds_of(sh.k_lens)
    if perm is not None:
        perm = check_permutation(perm, k_src[-1])
    if q_perm is not None:
        q_perm = check_permutation(q_perm, q_src[-1], "q_perm", subset=True)
    elif perm is not None:
        q_perm = check_permutation(perm, q_src[-1], "perm (it also orders the queries: no q_perm given)")
    n_q = q_src[-1] if q_perm is None else q_perm.numel()
    q_dst = _aligned_bounds(q_src, n_q, block_size, sh.world, q_perm)
    k_dst = _aligned_bounds(k_src, k_src[-1], block_size, sh.world, perm)
    n_kv = spec.num_blocks(k_src[-1], block_size)
    keep, n_keep_max = normalize_keep_blocks(keep_blocks, sh.batch, sh.heads, n_kv, q.device)

    to_q = Redistribution.plan(q_perm, q_src, q_dst, sh.rank)
    same_order = (q_perm is None and perm is None) or (
        q_perm is not None and perm is not None and q_perm.shape == perm.shape and torch.equal(q_perm, perm)
    )
    same = same_order and q_src == k_src and q_dst == k_dst
    to_k = to_q if same else Redistribution.plan(perm, k_src, k_dst, sh.rank)
    qa = to_q.apply(qh, 2, group)
    ka, va = (to_k.apply(x, 2, group) for x in (kh, vh))

    out, lse = _ring_aligned(
        qa, ka, va, k_dst, group, get_backend("reference"), density=density, block_size=block_size, mode=mode,
        covariance_aware=covariance_aware, scale=scale, keep=keep, n_keep_max=n_keep_max,
    )  # fmt: skip

    # Queries that q_perm leaves out come back as out = 0, lse = -inf (no term at all).
    out = to_layout(to_q.reverse(out, 2, group), layout)
    if not return_lse:
        return out
    return out, to_q.reverse(lse, 2, group, fill=float("-inf"))


def _aligned_bounds(src: list[int], total: int, block_size: int, world: int, perm) -> list[int]:
    """Keep the caller's shards when every boundary is on a block start; else balance whole blocks."""
    if perm is None and all(b % block_size == 0 for b in src[:-1]):
        return src
    return balanced_block_bounds(total, block_size, world)


def _ring_aligned(q, k, v, k_bounds, group, be: Backend, *, density, block_size, mode, covariance_aware, scale,
                  keep, n_keep_max):  # fmt: skip
    """Ring PISA on block-aligned shards ([B, H, L, D] views) with backend ``be``'s stages.
    Returns (out, lse) of the local queries."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    b, h, lq, d = q.shape
    hk = k.shape[1]
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    blocks = [spec.num_blocks(k_bounds[r + 1] - k_bounds[r], block_size) for r in range(world)]
    n_kv = sum(blocks)
    n_select = spec.num_selected(density, n_kv)

    # 1. Local statistics, then global ones: H̄ is the mean of all H_j, so the local means weighted
    #    by their block counts are all-reduced; ||H_j − H̄|| needs that global H̄.
    local = be.prepare(q, k, v, block_size)
    hbar = (local.hbar * blocks[rank]).contiguous()
    dist.all_reduce(hbar, group=group)
    hbar = hbar / n_kv
    if covariance_aware:
        local.hdev = be.deviation(k, v, local, hbar, block_size)
    shards, gathered = _gather_stats(local, blocks, group, hbar)

    # 2. Global top-k for the local query blocks.
    width = spec.selection_width(n_kv, n_select, n_keep_max if keep is not None else 0)
    sel = be.select(local.qmean, gathered["kmean"], n_select=n_select, width=width, scale=scale,
                    hdev=gathered.get("hdev"), keep=keep)
    del local, gathered

    # 3./4. Rotate k/v shards; each step's partial (kept in the accumulation dtype, so the output is
    # rounded once, as in one process) merges through its LSE.
    out = torch.zeros(b, h, lq, d, dtype=wide, device=q.device)
    lse = torch.full((b, h, lq), float("-inf"), dtype=torch.float32, device=q.device)
    ring = RingExchange(group)
    cur, src = torch.cat([k.reshape(-1), v.reshape(-1)]), rank
    for step in range(world):
        nxt = None
        if step < world - 1:
            prev = (src - 1) % world
            nxt = cur.new_empty(2 * b * hk * (k_bounds[prev + 1] - k_bounds[prev]) * d)
            ring.start(cur, nxt)
        n_tok = k_bounds[src + 1] - k_bounds[src]
        if n_tok and lq:
            ks, vs = cur.view(2, b, hk, n_tok, d).unbind(0)
            c0 = k_bounds[src] // block_size
            part = be.attend(q, ks, vs, shards[src], sel.blocks(c0, c0 + blocks[src]), mode=mode, scale=scale,
                             block_size=block_size, n_select=n_select, out_dtype=wide)
            out, lse = merge([(out, lse), part], out_dtype=wide)
        if nxt is not None:
            ring.wait()
            cur, src = nxt, (src - 1) % world
    return out.to(q.dtype), lse


def _gather_stats(local, blocks: list[int], group, hbar: Tensor):
    """Every rank's statistics from this rank's ``local`` ones: (per-rank stats with the global
    ``hbar``, {field: all ranks' blocks concatenated} for the per-block fields)."""
    world = len(blocks)
    offsets = bounds_of(blocks)
    per_rank: list[dict] = [{} for _ in range(world)]
    gathered = {}
    for name, axis in type(local).BLOCK_AXES.items():
        x = getattr(local, name)
        if x is None:
            continue
        full = all_gather_var(x, axis, blocks, group)
        gathered[name] = full
        for r in range(world):  # contiguous: kernels index statistics by their shape, not by strides
            per_rank[r][name] = full.narrow(axis, offsets[r], blocks[r]).contiguous()
    for name in type(local).SHARD_FIELDS:
        x = getattr(local, name).contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        for r in range(world):
            per_rank[r][name] = parts[r]
    shards = [dataclasses.replace(local, qmean=None, **fields).with_hbar(hbar) for fields in per_rank]
    return shards, gathered
