"""The first-order weight in the diffusers integration: ``apply_pisa(alpha=, calibrate=, alpha_table=)``
on tiny random-weight models (CPU)."""

import io

import pytest
import torch

pytest.importorskip("diffusers")

import pisa_attn.diffusers as pd  # noqa: E402
from diffusers_tiny import TILE_BLOCK, forward_inputs, prompt_kwargs, tiny_pipeline, tiny_transformer  # noqa: E402
from pisa_attn import alpha_table as at  # noqa: E402
from pisa_attn import calibration as cal  # noqa: E402
from pisa_attn import spec  # noqa: E402
from pisa_attn.layout import block_floor  # noqa: E402

RUN = dict(density=0.25, block_size=TILE_BLOCK, min_kv_len=0, dense_layers=0, dense_steps=1)


def _generate(pipe, family, seed=0):
    with torch.no_grad():
        return pipe(**prompt_kwargs(family, seed=seed), num_inference_steps=3)[0]


class _Calls:
    """Records every managed call's (layer, step, dense, alpha) and the first warm-up call per layer."""

    def __init__(self, tr):
        self.seen, self.warmup = [], {}
        self.remove = pd.hooks.add_observer(tr, self)

    def __call__(self, call):
        self.seen.append((call.layer, call.step, call.dense, call.alpha))
        if call.dense and call.layer not in self.warmup:
            self.warmup[call.layer] = call


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_calibrated_run_equals_a_run_with_its_table(family):
    """The weights frozen at the first sparse step are used by every sparse call and saved by
    alpha_table(); loading that table reproduces the run exactly; they differ from the default."""
    pipe = tiny_pipeline(family)
    pd.apply_pisa(pipe, calibrate=True, **RUN)
    calls = _Calls(pipe.transformer)
    out = _generate(pipe, family)
    table = pd.alpha_table(pipe)
    layers = table.layers()
    state = pd.pisa_state(pipe.transformer)
    assert sorted(layers) == list(range(len(state.blocks)))
    for i, entry in layers.items():
        assert len(entry.alpha) == 2 and all(0.0 <= a <= 1.0 for a in entry.alpha)
        assert 0.0 < entry.tail_mass < 1.0 and entry.rows > 0
        assert entry.residual_vs_paper <= 1.0 + 1e-12  # the fit never does worse than weight 1 on its rows
    sparse = [(layer, a) for layer, step, dense, a in calls.seen if not dense]
    assert sparse and all(a == layers[layer].alpha for layer, a in sparse)
    warm = [a for _, _, dense, a in calls.seen if dense]
    assert all(a == (spec.DEFAULT_ALPHA,) * 2 for a in warm)  # before the freeze: what the layer had
    calls.remove()
    pd.remove_pisa(pipe)

    pd.apply_pisa(pipe, alpha_table=table.to_json(), **RUN)
    torch.testing.assert_close(_generate(pipe, family), out, rtol=0, atol=0)
    pd.remove_pisa(pipe)
    pd.apply_pisa(pipe, **RUN)
    assert not torch.equal(_generate(pipe, family), out)
    pd.remove_pisa(pipe)


def test_calibration_is_the_fit_of_the_warmup_rows():
    """With every query row sampled (16-row blocks: one run each), a layer's weight is the least-squares fit of its warm-up
    call (image queries, text key blocks kept exact, the call's scale and selection: FLUX's default
    is covariance-aware)."""
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, calibrate=pd.CalibrationConfig(rows=10**6, choose_selection=False), **RUN)
    calls = _Calls(pipe.transformer)
    _generate(pipe, "flux")
    frozen = pd.pisa_state(pipe.transformer).calibrator.frozen
    for layer, call in calls.warmup.items():
        lo, hi = call.meta["image_range"]
        start = block_floor(lo, TILE_BLOCK)
        fit = cal.fit_rows(call.q[:, :, start:hi], call.k, call.v, density=call.density, block_size=TILE_BLOCK,
                           measured=(lo - start, hi - start), keep_blocks=call.keep_blocks, scale=call.scale,
                           covariance_aware=call.covariance_aware)
        want = fit.stats.alpha(default=spec.DEFAULT_ALPHA, bounds=cal.FIT_BOUNDS)
        assert call.covariance_aware
        torch.testing.assert_close(frozen[layer], want, rtol=1e-6, atol=1e-6)
    pd.remove_pisa(pipe)


