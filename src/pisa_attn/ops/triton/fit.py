"""The calibration fit of sampled query rows in a few kernel launches (reference:
:func:`pisa_attn.calibration._fit_sums`, the same sums in PyTorch).

A calibrated layer call fits the first-order weight on ``R`` sampled query rows against dense
attention, under one or two selection rules (top-k, covariance-aware). Per rule and query head it
needs four sums over the rows and channels: ``Σ⟨c, r⟩``, ``Σ‖c‖²``, ``Σ‖r‖²`` with ``r`` the dense
output less PISA's zeroth-order output and ``c`` the normalised first-order correction, and the
dense softmax mass on the tail. :func:`fit_sums` computes them with:

1. the Triton prepare stage on all keys (centroids, value means, H̄, and ``‖H_j − H̄‖`` when a
   rule is covariance-aware: the kernels' own statistics, what the sparse calls will use), then
   ``_select_kernel``, one program per (batch x head, sampled query block): the block's query mean
   (read from q in place), its float32 pooled scores against every key block and, per rule,
   ``keep ∪ top-n`` by a sort of int64 keys (ties to the lower block index), as byte masks;
2. ``_rows_kernel``, one program per (batch x head, row tile, key chunk): the rows' scores against
   the chunk on tensor cores and one online softmax (exp2 domain, one running maximum) carrying
   the dense numerator and denominator and, per rule, PISA's zeroth-order numerator and
   denominator (an exact block adds its ``P·V`` and ``ΣP``, a tail block its centroid term
   ``a_j·Σv_j`` and ``n_j·a_j`` with ``a_j = exp(s·q·k̄_j − m)``), the centroid mass ``Σ_U a_j``
   and the dense tail mass. ``P·V`` is one product per block whatever the rules: the selection is
   constant over a block, so a rule only decides where the product is added. The centroid score
   ``s·q·k̄_j`` is the mean of the block's token scores (linear in ``k``), taken from the score tile
   it already holds. q (at the rows' positions), k and v are read in place, once by this kernel;
   nothing of size ``rows x keys`` is stored;
3. ``_merge_kernel``, one program per (batch x head, row tile, channel slice): the chunks'
   partials rescaled to their common maximum and summed, then ``o⁰ = N⁰/D``,
   ``c = (Σ_U a_j)·s·q·H̄ / D`` (float32 ``H̄``), the dense output, and the four sums over its rows
   and channels, in float64 per program; one ``sum`` adds the programs up (no atomics: the sums
   are the same bit for bit on every call).

No host synchronisation and no host-to-device copy when the row-to-block map and the kept blocks
are on the device (:class:`pisa_attn.calibration.FitGraphs` keeps both there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import spec
from ...spec import COV_EPS
from ..launch import Launcher, spec_class
from ..selection import check_keep_blocks
from . import prepare as tprep
from ._common import LOG2E, check_token_strides, compile_sm90, interpreting, next_pow2, sm_count

# Programs of the rows kernel per multiprocessor (key chunks are cut to this many waves; more
# chunks mean more partials for the merge to read), warps and pipelining depth of its loads,
# channels per merge program. H100 (calibration_cost.py --tune, rows + merge kernels at the Wan /
# FLUX layer shapes): 2 waves, 4 warps 101 / 41 us; 1 wave 113 / 52; 4 waves 135 / 61; 8 warps slower.
FIT_TUNING = {"waves": 2, "warps": 4, "stages": 3, "merge_slice": 32}
SUMS_PER_RULE = 4  # cr, cc, rr, tail mass (the order of pisa_attn.calibration.SUMS)
MAX_KEY_BLOCKS = 4096  # the selection's sort keys hold a block index in 12 bits
_COV_EPS = tl.constexpr(COV_EPS)


@triton.jit
def _sort_key(score, cols, valid):
    """int64 keys in the order of ``score`` (float32), ties broken towards the lower block index
    (``cols``), every invalid column below every valid one: the top ``n`` keys are exactly ``n``."""
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving signed image of the floats
    key = tl.where(valid, key, -2147483648)
    return key.to(tl.int64) * 4096 + (4095 - cols)


@triton.jit
def _top(key, cols, n_sel):
    """Bool: the ``n_sel`` largest of the distinct ``key``s (``n_sel`` >= 1)."""
    ranked = tl.sort(key, descending=True)
    thr = tl.sum(tl.where(cols == n_sel - 1, ranked, 0), axis=0)
    return key >= thr


@triton.jit(do_not_specialize=["H", "HK", "NBLK", "NK", "LQB", "n_sel", "keep_sb", "keep_sh"])
def _select_kernel(
    q_ptr, start_ptr, kmean_t_ptr, hdev_ptr, keep_ptr, mask_ptr,
    sqb, sqh, sqr, sqd,
    H, HK, NBLK, NK, LQB, n_sel, scale, keep_sb, keep_sh,
    BS: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, NKP: tl.constexpr, NR: tl.constexpr,
    COV0: tl.constexpr, COV1: tl.constexpr, HAS_KEEP: tl.constexpr,
):  # fmt: skip
    # program (bh, sampled block i): the block's query mean q̄_i (float32, read from q in place:
    # rows [start_i, min(start_i + BS, LQB))), its pooled scores s·q̄_i·k̄_j against every key
    # block in float32, then per rule (covariance-aware: COV0, COV1) the exact set
    # keep ∪ top-n_sel of the others, as bytes mask[rule, b, h, i, j]
    pid = tl.program_id(0)
    i = pid % NBLK
    bh = pid // NBLK
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // (H // HK)
    cols = tl.arange(0, NKP)
    valid = cols < NK
    kt_base = kmean_t_ptr + (b * HK + hk) * D * NK
    start = tl.load(start_ptr + i)
    qrows = start + tl.arange(0, BS)
    qval = qrows < tl.minimum(start + BS, LQB)
    nq = (tl.minimum(start + BS, LQB) - start).to(tl.float32)
    q_base = q_ptr + b * sqb + h * sqh + qrows.to(tl.int64)[:, None] * sqr
    s = tl.zeros([NKP], tl.float32)
    for d0 in range(0, D, DC):
        dd = d0 + tl.arange(0, DC)
        qc = tl.sum(tl.load(q_base + dd[None, :] * sqd, mask=qval[:, None], other=0.0).to(tl.float32), axis=0) / nq
        kc = tl.load(kt_base + dd[:, None] * NK + cols[None, :], mask=valid[None, :], other=0.0)
        s += tl.sum(qc[:, None] * kc, axis=0)
    s = s * scale
    excl = cols < 0
    if HAS_KEEP:
        excl = tl.load(keep_ptr + b * keep_sb + h * keep_sh + cols, mask=valid, other=0) != 0
    cov = s
    if COV0 or COV1:
        hd = tl.load(hdev_ptr + (b * HK + hk) * NK + cols, mask=valid, other=1.0)
        cov = s + tl.log(hd + _COV_EPS)
    out = mask_ptr + (bh.to(tl.int64) * NBLK + i) * NK + cols
    score = cov if COV0 else s
    sel = _top(_sort_key(tl.where(excl, float("-inf"), score), cols, valid), cols, n_sel) | excl
    tl.store(out, sel.to(tl.uint8), mask=valid)
    if NR == 2:
        score = cov if COV1 else s
        sel = _top(_sort_key(tl.where(excl, float("-inf"), score), cols, valid), cols, n_sel) | excl
        tl.store(out + tl.num_programs(0).to(tl.int64) * NK, sel.to(tl.uint8), mask=valid)


@triton.jit
def _rule_bits(mask_ptr, row_off, j, rmask):
    """Whether key block ``j`` is exact for each row (its mask row starts at ``row_off``)."""
    return tl.load(mask_ptr + row_off + j, mask=rmask, other=0) != 0


@triton.jit
def _rule_step(n, den, asum, mr, e, pv, psum, bm, cj, vs, nj):
    """One key block into a rule's zeroth-order sums, shifted by the rule's own running maximum
    ``mr`` (its exact tokens' and tail centroids' scores), not the dense one: a token far above
    everything PISA sees would otherwise underflow every term of the rule. ``pv``/``psum`` are
    relative to the block's maximum ``bm``."""
    top = tl.where(e, bm, cj)  # the block's largest term in PISA: its tokens' maximum, or its centroid
    mr_new = tl.maximum(mr, top)
    beta = tl.exp2(mr - mr_new)
    g = tl.exp2(tl.minimum(bm - mr_new, 0.0))  # <= 1 where the block is exact (its only use)
    a = tl.exp2(tl.minimum(cj - mr_new, 0.0))  # <= 1 where it is in the tail
    n = n * beta[:, None] + tl.where(e[:, None], pv * g[:, None], a[:, None] * vs[None, :])
    den = den * beta + tl.where(e, psum * g, nj * a)
    asum = asum * beta + tl.where(e, 0.0, a)
    return n, den, asum, mr_new


