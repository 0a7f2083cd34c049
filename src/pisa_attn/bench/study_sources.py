"""Where the accuracy study gets its q/k/v: the synthetic DiT-like generator or a capture file.

Every sample is ``[B, H, L, D]`` in tiled order together with its :class:`TokenOrder` (``None``
when a capture file carries no layout: tiling and length analyses are then skipped).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import layout as lay
from ..data import dit_qkv


@dataclass
class Sample:
    name: str
    q: Tensor
    k: Tensor
    v: Tensor
    layout: lay.TokenOrder | None  # the order q/k/v are in (tiled, unless it is a raster layout)
    origin: str | None = None  # the captured entry (or synthetic draw) a crop was cut from
    # [lo, hi): the query rows PISA ran on, as a capture records them; read when there is no layout
    # to derive them from (the diffusers backend runs text queries densely)
    image_range: tuple[int, int] | None = None

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def keep_blocks(self, block_size: int) -> Tensor | None:
        if self.layout is None or self.layout.num_text_tokens == 0:
            return None
        return self.layout.keep_blocks(block_size)

    def query_range(self) -> tuple[int, int]:
        """The queries PISA runs on: the image tokens when they are one contiguous run (the
        diffusers backend's joint layout, whose text queries attend densely), else all."""
        n = self.q.shape[2]
        if self.layout is None and self.image_range is not None:
            lo, hi = self.image_range
            return int(lo), int(hi)
        if self.layout is None or self.layout.num_text_tokens == 0:
            return 0, n
        image = torch.nonzero(~self.layout.text_mask_tokens()).squeeze(1)
        lo, hi = int(image[0]), int(image[-1]) + 1
        return (lo, hi) if hi - lo == image.numel() else (0, n)

    def query_rows(self, block_size: int) -> tuple[slice, slice]:
        """``(run, measured)``: PISA runs on queries ``q[:, :, run]``, from the block boundary at or
        before the first query of :meth:`query_range` (so query blocks are key blocks, as in the
        diffusers backend); ``measured`` picks that range's queries out of the output."""
        lo, hi = self.query_range()
        start = lay.block_floor(lo, block_size)
        return slice(start, hi), slice(lo - start, hi - start)

    def raster(self) -> Sample:
        """The same tokens in original (untiled) order."""
        if self.layout is None:
            raise ValueError(f"sample {self.name!r} has no token layout: cannot undo its tiling")
        undo = [self.layout.from_tiled(x, dim=2) for x in (self.q, self.k, self.v)]
        return Sample(self.name + " (raster)", *undo, self.layout.raster(), self.origin)

    def crop(self, grid: tuple[int, ...]) -> Sample:
        """Keep the text and the grid tokens inside ``grid`` (a leading corner of the token grid),
        re-tiled with the sample's tile and order: a smaller image/video of the same statistics."""
        if self.layout is None:
            raise ValueError(f"sample {self.name!r} has no token layout: cannot crop it")
        full = self.layout.grid_shape
        coords = self.layout.coords(tiled=False)  # original order, -1 rows for text
        inside = (coords < torch.tensor(grid)).all(dim=1) & (coords >= 0).all(dim=1)
        is_text = self.layout.text_mask_tokens().index_select(0, self.layout.inv_perm)
        keep = torch.nonzero(inside | is_text).squeeze(1)
        segs = tuple(lay.Grid(tuple(grid)) if isinstance(s, lay.Grid) else s for s in self.layout.segments)
        new = lay.TokenOrder(segs, self.layout.tile, self.layout.order, self.layout.offset)
        if new.order == "compact" and not _text_in_place(new) and _text_in_place(self.layout):
            new = lay.TokenOrder(segs, self.layout.tile, "compact_inplace")  # text in place, as in diffusers
        idx = keep.to(self.q.device)
        out = [new.to_tiled(self.layout.from_tiled(x, dim=2).index_select(2, idx), dim=2)
               for x in (self.q, self.k, self.v)]
        name = f"{self.name} crop {'x'.join(map(str, grid))} of {'x'.join(map(str, full))}"
        return Sample(name, *out, new, self.origin or self.name)


def _text_in_place(layout: lay.TokenOrder) -> bool:
    """Text tokens sit where the original order has them (diffusers moves only image tokens)."""
    return torch.equal(layout.text_mask_tokens(), layout.raster().text_mask_tokens())


def synthetic_grid(length: int) -> tuple[int, int, int]:
    """Video-like ``(t, h, w)`` grid of exactly ``length`` tokens: frames of 32x32 tokens when that
    gives at least two frames, else 16x16, else 8x8."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 64 or length % 64:
        raise ValueError(f"synthetic lengths must be multiples of 64 tokens (>= 64), got {length!r}")
    for side in (32, 16, 8):
        if length % (side * side) == 0 and length // (side * side) >= 2:
            return (length // (side * side), side, side)
    return (length // 64, 8, 8)


class SyntheticSource:
    """Seeded DiT-like q/k/v (:func:`pisa_attn.data.dit_qkv`) on video-like grids of any length."""

    kind = "synthetic"

    def __init__(self, *, heads: int, head_dim: int, seed: int, text_tokens: int, dtype, device):
        self.heads, self.head_dim, self.seed, self.text_tokens = heads, head_dim, seed, text_tokens
        self.dtype, self.device = dtype, device
        self._head_types: list[str] = []
        self._fixed: Sample | None = None  # the density sweep's sample, reused by the length sweep

    def describe(self) -> dict:
        return {"kind": self.kind, "heads": self.heads, "head_dim": self.head_dim, "seed": self.seed,
                "text_tokens": self.text_tokens, "head_types": self._head_types}

    def _make(self, length: int) -> Sample:
        grid = synthetic_grid(length)
        g = dit_qkv(grid, heads=self.heads, head_dim=self.head_dim, text_tokens=self.text_tokens,
                    seed=self.seed, dtype=self.dtype, device=self.device, tiled=True)
        self._head_types = list(g.head_types)
        return Sample(f"synthetic {'x'.join(map(str, grid))} seed {self.seed}", g.q, g.k, g.v, g.token_layout)

    def _image_tokens(self, sample: Sample) -> int:
        return sample.length - self.text_tokens  # lengths here count image tokens (text comes on top)

    def fixed(self, length: int) -> list[Sample]:
        if self._fixed is None or self._image_tokens(self._fixed) != length:
            self._fixed = self._make(length)
        return [self._fixed]

    def sweep(self, lengths, min_tokens: int = 0) -> list[tuple[int, list[Sample]]]:
        same = self._fixed is not None
        return [(n, [self._fixed] if same and n == self._image_tokens(self._fixed) else [self._make(n)])
                for n in lengths]

    def calibration(self):
        """Where a calibrated variant fits its weights: another draw of the generator (seed + 1)."""
        return _SyntheticPartners(SyntheticSource(heads=self.heads, head_dim=self.head_dim, seed=self.seed + 1,
                                                  text_tokens=self.text_tokens, dtype=self.dtype, device=self.device))


class _SyntheticPartners:
    """The calibration sample of a synthetic sample: the other draw at the same length."""

    def __init__(self, other: SyntheticSource):
        self.other = other
        self.note = f"synthetic draw with seed {other.seed}"
        self._cache: dict[int, Sample] = {}

    def partner(self, sample: Sample) -> Sample | None:
        n = sample.length - self.other.text_tokens  # the image tokens _make was given (text comes on top)
        if n not in self._cache:
            self._cache[n] = self.other._make(n)
        return self._cache[n]


class CapturedSource:
    """q/k/v captured from a real pipeline by :func:`pisa_attn.diffusers.capture_qkv`."""

    kind = "safetensors"

    def __init__(self, path: str, *, entries=None, max_entries: int = 4, dtype, device):
        from ..qkv_file import check_entry, read_qkv_file

        self.path = str(path)
        self.file = read_qkv_file(self.path)
        names = [e.name for e in self.file.entries]
        if entries:
            missing = [n for n in entries if n not in names]
            if missing:
                raise ValueError(f"entries {missing} are not in {self.path} (it holds {names})")
            chosen = [e for e in self.file.entries if e.name in set(entries)]
        else:
            chosen = self.file.entries[: max(1, max_entries)]
        if not chosen:
            raise ValueError(f"{self.path} holds no captured call")
        for e in chosen:  # every entry the study reads is checked before any work
            check_entry(e)
        heads = sorted({e.q.shape[1] for e in chosen})
        if len(heads) > 1:  # the study's per-head results are means over the entries
            raise ValueError(f"the studied entries of {self.path} must have one number of query heads, got {heads} "
                             "(choose entries of one model with entries=/--entries)")
        self.entries = chosen
        self.dtype, self.device = dtype, device

    def describe(self) -> dict:
        return {"kind": self.kind, "path": self.path, "model": self.file.meta.get("model"),
                "entries": [e.name for e in self.entries], "available": len(self.file.entries)}

    def _sample(self, entry) -> Sample:
        q, k, v = (x.to(device=self.device, dtype=self.dtype) for x in (entry.q, entry.k, entry.v))
        scale = entry.info.get("scale")  # absent in older captures: the default 1/sqrt(D)
        if scale is not None and scale != q.shape[-1] ** -0.5:
            # Every study quantity (selection, softmax, token scores) depends on scale·q only, and
            # the study uses the default scale: fold the captured call's scale into q.
            q = q * (scale * q.shape[-1] ** 0.5)
        rng = entry.info.get("image_range")  # checked by check_entry: [lo, hi) inside q's rows
        return Sample(entry.name, q, k, v, entry.layout, image_range=None if rng is None else tuple(rng))

    def fixed(self, length: int | None = None) -> list[Sample]:
        return [self._sample(e) for e in self.entries]  # the source decides the length

    def calibration(self, calib_path: str | None = None):
        """Where a calibrated variant fits the weights of each studied entry: the same layer in
        the capture ``calib_path`` (another input), else the same layer at another captured step
        of this file. Entries without one get no calibrated result."""
        return _CapturedPartners(self, calib_path)

    def sweep(self, lengths, min_tokens: int = 256) -> list[tuple[int, list[Sample]]]:
        """Crops of every entry, halving the grid (frames first) down to ``len(lengths)`` sizes
        of at least ``min_tokens`` grid tokens."""
        full = self.fixed()
        if any(s.layout is None or len(s.layout.grids) != 1 for s in full):
            return [(full[0].length, full)] if len({s.length for s in full}) == 1 else []
        out = []
        for grid in halving_grids(full[0].layout.grid_shape, len(lengths), min_tokens):
            crops = [s if grid == s.layout.grid_shape else s.crop(grid) for s in full]
            out.append((crops[0].length, crops))
        return sorted(out, key=lambda t: t[0])


class _CapturedPartners:
    def __init__(self, source: CapturedSource, calib_path: str | None):
        from ..qkv_file import check_entry, read_qkv_file

        self.source = source
        # The studied file named as calib_path: fitting on it would be in-sample, so it keeps the
        # held-out rule of the default (the same layer at another step).
        same = calib_path is not None and _same_file(calib_path, source.path)
        other = read_qkv_file(calib_path) if calib_path and not same else source.file
        self.note = (f"the same layer in {calib_path}" if calib_path and not same
                     else "the same layer at another captured step of the same file"
                     + (" (calib_source is the studied file)" if same else ""))
        if same:
            calib_path = None
        self._entries = {}
        self._full: dict[str, Sample] = {}
        mine, theirs = source.file.meta.get("model"), other.meta.get("model")
        if mine is not None and theirs is not None and mine != theirs:  # another family: no partner
            self.note += f" (a {theirs!r} capture for a {mine!r} one: not used)"
            return
        for e in source.entries:
            match = [c for c in other.entries if c.layer == e.layer and _prefix(c.name) == _prefix(e.name)
                     and (calib_path or c.step != e.step)]
            if match:
                check_entry(match[0])  # checked as the studied entries are (it may not be one of them)
                self._entries[e.name] = match[0]

    def partner(self, sample: Sample) -> Sample | None:
        name = sample.origin or sample.name
        entry = self._entries.get(name)
        if entry is None:
            return None
        if name not in self._full:
            self._full[name] = self.source._sample(entry)
        full = self._full[name]
        if full.q.shape[1] != sample.q.shape[1]:  # another model: no weight per head to transfer
            return None
        if full.layout is not None and sample.layout is not None and \
                len(full.layout.grid_shape) != len(sample.layout.grid_shape):  # an image model for a video one
            return None
        if sample.origin is None:  # an entry itself
            return _held_out(full, sample)
        grid = sample.layout.grid_shape  # a crop of an entry: the same crop of the partner
        if full.layout is None or len(full.layout.grids) != 1:
            return None
        if grid == full.layout.grid_shape:
            return _held_out(full, sample)
        if any(a > b for a, b in zip(grid, full.layout.grid_shape)):
            return None
        return _held_out(full.crop(grid), sample)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is gone: compare the spelled paths
        return os.path.realpath(a) == os.path.realpath(b)


def _held_out(partner: Sample, sample: Sample) -> Sample | None:
    """``partner`` unless it holds the studied sample's own q/k/v (a copy of the studied file as
    calib_source): a fit on them would be in-sample."""
    same = partner.q.shape == sample.q.shape and partner.k.shape == sample.k.shape and \
        torch.equal(partner.q, sample.q) and torch.equal(partner.k, sample.k) and torch.equal(partner.v, sample.v)
    return None if same else partner


def _prefix(name: str) -> str:
    return name[: name.rfind("step")]


def halving_grids(grid: tuple[int, ...], count: int, min_tokens: int = 256) -> list[tuple[int, ...]]:
    """``grid`` and up to ``count - 1`` successive halvings (time first, then the longer side)."""
    out = [tuple(grid)]
    g = list(grid)
    while len(out) < count:
        axis = 0 if len(g) == 3 and g[0] >= 2 else max(range(len(g) - 2, len(g)), key=lambda a: g[a])
        if g[axis] < 2 or math.prod(g) // 2 < min_tokens:
            break
        g[axis] //= 2
        out.append(tuple(g))
    return out