def test_calibration_chooses_the_selection_rule_per_layer_and_sparse_calls_use_it():
    """With choose_selection (the default) both rules are fitted on the same warm-up rows; each
    layer keeps the rule of the smaller squared error at its fitted weights, the sparse calls run
    it, the table stores it and a run loading that table reproduces the calibrated run."""
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, calibrate=pd.CalibrationConfig(rows=10**6), **RUN)
    calls = _Calls(pipe.transformer)
    out = _generate(pipe, "flux")
    state = pd.pisa_state(pipe.transformer)
    cal_ = state.calibrator
    rules = cal_.selection()
    assert sorted(rules) == sorted(cal_.frozen)
    for layer, by_rule in cal_.fits.items():
        assert set(by_rule) == {False, True}
        err = {r: float(f.stats.residual(f.stats.alpha(default=spec.DEFAULT_ALPHA, bounds=cal.FIT_BOUNDS)).sum())
               for r, f in by_rule.items()}
        assert rules[layer] == (err[True] < err[False])
    table = pd.alpha_table(pipe)
    assert {i: x.covariance_aware for i, x in table.layers().items()} == rules
    calls.remove()
    pd.remove_pisa(pipe)
    clash = not rules[min(rules)]  # an explicit rule one fitted layer contradicts: refused, nothing installed
    with pytest.raises(ValueError, match=f"covariance_aware={clash}.*layers"):
        pd.apply_pisa(pipe, alpha_table=table.to_json(), covariance_aware=clash, **RUN)
    assert pd.pisa_state(pipe.transformer) is None
    pd.apply_pisa(pipe, alpha_table=table.to_json(), **RUN)
    assert pd.pisa_state(pipe.transformer).rules == rules
    torch.testing.assert_close(_generate(pipe, "flux"), out, rtol=0, atol=0)
    pd.remove_pisa(pipe)


def test_each_generation_fits_anew_and_dense_layers_are_skipped():
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, calibrate=True, **{**RUN, "dense_layers": 1})
    cal_ = pd.pisa_state(pipe.transformer).calibrator
    _generate(pipe, "flux", seed=0)
    first = {i: a.clone() for i, a in cal_.frozen.items()}
    assert 0 not in first and sorted(first) == [1, 2, 3]  # block 0 always runs dense: no weight needed
    n_calls = cal_.calls
    _generate(pipe, "flux", seed=5)
    assert cal_.calls == n_calls  # counted per generation, not accumulated
    assert any(not torch.equal(first[i], cal_.frozen[i]) for i in first)
    # A transformer called directly (no pipeline hook): a rising timestep starts a generation too.
    pd.remove_pisa(pipe)
    tr = pipe.transformer
    pd.apply_pisa(tr, calibrate=True, **RUN)
    c = pd.pisa_state(tr).calibrator
    inputs = forward_inputs("flux")
    with torch.no_grad():
        for t in (0.9, 0.5, 0.9, 0.5):  # steps 0, 1, then a new generation
            tr(**{**inputs, "timestep": torch.full((1,), t)})
    assert c.frozen is not None and c.calls == 4  # the second generation's warm-up step, 4 layers
    pd.remove_pisa(tr)
    assert pd.hooks.observers(tr) == []


def test_fixed_alpha_and_per_head_alpha_reach_the_calls():
    tr = tiny_transformer("wan")
    for alpha, want in ((0.5, (0.5, 0.5)), (torch.tensor([0.25, 1.0]), (0.25, 1.0)), (None, (spec.DEFAULT_ALPHA,) * 2),
                        ([0.5], (0.5, 0.5)), ((0.75,), (0.75, 0.75))):  # one value: every head's, as in pisa_attention
        pd.apply_pisa(tr, alpha=alpha, **{**RUN, "dense_steps": 0})
        calls = _Calls(tr)
        with torch.no_grad():
            tr(**forward_inputs("wan"))
        assert [a for *_, a in calls.seen] == [want, want]
        calls.remove()
        pd.remove_pisa(tr)
    pd.apply_pisa(tr, mode="zeroth", **{**RUN, "dense_steps": 0})
    calls = _Calls(tr)
    with torch.no_grad():
        tr(**forward_inputs("wan"))
    assert [a for *_, a in calls.seen] == [None, None]
    pd.remove_pisa(tr)


