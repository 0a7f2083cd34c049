"""Host side of the Hopper backend on the CPU: what the stage functions check before a Gluon
kernel is launched (the kernels themselves are stubbed: they need an sm_90 GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

from pisa_attn.ops.selection import Selection  # noqa: E402


def _kernel_reached(*args, **kwargs):
    raise AssertionError("the kernel was launched")


def _inputs(b, h, hk, lq, lk, d=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, lq, d, generator=g).bfloat16()
    k = torch.randn(b, hk, lk, d, generator=g).bfloat16()
    v = torch.randn(b, hk, lk, d, generator=g).bfloat16()
    return q, k, v


def _selection(b, h, nq, nk, w=1):
    idx = torch.zeros(b, h, nq, w, dtype=torch.int32)
    cnt = torch.ones(b, h, nq, dtype=torch.int32)
    bits = torch.zeros(b, h, nq, -(-nk // 32), dtype=torch.int32)
    bits[..., 0] = 1
    return Selection(idx, cnt, bits)


@pytest.mark.parametrize("precision", ["fp8", "int8"])
@pytest.mark.parametrize(("b", "h", "hk", "lq", "lk", "bad"), [
    (1, 2, 2, 128, 128, "rows"),    # B1-H2-L128: a selection of one query block too few
    (2, 3, 1, 100, 70, "heads"),    # B2-H3-Hk1-Lq100-Lk70: a selection of another head count
    (1, 2, 1, 130, 2200, "words"),  # B1-H2-Hk1-Lk2200: 35 key blocks, a selection of one bitmask word
], ids=["B1-H2-L128-D64-rows", "B2-H3-Hk1-Lq100-Lk70-D64-heads", "B1-H2-Hk1-Lq130-Lk2200-D64-words"])
def test_lowp_attend_checks_the_selection(monkeypatch, precision, b, h, hk, lq, lk, bad):
    """The low-precision attend indexes the selection by q's and k's block shapes, as the input
    precision's does: a selection of other shapes is a ValueError naming it before the kernel
    (which would read past it) is launched."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.hopper import op as hop
    from pisa_attn.ops.triton.prepare import prepare

    q, k, v = _inputs(b, h, hk, lq, lk)
    nq, nk = -(-lq // 64), -(-lk // 64)
    stats = prepare(q, k, v, 64, quant=precision)
    monkeypatch.setattr(gfp8, "attention", _kernel_reached)
    sel = {"rows": _selection(b, h, nq - 1, nk), "heads": _selection(b, h + 1, nq, nk),
           "words": _selection(b, h, nq, 32)}[bad]
    with pytest.raises(ValueError, match="selection"):
        hop.attend_lowp(q, k, v, stats, sel, mode="hybrid", scale=0.125, block_size=64, precision=precision)
    with pytest.raises(AssertionError, match="kernel was launched"):  # the fitting selection gets there
        hop.attend_lowp(q, k, v, stats, _selection(b, h, nq, nk), mode="hybrid", scale=0.125, block_size=64,
                        precision=precision)


@pytest.mark.parametrize(("b", "h", "hk", "lq", "lk"), [(1, 2, 2, 128, 128), (2, 3, 1, 100, 70)],
                         ids=["B1-H2-L128-D64", "B2-H3-Hk1-Lq100-Lk70-D64"])
def test_attend_output_buffer_of_another_dtype(monkeypatch, b, h, hk, lq, lk):
    """The pair kernels store the output tile in q's dtype through TMA: a float32 ``out`` buffer
    (a partial, as ``out_dtype=torch.float32`` asks for) runs the Triton kernel (the same function)
    at the input precision, and is a ValueError naming ``out`` in low precision (no other kernel)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.hopper import attention as gattn
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.hopper import op as hop
    from pisa_attn.ops.triton.prepare import prepare

    q, k, v = _inputs(b, h, hk, lq, lk)
    nq, nk = -(-lq // 64), -(-lk // 64)
    sel = _selection(b, h, nq, nk)
    kw = dict(mode="hybrid", scale=0.125, block_size=64)
    monkeypatch.setattr(gattn, "attention", _kernel_reached)
    monkeypatch.setattr(gfp8, "attention", _kernel_reached)
    calls = []
    monkeypatch.setattr(hop._top, "attend", lambda *a, **kw_: calls.append(kw_["out"]) or (kw_["out"], None))
    out = torch.empty(b, h, lq, 64)
    hop.attend(q, k, v, prepare(q, k, v, 64), sel, out=out, **kw)
    assert len(calls) == 1 and calls[0] is out
    with pytest.raises(AssertionError, match="kernel was launched"):  # q's dtype: the pair kernel
        hop.attend(q, k, v, prepare(q, k, v, 64), sel, out=torch.empty_like(q), **kw)
    with pytest.raises(ValueError, match="out"):
        hop.attend_lowp(q, k, v, prepare(q, k, v, 64, quant="fp8"), sel, out=out, precision="fp8", **kw)


class _NoLaunch:
    """The pair kernel's launcher, refusing to launch (the host work before it runs)."""

    def cached(self, key, args):
        return True

    def __call__(self, *args, **kwargs):
        _kernel_reached()


@pytest.mark.parametrize(("opt", "match"), [
    (dict(pair_order="descending"), "pair_order"),
    (dict(pair_group=5), "pair_group"),
    (dict(pair_group=1), "pair_group"),
    (dict(pair_group=3), "pair_group"),
], ids=["pair_order-descending", "pair_group-5", "pair_group-1", "pair_group-3"])
def test_pair_kernel_options_are_checked_by_name(monkeypatch, opt, match):
    """The pair kernel's pairing options: a value it has no stream for is a ValueError naming the
    option (B1-H2-L256-D64: four query blocks, so a group is matched), never a KeyError of the
    stream builder, another argument's name, or a silent adjacency."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.hopper import attention as gattn
    from pisa_attn.ops.triton.prepare import prepare

    q, k, v = _inputs(1, 2, 2, 256, 256)
    st = prepare(q, k, v, 64)
    sel = _selection(1, 2, 4, 4)
    monkeypatch.setattr(gattn, "_launch", _NoLaunch())
    kw = dict(mode="hybrid", scale=0.125, block_size=64, n_select=1, kbound=st.kbound)
    with pytest.raises(ValueError, match=match):
        gattn.attention(q, k, v, *st.tail(), *sel, **opt, **kw)
    with pytest.raises(AssertionError, match="kernel was launched"):  # the defaults get there
        gattn.attention(q, k, v, *st.tail(), *sel, pair_group=4, pair_order="ascending", **kw)


@pytest.mark.parametrize("qk", [torch.float8_e4m3fn, torch.int8], ids=["k8-e4m3", "k8-int8"])
def test_lowp_kernel_names_values_given_beside_8bit_copies(qk):
    """Values in the input dtype passed beside quantised keys that hold 8-bit values too (B1-H2-L128-D64):
    a ValueError naming ``v``, not a StopIteration from looking up a precision of e4m3 scores with
    16-bit values (which none is)."""
    from types import SimpleNamespace

    from pisa_attn.ops.hopper import fp8 as gfp8

    q = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)
    qz = SimpleNamespace(k8=torch.zeros(1, 2, 128, 64, dtype=qk),
                         v8t=torch.zeros(1, 2, 64, 128, dtype=torch.float8_e4m3fn))
    kbar = torch.zeros(1, 2, 2, 64, dtype=torch.float16)
    none = (None,) * 7  # kscale, vbar, hbar, hscale, idx, cnt, bits
    with pytest.raises(ValueError, match="v: pass the values exactly when"):
        gfp8.attention(q, qz, kbar, *none, mode="hybrid", scale=0.125, block_size=64, lk=128, v=q)


@pytest.mark.parametrize("precision", ["fp8", "int8"])
@pytest.mark.parametrize("bad", ["out", "q", "v"])
def test_lowp_attend_names_the_tensor_tma_cannot_read(monkeypatch, precision, bad):
    """A tensor the low-precision kernel would read or write through TMA with a stride that is not
    a multiple of 16 bytes (B1-H2-L128-D64, a view of rows of 65 elements): the ValueError names
    that tensor (``v`` only where P·V reads it, ``"int8"``)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.hopper import op as hop
    from pisa_attn.ops.triton.prepare import prepare

    q, k, v = _inputs(1, 2, 2, 128, 128)
    stats = prepare(q, k, v, 64, quant=precision)
    monkeypatch.setattr(gfp8, "attention", _kernel_reached)
    odd = torch.zeros(1, 2, 128, 65, dtype=torch.bfloat16)[..., :64]
    args = {"q": q, "k": k, "v": v, "out": None, bad: odd.copy_({"q": q, "v": v, "out": q}[bad])}
    kw = dict(mode="hybrid", scale=0.125, block_size=64, precision=precision, out=args["out"])
    if bad == "v" and precision == "fp8":  # 8-bit values: v itself is not read
        with pytest.raises(AssertionError, match="kernel was launched"):
            hop.attend_lowp(args["q"], k, args["v"], stats, _selection(1, 2, 2, 2), **kw)
        return
    with pytest.raises(ValueError, match=f"TMA: {bad}: a stride is not a multiple of 16 bytes"):
        hop.attend_lowp(args["q"], k, args["v"], stats, _selection(1, 2, 2, 2), **kw)
