"""The hot path of a planned run: launches recorded once per call signature and replayed with the
call's pointers swapped in must issue exactly the launches a checked run issues (kernels faked:
see tests/fake_launch.py; the GPU tests compare outputs bit for bit)."""

from __future__ import annotations

import pytest
import torch

import pisa_attn.attention as attention
from pisa_attn import PisaSettings, pisa_attention, plan, run
from fake_launch import entries, fake_kernels


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
def test_replay_issues_the_launches_of_a_checked_run_B1_H2_L256_D64(cov, layout, call, monkeypatch):
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

    with fake_kernels() as log:
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
