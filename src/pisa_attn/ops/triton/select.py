"""Selection: pooled block scores and top-k per query block, with no full score matrix stored.

Per query block ``i`` the exact set is ``keep ∪ topk_{j ∉ keep}(s·q̄_i·k̄_j [+ log(||H_j−H̄||+ε)])``.
Scores come from an fp32 GEMM (cuBLAS; the reference's arithmetic) over chunks of query blocks
into a scratch buffer bounded by the caller (the whole ``[B, H, Nq, Nk]`` matrix would break the
memory budget at long lengths). A Triton kernel then finds each row's ``n_select``-th largest
score by a 32-step bitwise search over an order-preserving integer image of the floats (exact: the
k-th order statistic, not an estimate) and compacts the chosen blocks. Ties at the threshold go to
the lowest block indices (``torch.topk`` may break them differently; tests compare attention under
one shared selection and check selection overlap separately).

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
from ..selection import Selection
from ._common import next_pow2

MAX_FUSED_BLOCKS = 4096
# Warps per top-k program; a program holds 1024 fp32 scores per warp (32 per thread), i.e.
# 1024 * warps // NKP rows. Fewer warps keep each row's reductions inside fewer warps.
TOPK_WARPS = {"warps": 1}  # fastest on the H100 (tests/gpu/diagnose.py times 1, 2, 4, 8)
_COV_EPS = tl.constexpr(COV_EPS)


@triton.jit(do_not_specialize=["H", "HK", "NQ", "NK", "n_sel", "W", "NW", "C0", "CQ", "N_ROWS", "keep_sb", "keep_sh"])
def _topk_kernel(
    scores_ptr, hdev_ptr, keep_ptr, idx_ptr, cnt_ptr, bits_ptr,
    H, HK, NQ, NK, n_sel, W, NW, scale, C0, CQ, N_ROWS,
    keep_sb, keep_sh,
    R: tl.constexpr, NKP: tl.constexpr, COV: tl.constexpr, HAS_KEEP: tl.constexpr, REP: tl.constexpr = 1,
):
    # NQ counts output rows: score row qi is written to rows qi·REP .. qi·REP + REP - 1 (< NQ).
    # Rows of this chunk's score buffer [B, H, CQ, NK] are (b·H + h, query block C0 + r % CQ).
    r = tl.program_id(0) * R + tl.arange(0, R)
    rvalid = r < N_ROWS
    bh = r // CQ
    qi = C0 + r % CQ
    b = bh // H
    h = bh % H
    bhk = b * HK + h // (H // HK)
    cols = tl.arange(0, NKP)
    cvalid = cols < NK
    m2 = rvalid[:, None] & cvalid[None, :]
    scores = tl.load(scores_ptr + r.to(tl.int64)[:, None] * NK + cols[None, :], mask=m2, other=0.0) * scale
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
    thr = tl.zeros([R], tl.uint32)
    one = tl.full([R], 1, tl.uint32)
    for step in range(32):
        cand = thr | (one << (31 - step))
        n_ge = tl.sum((key >= cand[:, None]).to(tl.int32), axis=1)
        thr = tl.where(n_ge >= n_sel, cand, thr)
    gt = key > thr[:, None]
    eq = key == thr[:, None]
    need = n_sel - tl.sum(gt.to(tl.int32), axis=1)
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=1)
    exact = gt | (eq & (eq_rank <= need[:, None]))
    if HAS_KEEP:
        exact = exact | kp
    exact = exact & cvalid[None, :]

    ex = exact.to(tl.int32)
    pos = tl.cumsum(ex, axis=1) - 1
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


_launch_topk = Launcher(_topk_kernel)


class SelectionWorkspace(NamedTuple):
    """The buffers :func:`select` writes: the selection and the score scratch of one chunk."""

    selection: Selection
    scratch: Tensor


def _chunk_rows(b: int, h: int, nqs: int, nk: int, scratch_elems: int | None) -> int:
    return max(1, nqs if scratch_elems is None else min(nqs, scratch_elems // max(1, b * h * nk)))


def selection_workspace(b: int, h: int, nq: int, nk: int, width: int, device, *, n_q_rows: int | None = None,
                        scratch_elems: int | None = None) -> SelectionWorkspace:
    """The buffers of :func:`select` for ``B x H x nq`` query blocks over ``nk`` key blocks and an
    index list of ``width`` (``n_q_rows``: rows of ``qmean``, default ``nq``; ``scratch_elems`` as
    :func:`select` takes it), allocated once (pass it back as ``ws``)."""
    nqs = nq if n_q_rows is None else n_q_rows
    i32 = dict(device=device, dtype=torch.int32)
    sel = Selection(torch.empty(b, h, nq, width, **i32), torch.empty(b, h, nq, **i32),
                    torch.empty(b, h, nq, -(-nk // 32), **i32))
    cq = _chunk_rows(b, h, nqs, nk, scratch_elems)
    return SelectionWorkspace(sel, torch.empty(b * h * cq * nk, device=device, dtype=torch.float32))


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
) -> Selection:
    """The :class:`Selection` from ``qmean [B,H,Nq,D]`` (contiguous) and ``kmean [B,Hk,Nk,D]``
    (float32, ideally the transposed view :func:`prepare.prepare` returns); ``keep`` bool
    ``[B|1, H|1, Nk]``. ``scratch_elems`` bounds the score buffer (default: the whole matrix in
    one chunk). ``repeat``: each row of ``qmean`` selects for that many consecutive query blocks
    (means of ``query_block`` rows), ``n_q_blocks`` of them in all. ``ws``: the buffers from
    :func:`selection_workspace` for these sizes (then nothing is allocated). Issues no host
    synchronisation."""
    b, h, nqs, d = qmean.shape
    hk, nk = kmean.shape[1], kmean.shape[2]
    n_sel = min(n_select, nk)
    nq = nqs if n_q_blocks is None else n_q_blocks
    if nk > MAX_FUSED_BLOCKS:
        return _ref.select(qmean, kmean, n_select=n_sel, width=width, scale=scale, hdev=hdev, keep=keep,
                           scratch_elems=1 << 24, repeat=repeat, n_q_blocks=nq)
    if keep is not None:
        keep = keep.contiguous()
    dev = qmean.device
    g = h // hk
    nw = -(-nk // 32)
    if ws is None:
        ws = selection_workspace(b, h, nq, nk, width, dev, n_q_rows=nqs, scratch_elems=scratch_elems)
    (idx, cnt, bits), scratch = ws
    kmean_t = kmean.transpose(2, 3)  # [B, Hk, D, Nk]
    cq = _chunk_rows(b, h, nqs, nk, scratch_elems)
    nkp = max(32, next_pow2(nk))
    warps = max(TOPK_WARPS["warps"], nkp // 1024)  # at most 32 scores per thread (no spills)
    r = max(1, min(64, 1024 * warps // nkp))
    if keep is not None:
        keep_u8 = keep.view(torch.uint8)
        ksb = keep_u8.stride(0) if keep_u8.shape[0] > 1 else 0
        ksh = keep_u8.stride(1) if keep_u8.shape[1] > 1 else 0
    else:
        keep_u8, ksb, ksh = cnt, 0, 0  # placeholder pointer, never read (HAS_KEEP=False)
    for c0 in range(0, nqs, cq):
        c = min(cq, nqs - c0)
        sc = scratch[: b * h * c * nk].view(b, hk, g, c, nk)
        # [B, Hk, G, c, D] @ [B, Hk, 1, D, Nk]: GQA groups share their kv head's centroids.
        torch.matmul(qmean[:, :, c0 : c0 + c].view(b, hk, g, c, d), kmean_t.unsqueeze(2), out=sc)
        args = (sc, hdev if hdev is not None else sc, keep_u8, idx, cnt, bits,
                h, hk, nq, nk, n_sel, width, nw, scale, c0, c, b * h * c, ksb, ksh)
        _launch_topk((r, nkp, warps, hdev is not None, keep is not None, repeat, spec_class(*args[:6])),
                     (triton.cdiv(b * h * c, r),), args,
                     dict(R=r, NKP=nkp, COV=hdev is not None, HAS_KEEP=keep is not None, REP=repeat), num_warps=warps)
    return Selection(idx, cnt, bits)
