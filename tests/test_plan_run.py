"""plan/run: the same results as pisa_attention, a workspace reused, selections in and out, and
runs whose tensors do not match their plan refused."""

from __future__ import annotations

import os

import pytest
import torch

from pisa_attn import PisaPlan, PisaSettings, pisa_attention, plan, run, spec
from pisa_attn.ops.selection import Selection

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton kernels take fp16/bf16; the reference every float dtype.
CASES = [("reference", torch.float32), ("triton", torch.bfloat16)]
# Shapes stay tiny: on the CPU the Triton kernels run through Triton's (slow) interpreter.


def make_qkv(b, h, hk, lq, lk, d, dtype, layout="bhsd", seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(heads, n):
        shape = (b, heads, n, d) if layout == "bhsd" else (b, n, heads, d)
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    return t(h, lq), t(hk, lk), t(hk, lk)


@pytest.mark.parametrize("backend,dtype", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("mode", ["hybrid", "drop"])
def test_run_equals_pisa_attention_bit_for_bit_B1_H2_Hk1_Lq40_Lk48_D16(backend, dtype, layout, mode):
    q, k, v = make_qkv(1, 2, 1, 40, 48, 16, dtype, layout)
    s = PisaSettings(density=0.3, block_size=16, mode=mode, backend=backend, layout=layout)
    p = plan(q, k, s)
    assert p.backend == backend and p.workspace is not None or backend == "reference"
    want, want_lse = pisa_attention(q, k, v, density=0.3, block_size=16, mode=mode, backend=backend, layout=layout,
                                    return_lse=True)
    for _ in range(2):  # the workspace is reused: a second run gives the same bits
        out, lse = run(p, q, k, v, return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert out.shape == q.shape


@pytest.mark.parametrize("backend,dtype", CASES, ids=[c[0] for c in CASES])
def test_plan_from_shapes_equals_plan_from_tensors(backend, dtype):
    q, k, v = make_qkv(1, 2, 1, 64, 64, 16, dtype)
    s = PisaSettings(density=0.25, block_size=16, backend=backend)
    p = plan(tuple(q.shape), k.shape, s, dtype=dtype, device=DEV)
    assert isinstance(p, PisaPlan) and (p.n_kv_blocks, p.n_select, p.width) == (4, 1, 1)
    assert torch.equal(run(p, q, k, v), run(plan(q, k, s), q, k, v))


@pytest.mark.parametrize("backend,dtype", CASES, ids=[c[0] for c in CASES])
def test_selection_returned_and_passed_in(backend, dtype):
    q, k, v = make_qkv(1, 2, 1, 64, 96, 16, dtype, seed=3)
    p = plan(q, k, PisaSettings(density=0.34, block_size=16, backend=backend))
    out, sel = run(p, q, k, v, return_selection=True)
    assert isinstance(sel, Selection) and sel.idx.shape == (1, 2, 4, p.width)
    assert torch.equal(sel.cnt, torch.full_like(sel.cnt, spec.num_selected(0.34, 6)))
    again, sel2 = run(p, q, k, v, selection=sel, return_selection=True)
    assert torch.equal(again, out) and all(torch.equal(a, b) for a, b in zip(sel, sel2))
    # a different selection (every block exact) changes the output to dense attention
    dense = Selection.from_mask(torch.ones(1, 2, 4, 6, dtype=torch.bool, device=DEV), p.n_kv_blocks)
    got = run(p, q, k, v, selection=dense)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat(1, 2, 1, 1),
                                                           v.float().repeat(1, 2, 1, 1))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got.float() - ref).abs().mean() / ref.abs().mean()).item() < tol


