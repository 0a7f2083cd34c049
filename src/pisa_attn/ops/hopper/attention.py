"""Warp-specialised Hopper (sm_90) PISA attention in Gluon: two or three query blocks share K/V loads.

One CTA owns a group of ``NC`` 64-row query blocks of one head: a *pair* (chosen by how many exact
key blocks they share, :func:`pisa_attn.ops.triton.pairs.pair_match`, or adjacent), or three
adjacent blocks (:func:`pisa_attn.ops.triton.pairs.triple_union`; the default, see
:data:`QUERY_GROUP`). It runs ``NC + 1`` partitions:

* the loader (default partition, 4 warps, few registers) streams, through a ring of ``STAGES``
  shared-memory slots filled by TMA, first the sorted union of the group's exact key blocks,
  then the head's centroid groups (``kbar``/``vbar``, ``C = BS`` centroids a slot), and loads
  the query tiles, ``H̄`` and the group's stream codes (``CODES``: into shared memory, so no
  partition loads from global memory in its loop) once; with three query blocks at D = 2·BS,
  ``H̄`` comes last through the ring instead (:func:`hbar_in_ring`);
* ``NC`` consumer warpgroups (worker partitions), one per query block, walk the same stream: each
  computes only the exact blocks its own selection holds (the union code's owner bits), then
  every centroid group under its own tail bitmask, all in one softmax (base 2), then the
  first-order term ``ℓ_tail · α_h s (q H̄)`` (``α_h`` from ``alpha_ptr``, one float per query
  head; ``H̄`` read divided by its head's power of two ``hscale``, folded back in the output's
  scaling). The tail's maximum is fixed before the scan where a per-row bound of the centroid scores
  (from ``kbound``, the per-channel centroid maxima) is close enough to the exact blocks' maximum
  (:data:`TAIL_SLACK`): no row maximum and no rescale per group; else it stays online. A slot is
  released when every consumer arrived. The exact blocks run one after the other (Q·Kᵀ, softmax,
  P·V); ``PIPELINE`` (pairs) selects an FA3-style schedule instead, each block's Q·Kᵀ and softmax
  under the previous block's P·V. Every protocol computes the same bits; the defaults are the ones
  measured fastest or no slower (``notes/kernel-notes.md``).

The selection is the paper's, per 64-row query block; only the loads are shared. The function is
the Triton kernel's (``ops/triton/attention.py``): same scaled float16 centroid scores with
``log2 n_j`` folded in, same tail normaliser; the rounding differs where the tail's maximum is
fixed and in the first-order term, which accumulates into the normalised output.
"""
from __future__ import annotations

import functools
import math
import os

import triton

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import kernel_constants
from ..kernel_constants import LOG2E, MODE_IDS
from ..launch import Desc, Launcher
from ..triton.attention import alpha_arg, out_buffers
from ..triton.grid import grid_dependency
from ..triton.grid import level as grid_level
from ..triton.pairs import ORDERS, pair_match, pair_union, triple_union, triple_width, union_width

LN2 = gl.constexpr(kernel_constants.LN2)
# With the tail's maximum fixed before the scan (``max(m, bound − TAIL_HEADROOM)``), a tail weight
# is at most 2^15: finite in float16's P operand, and far from float32's range in ``l``.
TAIL_HEADROOM = gl.constexpr(15.0)
EXACT_TAIL_HEADROOM = gl.constexpr(60.0)


# Names that moved between Triton releases (3.6: ``_reinterpret``, ``async_copy_*``).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the partition's threads
if hasattr(gl.shared_memory_descriptor, "reinterpret"):
    @gluon.jit
    def _box(buf, desc):
        """A ``[rows, D]`` slot seen as the descriptor's ``[1, .., rows, D]`` TMA box (same bytes)."""
        return buf.reinterpret(desc.dtype, desc.block_type.shape, desc.layout)

    @gluon.jit
    def _as_fp16(buf):
        return buf.reinterpret(gl.float16, buf.shape, buf.type.layout)

    @gluon.jit
    def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return buf.reinterpret(dtype, shape, layout)
else:
    @gluon.jit
    def _box(buf, desc):
        """A ``[rows, D]`` slot seen as the descriptor's ``[1, .., rows, D]`` TMA box (same bytes)."""
        return buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)

    @gluon.jit
    def _as_fp16(buf):
        return buf._reinterpret(gl.float16, buf.shape, buf.type.layout)

    @gluon.jit
    def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return buf._reinterpret(dtype, shape, layout)


@gluon.jit
def _query_block(qpair_ptr, pair_row, pair, c: gl.constexpr, HAS_QPAIR: gl.constexpr, NC: gl.constexpr):
    """Query block ``c`` (0 to NC - 1) of the CTA's group: from the pairing table (pairs only), else
    adjacent blocks."""
    if HAS_QPAIR:
        qi = gl.load(qpair_ptr + pair_row * 2 + c)
    else:
        qi = pair * NC + c
    return qi


@gluon.jit
def _code(codes, u, CODE_L: gl.constexpr):
    """Stream entry ``u`` from the shared-memory copy of the pair's stream (``[W2S, 1]`` view)."""
    return gl.max(codes.index(u).load(CODE_L), axis=0)


@gluon.jit
def _codes_view(codes_smem, NCH: gl.constexpr, CW: gl.constexpr):
    """The TMA buffer of the stream codes (``[NCH, 1, CW]``, unswizzled) seen as one code per row."""
    return _reinterpret(codes_smem, gl.int32, [NCH * CW, 1],
                        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))


@gluon.jit
def _loader(q_desc, k_desc, v_desc, kb_desc, vb_desc, hb_desc, cd_desc,
            q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
            uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, b, h, hk, bhk, NK,
            BS: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
            HAS_QPAIR: gl.constexpr, CODES: gl.constexpr, NCH: gl.constexpr, CW: gl.constexpr,
            NC: gl.constexpr, HB_RING: gl.constexpr):
    # The group's stream codes first (one TMA into shared memory, when CODES), then the query tiles
    # (a tile past Lq is zero-filled by TMA) and H̄ (unless it comes last through the ring,
    # HB_RING), each on its own barrier.
    if CODES:
        mbarrier.expect(code_bar.index(0), NCH * cd_desc.block_type.nbytes)
        for c in gl.static_range(NCH):
            _tma_load(cd_desc, [pair_row, c * CW], code_bar.index(0), _box(codes_smem.index(c), cd_desc))
    for c in gl.static_range(NC):
        qi = _query_block(qpair_ptr, pair_row, pair, c, HAS_QPAIR, NC)
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, qi * BS, 0], q_bar.index(c), _box(q_smem.index(c), q_desc))
    if MODE == 2 and not HB_RING:
        mbarrier.expect(hb_bar.index(0), hb_desc.block_type.nbytes)
        _tma_load(hb_desc, [bhk, 0, 0], hb_bar.index(0), _box(hb_smem, hb_desc))
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    CODE_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    n_union = gl.load(ucnt_ptr + pair_row)
    ubase = uidx_ptr + pair_row.to(gl.int64) * W2  # the stream may pass 2**31 entries (B·H = 64 at 1M tokens)
    codes = _codes_view(codes_smem, NCH, CW)
    t = 0
    # Every read of the stream is issued one entry ahead, off the critical path.
    if CODES:
        mbarrier.wait(code_bar.index(0), 0)
        code = _code(codes, 0, CODE_L)
    else:
        code = gl.load(ubase, mask=n_union > 0, other=0)
    for u in range(n_union):
        j = code >> NC  # a code: key block << NC | owner bits
        if CODES:
            code = _code(codes, gl.minimum(u + 1, NCH * CW - 1), CODE_L)
        else:
            code = gl.load(ubase + u + 1, mask=u + 1 < n_union, other=0)
        s = t % STAGES
        # A fresh mbarrier counts as having completed phase 1: the first pass never waits.
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), kv_bytes)
        _tma_load(k_desc, [b, hk, j * BS, 0], ready.index(s), _box(k_bufs.index(s), k_desc))
        _tma_load(v_desc, [b, hk, j * BS, 0], ready.index(s), _box(v_bufs.index(s), v_desc))
        t += 1
    if MODE > 0:
        c_bytes: gl.constexpr = kb_desc.block_type.nbytes + vb_desc.block_type.nbytes
        for g0 in range(0, NK, C):
            s = t % STAGES
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), c_bytes)
            _tma_load(kb_desc, [bhk, g0, 0], ready.index(s), _box(k_bufs.index(s), kb_desc))
            _tma_load(vb_desc, [bhk, g0, 0], ready.index(s), _box(v_bufs.index(s), vb_desc))
            t += 1
    if HB_RING:
        # H̄'s two 64-row halves as the ring's last entry (its K and V slots): only the
        # first-order term needs them, so no slot of their size is held through the loops.
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), 2 * hb_desc.block_type.nbytes)
        _tma_load(hb_desc, [bhk, 0, 0], ready.index(s), _box(k_bufs.index(s), hb_desc))
        _tma_load(hb_desc, [bhk, BS, 0], ready.index(s), _box(v_bufs.index(s), hb_desc))


