"""apply_pisa as a transaction: every failure leaves the model (and pipeline) exactly as it was."""

import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers.models import attention_dispatch as ad  # noqa: E402
from pisa_attn.diffusers import telemetry as tm  # noqa: E402
from diffusers_tiny import TILE_BLOCK, forward_inputs, prompt_kwargs, tiny_pipeline, tiny_transformer  # noqa: E402

SPARSE = dict(density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=0)


def _hooks(m) -> tuple:
    return tuple(
        tuple(d.values())
        for d in (m._forward_pre_hooks, m._forward_hooks, m._forward_pre_hooks_with_kwargs, m._forward_hooks_always_called)
    )


def snapshot(obj) -> dict:
    """What apply_pisa can touch, by identity: every module's hooks and attributes, every processor
    and its attributes, the pipeline's attributes, diffusers' active backend."""
    mods = obj.transformer.named_modules() if hasattr(obj, "transformer") else obj.named_modules()
    out = {"active_backend": ad._AttentionBackendRegistry._active_backend}
    for name, m in mods:
        proc = getattr(m, "processor", None)
        out[name] = (
            _hooks(m),
            dict(m.__dict__),
            proc,
            None if proc is None else dict(vars(proc)),
            None if proc is None else getattr(proc, "_attention_backend", "<absent>"),
        )
    if not isinstance(obj, torch.nn.Module):
        out["pipe"] = dict(obj.__dict__)
        out["scheduler"] = dict(obj.scheduler.__dict__)  # apply_pisa wraps its set_timesteps
    return out


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "active_backend":
            assert before[key] is after[key]
            continue
        if key in ("pipe", "scheduler"):
            assert before[key].keys() == after[key].keys()
            assert all(before[key][k] is after[key][k] for k in before[key]), key
            continue
        hooks0, attrs0, proc0, pattrs0, backend0 = before[key]
        hooks1, attrs1, proc1, pattrs1, backend1 = after[key]
        assert hooks0 == hooks1, f"{key}: hooks changed"
        assert attrs0.keys() == attrs1.keys(), f"{key}: attributes {set(attrs0) ^ set(attrs1)}"
        assert all(attrs0[k] is attrs1[k] for k in attrs0), f"{key}: an attribute was replaced"
        assert proc0 is proc1, f"{key}: processor replaced"
        assert pattrs0 == pattrs1 and backend0 == backend1, f"{key}: processor attributes changed"