@pytest.mark.parametrize("backend,dtype", CASES, ids=[c[0] for c in CASES])
def test_drop_row_without_exact_blocks_is_zero(backend, dtype):
    """Keep-or-drop under a selection with an empty row: out 0, lse -inf there (no 0/0)."""
    q, k, v = make_qkv(1, 1, 1, 64, 64, 16, dtype, seed=7)
    p = plan(q, k, PisaSettings(density=0.5, block_size=32, mode="drop", backend=backend))
    mask = torch.zeros(1, 1, 2, 2, dtype=torch.bool, device=DEV)
    mask[0, 0, 0, 0] = True
    out, lse = run(p, q, k, v, selection=Selection.from_mask(mask, p.width), return_lse=True)
    assert torch.isfinite(out).all() and (out[:, :, 32:] == 0).all() and torch.isneginf(lse[:, :, 32:]).all()
    assert torch.isfinite(lse[:, :, :32]).all()


@pytest.mark.parametrize("backend,dtype", CASES, ids=[c[0] for c in CASES])
def test_out_and_lse_buffers_are_written(backend, dtype):
    q, k, v = make_qkv(1, 2, 1, 48, 48, 16, dtype, seed=4)
    p = plan(q, k, PisaSettings(density=0.5, block_size=16, backend=backend))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, 48), float("nan"), device=DEV)
    got, got_lse = run(p, q, k, v, out=out, lse=lse, return_lse=True)
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    want, want_lse = run(p, q, k, v, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("backend,dtype", CASES, ids=[c[0] for c in CASES])
def test_alpha_default_is_the_same_in_run_and_pisa_attention(backend, dtype):
    q, k, v = make_qkv(1, 2, 1, 32, 32, 16, dtype, seed=5)
    p = plan(q, k, PisaSettings(density=0.5, block_size=16, backend=backend))
    default = run(p, q, k, v)
    assert torch.equal(default, pisa_attention(q, k, v, density=0.5, block_size=16, backend=backend))
    assert torch.equal(default, run(p, q, k, v, alpha=spec.DEFAULT_ALPHA))
    per_head = plan(q, k, PisaSettings(density=0.5, block_size=16, backend=backend, alpha=(0.5, 1.0)))
    assert torch.equal(run(per_head, q, k, v), run(p, q, k, v, alpha=torch.tensor([0.5, 1.0])))
    if backend == "reference":
        assert not torch.equal(default, run(p, q, k, v, alpha=1.0))


def _bad_runs():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float32)
    p = plan(q, k, PisaSettings(density=0.25, block_size=16, backend="reference"))
    sel = run(p, q, k, v, return_selection=True)[1]
    return p, q, k, v, sel