@gluon.jit
def _softmax_core(m_i, l_i, acc, s, scale, o_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr):
    """The online-softmax update of one tile of scores ``s·scale`` (base 2; ``scale > 0``): (m, l,
    acc rescaled, the rescale factor, the tile's row sums, P as the P·V product's register operand).
    The scale goes into the row maximum (two numbers a row: ``max(s)·scale`` is ``max(s·scale)``,
    rounding being monotonic) and into the exponent's FMA, not into every score."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    # A row with nothing seen yet keeps finite arithmetic: exp2(-inf - 0) = 0, never NaN.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = gl.exp2(m_i - m_use)
    p = gl.exp2(s * scale - m_use[:, None])
    ps = gl.sum(p, axis=1)
    l_i = l_i * rescale + ps
    acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o_layout))[:, None]
    pv = gl.convert_layout(p.to(dtype), p_layout)
    return m_new, l_i, acc, rescale, ps, pv


@gluon.jit
def _softmax_step(m_i, l_i, acc, s, scale, v_smem, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  p_layout: gl.constexpr):
    """One tile of scores ``s·scale`` (base 2) into the running (m, l, acc); also returns the
    rescale factor and the tile's row sums (the tail normaliser needs both)."""
    m_new, l_i, acc, rescale, ps, pv = _softmax_core(m_i, l_i, acc, s, scale, o_layout, p_layout, v_smem.dtype)
    acc = warpgroup_mma(pv, v_smem, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return m_new, l_i, acc, rescale, ps


@gluon.jit
def _tail_group(q16, kb, vb, lo, hi, g0, cols, m_i, l_i, acc, l_tail, s_zero, sc_scale, LK, NK,
                BS: gl.constexpr, C: gl.constexpr, EVEN_K: gl.constexpr, LOG2_BS: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """One group of ``C`` centroids (``kb`` float16, ``vb`` the value sums) into the running (m, l,
    acc) and ``l_tail`` (BS·Σα), under the group's exact-set bits ``lo`` (and ``hi`` for C = 64):
    score ``q·k̄_j·s + log2 n_j`` for a tail block, -inf for an exact one."""
    cj = g0 + cols
    if C > 32:  # bits 32.. of the group come from the next word
        word = gl.where(cols < 32, lo, hi)
    else:
        word = lo
    tail = (((word >> (cols % 32)) & 1) == 0) & (cj < NK)
    # per column: log2 n_j for a tail block, -inf for an exact one
    if EVEN_K:
        bias = gl.where(tail, LOG2_BS, float("-inf"))
    else:
        n_j = gl.maximum(gl.minimum(LK - cj * BS, BS), 1).to(gl.float32)
        bias = gl.where(tail, gl.log2(n_j), float("-inf"))
    sc = warpgroup_mma(q16, kb.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,)) * sc_scale + bias[None, :]
    m_i, l_i, acc, rescale, ps = _softmax_step(m_i, l_i, acc, sc, 1.0, vb, s_layout, o_layout, p_layout)
    # l_tail holds BS·Σα: every block but a ragged last one has n_j = BS.
    l_tail = l_tail * rescale + ps
    if not EVEN_K:
        l_tail = _ragged_last(l_tail, sc, m_i, cj, g0, LK, NK, BS, C, gl.SliceLayout(1, s_layout))
    return m_i, l_i, acc, l_tail


@gluon.jit
def _ragged_last(l_tail, sc, m_i, cj, g0, LK, NK, BS: gl.constexpr, C: gl.constexpr, row_l: gl.constexpr):
    """A ragged last block has ``n_j < BS``: ``l_tail`` (BS·Σα, rows in ``row_l``) counts its weight
    ``BS / n_j`` times (``sc``, ``m_i``: the group's scores and maximum, rows in the scores' layout)."""
    if g0 + C >= NK:
        n_last = (LK - (NK - 1) * BS).to(gl.float32)
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        a_last = gl.sum(gl.where((cj == NK - 1)[None, :], gl.exp2(sc - m_use[:, None]), 0.0), axis=1)
        l_tail += gl.convert_layout(a_last * (BS / n_last - 1.0), row_l)
    return l_tail


@gluon.jit
def _pad_bits(word, n):
    """``word`` with bits ``n`` and up set (columns past the last key block count as exact)."""
    return word | gl.where(n >= 32, 0, -(1 << gl.maximum(gl.minimum(n, 31), 0)))


@gluon.jit
def _mask_ragged(sc, j, cols, LK, BS: gl.constexpr):
    """Scores of key block ``j`` with the columns past ``LK`` at -inf (only the last block has any).
    Pairs stream their blocks out of order and select on every block: a branch around the select
    for the last block alone miscompiled at D = 64 in keep-or-drop mode with Triton 3.6 (every
    output wrong); three query blocks peel the last stream entry instead."""
    return gl.where((cols < gl.minimum(LK - j * BS, BS))[None, :], sc, float("-inf"))


@gluon.jit
def _tail_tile_fixed(q16, kb, vb, lo, hi, j0, ct, m_t, c_t, l_i, acc, l_tail, zero, sc_scale, LK, NK,
                     BS: gl.constexpr, EVEN_K: gl.constexpr, row_s: gl.constexpr, p_layout: gl.constexpr):
    """``CT`` centroids from ``j0`` (``kb`` ``[CT, D]``; bitmask words ``lo``, and ``hi`` for
    columns 32..) under the tail's fixed maximum ``m_t`` (``c_t = log2 BS − m_t``; rows in the
    score tile's layout): no row maximum, no rescale."""
    CT: gl.constexpr = kb.shape[0]
    if CT > 32:
        word = gl.where(ct < 32, lo, hi)
    else:
        word = lo
    tail = ((word >> (ct % 32)) & 1) == 0
    sc = warpgroup_mma(q16, kb.permute((1, 0)), zero, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    if EVEN_K:
        p = gl.where(tail[None, :], gl.exp2(sc * sc_scale + c_t[:, None]), 0.0)
    else:
        cj = j0 + ct
        n_j = gl.maximum(gl.minimum(LK - cj * BS, BS), 1).to(gl.float32)
        sc = sc * sc_scale + gl.where(tail, gl.log2(n_j), float("-inf"))[None, :]
        p = gl.exp2(sc - m_t[:, None])
    ps = gl.convert_layout(gl.sum(p, axis=1), row_s)
    l_i += ps
    l_tail += ps
    acc = warpgroup_mma(gl.convert_layout(p.to(vb.dtype), p_layout), vb, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if not EVEN_K:
        l_tail = _ragged_last(l_tail, sc, m_t, cj, j0, LK, NK, BS, CT, row_s)
    return l_i, acc, l_tail


@gluon.jit
def _tail_group_fixed(q16, kb, vb, lo, hi, g0, m_i, l_i, acc, l_tail, sc_scale, LK, NK,
                      BS: gl.constexpr, C: gl.constexpr, EVEN_K: gl.constexpr, LOG2_BS: gl.constexpr,
                      s_layout: gl.constexpr, o_layout: gl.constexpr):
    """One group of ``C`` centroids as :func:`_tail_group`, under a maximum ``m_i`` fixed for the
    whole tail."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, C, 16])
    pt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_t: gl.constexpr = gl.SliceLayout(1, st_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    ct = gl.arange(0, C, layout=gl.SliceLayout(0, st_layout))
    zero = gl.zeros([BS, C], gl.float32, layout=st_layout)
    m_t = gl.convert_layout(m_i, row_t)
    c_t = LOG2_BS - m_t
    # Past NK the words' bits count as exact: a scalar per word, not a compare per column.
    lo = _pad_bits(lo, NK - g0)
    hi = _pad_bits(hi, NK - g0 - 32)
    l_i, acc, l_tail = _tail_tile_fixed(q16, kb, vb, lo, hi, g0, ct, m_t, c_t, l_i, acc, l_tail, zero, sc_scale,
                                        LK, NK, BS, EVEN_K, row_s, pt_layout)
    return m_i, l_i, acc, l_tail


@gluon.jit
def _tail_step(q16, k_bufs, v_bufs, ready, empty, t, g0, brow, NW, active, lo_next, hi_next, m_i, l_i, acc, l_tail,
               s_zero, cols, sc_scale, LK, NK, BS: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr,
               EVEN_K: gl.constexpr, LOG2_BS: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
               p_layout: gl.constexpr, FIXED: gl.constexpr):
    """The centroid group from ``g0`` (ring entry ``t + g0 / C``; its bitmask words ``lo_next``,
    ``hi_next``) into the running state; the next group's words are read here, one group ahead."""
    lo = lo_next
    hi = hi_next
    w_next = (g0 + C) // 32
    lo_next = gl.load(brow + w_next, mask=active & (w_next < NW), other=0)
    if C > 32:
        hi_next = gl.load(brow + w_next + 1, mask=active & (w_next + 1 < NW), other=-1)
    u = t + g0 // C  # the group's ring entry
    s = u % STAGES
    mbarrier.wait(ready.index(s), (u // STAGES) & 1)
    if active:
        if FIXED:
            m_i, l_i, acc, l_tail = _tail_group_fixed(q16, _as_fp16(k_bufs.index(s)), v_bufs.index(s), lo, hi, g0,
                                                      m_i, l_i, acc, l_tail, sc_scale, LK, NK, BS, C, EVEN_K,
                                                      LOG2_BS, s_layout, o_layout)
        else:
            m_i, l_i, acc, l_tail = _tail_group(q16, _as_fp16(k_bufs.index(s)), v_bufs.index(s), lo, hi, g0,
                                                cols, m_i, l_i, acc, l_tail, s_zero, sc_scale, LK, NK, BS, C,
                                                EVEN_K, LOG2_BS, s_layout, o_layout, p_layout)
    mbarrier.arrive(empty.index(s), count=1)
    return lo_next, hi_next, m_i, l_i, acc, l_tail


@gluon.jit
def _tail_loop(q16, k_bufs, v_bufs, ready, empty, t, brow, NW, active, m_i, l_i, acc, l_tail, s_zero, sc_scale,
               LK, NK, BS: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
               LOG2_BS: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
               FIXED: gl.constexpr, PEEL: gl.constexpr):
    """Every centroid group of the ring (entries ``t``, ``t + 1``, ..; ``ready``/``empty`` its
    barriers) into the running state, under the fixed maximum ``m_i`` (FIXED) or the online one;
    a consumer whose query block is past the end (not ``active``) only releases the slots. With a
    ragged Lk and ``PEEL`` only the group holding the last key block weighs its columns by
    ``log2 n_j``, after the loop: that keeps the ragged code's registers out of it (three
    consumers at 160 registers need that; pairs at 240 do not, and the second copy of the group's
    code would cost them a few spills outside the loop)."""
    # made here, not kept in registers through the exact loop
    cols = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
    # The group's exact-set bits, one (C = 32) or two (C = 64) words, read one group ahead.
    lo_next = gl.load(brow, mask=active, other=0)
    hi_next = gl.load(brow + 1, mask=active & (NW > 1), other=-1)
    if EVEN_K or not PEEL:
        n_even = NK
    else:
        n_even = (NK - 1) // C * C  # the groups before the one holding the ragged last block
    for g0 in range(0, n_even, C):
        lo_next, hi_next, m_i, l_i, acc, l_tail = _tail_step(
            q16, k_bufs, v_bufs, ready, empty, t, g0, brow, NW, active, lo_next, hi_next, m_i, l_i, acc, l_tail,
            s_zero, cols, sc_scale, LK, NK, BS, C, STAGES, EVEN_K or PEEL, LOG2_BS, s_layout, o_layout, p_layout,
            FIXED)
    if PEEL and not EVEN_K:
        lo_next, hi_next, m_i, l_i, acc, l_tail = _tail_step(
            q16, k_bufs, v_bufs, ready, empty, t, n_even, brow, NW, active, lo_next, hi_next, m_i, l_i, acc, l_tail,
            s_zero, cols, sc_scale, LK, NK, BS, C, STAGES, False, LOG2_BS, s_layout, o_layout, p_layout, FIXED)
    return m_i, l_i, acc, l_tail


@gluon.jit
def _tail_bound(q_s, kbound_ptr, bhk, qk_scale, BS: gl.constexpr, D: gl.constexpr, LOG2_BS: gl.constexpr,
                row_s: gl.constexpr):
    """Per row, an upper bound of every tail score ``q·k̄_j·s + log2 n_j`` (base 2):
    ``s·Σ_d |q_d|·max_j |k̄_jd| + log2 BS`` (``kbound``: the per-channel maxima)."""
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros([BS], gl.float32, layout=gl.SliceLayout(1, BL))
    for c in gl.static_range(D // 64):  # 64 columns at a time: few registers
        qv = q_s.slice(c * 64, 64, dim=1).load(BL).to(gl.float32)
        r = gl.load(kbound_ptr + bhk * D + c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, BL)))
        acc += gl.sum(gl.abs(qv) * r[None, :], axis=1)
    return gl.convert_layout(acc * qk_scale + LOG2_BS, row_s)


@gluon.jit
def _fixed_max(m_i, bound, HEADROOM: gl.constexpr, SLACK: gl.constexpr):
    """The tail's fixed maximum ``max(m, bound − HEADROOM)`` per row (every tail weight is then at
    most ``2^HEADROOM``), and whether it may be used: it is at most ``SLACK`` above the exact
    blocks' maximum in every row (else the weights could underflow, and the tail keeps the online
    maximum)."""
    m_fix = gl.maximum(m_i, bound - HEADROOM)
    gap = gl.where(m_i == float("-inf"), float("inf"), m_fix - m_i)
    return m_fix, gl.max(gap, axis=0) <= SLACK


@gluon.jit
def _stream_code(codes, ubase, n_union, i, CODES: gl.constexpr, NCODES: gl.constexpr, CODE_L: gl.constexpr):
    """Entry ``i`` of the pair's stream: from its shared-memory copy (CODES), else from global
    memory (0 past the end)."""
    if CODES:
        c = _code(codes, gl.minimum(i, NCODES - 1), CODE_L)
    else:
        c = gl.load(ubase + i, mask=i < n_union, other=0)
    return c


@gluon.jit
def _softmax_p(m_i, l_i, s, scale, p_layout: gl.constexpr, dtype: gl.constexpr):
    """The online-softmax update of one tile of scores ``s·scale`` without the accumulator, as
    :func:`_softmax_core`: (m, l, rescale, P as the P·V product's register operand)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = gl.exp2(m_i - m_use)
    p = gl.exp2(s * scale - m_use[:, None])
    l_i = l_i * rescale + gl.sum(p, axis=1)
    return m_new, l_i, rescale, gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _flush_pv(acc, p, v_bufs, empty, tp, STAGES: gl.constexpr):
    """The pending block's P·V into ``acc``, then its slot back to the loader."""
    sp = tp % STAGES
    tok = warpgroup_mma(p, v_bufs.index(sp), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(tok, p))
    mbarrier.arrive(empty.index(sp), count=1)
    return acc


@gluon.jit
def _exact_pipelined(qa, k_bufs, v_bufs, ready, empty, codes, ubase, n_union, m_i, l_i, acc,
                     s_zero, cols, qk_scale, LK,
                     CID: gl.constexpr, BS: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
                     s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                     CODES: gl.constexpr, NCODES: gl.constexpr, CODE_L: gl.constexpr, NC: gl.constexpr):
    """The exact blocks with each block's Q·Kᵀ and softmax under the previous owned block's P·V
    (FA3's intra-warpgroup schedule): per owned block, Q·Kᵀ(j) and P·V(j-1) are queued, the wait
    for the older group (the scores) lets the softmax of j run while the tensor cores compute
    P·V(j-1), then the second wait, the slot of j-1 goes back and ``acc`` is rescaled to j's
    maximum. The P of the last owned block (``tp``: its stream entry, -1 none) is carried in
    registers with its P·V not yet issued, so no product is in flight across iterations.

    A consumer holds at most one slot past its position. Before waiting on an entry ``STAGES`` or
    more past the held one it flushes (issues and waits that P·V, releases the slot): the loader
    fills entry u only once entry u - STAGES is released by both consumers, so holding it would
    deadlock when the other consumer owns a long run of the stream."""
    p = gl.zeros([BS, BS], v_bufs.dtype, layout=p_layout)
    tp = n_union * 0 - 1
    code_next = _stream_code(codes, ubase, n_union, 0, CODES, NCODES, CODE_L)
    for u in range(n_union):
        code = code_next
        code_next = _stream_code(codes, ubase, n_union, u + 1, CODES, NCODES, CODE_L)
        s = u % STAGES
        if (tp >= 0) & (u - tp >= STAGES):
            acc = _flush_pv(acc, p, v_bufs, empty, tp, STAGES)
            tp = -1
        mbarrier.wait(ready.index(s), (u // STAGES) & 1)
        if ((code >> CID) & 1) != 0:
            s_tok = warpgroup_mma(qa, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if tp >= 0:
                sp = tp % STAGES
                a_tok = warpgroup_mma(p, v_bufs.index(sp), acc, is_async=True)
                # The oldest group only (the scores): P·V(j-1) stays on the tensor cores.
                sc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                if not EVEN_K:
                    sc = _mask_ragged(sc, code >> NC, cols, LK, BS)
                m_i, l_i, rescale, p_new = _softmax_p(m_i, l_i, sc, qk_scale, p_layout, v_bufs.dtype)
                acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(a_tok, p))
                mbarrier.arrive(empty.index(sp), count=1)
            else:
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
                if not EVEN_K:
                    sc = _mask_ragged(sc, code >> NC, cols, LK, BS)
                m_i, l_i, rescale, p_new = _softmax_p(m_i, l_i, sc, qk_scale, p_layout, v_bufs.dtype)
            # acc holds the blocks before j at the old maximum: rescale it after their P·V.
            acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o_layout))[:, None]
            p = p_new
            tp = u
        else:
            mbarrier.arrive(empty.index(s), count=1)
    if tp >= 0:
        acc = _flush_pv(acc, p, v_bufs, empty, tp, STAGES)
    return m_i, l_i, acc


@gluon.jit
def _finish(q_s, k_bufs, v_bufs, ready, empty, t, hb_smem, hb_bar, o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr,
            kbound_ptr, alpha_ptr, m_i, l_i, acc, active, row, qi, NW, b, h, bhk, bh, LQ, LK, NK, qk_scale, scale, pw,
            BS: gl.constexpr, D: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
            EVEN_K: gl.constexpr, LOG2_BS: gl.constexpr, NC: gl.constexpr, TAIL_SLACK: gl.constexpr,
            s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, HB_RING: gl.constexpr = False,
            efix=0, EXACT_FX: gl.constexpr = False, PW_BF16: gl.constexpr = True):
    """A consumer's work after its exact blocks, shared by the input-precision and low-precision
    kernels: the centroid tail (ring entries ``t``, ``t + 1``, .. of ``k_bufs``/``v_bufs``), the
    first-order term, the LSE and the output tile (staged in the dead query tile ``q_s``, then one
    TMA store). ``m_i``, ``l_i`` (rows of ``s_layout``) and ``acc`` (``o_layout``): the state after
    the exact blocks, in the input-precision kernel's units. H̄ is ``hb_smem`` (its barrier
    ``hb_bar``), or with HB_RING (three query blocks, D = 2·BS) the ring entry after the tail: rows
    0..BS-1 in its K slot, BS..D-1 in its V slot. ``PW_BF16``: the first-order product's power of
    two for bfloat16 too (the low-precision kernel's ``int8-fp8`` keeps it: without, ptxas
    spilled in its exact loop)."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q16_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    s_zero = gl.zeros([BS, BS], gl.float32, layout=s_layout)
    l_tail = gl.zeros([BS], gl.float32, layout=row_s)
    if MODE > 0:
        bound = _tail_bound(q_s, kbound_ptr, bhk, qk_scale, BS, D, LOG2_BS, row_s)
        # q in float16 scaled by a power of two so its largest entry sits in [2^13, 2^14): the
        # bf16 -> fp16 conversion is then exact whatever the magnitude (centroids are scaled alike).
        # q is read from shared memory again: a register copy kept for this through the exact loop
        # made ptxas 12.8 spill Q there with three consumers (every Q·Kᵀ product then serialised).
        qa = q_s.load(q16_layout)
        # the largest |q| in the input dtype (exact), so that q is converted once, element by element
        qmax = gl.max(gl.max(gl.abs(qa), axis=1), axis=0).to(gl.float32)
        q_sc = gl.where(qmax > 0, gl.exp2(gl.ceil(gl.log2(qmax)) - 14.0), 1.0)
        q16 = (qa.to(gl.float32) * (1.0 / q_sc)).to(gl.float16)
        if NC == 3:
            # At 160 registers a consumer, the tail's products read this float16 copy from the
            # (dead) query tile, and so does the first-order term: no q16 beside a 64-column score
            # tile in registers (it fit beside 32-column tiles, which ran 1-2 % slower at 4K).
            q_s16 = _as_fp16(q_s)
            q_s16.store(q16)
            fence_async_shared()
            q16 = q_s16
        sc_scale = qk_scale * q_sc * gl.load(kscale_ptr + bhk)  # all scales: powers of 2
        brow = bits_ptr + row * NW
        # With a maximum fixed before the scan the tail needs no row maximum and no rescale per
        # group (tail loop about 270 SASS instructions against 430 with the online one, ptxas 12.8).
        m_fix, fixed = _fixed_max(m_i, bound, TAIL_HEADROOM, TAIL_SLACK)
        if EXACT_FX:
            if efix != 0:
                # m is the exact scores' bound, at or above every exact score but up to the exact
                # loop's slack above the row's maximum: the tail keeps it (no move further up)
                # when no tail weight can exceed 2^EXACT_TAIL_HEADROOM under it.
                m_fix = m_i
                fixed = gl.max(bound - m_i, axis=0) <= EXACT_TAIL_HEADROOM
        if fixed:
            rescale = gl.exp2(m_i - m_fix)
            acc = acc * gl.convert_layout(rescale, row_o)[:, None]
            l_i = l_i * rescale
            m_i, l_i, acc, l_tail = _tail_loop(q16, k_bufs, v_bufs, ready, empty, t, brow, NW, active, m_fix, l_i,
                                               acc, l_tail, s_zero, sc_scale, LK, NK, BS, C, STAGES, EVEN_K, LOG2_BS,
                                               s_layout, o_layout, p_layout, True, NC == 3)
        else:
            m_i, l_i, acc, l_tail = _tail_loop(q16, k_bufs, v_bufs, ready, empty, t, brow, NW, active, m_i, l_i,
                                               acc, l_tail, s_zero, sc_scale, LK, NK, BS, C, STAGES, EVEN_K, LOG2_BS,
                                               s_layout, o_layout, p_layout, False, NC == 3)

    if HB_RING:
        u_hb = t + (NK + C - 1) // C  # the entry after the centroid groups
        s_hb = u_hb % STAGES
        mbarrier.wait(ready.index(s_hb), (u_hb // STAGES) & 1)
    if active:
        if MODE == 0:  # keep-or-drop: a row given no exact block has l = 0 (out 0, lse -inf)
            out = acc / gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), row_o)[:, None]
        else:
            out = acc / gl.convert_layout(l_i, row_o)[:, None]
        if MODE == 2:
            # + (l_tail / l)·α·(s / BS)·q H̄, accumulated into the output (no [BS, D] temporary):
            # q·(α l_tail / l)·(s / BS) as the A operand. In float16 that operand is taken 2^e
            # larger (at most α|q|), above float16's subnormals, and the output scaled by the power
            # of two ``pw`` = 2^e ≈ BS / s around the product; bfloat16's exponent range needs no
            # such scaling, which saves two passes over the tile. Either way α = 0 is zeroth mode
            # bit for bit.
            PW: gl.constexpr = PW_BF16 or q_s.dtype == gl.float16
            # two spelled-out branches: the PW one is the code the GPU suite and the low-precision
            # builds checked (a shared factor changed every variant's PTX)
            # H̄ was stored divided by the head's power of two ``hs``: with PW it joins the output's
            # shift (pw / hs, a power of two), so the A operand keeps its magnitude
            hs = gl.load(hscale_ptr + bhk)
            if PW:
                w = gl.convert_layout(l_tail / l_i * (gl.load(alpha_ptr + h) * (scale / BS) * pw),
                                      gl.SliceLayout(1, p_layout))
                pwh = pw / hs
            else:
                w = gl.convert_layout(l_tail / l_i * (gl.load(alpha_ptr + h) * (scale / BS) * hs),
                                      gl.SliceLayout(1, p_layout))
            if HB_RING:
                # q back from its float16 copy, as below, in two halves of D against H̄'s row halves
                # (the same products in the same order as one K = D product)
                q_h = _as_fp16(q_s)
                qw = q_h.slice(0, BS, dim=1).load(p_layout).to(gl.float32) * (w * q_sc)[:, None]
                out = warpgroup_mma(qw.to(q_s.dtype), k_bufs.index(s_hb), out * pwh if PW else out, is_async=True)
                qw = q_h.slice(BS, BS, dim=1).load(p_layout).to(gl.float32) * (w * q_sc)[:, None]
                out = warpgroup_mma(qw.to(q_s.dtype), v_bufs.index(s_hb), out, is_async=True)
            else:
                mbarrier.wait(hb_bar.index(0), 0)
                if NC == 3:
                    # q back from its float16 copy (exact but for entries below 2^-28 of the row's
                    # largest, which fall into float16's subnormals)
                    qw = _as_fp16(q_s).load(p_layout).to(gl.float32) * (w * q_sc)[:, None]
                else:
                    qw = q_s.load(p_layout).to(gl.float32) * w[:, None]
                out = warpgroup_mma(qw.to(q_s.dtype), hb_smem, out * pwh if PW else out, is_async=True)
            out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))
            if PW:
                out = out * (1.0 / pwh)
        lse = (m_i + gl.log2(l_i)) * LN2
        rows = qi * BS + gl.arange(0, BS, layout=row_s)
        gl.store(lse_ptr + bh * LQ + rows, lse, mask=rows < LQ)
        # The query tile is dead now: its slot stages the output for one TMA store (rows past Lq
        # fall outside the descriptor and are clipped).
        q_s.store(out.to(q_s.dtype))
        fence_async_shared()
        _tma_store(o_desc, [b, h, qi * BS, 0], _box(q_s, o_desc))
        tma.store_wait(pendings=0)
    if HB_RING:
        mbarrier.arrive(empty.index(s_hb), count=1)


@gluon.jit
def _exact_scores(qa, k_slot, s_zero, code, cols, LK, BS: gl.constexpr, EVEN_K: gl.constexpr, NC: gl.constexpr):
    """Q·Kᵀ of one exact block (its K tile ``k_slot``; ``code``: key block << NC | owner bits), the
    columns past ``LK`` at -inf without EVEN_K."""
    sc = warpgroup_mma(qa, k_slot.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
    if not EVEN_K:
        sc = _mask_ragged(sc, code >> NC, cols, LK, BS)
    return sc


@gluon.jit
def _exact_step(qa, k_bufs, v_bufs, ready, empty, code, u, m_i, l_i, acc, s_zero, cols, qk_scale, LK,
                CID: gl.constexpr, BS: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, NC: gl.constexpr):
    """Stream entry ``u`` (``code``: key block << NC | owner bits) of the sequential exact loop:
    wait for its slot, and if this consumer owns it Q·Kᵀ, softmax, P·V; then release the slot.
    Without EVEN_K the columns past ``LK`` are masked."""
    s = u % STAGES
    mbarrier.wait(ready.index(s), (u // STAGES) & 1)
    if ((code >> CID) & 1) != 0:
        sc = _exact_scores(qa, k_bufs.index(s), s_zero, code, cols, LK, BS, EVEN_K, NC)
        m_i, l_i, acc, rescale, ps = _softmax_step(m_i, l_i, acc, sc, qk_scale, v_bufs.index(s), s_layout,
                                                   o_layout, p_layout)
    mbarrier.arrive(empty.index(s), count=1)
    return m_i, l_i, acc


@gluon.jit
def _exact_step_fx(qa, k_bufs, v_bufs, ready, empty, code, u, m_i, l_i, acc, fx, s_zero, cols, qk_scale, LK,
                   CID: gl.constexpr, BS: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
                   s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, NC: gl.constexpr,
                   SLACK: gl.constexpr):
    """:func:`_exact_step` under a maximum fixed once per consumer (``fx`` 1) at a per-row bound of
    every exact score, ``s·Σ_d |q_d|·max_n |k_nd|`` (base 2; ``kmax``: the per-channel maxima of
    the kv head's keys): no row maximum, no rescale of ``acc``. Until the first owned block
    (``fx`` 0) ``m_i`` holds that bound (no other register carries it through the loop); the first
    owned block's maximum, a lower bound of the row's, decides: if the bound is at most ``SLACK``
    above it in every row, it stays the maximum (``fx`` 1), else the online maximum takes over from
    that block on (``fx`` 2)."""
    s = u % STAGES
    mbarrier.wait(ready.index(s), (u // STAGES) & 1)
    if ((code >> CID) & 1) != 0:
        sc = _exact_scores(qa, k_bufs.index(s), s_zero, code, cols, LK, BS, EVEN_K, NC)
        if fx == 0:
            m_blk = gl.max(sc, axis=1) * qk_scale
            gap = gl.where(m_blk == float("-inf"), float("inf"), m_i - m_blk)
            if gl.max(gap, axis=0) <= SLACK:
                fx = fx * 0 + 1
            else:
                fx = fx * 0 + 2
                m_i = gl.full([BS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        if fx == 1:
            p = gl.exp2(sc * qk_scale - m_i[:, None])
            l_i = l_i + gl.sum(p, axis=1)
            pv = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
            acc = warpgroup_mma(pv, v_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            m_i, l_i, acc, rescale, ps = _softmax_step(m_i, l_i, acc, sc, qk_scale, v_bufs.index(s), s_layout,
                                                       o_layout, p_layout)
    mbarrier.arrive(empty.index(s), count=1)
    return m_i, l_i, acc, fx


@gluon.jit
def _consumer(o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, kmax_ptr, alpha_ptr,
              q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
              uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, NW, b, h, bhk, bh, LQ, LK, NQ, NK,
              qk_scale, scale, pw,
              CID: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, C: gl.constexpr,
              STAGES: gl.constexpr, MODE: gl.constexpr, EVEN_K: gl.constexpr, LOG2_BS: gl.constexpr,
              Q_REG: gl.constexpr, HAS_QPAIR: gl.constexpr, PIPELINE: gl.constexpr,
              CODES: gl.constexpr, NCH: gl.constexpr, CW: gl.constexpr, NC: gl.constexpr,
              TAIL_SLACK: gl.constexpr, HB_RING: gl.constexpr, EXACT_SLACK: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q16_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    qi = _query_block(qpair_ptr, pair_row, pair, CID, HAS_QPAIR, NC)
    active = qi < NQ  # a lone block's partner is Nq: its consumer only releases the slots
    row = bh * NQ + qi
    q_s = q_smem.index(CID)
    mbarrier.wait(q_bar.index(CID), 0)
    # Q·Kᵀ with Q in registers reads only K from shared memory (with Q there too, a 64-row
    # product moves as many shared-memory bytes as the tensor cores can consume).
    if Q_REG:
        qa = q_s.load(q16_layout)
    else:
        qa = q_s

    m_i = gl.full([BS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BS], gl.float32, layout=row_s)
    acc = gl.zeros([BS, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BS, BS], gl.float32, layout=s_layout)
    cols = gl.arange(0, BS, layout=col_s)

    n_union = gl.load(ucnt_ptr + pair_row)
    ubase = uidx_ptr + pair_row.to(gl.int64) * W2  # the stream may pass 2**31 entries (B·H = 64 at 1M tokens)
    CODE_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    codes = _codes_view(codes_smem, NCH, CW)
    if CODES:
        mbarrier.wait(code_bar.index(0), 0)
    if PIPELINE:
        m_i, l_i, acc = _exact_pipelined(qa, k_bufs, v_bufs, ready, empty, codes, ubase, n_union,
                                         m_i, l_i, acc, s_zero, cols, qk_scale, LK, CID, BS, STAGES, EVEN_K, s_layout,
                                         o_layout, p_layout, CODES, NCH * CW, CODE_L, NC)
    else:
        # The reference loop: Q·Kᵀ, wait, softmax, P·V, wait, one block after the other. Three
        # query blocks stream the union in ascending order, so a ragged last key block can only
        # be the last entry: it is masked after the loop (PEEL), and the loop masks nothing.
        PEEL: gl.constexpr = NC == 3 and not EVEN_K
        n_loop = n_union - 1 if PEEL else n_union
        code_next = _stream_code(codes, ubase, n_union, 0, CODES, NCH * CW, CODE_L)
        if EXACT_SLACK >= 0:
            fx = n_union * 0
            m_i = _tail_bound(q_s, kmax_ptr, bhk, qk_scale, BS, D, 0.0, row_s)
            for u in range(n_loop):
                code = code_next
                code_next = _stream_code(codes, ubase, n_union, u + 1, CODES, NCH * CW, CODE_L)
                m_i, l_i, acc, fx = _exact_step_fx(qa, k_bufs, v_bufs, ready, empty, code, u, m_i, l_i, acc, fx,
                                                   s_zero, cols, qk_scale, LK, CID, BS, STAGES, EVEN_K or PEEL,
                                                   s_layout, o_layout, p_layout, NC, EXACT_SLACK)
            if PEEL:
                if n_union > 0:
                    m_i, l_i, acc, fx = _exact_step_fx(qa, k_bufs, v_bufs, ready, empty, code_next, n_loop, m_i,
                                                       l_i, acc, fx, s_zero, cols, qk_scale, LK, CID, BS, STAGES,
                                                       False, s_layout, o_layout, p_layout, NC, EXACT_SLACK)
        else:
            for u in range(n_loop):
                code = code_next
                code_next = _stream_code(codes, ubase, n_union, u + 1, CODES, NCH * CW, CODE_L)
                m_i, l_i, acc = _exact_step(qa, k_bufs, v_bufs, ready, empty, code, u, m_i, l_i, acc, s_zero, cols,
                                            qk_scale, LK, CID, BS, STAGES, EVEN_K or PEEL, s_layout, o_layout,
                                            p_layout, NC)
            if PEEL:
                if n_union > 0:
                    m_i, l_i, acc = _exact_step(qa, k_bufs, v_bufs, ready, empty, code_next, n_loop, m_i, l_i, acc,
                                                s_zero, cols, qk_scale, LK, CID, BS, STAGES, False, s_layout,
                                                o_layout, p_layout, NC)
    if EXACT_SLACK >= 0:
        efix = (fx == 1).to(gl.int32)
        if fx == 0:
            # no owned exact block (a ring shard's row, a given selection): m_i still holds the
            # scores' bound, which may sit far above the tail's scores (every weight 0); the tail
            # starts from nothing, as the online loop would
            m_i = gl.full([BS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    else:
        efix = 0
    _finish(q_s, k_bufs, v_bufs, ready, empty, n_union, hb_smem, hb_bar, o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr,
            kbound_ptr, alpha_ptr, m_i, l_i, acc, active, row, qi, NW, b, h, bhk, bh, LQ, LK, NK, qk_scale, scale, pw,
            BS, D, C, STAGES, MODE, EVEN_K, LOG2_BS, NC, TAIL_SLACK, s_layout, o_layout, p_layout, HB_RING,
            efix, EXACT_SLACK >= 0, False)


@gluon.jit
def await_prior_grid(PDL: gl.constexpr):
    """The kernel's first statement (before its partitions start, so every one of them is behind
    it): with ``PDL`` ≥ 1 (launched as a programmatic dependent of the chain's last kernel) wait
    until that kernel has finished and its writes are visible. Gluon has no builtin for it."""
    if PDL >= 1:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit(do_not_specialize=["H", "HK", "LQ", "LK", "NQ", "NK", "W2", "NW"])
def _pair_attn_kernel(
    q_desc, k_desc, v_desc, o_desc, kb_desc, vb_desc, hb_desc, cd_desc,
    kscale_ptr, hscale_ptr, kbound_ptr, kmax_ptr, uidx_ptr, ucnt_ptr, qpair_ptr, bits_ptr, lse_ptr, alpha_ptr,
    H, HK, LQ, LK, NQ, NK, W2, NW,
    qk_scale, scale, pw,
    BS: gl.constexpr, D: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
    EVEN_K: gl.constexpr, LOG2_BS: gl.constexpr, Q_REG: gl.constexpr, HAS_QPAIR: gl.constexpr,
    PIPELINE: gl.constexpr, CODES: gl.constexpr, NCH: gl.constexpr, CW: gl.constexpr, NC: gl.constexpr,
    TAIL_SLACK: gl.constexpr, HB_RING: gl.constexpr, EXACT_SLACK: gl.constexpr, PDL: gl.constexpr = 0,
):
    # One CTA per group of NC query blocks (a pair, or three adjacent blocks: NC consumers).
    await_prior_grid(PDL)
    pair = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // (H // HK)
    bhk = b * HK + hk
    pair_row = bh * ((NQ + NC - 1) // NC) + pair
    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BS, D], dtype)

    q_smem = gl.allocate_shared_memory(dtype, [NC, BS, D], tile_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BS, D], tile_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BS, D], tile_layout)
    if MODE == 2 and not HB_RING:
        hb_smem = gl.allocate_shared_memory(dtype, [D, D], gl.NVMMASharedLayout.get_default_for([D, D], dtype))
    else:
        hb_smem = gl.allocate_shared_memory(dtype, [16, D], gl.NVMMASharedLayout.get_default_for([16, D], dtype))
    # The group's stream codes (CODES: copied once by TMA; read by the loader and every consumer).
    codes_smem = gl.allocate_shared_memory(gl.int32, [NCH, 1, CW], cd_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    hb_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    code_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(NC):
        mbarrier.init(q_bar.index(c), count=1)
    mbarrier.init(hb_bar.index(0), count=1)
    mbarrier.init(code_bar.index(0), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NC)  # every consumer releases every slot

    # Registers: 240 a consumer for two (168 each at launch), 160 for three (128 at launch).
    if NC == 2:
        gl.warp_specialize([
            (_loader, (q_desc, k_desc, v_desc, kb_desc, vb_desc, hb_desc, cd_desc,
                       q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
                       uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, b, h, hk, bhk, NK,
                       BS, C, STAGES, MODE, HAS_QPAIR, CODES, NCH, CW, NC, HB_RING)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, kmax_ptr, alpha_ptr,
                         q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
                         uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, NW, b, h, bhk, bh, LQ, LK, NQ, NK,
                         qk_scale, scale, pw, 0, BS, D, C, STAGES, MODE, EVEN_K, LOG2_BS, Q_REG, HAS_QPAIR,
                         PIPELINE, CODES, NCH, CW, NC, TAIL_SLACK, HB_RING, EXACT_SLACK)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, kmax_ptr, alpha_ptr,
                         q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
                         uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, NW, b, h, bhk, bh, LQ, LK, NQ, NK,
                         qk_scale, scale, pw, 1, BS, D, C, STAGES, MODE, EVEN_K, LOG2_BS, Q_REG, HAS_QPAIR,
                         PIPELINE, CODES, NCH, CW, NC, TAIL_SLACK, HB_RING, EXACT_SLACK)),
        ], [4, 4], [240, 240])
    else:
        gl.warp_specialize([
            (_loader, (q_desc, k_desc, v_desc, kb_desc, vb_desc, hb_desc, cd_desc,
                       q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
                       uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, b, h, hk, bhk, NK,
                       BS, C, STAGES, MODE, HAS_QPAIR, CODES, NCH, CW, NC, HB_RING)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, kmax_ptr, alpha_ptr,
                         q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
                         uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, NW, b, h, bhk, bh, LQ, LK, NQ, NK,
                         qk_scale, scale, pw, 0, BS, D, C, STAGES, MODE, EVEN_K, LOG2_BS, Q_REG, HAS_QPAIR,
                         PIPELINE, CODES, NCH, CW, NC, TAIL_SLACK, HB_RING, EXACT_SLACK)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, kmax_ptr, alpha_ptr,
                         q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
                         uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, NW, b, h, bhk, bh, LQ, LK, NQ, NK,
                         qk_scale, scale, pw, 1, BS, D, C, STAGES, MODE, EVEN_K, LOG2_BS, Q_REG, HAS_QPAIR,
                         PIPELINE, CODES, NCH, CW, NC, TAIL_SLACK, HB_RING, EXACT_SLACK)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, kmax_ptr, alpha_ptr,
                         q_smem, k_bufs, v_bufs, hb_smem, codes_smem, q_bar, hb_bar, code_bar, ready, empty,
                         uidx_ptr, ucnt_ptr, qpair_ptr, pair, pair_row, W2, NW, b, h, bhk, bh, LQ, LK, NQ, NK,
                         qk_scale, scale, pw, 2, BS, D, C, STAGES, MODE, EVEN_K, LOG2_BS, Q_REG, HAS_QPAIR,
                         PIPELINE, CODES, NCH, CW, NC, TAIL_SLACK, HB_RING, EXACT_SLACK)),
        ], [4, 4, 4], [160, 160, 160])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

# Ring depth per head dim: 3 slots of K+V (32 KB each at D=128) + two query tiles + H̄ fit one
# CTA per SM with room for the epilogue; D=64 halves every tile.
STAGES = {64: 4, 128: 3}
# 12 warps (loader warpgroup + two consumer warpgroups) share the register file: 168 each at
# launch, then the loader gives its registers to the consumers (240 each); with three consumers
# (16 warps) 128 at launch and 160 a consumer.
MAX_REGS = {2: 168, 3: 128}
# Query blocks a CTA serves, per mode: 2 (a pair; its partner adjacent or matched) or 3 (adjacent
# blocks, three consumer warpgroups at 160 registers, the union stream in ascending order). Three
# overlap more of the exact loop's latency: keep-or-drop up to 7 % faster at 8K-64K, hybrid 3-9 %
# faster at 32K-64K (the tail under its fixed maximum; H200,
# benchmarks/results/h200_query_group.json, h200_tail_fixed.json). A ragged Lk too, since only the
# tail group holding its last block weighs columns by log2 n_j, after the tail loop (no spills in
# the loops): hybrid attend 2-10 % and the whole call 3-8 % faster than pairs at 32K-75K
# (h200_ragged_groups.json). Ring depth for three per head dim: at D = 128 five slots, H̄ coming
# through the ring (:func:`hbar_in_ring`) so that hybrid fits them too; keep-or-drop with five
# against four was 1-2 % faster at 16K-64K in six rounds (H200, results/h200_stages3_drop.json).
QUERY_GROUP = {"drop": 3, "zeroth": 3, "hybrid": 3}
STAGES3 = {64: 4, 128: 5}


def hbar_in_ring(mode: str, query_group: int, head_dim: int, block_size: int) -> bool:
    """Whether H̄ comes to the consumers as the ring's last entry (its two row halves in a K and a V
    slot) instead of its own ``[D, D]`` tile, held from the start: three query blocks in the hybrid
    mode at D = 2·BS, where that tile's 32 KB is a fifth ring slot."""
    return mode == "hybrid" and query_group == 3 and head_dim == 2 * block_size


def query_group_for(mode: str, lk: int, block_size: int) -> int:
    """Query blocks per CTA the kernel uses by default for ``mode`` (any key length)."""
    del lk, block_size
    return QUERY_GROUP[mode]


# Query blocks are paired inside aligned groups of this many blocks by shared exact blocks
# (:func:`pisa_attn.ops.triton.pairs.pair_match`); 2 pairs adjacent blocks without a table. Adjacent:
# matching in groups of 4 or 8 raised the pair overlap on Gaussian inputs (0.13 -> 0.18) and DINOv2
# heads (0.20 -> 0.40 on layer 5), not on DiT-like ones (0.65), and was no faster at 32K/64K
# (H100, benchmarks/results/h100_exact_loop.json): the loop is not bound by L2 alone.
PAIR_GROUP = 2
# The stream order (``pairs.ORDERS``): "owners" keeps both consumers busy; "ascending" makes each
# block's arithmetic independent of its partner, and costs 2-5 % (same measurements).
PAIR_ORDER = "owners"
# The exact loop's schedule: True queues each owned block's Q·Kᵀ with the previous one's P·V and
# runs the softmax under that product (:func:`_exact_pipelined`); False is the sequential loop,
# the default: the pipelined loop measured 3-32 % slower on the H100 at 32K/64K (holding a slot one
# block longer starves the 3-slot ring; 4 slots: 3-15 % slower; benchmarks/results/h100_pipeline.json).
PIPELINE = False
# The pair's stream codes: copied into shared memory by one TMA per CTA (chunks of up to
# CODE_CHUNK codes, the TMA box limit; at most CODES_MAX_CHUNKS chunks, 8 KB), so that neither the
# loader nor the consumers load from global memory inside the loop; a longer stream (more than
# 2048 union entries) is read from global memory, one entry ahead, and so is a stream of fewer than
# 32 entries: a chunk is at least 32 codes (a TMA copy's shared-memory destination must be 128-byte
# aligned) and a TMA box no wider than the stream.
# Neutral to slightly faster on the H100 (no L1TEX-scoreboard stalls left; whole call 1-5 % faster
# in 7 of 8 cases at 32K/64K, within noise; benchmarks/results/h100_exact_loop_v2.json).
CODES = True
CODE_CHUNK = 256
CODES_MAX_CHUNKS = 8
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# The tail's maximum is fixed before the scan (no row maximum, no rescale per centroid group) when
# ``max(m, bound − 15)`` is at most this far above the exact blocks' maximum ``m`` in every row of
# the block (``bound``: :func:`tail_bound`, from the per-channel centroid maxima); else the online
# maximum. bfloat16 P keeps float32's exponent range, so 64 loses nothing; a float16 P weight
# below 2^-14 is subnormal, so float16 allows 4. Measured ``bound − m`` per block: a median of
# 7-24 on Gaussian, DiT-like and DINOv2 heads, all within 32 (notes/kernel-notes.md).
TAIL_SLACK = {torch.bfloat16: 64.0, torch.float16: 4.0}
TAIL_MAX = "auto"
# The exact loop's maximum is fixed at a per-row bound of every exact score, ``s·Σ_d |q_d|·kmax_d``
# (``kmax``: per-channel maxima of |k| over the kv head), when the bound is at most this far above
# the first owned block's maximum in every row; else the online maximum. A weight is then flushed
# to zero (below 2^-126) only if it is under 2^-36 of the row's largest: nothing a bfloat16 P
# keeps. Float16 P (subnormal below 2^-14) always takes the online maximum. Measured ``bound − m``
# per query block: 30-70 on Gaussian, DiT-like and DINOv2 heads (notes/kernel-notes.md).
EXACT_SLACK = {torch.bfloat16: 90.0, torch.float16: -1.0}
# "auto": the bound from EXACT_MIN_KEYS keys on (H100: the attend 3-14 % faster at 32K-64K, 64K
# Gaussian keep-or-drop unchanged; at 4K and 8K the whole call was 1-3 % slower with a tail),
# "bound": wherever it is tight enough, "online": never.
EXACT_MAX = "auto"
EXACT_MIN_KEYS = 16384
# The query tile as the A operand of Q·Kᵀ: held in registers (loaded once per CTA) or read from
# shared memory in every product; None: :func:`query_tile_in_registers`.
Q_REG = None


@functools.lru_cache(maxsize=8)
def _ptxas_major(env: tuple) -> int:
    del env  # the cache key: the tool Triton resolves from it
    from triton.backends.nvidia.compiler import get_ptxas

    return int(get_ptxas(90).version.split(".")[0])


def _ptxas13() -> bool:
    """Whether Triton builds sm_90 with CUDA 13's ptxas or later (asked once per setting of the
    variables that move Triton to another ptxas)."""
    env = os.environ
    return _ptxas_major((env.get("TRITON_PTXAS_PATH"), env.get("TRITON_PTXAS_BLACKWELL_PATH"))) >= 13


def query_tile_in_registers(query_group: int) -> bool:
    """Whether the consumers hold the query tile in registers (:data:`Q_REG`, None: by the ptxas
    that builds the kernel). Three consumers get 160 registers each: CUDA 12's ptxas fits the loops
    there with the tile in registers; CUDA 13's (Triton 3.9 uses 13.4 for sm_90) spills 59 values
    in the hybrid loops and 102 in keep-or-drop, and with the tile read from shared memory
    keep-or-drop spills none and the default hybrid attend ran 2-8 % faster (H100, 32K-64K; under
    Triton 3.6 within noise either way: notes/kernel-notes.md). Pairs (240 registers) keep it."""
    if Q_REG is not None:
        return bool(Q_REG)
    return query_group == 2 or not _ptxas13()


# Extra ptxas options per mode for three consumers under CUDA 13's ptxas (Triton 3.9 passes
# ``--regAllocOptLevel=2`` to it, a kernel's options come after). Keep-or-drop with
# ``--register-usage-level=0``: 11-14 % faster at 32K in two sessions, 8K and 64K within -1 to +4 %;
# hybrid 2-6 % slower at 32K with it, so none there (H100, notes/kernel-notes.md).
PTXAS13_OPTIONS = {"drop": "--register-usage-level=0"}


def ptxas_options(mode: str, query_group: int) -> str | None:
    """The extra ptxas options the kernel for ``mode`` and ``query_group`` is built with (None:
    none; only three consumers under CUDA 13's ptxas take :data:`PTXAS13_OPTIONS`)."""
    if query_group != 3 or mode not in PTXAS13_OPTIONS:
        return None
    return PTXAS13_OPTIONS[mode] if _ptxas13() else None


def _desc(x: Tensor, block: list[int]) -> TensorDescriptor:
    if x.dtype == torch.int32:  # the stream codes: unswizzled, read one code at a time
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    else:
        layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def code_chunks(w2: int, codes: bool) -> tuple[bool, int, int]:
    """(codes staged in shared memory, chunk width, chunks) for a stream of width ``w2``."""
    cw = min(CODE_CHUNK, 1 << (max(w2, 1).bit_length() - 1))  # a box no wider than the stream
    nch = -(-w2 // cw)
    if not codes or cw < 32 or nch > CODES_MAX_CHUNKS:
        return False, 32, 1  # a 128-byte buffer, never loaded
    return True, cw, nch


_launch = Launcher(_pair_attn_kernel)


def tma_unsupported_reason(*tensors: Tensor) -> str | None:
    """None when every tensor can be read through TMA (unit inner stride, 16-byte aligned base and
    outer strides), else why not."""
    for x in tensors:
        if x.stride(-1) != 1:
            return "the head dimension is not contiguous"
        if x.data_ptr() % 16:
            return "a tensor's base address is not 16-byte aligned"
        if any((s * x.element_size()) % 16 for s in x.stride()[:-1]):
            return "a stride is not a multiple of 16 bytes"
    return None


def attention(
    q: Tensor, k: Tensor, v: Tensor,
    kbar: Tensor, kscale: Tensor, vbar: Tensor, hbar: Tensor, hscale: Tensor,
    idx: Tensor, cnt: Tensor, bits: Tensor,
    *, mode: str, scale: float, block_size: int, n_select: int,
    out: Tensor | None = None, lse: Tensor | None = None, stages: int | None = None, q_reg: bool | None = None,
    alpha: Tensor | None = None, pairs: tuple[Tensor, Tensor, Tensor] | None = None,
    pair_group: int | None = None, pair_order: str | None = None, pipeline: bool | None = None,
    codes: bool | None = None, query_group: int | None = None, kbound: Tensor | None = None,
    tail_max: str | None = None, exact_max: str | None = None, kmax: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The pair kernel for a given selection; same contract as the Triton ``attention``:
    ``[B, H, L, D]`` views in (any TMA-compatible strides), (out, lse [B, H, Lq] fp32) out.
    The stream is built from ``bits`` (``idx`` only gives the list width); both kernels take one
    selection. ``alpha``: ``[H]`` float32 weights of the first-order term (None: 1). ``pairs``:
    (uidx, ucnt, qpair) buffers for the pair stream (:mod:`pisa_attn.ops.triton.pairs`).
    ``pair_group``: query blocks are paired by shared exact blocks inside aligned groups of this
    many (None: :data:`PAIR_GROUP`; 2: adjacent blocks); ``pair_order``: the stream order
    (``pairs.ORDERS``; None: :data:`PAIR_ORDER`). Neither changes the function computed; in the
    ``"ascending"`` order the pairing does not change a single bit of it. ``pipeline``: the exact
    loop's schedule (None: :data:`PIPELINE`); both compute the same function (the same operations
    in the same order per block). ``codes``: stage the stream codes in shared memory (None:
    :data:`CODES`); it does not change a bit of the result. ``query_group``: query blocks per CTA,
    2 or 3 (None: :func:`query_group_for`, or 2 when an option only pairs have is given); 3 takes
    adjacent blocks and its own stream order (each owner's blocks ascending: the same bits as pairs
    in the ``"ascending"`` order), neither a pairing table, another order nor the pipelined loop.
    ``kbound``: ``[B, Hk, D]`` float32 ``max_j |k̄_jd|`` (the statistics'; None: computed from
    ``kbar``). ``tail_max``: ``"auto"`` fixes the tail's maximum from that bound where it is tight
    enough (:data:`TAIL_SLACK`), ``"online"`` never does (None: :data:`TAIL_MAX`); both compute the
    same function. ``exact_max``: ``"bound"`` fixes the exact loop's maximum at the per-row bound
    from ``kmax`` (``[B, Hk, D]`` float32 per-channel maxima of ``|k|``; None: computed here) where
    it is tight enough (:data:`EXACT_SLACK`), ``"auto"`` does from :data:`EXACT_MIN_KEYS` keys on,
    ``"online"`` never does (None: :data:`EXACT_MAX`); the same function up to the rounding of P
    (the pipelined loop of pairs keeps the online maximum). ``q_reg``: hold the query tile in
    registers through the loops, or read it from shared memory in every product (None:
    :func:`query_tile_in_registers`); bit for bit the same function."""
    del cnt, n_select
    if pair_group is not None or pair_order is not None:  # benchmark options: named here, not as pair_match's
        if pair_group not in (None, 2, 4, 8):
            raise ValueError(f"pair_group must be 2, 4 or 8, got {pair_group!r}")
        if pair_order not in (None, *ORDERS):
            raise ValueError(f"pair_order must be one of {tuple(ORDERS)}, got {pair_order!r}")
    slack = tail_slack(tail_max, kbound, q, k.shape[1])
    pair_only = (pair_group or 2) > 2 or bool(pipeline) or pair_order not in (None, "ascending")
    if query_group is None:  # the mode's default, unless an option only pairs have is asked for
        nc = 2 if pair_only else query_group_for(mode, k.shape[2], block_size)
    else:
        nc = query_group
    if nc not in (2, 3):
        raise ValueError(f"query_group must be 2 or 3, got {query_group!r}")
    if nc == 3 and pair_only:
        raise ValueError("query_group=3 serves adjacent blocks in ascending stream order with the sequential "
                         f"loop: pair_group={pair_group!r}, pair_order={pair_order!r}, pipeline={pipeline!r}")
    q_reg = query_tile_in_registers(nc) if q_reg is None else bool(q_reg)
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    bs = block_size
    nq, nk = -(-lq // bs), -(-lk // bs)
    out, lse = out_buffers(q, out, lse, (q.dtype,))  # the tile is stored in q's dtype through TMA
    group = PAIR_GROUP if pair_group is None else pair_group
    qpair = None
    # The workspace's buffers serve when they have this launch's shapes (a plan sizes them for its
    # mode's query group); else the stream is built in fresh ones.
    width = (triple_width if nc == 3 else union_width)(nk, idx.shape[-1])
    if pairs is not None and pairs[0].shape[-2:] != (-(-nq // nc), width):
        pairs = None
    if nc == 3:
        uidx, ucnt = triple_union(bits, nk, idx.shape[-1], out=None if pairs is None else pairs[:2])
    else:
        if group > 2 and nq > 2:
            qpair = pair_match(bits, group, out=None if pairs is None else pairs[2])
        uidx, ucnt = pair_union(bits, nk, idx.shape[-1], qpair=qpair, out=None if pairs is None else pairs[:2],
                                order=PAIR_ORDER if pair_order is None else pair_order)
    has_qpair = qpair is not None
    alpha = alpha_arg(alpha, h, q.device)
    if kbound is None:
        kbound = tail_bound(kbar, kscale)
    m = MODE_IDS[mode]
    st = stages or (STAGES if nc == 2 else STAGES3)[d]
    pipe = nc == 2 and (PIPELINE if pipeline is None else bool(pipeline))
    exact_slack = exact_max_slack(exact_max, kmax, q, hk, pipe, lk)
    if exact_slack >= 0 and kmax is None:
        kmax = k.abs().amax(2).float()
    w2 = uidx.shape[-1]
    use_codes, cw, nch = code_chunks(w2, CODES if codes is None else bool(codes))
    hb_ring = hbar_in_ring(mode, nc, d, bs)
    pdl = grid_dependency(q.device)
    tensors = (q, k, v, out, kbar.view(b * hk, nk, d), vbar.view(b * hk, nk, d), hbar.view(b * hk, d, d),
               uidx.view(-1, w2))
    blocks = ([1, 1, bs, d],) * 4 + ([1, bs, d], [1, bs, d], [1, bs if hb_ring else d, d], [1, cw])
    scalars = (kscale, hscale, kbound, kbound if kmax is None else kmax, uidx, ucnt, qpair if has_qpair else ucnt, bits, lse,
               alpha, h, hk, lq, lk, nq, nk,
               uidx.shape[-1], bits.shape[-1], scale * LOG2E, scale, first_order_shift(bs, scale))
    constexprs = dict(BS=bs, D=d, C=bs, STAGES=st, MODE=m, EVEN_K=lk % bs == 0, LOG2_BS=math.log2(bs), Q_REG=q_reg,
                      HAS_QPAIR=has_qpair, PIPELINE=pipe, CODES=use_codes, NCH=nch, CW=cw, NC=nc,
                      TAIL_SLACK=slack, HB_RING=hb_ring, EXACT_SLACK=exact_slack, PDL=pdl)
    popt = ptxas_options(mode, nc)
    key = (q.dtype, d, bs, st, m, lk % bs == 0, q_reg, has_qpair, pipe, use_codes, nch, cw, nc, slack, exact_slack,
           popt, pdl, tuple(x.data_ptr() % 16 == 0 for x in scalars[:10]))
    descs = tuple(Desc(x, list(x.shape), list(x.stride())) for x in tensors)
    full = None if _launch.cached(key, descs + scalars) else tuple(_desc(x, blk) for x, blk in zip(tensors, blocks))
    _launch(key, (-(-nq // nc), b * h), descs + scalars, constexprs,
            full_args=None if full is None else full + scalars, num_warps=4, maxnreg=MAX_REGS[nc],
            launch_pdl=pdl > 0, **({} if popt is None else dict(ptx_options=popt)))
    return out, lse


def tail_slack(tail_max: str | None, kbound: Tensor | None, q: Tensor, hk: int) -> float:
    """The kernels' ``TAIL_SLACK`` for ``tail_max`` (None: :data:`TAIL_MAX`; -1: the online
    maximum), after checking it and ``kbound`` (a contiguous float32 ``[B, Hk, D]``, or None)."""
    tail_max = TAIL_MAX if tail_max is None else tail_max
    if tail_max not in ("auto", "online"):
        raise ValueError(f"tail_max must be 'auto' or 'online', got {tail_max!r}")
    b, d = q.shape[0], q.shape[-1]
    if kbound is not None and (kbound.shape != (b, hk, d) or kbound.dtype != torch.float32
                               or not kbound.is_contiguous()):
        raise ValueError(f"kbound must be a contiguous float32 [B, Hk, D] = [{b}, {hk}, {d}] tensor, got "
                         f"{kbound.dtype} {list(kbound.shape)}")
    return TAIL_SLACK[q.dtype] if tail_max == "auto" else -1.0


def exact_mode(exact_max: str | None, lk: int) -> str:
    """``"bound"`` or ``"online"``: the exact loop ``exact_max`` (None: :data:`EXACT_MAX`) asks for
    with ``lk`` keys (``"auto"``: the bound from :data:`EXACT_MIN_KEYS` keys on)."""
    exact_max = EXACT_MAX if exact_max is None else exact_max
    if exact_max not in ("auto", "bound", "online"):
        raise ValueError(f"exact_max must be 'auto', 'bound' or 'online', got {exact_max!r}")
    if exact_max == "auto":
        return "bound" if lk >= EXACT_MIN_KEYS else "online"
    return exact_max


def uses_kmax(dtype: torch.dtype, lk: int) -> bool:
    """Whether the kernel's default exact loop (:data:`EXACT_MAX`) reads the keys' maxima for
    ``lk`` keys of ``dtype`` (prepare then writes them)."""
    return EXACT_SLACK.get(dtype, -1.0) >= 0 and exact_mode(None, lk) == "bound"


def exact_max_slack(exact_max: str | None, kmax: Tensor | None, q: Tensor, hk: int, pipeline: bool,
                    lk: int) -> float:
    """The kernel's ``EXACT_SLACK`` for ``exact_max`` (:func:`exact_mode`) and ``lk`` keys (-1: the
    online maximum), after checking it and ``kmax`` (a contiguous float32 ``[B, Hk, D]``, or
    None)."""
    mode = exact_mode(exact_max, lk)
    b, d = q.shape[0], q.shape[-1]
    if kmax is not None and (kmax.shape != (b, hk, d) or kmax.dtype != torch.float32 or not kmax.is_contiguous()):
        raise ValueError(f"kmax must be a contiguous float32 [B, Hk, D] = [{b}, {hk}, {d}] tensor, got "
                         f"{kmax.dtype} {list(kmax.shape)}")
    if mode == "online" or pipeline:  # the pipelined loop keeps the online maximum
        return -1.0
    return EXACT_SLACK[q.dtype]


def first_order_shift(block_size: int, scale: float) -> float:
    """The power of two near ``block_size / scale`` the output is scaled by around the first-order
    product (so its A operand stays near q in magnitude)."""
    return 2.0 ** min(max(math.floor(math.log2(block_size / scale)), -60), 60)


def tail_bound(kbar: Tensor, kscale: Tensor) -> Tensor:
    """``[B, Hk, D]`` float32 per-channel maxima ``max_j |k̄_jd|`` of the float16 centroids ``kbar``
    ``[B, Hk, Nk, D]`` times their per-head scale ``kscale`` ``[B, Hk]`` (what prepare writes as
    ``kbound``)."""
    return kbar.abs().amax(2).float() * kscale.float()[..., None]


def compile_for_sm90(head_dim: int = 128, mode: str = "hybrid", even_k: bool = True,
                     dtype: torch.dtype = torch.bfloat16, stages: int | None = None, q_reg: bool | None = None,
                     has_qpair: bool = True, pipeline: bool | None = None, codes: bool | None = None,
                     union_entries: int = 128, query_group: int = 2, tail_max: str = "auto",
                     exact_max: str | None = None):
    """Compile the pair kernel for sm_90a without a GPU (Triton ships ``ptxas``): what a CPU CI
    runs so that a kernel that does not build fails there. Returns Triton's compiled kernel
    (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    d, bs = head_dim, 64
    x = torch.empty(1, 1, bs, d, dtype=dtype)  # only shapes, strides and dtypes are read
    c = torch.empty(1, bs, d, dtype=torch.float16)
    descs = dict(q_desc=_desc(x, [1, 1, bs, d]), k_desc=_desc(x, [1, 1, bs, d]), v_desc=_desc(x, [1, 1, bs, d]),
                 o_desc=_desc(x, [1, 1, bs, d]), kb_desc=_desc(c, [1, bs, d]),
                 vb_desc=_desc(torch.empty(1, bs, d, dtype=dtype), [1, bs, d]),
                 hb_desc=_desc(torch.empty(1, d, d, dtype=dtype),
                               [1, bs if hbar_in_ring(mode, query_group, d, bs) else d, d]))
    use_codes, cw, nch = code_chunks(union_entries, CODES if codes is None else bool(codes))
    descs["cd_desc"] = _desc(torch.empty(1, union_entries, dtype=torch.int32), [1, cw])
    constexprs = dict(BS=bs, D=d, C=bs, STAGES=stages or (STAGES if query_group == 2 else STAGES3)[d], MODE=MODE_IDS[mode], EVEN_K=even_k,
                      LOG2_BS=math.log2(bs), Q_REG=query_tile_in_registers(query_group) if q_reg is None else q_reg,
                      HAS_QPAIR=has_qpair,
                      PIPELINE=PIPELINE if pipeline is None else bool(pipeline), CODES=use_codes, NCH=nch, CW=cw,
                      NC=query_group, TAIL_SLACK=TAIL_SLACK[dtype] if tail_max == "auto" else -1.0,
                      HB_RING=hbar_in_ring(mode, query_group, d, bs),
                      EXACT_SLACK=exact_max_slack("bound" if exact_max is None else exact_max, None, x, 1,
                                                  query_group == 2 and (
                                                      PIPELINE if pipeline is None else bool(pipeline)), 0),
                      PDL=grid_level())
    types = dict(kscale_ptr="*fp32", hscale_ptr="*fp32", kbound_ptr="*fp32", kmax_ptr="*fp32", uidx_ptr="*i32", ucnt_ptr="*i32", qpair_ptr="*i32", bits_ptr="*i32",
                 lse_ptr="*fp32",
                 alpha_ptr="*fp32", qk_scale="fp32", scale="fp32", pw="fp32")
    sig = {}
    for name in _pair_attn_kernel.arg_names:
        sig[name] = ("constexpr" if name in constexprs else mangle_type(descs[name]) if name in descs
                     else types.get(name, "i32"))
    src = GluonASTSource(fn=_pair_attn_kernel, signature=sig, constexprs=constexprs)
    popt = ptxas_options(mode, query_group)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=4, maxnreg=MAX_REGS[query_group], **({} if popt is None else dict(ptx_options=popt))))
