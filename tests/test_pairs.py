"""The pairing of query blocks and the pair-union stream (Triton, interpreter on the CPU) against
their PyTorch statements."""

from __future__ import annotations

import pytest
import torch

from pisa_attn.ops.selection import Selection
from pisa_attn.ops.triton.pairs import pair_match, pair_union, triple_union, triple_width, union_width


def _bits(mask, w=None):
    w = int(mask.sum(-1).max().clamp_min(1)) if w is None else w
    return Selection.from_mask(mask, w).bits.contiguous(), w


def _local_mask(b, h, nq, nk, g, p=0.3):
    """Selections that drift with the query block (neighbours share some, not all)."""
    centre = (torch.arange(nq)[:, None] * nk / max(nq, 1)).long()
    near = (torch.arange(nk)[None, :] - centre).abs() < max(2, nk // 4)
    return (torch.rand(b, h, nq, nk, generator=g) < p) & near | (torch.rand(b, h, nq, nk, generator=g) < 0.05)


@pytest.mark.parametrize("nq,nk", [(5, 70), (4, 33), (1, 5), (7, 128), (3, 1)],
                         ids=["Nq5-Nk70", "Nq4-Nk33", "Nq1-Nk5", "Nq7-Nk128", "Nq3-Nk1"])
@pytest.mark.parametrize("order", ["owners", "ascending"])
def test_pair_union_matches_torch(nq, nk, order):
    g = torch.Generator().manual_seed(nq * 1000 + nk)
    mask = torch.rand(2, 3, nq, nk, generator=g) < 0.3
    bits, w = _bits(mask)
    uidx, ucnt = pair_union(bits, nk, w, order=order)
    ref_idx, ref_cnt = pair_union_torch(bits, nk, w, order=order)
    assert torch.equal(ucnt, ref_cnt)
    _check_stream(uidx, ucnt, ref_idx, mask, adjacent_pairs(2, 3, nq), order)


@pytest.mark.parametrize("nq,nk", [(5, 70), (6, 33), (1, 5), (7, 128), (3, 1)],
                         ids=["Nq5-Nk70", "Nq6-Nk33", "Nq1-Nk5", "Nq7-Nk128", "Nq3-Nk1"])
def test_triple_union_matches_torch(nq, nk):
    """Three adjacent query blocks' stream: every key block any of them selects, ascending, tagged
    with the owner bits (blocks past Nq own nothing)."""
    g = torch.Generator().manual_seed(nq * 1000 + nk + 7)
    mask = torch.rand(2, 3, nq, nk, generator=g) < 0.3
    bits, w = _bits(mask)
    uidx, ucnt = triple_union(bits, nk, w)
    nq3 = -(-nq // 3)
    assert uidx.shape == (2, 3, nq3, triple_width(nk, w)) and ucnt.shape == (2, 3, nq3)
    pad = torch.cat([mask, torch.zeros(2, 3, nq3 * 3 - nq, nk, dtype=torch.bool)], 2).view(2, 3, nq3, 3, nk).int()
    own = pad[..., 0, :] | (pad[..., 1, :] << 1) | (pad[..., 2, :] << 2)
    for bi in range(2):
        for hi in range(3):
            for t in range(nq3):
                js = own[bi, hi, t].nonzero().flatten()
                assert ucnt[bi, hi, t].item() == len(js)
                ref = (js * 8 + own[bi, hi, t, js]).int()
                assert torch.equal(uidx[bi, hi, t, : len(js)], ref), (bi, hi, t)


@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("nq,nk", [(13, 70), (16, 40), (1, 5), (9, 129)],
                         ids=["Nq13-Nk70", "Nq16-Nk40", "Nq1-Nk5", "Nq9-Nk129"])
def test_pair_match_matches_torch(nq, nk, group):
    """The matching against its PyTorch statement, and the pair-union stream built on it (a given
    ``qpair``): one order per group, so each shape's stream is checked in both orders."""
    g = torch.Generator().manual_seed(nq * 100 + nk + group)
    mask = _local_mask(1, 2, nq, nk, g)
    bits, w = _bits(mask)
    qpair = pair_match(bits, group)
    ref = pair_match_torch(bits, group)
    assert torch.equal(qpair, ref)
    # every query block in exactly one pair; the partner of a lone block is Nq (none)
    flat = qpair.flatten(2)
    for b in range(1):
        for h in range(2):
            got = sorted(x for x in flat[b, h].tolist() if x != nq)
            assert got == list(range(nq))
    for order in ("owners",) if group == 4 else ("ascending",):
        uidx, ucnt = pair_union(bits, nk, w, qpair=qpair, order=order)
        ref_idx, ref_cnt = pair_union_torch(bits, nk, w, qpair=ref, order=order)
        assert torch.equal(ucnt, ref_cnt)
        _check_stream(uidx, ucnt, ref_idx, mask, qpair, order)


def test_pair_match_group_of_two_is_adjacency():
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(1, 2, 11, 50, generator=g) < 0.3
    bits, w = _bits(mask)
    assert torch.equal(pair_match(bits, 2), adjacent_pairs(1, 2, 11))
    # with qpair = adjacency the stream is the one built without a table
    a = pair_union(bits, 50, w)
    b = pair_union(bits, 50, w, qpair=adjacent_pairs(1, 2, 11))
    assert torch.equal(a[1], b[1])
    for p in range(6):
        n = int(a[1][0, 0, p])
        assert torch.equal(a[0][0, 0, p, :n], b[0][0, 0, p, :n])


def test_pair_match_prefers_the_partner_sharing_most():
    mask = torch.zeros(1, 1, 4, 16, dtype=torch.bool)
    mask[0, 0, 0, [0, 1, 2, 3]] = True
    mask[0, 0, 1, [8, 9, 10, 11]] = True
    mask[0, 0, 2, [0, 1, 2, 5]] = True  # shares 3 with block 0
    mask[0, 0, 3, [8, 9, 12, 13]] = True  # shares 2 with block 1
    bits, _ = _bits(mask)
    assert pair_match(bits, 4)[0, 0].tolist() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="group"):
        pair_match(bits, 16)


def test_owners_alternate_between_shared_blocks():
    mask = torch.zeros(1, 1, 2, 12, dtype=torch.bool)
    mask[0, 0, 0, [0, 1, 2, 7, 9, 10]] = True  # first: 0 1 2 (own) 7 (shared) 9 10 (own)
    mask[0, 0, 1, [5, 7, 8, 11]] = True  # second: 5 (own) 7 (shared) 8 11 (own)
    bits, _ = _bits(mask, 6)
    uidx, ucnt = pair_union(bits, 12, 6, order="ascending")
    codes = uidx[0, 0, 0, : int(ucnt[0, 0, 0])].tolist()
    assert [(c >> 2, c & 3) for c in codes] == [(0, 1), (5, 2), (1, 1), (2, 1), (7, 3), (9, 1), (8, 2), (10, 1),
                                               (11, 2)]
    # the default order: own blocks interleaved, shared ones last
    uidx, ucnt = pair_union(bits, 12, 6)
    codes = uidx[0, 0, 0, : int(ucnt[0, 0, 0])].tolist()
    assert [c >> 2 for c in codes] == [0, 5, 1, 8, 2, 11, 9, 10, 7]


def _check_stream(uidx, ucnt, ref_idx, mask, qpair, order):
    """Equal to the reference; every block of either query block exactly once, tagged with its
    owners; in the ascending order, each owner's blocks ascending (independent of the partner)."""
    b_, h_, nq, nk = mask.shape
    for b in range(b_):
        for h in range(h_):
            for p in range(ucnt.shape[2]):
                n = int(ucnt[b, h, p])
                assert torch.equal(uidx[b, h, p, :n], ref_idx[b, h, p, :n])
                codes = uidx[b, h, p, :n]
                own = torch.zeros(nk, dtype=torch.int32)
                own[(codes >> 2).long()] = codes & 3
                qa, qb = qpair[b, h, p].tolist()
                a = mask[b, h, qa].int()
                o = mask[b, h, qb].int() if qb < nq else torch.zeros_like(a)
                assert torch.equal(own, a | (o << 1))
                assert len(set((codes >> 2).tolist())) == n
                for bit in (1, 2) if order == "ascending" else ():
                    js = (codes[(codes & bit) != 0] >> 2).tolist()
                    assert js == sorted(js)


def adjacent_pairs(b, h, nq):
    first = torch.arange(0, nq, 2, dtype=torch.int32)
    return torch.stack([first, first + 1], -1).expand(b, h, -1, -1).contiguous()


def _mask_of(bits, n_kv_blocks):
    b, h, nq, nw = bits.shape
    lanes = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> lanes) & 1).reshape(b, h, nq, nw * 32)[..., :n_kv_blocks].bool()


