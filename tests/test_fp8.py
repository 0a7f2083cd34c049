"""The low precisions (``fp8``, ``int8-fp8``, ``int8-int8``, ``int8``) on the CPU: the quantised reference (what is
rounded where), the quantisation kernel under Triton's interpreter, the settings and the errors at
the call (the kernel itself: tests/test_fp8_build.py cross-compiles it, tests/gpu/test_gpu_fp8.py
runs it)."""

from __future__ import annotations

import pytest
import torch

from pisa_attn import PisaSettings, pisa_attention, plan
from pisa_attn.data import dit_qkv
from pisa_attn.ops import quant
from pisa_attn.ops import reference as ref

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_FINITE = E4M3_VALUES[torch.isfinite(E4M3_VALUES)]
LOWP = ["fp8", "int8-fp8", "int8-int8", "int8"]


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


def _lowp(precision, q, k, v, st, mask, mode="hybrid"):
    return quant.lowp_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode=mode, scale=64**-0.5,
                                   block_size=64, precision=precision)


@pytest.mark.parametrize("precision", LOWP)
@pytest.mark.parametrize("mode", ["hybrid", "zeroth", "drop"])
def test_lowp_reference_close_to_float64_pisa(mode, precision):
    q, k, v = _case()
    out, _, mask = ref.pisa_reference(q.double(), k.double(), v.double(), density=0.125, mode=mode)
    st = ref.block_stats(k.float(), v.float(), 64)
    o8, l8 = _lowp(precision, q, k, v, st, mask, mode)
    assert torch.isfinite(o8).all() and torch.isfinite(l8).all()
    assert rel_l1(o8, out) < 2e-2


def test_lowp_reference_is_not_the_unquantised_math():
    """The rounding is really there (a reference that skipped it would pass the bound above), and
    the precisions order as the formats do: int8 Q·Kᵀ (7 bits) beats e4m3 (3 bits); in P·V the
    input dtype beats unsigned 8-bit probability codes, which beat e4m3."""
    q, k, v = _case()
    out, _, mask = ref.pisa_reference(q.double(), k.double(), v.double(), density=0.125)
    st = ref.block_stats(k.float(), v.float(), 64)
    o16, _ = ref.pisa_forward(q.float(), k.float(), v.float(), st, mask, mode="hybrid", scale=64**-0.5,
                              block_size=64)
    err = {p: rel_l1(_lowp(p, q, k, v, st, mask)[0], o16) for p in LOWP}
    assert err["fp8"] > 1e-3 and err["int8"] > 1e-5
    assert err["int8"] < err["int8-int8"] < err["int8-fp8"] < err["fp8"]
    assert err["int8"] < err["fp8"] / 3


@pytest.mark.parametrize("precision", LOWP)
@pytest.mark.parametrize("mag", [10.0, 30.0])
def test_lowp_reference_large_magnitude_is_finite(mag, precision):
    q, k, v = _case(mag=mag)
    out, _, mask = ref.pisa_reference(q.double(), k.double(), v.double(), density=0.125)
    st = ref.block_stats(k.float(), v.float(), 64)
    o8, l8 = _lowp(precision, q, k, v, st, mask)
    assert torch.isfinite(o8).all() and torch.isfinite(l8).all()
    if precision == "int8":  # the scores' error grows with their magnitude, int8's slower than e4m3's
        assert rel_l1(o8, out) < rel_l1(_lowp("fp8", q, k, v, st, mask)[0], out) / 2


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_reference_takes_strided_views(precision):
    """[B, L, H, D] tensors seen as [B, H, L, D] (a length that is a whole number of blocks, so no
    padding copies them): the same result as on contiguous copies."""
    q, k, v = _case(lk=1024)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not ks.is_contiguous()
    st = ref.block_stats(k.float(), v.float(), 64)
    mask = torch.rand(1, 4, 16, 16, generator=torch.Generator().manual_seed(0)) < 0.3
    want = _lowp(precision, q, k, v, st, mask)
    got = _lowp(precision, qs, ks, vs, st, mask)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_lowp_reference_refuses_the_input_precision():
    q, k, v = _case(lk=128)
    st = ref.block_stats(k.float(), v.float(), 64)
    mask = torch.ones(1, 4, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="precision must be a low precision"):
        _lowp("input", q, k, v, st, mask)
    with pytest.raises(ValueError, match="precision must be one of"):
        _lowp("int4", q, k, v, st, mask)