class _OwnSDPA:
    """A processor that computes attention itself (no ``_attention_backend``: PISA cannot reach it)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def _non_dispatching(tr):
    """Give the last managed attention module a processor that does not call the dispatcher."""
    blocks = tr.single_transformer_blocks if hasattr(tr, "single_transformer_blocks") else tr.blocks
    attn = blocks[-1].attn if hasattr(blocks[-1], "attn") else blocks[-1].attn1
    attn.processor = _OwnSDPA(attn.processor)
    return tr


BAD = [
    (dict(telemetry=2.0), ValueError, "telemetry must be"),
    (dict(telemetry="yes"), TypeError, "telemetry"),
    (dict(density=2.0), ValueError, "density"),
    (dict(mode="fast"), ValueError, "mode"),
    (dict(block_size=48), ValueError, "block_size"),
    (dict(tile=(8,)), ValueError, "tile"),
    (dict(tile=(1, 1, 2)), ValueError, "tile must hold block_size = "),
    (dict(dense_layers=-1), ValueError, "dense_layers"),
    (dict(dense_steps=1.5), TypeError, "dense_steps"),
    (dict(covariance_aware="no"), TypeError, "covariance_aware"),
    (dict(min_kv_len=-1), ValueError, "min_kv_len"),
    (dict(alpha=float("nan")), ValueError, "alpha"),
    (dict(alpha=torch.ones(3)), ValueError, "alpha"),
    (dict(alpha=0.5, mode="drop"), ValueError, "alpha"),
    (dict(calibrate=True), ValueError, "dense_steps"),
    (dict(calibrate=True, dense_steps=1, mode="zeroth"), ValueError, "calibrate"),
    (dict(calibrate="yes"), TypeError, "calibrate"),
    (dict(alpha_table={"format": "nope"}), ValueError, "alpha_table"),
    (dict(query_block=24), ValueError, "query_block"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(calibrate=True, dense_steps=1, alpha_table={"format": "nope"}), ValueError, "alpha_table"),
]


@pytest.mark.parametrize("managed", [False, True], ids=["fresh", "managed"])
@pytest.mark.parametrize("kwargs, exc, match", BAD, ids=[next(iter(k)) + "-" + e.__name__ for k, e, _ in BAD])
def test_bad_settings_leave_model_unchanged(kwargs, exc, match, managed):
    tr = tiny_transformer("hunyuan")
    if managed:
        pd.apply_pisa(tr, telemetry=True, **SPARSE)
    state = pd.pisa_state(tr)
    before = snapshot(tr)
    with pytest.raises(exc, match=match):
        pd.apply_pisa(tr, **{**SPARSE, **kwargs})
    assert_same(before, snapshot(tr))
    assert pd.pisa_state(tr) is state
    if managed:
        assert tm.get(tr).active and len(pd.hooks.observers(tr)) == 1
        pd.remove_pisa(tr)


@pytest.mark.parametrize("managed", [False, True], ids=["fresh", "managed"])
def test_unroutable_processor_leaves_model_unchanged(managed):
    # The failing module comes after routable ones: nothing may have been re-routed before the check.
    tr = tiny_transformer("hunyuan")
    if managed:
        pd.apply_pisa(tr, **SPARSE)
    state = pd.pisa_state(tr)
    _non_dispatching(tr)
    before = snapshot(tr)
    with pytest.raises(ValueError, match="_OwnSDPA"):
        pd.apply_pisa(tr, **SPARSE)
    assert_same(before, snapshot(tr))
    assert pd.pisa_state(tr) is state
    if managed:
        pd.remove_pisa(tr)


def test_pipeline_second_transformer_failure_leaves_both_unchanged():
    pipe = tiny_pipeline("wan")
    pipe.register_modules(transformer_2=_non_dispatching(tiny_transformer("wan", seed=1)))
    before = snapshot(pipe)
    before2 = snapshot(pipe.transformer_2)
    with pytest.raises(ValueError, match="_OwnSDPA"):
        pd.apply_pisa(pipe, **SPARSE)
    assert_same(before, snapshot(pipe))
    assert_same(before2, snapshot(pipe.transformer_2))
    assert pd.pisa_state(pipe.transformer) is None


def test_version_guard_leaves_model_unchanged(monkeypatch):
    import diffusers

    tr = tiny_transformer("wan")
    before = snapshot(tr)
    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    with pytest.raises(RuntimeError, match="tested with diffusers"):
        pd.apply_pisa(tr)
    assert_same(before, snapshot(tr))


def test_unsupported_model_checks_leave_model_unchanged():
    tr = tiny_transformer("hunyuan", image_condition_type="token_replace")
    before = snapshot(tr)
    with pytest.raises(ValueError, match="token_replace"):
        pd.apply_pisa(tr)
    assert_same(before, snapshot(tr))


@pytest.mark.parametrize("managed", [False, True], ids=["fresh", "managed"])
def test_failure_while_installing_rolls_back(monkeypatch, managed):
    # A failure after validation (here: attaching telemetry) undoes what was installed and puts
    # back the previous apply_pisa.
    pipe = tiny_pipeline("wan")
    tr = pipe.transformer
    inputs = forward_inputs("wan")
    if managed:
        pd.apply_pisa(pipe, telemetry=True, **SPARSE)
    state = pd.pisa_state(tr)
    with torch.no_grad():
        expect = tr(**inputs).sample
    before = snapshot(pipe)

    def boom(transformer, config=True):
        raise RuntimeError("telemetry broke")

    monkeypatch.setattr(tm, "attach", boom)
    with pytest.raises(RuntimeError, match="telemetry broke"):
        pd.apply_pisa(pipe, telemetry=0.5, **{**SPARSE, "density": 0.25})
    monkeypatch.undo()
    after = snapshot(pipe)
    assert pd.pisa_state(tr) is state
    if not managed:
        assert_same(before, after)
    else:  # re-installed: same state, hooks and routing in place again, telemetry active
        assert {k: len(v[0][0]) + len(v[0][2]) for k, v in before.items() if k not in ("pipe", "scheduler", "active_backend")} == {
            k: len(v[0][0]) + len(v[0][2]) for k, v in after.items() if k not in ("pipe", "scheduler", "active_backend")
        }
        assert [v[4] for k, v in before.items() if k not in ("pipe", "scheduler", "active_backend")] == [
            v[4] for k, v in after.items() if k not in ("pipe", "scheduler", "active_backend")
        ]
        assert tm.get(tr).active and len(pd.hooks.observers(tr)) == 1
        assert before["pipe"].keys() == after["pipe"].keys()
    with torch.no_grad():
        torch.testing.assert_close(tr(**inputs).sample, expect, rtol=0, atol=0)
    pd.remove_pisa(pipe)


def test_failure_on_the_first_transformer_leaves_the_second_managed(monkeypatch):
    # Wan2.2-like pipeline: the failure comes while installing the first transformer, so the
    # second one, never reached, keeps its earlier state (not a second copy of it, not none).
    pipe = tiny_pipeline("wan")
    pipe.register_modules(transformer_2=tiny_transformer("wan", seed=1))
    pd.apply_pisa(pipe, **SPARSE)
    state2 = pd.pisa_state(pipe.transformer_2)
    inputs = forward_inputs("wan")
    with torch.no_grad():
        expect = pipe.transformer_2(**inputs).sample

    def boom(transformer, config=True):
        raise RuntimeError("telemetry broke")

    monkeypatch.setattr(tm, "attach", boom)
    with pytest.raises(RuntimeError, match="telemetry broke") as err:
        pd.apply_pisa(pipe, telemetry=0.5, **SPARSE)
    monkeypatch.undo()
    assert not getattr(err.value, "__notes__", None)
    assert pd.pisa_state(pipe.transformer_2) is state2
    with torch.no_grad():
        torch.testing.assert_close(pipe.transformer_2(**inputs).sample, expect, rtol=0, atol=0)
    pd.remove_pisa(pipe)


@pytest.mark.parametrize("head_dim", [8, 512])
def test_head_dim_outside_kernel_range_refused_at_apply(head_dim):
    tr = tiny_transformer("wan", attention_head_dim=head_dim)
    before = snapshot(tr)
    with pytest.raises(ValueError, match=rf"head dim.*\b{head_dim}\b"):
        pd.apply_pisa(tr, density=0.5)
    assert_same(before, snapshot(tr))


def test_stats_and_report_on_a_compile_wrapper():
    tr = tiny_transformer("wan")
    compiled = torch.compile(tr, backend="eager")
    pd.apply_pisa(compiled, telemetry=True, **SPARSE)
    try:
        assert pd.pisa_state(compiled) is pd.pisa_state(tr) is not None
        with torch.no_grad():
            tr(**forward_inputs("wan"))  # the wrapped model itself, eagerly
        assert pd.stats(compiled) == pd.stats(tr) == {"sparse": 2}
        assert tm.get(compiled) is tm.get(tr) and len(tm.get(compiled).records) == 2
        summary = pd.report(compiled, console=_quiet_console())
        assert summary["transformer"]["records"] == 2
    finally:
        pd.remove_pisa(compiled)
    assert pd.pisa_state(tr) is None


def _quiet_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO())


def test_a_managed_model_refuses_deepcopy_and_pickling():
    # A copy would share the original's processors (by state handle) and undo steps: removing PISA
    # from the copy would turn it off on the original. Refused, and the original untouched.
    import copy
    import io
    import pickle

    tr, inputs = tiny_transformer("wan"), forward_inputs("wan")
    pd.apply_pisa(tr, **SPARSE)
    with torch.no_grad():
        want = tr(**inputs).sample
    before = snapshot(tr)
    with pytest.raises(TypeError, match="remove_pisa on it first"):
        copy.deepcopy(tr)
    with pytest.raises(TypeError, match="remove_pisa on it first"):  # pickling (torch.save) says so too
        pickle.dumps(tr)
    with pytest.raises(TypeError, match="remove_pisa on it first"):
        torch.save(tr, io.BytesIO())
    assert_same(before, snapshot(tr))
    with torch.no_grad():
        assert torch.equal(tr(**inputs).sample, want)
    pd.remove_pisa(tr)
    copy.deepcopy(tr)  # a model PISA no longer manages copies as before


def test_processors_replaced_after_apply_warn_once():
    # fuse_qkv_projections swaps SD3's processors for fused ones: those layers run native attention.
    tr, inputs = tiny_transformer("sd3", dual_attention_layers=()), forward_inputs("sd3")
    pd.apply_pisa(tr, **SPARSE)
    tr.fuse_qkv_projections()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="PISA runs on 0 of the 2 attention layers"):
        tr(**inputs)
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        tr(**inputs)  # the same count: said once
    pd.remove_pisa(tr)


def test_each_pipeline_call_starts_a_generation():
    # A generation starting below the last timestep of the one before (img2img, lower strength) is
    # a new one: its warm-up step runs dense and its stats start from zero. remove_pisa unhooks.
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, **{**SPARSE, "dense_steps": 1})
    with torch.no_grad():
        pipe(**prompt_kwargs("flux"), num_inference_steps=4)
        first = dict(pd.stats(pipe.transformer))
        assert pd.stats(pipe) == first  # a pipeline with one transformer names it
        pipe(**prompt_kwargs("flux"), sigmas=[0.2, 0.1], num_inference_steps=2)
        second = dict(pd.stats(pipe.transformer))
    per_step = first["dense"]  # dense calls of one step (the warm-up step)
    assert first["sparse"] == 3 * per_step
    assert second == {"dense": per_step, "warmup_step": per_step, "sparse": per_step}
    assert "set_timesteps" in pipe.scheduler.__dict__
    pd.remove_pisa(pipe)
    assert "set_timesteps" not in pipe.scheduler.__dict__


def test_sd3_fuse_remove_unfuse_leaves_a_working_model_and_apply_works_again():
    """diffusers keeps the processors it saw when fusing and puts them back when unfusing: after
    remove_pisa those are PISA processors of a removed state, which then run the processor they
    replaced; SD3's unfuse leaves ``fused_projections`` set, which does not block apply_pisa."""
    import warnings

    from pisa_attn.diffusers.processors import PisaProcessor

    tr, x = tiny_transformer("sd3", dual_attention_layers=()), forward_inputs("sd3")
    with torch.no_grad():
        ref = tr(**x).sample
    dense = dict(density=1.0, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0)
    pd.apply_pisa(tr, **dense)
    tr.fuse_qkv_projections()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the processors-replaced warning
        tr(**x)
    pd.remove_pisa(tr)
    tr.unfuse_qkv_projections()
    with torch.no_grad():
        torch.testing.assert_close(tr(**x).sample, ref)  # left-over processors run the originals
    pd.apply_pisa(tr, **dense)  # accepted although fused_projections stays True
    procs = [m.processor for m in tr.modules() if isinstance(getattr(m, "processor", None), PisaProcessor)]
    assert procs and all(type(p.original).__name__ == "JointAttnProcessor2_0" for p in procs)
    with torch.no_grad():
        torch.testing.assert_close(tr(**x).sample, ref, rtol=1e-4, atol=1e-5)
    pd.remove_pisa(tr)
    assert not any(isinstance(getattr(m, "processor", None), PisaProcessor) for m in tr.modules())


