"""precision="fp8" on the CPU: the quantised reference (what is rounded where), the quantisation
kernel under Triton's interpreter, the settings and the errors at the call (the kernel itself:
tests/test_fp8_build.py cross-compiles it, tests/gpu/test_gpu_fp8.py runs it)."""

from __future__ import annotations

import pytest
import torch

from pisa_attn import PisaSettings, pisa_attention, plan
from pisa_attn.data import dit_qkv
from pisa_attn.ops import quant
from pisa_attn.ops import reference as ref

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_FINITE = E4M3_VALUES[torch.isfinite(E4M3_VALUES)]


def rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


@pytest.mark.parametrize("x", [1e-30, 3e-8, 0.3, 1.0, 1.5, 2.0, 447.0, 3e4, 1e30])
def test_pow2_scale_puts_the_largest_entry_in_128_256(x):
    s = quant.pow2_scale(torch.tensor([x]))
    assert torch.log2(s).item() == int(torch.log2(s).item())  # a power of two: division is exact
    assert 128 <= x / s.item() < 256


def test_pow2_scale_of_zero_and_subnormal_is_finite():
    s = quant.pow2_scale(torch.tensor([0.0, 1e-45, 1e-39]))
    assert torch.all(s == 2.0**-126)
    assert torch.isfinite(torch.tensor([0.0, 1e-45, 1e-39]) / s).all()


def test_to_e4m3_rounds_to_nearest_and_saturates():
    x = torch.tensor([0.3, 125.18, 500.0, -1e6, 17.0])
    y = quant.to_e4m3(x).float()
    nearest = E4M3_FINITE[(x[:4, None] - E4M3_FINITE[None]).abs().argmin(1)]
    assert torch.equal(y[:2], nearest[:2])
    assert y[2] == 448 and y[3] == -448
    assert y[4] == 16  # a tie (16 and 18) goes to the even mantissa


def test_quantize_kv_shapes_scales_and_padding():
    torch.manual_seed(0)
    k = (torch.randn(2, 3, 200, 64) * 5 + 2).bfloat16()
    v = torch.randn(2, 3, 200, 64).bfloat16()
    mu = k.float().mean(2)
    k8, sig, v8t, tau = quant.quantize_kv(k, v, mu, 64)
    assert k8.shape == (2, 3, 256, 64) and sig.shape == (2, 3, 4) and v8t.shape == (2, 3, 64, 256)
    assert tau.shape == (2, 3, 64)
    assert (k8[:, :, 200:].float() == 0).all() and (v8t[..., 200:].float() == 0).all()
    kd, vd = quant.dequantized_kv(k8, sig, v8t, tau, 200, 64)
    # e4m3 keeps 3 mantissa bits: every entry within 1/16 of itself or one step of the block's scale
    kc = k.float() - mu[:, :, None]
    step = sig.repeat_interleave(64, 2)[:, :, :200, None] * 2.0**-9
    assert ((kd - kc).abs() <= kc.abs() / 16 + step).all()
    assert ((vd - v.float()).abs() <= v.float().abs() / 16 + tau[:, :, None] * 2.0**-9).all()
    assert k8.float().abs().amax() <= 256 and v8t.float().abs().amax() <= 256  # [128, 256) rounded


def _case(mag=1.0, lk=1000, hk=2, h=4, seed=0):
    x = dit_qkv((4, 16, 16), heads=h, head_dim=64, seed=seed)
    q = (x.q[:, :, :lk] * mag).bfloat16()
    k = (x.k[:, :hk, :lk] * mag).bfloat16()
    v = x.v[:, :hk, :lk].bfloat16()
    return q, k, v


@pytest.mark.parametrize("mode", ["hybrid", "zeroth", "drop"])
def test_fp8_reference_close_to_float64_pisa(mode):
    q, k, v = _case()
    out, _, mask = ref.pisa_reference(q.double(), k.double(), v.double(), density=0.125, mode=mode)
    st = ref.block_stats(k.float(), v.float(), 64)
    o8, l8 = quant.fp8_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode=mode, scale=64**-0.5,
                                    block_size=64)
    assert torch.isfinite(o8).all() and torch.isfinite(l8).all()
    assert rel_l1(o8, out) < 2e-2


