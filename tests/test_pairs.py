"""The pair-union stream (Triton, interpreter on the CPU) against its PyTorch statement."""

from __future__ import annotations

import pytest
import torch

from pisa_attn.ops.triton.pairs import pair_union, union_width
from pisa_attn.ops.selection import Selection


@pytest.mark.parametrize("nq,nk", [(5, 70), (4, 33), (1, 5), (7, 128), (3, 1)],
                         ids=["Nq5-Nk70", "Nq4-Nk33", "Nq1-Nk5", "Nq7-Nk128", "Nq3-Nk1"])
def test_pair_union_matches_torch(nq, nk):
    g = torch.Generator().manual_seed(nq * 1000 + nk)
    mask = torch.rand(2, 3, nq, nk, generator=g) < 0.3
    w = int(mask.sum(-1).max().clamp_min(1))
    bits = Selection.from_mask(mask, w).bits
    uidx, ucnt = pair_union(bits.contiguous(), nk, w)
    ref_idx, ref_cnt = pair_union_torch(bits, nk, w)
    assert torch.equal(ucnt, ref_cnt)
    for b in range(2):
        for h in range(3):
            for p in range(ucnt.shape[2]):
                n = int(ucnt[b, h, p])
                assert torch.equal(uidx[b, h, p, :n], ref_idx[b, h, p, :n])
                # every block of either query block appears exactly once, tagged with its owners
                codes = uidx[b, h, p, :n]
                own = torch.zeros(nk, dtype=torch.int32)
                own[(codes >> 2).long()] = codes & 3
                a = mask[b, h, 2 * p].int()
                o = mask[b, h, 2 * p + 1].int() if 2 * p + 1 < nq else torch.zeros_like(a)
                assert torch.equal(own, a | (o << 1))
                assert len(set((codes >> 2).tolist())) == n


def test_owners_alternate_before_shared_blocks():
    mask = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    mask[0, 0, 0, [0, 1, 2, 7]] = True  # even block: 0 1 2 (own) 7 (shared)
    mask[0, 0, 1, [5, 7]] = True  # odd block: 5 (own) 7 (shared)
    bits = Selection.from_mask(mask, 4).bits
    uidx, ucnt = pair_union(bits.contiguous(), 10, 4)
    codes = uidx[0, 0, 0, : int(ucnt[0, 0, 0])].tolist()
    assert [(c >> 2, c & 3) for c in codes] == [(0, 1), (5, 2), (1, 1), (2, 1), (7, 3)]


def pair_union_torch(bits, n_kv_blocks: int, width: int):
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
