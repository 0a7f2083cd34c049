"""The Hopper pair kernel with its exact blocks in low precision (Gluon, sm_90a).

Same structure as :mod:`.attention` (a loader partition streaming through TMA, one consumer
warpgroup per 64-row query block of a pair or of three adjacent blocks (:data:`QUERY_GROUP`), one
online softmax in base 2, the same streams ``(uidx, ucnt)`` from
:func:`pisa_attn.ops.triton.pairs.pair_union` / ``triple_union``), with the exact phase's
products on 8-bit tensor cores (twice the bf16 rate, half the bytes of every 8-bit tile). Three
constexprs pick the formats (:data:`pisa_attn.spec.PRODUCT_FORMATS`):

* ``Q·Kᵀ`` (``QK_INT8``: int8 x int8 -> int32, else e4m3 x e4m3 -> float32): the query tile is
  quantised in the consumer's registers (one scale per row: a power of two for e4m3, ``amax/127``
  for int8) and is the register A operand (``k_width = 4``; with three consumers it is stored to
  shared memory instead, 16 registers fewer); the keys are the pre-quantised
  smoothed ``k8`` ``[B, Hk, Lk', D]`` (the quantisation pass, :mod:`pisa_attn.ops.triton.quantize`);
  the scores are rescaled per row and per key block and the smoothing constant ``s·q_t·μ`` (one
  float per row, computed once from the unquantised ``q``) is added back.
* ``P·V`` (``PV8``: 8-bit values stored transposed ``[B, Hk, D, Lk']``, as an 8-bit wgmma B
  operand must be K-major): ``e4m3(256·p)`` in registers against e4m3 ``v8`` with one value
  scale per channel for the whole head, the accumulator multiplied by ``τ / 256`` once, after the
  exact blocks and before the tail adds to it; or (``PV_INT8``) the unsigned code
  ``round(255·p)``, p against the row's largest score in the block, against int8 ``v8`` with one
  scale per block and channel: the wgmma multiplies signed bytes, so the A operand is
  ``code − 128`` and the block's int32 sum gets ``128·Σ_n v8_n`` (the quantisation pass's code
  sums) back, exactly, before the block's scales and its factor ``exp2(b − m)`` multiply it.
  Without ``PV8``, ``256·p`` in the input dtype against ``v`` itself (the input kernel's
  operands; the 256 is exact). Either way one product per block is added to a float32
  accumulator. With P in the input dtype the loop's maximum may be fixed at the per-row bound of
  its scores (:data:`EXACT_MAX`, as the input kernel's exact loop: no row maximum, no rescale).

The centroid tail, the first-order term and the output store are the input-precision kernel's
(:func:`.attention._finish`: float16 centroid scores, bf16/fp16 ``P·V̂``, the tail's maximum fixed
from the per-channel bound where it is tight enough), on a ring of 16-bit slots (twice the size
of an 8-bit tile): its own, which the loader fills while the consumers still work on the exact
blocks, or (``TAIL_ALIAS``, three query blocks) laid over the exact ring once the exact blocks
are done with it (a centroid tile over two 8-bit key slots; a value tile over two 8-bit value
slots, or over one 16-bit value slot for P·V in the input dtype), so that the exact ring gets all
the room (H̄ then comes last through that ring, as in the input-precision kernel).
What is rounded where: :mod:`pisa_attn.ops.quant`.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...spec import PRODUCT_FORMATS
from ..kernel_constants import LOG2E, MODE_IDS
from ..launch import Desc, Launcher
from ..triton.attention import alpha_arg, out_buffers
from ..triton.grid import grid_dependency
from ..triton.grid import level as grid_level
from ..triton.pairs import pair_union, triple_union, triple_width, union_width
from .attention import (EXACT_SLACK, MAX_REGS, TAIL_SLACK, _box, _finish, _reinterpret, _thread_barrier, _tma_load,
                        await_prior_grid, exact_mode, first_order_shift, hbar_in_ring, tail_bound, tail_slack)

# The probabilities' factor: 256 for e4m3 and the input dtype, 255 for the unsigned INT8 codes.
P_SCALE = gl.constexpr(256.0)
P_SCALE_INT8 = gl.constexpr(255.0)
P_LOG2_INT8 = gl.constexpr(math.log2(255.0))
INT8_P_OFFSET = gl.constexpr(128)
# Integer <-> float32 by bit patterns instead of the conversion instructions (which share the
# quarter-rate pipe with exp2): for |t| < 2^22 the float 1.5·2^23 + t is exact, its bits are
# MAGIC_BITS + t, and float addition of MAGIC rounds to the nearest integer (ties to even).
MAGIC = gl.constexpr(12582912.0)
MAGIC_BITS = gl.constexpr(0x4B400000)


@gluon.jit
def _pow2_scale_inv(amax):
    """1 / ``2^(floor(log2 amax) − 7)`` from the exponent bits (``2^126`` for 0 or tiny), exact."""
    e = ((amax.to(gl.int32, bitcast=True) >> 23) & 255) - 127 - 7
    e = gl.where(amax > 0, gl.maximum(e, -126), -126)
    return ((127 - e) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _qk_issue(q8, k_slot, zero, QK_INT8: gl.constexpr, D: gl.constexpr):
    """One exact block's quantised Q·Kᵀ, issued (int32 or float32 accumulator)."""
    if QK_INT8:
        return warpgroup_mma(q8, k_slot.permute((1, 0)), zero, use_acc=False, is_async=True)
    else:
        return warpgroup_mma(q8, k_slot.permute((1, 0)), zero, use_acc=False, is_async=True,
                             max_num_imprecise_acc=D)


@gluon.jit
def _qk_raw(sc, num_outstanding: gl.constexpr, QK_INT8: gl.constexpr):
    """The issued Q·Kᵀ's raw scores in float32 (int32 sums, |·| <= D·127² < 2^22 for D <= 128: exact
    through the bit pattern)."""
    raw = warpgroup_mma_wait(num_outstanding=num_outstanding, deps=(sc,))
    if QK_INT8:
        raw = (raw + MAGIC_BITS).to(gl.float32, bitcast=True) - MAGIC
    return raw


