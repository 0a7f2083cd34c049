"""Per-layer error telemetry of apply_pisa: sampling counts, measurements, report and heat-map."""

import io
import random

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers_tiny import forward_inputs, prompt_kwargs, tiny_pipeline, tiny_transformer  # noqa: E402
from pisa_attn import pisa_attention  # noqa: E402
from pisa_attn import metrics  # noqa: E402
from pisa_attn.data import dit_qkv  # noqa: E402
from pisa_attn.diffusers import hooks  # noqa: E402
from pisa_attn.diffusers import telemetry as tm  # noqa: E402

LAYERS, STEPS = 4, 3  # tiny FLUX: 4 managed attention layers per forward
SPARSE = dict(density=0.25, block_size=16, min_kv_len=0, dense_layers=1, dense_steps=1)


@pytest.fixture(scope="module")
def every_call():
    """A tiny FLUX run measured on every call; an extra observer checks the backend's sparse
    outputs against the PISA recomputation measure() uses for dense calls."""
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, telemetry=tm.TelemetryConfig(every=1), **SPARSE)
    checked = []

    def check(call):
        if call.dense:
            return
        lo, hi = call.meta["image_range"]
        out = pisa_attention(call.q[:, :, lo:hi], call.k, call.v, density=call.density, block_size=call.block_size,
                             mode=call.mode, covariance_aware=call.covariance_aware, keep_blocks=call.keep_blocks)
        checked.append(float((out - call.out[:, :, lo:hi]).abs().max()))

    remove = hooks.add_observer(pipe.transformer, check)
    pipe(**prompt_kwargs("flux"), num_inference_steps=STEPS)
    remove()
    return pipe, checked


