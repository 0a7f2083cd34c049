"""Input checks and edge cases of the error and tail-mass measurements (pisa_attn.metrics)."""

import math

import numpy as np
import pytest
import torch

from pisa_attn import metrics, spec
from pisa_attn.ops import reference as ref


def _qkv(length=256, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, length, dim, generator=g) for _ in range(3))


def test_rel_l1_of_a_nan_reference_is_nan():
    out = torch.zeros(1, 2, 4, 16)
    dense = torch.full((1, 2, 4, 16), float("nan"))
    assert math.isnan(metrics.rel_l1(out, dense))  # 0 ("no error") before
    assert metrics.rel_l1_per_head(out, dense).isnan().all()
    nan_out = torch.full((1, 2, 4, 16), float("nan"))
    assert math.isnan(metrics.rel_l1(nan_out, torch.zeros(1, 2, 4, 16)))
    # a zero reference still gives 0 for an equal output and inf for another one
    assert metrics.rel_l1(torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16)) == 0.0
    assert metrics.rel_l1(torch.ones(1, 2, 4, 16), torch.zeros(1, 2, 4, 16)) == math.inf


def test_rel_l1_refuses_empty_and_non_tensor_inputs():
    empty = torch.zeros(1, 2, 0, 16)
    with pytest.raises(ValueError, match="must not be empty"):
        metrics.rel_l1(empty, empty)
    with pytest.raises(ValueError, match="must not be empty"):
        metrics.rel_l1_per_head(empty, empty)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        metrics.rel_l1([0.0], torch.zeros(1))
    with pytest.raises(TypeError, match="dense must be a torch.Tensor"):
        metrics.rel_l1_per_head(torch.zeros(1, 1, 1, 16), np.zeros((1, 1, 1, 16)))


def test_select_reads_a_numpy_float32_density_as_its_decimal():
    """np.float32(0.53) is 0.52999997: 0.53·50 = 26.5 must round to 27 blocks, as pisa_attention's
    settings read the density (as_float), not to 26."""
    q, k, v = _qkv(length=50 * 16)
    assert spec.num_selected(0.53, 50) == 27
    sel = metrics.select(q, k, v, density=np.float32(0.53), block_size=16)
    assert sel.selected.shape[-1] == 50
    assert bool((sel.selected.sum(-1) == 27).all())


def test_select_checks_stats_by_name():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="stats must be a reference.BlockStats"):
        metrics.select(q, k, v, density=0.5, block_size=64, stats={"kmean": k})
    other = ref.block_stats(k, v, 32)  # another block size: 8 blocks, not 4
    with pytest.raises(ValueError, match="stats must be the block statistics of k at block_size=64"):
        metrics.select(q, k, v, density=0.5, block_size=64, stats=other)
    k2, v2 = k[:, :1], v[:, :1]  # another head count
    with pytest.raises(ValueError, match="stats.kmean must have shape"):
        metrics.select(q, k, v, density=0.5, block_size=64, stats=ref.block_stats(k2, v2, 64))
    good = ref.block_stats(k, v, 64, with_hdev=True)
    a = metrics.select(q, k, v, density=0.5, block_size=64, stats=good, covariance_aware=True)
    b = metrics.select(q, k, v, density=0.5, block_size=64, covariance_aware=True)
    assert torch.equal(a.selected, b.selected)


def test_dense_pass_checks_its_arguments_by_name():
    q, k, v = _qkv()
    sel = metrics.select(q, k, v, density=0.5, block_size=64).selected  # [1, 2, 4, 4]
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        metrics.dense_pass(q.numpy(), k, v, block_size=64)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        metrics.dense_pass(q, k, v[:, :, :128], block_size=64)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        metrics.dense_pass(q, k, v, block_size=0)
    with pytest.raises(TypeError, match=r"masks\[0\] must have dtype torch.bool"):
        metrics.dense_pass(q, k, v, block_size=64, masks=(sel.float(),))
    with pytest.raises(ValueError, match=r"masks\[0\] must have shape \[1, 2, Nq, 8\]"):
        metrics.dense_pass(q, k, v, block_size=32, masks=(sel,))  # a mask of 64-token blocks
    with pytest.raises(ValueError, match=r"masks\[0\] has 2 query-block rows"):
        metrics.dense_pass(q, k, v, block_size=64, masks=(sel[:, :, :2],))
    with pytest.raises(ValueError, match="kmean must be the key-block means"):
        metrics.dense_pass(q, k, v, block_size=64, masks=(sel,), kmean=ref.block_stats(k, v, 32).kmean)
    with pytest.raises(ValueError, match="row_blocks must be an integer tensor of shape"):
        metrics.dense_pass(q, k, v, block_size=64, masks=(sel,), row_blocks=torch.zeros(3, dtype=torch.long))
    dp = metrics.dense_pass(q, k, v, block_size=64, masks=(sel,), kmean=ref.block_stats(k, v, 64).kmean)
    assert dp.tail_mass[0].shape == (1, 2, 256)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_dense_pass_refuses_a_bad_scale(scale):
    # the reference of every error measurement: a NaN or inf scale made it NaN without a word
    q, k, v = _qkv(length=64)
    with pytest.raises(ValueError, match="scale"):
        metrics.dense_pass(q, k, v, block_size=64, scale=scale)


