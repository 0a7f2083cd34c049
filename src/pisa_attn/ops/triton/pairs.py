"""The selection of two adjacent query blocks as one stream: the union of their exact key blocks,
each entry tagged with which of the two blocks owns it.

A kernel that serves two query blocks from one K/V stream (the Hopper pair kernel) loads every
block of the union once and lets each query block compute only the blocks it owns, so the
paper's per-block selection is kept exactly while shared blocks are read once.

Order: blocks owned by one query block only alternate between the two owners (even, odd, even,
odd, ...; the longer list's rest follows), then the shared blocks, each class ascending. Both
consumers of the stream then have work in every window of a few entries; in ascending order a
run of one owner's blocks left the other consumer idle (H100, 32K, 12.5 %: the pair kernel
was no faster than the one-block kernel).

Output, static shapes, no host synchronisation:

* ``uidx`` int32 ``[B, H, ceil(Nq / 2), W2]``: ``j << 2 | owner``, owner bit 0 = the even query
  block ``2p``, bit 1 = the odd one ``2p + 1``; ``W2 = min(Nk, 2 · W)``; entries past ``ucnt``
  are unspecified;
* ``ucnt`` int32 ``[B, H, ceil(Nq / 2)]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..launch import Launcher
from ._common import next_pow2


@triton.jit(do_not_specialize=["NQ", "NQ2", "NK", "NW", "W2", "N_PAIRS"])
def _pair_union_kernel(bits_ptr, uidx_ptr, ucnt_ptr, NQ, NQ2, NK, NW, W2, N_PAIRS,
                       R: tl.constexpr, NKP: tl.constexpr):
    p = tl.program_id(0) * R + tl.arange(0, R)
    pvalid = p < N_PAIRS
    bh = p // NQ2
    qa = 2 * (p % NQ2)
    row_a = bh.to(tl.int64) * NQ + qa
    cols = tl.arange(0, NKP)
    word = cols // 32
    bit = cols % 32
    m_a = pvalid[:, None] & (cols < NK)[None, :]
    m_b = m_a & (qa + 1 < NQ)[:, None]
    wa = tl.load(bits_ptr + row_a[:, None] * NW + word[None, :], mask=m_a, other=0)
    wb = tl.load(bits_ptr + (row_a + 1)[:, None] * NW + word[None, :], mask=m_b, other=0)
    own = ((wa >> bit[None, :]) & 1) | (((wb >> bit[None, :]) & 1) << 1)
    only_a = (own == 1).to(tl.int32)
    only_b = (own == 2).to(tl.int32)
    both = (own == 3).to(tl.int32)
    n_a = tl.sum(only_a, axis=1)[:, None]
    n_b = tl.sum(only_b, axis=1)[:, None]
    n_ab = tl.minimum(n_a, n_b)
    r_a = tl.cumsum(only_a, axis=1) - 1
    r_b = tl.cumsum(only_b, axis=1) - 1
    r_s = tl.cumsum(both, axis=1) - 1
    pos = tl.where(own == 1, tl.where(r_a < n_ab, 2 * r_a, n_ab + r_a),
                   tl.where(own == 2, tl.where(r_b < n_ab, 2 * r_b + 1, n_ab + r_b), n_a + n_b + r_s))
    present = own != 0
    tl.store(uidx_ptr + p.to(tl.int64)[:, None] * W2 + pos, cols[None, :] * 4 + own,
             mask=present & pvalid[:, None] & (pos < W2))
    tl.store(ucnt_ptr + p, tl.sum(present.to(tl.int32), axis=1), mask=pvalid)


_launch = Launcher(_pair_union_kernel)


def union_width(n_kv_blocks: int, width: int) -> int:
    return max(1, min(n_kv_blocks, 2 * width))


def pair_union(bits: Tensor, n_kv_blocks: int, width: int, *,
               out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(uidx, ucnt) of every pair of query blocks from the selection bitmask ``bits [B, H, Nq, NW]``
    (contiguous); ``width`` is the selection's list width ``W``. ``out``: (uidx, ucnt) buffers of
    those shapes to write into (then nothing is allocated)."""
    b, h, nq, nw = bits.shape
    nq2 = -(-nq // 2)
    w2 = union_width(n_kv_blocks, width)
    if out is None:
        uidx = torch.empty(b, h, nq2, w2, device=bits.device, dtype=torch.int32)
        ucnt = torch.empty(b, h, nq2, device=bits.device, dtype=torch.int32)
    else:
        uidx, ucnt = out
    nkp = max(32, next_pow2(n_kv_blocks))
    warps = max(1, min(8, nkp // 1024))
    r = max(1, min(32, 1024 * warps // nkp))
    n_pairs = b * h * nq2
    args = (bits, uidx, ucnt, nq, nq2, n_kv_blocks, nw, w2, n_pairs)
    _launch((nkp, r, warps, bits.data_ptr() % 16 == 0), (triton.cdiv(n_pairs, r),), args, dict(R=r, NKP=nkp),
            num_warps=warps)
    return uidx, ucnt


def pair_union_torch(bits: Tensor, n_kv_blocks: int, width: int) -> tuple[Tensor, Tensor]:
    """The same (uidx, ucnt) in plain PyTorch (the reference the kernel is tested against)."""
    b, h, nq, nw = bits.shape
    lanes = torch.arange(32, device=bits.device, dtype=torch.int32)
    mask = ((bits[..., None] >> lanes) & 1).reshape(b, h, nq, nw * 32)[..., :n_kv_blocks].to(torch.int32)
    if nq % 2:
        mask = torch.cat([mask, torch.zeros_like(mask[:, :, :1])], 2)
    own = (mask[:, :, 0::2] | (mask[:, :, 1::2] << 1)).long()  # [B, H, Nq2, Nk]
    w2 = union_width(n_kv_blocks, width)
    codes = torch.zeros(b, h, own.shape[2], w2, dtype=torch.int32, device=bits.device)
    for bi in range(b):
        for hi in range(h):
            for p in range(own.shape[2]):
                o = own[bi, hi, p]
                a, bb, s = [(o == c).nonzero().flatten() for c in (1, 2, 3)]
                m = min(len(a), len(bb))
                inter = torch.stack([a[:m], bb[:m]], 1).flatten()
                order = torch.cat([inter, a[m:], bb[m:], s])
                codes[bi, hi, p, : len(order)] = (order * 4 + o[order]).to(torch.int32)
    return codes, (own != 0).sum(-1, dtype=torch.int32)
