"""Selection: pooled block scores and top-k per query block, with no full score matrix stored.

Per query block ``i`` the exact set is ``keep ∪ topk_{j ∉ keep}(s·q̄_i·k̄_j [+ log(||H_j−H̄||+ε)])``.

Scores ``q̄_i·k̄_j`` run on the tensor cores in 3xTF32 (each float32 operand split into two TF32
parts, three products: close to float32, not bit-equal to it; a near-tie can resolve differently
from the float32 reference). Where a program's rows fit its registers (up to ``FUSED["max_nkp"]``
key blocks) one kernel computes a tile of rows' scores and selects from them in registers; beyond,
a tensor-core GEMM writes the final scores (scaled, the covariance term added) of a chunk of query
blocks into a scratch buffer bounded by the caller (the whole ``[B, H, Nq, Nk]`` matrix would break
the memory budget at long lengths) and the top-k kernel streams them.

Top-k: each row's ``n_select``-th largest score by a bitwise search over an order-preserving
integer image of the floats (exact: the k-th order statistic, not an estimate; at most 32 steps,
ending once every row's count at the threshold is exactly ``n_select``), then the chosen blocks
compacted. Ties at the threshold go to the lowest block indices
(``torch.topk`` may break them differently; tests compare attention under one shared selection and
check selection overlap separately).

The output is a :class:`pisa_attn.ops.selection.Selection` (index list in ascending order, which
also keeps neighbouring attention programs on the same key blocks and helps L2; count; bitmask for
the tail scan). Beyond ``MAX_FUSED_BLOCKS`` key blocks one row does not fit a program's registers;
then the reference's chunked ``torch.topk`` selection produces it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...spec import COV_EPS
from .. import reference as _ref
from ..launch import Launcher, spec_class
from ..selection import Selection, check_select_width
from ._common import compile_sm90, interpreting, next_pow2, sm_count
from .grid import await_prior_grid, grid_dependency
from .grid import level as grid_level
from .pairs import union_width

MAX_FUSED_BLOCKS = 4096
# Warps per top-k program of the two-kernel path; a program holds 1024 fp32 scores per warp (32 per
# thread), i.e. 1024 * warps // NKP rows. Fewer warps keep each row's reductions inside fewer warps.
# Threshold bits decided per search step: 2 (16 steps of three counts) up to "two_bit_max_nkp" padded
# key blocks, 1 (32 steps) beyond. H100: 8K 0.024 vs 0.030 ms with 2 bits, 32K 0.189 vs 0.215 ms with 1.
TOPK_WARPS = {"warps": 1, "two_bit_max_nkp": 128, "keys_per_thread": 32}  # 1 warp: 0.145 ms vs 8 warps 0.285 ms at 32K (H100)
# Precision of the score products on the GPU: tf32x3 is within float32 rounding of the float32
# reference's scores (the interpreter computes them in float32).
SCORES_PRECISION = "tf32x3"
# Score GEMM tile of the two-kernel path (rows, key blocks, warps).
SCORES_TILE = {"bm": 64, "bn": 64, "warps": 4}
# The one-kernel path: rows per program (a 64-row tensor-core tile over 4 warps keeps each row in
# one warp; 16 where programs of 16 rows still fit one wave: B2-H16 at 4K ran 32 programs, 17.3 →
# 13.6 µs with 16 rows (21.4 → 17.5 covariance-aware), B1-H24 17.6 → 14.7, the same selections;
# B4-H24, 384 such programs, 22.6 → 29.9; 32 rows spill at 4 warps; H100,
# results/h100_select_short_calls.json) and the widest padded row it takes.
FUSED = {"max_nkp": 64, "rows": 64, "short_rows": 16, "warps": 4}
_COV_EPS = tl.constexpr(COV_EPS)


@triton.jit
def _select_rows(
    scores, rvalid, bh, qi, b, h, bhk,
    hdev_ptr, keep_ptr, idx_ptr, cnt_ptr, bits_ptr,
    NQ, NK, n_sel, W, NW, keep_sb, keep_sh,
    R: tl.constexpr, NKP: tl.constexpr, COV: tl.constexpr, HAS_KEEP: tl.constexpr, REP: tl.constexpr,
    BITS: tl.constexpr, ONE_HEAD: tl.constexpr = False,
):
    """Top-k of ``scores [R, NKP]`` (already scaled) of score rows ``qi`` of heads ``bh``; writes
    output rows ``qi·REP .. qi·REP + REP − 1`` (those < NQ). With ONE_HEAD every row belongs to one
    head (``bh``, ``b``, ``h``, ``bhk`` scalars), and the covariance term and the kept blocks are
    read as one row of NKP instead of an ``[R, NKP]`` tile: the tile's registers, live through the
    threshold search, made that search spill."""
    cols = tl.arange(0, NKP)
    cvalid = cols < NK
    if ONE_HEAD:
        if COV:
            hd = tl.load(hdev_ptr + bhk.to(tl.int64) * NK + cols, mask=cvalid, other=1.0)
            scores += tl.log(hd + _COV_EPS)[None, :]
        if HAS_KEEP:
            kp = (tl.load(keep_ptr + b * keep_sb + h * keep_sh + cols, mask=cvalid, other=0) != 0)[None, :]
            scores = tl.where(kp, float("-inf"), scores)
    else:
        m2 = rvalid[:, None] & cvalid[None, :]
        if COV:
            hd = tl.load(hdev_ptr + bhk.to(tl.int64)[:, None] * NK + cols[None, :], mask=m2, other=1.0)
            scores += tl.log(hd + _COV_EPS)
        if HAS_KEEP:
            kp = tl.load(keep_ptr + (b * keep_sb + h * keep_sh)[:, None] + cols[None, :], mask=m2, other=0) != 0
            scores = tl.where(kp, float("-inf"), scores)

    # Order-preserving uint32 image of the scores; padding columns get 0, below every real score
    # (-inf maps to 0x007FFFFF), so they are never counted while n_sel <= NK.
    u = scores.to(tl.uint32, bitcast=True)
    top = tl.full([R, NKP], 1, tl.uint32) << 31
    key = tl.where((u & top) != 0, ~u, u | top)
    key = tl.where(cvalid[None, :], key, tl.zeros([R, NKP], tl.uint32))

    # Largest T with #{key >= T} >= n_sel, built from the top bit down: T is the n_sel-th largest key.
    # A row is settled once #{key >= T} == n_sel: later steps only move T inside the gap above the
    # (n_sel+1)-th key, which names the same set, so the search stops when every row of the
    # program is settled (about half the steps on continuous scores; ties at the n_sel-th key run
    # them all). Rows past the last query block count as settled.
    thr = tl.zeros([R], tl.uint32)
    one = tl.full([R], 1, tl.uint32)
    n_thr = tl.where(rvalid, NKP + 1, n_sel)  # #{key >= thr}; NKP + 1: not settled before the first step
    step = 0
    if BITS == 2:
        # Two bits per step: three independent counts, half the dependent steps (each step waits on
        # its row reductions); the largest digit whose count still reaches n_sel wins.
        while (step < 16) & (tl.max((n_thr != n_sel).to(tl.int32), axis=0) != 0):
            sh = 30 - 2 * step
            c1 = thr | (one << sh)
            c2 = thr | ((one + one) << sh)
            c3 = c1 | c2
            n1 = tl.sum((key >= c1[:, None]).to(tl.int32), axis=1)
            n2 = tl.sum((key >= c2[:, None]).to(tl.int32), axis=1)
            n3 = tl.sum((key >= c3[:, None]).to(tl.int32), axis=1)
            thr = tl.where(n3 >= n_sel, c3, tl.where(n2 >= n_sel, c2, tl.where(n1 >= n_sel, c1, thr)))
            n_thr = tl.where(n3 >= n_sel, n3, tl.where(n2 >= n_sel, n2, tl.where(n1 >= n_sel, n1, n_thr)))
            step += 1
    else:
        while (step < 32) & (tl.max((n_thr != n_sel).to(tl.int32), axis=0) != 0):
            cand = thr | (one << (31 - step))
            n_ge = tl.sum((key >= cand[:, None]).to(tl.int32), axis=1)
            thr = tl.where(n_ge >= n_sel, cand, thr)
            n_thr = tl.where(n_ge >= n_sel, n_ge, n_thr)
            step += 1
    gt = key > thr[:, None]
    eq = key == thr[:, None]
    need = n_sel - tl.sum(gt.to(tl.int32), axis=1)
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=1)
    exact = gt | (eq & (eq_rank <= need[:, None]))
    if HAS_KEEP:
        exact = exact | kp
    exact = exact & cvalid[None, :]

    pos = tl.cumsum(exact.to(tl.int32), axis=1) - 1
    # A row lists at most W blocks (its first W, in the index list and the bits alike): the host
    # wrapper refuses a narrower width, and no other caller makes the kernel write past a row.
    exact = exact & (pos < W)
    ex = exact.to(tl.int32)
    count = tl.sum(ex, axis=1)
    # Distinct bits: their sum is their OR (uint32, no carries).
    lanes = tl.arange(0, 32).to(tl.uint32)
    words = tl.sum(tl.reshape(ex.to(tl.uint32), [R, NKP // 32, 32]) << lanes[None, None, :], axis=2)
    words = words.to(tl.int32, bitcast=True)
    w_idx = tl.arange(0, NKP // 32)
    for rep in tl.static_range(REP):
        row_ok = rvalid & (qi * REP + rep < NQ)
        out_rows = bh.to(tl.int64) * NQ + qi * REP + rep
        tl.store(idx_ptr + out_rows[:, None] * W + pos, cols[None, :] + tl.zeros([R, NKP], tl.int32),
                 mask=exact & row_ok[:, None])
        tl.store(cnt_ptr + out_rows, count, mask=row_ok)
        tl.store(bits_ptr + out_rows[:, None] * NW + w_idx[None, :], words, mask=row_ok[:, None] & (w_idx < NW)[None, :])


@triton.jit(do_not_specialize=["H", "HK", "NQS", "NQ", "NK", "n_sel", "W", "NW", "keep_sb", "keep_sh"])
def _select_kernel(
    qmean_ptr, kmean_ptr, hdev_ptr, keep_ptr, idx_ptr, cnt_ptr, bits_ptr,
    H, HK, NQS, NQ, NK, n_sel, W, NW, scale, keep_sb, keep_sh,
    R: tl.constexpr, NKP: tl.constexpr, D: tl.constexpr, COV: tl.constexpr, HAS_KEEP: tl.constexpr,
    REP: tl.constexpr, PREC: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr = 0,
):
    # Rows qi of one head: their scores against every key block of the head's kv head, in registers.
    await_prior_grid(PDL)
    bh1 = tl.program_id(1)
    qi = tl.program_id(0) * R + tl.arange(0, R)
    rvalid = qi < NQS
    b1 = bh1 // H
    h1 = bh1 % H
    bhk1 = b1 * HK + h1 // (H // HK)
    offs_d = tl.arange(0, D)
    cols = tl.arange(0, NKP)
    qm = tl.load(qmean_ptr + (bh1.to(tl.int64) * NQS + qi)[:, None] * D + offs_d[None, :], mask=rvalid[:, None],
                 other=0.0)
    km = tl.load(kmean_ptr + bhk1.to(tl.int64) * D * NK + offs_d[:, None] * NK + cols[None, :],
                 mask=(cols < NK)[None, :], other=0.0)
    scores = tl.dot(qm, km, input_precision=PREC) * scale
    _select_rows(scores, rvalid, bh1, qi, b1, h1, bhk1,
                 hdev_ptr, keep_ptr, idx_ptr, cnt_ptr, bits_ptr, NQ, NK, n_sel, W, NW, keep_sb, keep_sh,
                 R, NKP, COV, HAS_KEEP, REP, BITS, ONE_HEAD=True)


@triton.jit(do_not_specialize=["H", "HK", "NQS", "NK", "C0", "CQ"])
def _scores_kernel(
    qmean_ptr, kmean_ptr, hdev_ptr, out_ptr, H, HK, NQS, NK, C0, CQ, scale,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, COV: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    # out[bh, r, j] = s·q̄[bh, C0 + r]·k̄[bhk, j] (+ log(||H_j − H̄|| + ε)) for the CQ score rows of one
    # chunk: the covariance term is one load and one log per column of the tile here, where the
    # top-k would load and take it for every row (the same float32 operations in the same order).
    # One output tile a program: looping over column tiles with the query tile kept (4-8x fewer
    # operand reads) ran 3-5x slower at 16K-64K (notes/kernel-notes.md).
    await_prior_grid(PDL)
    bh = tl.program_id(2)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    bhk = (bh // H) * HK + (bh % H) // (H // HK)
    offs_d = tl.arange(0, D)
    rv = rows < CQ
    cv = cols < NK
    qm = tl.load(qmean_ptr + (bh.to(tl.int64) * NQS + C0 + rows)[:, None] * D + offs_d[None, :], mask=rv[:, None],
                 other=0.0)
    km = tl.load(kmean_ptr + bhk.to(tl.int64) * D * NK + offs_d[:, None] * NK + cols[None, :], mask=cv[None, :],
                 other=0.0)
    s = tl.dot(qm, km, input_precision=PREC) * scale
    if COV:
        hd = tl.load(hdev_ptr + bhk.to(tl.int64) * NK + cols, mask=cv, other=1.0)
        s += tl.log(hd + _COV_EPS)[None, :]
    tl.store(out_ptr + (bh.to(tl.int64) * CQ + rows)[:, None] * NK + cols[None, :], s, mask=rv[:, None] & cv[None, :])


@triton.jit(do_not_specialize=["H", "HK", "NQ", "NK", "n_sel", "W", "NW", "C0", "CQ", "N_ROWS", "keep_sb", "keep_sh"])
def _topk_kernel(
    scores_ptr, keep_ptr, idx_ptr, cnt_ptr, bits_ptr,
    H, HK, NQ, NK, n_sel, W, NW, C0, CQ, N_ROWS,
    keep_sb, keep_sh,
    R: tl.constexpr, NKP: tl.constexpr, HAS_KEEP: tl.constexpr, REP: tl.constexpr = 1,
    BITS: tl.constexpr = 1, PDL: tl.constexpr = 0,
):
    # NQ counts output rows: score row qi is written to rows qi·REP .. qi·REP + REP - 1 (< NQ).
    # Rows of this chunk's score buffer [B, H, CQ, NK] (final scores: scaled, covariance term added)
    # are (b·H + h, query block C0 + r % CQ).
    await_prior_grid(PDL)
    r = tl.program_id(0) * R + tl.arange(0, R)
    rvalid = r < N_ROWS
    bh = r // CQ
    qi = C0 + r % CQ
    b = bh // H
    h = bh % H
    bhk = b * HK + h // (H // HK)
    cols = tl.arange(0, NKP)
    m2 = rvalid[:, None] & (cols < NK)[None, :]
    scores = tl.load(scores_ptr + r.to(tl.int64)[:, None] * NK + cols[None, :], mask=m2, other=0.0)
    # COV=False: the scores hold the term already (cnt_ptr stands in for the hdev pointer, never read)
    _select_rows(scores, rvalid, bh, qi, b, h, bhk, cnt_ptr, keep_ptr, idx_ptr, cnt_ptr, bits_ptr,
                 NQ, NK, n_sel, W, NW, keep_sb, keep_sh, R, NKP, False, HAS_KEEP, REP, BITS)


_launch_topk = Launcher(_topk_kernel)
_launch_select = Launcher(_select_kernel)
_launch_scores = Launcher(_scores_kernel)


class SelectionWorkspace(NamedTuple):
    """Buffers of one selection shape: the :class:`Selection` written, the score scratch of the
    two-kernel path (None where one kernel selects) and the pair stream's ``(uidx, ucnt)`` (None
    unless asked for)."""

    sel: Selection
    scratch: Tensor | None
    union: tuple[Tensor, Tensor] | None


def _fused(nk: int) -> bool:
    return max(32, next_pow2(nk)) <= FUSED["max_nkp"]


def _fused_rows(n_heads: int, nqs: int, device: torch.device) -> int:
    """Rows per program of the one-kernel path: ``FUSED["short_rows"]`` where that many programs
    still fit one wave of the GPU, else ``FUSED["rows"]``."""
    short = FUSED["short_rows"]
    return short if n_heads * triton.cdiv(nqs, short) <= sm_count(device) else FUSED["rows"]


def _topk_config(nkp: int) -> tuple[int, int, int]:
    """(rows per program, warps, threshold bits per step) of the top-k kernel for ``nkp`` padded
    key blocks."""
    kpt = TOPK_WARPS["keys_per_thread"]  # a row's scores per thread, at most
    warps = max(TOPK_WARPS["warps"], nkp // (32 * kpt))
    return max(1, min(64, 32 * kpt * warps // nkp)), warps, 2 if nkp <= TOPK_WARPS["two_bit_max_nkp"] else 1


def compile_for_sm90(nk: int, cov: bool = True, keep: bool = False, head_dim: int = 128, rows: int | None = None):
    """Compile the selection kernel :func:`select` launches for ``nk`` key blocks (the fused one up
    to ``FUSED["max_nkp"]`` padded blocks, with ``rows`` rows a program, default ``FUSED["rows"]``;
    else the top-k kernel, which reads final scores: ``cov`` is the score GEMM's then) for sm_90
    without a GPU: what the CPU build tests read registers and spills from. Returns Triton's
    compiled kernel."""
    nkp = max(32, next_pow2(nk))
    ptr = dict(hdev_ptr="*fp32", keep_ptr="*u8", idx_ptr="*i32", cnt_ptr="*i32", bits_ptr="*i32", scale="fp32")
    if _fused(nk):
        fn, warps = _select_kernel, FUSED["warps"]
        cons = dict(R=rows or FUSED["rows"], NKP=nkp, D=head_dim, COV=cov, HAS_KEEP=keep, REP=1,
                    PREC=SCORES_PRECISION, BITS=_topk_config(nkp)[2], PDL=grid_level())
        ptr.update(qmean_ptr="*fp32", kmean_ptr="*fp32")
    else:  # the covariance term is the score kernel's then (:func:`compile_scores_for_sm90`)
        fn = _topk_kernel
        r, warps, bits_ = _topk_config(nkp)
        cons = dict(R=r, NKP=nkp, HAS_KEEP=keep, REP=1, BITS=bits_, PDL=grid_level())
        ptr.update(scores_ptr="*fp32")
        del ptr["hdev_ptr"], ptr["scale"]
    return compile_sm90(fn, ptr, cons, aligned=True, num_warps=warps)


def compile_scores_for_sm90(cov: bool = True, head_dim: int = 128):
    """Compile the two-kernel path's score GEMM for sm_90 without a GPU (the CPU build tests)."""
    ptr = dict(qmean_ptr="*fp32", kmean_ptr="*fp32", hdev_ptr="*fp32", out_ptr="*fp32", scale="fp32")
    cons = dict(BM=SCORES_TILE["bm"], BN=SCORES_TILE["bn"], D=head_dim, PREC=SCORES_PRECISION, COV=cov,
                PDL=grid_level())
    return compile_sm90(_scores_kernel, ptr, cons, aligned=True, num_warps=SCORES_TILE["warps"])


def _chunk_rows(b: int, h: int, nqs: int, nk: int, scratch_elems: int | None) -> int:
    return max(1, nqs if scratch_elems is None else min(nqs, scratch_elems // max(1, b * h * nk)))


def selection_workspace(b: int, h: int, nq: int, nk: int, width: int, device, *, repeat: int = 1,
                        n_q_rows: int | None = None, scratch_elems: int | None = None,
                        pairs: bool = False) -> SelectionWorkspace:
    """Every buffer :func:`select` writes for ``nq`` query blocks (``n_q_rows`` score rows, i.e.
    rows of ``qmean``; default ``ceil(nq / repeat)``) and ``nk`` key blocks, index lists ``width``
    wide; ``pairs`` adds the pair stream (:func:`pisa_attn.ops.triton.pairs.pair_union`)."""
    dev = torch.device(device)
    i32 = dict(device=dev, dtype=torch.int32)
    sel = Selection(torch.empty(b, h, nq, width, **i32), torch.empty(b, h, nq, **i32),
                    torch.empty(b, h, nq, -(-nk // 32), **i32))
    scratch = None
    if not _fused(nk) and nk <= MAX_FUSED_BLOCKS:
        nqs = -(-nq // repeat) if n_q_rows is None else n_q_rows
        scratch = torch.empty(b * h * _chunk_rows(b, h, nqs, nk, scratch_elems) * nk, device=dev, dtype=torch.float32)
    union = None
    if pairs:
        nq2 = -(-nq // 2)
        union = (torch.empty(b, h, nq2, union_width(nk, width), **i32), torch.empty(b, h, nq2, **i32))
    return SelectionWorkspace(sel, scratch, union)


def select(
    qmean: Tensor,
    kmean: Tensor,
    *,
    n_select: int,
    width: int,
    scale: float,
    hdev: Tensor | None = None,
    keep: Tensor | None = None,
    scratch_elems: int | None = None,
    repeat: int = 1,
    n_q_blocks: int | None = None,
    ws: SelectionWorkspace | None = None,
    n_keep_max: int | None = None,
) -> Selection:
    """The :class:`Selection` from ``qmean [B,H,Nq,D]`` (contiguous) and ``kmean [B,Hk,Nk,D]``
    (float32, the transposed view of ``[B, Hk, D, Nk]`` storage that :func:`prepare.prepare`
    returns); ``keep`` bool ``[B|1, H|1, Nk]``. ``scratch_elems`` bounds the score buffer of the
    two-kernel path (default: the whole matrix in one chunk). ``repeat``: each row of ``qmean``
    selects for that many consecutive query blocks (means of ``query_block`` rows),
    ``n_q_blocks`` of them in all. ``ws``: a :func:`selection_workspace` of these shapes, written
    into (nothing is allocated then). ``n_keep_max``: the most kept blocks of any row of ``keep``
    (``width`` must hold ``min(Nk, n_select + n_keep_max)`` blocks; ValueError otherwise).

    Issues no host synchronisation, except with ``keep`` and ``n_keep_max=None`` at a ``width``
    below ``Nk``: then the count is read from ``keep`` (one synchronisation; refused while a CUDA
    graph is captured)."""
    b, h, nqs, d = qmean.shape
    hk, nk = kmean.shape[1], kmean.shape[2]
    n_sel = min(n_select, nk)
    # The kernels write every chosen block, kept ones on top of the top-k, into the row's index list.
    n_keep_max = check_select_width(width, n_sel, nk, keep, n_keep_max)
    nq = nqs if n_q_blocks is None else n_q_blocks
    if nk > MAX_FUSED_BLOCKS:
        sel = _ref.select(qmean, kmean, n_select=n_sel, width=width, scale=scale, hdev=hdev, keep=keep,
                          scratch_elems=1 << 24, repeat=repeat, n_q_blocks=nq, n_keep_max=n_keep_max)
        if ws is None:
            return sel
        for dst, src in zip(ws.sel, sel):
            dst.copy_(src)
        return ws.sel
    if ws is None:
        ws = selection_workspace(b, h, nq, nk, width, qmean.device, repeat=repeat, scratch_elems=scratch_elems)
    elif (ws.sel.idx.shape != (b, h, nq, width) or ws.sel.bits.shape[-1] != -(-nk // 32)
          or ws.sel.idx.device != qmean.device or (ws.scratch is None) != _fused(nk)):
        raise ValueError("ws: a selection_workspace made for other shapes or another device")
    idx, cnt, bits = ws.sel
    nw = bits.shape[-1]
    kmean_t = kmean.transpose(2, 3)  # [B, Hk, D, Nk] storage
    if not kmean_t.is_contiguous():
        kmean_t = kmean_t.contiguous()
    # the kernels index qmean and hdev by their shapes, without strides (no copy when contiguous)
    qmean = qmean.contiguous()
    if hdev is not None:
        hdev = hdev.contiguous()
    if keep is not None:
        keep_u8 = keep.view(torch.uint8)
        if keep_u8.stride(-1) != 1:
            keep_u8 = keep_u8.contiguous()
        ksb = keep_u8.stride(0) if keep_u8.shape[0] > 1 else 0
        ksh = keep_u8.stride(1) if keep_u8.shape[1] > 1 else 0
    else:
        keep_u8, ksb, ksh = cnt, 0, 0  # placeholder pointer, never read (HAS_KEEP=False)
    hd = hdev if hdev is not None else cnt
    cov, has_keep = hdev is not None, keep is not None
    nkp = max(32, next_pow2(nk))
    prec = "ieee" if interpreting() else SCORES_PRECISION
    r, warps, bits_ = _topk_config(nkp)
    pdl = grid_dependency(qmean.device)
    if _fused(nk):  # its own rows and warps; the top-k's threshold bits
        r = _fused_rows(b * h, nqs, qmean.device)
        args = (qmean, kmean_t, hd, keep_u8, idx, cnt, bits, h, hk, nqs, nq, nk, n_sel, width, nw, scale, ksb, ksh)
        _launch_select((r, nkp, d, cov, has_keep, repeat, FUSED["warps"], bits_, pdl, prec, spec_class(*args[:7])),
                       (triton.cdiv(nqs, r), b * h), args,
                       dict(R=r, NKP=nkp, D=d, COV=cov, HAS_KEEP=has_keep, REP=repeat, PREC=prec, BITS=bits_,
                            PDL=pdl),
                       num_warps=FUSED["warps"], launch_pdl=pdl > 0)
        return ws.sel
    cq = ws.scratch.numel() // max(1, b * h * nk)
    bm, bn, sw = SCORES_TILE["bm"], SCORES_TILE["bn"], SCORES_TILE["warps"]
    for c0 in range(0, nqs, cq):
        c = min(cq, nqs - c0)
        _launch_scores((d, prec, bm, bn, sw, cov, pdl, spec_class(qmean, kmean_t, hd, ws.scratch)),
                       (triton.cdiv(c, bm), triton.cdiv(nk, bn), b * h),
                       (qmean, kmean_t, hd, ws.scratch, h, hk, nqs, nk, c0, c, scale),
                       dict(BM=bm, BN=bn, D=d, PREC=prec, COV=cov, PDL=pdl), num_warps=sw, launch_pdl=pdl > 0)
        args = (ws.scratch, keep_u8, idx, cnt, bits, h, hk, nq, nk, n_sel, width, nw, c0, c, b * h * c, ksb, ksh)
        _launch_topk((r, nkp, warps, has_keep, repeat, bits_, pdl, spec_class(*args[:5])),
                     (triton.cdiv(b * h * c, r),), args,
                     dict(R=r, NKP=nkp, HAS_KEEP=has_keep, REP=repeat, BITS=bits_, PDL=pdl), num_warps=warps,
                     launch_pdl=pdl > 0)
    return ws.sel
