"""Public API ``pisa_attention``: validation errors, layouts, GQA, LSE, keep_blocks, properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from brute import MODES, brute_dense, brute_n_select, brute_pisa, brute_selection, paper
from pisa_attn import PisaSettings, pisa_attention, spec
from pisa_attn.ops import reference as ref


def make_qkv(b, h, hk, lq, lk, d, *, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g)
    v = torch.randn(b, hk, lk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ---------------------------------------------------------------- validation: every error names its argument
def _base():
    return dict(zip("qkv", make_qkv(1, 4, 2, 64, 64, 32)))


def _with(**changes):
    def build():
        kw = _base()
        for name, value in changes.items():
            kw[name] = value(kw) if callable(value) else value
        return kw

    return build


BAD_INPUTS = [
    ("q-rank3", _with(q=lambda kw: kw["q"][0]), ValueError, r"\bq\b.*rank 4"),
    ("k-rank5", _with(k=lambda kw: kw["k"][None]), ValueError, r"\bk\b.*rank 4"),
    ("v-rank2", _with(v=lambda kw: kw["v"][0, 0]), ValueError, r"\bv\b.*rank 4"),
    ("q-not-tensor", _with(q=lambda kw: kw["q"].tolist()), TypeError, r"\bq\b.*torch.Tensor"),
    ("layout", _with(layout="bsdh"), ValueError, "layout"),
    ("mode", _with(mode="second"), ValueError, "mode"),
    ("backend", _with(backend="cuda"), ValueError, "backend"),
    ("batch-mismatch", _with(k=lambda kw: kw["k"].expand(2, -1, -1, -1), v=lambda kw: kw["v"].expand(2, -1, -1, -1)), ValueError, "batch"),
    ("headdim-mismatch", _with(k=lambda kw: kw["k"][..., :16], v=lambda kw: kw["v"][..., :16]), ValueError, "head dim"),
    ("headdim-too-small", _with(**{n: (lambda kw, n=n: kw[n][..., :8]) for n in "qkv"}), ValueError, "head dim"),
    ("headdim-too-large", _with(**{n: (lambda kw, n=n: kw[n].repeat(1, 1, 1, 9)) for n in "qkv"}), ValueError, "head dim"),
    ("kv-shape-mismatch", _with(v=lambda kw: kw["v"][:, :, :32]), ValueError, r"\bk\b and \bv\b"),
    ("heads-not-divisible", _with(k=lambda kw: kw["k"].repeat(1, 2, 1, 1)[:, :3], v=lambda kw: kw["v"].repeat(1, 2, 1, 1)[:, :3]), ValueError, "heads"),
    ("empty-q", _with(q=lambda kw: kw["q"][:, :, :0]), ValueError, "empty"),
    ("no-query-heads", _with(q=lambda kw: kw["q"][:, :0]), ValueError, "empty"),
    ("no-heads", _with(**{n: (lambda kw, n=n: kw[n][:, :0]) for n in "qkv"}), ValueError, "empty"),
    ("dtype-mismatch", _with(k=lambda kw: kw["k"].double()), TypeError, "dtype"),
    ("device-mismatch", _with(v=lambda kw: kw["v"].to("meta")), ValueError, "device"),
    ("int-dtype", _with(**{n: (lambda kw, n=n: kw[n].to(torch.int32)) for n in "qkv"}), TypeError, r"\bq\b.*floating"),
    ("bool-dtype", _with(**{n: (lambda kw, n=n: kw[n] > 0) for n in "qkv"}), TypeError, "floating"),
    ("complex-dtype", _with(**{n: (lambda kw, n=n: kw[n].to(torch.complex64)) for n in "qkv"}), TypeError, "floating"),
    ("density-0", _with(density=0.0), ValueError, "density"),
    ("density-negative", _with(density=-0.1), ValueError, "density"),
    ("density-above-1", _with(density=1.5), ValueError, "density"),
    ("density-nan", _with(density=float("nan")), ValueError, "density"),
    ("density-str", _with(density="0.5"), TypeError, "density"),
    ("density-bool", _with(density=True), TypeError, "density"),
    ("density-tensor", _with(density=torch.tensor(0.5)), TypeError, "density"),
    ("block-24", _with(block_size=24), ValueError, "block_size"),
    ("block-8", _with(block_size=8), ValueError, "block_size"),
    ("block-0", _with(block_size=0), ValueError, "block_size"),
    ("block-float", _with(block_size=64.0), ValueError, "block_size"),
    ("block-bool", _with(block_size=True), ValueError, "block_size"),
    ("scale-negative", _with(scale=-1.0), ValueError, "scale"),
    ("scale-inf", _with(scale=float("inf")), ValueError, "scale"),
    # finite, but inf in float32 (the kernels' arithmetic): every output NaN
    ("scale-past-float32", _with(scale=1e39), ValueError, "scale"),
    ("scale-huge-int", _with(scale=10**400), ValueError, "scale"),
    ("keep-wrong-length", _with(keep_blocks=torch.ones(3, dtype=torch.bool)), ValueError, "keep_blocks"),
    ("keep-wrong-rank", _with(keep_blocks=torch.ones(1, 4, dtype=torch.bool)), ValueError, "keep_blocks"),
    ("keep-wrong-heads", _with(keep_blocks=torch.ones(1, 3, 1, dtype=torch.bool)), ValueError, "keep_blocks"),
    ("keep-per-query-block", _with(keep_blocks=torch.ones(1, 4, 1, 1, dtype=torch.bool)), ValueError, "keep_blocks"),
    ("keep-float", _with(keep_blocks=torch.ones(1)), TypeError, "keep_blocks"),
    ("cov-truthy-str", _with(covariance_aware="no"), TypeError, "covariance_aware"),
    ("cov-int", _with(covariance_aware=1), TypeError, "covariance_aware"),
    ("return-lse-truthy-str", _with(return_lse="no"), TypeError, "return_lse"),
    ("return-lse-none", _with(return_lse=None), TypeError, "return_lse"),
    ("keep-list", _with(keep_blocks=[True]), TypeError, "keep_blocks"),
    ("alpha-nan", _with(alpha=float("nan")), ValueError, "alpha.*finite"),
    ("alpha-inf-in-tensor", _with(alpha=torch.tensor([0.5, float("inf"), 0.5, 0.5])), ValueError, "alpha.*finite"),
    ("alpha-huge", _with(alpha=1e30), ValueError, "alpha.*within"),
    ("alpha-huge-in-tensor", _with(alpha=torch.tensor([0.5, -2e3, 0.5, 0.5])), ValueError, "alpha.*within"),
    ("alpha-wrong-heads", _with(alpha=torch.ones(2)), ValueError, r"alpha.*\[4\]"),
    ("alpha-per-kv-head-matrix", _with(alpha=torch.ones(1, 4)), ValueError, "alpha"),
    ("alpha-str", _with(alpha="0.5"), TypeError, "alpha"),
    ("alpha-bool", _with(alpha=True), TypeError, "alpha"),
    ("alpha-list-wrong-heads", _with(alpha=[0.5] * 3), ValueError, "alpha.*4 values"),
    ("alpha-empty-list", _with(alpha=[]), ValueError, "alpha"),
    ("alpha-list-of-str", _with(alpha=["0.5"] * 4), TypeError, "alpha"),
    ("alpha-ndarray", _with(alpha=np.full(4, 0.5)), TypeError, "alpha"),
    ("alpha-int-tensor", _with(alpha=torch.ones(4, dtype=torch.int32)), TypeError, "alpha"),
    ("alpha-zeroth", _with(alpha=0.5, mode="zeroth"), ValueError, "alpha.*zeroth"),
    ("alpha-drop", _with(alpha=1.0, mode="drop"), ValueError, "alpha.*drop"),
    ("alpha-other-device", _with(alpha=torch.ones(4, device="meta")), ValueError, "alpha.*device"),
]


@pytest.mark.parametrize("build,exc,pattern", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(build, exc, pattern):
    kw = build()
    with pytest.raises(exc, match=pattern):
        pisa_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


@pytest.mark.parametrize(
    "density,n,k", [(0.25, 10, 3), (0.15, 10, 2), (0.05, 10, 1), (0.35, 10, 4), (0.01, 10, 1), (1.0, 7, 7), (0.5, 3, 2)]
)
def test_selected_count_is_density_times_blocks_rounded_half_up(density, n, k):
    assert spec.num_selected(density, n) == k


@pytest.mark.parametrize("loose", [dict(density=0.125), dict(block_size=64), dict(mode="hybrid"),
                                   dict(covariance_aware=True), dict(layout="bhsd"), dict(backend="auto"),
                                   dict(precision="input")], ids=lambda d: next(iter(d)))
def test_settings_and_a_loose_argument_at_its_default_value_is_refused(loose):
    """With settings=, a loose argument the caller passed is refused even at the default value
    (settings would silently win over it)."""
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match=f"not both.*{next(iter(loose))}"):
        pisa_attention(q, q, q, settings=PisaSettings(density=0.5, block_size=16, covariance_aware=False), **loose)


def test_make_plan_checks_its_tensors():
    from pisa_attn import make_plan

    q = torch.randn(1, 2, 70, 32)
    with pytest.raises(ValueError, match="q must have rank 4"):
        make_plan(q[0], q[0], 0.3, 16, "hybrid", False, None, "auto")
    with pytest.raises(TypeError, match="floating"):
        make_plan(q.int(), q.int(), 0.3, 16, "hybrid", False, None, "auto")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        make_plan(torch.randn(1, 3, 70, 32), q, 0.3, 16, "hybrid", False, None, "auto")


def test_selected_count_rounds_the_decimal_density():
    # 0.29 * 50 is 14.4999... in floats; the rule reads the density as written (14.5 -> 15)
    assert spec.num_selected(0.29, 50) == 15
    pairs = [(i / 1000, n) for i in range(1, 1001) for n in range(1, 300, 7)]
    assert [spec.num_selected(d, n) for d, n in pairs] == [brute_n_select(d, n) for d, n in pairs]


def test_reference_backend_is_differentiable():
    q, k, v = make_qkv(1, 2, 2, 48, 48, 16)
    q.requires_grad_()
    pisa_attention(q, k, v, density=0.5, block_size=16, backend="reference").sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_keep_blocks_on_another_accelerator_rejected():
    kw = _base()
    with pytest.raises(ValueError, match="keep_blocks"):
        pisa_attention(**kw, keep_blocks=torch.ones(1, dtype=torch.bool, device="meta"))


# ---------------------------------------------------------------- layouts, shapes, GQA, head dims
@pytest.mark.parametrize("mode", MODES)
def test_bshd_equals_transposed_bhsd_B2_H4_Hk2_Lq100_Lk77_D32(mode):
    q, k, v = make_qkv(2, 4, 2, 100, 77, 32, seed=1)
    out, lse = pisa_attention(q, k, v, density=0.3, block_size=16, mode=mode, return_lse=True)
    # [B, L, H, D] copies and plain strided views must both work
    for q2, k2, v2 in [(x.transpose(1, 2).contiguous() for x in (q, k, v)), (x.transpose(1, 2) for x in (q, k, v))]:
        out2, lse2 = pisa_attention(q2, k2, v2, density=0.3, block_size=16, mode=mode, layout="bshd", return_lse=True)
        assert out2.shape == (2, 100, 4, 32)
        torch.testing.assert_close(out2, out.transpose(1, 2), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse2, lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hk", [2, 1], ids=["Hk2", "Hk1"])
def test_gqa_equals_repeated_kv_heads_B1_H4_L96_D32(hk, mode):
    q, k, v = make_qkv(1, 4, hk, 96, 96, 32, seed=2)
    out = pisa_attention(q, k, v, covariance_aware=False, density=0.25, block_size=16, mode=mode)
    rep = 4 // hk
    want = pisa_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), covariance_aware=False, density=0.25, block_size=16, mode=mode)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    sel = brute_selection(q, k, density=0.25, block_size=16)
    want = brute_pisa(q, k, v, sel, mode=mode, block_size=16, alpha=spec.DEFAULT_ALPHA)[0]  # the default weight
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


LQ_LK = [(40, 200), (200, 40), (1, 33), (33, 1)]


@pytest.mark.parametrize("lq,lk", LQ_LK, ids=[f"B2-H2-Lq{a}-Lk{b}-D32" for a, b in LQ_LK])
def test_lq_differs_from_lk(lq, lk):
    q, k, v = make_qkv(2, 2, 2, lq, lk, 32, seed=3)
    out, lse = pisa_attention(q, k, v, covariance_aware=False, density=0.5, block_size=16, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2, lq)
    sel = brute_selection(q, k, density=0.5, block_size=16)
    want = brute_pisa(q, k, v, sel, mode="hybrid", block_size=16, alpha=spec.DEFAULT_ALPHA)[0]
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("d", [32, 64, 128, 256], ids=lambda d: f"B1-H2-L130-D{d}")
def test_head_dims(d):
    q, k, v = make_qkv(1, 2, 2, 130, 130, d, seed=4)
    dense = pisa_attention(q, k, v, density=1.0, block_size=32)
    torch.testing.assert_close(dense, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    sparse = pisa_attention(q, k, v, density=0.2, block_size=32)
    assert sparse.shape == q.shape and torch.isfinite(sparse).all()


def test_return_lse_flag_and_fp64_dtype():
    q, k, v = make_qkv(1, 2, 2, 50, 50, 32, dtype=torch.float64, seed=5)
    out = pisa_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    out2, lse = pisa_attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and lse.dtype == torch.float32 and lse.shape == (1, 2, 50)


# ---------------------------------------------------------------- LSE
@pytest.mark.parametrize("scale", [None, 0.05], ids=["default-scale", "scale0.05"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_lse_at_density_one_is_logsumexp_of_scaled_scores_B2_H4_Hk2_L150_D64(layout, scale):
    q, k, v = make_qkv(2, 4, 2, 150, 150, 64, seed=6)
    args = (q, k, v) if layout == "bhsd" else tuple(x.transpose(1, 2) for x in (q, k, v))
    _, lse = pisa_attention(*args, density=1.0, scale=scale, layout=layout, return_lse=True)
    assert lse.shape == (2, 4, 150) and lse.dtype == torch.float32
    s = 64**-0.5 if scale is None else scale
    want = torch.logsumexp(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * s, -1)
    torch.testing.assert_close(lse, want, atol=1e-5, rtol=1e-5)


def test_lse_of_sparse_call_is_log_of_approximate_denominator():
    q, k, v = make_qkv(1, 2, 1, 100, 120, 32, seed=7)
    _, lse = pisa_attention(q, k, v, covariance_aware=False, density=0.25, block_size=16, mode="zeroth", return_lse=True)
    sel = brute_selection(q, k, density=0.25, block_size=16)
    torch.testing.assert_close(lse.double(), brute_pisa(q, k, v, sel, mode="zeroth", block_size=16)[1], atol=1e-5, rtol=1e-6)


# ---------------------------------------------------------------- keep_blocks
def test_keep_blocks_are_exact_and_do_not_count_against_k():
    q, k, v = make_qkv(2, 4, 2, 160, 160, 32, seed=8)  # 10 key blocks of 16
    keep = torch.zeros(10, dtype=torch.bool)
    keep[[0, 7]] = True
    n_sel = spec.num_selected(0.2, 10)
    _, _, sel = ref.pisa_reference(q, k, v, density=0.2, block_size=16, keep_blocks=keep)
    assert sel[..., keep].all()
    assert (sel[..., ~keep].sum(-1) == n_sel).all()
    assert torch.equal(sel, brute_selection(q, k, density=0.2, block_size=16, keep_blocks=keep))
    for mode in MODES:
        out = pisa_attention(q, k, v, density=0.2, block_size=16, mode=mode, keep_blocks=keep, **paper(mode))
        torch.testing.assert_close(out.double(), brute_pisa(q, k, v, sel, mode=mode, block_size=16)[0], atol=2e-5, rtol=1e-4)


def test_keep_blocks_shapes_are_equivalent():
    q, k, v = make_qkv(2, 4, 2, 100, 100, 32, seed=9)  # 7 key blocks
    per_head = torch.zeros(2, 4, 7, dtype=torch.bool)
    per_head[:, :, 3] = True
    want = pisa_attention(q, k, v, density=0.15, block_size=16, keep_blocks=per_head)
    for keep in (per_head[0, 0], per_head[:1], per_head[:, :1], per_head[:1, :1]):
        torch.testing.assert_close(pisa_attention(q, k, v, density=0.15, block_size=16, keep_blocks=keep), want, atol=0, rtol=0)
    other = torch.zeros(7, dtype=torch.bool)
    other[5] = True  # a different kept block changes the result: the flag is really used
    assert not torch.allclose(pisa_attention(q, k, v, density=0.15, block_size=16, keep_blocks=other), want)


@pytest.mark.parametrize("mode", MODES)
def test_keeping_every_block_is_dense(mode):
    q, k, v = make_qkv(1, 2, 2, 90, 90, 32, seed=10)
    out = pisa_attention(q, k, v, density=0.1, block_size=16, mode=mode, keep_blocks=torch.ones(6, dtype=torch.bool))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- properties over small shapes
@st.composite
def problems(draw):
    hk = draw(st.integers(1, 2))
    return dict(
        b=draw(st.integers(1, 2)),
        hk=hk,
        h=hk * draw(st.integers(1, 2)),
        lq=draw(st.integers(1, 140)),
        lk=draw(st.integers(1, 140)),
        d=draw(st.sampled_from([16, 32, 48, 64])),
        block_size=draw(st.sampled_from([16, 32, 64])),
        density=draw(st.floats(0.01, 1.0)),
        mode=draw(st.sampled_from(MODES)),
        layout=draw(st.sampled_from(["bhsd", "bshd"])),
        scale_up=draw(st.sampled_from([1.0, 8.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=30, deadline=None)
@given(problems())
def test_property_finite_shapes_and_density_one_is_dense(p):
    q, k, v = make_qkv(p["b"], p["h"], p["hk"], p["lq"], p["lk"], p["d"], seed=p["seed"])
    q = q * p["scale_up"]
    to = (lambda x: x) if p["layout"] == "bhsd" else (lambda x: x.transpose(1, 2))
    kw = dict(block_size=p["block_size"], mode=p["mode"], layout=p["layout"], return_lse=True)
    out, lse = pisa_attention(to(q), to(k), to(v), density=p["density"], **kw)
    assert out.shape == to(q).shape and out.dtype == q.dtype
    assert lse.shape == (p["b"], p["h"], p["lq"]) and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    dense, dense_lse = pisa_attention(to(q), to(k), to(v), density=1.0, **kw)
    want, want_lse = brute_dense(q, k, v)
    torch.testing.assert_close(to(dense).double(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dense_lse.double(), want_lse, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- the first-order weight alpha
@pytest.mark.parametrize("mode", ["hybrid", "first"])
@pytest.mark.parametrize("hk", [4, 1], ids=["Hk4", "Hk1-gqa"])
def test_alpha_per_query_head_matches_brute_B2_H4_Lq90_Lk110_D32(mode, hk):
    """A weight per QUERY head (heads sharing a kv head differ) on ragged blocks, both first-order
    forms, against the brute force with the same weights."""
    q, k, v = make_qkv(2, 4, hk, 90, 110, 32, dtype=torch.float64, seed=21)
    w = torch.tensor([0.0, 0.4, 1.0, -0.3], dtype=torch.float64)
    out = pisa_attention(q, k, v, covariance_aware=False, density=0.3, block_size=16, mode=mode, alpha=w, backend="reference")
    sel = brute_selection(q, k, density=0.3, block_size=16)
    torch.testing.assert_close(out, brute_pisa(q, k, v, sel, mode=mode, block_size=16, alpha=w)[0], atol=1e-11, rtol=1e-11)
    # A float is the same weight for every head; a 0-d tensor is a float.
    one = pisa_attention(q, k, v, covariance_aware=False, density=0.3, block_size=16, mode=mode, alpha=0.4, backend="reference")
    torch.testing.assert_close(one[:, 1], out[:, 1], atol=0, rtol=0)
    assert torch.equal(one, pisa_attention(q, k, v, covariance_aware=False, density=0.3, block_size=16, mode=mode, alpha=torch.tensor(0.4, dtype=torch.float64)))


def test_alpha_endpoints_are_zeroth_and_the_paper_bit_for_bit():
    q, k, v = make_qkv(1, 2, 2, 150, 150, 32, seed=22)
    kw = dict(density=0.25, block_size=32, return_lse=True)
    zeroth = pisa_attention(q, k, v, mode="zeroth", **kw)
    a0 = pisa_attention(q, k, v, alpha=0.0, **kw)
    assert torch.equal(a0[0], zeroth[0]) and torch.equal(a0[1], zeroth[1])
    out, lse, _ = ref.pisa_reference(q, k, v, covariance_aware=spec.DEFAULT_COVARIANCE_AWARE, density=0.25,
                                     block_size=32)  # no weight: the paper's term
    a1 = pisa_attention(q, k, v, alpha=1.0, **kw)
    assert torch.equal(a1[0], out) and torch.equal(a1[1], lse)
    default = pisa_attention(q, k, v, **kw)
    assert torch.equal(default[1], lse)  # the weight never touches the denominator
    # The output is affine in the weight: the default sits at DEFAULT_ALPHA between the endpoints.
    want = zeroth[0].double() + spec.DEFAULT_ALPHA * (out.double() - zeroth[0].double())
    torch.testing.assert_close(default[0].double(), want, atol=1e-6, rtol=1e-6)
    assert spec.DEFAULT_ALPHA == 0.75


def test_alpha_takes_what_settings_take():
    """Per call, alpha takes the values PisaSettings takes: numpy numbers and sequences of one value
    or one per query head, each the same call as the tensor of those values."""
    from pisa_attn import PisaSettings

    q, k, v = make_qkv(1, 2, 2, 96, 96, 32, seed=29)
    kw = dict(density=0.25, block_size=16)
    for alpha, want in ((np.float32(0.5), [0.5, 0.5]), ([0.25, 1.0], [0.25, 1.0]), ((0.5,), [0.5, 0.5]),
                        ([np.float64(0.25), 1], [0.25, 1.0])):
        PisaSettings(alpha=alpha)
        got = pisa_attention(q, k, v, alpha=alpha, **kw)
        assert torch.equal(got, pisa_attention(q, k, v, alpha=torch.tensor(want), **kw)), alpha


def test_alpha_cpu_tensor_values_are_read_every_call():
    """A CPU tensor's values are read on each call (the device copy is cached by value): editing it
    in place changes the next call's output."""
    q, k, v = make_qkv(1, 2, 2, 96, 96, 32, seed=23)
    w = torch.tensor([0.5, 0.5])
    first = pisa_attention(q, k, v, density=0.25, block_size=16, alpha=w)
    w[1] = 1.0
    second = pisa_attention(q, k, v, density=0.25, block_size=16, alpha=w)
    assert torch.equal(first[:, 0], second[:, 0]) and not torch.equal(first[:, 1], second[:, 1])


