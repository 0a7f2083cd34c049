"""GPU checks of the low precisions ``fp8``, ``int8-fp8``, ``int8-int8``, ``int8`` (the
low-precision Hopper pair kernel; skipped off sm_90).

Under the kernel's own selection, per precision: the quantisation pass bit for bit against
:mod:`pisa_attn.ops.quant`; the kernel against the quantised reference and against float64 PISA;
large-magnitude q/k and the tail-maximum case stay finite; ragged lengths, GQA, D=64; the clear
errors for what the low-precision kernel does not take.

    PYTHONPATH=src python -m pytest tests/gpu/test_gpu_fp8.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pisa_attn import PisaSettings, pisa_attention, plan, run  # noqa: E402
from pisa_attn.attention import get_backend  # noqa: E402
from pisa_attn.ops import quant  # noqa: E402
from pisa_attn.ops import reference as ref  # noqa: E402


def _fp8_reason():
    try:
        return get_backend("hopper_fp8").unsupported_reason(
            torch.empty(1, 1, 64, 128, device="cuda", dtype=torch.bfloat16), "hybrid", 64)
    except ValueError as e:
        return str(e)


if torch.cuda.is_available() and _fp8_reason() is not None:
    pytestmark.append(pytest.mark.skip(reason=f"fp8: {_fp8_reason()}"))

LOWP = ("fp8", "int8-fp8", "int8-int8", "int8")
BACKENDS = {"fp8": "hopper_fp8", "int8-fp8": "hopper_int8_fp8", "int8-int8": "hopper_int8_int8", "int8": "hopper_int8"}
# INT8 P·V runs in the sequential loop only, each block's product from zero
LOWP_SCHEDULED = tuple(p for p in LOWP if p != "int8-int8")

# Kernel and quantised reference round the same numbers (same scales, same running maximum);
# they differ by the kernel's float16 centroids in the tail and the tensor cores' FP8 sums: about
# 2e-3 on DiT-like rows. On Gaussian rows (flat softmax, a small output averaging many terms) the
# few probabilities that round to the other e4m3 neighbour move the output more: 5e-3 to 1e-2
# measured on the H100, so those cases get the looser bound.
QREF_TOL = 5e-3
QREF_TOL_GAUSSIAN = 1.5e-2
F64_TOL = 2e-2  # the bound against float64 PISA under the same selection (DiT-like inputs)
# Gaussian q/k/v have a flat softmax and a small output: e4m3's 3 mantissa bits alone (dense, all
# of Q·Kᵀ, P and V rounded) give 3-5 % rel-L1 there (notes/fp8.md), so they get a looser bound.
F64_TOL_GAUSSIAN = 6e-2


def f64_tol(precision, data):
    """e4m3 products on Gaussian rows get the looser bound; INT8 Q·Kᵀ with P·V in the input dtype
    is held to the issue's bound on every case."""
    return F64_TOL if data == "dit" or precision == "int8" else F64_TOL_GAUSSIAN


def rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