def test_alpha_table_checks_and_file_roundtrip(tmp_path):
    tr = tiny_transformer("wan")
    good = at.AlphaTable({"transformer": {1: at.LayerAlpha((0.2, 0.7))}}, dict(RUN_SETTINGS))
    path = good.save(tmp_path / "alpha.json")
    assert at.load(path).to_json() == good.to_json()
    pd.apply_pisa(tr, alpha_table=path, **{**RUN, "dense_steps": 0})
    calls = _Calls(tr)
    with torch.no_grad():
        tr(**forward_inputs("wan"))
    assert [a for *_, a in calls.seen] == [(spec.DEFAULT_ALPHA,) * 2, (0.2, 0.7)]  # layer 0 not in the table
    assert pd.alpha_table(tr).layers()[1].alpha == (0.2, 0.7)
    calls.remove()
    pd.remove_pisa(tr)
    bad = [
        ({"format": "other"}, ValueError, "alpha_table"),
        ({**good.to_json(), "version": 7}, ValueError, "version"),
        ({**good.to_json(), "transformers": {"transformer": {"x": {"alpha": [1.0, 1.0]}}}}, ValueError, "layer keys"),
        ({**good.to_json(), "transformers": {"transformer": {"0": {"alpha": [1.0, float("nan")]}}}}, ValueError,
         "finite"),
        ({**good.to_json(), "transformers": {"transformer": {"0": {"alpha": [1.0, 1.0, 1.0]}}}}, ValueError, "heads"),
        ({**good.to_json(), "transformers": {"transformer": {"9": {"alpha": [1.0, 1.0]}}}}, ValueError, "layer 9"),
        ({**good.to_json(), "version": 1.0}, ValueError, "version"),
        ({**good.to_json(), "version": True}, ValueError, "version"),
        ({**good.to_json(), "transformers": {"transformer": {"1": {"alpha": [0.2, 0.7]},
                                                              " 1": {"alpha": [0.9, 0.9]}}}}, ValueError, "layer keys"),
        ({**good.to_json(), "transformers": {"transformer": {"0": {"alpha": [1.0, 10**400]}}}}, ValueError, "finite"),
        ({**good.to_json(), "settings": {"density": 10**400}}, ValueError, "density"),
        ({**good.to_json(), "settings": {"query_block": "x"}}, ValueError, "query_block"),
        ({**good.to_json(), "settings": {"precision": "fp4"}}, ValueError, "precision"),
        ({**good.to_json(), "transformers": {"transformer": {"0": {"alpha": [1.0, 1.0], "tail_mass": "abc"}}}},
         ValueError, "tail_mass"),
        ({**good.to_json(), "transformers": {"transformer": {"0": {"alpha": [1.0, 1.0], "rows": -5}}}},
         ValueError, "rows"),
        (str(tmp_path / "missing.json"), ValueError, "alpha_table"),
        (3, TypeError, "alpha_table"),
    ]
    for table, exc, match in bad:
        with pytest.raises(exc, match=match):
            pd.apply_pisa(tr, alpha_table=table, **RUN)
        assert pd.pisa_state(tr) is None
    with pytest.warns(RuntimeWarning, match="density"):
        pd.apply_pisa(tr, alpha_table={**good.to_json(), "settings": {**RUN_SETTINGS, "density": 0.5}}, **RUN)
    pd.remove_pisa(tr)


RUN_SETTINGS = {"density": 0.25, "mode": "hybrid", "covariance_aware": False, "block_size": TILE_BLOCK}