def test_lowp_reference_refuses_mode_first_and_a_misshapen_alpha():
    """'first' has no low-precision math (it returned the zeroth-order output); alpha needs one
    weight per query head, refused by name where it enters."""
    q, k, v = _case(lk=128)
    st = ref.block_stats(k.float(), v.float(), 64)
    mask = torch.ones(1, 4, 2, 2, dtype=torch.bool)
    for mode, match in (("first", "mode='first' has no low-precision math"), ("bogus", "mode")):
        with pytest.raises(ValueError, match=match):
            _lowp("int8", q, k, v, st, mask, mode)
    with pytest.raises(ValueError, match=r"alpha must be a tensor of one weight per query head \(4\)"):
        quant.lowp_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode="hybrid", scale=64**-0.5,
                                block_size=64, precision="int8", alpha=torch.ones(3))


@pytest.mark.parametrize("shape", [(1, 4, 2, 3), (1, 4, 3, 2), (1, 1, 2, 2), (2, 4, 2, 2), (4, 2, 2)],
                         ids=["B1-H4-Nq2-Nk3", "B1-H4-Nq3-Nk2", "B1-H1-Nq2-Nk2", "B2-H4-Nq2-Nk2", "3d"])
def test_lowp_reference_refuses_a_misshapen_selection(shape):
    """The exact-block mask is indexed by q's and k's blocks (B1-H4-Hk2-L128-D64: [1, 4, 2, 2]):
    a mask of more key blocks, more query blocks, fewer heads or another batch is refused by name
    (it was read in part, or broadcast over the heads), as is a mask that is not bool."""
    q, k, v = _case(lk=128)
    st = ref.block_stats(k.float(), v.float(), 64)
    with pytest.raises(ValueError, match="selected must be a bool"):
        _lowp("fp8", q, k, v, st, torch.ones(shape, dtype=torch.bool))
    with pytest.raises(ValueError, match="selected must be a bool"):
        _lowp("fp8", q, k, v, st, torch.ones(1, 4, 2, 2))
    assert torch.isfinite(_lowp("fp8", q, k, v, st, torch.ones(1, 4, 2, 2, dtype=torch.bool))[0]).all()


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_reference_first_order_term_without_tail_weight_is_not_nan(precision):
    """Every block exact and s·q·H̄ past float32: no tail weight, so no first-order term (0 · inf
    gave NaN), as in the float32 reference."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 2, 128, 64, generator=g) * 1e15).bfloat16()
    k, v = ((torch.randn(1, 2, 128, 64, generator=g).sign() * 1e12).bfloat16() for _ in range(2))
    st = ref.block_stats(k.float(), v.float(), 64)
    mask = torch.ones(1, 2, 2, 2, dtype=torch.bool)
    assert torch.isfinite(ref.pisa_forward(q.float(), k.float(), v.float(), st, mask, mode="hybrid",
                                           scale=64**-0.5, block_size=64)[0]).all()
    assert torch.isfinite(_lowp(precision, q, k, v, st, mask)[0]).all()


def test_quantisation_pass_refuses_a_precision_it_has_no_format_for():
    from pisa_attn.ops.triton.quantize import quant_workspace, quantize

    with pytest.raises(ValueError, match="precision must be a low precision"):
        quant_workspace(1, 1, 64, 64, 64, "cpu", precision="bf16")
    k = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="precision must be a low precision"):
        quantize(k, k, k, torch.ones(1, 1), 64, precision="input")


def test_int8_scale_and_rounding():
    amax = torch.tensor([0.0, 1e-30, 1.0, 127.0, 3e4])
    sc, inv = quant.int8_scale(amax)
    assert sc[0] == 0 and inv[0] == 0
    assert torch.equal(sc[1:], amax[1:] / torch.tensor(127.0)) and torch.equal(inv[1:], torch.tensor(127.0) / amax[1:])
    assert inv[3] == 1.0
    x = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5, 0.49999997, 126.6, 200.0, -300.0, 0.0])
    y = quant.to_int8(x, torch.tensor(1.0))
    assert y.dtype == torch.int8
    # half away from zero as trunc(y ± 0.5) in float32 (0.49999997 + 0.5 rounds to 1), clamped to ±127
    assert y.tolist() == [1, -1, 2, 3, -3, 1, 127, 127, -127, 0]


def test_int8_scale_of_tiny_bfloat16_maxima_is_finite():
    """bfloat16 reaches maxima below 127 / float32's max: the scale is taken from 2^-121 there, so
    127 / amax stays finite and the codes keep their proportions (they were all ±127, 0·inf = NaN)."""
    amax = torch.tensor([1e-37, 2.0**-121, 1e-30])
    sc, inv = quant.int8_scale(amax)
    assert torch.isfinite(inv).all() and torch.isfinite(sc).all()
    assert inv[0] == inv[1] == 127.0 * 2.0**121 and inv[2] == 127.0 / amax[2]
    x = torch.tensor([1e-37, 5e-38, 0.0, -2e-38])
    assert quant.to_int8(x, inv[0]).tolist() == [34, 17, 0, -7]  # x / 2^-121 · 127, rounded


@pytest.mark.parametrize("precision", ["int8-int8", "int8"])
def test_lowp_reference_tiny_keys_and_values(precision):
    """bfloat16 keys (and values) around 1e-37, queries around 1e37: finite, within the format's
    error of float64 PISA on the same inputs (it read 1.5-2.1 when 127 / amax overflowed)."""
    q, k, v = _case()
    q, k = (q.float() * 1e37).bfloat16(), (k.float() * 1e-37).bfloat16()
    if precision == "int8-int8":
        v = (v.float() * 1e-37).bfloat16()
    out, _, mask = ref.pisa_reference(q.double(), k.double(), v.double(), density=0.125, mode="drop")
    st = ref.block_stats(k.float(), v.float(), 64)
    o8, l8 = _lowp(precision, q, k, v, st, mask, "drop")
    assert torch.isfinite(o8).all() and torch.isfinite(l8).all()
    assert rel_l1(o8, out) < 2e-2, rel_l1(o8, out)


def test_quantize_v_int8_codes_scales_and_block_sums():
    torch.manual_seed(0)
    v = (torch.randn(2, 3, 200, 64) * 4 - 1).bfloat16()
    v8t, tau = quant.quantize_v(v, 64, "int8")
    assert v8t.dtype == torch.int8 and v8t.shape == (2, 3, 64, 256) and tau.shape == (2, 3, 4, 64)
    assert (v8t[..., 200:] == 0).all()
    vb = torch.nn.functional.pad(v.float(), (0, 0, 0, 56)).view(2, 3, 4, 64, 64)
    assert torch.equal(tau, vb.abs().amax(3) / torch.tensor(127.0))  # one scale per key block and channel
    codes = v8t.view(2, 3, 64, 4, 64).abs().amax(-1)  # [B, Hk, D, Nk]
    assert (codes == 127).all()  # each block's largest entry per channel maps to ±127
    vd = quant.dequantized_v(v8t, tau, 200, 64)
    assert ((vd - v.float()).abs() <= tau.repeat_interleave(64, 2)[:, :, :200] * 0.5001).all()
    cs = quant.value_code_sums(v8t, 64)
    assert cs.dtype == torch.int32 and cs.shape == (2, 3, 4, 64)
    assert torch.equal(cs[:, :, 1], v8t[..., 64:128].to(torch.int32).sum(-1))
    assert torch.equal(cs[:, :, 3], v8t[..., 192:200].to(torch.int32).sum(-1))


def test_int8_probability_codes():
    """INT8 P·V rounds 255·p to the nearest unsigned code (ties to even): 0..255, steps of 1/255
    in p; the same as the kernel's float32 bit pattern of ``p + 1.5·2^23``."""
    p = torch.tensor([0.0, 0.5, 1.49, 1.5, 2.5, 127.5, 254.6, 255.0])
    codes = quant._round_p(p, "int8", torch.bfloat16)
    assert codes.tolist() == [0, 0, 1, 2, 2, 128, 255, 255]
    pr = torch.rand(10000) * 255
    bits = (pr + 12582912.0).view(torch.int32)
    want = quant._round_p(pr, "int8", torch.bfloat16).int()
    assert torch.equal((bits & 0xFF) ^ 0x80, (want - 128) & 0xFF)
    assert torch.equal(bits - 0x4B400000, want)
    assert quant.P_SCALES["int8"] == 255.0 and quant.P_SCALES["e4m3"] == quant.P_SCALE


