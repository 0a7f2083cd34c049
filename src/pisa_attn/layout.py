"""Token layouts: where image/video tokens sit in the sequence PISA sees.

PISA pools queries and keys over runs of ``block_size`` consecutive tokens, so a block must be a
compact patch of the image/video: in raster order a 64-token block is a thin line, far from its
centroid, and the 0th-order (centroid) tail error is several times larger. A :class:`TokenOrder`
describes a sequence (ordered text and grid segments) and a permutation into *tiled* order.

Orders (``TokenOrder.order``):

* ``"raster"``: the original order (identity permutation), the untiled baseline.
* ``"tiles"``: segments in their original order; each grid is cut into tiles, tiles raster over the
  tile grid, tokens raster within a tile, and the smaller ragged tiles at the right/bottom/last-frame
  edges stay in line. Simple, but every ragged tile shifts all later tiles off the block grid (and a
  text prefix whose length is not a multiple of the tile volume shifts the whole grid), so many
  blocks straddle two tiles.
* ``"compact"`` (default): block-aligned packing. Each grid is cut into boxes (the full-tile core and
  the ragged edge slabs); an edge slab that is thinner than the tile in some axis is tiled with a
  re-shaped tile that keeps that thin extent and grows the other axes until it holds about a tile's
  volume (e.g. the 1-frame remainder of a 4x4x4 tiling is cut into 1x8x8 tiles). The sequence is

      [all full tiles of all grids] [text segments, in order] [leftover pieces]

  so every full tile is one aligned block when ``prod(tile) == block_size`` whatever the text
  length; text starts at a block boundary (it follows whole tiles) and stays contiguous and in
  order; the few leftover pieces smaller than a tile share blocks (a block may straddle text and
  image: it is then a keep block, see :meth:`TokenOrder.keep_blocks`).
* ``"compact_inplace"``: the same pieces as ``"compact"``, but every segment keeps its original
  range of positions, so text stays exactly where the model has it (the diffusers integration
  permutes only image tokens). Within a grid's range ``[s, s + n)`` the order is

      [tail of the leftovers: up to the first block boundary] [full tiles] [rest of the leftovers]

  so the full tiles start on a block boundary whatever ``s`` is. Padding to the boundary is not
  possible (the permutation is a bijection on the model's tokens), so leftover pieces fill the
  partial block shared with the text before; when there are too few, the last full tiles are
  broken up to fill it: ``min(full tiles, aligned blocks inside [s, s + n))`` tiles are one
  aligned block, which is the most any placement can reach. ``offset`` is the position of the
  layout's first token in the attention sequence whose blocks count (an image-only layout that
  must match the image part of a joint ``[text][image]`` sequence); only ``offset % prod(tile)``
  matters.

:meth:`TokenOrder.compactness` measures how many blocks of a layout are exactly one tile and how
far their tokens sit from the block centroid (per-grid numbers: ``notes/token-layouts.md``).

Original order is the concatenation of segments, each grid flattened row-major ((t, h, w) or
(h, w)), as DiT patchifiers emit it. ``perm[i]`` is the original index of tiled position ``i``:
``x_tiled = x.index_select(dim, perm)`` and ``x = x_tiled.index_select(dim, inv_perm)``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .settings import as_int

ORDERS = ("compact", "compact_inplace", "tiles", "raster")
DEFAULT_TILES = {2: (8, 8), 3: (4, 4, 4)}


def _check_int(name: str, value, minimum: int) -> int:
    value = as_int(name, value, "an int")  # numpy ints too, returned as a Python int
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_shape(name: str, shape, ranks=(2, 3)) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(shape).__name__}")
    if len(shape) not in ranks:
        raise ValueError(f"{name} must have rank {' or '.join(map(str, ranks))}, got {tuple(shape)}")
    for i, s in enumerate(shape):
        _check_int(f"{name}[{i}]", s, 1)
    return tuple(int(s) for s in shape)


@dataclass(frozen=True)
class Text:
    """A run of ``n`` non-grid tokens (text, prefix, suffix, registers) kept contiguous."""

    n: int
    name: str = "text"

    def __post_init__(self):
        object.__setattr__(self, "n", _check_int("n", self.n, 1))

    @property
    def num_tokens(self) -> int:
        return self.n


@dataclass(frozen=True)
class Grid:
    """An image ``(h, w)`` or video ``(t, h, w)`` token grid, flattened row-major in original order."""

    shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", _check_shape("grid", self.shape))

    @property
    def num_tokens(self) -> int:
        return math.prod(self.shape)


class _Tables(NamedTuple):
    perm: Tensor  # [L] tiled position -> original index
    inv_perm: Tensor  # [L] original index -> tiled position
    piece: Tensor  # [L] per tiled token: tile/piece id (-1: text, or any token of a raster layout)
    piece_size: Tensor  # [P] tokens per piece
    coords: Tensor  # [L, r] per tiled token: grid coordinates (-1 for text); r = 0 without grids
    segment: Tensor  # [L] per tiled token: segment index


class BlockInfo(NamedTuple):
    """Per-block description of a tiled sequence cut into ``block_size`` blocks (``N`` blocks).

    counts:      [N] tokens per block (the last block may be short)
    text_counts: [N] text tokens per block (> 0 marks a keep block)
    tile_index:  [N] id of the tile the block is exactly made of, else -1 (straddling / raster)
    lo, hi:      [N, r] inclusive bounding box of the block's grid tokens (-1 when it has none)
    spread:      [N] RMS distance (in tokens) of the block's grid tokens to their centroid;
                 a 4x4x4 tile has 1.94, an 8x8 tile 3.24, 64 tokens of one raster row 18.5
    """

    counts: Tensor
    text_counts: Tensor
    tile_index: Tensor
    lo: Tensor
    hi: Tensor
    spread: Tensor


@dataclass(frozen=True)
class TokenOrder:
    """A token sequence (ordered :class:`Text`/:class:`Grid` segments) and its tiled order.

    Hashable and cheap; the permutations are built once per distinct layout (cached) in well
    under a second even for 33x45x80. Tensors returned by the properties are shared cached
    objects: do not modify them in place.
    """

    segments: tuple[Text | Grid, ...]
    tile: tuple[int, ...] | None = None
    order: str = "compact"
    offset: int = 0  # "compact_inplace" only: position of the first token in the blocked sequence

    def __post_init__(self):
        segs = tuple(self.segments) if isinstance(self.segments, (tuple, list)) else None
        if not segs or not all(isinstance(s, (Text, Grid)) for s in segs):
            raise ValueError("segments must be a non-empty sequence of Text and Grid segments")
        object.__setattr__(self, "segments", segs)
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        ranks = {len(s.shape) for s in segs if isinstance(s, Grid)}
        if len(ranks) > 1:
            raise ValueError(f"all grids of one layout must have the same rank, got ranks {sorted(ranks)}")
        if self.order == "raster":
            if self.tile is not None:
                _check_shape("tile", self.tile)  # refused alike in every order, then dropped
            object.__setattr__(self, "tile", None)  # tile is meaningless without tiling
        elif ranks:
            if self.tile is None:
                raise ValueError(f"tile is required for order={self.order!r}")
            (rank,) = ranks
            tile = _check_shape("tile", self.tile)
            if len(tile) != rank:
                raise ValueError(f"tile must have the grid's rank {rank}, got {tile}")
            object.__setattr__(self, "tile", tile)
        else:
            object.__setattr__(self, "tile", None)
        object.__setattr__(self, "offset", _check_int("offset", self.offset, 0))
        if self.offset and self.order != "compact_inplace":
            raise ValueError(f"offset applies to order='compact_inplace' only, got order={self.order!r}")
        # Only the phase within a block steers the placement: equal orders compare and hash equal.
        object.__setattr__(self, "offset", self.offset % math.prod(self.tile) if self.tile else 0)

    # --- sizes -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def num_text_tokens(self) -> int:
        return sum(s.n for s in self.segments if isinstance(s, Text))

    @property
    def grids(self) -> tuple[Grid, ...]:
        return tuple(s for s in self.segments if isinstance(s, Grid))

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Shape of the layout's single grid (ValueError when it has none or several)."""
        if len(self.grids) != 1:
            raise ValueError(f"layout has {len(self.grids)} grids, grid_shape needs exactly one")
        return self.grids[0].shape

    @property
    def is_identity(self) -> bool:
        return self.order == "raster" or not self.grids

    def raster(self) -> TokenOrder:
        """The same segments in original (untiled) order."""
        return TokenOrder(self.segments, None, "raster")

    # --- permutations ------------------------------------------------------------------------
    @property
    def perm(self) -> Tensor:
        """LongTensor [L] (CPU): tiled position -> original index."""
        return _tables(self).perm

    @property
    def inv_perm(self) -> Tensor:
        """LongTensor [L] (CPU): original index -> tiled position."""
        return _tables(self).inv_perm

    def perm_on(self, device, inverse: bool = False) -> Tensor:
        """``perm`` (or ``inv_perm``) on ``device``, cached per device."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the cache key names the device it holds
            device = torch.device("cuda", torch.cuda.current_device())
        return _device_perm(self, str(device), bool(inverse))

    def to_tiled(self, x: Tensor, dim: int) -> Tensor:
        """Reorder ``x`` along ``dim`` (length ``num_tokens``) from original to tiled order.

        Identity layouts (raster, text only) return ``x`` itself, others a new tensor.
        """
        return self._apply(x, dim, inverse=False)

    def from_tiled(self, x: Tensor, dim: int) -> Tensor:
        """Exact inverse of :meth:`to_tiled`."""
        return self._apply(x, dim, inverse=True)

    def _apply(self, x: Tensor, dim: int, inverse: bool) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = as_int("dim", dim, "an int")  # numpy ints too; a bool or float is a TypeError
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}")
        if x.shape[dim] != self.num_tokens:
            raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim}, the layout has {self.num_tokens}")
        if self.is_identity:
            return x
        return x.index_select(dim, self.perm_on(x.device, inverse))

    def mask_to_tiled(self, mask: Tensor, batch: int) -> Tensor:
        """An attention mask over this sequence in original order, reordered like the tokens.

        ``mask`` is a key-padding mask ``[batch, L]`` or a mask broadcastable to ``[B, H, Lq, Lk]``
        whose last dim (keys) and, when not 1, second-to-last dim (queries) have ``L`` entries.
        """
        if not isinstance(mask, Tensor):
            raise TypeError(f"attention mask must be a tensor, got {type(mask).__name__}")
        n = self.num_tokens
        if mask.dim() == 2 and batch == n and mask.shape[0] == n:  # key padding or query x key?
            raise ValueError(f"attention mask of shape {tuple(mask.shape)} is ambiguous for a batch of {batch}: "
                             f"give key padding as [{batch}, 1, 1, {n}] or a query x key mask as [1, 1, {n}, {n}]")
        if mask.dim() == 2 and tuple(mask.shape) == (batch, n):  # key padding (diffusers' 2-D form)
            return self.to_tiled(mask, 1)
        if mask.dim() < 1 or mask.shape[-1] != n or (mask.dim() >= 2 and mask.shape[-2] not in (1, n)):
            raise ValueError(
                f"attention mask of shape {tuple(mask.shape)} does not cover this {n}-token sequence "
                f"([{batch}, {n}] key padding, or broadcastable to [B, H, {n}, {n}])"
            )
        out = self.to_tiled(mask, mask.dim() - 1)
        return self.to_tiled(out, out.dim() - 2) if out.dim() >= 2 and out.shape[-2] == n else out

    # --- per-token / per-block descriptions (tiled order) -------------------------------------
    def text_mask_tokens(self) -> Tensor:
        """Bool [L]: which tiled positions hold text tokens."""
        return _text_mask(self)

    def coords(self, tiled: bool = True) -> Tensor:
        """LongTensor [L, r]: grid coordinates per token ((t, h, w) or (h, w)), -1 rows for text."""
        c = _tables(self).coords
        return c if tiled else c.index_select(0, self.inv_perm)

    def segment_ids(self, tiled: bool = True) -> Tensor:
        """LongTensor [L]: index into ``segments`` per token."""
        s = _tables(self).segment
        return s if tiled else s.index_select(0, self.inv_perm)

    def keep_blocks(self, block_size: int = 64) -> Tensor:
        """Bool [Nk]: key blocks of the tiled sequence holding at least one text token.

        Pass it as ``pisa_attention(keep_blocks=...)``: text keys are few and attended by every
        image query, so they are always computed exactly.
        """
        return self.blocks(block_size).text_counts > 0

    def block_tokens(self, block_size: int = 64) -> Tensor:
        """LongTensor [Nk]: tokens per block (``block_size`` except a shorter last block)."""
        return self.blocks(block_size).counts

    def blocks(self, block_size: int = 64) -> BlockInfo:
        """Per-block description (:class:`BlockInfo`) of the tiled sequence."""
        _check_int("block_size", block_size, 1)
        return _block_info(self, block_size)

    def compactness(self, block_size: int = 64) -> dict:
        """Summary of how image-like the blocks are (grid blocks only, i.e. no text token).

        ``one_tile``: fraction of blocks that are exactly one full tile of ``block_size`` tokens;
        ``mean_spread`` / ``max_spread``: RMS token distance to the block centroid (see
        :class:`BlockInfo`).
        """
        info = self.blocks(block_size)
        grid_only = info.text_counts == 0
        whole = (info.tile_index >= 0) & (info.counts == block_size)
        spread = info.spread[grid_only]
        n = int(grid_only.sum())
        return {
            "blocks": int(info.counts.numel()),
            "grid_blocks": n,
            "one_tile": float(whole[grid_only].float().mean()) if n else 0.0,
            "mean_spread": float(spread.mean()) if n else 0.0,
            "max_spread": float(spread.max()) if n else 0.0,
        }


def block_floor(position: int, block_size: int) -> int:
    """The block boundary at or before ``position``.

    Queries ``[lo, hi)`` of a blocked sequence (the image queries after a text prefix) run as rows
    ``[block_floor(lo), hi)``: their query blocks are then the key blocks, i.e. the tiles the layout
    put on block boundaries; cut at ``lo``, every query block would straddle two tiles. The extra
    rows before ``lo`` are computed and dropped.
    """
    position = _check_int("position", position, 0)
    block_size = _check_int("block_size", block_size, 1)  # 0 would divide by zero
    return position - position % block_size


# --- constructors ------------------------------------------------------------------------------
def _segments(grid: Grid, text_before: int, text_after: int) -> tuple[Text | Grid, ...]:
    _check_int("text_before", text_before, 0)
    _check_int("text_after", text_after, 0)
    segs: list[Text | Grid] = []
    if text_before:
        segs.append(Text(text_before, "prefix"))
    segs.append(grid)
    if text_after:
        segs.append(Text(text_after, "suffix"))
    return tuple(segs)


def make_layout(
    grid, *, tile=None, text_before: int = 0, text_after: int = 0, order: str = "compact", offset: int = 0
) -> TokenOrder:
    """Layout of ``[text_before tokens][grid][text_after tokens]`` in tiled ``order``.

    ``grid`` is ``(h, w)`` or ``(t, h, w)``; ``tile`` defaults to 8x8 / 4x4x4 (64 tokens);
    ``offset``: see ``"compact_inplace"`` in the module docstring.
    """
    g = Grid(_check_shape("grid", grid))
    if tile is None:
        tile = DEFAULT_TILES[len(g.shape)]
    tile = tuple(tile) if isinstance(tile, list) else tile
    return TokenOrder(_segments(g, text_before, text_after), tile, order, offset)


def grid2d(h: int, w: int, *, tile=(8, 8), text_before: int = 0, text_after: int = 0, order: str = "compact") -> TokenOrder:
    """Image layout: an ``h x w`` token grid with optional text before/after."""
    return make_layout((h, w), tile=tile, text_before=text_before, text_after=text_after, order=order)


def grid3d(
    t: int, h: int, w: int, *, tile=(4, 4, 4), text_before: int = 0, text_after: int = 0, order: str = "compact"
) -> TokenOrder:
    """Video layout: a ``t x h x w`` token grid with optional text before/after."""
    return make_layout((t, h, w), tile=tile, text_before=text_before, text_after=text_after, order=order)


def raster(grid, *, text_before: int = 0, text_after: int = 0) -> TokenOrder:
    """The untiled baseline: original order (identity permutation)."""
    return TokenOrder(_segments(Grid(_check_shape("grid", grid)), text_before, text_after), None, "raster")


# --- construction of the tables ----------------------------------------------------------------
def _strides(shape) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def _adapt_tile(box, tile, fixed, target) -> tuple[int, ...]:
    """Tile for a box: thin (``fixed``) axes take the box extent; the others start at the base
    tile and grow (smallest axis first, ties to the last axis) until about ``target`` tokens."""
    t = [box[d] if d in fixed else min(tile[d], box[d]) for d in range(len(box))]
    while math.prod(t) < target:
        free = [d for d in range(len(box)) if d not in fixed and t[d] < box[d]]
        if not free:
            break
        d = min(free, key=lambda a: (t[a], -a))
        others = math.prod(t) // t[d]
        t[d] = min(box[d], 2 * t[d], -(-target // others))
    return tuple(t)


def _tile_boxes(origin, box, tile, target, out) -> None:
    """Cut ``box`` into a full-tile core plus edge boxes (each tiled with an adapted tile)."""
    rank = len(box)
    core = [b // t * t for b, t in zip(box, tile)]
    out.append((tuple(origin), tuple(core), tuple(tile)))
    ragged = [d for d in range(rank) if core[d] < box[d]]
    subsets = [c for n in range(1, len(ragged) + 1) for c in itertools.combinations(ragged, n)]
    for mask in subsets:
        sub_origin = [origin[d] + (core[d] if d in mask else 0) for d in range(rank)]
        sub_box = [box[d] - core[d] if d in mask else core[d] for d in range(rank)]
        _tile_boxes(sub_origin, sub_box, _adapt_tile(sub_box, tile, set(mask), target), target, out)


def _box_tokens(origin, core, tile, strides) -> Tensor:
    """Flat grid indices of a box cut into whole tiles: [n_tiles, tile volume], tiles raster over
    the tile grid, tokens raster within a tile."""
    rank = len(core)
    n = [c // t for c, t in zip(core, tile)]
    idx = torch.zeros([1] * (2 * rank), dtype=torch.long)
    for d in range(rank):
        a = origin[d] + torch.arange(n[d])[:, None] * tile[d] + torch.arange(tile[d])[None, :]
        shape = [1] * (2 * rank)
        shape[d], shape[rank + d] = n[d], tile[d]
        idx = idx + (a * strides[d]).reshape(shape)
    return idx.reshape(math.prod(n), math.prod(tile))


def _inline_tokens(shape, tile) -> tuple[Tensor, Tensor]:
    """"tiles" order: (flat indices, tile id per token), ragged tiles in line."""
    rank = len(shape)
    coords = _unravel(torch.arange(math.prod(shape)), shape)
    ntile = [-(-s // t) for s, t in zip(shape, tile)]
    tile_id = sum((coords[:, d] // tile[d]) * _strides(ntile)[d] for d in range(rank))
    within = sum((coords[:, d] % tile[d]) * _strides(tile)[d] for d in range(rank))
    key = tile_id * math.prod(tile) + within
    order = torch.argsort(key)
    return order, tile_id[order]


def _unravel(flat: Tensor, shape) -> Tensor:
    out = []
    for s in reversed(shape):
        out.append(flat % s)
        flat = flat // s
    return torch.stack(out[::-1], dim=1)


def _compact_parts(shape, tile, target, off) -> tuple[list, list]:
    """"compact" pieces of one grid whose flat indices start at ``off``: (parts made of pieces of
    exactly ``target`` tokens, parts of leftover pieces), each part (indices, piece id, sizes)."""
    fixed = {d for d in range(len(shape)) if shape[d] < tile[d]}
    boxes: list = []
    _tile_boxes([0] * len(shape), shape, _adapt_tile(shape, tile, fixed, target), target, boxes)
    strides = _strides(shape)
    whole, rest = [], []
    for origin, core, t in boxes:
        if 0 in core:
            continue
        toks = _box_tokens(origin, core, t, strides) + off
        n_t, vol = toks.shape
        part = (toks.reshape(-1), torch.arange(n_t).repeat_interleave(vol), torch.full((n_t,), vol))
        (whole if vol == target else rest).append(part)
    return whole, rest


def _in_place_part(whole: list, rest: list, start: int, target: int) -> tuple[Tensor, Tensor, Tensor]:
    """"compact_inplace" order of one grid occupying sequence positions [start, start + n):
    leftovers up to the first block boundary, then the full tiles (each one aligned block), then
    the remaining leftovers. When the leftovers cannot fill the gap before the boundary, the last
    full tiles join the leftovers: only ``m`` whole blocks fit inside the range anyway."""
    parts = whole + rest
    idx = torch.cat([p[0] for p in parts])
    sizes = torch.cat([p[2] for p in parts])
    base = list(itertools.accumulate([p[2].numel() for p in parts], initial=0))  # piece ids per part
    pid = torch.cat([p[1] + base[i] for i, p in enumerate(parts)])
    n, n_whole = idx.numel(), sum(p[0].numel() for p in whole)
    gap = -start % target  # tokens before the first block boundary inside the range
    m = max(0, ((start + n) // target * target - start - gap) // target)  # whole blocks inside
    keep = min(n_whole // target, m) * target
    spare = torch.cat([torch.arange(n_whole, n), torch.arange(keep, n_whole)])  # leftovers, broken tiles
    h = min(gap, spare.numel())
    order = torch.cat([spare[spare.numel() - h :], torch.arange(keep), spare[: spare.numel() - h]])
    return idx[order], pid[order], sizes


@functools.lru_cache(maxsize=64)
def _tables(layout: TokenOrder) -> _Tables:
    offsets = list(itertools.accumulate([s.num_tokens for s in layout.segments], initial=0))
    target = math.prod(layout.tile) if layout.tile else 0
    # Parts in tiled order; each is (original indices, piece id per token (local), piece sizes).
    head, middle, tail = [], [], []
    for si, seg in enumerate(layout.segments):
        off = offsets[si]
        if isinstance(seg, Text) or layout.order == "raster":
            part = (torch.arange(off, off + seg.num_tokens), None, None)
            (middle if layout.order == "compact" else head).append((si, part))
            continue
        if layout.order == "tiles":
            idx, tid = _inline_tokens(seg.shape, layout.tile)
            sizes = torch.bincount(tid)
            head.append((si, (idx + off, tid, sizes)))
            continue
        whole, rest = _compact_parts(seg.shape, layout.tile, target, off)
        if layout.order == "compact_inplace":  # the grid keeps its own range of positions
            head.append((si, _in_place_part(whole, rest, layout.offset + off, target)))
            continue
        head.extend((si, p) for p in whole)
        tail.extend((si, p) for p in rest)
    perm_parts, piece_parts, size_parts, seg_parts = [], [], [], []
    n_pieces = 0
    for si, (idx, pid, sizes) in head + middle + tail:
        perm_parts.append(idx)
        seg_parts.append(torch.full((idx.numel(),), si, dtype=torch.long))
        if pid is None:
            piece_parts.append(torch.full((idx.numel(),), -1, dtype=torch.long))
        else:
            piece_parts.append(pid + n_pieces)
            size_parts.append(sizes)
            n_pieces += sizes.numel()
    perm = torch.cat(perm_parts)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    segment = torch.cat(seg_parts)
    rank = len(layout.grids[0].shape) if layout.grids else 0
    coords = torch.full((perm.numel(), rank), -1, dtype=torch.long)
    for si, seg in enumerate(layout.segments):
        if isinstance(seg, Grid):
            sel = segment == si
            coords[sel] = _unravel(perm[sel] - offsets[si], seg.shape)
    sizes = torch.cat(size_parts) if size_parts else torch.zeros(0, dtype=torch.long)
    return _Tables(perm, inv, torch.cat(piece_parts), sizes, coords, segment)


@functools.lru_cache(maxsize=64)
def _device_perm(layout: TokenOrder, device: str, inverse: bool) -> Tensor:
    t = _tables(layout)
    return (t.inv_perm if inverse else t.perm).to(device)


@functools.lru_cache(maxsize=64)
def _text_mask(layout: TokenOrder) -> Tensor:
    t = _tables(layout)
    is_text = torch.tensor([isinstance(s, Text) for s in layout.segments], dtype=torch.bool)
    return is_text[t.segment]


@functools.lru_cache(maxsize=64)
def _block_info(layout: TokenOrder, block_size: int) -> BlockInfo:
    t = _tables(layout)
    length = t.perm.numel()
    n = -(-length // block_size)
    blk = torch.arange(length) // block_size
    counts = torch.bincount(blk, minlength=n)
    text = _text_mask(layout)
    text_counts = torch.bincount(blk, weights=text.double(), minlength=n).long()
    # A block is one tile when all its tokens share one piece id and that piece has no other token.
    piece = t.piece
    pmin = torch.full((n,), length, dtype=torch.long).scatter_reduce(0, blk, piece, "amin")
    pmax = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, blk, piece, "amax")
    whole = (pmin == pmax) & (pmin >= 0)
    if whole.any():
        whole[whole.clone()] = t.piece_size[pmin[whole]] == counts[whole]
    tile_index = torch.where(whole, pmin, torch.full_like(pmin, -1))
    rank = t.coords.shape[1]
    grid = ~text
    gblk = blk[grid]
    c = t.coords[grid]
    big = torch.iinfo(torch.long).max
    lo = torch.full((n, rank), big, dtype=torch.long).scatter_reduce(0, gblk[:, None].expand_as(c), c, "amin")
    hi = torch.full((n, rank), -1, dtype=torch.long).scatter_reduce(0, gblk[:, None].expand_as(c), c, "amax")
    lo = torch.where(lo == big, torch.full_like(lo, -1), lo)
    ng = torch.bincount(gblk, minlength=n).double().clamp_min(1)[:, None]
    cf = c.double()
    mean = torch.zeros(n, rank, dtype=torch.float64).index_add_(0, gblk, cf) / ng
    sq = torch.zeros(n, rank, dtype=torch.float64).index_add_(0, gblk, cf * cf) / ng
    spread = (sq - mean * mean).clamp_min(0).sum(1).sqrt()
    return BlockInfo(counts, text_counts, tile_index, lo, hi, spread)
