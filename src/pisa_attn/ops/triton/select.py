"""Selection: pooled block scores and top-k per query block, with no full score matrix stored.

Per query block ``i`` the exact set is ``keep ∪ topk_{j ∉ keep}(s·q̄_i·k̄_j [+ log(||H_j−H̄||+ε)])``.
Scores come from an fp32 GEMM (cuBLAS; the reference's arithmetic) over chunks of query blocks
into a scratch buffer bounded by the caller (the whole ``[B, H, Nq, Nk]`` matrix would break the
memory budget at long lengths). A Triton kernel then finds each row's ``n_select``-th largest
score by a 32-step bitwise search over an order-preserving integer image of the floats (exact: the
k-th order statistic, not an estimate) and compacts the chosen blocks. Ties at the threshold go to
the lowest block indices (``torch.topk`` may break them differently; tests compare attention under
one shared selection and check selection overlap separately).

(A first version computed the scores inside the kernel by fp32 outer products over D: one
dependent centroid load per step left it latency-bound, 9.3 ms at 64K on an H100.)

Outputs, all of static shape:

* ``idx``  int32 ``[B, H, Nq, W]``: the exact blocks in ascending order (ascending order also keeps
  neighbouring programs on the same key blocks, which helps L2), ``W = min(Nk, n_select + n_keep_max)``;
  entries past ``cnt`` are unspecified;
* ``cnt``  int32 ``[B, H, Nq]``: how many entries of ``idx`` are valid;
* ``bits`` int32 ``[B, H, Nq, ceil(Nk/32)]``: the same set as a bitmask, for the tail scan.

Beyond ``MAX_FUSED_BLOCKS`` key blocks one row no longer fits a program's registers; a chunked
PyTorch path (``torch.topk``) produces the same three tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import COV_EPS, next_pow2

MAX_FUSED_BLOCKS = 4096
# Warps per top-k program; a program holds 1024 fp32 scores per warp (32 per thread), i.e.
# 1024 * warps // NKP rows. Fewer warps keep each row's reductions inside fewer warps.
TOPK_WARPS = {"warps": 1}  # H100, 32K: 0.145 ms at 1 warp vs 0.285 ms at 8 (tests/gpu/diagnose.py)
_COV_EPS = tl.constexpr(COV_EPS)


@triton.jit(do_not_specialize=["H", "HK", "NQ", "NK", "n_sel", "W", "NW", "C0", "CQ", "N_ROWS", "keep_sb", "keep_sh"])
def _topk_kernel(
    scores_ptr, hdev_ptr, keep_ptr, idx_ptr, cnt_ptr, bits_ptr,
    H, HK, NQ, NK, n_sel, W, NW, scale, C0, CQ, N_ROWS,
    keep_sb, keep_sh,
    R: tl.constexpr, NKP: tl.constexpr, COV: tl.constexpr, HAS_KEEP: tl.constexpr,
):
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
    out_rows = bh.to(tl.int64) * NQ + qi
    tl.store(idx_ptr + out_rows[:, None] * W + pos, cols[None, :] + tl.zeros([R, NKP], tl.int32),
             mask=exact & rvalid[:, None])
    tl.store(cnt_ptr + out_rows, tl.sum(ex, axis=1), mask=rvalid)
    # Distinct bits: their sum is their OR (uint32, no carries).
    lanes = tl.arange(0, 32).to(tl.uint32)
    words = tl.sum(tl.reshape(ex.to(tl.uint32), [R, NKP // 32, 32]) << lanes[None, None, :], axis=2)
    words = words.to(tl.int32, bitcast=True)
    w_idx = tl.arange(0, NKP // 32)
    tl.store(bits_ptr + out_rows[:, None] * NW + w_idx[None, :], words, mask=rvalid[:, None] & (w_idx < NW)[None, :])


def selection_width(n_kv_blocks: int, n_select: int, n_keep_max: int) -> int:
    return max(1, min(n_kv_blocks, n_select + n_keep_max))


def select(
    qmean: Tensor,
    kmean: Tensor,
    hdev: Tensor | None,
    keep: Tensor | None,
    n_select: int,
    width: int,
    scale: float,
    scratch_elems: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(idx, cnt, bits) from ``qmean [B,H,Nq,D]`` (contiguous) and ``kmean [B,Hk,Nk,D]`` (float32, the
    transposed view :func:`prepare.prepare` returns). ``scratch_elems`` bounds the score buffer
    (default: the whole matrix in one chunk). Issues no host synchronisation."""
    b, h, nq, d = qmean.shape
    hk, nk = kmean.shape[1], kmean.shape[2]
    n_sel = min(n_select, nk)
    if nk > MAX_FUSED_BLOCKS:
        return select_torch(qmean, kmean, hdev, keep, n_sel, width, scale)
    dev = qmean.device
    g = h // hk
    nw = -(-nk // 32)
    idx = torch.empty(b, h, nq, width, device=dev, dtype=torch.int32)
    cnt = torch.empty(b, h, nq, device=dev, dtype=torch.int32)
    bits = torch.empty(b, h, nq, nw, device=dev, dtype=torch.int32)
    kmean_t = kmean.transpose(2, 3)  # [B, Hk, D, Nk]
    cq = nq if scratch_elems is None else max(1, min(nq, scratch_elems // (b * h * nk)))
    scratch = torch.empty(b * h * cq * nk, device=dev, dtype=torch.float32)
    nkp = max(32, next_pow2(nk))
    warps = max(TOPK_WARPS["warps"], nkp // 1024)  # at most 32 scores per thread (no spills)
    r = max(1, min(64, 1024 * warps // nkp))
    if keep is not None:
        keep_u8 = keep.view(torch.uint8)
        ksb = keep_u8.stride(0) if keep_u8.shape[0] > 1 else 0
        ksh = keep_u8.stride(1) if keep_u8.shape[1] > 1 else 0
    else:
        keep_u8, ksb, ksh = cnt, 0, 0  # placeholder pointer, never read (HAS_KEEP=False)
    for c0 in range(0, nq, cq):
        c = min(cq, nq - c0)
        sc = scratch[: b * h * c * nk].view(b, hk, g, c, nk)
        # [B, Hk, G, c, D] @ [B, Hk, 1, D, Nk]: GQA groups share their kv head's centroids.
        torch.matmul(qmean[:, :, c0 : c0 + c].view(b, hk, g, c, d), kmean_t.unsqueeze(2), out=sc)
        _topk_kernel[(triton.cdiv(b * h * c, r),)](
            sc, hdev if hdev is not None else sc, keep_u8, idx, cnt, bits,
            h, hk, nq, nk, n_sel, width, nw, scale, c0, c, b * h * c,
            ksb, ksh,
            R=r, NKP=nkp, COV=hdev is not None, HAS_KEEP=keep is not None,
            num_warps=warps,
        )
    return idx, cnt, bits


def select_torch(
    qmean: Tensor,
    kmean: Tensor,
    hdev: Tensor | None,
    keep: Tensor | None,
    n_select: int,
    width: int,
    scale: float,
    chunk_blocks: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Selection through ``torch.topk`` on a score matrix, processed in query chunks so the scores
    never exceed ~64 MB. Same outputs and semantics as :func:`select` (ties may break differently)."""
    b, h, nq, d = qmean.shape
    hk, nk = kmean.shape[1], kmean.shape[2]
    n_sel = min(n_select, nk)
    km = kmean.repeat_interleave(h // hk, dim=1) if hk != h else kmean
    bias = None
    if hdev is not None:
        hd = hdev.repeat_interleave(h // hk, dim=1) if hk != h else hdev
        bias = torch.log(hd + COV_EPS)[:, :, None, :]
    keep4 = None if keep is None else keep[:, :, None, :]
    if chunk_blocks is None:
        chunk_blocks = max(1, (1 << 24) // max(1, b * h * nk))
    idx_parts, cnt_parts, bit_parts = [], [], []
    for i0 in range(0, nq, chunk_blocks):
        qm = qmean[:, :, i0 : i0 + chunk_blocks]
        s = torch.einsum("bhid,bhjd->bhij", qm, km) * scale
        if bias is not None:
            s = s + bias
        if keep4 is not None:
            s = s.masked_fill(keep4, float("-inf"))
        top = s.topk(n_sel, dim=-1, sorted=False).indices
        mask = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True)
        if keep4 is not None:
            mask = mask | keep4
        i, c, w = mask_to_selection(mask, width)
        idx_parts.append(i)
        cnt_parts.append(c)
        bit_parts.append(w)
    return torch.cat(idx_parts, 2), torch.cat(cnt_parts, 2), torch.cat(bit_parts, 2)


def mask_to_selection(mask: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Bool exact-set mask ``[B, H, Nq, Nk]`` -> (idx ascending, cnt, bits), all int32, no sync.
    Rows with more than ``width`` exact blocks are truncated (callers size ``width`` to fit)."""
    nk = mask.shape[-1]
    ar = torch.arange(nk, device=mask.device, dtype=torch.int32)
    # Selected blocks sort first, in ascending order; the rest follow as j + Nk.
    order = torch.where(mask, ar, ar + nk)
    idx = order.topk(width, dim=-1, largest=False, sorted=True).values
    idx = torch.where(idx >= nk, idx - nk, idx).to(torch.int32)
    cnt = mask.sum(-1, dtype=torch.int32).clamp_max(width)
    nw = -(-nk // 32)
    padded = torch.nn.functional.pad(mask, (0, nw * 32 - nk)).reshape(*mask.shape[:-1], nw, 32)
    weights = torch.ones(32, device=mask.device, dtype=torch.int64) << torch.arange(32, device=mask.device)
    words = (padded.to(torch.int64) * weights).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return idx, cnt, words


def selection_to_mask(idx: Tensor, cnt: Tensor, n_kv_blocks: int) -> Tensor:
    """Inverse of :func:`mask_to_selection`: the bool ``[B, H, Nq, Nk]`` exact-set mask."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
    mask = torch.zeros(*idx.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=idx.device)
    safe = torch.where(valid, idx.long(), torch.full_like(idx, n_kv_blocks, dtype=torch.long))
    mask.scatter_(-1, safe, True)
    return mask[..., :n_kv_blocks]


def bits_to_mask(bits: Tensor, n_kv_blocks: int) -> Tensor:
    """Unpack the ``bits`` output to a bool ``[B, H, Nq, Nk]`` mask (tests)."""
    lanes = torch.arange(32, device=bits.device, dtype=torch.int32)
    m = ((bits[..., None] >> lanes) & 1).bool()
    return m.reshape(*bits.shape[:-1], -1)[..., :n_kv_blocks]