def test_int8_pv_offset_codes_are_the_reference_product():
    """The Hopper kernel's INT8 P·V algebra on one query block, in exact integer arithmetic: the
    signed codes ``c − 128`` against int8 values plus ``128·Σ v8`` per block (the code sums),
    times the block's value scales and ``exp(b − m)``, are the reference's rounded probabilities
    times its dequantised values; every int32 sum stays below 2^24 (exact in float32)."""
    torch.manual_seed(3)
    v = (torch.randn(1, 1, 256, 64) * 3).bfloat16()
    v8t, tau = quant.quantize_v(v, 64, "int8")
    vcs = quant.value_code_sums(v8t, 64)
    sb = (torch.randn(64, 256) * 4).view(64, 4, 64)  # 64 rows' scores on 4 exact blocks
    b = sb.amax(-1)  # each block's row maximum
    m = b.amax(-1, keepdim=True)
    codes = quant._round_p(quant.P_SCALES["int8"] * torch.exp(sb - b[..., None]), "int8", torch.bfloat16)
    assert codes.min() >= 0 and codes.max() == 255
    v8 = v8t[0, 0].T.to(torch.int64).view(4, 64, 64)  # [block, key, channel]
    acc = torch.zeros(64, 64, dtype=torch.float64)
    for j in range(4):
        i32 = (codes[:, j].to(torch.int64) - 128) @ v8[j] + 128 * vcs[0, 0, j].to(torch.int64)
        assert i32.abs().max() < 2**24
        acc += i32.double() * tau[0, 0, j].double() * torch.exp(b[:, j:j + 1] - m).double()
    p8 = (codes.double() / 255 * torch.exp(b - m).double()[..., None]).reshape(64, 256)
    want = p8 @ quant.dequantized_v(v8t.double(), tau.double(), 256, 64)[0, 0].double()
    torch.testing.assert_close(acc / 255, want, rtol=1e-9, atol=1e-9)