def test_telemetry_reports_alpha_per_layer():
    from rich.console import Console

    pipe = tiny_pipeline("wan")
    pd.apply_pisa(pipe, calibrate=True, telemetry=True, **RUN)
    _generate(pipe, "wan")
    tel = pd.telemetry.get(pipe.transformer)
    frozen = pd.pisa_state(pipe.transformer).calibrator.frozen
    sparse = [r for r in tel.records if not r["dense"]]
    assert sparse and all(r["alpha_per_head"] == frozen[r["layer"]].tolist() for r in sparse)
    buf = io.StringIO()
    summary = pd.report(pipe, console=Console(file=buf, width=200))
    assert "α (mean)" in buf.getvalue()
    assert all(0.0 <= r["alpha"] <= 1.0 for r in summary["transformer"]["layers"])
    pd.remove_pisa(pipe)


# --- offline: pisa-attn calibrate FILE ----------------------------------------------------------
def test_calibrate_command_fits_a_capture_and_apply_loads_it(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from pisa_attn import cli
    from pisa_attn.diffusers.capture import capture_qkv
    from pisa_attn.qkv_file import read_qkv_file

    pipe = tiny_pipeline("flux")
    cap = tmp_path / "flux.safetensors"
    # captured in the tiles of the block size it is calibrated at (capture keeps the model's PISA)
    pd.apply_pisa(pipe, block_size=TILE_BLOCK, density=1.0, dense_steps=100)
    with capture_qkv(pipe, steps=[0, 1], path=cap):
        pipe(**prompt_kwargs("flux"), num_inference_steps=2)
    pd.remove_pisa(pipe)
    out = tmp_path / "alpha.json"
    args = ["calibrate", str(cap), "--out", str(out), "--density", "0.25", "--block-size", str(TILE_BLOCK),
            "--rows", "0"]
    assert cli.main(args) == 0
    assert "first-order weight" in capsys.readouterr().err
    table = at.load(str(out))
    assert table.model == "flux" and sorted(table.layers()) == [0, 1, 2, 3]
    assert table.settings == {"density": 0.25, "mode": "hybrid", "covariance_aware": True,  # FLUX's default
                              "block_size": TILE_BLOCK}
    # Every block of both steps: the pooled least-squares fit of each layer's two calls, under the
    # selection rule chosen for the layer (the one of the smaller squared error at its fit).
    f = read_qkv_file(str(cap))
    for layer in range(4):
        fits = {False: [], True: []}
        for e in (x for x in f.entries if x.layer == layer):
            lo, hi = e.info["image_range"]
            start = block_floor(lo, TILE_BLOCK)
            for rule in (False, True):
                fits[rule].append(cal.fit_rows(e.q[:, :, start:hi], e.k, e.v, density=0.25, block_size=TILE_BLOCK,
                                               measured=(lo - start, hi - start), covariance_aware=rule,
                                               scale=e.info["scale"], keep_blocks=e.layout.keep_blocks(TILE_BLOCK)))
        pooled = {r: (x[0] + x[1]).stats for r, x in fits.items()}
        err = {r: float(st.residual(st.alpha(default=spec.DEFAULT_ALPHA, bounds=cal.FIT_BOUNDS)).sum())
               for r, st in pooled.items()}
        rule = err[True] < err[False]
        assert table.layers()[layer].covariance_aware == rule
        want = pooled[rule].alpha(default=spec.DEFAULT_ALPHA, bounds=cal.FIT_BOUNDS)
        torch.testing.assert_close(torch.tensor(table.layers()[layer].alpha, dtype=torch.float64), want,
                                   rtol=1e-9, atol=1e-12)
    pd.apply_pisa(pipe, alpha_table=str(out), **RUN)  # the settings match: no warning
    assert set(pd.pisa_state(pipe.transformer).alphas) == {0, 1, 2, 3}
    pd.remove_pisa(pipe)
    # sampled blocks, one weight per layer, one step
    assert cli.main([*args[:-1], "2", "--fit", "layer", "--steps", "1", "--out", str(tmp_path / "b.json")]) == 0
    b = at.load(str(tmp_path / "b.json"))
    assert all(len(set(x.alpha)) == 1 for x in b.layers().values())
    assert cli.main(["calibrate", str(cap), "--steps", "7", "--out", str(tmp_path / "c.json")]) == 2
    assert "no captured call" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["calibrate", str(tmp_path / "missing.safetensors")])


