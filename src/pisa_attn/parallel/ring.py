"""PISA under ring (sequence) parallelism, exact in its semantics.

Every rank holds a contiguous slice of the sequence. PISA's selection is global (top-k over all key
blocks) and its tail terms need the global ``H̄``, but both are built from cheap per-block
statistics, so:

1. each rank computes block statistics of its keys; ``k̄_j`` and ``V̂_j`` are all-gathered and
   ``Σ_j H_j`` (a plain sum) is all-reduced into the global ``H̄``;
2. each rank selects, for its own query blocks, the global top-k key blocks;
3. key/value shards travel round the ring; each step adds the partial for that shard (its selected
   blocks exactly, its other blocks through the tail) with the global ``H̄``;
4. partials merge through their log-sum-exp, since numerator and denominator are sums over key blocks.

The result equals single-process :func:`pisa_attn.pisa_attention` on the whole sequence (same
selection, float tolerance; the reference returns float32 LSEs, so float64 inputs agree to about
1e-7, not to float64 round-off). Global blocks must not straddle ranks: when the shards are not block
aligned (or a token permutation is asked for), tokens are first redistributed to block-aligned
shards with one all-to-all, and the output is sent back the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention import normalize_keep_blocks
from ..ops import reference as ref
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
        when ``return_lse``. Inference only; runs the PyTorch reference pieces per ring step.
    """
    qh, kh, vh, sh = check_inputs(
        q, k, v, group=group, density=density, block_size=block_size, mode=mode, scale=scale,
        layout=layout, keep_blocks=keep_blocks, backend="reference", what="ring_pisa_attention", seq_lens=seq_lens,
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
    n_kv = ref.num_blocks(k_src[-1], block_size)
    keep, _ = normalize_keep_blocks(keep_blocks, sh.batch, sh.heads, n_kv, q.device)

    to_q = Redistribution.plan(q_perm, q_src, q_dst, sh.rank)
    same_order = (q_perm is None and perm is None) or (
        q_perm is not None and perm is not None and q_perm.shape == perm.shape and torch.equal(q_perm, perm)
    )
    same = same_order and q_src == k_src and q_dst == k_dst
    to_k = to_q if same else Redistribution.plan(perm, k_src, k_dst, sh.rank)
    qa = to_q.apply(qh, 2, group)
    ka, va = (to_k.apply(x, 2, group) for x in (kh, vh))

    out, lse = _ring_aligned(qa, ka, va, k_dst, group, density, block_size, mode, covariance_aware, scale, keep)

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


def _ring_aligned(q, k, v, k_bounds, group, density, block_size, mode, covariance_aware, scale, keep):
    """Ring PISA on block-aligned shards ([B, H, L, D] views). Returns (out, lse) of local queries."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    b, h, lq, d = q.shape
    hk = k.shape[1]
    stat_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    blocks = [ref.num_blocks(k_bounds[r + 1] - k_bounds[r], block_size) for r in range(world)]
    n_kv = sum(blocks)

    # 1. Local statistics, then global ones. Σ_j H_j is additive: all-reduce the local sums.
    local = _local_stats(k, v, block_size, stat_dtype)
    kv_means = all_gather_var(torch.cat([local.kmean, local.vsum], dim=-1), 2, blocks, group)
    hsum = local.hbar.contiguous()
    dist.all_reduce(hsum, group=group)
    hbar = hsum / n_kv
    hdev = None
    if covariance_aware:
        # ||H_j − H̄||_F needs the global H̄, so it is computed after the all-reduce, per owned block.
        mine = _local_hdev(k, v, local, hbar, block_size, stat_dtype)
        hdev = all_gather_var(mine, 2, blocks, group)
    stats = ref.BlockStats(
        kmean=kv_means[..., :d],
        vsum=kv_means[..., d:],
        counts=ref.block_counts(k_bounds[-1], block_size, q.device, stat_dtype),
        hbar=hbar,
        hdev=hdev,
    )

    # 2. Global top-k for the local query blocks.
    if lq:
        qmean = ref.block_means(q, block_size, stat_dtype)
        scores = ref.selection_scores(qmean, stats, scale, covariance_aware)
        selected = ref.select_blocks(scores, ref.num_selected(density, n_kv), keep)
    else:
        selected = torch.zeros(b, h, 0, n_kv, dtype=torch.bool, device=q.device)

    # 3./4. Rotate k/v shards; each step's partial merges through its LSE. Partials stay in the
    # accumulation dtype so the output is rounded once, as in the single-process kernel.
    qc = q.to(stat_dtype)
    out = torch.zeros(b, h, lq, d, dtype=stat_dtype, device=q.device)
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
            # Cast once per step: the reference casts k/v per query chunk otherwise.
            ks, vs = cur.view(2, b, hk, n_tok, d).to(stat_dtype).unbind(0)
            c0 = k_bounds[src] // block_size
            cols = slice(c0, c0 + blocks[src])
            part = ref.BlockStats(stats.kmean[:, :, cols], stats.vsum[:, :, cols], stats.counts[cols], hbar)
            o, l = ref.pisa_forward(
                qc, ks, vs, part, selected[..., cols], mode=mode, scale=scale, block_size=block_size
            )
            out, lse = merge_partials(out, lse, o, l)
        if nxt is not None:
            ring.wait()
            cur, src = nxt, (src - 1) % world
    return out.to(q.dtype), lse


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two softmax partials over disjoint key sets: weights exp(lse_x − lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    # Rows with no term on either side stay (0, -inf) rather than turning into NaN.
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - shift).to(out_a.dtype)[..., None]
    wb = torch.exp(lse_b - shift).to(out_a.dtype)[..., None]
    return wa * out_a + wb * out_b.to(out_a.dtype), lse


def _local_stats(k: Tensor, v: Tensor, block_size: int, dtype) -> ref.BlockStats:
    """Block statistics of this shard with ``hbar`` holding the *sum* Σ_j H_j (not the mean)."""
    b, hk, lk, d = k.shape
    if lk == 0:
        z = k.new_zeros((b, hk, 0, d), dtype=dtype)
        return ref.BlockStats(z, z, k.new_zeros(0, dtype=dtype), k.new_zeros((b, hk, d, d), dtype=dtype))
    st = ref.block_stats(k, v, block_size)
    st.hbar = st.hbar * st.kmean.shape[2]
    return st


def _local_hdev(k: Tensor, v: Tensor, local: ref.BlockStats, hbar: Tensor, block_size: int, dtype) -> Tensor:
    if k.shape[2] == 0:
        return k.new_zeros((k.shape[0], k.shape[1], 0), dtype=dtype)
    kb = ref._pad_to_blocks(k.to(dtype), block_size)
    vb = ref._pad_to_blocks(v.to(dtype), block_size)
    return ref._block_h_deviation(kb, vb, local.kmean, hbar, local.counts)