def test_int8_pv_online_loop_is_the_reference():
    """The Hopper kernel's exact loop for INT8 P·V, emulated step by step in float64 (base 2, codes
    against each block's row maximum, the running (m, l) and the accumulator rescaled, each block's
    offset-coded int32 product times its value scales and exp2(b − m)), equals the quantised
    reference in drop mode on the same selection."""
    q, k, v = _case(lk=512, hk=4)
    q, k, v = q[:, :, :128], k, v
    st = ref.block_stats(k.float(), v.float(), 64)
    mask = torch.zeros(1, 4, 2, 8, dtype=torch.bool)
    mask[:, :, 0, [0, 3, 6]] = True
    mask[:, :, 1, [1, 2, 7]] = True
    want, _ = _lowp("int8-int8", q, k, v, st, mask, mode="drop")
    mu = st.kmean.float().mean(2)
    k8, sig = quant.quantize_k(k, mu, 64, "int8")
    v8t, tau = quant.quantize_v(v, 64, "int8")
    vcs = quant.value_code_sums(v8t, 64).long()
    s2 = 64**-0.5 * 1.4426950408889634  # the kernel's scores are in base 2
    out = torch.empty(1, 4, 128, 64, dtype=torch.float64)
    for h in range(4):
        for qb in range(2):
            qr = q[0, h, qb * 64:(qb + 1) * 64].float()
            q8, rho = quant.quantize_rows(qr, "int8")
            q_mu = (qr.double() @ mu[0, h].double()) * s2
            m = torch.full((64,), float("-inf"), dtype=torch.float64)
            l = torch.zeros(64, dtype=torch.float64)
            acc = torch.zeros(64, 64, dtype=torch.float64)
            for j in mask[0, h, qb].nonzero().flatten().tolist():
                raw = (q8.long() @ k8[0, h, j * 64:(j + 1) * 64].long().T).double()
                a = rho.double() * sig[0, h, j].double() * s2
                b = raw.amax(1) * a + q_mu
                m_new = torch.maximum(m, b)
                rescale, f = torch.exp2(m - m_new), torch.exp2(b - m_new)
                p = torch.exp2(raw * a[:, None] + (q_mu - b + 7.994353436858858)[:, None])  # 255·exp2(S − b)
                l = l * rescale + p.sum(1) * f
                c = torch.round(p).long() - 128
                i32 = c @ v8t[0, h, :, j * 64:(j + 1) * 64].long().T + 128 * vcs[0, h, j]
                acc = acc * rescale[:, None] + i32.double() * tau[0, h, j].double() * f[:, None]
                m = m_new
            out[0, h, qb * 64:(qb + 1) * 64] = acc / l[:, None]
    assert rel_l1(out, want) < 1e-5


