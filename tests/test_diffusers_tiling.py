"""Token layouts of the diffusers integration at the real models' grid sizes (no models needed)."""

import pytest
import torch

from pisa_attn.diffusers.tiling import build_layouts, default_tile

BS = 64
# (grid, text tokens, text position): Wan 480p / 720p, Hunyuan 720p, FLUX 1024^2 and 1360x768, SD3.5 1024^2.
CASES = [
    ((21, 30, 52), 0, "none"),
    ((21, 45, 80), 0, "none"),
    ((33, 45, 80), 256, "after"),
    ((64, 64), 512, "before"),
    ((48, 85), 512, "before"),
    ((64, 64), 333, "after"),
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


def test_video_grids_use_compact_blocks():
    # Wan 480p has ragged edges in every axis; the compact order keeps 510 of 512 blocks one tile.
    lay = build_layouts((21, 30, 52), 0, "none", (4, 4, 4), BS)
    assert lay.image.order == "compact"
    assert lay.image.compactness(BS)["one_tile"] > 0.99


def test_masked_text_keys_keep_prefix_blocks():
    lay = build_layouts((16, 16), 40, "after", (4, 4), 16)
    seq = lay.joint
    assert seq.keep_for(seq.length, 16).nonzero().flatten().tolist() == [16, 17, 18]
    assert seq.keep_for(256 + 10, 16).nonzero().flatten().tolist() == [16]  # only 10 valid text keys
    assert seq.keep_for(256, 16) is None