def test_failed_apply_puts_back_the_scheduler_hook(monkeypatch):
    """The earlier state comes back with its set_timesteps hook: a generation starting below the
    last timestep still gets its warm-up step."""
    kw = dict(density=0.5, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=1)
    pipe = tiny_pipeline("flux")
    pipe.set_progress_bar_config(disable=True)
    pd.apply_pisa(pipe, **kw)
    hook = pipe.scheduler.__dict__["set_timesteps"]
    monkeypatch.setattr(tm, "attach", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("telemetry broke")))
    with pytest.raises(RuntimeError, match="telemetry broke"):
        pd.apply_pisa(pipe, telemetry=0.5, **kw)
    monkeypatch.undo()
    assert pd.pisa_state(pipe.transformer) is not None and "set_timesteps" in pipe.scheduler.__dict__
    assert pipe.scheduler.__dict__["set_timesteps"] is not hook  # a new wrapper of the same kind
    with torch.no_grad():
        pipe(**prompt_kwargs("flux"), num_inference_steps=4)
        pipe(**prompt_kwargs("flux"), sigmas=[0.2, 0.1], num_inference_steps=2)
    assert pd.stats(pipe.transformer).get("warmup_step", 0) > 0


def test_remove_takes_the_scheduler_hook_off_in_any_order():
    import pickle

    p = tiny_pipeline("wan")
    p.register_modules(transformer_2=p.transformer)  # one model under both names
    pd.apply_pisa(p, **SPARSE)
    pd.remove_pisa(p)
    assert pd.pisa_state(p.transformer) is None and "set_timesteps" not in p.scheduler.__dict__
    a, b = tiny_pipeline("flux"), tiny_pipeline("flux", seed=1)
    b.register_modules(scheduler=a.scheduler)  # two pipelines, one scheduler
    for order in ((a, b), (b, a)):
        pd.apply_pisa(a, **SPARSE)
        pd.apply_pisa(b, **SPARSE)
        pd.remove_pisa(order[0])
        assert "set_timesteps" in a.scheduler.__dict__  # the other pipeline still needs it
        pd.remove_pisa(order[1])
        assert "set_timesteps" not in a.scheduler.__dict__
    pickle.dumps(a.scheduler)