@gluon.jit
def _pv_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, PV8: gl.constexpr, PV_INT8: gl.constexpr = False):
    """The scaled probabilities as P·V's register A operand: e4m3(256·p), the signed INT8 code
    ``round(255·p) − 128``, or 256·p in the input dtype. The INT8 code is the low byte of
    ``p + MAGIC``'s bits (0 <= p <= 255), its top bit flipped: ``c − 128`` in two's complement."""
    if PV8:
        if PV_INT8:
            bits = (p + MAGIC).to(gl.int32, bitcast=True)
            return gl.convert_layout((bits ^ INT8_P_OFFSET).to(gl.int8), p_layout)
        else:
            return gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _pv_issue(pa, v_slot, acc, PV8: gl.constexpr, BS: gl.constexpr, USE_ACC: gl.constexpr = False,
              PV_INT8: gl.constexpr = False):
    """One exact block's P·V, issued (from zero, or into ``acc`` with ``USE_ACC``): against the
    transposed 8-bit tile or ``v``'s own."""
    if PV8:
        if PV_INT8:
            return warpgroup_mma(pa, v_slot.permute((1, 0)), acc, use_acc=USE_ACC, is_async=True)
        else:
            return warpgroup_mma(pa, v_slot.permute((1, 0)), acc, use_acc=USE_ACC, is_async=True,
                                 max_num_imprecise_acc=BS)
    else:
        return warpgroup_mma(pa, v_slot, acc, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _pv_flush(pa, v_slot, acc, zero, PV8: gl.constexpr, BS: gl.constexpr, PV_ACC: gl.constexpr):
    """A held block's P·V added to ``acc`` at once (into it in the wgmma with ``PV_ACC``)."""
    if PV_ACC:
        acc = _pv_issue(pa, v_slot, acc, PV8, BS, True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        pv = _pv_issue(pa, v_slot, zero, PV8, BS)
        acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    return acc


@gluon.jit
def _pv_halves(ph, v_slot, acc_lo, acc_hi, rescale, BS: gl.constexpr, D: gl.constexpr):
    """One block's e4m3 P·V from zero in two halves of D (``v_slot``: the ``[D, BS]`` transposed
    tile), each added to its half of the rescaled accumulator: the sums of one ``[64, D]`` product
    in half its registers."""
    pv = _pv_issue(ph, v_slot.slice(0, D // 2, dim=0), gl.zeros_like(acc_lo), True, BS)
    acc_lo = acc_lo * rescale[:, None] + warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    pv = _pv_issue(ph, v_slot.slice(D // 2, D // 2, dim=0), gl.zeros_like(acc_hi), True, BS)
    acc_hi = acc_hi * rescale[:, None] + warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    return acc_lo, acc_hi


@gluon.jit
def _exact_softmax(raw, a, m_i, l_i, j, LK, cols8, BS: gl.constexpr, EVEN_K: gl.constexpr,
                   P_LOG2: gl.constexpr = 8.0, BLOCK_MAX: gl.constexpr = False):
    """One exact block's raw 8-bit scores into the running (m, l): (m, l, rescale, F·p, f).

    Scores S = raw·a + s·q·μ (base 2) with a = ρ_t σ_j s ≥ 0. The row's constant s·q·μ cancels
    in every exponent of the exact blocks, so the running maximum ``m`` here leaves it out (the
    caller adds it after the loop, before the tail continues in the frame of S): max = max(raw)·a,
    and the scaling and the probabilities' factor F = 2^P_LOG2 (256, or 255 for INT8 codes) are
    one FMA in the exponent: F·p = exp2(raw·a + (P_LOG2 − r)), r the new running maximum m,
    f = 1. With ``BLOCK_MAX`` r is the row's largest score in this block instead (the INT8 codes'
    reference) and f = exp2(r − m) ≤ 1 weighs the block's product and its share of ``l`` (in
    units of F). Columns past ``LK`` are masked after the scaling: ``a`` is 0 for an all-zero
    query row, where −inf·0 would be NaN."""
    if EVEN_K:
        b_new = gl.max(raw, axis=1) * a
    else:
        x = gl.where((j * BS + cols8 < LK)[None, :], raw * a[:, None], float("-inf"))
        b_new = gl.max(x, axis=1)
    m_new = gl.maximum(m_i, b_new)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = gl.exp2(m_i - m_use)
    if BLOCK_MAX:
        r = gl.where(b_new == float("-inf"), m_use, b_new)
        f = gl.exp2(r - m_use)
    else:
        r = m_use
        f = rescale  # unused
    if EVEN_K:
        p = gl.exp2(raw * a[:, None] + (P_LOG2 - r)[:, None])
    else:
        p = gl.exp2(x + (P_LOG2 - r)[:, None])
    if BLOCK_MAX:
        l_i = l_i * rescale + gl.sum(p, axis=1) * f
    else:
        l_i = l_i * rescale + gl.sum(p, axis=1)
    return m_new, l_i, rescale, p, f


@gluon.jit
def _exact_fx(raw, a, m_i, l_i, acc, fx, v_slot, j, LK, cols8, dtype: gl.constexpr, p8_layout: gl.constexpr,
              o8_layout: gl.constexpr, row8: gl.constexpr, BS: gl.constexpr, EVEN_K: gl.constexpr,
              P_LOG2: gl.constexpr, SLACK: gl.constexpr):
    """One exact block with P in the input dtype under a maximum fixed at the per-row bound of the
    scores (``fx`` 1: no row maximum, no rescale; P·V into ``acc`` in the wgmma), as the
    input-precision kernel's :func:`.attention._exact_step_fx`: until the first owned block
    (``fx`` 0) ``m_i`` holds the bound, and that block's maximum decides whether it stays (bound at
    most ``SLACK`` above it in every row) or the online maximum takes over (``fx`` 2) from this
    block on, computed as the online loop computes it (the same bits). Scores ``raw·a`` as
    :func:`_exact_softmax` (the row's s·q·μ left out)."""
    if not EVEN_K:  # the columns past LK at -inf (after the scaling, as :func:`_exact_softmax`)
        x = gl.where((j * BS + cols8 < LK)[None, :], raw * a[:, None], float("-inf"))
    if fx == 0:
        if EVEN_K:
            m_blk = gl.max(raw, axis=1) * a
        else:
            m_blk = gl.max(x, axis=1)
        gap = gl.where(m_blk == float("-inf"), float("inf"), m_i - m_blk)
        if gl.max(gap, axis=0) <= SLACK:
            fx = fx * 0 + 1
        else:
            fx = fx * 0 + 2
            m_i = gl.full([BS], float("-inf"), gl.float32, layout=row8)
    if fx == 1:
        if EVEN_K:  # one product per score, fused into the exponent's add
            p = gl.exp2(raw * a[:, None] + (P_LOG2 - m_i)[:, None])
        else:
            p = gl.exp2(x + (P_LOG2 - m_i)[:, None])
        l_i = l_i + gl.sum(p, axis=1)
    else:
        m_i, l_i, rescale, p, f = _exact_softmax(raw, a, m_i, l_i, j, LK, cols8, BS, EVEN_K, P_LOG2, False)
        acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o8_layout))[:, None]
    acc = _pv_issue(_pv_operand(p, dtype, p8_layout, False), v_slot, acc, False, BS, True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return m_i, l_i, acc, fx


@gluon.jit
def _row_dot(q_s, vec_ptr, qk_scale, BS: gl.constexpr, D: gl.constexpr, row_s: gl.constexpr):
    """``s·q·v`` per row of the query tile ``q_s`` (``v``: ``D`` floats at ``vec_ptr``), read as
    :func:`.attention._tail_bound` reads the tile (64 columns at a time)."""
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros([BS], gl.float32, layout=gl.SliceLayout(1, BL))
    for c in gl.static_range(D // 64):
        qv = q_s.slice(c * 64, 64, dim=1).load(BL).to(gl.float32)
        v = gl.load(vec_ptr + c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, BL)))
        acc += gl.sum(qv * v[None, :], axis=1)
    return gl.convert_layout(acc * qk_scale, row_s)


@gluon.jit
def _next_code(ubase, u, n_union, code2, LOOKAHEAD: gl.constexpr):
    """The union codes of entries u + 1 and (``LOOKAHEAD`` 2) u + 2, past the end 0 (block 0).

    With ``LOOKAHEAD`` 1 entry u + 1's code is read in the iteration of entry u, and the key scale
    it indexes right after it: two dependent global reads at the top of every iteration, a stall
    the length of both where the entry is not this consumer's (nothing to hide them under). With
    2 the code arrives one iteration early and only the scale's read is left in the iteration."""
    if LOOKAHEAD > 1:
        return code2, gl.load(ubase + u + 2, mask=u + 2 < n_union, other=0)
    else:
        return gl.load(ubase + u + 1, mask=u + 1 < n_union, other=0), code2


@gluon.jit
def _turn_wait(turn, u, CID: gl.constexpr, PINGPONG: gl.constexpr):
    """Wait for this consumer's turn at union entry ``u`` (``PINGPONG``: the two consumers issue
    their products in turns, consumer 0 first at every entry).

    Every consumer takes one turn per union entry, owned or not (an entry it skips is a turn that
    issues nothing), so both take exactly ``n_union`` turns and neither waits for a turn its
    partner never gives. ``turn[c]`` completes phase k when the partner has passed its turn at
    entry k; consumer 0 waits at entry u for phase u − 1 (at entry 0 the fresh barrier's phase
    "−1", complete), consumer 1 for phase u. A barrier is never two phases ahead of its waiter (each arrival needs the waiter's
    previous turn), so the parity names the phase. The slot waits come first and release as
    without turns (a consumer flushes a held slot before waiting), so no cycle through the loader:
    entry u's slot needs only entries ≤ u − STAGES released, and both consumers release those
    before their turn at u."""
    if PINGPONG:
        mbarrier.wait(turn.index(CID), (u & 1) ^ (1 - CID))


@gluon.jit
def _turn_pass(turn, CID: gl.constexpr, PINGPONG: gl.constexpr):
    """Hand the turn to the partner once this entry's products are issued (``PINGPONG``): its
    products run on the tensor cores while this consumer's softmax runs."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - CID), count=1)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, kb_desc, vb_desc, hb_desc,
            q_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty, tready, tempty,
            code_ring, sig_ring, uidx_ptr, ucnt_ptr, sig_ptr, pair_row, W2, b, h, hk, bhk, q0, NK,
            BS: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, TSTAGES: gl.constexpr, MODE: gl.constexpr,
            PV8: gl.constexpr, LOOKAHEAD: gl.constexpr, NC: gl.constexpr, SLOT_META: gl.constexpr,
            TAIL_ALIAS: gl.constexpr, HB_RING: gl.constexpr):
    for c in gl.static_range(NC):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, q0 + c * BS, 0], q_bar.index(c), _box(q_smem.index(c), q_desc))
    if MODE == 2 and not HB_RING:
        mbarrier.expect(hb_bar.index(0), hb_desc.block_type.nbytes)
        _tma_load(hb_desc, [bhk, 0, 0], hb_bar.index(0), _box(hb_smem, hb_desc))
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    n_union = gl.load(ucnt_ptr + pair_row)
    ubase = uidx_ptr + pair_row.to(gl.int64) * W2  # the stream may pass 2**31 entries (B·H = 64 at 1M tokens)
    code = gl.load(ubase, mask=n_union > 0, other=0)
    code2 = gl.load(ubase + 1, mask=(n_union > 1) & (LOOKAHEAD > 1), other=0)
    META_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for u in range(n_union):
        cur = code
        j = code >> NC  # a code: key block << NC | owner bits
        code, code2 = _next_code(ubase, u, n_union, code2, LOOKAHEAD)
        s = u % STAGES
        if SLOT_META:
            sig = gl.load(sig_ptr + bhk * NK + j)
        mbarrier.wait(empty.index(s), ((u // STAGES) & 1) ^ 1)
        if SLOT_META:
            # The entry's code and key scale travel with its slot: every loader thread stores the
            # same values, and the barrier orders all of those stores before the arrival below that
            # releases the slot to the consumers.
            code_ring.index(s).store(gl.full([1], 0, gl.int32, META_L) + cur)
            sig_ring.index(s).store(gl.full([1], 0.0, gl.float32, META_L) + sig)
            _thread_barrier()
        mbarrier.expect(ready.index(s), kv_bytes)
        _tma_load(k_desc, [b, hk, j * BS, 0], ready.index(s), _box(k_bufs.index(s), k_desc))
        if PV8:
            _tma_load(v_desc, [b, hk, 0, j * BS], ready.index(s), _box(v_bufs.index(s), v_desc))
        else:
            _tma_load(v_desc, [b, hk, j * BS, 0], ready.index(s), _box(v_bufs.index(s), v_desc))
    if MODE > 0:
        # The tail ring: with its own slots, its first groups load while the exact blocks are
        # computed; laid over the exact ring (TAIL_ALIAS), once those slots are free.
        c_bytes: gl.constexpr = kb_desc.block_type.nbytes + vb_desc.block_type.nbytes
        t = 0
        for g0 in range(0, NK, C):
            s = _tail_slot_wait(t, n_union, empty, tempty, STAGES, TSTAGES, TAIL_ALIAS, PV8)
            mbarrier.expect(tready.index(s), c_bytes)
            _tma_load(kb_desc, [bhk, g0, 0], tready.index(s), _box(kb_bufs.index(s), kb_desc))
            _tma_load(vb_desc, [bhk, g0, 0], tready.index(s), _box(vb_bufs.index(s), vb_desc))
            t += 1
        if HB_RING:
            # H̄'s two 64-row halves as the tail ring's last entry (as the input-precision kernel's
            # ring): no [D, D] tile held through the loops.
            s = _tail_slot_wait(t, n_union, empty, tempty, STAGES, TSTAGES, TAIL_ALIAS, PV8)
            mbarrier.expect(tready.index(s), 2 * hb_desc.block_type.nbytes)
            _tma_load(hb_desc, [bhk, 0, 0], tready.index(s), _box(kb_bufs.index(s), hb_desc))
            _tma_load(hb_desc, [bhk, BS, 0], tready.index(s), _box(vb_bufs.index(s), hb_desc))


@gluon.jit
def _tail_slot_wait(t, n_union, empty, tempty, STAGES: gl.constexpr, TSTAGES: gl.constexpr,
                    TAIL_ALIAS: gl.constexpr, PV8: gl.constexpr):
    """The loader's wait before it fills tail entry ``t``; its slot out. A tail slot s laid over
    the exact ring (TAIL_ALIAS: its centroid tile over 8-bit K slots 2s and 2s + 1, its value tile
    over 8-bit V slots 2s and 2s + 1, or over 16-bit V slot s) is first filled once every consumer
    released the last exact entries those held: the wait on each is the one the entry after them
    would make there."""
    s = t % TSTAGES
    if TAIL_ALIAS:
        if t < TSTAGES:
            for e in gl.static_range(2):
                _exact_slot_drained(2 * s + e, n_union, empty, STAGES)
            if not PV8:
                _exact_slot_drained(s, n_union, empty, STAGES)
    mbarrier.wait(tempty.index(s), ((t // TSTAGES) & 1) ^ 1)
    return s


@gluon.jit
def _exact_slot_drained(se, n_union, empty, STAGES: gl.constexpr):
    """Wait until every consumer released the last exact entry slot ``se`` held (the exact ring
    is never refilled after the stream, so the release stays complete)."""
    un = n_union + (se + STAGES - n_union % STAGES) % STAGES
    mbarrier.wait(empty.index(se), ((un // STAGES) & 1) ^ 1)


@gluon.jit
def _consumer(o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, alpha_ptr, sig_ptr, tau_ptr, mu_ptr, vcs_ptr,
              kcmax_ptr, q_smem, q8_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty, tready, tempty,
              turn, code_ring, sig_ring, uidx_ptr, ucnt_ptr, pair_row, W2, NW, b, h, bhk, q0, bh, LQ, LK, LKP, NQ, NK,
              qk_scale, scale, pw,
              CID: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, C: gl.constexpr,
              STAGES: gl.constexpr, TSTAGES: gl.constexpr, MODE: gl.constexpr, EVEN_K: gl.constexpr,
              LOG2_BS: gl.constexpr, PIPELINE: gl.constexpr, QK_INT8: gl.constexpr, PV8: gl.constexpr,
              PV_ACC: gl.constexpr, PINGPONG: gl.constexpr, LOOKAHEAD: gl.constexpr, PV_INT8: gl.constexpr,
              NC: gl.constexpr, TAIL_SLACK: gl.constexpr, SLOT_META: gl.constexpr, HB_RING: gl.constexpr,
              EXACT_SLACK: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # 8-bit products: the same accumulator layouts with wgmma's 32-deep 8-bit instruction shape;
    # P·V in the input dtype keeps the input kernel's.
    s8_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BS, 32])
    o8_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 32 if PV8 else 16])
    p8_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o8_layout, k_width=4 if PV8 else 2)
    # Three consumers with a tail: an e4m3 P·V from zero in two halves of D (a [64, D/2] product,
    # 32 registers, instead of [64, D]), the accumulator in two halves joined after the loop (in
    # registers), so that the exact loop fits 160 registers.
    PV_HALVES: gl.constexpr = NC == 3 and MODE > 0 and PV8 and not PV_INT8 and not PV_ACC
    oh_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D // 2, 32])
    ph_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=oh_layout, k_width=4)
    q8_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s8_layout, k_width=4)
    # Not the layout of :func:`.attention._tail_bound`'s reads of the same tile after the loop: with
    # it LLVM computes the shared-memory addresses of both reads once and holds them (45 registers)
    # through the exact loop.
    qrow_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    P_MUL: gl.constexpr = P_SCALE_INT8 if PV_INT8 else P_SCALE
    P_LOG2: gl.constexpr = P_LOG2_INT8 if PV_INT8 else 8.0

    qi = q0 // BS + CID
    active = qi < NQ
    row = bh * NQ + qi
    q_s = q_smem.index(CID)
    mbarrier.wait(q_bar.index(CID), 0)
    # The query tile in 8 bits, one scale per row, and the smoothing constant s·q·μ (base 2) from
    # the unquantised rows.
    qf = q_s.load(qrow_layout).to(gl.float32)
    q_amax = gl.max(gl.abs(qf), axis=1)
    if QK_INT8:
        pos = q_amax > 0
        q_amax = gl.maximum(q_amax, 3.761581922631320e-37)  # quant.INT8_MIN_AMAX: 127 / amax stays finite
        q_inv = gl.where(pos, 127.0 / gl.where(pos, q_amax, 1.0), 0.0)
        y = qf * q_inv[:, None]
        # round half away from zero (the cast truncates), clamped to ±127
        y = gl.minimum(gl.maximum(y + gl.where(y >= 0, 0.5, -0.5), -127.0), 127.0)
        y8 = y.to(gl.int8)
        q_rs = qk_scale * (q_amax / 127.0)
    else:
        q_inv = _pow2_scale_inv(q_amax)
        y8 = (qf * q_inv[:, None]).to(gl.float8e4nv)
        q_rs = qk_scale / q_inv
    if NC == 3:
        # Q·Kᵀ reads the 8-bit query tile from shared memory: 16 registers fewer than the
        # register operand, which three consumers (160 registers each) need in the exact loop.
        q8 = q8_smem.index(CID)
        q8.store(y8)
        fence_async_shared()
    else:
        q8 = gl.convert_layout(y8, q8_layout)

    row8: gl.constexpr = gl.SliceLayout(1, s8_layout)
    m_i = gl.full([BS], float("-inf"), gl.float32, layout=row8)
    if EXACT_SLACK >= 0:
        # P in the input dtype: the exact loop's maximum may be fixed at a per-row bound of its
        # quantised scores, in the loop's frame (without s·q·μ): s·σ_q·Σ_d |y_d|·(c_d + max c / 127),
        # y the query's codes, c_d = max_n |k_nd − μ_d| (the smoothed keys' per-channel maxima, from
        # the quantisation pass; a key's code is off by at most half its block's scale, ≤ max c / 254).
        # The unquantised s·Σ_d |q_d|·c_d is no bound: rounding may double a small entry, and a row
        # of such entries beside one large one scored past it by hundreds (exp2 overflowed). Until
        # the first owned block m_i holds it (``fx`` 0); that block decides
        # (:func:`.attention._exact_step_fx`).
        kc = gl.load(kcmax_ptr + bhk * D + gl.arange(0, D, layout=gl.SliceLayout(0, qrow_layout)))
        kc = kc + gl.max(kc, axis=0) * (1.0 / 127.0)
        m_i = gl.convert_layout(gl.sum(gl.abs(y) * kc[None, :], axis=1) * q_rs, row8)
    l_i = gl.zeros([BS], gl.float32, layout=row8)
    acc = gl.zeros([BS, D], gl.float32, layout=o8_layout)
    if PV_HALVES:
        acc_lo = gl.zeros([BS, D // 2], gl.float32, layout=oh_layout)
        acc_hi = gl.zeros([BS, D // 2], gl.float32, layout=oh_layout)
    s8_zero = gl.zeros([BS, BS], gl.int32 if QK_INT8 else gl.float32, layout=s8_layout)
    o8_zero = gl.zeros([BS, D], gl.int32 if PV_INT8 else gl.float32, layout=o8_layout)
    # INT8 P·V: each block's value-code sums (the offset's correction) and value scales per
    # channel, in the accumulator's column layout, addressed by a scalar row offset plus one int32
    # column vector (a vector of 64-bit pointers per array, held across the loop, spilled)
    d8 = gl.arange(0, D, layout=gl.SliceLayout(0, o8_layout))
    vs_row = bhk * NK * D
    cols8 = gl.arange(0, BS, layout=gl.SliceLayout(0, s8_layout))
    q_rs = gl.convert_layout(q_rs, row8)

    n_union = gl.load(ucnt_ptr + pair_row)
    fx = n_union * 0  # the fixed maximum's state (EXACT_SLACK)
    ubase = uidx_ptr + pair_row.to(gl.int64) * W2  # the stream may pass 2**31 entries (B·H = 64 at 1M tokens)
    sig_base = sig_ptr + bhk * NK
    if not SLOT_META:
        code_next = gl.load(ubase, mask=n_union > 0, other=0)
        sig_next = gl.load(sig_base + (code_next >> NC))
        code_next2 = gl.load(ubase + 1, mask=(n_union > 1) & (LOOKAHEAD > 1), other=0)
    if PIPELINE:
        # As the input-precision kernel's pipelined loop (.attention._exact_pipelined): this
        # block's Q·Kᵀ and the previous owned block's P·V are queued together and the softmax runs
        # under the P·V; the last owned block's P (entry ``tp``, -1 none) waits in registers, and
        # is flushed before the loop waits on an entry STAGES past its slot. (The wait cannot
        # take the 8-bit P as a dependency; ptxas keeps an in-flight wgmma's registers.)
        p8 = _pv_operand(gl.zeros([BS, BS], gl.float32, layout=s8_layout), q_s.dtype, p8_layout, PV8)
        tp = n_union * 0 - 1
        for u in range(n_union):
            code = code_next
            sig = sig_next
            code_next, code_next2 = _next_code(ubase, u, n_union, code_next2, LOOKAHEAD)
            sig_next = gl.load(sig_base + (code_next >> NC))
            s = u % STAGES
            if (tp >= 0) & (u - tp >= STAGES):
                sp = tp % STAGES
                acc = _pv_flush(p8, v_bufs.index(sp), acc, o8_zero, PV8, BS, PV_ACC)
                mbarrier.arrive(empty.index(sp), count=1)
                tp = -1
            mbarrier.wait(ready.index(s), (u // STAGES) & 1)
            _turn_wait(turn, u, CID, PINGPONG)
            if ((code >> CID) & 1) != 0:
                sc = _qk_issue(q8, k_bufs.index(s), s8_zero, QK_INT8, D)
                if tp >= 0:
                    sp = tp % STAGES
                    if PV_ACC:  # into the accumulator (at the previous maximum), rescaled after
                        pv = _pv_issue(p8, v_bufs.index(sp), acc, PV8, BS, True)
                    else:
                        pv = _pv_issue(p8, v_bufs.index(sp), o8_zero, PV8, BS)
                    _turn_pass(turn, CID, PINGPONG)
                    raw = _qk_raw(sc, 1, QK_INT8)
                    m_i, l_i, rescale, p, f = _exact_softmax(raw, q_rs * sig, m_i, l_i, code >> NC, LK, cols8, BS,
                                                          EVEN_K, P_LOG2, PV_INT8)
                    p8_new = _pv_operand(p, q_s.dtype, p8_layout, PV8, PV_INT8)
                    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                    mbarrier.arrive(empty.index(sp), count=1)
                    # The previous block's product is at the previous maximum: add, then rescale.
                    if PV_ACC:
                        acc = pv * gl.convert_layout(rescale, gl.SliceLayout(1, o8_layout))[:, None]
                    else:
                        acc = (acc + pv) * gl.convert_layout(rescale, gl.SliceLayout(1, o8_layout))[:, None]
                else:
                    _turn_pass(turn, CID, PINGPONG)
                    raw = _qk_raw(sc, 0, QK_INT8)
                    m_i, l_i, rescale, p, f = _exact_softmax(raw, q_rs * sig, m_i, l_i, code >> NC, LK, cols8, BS,
                                                          EVEN_K, P_LOG2, PV_INT8)
                    p8_new = _pv_operand(p, q_s.dtype, p8_layout, PV8, PV_INT8)
                    acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o8_layout))[:, None]
                p8 = p8_new
                tp = u
            else:
                _turn_pass(turn, CID, PINGPONG)
                mbarrier.arrive(empty.index(s), count=1)
        if tp >= 0:
            sp = tp % STAGES
            acc = _pv_flush(p8, v_bufs.index(sp), acc, o8_zero, PV8, BS, PV_ACC)
            mbarrier.arrive(empty.index(sp), count=1)
    else:
        META_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        for u in range(n_union):
            s = u % STAGES
            if SLOT_META:
                # The entry's code and key scale from its slot (the loader wrote them): no pointer
                # into the stream or the scales is live through the loop.
                mbarrier.wait(ready.index(s), (u // STAGES) & 1)
                code = gl.max(code_ring.index(s).load(META_L), axis=0)
                sig = gl.max(sig_ring.index(s).load(META_L), axis=0)
            else:
                code = code_next
                sig = sig_next
                # The next block's code and key scale, read ahead (code 0 past the end: block 0).
                code_next, code_next2 = _next_code(ubase, u, n_union, code_next2, LOOKAHEAD)
                sig_next = gl.load(sig_base + (code_next >> NC))
                mbarrier.wait(ready.index(s), (u // STAGES) & 1)
            _turn_wait(turn, u, CID, PINGPONG)
            if ((code >> CID) & 1) != 0:
                if PV_INT8:
                    vs_off = vs_row + (code >> NC) * D + d8
                    vcs = gl.load(vcs_ptr + vs_off)
                    tau_j = gl.load(tau_ptr + vs_off)
                sc = _qk_issue(q8, k_bufs.index(s), s8_zero, QK_INT8, D)
                _turn_pass(turn, CID, PINGPONG)
                raw = _qk_raw(sc, 0, QK_INT8)
                if EXACT_SLACK >= 0:
                    m_i, l_i, acc, fx = _exact_fx(raw, q_rs * sig, m_i, l_i, acc, fx, v_bufs.index(s), code >> NC,
                                                  LK, cols8, q_s.dtype, p8_layout, o8_layout, row8, BS, EVEN_K,
                                                  P_LOG2, EXACT_SLACK)
                else:
                    m_i, l_i, rescale, p, f = _exact_softmax(raw, q_rs * sig, m_i, l_i, code >> NC, LK, cols8, BS,
                                                          EVEN_K, P_LOG2, PV_INT8)
                    if PV_HALVES:
                        acc_lo, acc_hi = _pv_halves(_pv_operand(p, q_s.dtype, ph_layout, PV8), v_bufs.index(s), acc_lo,
                                                    acc_hi, gl.convert_layout(rescale, gl.SliceLayout(1, oh_layout)),
                                                    BS, D)
                    elif PV_ACC:  # the input kernel's way: rescale, then accumulate in the wgmma
                        p8 = _pv_operand(p, q_s.dtype, p8_layout, PV8, PV_INT8)
                        acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o8_layout))[:, None]
                        acc = _pv_issue(p8, v_bufs.index(s), acc, PV8, BS, True)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    else:
                        # Each block's P·V starts from zero and is added in float32, so the
                        # accumulator's rescale runs while the tensor cores compute the product (and
                        # no FP8 sum spans more than one block).
                        p8 = _pv_operand(p, q_s.dtype, p8_layout, PV8, PV_INT8)
                        pv = _pv_issue(p8, v_bufs.index(s), o8_zero, PV8, BS, False, PV_INT8)
                        acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o8_layout))[:, None]
                        if PV_INT8:
                            # Σ (c − 128)·v8 + 128·Σ v8 (|·| <= 64·255·127 < 2^22: exact through the
                            # bit pattern), times the block's value scales and its factor f
                            corr = vcs * INT8_P_OFFSET + MAGIC_BITS
                            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                            pvf = ((pv + corr[None, :]).to(gl.float32, bitcast=True) - MAGIC) * tau_j[None, :]
                            acc = acc + pvf * gl.convert_layout(f, gl.SliceLayout(1, o8_layout))[:, None]
                        else:
                            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
            else:
                _turn_pass(turn, CID, PINGPONG)
            mbarrier.arrive(empty.index(s), count=1)

    if PV_HALVES:
        acc = gl.convert_layout(gl.reshape(gl.permute(gl.join(acc_lo, acc_hi), (0, 2, 1)), [BS, D]), o8_layout)
    # The exact blocks' numerator back in value units (τ / F per channel, or 1 / F: int8 values
    # are scaled per block above), then the tail's input-precision layouts.
    if PV8 and not PV_INT8:
        tau = gl.load(tau_ptr + bhk * D + gl.arange(0, D, layout=gl.SliceLayout(0, o8_layout))) * (1.0 / P_MUL)
        acc = gl.convert_layout(acc * tau[None, :], o_layout)
    else:
        acc = gl.convert_layout(acc * (1.0 / P_MUL), o_layout)
    if EXACT_SLACK >= 0:
        if fx == 0:  # no owned exact block: m_i is still the bound (see the bf16 kernel's consumer)
            m_i = gl.full([BS], float("-inf"), gl.float32, layout=row8)
    # The running maximum back in the frame of the scores S = raw·a + s·q·μ (the loop left the
    # row's constant out: it needs no register there).
    m_i = gl.convert_layout(m_i, row_s) + _row_dot(q_s, mu_ptr + bhk * D, qk_scale, BS, D, row_s)
    l_i = gl.convert_layout(l_i * (1.0 / P_MUL), row_s)
    # The input-precision kernel's tail (on the tail ring), first-order term and output; int8-fp8
    # keeps the first-order product's power of two in bfloat16 (without, ptxas spilled in its
    # hybrid exact loop at D = 128).
    _finish(q_s, kb_bufs, vb_bufs, tready, tempty, 0, hb_smem, hb_bar, o_desc, lse_ptr, bits_ptr, kscale_ptr,
            hscale_ptr, kbound_ptr, alpha_ptr, m_i, l_i, acc, active, row, qi, NW, b, h, bhk, bh, LQ, LK, NK, qk_scale, scale, pw,
            BS, D, C, TSTAGES, MODE, EVEN_K, LOG2_BS, NC, TAIL_SLACK, s_layout, o_layout, p_layout, HB_RING,
            (fx == 1).to(gl.int32), EXACT_SLACK >= 0, QK_INT8 and PV8 and not PV_INT8)


@gluon.jit(do_not_specialize=["H", "HK", "LQ", "LK", "LKP", "NQ", "NK", "W2", "NW"])
def _fp8_pair_kernel(
    q_desc, k_desc, v_desc, o_desc, kb_desc, vb_desc, hb_desc,
    kscale_ptr, hscale_ptr, kbound_ptr, uidx_ptr, ucnt_ptr, bits_ptr, lse_ptr, alpha_ptr, sig_ptr, tau_ptr, mu_ptr, vcs_ptr,
    kcmax_ptr, H, HK, LQ, LK, LKP, NQ, NK, W2, NW,
    qk_scale, scale, pw,
    BS: gl.constexpr, D: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, TSTAGES: gl.constexpr,
    MODE: gl.constexpr, EVEN_K: gl.constexpr, LOG2_BS: gl.constexpr, PIPELINE: gl.constexpr,
    QK_INT8: gl.constexpr, PV8: gl.constexpr, PV_ACC: gl.constexpr, PINGPONG: gl.constexpr,
    LOOKAHEAD: gl.constexpr, PV_INT8: gl.constexpr, NC: gl.constexpr, TAIL_SLACK: gl.constexpr,
    SLOT_META: gl.constexpr, TAIL_ALIAS: gl.constexpr, HB_RING: gl.constexpr, EXACT_SLACK: gl.constexpr = -1.0,
    PDL: gl.constexpr = 0,
):
    # One CTA per group of NC adjacent query blocks (a pair or three: NC consumer warpgroups).
    await_prior_grid(PDL)
    pair = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // (H // HK)
    bhk = b * HK + hk
    q0 = pair * NC * BS
    pair_row = bh * ((NQ + NC - 1) // NC) + pair
    dtype: gl.constexpr = q_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BS, D], dtype)
    k8_dtype: gl.constexpr = k_desc.dtype  # int8 or e4m3
    k8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BS, D], k8_dtype)
    v8_dtype: gl.constexpr = v_desc.dtype  # e4m3 or int8 when PV8
    v8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, BS], v8_dtype)

    q_smem = gl.allocate_shared_memory(dtype, [NC, BS, D], tile_layout)
    k_bufs = gl.allocate_shared_memory(k8_dtype, [STAGES, BS, D], k8_layout)
    if TAIL_ALIAS and PV8:
        # The tail's 16-bit slots laid over pairs of 8-bit slots (no room of their own). The V ring
        # is allocated in the K ring's 128-byte swizzle, so that the tail's tiles over it have the
        # alignment their swizzle needs, and seen as the transposed 8-bit value tiles.
        v_ring = gl.allocate_shared_memory(k8_dtype, [STAGES, BS, D], k8_layout)
    if NC == 3:  # the 8-bit query tiles (two consumers hold theirs in registers)
        q8_smem = gl.allocate_shared_memory(k8_dtype, [NC, BS, D], k8_layout)
    else:
        q8_smem = gl.allocate_shared_memory(k8_dtype, [1, 16, 32], gl.NVMMASharedLayout.get_default_for([16, 32], k8_dtype))
    if TAIL_ALIAS and PV8:
        v_bufs = _reinterpret(v_ring, v8_dtype, [STAGES, D, BS], v8_layout)
    elif PV8:
        v_bufs = gl.allocate_shared_memory(v8_dtype, [STAGES, D, BS], v8_layout)
    else:
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BS, D], tile_layout)
    if TAIL_ALIAS:
        kb_bufs = _reinterpret(k_bufs, dtype, [TSTAGES, BS, D], tile_layout)
        if PV8:
            vb_bufs = _reinterpret(v_ring, dtype, [TSTAGES, BS, D], tile_layout)
        else:  # 16-bit value slots: the tail's value tile s is value slot s
            vb_bufs = _reinterpret(v_bufs, dtype, [TSTAGES, BS, D], tile_layout)
    elif MODE > 0:
        kb_bufs = gl.allocate_shared_memory(dtype, [TSTAGES, BS, D], tile_layout)
        vb_bufs = gl.allocate_shared_memory(dtype, [TSTAGES, BS, D], tile_layout)
    else:
        kb_bufs = gl.allocate_shared_memory(dtype, [1, 16, D], gl.NVMMASharedLayout.get_default_for([16, D], dtype))
        vb_bufs = gl.allocate_shared_memory(dtype, [1, 16, D], gl.NVMMASharedLayout.get_default_for([16, D], dtype))
    if MODE == 2 and not HB_RING:
        hb_smem = gl.allocate_shared_memory(dtype, [D, D], gl.NVMMASharedLayout.get_default_for([D, D], dtype))
    else:
        hb_smem = gl.allocate_shared_memory(dtype, [16, D], gl.NVMMASharedLayout.get_default_for([16, D], dtype))
    q_bar = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    hb_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tready = gl.allocate_shared_memory(gl.int64, [TSTAGES, 1], mbarrier.MBarrierLayout())
    tempty = gl.allocate_shared_memory(gl.int64, [TSTAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    meta_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    code_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 1], meta_layout)
    sig_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1], meta_layout)
    for c in gl.static_range(NC):
        mbarrier.init(q_bar.index(c), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    mbarrier.init(hb_bar.index(0), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NC)  # every consumer releases every slot
    for s in gl.static_range(TSTAGES):
        mbarrier.init(tready.index(s), count=1)
        mbarrier.init(tempty.index(s), count=NC)

    # Registers: 240 a consumer for two (168 each at launch), 160 for three (128 at launch).
    if NC == 2:
        gl.warp_specialize([
            (_loader, (q_desc, k_desc, v_desc, kb_desc, vb_desc, hb_desc,
                       q_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty, tready, tempty,
                       code_ring, sig_ring, uidx_ptr, ucnt_ptr, sig_ptr, pair_row, W2, b, h, hk, bhk, q0, NK,
                       BS, C, STAGES, TSTAGES, MODE, PV8, LOOKAHEAD, NC, SLOT_META, TAIL_ALIAS, HB_RING)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, alpha_ptr, sig_ptr, tau_ptr, mu_ptr, vcs_ptr,
                         kcmax_ptr, q_smem, q8_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty,
                         tready, tempty, turn, code_ring, sig_ring, uidx_ptr, ucnt_ptr, pair_row, W2, NW, b, h, bhk, q0, bh, LQ, LK, LKP, NQ, NK,
                         qk_scale, scale, pw, 0, BS, D, C, STAGES, TSTAGES, MODE, EVEN_K, LOG2_BS, PIPELINE,
                         QK_INT8, PV8, PV_ACC, PINGPONG, LOOKAHEAD, PV_INT8, NC, TAIL_SLACK, SLOT_META, HB_RING,
                         EXACT_SLACK)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, alpha_ptr, sig_ptr, tau_ptr, mu_ptr, vcs_ptr,
                         kcmax_ptr, q_smem, q8_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty,
                         tready, tempty, turn, code_ring, sig_ring, uidx_ptr, ucnt_ptr, pair_row, W2, NW, b, h, bhk, q0, bh, LQ, LK, LKP, NQ, NK,
                         qk_scale, scale, pw, 1, BS, D, C, STAGES, TSTAGES, MODE, EVEN_K, LOG2_BS, PIPELINE,
                         QK_INT8, PV8, PV_ACC, PINGPONG, LOOKAHEAD, PV_INT8, NC, TAIL_SLACK, SLOT_META, HB_RING,
                         EXACT_SLACK)),
        ], [4, 4], [240, 240])
    else:
        gl.warp_specialize([
            (_loader, (q_desc, k_desc, v_desc, kb_desc, vb_desc, hb_desc,
                       q_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty, tready, tempty,
                       code_ring, sig_ring, uidx_ptr, ucnt_ptr, sig_ptr, pair_row, W2, b, h, hk, bhk, q0, NK,
                       BS, C, STAGES, TSTAGES, MODE, PV8, LOOKAHEAD, NC, SLOT_META, TAIL_ALIAS, HB_RING)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, alpha_ptr, sig_ptr, tau_ptr, mu_ptr, vcs_ptr,
                         kcmax_ptr, q_smem, q8_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty,
                         tready, tempty, turn, code_ring, sig_ring, uidx_ptr, ucnt_ptr, pair_row, W2, NW, b, h, bhk, q0, bh, LQ, LK, LKP, NQ, NK,
                         qk_scale, scale, pw, 0, BS, D, C, STAGES, TSTAGES, MODE, EVEN_K, LOG2_BS, PIPELINE,
                         QK_INT8, PV8, PV_ACC, PINGPONG, LOOKAHEAD, PV_INT8, NC, TAIL_SLACK, SLOT_META, HB_RING,
                         EXACT_SLACK)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, alpha_ptr, sig_ptr, tau_ptr, mu_ptr, vcs_ptr,
                         kcmax_ptr, q_smem, q8_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty,
                         tready, tempty, turn, code_ring, sig_ring, uidx_ptr, ucnt_ptr, pair_row, W2, NW, b, h, bhk, q0, bh, LQ, LK, LKP, NQ, NK,
                         qk_scale, scale, pw, 1, BS, D, C, STAGES, TSTAGES, MODE, EVEN_K, LOG2_BS, PIPELINE,
                         QK_INT8, PV8, PV_ACC, PINGPONG, LOOKAHEAD, PV_INT8, NC, TAIL_SLACK, SLOT_META, HB_RING,
                         EXACT_SLACK)),
            (_consumer, (o_desc, lse_ptr, bits_ptr, kscale_ptr, hscale_ptr, kbound_ptr, alpha_ptr, sig_ptr, tau_ptr, mu_ptr, vcs_ptr,
                         kcmax_ptr, q_smem, q8_smem, k_bufs, v_bufs, kb_bufs, vb_bufs, hb_smem, q_bar, hb_bar, ready, empty,
                         tready, tempty, turn, code_ring, sig_ring, uidx_ptr, ucnt_ptr, pair_row, W2, NW, b, h, bhk, q0, bh, LQ, LK, LKP, NQ, NK,
                         qk_scale, scale, pw, 2, BS, D, C, STAGES, TSTAGES, MODE, EVEN_K, LOG2_BS, PIPELINE,
                         QK_INT8, PV8, PV_ACC, PINGPONG, LOOKAHEAD, PV_INT8, NC, TAIL_SLACK, SLOT_META, HB_RING,
                         EXACT_SLACK)),
        ], [4, 4, 4], [160, 160, 160])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

# Ring depths (exact 8-bit K+V slots, tail slots) per head dim and whether the mode has a tail. At
# D=128 two query tiles (32 KB) and H̄ (32 KB) leave room for 5 8-bit slots (80 KB) and 2 tail slots
# (64 KB) in one CTA per SM; without a tail the FP8 ring takes the room. Deeper exact rings measured
# faster than (3, 3) / (6, 1) on the H100 (hybrid -2 to -10 % at 32K, drop up to -5 %; outputs
# bit-identical; benchmarks/results/h100_schedules.json).
# P·V in the input dtype (``"int8"``) takes a 16-bit V tile per slot (24 KB at D=128 instead of
# 16): fewer slots in the same room.
STAGES = {(64, True): (6, 3), (64, False): (8, 1), (128, True): (5, 2), (128, False): (8, 1)}
# At D=128 in drop mode 5 slots measured faster than 7 (exact phase 4.34 -> 4.24 ms at 32K,
# results/h100_fp8_sweep.json); 4 with a tail do not fit.
STAGES_V16 = {(64, True): (6, 3), (64, False): (8, 1), (128, True): (3, 2), (128, False): (5, 1)}
# Three query tiles (48 KB at D=128, their 8-bit copies another 24) leave fewer slots with a tail
# ring of its own (the default lays it over the exact ring: :data:`STAGES_ALIAS`).
STAGES3 = {**STAGES, (128, True): (3, 2)}
STAGES3_V16 = {**STAGES_V16, (128, True): (2, 2)}


# With the tail ring laid over the exact ring (:func:`tail_alias_for`) the tail takes no room of
# its own: (exact slots, tail slots = half of them) per head dim and query blocks per CTA. At
# D = 128: pairs 8 slots (128 KB) beside two query tiles and H̄ (64 KB); three query blocks 8
# beside three query tiles and their 8-bit copies (72 KB), H̄ coming through the tail ring
# (:func:`hbar_in_tail_ring`).
STAGES_ALIAS = {(64, 2): (8, 4), (64, 3): (8, 4), (128, 2): (8, 4), (128, 3): (8, 4)}
# P·V in the input dtype: 16-bit value slots (24 KB a slot with the 8-bit keys at D = 128), so 6
# beside three query tiles and their 8-bit copies (72 KB), or beside two and H̄ (64 KB).
STAGES_ALIAS_V16 = {(64, 2): (8, 4), (64, 3): (8, 4), (128, 2): (6, 3), (128, 3): (6, 3)}


def ring_depths(head_dim: int, tail: bool, pv8: bool, query_group: int, alias: bool = False) -> tuple[int, int]:
    """(exact slots, tail slots) for a head dim, a mode with or without a tail, 8-bit values or
    not, the query blocks per CTA and whether the tail ring lies over the exact one."""
    if alias:
        return (STAGES_ALIAS if pv8 else STAGES_ALIAS_V16)[head_dim, query_group]
    table = (STAGES if pv8 else STAGES_V16) if query_group == 2 else (STAGES3 if pv8 else STAGES3_V16)
    return table[head_dim, tail]


# Where the tail ring lies over the exact ring by default (a mode with a tail): per (precision,
# query blocks per CTA). Three query blocks with a tail had 3 exact slots and 2 tail slots of their
# own at D = 128; over one ring they get 8 and 4. H200, 32K Gaussian hybrid attend, medians of 3
# rounds (results/h200_fp8_tail_alias.json): ``fp8`` three 4.67 -> 4.39 ms (6 + 3 slots 4.34;
# pairs 4.43), ``int8-fp8`` 4.88 -> 4.59 (4.63; pairs 4.78); pairs over one ring (8 + 4 for
# 5 + 2) were slower (4.54, 4.87), so they keep their own tail slots. ``int8`` (16-bit value
# slots, 6 + 3 over one ring): three over the ring against its default pairs within the rounds'
# spread at 32K-64K on the H100 (results/h100_int8_tail_ring.json), so pairs stay.
TAIL_ALIAS = {("fp8", 3), ("int8-fp8", 3)}


def tail_alias_for(precision: str, query_group: int, mode: str, tail_alias: bool | None = None) -> bool:
    """Whether the tail's 16-bit slots lie over the exact ring (``tail_alias``, None:
    :data:`TAIL_ALIAS`): the exact ring then gets the tail ring's room too (8-bit or 16-bit value
    slots: :func:`_tail_slot_wait`). Needs a mode with a tail."""
    if mode == "drop":
        if tail_alias:
            raise ValueError(f"tail_alias: needs a mode with a tail, got mode={mode!r}")
        return False
    if tail_alias is None:
        return (precision, query_group) in TAIL_ALIAS
    return bool(tail_alias)


def hbar_in_tail_ring(alias: bool, mode: str, query_group: int, head_dim: int, block_size: int) -> bool:
    """Whether H̄ comes as the tail ring's last entry (its row halves over a tail slot's two tiles,
    as :func:`.attention.hbar_in_ring`) instead of its own ``[D, D]`` tile: three query blocks with
    the tail over the exact ring, hybrid, D = 2·BS."""
    return alias and hbar_in_ring(mode, query_group, head_dim, block_size)
HEAD_DIMS = (64, 128)
# The exact loop's schedule (see :data:`.attention.PIPELINE`): sequential by default, the pipelined
# loop measured 16-25 % slower on the H100 (benchmarks/results/h100_pipeline.json).
PIPELINE = False
# The two consumers issue their products in turns, one per union entry (:func:`_turn_wait`), so
# one's softmax runs under the other's products instead of both in step (FA3's ping-pong). Off:
# slower for every precision, loop and length on the H100 (exact phase at 32K: sequential loop +7
# to +15 % drop, +6 to +18 % hybrid; pipelined loop +1 to +29 %; results/h100_fp8_pingpong.json).
PINGPONG = False
# How many union entries ahead the loops read the stream's codes (:func:`_next_code`), per format
# (key: P·V on 8-bit values; int8 values take the e4m3 setting, unmeasured). Measured at 32K/64K
# in one run (results/h100_fp8_lookahead.json): 2 is faster for the e4m3 P·V formats in 6 of 8
# drop/hybrid cases (up to -5.5 %), slower for ``int8`` in 3 of 4; near the spread between two
# timings of the same configuration (up to 13 % in that run).
LOOKAHEAD = {True: 2, False: 1}
# Where the sequential loop reads each entry's code and key scale: from a copy the loader writes
# into the entry's slot (for these (precision, query blocks per CTA, tail, even Lk)), else from
# global memory ahead of the slot (``LOOKAHEAD``). The slot copy takes the stream and scale
# pointers out of the loop (fewer registers there) but puts a shared-memory read after the slot's
# wait. H200, 32K Gaussian, medians of 3-4 interleaved rounds (results/h200_fp8_slot_meta.json,
# h200_fp8_tail_alias.json), exact phase slot / global: three drop 3.56 / 3.68 ms (fp8), 3.71 /
# 3.92 (int8-fp8), ragged 3.94 / 4.11 (fp8); pairs hybrid 4.42 / 4.49, 4.76 / 4.85; three hybrid
# (tail over the ring) 4.29 / 4.30 (fp8), ragged 4.93 / 5.01 (fp8), 5.17 / 5.45 (int8-fp8). Global
# stays where it measured faster: pairs drop 4.12 / 3.91 (int8-fp8), ragged pairs hybrid 5.52 /
# 5.33, ragged pairs drop 4.53 / 4.33; and for ``int8-fp8`` three with a tail at an even Lk (4.58 /
# 4.63, but the slot read leaves its exact loop two registers short: local memory in the loop).
SLOT_META = {("fp8", 3, False, True), ("fp8", 3, False, False), ("fp8", 2, True, True),
             ("int8-fp8", 3, False, True), ("int8-fp8", 2, True, True),
             ("fp8", 3, True, True), ("fp8", 3, True, False), ("int8-fp8", 3, True, False)}


def slot_meta_for(precision: str, query_group: int, mode: str, even_k: bool, pipeline: bool,
                  slot_meta: bool | None = None) -> bool:
    """Whether the sequential loop reads codes and key scales from the slots (``slot_meta``, None:
    :data:`SLOT_META`); the pipelined loop always reads them ahead."""
    if pipeline:
        return False
    if slot_meta is None:
        return (precision, query_group, mode != "drop", even_k) in SLOT_META
    return bool(slot_meta)
# The exact loop's P·V per format (key: P·V on 8-bit values; int8 values always from zero): from
# zero and added in float32 (False),
# or into the rescaled accumulator in the wgmma (True, as the input-precision kernel). Measured at
# 32K (results/h100_fp8_sweep.json): e4m3 from zero 3.87 vs 4.18 ms (drop), input dtype into the
# accumulator 4.34 vs 4.57 ms.
PV_ACCUMULATE = {True: False, False: True}
# Adjacent query blocks a CTA serves, per precision and whether the mode has a tail (a ragged Lk:
# :data:`QUERY_GROUP_RAGGED`). Three consumers get 160 registers; the e4m3 P·V formats' exact loop
# fits them in every mode (P·V in two halves of D, the row constant s·q·μ added after the loop;
# ptxas 12.8, Triton 3.6). With a tail three need the tail ring over the exact ring
# (:data:`TAIL_ALIAS`), else their exact loop has 3 slots: H200, 32K, three (tail over the ring)
# against pairs, medians of 3 rounds (results/h200_fp8_tail_alias.json): ``fp8`` hybrid 4.29
# against 4.51 ms, zeroth 4.43 / 4.47; ``int8-fp8`` hybrid 4.63 / 4.82, zeroth 4.57 / 4.73; 64K
# hybrid 16.32 / 16.88 (``fp8``), 17.20 / 17.96 (``int8-fp8``). ``int8-int8``'s loop spills in
# every mode. Without a tail, on the H200 at 32K / 64K (benchmarks/results/h200_fp8_query_group.json),
# exact phase three against two: ``fp8`` drop -1.0 / -0.8 %, ``int8`` drop -3.8 / +0.5 % (kept);
# ``int8`` hybrid +4.8 / +7.8 % (its 16-bit V slots: pairs kept). With the codes from the slot
# (:data:`SLOT_META`) ``int8-fp8`` drop on three: 3.71 against 3.91 ms on pairs.
QUERY_GROUP = {("fp8", False): 3, ("fp8", True): 3, ("int8-fp8", False): 3, ("int8-fp8", True): 3,
               ("int8-int8", False): 2, ("int8-int8", True): 2, ("int8", False): 3, ("int8", True): 2}


def precision_of(quant, v: Tensor | None) -> str:
    """The precision whose product formats ``quant`` (and ``v``: values in the input dtype) hold."""
    qk = "int8" if quant.k8.dtype == torch.int8 else "e4m3"
    pv = "input" if v is not None else "int8" if quant.v8t.dtype == torch.int8 else "e4m3"
    return next(p for p, f in PRODUCT_FORMATS.items() if f == (qk, pv))


# A ragged Lk: the e4m3 P·V formats on three query blocks in every mode (no spill in the loops, ptxas
# 12.8). H200, 32K Gaussian at Lk = L - 37, medians of 2 rounds (results/h200_fp8_tail_alias.json),
# three with the tail over the exact ring and the codes from the slots against pairs: ``fp8``
# hybrid 4.93 / 5.48 ms, zeroth 4.90 / 5.38; ``int8-fp8`` hybrid 5.17 / 5.81, zeroth 5.22 / 5.50;
# ``fp8`` drop on three 3.94 against 4.33 ms on pairs; the other formats stay on pairs (not measured).
QUERY_GROUP_RAGGED = {("fp8", True): 3, ("fp8", False): 3, ("int8-fp8", True): 3, ("int8-fp8", False): 3}


def query_group_for(mode: str, lk: int, block_size: int, precision: str) -> int:
    """Query blocks per CTA the low-precision kernel uses by default (:data:`QUERY_GROUP`, and
    :data:`QUERY_GROUP_RAGGED` for a ragged ``lk``)."""
    if lk % block_size == 0:
        return QUERY_GROUP[precision, mode != "drop"]
    return QUERY_GROUP_RAGGED.get((precision, mode != "drop"), 2)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
              torch.int8: gl.int8}


def _desc(x: Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


_launch = Launcher(_fp8_pair_kernel)

# The exact loop's maximum, for P·V in the input dtype (``"int8"``): fixed at the per-row bound of
# its scores where tight enough (as the input-precision kernel's, :data:`.attention.EXACT_MAX`;
# "auto": from :data:`.attention.EXACT_MIN_KEYS` keys on), or online. The e4m3 P formats keep the
# online maximum: their probabilities need a scale near the row's own maximum. H100, attend alone,
# bound against online (benchmarks/results/h100_int8_exact_max.json): keep-or-drop 12-17 % faster
# at 32K, 8-10 % at 64K; hybrid 5-12 %.
EXACT_MAX = "auto"


def exact_max_slack(exact_max: str | None, quant, q: Tensor, lk: int, pv8: bool, pipeline: bool,
                    pv_accumulate: bool) -> float:
    """The kernel's ``EXACT_SLACK`` for ``exact_max`` (None: :data:`EXACT_MAX`; -1: the online
    maximum). ``"bound"`` where the loop cannot take it is a ValueError naming ``exact_max``."""
    mode = exact_mode(EXACT_MAX if exact_max is None else exact_max, lk)
    if mode == "online":
        return -1.0
    if pv8 or pipeline or not pv_accumulate:
        if exact_max == "bound":
            raise ValueError("exact_max='bound' needs P·V in the input dtype (precision 'int8') accumulated in the "
                             "sequential loop; this call has "
                             + ("8-bit values" if pv8 else "the pipelined loop" if pipeline else "pv_accumulate=False"))
        return -1.0
    if quant.kcmax.numel() == 0:
        raise ValueError("exact_max: the quantised keys hold no per-channel maxima of |k − μ| (a quant_workspace "
                         "of a precision with 8-bit values)")
    return EXACT_SLACK.get(q.dtype, -1.0)


def attention(
    q: Tensor, quant, kbar: Tensor, kscale: Tensor, vbar: Tensor, hbar: Tensor, hscale: Tensor,
    idx: Tensor, cnt: Tensor, bits: Tensor,
    *, mode: str, scale: float, block_size: int, lk: int,
    out: Tensor | None = None, lse: Tensor | None = None, alpha: Tensor | None = None,
    pairs: tuple[Tensor, ...] | None = None, stages: tuple[int, int] | None = None,
    pipeline: bool | None = None, v: Tensor | None = None, pv_accumulate: bool | None = None,
    pingpong: bool | None = None, lookahead: int | None = None, query_group: int | None = None,
    kbound: Tensor | None = None, tail_max: str | None = None, slot_meta: bool | None = None,
    tail_alias: bool | None = None, exact_max: str | None = None,
) -> tuple[Tensor, Tensor]:
    """The low-precision kernel for a given selection: ``q`` a ``[B, H, Lq, D]`` view,
    ``quant`` the :class:`pisa_attn.ops.triton.quantize.Quantized` keys (int8 or e4m3: the format
    of ``Q·Kᵀ``) and values (e4m3 or int8: the format of ``P·V``; ``lk`` the true key count), the
    statistics' tail terms as :func:`.attention.attention` takes them; (out, lse) out. ``v``: the
    ``[B, Hk, Lk, D]`` values for ``P·V`` in the input dtype (then ``quant`` holds no value copy),
    None for 8-bit ``P·V``. INT8 ``P·V`` runs in the sequential loop, from zero per block (its
    int32 sums cannot go into the float32 accumulator): ``pipeline`` and ``pv_accumulate`` are
    refused for it.
    ``pipeline``: the exact loop's schedule (None: :data:`PIPELINE`); ``pv_accumulate``: either
    loop's P·V into the accumulator (None: :data:`PV_ACCUMULATE` for the format);
    ``pingpong``: the consumers' products in turns (None: :data:`PINGPONG`); ``lookahead``: how far
    ahead the stream's codes are read (None: :data:`LOOKAHEAD` for the format); ``slot_meta``: the
    sequential loop reads each entry's code and key scale from the copy in its slot instead (None:
    :data:`SLOT_META`; the pipelined loop reads them ahead). ``tail_alias``: the tail's slots laid
    over the exact ring's (None: :func:`tail_alias_for`). ``query_group``:
    adjacent query blocks per CTA, 2 or 3 (None: :func:`query_group_for`, or 2 with ``pipeline`` or
    ``pingpong``; 3 runs neither the pipelined loop nor ping-pong). ``kbound``, ``tail_max``: the tail's maximum, as
    :func:`.attention.attention` takes them. ``exact_max``: the exact loop's maximum (None:
    :data:`EXACT_MAX`; :func:`exact_max_slack`), fixed at the bound from ``quant.kcmax`` only for
    P·V in the input dtype."""
    del cnt
    b, h, lq, d = q.shape
    hk, lkp = quant.k8.shape[1], quant.k8.shape[2]
    bs = block_size
    nq, nk = -(-lq // bs), lkp // bs
    # before precision_of, which has no precision for 8-bit keys with values in the input dtype
    pv8 = v is None
    if pv8 == (quant.v8t.numel() == 0 and b * hk * d > 0):
        raise ValueError("v: pass the values exactly when quant holds no 8-bit copy of them (P·V in the input dtype)")
    slack = tail_slack(tail_max, kbound, q, hk)
    if query_group is None:  # the default, unless an option only pairs have is asked for
        nc = 2 if pipeline or pingpong else query_group_for(mode, lk, bs, precision_of(quant, v))
    else:
        nc = query_group
    if nc not in (2, 3):
        raise ValueError(f"query_group must be 2 or 3, got {query_group!r}")
    if nc == 3 and (pipeline or pingpong):
        raise ValueError(f"query_group=3 runs the sequential loop without turns: pipeline={pipeline!r}, "
                         f"pingpong={pingpong!r}")
    alias = tail_alias_for(precision_of(quant, v), nc, mode, tail_alias)
    hb_ring = hbar_in_tail_ring(alias, mode, nc, d, bs)
    st, tst = stages or ring_depths(d, mode != "drop", pv8, nc, alias)
    if alias and st != 2 * tst:
        raise ValueError(f"stages: a tail laid over the exact ring has half as many slots, got {stages!r}")
    pv_int8 = pv8 and quant.v8t.dtype == torch.int8
    pipe = nc == 2 and (PIPELINE if pipeline is None else bool(pipeline))
    pv_acc = PV_ACCUMULATE[pv8] if pv_accumulate is None else bool(pv_accumulate)
    if pv_int8 and (pipe or pv_acc):
        raise ValueError("pipeline / pv_accumulate: INT8 P·V runs in the sequential loop, each block's product "
                         "from zero")
    exact_slack = exact_max_slack(exact_max, quant, q, lk, pv8, pipe, pv_acc)
    out, lse = out_buffers(q, out, lse, (q.dtype,))  # the tile is stored in q's dtype through TMA
    # Adjacent blocks; the workspace's (uidx, ucnt[, qpair]) buffers where they have this launch's
    # shapes (a plan sizes them for its query group).
    width = (triple_width if nc == 3 else union_width)(nk, idx.shape[-1])
    if pairs is not None and pairs[0].shape[-2:] != (-(-nq // nc), width):
        pairs = None
    union = triple_union if nc == 3 else pair_union
    uidx, ucnt = union(bits, nk, idx.shape[-1], out=None if pairs is None else pairs[:2])
    if kbound is None:
        kbound = tail_bound(kbar, kscale)
    alpha = alpha_arg(alpha, h, q.device)
    m = MODE_IDS[mode]
    qk_int8 = quant.k8.dtype == torch.int8
    tensors = (q, quant.k8, quant.v8t if pv8 else v, out, kbar.view(b * hk, nk, d), vbar.view(b * hk, nk, d),
               hbar.view(b * hk, d, d))
    blocks = ([1, 1, bs, d], [1, 1, bs, d], [1, 1, d, bs] if pv8 else [1, 1, bs, d], [1, 1, bs, d], [1, bs, d],
              [1, bs, d], [1, bs if hb_ring else d, d])
    tau = quant.tau if pv8 else quant.sigma  # unread without 8-bit values
    vcs = quant.vcs if pv_int8 else quant.sigma  # unread without int8 values
    kcmax = quant.kcmax.view(torch.float32) if exact_slack >= 0 else quant.sigma  # unread online
    scalars = (kscale, hscale, kbound, uidx, ucnt, bits, lse, alpha, quant.sigma, tau, quant.mu, vcs, kcmax,
               h, hk, lq, lk, lkp, nq, nk, uidx.shape[-1], bits.shape[-1], scale * LOG2E, scale,
               first_order_shift(bs, scale))
    pp = nc == 2 and (PINGPONG if pingpong is None else bool(pingpong))
    la = LOOKAHEAD[pv8] if lookahead is None else lookahead
    if la not in (1, 2):
        raise ValueError(f"lookahead: 1 or 2 union entries, got {lookahead!r}")
    meta = slot_meta_for(precision_of(quant, v), nc, mode, lk % bs == 0, pipe, slot_meta)
    pdl = grid_dependency(q.device)
    constexprs = dict(BS=bs, D=d, C=bs, STAGES=st, TSTAGES=tst, MODE=m, EVEN_K=lk % bs == 0, LOG2_BS=math.log2(bs),
                      PIPELINE=pipe, QK_INT8=qk_int8, PV8=pv8, PV_ACC=pv_acc, PINGPONG=pp, LOOKAHEAD=la,
                      PV_INT8=pv_int8, NC=nc, TAIL_SLACK=slack, SLOT_META=meta, TAIL_ALIAS=alias,
                      HB_RING=hb_ring, EXACT_SLACK=exact_slack, PDL=pdl)
    key = (q.dtype, d, bs, st, tst, m, lk % bs == 0, pipe, qk_int8, pv8, pv_acc, pp, la, pv_int8, nc, slack, meta, alias,
           exact_slack, pdl, tuple(x.data_ptr() % 16 == 0 for x in scalars[:13]))
    descs = tuple(Desc(x, list(x.shape), list(x.stride())) for x in tensors)
    full = None if _launch.cached(key, descs + scalars) else tuple(_desc(x, blk) for x, blk in zip(tensors, blocks))
    _launch(key, (-(-nq // nc), b * h), descs + scalars, constexprs,
            full_args=None if full is None else full + scalars, num_warps=4, maxnreg=MAX_REGS[nc],
            launch_pdl=pdl > 0)
    return out, lse


def compile_for_sm90(head_dim: int = 128, mode: str = "hybrid", even_k: bool = True,
                     dtype: torch.dtype = torch.bfloat16, stages: tuple[int, int] | None = None,
                     pipeline: bool | None = None, precision: str = "fp8", pingpong: bool | None = None,
                     lookahead: int | None = None, query_group: int = 2, tail_max: str = "auto",
                     pv_accumulate: bool | None = None, slot_meta: bool | None = None,
                     tail_alias: bool | None = None, exact_max: str = "online"):
    """Compile the low-precision pair kernel for sm_90a without a GPU (as
    :func:`.attention.compile_for_sm90`), the products in the formats of ``precision``;
    ``exact_max="bound"``: the exact loop under the bound of its scores (P·V in the input dtype)."""
    qk_fmt, pv_fmt = PRODUCT_FORMATS[precision]
    pv8 = pv_fmt != "input"
    pv_int8 = pv_fmt == "int8"
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    d, bs = head_dim, 64
    alias = tail_alias_for(precision, query_group, mode, tail_alias)
    hb_ring = hbar_in_tail_ring(alias, mode, query_group, d, bs)
    x = torch.empty(1, 1, bs, d, dtype=dtype)
    k8 = torch.empty(1, 1, bs, d, dtype=torch.int8 if qk_fmt == "int8" else torch.float8_e4m3fn)
    v8 = torch.empty(1, 1, d, bs, dtype=torch.int8 if pv_int8 else torch.float8_e4m3fn) if pv8 else x
    c = torch.empty(1, bs, d, dtype=torch.float16)
    descs = dict(q_desc=_desc(x, [1, 1, bs, d]), k_desc=_desc(k8, [1, 1, bs, d]), v_desc=_desc(v8, [1, 1, d, bs] if pv8 else [1, 1, bs, d]),
                 o_desc=_desc(x, [1, 1, bs, d]), kb_desc=_desc(c, [1, bs, d]),
                 vb_desc=_desc(torch.empty(1, bs, d, dtype=dtype), [1, bs, d]),
                 hb_desc=_desc(torch.empty(1, d, d, dtype=dtype), [1, bs if hb_ring else d, d]))
    st, tst = stages or ring_depths(d, mode != "drop", pv8, query_group, alias)
    pipe = PIPELINE if pipeline is None else bool(pipeline)
    if pv_int8 and pipe:
        raise ValueError("pipeline: INT8 P·V runs in the sequential loop")
    constexprs = dict(BS=bs, D=d, C=bs, STAGES=st, TSTAGES=tst, MODE=MODE_IDS[mode], EVEN_K=even_k,
                      LOG2_BS=math.log2(bs), PIPELINE=pipe,
                      QK_INT8=qk_fmt == "int8", PV8=pv8,
                      PV_ACC=PV_ACCUMULATE[pv8] if pv_accumulate is None else bool(pv_accumulate),
                      PINGPONG=PINGPONG if pingpong is None else bool(pingpong),
                      LOOKAHEAD=LOOKAHEAD[pv8] if lookahead is None else int(lookahead), PV_INT8=pv_int8,
                      NC=query_group, TAIL_SLACK=TAIL_SLACK[dtype] if tail_max == "auto" else -1.0,
                      SLOT_META=slot_meta_for(precision, query_group, mode, even_k, pipe, slot_meta),
                      TAIL_ALIAS=alias, HB_RING=hb_ring, PDL=grid_level(),
                      EXACT_SLACK=EXACT_SLACK[dtype] if exact_max == "bound" else -1.0)
    if exact_max == "bound" and (pv8 or pipe):
        raise ValueError("exact_max='bound' needs P·V in the input dtype in the sequential loop")
    types = dict(kscale_ptr="*fp32", hscale_ptr="*fp32", kbound_ptr="*fp32", uidx_ptr="*i32", ucnt_ptr="*i32", bits_ptr="*i32", lse_ptr="*fp32",
                 alpha_ptr="*fp32", sig_ptr="*fp32", tau_ptr="*fp32", mu_ptr="*fp32", vcs_ptr="*i32", kcmax_ptr="*fp32",
                 qk_scale="fp32", scale="fp32", pw="fp32")
    sig = {}
    for name in _fp8_pair_kernel.arg_names:
        sig[name] = ("constexpr" if name in constexprs else mangle_type(descs[name]) if name in descs
                     else types.get(name, "i32"))
    src = GluonASTSource(fn=_fp8_pair_kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=MAX_REGS[query_group]))
