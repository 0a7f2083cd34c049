"""The hot path of a planned run: launches recorded once per call signature and replayed with the
call's pointers swapped in must issue exactly the launches a checked run issues (kernels faked:
see tests/fake_launch.py; the GPU tests compare outputs bit for bit)."""

from __future__ import annotations

import pytest
import torch

import pisa_attn.attention as attention
from pisa_attn import PisaSettings, pisa_attention, plan, run
from fake_launch import STYLES, entries, fake_kernels


def _qkv(layout="bhsd", seed=0, lq=256, lk=320):
    g = torch.Generator().manual_seed(seed)

    def t(n, h):
        shape = (1, h, n, 64) if layout == "bhsd" else (1, n, h, 64)
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return t(lq, 2), t(lk, 2), t(lk, 2)


def _tokens(log, names):
    """The launch log with the given pointers named (so logs of two calls compare)."""
    return [(n, g, tuple(names.get(a[1], a) if isinstance(a, tuple) and a[:1] == ("ptr",) else a for a in args))
            for n, g, args in log]


def _programs(p):
    return [x for x in p.programs.values() if isinstance(x, attention._Program)]


@pytest.mark.parametrize("cov", [False, True], ids=["topk", "cov"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("call", ["plain", "out", "lse", "alpha", "pisa_attention"])
@pytest.mark.parametrize("style", STYLES)
def test_replay_issues_the_launches_of_a_checked_run_B1_H2_L256_D64(cov, layout, call, style, monkeypatch):
    s = PisaSettings(covariance_aware=cov, layout=layout, backend="triton", density=0.25)
    qa, ka, va = _qkv(layout, 0)
    qb, kb, vb = _qkv(layout, 1)
    buf = torch.empty_like(qb)

    def call_(q, k, v):
        if call == "pisa_attention":
            return pisa_attention(q, k, v, settings=s), None
        kw = {"out": buf} if call == "out" else {"alpha": 0.5} if call == "alpha" else {}
        res = run(p, q, k, v, return_lse=call == "lse", **kw)
        return res if call == "lse" else (res, None)

    with fake_kernels(style) as log:
        p = plan(qa, ka, s) if call != "pisa_attention" else None
        for _ in range(3):  # compile, record, replay
            call_(qa, ka, va)
        if p is None:
            p = next(x for x in attention._PLANS.values() if x.settings == s and x.q_shape == tuple(qa.shape))
        assert len(_programs(p)) == 1
        del log[:]
        out, lse = call_(qb, kb, vb)
        replayed = entries(log)
        del log[:]
        monkeypatch.setattr(attention, "_bound_run", lambda *a, **k: None)
        out2, lse2 = call_(qb, kb, vb)
        checked = entries(log)
    assert replayed and len(replayed) == len(checked)
    names = {qb.data_ptr(): "q", kb.data_ptr(): "k", vb.data_ptr(): "v"}
    a = _tokens(replayed, {**names, out.data_ptr(): "out", **({} if lse is None else {lse.data_ptr(): "lse"})})
    b = _tokens(checked, {**names, out2.data_ptr(): "out", **({} if lse2 is None else {lse2.data_ptr(): "lse"})})
    assert a == b
    flat = [x for _, _, args in a for x in args]
    assert {"q", "k", "v", "out"} <= set(flat) and ("lse" in flat) == (call == "lse")
    assert out.shape == qb.shape and out.dtype == qb.dtype and out.stride() == out2.stride()
    if call == "out":
        assert out is buf


def test_a_new_stride_is_recorded_apart_and_mismatches_are_refused():
    s = PisaSettings(backend="triton")
    q, k, v = _qkv()
    with fake_kernels() as log:
        p = plan(q, k, s)
        for _ in range(3):
            run(p, q, k, v)
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
        for _ in range(3):
            run(p, qt, k, v)
        assert len(_programs(p)) == 2
        n = len(log)
        with pytest.raises(ValueError, match="q has shape"):
            run(p, q[:, :, :128], k, v)
        with pytest.raises(TypeError, match="q has dtype"):
            run(p, q.half(), k, v)
        with pytest.raises(TypeError, match="q must be a torch.Tensor"):
            run(p, None, k, v)
        assert len(log) == n  # nothing launched for a refused run


def test_aliased_tensors_stay_on_the_checked_path():
    s = PisaSettings(backend="triton")
    q, k, _ = _qkv()
    with fake_kernels() as log:
        p = plan(q, k, s)
        for _ in range(5):
            run(p, q, k, k)
        assert not _programs(p) and log and len(log) % 4 == 0  # every call after the compiling one launched


def test_interpreter_runs_are_never_recorded():
    q, k, v = _qkv(lq=64, lk=64)
    p = plan(q, k, PisaSettings(backend="triton"))
    for _ in range(4):
        run(p, q, k, v)
    assert not _programs(p) and False in p.programs.values()


def test_replayed_selection_and_lse_are_returned_as_the_checked_path_returns_them():
    s = PisaSettings(backend="triton")
    q, k, v = _qkv()
    with fake_kernels():
        p = plan(q, k, s)
        for _ in range(3):
            out, lse, sel = run(p, q, k, v, return_lse=True, return_selection=True)
        assert len(_programs(p)) == 1
        ws_sel = p.workspace.selection.sel
        # a copy of the workspace's selection, and a fresh lse per call (not the workspace's)
        assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(sel, ws_sel))
        assert lse.shape == (1, 2, 256) and lse.data_ptr() != p.workspace.lse.data_ptr()
        out2, lse2 = run(p, q, k, v, return_lse=True)
        assert lse2.data_ptr() != lse.data_ptr()  # lse is still referenced: a new one


def test_programs_per_plan_are_bounded(monkeypatch):
    monkeypatch.setattr(attention, "_PROGRAM_LIMIT", 4)
    s = PisaSettings(backend="triton")
    q, k, v = _qkv()
    with fake_kernels():
        p = plan(q, k, s)
        for i in range(12):  # 12 signatures: other output strides each time
            out = torch.empty(1, 2, 256, 64 + 8 * i, dtype=torch.bfloat16)[..., :64]
            for _ in range(2):
                run(p, q, k, v, out=out)
            assert len(p.programs) <= 4


def _keep_ptr(log, keep_ptrs):
    """The keep-mask pointers the select launch of ``log`` read (of the candidates)."""
    return {a[1] for _, _, args in entries(log) for a in args if isinstance(a, tuple) and a[1] in keep_ptrs}


def test_keep_blocks_replay_reads_the_plans_copy_of_each_mask_B1_H2_L256_D64(monkeypatch):
    s = PisaSettings(backend="triton", density=0.25)
    q, k, v = _qkv(lk=320)
    ka = torch.zeros(5, dtype=torch.bool)
    ka[0] = True
    kb = torch.zeros(5, dtype=torch.bool)
    kb[4] = True
    with fake_kernels() as log:
        p = plan(q, k, s, max_keep=1)
        for _ in range(3):
            run(p, q, k, v, keep_blocks=ka)
        assert len(_programs(p)) == 1 and len(p.keeps) == 1
        run(p, q, k, v, keep_blocks=kb)  # another mask of the same shape: the same program, its own copy
        assert len(_programs(p)) == 1 and len(p.keeps) == 2
        copies = {c.data_ptr(): c for c in p.keeps.values()}
        for mask in (ka, kb, ka.clone(), kb[:5]):  # by value: a new tensor or view of the same flags hits
            del log[:]
            out = run(p, q, k, v, keep_blocks=mask)
            (ptr,) = _keep_ptr(log, copies)
            assert torch.equal(copies[ptr].reshape(-1), mask)
            replayed = entries(log)
            del log[:]
            seen = []
            norm = attention.normalize_keep_blocks
            with monkeypatch.context() as m:
                m.setattr(attention, "_bound_run", lambda *a, **kw: None)
                m.setattr(attention, "normalize_keep_blocks", lambda *a: seen.append(norm(*a)) or seen[-1])
                out2 = run(p, q, k, v, keep_blocks=mask)
            checked = entries(log)
            # the checked path copies the mask per call: the launches agree up to that pointer
            names = {q.data_ptr(): "q", k.data_ptr(): "k", v.data_ptr(): "v", p.alpha.data_ptr(): "alpha"}
            a = _tokens(replayed, {**names, out.data_ptr(): "out", ptr: "keep"})
            b = _tokens(checked, {**names, out2.data_ptr(): "out", seen[0][0].data_ptr(): "keep"})
            assert "keep" in [x for _, _, args in a for x in args]
            assert a == b
        ka[1] = True  # changed in place: a new value, a new copy (never the old one)
        del log[:]
        run(p, q, k, v, keep_blocks=ka[[0, 2, 3, 4]].new_zeros(5).index_fill_(0, torch.tensor([1]), True))
        (ptr,) = _keep_ptr(log, {c.data_ptr(): c for c in p.keeps.values()})
        assert torch.equal(next(c for c in p.keeps.values() if c.data_ptr() == ptr).reshape(-1),
                           torch.tensor([False, True, False, False, False]))
        with pytest.raises(ValueError, match="max_keep"):
            run(p, q, k, v, keep_blocks=ka)  # two kept blocks, planned for one: refused, not replayed



def _flux_tiny(backend):
    from pisa_attn.bench import dit_cases as dc
    from pisa_attn.bench.e2e.backends import sequence

    case = dc.tiny(dc.CASES["flux-1024"])
    seq = sequence(case, 64).joint
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, seq.length, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    return q, k, v, seq, PisaSettings(density=0.25, layout="bshd", backend=backend)


def test_sparse_attention_writes_the_image_rows_in_place_B2_H2_D64():
    from pisa_attn.diffusers.calls import sparse_attention

    q, k, v, seq, s = _flux_tiny("reference")
    assert seq.image_lo > 0 and seq.keep is not None
    want = sparse_attention(q, k, v, seq, None, s)  # pisa_attention: the copy into the output
    got = sparse_attention(q, k, v, seq, None, s, plans={})
    assert torch.equal(got, want)
    q, k, v, seq, s = _flux_tiny("triton")
    plans: dict = {}
    with fake_kernels() as log:
        for _ in range(3):
            sparse_attention(q, k, v, seq, None, s, plans=plans)
        (p,) = plans.values()
        assert len(_programs(p)) == 1
        del log[:]
        out = sparse_attention(q, k, v, seq, None, s, plans=plans)
        attn = [args for n, _, args in entries(log) if n == "_attn_kernel"]
    start = seq.image_lo // 64 * 64
    assert len(attn) == 1 and ("ptr", out[:, start:].data_ptr()) in attn[0]  # the kernel wrote into out


def _op_args(q, k, v, keep, alpha, p):
    return (q, k, v, keep, alpha, p.n_select, p.width, p.mode, p.scale, p.block_size, p.covariance_aware,
            p.query_block, p.backend)


@pytest.mark.parametrize("keep", [False, True], ids=["nokeep", "keep"])
def test_registered_op_runs_a_cached_plan_and_replays_it_B1_H2_L256_D64(keep, monkeypatch):
    from pisa_attn.ops import fused

    s = PisaSettings(backend="triton", covariance_aware=True, density=0.25)
    q, k, v = _qkv(seed=4)
    mask = torch.zeros(1, 1, 5, dtype=torch.bool)
    mask[..., 0] = True
    attention.clear_plans()
    with fake_kernels() as log:
        p = plan(q, k, s, max_keep=5 if keep else 0)  # the static width a traced call with keep_blocks has
        kd = mask.clone() if keep else None
        alpha = torch.full((2,), 0.75)
        for _ in range(3):  # compile, record, replay
            out, lse = torch.ops.pisa_attn.pisa_fwd(*_op_args(q, k, v, kd, alpha, p))
        (op_plan,) = attention._OP_PLANS.values()
        assert len(_programs(op_plan)) == 1 and op_plan.width == p.width
        del log[:]
        kd2 = mask.clone() if keep else None  # the graph's fresh device mask: its pointer is swapped in
        out, lse = torch.ops.pisa_attn.pisa_fwd(*_op_args(q, k, v, kd2, alpha, p))
        replayed = entries(log)
        del log[:]
        monkeypatch.setattr(fused, "_PLANNED", None)  # the unplanned stages, as before
        out2, lse2 = torch.ops.pisa_attn.pisa_fwd(*_op_args(q, k, v, kd2, alpha, p))
        unplanned = entries(log)
    assert out.shape == out2.shape and out.stride() == out2.stride() and lse.shape == lse2.shape
    names = {q.data_ptr(): "q", k.data_ptr(): "k", v.data_ptr(): "v", alpha.data_ptr(): "alpha",
             **({kd2.data_ptr(): "keep"} if keep else {})}
    a = _tokens(replayed, {**names, out.data_ptr(): "out", lse.data_ptr(): "lse"})
    b = _tokens(unplanned, {**names, out2.data_ptr(): "out", lse2.data_ptr(): "lse"})
    # the same kernels on the same grids with the same call tensors (workspace buffers differ)
    assert [(n, g) for n, g, _ in a] == [(n, g) for n, g, _ in b]
    for (_, _, x), (_, _, y) in zip(a, b):
        assert [t for t in x if isinstance(t, str)] == [t for t in y if isinstance(t, str)]
        assert [t for t in x if not isinstance(t, tuple)] == [t for t in y if not isinstance(t, tuple)]
    assert keep == ("keep" in [t for _, _, x in a for t in x])


def test_registered_op_on_a_plan_equals_the_stages_interpreted_B1_H2_L128_D64(monkeypatch):
    from pisa_attn.ops import fused

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s = PisaSettings(backend="triton", density=0.5)
    q, k, v = _qkv(seed=5, lq=128, lk=192)
    p = plan(q, k, s, max_keep=3)
    keep = torch.zeros(1, 1, 3, dtype=torch.bool)
    keep[..., 2] = True
    args = _op_args(q, k, v, keep, torch.full((2,), 0.5), p)
    out, lse = torch.ops.pisa_attn.pisa_fwd(*args)
    monkeypatch.setattr(fused, "_PLANNED", None)
    out2, lse2 = torch.ops.pisa_attn.pisa_fwd(*args)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_pisa_attention_with_keep_blocks_replays_B1_H2_L256_D64(monkeypatch):
    s = PisaSettings(backend="triton", density=0.25)
    q, k, v = _qkv(seed=6)
    keep = torch.zeros(5, dtype=torch.bool)
    keep[[0, 3]] = True
    attention.clear_plans()  # and the kept-block counts of masks seen (another test's masks)
    with fake_kernels() as log:
        for _ in range(3):
            pisa_attention(q, k, v, settings=s, keep_blocks=keep.clone())
        p = next(x for x in attention._PLANS.values() if x.settings == s and x.max_keep == 2)
        assert len(_programs(p)) == 1 and len(p.keeps) == 1
        (copy,) = p.keeps.values()
        del log[:]
        calls = []
        checked = attention._run
        monkeypatch.setattr(attention, "_run", lambda *a, **kw: calls.append(1) or checked(*a, **kw))
        out = pisa_attention(q, k, v, settings=s, keep_blocks=keep.clone())
        assert not calls and out.shape == q.shape
        assert ("ptr", copy.data_ptr()) in [x for _, _, args in entries(log) for x in args]
        other = torch.zeros(5, dtype=torch.bool)
        other[1] = True  # another mask: the checked path first (its count is read once), never the old copy
        pisa_attention(q, k, v, settings=s, keep_blocks=other)
        assert calls  # the checked path


def test_host_descriptors_carry_every_field_tritons_descriptor_has():
    # The cached launchers hand Triton's descriptor encoder a ``Desc`` (or a ``_PtrDesc``) where it
    # expects its own host ``TensorDescriptor``: a field a Triton release adds and reads (3.9:
    # ``round_f32_to_tf32``) must be there, or every cached launch fails after the first call.
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor as TritonDesc

    from pisa_attn.ops.bound import _PtrDesc
    from pisa_attn.ops.launch import Desc

    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc
    except ImportError:
        GluonDesc = TritonDesc
    needed = {f.name for cls in (TritonDesc, GluonDesc) for f in dataclasses.fields(cls)} - {"block_shape", "layout"}
    d = Desc(torch.zeros(4, 4), [4, 4], [4, 1])
    p = _PtrDesc(0, [4, 4], [4, 1], "zero")
    assert needed <= set(Desc._fields), needed - set(Desc._fields)
    assert all(hasattr(p, n) for n in needed), [n for n in needed if not hasattr(p, n)]
    assert not d.round_f32_to_tf32 and d.padding == "zero"


def test_descriptor_route_finds_the_raw_entry_point_under_tritons_wrapper():
    # A bound replay encodes the TMA descriptors of workspace tensors once and calls the C entry
    # point under Triton's descriptor-expanding wrapper itself; it finds that entry point, the
    # descriptors' metadata and the encoder in the wrapper's closure, for this Triton's layout.
    from triton.backends.nvidia import driver

    from pisa_attn.ops.bound import _tensordesc_route
    from pisa_attn.ops.launch import Entry

    def raw(*a):
        raise AssertionError("not launched here")

    meta = [dict(swizzle=128, elem_size=2, elem_type=10, block_size=[64, 128], fp4_padded=False)]
    wrapped = driver.wrap_handle_tensordesc(raw, {0: "tensordesc<bf16[64,128]>", 1: "i32"}, meta)
    assert wrapped is not raw
    route = _tensordesc_route(Entry(wrapped, None, (0,), (), None))
    assert route is not None and route[0] is raw and route[1] == meta
    assert _tensordesc_route(Entry(wrapped, None, (), (), None)) is None  # the public path: no route


def test_direct_launch_layout_is_the_installed_tritons():
    # The cached launchers call the C entry point with fixed arguments laid out as Triton's own
    # launcher object lays them out (``ops.launch.Entry``). On a release where that is assumed
    # (``_DIRECT``), the launcher's call must pass exactly these, in this order.
    import ast
    import inspect
    import textwrap

    import triton
    from triton.backends.nvidia import driver

    from pisa_attn.ops import launch

    if not launch._DIRECT:
        pytest.skip(f"Triton {triton.__version__}: cached launches take the public path")
    cls = driver.CudaLauncher
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.launch"]
    assert len(calls) == 1
    passed = [ast.unparse(a) for a in calls[0].args]
    head = ["gridX", "gridY", "gridZ", "stream", "function", "self.launch_cooperative_grid", "self.launch_pdl"]
    if "arg_annotations" in inspect.getsource(cls.__init__):  # one generic entry point (Entry.packed)
        assert passed == head + ["kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook",
                                 "global_scratch", "profile_scratch", "self.arg_annotations",
                                 "self.kernel_signature", "kernel_args"], passed
    else:  # one entry point per signature; ``args`` starts with the kernel metadata, launch metadata, hooks
        assert passed == head + ["global_scratch", "profile_scratch", "*args"], passed


def test_two_threads_recording_at_once_keep_their_own_launches(monkeypatch):
    """The recorder is per thread: a thread whose recording ends while another's runs does not take
    the other's launches with it, nor leave its own recorder installed for later launches."""
    import threading

    from pisa_attn.ops import bound, launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)

    class Jit:
        fn = staticmethod(lambda x_ptr, n: None)

    lau = launch.Launcher(Jit())
    x = torch.zeros(4)
    lau._cache[launch._full_key("k", (x, 1))] = launch.Entry(lambda *a: None, None, (), (), None)
    ev = [threading.Event() for _ in range(3)]
    out = {}

    def a_run():
        lau("k", (1,), (x, 1), {})
        ev[0].set()
        ev[1].wait()

    def b_run():
        ev[1].set()
        ev[2].wait()  # A's recording has ended meanwhile
        lau("k", (1,), (x, 1), {})
        lau("k", (2,), (x, 1), {})

    def ta():
        out["A"] = bound.record(a_run)[1]
        ev[2].set()

    def tb():
        ev[0].wait()
        out["B"] = bound.record(b_run)[1]

    threads = [threading.Thread(target=ta), threading.Thread(target=tb)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [lc.grid for lc in out["A"].launches] == [(1,)]
    assert [lc.grid for lc in out["B"].launches] == [(1,), (2,)]
    lau("k", (3,), (x, 1), {})  # nothing recording now: no recorder keeps it
    assert launch._recorder() is None and len(out["A"].launches) == 1


def test_a_kernel_compiled_for_an_aligned_buffer_does_not_serve_an_unaligned_one():
    from pisa_attn.ops import launch

    x = torch.zeros(64)
    assert launch._full_key("k", (x, 1)) != launch._full_key("k", (x[2:], 1))
    assert launch._full_key("k", (x, 1)) == launch._full_key("k", (x[4:], 1))


def test_a_replaced_plan_records_its_own_programs():
    import dataclasses

    q = torch.zeros(1, 2, 128, 64)
    p = plan(q, q, PisaSettings(backend="reference"))
    p.programs["x"] = 1
    p.keeps["y"] = 2
    r = dataclasses.replace(p, mode="drop")
    assert r.programs == {} and r.keeps == {} and p.programs == {"x": 1}


def test_registered_op_replay_never_serves_weights_it_was_not_recorded_for_B1_H2_L256_D64():
    # The kernels read alpha as H contiguous float32 values; the checked path copies a strided
    # alpha and refuses another dtype. A replay recorded for a contiguous float32 alpha must do
    # neither for such an alpha (it would read the wrong elements, or the wrong bytes).
    s = PisaSettings(backend="triton", density=0.25)
    q, k, v = _qkv(seed=7)
    attention.clear_plans()
    with fake_kernels() as log:
        p = plan(q, k, s)
        for _ in range(3):
            torch.ops.pisa_attn.pisa_fwd(*_op_args(q, k, v, None, torch.full((2,), 0.75), p))
        (op_plan,) = attention._OP_PLANS.values()
        assert len(_programs(op_plan)) == 1
        base = torch.tensor([0.5, 9.0, 0.25, 9.0])
        strided = base[::2]  # [0.5, 0.25], 16-byte aligned, stride 2
        del log[:]
        torch.ops.pisa_attn.pisa_fwd(*_op_args(q, k, v, None, strided, p))
        (attn,) = [args for n, _, args in entries(log) if n == "_attn_kernel"]
        assert ("ptr", base.data_ptr()) not in attn  # a contiguous copy, not the strided storage
        with pytest.raises(ValueError, match="alpha must be a float32"):
            torch.ops.pisa_attn.pisa_fwd(*_op_args(q, k, v, None, torch.full((2,), 0.75, dtype=torch.float64), p))


def test_a_recording_that_cannot_be_bound_leaves_its_signature_on_the_checked_path(monkeypatch):
    """A bind that raises (an unexpected launch) costs the call nothing but its recording: the call
    returns what the checked run computed, and the signature is never recorded (or bound) again."""
    from pisa_attn.ops import bound

    binds = []
    real_bind = bound.bind
    monkeypatch.setattr(bound, "bind", lambda *a, **kw: binds.append(1) or real_bind(*a, **kw))

    def broken(*a, **kw):
        raise RuntimeError("an unexpected launch")

    monkeypatch.setattr(bound, "_pack", broken)  # raises inside bind, after the run was recorded
    s = PisaSettings(backend="triton")
    q, k, v = _qkv()
    with fake_kernels() as log, pytest.warns(RuntimeWarning, match="an unexpected launch"):
        p = plan(q, k, s)
        for i in range(8):
            n = len(log)
            out = run(p, q, k, v)
            assert out.shape == q.shape and (i == 0 or len(log) > n)  # checked runs (after the compiling one)
    assert not _programs(p) and False in p.programs.values()
    assert len(binds) == 1