def test_forward_wrapped_after_apply_survives_remove():
    """A wrapper put on a hooked module's forward after apply_pisa (as accelerate's CPU offload does:
    it keeps the forward it found and calls it) stays through remove_pisa; PISA's hook there is left
    as a pass-through, and a second apply takes it up again."""
    tr, inputs = tiny_transformer("flux"), forward_inputs("flux")
    with torch.no_grad():
        native = tr(**inputs).sample
    pd.apply_pisa(tr, **{**SPARSE, "density": 1.0})
    calls, inners = [], {}
    for name in ("x_embedder", "proj_out"):
        mod = tr.get_submodule(name)
        inner = inners[name] = mod.forward

        def outer(*args, _inner=inner, _name=name, **kwargs):
            calls.append(_name)
            return _inner(*args, **kwargs)

        mod.forward = outer
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(tr(**inputs).sample, native, atol=1e-5, rtol=0)
        pd.remove_pisa(tr)
        calls.clear()
        with torch.no_grad():
            assert torch.equal(tr(**inputs).sample, native)
        assert calls == ["x_embedder", "proj_out"]
        pd.apply_pisa(tr, **{**SPARSE, "density": 1.0})
    pd.remove_pisa(tr)
    # the wrappers taken off again (as accelerate's remove_hook_from_module puts back the forward it
    # kept): a later apply and remove leave the modules as they were before the first apply
    for name, inner in inners.items():
        tr.get_submodule(name).forward = inner
    pd.apply_pisa(tr, **{**SPARSE, "density": 1.0})
    pd.remove_pisa(tr)
    for name in inners:
        assert not {"forward", "_diffusers_hook"} & set(tr.get_submodule(name).__dict__), name
    with torch.no_grad():
        assert torch.equal(tr(**inputs).sample, native)


