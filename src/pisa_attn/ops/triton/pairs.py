"""Pairs of query blocks of one head that share a K/V stream, and the stream itself: the union of
their exact key blocks, each entry tagged with which of the two blocks owns it.

A kernel that serves two query blocks from one K/V stream (the Hopper pair kernel) loads every
block of the union once and lets each query block compute only the blocks it owns, so the
paper's per-block selection is kept exactly while shared blocks are read once. The fewer blocks
two partners share, the more the stream reads: :func:`pair_match` chooses the partners by how many
exact blocks they share (a greedy matching inside aligned groups of ``group`` query blocks);
without it, partners are adjacent (``2p``, ``2p + 1``), which is the matching of groups of 2.

Stream orders (:data:`ORDERS`). Blocks owned by one partner only alternate between the two owners
(first, second, first, ...; the longer list's rest follows), so that both consumers of the stream
have work in every window of a few entries (in plain ascending order a run of one owner's blocks
left the other consumer idle: H100, 32K, 12.5 %, the pair kernel was no faster than the one-block
kernel).

* ``"owners"`` (default): all blocks owned by one partner only, alternating, then the shared
  blocks, each class ascending. The fastest; a block's order of online-softmax steps (so its
  rounding) depends on its partner.
* ``"ascending"``: every owner sees its own blocks in ascending order whoever its partner is, so a
  query block's arithmetic does not depend on the pairing: between two consecutive shared blocks
  the own blocks alternate, then the shared block. Runs of one owner occur in every segment: up
  to 9 % slower (H100, 32K, Gaussian inputs).

Output, static shapes, no host synchronisation:

* ``qpair`` int32 ``[B, H, ceil(Nq / 2), 2]`` (:func:`pair_match`): the two query blocks of each
  pair, the smaller first; a block left alone (an odd count) has the partner ``Nq`` (none);
* ``uidx`` int32 ``[B, H, ceil(Nq / 2), W2]``: ``j << 2 | owner``, owner bit 0 = the pair's first
  query block, bit 1 = its second; ``W2 = min(Nk, 2 · W)`` rounded up to a multiple of 4; entries
  past ``ucnt`` are unspecified;
* ``ucnt`` int32 ``[B, H, ceil(Nq / 2)]``.

:func:`triple_union` builds the same stream for three adjacent query blocks (``j << 3 | owners``,
ascending), for the kernel's three-consumer CTA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..launch import Launcher
from ._common import next_pow2
from .grid import await_prior_grid, grid_dependency

ORDERS = {"ascending": 0, "owners": 1}  # ``ORDER`` of the union kernel


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _popc(x):
    """Set bits of each int32 (bit tricks: the interpreter has no popc)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)