@triton.jit(do_not_specialize=["H", "HK", "R", "LK", "NK", "NBLK", "RULE_STRIDE", "PER", "CHUNKS", "RTILES", "RP"])
def _rows_kernel(
    q_ptr, pos_ptr, k_ptr, v_ptr, vbar_ptr, mask_ptr, which_ptr, pv_ptr, ps_ptr,
    sqb, sqh, sqr, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    H, HK, R, LK, NK, NBLK, RULE_STRIDE, PER, CHUNKS, RTILES, RP, qk_scale,
    BS: tl.constexpr, D: tl.constexpr, RT: tl.constexpr, NR: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    c = pid % CHUNKS
    t = (pid // CHUNKS) % RTILES
    bh = pid // (CHUNKS * RTILES)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // (H // HK)
    offs_d = tl.arange(0, D)
    rows = t * RT + tl.arange(0, RT)
    rmask = rows < R
    qpos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)  # the rows' positions in q
    q = tl.load(q_ptr + b * sqb + h * sqh + qpos[:, None] * sqr + offs_d[None, :] * sqd, mask=rmask[:, None],
                other=0.0)
    blk = tl.load(which_ptr + rows, mask=rmask, other=0)
    blk_off = ((b * H + h) * NBLK + blk) * NK  # each row's mask row (rule 0; rule 1 RULE_STRIDE on)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    vbar_base = vbar_ptr + (b * HK + hk) * NK * D
    if F32:  # Triton's interpreter mis-evaluates low-precision tl.dot
        q = q.to(tl.float32)
    m = tl.full([RT], float("-inf"), tl.float32)
    z = tl.zeros([RT], tl.float32)
    acc = tl.zeros([RT, D], tl.float32)
    n0 = tl.zeros([RT, D], tl.float32)
    den0 = tl.zeros([RT], tl.float32)
    a0 = tl.zeros([RT], tl.float32)
    t0 = tl.zeros([RT], tl.float32)
    m0 = tl.full([RT], float("-inf"), tl.float32)
    n1 = tl.zeros([RT, D], tl.float32)
    den1 = tl.zeros([RT], tl.float32)
    a1 = tl.zeros([RT], tl.float32)
    t1 = tl.zeros([RT], tl.float32)
    m1 = tl.full([RT], float("-inf"), tl.float32)
    j0 = c * PER
    for j in range(j0, tl.minimum(NK, j0 + PER)):
        r = tl.arange(0, BS)
        keys = j * BS + r
        kval = keys < LK
        k0 = tl.cast(j * BS, tl.int64)  # int64: row x token stride passes 2^31 in sequence-first layouts
        kt = tl.load(k_base + k0 * skl + r[:, None] * skl + offs_d[None, :] * skd, mask=kval[:, None], other=0.0)
        vt = tl.load(v_base + k0 * svl + r[:, None] * svl + offs_d[None, :] * svd, mask=kval[:, None], other=0.0)
        if F32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt)) * qk_scale  # [RT, BS], log2 units
        nj = tl.minimum(LK - j * BS, BS).to(tl.float32)
        cj = tl.sum(tl.where(kval[None, :], s, 0.0), axis=1) / nj  # the centroid score: the tokens' mean
        s = tl.where(kval[None, :], s, float("-inf"))
        bm = tl.max(s, axis=1)  # the block's maximum: its P·V serves the dense and every rule's sums
        p = tl.exp2(s - bm[:, None])
        psum = tl.sum(p, axis=1)
        pv = tl.dot(p.to(vt.dtype), vt)
        m_new = tl.maximum(m, bm)
        alpha = tl.exp2(m - m_new)
        f = tl.exp2(bm - m_new)
        acc = acc * alpha[:, None] + pv * f[:, None]
        z = z * alpha + psum * f
        vs = tl.load(vbar_base + j * D + offs_d).to(tl.float32) * nj
        e = _rule_bits(mask_ptr, blk_off, j, rmask)
        n0, den0, a0, m0 = _rule_step(n0, den0, a0, m0, e, pv, psum, bm, cj, vs, nj)
        t0 = t0 * alpha + tl.where(e, 0.0, psum * f)  # the dense mass on the tail: the dense shift
        if NR == 2:
            e = _rule_bits(mask_ptr + RULE_STRIDE, blk_off, j, rmask)
            n1, den1, a1, m1 = _rule_step(n1, den1, a1, m1, e, pv, psum, bm, cj, vs, nj)
            t1 = t1 * alpha + tl.where(e, 0.0, psum * f)
        m = m_new
    # partials: scalars [BH, CHUNKS, RP, 2 + 4·NR] (m, z, then per rule its maximum, den, Σa under
    # it, and the tail mass under m) and vectors [BH, CHUNKS, RP, 1 + NR, D] (dense numerator, then
    # N⁰ per rule)
    NS: tl.constexpr = 2 + 4 * NR
    row_at = (bh.to(tl.int64) * CHUNKS + c) * RP + rows
    sp = ps_ptr + row_at * NS
    tl.store(sp, m, mask=rmask)
    tl.store(sp + 1, z, mask=rmask)
    tl.store(sp + 2, m0, mask=rmask)
    tl.store(sp + 3, den0, mask=rmask)
    tl.store(sp + 4, a0, mask=rmask)
    tl.store(sp + 5, t0, mask=rmask)
    vp = pv_ptr + row_at[:, None] * ((1 + NR) * D) + offs_d[None, :]
    tl.store(vp, acc, mask=rmask[:, None])
    tl.store(vp + D, n0, mask=rmask[:, None])
    if NR == 2:
        tl.store(sp + 6, m1, mask=rmask)
        tl.store(sp + 7, den1, mask=rmask)
        tl.store(sp + 8, a1, mask=rmask)
        tl.store(sp + 9, t1, mask=rmask)
        tl.store(vp + 2 * D, n1, mask=rmask[:, None])