def test_calibration_config_cuda_graphs_is_checked():
    assert pd.CalibrationConfig().cuda_graphs is True
    with pytest.raises(TypeError, match="cuda_graphs"):
        pd.CalibrationConfig(cuda_graphs=1)


def test_a_generation_repeated_calibrates_alike_and_batch_order_does_not_matter():
    """Each generation samples its rows from the seed anew (the same input, the same weights and
    output), and every batch row gives the same sampled positions (a sample's weights do not depend
    on its place in the batch)."""
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, calibrate=True, **RUN)
    first = _generate(pipe, "flux", seed=3)
    alphas = {i: a.clone() for i, a in pd.pisa_state(pipe.transformer).calibrator.frozen.items()}
    assert torch.equal(_generate(pipe, "flux", seed=3), first)
    assert all(torch.equal(a, pd.pisa_state(pipe.transformer).calibrator.frozen[i]) for i, a in alphas.items())
    pd.remove_pisa(pipe)

    tr = pipe.transformer
    other = {k: (v.flip(0) if torch.is_tensor(v) and k in ("hidden_states", "encoder_hidden_states",
                                                             "pooled_projections") else v)
             for k, v in forward_inputs("flux", batch=2).items()}
    outs = []
    for order in ((0, 1), (1, 0)):
        batch = {k: (v[list(order)] if torch.is_tensor(v) and v.dim() and v.shape[0] == 2 else v)
                 for k, v in other.items()}
        pd.apply_pisa(tr, calibrate=True, **RUN)
        with torch.no_grad():
            for t in (0.9, 0.5):  # the warm-up step, then a sparse one
                out = tr(**{**batch, "timestep": torch.full((2,), t)}).sample
        outs.append(out[list(order).index(0)])
        pd.remove_pisa(tr)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_calibrate_with_query_block_is_refused():
    with pytest.raises(ValueError, match="query_block"):
        pd.apply_pisa(tiny_transformer("flux"), calibrate=True, query_block=2 * TILE_BLOCK, **RUN)


def test_a_table_of_another_model_is_refused_and_tables_record_their_model(tmp_path):
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, calibrate=True, **RUN)
    _generate(pipe, "flux")
    table = pd.alpha_table(pipe)
    assert table.model == "flux"
    path = table.save(tmp_path / "flux.json")
    pd.remove_pisa(pipe)
    wan = tiny_transformer("wan")
    with pytest.raises(ValueError, match="fitted on a 'flux' model"):
        pd.apply_pisa(wan, alpha_table=path, **RUN)
    assert pd.pisa_state(wan) is None


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_calibration_rows_are_shared_out_over_the_batch(batch):
    from pisa_attn.diffusers.calibrate import CalibrationConfig, Calibrator
    from pisa_attn.diffusers.hooks import AttentionCall
    from pisa_attn.diffusers.schedule import Schedule

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(batch, 2, 1024, 32, generator=g) for _ in range(3))
    c = Calibrator(CalibrationConfig(rows=32, side_stream=False, cuda_graphs=False),
                   Schedule(dense_steps=2, min_kv_len=0))
    c.observe(AttentionCall(model="wan", layer=0, step=0, q=q, k=k, v=v, out=q, dense=True, density=0.25,
                            mode="hybrid", covariance_aware=False, block_size=64, meta={"dense_reason": "warmup_step"}))
    assert c._sums[0][1] == 32


def test_calibrate_takes_query_block_equal_to_block_size():
    tr = tiny_transformer("flux")
    pd.apply_pisa(tr, calibrate=True, query_block=TILE_BLOCK, **RUN)  # selects as query_block=None
    pd.remove_pisa(tr)


def test_alpha_table_of_a_per_layer_calibration_says_so():
    pipe = tiny_pipeline("flux")
    pd.apply_pisa(pipe, calibrate=pd.CalibrationConfig(fit="layer"), **RUN)
    _generate(pipe, "flux")
    assert pd.pisa_state(pipe.transformer).calibrator.table().fit == "layer"
    table = pd.alpha_table(pipe)
    assert table.fit == "layer"
    assert all(len(set(e.alpha)) == 1 for e in table.layers().values())  # one weight per layer
    pd.remove_pisa(pipe)


