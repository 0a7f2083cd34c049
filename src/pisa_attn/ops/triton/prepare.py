"""Prepare phase: the block statistics PISA needs, in three launches over q, k, v.

1. ``_kv_means_kernel`` (streaming, one key block per program; true counts for the ragged last
   block): centroid ``k̄_j`` in float32 (selection) and the head's largest centroid entry; value
   mean ``V̂_j / n_j`` in the input dtype; ``V̂_j`` in float32 (scratch).
2. ``_hbar_kernel``: ``H̄ = (1/N) Σ_j H_j`` with ``H_j = K_jᵀV_j − k̄_jᵀV̂_j``, a GEMM-like loop
   (tensor-core product, rank-1 correction from the stored means) reduced on-chip per run of
   blocks and added atomically into one ``[D, D]`` float32 matrix per kv head (never a per-block
   ``D×D`` buffer); on the way it writes the tail scan's centroids as float16 divided by one power
   of two per head (11 mantissa bits instead of bfloat16's 8, one tensor-core product per tail
   score, no overflow whatever the magnitude).
3. ``_q_mean_kernel`` (streaming): the query means selection reads.

The kv work is split in two so that no loop holds a block-wide reduction (a barrier): fused into
one loop that reads k and v once it measured slower, twice (notes/kernel-notes.md).

For covariance-aware selection a second, equally cheap pass computes ``||H_j − H̄||_F`` directly
(``H_j`` lives in registers for one block at a time). The algebraic expansion
``||H_j||² − 2⟨H_j, H̄⟩ + ||H̄||²`` also needs ``H̄`` first, so it saves no pass and cancels badly
when ``H_j ≈ H̄``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..launch import Launcher, spec_class
from ..stages import slice_blocks
from ._common import chunking, interpreting


@triton.jit(do_not_specialize=["HK", "LK", "NK"])
def _kv_means_kernel(
    k_ptr, v_ptr,
    kmean_ptr, kmax_ptr, vbar_ptr, vsum_ptr,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    HK, LK, NK,
    BS: tl.constexpr, D: tl.constexpr,
):
    # One block per program: a streaming pass with many independent loads in flight.
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HK).to(tl.int64)
    h = (bh % HK).to(tl.int64)
    rows = j * BS + tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    valid = (rows < LK)[:, None]
    kf = tl.load(k_ptr + b * skb + h * skh + rows[:, None] * skl + offs_d[None, :] * skd, mask=valid, other=0.0)
    vt = tl.load(v_ptr + b * svb + h * svh + rows[:, None] * svl + offs_d[None, :] * svd, mask=valid, other=0.0)
    inv_n = 1.0 / tl.minimum(LK - j * BS, BS).to(tl.float32)
    km = tl.sum(kf.to(tl.float32), axis=0) * inv_n
    v_sum = tl.sum(vt.to(tl.float32), axis=0)
    out_off = (bh.to(tl.int64) * NK + j) * D + offs_d
    # k̄ in float32 is stored transposed ([D, Nk] per head): the selection GEMM's right operand.
    tl.store(kmean_ptr + bh.to(tl.int64) * D * NK + offs_d * NK + j, km)
    # The head's largest |k̄| picks the float16 scale of its centroids (written by _hbar_kernel).
    tl.atomic_max(kmax_ptr + bh, tl.max(tl.abs(km), axis=0))
    tl.store(vbar_ptr + out_off, (v_sum * inv_n).to(vt.dtype))
    tl.store(vsum_ptr + out_off, v_sum)


@triton.jit
def _add_block_h(acc, k_base, v_base, kmean_ptr, vsum_ptr, bh, j, NK, LK, skl, skd, svl, svd,
                 BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr):
    """``acc + H_j`` with ``H_j = K_jᵀV_j − k̄_jᵀ V̂_j`` (and ``k̄_j``): the product straight from the
    bf16/fp16 tiles on the tensor cores (fp32 accumulate), the rank-1 correction on the CUDA cores
    from the means ``_kv_means_kernel`` stored; padded rows are 0."""
    rows = j * BS + tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    valid = (rows < LK)[:, None]
    kt = tl.load(k_base + rows[:, None] * skl + offs_d[None, :] * skd, mask=valid, other=0.0)
    vt = tl.load(v_base + rows[:, None] * svl + offs_d[None, :] * svd, mask=valid, other=0.0)
    km = tl.load(kmean_ptr + bh.to(tl.int64) * D * NK + offs_d * NK + j)
    v_sum = tl.load(vsum_ptr + (bh.to(tl.int64) * NK + j) * D + offs_d)
    if F32:  # Triton 3.9's interpreter mis-evaluates low-precision tl.dot
        acc = tl.dot(tl.trans(kt.to(tl.float32)), vt.to(tl.float32), acc)
    else:
        acc = tl.dot(tl.trans(kt), vt, acc)
    return acc - km[:, None] * v_sum[None, :], km


@triton.jit(do_not_specialize=["HK", "LK", "NK", "KV_PER", "KV_CHUNKS"])
def _hbar_kernel(
    k_ptr, v_ptr, kmean_ptr, vsum_ptr, hbar_ptr, kmax_ptr, kbar_ptr, kscale_ptr,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    HK, LK, NK, KV_PER, KV_CHUNKS,
    inv_nk,
    BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr,
):
    # Only tensor-core work and two vector loads per block (the means come from _kv_means_kernel):
    # a GEMM-like loop with nothing that needs a block-wide reduction or barrier.
    pid = tl.program_id(0)
    offs_d = tl.arange(0, D)
    c = pid % KV_CHUNKS
    bh = pid // KV_CHUNKS
    b = (bh // HK).to(tl.int64)
    h = (bh % HK).to(tl.int64)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    hacc = tl.zeros([D, D], dtype=tl.float32)
    # Power-of-two scale per head: its largest |k̄| lands in [2^13, 2^14), far from fp16's
    # overflow, and the scaling itself is exact (one scalar for the attention kernel to fold back;
    # a scale per block costs the Triton tail scan a per-column vector in the score tile's layout).
    kmax = tl.load(kmax_ptr + bh)
    ks = tl.where(kmax > 0, tl.exp2(tl.ceil(tl.log2(kmax)) - 14.0), 1.0)
    if c == 0:
        tl.store(kscale_ptr + bh, ks)
    j0 = c * KV_PER
    for j in range(j0, tl.minimum(NK, j0 + KV_PER)):
        hacc, km = _add_block_h(hacc, k_base, v_base, kmean_ptr, vsum_ptr, bh, j, NK, LK, skl, skd, svl, svd,
                                BS, D, F32)
        tl.store(kbar_ptr + (bh.to(tl.int64) * NK + j) * D + offs_d, (km / ks).to(tl.float16))
    # Dividing before the atomic add leaves H̄ itself in the buffer (no epilogue launch).
    tl.atomic_add(hbar_ptr + bh.to(tl.int64) * D * D + offs_d[:, None] * D + offs_d[None, :], hacc * inv_nk)


@triton.jit(do_not_specialize=["H", "LQ", "NQ"])
def _q_mean_kernel(
    q_ptr, qmean_ptr, sqb, sqh, sql, sqd, H, LQ, NQ,
    BS: tl.constexpr, D: tl.constexpr,
):
    # One block per program: many small independent loads in flight (a streaming pass).
    i = tl.program_id(0)
    bh = tl.program_id(1)
    rows = i * BS + tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (bh // H).to(tl.int64) * sqb + (bh % H).to(tl.int64) * sqh + rows[:, None] * sql
                + offs_d[None, :] * sqd, mask=(rows < LQ)[:, None], other=0.0)
    qm = tl.sum(q.to(tl.float32), axis=0) / tl.minimum(LQ - i * BS, BS).to(tl.float32)
    tl.store(qmean_ptr + (bh.to(tl.int64) * NQ + i) * D + offs_d, qm)


@triton.jit(do_not_specialize=["HK", "LK", "NK", "KV_PER", "KV_CHUNKS"])
def _hdev_kernel(
    k_ptr, v_ptr, kmean_ptr, vsum_ptr, hbar_ptr, hdev_ptr,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    HK, LK, NK, KV_PER, KV_CHUNKS,
    BS: tl.constexpr, D: tl.constexpr, F32: tl.constexpr,
):
    pid = tl.program_id(0)
    c = pid % KV_CHUNKS
    bh = pid // KV_CHUNKS
    b = (bh // HK).to(tl.int64)
    h = (bh % HK).to(tl.int64)
    offs_d = tl.arange(0, D)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    hb = tl.load(hbar_ptr + bh.to(tl.int64) * D * D + offs_d[:, None] * D + offs_d[None, :])
    stat_row = bh.to(tl.int64) * NK
    j0 = c * KV_PER
    for j in range(j0, tl.minimum(NK, j0 + KV_PER)):
        hj, _ = _add_block_h(tl.zeros([D, D], dtype=tl.float32), k_base, v_base, kmean_ptr, vsum_ptr, bh, j,
                             NK, LK, skl, skd, svl, svd, BS, D, F32)
        diff = hj - hb
        tl.store(hdev_ptr + stat_row + j, tl.sqrt(tl.sum(tl.sum(diff * diff, axis=1), axis=0)))


@dataclass
class Stats:
    """Outputs of the prepare stage (``[B, H|Hk, N, D]`` contiguous unless noted)."""

    qmean: Tensor | None  # [B, H, Nq, D] float32
    kmean: Tensor | None  # [B, Hk, Nk, D] float32, a transposed view of [B, Hk, D, Nk] storage
    kbar: Tensor  # [B, Hk, Nk, D] float16: k̄_j / kscale, the tail scan's operand
    kscale: Tensor  # [B, Hk] float32: the power of two each head's ``kbar`` was divided by
    vbar: Tensor  # [B, Hk, Nk, D] input dtype: value block means (V̂_j / n_j)
    hbar: Tensor | None  # [B, Hk, D, D] float32 (None after a lean prepare)
    hbar_lp: Tensor  # [B, Hk, D, D] input dtype: the attention kernel's operand for q·H̄
    hdev: Tensor | None  # [B, Hk, Nk] float32, ||H_j − H̄||_F (covariance-aware only)
    kmax: Tensor | None = None  # [B, Hk] float32 scratch: the head's largest |k̄| (a workspace's)
    vsum: Tensor | None = None  # [B, Hk, Nk, D] float32 scratch: value sums (a workspace's)

    BLOCK_AXES: ClassVar[dict[str, int]] = {"kmean": 2, "kbar": 2, "vbar": 2, "hdev": 2}
    # kbar is only meaningful with the kscale it was divided by: a shard keeps its own.
    SHARD_FIELDS: ClassVar[tuple[str, ...]] = ("kscale",)

    def tail(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What the attention kernel reads besides q, k, v and the selection."""
        return self.kbar, self.kscale, self.vbar, self.hbar_lp

    def blocks(self, lo: int, hi: int) -> "Stats":
        return slice_blocks(self, lo, hi)

    def with_hbar(self, hbar: Tensor) -> "Stats":
        return Stats(self.qmean, self.kmean, self.kbar, self.kscale, self.vbar, hbar,
                     hbar.to(self.hbar_lp.dtype), self.hdev)

    def for_attend(self) -> "Stats":
        self.qmean = self.kmean = self.hbar = self.hdev = None  # in place: no allocation per call
        return self