BAD_RUNS = [
    ("q-longer", lambda p, q, k, v, s: dict(q=torch.cat([q, q], 2)), ValueError, r"\bq\b has shape"),
    ("k-shorter", lambda p, q, k, v, s: dict(k=k[:, :, :32], v=v[:, :, :32]), ValueError, r"\bk\b has shape"),
    ("v-heads", lambda p, q, k, v, s: dict(v=v[:, :1]), ValueError, r"\bv\b has shape"),
    ("layout", lambda p, q, k, v, s: dict(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2)),
     ValueError, "layout"),
    ("dtype", lambda p, q, k, v, s: dict(q=q.double(), k=k.double(), v=v.double()), TypeError, r"\bq\b has dtype"),
    ("v-dtype", lambda p, q, k, v, s: dict(v=v.half()), TypeError, r"\bv\b has dtype"),
    ("device", lambda p, q, k, v, s: dict(q=q.to("meta")), ValueError, r"\bq\b is on meta"),
    ("not-tensor", lambda p, q, k, v, s: dict(k=k.tolist()), TypeError, r"\bk\b must be a torch.Tensor"),
    ("out-shape", lambda p, q, k, v, s: dict(out=q[:, :, :32]), ValueError, r"\bout\b must be"),
    ("out-dtype", lambda p, q, k, v, s: dict(out=q.double()), ValueError, r"\bout\b must be"),
    ("lse-shape", lambda p, q, k, v, s: dict(lse=torch.empty(1, 2, 63)), ValueError, r"\blse\b must be"),
    # an aliased output is a wrong answer (the stages read k and v after writing), not an in-place one
    ("out-is-q", lambda p, q, k, v, s: dict(out=q), ValueError, r"\bout\b shares memory with q"),
    ("out-is-k", lambda p, q, k, v, s: dict(out=k), ValueError, r"\bout\b shares memory with k"),
    ("lse-in-v", lambda p, q, k, v, s: dict(lse=v.reshape(-1)[:128].view(1, 2, 64)), ValueError,
     r"\blse\b shares memory with v"),
    ("keep-beyond-plan", lambda p, q, k, v, s: dict(keep_blocks=torch.ones(4, dtype=torch.bool)), ValueError,
     "max_keep"),
    ("selection-rows", lambda p, q, k, v, s: dict(selection=Selection(*(x[:, :1] for x in s))), ValueError,
     r"selection\.idx"),
    ("selection-dtype", lambda p, q, k, v, s: dict(selection=Selection(s.idx.long(), s.cnt, s.bits)), ValueError,
     r"selection\.idx"),
    ("selection-tuple", lambda p, q, k, v, s: dict(selection=(1, 2, 3)), TypeError, "selection"),
    ("return-lse-truthy-str", lambda p, q, k, v, s: dict(return_lse="no"), TypeError, "return_lse"),
    ("return-selection-int", lambda p, q, k, v, s: dict(return_selection=1), TypeError, "return_selection"),
    ("out-expanded", lambda p, q, k, v, s: dict(out=torch.empty(1, 1, 64, 32).expand(1, 2, 64, 32)), ValueError,
     r"\bout\b has elements sharing memory"),
    ("out-requires-grad", lambda p, q, k, v, s: dict(out=torch.empty_like(q, requires_grad=True)), ValueError,
     r"\bout\b must not require grad"),
    # contents: the kernels index K/V with idx (the interpreter segfaulted on cnt past the width)
    ("selection-cnt-past-width", lambda p, q, k, v, s: dict(selection=Selection(s.idx, s.cnt.clone().fill_(50), s.bits)),
     ValueError, "one set of key blocks"),
    ("selection-idx-out-of-range", lambda p, q, k, v, s: dict(selection=Selection(s.idx.clone().fill_(10**6), s.cnt,
                                                                                   s.bits)), ValueError, "one set"),
    ("selection-bits-disagree", lambda p, q, k, v, s: dict(selection=Selection(s.idx, s.cnt, torch.zeros_like(s.bits))),
     ValueError, "one set"),
    ("alpha-shape", lambda p, q, k, v, s: dict(alpha=torch.ones(3)), ValueError, "alpha"),
]


@pytest.mark.parametrize("change,exc,pattern", [b[1:] for b in BAD_RUNS], ids=[b[0] for b in BAD_RUNS])
def test_run_refuses_tensors_that_do_not_match_the_plan(change, exc, pattern):
    p, q, k, v, sel = _bad_runs()
    kw = dict(q=q, k=k, v=v)
    kw.update(change(p, q, k, v, sel))
    with pytest.raises(exc, match=pattern):
        run(p, kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


def test_run_refuses_a_non_plan_and_plan_refuses_bad_input():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float32)
    with pytest.raises(TypeError, match="plan"):
        run("plan", q, k, v)
    with pytest.raises(TypeError, match="settings"):
        plan(q, k, dict(density=0.5))
    with pytest.raises(TypeError, match="dtype"):
        plan((1, 2, 64, 32), (1, 2, 64, 32), device="cpu")
    with pytest.raises(ValueError, match=r"\bq\b.*rank 4"):
        plan((1, 2, 64), (1, 2, 64, 32), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="head dim"):
        plan(q, k[..., :16])
    with pytest.raises(ValueError, match="max_keep"):
        plan(q, k, max_keep=-1)


def test_keep_blocks_within_the_planned_width():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float32, seed=6)
    keep = torch.tensor([True, False, False, True])
    p = plan(q, k, PisaSettings(density=0.25, block_size=16, backend="reference"), max_keep=2)
    want = pisa_attention(q, k, v, density=0.25, block_size=16, backend="reference", keep_blocks=keep)
    assert torch.equal(run(p, q, k, v, keep_blocks=keep), want)