def test_calibrate_keeps_the_runs_alpha_for_heads_without_a_tail():
    """A head no fitted row gives a tail keeps the run's alpha, per head when alpha is per head."""
    st = cal.AlphaStats(*(torch.tensor(x, dtype=torch.float64) for x in ([1.0, 0.0], [2.0, 0.0], [3.0, 3.0], [4, 4])))
    assert st.alpha("head", default=(0.3, 0.4)).tolist() == [0.5, 0.4]
    assert st.alpha("head", default=0.3).tolist() == [0.5, 0.3]
    with pytest.raises(ValueError, match="default"):
        st.alpha("head", default=(0.1, 0.2, 0.3))
    tr = tiny_transformer("wan")
    for alpha, default in (([0.3, 0.4], (0.3, 0.4)), ([0.3], 0.3), (0.25, 0.25), (None, spec.DEFAULT_ALPHA)):
        pd.apply_pisa(tr, calibrate=True, alpha=alpha, **RUN)
        assert pd.pisa_state(tr).calibrator.default == default
        pd.remove_pisa(tr)


def test_an_alpha_table_object_gets_the_checks_a_file_gets():
    tr = tiny_transformer("wan")
    bad = [
        (at.AlphaTable({"transformer": {0: at.LayerAlpha((float("nan"), 0.5))}}, dict(RUN_SETTINGS)), "finite"),
        (at.AlphaTable({"transformer": {-1: at.LayerAlpha((0.1, 0.5))}}, dict(RUN_SETTINGS)), "layer keys"),
        (at.AlphaTable({"transformer": {0: at.LayerAlpha((0.1, 0.5), covariance_aware="no")}}, dict(RUN_SETTINGS)),
         "covariance_aware"),
        (at.AlphaTable({"transformer": {0: at.LayerAlpha((0.1, 0.5))}}, dict(RUN_SETTINGS), fit="bogus"), "fit"),
    ]
    for table, match in bad:
        with pytest.raises(ValueError, match=match):
            pd.apply_pisa(tr, alpha_table=table, **RUN)
        assert pd.pisa_state(tr) is None


def test_calibrate_fits_layers_whose_padded_keys_run_sparse():
    """HunyuanVideo pads its text: a layer runs sparse on the padded key count, so the fit decides
    on it too (not on a row's valid keys, which may be fewer than min_kv_len)."""
    pipe = tiny_pipeline("hunyuan")
    seen = []
    remove = None
    for min_kv in (0, None):
        if min_kv is None:  # between the row's valid and padded key counts
            lens = {c.meta["key_lens"][0] for c in seen}
            n = {c.k.shape[2] for c in seen}
            assert len(lens) == 1 and len(n) == 1 and min(lens) < min(n)
            min_kv = min(n)
        pd.apply_pisa(pipe, calibrate=True, **{**RUN, "min_kv_len": min_kv})
        remove = pd.hooks.add_observer(pipe.transformer, seen.append)
        _generate(pipe, "hunyuan")
        frozen = pd.pisa_state(pipe.transformer).calibrator.frozen
        assert frozen is not None and sorted(frozen) == sorted({c.layer for c in seen if not c.dense})
        remove()
        pd.remove_pisa(pipe)


def test_an_explicit_selection_rule_is_kept_by_calibrate():
    pipe = tiny_pipeline("flux")
    for cov in (False, True):
        pd.apply_pisa(pipe, calibrate=True, covariance_aware=cov, **RUN)
        _generate(pipe, "flux")
        st = pd.pisa_state(pipe.transformer)
        assert {st.covariance_for(i) for i in st.calibrator.frozen} == {cov}
        pd.remove_pisa(pipe)
    with pytest.raises(ValueError, match="choose_selection"):
        pd.apply_pisa(pipe, calibrate=pd.CalibrationConfig(choose_selection=True), covariance_aware=True, **RUN)
    assert pd.pisa_state(pipe.transformer) is None
    pd.apply_pisa(pipe, calibrate=pd.CalibrationConfig(choose_selection=False), covariance_aware=True, **RUN)
    pd.remove_pisa(pipe)
