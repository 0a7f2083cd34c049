"""Argument checks of the calibration entry points: bad bounds, measured ranges and rows are refused
naming the argument, never turned into a silent weight or a plan of rows that do not exist."""

from __future__ import annotations

import pytest
import torch

from pisa_attn import calibration as cal


def _qkv(b=1, h=2, length=256, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, length, d, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.fixture(scope="module")
def terms_and_dense():
    q, k, v = _qkv()
    t = cal.tail_terms(q, k, v, density=0.25, block_size=64)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return t, dense


@pytest.mark.parametrize("bounds", [(1.0, 0.0), (float("nan"), 1.0), (0.0, float("nan")), (0.5,), (0.0, 1.0, 2.0),
                                    "01", 0.5],
                         ids=["reversed", "nan-lo", "nan-hi", "one", "three", "str", "float"])
def test_alpha_refuses_bad_bounds(terms_and_dense, bounds):
    # (1, 0) clamped every weight to 0 and a NaN bound made every weight NaN, silently.
    st = cal.alpha_stats(*terms_and_dense)
    with pytest.raises((ValueError, TypeError), match="bounds"):
        st.alpha(bounds=bounds)


def test_alpha_takes_good_bounds(terms_and_dense):
    st = cal.alpha_stats(*terms_and_dense)
    free = st.alpha()
    assert torch.equal(st.alpha(bounds=(0.0, 1.0)), free.clamp(0.0, 1.0))
    assert torch.equal(st.alpha(bounds=[-float("inf"), float("inf")]), free)
    assert torch.equal(st.alpha(bounds=(0.5, 0.5)), torch.full_like(free, 0.5))


def test_alpha_refuses_a_non_finite_default():
    # a head without tail gets the default: NaN there would be a NaN weight from finite statistics
    z = torch.zeros(2, dtype=torch.float64)
    st = cal.AlphaStats(z, z, z, z)
    with pytest.raises(ValueError, match="default"):
        st.alpha(default=float("nan"))
    assert st.alpha(default=0.75).tolist() == [0.75, 0.75]


@pytest.mark.parametrize("measured", [(0, 1000), (-64, 64), (200, 300), (100, 50), (0.5, 100), (0, 100, 3), 5,
                                      (True, 100)],
                         ids=["past-end", "negative", "straddles-end", "reversed", "float", "three", "int", "bool"])
def test_row_plan_refuses_bad_measured(measured):
    # rows outside [0, Lq) made plans of rows that do not exist (blocks -1, spans (256, 256))
    with pytest.raises((ValueError, TypeError), match="measured"):
        cal.row_plan(256, 64, None, measured)


def test_fit_rows_refuses_measured_past_the_rows():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="measured"):
        cal.fit_rows(q, k, v, density=0.25, measured=(0, 1000), block_size=64)
    fit = cal.fit_rows(q, k, v, density=0.25, measured=(10, 256), block_size=64)
    assert fit.rows == 246


@pytest.mark.parametrize("rows", [torch.tensor([1000]), torch.tensor([-1]), torch.tensor([1.0]),
                                  torch.ones(10, dtype=torch.bool), slice(5, 5), torch.zeros(256, dtype=torch.bool),
                                  [], "rows"],
                         ids=["past-end", "negative", "float", "short-mask", "empty-slice", "empty-mask",
                              "empty-list", "str"])
def test_alpha_stats_refuses_bad_rows(terms_and_dense, rows):
    # out-of-range rows were an IndexError; no rows at all gave every head the default, silently
    with pytest.raises((ValueError, TypeError), match="rows"):
        cal.alpha_stats(*terms_and_dense, rows=rows)
    with pytest.raises((ValueError, TypeError), match="rows"):
        cal.fit_alpha(*terms_and_dense, rows=rows)
    with pytest.raises((ValueError, TypeError), match="rows"):
        cal.fit_alpha_l1(*terms_and_dense, rows=rows)


def test_alpha_stats_rows_forms_agree(terms_and_dense):
    t, dense = terms_and_dense
    mask = torch.zeros(256, dtype=torch.bool)
    mask[64:128] = True
    ref = cal.alpha_stats(t, dense, rows=slice(64, 128))
    for rows in (mask, torch.arange(64, 128), list(range(64, 128))):
        st = cal.alpha_stats(t, dense, rows=rows)
        assert torch.equal(st.cr, ref.cr) and torch.equal(st.cc, ref.cc) and torch.equal(st.n, ref.n)


def test_tail_terms_refuses_a_selection_rule_beside_a_mask_and_foreign_stats():
    # keep_blocks / covariance_aware beside selected= were ignored; stats of another block size or
    # key length failed deep inside the reference.
    from pisa_attn.ops import reference as ref

    q, k, v = _qkv()
    sel = cal.tail_terms(q, k, v, density=0.25, block_size=64).selected
    keep = torch.tensor([True, False, False, False])  # one flag per key block
    for extra in (dict(keep_blocks=keep), dict(covariance_aware=True)):
        with pytest.raises(ValueError, match="with selected= the mask names the exact blocks"):
            cal.tail_terms(q, k, v, selected=sel, block_size=64, **extra)
    with pytest.raises(ValueError, match=r"stats must hold k's and v's blocks at block_size=64"):
        cal.tail_terms(q, k, v, density=0.25, block_size=64, stats=ref.prepare(q, k, v, 32))
    with pytest.raises(TypeError, match="stats must be the reference's BlockStats"):
        cal.tail_terms(q, k, v, density=0.25, block_size=64, stats={"kmean": None})
    given = cal.tail_terms(q, k, v, density=0.25, block_size=64, stats=ref.prepare(q, k, v, 64))
    assert torch.equal(given.base, cal.tail_terms(q, k, v, density=0.25, block_size=64).base)