def _fed_module(config, dense_pattern):
    """A bare module with telemetry attached, notified of small synthetic calls."""
    module = torch.nn.Linear(1, 1)
    tm.attach(module, config)
    call = _call(dense=False, grid=(1, 8, 16), text=0)[0]
    for i, dense in enumerate(dense_pattern):
        c = hooks.AttentionCall(**{**call.__dict__, "layer": i % LAYERS, "step": i // LAYERS, "dense": dense})
        hooks.notify(module, c)
    return module


def _feed(config, dense_pattern):
    """The telemetry of :func:`_fed_module`."""
    return tm.get(_fed_module(config, dense_pattern))


def test_every_nth_call_is_measured():
    t = _feed(tm.TelemetryConfig(every=3), [False] * 12)
    assert (t.calls, t.eligible, t.sampled, len(t.records), t.skipped) == (12, 12, 4, 4, 0)
    assert [r["call"] for r in t.records] == [0, 3, 6, 9]
    assert [(r["layer"], r["step"]) for r in t.records] == [(i % LAYERS, i // LAYERS) for i in (0, 3, 6, 9)]


def test_sample_rate_is_seeded_and_dense_calls_can_be_excluded():
    pattern = [i % 3 == 0 for i in range(12)]
    t = _feed(tm.TelemetryConfig(sample_rate=0.5, seed=7, include_dense=False), pattern)
    rng = random.Random(7)
    expect = sum(rng.random() < 0.5 for _ in range(8))
    assert (t.calls, t.eligible, t.sampled, len(t.records)) == (12, 8, expect, expect)
    assert all(not r["dense"] for r in t.records)
    assert _feed(0.5, pattern).eligible == 12  # a float is a sampling rate; dense calls count


def test_a_measurement_that_raises_is_counted_and_the_forward_goes_on(monkeypatch):
    """Out of memory in the dense reference (say) skips that record, warns once, and is reported;
    the user's generation is not failed by a diagnostic."""
    import logging

    real, n = tm.measure, [0]

    def flaky(call, drop=True):
        n[0] += 1
        if n[0] % 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(call, drop=drop)

    monkeypatch.setattr(tm, "measure", flaky)
    monkeypatch.setattr(tm, "log_once", lambda msg, level: said.append((msg, level)))
    said = []
    module = _fed_module(tm.TelemetryConfig(), [False] * 4)
    t = tm.get(module)
    assert (t.sampled, len(t.records), t.failed) == (4, 2, 2)
    assert t.first_error == "OutOfMemoryError: CUDA out of memory (test)"
    assert said and all(level == logging.WARNING and "could not be measured" in m for m, level in said)
    summary = tm.summarize(t)
    assert (summary["failed"], summary["first_error"]) == (2, t.first_error)
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    tm.report(module, console=console)
    assert "2 sampled call(s) could not be measured" in console.file.getvalue()
    module = torch.nn.Linear(1, 1)
    tel = tm.attach(module, True)
    monkeypatch.setattr(tm, "measure", lambda call, drop=True: 1 / 0)
    hooks.notify(module, _call(dense=False, grid=(1, 8, 16), text=0)[0])
    assert tel.failed == 1
    with pytest.raises(ValueError, match="ZeroDivisionError"):  # nothing measured: says why
        tm.report(module, console=None)


def test_max_records_caps_measurements():
    t = _feed(tm.TelemetryConfig(max_records=5), [False] * 9)
    assert (t.sampled, len(t.records), t.skipped) == (9, 5, 4)


def test_records_and_sparse_outputs_are_consistent(every_call):
    pipe, checked = every_call
    t = tm.get(pipe.transformer)
    assert (t.calls, t.sampled, len(t.records)) == (LAYERS * STEPS,) * 3
    for r in t.records:
        assert r["dense"] == (r["step"] == 0 or r["layer"] == 0)
        assert 0.0 < r["tail_mass"] < 1.0 and len(r["tail_mass_per_head"]) == 2
        assert 0.0 < r["rel_l1_pisa"] < r["rel_l1_drop"]  # the tiny model's tails are far from negligible
        assert r["density"] == 0.25 and r["mode"] == "hybrid"
    # measure() recomputes PISA for dense calls: it must be what the backend runs on sparse ones.
    assert len(checked) == (STEPS - 1) * (LAYERS - 1) and max(checked) < 1e-5


def _call(dense: bool, grid=(2, 16, 16), text: int = 64, scale=None, query_block=None):
    g = dit_qkv(grid, heads=2, head_dim=32, text_tokens=text, text_position="before", seed=1)
    keep = g.keep_blocks(64)
    # The image queries (one contiguous run here), the ones the backend runs PISA on.
    lo, hi = g.token_layout.text_mask_tokens().logical_not().nonzero()[[0, -1], 0].tolist()
    assert hi + 1 - lo == g.token_layout.num_tokens - text
    q = g.q[:, :, lo:hi + 1]
    kw = dict(density=0.25, block_size=64, mode="hybrid", covariance_aware=False, keep_blocks=keep, scale=scale,
              query_block=query_block)
    dense_out = torch.nn.functional.scaled_dot_product_attention(g.q, g.k, g.v, scale=scale)
    out = dense_out.clone()
    if not dense:
        out[:, :, lo:hi + 1] = pisa_attention(q, g.k, g.v, **kw)
    meta = {"image_range": (lo, hi + 1), "key_lens": None, "dense_reason": "warmup_step" if dense else None}
    call = hooks.AttentionCall(model="synthetic", layer=0, step=0, q=g.q, k=g.k, v=g.v, out=out, dense=dense,
                               density=0.25, mode="hybrid", covariance_aware=False, block_size=64, keep_blocks=keep,
                               meta=meta, scale=scale, query_block=query_block)
    return call, q, g, kw, dense_out[:, :, lo:hi + 1]


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default_scale", "scale0.3"])
def test_measure_agrees_between_dense_and_sparse_calls(scale):
    # A record's scale (None: 1/sqrt(32)) drives every recomputation: dense, drop, PISA, tail mass.
    sparse, q, g, kw, dense = _call(dense=False, scale=scale)
    assert sparse.scale == (32**-0.5 if scale is None else scale)
    a, b = tm.measure(sparse), tm.measure(_call(dense=True, scale=scale)[0])
    for key in ("tail_mass", "rel_l1_pisa", "rel_l1_drop"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    drop = pisa_attention(q, g.k, g.v, **{**kw, "mode": "drop"})
    assert a["rel_l1_drop"] == pytest.approx(metrics.rel_l1(drop, dense), rel=1e-5)
    lo, hi = sparse.meta["image_range"]
    assert a["rel_l1_pisa"] == pytest.approx(metrics.rel_l1(sparse.out[:, :, lo:hi], dense), rel=1e-5)
    sel = metrics.select(q, g.k, g.v, density=0.25, block_size=64, keep_blocks=kw["keep_blocks"], scale=sparse.scale)
    p = torch.softmax(q.double() @ g.k.double().transpose(-1, -2) * sparse.scale, -1)
    rows, keys = torch.arange(q.shape[2]) // 64, torch.arange(g.k.shape[2]) // 64
    exact = sel.selected.index_select(2, rows).index_select(-1, keys)
    assert a["tail_mass"] == pytest.approx(float(p.masked_fill(exact, 0).sum(-1).mean()), rel=1e-5)
    assert tm.measure(sparse, drop=False)["rel_l1_drop"] is None


def test_measure_uses_the_calls_query_block():
    """Under query_block the recorded errors are those of the selection the call ran with: a sparse
    call's own output and its dense twin's recomputation agree, and the drop error is the drop
    error at that selection."""
    sparse, q, g, kw, dense = _call(dense=False, query_block=128)
    a, b = tm.measure(sparse), tm.measure(_call(dense=True, query_block=128)[0])
    for key in ("tail_mass", "rel_l1_pisa", "rel_l1_drop"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    drop = pisa_attention(q, g.k, g.v, **{**kw, "mode": "drop"})
    assert a["rel_l1_drop"] == pytest.approx(metrics.rel_l1(drop, dense), rel=1e-5)
    per_block = tm.measure(_call(dense=True)[0])
    assert a["rel_l1_drop"] != pytest.approx(per_block["rel_l1_drop"], rel=1e-3)  # another selection


def test_hunyuan_dense_warmup_calls_measure_only_valid_keys():
    # HunyuanVideo pads its text keys. A dense warm-up call must be measured on the valid keys, as
    # the sparse call on the same inputs is: padded keys counted as valid change ρ and the errors.
    tr, inputs = tiny_transformer("hunyuan"), forward_inputs("hunyuan")
    settings = dict(density=0.25, block_size=16, min_kv_len=0, dense_layers=0, telemetry=tm.TelemetryConfig(every=1))
    records, calls = {}, []
    with torch.no_grad():
        for dense_steps in (1, 0):  # the one forward is step 0: a warm-up step, then not
            pd.apply_pisa(tr, dense_steps=dense_steps, **settings)
            remove = hooks.add_observer(tr, calls.append)
            tr(**inputs)
            remove()
            records[dense_steps] = tm.get(tr).records
        pd.remove_pisa(tr)
    dense, sparse = records[1], records[0]
    assert [r["dense"] for r in dense] == [True, True] and [r["dense"] for r in sparse] == [False, False]
    n = calls[0].k.shape[2]
    assert all(c.meta["key_lens"] == [n - 3] for c in calls)  # 5 of 8 text tokens are valid
    assert torch.equal(calls[0].k, calls[2].k)  # layer 0 sees the same q/k/v in both forwards
    a, b = dense[0], sparse[0]
    for key in ("tail_mass", "rel_l1_pisa", "rel_l1_drop"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert a["rel_l1_pisa"] > 0.0


def test_report_prints_table_and_saves_heatmap(every_call, tmp_path):
    buf = io.StringIO()
    from rich.console import Console

    assert pd.report is tm.report  # the package exports it
    out = tm.report(every_call[0], heatmap=tmp_path / "h.png", console=Console(file=buf, width=160))
    s = out["transformer"]
    assert s["records"] == sum(r["samples"] for r in s["layers"]) == LAYERS * STEPS
    assert [r["layer"] for r in s["layers"]] == list(range(LAYERS))
    assert s["heatmap"]["steps"] == list(range(STEPS)) and len(s["heatmap"]["rel_l1_pisa"]) == LAYERS
    text = buf.getvalue()
    assert "rel-L1 PISA" in text and "tail mass" in text
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_remove_pisa_detaches_but_keeps_records(every_call):
    pipe, _ = every_call
    n = len(tm.get(pipe.transformer).records)
    pd.remove_pisa(pipe)
    assert not tm.get(pipe.transformer).active and not hooks.observers(pipe.transformer)
    pipe(**prompt_kwargs("flux"), num_inference_steps=1)
    assert len(tm.get(pipe.transformer).records) == n
    assert tm.report(pipe, console=_quiet())["transformer"]["records"] == n
    # removed, the transformer saves as any model does (its kept records included)
    import pickle

    assert len(pickle.loads(pickle.dumps(pipe.transformer)).__dict__[tm.ATTR].records) == n


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO())


def test_bad_config_and_missing_telemetry():
    with pytest.raises(ValueError, match="sample_rate"):
        tm.TelemetryConfig(sample_rate=0.0)
    with pytest.raises(ValueError, match="every"):
        tm.TelemetryConfig(every=0)
    with pytest.raises(ValueError, match="max_records"):
        tm.TelemetryConfig(max_records=0)
    with pytest.raises(TypeError, match="telemetry"):
        tm.as_config("often")
    with pytest.raises(ValueError, match="telemetry must be"):  # the argument the user wrote
        tm.as_config(1.5)
    for name in ("drop", "include_dense"):
        with pytest.raises(TypeError, match=name):
            tm.TelemetryConfig(**{name: "no"})
    with pytest.raises(ValueError, match="sample_rate"):
        tm.TelemetryConfig(sample_rate=np.float32(1.5))
    with pytest.raises(ValueError, match="every"):
        tm.TelemetryConfig(every=np.float64(2.0))  # a float is no count, numpy's either


def test_numpy_numbers_configure_telemetry_as_python_numbers():
    cfg = tm.TelemetryConfig(sample_rate=np.float32(0.25), every=np.int64(3), seed=np.int32(7),
                             max_records=np.uint16(9))  # fmt: skip
    assert (cfg.sample_rate, cfg.every, cfg.seed, cfg.max_records) == (0.25, 3, 7, 9)
    assert all(type(x) in (float, int) for x in (cfg.sample_rate, cfg.every, cfg.seed, cfg.max_records))
    assert tm.as_config(np.float16(0.5)).sample_rate == 0.5


def test_report_without_telemetry_is_refused():
    pipe = tiny_pipeline("flux")
    with pytest.raises(ValueError, match="no telemetry"):
        tm.report(pipe)
    with pytest.raises(TypeError, match="pipe_or_transformer"):
        tm.report(object())


def test_measure_follows_the_backend_when_the_image_starts_mid_block():
    # 13 text tokens before the image (blocks of 16): measure() must recompute PISA (for dense
    # calls) and the selection exactly as the backend runs the image queries.
    tr = tiny_transformer("flux")
    inputs = forward_inputs("flux")
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, :13]
    inputs["txt_ids"] = inputs["txt_ids"][:13]
    calls = []
    pd.apply_pisa(tr, density=0.25, block_size=16, min_kv_len=0, dense_layers=0, dense_steps=0)
    remove = hooks.add_observer(tr, calls.append)
    try:
        with torch.no_grad():
            tr(**inputs)
    finally:
        remove()
        pd.remove_pisa(tr)
    assert calls and all(not c.dense and c.meta["image_range"][0] == 13 for c in calls)
    for call in calls:
        sparse = tm.measure(call)
        as_dense = tm.measure(hooks.AttentionCall(**{**call.__dict__, "dense": True}))
        for key in ("tail_mass", "rel_l1_pisa", "rel_l1_drop"):
            assert sparse[key] == pytest.approx(as_dense[key], rel=1e-5), key


def test_measure_recomputes_with_the_calls_backend_and_precision(monkeypatch):
    """A dense call's "what PISA would give" and the drop run use the backend and precision the
    sparse calls run with (an fp8 model's telemetry must not report bf16 errors)."""
    seen = []

    def spy(*args, **kw):
        seen.append((kw["backend"], kw["precision"]))
        return pisa_attention(*args, **{**kw, "backend": "reference", "precision": "input"})

    monkeypatch.setattr(tm, "pisa_attention", spy)
    call, *_ = _call(dense=True)
    call = hooks.AttentionCall(**{**call.__dict__, "backend": "hopper", "precision": "fp8"})
    tm.measure(call)
    assert seen == [("hopper", "fp8")] * 2  # PISA and drop


def test_managed_calls_report_their_backend_and_precision():
    tr = tiny_transformer("flux")
    calls = []
    pd.apply_pisa(tr, density=0.25, block_size=16, min_kv_len=0, dense_layers=0, dense_steps=0, backend="reference")
    remove = hooks.add_observer(tr, calls.append)
    try:
        with torch.no_grad():
            tr(**forward_inputs("flux"))
    finally:
        remove()
        pd.remove_pisa(tr)
    assert calls and all((c.backend, c.precision) == ("reference", "input") for c in calls)


def test_measure_reports_the_selection_rule_and_the_signed_bias():
    sparse, q, g, kw, dense = _call(dense=False)
    r = tm.measure(sparse)
    lo, hi = sparse.meta["image_range"]
    e = sparse.out[:, :, lo:hi].double() - dense.double()
    want = float(e.mean(dim=2).abs().mean() / dense.double().abs().mean())
    assert r["covariance_aware"] is False
    assert r["bias_pisa"] == pytest.approx(want, rel=1e-6) and 0 < r["bias_pisa"] < r["rel_l1_pisa"]
    assert tm._selection([False, False]) == "top-k" and tm._selection([True]) == "cov"
    assert tm._selection([True, False]) == "mixed" and tm._selection([None]) == "-"


def test_attach_to_a_compiled_wrapper_is_the_models_telemetry():
    # hooks.add_observer takes the torch.compile wrapper of a model: the telemetry attached through
    # it must be the one get/report/detach find, and attaching again must replace it
    module = torch.nn.Linear(1, 1)
    compiled = torch.compile(module)
    first = tm.attach(compiled, tm.TelemetryConfig(every=1))
    assert tm.get(compiled) is first and tm.get(module) is first
    second = tm.attach(compiled, tm.TelemetryConfig(every=1))
    assert not first.active and hooks.observers(module) == [second.observe]
    assert tm.ATTR not in compiled.__dict__


def test_heatmap_leaves_the_matplotlib_backend_alone(every_call, tmp_path):
    # a notebook's interactive backend must survive report(heatmap=...)
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    plt.switch_backend("svg")
    try:
        tm.report(every_call[0], heatmap=tmp_path / "h.png", console=_quiet())
        assert matplotlib.get_backend() == "svg"
        assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        plt.switch_backend(before)


@pytest.mark.parametrize("name", ["h.pgf", "h.txt", "h"])
def test_heatmap_of_a_format_it_cannot_write_is_refused_before_the_report(every_call, tmp_path, name):
    from rich.console import Console

    # pgf needs TeX: it used to fail only after the table had been printed
    buf = io.StringIO()
    with pytest.raises(ValueError, match="heatmap"):
        tm.report(every_call[0], heatmap=tmp_path / name, console=Console(file=buf, width=160))
    assert buf.getvalue() == "" and not list(tmp_path.iterdir())
