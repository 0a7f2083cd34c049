"""The one representation of a block selection, shared by every backend.

A selection says, per (batch, head, query block), which key blocks are computed exactly; every
other key block is tail. Three int32 tensors of static shape (no host synchronisation to build):

* ``idx``  ``[B, H, Nq, W]``: the exact blocks in ascending order; entries past ``cnt`` are
  unspecified (``W`` is :func:`pisa_attn.spec.selection_width`);
* ``cnt``  ``[B, H, Nq]``: how many entries of ``idx`` are valid;
* ``bits`` ``[B, H, Nq, ceil(Nk / 32)]``: the same set as a bitmask (bit ``j % 32`` of word ``j // 32``).

Key block indices are relative to the key/value tensor the selection is used with: for one shard
of a longer sequence, :meth:`Selection.blocks` re-bases them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Selection(NamedTuple):
    idx: Tensor
    cnt: Tensor
    bits: Tensor

    @classmethod
    def from_mask(cls, mask: Tensor, width: int | None = None) -> "Selection":
        """From a bool exact-set mask ``[B, H, Nq, Nk]``. Rows with more than ``width`` exact blocks
        are truncated (size ``width`` to fit; default ``Nk``)."""
        return cls(*_mask_to_selection(mask, mask.shape[-1] if width is None else width))

    def to_mask(self, n_kv_blocks: int) -> Tensor:
        """The bool exact-set mask ``[B, H, Nq, Nk]`` (from ``bits``)."""
        return bits_to_mask(self.bits, n_kv_blocks)

    def repeat_rows(self, factor: int, n_q_blocks: int) -> "Selection":
        """Each row given to ``factor`` consecutive query blocks (a selection made per query block of
        ``factor`` blocks), cut to ``n_q_blocks`` rows."""
        if factor == 1:
            return self
        return Selection(*(x.repeat_interleave(factor, dim=2)[:, :, :n_q_blocks].contiguous() for x in self))

    def blocks(self, lo: int, hi: int) -> "Selection":
        """The selection restricted to key blocks ``[lo, hi)``, indices relative to ``lo``: what
        attends one K/V shard holding exactly those blocks."""
        mask = bits_to_mask(self.bits, hi)[..., lo:]
        return Selection.from_mask(mask, max(1, min(hi - lo, self.idx.shape[-1])))


def _mask_to_selection(mask: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    nk = mask.shape[-1]
    ar = torch.arange(nk, device=mask.device, dtype=torch.int32)
    # Selected blocks sort first, in ascending order; the rest follow as j + Nk.
    order = torch.where(mask, ar, ar + nk)
    idx = order.topk(min(width, nk), dim=-1, largest=False, sorted=True).values
    idx = torch.where(idx >= nk, idx - nk, idx).to(torch.int32)
    if width > nk:  # a wider list than there are blocks: pad (entries past cnt are unspecified)
        idx = torch.nn.functional.pad(idx, (0, width - nk))
    cnt = mask.sum(-1, dtype=torch.int32).clamp_max(width)
    nw = -(-nk // 32)
    padded = torch.nn.functional.pad(mask, (0, nw * 32 - nk)).reshape(*mask.shape[:-1], nw, 32)
    weights = torch.ones(32, device=mask.device, dtype=torch.int64) << torch.arange(32, device=mask.device)
    words = (padded.to(torch.int64) * weights).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return idx, cnt, words


def idx_to_mask(idx: Tensor, cnt: Tensor, n_kv_blocks: int) -> Tensor:
    """The bool ``[B, H, Nq, Nk]`` mask named by the first ``cnt`` entries of ``idx`` (tests check
    that ``idx`` and ``bits`` of a selection agree)."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
    mask = torch.zeros(*idx.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=idx.device)
    safe = torch.where(valid, idx.long(), torch.full_like(idx, n_kv_blocks, dtype=torch.long))
    mask.scatter_(-1, safe, True)
    return mask[..., :n_kv_blocks]


def bits_to_mask(bits: Tensor, n_kv_blocks: int) -> Tensor:
    """Unpack a ``bits`` tensor to the bool ``[B, H, Nq, Nk]`` mask."""
    lanes = torch.arange(32, device=bits.device, dtype=torch.int32)
    m = ((bits[..., None] >> lanes) & 1).bool()
    return m.reshape(*bits.shape[:-1], -1)[..., :n_kv_blocks]
