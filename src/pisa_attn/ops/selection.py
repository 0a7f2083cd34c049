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

from ..spec import is_int


class Selection(NamedTuple):
    idx: Tensor
    cnt: Tensor
    bits: Tensor

    @classmethod
    def from_mask(cls, mask: Tensor, width: int | None = None) -> "Selection":
        """From a bool exact-set mask ``[B, H, Nq, Nk]``. Rows with more than ``width`` exact blocks
        are truncated to their first ``width`` blocks, in the index list and the bits alike
        (default ``Nk``, at least 1)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a bool tensor [B, H, Nq, Nk], got {got}")
        if mask.dim() != 4:
            raise ValueError(f"mask must be a bool tensor [B, H, Nq, Nk], got shape {tuple(mask.shape)}")
        if width is None:
            width = max(1, mask.shape[-1])
        if width < 1:  # kernels and the selection checks read an index list of at least one column
            raise ValueError(f"width must be a positive int, got {width!r}")
        return cls(*_mask_to_selection(mask, width))

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
        attends one K/V shard holding exactly those blocks. Width ``max(1, min(hi - lo, W))``.

        Elementwise work on the index list and the bitmask only (a ring calls it once per step):
        the list is ascending, so the shard's entries are one contiguous run of it, and the
        shard's bitmask is the global one shifted right by ``lo`` bits."""
        if not 0 <= lo <= hi:
            raise ValueError(f"blocks: need 0 <= lo <= hi, got lo={lo}, hi={hi}")
        idx, cnt, bits = self.idx, self.cnt, self.bits
        w = idx.shape[-1]
        width = max(1, min(hi - lo, w))
        pos = torch.arange(w, device=idx.device, dtype=torch.int32)
        valid = pos < cnt[..., None]
        start = ((idx < lo) & valid).sum(-1, dtype=torch.int32)
        n_in = ((idx < hi) & valid).sum(-1, dtype=torch.int32) - start
        take = (start[..., None] + torch.arange(width, device=idx.device)).clamp_max(w - 1)
        # Entries past cnt are unspecified by contract; keep them inside the shard all the same.
        new_idx = (idx.gather(-1, take) - lo).clamp(0, max(hi - lo - 1, 0)).to(torch.int32)
        return Selection(new_idx, n_in, _shift_bits(bits, lo, hi))


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
    if width < nk:  # the bits must name exactly the listed blocks (a kernel reads both)
        mask = mask & (mask.cumsum(-1) <= width)
    nw = -(-nk // 32)
    padded = torch.nn.functional.pad(mask, (0, nw * 32 - nk)).reshape(*mask.shape[:-1], nw, 32)
    weights = torch.ones(32, device=mask.device, dtype=torch.int64) << torch.arange(32, device=mask.device)
    words = (padded.to(torch.int64) * weights).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return idx, cnt, words


def _shift_bits(bits: Tensor, lo: int, hi: int) -> Tensor:
    """Bitmask words of blocks ``[lo, hi)`` re-based to 0 (bit ``j - lo``), bits past ``hi`` cleared."""
    n = hi - lo
    nw = -(-n // 32)
    if nw == 0:
        return bits[..., :0]
    w0, s = divmod(lo, 32)
    u = bits.to(torch.int64) & 0xFFFFFFFF  # the words as unsigned 32-bit values
    need = w0 + nw + 1  # the words read below, one past the last for the high part
    if u.shape[-1] < need:
        u = torch.nn.functional.pad(u, (0, need - u.shape[-1]))
    low, high = u[..., w0 : w0 + nw], u[..., w0 + 1 : w0 + nw + 1]
    words = ((low >> s) | (high << (32 - s))) & 0xFFFFFFFF
    tail = n - 32 * (nw - 1)  # valid bits of the last word (1..32)
    if tail < 32:
        words[..., -1] &= (1 << tail) - 1
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def bits_to_mask(bits: Tensor, n_kv_blocks: int) -> Tensor:
    """Unpack a ``bits`` tensor to the bool ``[B, H, Nq, Nk]`` mask (``bits`` holds ``ceil(Nk / 32)``
    words: another count is a selection of other keys, whose mask would be cut or short)."""
    if n_kv_blocks < 0 or (n_kv_blocks + 31) // 32 != bits.shape[-1]:
        raise ValueError(f"n_kv_blocks must be a block count of {bits.shape[-1]} bitmask words "
                         f"({max(0, 32 * bits.shape[-1] - 31)}..{32 * bits.shape[-1]}), got {n_kv_blocks!r}")
    lanes = torch.arange(32, device=bits.device, dtype=torch.int32)
    m = ((bits[..., None] >> lanes) & 1).bool()
    return m.reshape(*bits.shape[:-1], bits.shape[-1] * 32)[..., :n_kv_blocks]


def check_keep_blocks(keep_blocks, batch: int, heads: int, n_kv_blocks: int, device) -> Tensor | None:
    """Validate ``keep_blocks`` (TypeError/ValueError naming it) and return it as a bool
    ``[B|1, H|1, Nk]`` view, where it is (no copy, no host read)."""
    if keep_blocks is None:
        return None
    if not isinstance(keep_blocks, Tensor):
        raise TypeError(f"keep_blocks must be a bool tensor or None, got {type(keep_blocks).__name__}")
    if keep_blocks.dtype != torch.bool:
        raise TypeError(f"keep_blocks must have dtype torch.bool, got {keep_blocks.dtype}")
    if keep_blocks.device != device and keep_blocks.device.type != "cpu":
        raise ValueError(f"keep_blocks must be on the CPU or on q's device ({device}), got {keep_blocks.device}")
    shape = tuple(keep_blocks.shape)
    ok = (len(shape) == 1 and shape[0] == n_kv_blocks) or (
        len(shape) == 3 and shape[0] in (1, batch) and shape[1] in (1, heads) and shape[2] == n_kv_blocks
    )
    if not ok:
        raise ValueError(
            f"keep_blocks must have shape [{n_kv_blocks}] or broadcastable [{batch}, {heads}, {n_kv_blocks}] "
            f"(one flag per key block), got {shape}"
        )
    return keep_blocks.reshape(1, 1, n_kv_blocks) if len(shape) == 1 else keep_blocks


def _no_host_read(keep: Tensor) -> bool:
    """True while a graph is traced or a CUDA graph captured: ``keep`` cannot be read then."""
    return torch.compiler.is_compiling() or (keep.is_cuda and torch.cuda.is_current_stream_capturing())


def keep_row_bound(keep: Tensor, n_kv_blocks: int) -> int:
    """The most kept blocks of any row of ``keep`` (bool ``[B|1, H|1, Nk]``): read on the host (free
    for a CPU mask, one synchronisation otherwise), or, while a graph is traced or a CUDA graph
    captured, where nothing may be read, the static bound ``n_kv_blocks`` (an index list of every
    block holds any row)."""
    return n_kv_blocks if _no_host_read(keep) else int(keep.sum(-1).max())


def check_select_width(width: int, n_select: int, n_kv_blocks: int, keep: Tensor | None,
                       n_keep_max: int | None) -> int | None:
    """Check that a select call's index lists of ``width`` hold every block a row lists:
    ``min(n_select, Nk)`` (at least 1), plus with ``keep`` up to ``n_keep_max`` kept blocks, at
    most ``Nk`` in all (ValueError naming ``width``; ``n_keep_max`` must be an int in ``[0, Nk]``,
    TypeError/ValueError naming it). ``n_keep_max=None`` with ``keep``: the most kept blocks of a
    row are read from ``keep`` where the width needs it (below ``Nk``), one host synchronisation;
    refused while a CUDA graph is captured or a graph traced (pass ``n_keep_max`` there). Returns
    ``n_keep_max`` (read from ``keep`` where it was), to pass on without another read."""
    if n_keep_max is not None:
        if not is_int(n_keep_max):
            raise TypeError(f"n_keep_max must be an int (the most kept blocks of any row) or None, "
                            f"got {n_keep_max!r} ({type(n_keep_max).__name__})")
        if not 0 <= n_keep_max <= n_kv_blocks:
            raise ValueError(f"n_keep_max must be in [0, Nk = {n_kv_blocks}] (the most kept blocks of any row), "
                             f"got {n_keep_max}")
    n_sel = max(1, min(n_select, n_kv_blocks))
    if width < n_sel:
        raise ValueError(f"width must be at least min(n_select, Nk) = {n_sel} (the blocks every row lists), "
                         f"got {width!r}")
    if keep is None or width >= n_kv_blocks:  # a list of every block holds any row
        return n_keep_max
    if n_keep_max is None:
        if _no_host_read(keep):  # the static bound (every block) would not fit a width below Nk
            raise ValueError("n_keep_max must be given with keep while a CUDA graph is captured or a graph traced "
                             "(reading the kept blocks' count from keep is a host synchronisation)")
        n_keep_max = keep_row_bound(keep, n_kv_blocks)
    need = min(n_kv_blocks, n_sel + n_keep_max)
    if width < need:
        # the kernels list every kept block on top of the top-k: a narrower list cannot hold them
        raise ValueError(f"width must be at least min(Nk, n_select + n_keep_max) = {need} (the top-k plus up to "
                         f"{n_keep_max} kept blocks a row lists), got {width!r}")
    return n_keep_max


def check_selection(selection, batch: int, heads: int, n_q_blocks: int, n_kv_blocks: int, device,
                    contiguous: bool = False) -> None:
    """Check that ``selection`` is a :class:`Selection` of rows ``[batch, heads, n_q_blocks]``,
    an index list of at least one column, ``ceil(n_kv_blocks / 32)`` bitmask words, int32 on
    ``device`` (and ``contiguous``, for kernels that read it without strides): TypeError or
    ValueError naming ``selection``. Shapes, dtypes and devices only: no host synchronisation."""
    if not isinstance(selection, Selection):
        raise TypeError(f"selection must be a pisa_attn.ops.selection.Selection, got {type(selection).__name__}")
    rows = (batch, heads, n_q_blocks)
    nw = -(-n_kv_blocks // 32)
    device = torch.device(device)
    for name, x in zip(Selection._fields, selection):
        if not isinstance(x, Tensor):
            raise ValueError(f"selection.{name} must be an int32 tensor, got {type(x).__name__}")
        s = x.shape
        shape_ok = s[:3] == rows and (len(s) == 4 and s[3] >= 1 if name == "idx" else
                                      len(s) == 3 if name == "cnt" else len(s) == 4 and s[3] == nw)
        if not shape_ok or x.dtype != torch.int32 or x.device != device:
            raise ValueError(f"selection.{name} does not fit the call (rows [B, H, Nq] = {list(rows)}, index lists of "
                             f"at least one entry, {nw} bitmask words for {n_kv_blocks} key blocks, int32 on "
                             f"{device}): got {x.dtype} {tuple(s)} on {x.device}")
        if contiguous and not x.is_contiguous():
            raise ValueError(f"selection.{name} must be contiguous (the kernels read it without strides), got "
                             f"strides {tuple(x.stride())}: pass Selection(*(x.contiguous() for x in selection))")