def test_quantize_k_int8_codes_and_scales():
    torch.manual_seed(0)
    k = (torch.randn(2, 3, 200, 64) * 5 + 2).bfloat16()
    mu = k.float().mean(2)
    k8, sig = quant.quantize_k(k, mu, 64, "int8")
    assert k8.dtype == torch.int8 and k8.shape == (2, 3, 256, 64) and sig.shape == (2, 3, 4)
    assert (k8[:, :, 200:] == 0).all()
    kc = torch.nn.functional.pad(k.float() - mu[:, :, None], (0, 0, 0, 56)).view(2, 3, 4, -1)
    assert torch.equal(sig, kc.abs().amax(-1) / torch.tensor(127.0))
    # each block's largest entry maps to ±127; every entry within half a step
    assert (k8.view(2, 3, 4, -1).abs().amax(-1) == 127).all()
    kd = quant.dequantized_k(k8, sig, 200, 64)
    step = sig.repeat_interleave(64, 2)[:, :, :200, None]
    assert ((kd - (k.float() - mu[:, :, None])).abs() <= step * 0.5001).all()
    with pytest.raises(ValueError, match="fmt must be"):
        quant.quantize_k(k, mu, 64, "int4")


@pytest.mark.parametrize("precision", LOWP)
def test_lowp_reference_tail_maximum_row(precision):
    """A row whose largest score is a tail centroid: no NaN, close to float64 PISA."""
    q, k, v = _case(lk=1024, hk=4)
    k = k.clone()
    k[:, :, 512:576] = (q[:, :, :64].float().mean(2, keepdim=True) * 8).bfloat16()
    st = ref.block_stats(k.float(), v.float(), 64)
    mask = torch.zeros(1, 4, 16, 16, dtype=torch.bool)
    mask[..., 0] = True  # only block 0 exact: block 8 (the maximum) is in the tail
    out, _ = ref.pisa_forward(q.double(), k.double(), v.double(), ref.block_stats(k.double(), v.double(), 64), mask,
                              mode="hybrid", scale=64**-0.5, block_size=64)
    o8, l8 = _lowp(precision, q, k, v, st, mask)
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