def dit(b, h, hk, lq, lk, d, seed, mag=1.0):
    """DiT-like video attention (peaked, local): ``hk`` of the ``h`` heads give K/V (GQA)."""
    from pisa_attn.data import dit_qkv

    x = dit_qkv((-(-max(lq, lk) // 256), 16, 16), heads=h, head_dim=d, batch=b, seed=seed, device="cuda")
    q, k, v = x.q[:, :, :lq] * mag, x.k[:, :hk, :lk] * mag, x.v[:, :hk, :lk]
    return q.bfloat16().contiguous(), k.bfloat16().contiguous(), v.bfloat16().contiguous()


def qkv(b, h, hk, lq, lk, d, seed, mag=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, device="cuda") * mag
    k = torch.randn(b, hk, lk, d, generator=g, device="cuda") * mag + 0.5 * mag  # a common key component
    v = torch.randn(b, hk, lk, d, generator=g, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def fp8_run(q, k, v, mode="hybrid", density=0.125, precision="fp8"):
    s = PisaSettings(density=density, mode=mode, precision=precision, backend="hopper")
    p = plan(q, k, s)
    out, sel = run(p, q, k, v, return_selection=True)
    return p, out, sel


def references(q, k, v, p, sel, precision="fp8"):
    """(quantised reference, float64 PISA) under the kernel's selection, with the plan's weight."""
    nk = p.n_kv_blocks
    mask = sel.to_mask(nk)
    alpha = None if p.alpha is None else p.alpha.float()
    st = ref.block_stats(k.float(), v.float(), p.block_size)
    # the smoothing vector the kernel used (from the Hopper statistics' float16 centroids): the
    # same keys are then rounded the same way
    tst = get_backend("hopper").prepare(q, k, v, p.block_size)
    mu = quant.head_key_mean(tst.kbar, tst.kscale)
    oq, _ = quant.lowp_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode=p.mode, scale=p.scale,
                                    block_size=p.block_size, alpha=alpha, mu=mu, precision=precision)
    st64 = ref.block_stats(k.double(), v.double(), p.block_size)
    o64, _ = ref.pisa_forward(q.double(), k.double(), v.double(), st64, mask, mode=p.mode, scale=p.scale,
                              block_size=p.block_size, alpha=None if alpha is None else alpha.double())
    return oq, o64


CASES = {
    "B1-H4-L2048-D128-hybrid": (1, 4, 4, 2048, 2048, 128, "hybrid"),
    "B2-H4-L1536-D128-zeroth": (2, 4, 4, 1536, 1536, 128, "zeroth"),
    "B1-H4-L2048-D128-drop": (1, 4, 4, 2048, 2048, 128, "drop"),
    "B1-H4-L1000-D128-hybrid-ragged": (1, 4, 4, 1000, 1000, 128, "hybrid"),
    "B1-H4-Lq960-Lk1379-D64-hybrid": (1, 4, 4, 960, 1379, 64, "hybrid"),
    "B1-H8-Hk2-L2048-D128-hybrid-gqa": (1, 8, 2, 2048, 2048, 128, "hybrid"),
}


@pytest.mark.parametrize("data", ["dit", "gaussian"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("precision", LOWP)
def test_lowp_kernel_vs_references(precision, name, data):
    b, h, hk, lq, lk, d, mode = CASES[name]
    q, k, v = (dit if data == "dit" else qkv)(b, h, hk, lq, lk, d, seed=len(name))
    p, out, sel = fp8_run(q, k, v, mode, precision=precision)
    assert p.backend == BACKENDS[precision]
    oq, o64 = references(q, k, v, p, sel, precision)
    assert torch.isfinite(out).all()
    e_q, e_64 = rel_l1(out, oq), rel_l1(out, o64)
    print(f"[{precision}-{name}-{data}] rel-L1 vs quantised reference {e_q:.2e}, vs float64 PISA {e_64:.2e}")
    assert e_q < (QREF_TOL if data == "dit" else QREF_TOL_GAUSSIAN)
    assert e_64 < f64_tol(precision, data)


@pytest.mark.parametrize("precision", LOWP)
def test_quantize_pass_matches_reference_bitwise(precision):
    from pisa_attn.ops.triton import prepare as tprep
    from pisa_attn.ops.triton.quantize import quantize

    q, k, v = qkv(2, 4, 2, 1000, 1000, 128, seed=3, mag=3.0)
    st = tprep.prepare(q, k, v, 64)
    qz = quantize(k, v, st.kbar, st.kscale, 64, precision=precision)
    mu = quant.head_key_mean(st.kbar, st.kscale)
    torch.testing.assert_close(qz.mu, mu, rtol=1e-6, atol=1e-6)
    qk_fmt, pv_fmt = quant.PRODUCT_FORMATS[precision]
    k8, sig = quant.quantize_k(k, qz.mu, 64, qk_fmt)
    assert torch.equal(qz.sigma, sig)
    assert torch.equal(qz.k8.view(torch.uint8), k8.view(torch.uint8))
    if pv_fmt != "input":
        v8t, tau = quant.quantize_v(v, 64, pv_fmt)
        assert torch.equal(qz.tau, tau)
        assert torch.equal(qz.v8t.view(torch.uint8), v8t.view(torch.uint8))
    else:
        assert qz.v8t.numel() == 0
    if pv_fmt == "int8":
        assert torch.equal(qz.vcs, quant.value_code_sums(v8t, 64))
    else:
        assert qz.vcs.numel() == 0


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("with_hdev", [True, False])
@pytest.mark.parametrize("shape", ["B2-H4-Hk2-L1000-D128", "B1-H2-L4096-D64"])
@pytest.mark.parametrize("precision", LOWP)
def test_prepare_quant_is_the_standalone_pass_bitwise(precision, shape, with_hdev):
    """The copies prepare writes (the ``|v|`` maximum from its own read of V) are the standalone
    pass's bit for bit (and so the reference's, above); the statistics are unchanged by them."""
    from pisa_attn.ops.triton import prepare as tprep
    from pisa_attn.ops.triton.quantize import quantize

    b, h, hk, lq, d = (2, 4, 2, 1000, 128) if shape.startswith("B2") else (1, 2, 2, 4096, 64)
    q, k, v = qkv(b, h, hk, lq, lq, d, seed=5, mag=3.0)
    st = tprep.prepare(q, k, v, 64, with_hdev=with_hdev, quant=precision)
    plain = tprep.prepare(q, k, v, 64, with_hdev=with_hdev)
    qz = quantize(k, v, plain.kbar, plain.kscale, 64, precision=precision)
    for f in ("mu", "k8", "sigma", "v8t", "tau", "vcs"):
        assert torch.equal(_u8(getattr(st.quant, f)), _u8(getattr(qz, f))), f
    if quant.PRODUCT_FORMATS[precision][1] == "e4m3":
        assert torch.equal(st.quant.vmax, qz.vmax)
    for f in ("qmean", "kmean", "kbar", "kscale", "vbar", "hbar", "kbound"):
        assert torch.equal(getattr(st, f), getattr(plain, f)), f
    if with_hdev:
        assert torch.equal(st.hdev, plain.hdev)


@pytest.mark.parametrize("precision", LOWP)
@pytest.mark.parametrize("mag", [10.0, 30.0])
def test_lowp_large_magnitude_is_finite(mag, precision):
    q, k, v = dit(1, 4, 4, 2048, 2048, 128, seed=5, mag=mag)
    p, out, sel = fp8_run(q, k, v, precision=precision)
    oq, o64 = references(q, k, v, p, sel, precision)
    assert torch.isfinite(out).all()
    # Peaked softmax at these magnitudes: score errors of a few units move the weights, so the
    # bound here is the quantised reference (same roundings), not float64.
    print(f"[{precision}-mag{mag:g}] rel-L1 vs quantised reference {rel_l1(out, oq):.2e}, "
          f"vs float64 PISA {rel_l1(out, o64):.2e}")
    assert rel_l1(out, oq) < 5 * QREF_TOL


EXACT_FX_CASES = ("B1-H4-L2048-D128-hybrid", "B1-H4-L2048-D128-drop", "B1-H4-L1000-D128-hybrid-ragged",
                  "B1-H8-Hk2-L2048-D128-hybrid-gqa", "B2-H4-L1536-D128-zeroth")


@pytest.mark.parametrize("data", ["dit", "gaussian", "gauss30"])
@pytest.mark.parametrize("name", EXACT_FX_CASES)
def test_int8_exact_fixed_maximum(name, data):
    """``int8`` (P·V in the input dtype): the exact loop under the bound of its scores
    (``exact_max="bound"``, from the quantisation pass's ``max |k − μ|``) and the online loop, on
    one selection: both within the bounds of the quantised reference and of float64 PISA. On
    unit-scale heads the bound is used (the sums then round differently, so equal bits would mean
    the fixed path never ran); at 30x magnitude it is too loose and the loop keeps the online
    maximum, bit for bit the online result. The default (``"auto"``) is the online loop below
    16K keys."""
    from pisa_attn.ops.hopper import fp8 as _fp8

    b, h, hk, lq, lk, d, mode = CASES[name]
    mag = 30.0 if data == "gauss30" else 1.0
    q, k, v = (dit if data == "dit" else qkv)(b, h, hk, lq, lk, d, seed=len(name), mag=mag)
    p, _, sel = fp8_run(q, k, v, mode, precision="int8")
    st = get_backend("hopper_int8").prepare(q, k, v, 64)
    oq, o64 = references(q, k, v, p, sel, "int8")
    outs = {}
    for exact_max in ("bound", "online", None):
        out, lse = _fp8.attention(q, st.quant, *st.tail(), *sel, mode=mode, scale=p.scale, block_size=64, lk=lk, v=v,
                                  kbound=st.kbound, alpha=p.alpha, exact_max=exact_max)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), exact_max
        if data == "gauss30":  # a peaked softmax: the quantised reference's bound (as for large magnitudes)
            assert rel_l1(out, oq) < 5 * QREF_TOL, exact_max
        else:
            assert rel_l1(out, oq) < (QREF_TOL if data == "dit" else QREF_TOL_GAUSSIAN), (exact_max, rel_l1(out, oq))
            assert rel_l1(out, o64) < F64_TOL, (exact_max, rel_l1(out, o64))
        outs[exact_max] = (out, lse)
    (fo, fl), (oo, ol), (ao, al) = outs["bound"], outs["online"], outs[None]
    assert torch.equal(ao, oo) and torch.equal(al, ol)  # "auto" below 16K keys: online
    if data == "gauss30":
        assert torch.equal(fo, oo) and torch.equal(fl, ol)
    else:
        assert not torch.equal(fo, oo)
        assert rel_l1(fo, oo) < 5e-3
    print(f"\n[int8 {name} {data}] exact fixed vs online rel-L1 {rel_l1(fo, oo):.1e}, "
          f"max |dLSE| {(fl - ol).abs().max().item():.1e}")


@pytest.mark.parametrize("mode", ["hybrid", "drop"])
def test_int8_bound_holds_for_the_quantised_scores(mode):
    """``int8`` under the bound of its scores: the bound is the quantised scores' (the codes'
    rounding included), not the unquantised ``s·Σ|q_d|·max|k_d − μ_d|``. Each query row is one
    entry of 127 code steps beside entries of half a step, which round up to twice their value;
    the keys ±8 in every channel (μ = 0, no rounding): the quantised score runs 259 (base 2) past
    the unquantised bound, where exp2 overflowed to an inf output."""
    from pisa_attn.ops.hopper import fp8 as _fp8

    b, h, l, d = 1, 2, 2048, 128
    q = torch.full((b, h, l, d), 2.0, device="cuda", dtype=torch.bfloat16)
    q[..., 0] = 508.0  # σ_q = 4: code 127, the others 0.5 -> 1
    sign = 1.0 - 2.0 * (torch.arange(l, device="cuda") % 2)
    k = (8.0 * sign)[None, None, :, None].expand(b, h, l, d).to(torch.bfloat16).contiguous()
    g = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(b, h, l, d, device="cuda", generator=g).to(torch.bfloat16)
    p, _, sel = fp8_run(q, k, v, mode, precision="int8")
    st = get_backend("hopper_int8").prepare(q, k, v, 64)
    oq, _ = references(q, k, v, p, sel, "int8")
    outs = []
    for exact_max in ("bound", "online"):
        out, lse = _fp8.attention(q, st.quant, *st.tail(), *sel, mode=mode, scale=p.scale, block_size=64, lk=l, v=v,
                                  kbound=st.kbound, alpha=p.alpha, exact_max=exact_max)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), exact_max
        assert rel_l1(out, oq) < QREF_TOL, (exact_max, rel_l1(out, oq))
        outs.append((out, lse))
    assert (outs[0][1] - outs[1][1]).abs().max() < 1e-3


@pytest.mark.parametrize("mode", ["hybrid", "drop"])
def test_int8_planned_call_from_16k_keys_takes_the_bound(mode, monkeypatch):
    """A planned ``int8`` call from 16K keys runs its exact loop under the bound (``"auto"``), with
    the bound's channel maxima from the plan's prepare: within the bounds of the quantised
    reference and float64 PISA, and rounding away from the same call with the online loop."""
    from pisa_attn.ops.hopper import fp8 as _fp8

    q, k, v = dit(1, 2, 2, 16384, 16384, 128, seed=23)
    p, out, sel = fp8_run(q, k, v, mode, precision="int8")
    assert p.backend == "hopper_int8"
    oq, o64 = references(q, k, v, p, sel, "int8")
    assert torch.isfinite(out).all()
    assert rel_l1(out, oq) < QREF_TOL and rel_l1(out, o64) < F64_TOL, (rel_l1(out, oq), rel_l1(out, o64))
    monkeypatch.setattr(_fp8, "EXACT_MAX", "online")
    online = run(plan(q, k, PisaSettings(density=0.125, mode=mode, precision="int8", backend="hopper")), q, k, v,
                 selection=sel)
    assert not torch.equal(out, online) and rel_l1(out, online) < 5e-3
    print(f"\n[int8 planned 16K {mode}] vs quantised reference {rel_l1(out, oq):.1e}, float64 {rel_l1(out, o64):.1e}, "
          f"bound vs online {rel_l1(out, online):.1e}")


def test_int8_exact_fixed_maximum_refused_where_it_cannot_run():
    """``exact_max="bound"`` for e4m3 P: a ValueError naming it (the probabilities need a scale
    near the row's own maximum); ``"auto"`` keeps their online loop."""
    from pisa_attn.ops.hopper import fp8 as _fp8

    q, k, v = qkv(1, 2, 2, 1024, 1024, 128, seed=3)
    p, _, sel = fp8_run(q, k, v, precision="fp8")
    st = get_backend("hopper_fp8").prepare(q, k, v, 64)
    with pytest.raises(ValueError, match="exact_max"):
        _fp8.attention(q, st.quant, *st.tail(), *sel, mode="hybrid", scale=p.scale, block_size=64, lk=1024,
                       kbound=st.kbound, exact_max="bound")
    with pytest.raises(ValueError, match="exact_max must be"):
        _fp8.attention(q, st.quant, *st.tail(), *sel, mode="hybrid", scale=p.scale, block_size=64, lk=1024,
                       kbound=st.kbound, exact_max="fixed")


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_tail_maximum_is_finite(precision):
    """A row whose largest score is a centroid of a tail block (the exact blocks far below it)."""
    b, h, l, d = 1, 2, 2048, 128
    q, k, v = dit(b, h, h, l, l, d, seed=7)
    k = k.clone()
    k[:, :, 1024:1088] = (q[:, :, :64].float().mean(2, keepdim=True) * 8).bfloat16()  # one hot block
    s = PisaSettings(density=0.05, precision=precision, backend="hopper", covariance_aware=False)
    p = plan(q, k, s)
    out, sel = run(p, q, k, v, return_selection=True)
    assert torch.isfinite(out).all()
    oq, o64 = references(q, k, v, p, sel, precision)
    assert rel_l1(out, o64) < F64_TOL


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_zero_query_rows_ragged_are_finite(precision):
    """All-zero query rows (padding) with a ragged key length: their row scale is 0, and the
    masked columns of the last key block must stay −inf, not become −inf·0 = NaN."""
    q, k, v = dit(1, 4, 4, 1000, 1000, 128, seed=19)
    q = q.clone()
    q[:, :, 900:] = 0
    q[:, :, 10:20] = 0
    p, out, sel = fp8_run(q, k, v, precision=precision)
    assert torch.isfinite(out).all()
    oq, _ = references(q, k, v, p, sel, precision)
    assert rel_l1(out, oq) < QREF_TOL


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_same_selection_as_bf16_and_close_to_it(precision):
    q, k, v = dit(1, 4, 4, 4096, 4096, 128, seed=11)
    p8, out8, sel = fp8_run(q, k, v, precision=precision)
    pb = plan(q, k, PisaSettings(density=0.125, backend="hopper"))
    outb = run(pb, q, k, v, selection=sel)
    print(f"[{precision} vs bf16 hopper] rel-L1 {rel_l1(out8, outb):.2e}")
    assert rel_l1(out8, outb) < F64_TOL


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_pisa_attention_and_bshd(precision):
    q, k, v = qkv(1, 4, 4, 1024, 1024, 128, seed=13)
    out = pisa_attention(q, k, v, precision=precision)
    o2 = pisa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd", precision=precision)
    assert torch.isfinite(out).all()
    assert rel_l1(o2.transpose(1, 2), out) < 1e-6


@pytest.mark.parametrize("precision", LOWP)
@pytest.mark.parametrize("kw,match", [
    (dict(mode="first"), "precision"),
    (dict(backend="triton"), "precision"),
])
def test_lowp_clear_errors(kw, match, precision):
    q, k, v = qkv(1, 2, 2, 256, 256, 128, seed=1)
    with pytest.raises(ValueError, match=match):
        pisa_attention(q, k, v, precision=precision, **kw)


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_head_dim_error(precision):
    q = torch.randn(1, 2, 256, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"precision='{precision}'.*head dim 96"):
        pisa_attention(q, q, q, precision=precision)


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_graph_capture_and_compile(precision):
    q, k, v = qkv(1, 4, 4, 2048, 2048, 128, seed=17)
    s = PisaSettings(precision=precision)
    p = plan(q, k, s)
    want = run(p, q, k, v)
    g = torch.cuda.CUDAGraph()
    out = torch.empty_like(want)
    run(p, q, k, v, out=out)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        run(p, q, k, v, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    f = torch.compile(lambda a, b_, c: pisa_attention(a, b_, c, settings=s), fullgraph=True)
    assert torch.equal(f(q, k, v), want)



PIPELINE_CASES = ["B1-H4-L2048-D128-hybrid", "B1-H4-L1000-D128-hybrid-ragged", "B1-H4-Lq960-Lk1379-D64-hybrid",
                  "B1-H4-L2048-D128-drop"]


# fp8 on every case; the INT8 variants (the same loop with other operand types) on the ragged ones
@pytest.mark.parametrize("sel_kind", ["topk", "uneven"])
@pytest.mark.parametrize("precision,name", [("fp8", n) for n in PIPELINE_CASES]
                         + [(p, n) for p in LOWP_SCHEDULED[1:] for n in PIPELINE_CASES[1:3]])
def test_lowp_pipelined_loop_matches_sequential(name, sel_kind, precision, monkeypatch):
    """The pipelined exact loop against the sequential one on the same selection (they sum the
    same float32 terms in another order: (acc + PV)·r vs acc·r + PV), and against the quantised
    reference. ``uneven``: even query blocks own a long run of key blocks, odd ones three, so a
    consumer holds a block while its partner runs through many entries."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.selection import Selection

    b, h, hk, lq, lk, d, mode = CASES[name]
    q, k, v = dit(b, h, hk, lq, lk, d, seed=5)
    density = 0.5 if sel_kind == "uneven" else 0.125
    p = plan(q, k, PisaSettings(density=density, mode=mode, precision=precision, backend="hopper"))
    if sel_kind == "uneven":
        # even blocks: the plan's width of blocks from 0; odd ones: block 0 (shared) and the last two
        nq, nk = -(-lq // 64), p.n_kv_blocks
        mask = torch.zeros(b, h, nq, nk, dtype=torch.bool, device="cuda")
        mask[:, :, 0::2, : p.width] = True
        mask[:, :, 1::2, nk - 2:] = True
        mask[:, :, 1::2, 0] = True
        sel = Selection.from_mask(mask, p.width)
    else:
        _, sel = run(p, q, k, v, return_selection=True)
    outs = {}
    for pipe in (False, True):
        monkeypatch.setattr(gfp8, "PIPELINE", pipe)
        outs[pipe] = run(p, q, k, v, selection=sel).clone()
        torch.cuda.synchronize()
        assert torch.isfinite(outs[pipe]).all()
    oq, _ = references(q, k, v, p, sel, precision)
    e_pipe, e_q = rel_l1(outs[True], outs[False]), rel_l1(outs[True], oq)
    print(f"[{precision}-{name}-{sel_kind}] pipelined vs sequential {e_pipe:.2e}, vs quantised reference {e_q:.2e}")
    assert e_pipe < 1e-3
    assert e_q < QREF_TOL


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("precision", LOWP_SCHEDULED)
@pytest.mark.parametrize("name", ["B1-H4-L1000-D128-hybrid-ragged", "B1-H4-L2048-D128-drop"])
def test_lowp_pv_accumulate_matches_from_zero(name, precision, pipelined):
    """Either exact loop's two P·V schedules (into the accumulator, or from zero and added) on
    the same selection: the same float32 terms summed in another order."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.triton.quantize import quantize

    b, h, hk, lq, lk, d, mode = CASES[name]
    q, k, v = dit(b, h, hk, lq, lk, d, seed=9)
    p, out, sel = fp8_run(q, k, v, mode, precision=precision)
    hop = get_backend("hopper")
    st = hop.prepare(q, k, v, 64)
    qz = quantize(k, v, st.kbar, st.kscale, 64, precision=precision)
    vv = v if quant.PRODUCT_FORMATS[precision][1] == "input" else None
    outs = [gfp8.attention(q, qz, *st.tail(), *sel, mode=mode, scale=p.scale, block_size=64, lk=lk, v=vv,
                           alpha=p.alpha, pv_accumulate=acc, pipeline=pipelined)[0] for acc in (False, True)]
    torch.cuda.synchronize()
    oq, _ = references(q, k, v, p, sel, precision)
    print(f"[{precision}-{name}-{'pipelined' if pipelined else 'sequential'}] accumulate vs from zero {rel_l1(outs[1], outs[0]):.2e}, "
          f"vs quantised reference {rel_l1(outs[1], oq):.2e}")
    assert rel_l1(outs[1], outs[0]) < 1e-3
    assert rel_l1(outs[1], oq) < QREF_TOL and rel_l1(outs[0], oq) < QREF_TOL


def test_int8_pv_refuses_the_other_schedules():
    """INT8 P·V sums each block in int32 from zero: the pipelined loop and accumulating in the
    wgmma are refused by name, not run in another way."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.triton.quantize import quantize

    q, k, v = dit(1, 2, 2, 512, 512, 128, seed=3)
    p, _, sel = fp8_run(q, k, v, precision="int8-int8")
    st = get_backend("hopper").prepare(q, k, v, 64)
    qz = quantize(k, v, st.kbar, st.kscale, 64, precision="int8-int8")
    for kw in (dict(pipeline=True), dict(pv_accumulate=True)):
        with pytest.raises(ValueError, match="pipeline / pv_accumulate"):
            gfp8.attention(q, qz, *st.tail(), *sel, mode="hybrid", scale=p.scale, block_size=64, lk=512, **kw)


def _lopsided_selection(p, lq, kind):
    """A selection where the pair's two consumers own very different parts of the union stream:
    ``uneven``: even query blocks the plan's width of blocks from 0, odd ones block 0 and the last
    two; ``lopsided``: odd ones block 0 alone (they own nothing after the first union entry)."""
    from pisa_attn.ops.selection import Selection

    nq, nk = -(-lq // 64), p.n_kv_blocks
    mask = torch.zeros(p.batch, p.heads, nq, nk, dtype=torch.bool, device="cuda")
    mask[:, :, 0::2, : p.width] = True
    mask[:, :, 1::2, 0] = True
    if kind == "uneven":
        mask[:, :, 1::2, nk - 2:] = True
    return Selection.from_mask(mask, p.width)


# Every precision under the sequential loop, and under the pipelined one where it runs (not INT8
# P·V); ``Lq960``: 15 query blocks, so the last pair's second consumer has no query block and owns
# no entry at all.
@pytest.mark.parametrize("name,sel_kind", [("B1-H4-L1000-D128-hybrid-ragged", "topk"),
                                           ("B1-H4-L1000-D128-hybrid-ragged", "lopsided"),
                                           ("B1-H4-Lq960-Lk1379-D64-hybrid", "uneven"),
                                           ("B1-H4-Lq960-Lk1379-D64-hybrid", "lopsided")])
@pytest.mark.parametrize("precision,pipelined", [(p, False) for p in LOWP] + [(p, True) for p in LOWP_SCHEDULED],
                         ids=[f"{p}-sequential" for p in LOWP] + [f"{p}-pipelined" for p in LOWP_SCHEDULED])
def test_lowp_pingpong_is_bitwise_unscheduled(precision, name, sel_kind, pipelined):
    """The consumers' products in turns change only when independent work is issued: outputs and
    LSE equal the unscheduled kernel's (pairs: turns are a pairs option) bit for bit, and the
    kernel finishes (no lost turn) where one consumer owns few or no entries of the union."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.triton.quantize import quantize

    b, h, hk, lq, lk, d, mode = CASES[name]
    q, k, v = dit(b, h, hk, lq, lk, d, seed=11)
    density = 0.5 if sel_kind != "topk" else 0.125
    p, _, sel = fp8_run(q, k, v, mode, density=density, precision=precision)
    if sel_kind != "topk":
        sel = _lopsided_selection(p, lq, sel_kind)
    st = get_backend("hopper").prepare(q, k, v, 64)
    qz = quantize(k, v, st.kbar, st.kscale, 64, precision=precision)
    vv = v if quant.PRODUCT_FORMATS[precision][1] == "input" else None
    res = [gfp8.attention(q, qz, *st.tail(), *sel, mode=mode, scale=p.scale, block_size=64, lk=lk, v=vv,
                          alpha=p.alpha, pipeline=pipelined, pingpong=pp, query_group=2) for pp in (False, True)]
    torch.cuda.synchronize()
    assert torch.isfinite(res[1][0]).all()
    assert torch.equal(res[1][0], res[0][0]) and torch.equal(res[1][1], res[0][1])


@pytest.mark.parametrize("name,sel_kind", [("B1-H4-L1000-D128-hybrid-ragged", "topk"),
                                           ("B1-H4-Lq960-Lk1379-D64-hybrid", "lopsided")])
@pytest.mark.parametrize("precision", LOWP)
def test_lowp_lookahead_is_bitwise(precision, name, sel_kind):
    """Reading the stream's codes two entries ahead changes when the codes arrive, nothing else:
    outputs and LSE equal the one-ahead kernel's bit for bit (pairs reading the codes from global
    memory, where the lookahead applies)."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.triton.quantize import quantize

    b, h, hk, lq, lk, d, mode = CASES[name]
    q, k, v = dit(b, h, hk, lq, lk, d, seed=13)
    density = 0.5 if sel_kind != "topk" else 0.125
    p, _, sel = fp8_run(q, k, v, mode, density=density, precision=precision)
    if sel_kind != "topk":
        sel = _lopsided_selection(p, lq, sel_kind)
    st = get_backend("hopper").prepare(q, k, v, 64)
    qz = quantize(k, v, st.kbar, st.kscale, 64, precision=precision)
    vv = v if quant.PRODUCT_FORMATS[precision][1] == "input" else None
    res = [gfp8.attention(q, qz, *st.tail(), *sel, mode=mode, scale=p.scale, block_size=64, lk=lk, v=vv,
                          alpha=p.alpha, lookahead=la, query_group=2, slot_meta=False) for la in (1, 2)]
    torch.cuda.synchronize()
    assert torch.isfinite(res[1][0]).all()
    assert torch.equal(res[1][0], res[0][0]) and torch.equal(res[1][1], res[0][1])


@pytest.mark.parametrize("name,nc", [("B1-H4-L2048-D128-hybrid", 2), ("B1-H4-L2048-D128-hybrid", 3),
                                     ("B1-H4-L2048-D128-drop", 3),
                                     ("B1-H4-L1000-D128-hybrid-ragged", 3), ("B1-H4-L2048-D128-drop", 2),
                                     ("B1-H4-Lq960-Lk1379-D64-hybrid", 2)])
@pytest.mark.parametrize("precision", ["fp8", "int8-fp8"])
def test_lowp_slot_meta_is_bitwise(precision, name, nc):
    """Each entry's code and key scale from the copy the loader writes into its slot, or read
    ahead from global memory: the same numbers, so outputs and LSE are equal bit for bit (two
    and three query blocks, with and without a tail, even and ragged key lengths)."""
    res, refs = _kernel_both_ways(precision, CASES[name], nc, 21, "slot_meta")
    assert torch.isfinite(res[1][0]).all() and rel_l1(res[1][0], refs()[0]) < QREF_TOL
    assert torch.equal(res[1][0], res[0][0]) and torch.equal(res[1][1], res[0][1])


def _kernel_both_ways(precision, case, nc, seed, option):
    """The 8-bit-value kernel on a case's DiT-like inputs and top-k selection with ``option`` False,
    then True: the two (out, lse), and a function giving (quantised reference, float64 PISA)."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.triton.quantize import quantize

    b, h, hk, lq, lk, d, mode = case
    q, k, v = dit(b, h, hk, lq, lk, d, seed=seed)
    p, _, sel = fp8_run(q, k, v, mode, precision=precision)
    st = get_backend("hopper").prepare(q, k, v, 64)
    qz = quantize(k, v, st.kbar, st.kscale, 64, precision=precision)
    vv = v if quant.PRODUCT_FORMATS[precision][1] == "input" else None
    res = [gfp8.attention(q, qz, *st.tail(), *sel, mode=mode, scale=p.scale, block_size=64, lk=lk, v=vv,
                          alpha=p.alpha, query_group=nc, kbound=st.kbound, **{option: on}) for on in (False, True)]
    torch.cuda.synchronize()
    return res, lambda: references(q, k, v, p, sel, precision)


@pytest.mark.parametrize("name,nc", [("B1-H4-L2048-D128-hybrid", 2), ("B1-H4-L2048-D128-hybrid", 3),
                                     ("B2-H4-L1536-D128-zeroth", 3), ("B1-H4-L1000-D128-hybrid-ragged", 3),
                                     ("B1-H4-Lq960-Lk1379-D64-hybrid", 2), ("B1-H4-Lq960-Lk1379-D64-hybrid", 3),
                                     ("B1-H8-Hk2-L2048-D128-hybrid-gqa", 3), ("B1-H2-L20480-D128-hybrid", 2),
                                     ("B1-H2-L20480-D128-hybrid", 3)])
@pytest.mark.parametrize("precision", ["fp8", "int8-fp8", "int8"])
def test_lowp_tail_alias_is_bitwise(precision, name, nc):
    """The tail's slots laid over the exact ring's (H̄ through that ring with three query blocks in
    hybrid mode at D = 128; ``int8``: over 16-bit value slots) or in their own: the same products
    in the same order, so outputs and LSE are equal bit for bit. L = 20480 has five centroid
    groups, so the tail ring wraps around (and ``int8`` runs its exact loop under the bound)."""
    case = {**CASES, "B1-H2-L20480-D128-hybrid": (1, 2, 2, 20480, 20480, 128, "hybrid")}[name]
    res, refs = _kernel_both_ways(precision, case, nc, 23, "tail_alias")
    assert torch.isfinite(res[1][0]).all()
    if case[3] <= 4096:
        assert rel_l1(res[1][0], refs()[0]) < QREF_TOL
    assert torch.equal(res[1][0], res[0][0]) and torch.equal(res[1][1], res[0][1])


@pytest.mark.parametrize("mode", ["drop", "hybrid"])
@pytest.mark.parametrize("lq", [2048, 1088], ids=["L2048", "L1088"])  # 1088: the last group of three has two blocks
@pytest.mark.parametrize("precision", LOWP)
def test_lowp_query_groups_and_tail_maximum(precision, lq, mode):
    """Two or three query blocks per CTA, the tail's maximum fixed or online: the same function,
    each against the quantised reference and float64 PISA under one selection."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.triton.quantize import quantize

    q, k, v = dit(1, 4, 4, lq, lq, 128, seed=17)
    p, _, sel = fp8_run(q, k, v, mode, precision=precision)
    oq, o64 = references(q, k, v, p, sel, precision)
    st = get_backend("hopper").prepare(q, k, v, 64)
    qz = quantize(k, v, st.kbar, st.kscale, 64, precision=precision)
    vv = v if quant.PRODUCT_FORMATS[precision][1] == "input" else None
    for nc in (2, 3):
        for tail_max in ("auto", "online"):
            out, lse = gfp8.attention(q, qz, *st.tail(), *sel, mode=mode, scale=p.scale, block_size=64, lk=lq, v=vv,
                                      alpha=p.alpha, query_group=nc, tail_max=tail_max, kbound=st.kbound)
            e_q, e_64 = rel_l1(out, oq), rel_l1(out, o64)
            print(f"[{precision}-L{lq}-{mode}-nc{nc}-{tail_max}] vs quantised reference {e_q:.2e}, "
                  f"vs float64 PISA {e_64:.2e}")
            assert torch.isfinite(out).all() and torch.isfinite(lse).all()
            assert e_q < QREF_TOL and e_64 < F64_TOL