@triton.jit
def _rule_sums(nv, den, asum, dense, qh, rmask):
    """(Σ⟨c, r⟩, Σ‖c‖², Σ‖r‖²) over a tile's valid rows, float64."""
    inv = 1.0 / tl.maximum(den, 1.1754943508222875e-38)
    res = dense - nv * inv[:, None]
    corr = (asum * inv)[:, None] * qh
    res = tl.where(rmask[:, None], res, 0.0)
    corr = tl.where(rmask[:, None], corr, 0.0)
    cr = tl.sum(tl.sum(corr * res, axis=1), axis=0).to(tl.float64)
    cc = tl.sum(tl.sum(corr * corr, axis=1), axis=0).to(tl.float64)
    rr = tl.sum(tl.sum(res * res, axis=1), axis=0).to(tl.float64)
    return cr, cc, rr


@triton.jit(do_not_specialize=["H", "HK", "R", "CHUNKS", "RTILES", "RP", "NPROG"])
def _merge_kernel(
    q_ptr, pos_ptr, hbar_ptr, pv_ptr, ps_ptr, out_ptr,
    sqb, sqh, sqr, sqd,
    H, HK, R, CHUNKS, RTILES, RP, NPROG, scale,
    D: tl.constexpr, DS: tl.constexpr, RT: tl.constexpr, NR: tl.constexpr,
):  # fmt: skip
    # program (bh, row tile t, channel slice g); its sums go to out[rule, sum, h, (b, t, g)]
    pid = tl.program_id(0)
    NG: tl.constexpr = D // DS
    g = pid % NG
    t = (pid // NG) % RTILES
    bh = pid // (NG * RTILES)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // (H // HK)
    NS: tl.constexpr = 2 + 4 * NR
    rows = t * RT + tl.arange(0, RT)
    rmask = rows < R
    offs_d = tl.arange(0, D)
    cols = g * DS + tl.arange(0, DS)
    base = bh.to(tl.int64) * CHUNKS * RP + rows  # row_at of chunk 0
    mx = tl.full([RT], float("-inf"), tl.float32)
    mx0 = tl.full([RT], float("-inf"), tl.float32)
    mx1 = tl.full([RT], float("-inf"), tl.float32)
    for c in range(CHUNKS):
        sp = ps_ptr + (base + c * RP) * NS
        mx = tl.maximum(mx, tl.load(sp, mask=rmask, other=0.0))
        mx0 = tl.maximum(mx0, tl.load(sp + 2, mask=rmask, other=0.0))
        if NR == 2:
            mx1 = tl.maximum(mx1, tl.load(sp + 6, mask=rmask, other=0.0))
    z = tl.zeros([RT], tl.float32)
    acc = tl.zeros([RT, DS], tl.float32)
    n0 = tl.zeros([RT, DS], tl.float32)
    den0 = tl.zeros([RT], tl.float32)
    a0 = tl.zeros([RT], tl.float32)
    t0 = tl.zeros([RT], tl.float32)
    n1 = tl.zeros([RT, DS], tl.float32)
    den1 = tl.zeros([RT], tl.float32)
    a1 = tl.zeros([RT], tl.float32)
    t1 = tl.zeros([RT], tl.float32)
    for c in range(CHUNKS):
        at = base + c * RP
        sp = ps_ptr + at * NS
        w = tl.exp2(tl.load(sp, mask=rmask, other=0.0) - mx)
        vp = pv_ptr + at[:, None] * ((1 + NR) * D) + cols[None, :]
        z += w * tl.load(sp + 1, mask=rmask, other=0.0)
        acc += w[:, None] * tl.load(vp, mask=rmask[:, None], other=0.0)
        w0 = tl.exp2(tl.load(sp + 2, mask=rmask, other=0.0) - mx0)
        den0 += w0 * tl.load(sp + 3, mask=rmask, other=1.0)
        a0 += w0 * tl.load(sp + 4, mask=rmask, other=0.0)
        t0 += w * tl.load(sp + 5, mask=rmask, other=0.0)
        n0 += w0[:, None] * tl.load(vp + D, mask=rmask[:, None], other=0.0)
        if NR == 2:
            w1 = tl.exp2(tl.load(sp + 6, mask=rmask, other=0.0) - mx1)
            den1 += w1 * tl.load(sp + 7, mask=rmask, other=1.0)
            a1 += w1 * tl.load(sp + 8, mask=rmask, other=0.0)
            t1 += w * tl.load(sp + 9, mask=rmask, other=0.0)
            n1 += w1[:, None] * tl.load(vp + 2 * D, mask=rmask[:, None], other=0.0)
    zi = 1.0 / tl.where(rmask, z, 1.0)
    dense = acc * zi[:, None]
    # s·q·H̄ on this channel slice (float32 H̄; TF32 products on a GPU)
    qpos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
    q = tl.load(q_ptr + b * sqb + h * sqh + qpos[:, None] * sqr + offs_d[None, :] * sqd, mask=rmask[:, None],
                other=0.0).to(tl.float32)
    hb = tl.load(hbar_ptr + (b * HK + hk) * D * D + offs_d[:, None] * D + cols[None, :])
    qh = tl.dot(q, hb) * scale
    slot = (b * RTILES + t) * NG + g
    cr, cc, rr = _rule_sums(n0, den0, a0, dense, qh, rmask)
    tm = tl.sum(tl.where(rmask & (g == 0), t0 * zi, 0.0), axis=0).to(tl.float64)
    o = out_ptr + h * NPROG + slot
    HP = H * NPROG
    tl.store(o, cr)
    tl.store(o + HP, cc)
    tl.store(o + 2 * HP, rr)
    tl.store(o + 3 * HP, tm)
    if NR == 2:
        cr, cc, rr = _rule_sums(n1, den1, a1, dense, qh, rmask)
        tm = tl.sum(tl.where(rmask & (g == 0), t1 * zi, 0.0), axis=0).to(tl.float64)
        o += 4 * HP
        tl.store(o, cr)
        tl.store(o + HP, cc)
        tl.store(o + 2 * HP, rr)
        tl.store(o + 3 * HP, tm)


_launch_select = Launcher(_select_kernel)
_launch_rows = Launcher(_rows_kernel)
_launch_merge = Launcher(_merge_kernel)


def row_tile(rows: int) -> int:
    """Query rows per program: a tensor-core tile of 16 to 64 rows."""
    return min(64, max(16, next_pow2(rows)))


def chunking(batch_heads: int, row_tiles: int, nk: int, device) -> tuple[int, int]:
    """``(key blocks per chunk, chunks)``: the rows kernel's programs fill ``FIT_TUNING["waves"]``
    waves of the GPU, every chunk non-empty."""
    want = max(1, -(-FIT_TUNING["waves"] * sm_count(device) // max(1, batch_heads * row_tiles)))
    per = max(1, -(-nk // want))
    return per, -(-nk // per)


def select_masks(q: Tensor, starts: Tensor, kmean: Tensor, hdev: Tensor | None, keep_blocks: Tensor | None, *,
                 rules: tuple[bool, ...], n_select: int, scale: float, block_size: int) -> Tensor:
    """Exact-set masks ``[len(rules), B, H, Nq, Nk]`` uint8 of ``Nq`` query blocks of ``q``
    ``[B, H, Lq, D]`` (any strides, read in place: block ``i`` is rows ``[starts[i],
    min(starts[i] + block_size, Lq))``, ``starts`` int32 ``[Nq]`` on the device) against the
    prepare stage's ``kmean`` ``[B, Hk, Nk, D]`` (its transposed view of ``[B, Hk, D, Nk]``
    storage) per selection rule: ``keep ∪ top-n_select`` of the float32 pooled scores of the
    blocks' float32 query means (``+ log(hdev + ε)`` for a covariance-aware rule), ties to the
    lower block index. The reference's :func:`pisa_attn.ops.reference.select_blocks` up to float32
    rounding of the means and scores; one launch for both rules."""
    b, h, lq, d = q.shape
    nblk = starts.shape[0]
    hk, nk = kmean.shape[1], kmean.shape[2]
    dev = q.device
    nr = len(rules)
    if nk > MAX_KEY_BLOCKS:
        raise ValueError(f"kmean: {nk} key blocks, more than the fit kernel's {MAX_KEY_BLOCKS}")
    if any(rules) and hdev is None:
        raise ValueError("hdev: a covariance-aware rule needs the blocks' ||H_j - H̄||")
    mask = torch.empty(nr, b, h, nblk, nk, device=dev, dtype=torch.uint8)
    # its bytes are read as flags: any other dtype or shape would be read wrongly, not refused
    keep_blocks = check_keep_blocks(keep_blocks, b, h, nk, dev)
    if keep_blocks is not None:
        keep = keep_blocks.to(dev, non_blocking=True).view(torch.uint8)
        keep = keep if keep.stride(-1) == 1 else keep.contiguous()
        ksb = keep.stride(0) if keep.shape[0] > 1 else 0
        ksh = keep.stride(1) if keep.shape[1] > 1 else 0
    else:
        keep, ksb, ksh = mask, 0, 0  # never read (HAS_KEEP=False)
    hd = hdev if hdev is not None else mask  # never read without a covariance-aware rule
    nkp = max(16, next_pow2(nk))
    # channels per step: the [D-slice, Nk] centroid tile and the [block, D-slice] query tile
    dc = max(1, min(d, 8192 // max(nkp, block_size)))
    cov = (bool(rules[0]), bool(rules[-1]))
    kt = kmean.transpose(2, 3)
    if not kt.is_contiguous():
        kt = kt.contiguous()
    starts = starts.to(torch.int32) if starts.dtype != torch.int32 else starts
    n_sel = min(max(1, int(n_select)), nk)
    args = (q, starts, kt, hd, keep, mask, *q.stride(), h, hk, nblk, nk, lq, n_sel, float(scale), ksb, ksh)
    _launch_select((block_size, d, dc, nkp, nr, cov, keep_blocks is not None, spec_class(*args[:10])),
                   (b * h * nblk,), args,
                   dict(BS=block_size, D=d, DC=dc, NKP=nkp, NR=nr, COV0=cov[0], COV1=cov[1],
                        HAS_KEEP=keep_blocks is not None), num_warps=4)
    return mask


def fit_sums(q: Tensor, rows: Tensor, starts: Tensor, which: Tensor, k: Tensor, v: Tensor,
             keep_blocks: Tensor | None, *, density: float, rules: tuple[bool, ...], scale: float, block_size: int,
             q_blocks: Tensor | None = None) -> Tensor:
    """The sums of :func:`pisa_attn.calibration._fit_sums` for ``"hybrid"``: ``[len(rules), 4, H]``
    float64, per rule (``covariance_aware`` False/True) :data:`pisa_attn.calibration.SUMS`.

    Every index is an int32 tensor on the device; q, k and v are read in place (nothing gathered):
    ``q`` ``[B, H, Lq, D]`` any strides, the fitted rows are ``q[:, :, rows]`` (``rows`` ``[R]``);
    the sampled query blocks (their selection) start at rows ``starts`` ``[Nb]`` of ``q_blocks``
    (default ``q``; each block ``block_size`` rows or up to the end); ``which`` ``[R]``: each
    row's index into ``starts``; ``k``/``v`` ``[B, Hk, Lk, D]`` any strides; ``keep_blocks`` bool
    ``[Nk]`` or ``[B|1, H|1, Nk]``. float16/bfloat16, head dims and block sizes of the Triton
    kernels (CUDA, or CPU under Triton's interpreter)."""
    if len(rules) not in (1, 2) or len(set(rules)) != len(rules):
        raise ValueError(f"rules must be one or two distinct selection rules, got {rules!r}")
    b, h, _, d = q.shape
    r = rows.shape[0]
    hk, lk = k.shape[1], k.shape[2]
    check_token_strides(k=k, v=v)  # q's rows are addressed in int64
    bs = block_size
    dev = q.device
    nk = spec.num_blocks(lk, bs)
    if nk > MAX_KEY_BLOCKS:
        raise ValueError(f"k: {nk} key blocks, more than the fit kernel's {MAX_KEY_BLOCKS}")
    # key statistics only: the query block means are the selection kernel's
    st = tprep.prepare(q[:, :, :0], k, v, bs, with_hdev=any(rules))
    n_sel = min(spec.num_selected(density, nk), nk)
    nr = len(rules)
    nblk = starts.shape[0]
    mask = select_masks(q if q_blocks is None else q_blocks, starts, st.kmean, st.hdev, keep_blocks, rules=rules,
                        n_select=n_sel, scale=scale, block_size=bs)
    rt = row_tile(r)
    rtiles = -(-r // rt)
    rp = rtiles * rt
    per, chunks = chunking(b * h, rtiles, nk, dev)
    f32 = dict(device=dev, dtype=torch.float32)
    ps = torch.empty(b * h * chunks * rp * (2 + 4 * nr), **f32)
    pv = torch.empty(b * h * chunks * rp * (1 + nr) * d, **f32)
    rows = rows.to(torch.int32) if rows.dtype != torch.int32 else rows
    which = which.to(torch.int32) if which.dtype != torch.int32 else which
    interp = interpreting()
    strides = (*q.stride(), *k.stride(), *v.stride())
    args = (q, rows, k, v, st.vbar, mask, which, pv, ps, *strides,
            h, hk, r, lk, nk, nblk, b * h * nblk * nk, per, chunks, rtiles, rp, float(scale) * LOG2E)
    _launch_rows((bs, d, rt, nr, FIT_TUNING["warps"], FIT_TUNING["stages"], spec_class(q, k, v, *strides)),
                 (b * h * rtiles * chunks,), args, dict(BS=bs, D=d, RT=rt, NR=nr, F32=interp),
                 num_warps=FIT_TUNING["warps"], num_stages=FIT_TUNING["stages"])
    ds = min(FIT_TUNING["merge_slice"], d)
    nprog = b * rtiles * (d // ds)
    out = torch.empty(nr, SUMS_PER_RULE, h, nprog, device=dev, dtype=torch.float64)
    margs = (q, rows, st.hbar, pv, ps, out, *q.stride(), h, hk, r, chunks, rtiles, rp, nprog, float(scale))
    _launch_merge((d, ds, rt, nr, spec_class(q, *q.stride())), (b * h * rtiles * (d // ds),), margs,
                  dict(D=d, DS=ds, RT=rt, NR=nr), num_warps=4)
    return out.sum(-1)


def compile_for_sm90(head_dim: int = 128, rows: int = 32, rules: int = 2, dtype: torch.dtype = torch.bfloat16,
                     key_blocks: int = 512) -> dict:
    """Compile the select, rows and merge kernels for sm_90 without a GPU (Triton ships
    ``ptxas``): what a CPU CI runs so that a kernel that does not build fails there. Returns
    ``{name: Triton's compiled kernel}``."""
    lp = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    d, rt, nr = head_dim, row_tile(rows), rules
    nkp = max(16, next_pow2(key_blocks))
    kernels = {
        "select": (_select_kernel, dict(q_ptr=lp, start_ptr="*i32", kmean_t_ptr="*fp32", hdev_ptr="*fp32",
                                        keep_ptr="*u8", mask_ptr="*u8", scale="fp32"),
                   dict(BS=64, D=d, DC=max(1, min(d, 8192 // max(nkp, 64))), NKP=nkp, NR=nr, COV0=False,
                        COV1=nr == 2, HAS_KEEP=True), 4, 3),
        "rows": (_rows_kernel, dict(q_ptr=lp, pos_ptr="*i32", k_ptr=lp, v_ptr=lp, vbar_ptr=lp, mask_ptr="*u8",
                                    which_ptr="*i32", pv_ptr="*fp32", ps_ptr="*fp32", qk_scale="fp32"),
                 dict(BS=64, D=d, RT=rt, NR=nr, F32=False), FIT_TUNING["warps"], FIT_TUNING["stages"]),
        "merge": (_merge_kernel, dict(q_ptr=lp, pos_ptr="*i32", hbar_ptr="*fp32", pv_ptr="*fp32", ps_ptr="*fp32",
                                      out_ptr="*fp64", scale="fp32"),
                  dict(D=d, DS=min(FIT_TUNING["merge_slice"], d), RT=rt, NR=nr), 4, 3),
    }
    return {name: compile_sm90(fn, types, constexprs, num_warps=warps, num_stages=stages)
            for name, (fn, types, constexprs, warps, stages) in kernels.items()}