@pytest.mark.parametrize("precision", ["int8-fp8", "int8-int8", "int8"])
def test_quantize_kernel_int8_interpreted(monkeypatch, precision):
    """The int8 keys (and int8 values with their block code sums) of the Triton pass bit for bit
    (ragged Lk, 30x magnitude); no value copy for P·V in the input dtype."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.triton.quantize import quantize

    torch.manual_seed(2)
    k = (torch.randn(1, 2, 200, 64) * 90 + 30).bfloat16()
    v = torch.randn(1, 2, 200, 64).bfloat16()
    kbar = (k.float().view(1, 2, -1, 8, 64).mean(3)[:, :, :4] / 64).half()
    kscale = torch.tensor([[64.0, 64.0]])
    qz = quantize(k, v, kbar, kscale, 64, precision=precision)
    mu = quant.head_key_mean(kbar, kscale)
    assert torch.equal(qz.mu, mu)
    k8, sig = quant.quantize_k(k, mu, 64, "int8")
    assert qz.k8.dtype == torch.int8
    assert torch.equal(qz.sigma, sig) and torch.equal(qz.k8, k8)
    if precision == "int8":
        # the exact loop's bound: max |k − μ| per channel (rows past Lk are not keys)
        assert torch.equal(qz.kcmax.view(torch.float32), quant.smoothed_key_maxima(k, mu))
    else:
        assert qz.kcmax.numel() == 0
    if precision == "int8":
        assert qz.v8t.numel() == 0 and qz.tau.numel() == 0 and qz.vcs.numel() == 0
    elif precision == "int8-int8":
        v8t, tau = quant.quantize_v(v, 64, "int8")
        assert qz.v8t.dtype == torch.int8
        assert torch.equal(qz.tau, tau) and torch.equal(qz.v8t, v8t)
        assert torch.equal(qz.vcs, quant.value_code_sums(v8t, 64))
    else:
        v8t, tau = quant.quantize_v(v, 64)
        assert torch.equal(qz.tau, tau)
        assert (qz.v8t.float() == v8t.float()).float().mean() > 0.9
        assert qz.vcs.numel() == 0
    with pytest.raises(ValueError, match="another precision"):
        quantize(k, v, kbar, kscale, 64, ws=qz, precision="fp8")


@pytest.mark.parametrize(("precision", "with_hdev"), [("fp8", True), ("int8-int8", False), ("int8", True)])
def test_prepare_writes_the_quantised_copies_interpreted(monkeypatch, precision, with_hdev):
    """``prepare(quant=)`` writes the standalone pass's copies (the ``|v|`` maximum from its own
    read of V; bit for bit here: both paths round through the interpreter's casts), keeps the
    statistics, and a shard's statistics drop them (quantised against the whole head's μ)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.triton.prepare import prepare, stats_workspace
    from pisa_attn.ops.triton.quantize import quantize

    torch.manual_seed(4)
    q = torch.randn(1, 2, 200, 64).bfloat16()
    k = (torch.randn(1, 2, 200, 64) * 3 + 1).bfloat16()
    v = (torch.randn(1, 2, 200, 64) * 2).bfloat16()
    st = prepare(q, k, v, 64, with_hdev=with_hdev, quant=precision)
    plain = prepare(q, k, v, 64, with_hdev=with_hdev)
    qz = quantize(k, v, plain.kbar, plain.kscale, 64, precision=precision)
    for f in ("mu", "k8", "sigma", "v8t", "tau", "vcs", "kcmax"):
        a, b = getattr(st.quant, f), getattr(qz, f)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == quant.E4M3 else a,
                                                  b.view(torch.uint8) if b.dtype == quant.E4M3 else b), f
    assert torch.equal(st.kbar, plain.kbar) and torch.equal(st.hbar, plain.hbar)
    if with_hdev:
        assert torch.equal(st.hdev, plain.hdev)
    assert st.blocks(0, 2).quant is None
    copies = st.quant
    assert st.for_attend().quant is copies  # attend reads them
    with pytest.raises(ValueError, match="quant must be"):
        prepare(q, k, v, 64, quant="bf16")
    ws = stats_workspace(q.shape, k.shape, q.dtype, "cpu", block_size=64)
    with pytest.raises(ValueError, match="ws: a stats_workspace"):
        prepare(q, k, v, 64, quant=precision, ws=ws)
    ws = stats_workspace(q.shape, k.shape, q.dtype, "cpu", block_size=64, quant="int8")
    with pytest.raises(ValueError, match="ws.quant: a quant_workspace"):
        prepare(q, k, v, 64, quant="fp8", ws=ws)


@pytest.mark.parametrize("precision", LOWP)
def test_precision_setting(precision):
    assert PisaSettings().precision == "input"
    assert PisaSettings(precision=precision).precision == precision
    with pytest.raises(ValueError, match="precision must be one of"):
        PisaSettings(precision="bf16")
    with pytest.raises(ValueError, match=f"precision='{precision}' runs on the hopper backend only"):
        PisaSettings(precision=precision, backend="triton")


@pytest.mark.parametrize("precision", LOWP)
def test_precision_lowp_refused_off_hopper(precision):
    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"precision='{precision}'"):
        pisa_attention(q, q, q, precision=precision)
    with pytest.raises(ValueError, match=f"precision='{precision}'"):
        plan(q, q, PisaSettings(precision=precision))
    with pytest.raises(ValueError, match="precision"):
        pisa_attention(q, q, q, precision="fp16")


@pytest.mark.parametrize("precision", LOWP)
def test_precision_lowp_refuses_mode_first_without_pointing_at_the_reference(precision):
    """mode='first' has no low-precision kernel: the error says so (the input kernels' reason read
    "so it runs on the PyTorch reference", which a low precision never does)."""
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    for call in (lambda: pisa_attention(q, q, q, precision=precision, mode="first"),
                 lambda: plan(q, q, PisaSettings(precision=precision, mode="first"))):
        with pytest.raises(ValueError, match=f"precision='{precision}'.*mode='first' has no low-precision kernel") as e:
            call()
        assert "reference" not in str(e.value)