def test_alpha_requiring_grad_is_differentiated_on_the_reference():
    """The output is affine in alpha: d(sum out)/d alpha_h is the head's first-order term summed,
    i.e. out(alpha=1) - out(alpha=0) summed over the head."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float64, seed=7)
    a = torch.tensor([0.3, 0.8], dtype=torch.float64, requires_grad=True)
    out = pisa_attention(q, k, v, density=0.25, block_size=16, backend="reference", alpha=a)
    out.sum().backward()
    one = pisa_attention(q, k, v, density=0.25, block_size=16, backend="reference", alpha=1.0)
    zero = pisa_attention(q, k, v, density=0.25, block_size=16, backend="reference", alpha=0.0)
    torch.testing.assert_close(a.grad, (one - zero).sum(dim=(0, 2, 3)), rtol=1e-9, atol=1e-9)
    # float32 input, float32 alpha: flows as well
    a32 = torch.tensor([0.3, 0.8], requires_grad=True)
    pisa_attention(q.float(), k.float(), v.float(), density=0.25, block_size=16, alpha=a32).sum().backward()
    assert a32.grad is not None and torch.isfinite(a32.grad).all()


def test_alpha_requiring_grad_is_refused_by_the_kernels():
    q, k, v = make_qkv(1, 2, 1, 32, 32, 16, torch.bfloat16, seed=8)
    a = torch.tensor([0.3, 0.8], requires_grad=True)
    with pytest.raises(ValueError, match="inference-only"):
        pisa_attention(q, k, v, density=0.25, block_size=16, backend="triton", alpha=a)
    with torch.no_grad():
        pisa_attention(q, k, v, density=0.25, block_size=16, backend="triton", alpha=a)


def test_pisa_attention_takes_a_settings_object():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float32, seed=9)
    s = PisaSettings(density=0.5, block_size=16, mode="zeroth")
    assert torch.equal(pisa_attention(q, k, v, settings=s),
                       pisa_attention(q, k, v, density=0.5, block_size=16, mode="zeroth"))
    with pytest.raises(ValueError, match="not both.*density"):
        pisa_attention(q, k, v, settings=s, density=0.25)
    with pytest.raises(TypeError, match="settings"):
        pisa_attention(q, k, v, settings={"density": 0.5})


class _CountOps:
    """Every aten op a block of code dispatches (a TorchDispatchMode)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


FACTORIES = ("empty", "zeros", "ones", "full", "new_", "rand", "arange", "tensor", "clone", "contiguous", "_to_copy")