@triton.jit(do_not_specialize=["NQ", "NQ2", "NW"])
def _pair_match_kernel(bits_ptr, qpair_ptr, NQ, NQ2, NW, G: tl.constexpr, NWP: tl.constexpr,
                       NM: tl.constexpr, NMP: tl.constexpr):
    grp = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, G)
    qi = grp * G + j
    valid = qi < NQ
    w = tl.arange(0, NWP)
    x = tl.load(bits_ptr + (bh * NQ + qi)[:, None] * NW + w[None, :], mask=valid[:, None] & (w < NW)[None, :],
                other=0)
    shared = tl.sum(_popc(x[:, None, :] & x[None, :, :]), axis=2)  # [G, G]: exact blocks both select
    # Every perfect matching of the group, numbered in mixed radix (G-1)(G-3)..1: at step s the
    # first free block pairs with the c-th free block after it. Matching 0 is adjacency.
    m = tl.arange(0, NMP)
    rem = m
    matched = tl.zeros([NMP, G], dtype=tl.int32)
    pairs = tl.zeros([NMP, G], dtype=tl.int32)
    weight = tl.zeros([NMP], dtype=tl.int32)
    for st in tl.static_range(G // 2):
        c = rem % (G - 1 - 2 * st)
        rem = rem // (G - 1 - 2 * st)
        free = matched == 0
        first = tl.min(tl.where(free, j[None, :], G), axis=1)
        rank = tl.cumsum(free.to(tl.int32), axis=1)  # the first free block has rank 1
        second = tl.min(tl.where(free & (rank == c[:, None] + 2), j[None, :], G), axis=1)
        hit_a = j[None, :] == first[:, None]
        hit_b = j[None, :] == second[:, None]
        matched = matched | (hit_a | hit_b).to(tl.int32)
        both = hit_a[:, :, None] & hit_b[:, None, :]
        weight += tl.sum(tl.sum(tl.where(both, shared[None, :, :], 0), axis=2), axis=1)
        pairs = tl.where(j[None, :] == 2 * st, first[:, None], tl.where(j[None, :] == 2 * st + 1, second[:, None], pairs))
    # The matching sharing most (ties: the lowest number, so adjacency when nothing is gained); a
    # group cut by Nq keeps adjacent pairs.
    best = tl.argmax(tl.where(m < NM, weight, -1), axis=0, tie_break_left=True)
    pick = tl.where((grp + 1) * G <= NQ, best, 0)
    local = tl.sum(tl.where((m == pick)[:, None], pairs, 0), axis=0)  # [G]: first, second, first, ...
    q = tl.minimum(grp * G + local, NQ)
    tl.store(qpair_ptr + (bh * NQ2 + grp * (G // 2)) * 2 + j, q, mask=grp * G + 2 * (j // 2) < NQ)


@triton.jit(do_not_specialize=["NQ", "NQ2", "NK", "NW", "W2", "N_PAIRS"])
def _pair_union_kernel(bits_ptr, qpair_ptr, uidx_ptr, ucnt_ptr, NQ, NQ2, NK, NW, W2, N_PAIRS,
                       R: tl.constexpr, NKP: tl.constexpr, HAS_QPAIR: tl.constexpr, ORDER: tl.constexpr):
    p = tl.program_id(0) * R + tl.arange(0, R)
    pvalid = p < N_PAIRS
    bh = (p // NQ2).to(tl.int64)
    if HAS_QPAIR:
        qa = tl.load(qpair_ptr + p.to(tl.int64) * 2, mask=pvalid, other=0)
        qb = tl.load(qpair_ptr + p.to(tl.int64) * 2 + 1, mask=pvalid, other=NQ)
    else:
        qa = 2 * (p % NQ2)
        qb = qa + 1
    cols = tl.arange(0, NKP)
    word = cols // 32
    bit = cols % 32
    m_a = pvalid[:, None] & (cols < NK)[None, :]
    m_b = m_a & (qb < NQ)[:, None]
    wa = tl.load(bits_ptr + (bh * NQ + qa)[:, None] * NW + word[None, :], mask=m_a, other=0)
    wb = tl.load(bits_ptr + (bh * NQ + qb)[:, None] * NW + word[None, :], mask=m_b, other=0)
    own = ((wa >> bit[None, :]) & 1) | (((wb >> bit[None, :]) & 1) << 1)
    only_a = (own == 1).to(tl.int32)
    only_b = (own == 2).to(tl.int32)
    both = own == 3
    present = own != 0
    c_a = tl.cumsum(only_a, axis=1)
    c_b = tl.cumsum(only_b, axis=1)
    if ORDER == 0:
        # Segments end at shared blocks: a segment's start counts (the running counts at the shared
        # block before it) by a running maximum, its end counts by a reversed running minimum.
        c_u = tl.cumsum(present.to(tl.int32), axis=1)
        a0 = tl.associative_scan(tl.where(both, c_a, 0), 1, _max)
        b0 = tl.associative_scan(tl.where(both, c_b, 0), 1, _max)
        u0 = tl.associative_scan(tl.where(both, c_u, 0), 1, _max)
        a1 = tl.minimum(tl.associative_scan(tl.where(both, c_a, NKP + 1), 1, _min, reverse=True),
                        tl.sum(only_a, axis=1)[:, None])
        b1 = tl.minimum(tl.associative_scan(tl.where(both, c_b, NKP + 1), 1, _min, reverse=True),
                        tl.sum(only_b, axis=1)[:, None])
        n_ab = tl.minimum(a1 - a0, b1 - b0)
        r_a = c_a - 1 - a0
        r_b = c_b - 1 - b0
        pos = tl.where(own == 1, u0 + tl.where(r_a < n_ab, 2 * r_a, n_ab + r_a),
                       tl.where(own == 2, u0 + tl.where(r_b < n_ab, 2 * r_b + 1, n_ab + r_b), c_u - 1))
    else:
        n_a = tl.sum(only_a, axis=1)[:, None]
        n_b = tl.sum(only_b, axis=1)[:, None]
        n_ab = tl.minimum(n_a, n_b)
        r_a = c_a - 1
        r_b = c_b - 1
        r_s = tl.cumsum(both.to(tl.int32), axis=1) - 1
        pos = tl.where(own == 1, tl.where(r_a < n_ab, 2 * r_a, n_ab + r_a),
                       tl.where(own == 2, tl.where(r_b < n_ab, 2 * r_b + 1, n_ab + r_b), n_a + n_b + r_s))
    tl.store(uidx_ptr + p.to(tl.int64)[:, None] * W2 + pos, cols[None, :] * 4 + own,
             mask=present & pvalid[:, None] & (pos < W2))
    tl.store(ucnt_ptr + p, tl.sum(present.to(tl.int32), axis=1), mask=pvalid)


_launch_match = Launcher(_pair_match_kernel)
_launch = Launcher(_pair_union_kernel)


def union_width(n_kv_blocks: int, width: int, owners: int = 2) -> int:
    """Entries per pair's stream: at most both lists' widths (``owners`` lists), at most every key
    block, rounded up to a multiple of 4 (16-byte rows, so that a kernel can copy a stream by TMA)."""
    return -(-max(1, min(n_kv_blocks, owners * width)) // 4) * 4


def _stream_buffers(bits: Tensor, groups: int, w: int, out: tuple[Tensor, Tensor] | None):
    """``out``, or fresh (uidx ``[B, H, groups, w]``, ucnt ``[B, H, groups]``) int32 buffers."""
    if out is not None:
        return out
    b, h = bits.shape[:2]
    return (torch.empty(b, h, groups, w, device=bits.device, dtype=torch.int32),
            torch.empty(b, h, groups, device=bits.device, dtype=torch.int32))


def _union_config(n_kv_blocks: int) -> tuple[int, int, int]:
    """(key blocks padded to a power of two, warps, stream rows a program) of a union launch."""
    nkp = max(32, next_pow2(n_kv_blocks))
    warps = max(1, min(8, nkp // 1024))
    return nkp, warps, max(1, min(32, 1024 * warps // nkp))


def n_matchings(group: int) -> int:
    """Perfect matchings of ``group`` query blocks: (group - 1)(group - 3)...1."""
    n = 1
    for c in range(group - 1, 0, -2):
        n *= c
    return n


def pair_match(bits: Tensor, group: int, *, out: Tensor | None = None) -> Tensor:
    """``qpair [B, H, ceil(Nq / 2), 2]`` from the selection bitmask ``bits [B, H, Nq, NW]``
    (contiguous): inside each aligned group of ``group`` query blocks (2, 4 or 8), the matching
    into pairs that shares the most exact blocks (every matching is scored; ties and a group cut
    short by ``Nq`` keep adjacent pairs). ``out``: a preallocated contiguous ``qpair``, written and
    returned."""
    if group not in (2, 4, 8):
        raise ValueError(f"group must be 2, 4 or 8, got {group}")
    b, h, nq, nw = bits.shape
    nq2 = -(-nq // 2)
    if out is None:
        out = torch.empty(b, h, nq2, 2, device=bits.device, dtype=torch.int32)
    nwp = max(1, next_pow2(nw))
    nm = n_matchings(group)
    warps = 4 if group * group * max(nwp, next_pow2(nm)) >= 4096 else 1
    _launch_match((group, nwp, warps), (-(-nq // group), b * h), (bits, out, nq, nq2, nw),
                  dict(G=group, NWP=nwp, NM=nm, NMP=next_pow2(nm)), num_warps=warps)
    return out


def pair_union(bits: Tensor, n_kv_blocks: int, width: int, *, qpair: Tensor | None = None,
               out: tuple[Tensor, Tensor] | None = None, order: str = "owners") -> tuple[Tensor, Tensor]:
    """(uidx, ucnt) of every pair of query blocks from the selection bitmask ``bits [B, H, Nq, NW]``
    (contiguous); ``width`` is the selection's list width ``W``; ``qpair``: the pairs
    (:func:`pair_match`; None: adjacent blocks). ``out``: preallocated ``(uidx, ucnt)`` of the
    shapes above (contiguous), written and returned. ``order``: a key of :data:`ORDERS`."""
    order_id = ORDERS.get(order)
    if order_id is None:
        raise ValueError(f"order must be one of {tuple(ORDERS)}, got {order!r}")
    b, h, nq, nw = bits.shape
    nq2 = -(-nq // 2)
    w2 = union_width(n_kv_blocks, width)
    uidx, ucnt = _stream_buffers(bits, nq2, w2, out)
    nkp, warps, r = _union_config(n_kv_blocks)
    n_pairs = b * h * nq2
    has_qpair = qpair is not None
    args = (bits, qpair if has_qpair else ucnt, uidx, ucnt, nq, nq2, n_kv_blocks, nw, w2, n_pairs)
    _launch((nkp, r, warps, has_qpair, order_id, bits.data_ptr() % 16 == 0), (triton.cdiv(n_pairs, r),), args,
            dict(R=r, NKP=nkp, HAS_QPAIR=has_qpair, ORDER=order_id), num_warps=warps)
    return uidx, ucnt


@triton.jit(do_not_specialize=["NQ", "NQ3", "NK", "NW", "W3", "N_GROUPS"])
def _triple_union_kernel(bits_ptr, uidx_ptr, ucnt_ptr, NQ, NQ3, NK, NW, W3, N_GROUPS,
                         R: tl.constexpr, NKP: tl.constexpr, PDL: tl.constexpr = 0):
    await_prior_grid(PDL)
    g = tl.program_id(0) * R + tl.arange(0, R)
    gvalid = g < N_GROUPS
    bh = (g // NQ3).to(tl.int64)
    q0 = 3 * (g % NQ3)
    cols = tl.arange(0, NKP)
    word = cols // 32
    bit = cols % 32
    m = gvalid[:, None] & (cols < NK)[None, :]
    own = tl.zeros([R, NKP], dtype=tl.int32)
    for c in tl.static_range(3):
        w = tl.load(bits_ptr + (bh * NQ + q0 + c)[:, None] * NW + word[None, :], mask=m & (q0 + c < NQ)[:, None],
                    other=0)
        own |= ((w >> bit[None, :]) & 1) << c
    present = own != 0
    pos = tl.cumsum(present.to(tl.int32), axis=1) - 1
    tl.store(uidx_ptr + g.to(tl.int64)[:, None] * W3 + pos, cols[None, :] * 8 + own,
             mask=present & gvalid[:, None] & (pos < W3))
    tl.store(ucnt_ptr + g, tl.sum(present.to(tl.int32), axis=1), mask=gvalid)


_launch_triple = Launcher(_triple_union_kernel)


def triple_width(n_kv_blocks: int, width: int) -> int:
    """Entries per triple's stream (:func:`union_width` of three lists)."""
    return union_width(n_kv_blocks, width, 3)


def triple_union(bits: Tensor, n_kv_blocks: int, width: int, *,
                 out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(uidx, ucnt) of every triple of adjacent query blocks (``3t, 3t + 1, 3t + 2``; past Nq: none)
    from ``bits [B, H, Nq, NW]`` (contiguous): ``uidx [B, H, ceil(Nq / 3), W3]`` holds
    ``j << 3 | owners`` (bit c: query block ``3t + c`` selects key block j) in ascending order of
    j, so every owner sees its own blocks in ascending order; ``ucnt [B, H, ceil(Nq / 3)]``."""
    b, h, nq, nw = bits.shape
    nq3 = -(-nq // 3)
    w3 = triple_width(n_kv_blocks, width)
    uidx, ucnt = _stream_buffers(bits, nq3, w3, out)
    nkp, warps, r = _union_config(n_kv_blocks)
    n_groups = b * h * nq3
    pdl = grid_dependency(bits.device)
    _launch_triple((nkp, r, warps, bits.data_ptr() % 16 == 0, pdl), (triton.cdiv(n_groups, r),),
                   (bits, uidx, ucnt, nq, nq3, n_kv_blocks, nw, w3, n_groups), dict(R=r, NKP=nkp, PDL=pdl),
                   num_warps=warps, launch_pdl=pdl > 0)
    return uidx, ucnt
