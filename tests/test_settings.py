"""PisaSettings: one frozen, validated, hashable object; numpy scalars accepted and normalised."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pisa_attn import spec
from pisa_attn.settings import PisaSettings


def test_defaults_match_pisa_attention():
    s = PisaSettings()
    assert (s.density, s.mode, s.alpha, s.block_size, s.query_block) == (0.125, "hybrid", None, 64, None)
    assert s.alpha_values(3) == (spec.DEFAULT_ALPHA,) * 3


@pytest.mark.parametrize("field,value,expected", [
    ("block_size", np.int64(32), 32),
    ("block_size", np.int32(64), 64),
    ("density", np.float32(0.25), 0.25),
    ("density", np.float64(0.5), 0.5),
    ("scale", np.float32(0.125), 0.125),
    ("covariance_aware", np.True_, True),
    ("covariance_aware", np.False_, False),
    ("query_block", np.int64(128), 128),
    ("alpha", np.float32(0.5), 0.5),
    # read as the decimal it prints: 0.35 of 10 blocks is 4 (half up), 0.3499999940 would give 3
    ("density", np.float32(0.35), 0.35),
    ("density", np.float16(0.35), 0.35),
    # numpy's strings (from a config array, say) are stored as str: they were kept as np.str_
    ("mode", np.str_("drop"), "drop"),
    ("backend", np.str_("reference"), "reference"),
    ("layout", np.str_("bshd"), "bshd"),
    ("precision", np.str_("input"), "input"),
])
def test_numpy_scalars_are_normalised_to_python(field, value, expected):
    s = PisaSettings(**{field: value})
    got = getattr(s, field)
    assert got == expected and type(got) is type(expected)
    hash(s)


@pytest.mark.parametrize("alpha,expected", [
    ([1.0, 0.5], (1.0, 0.5)),
    ((np.float64(0.25), 1), (0.25, 1.0)),
    (torch.tensor([0.5, 1.0]), (0.5, 1.0)),
    (torch.tensor(0.5), 0.5),
    (1, 1.0),
])
def test_alpha_normalised_to_hashable_floats(alpha, expected):
    s = PisaSettings(alpha=alpha)
    assert s.alpha == expected
    assert PisaSettings(alpha=alpha) == s and hash(PisaSettings(alpha=alpha)) == hash(s)


BAD = [
    ("density-str", dict(density="0.5"), TypeError, r"density.*'0.5' \(str\)"),
    ("density-tensor", dict(density=torch.tensor(0.5)), TypeError, "density"),
    ("density-bool", dict(density=True), TypeError, "density"),
    ("density-0", dict(density=0.0), ValueError, "density"),
    ("density-nan", dict(density=np.float32("nan")), ValueError, "density"),
    ("block-float", dict(block_size=64.0), ValueError, r"block_size.*\(float\)"),
    ("block-np-float", dict(block_size=np.float64(64)), ValueError, r"block_size.*float64"),
    ("block-24", dict(block_size=np.int64(24)), ValueError, "block_size"),
    ("block-bool", dict(block_size=True), ValueError, "block_size"),
    ("query-block-96", dict(query_block=96), ValueError, "query_block"),
    ("query-block-float", dict(query_block=128.0), ValueError, r"query_block.*\(float\)"),
    ("cov-int", dict(covariance_aware=1), TypeError, r"covariance_aware.*\(int\)"),
    ("cov-str", dict(covariance_aware="no"), TypeError, "covariance_aware"),
    ("scale-neg", dict(scale=np.float32(-1)), ValueError, "scale"),
    ("scale-str", dict(scale="1"), ValueError, r"scale.*\(str\)"),
    ("mode", dict(mode="second"), ValueError, "mode"),
    ("backend", dict(backend="cuda"), ValueError, "backend"),
    ("layout", dict(layout="bsdh"), ValueError, "layout"),
    ("alpha-in-drop", dict(mode="drop", alpha=1.0), ValueError, "alpha"),
    ("alpha-in-zeroth", dict(mode="zeroth", alpha=0.5), ValueError, "alpha"),
    ("alpha-nan", dict(alpha=float("nan")), ValueError, "alpha"),
    ("alpha-huge", dict(alpha=(0.5, 1e30)), ValueError, "alpha.*within"),
    ("alpha-str", dict(alpha="1"), TypeError, "alpha"),
    ("alpha-empty", dict(alpha=()), ValueError, "alpha"),
    ("alpha-empty-tensor", dict(alpha=torch.empty(0)), ValueError, "alpha"),  # as an empty sequence is
    ("alpha-int-tensor", dict(alpha=torch.ones(2, dtype=torch.int64)), TypeError, "alpha"),
    ("alpha-requires-grad", dict(alpha=torch.ones(2, requires_grad=True)), TypeError, "alpha.*per call"),
    ("alpha-meta", dict(alpha=torch.ones(2, device="meta")), TypeError, "alpha.*per call"),
    ("alpha-rank2", dict(alpha=torch.ones(2, 2)), ValueError, "alpha"),
    ("density-huge-int", dict(density=10**400), ValueError, "density.*too large"),
    ("scale-huge-int", dict(scale=10**400), ValueError, "scale.*float32's largest"),
    ("scale-past-float32", dict(scale=1e39), ValueError, "scale.*float32's largest"),
    ("alpha-huge-int", dict(alpha=10**400), ValueError, "alpha"),
]


@pytest.mark.parametrize("kwargs,exc,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_settings_raise_naming_the_field(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        PisaSettings(**kwargs)


def test_frozen_and_replace_revalidates():
    s = PisaSettings()
    with pytest.raises(AttributeError):
        s.density = 0.5  # type: ignore[misc]
    assert s.replace(density=np.float32(0.5)).density == 0.5
    with pytest.raises(ValueError, match="density"):
        s.replace(density=2.0)


def test_alpha_values_per_head_count_checked():
    s = PisaSettings(alpha=(0.5, 1.0))
    assert s.alpha_values(2) == (0.5, 1.0)
    with pytest.raises(ValueError, match="alpha.*4 query heads"):
        s.alpha_values(4)
    assert PisaSettings(mode="drop").alpha_values(4) is None


def test_np_float32_density_selects_the_decimal_count():
    assert spec.num_selected(PisaSettings(density=np.float32(0.35)).density, 10) == 4
    # the rule itself, for callers that pass the user's number straight through (the fits)
    assert spec.num_selected(np.float32(0.53), 50) == spec.num_selected(0.53, 50) == 27
    assert spec.num_selected(np.float16(0.5), 3) == 2 and spec.num_selected(np.float64(0.29), 50) == 15


@pytest.mark.parametrize("name", ["density", "block_size", "mode", "backend", "layout", "precision"])
def test_none_is_not_the_default_for_keywords_whose_default_is_a_value(name):
    """``layout=None`` on bshd tensors once ran as bhsd: None is a value there, and refused."""
    from pisa_attn import pisa_attention

    q = torch.randn(1, 2, 64, 16)
    with pytest.raises((TypeError, ValueError), match=name):
        pisa_attention(q, q, q, **{"block_size": 16, "backend": "reference", name: None})


def test_none_keeps_meaning_default_where_it_is_the_default():
    from pisa_attn import pisa_attention

    q = torch.randn(1, 2, 64, 16)
    want = pisa_attention(q, q, q, block_size=16, backend="reference")
    got = pisa_attention(q, q, q, block_size=16, backend="reference", covariance_aware=None, scale=None,
                         query_block=None, alpha=None)
    assert torch.equal(got, want)


def test_spec_checks_take_numpy_numbers_and_huge_ints():
    spec.check_density(np.float32(0.3))
    spec.check_block_size(np.int64(64))
    spec.check_scale(np.float64(0.1))
    spec.check_scale(np.float32(3e38))
    with pytest.raises(ValueError, match="scale"):  # finite, but inf in the kernels' float32
        spec.check_scale(10**400)
    with pytest.raises(ValueError, match="density"):
        spec.check_density(10**400)


def test_numpy_float16_scale_is_checked_without_an_overflow_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32's largest value cast to float16 overflowed in the check
        spec.check_scale(np.float16(0.125))
        assert PisaSettings(scale=np.float16(0.125)).scale == 0.125


def test_a_stored_scale_passes_the_check_it_was_made_with():
    """The scale is stored as the decimal a narrow numpy float prints as; the check must judge that
    value, or a settings object is made that its own replace() refuses."""
    with pytest.raises(ValueError, match="scale"):  # prints as 3.4028235e+38, past float32's largest
        PisaSettings(scale=np.float32(spec.FLOAT32_MAX))
    s = PisaSettings(scale=np.float32(3e38))
    spec.check_scale(s.scale)
    assert s.replace(density=0.5).scale == s.scale