def test_fp8_reference_is_not_the_unquantised_math():
    """The rounding is really there (a reference that skipped it would pass the bound above)."""
    q, k, v = _case()
    out, _, mask = ref.pisa_reference(q.double(), k.double(), v.double(), density=0.125)
    st = ref.block_stats(k.float(), v.float(), 64)
    o8, _ = quant.fp8_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode="hybrid", scale=64**-0.5,
                                   block_size=64)
    assert rel_l1(o8, out) > 1e-3


@pytest.mark.parametrize("mag", [10.0, 30.0])
def test_fp8_reference_large_magnitude_is_finite(mag):
    q, k, v = _case(mag=mag)
    out, _, mask = ref.pisa_reference(q.double(), k.double(), v.double(), density=0.125)
    st = ref.block_stats(k.float(), v.float(), 64)
    o8, l8 = quant.fp8_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode="hybrid", scale=64**-0.5,
                                    block_size=64)
    assert torch.isfinite(o8).all() and torch.isfinite(l8).all()


def test_fp8_reference_tail_maximum_row():
    """A row whose largest score is a tail centroid: no NaN, close to float64 PISA."""
    q, k, v = _case(lk=1024, hk=4)
    k = k.clone()
    k[:, :, 512:576] = (q[:, :, :64].float().mean(2, keepdim=True) * 8).bfloat16()
    st = ref.block_stats(k.float(), v.float(), 64)
    mask = torch.zeros(1, 4, 16, 16, dtype=torch.bool)
    mask[..., 0] = True  # only block 0 exact: block 8 (the maximum) is in the tail
    out, _ = ref.pisa_forward(q.double(), k.double(), v.double(), ref.block_stats(k.double(), v.double(), 64), mask,
                              mode="hybrid", scale=64**-0.5, block_size=64)
    o8, l8 = quant.fp8_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode="hybrid", scale=64**-0.5,
                                    block_size=64)
    assert torch.isfinite(o8).all() and torch.isfinite(l8).all()
    assert rel_l1(o8, out) < 2e-2


def test_quantize_kernel_interpreted(monkeypatch):
    """The Triton quantisation pass: scales and μ exactly, e4m3 codes up to the interpreter's cast
    (Triton 3.9's interpreter mis-rounds a few e4m3 casts that carry into the next binade; the
    GPU test compares bit for bit)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.triton.quantize import quantize

    torch.manual_seed(1)
    k = (torch.randn(1, 2, 200, 64) * 3 + 1).bfloat16()
    v = torch.randn(1, 2, 200, 64).bfloat16()
    kbar = torch.randn(1, 2, 4, 64).half()
    kscale = torch.tensor([[0.5, 2.0]])
    qz = quantize(k, v, kbar, kscale, 64)
    mu = quant.head_key_mean(kbar, kscale)
    assert torch.equal(qz.mu, mu)
    k8, sig, v8t, tau = quant.quantize_kv(k, v, mu, 64)
    assert torch.equal(qz.sigma, sig) and torch.equal(qz.tau, tau)
    assert (qz.k8.float() == k8.float()).float().mean() > 0.95
    assert (qz.v8t.float() == v8t.float()).float().mean() > 0.9


def test_precision_setting():
    assert PisaSettings().precision == "input"
    assert PisaSettings(precision="fp8").precision == "fp8"
    with pytest.raises(ValueError, match="precision must be one of"):
        PisaSettings(precision="bf16")
    with pytest.raises(ValueError, match="precision='fp8' runs on the hopper backend only"):
        PisaSettings(precision="fp8", backend="triton")


def test_precision_fp8_refused_off_hopper():
    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="precision='fp8'"):
        pisa_attention(q, q, q, precision="fp8")
    with pytest.raises(ValueError, match="precision='fp8'"):
        plan(q, q, PisaSettings(precision="fp8"))
    with pytest.raises(ValueError, match="precision"):
        pisa_attention(q, q, q, precision="fp16")


def test_precision_fp8_refused_by_the_ring():
    """Sharded keys merge float32 partial outputs, which the FP8 kernel does not write."""
    from pisa_attn.parallel import ring_pisa_attention

    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="precision='fp8' is not supported by ring_pisa_attention"):
        ring_pisa_attention(q, q, q, group=None, settings=PisaSettings(precision="fp8"))