def test_tensor_parallel_refused_at_apply_and_at_the_forward():
    # diffusers' tensor parallelism shards the projections by heads while attn.heads stays whole
    from diffusers.models._modeling_parallel import ParallelConfig, TensorParallelConfig

    tp = ParallelConfig(tensor_parallel_config=TensorParallelConfig(tp_degree=2))
    tr = tiny_transformer("flux")
    tr._parallel_config = tp
    before = snapshot(tr)
    with pytest.raises(ValueError, match="tensor parallelism"):
        pd.apply_pisa(tr, **SPARSE)
    assert_same(before, snapshot(tr))
    tr._parallel_config = None
    pd.apply_pisa(tr, **SPARSE)
    tr._parallel_config = tp  # enabled after apply_pisa: refused at the forward, before any attention
    with pytest.raises(ValueError, match="tensor parallelism"), torch.no_grad():
        tr(**forward_inputs("flux"))
    tr._parallel_config = None
    pd.remove_pisa(tr)


def _two_experts():
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=tiny_transformer("wan", 0), transformer_2=tiny_transformer("wan", 1),
                       boundary_ratio=0.5)


def test_a_table_of_one_expert_is_not_used_for_the_other():
    """Wan2.2-like: a table naming one expert is refused for a pipeline of two (the other expert's
    weights would be silently the first's), and a table of both experts is refused for a bare
    transformer (it cannot say which entry is its own)."""
    from pisa_attn import alpha_table as at

    pipe = _two_experts()
    s = {"density": 0.5, "mode": "hybrid", "covariance_aware": False, "block_size": TILE_BLOCK}
    heads = pipe.transformer.config.num_attention_heads
    one = at.AlphaTable({"transformer_2": {0: at.LayerAlpha((0.9,) * heads)}}, dict(s), model="wan")
    before = snapshot(pipe.transformer)
    with pytest.raises(ValueError, match=r"alpha_table has no weights for 'transformer' \(it has \['transformer_2'\]\)"):
        pd.apply_pisa(pipe, alpha_table=one, **SPARSE)
    assert_same(before, snapshot(pipe.transformer))
    assert pd.pisa_state(pipe.transformer_2) is None
    both = at.AlphaTable({"transformer": {0: at.LayerAlpha((0.1,) * heads)},
                          "transformer_2": {0: at.LayerAlpha((0.9,) * heads)}}, dict(s), model="wan")
    with pytest.raises(ValueError, match="pass the pipeline"):
        pd.apply_pisa(pipe.transformer_2, alpha_table=both, **SPARSE)
    pd.apply_pisa(pipe, alpha_table=both, **SPARSE)
    assert pd.pisa_state(pipe.transformer_2).alphas[0].tolist() == [0.9] * heads
    pd.remove_pisa(pipe)


