"""Token layouts of the diffusers integration at the real models' grid sizes (no models needed)."""

import pytest
import torch

from pisa_attn.diffusers.tiling import build_layouts, default_tile

BS = 64
# (grid, text tokens, text position): Wan 480p / 720p, Hunyuan 720p, FLUX 1024^2 and 1360x768
# (also with a 77-token prompt: text not a whole number of blocks), SD3.5 1024^2 and 1360x768.
CASES = [
    ((21, 30, 52), 0, "none"),
    ((21, 45, 80), 0, "none"),
    ((33, 45, 80), 256, "after"),
    ((64, 64), 512, "before"),
    ((48, 85), 512, "before"),
    ((48, 85), 77, "before"),
    ((64, 64), 333, "after"),
    ((48, 85), 333, "after"),
]


def test_default_tile():
    assert default_tile(2, 64) == (8, 8) and default_tile(3, 64) == (4, 4, 4)
    assert default_tile(2, 16) == (4, 4) and default_tile(3, 16) == (2, 2, 4)
    assert default_tile(2, 128) == (8, 16) and default_tile(3, 128) == (4, 4, 8)


@pytest.mark.parametrize("grid, text_len, text", CASES)
def test_layouts_round_trip_and_keep_text_in_place(grid, text_len, text):
    tile = default_tile(len(grid), BS)
    lay = build_layouts(grid, text_len, text, tile, BS)
    n = 1
    for s in grid:
        n *= s
    image, joint = lay.image, lay.joint
    assert image.num_tokens == n and image.grid_shape == grid and not image.is_identity
    x = torch.randn(2, n, 3)
    tiled = image.to_tiled(x, 1)
    assert not torch.equal(tiled, x)
    assert torch.equal(image.from_tiled(tiled, 1), x)  # exact inverse
    # The joint sequence is [text_before][image in the image stream's order][text_after].
    before = text_len if text == "before" else 0
    assert (joint.image_lo, joint.image_hi, joint.text_len) == (before, before + n, text_len)
    assert joint.length == n + text_len
    expect = torch.cat([torch.arange(before), image.perm + before, torch.arange(before + n, n + text_len)])
    assert torch.equal(joint.layout.perm, expect)
    text_mask = joint.layout.text_mask_tokens()
    assert text_mask.sum() == text_len and not text_mask[joint.image_lo : joint.image_hi].any()
    if text_len:
        blocks = torch.arange(joint.length) // BS
        assert torch.equal(joint.keep, torch.zeros_like(joint.keep).index_fill_(0, blocks[text_mask], True))
        assert joint.text_ranges() == ([(0, before)] if before else [(n, n + text_len)])
    else:
        assert joint.keep is None and joint.text_ranges() == []
    assert lay.image_only.keep is None and lay.image_only.length == n


# One-tile fraction of the joint sequence's image blocks (text kept in place): the "tiles" order
# the integration used to fall back to reached 94.8 % (Hunyuan), 15.6 % / 0 % (FLUX 1360x768).
COMPACT = [
    ((21, 30, 52), 0, "none", 510 / 512),
    ((33, 45, 80), 256, "after", 1856 / 1856),
    ((64, 64), 512, "before", 64 / 64),
    ((48, 85), 512, "before", 60 / 64),
    ((48, 85), 77, "before", 60 / 63),
    ((64, 64), 333, "after", 64 / 64),
]


@pytest.mark.parametrize("grid, text_len, text, one_tile", COMPACT)
def test_joint_blocks_are_compact_tiles(grid, text_len, text, one_tile):
    lay = build_layouts(grid, text_len, text, default_tile(len(grid), BS), BS)
    assert lay.image.order == lay.joint.layout.order == "compact_inplace"
    assert lay.joint.layout.compactness(BS)["one_tile"] >= one_tile - 1e-3


def test_masked_text_keys_keep_prefix_blocks():
    lay = build_layouts((16, 16), 40, "after", (4, 4), 16)
    seq = lay.joint
    assert seq.keep_for(seq.length, 16).nonzero().flatten().tolist() == [16, 17, 18]
    assert seq.keep_for(256 + 10, 16).nonzero().flatten().tolist() == [16]  # only 10 valid text keys
    assert seq.keep_for(256, 16) is None