def _matchings(group):
    """Perfect matchings of ``range(group)`` in the kernel's numbering: matching m in mixed radix
    (group - 1, group - 3, ..., 1), least significant first; at step s the first free block pairs
    with the c_s-th free block after it (matching 0: adjacent pairs)."""
    n = 1
    for c in range(group - 1, 0, -2):
        n *= c
    for m in range(n):
        free, pairs = list(range(group)), []
        for radix in range(group - 1, 0, -2):
            c, m = m % radix, m // radix
            pairs.append((free[0], free[c + 1]))
            free = free[1:c + 1] + free[c + 2:]
        yield pairs


def pair_match_torch(bits, group: int):
    """The matching in plain PyTorch: per aligned group, the first matching (in the kernel's
    numbering) with the most shared exact blocks; a group cut short by Nq keeps adjacent pairs."""
    b, h, nq, nw = bits.shape
    mask = _mask_of(bits, nw * 32).int()
    out = torch.empty(b, h, -(-nq // 2), 2, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            k = 0
            for g0 in range(0, nq, group):
                if g0 + group <= nq:
                    shared = mask[bi, hi, g0:g0 + group] @ mask[bi, hi, g0:g0 + group].T
                    best = max(_matchings(group), key=lambda m: sum(int(shared[i, j]) for i, j in m))
                    # max returns the first of equal weights, as the kernel's argmax
                else:
                    best = [(i, i + 1) for i in range(0, nq - g0, 2)]
                for i, j in best:
                    out[bi, hi, k] = torch.tensor([g0 + i, min(g0 + j, nq)])
                    k += 1
    return out


def pair_union_torch(bits, n_kv_blocks: int, width: int, qpair=None, order="owners"):
    """The same (uidx, ucnt) in plain PyTorch (the reference the kernel is tested against)."""
    b, h, nq, nw = bits.shape
    mask = _mask_of(bits, n_kv_blocks).int()
    if qpair is None:
        qpair = adjacent_pairs(b, h, nq)
    w2 = union_width(n_kv_blocks, width)
    nq2 = qpair.shape[2]
    codes = torch.zeros(b, h, nq2, w2, dtype=torch.int32)
    cnt = torch.zeros(b, h, nq2, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for p in range(nq2):
                qa, qb = qpair[bi, hi, p].tolist()
                o = mask[bi, hi, qa] | ((mask[bi, hi, qb] << 1) if qb < nq else 0)
                if order == "owners":
                    a, bb, s = [(o == c).nonzero().flatten().tolist() for c in (1, 2, 3)]
                    m = min(len(a), len(bb))
                    seq = [x for pr in zip(a[:m], bb[:m]) for x in pr] + a[m:] + bb[m:] + s
                    codes[bi, hi, p, : len(seq)] = torch.tensor([j * 4 + int(o[j]) for j in seq], dtype=torch.int32)
                    cnt[bi, hi, p] = len(seq)
                    continue
                seq, seg_a, seg_b = [], [], []
                for j in range(n_kv_blocks):
                    c = int(o[j])
                    if c == 1:
                        seg_a.append(j)
                    elif c == 2:
                        seg_b.append(j)
                    elif c == 3:  # a shared block closes a segment
                        m = min(len(seg_a), len(seg_b))
                        seq += [x for pr in zip(seg_a[:m], seg_b[:m]) for x in pr] + seg_a[m:] + seg_b[m:] + [j]
                        seg_a, seg_b = [], []
                m = min(len(seg_a), len(seg_b))
                seq += [x for pr in zip(seg_a[:m], seg_b[:m]) for x in pr] + seg_a[m:] + seg_b[m:]
                codes[bi, hi, p, : len(seq)] = torch.tensor([j * 4 + int(o[j]) for j in seq], dtype=torch.int32)
                cnt[bi, hi, p] = len(seq)
    return codes, cnt


def test_pair_union_refuses_an_unknown_order():
    """An order that is not a key of ``ORDERS`` is a ValueError naming ``order`` (not a KeyError)."""
    bits, w = _bits(torch.ones(1, 2, 3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="order must be one of"):
        pair_union(bits, 5, w, order="descending")
