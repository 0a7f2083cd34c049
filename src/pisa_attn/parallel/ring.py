"""PISA under ring (sequence) parallelism, exact in its semantics.

Every rank holds a contiguous slice of the sequence. PISA's selection is global (top-k over all key
blocks) and its tail terms need the global ``H̄``, but both are built from cheap per-block
statistics, so one call is:

1. each rank runs the backend's prepare stage on its shard; the per-block statistics (centroids,
   tail terms), each shard's scale factors and ``N_r·H̄_r`` travel in ONE all-gather (a second,
   small one for ``||H_j − H̄||`` with covariance-aware selection, which needs the global ``H̄``);
2. each rank selects, for its own query blocks, the global top-k key blocks;
3. key/value shards travel round the ring; the next shard's send/receive is issued before the
   current step's attend, so the transfer overlaps it; each step attends to one shard (its
   selected blocks exactly, its other blocks through the tail) with the global ``H̄`` and returns
   a partial output and its LSE;
4. the partials merge in one pass (:func:`pisa_attn.ops.merge.merge`), since numerator and
   denominator are sums over key blocks.

The steps use only the stage contract (:mod:`pisa_attn.ops.stages`), so any backend runs them;
:func:`ring_pisa_attention` picks it as :func:`pisa_attn.pisa_attention` does (``backend="auto"``:
the kernels on CUDA). The result equals single-process ``pisa_attention`` on the whole sequence
(same selection, float tolerance: float16/bfloat16 partials are rounded to the input dtype, merged
in float32 and rounded again, so the output is within two roundings of one process's; float32 and
float64 partials keep their dtype, weighted through float32 log-sum-exps (the stage contract's
dtype), so a float64 output's relative error is about 1e-7 per unit of the rows' ``|lse|``: ~1e-7 at
unit-scale logits, ~1e-4 at ``|lse|`` near 1 500). Global blocks must not straddle ranks: when the shards are not
block aligned (or a token permutation is asked for), tokens are first redistributed to
block-aligned shards with one all-to-all, and the output is sent back the same way. Shards of
whole blocks are balanced to within one block; with fewer blocks than ranks some ranks hold none
and only relay.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .. import spec, tail_weight
from ..attention import backend_for, get_backend, normalize_keep_blocks
from ..ops.merge import merge
from ..ops.selection import Selection
from ..ops.stages import Backend
from ..settings import UNPASSED as _U
from ..settings import PisaSettings
from .comm import (
    RingExchange,
    Redistribution,
    all_gather_packed,
    balanced_block_bounds,
    bounds_of,
    check_permutation,
    order_key,
    to_device,
)
from .common import Shards, check_inputs, entry_settings, to_layout
from .phases import phase


def ring_pisa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    density: float = _U["density"],
    block_size: int = _U["block_size"],
    mode: str = _U["mode"],
    covariance_aware: bool | None = None,
    scale: float | None = None,
    layout: str = _U["layout"],
    keep_blocks: Tensor | None = None,
    perm: Tensor | None = None,
    q_perm: Tensor | None = None,
    exact_queries: Tensor | None = None,
    return_lse: bool = False,
    backend: str = _U["backend"],
    seq_lens: list[int] | None = None,
    alpha=None,
    query_block: int | None = None,
    settings: PisaSettings | None = None,
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
            it does not name are returned as 0 (lse ``-inf``) unless ``exact_queries`` names them.
        exact_queries: optional CPU int tensor of distinct global query positions that attend every
            key exactly (dense attention, e.g. the text queries of a joint sequence), in the same pass
            round the ring; where ``q_perm`` names them too (rows computed only to keep its query
            blocks on the key blocks' grid), the exact result is returned.
        keep_blocks: as in ``pisa_attention``, indexed by global key block (of the permuted order).
        density, block_size, mode, covariance_aware, scale, layout, return_lse, backend, alpha,
            query_block: as in :func:`pisa_attn.pisa_attention` (the backend runs every ring step).
        settings: a :class:`pisa_attn.PisaSettings` instead of the loose settings arguments.
        seq_lens: per-rank local lengths (q and k/v alike), when known to every rank: saves the
            all-gather of the shard shapes (a host sync), and with it every check that the ranks
            agree: each must then pass the same settings, dtype and ``[B, H, Hk, D]``, and an
            error on one rank leaves the others waiting in their next collective. Default:
            gathered and checked (a bad input or setting on any rank raises on every rank).

    Returns:
        ``out`` for this rank's queries (shape/layout of ``q``), plus its ``lse`` [B, H, Lq] fp32
        when ``return_lse``. Inference only.

    Token orders (``perm``, ``q_perm``, ``exact_queries``) are planned once per distinct tensor
    object (and in-place version) and shard lengths: pass the same tensors on every call of a model.
    """
    what = "ring_pisa_attention"
    s, alpha, error = entry_settings(settings, alpha, what=what, deferrable=seq_lens is None and isinstance(q, Tensor),
                                     sharded_keys=True,
                                     density=density, block_size=block_size, mode=mode, scale=scale, layout=layout,
                                     covariance_aware=covariance_aware, backend=backend, query_block=query_block)
    qh, kh, vh, sh = check_inputs(q, k, v, group=group, settings=s, what=what, return_lse=return_lse,
                                  seq_lens=seq_lens, alpha=alpha, pre_error=error)
    density, block_size, mode, covariance_aware = s.density, s.block_size, s.mode, s.covariance_aware
    layout = s.layout
    weights = tail_weight.resolve(alpha, mode=mode, heads=sh.heads, device=q.device,
                                  dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    be = get_backend(backend_for(s, qh))
    scale = float(sh.head_dim**-0.5 if s.scale is None else s.scale)
    route = _ring_route(perm, q_perm, exact_queries, sh, block_size, block_size * s.query_factor)
    n_kv = spec.num_blocks(route.k_dst[-1], block_size)
    keep, n_keep_max = normalize_keep_blocks(keep_blocks, sh.batch, sh.heads, n_kv, q.device)
    dev = q.device

    with phase("redist", dev):
        qa = route.to_q.apply(qh, 2, group)
        ka, va = (route.to_k.apply(x, 2, group) for x in (kh, vh))
        rest = route.rest_index(dev)
        q_rest = qh.index_select(2, rest) if rest is not None else None

    (out, lse), rest_res = _ring_aligned(
        qa, ka, va, route.k_dst, group, be, density=density, block_size=block_size, mode=mode,
        covariance_aware=covariance_aware, scale=scale, keep=keep, n_keep_max=n_keep_max, q_exact=q_rest,
        alpha=weights, query_block=block_size * s.query_factor,
    )  # fmt: skip

    with phase("redist", dev):
        # Queries that q_perm leaves out come back as out = 0, lse = -inf (no term at all)...
        out = route.to_q.reverse(out, 2, group)
        lse = route.to_q.reverse(lse, 2, group, fill=float("-inf")) if return_lse else None
        if rest_res is not None:  # ...and exact queries as they attended
            out.index_copy_(2, rest, rest_res[0])
            if lse is not None:
                lse.index_copy_(2, rest, rest_res[1])
    out = to_layout(out, layout)
    return (out, lse) if return_lse else out


@dataclass
class _RingRoute:
    """Where this rank's tokens go for one (token orders, shard lengths): computed on the host once."""

    to_q: Redistribution
    to_k: Redistribution
    k_dst: list[int]
    rest: Tensor | None  # local positions of the exact queries (CPU int64), None if there are none here
    refs: tuple  # the caller's order tensors: alive while cached, so their ids stay theirs
    _rest_dev: dict = dataclasses.field(default_factory=dict)

    def rest_index(self, device) -> Tensor | None:
        if self.rest is None:
            return None
        key = str(device)
        if key not in self._rest_dev:
            self._rest_dev[key] = to_device(self.rest, device)
        return self._rest_dev[key]


_ROUTES: OrderedDict = OrderedDict()
_MAX_ROUTES = 64


def _tensor_key(t, name: str):
    if t is not None and not isinstance(t, torch.Tensor):  # check_permutation's own message, before the cache
        check_permutation(t, 1, name)
    return None if t is None else order_key(t)


def _ring_route(perm, q_perm, exact, sh: Shards, block_size: int, query_block: int) -> _RingRoute:
    key = (_tensor_key(perm, "perm"), _tensor_key(q_perm, "q_perm"), _tensor_key(exact, "exact_queries"),
           tuple(sh.q_lens), tuple(sh.k_lens), sh.rank, block_size, query_block)  # fmt: skip
    route = _ROUTES.get(key)
    if route is not None:
        _ROUTES.move_to_end(key)
        return route
    refs = (perm, q_perm, exact)
    q_src, k_src = bounds_of(sh.q_lens), bounds_of(sh.k_lens)
    if perm is not None:
        perm = check_permutation(perm, k_src[-1])
    if q_perm is not None:
        q_perm = check_permutation(q_perm, q_src[-1], "q_perm", subset=True)
    elif perm is not None:
        q_perm = check_permutation(perm, q_src[-1], "perm (it also orders the queries: no q_perm given)")
    n_q = q_src[-1] if q_perm is None else q_perm.numel()
    # Query shards start on selection rows (query_block tokens), so each row's pooled mean is whole.
    q_dst = _aligned_bounds(q_src, n_q, query_block, sh.world, q_perm)
    k_dst = _aligned_bounds(k_src, k_src[-1], block_size, sh.world, perm)
    to_q = Redistribution.build(q_perm, q_src, q_dst, sh.rank)
    same_order = (q_perm is None and perm is None) or (
        q_perm is not None and perm is not None and q_perm.shape == perm.shape and torch.equal(q_perm, perm)
    )
    same = same_order and q_src == k_src and q_dst == k_dst
    to_k = to_q if same else Redistribution.build(perm, k_src, k_dst, sh.rank)
    rest = None
    if exact is not None:
        exact = check_permutation(exact, q_src[-1], "exact_queries", subset=True)
        mine = exact[(exact >= q_src[sh.rank]) & (exact < q_src[sh.rank + 1])] - q_src[sh.rank]
        rest = torch.sort(mine).values if mine.numel() else None
    route = _RingRoute(to_q, to_k, k_dst, rest, refs)
    _ROUTES[key] = route
    if len(_ROUTES) > _MAX_ROUTES:
        _ROUTES.popitem(last=False)
    return route


def _aligned_bounds(src: list[int], total: int, block_size: int, world: int, perm) -> list[int]:
    """Keep the caller's shards when every boundary is on a block start; else balance whole blocks."""
    if perm is None and all(b % block_size == 0 for b in src[:-1]):
        return src
    return balanced_block_bounds(total, block_size, world)


def _ring_aligned(q, k, v, k_bounds, group, be: Backend, *, density, block_size, mode, covariance_aware, scale,
                  keep, n_keep_max, q_exact=None, alpha=None, query_block=None):  # fmt: skip
    """Ring PISA on block-aligned K/V shards ([B, H, L, D] views, any strides) with backend ``be``'s
    stages. ``q``: this rank's query blocks (whole blocks of the global query sequence, which may
    differ from the key sequence). ``q_exact``: optional further queries (any count) that attend
    every key exactly, in the same pass. ``alpha``: ``[H]`` first-order weights of ``q``'s attend
    (``attend``'s). ``query_block``: tokens per selection row (``q`` starts on a row boundary). Returns ``((out, lse), (out_exact, lse_exact) | None)``,
    outputs in q's dtype, LSEs float32."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = q.device
    blocks = [spec.num_blocks(k_bounds[r + 1] - k_bounds[r], block_size) for r in range(world)]
    n_kv = sum(blocks)
    n_select = spec.num_selected(density, n_kv)
    # Partials in the kernels' own output dtype for 16-bit inputs (the Hopper kernel writes nothing
    # else; half the bytes to merge): rounded once there and once after the float32 merge.
    part_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else None

    with phase("stats", dev):
        lens = [hi - lo for lo, hi in zip(k_bounds, k_bounds[1:])]
        extra = {} if be.shard_prepare is None else be.shard_prepare(k.dtype, lens)  # the same fields on every rank
        local = be.prepare(q, k, v, block_size, query_block=query_block, **extra)
        shards, kmean, hdev = _gather_stats(be, local, k, v, blocks, group, covariance_aware, block_size)
    with phase("select", dev):
        width = spec.selection_width(n_kv, n_select, n_keep_max if keep is not None else 0)
        sel = be.select(local.qmean, kmean, n_select=n_select, width=width, scale=scale, hdev=hdev, keep=keep,
                        repeat=(query_block or block_size) // block_size,
                        n_q_blocks=spec.num_blocks(q.shape[2], block_size),
                        n_keep_max=None if keep is None else n_keep_max)
    del local, kmean, hdev

    # Query groups sharing the K/V pass: (queries, selection over all key blocks or None = every
    # block exact, mode, top-k count for the kernel's config choice).
    groups = [(q, sel, mode, n_select)]
    if q_exact is not None:
        groups.append((q_exact, None, "drop", None))
    parts: list[list] = [[] for _ in groups]
    exchange = RingExchange(group)
    cur, src = _KVShard.local(k, v), rank
    for step in range(world):
        nxt = None
        if step < world - 1:  # issued before this step's attend: the transfer overlaps it
            prev = (src - 1) % world
            nxt = cur.like(k_bounds[prev + 1] - k_bounds[prev])
            exchange.start(cur.wire, nxt.wire)
        if blocks[src]:
            ks, vs = cur.k, cur.v
            c0 = k_bounds[src] // block_size
            with phase("attend", dev):
                for (qg, selg, mode_g, n_sel), acc in zip(groups, parts):
                    if not qg.shape[2]:
                        continue
                    if selg is None:
                        s_shard, n_sel = _every_block(qg, blocks[src], block_size), blocks[src]
                    else:
                        s_shard = selg.blocks(c0, c0 + blocks[src])
                        # The kernel picks its config by density: a shard holds its share of the top-k.
                        n_sel = max(1, round(n_sel * blocks[src] / n_kv))
                    acc.append(be.attend(qg, ks, vs, shards[src], s_shard, mode=mode_g, scale=scale,
                                         block_size=block_size, n_select=n_sel, out_dtype=part_dtype,
                                         alpha=alpha if selg is not None else None))
        if nxt is not None:
            with phase("wait", dev):
                exchange.wait()
            cur, src = nxt, prev
    with phase("merge", dev):
        res = [merge(p, out_dtype=qg.dtype) if p else _no_rows(qg) for p, (qg, *_) in zip(parts, groups)]
    # float32 LSEs on every rank (a rank without queries too): the ranks exchange them afterwards.
    res = [(o, l.float()) for o, l in res]
    return res[0], (res[1] if len(res) > 1 else None)


def _every_block(q: Tensor, n_blocks: int, block_size: int) -> Selection:
    """Every key block exact for every query block of ``q`` (contiguous, as kernels index it)."""
    b, h, lq, _ = q.shape
    one = Selection.from_mask(torch.ones(1, 1, 1, n_blocks, dtype=torch.bool, device=q.device))
    nq = spec.num_blocks(lq, block_size)
    return Selection(*(x.expand(b, h, nq, *x.shape[3:]).contiguous() for x in one))  # cnt [B, H, Nq]


def _no_rows(q: Tensor) -> tuple[Tensor, Tensor]:
    b, h, lq, d = q.shape
    return q.new_zeros(b, h, lq, d), torch.full((b, h, lq), float("-inf"), device=q.device)


class _KVShard:
    """One K/V shard as it travels: ``k``/``v`` [B, Hk, L, D] views of ``wire``, two contiguous
    [L, B, Hk, D] buffers. Every rank uses this one memory order (the bytes a rank receives are
    read as the sender laid them out); it is the order redistributed tokens arrive in, and for
    B = 1 also diffusers' [B, L, H, D], so a shard is sent as it lies, without a packing copy."""

    _ORDER, _INVERSE = (2, 0, 1, 3), (1, 2, 0, 3)

    def __init__(self, wire: list[Tensor]):
        self.wire = wire
        self.k, self.v = (w.permute(self._INVERSE) for w in wire)

    @classmethod
    def local(cls, k: Tensor, v: Tensor) -> "_KVShard":
        return cls([x.permute(cls._ORDER).contiguous() for x in (k, v)])  # no copy when already so laid out

    def like(self, n_tokens: int) -> "_KVShard":
        """An empty shard of ``n_tokens`` tokens (a receive buffer)."""
        return _KVShard([w.new_empty((n_tokens, *w.shape[1:])) for w in self.wire])


def _gather_stats(be: Backend, local, k: Tensor, v: Tensor, blocks: list[int], group, covariance_aware: bool,
                  block_size: int):  # fmt: skip
    """Every rank's statistics from this rank's ``local`` ones, in one all-gather (two with
    covariance-aware selection). Returns (per-rank statistics with the global H̄ for attend, the
    global key centroids and ``||H_j − H̄||`` (or None) for selection)."""
    world, rank = len(blocks), dist.get_rank(group)
    cls = type(local)
    per_block = [(n, ax) for n, ax in cls.BLOCK_AXES.items() if n != "hdev" and getattr(local, n) is not None]
    whole = [n for n in cls.SHARD_FIELDS if getattr(local, n) is not None]  # e.g. kmax: hopper only
    hsum = local.hbar * blocks[rank]  # H̄ is the mean of all H_j: block-weighted local means add up

    def resized(x: Tensor, axis: int, n: int) -> tuple[int, ...]:
        shape = list(x.shape)
        shape[axis] = n
        return tuple(shape)

    tensors = [hsum] + [getattr(local, n) for n, _ in per_block] + [getattr(local, n) for n in whole]
    shapes = [
        [tuple(hsum.shape)] + [resized(getattr(local, n), ax, blocks[r]) for n, ax in per_block]
        + [tuple(getattr(local, n).shape) for n in whole]
        for r in range(world)
    ]  # fmt: skip
    got = all_gather_packed(tensors, shapes, group)
    hbar = got[0][0].clone()
    for r in range(1, world):  # the same order on every rank: every rank gets the same H̄
        hbar += got[r][0]
    hbar /= sum(blocks)
    fields = [dict(zip([n for n, _ in per_block] + whole, got[r][1:])) for r in range(world)]
    hdev = None
    if covariance_aware:
        mine = be.deviation(k, v, local, hbar, block_size)
        ax = cls.BLOCK_AXES["hdev"]
        parts = all_gather_packed([mine], [[resized(mine, ax, blocks[r])] for r in range(world)], group)
        for r in range(world):
            fields[r]["hdev"] = parts[r][0]
        hdev = torch.cat([p[0] for p in parts], dim=ax)
    ax = cls.BLOCK_AXES["kmean"]
    kmean = torch.cat([f["kmean"] for f in fields], dim=ax)
    shards = [dataclasses.replace(local, qmean=None, **f).with_hbar(hbar) for f in fields]
    return shards, kmean, hdev
