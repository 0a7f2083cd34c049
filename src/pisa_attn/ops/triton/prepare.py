"""Prepare phase: the block statistics PISA needs, from one read of q, k and v.

1. ``_stats_kernel``, one launch with two kinds of programs:

   * kv programs (a kv head and a run of its key blocks): per block, the centroid ``k̄_j`` (float32,
     stored transposed ``[D, Nk]``: the selection GEMM's right operand), the value mean
     ``V̂_j / n_j`` (input dtype) and ``H_j = (K_j − 1·k̄_j)ᵀ V_j``; the run's ``Σ H_j``, its largest
     ``|k̄|`` per channel and its count of blocks are stored as per-program partials (no atomics,
     nothing to zero per call);
   * q programs (a query head and a run of its query blocks): the query means selection reads.

   Every block sum is a tensor-core product with a constant operand: the centred keys
   ``Kᵀ·(I − J/BS)`` (``J`` all ones; a ragged block ``Kᵀ·I − Kᵀ·J/n_j``), and 16 columns of
   ``Kᵀ·J``, ``Vᵀ·J`` and ``Qᵀ·J`` (each column the block's sum). The loop therefore holds no
   reduction across the token axis, which would put a block-wide barrier into every step (the
   earlier one-pass kernel, notes/kernel-notes.md). Only reductions along the accumulator's
   columns remain, which stay inside a warp. The centred keys are summed in float32 from exact
   products and rounded once to the input dtype before ``(K − k̄)ᵀ·V``: rounding the
   centred keys instead of subtracting ``k̄ᵀV̂`` from ``KᵀV`` keeps keys with a large common
   component accurate (H̄ to about 2e-3 relative in bfloat16, the precision of its input-dtype
   copy the attention kernels read).
2. ``_finish_kernel`` (per kv head, one program per slice of rows): ``H̄`` from the partials (the
   mean over the blocks not in ``hbar_exclude``; ``0`` when every block is excluded), its
   input-dtype copy divided by one power of two per head (``hscale``: its largest entry at most
   ``2^14``, from a bound every program of the head computes alike, so float16 ``H̄`` cannot
   overflow when the keys and values share a large component), the tail scan's float16 centroids divided by one power of two per head
   (its largest ``|k̄|`` lands in ``[2^13, 2^14)``: no overflow whatever the magnitude, 11 mantissa
   bits, one scalar for the attention kernels to fold back), and ``kbound``, the per-channel
   ``max_j |k̄_jd|`` (the Hopper kernel bounds every tail score with it before the scan).

With ``quant=`` (a low precision) the kv programs also take the per-channel ``max |v|``, the finish
reduces it, and the quantisation pass of :mod:`.quantize` (``μ``, then the copies) follows.

Covariance-aware selection adds ``_hdev_kernel`` (``||H_j − H̄||_F``, a second read of k and v: it
needs ``H̄`` first; the expansion ``||H_j||² − 2⟨H_j, H̄⟩ + ||H̄||²`` saves no pass and cancels
badly when ``H_j ≈ H̄``).

:func:`stats_workspace` allocates every buffer once; ``prepare(..., ws=)`` then allocates nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...spec import PRODUCT_FORMATS
from ..launch import Launcher, spec_class
from ..stages import slice_blocks
from . import quantize as _quantize
from ._common import check_token_strides, compile_sm90, interpreting, sm_count
from .grid import await_prior_grid, grid_dependency
from .grid import level as grid_level

# Tunables, measured by benchmarks/stats_select_bench.py (H100): programs of one launch fill this
# many waves of the GPU (one below ``short_blocks_per_sm`` key-block equivalents per SM: 1 wave was
# fastest at 4K and 8K, 2-4 at 32K and 64K); software-pipelining depth of the loads (4 beat 3 and
# 2); bytes of q per step of a q program; waves of the hdev pass's equal runs of key blocks (one:
# H100, 4K-8K 12 % faster than runs that stop at a head's end, the same from 16K).
STATS_TUNING = {"waves": 2, "short_blocks_per_sm": 64, "stages": 4, "q_tile_bytes": 32768, "hdev_waves": 1}
F16_MAX = tl.constexpr(65504.0)


@triton.jit
def _centred_block(k_base, v_base, j, LK, skl, skd, svl, svd, eye, ones, centre,
                   BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr, CLAMP: tl.constexpr, FULL: tl.constexpr):
    """Block ``j`` of one kv head (``FULL``: of ``BS`` keys; else the ragged last one): (``(K_j −
    1·k̄_j)ᵀ`` ``[D, BS]`` in the dot dtype, ``K_jᵀ`` ``[D, BS]`` as loaded, ``V_j`` ``[BS, D]``,
    ``n_j``). Padded rows are 0, so they add nothing to any product."""
    r = tl.arange(0, BS)
    rows = j * BS + r
    offs_d = tl.arange(0, D)
    # the block's first row in int64: row x token stride passes 2^31 in sequence-first layouts
    k_blk = k_base + tl.cast(j * BS, tl.int64) * skl
    v_blk = v_base + tl.cast(j * BS, tl.int64) * svl
    if FULL:
        kt = tl.load(k_blk + r[:, None] * skl + offs_d[None, :] * skd)
        vt = tl.load(v_blk + r[:, None] * svl + offs_d[None, :] * svd)
    else:
        valid = (rows < LK)[:, None]
        kt = tl.load(k_blk + r[:, None] * skl + offs_d[None, :] * skd, mask=valid, other=0.0)
        vt = tl.load(v_blk + r[:, None] * svl + offs_d[None, :] * svd, mask=valid, other=0.0)
    if F32:  # Triton 3.9's interpreter mis-evaluates low-precision tl.dot
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    n = tl.minimum(LK - j * BS, BS).to(tl.float32)
    k_t = tl.trans(kt)
    # A full block: one product by I − J/BS, whose entries (1 − 1/BS, −1/BS) are exact in the dot
    # dtype up to BS = 256 (a power of two); its products are exact and summed in float32. A ragged
    # one: the keys and their sum (exact products by 1), then the subtraction.
    if FULL and BS <= 256:
        kc = tl.dot(k_t, centre)
    else:
        kc = tl.dot(k_t, eye) - tl.dot(k_t, ones) / n
    if CLAMP:  # float16 inputs: |k − k̄| may exceed float16's range by up to 2x
        kc = tl.minimum(tl.maximum(kc, -F16_MAX), F16_MAX)
    return kc.to(kt.dtype), k_t, vt, n


@triton.jit
def _consts(dtype, BS: tl.constexpr, QS: tl.constexpr):
    r = tl.arange(0, BS)
    diag = r[:, None] == r[None, :]
    eye = diag.to(dtype)
    ones = tl.full([BS, BS], 1.0, dtype)
    ones_n = tl.full([BS, QS], 1.0, dtype)
    centre = (diag.to(tl.float32) - 1.0 / BS).to(dtype)  # I − J/BS
    return eye, ones, ones_n, centre


@triton.jit
def _kv_block(k_base, v_base, excl_ptr, kmean_ptr, vbar_ptr, j, b, h, bh, LK, NK, skl, skd, svl, svd, ex_sb, ex_sh,
              eye, ones, ones_n, centre, hacc, kmax, count, vabs,
              BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr, CLAMP: tl.constexpr, HAS_EXCL: tl.constexpr,
              VMAX: tl.constexpr, FULL: tl.constexpr, KMAX: tl.constexpr):
    """Key block ``j`` of a kv program: its centroid and value mean stored, its ``H_j`` and bounds
    into the program's running (``Σ H_j``, largest ``|k̄|``, count, ``|v|`` maxima or, with KMAX,
    ``|k|`` maxima ``[D, BS]``)."""
    offs_d = tl.arange(0, D)
    kc, k_t, vt, n = _centred_block(k_base, v_base, j, LK, skl, skd, svl, svd, eye, ones, centre,
                                    BS, D, F32, CLAMP, FULL)
    if VMAX:
        vabs = tl.maximum(vabs, tl.abs(vt.to(tl.float32)))
    if KMAX:
        vabs = tl.maximum(vabs, tl.abs(k_t.to(tl.float32)))
    km = tl.max(tl.dot(k_t, ones_n), axis=1) / n  # every column holds the sum: a max is exact
    tl.store(kmean_ptr + bh.to(tl.int64) * D * NK + offs_d * NK + j, km)
    kmax = tl.maximum(kmax, tl.abs(km))
    v_mean = tl.max(tl.dot(tl.trans(vt), ones_n), axis=1) / n
    tl.store(vbar_ptr + (bh.to(tl.int64) * NK + j) * D + offs_d, v_mean.to(vbar_ptr.dtype.element_ty))
    if HAS_EXCL:
        w = (tl.load(excl_ptr + b * ex_sb + h * ex_sh + j) == 0).to(tl.float32)
        kc = (kc * w).to(kc.dtype)
        count += w
    else:
        count += 1.0
    hacc = tl.dot(kc, vt, hacc)
    return hacc, kmax, count, vabs


@triton.jit(do_not_specialize=["H", "HK", "LQ", "LK", "NQS", "NQT", "NK", "KV_PER", "KV_CHUNKS", "Q_PER",
                               "Q_CHUNKS", "N_KV", "ex_sb", "ex_sh"])
def _stats_kernel(
    q_ptr, k_ptr, v_ptr, excl_ptr,
    qmean_ptr, kmean_ptr, vbar_ptr, part_h_ptr, part_s_ptr, part_r_ptr, part_v_ptr,
    sqb, sqh, sql, sqd,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    ex_sb, ex_sh,
    H, HK, LQ, LK, NQS, NQT, NK, KV_PER, KV_CHUNKS, Q_PER, Q_CHUNKS, N_KV,
    BS: tl.constexpr, QB: tl.constexpr, QT: tl.constexpr, D: tl.constexpr, F32: tl.constexpr,
    CLAMP: tl.constexpr, HAS_EXCL: tl.constexpr, VMAX: tl.constexpr, KMAX: tl.constexpr, PDL: tl.constexpr = 0,
):
    await_prior_grid(PDL)
    pid = tl.program_id(0)
    dt = tl.float32 if F32 else k_ptr.dtype.element_ty
    eye, ones, ones_n, centre = _consts(dt, BS, 16)
    offs_d = tl.arange(0, D)
    if pid < N_KV:
        c = pid % KV_CHUNKS
        bh = pid // KV_CHUNKS
        b = (bh // HK).to(tl.int64)
        h = (bh % HK).to(tl.int64)
        k_base = k_ptr + b * skb + h * skh
        v_base = v_ptr + b * svb + h * svh
        hacc = tl.zeros([D, D], dtype=tl.float32)
        kmax = tl.zeros([D], dtype=tl.float32)
        count = 0.0
        # elementwise max |v| (or |k|, transposed), reduced once at the end
        if KMAX:
            vabs = tl.zeros([D, BS], dtype=tl.float32)
        else:
            vabs = tl.zeros([BS, D], dtype=tl.float32)
        j0 = c * KV_PER
        j1 = tl.minimum(NK, j0 + KV_PER)
        n_full = LK // BS  # a ragged last block runs after the loop, which then has no mask
        for j in range(j0, tl.minimum(j1, n_full)):
            hacc, kmax, count, vabs = _kv_block(k_base, v_base, excl_ptr, kmean_ptr, vbar_ptr, j, b, h, bh, LK, NK,
                                                skl, skd, svl, svd, ex_sb, ex_sh, eye, ones, ones_n, centre,
                                                hacc, kmax, count, vabs, BS, D, F32, CLAMP, HAS_EXCL, VMAX, True,
                                                KMAX)
        if j1 > n_full:
            hacc, kmax, count, vabs = _kv_block(k_base, v_base, excl_ptr, kmean_ptr, vbar_ptr, n_full, b, h, bh, LK,
                                                NK, skl, skd, svl, svd, ex_sb, ex_sh, eye, ones, ones_n, centre,
                                                hacc, kmax, count, vabs, BS, D, F32, CLAMP, HAS_EXCL, VMAX, False,
                                                KMAX)
        part = bh.to(tl.int64) * KV_CHUNKS + c
        tl.store(part_h_ptr + part * D * D + offs_d[:, None] * D + offs_d[None, :], hacc)
        tl.store(part_s_ptr + part * 3, tl.max(kmax, axis=0))
        tl.store(part_s_ptr + part * 3 + 1, count)
        # max |Σ H_j| of the run: summed over runs and divided by the count, a bound of max |H̄|
        # every finish program can read (H̄'s scale, below)
        tl.store(part_s_ptr + part * 3 + 2, tl.max(tl.max(tl.abs(hacc), axis=1), axis=0))
        tl.store(part_r_ptr + part * D + offs_d, kmax)
        if VMAX:
            tl.store(part_v_ptr + part * D + offs_d, tl.max(vabs, axis=0))
        if KMAX:
            tl.store(part_v_ptr + part * D + offs_d, tl.max(vabs, axis=1))
    else:
        # QT rows per step (several query blocks of QB rows): one tile load, and the block sums as
        # one product with a block-diagonal ones matrix, column c the sum of block c of the tile.
        p = pid - N_KV
        c = p % Q_CHUNKS
        bh = p // Q_CHUNKS
        q_base = q_ptr + (bh // H).to(tl.int64) * sqb + (bh % H).to(tl.int64) * sqh
        t = tl.arange(0, QT)
        t64 = t.to(tl.int64)  # a tile of up to 1024 rows: its row offsets in int64 too
        blk = tl.arange(0, 16)
        jb = ((t[:, None] // QB) == blk[None, :]).to(dt)
        i0 = c * Q_PER
        for i in range(i0, tl.minimum(NQT, i0 + Q_PER)):
            rows = i * QT + t
            qt = tl.load(q_base + (i * QT + t64)[:, None] * sql + offs_d[None, :] * sqd, mask=(rows < LQ)[:, None],
                         other=0.0)
            acc = tl.dot(tl.trans(qt.to(dt)), jb)  # [D, 16]
            qi = i * (QT // QB) + blk
            n = tl.maximum(tl.minimum(LQ - qi * QB, QB), 1).to(tl.float32)  # columns past the end: unused
            ok = (blk < QT // QB) & (qi < NQS)
            tl.store(qmean_ptr + (bh.to(tl.int64) * NQS + qi[None, :]) * D + offs_d[:, None], acc / n[None, :],
                     mask=ok[None, :])


@triton.jit(do_not_specialize=["NK", "KV_CHUNKS", "F_PER"])
def _finish_kernel(
    part_h_ptr, part_s_ptr, part_r_ptr, part_v_ptr, kmean_ptr, hbar_ptr, hbar_lp_ptr, hscale_ptr, kbar_ptr,
    kscale_ptr, kbound_ptr, vmax_ptr,
    NK, KV_CHUNKS, F_PER,
    D: tl.constexpr, RB: tl.constexpr, TJ: tl.constexpr, VMAX: tl.constexpr, KMAX: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    # Program (head, g): rows g·RB .. of H̄ from the partials, and key blocks g·F_PER .. of the
    # float16 centroids (D // RB programs per head share the work).
    await_prior_grid(PDL)
    pid = tl.program_id(0)
    g = pid % (D // RB)
    bh = (pid // (D // RB)).to(tl.int64)
    offs_d = tl.arange(0, D)
    kmax = 0.0
    hmax = 0.0
    count = 0.0
    for c in range(KV_CHUNKS):
        kmax = tl.maximum(kmax, tl.load(part_s_ptr + (bh * KV_CHUNKS + c) * 3))
        count += tl.load(part_s_ptr + (bh * KV_CHUNKS + c) * 3 + 1)
        hmax += tl.load(part_s_ptr + (bh * KV_CHUNKS + c) * 3 + 2)
    ks = tl.where(kmax > 0, tl.exp2(tl.ceil(tl.log2(kmax)) - 14.0), 1.0)
    hmax = hmax / tl.maximum(count, 1.0)  # >= max |H̄|, the same in every program of the head
    hs = tl.where((hmax > 0) & (hmax < 3e38), tl.exp2(tl.ceil(tl.log2(hmax)) - 14.0), 1.0)
    if g == 0:
        tl.store(kscale_ptr + bh, ks)
        tl.store(hscale_ptr + bh, hs)
        kb = tl.zeros([D], dtype=tl.float32)
        for c in range(KV_CHUNKS):
            kb = tl.maximum(kb, tl.load(part_r_ptr + (bh * KV_CHUNKS + c) * D + offs_d))
        tl.store(kbound_ptr + bh * D + offs_d, kb)
        if VMAX:  # the bits of max |v| per channel, as the quantisation pass reads them
            vm = tl.zeros([D], dtype=tl.float32)
            for c in range(KV_CHUNKS):
                vm = tl.maximum(vm, tl.load(part_v_ptr + (bh * KV_CHUNKS + c) * D + offs_d))
            tl.store(vmax_ptr + bh * D + offs_d, vm.to(tl.int32, bitcast=True))
        if KMAX:  # max |k| per channel (the exact loop's bound of its scores), float32
            km = tl.zeros([D], dtype=tl.float32)
            for c in range(KV_CHUNKS):
                km = tl.maximum(km, tl.load(part_v_ptr + (bh * KV_CHUNKS + c) * D + offs_d))
            tl.store(vmax_ptr + bh * D + offs_d, km)
    rows = g * RB + tl.arange(0, RB)
    tile = rows[:, None] * D + offs_d[None, :]
    hsum = tl.zeros([RB, D], dtype=tl.float32)
    for c in range(KV_CHUNKS):
        hsum += tl.load(part_h_ptr + (bh * KV_CHUNKS + c) * D * D + tile)
    hbar = hsum / tl.maximum(count, 1.0)  # nothing counted: the sum is 0, and so is H̄
    tl.store(hbar_ptr + bh * D * D + tile, hbar)
    hbar_lp = hbar / hs  # |H̄ / hs| <= 2^14: in float16's range whatever the keys' and values' scale
    if hbar_lp_ptr.dtype.element_ty == tl.float16:
        # saturated, not inf, should the bound itself have overflowed (float32 H̄ past 3e38)
        hbar_lp = tl.minimum(tl.maximum(hbar_lp, -65504.0), 65504.0)
    tl.store(hbar_lp_ptr + bh * D * D + tile, hbar_lp.to(hbar_lp_ptr.dtype.element_ty))
    cols = tl.arange(0, TJ)
    j0 = g * F_PER
    for t in range(j0, tl.minimum(NK, j0 + F_PER), TJ):
        j = t + cols
        m = (j < NK) & (j < j0 + F_PER)
        km = tl.load(kmean_ptr + bh * D * NK + offs_d[:, None] * NK + j[None, :], mask=m[None, :], other=0.0)
        tl.store(kbar_ptr + (bh * NK + j[None, :]) * D + offs_d[:, None], (km / ks).to(tl.float16), mask=m[None, :])


@triton.jit(do_not_specialize=["HK", "LK", "NK", "PER", "TOTAL"])
def _hdev_kernel(
    k_ptr, v_ptr, hbar_ptr, hdev_ptr,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    HK, LK, NK, PER, TOTAL,
    BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr = 0,
):
    """``||H_j − H̄||_F`` of the key blocks ``[pid·PER, (pid + 1)·PER)`` of the launch, numbered
    head after head (``bh·NK + j``; ``PER ≤ NK``). A run may go on into the next head: the runs
    split the launch evenly whatever the number of heads, so one wave leaves no SM idle."""
    await_prior_grid(PDL)
    pid = tl.program_id(0)
    f0 = pid * PER
    f1 = tl.minimum(TOTAL, f0 + PER)
    bh = f0 // NK
    j0 = f0 - bh * NK
    _hdev_run(k_ptr, v_ptr, hbar_ptr, hdev_ptr, skb, skh, skl, skd, svb, svh, svl, svd, HK, LK, NK, bh, j0,
              tl.minimum(NK, j0 + f1 - f0), BS, D, F32, CLAMP)
    if j0 + f1 - f0 > NK:  # the run's rest, in the next head (two loops one after the other, not
        # nested: a loop over heads around the block loop made ptxas spill H̄)
        _hdev_run(k_ptr, v_ptr, hbar_ptr, hdev_ptr, skb, skh, skl, skd, svb, svh, svl, svd, HK, LK, NK, bh + 1, 0,
                  j0 + f1 - f0 - NK, BS, D, F32, CLAMP)


@triton.jit
def _hdev_run(k_ptr, v_ptr, hbar_ptr, hdev_ptr, skb, skh, skl, skd, svb, svh, svl, svd, HK, LK, NK, bh, j0, j1,
              BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr, CLAMP: tl.constexpr):
    """Key blocks ``[j0, j1)`` of head ``bh`` (batch x kv head) against its H̄."""
    dt = tl.float32 if F32 else k_ptr.dtype.element_ty
    eye, ones, ones_n, centre = _consts(dt, BS, 16)
    offs_d = tl.arange(0, D)
    b = (bh // HK).to(tl.int64)
    h = (bh % HK).to(tl.int64)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    hb = tl.load(hbar_ptr + bh.to(tl.int64) * D * D + offs_d[:, None] * D + offs_d[None, :])
    n_full = LK // BS  # a ragged last block after the loop, as in the stats launch
    for j in range(j0, tl.minimum(j1, n_full)):
        _hdev_block(k_base, v_base, hdev_ptr, hb, j, bh, LK, NK, skl, skd, svl, svd, eye, ones, centre,
                    BS, D, F32, CLAMP, True)
    if j1 > n_full:
        _hdev_block(k_base, v_base, hdev_ptr, hb, n_full, bh, LK, NK, skl, skd, svl, svd, eye, ones, centre,
                    BS, D, F32, CLAMP, False)


@triton.jit
def _hdev_block(k_base, v_base, hdev_ptr, hb, j, bh, LK, NK, skl, skd, svl, svd, eye, ones, centre,
                BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr, CLAMP: tl.constexpr, FULL: tl.constexpr):
    """``||H_j − H̄||_F`` of key block ``j`` into ``hdev``."""
    kc, k_t, vt, n = _centred_block(k_base, v_base, j, LK, skl, skd, svl, svd, eye, ones, centre,
                                    BS, D, F32, CLAMP, FULL)
    diff = tl.dot(kc, vt) - hb
    tl.store(hdev_ptr + bh.to(tl.int64) * NK + j, tl.sqrt(tl.sum(tl.sum(diff * diff, axis=1), axis=0)))


def lowp_hbar(hbar: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """H̄ ``[B, Hk, D, D]`` float32 as the attention kernels read it: ``(H̄ / hscale`` in ``dtype``,
    ``hscale`` ``[B, Hk]`` float32``)``, one power of two per head that puts its largest entry in
    ``[2^13, 2^14)``. The finish kernel takes its power from a bound of ``max |H̄|`` (the runs'
    ``max |Σ H_j|`` summed), so it may be a few powers higher; the products are the same either
    way in float16's normal range. float16 is saturated should H̄ itself pass float32's range."""
    amax = hbar.abs().amax(dim=(-2, -1)).float()
    ok = (amax > 0) & (amax < 3e38)
    hs = torch.where(ok, torch.exp2(torch.ceil(torch.log2(torch.where(ok, amax, 1.0))) - 14.0), 1.0)
    lp = hbar / hs[..., None, None]
    if dtype == torch.float16:
        lp = lp.clamp(-65504.0, 65504.0)
    return lp.to(dtype), hs


@dataclass
class Stats:
    """Outputs of the prepare stage (``[B, H|Hk, N, D]`` contiguous unless noted)."""

    qmean: Tensor | None  # [B, H, Nq, D] float32
    kmean: Tensor | None  # [B, Hk, Nk, D] float32, a transposed view of [B, Hk, D, Nk] storage
    kbar: Tensor  # [B, Hk, Nk, D] float16: k̄_j / kscale, the tail scan's operand
    kscale: Tensor  # [B, Hk] float32: the power of two each head's ``kbar`` was divided by
    vbar: Tensor  # [B, Hk, Nk, D] input dtype: value block means (V̂_j / n_j)
    hbar: Tensor | None  # [B, Hk, D, D] float32 (None after a lean prepare)
    hbar_lp: Tensor  # [B, Hk, D, D] input dtype: H̄ / hscale, the attention kernels' operand for q·H̄
    hscale: Tensor  # [B, Hk] float32: the power of two each head's ``hbar_lp`` was divided by
    hdev: Tensor | None  # [B, Hk, Nk] float32, ||H_j − H̄||_F (covariance-aware only)
    work: Tensor | None = None  # float32 per-program partials of the prepare launch (scratch)
    # [B, Hk, D] float32: max_j |k̄_jd|, per channel (bounds every tail score before the scan)
    kbound: Tensor | None = None
    # [B, Hk, D] float32: max_n |k_nd| over the head's keys, per channel (bounds every exact score
    # before the Hopper kernel's exact loop), when prepare was asked for it (``with_kmax``)
    kmax: Tensor | None = None
    # the low-precision kernel's copies of K (and V), when prepare was asked for them (``quant=``)
    quant: _quantize.Quantized | None = None

    BLOCK_AXES: ClassVar[dict[str, int]] = {"kmean": 2, "kbar": 2, "vbar": 2, "hdev": 2}
    # kbar is only meaningful with the kscale it was divided by: a shard keeps its own.
    SHARD_FIELDS: ClassVar[tuple[str, ...]] = ("kscale", "hscale", "kbound", "kmax")

    def tail(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """What the attention kernel reads besides q, k, v and the selection."""
        return self.kbar, self.kscale, self.vbar, self.hbar_lp, self.hscale

    def blocks(self, lo: int, hi: int) -> "Stats":
        # the copies are quantised against the whole sequence's μ: a shard is quantised anew
        return dataclasses.replace(slice_blocks(self, lo, hi), quant=None)

    def with_hbar(self, hbar: Tensor) -> "Stats":
        hbar_lp, hscale = lowp_hbar(hbar, self.hbar_lp.dtype)
        return dataclasses.replace(self, hbar=hbar, hbar_lp=hbar_lp, hscale=hscale)

    def for_attend(self) -> "Stats":
        self.qmean = self.kmean = self.hbar = self.hdev = None  # in place: no allocation per call
        return self


_FINISH_ROWS = 16


def _q_tile(qb: int, d: int) -> int:
    """Query rows per step of a q program: a multiple of the query block, at most 16 blocks."""
    return max(qb, min(16 * qb, STATS_TUNING["q_tile_bytes"] // (2 * d)))


def _stats_stages(qt: int, d: int) -> int:
    """Pipeline stages of the stats launch: fewer where one query block's tile is larger than the
    tuned tile bytes (256-row selection rows at D = 128 asked 272 KB of shared memory in 4 stages)."""
    stages, tile = STATS_TUNING["stages"], 2 * qt * d
    return stages if tile <= STATS_TUNING["q_tile_bytes"] else max(1, stages * STATS_TUNING["q_tile_bytes"] // tile)


@functools.lru_cache(maxsize=64)
def _geometry(b: int, h: int, hk: int, lq: int, lk: int, bs: int, qb: int, d: int, device: torch.device,
              tuning: tuple):
    """(kv_per, kv_chunks, q_per, q_chunks, f_per, f_groups): blocks (q: tiles) per program and
    programs per head of the stats launch's kv and q programs, and of the finish launch (one per
    ``_FINISH_ROWS`` rows of H̄)."""
    tune = dict(tuning)
    nk = -(-lk // bs)
    qt = _q_tile(qb, d)
    nqt = -(-lq // qt)
    sms = sm_count(device)
    # A query row costs about half a key row (one tile read instead of two, no D×D product).
    units = nk * b * hk + 0.5 * nqt * (qt // bs) * b * h
    # Short calls: one wave (each kv program's D×D partial is a fixed cost; fewer, longer programs).
    waves = 1 if units < tune["short_blocks_per_sm"] * sms else tune["waves"]
    per = max(1, -(-int(units) // max(1, waves * sms)))
    kv_per = max(1, min(nk, per))
    kv_chunks = -(-nk // kv_per) if nk else 0
    q_per = max(1, min(nqt, (2 * per * bs) // qt))
    q_chunks = -(-nqt // q_per) if nqt else 0
    f_groups = d // _FINISH_ROWS
    f_per = max(1, -(-nk // f_groups))
    return kv_per, kv_chunks, q_per, q_chunks, f_per, f_groups


def _part_elems(d: int) -> int:
    """float32 elements of one kv program's partials: ``Σ H_j``, (largest ``|k̄|``, count, largest
    ``|Σ H_j|``), the per-channel largest ``|k̄|`` and largest ``|v|``."""
    return d * d + 3 + 2 * d


def _work_elems(b: int, hk: int, d: int, kv_chunks: int) -> int:
    return b * hk * max(kv_chunks, 1) * _part_elems(d)


def stats_workspace(q_shape, kv_shape, dtype: torch.dtype, device, *, block_size: int, query_block: int | None = None,
                    with_hdev: bool = False, quant: str | None = None, with_kmax: bool = False) -> Stats:
    """Every buffer :func:`prepare` writes for ``[B, H, Lq, D]`` queries and ``[B, Hk, Lk, D]``
    keys/values of ``dtype``, allocated once (pass it as ``ws=``); ``quant``: a low precision
    whose copies of K/V ``prepare(..., quant=)`` writes too; ``with_kmax``: room for the keys'
    per-channel maxima."""
    b, h, lq, d = q_shape
    hk, lk = kv_shape[1], kv_shape[2]
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    qb = query_block or block_size
    nk, nqs = -(-lk // block_size), -(-lq // qb)
    geo = _geometry(b, h, hk, lq, lk, block_size, qb, d, device, tuple(STATS_TUNING.items()))
    f32 = dict(device=device, dtype=torch.float32)
    return Stats(
        qmean=torch.empty(b, h, nqs, d, **f32),
        kmean=torch.empty(b, hk, d, nk, **f32).transpose(2, 3),
        kbar=torch.empty(b, hk, nk, d, device=device, dtype=torch.float16),
        kscale=torch.empty(b, hk, **f32),
        vbar=torch.empty(b, hk, nk, d, device=device, dtype=dtype),
        hbar=torch.empty(b, hk, d, d, **f32),
        hbar_lp=torch.empty(b, hk, d, d, device=device, dtype=dtype),
        hscale=torch.empty(b, hk, **f32),
        hdev=torch.empty(b, hk, nk, **f32) if with_hdev else None,
        work=torch.empty(_work_elems(b, hk, d, geo[1]), **f32),
        kbound=torch.empty(b, hk, d, **f32),
        kmax=torch.empty(b, hk, d, **f32) if with_kmax else None,
        quant=None if quant is None else _quantize.quant_workspace(b, hk, lk, d, block_size, device, quant),
    )


_launch_stats = Launcher(_stats_kernel)
_launch_finish = Launcher(_finish_kernel)
_launch_hdev = Launcher(_hdev_kernel)


def _stats_warps(d: int) -> int:
    return 8 if d >= 128 else 4


def prepare(q: Tensor, k: Tensor, v: Tensor, block_size: int, *, with_hdev: bool = False, lean: bool = False,
            query_block: int | None = None, hbar_exclude: Tensor | None = None, ws: Stats | None = None,
            quant: str | None = None, with_kmax: bool = False) -> Stats:
    """Block statistics of ``[B, H, L, D]`` views (any strides); the query means are over blocks of
    ``query_block`` rows (default ``block_size``). Issues no host synchronisation.

    ``hbar_exclude``: optional bool ``[B|1, Hk|1, Nk]``, key blocks left out of ``H̄`` (the mean
    over the others; ``0`` if none is left). ``ws``: a :func:`stats_workspace` of these shapes;
    the statistics are written into its buffers and nothing is allocated. ``lean`` drops the
    float32 ``H̄`` from the result (the fused path reads only its input-dtype copy). ``quant``: a
    low precision (:data:`pisa_attn.spec.PRODUCT_FORMATS`) whose copies of K (and V) are written
    too, into ``ws.quant`` (returned as ``stats.quant``; the math and kernel of
    :func:`pisa_attn.ops.triton.quantize.quantize`, with the values' ``max |v|`` taken from this
    pass's own read of V instead of another). ``with_kmax``: also ``kmax``, the per-channel maxima
    of ``|k|`` over each kv head's keys (from the same read of K; not with ``quant``, whose ``|v|``
    maxima take that register tile).
    """
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    qb = query_block or block_size
    nk, nqs = -(-lk // block_size), -(-lq // qb)
    dev = q.device
    geo = _geometry(b, h, hk, lq, lk, block_size, qb, d, dev, tuple(STATS_TUNING.items()))
    kv_per, kv_chunks, q_per, q_chunks, f_per, f_groups = geo
    if quant is not None and quant not in PRODUCT_FORMATS:
        raise ValueError(f"quant must be None or a low precision {tuple(PRODUCT_FORMATS)}, got {quant!r}")
    if with_kmax and quant is not None:
        raise ValueError(f"with_kmax and quant={quant!r} cannot be asked together (the kernel holds one maxima tile)")
    check_token_strides(k=k, v=v)  # q's rows are addressed in int64
    if ws is None:
        ws = stats_workspace(q.shape, k.shape, v.dtype, dev, block_size=block_size, query_block=qb,
                             with_hdev=with_hdev, quant=quant, with_kmax=with_kmax)
    n_part = b * hk * max(kv_chunks, 1)
    if (ws.work is None or ws.work.numel() < n_part * _part_elems(d) or ws.vbar.shape != (b, hk, nk, d)
            or ws.qmean.shape != (b, h, nqs, d) or ws.vbar.dtype != v.dtype or ws.vbar.device != dev
            or (with_hdev and ws.hdev is None) or (quant is not None and ws.quant is None)
            or (with_kmax and (ws.kmax is None or ws.kmax.shape != (b, hk, d)))):
        raise ValueError("ws: a stats_workspace made for other shapes, dtype, device or settings")
    qz = None if quant is None else _quantize.checked(ws.quant, k, block_size, quant, "ws.quant")
    vmax = qz is not None and _quantize.needs_vmax(quant)
    part_h = ws.work[: n_part * d * d]
    part_s = ws.work[n_part * d * d: n_part * (d * d + 3)]
    part_r = ws.work[n_part * (d * d + 3): n_part * (d * d + d + 3)]
    part_v = ws.work[n_part * (d * d + d + 3): n_part * _part_elems(d)]
    if hbar_exclude is not None:
        ex = _check_exclude(hbar_exclude, b, hk, nk).view(torch.uint8)
        ex_sb = ex.stride(0) if ex.shape[0] > 1 else 0
        ex_sh = ex.stride(1) if ex.shape[1] > 1 else 0
    else:
        ex, ex_sb, ex_sh = part_s, 0, 0  # never read (HAS_EXCL=False)
    kmean_t = ws.kmean.transpose(2, 3)
    f32 = interpreting()
    pdl = grid_dependency(q.device)
    clamp = k.dtype == torch.float16
    n_kv = b * hk * kv_chunks
    grid = n_kv + b * h * q_chunks
    if grid:
        strides = (*q.stride(), *k.stride(), *v.stride())
        qt = _q_tile(qb, d)
        args = (q, k, v, ex, ws.qmean, kmean_t, ws.vbar, part_h, part_s, part_r, part_v, *strides, ex_sb, ex_sh,
                h, hk, lq, lk, nqs, -(-lq // qt), nk, kv_per, kv_chunks, q_per, q_chunks, n_kv)
        stages = _stats_stages(qt, d)
        _launch_stats((k.dtype, block_size, qb, qt, d, hbar_exclude is not None, vmax, with_kmax, stages, pdl,
                       spec_class(q, k, v, ex, *strides)), (grid,), args,
                      dict(BS=block_size, QB=qb, QT=qt, D=d, F32=f32, CLAMP=clamp, HAS_EXCL=hbar_exclude is not None,
                           VMAX=vmax, KMAX=with_kmax, PDL=pdl),
                      num_warps=_stats_warps(d), num_stages=stages, launch_pdl=pdl > 0)
    if kv_chunks == 0:  # no key block (an empty K/V shard): H̄ = 0, scale 1, bounds 0
        ws.work[: n_part * _part_elems(d)].zero_()
    _launch_finish((d, vmax, with_kmax, pdl, spec_class(part_h, ws.hbar_lp)), (b * hk * f_groups,),
                   (part_h, part_s, part_r, part_v, kmean_t, ws.hbar, ws.hbar_lp, ws.hscale, ws.kbar, ws.kscale,
                    ws.kbound,
                    qz.vmax if vmax else ws.kmax if with_kmax else part_s, nk, max(kv_chunks, 1), f_per),
                   dict(D=d, RB=_FINISH_ROWS, TJ=32, VMAX=vmax, KMAX=with_kmax, PDL=pdl), num_warps=4,
                   launch_pdl=pdl > 0)
    if with_hdev:
        _run_hdev(k, v, ws.hbar, ws.hdev, block_size)
    if qz is not None and b * hk:  # its own launch: inside the hdev pass's loop it spilled (notes/fp8.md)
        _quantize.launch_mu(ws.kbar, ws.kscale, qz, quant, zero_vmax=False)
        if nk:
            _quantize.launch_quant(k, v, qz, quant, block_size)
    return Stats(qmean=ws.qmean, kmean=ws.kmean, kbar=ws.kbar, kscale=ws.kscale, vbar=ws.vbar,
                 hbar=None if lean else ws.hbar, hbar_lp=ws.hbar_lp, hscale=ws.hscale, hdev=ws.hdev if with_hdev else None,
                 work=ws.work, kbound=ws.kbound, kmax=ws.kmax if with_kmax else None, quant=qz)


def _check_exclude(ex: Tensor, b: int, hk: int, nk: int) -> Tensor:
    if not isinstance(ex, Tensor) or ex.dtype != torch.bool:
        raise TypeError(f"hbar_exclude must be a bool tensor, got {getattr(ex, 'dtype', type(ex).__name__)}")
    if ex.dim() != 3 or ex.shape[0] not in (1, b) or ex.shape[1] not in (1, hk) or ex.shape[2] != nk:
        raise ValueError(f"hbar_exclude must have shape [B|1, Hk|1, Nk] = [{b}|1, {hk}|1, {nk}], got {tuple(ex.shape)}")
    return ex if ex.stride(2) == 1 else ex.contiguous()


def _run_hdev(k: Tensor, v: Tensor, hbar: Tensor, hdev: Tensor, block_size: int):
    b, hk, lk, d = k.shape
    nk = -(-lk // block_size)
    total = b * hk * nk
    if total == 0:
        return
    check_token_strides(k=k, v=v)
    # no partials here, so the runs need not stop at a head's end: equal runs, whole waves (at
    # most a head long, so that a run spans two heads at most)
    per = min(nk, -(-total // min(total, STATS_TUNING["hdev_waves"] * sm_count(k.device))))
    strides = (*k.stride(), *v.stride())
    stages = STATS_TUNING["stages"]
    pdl = grid_dependency(k.device)
    _launch_hdev((k.dtype, block_size, d, stages, pdl, spec_class(k, v, hbar, *strides)), (-(-total // per),),
                 (k, v, hbar, hdev, *strides, hk, lk, nk, per, total),
                 dict(BS=block_size, D=d, F32=interpreting(), CLAMP=k.dtype == torch.float16, PDL=pdl),
                 num_warps=_stats_warps(d), num_stages=stages, launch_pdl=pdl > 0)


def deviation(k: Tensor, v: Tensor, stats: Stats, hbar: Tensor, block_size: int) -> Tensor:
    """||H_j − H̄||_F ``[B, Hk, Nk]`` of the blocks of ``k``/``v`` against any float32 ``hbar``
    ``[B, Hk, D, D]``, e.g. the global H̄ of a sharded sequence (``stats`` is not read: each
    block's ``H_j`` is recomputed from k and v)."""
    b, hk, lk, d = k.shape
    nk = -(-lk // block_size)
    hdev = torch.empty(b, hk, nk, device=k.device, dtype=torch.float32)
    _run_hdev(k, v, hbar.float().contiguous(), hdev, block_size)
    return hdev


def compile_for_sm90(kernel: str = "stats", head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                     block_size: int = 64, vmax: bool = False, exclude: bool = False, kmax: bool = False):
    """Compile the ``"stats"`` or ``"hdev"`` kernel of :func:`prepare` for sm_90 without a GPU (what
    the CPU build tests read registers and spills from), specialised as a launch on contiguous
    ``[B, H, L, D]`` tensors is (unit channel strides, the others multiples of 16): only then do
    the loads of the block loop go through ``cp.async`` stages, and as a launch on sm_90 waits for
    the grid before it (:data:`pisa_attn.ops.triton.grid.GRID_DEPENDENCY`). Returns Triton's compiled kernel."""
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    d, bs = head_dim, block_size
    if kernel == "stats":
        fn = _stats_kernel
        cons = dict(BS=bs, QB=bs, QT=_q_tile(bs, d), D=d, F32=False, CLAMP=dtype == torch.float16, HAS_EXCL=exclude,
                    VMAX=vmax, KMAX=kmax, PDL=grid_level(), sqd=1, skd=1, svd=1)
        ptr = dict(q_ptr=ty, k_ptr=ty, v_ptr=ty, excl_ptr="u8", vbar_ptr=ty)
        divisible = ("sqb", "sqh", "sql", "skb", "skh", "skl", "svb", "svh", "svl")
    elif kernel == "hdev":
        fn = _hdev_kernel
        cons = dict(BS=bs, D=d, F32=False, CLAMP=dtype == torch.float16, PDL=grid_level(), skd=1, svd=1)
        ptr = dict(k_ptr=ty, v_ptr=ty)
        divisible = ("skb", "skh", "skl", "svb", "svh", "svl")
    else:
        raise ValueError(f"kernel must be 'stats' or 'hdev', got {kernel!r}")
    types = {n: "*" + ptr.get(n, "fp32") for n in fn.arg_names if n.endswith("_ptr")}  # the rest: float32
    return compile_sm90(fn, types, cons, aligned=True, divisible=divisible, num_warps=_stats_warps(d),
                        num_stages=STATS_TUNING["stages"])