def test_quantisation_pass_checks_its_inputs_against_k(monkeypatch):
    """The standalone pass indexes v, kbar and kscale by k's shape: another shape is refused by name
    (the kernels read past them); a strided view of the centroids or their scales gives the mean of
    those centroids (the kernel read the view's storage as contiguous); a workspace that is not
    one is a TypeError naming it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.triton.quantize import checked, quantize

    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 130, 64, generator=g).bfloat16()
    v = torch.randn(2, 2, 130, 64, generator=g).bfloat16()
    kbar = torch.randn(2, 2, 3, 64, generator=g).half()
    kscale = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    for bad, match in (((v[:, :, :64], kbar, kscale), "v must have shape"),
                       ((v, kbar[:1], kscale), "kbar must have shape"),
                       ((v, kbar[:, :, :2], kscale), "kbar must have shape"),
                       ((v, kbar, kscale[:, :1]), "kscale must have shape")):
        with pytest.raises(ValueError, match=match):
            quantize(k, *bad, 64, precision="int8")
    wide = torch.randn(2, 2, 6, 64, generator=g).half()
    kst = kscale.t().contiguous().t()  # [B, Hk] with transposed strides
    assert not wide[:, :, :3].is_contiguous() and not kst.is_contiguous()
    qz = quantize(k, v, wide[:, :, :3], kst, 64, precision="int8")
    assert torch.equal(qz.mu, quant.head_key_mean(wide[:, :, :3], kst))
    assert torch.equal(qz.k8, quant.quantize_k(k, qz.mu, 64, "int8")[0])
    with pytest.raises(TypeError, match="ws must be a quant_workspace"):
        checked(object(), k, 64, "int8")


@pytest.mark.parametrize("precision", LOWP)
def test_precision_lowp_refused_by_the_ring(precision):
    """Sharded keys merge float32 partial outputs, which the low-precision kernel does not write."""
    from pisa_attn.parallel import ring_pisa_attention

    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported by ring_pisa_attention"):
        ring_pisa_attention(q, q, q, group=None, settings=PisaSettings(precision=precision))


def test_lowp_kernel_query_group_and_tail_options_are_checked():
    """The low-precision kernel's own options are refused before anything runs: a query group
    other than 2 or 3, three with a schedule only pairs have, an unknown tail option; the default
    query group per precision and mode (a ragged key length: three for ``fp8`` and ``int8-fp8``,
    else pairs)."""
    pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")
    from types import SimpleNamespace

    from pisa_attn.ops.hopper import fp8 as gfp8

    q = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)
    qz = SimpleNamespace(k8=torch.zeros(1, 2, 128, 64, dtype=torch.int8), v8t=torch.zeros(0, dtype=torch.int8))
    kbar = torch.zeros(1, 2, 2, 64, dtype=torch.float16)
    kw = dict(mode="hybrid", scale=0.125, block_size=64, lk=128, v=q)
    none = (None,) * 7  # kscale, vbar, hbar, hscale, idx, cnt, bits
    with pytest.raises(ValueError, match="query_group"):
        gfp8.attention(q, qz, kbar, *none, query_group=4, **kw)
    for opt in (dict(pipeline=True), dict(pingpong=True)):
        with pytest.raises(ValueError, match="query_group=3"):
            gfp8.attention(q, qz, kbar, *none, query_group=3, **opt, **kw)
    with pytest.raises(ValueError, match="tail_max"):
        gfp8.attention(q, qz, kbar, *none, tail_max="fast", **kw)
    with pytest.raises(ValueError, match="kbound"):
        gfp8.attention(q, qz, kbar, *none, kbound=torch.zeros(1, 2, 32), **kw)
    assert gfp8.precision_of(qz, q) == "int8"
    for prec in LOWP:
        for mode in ("drop", "hybrid"):
            assert gfp8.query_group_for(mode, 128, 64, prec) in (2, 3)
            # a ragged key length: three for the e4m3 P·V formats (their exact loop fits three
            # consumers there), else pairs
            assert gfp8.query_group_for(mode, 129, 64, prec) == (3 if prec in ("fp8", "int8-fp8") else 2)


def test_lowp_kernel_tail_alias_option_is_checked():
    """The tail's slots over the exact ring: only for a mode with a tail (refused by name before
    anything runs), at half as many slots as the exact ring (8-bit values or 16-bit value slots);
    by default where it measured faster (three query blocks), with H̄ through that ring in hybrid
    mode at D = 128."""
    pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")
    from types import SimpleNamespace

    from pisa_attn.ops.hopper import fp8 as gfp8

    q = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)
    kbar = torch.zeros(1, 2, 2, 64, dtype=torch.float16)
    none = (None,) * 7  # kscale, vbar, hbar, hscale, idx, cnt, bits
    kw = dict(scale=0.125, block_size=64, lk=128, tail_alias=True)
    v16 = SimpleNamespace(k8=torch.zeros(1, 2, 128, 64, dtype=torch.int8), v8t=torch.zeros(0, dtype=torch.int8))
    with pytest.raises(ValueError, match="tail_alias"):
        gfp8.attention(q, v16, kbar, *none, mode="drop", v=q, **kw)
    with pytest.raises(ValueError, match="stages"):
        gfp8.attention(q, v16, kbar, *none, mode="hybrid", v=q, stages=(3, 2), **kw)
    v8 = SimpleNamespace(k8=torch.zeros(1, 2, 128, 64, dtype=torch.float8_e4m3fn),
                         v8t=torch.zeros(1, 2, 64, 128, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="tail_alias"):
        gfp8.attention(q, v8, kbar, *none, mode="drop", **kw)
    with pytest.raises(ValueError, match="stages"):
        gfp8.attention(q, v8, kbar, *none, mode="hybrid", stages=(5, 2), **kw)
    for d in gfp8.HEAD_DIMS:
        for nc in (2, 3):
            for pv8 in (True, False):
                st, tst = gfp8.ring_depths(d, True, pv8, nc, alias=True)
                assert st == 2 * tst
    for prec in ("fp8", "int8-fp8", "int8"):
        assert gfp8.tail_alias_for(prec, 3, "hybrid") == ((prec, 3) in gfp8.TAIL_ALIAS)
        assert not gfp8.tail_alias_for(prec, 2, "hybrid")
        assert not gfp8.tail_alias_for(prec, 3, "drop")
    assert gfp8.tail_alias_for("fp8", 3, "hybrid")
    assert gfp8.hbar_in_tail_ring(True, "hybrid", 3, 128, 64)
    assert not gfp8.hbar_in_tail_ring(True, "zeroth", 3, 128, 64) and not gfp8.hbar_in_tail_ring(True, "hybrid", 3, 64, 64)


def test_lowp_exact_max_rule():
    """The exact loop's maximum in the low-precision kernel: fixed at the bound of its scores only
    with P·V in the input dtype (``int8``) in the sequential loop, from 16K keys by default
    (``"auto"``); ``"bound"`` elsewhere is refused by name, as an unknown value is."""
    pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")
    from types import SimpleNamespace

    from pisa_attn.ops.hopper import attention as gattn
    from pisa_attn.ops.hopper import fp8 as gfp8

    q = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)
    int8 = SimpleNamespace(kcmax=torch.zeros(1, 2, 64, dtype=torch.int32))
    e4m3 = SimpleNamespace(kcmax=torch.zeros(0, 2, 64, dtype=torch.int32))
    long, short = gattn.EXACT_MIN_KEYS, gattn.EXACT_MIN_KEYS - 1
    bf16 = gattn.EXACT_SLACK[torch.bfloat16]
    assert gfp8.exact_max_slack(None, int8, q, long, False, False, True) == bf16
    assert gfp8.exact_max_slack(None, int8, q, short, False, False, True) == -1.0
    assert gfp8.exact_max_slack("bound", int8, q, short, False, False, True) == bf16
    assert gfp8.exact_max_slack("online", int8, q, long, False, False, True) == -1.0
    assert gfp8.exact_max_slack(None, int8, q.half(), long, False, False, True) == -1.0  # float16 P: online
    assert gfp8.exact_max_slack(None, e4m3, q, long, True, False, False) == -1.0  # e4m3 P: online
    for args, what in (((e4m3, q, long, True, False, False), "8-bit values"),
                       ((int8, q, long, False, True, True), "pipelined"),
                       ((int8, q, long, False, False, False), "pv_accumulate")):
        with pytest.raises(ValueError, match=f"exact_max='bound'.*{what}"):
            gfp8.exact_max_slack("bound", *args)
    with pytest.raises(ValueError, match="exact_max must be"):
        gfp8.exact_max_slack("fixed", int8, q, long, False, False, True)
    with pytest.raises(ValueError, match="no per-channel maxima"):
        gfp8.exact_max_slack("bound", SimpleNamespace(kcmax=torch.zeros(0)), q, long, False, False, True)