def test_select_takes_a_numpy_query_block():
    # pisa_attention (PisaSettings) takes np.int64(128); the measurement of its selection must too
    q, k, v = _qkv()
    a = metrics.select(q, k, v, density=0.5, block_size=64, query_block=np.int64(128))
    b = metrics.select(q, k, v, density=0.5, block_size=64, query_block=128)
    assert torch.equal(a.selected, b.selected)


def test_token_scores_checks_its_arguments_by_name():
    """token_scores checks what dense_pass checks (tensors, shapes, block_size, scale) and its own
    selected mask and rows, by name; a negative row (which would wrap to q's end) is refused."""
    q, k, v = _qkv()
    sel = metrics.select(q, k, v, density=0.5, block_size=64).selected  # [1, 2, 4, 4]
    rows = torch.tensor([0, 70, 255])
    for kw, exc, match in (
        (dict(q=q.numpy()), TypeError, "q must be a torch.Tensor"),
        (dict(k=k[0]), ValueError, r"k must be a \[B, H, L, D\] tensor"),
        (dict(k=k[..., :16]), ValueError, "does not fit k"),
        (dict(block_size=0), ValueError, "block_size must be a positive int"),
        (dict(block_size=64.0), TypeError, "block_size"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(selected=sel.float()), TypeError, "selected must have dtype torch.bool"),
        (dict(selected=sel[:, :1]), ValueError, r"selected must have shape \[1, 2, Nq, 4\]"),
        (dict(selected=sel[:, :, :2]), ValueError, "selected has 2 query-block rows"),
        (dict(rows=[0, 1]), TypeError, "rows must be a torch.Tensor"),
        (dict(rows=rows.float()), ValueError, "rows must be a 1-D integer tensor"),
        (dict(rows=torch.tensor([-1])), ValueError, r"rows must lie in \[0, 256\)"),
        (dict(rows=torch.tensor([256])), ValueError, r"rows must lie in \[0, 256\)"),
    ):
        args = dict(q=q, k=k, selected=sel, block_size=64, rows=rows) | kw
        with pytest.raises(exc, match=match):
            metrics.token_scores(args.pop("q"), args.pop("k"), args.pop("selected"), **args)
    s, exact = metrics.token_scores(q, k, sel, block_size=np.int64(64), rows=rows)
    assert s.shape == exact.shape == (1, 2, 3, 256)
    assert torch.equal(exact[:, :, 1], sel[:, :, 1].repeat_interleave(64, dim=-1))


def test_dense_pass_takes_a_block_longer_than_the_keys():
    """A valid block_size far past the sequence (one block) is not padded to its length."""
    q, k, v = _qkv(length=50)
    sel = metrics.select(q, k, v, density=0.5, block_size=64).selected  # 50 tokens: one block at either size
    kmean = ref.block_stats(k, v, 64).kmean
    dp = metrics.dense_pass(q, k, v, block_size=2**40, masks=(~sel,), kmean=kmean)
    want = metrics.dense_pass(q, k, v, block_size=64, masks=(~sel,), kmean=kmean)
    assert torch.equal(dp.out, want.out) and torch.equal(dp.tail_mass[0], want.tail_mass[0])
    assert torch.allclose(dp.tail_estimate[0], want.tail_estimate[0])


def test_rel_l1_of_a_tiny_float64_reference():
    """A float64 reference smaller than 1e-300 is still a reference: twice it is an error of 1,
    not 1e-5 (the denominator was clamped)."""
    dense = torch.full((1, 2, 4, 16), 1e-305, dtype=torch.float64)
    assert metrics.rel_l1(2 * dense, dense) == pytest.approx(1.0)
    assert metrics.rel_l1_per_head(2 * dense, dense).tolist() == pytest.approx([1.0, 1.0])


def test_rel_l1_refuses_complex_tensors():
    # converting to float64 drops the imaginary part: |1j - 1| would read as |0 - 1|
    with pytest.raises(TypeError, match="out"):
        metrics.rel_l1(torch.tensor([1j]), torch.tensor([1 + 0j]))
    with pytest.raises(TypeError, match="dense"):
        metrics.rel_l1_per_head(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16, dtype=torch.complex64))


def test_select_takes_a_numpy_bool_covariance_aware():
    # pisa_attention (PisaSettings) takes np.True_; the measurement of its selection must too
    q, k, v = _qkv()
    a = metrics.select(q, k, v, density=0.5, block_size=64, covariance_aware=np.True_)
    b = metrics.select(q, k, v, density=0.5, block_size=64, covariance_aware=True)
    assert torch.equal(a.selected, b.selected)