@pytest.mark.parametrize("backend", ["triton", "hopper"])
def test_a_planned_run_allocates_only_the_output(backend, monkeypatch):
    """With the kernels' launches stubbed out (their buffers are the workspace's), the host path of
    a planned run and of a repeated pisa_attention call allocates one tensor: the output."""
    from pisa_attn.attention import _make_plan
    from pisa_attn.ops import launch
    from pisa_attn.ops.triton import attention as tattn

    class NoKernel:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    monkeypatch.setattr(launch.Launcher, "__call__", lambda self, *a, **k: None)
    monkeypatch.setattr(tattn, "_attn_kernel", NoKernel())
    q, k, v = (torch.empty(1, 4, 256, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    s = PisaSettings(backend="triton")
    p = plan(q, k, s)
    if backend == "hopper":  # the Hopper backend's host path (its kernel needs sm_90: planned by hand)
        pytest.importorskip("triton.experimental.gluon")
        from pisa_attn.ops.hopper import attention as gattn

        monkeypatch.setattr(gattn, "tma_unsupported_reason", lambda *a: None)
        p = _make_plan(s, q.shape, k.shape, q, k, 0, False)
        object.__setattr__(p, "backend", "hopper")
        from pisa_attn.ops.hopper import op as gop

        object.__setattr__(p, "workspace", gop.workspace(p, q, k))
    run(p, q, k, v)
    with _CountOps() as c:
        run(p, q, k, v)
    allocs = [op for op in c.ops if any(f in op for f in FACTORIES)]
    assert allocs == ["aten.empty.memory_format"], c.ops


def test_run_under_torch_compile_fullgraph_equals_eager():
    """A plan made eagerly and run inside a compiled function (the registered op; no graph break)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    q, k, v = make_qkv(1, 2, 1, 64, 64, 16, torch.float32, seed=10)
    p = plan(q, k, PisaSettings(density=0.25, block_size=16, backend="reference"))
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.empty_like(q)
    fn = torch.compile(lambda q, k, v: run(p, q, k, v, out=out), fullgraph=True, backend=counter)
    got = fn(q, k, v)
    torch.testing.assert_close(got, run(p, q, k, v), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, got)
    assert counter.frame_count == 1



def test_settings_alpha_is_data_one_plan_per_shape():
    """pisa_attention(settings=) with different alphas reuses one cached plan (and workspace)."""
    from pisa_attn import attention

    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, torch.float32, seed=11)
    attention.clear_plans()
    outs = [pisa_attention(q, k, v, settings=PisaSettings(density=0.25, block_size=16, alpha=a))
            for a in (0.5, (0.25, 1.0), 1.0)]
    assert len(attention._PLANS) == 1
    assert torch.equal(outs[1], pisa_attention(q, k, v, density=0.25, block_size=16, alpha=torch.tensor([0.25, 1.0])))
    assert torch.equal(outs[2], pisa_attention(q, k, v, density=0.25, block_size=16, alpha=1.0))
    with pytest.raises(ValueError, match="alpha"):
        pisa_attention(q, k, v, settings=PisaSettings(density=0.25, block_size=16, alpha=(0.1, 0.2, 0.3)))


def test_an_aliased_output_is_refused_after_a_recorded_run():
    # The replayed (bound) path keys its programs by shapes and strides, not pointers: a call that
    # aliases where the recorded one did not still reaches the check.
    p, q, k, v, _ = _bad_runs()
    out = torch.empty_like(q)
    for _ in range(3):
        run(p, q, k, v, out=out)
    with pytest.raises(ValueError, match="shares memory with k"):
        run(p, q, k, v, out=k)



@pytest.mark.parametrize("kw, exc, match", [
    (dict(q=(2, 4, -100, 32), k=(2, 2, 150, 32)), ValueError, "non-negative"),
    (dict(q=(2, 4, 100, 32), k=(2, 2, 150, 32), workspace="no"), TypeError, "workspace"),
], ids=["negative-length", "workspace-str"])
def test_plan_from_shapes_names_its_bad_argument(kw, exc, match):
    q, k = kw.pop("q"), kw.pop("k")
    with pytest.raises(exc, match=match):
        plan(q, k, PisaSettings(backend="reference"), dtype=torch.float32, device="cpu", **kw)


def test_selection_with_keep_blocks_and_compiled_return_selection_are_refused():
    """A given selection lists every exact block, so keep_blocks beside it would be ignored: refused
    by name; a compiled call returns no selection: refused by name, not a TypeError from inside."""
    q, k, v = make_qkv(1, 2, 1, 64, 64, 16, torch.float32, seed=3)
    p = plan(q, k, PisaSettings(density=0.25, block_size=16, backend="reference"), max_keep=4)
    _, sel = run(p, q, k, v, return_selection=True)
    with pytest.raises(ValueError, match="keep_blocks has no effect with selection="):
        run(p, q, k, v, selection=sel, keep_blocks=torch.ones(4, dtype=torch.bool))
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: run(p, q, k, v, return_selection=True), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="return_selection=True is not supported under torch.compile"):
        fn(q, k, v)


def test_plan_device_without_its_index_matches_the_tensors():
    """device="cpu:0" (or "cuda" on a GPU machine) names the device the tensors are on."""
    q, k, _ = make_qkv(1, 2, 1, 64, 64, 16, torch.float32)
    dev = "cuda" if q.is_cuda else "cpu:0"
    assert plan(q, k, PisaSettings(block_size=16, backend="reference"), device=dev).device == q.device
    with pytest.raises(ValueError, match=r"the plan is for torch.float32 on cpu \(q's, or dtype= / device=\)"):
        plan((1, 2, 64, 16), k.cpu().half(), PisaSettings(block_size=16, backend="reference"), dtype=torch.float32,
             device="cpu")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 7, reason="a machine with cuda:7")
def test_plan_for_a_device_that_is_not_there():
    with pytest.raises(ValueError, match="not available"):
        plan((1, 2, 64, 32), (1, 2, 64, 32), PisaSettings(backend="reference"), dtype=torch.float32, device="cuda:7")


def test_a_selection_with_a_repeated_block_is_refused():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float32)
    p = plan(q, k, PisaSettings(density=0.5, block_size=16, backend="reference"))
    _, s = run(p, q, k, v, return_selection=True)
    assert s.idx.shape[-1] >= 2 and (s.cnt == 2).all()
    idx = s.idx.clone()
    idx[..., 1] = idx[..., 0]
    with pytest.raises(ValueError, match="one set of key blocks"):
        run(p, q, k, v, selection=Selection(idx, s.cnt, s.bits))
    assert torch.equal(run(p, q, k, v, selection=s), run(p, q, k, v))  # its own selection passes


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_returned_selections_pass_the_check_with_keep_blocks_and_spare_width(backend):
    # entries past cnt are whatever the kernel left there (Triton: uninitialised): they count for
    # nothing, and a plan's spare keep width leaves many
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    q, k, v = (x.bfloat16() for x in make_qkv(1, 2, 2, 400, 400, 64, torch.float32))  # 7 blocks of 64
    p = plan(q, k, PisaSettings(density=0.15, backend=backend), max_keep=64)
    assert p.width - (p.n_select + 1) >= 4  # width 7 (all blocks), 2 used with the kept one: 5 spare
    keep = torch.zeros(p.n_kv_blocks, dtype=torch.bool)
    keep[0] = True
    want, s = run(p, q, k, v, keep_blocks=keep, return_selection=True)
    assert torch.equal(run(p, q, k, v, selection=s), want)


def test_a_one_value_alpha_is_the_same_in_every_entry_point():
    q, k, v = make_qkv(1, 4, 4, 100, 100, 32, torch.float32)
    s = PisaSettings(alpha=[0.5], backend="reference")
    want = pisa_attention(q, k, v, alpha=0.5, backend="reference")
    assert torch.equal(pisa_attention(q, k, v, settings=s), want)
    assert torch.equal(run(plan(q, k, s), q, k, v), want)
    assert torch.equal(pisa_attention(q, k, v, alpha=torch.tensor([0.5]), backend="reference"), want)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _qkv16(lk=128, seed=0, dtype=torch.float16, lq=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, lq, 16, generator=g).to(dtype),
            *(torch.randn(1, 2, lk, 16, generator=g).to(dtype) for _ in range(2)))


@pytest.mark.skipif(not INTERPRETED, reason="the Triton kernels run through the CPU interpreter here")
def test_a_keep_mask_seen_before_reaches_the_kernels_checked():
    """A CPU mask found by value takes the plan's checked copy on every call, also once recording
    gives up (the kernels once received the caller's 1-D mask there)."""
    q, k, v = _qkv16(lq=32)  # one query block is enough: the mask's path is what is checked
    keep = torch.zeros(4, dtype=torch.bool)
    keep[3] = True
    outs = [pisa_attention(q, k, v, density=0.25, block_size=32, keep_blocks=keep, backend="triton")
            for _ in range(6)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_a_keep_mask_checked_for_another_shape_is_checked_again():
    q, k, v = (x.float() for x in _qkv16())
    k8, v8 = torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    m8 = torch.zeros(8, dtype=torch.bool)
    m8[0] = True
    keep = torch.zeros(4, dtype=torch.bool)
    keep[3] = True
    pisa_attention(q, k8, v8, block_size=32, keep_blocks=m8)  # a plan for 8 blocks with one kept
    pisa_attention(q, k, v, block_size=32, keep_blocks=keep)  # this mask counted, for 4 blocks
    with pytest.raises(ValueError, match=r"keep_blocks must have shape \[8\]"):
        pisa_attention(q, k8, v8, block_size=32, keep_blocks=keep)


@pytest.mark.parametrize("field", ["idx", "cnt", "bits"])
def test_a_strided_selection_is_refused(field):
    q, k, v = _qkv16()
    p = plan(q, k, PisaSettings(density=0.25, block_size=32))
    _, sel = run(p, q, k, v, return_selection=True)
    parts = sel._asdict() if hasattr(sel, "_asdict") else dict(idx=sel.idx, cnt=sel.cnt, bits=sel.bits)
    x = parts[field]
    parts[field] = torch.stack([x, x], -1)[..., 0]  # the same values, every other element
    with pytest.raises(ValueError, match=f"selection.{field} must be contiguous"):
        run(p, q, k, v, selection=Selection(parts["idx"], parts["cnt"], parts["bits"]))


def test_a_strided_lse_buffer_is_refused():
    q, k, v = _qkv16()
    p = plan(q, k, PisaSettings(density=0.25, block_size=32))
    with pytest.raises(ValueError, match="lse must be contiguous"):
        run(p, q, k, v, lse=torch.zeros(1, 64, 2).transpose(1, 2), return_lse=True)


def test_grad_is_refused_after_a_recorded_run():
    """The replayed path looks at alpha's and the buffers' requires_grad too."""
    from fake_launch import fake_kernels

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g).bfloat16() for _ in range(3))
    with fake_kernels():
        p = plan(q, k, PisaSettings(backend="triton", density=0.25))
        out = torch.empty_like(q)
        for _ in range(3):
            run(p, q, k, v, alpha=torch.tensor([0.5, 0.6]))
            run(p, q, k, v, out=out)
        with pytest.raises(ValueError, match="inference-only"):
            run(p, q, k, v, alpha=torch.tensor([0.5, 0.6], requires_grad=True))
        with pytest.raises(ValueError, match="out must not require grad"):
            run(p, q, k, v, out=torch.empty_like(q).requires_grad_())


def test_settings_alpha_keeps_float64():
    q, k, v = (x.double() for x in _qkv16())
    s = PisaSettings(density=0.25, block_size=32, alpha=(0.1, 0.3))
    assert torch.equal(pisa_attention(q, k, v, settings=s), run(plan(q, k, s), q, k, v))


def test_loose_arguments_numpy_and_unhashable():
    np = pytest.importorskip("numpy")
    q, k, v = (x.float() for x in _qkv16())
    with pytest.raises(ValueError, match="mode must be one of"):
        pisa_attention(q, k, v, mode=["hybrid"])
    out, lse = pisa_attention(q, k, v, block_size=32, return_lse=np.bool_(True))
    assert torch.equal(out, pisa_attention(q, k, v, block_size=32))
    p = plan((np.int64(1), 2, 64, 16), (1, 2, 128, 16), dtype=torch.float32, device="cpu")
    assert p.q_shape == (1, 2, 64, 16) and all(type(n) is int for n in p.q_shape)


def test_compiled_run_keeps_every_kept_block():
    """Traced, run cannot count the mask's kept blocks (its check is skipped): the index list is
    sized for every block, so a mask beyond the plan's max_keep is not cut off."""
    q, k, v = make_qkv(1, 2, 2, 96, 96, 16, torch.float16, seed=12)
    p = plan(q, k, PisaSettings(block_size=16, density=0.1, backend="triton", mode="drop"), max_keep=1)
    kb = torch.zeros(6, dtype=torch.bool)
    kb[[0, 2, 4]] = True
    want = pisa_attention(q, k, v, block_size=16, density=0.1, backend="triton", mode="drop", keep_blocks=kb)
    torch._dynamo.reset()
    got = torch.compile(lambda q, k, v, kb: run(p, q, k, v, keep_blocks=kb), fullgraph=True,
                        backend="aot_eager")(q, k, v, kb)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compiled_call_follows_a_new_key_length():
    """A second key length makes dynamo trace the length symbolically: the block count must be
    traceable (the density -> k rule on it included)."""
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: pisa_attention(q, k, v, block_size=16, density=0.4), fullgraph=True,
                      backend="eager")
    for n in (48, 40):  # the second, ragged length is traced symbolically
        x = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(f(x, x, x), pisa_attention(x, x, x, block_size=16, density=0.4), rtol=0, atol=0)