_launch_means = Launcher(_kv_means_kernel)
_launch_hbar = Launcher(_hbar_kernel)
_launch_qmean = Launcher(_q_mean_kernel)


def stats_workspace(q_shape, kv_shape, dtype: torch.dtype, device, *, block_size: int,
                    query_block: int | None = None, with_hdev: bool = False) -> Stats:
    """Every buffer :func:`prepare` writes for ``[B, H, Lq, D]`` queries and ``[B, Hk, Lk, D]``
    keys/values, allocated once (pass it back as ``ws``)."""
    b, h, lq, d = q_shape
    hk, lk = kv_shape[1], kv_shape[2]
    nk = -(-lk // block_size)
    nqs = -(-lq // (query_block or block_size))
    f32 = dict(device=device, dtype=torch.float32)
    return Stats(
        qmean=torch.empty(b, h, nqs, d, **f32),
        kmean=torch.empty(b, hk, d, nk, **f32).transpose(2, 3),
        kbar=torch.empty(b, hk, nk, d, device=device, dtype=torch.float16),
        kscale=torch.ones(b, hk, **f32),
        vbar=torch.empty(b, hk, nk, d, device=device, dtype=dtype),
        hbar=torch.zeros(b, hk, d, d, **f32),
        hbar_lp=torch.empty(b, hk, d, d, device=device, dtype=dtype),
        hdev=torch.empty(b, hk, nk, **f32) if with_hdev else None,
        kmax=torch.zeros(b, hk, **f32),
        vsum=torch.empty(b, hk, nk, d, **f32),
    )  # fmt: skip


def prepare(q: Tensor, k: Tensor, v: Tensor, block_size: int, *, with_hdev: bool = False,
            lean: bool = False, query_block: int | None = None, hbar_exclude: Tensor | None = None,
            ws: Stats | None = None) -> Stats:
    """Block statistics of ``[B, H, L, D]`` views (any strides); the query means are over blocks of
    ``query_block`` rows (default ``block_size``). Issues no host synchronisation.

    ``lean`` frees the float32 ``H̄`` once its input-dtype copy exists (the fused path: at short
    lengths these fixed ``D×D`` buffers dominate the extra memory). ``ws`` (from
    :func:`stats_workspace` for these shapes): write into it and allocate nothing.
    ``hbar_exclude`` (key blocks left out of H̄'s mean) is not supported by these kernels.
    """
    if hbar_exclude is not None:
        raise ValueError("hbar_exclude is not supported by this prepare")
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    nq, nk = -(-lq // block_size), -(-lk // block_size)
    dev = q.device
    if ws is None:
        ws = stats_workspace(q.shape, k.shape, k.dtype, dev, block_size=block_size, query_block=query_block,
                             with_hdev=with_hdev)
    else:
        ws.kmax.zero_()
        ws.hbar.zero_()
    kmean, kbar, kscale, kmax, vbar, hbar, vsum = ws.kmean, ws.kbar, ws.kscale, ws.kmax, ws.vbar, ws.hbar, ws.vsum
    kv_per, kv_chunks = chunking(nk, b * hk, dev)
    strides = (*k.stride(), *v.stride())
    cls = spec_class(k, v, *strides)
    _launch_means((k.dtype, block_size, d, cls), (nk, b * hk),
                  (k, v, kmean, kmax, vbar, vsum, *strides, hk, lk, nk), dict(BS=block_size, D=d), num_warps=4)
    warps = 8 if d >= 128 else 4
    _launch_hbar((k.dtype, block_size, d, warps, cls), (b * hk * kv_chunks,),
                 (k, v, kmean, vsum, hbar, kmax, kbar, kscale, *strides, hk, lk, nk, kv_per, kv_chunks,
                  1.0 / max(nk, 1)),
                 dict(BS=block_size, D=d, F32=interpreting()), num_warps=warps)
    hdev = _hdev(k, v, kmean, vsum, hbar, block_size, out=ws.hdev) if with_hdev else None
    # Rounded once here instead of in every attention program (each would read 4·D² bytes).
    hbar_lp = ws.hbar_lp.copy_(hbar)
    qb = query_block or block_size
    nqs = -(-lq // qb)
    qmean = ws.qmean
    _launch_qmean((q.dtype, qb, d, spec_class(q, *q.stride())), (nqs, b * h), (q, qmean, *q.stride(), h, lq, nqs),
                  dict(BS=qb, D=d), num_warps=4 if qb * d <= 8192 else 8)
    return Stats(qmean=qmean, kmean=kmean, kbar=kbar, kscale=kscale, vbar=vbar, hbar=None if lean else hbar,
                 hbar_lp=hbar_lp, hdev=hdev)


def _hdev(k: Tensor, v: Tensor, kmean: Tensor, vsum: Tensor, hbar: Tensor, block_size: int,
          out: Tensor | None = None) -> Tensor:
    b, hk, lk, d = k.shape
    nk = kmean.shape[2]
    kv_per, kv_chunks = chunking(nk, b * hk, k.device)
    hdev = torch.empty(b, hk, nk, device=k.device, dtype=torch.float32) if out is None else out
    _hdev_kernel[(b * hk * kv_chunks,)](
        k, v, kmean, vsum, hbar, hdev,
        *k.stride(), *v.stride(),
        hk, lk, nk, kv_per, kv_chunks,
        BS=block_size, D=d, F32=interpreting(), num_warps=8 if d >= 128 else 4,
    )
    return hdev


def deviation(k: Tensor, v: Tensor, stats: Stats, hbar: Tensor, block_size: int) -> Tensor:
    """||H_j − H̄||_F ``[B, Hk, Nk]`` of the blocks of ``k``/``v`` (described by ``stats``) against
    any float32 ``hbar`` ``[B, Hk, D, D]``, e.g. the global H̄ of a sharded sequence. Reruns the
    streaming means pass for the float32 value sums, which prepare does not keep."""
    b, hk, lk, d = k.shape
    nk = stats.kbar.shape[2]
    dev = k.device
    kmean = torch.empty(b, hk, d, nk, device=dev, dtype=torch.float32).transpose(2, 3)
    kmax = torch.zeros(b, hk, device=dev, dtype=torch.float32)
    vbar = torch.empty(b, hk, nk, d, device=dev, dtype=v.dtype)
    vsum = torch.empty(b, hk, nk, d, device=dev, dtype=torch.float32)
    _kv_means_kernel[(nk, b * hk)](
        k, v, kmean, kmax, vbar, vsum, *k.stride(), *v.stride(), hk, lk, nk,
        BS=block_size, D=d, num_warps=4,
    )
    return _hdev(k, v, kmean, vsum, hbar.float().contiguous(), block_size)
