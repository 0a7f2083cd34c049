"""Token layouts: exact permutations, tile/text structure, block descriptions, validation."""

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pisa_attn import layout as L

CASES = [
    # (grid, tile, text_before, text_after)
    ((16, 16), (8, 8), 0, 0),
    ((13, 21), (8, 8), 77, 0),
    ((12, 20), (8, 8), 0, 33),
    ((4, 16, 16), (4, 4, 4), 0, 0),
    ((5, 9, 11), (4, 4, 4), 10, 7),
    ((1, 10, 14), (4, 4, 4), 64, 0),
]


def _id(case):
    grid, tile, tb, ta = case
    return f"G{'x'.join(map(str, grid))}-T{'x'.join(map(str, tile))}-Tb{tb}-Ta{ta}"


def _text_runs(layout: L.TokenOrder) -> list[tuple[int, int]]:
    """[start, end) of each run of text tokens in tiled order."""
    mask = layout.text_mask_tokens().tolist()
    runs, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.parametrize("order", L.ORDERS)
def test_round_trip_exact(case, order):
    grid, tile, tb, ta = case
    lay = L.make_layout(grid, tile=tile, text_before=tb, text_after=ta, order=order)
    n = lay.num_tokens
    assert n == math.prod(grid) + tb + ta
    x = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(0))
    y = lay.to_tiled(x, dim=1)
    assert torch.equal(y, x.index_select(1, lay.perm))
    assert torch.equal(lay.from_tiled(y, dim=1), x)
    assert torch.equal(lay.from_tiled(y, dim=-2), x)  # negative dims too
    assert torch.equal(lay.perm[lay.inv_perm], torch.arange(n))
    assert torch.equal(torch.sort(lay.perm).values, torch.arange(n))


@pytest.mark.parametrize("grid", [(21, 30, 52), (33, 45, 80)], ids=["wan480p", "hunyuan720p"])
def test_real_grids_perm_fast_and_valid(grid):
    lay = L.grid3d(*grid, text_before=0, text_after=256)
    L._tables.cache_clear()
    t0 = time.perf_counter()
    perm = lay.perm
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"building the permutation took {elapsed:.2f}s"
    n = lay.num_tokens
    assert torch.equal(torch.sort(perm).values, torch.arange(n))
    assert torch.equal(perm[lay.inv_perm], torch.arange(n))
    assert lay.perm is perm  # cached


@pytest.mark.parametrize("grid,tile", [((20, 24), (8, 8)), ((8, 12, 16), (4, 4, 4)), ((21, 30, 52), (4, 4, 4))],
                         ids=["G20x24", "G8x12x16", "G21x30x52"])