def test_alpha_device_tensors_are_cached_by_value():
    from pisa_attn import tail_weight

    a = tail_weight.resolve(0.25, mode="hybrid", heads=3, device="cpu")
    assert a is tail_weight.resolve(torch.tensor([0.25, 0.25, 0.25]), mode="hybrid", heads=3, device="cpu")
    assert a.dtype == torch.float32 and a.tolist() == [0.25] * 3
    assert tail_weight.resolve(None, mode="hybrid", heads=3, device="cpu").tolist() == [spec.DEFAULT_ALPHA] * 3
    assert tail_weight.resolve(None, mode="zeroth", heads=3, device="cpu") is None


def test_alpha_under_torch_compile_is_an_input_not_a_constant(monkeypatch):
    """Under torch.compile (fullgraph) alpha is traced, and a new per-head tensor does not recompile;
    nor does the second call when the first compiled one loaded the backend (an empty cache)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import pisa_attn.attention as attention

    monkeypatch.setattr(attention, "_BACKENDS", {})
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 2, 2, 128, 128, 32, seed=24)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda q, k, v, a: pisa_attention(q, k, v, density=0.25, block_size=32, alpha=a),
                       fullgraph=True, backend=counter)
    for w in (torch.tensor([0.2, 0.9]), torch.tensor([1.0, 0.0])):
        torch.testing.assert_close(fn(q, k, v, w), pisa_attention(q, k, v, density=0.25, block_size=32, alpha=w),
                                   rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_float_alpha_and_scale_change_under_torch_compile_fullgraph(backend):
    """A Python float alpha or scale that changes between compiled calls becomes a symbolic float
    after the first change: its checks must trace (no math.isfinite on it) and the values must reach
    the kernels (the result follows them)."""
    torch._dynamo.reset()
    dtype = torch.float16 if backend == "triton" else torch.float32  # the kernels take half precision
    q, k, v = make_qkv(1, 2, 2, 128, 128, 32, dtype=dtype, seed=25)
    kw = dict(density=0.25, block_size=32, backend=backend)
    fn = torch.compile(lambda q, k, v, a, s: pisa_attention(q, k, v, alpha=a, scale=s, **kw),
                       fullgraph=True, backend="eager")
    outs = []
    for a, s in ((0.3, 0.2), (0.7, 0.2), (0.7, 0.11)):  # alpha changes, then scale
        got = fn(q, k, v, a, s)
        torch.testing.assert_close(got, pisa_attention(q, k, v, alpha=a, scale=s, **kw), rtol=1e-5, atol=1e-5)
        outs.append(got)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_keep_blocks_under_torch_compile_fullgraph():
    """The kept-block count is never read on the host while tracing: dynamo traces the whole call
    (fullgraph: a graph break raises) and AOTAutograd retraces it with fake tensors. (The reference
    backend through inductor's C++ code generation: test_diffusers_compile.py, marked slow.)"""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 32) for _ in range(3))
    keep = torch.zeros(5, dtype=torch.bool)
    keep[1] = True
    fn = torch.compile(
        lambda q, k, v: pisa_attention(q, k, v, density=0.2, keep_blocks=keep, backend="reference"),
        fullgraph=True,
        backend="aot_eager",
    )
    torch.testing.assert_close(fn(q, k, v), pisa_attention(q, k, v, density=0.2, keep_blocks=keep), rtol=1e-5, atol=1e-5)

