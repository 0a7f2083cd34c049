"""The Selection type on its own: mask round trips at block counts around the 32-bit words, the
index list and the bits naming one set, and its argument checks."""

from __future__ import annotations

import pytest
import torch

from pisa_attn.ops.selection import Selection, bits_to_mask, check_select_width
from selection_masks import idx_to_mask


@pytest.mark.parametrize("nk", [1, 31, 32, 33, 64, 65, 100])
def test_mask_round_trip_and_bits_agree_with_idx(nk):
    """Empty rows, full rows and random rows come back from bits; with a width below a row's count
    the list and the bits both keep its first ``width`` blocks."""
    g = torch.Generator().manual_seed(nk)
    mask = torch.rand(2, 3, 4, nk, generator=g) < 0.4
    mask[0, 0, 0] = False
    mask[0, 0, 1] = True
    sel = Selection.from_mask(mask)
    assert sel.bits.shape[-1] == -(-nk // 32) and sel.bits.dtype == torch.int32
    assert torch.equal(sel.to_mask(nk), mask) and torch.equal(idx_to_mask(sel.idx, sel.cnt, nk), mask)
    for width in (1, 5, nk + 3):
        s = Selection.from_mask(mask, width)
        assert s.idx.shape[-1] == width and int(s.cnt.max()) <= width
        assert torch.equal(s.to_mask(nk), idx_to_mask(s.idx, s.cnt, nk))
        assert torch.equal(s.to_mask(nk) & ~mask, torch.zeros_like(mask))  # never a block the mask lacks


def test_to_mask_rejects_a_block_count_the_bits_do_not_hold():
    """Bits hold ``ceil(Nk / 32)`` words: another block count (a selection of other keys) would give
    a mask of the wrong width or silently drop blocks."""
    sel = Selection.from_mask(torch.ones(1, 2, 3, 40, dtype=torch.bool))
    assert sel.to_mask(33).shape[-1] == 33 and sel.to_mask(64).shape[-1] == 64  # two words either way
    for n in (70, 10, -1):
        with pytest.raises(ValueError, match="n_kv_blocks"):
            sel.to_mask(n)
        with pytest.raises(ValueError, match="n_kv_blocks"):
            bits_to_mask(sel.bits, n)


def test_from_mask_checks_its_arguments():
    mask = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    with pytest.raises(TypeError, match="mask"):
        Selection.from_mask(mask.int())
    with pytest.raises(TypeError, match="mask"):
        Selection.from_mask(mask.tolist())
    for width in (0, -1):  # an index list needs a column (kernels and checks read W >= 1)
        with pytest.raises(ValueError, match="width"):
            Selection.from_mask(mask, width)
    with pytest.raises(ValueError, match="mask"):
        Selection.from_mask(torch.ones(8, dtype=torch.bool))


def test_select_width_check_reads_keep_only_where_it_may(monkeypatch):
    """Without ``n_keep_max`` the kept blocks' count is read from ``keep`` (a host sync) only where
    the width needs it; while a graph is traced or captured that read is refused, naming the argument."""
    keep = torch.zeros(1, 2, 10, dtype=torch.bool)
    keep[0, 1, :4] = True
    assert check_select_width(7, 3, 10, keep, None) == 4
    with pytest.raises(ValueError, match="width"):
        check_select_width(6, 3, 10, keep, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="n_keep_max"):
        check_select_width(7, 3, 10, keep, None)
    assert check_select_width(10, 3, 10, keep, None) is None  # every block fits: nothing to read
    assert check_select_width(7, 3, 10, keep, 4) == 4