def test_full_tiles_are_aligned_blocks(grid, tile):
    """The core tiles come first, each one aligned 64-token block, raster over tiles."""
    lay = L.make_layout(grid, tile=tile, text_before=13)
    vol = math.prod(tile)
    counts = [g // t for g, t in zip(grid, tile)]
    coords = lay.coords()
    info = lay.blocks(vol)
    for i, tidx in enumerate(torch.cartesian_prod(*[torch.arange(c) for c in counts]).reshape(-1, len(grid))):
        block = coords[i * vol:(i + 1) * vol]
        lo = tidx * torch.tensor(tile)
        offsets = torch.cartesian_prod(*[torch.arange(t) for t in tile]).reshape(-1, len(grid))
        assert torch.equal(block, lo + offsets), f"block {i} is not tile {tidx.tolist()} in raster order"
        assert info.tile_index[i] >= 0
    assert info.text_counts[: math.prod(counts)].sum() == 0


def test_compact_packing_beats_inline_on_wan():
    """Measured block compactness (see the module docstring)."""
    stats = {o: L.grid3d(21, 30, 52, order=o).compactness(64) for o in L.ORDERS}
    assert stats["compact"]["blocks"] == 512
    assert round(stats["compact"]["one_tile"] * 512) == 510
    assert stats["compact"]["one_tile"] > stats["tiles"]["one_tile"] > stats["raster"]["one_tile"] == 0.0
    assert stats["compact"]["mean_spread"] < stats["tiles"]["mean_spread"] < stats["raster"]["mean_spread"]


@pytest.mark.parametrize("tb,ta", [(0, 0), (77, 0), (0, 333), (64, 30), (1, 1)])
@pytest.mark.parametrize("order", L.ORDERS)
def test_text_contiguous_in_order_and_kept(tb, ta, order):
    lay = L.grid3d(5, 9, 11, text_before=tb, text_after=ta, order=order)
    n_grid = 5 * 9 * 11
    seg = lay.segment_ids()
    expected = {"prefix": list(range(tb)), "suffix": list(range(tb + n_grid, tb + n_grid + ta))}
    starts = {}
    for i, s in enumerate(lay.segments):
        if isinstance(s, L.Text):
            pos = (seg == i).nonzero().flatten()
            assert pos.tolist() == list(range(int(pos[0]), int(pos[0]) + s.n)), f"{s.name} is not contiguous"
            assert lay.perm[pos].tolist() == expected[s.name]
            starts[s.name] = int(pos[0])
    assert len(starts) == (tb > 0) + (ta > 0)
    if order == "compact" and tb and ta:
        assert starts["suffix"] == starts["prefix"] + tb  # text segments packed together, in order
    for bs in (16, 64):
        mask = lay.text_mask_tokens()
        pad = -len(mask) % bs
        by_block = torch.cat([mask, mask.new_zeros(pad)]).reshape(-1, bs).any(1)
        assert torch.equal(lay.keep_blocks(bs), by_block)
        assert lay.keep_blocks(bs).dtype == torch.bool


def test_compact_text_starts_on_block_boundary():
    lay = L.grid3d(5, 9, 11, text_before=77)
    (start, _), = _text_runs(lay)
    assert start % 64 == 0


def test_inline_tiles_order_matches_definition():
    """"tiles" order: raster over (ragged) tiles, raster within a tile."""
    grid, tile = (5, 7, 9), (2, 3, 4)
    lay = L.make_layout(grid, tile=tile, order="tiles")
    c = L.raster(grid).coords()
    t = torch.tensor(tile)
    key = [tuple((c[i] // t).tolist()) + tuple((c[i] % t).tolist()) for i in range(len(c))]
    assert lay.perm.tolist() == sorted(range(len(c)), key=lambda i: key[i])


def test_raster_is_identity_and_aliases():
    lay = L.raster((3, 5, 7), text_before=4)
    assert lay.is_identity and lay.tile is None
    assert torch.equal(lay.perm, torch.arange(lay.num_tokens))
    x = torch.randn(lay.num_tokens, 2)
    assert lay.to_tiled(x, 0) is x and lay.from_tiled(x, 0) is x
    assert L.grid3d(3, 5, 7, text_before=4).raster() == lay


def test_block_info_and_coords():
    lay = L.grid2d(8, 16, text_after=10)
    info = lay.blocks(64)
    assert info.counts.tolist() == [64, 64, 10]
    assert info.text_counts.tolist() == [0, 0, 10]
    assert info.tile_index.tolist() == [0, 1, -1]
    assert info.lo[1].tolist() == [0, 8] and info.hi[1].tolist() == [7, 15]
    assert info.lo[2].tolist() == [-1, -1]
    assert abs(float(info.spread[0]) - math.sqrt(2 * (64 - 1) / 12)) < 1e-9  # 8x8 tile
    assert torch.equal(lay.block_tokens(64), info.counts)
    orig = lay.coords(tiled=False)
    assert orig[:128].tolist() == [[i, j] for i in range(8) for j in range(16)]
    assert (orig[128:] == -1).all()
    assert lay.segment_ids(tiled=False).tolist() == [0] * 128 + [1] * 10


def test_small_grid_adapts_tile():
    """A one-frame video is tiled 1x8x8, not 1x4x4 (16-token) tiles."""
    lay = L.grid3d(1, 16, 16)
    assert lay.compactness(64)["one_tile"] == 1.0
    assert lay.blocks(64).hi[0].tolist() == [0, 7, 7]


def test_two_grids_and_perm_on_device():
    lay = L.TokenOrder((L.Text(5), L.Grid((4, 8, 8)), L.Grid((4, 4, 4)), L.Text(3, "suffix")), (4, 4, 4))
    x = torch.arange(lay.num_tokens)
    assert torch.equal(lay.from_tiled(lay.to_tiled(x, 0), 0), x)
    assert lay.perm_on("cpu") is lay.perm_on(torch.device("cpu"))
    assert torch.equal(lay.perm_on("cpu", inverse=True), lay.inv_perm)
    with pytest.raises(ValueError, match="grid_shape"):
        lay.grid_shape


@settings(max_examples=25, deadline=None)
@given(
    grid=st.one_of(st.tuples(*[st.integers(1, 12)] * 2), st.tuples(*[st.integers(1, 9)] * 3)),
    tile_side=st.integers(1, 5),
    tb=st.integers(0, 70),
    ta=st.integers(0, 70),
    order=st.sampled_from(L.ORDERS),
)
def test_random_layouts(grid, tile_side, tb, ta, order):
    tile = (tile_side,) * len(grid)
    lay = L.make_layout(grid, tile=tile, text_before=tb, text_after=ta, order=order)
    n = lay.num_tokens
    assert torch.equal(torch.sort(lay.perm).values, torch.arange(n))
    x = torch.arange(n) * 3 + 1
    assert torch.equal(lay.from_tiled(lay.to_tiled(x, 0), 0), x)
    if order == "compact":
        assert len(_text_runs(lay)) == (1 if tb + ta else 0)
    info = lay.blocks(16)
    assert int(info.counts.sum()) == n and int(info.text_counts.sum()) == tb + ta
    assert torch.equal(lay.text_mask_tokens(), (lay.coords() < 0).all(1))


BAD = [
    (lambda: L.grid2d(0, 4), "grid"),
    (lambda: L.grid3d(2, -1, 4), "grid"),
    (lambda: L.make_layout((4,)), "grid"),
    (lambda: L.make_layout((4, 4, 4, 4)), "grid"),
    (lambda: L.grid3d(4, 4, 4, tile=(4, 4)), "tile"),
    (lambda: L.grid2d(4, 4, tile=(8, 0)), "tile"),
    (lambda: L.grid2d(4, 4, tile=(8, 0), order="raster"), "tile"),  # refused in every order
    (lambda: L.grid2d(4, 4, text_before=-1), "text_before"),
    (lambda: L.grid2d(4, 4, text_after=-3), "text_after"),
    (lambda: L.grid2d(4, 4, order="hilbert"), "order"),
    (lambda: L.make_layout((4, 4), offset=3), "offset"),  # only "compact_inplace" uses it
    (lambda: L.make_layout((4, 4), order="compact_inplace", offset=-1), "offset"),
    (lambda: L.TokenOrder((), (8, 8)), "segments"),
    (lambda: L.TokenOrder((L.Grid((4, 4)), L.Grid((2, 2, 2))), (4, 4)), "rank"),
    (lambda: L.Text(0), "n"),
    (lambda: L.grid2d(4, 4).keep_blocks(0), "block_size"),
    (lambda: L.grid2d(4, 4).to_tiled(torch.zeros(15), 0), "x has 15 tokens"),
    (lambda: L.grid2d(4, 4).to_tiled(torch.zeros(16), 1), "dim"),
]


@pytest.mark.parametrize("call,name", BAD, ids=[f"{n.split()[0]}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_arguments_raise_value_error(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="grid"):
        L.make_layout(16)
    with pytest.raises(TypeError, match=r"grid\[0\]"):
        L.grid2d(4.0, 4)
    with pytest.raises(TypeError, match="x"):
        L.grid2d(4, 4).to_tiled([0] * 16, 0)


# --- "compact_inplace": compact tiles, text where the model has it ------------------------------
def _whole_pieces(grid, tile) -> int:
    """Pieces of exactly one tile volume: the "compact" order of the bare grid puts them first,
    one aligned block each."""
    c = L.make_layout(grid, tile=tile, order="compact").blocks(math.prod(tile))
    return int(((c.tile_index >= 0) & (c.counts == math.prod(tile))).sum())


def _one_tile_blocks(lay, bs) -> int:
    info = lay.blocks(bs)
    return int(((info.tile_index >= 0) & (info.counts == bs)).sum())


def _check_in_place(lay, bs):
    """Every segment keeps its original range; text tokens keep their exact positions."""
    raster = lay.raster()
    assert torch.equal(lay.segment_ids(), raster.segment_ids())
    text = lay.text_mask_tokens()
    assert torch.equal(text, raster.text_mask_tokens())
    assert torch.equal(lay.perm[text], torch.nonzero(text).flatten())
    blocks = torch.arange(lay.num_tokens) // bs
    assert torch.equal(lay.keep_blocks(bs), torch.zeros_like(lay.keep_blocks(bs)).index_fill_(0, blocks[text], True))


INPLACE_CASES = CASES + [((16, 16), (8, 8), 77, 0), ((16, 16), (8, 8), 77, 5), ((48, 85), (8, 8), 77, 3)]


@pytest.mark.parametrize("case", INPLACE_CASES, ids=[_id(c) for c in INPLACE_CASES])
def test_compact_inplace_keeps_text_and_aligns_full_tiles(case):
    grid, tile, tb, ta = case
    vol = math.prod(tile)
    lay = L.make_layout(grid, tile=tile, text_before=tb, text_after=ta, order="compact_inplace")
    _check_in_place(lay, vol)
    # The full tiles are the bare grid's "compact" tiles, in order, from the first block boundary
    # at or after the grid's start; as many as fit as whole blocks inside the grid's range.
    n = math.prod(grid)
    first = -(-tb // vol) * vol
    fit = ((tb + n) // vol * vol - first) // vol
    k = min(_whole_pieces(grid, tile), max(fit, 0))
    bare = L.make_layout(grid, tile=tile, order="compact")
    assert torch.equal(lay.perm[first : first + k * vol], bare.perm[: k * vol] + tb)
    assert _one_tile_blocks(lay, vol) == k


def test_compact_inplace_breaks_a_tile_when_blocks_run_short():
    # 77 text tokens + 16x16: the grid holds 4 tiles but only 3 whole blocks ([128, 320)); the
    # 4th tile fills the partial blocks on both sides of them, where it shares blocks with text.
    lay = L.grid2d(16, 16, text_before=77, order="compact_inplace")
    info = lay.blocks(64)
    assert info.tile_index.tolist() == [-1, -1, 0, 1, 2, -1]
    assert info.text_counts.tolist() == [64, 13, 0, 0, 0, 0] and info.counts[-1] == 13
    assert sorted(lay.coords()[77:128].tolist() + lay.coords()[320:].tolist()) == [
        [i, j] for i in range(8, 16) for j in range(8, 16)
    ]  # the broken tile is tile 3, whole, in the two straddling blocks
    # The image-only stream at offset 77 has the grid part of the joint permutation.
    image = L.make_layout((16, 16), tile=(8, 8), order="compact_inplace", offset=77)
    assert torch.equal(lay.perm[77:], image.perm + 77)
    assert image == L.make_layout((16, 16), tile=(8, 8), order="compact_inplace", offset=77 + 64 * 3)


@settings(max_examples=40, deadline=None)
@given(
    grid=st.one_of(st.tuples(*[st.integers(1, 14)] * 2), st.tuples(*[st.integers(1, 9)] * 3)),
    tile_side=st.integers(1, 4),
    tb=st.integers(0, 70),
    ta=st.integers(0, 70),
    offset=st.integers(0, 100),
)
def test_compact_inplace_random(grid, tile_side, tb, ta, offset):
    tile = (tile_side,) * len(grid)
    vol = tile_side ** len(grid)
    lay = L.make_layout(grid, tile=tile, text_before=tb, text_after=ta, order="compact_inplace", offset=offset)
    n = lay.num_tokens
    assert torch.equal(torch.sort(lay.perm).values, torch.arange(n))
    x = torch.arange(n) * 3 + 1
    assert torch.equal(lay.from_tiled(lay.to_tiled(x, 0), 0), x)
    _check_in_place(lay, vol)
    if offset:  # offset acts as that much text before the layout
        shifted = L.TokenOrder((L.Text(offset), *lay.segments), tile, "compact_inplace")
        assert torch.equal(shifted.perm[offset:], lay.perm + offset)
    else:  # optimal: a one-tile block is an aligned block inside the grid's range holding a whole piece
        fit = max(((tb + math.prod(grid)) // vol * vol - -(-tb // vol) * vol) // vol, 0)
        assert _one_tile_blocks(lay, vol) == min(_whole_pieces(grid, tile), fit)


# Real models, text in place (measured, see the module docstring): (grid, text before, after, one-tile blocks).
REAL = [
    ("flux-1024", (64, 64), 512, 0, 64 / 64),
    ("flux-1360x768", (48, 85), 512, 0, 60 / 64),
    ("sd3-1024", (64, 64), 0, 333, 64 / 64),
    ("image-then-154-text", (64, 64), 0, 154, 64 / 64),  # SD3 is always 77 + 256 (T5 zeros if absent)
    ("hunyuan-720p", (33, 45, 80), 0, 256, 1856 / 1856),
    ("wan-480p", (21, 30, 52), 0, 0, 510 / 512),
]


@pytest.mark.parametrize("grid,tb,ta,one_tile", [r[1:] for r in REAL], ids=[r[0] for r in REAL])
def test_compact_inplace_real_models(grid, tb, ta, one_tile):
    lay = L.make_layout(grid, text_before=tb, text_after=ta, order="compact_inplace")
    stats = lay.compactness(64)
    assert stats["one_tile"] >= one_tile - 1e-3
    assert stats["mean_spread"] < 3.3
    tiles = L.make_layout(grid, text_before=tb, text_after=ta, order="tiles").compactness(64)
    assert stats["one_tile"] >= tiles["one_tile"]


def test_mask_to_tiled_moves_masks_with_the_tokens():
    lay = L.make_layout((6, 10), tile=(4, 4), text_before=5, order="compact_inplace")
    n, perm = lay.num_tokens, lay.perm
    g = torch.Generator().manual_seed(0)
    pad = torch.rand(2, n, generator=g) > 0.5
    torch.testing.assert_close(lay.mask_to_tiled(pad, 2), pad[:, perm], rtol=0, atol=0)
    full = torch.rand(2, 1, n, n, generator=g)
    torch.testing.assert_close(lay.mask_to_tiled(full, 2), full[:, :, perm][..., perm], rtol=0, atol=0)
    keys = torch.rand(1, 1, 1, n, generator=g)
    torch.testing.assert_close(lay.mask_to_tiled(keys, 3), keys[..., perm], rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not cover"):
        lay.mask_to_tiled(torch.ones(2, n - 1, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="does not cover"):
        lay.mask_to_tiled(torch.ones(1, 1, 7, n, dtype=torch.bool), 1)
    # a batch of n: [n, n] could be key padding or queries x keys (only the keys were moved)
    with pytest.raises(ValueError, match="ambiguous"):
        lay.mask_to_tiled(torch.ones(n, n, dtype=torch.bool), n)
    torch.testing.assert_close(lay.mask_to_tiled(full[0, 0], 2), full[0, 0][perm][:, perm], rtol=0, atol=0)


def test_block_floor_checks_its_arguments():
    """block_floor rounds down to a block boundary; a non-positive block_size (was ZeroDivisionError),
    a negative position or a non-int is refused naming the argument; numpy ints are taken."""
    assert L.block_floor(77, 64) == 64 and L.block_floor(0, 16) == 0 and L.block_floor(64, 64) == 64
    assert L.block_floor(np.int64(77), np.int64(64)) == 64
    for args, exc, name in (((5, 0), ValueError, "block_size"), ((5, -64), ValueError, "block_size"),
                            ((-1, 64), ValueError, "position"), ((5, 64.0), TypeError, "block_size"),
                            ((5.0, 64), TypeError, "position"), ((5, True), TypeError, "block_size")):
        with pytest.raises(exc, match=name):
            L.block_floor(*args)


def test_numpy_ints_are_taken_and_stored_as_python_ints():
    """Sizes given as numpy ints build the same layout as Python ints (and store Python ints)."""
    a = L.make_layout((np.int64(4), np.int64(6)), tile=(np.int32(2), np.int32(2)), text_before=np.int64(3),
                      order="compact_inplace", offset=np.int64(1))
    b = L.make_layout((4, 6), tile=(2, 2), text_before=3, order="compact_inplace", offset=1)
    assert a == b and torch.equal(a.perm, b.perm)
    assert type(a.segments[0].n) is int and type(a.offset) is int


def test_dim_takes_numpy_ints_and_refuses_non_ints_with_type_error():
    """to_tiled/from_tiled take a numpy int dim like an int; a bool or float dim is a TypeError
    naming ``dim`` (not a ValueError claiming an in-range int is out of range)."""
    lay = L.grid2d(5, 6, tile=(4, 4), text_before=3)
    x = torch.arange(2 * lay.num_tokens).reshape(2, -1)
    assert torch.equal(lay.to_tiled(x, np.int64(1)), lay.to_tiled(x, 1))
    assert torch.equal(lay.from_tiled(lay.to_tiled(x, np.int32(-1)), np.int64(1)), x)
    for dim in (True, 1.0, "1"):
        with pytest.raises(TypeError, match="dim"):
            lay.to_tiled(x, dim)
    with pytest.raises(ValueError, match="dim"):
        lay.to_tiled(x, np.int64(2))