def test_a_table_of_two_experts_under_different_settings_is_refused():
    pipe = _two_experts()
    pd.apply_pisa(pipe.transformer, **{**SPARSE, "alpha": 0.5})
    pd.apply_pisa(pipe.transformer_2, **{**SPARSE, "alpha": 0.5, "density": 0.25})
    with pytest.raises(ValueError, match="different settings"):
        pd.alpha_table(pipe)
    pd.remove_pisa(pipe)


def test_a_table_under_query_block_is_warned():
    from pisa_attn import alpha_table as at

    tr = tiny_transformer("wan")
    heads = tr.config.num_attention_heads
    s = {"density": 0.5, "mode": "hybrid", "covariance_aware": False, "block_size": TILE_BLOCK}
    table = at.AlphaTable({"transformer": {0: at.LayerAlpha((0.9,) * heads)}}, s, model="wan")
    with pytest.warns(RuntimeWarning, match=f"query_block None vs {2 * TILE_BLOCK}"):
        pd.apply_pisa(tr, alpha_table=table, **{**SPARSE, "covariance_aware": False, "query_block": 2 * TILE_BLOCK})
    pd.remove_pisa(tr)


def test_a_failed_apply_puts_back_one_calibrator_and_remove_takes_it(monkeypatch):
    """The observer lists come back with the rollback, calibrator included: re-installing the
    earlier state must not attach it a second time (every warm-up call sampled twice, and one copy
    left on the model after remove_pisa)."""
    from pisa_attn.diffusers import hooks

    pipe = tiny_pipeline("wan")
    tr = pipe.transformer
    pd.apply_pisa(pipe, **{**SPARSE, "dense_steps": 1}, calibrate=True)
    monkeypatch.setattr(tm, "attach", lambda transformer, config=True: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        pd.apply_pisa(pipe, telemetry=0.5, **{**SPARSE, "dense_steps": 1, "density": 0.25})
    monkeypatch.undo()
    assert hooks.observers(tr) == [pd.pisa_state(tr).calibrator.observe]
    pd.remove_pisa(pipe)
    assert hooks.observers(tr) == []


def test_an_expert_applied_again_keeps_the_shared_step_count():
    """Re-applying one expert of a two-expert pipeline (other settings for it) keeps the step count
    the experts share and its scheduler hooks: its steps are not counted from 0 again when the
    pipeline switches to it."""
    pipe = _two_experts()
    pd.apply_pisa(pipe, **SPARSE)
    shared = pd.pisa_state(pipe.transformer).tracker
    pd.apply_pisa(pipe.transformer_2, **{**SPARSE, "density": 0.25})
    st2 = pd.pisa_state(pipe.transformer_2)
    assert st2.tracker is shared and st2.scheduler is pipe.scheduler
    pd.remove_pisa(pipe.transformer)
    assert "step" in pipe.scheduler.__dict__ and "set_timesteps" in pipe.scheduler.__dict__  # the expert's own
    pd.remove_pisa(pipe.transformer_2)
    assert "step" not in pipe.scheduler.__dict__ and "set_timesteps" not in pipe.scheduler.__dict__


def test_bfloat16_timesteps_of_two_steps_count_as_two():
    """FLUX passes timesteps in the latents' dtype; in bfloat16 neighbouring steps near t = 1000
    round to one value. The pipeline's scheduler.step marks each step's end, so dense_steps=2 runs
    exactly two steps dense."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = tiny_pipeline("flux")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=16,
                                                     max_image_seq_len=256, base_shift=0.5, max_shift=3.23)
    pipe.to(torch.bfloat16)
    pd.apply_pisa(pipe, **{**SPARSE, "dense_steps": 2})
    seen = []
    remove = pd.hooks.add_observer(pipe.transformer, lambda c: c.layer == 0 and seen.append((c.step, c.dense)))
    kw = prompt_kwargs("flux")
    kw = {k: v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
    with torch.no_grad():
        pipe(**kw, num_inference_steps=28)
    remove()
    pd.remove_pisa(pipe)
    assert [s for s, _ in seen] == list(range(28)), seen
    assert [d for _, d in seen] == [True, True] + [False] * 26


def test_observers_of_a_compiled_wrapper_and_a_non_callable():
    from pisa_attn.diffusers import hooks

    tr = tiny_transformer("wan")
    wrapped = torch.compile(tr)
    remove = hooks.add_observer(wrapped, print)
    assert hooks.observers(tr) == [print] and hooks.observers(wrapped) == [print]
    remove()
    with pytest.raises(TypeError, match="fn must be callable"):
        hooks.add_observer(tr, "not a function")


def test_calibrate_says_when_an_expert_saw_no_warm_up_call():
    """Wan2.2-like, dense_steps inside the first expert: the second never sees a warm-up call, so
    its sparse calls keep the uncalibrated weight, and apply_pisa says so."""
    pipe = _two_experts()
    pd.apply_pisa(pipe, **{**SPARSE, "dense_steps": 2}, calibrate=True)
    with pytest.warns(RuntimeWarning, match="no dense warm-up call of this transformer was sampled"):
        with torch.no_grad():
            pipe(**prompt_kwargs("wan"), num_inference_steps=6)
    pd.remove_pisa(pipe)


def test_the_second_expert_reports_nothing_of_the_last_generation_before_its_first_call():
    """Wan2.2: mid-generation, before the second expert runs, its stats and fits are not the last
    generation's (its first call would forget them; a read does too)."""
    pipe = _two_experts()
    pd.apply_pisa(pipe, calibrate=True, **{**SPARSE, "dense_steps": 4})
    with torch.no_grad():
        pipe(**prompt_kwargs("wan", seed=0), num_inference_steps=6)
    assert pd.stats(pipe.transformer_2) and pd.alpha_table(pipe).layers("transformer_2")
    seen = {}

    def mid(p, i, t, kw):
        if i == 0:
            seen["stats"], seen["table"] = pd.stats(p.transformer_2), pd.alpha_table(p)
        return kw

    with torch.no_grad():
        pipe(**prompt_kwargs("wan", seed=5), num_inference_steps=6, callback_on_step_end=mid)
    assert seen["stats"] == {} and seen["table"].layers("transformer_2") == {}
    assert pd.stats(pipe.transformer_2)  # it ran later in the generation
    pd.remove_pisa(pipe)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_forwards_under_inference_mode_and_no_grad_agree(family):
    """Pipelines run under torch.inference_mode() too: FLUX's ids (no version counter there) and
    the calibration's running sums, made in one mode and updated in the other, must work."""
    tr = tiny_transformer(family)
    pd.apply_pisa(tr, density=0.25, block_size=16, min_kv_len=0, dense_layers=0, dense_steps=1, calibrate=True)
    try:
        outs = []
        for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
            with mode():
                outs.append(tr(**forward_inputs(family)).sample)
    finally:
        pd.remove_pisa(tr)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_telemetry_false_is_off_as_calibrate_false_is():
    tr = tiny_transformer("wan")
    pd.apply_pisa(tr, telemetry=False, calibrate=False, **SPARSE)
    try:
        assert tm.get(tr) is None and pd.pisa_state(tr).calibrator is None
    finally:
        pd.remove_pisa(tr)