@pytest.mark.parametrize("call, match", [
    (lambda: default_tile(2, 0), "block_size"), (lambda: default_tile(2, 48), "block_size"),
    (lambda: default_tile(0, 64), "ndim"), (lambda: build_layouts((4, 4), 3, "middle", (4, 4), 16), "text"),
    (lambda: build_layouts((4, 4), -1, "before", (4, 4), 16), "text_len"),
    (lambda: build_layouts((4, 4), 10, "none", (4, 4), 16), "text_len must be 0 when text='none'"),
    (lambda: build_layouts((4, 4), 0, "none", (4, 4), 0), "block_size"),
], ids=["block-0", "block-48", "ndim-0", "text-middle", "text-len-negative", "text-len-without-text",
        "build-block-0"])
def test_layout_helpers_name_their_bad_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layout_helpers_take_numpy_ints_and_refuse_non_ints():
    """Sizes given as numpy ints build the same layouts as Python ints (as make_layout does); a
    float, bool or string is a TypeError naming the argument."""
    np = pytest.importorskip("numpy")
    assert default_tile(np.int64(3), np.int32(16)) == default_tile(3, 16) == (2, 2, 4)
    a = build_layouts((np.int64(6), np.int64(8)), np.int64(13), "before", (np.int64(4), np.int64(4)), np.int64(16))
    b = build_layouts((6, 8), 13, "before", (4, 4), 16)
    assert a.image == b.image and a.joint.layout == b.joint.layout and torch.equal(a.joint.keep, b.joint.keep)
    for call, name in [(lambda: build_layouts((4, 4), 3.0, "before", (4, 4), 16), "text_len"),
                       (lambda: build_layouts((4, 4), True, "before", (4, 4), 16), "text_len"),
                       (lambda: build_layouts((4, 4), 3, "before", (4, 4), 16.0), "block_size"),
                       (lambda: default_tile(2.0, 16), "ndim"), (lambda: default_tile(2, "64"), "block_size"),
                       (lambda: default_tile(True, 16), "ndim")]:
        with pytest.raises(TypeError, match=name):
            call()


class _StrictIndexDevice(torch.overrides.TorchFunctionMode):
    """``index_select`` refuses an index on another device than the tensor it indexes, as CUDA
    does (the CPU alone does not check it against the meta device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.index_select, torch.Tensor.index_select):
            x, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
            if index.device != x.device:
                raise RuntimeError(f"index_select: index on {index.device}, tensor on {x.device}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("text_before", [False, True], ids=["image-only", "text-before"])
def test_tiling_hooks_index_tensors_on_their_own_device(text_before):
    """Rotary embeddings (and token inputs) on another device than the hidden states the
    permutation was made on are permuted with an index on their own device; on one device the
    results are the permutation applied as before."""
    from types import SimpleNamespace

    from pisa_attn.diffusers.tiling import _rope_hook, _tile_token_input

    n, t = 6, 3 if text_before else 0
    perm = torch.tensor([2, 0, 5, 1, 4, 3])
    state = SimpleNamespace(tiling=(perm, torch.argsort(perm)), transformer=torch.nn.Module())
    hook = _rope_hook(state, 0, text_before)
    cos, sin = torch.randn(t + n, 4), torch.randn(t + n, 4)
    out = hook(None, None, (cos, sin))
    for a, b in zip(out, (cos, sin)):
        assert torch.equal(a, torch.cat([b[:t], b[t:][perm]]))
    x = torch.randn(2, n, 3)
    assert torch.equal(_tile_token_input(perm, [x])[0], x[:, perm])
    with _StrictIndexDevice():
        out = hook(None, None, (cos.to("meta"), sin.to("meta")))
        assert all(o.device.type == "meta" and o.shape == (t + n, 4) for o in out)
        assert hook(None, None, cos.to("meta")).device.type == "meta"
        (y,) = _tile_token_input(perm, (x.to("meta"),))
        assert y.device.type == "meta" and y.shape == x.shape
