"""The paper-scale end-to-end benchmark (pisa_attn.bench.e2e, run by benchmarks/bench_e2e.py): its
cases, its arithmetic, and one CPU run of every code path with tiny models of the same classes."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from pisa_attn.bench import dit_cases as dc
from pisa_attn.bench import e2e_estimates as est
from pisa_attn.bench.e2e import main as e2e_main
from pisa_attn.bench.e2e import measure, report, stages
from pisa_attn.diffusers.schedule import DEFAULT_MIN_KV_LEN

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"


@pytest.mark.parametrize(
    "key, grid, text, joint, blocks",
    [
        ("wan14b-720p", (21, 45, 80), 512, 75_600, 40),
        ("hunyuan-720p", (33, 45, 80), 256, 119_056, 60),
        ("flux-1024", (64, 64), 512, 4_608, 57),
        ("flux-2048", (128, 128), 512, 16_896, 57),
        ("wan1.3b-480p", (21, 30, 52), 512, 32_760, 30),
    ],
)
def test_cases_have_the_papers_token_counts(key, grid, text, joint, blocks):
    case = dc.CASES[key]
    assert case.grid == grid and case.text == text and case.blocks == blocks
    assert case.image_tokens + case.joint_text == joint


def test_case_settings_follow_the_paper():
    # Appendix D warm-up; 87.5% sparsity for video, 85% for FLUX; the paper's own speed-ups.
    assert {k: (c.density, c.dense_layers, c.dense_steps) for k, c in dc.CASES.items()} == {
        "wan14b-720p": (0.125, 1, 10), "hunyuan-720p": (0.125, 1, 10), "flux-1024": (0.15, 4, 0),
        "flux-2048": (0.15, 4, 0), "wan1.3b-480p": (0.125, 1, 15), "sd35-1024": (0.15, 4, 0),
    }  # fmt: skip
    assert dc.CASES["wan14b-720p"].paper.speedup == 1.91 and dc.CASES["hunyuan-720p"].paper.speedup == 2.57


def test_reduced_scales_every_block_kind():
    hun = dc.reduced(dc.CASES["hunyuan-720p"], 0.1)
    assert (hun.config["num_layers"], hun.config["num_single_layers"], hun.blocks) == (2, 4, 6)
    assert dc.reduced(dc.CASES["wan14b-720p"], 0.01).blocks == 1  # at least one block
    assert dc.reduced(dc.CASES["flux-1024"], 1.0) is dc.CASES["flux-1024"]
    with pytest.raises(ValueError, match="fraction"):
        dc.reduced(dc.CASES["flux-1024"], 0)


def test_amdahl_bound():
    assert est.amdahl_bound(10.0, 3.0, 7.0) == pytest.approx(2.5)  # 10 / (3 + 7 / 7)
    assert est.amdahl_bound(10.0, 3.0, 1.0) == pytest.approx(1.0)
    assert est.amdahl_bound(10.0, 3.0, 1e12) == pytest.approx(10 / 3)
    with pytest.raises(ValueError):
        est.amdahl_bound(10.0, 3.0, 0.0)


def test_schedule_speedup_weights_steps_and_layers():
    s = est.schedule_speedup(100.0, 40.0, steps=50, dense_steps=10, dense_layers=1, dense_layer_extra=2.0,
                             dense_step_extra=5.0)  # fmt: skip
    assert s["dense_step_ms"] == 105.0 and s["sparse_step_ms"] == 42.0
    assert s["speedup"] == pytest.approx(5000 / (10 * 105 + 40 * 42))
    assert est.schedule_speedup(100.0, 40.0, steps=3, dense_steps=0, dense_layers=0)["speedup"] == pytest.approx(2.5)
    with pytest.raises(ValueError):
        est.schedule_speedup(100.0, 40.0, steps=5, dense_steps=6, dense_layers=0)


def test_flop_estimate_of_wan14b_attention():
    f = est.forward_flops(dc.CASES["wan14b-720p"])
    assert f["attention"] == 4 * 75_600**2 * 40 * 128 * 40
    s = est.forward_seconds(dc.CASES["wan14b-720p"])
    assert s["pisa"] < s["dense"] and s["rest"] < s["dense"]


def test_derive_extrapolates_reduced_models():
    full = dc.CASES["wan14b-720p"]
    case = dc.reduced(full, 0.1)  # 4 of 40 blocks: per-forward times x10
    rec = {
        "forward_ms": {n: {"ms": ms} for n, ms in
                       (("dense", 1000.0), ("pisa", 500.0), ("no_attention", 300.0), ("no_attention_pisa_hooks", 310.0))},
        "attention_call": {"speedup": 7.0, "pisa_ms": 10.0, "pisa_dense_path_ms": 80.0, "dense_backend": "cudnn",
                           "dense_ms": {"cudnn": 70.0}},
    }  # fmt: skip
    args = stages.parse_args(["--tiny"])
    d = report.derive(rec, case, full, args)
    assert d["speedup"] == pytest.approx(2.0) and d["dense_forward_ms"] == pytest.approx(10_000.0)
    assert d["amdahl_bound"] == pytest.approx(1000 / (300 + 700 / 7))
    assert d["share_of_bound"] == pytest.approx(2.0 / d["amdahl_bound"])
    assert d["boundary_pct_of_pisa_forward"] == pytest.approx(100 * 10 / 5000)  # once per full forward
    sched = d["schedule"]
    assert sched["sparse_step_ms"] == pytest.approx(5000 + 1 * (80 - 10))
    assert sched["dense_step_ms"] == pytest.approx(10_000 + 40 * (80 - 70))


def test_derive_gives_no_bound_or_schedule_from_noise():
    """A forward without attention no faster than dense gives no bound (not one below 1); a
    schedule step estimated at or below zero gives no speed-up; a warm-up-only row is left out."""
    full = dc.CASES["wan14b-720p"]
    rec = {
        "forward_ms": {"dense": {"ms": 100.0}, "pisa": {"ms": 90.0}, "no_attention": {"ms": 101.0},
                       "no_attention_pisa_hooks": {"ms": 50.0, "cold_only": True}},
        "attention_call": {"speedup": 7.0, "pisa_ms": 10.0, "pisa_dense_path_ms": 1.0, "dense_backend": "cudnn",
                           "dense_ms": {"cudnn": 70.0}},
    }  # fmt: skip
    d = report.derive(rec, full, full, stages.parse_args(["--tiny"]))
    assert d["ideal_bound"] is None and "amdahl_bound" not in d and d["bound_note"]
    assert "boundary_ms" not in d and d["warmup_only"] == ["no_attention_pisa_hooks"]
    s = est.schedule_speedup(100.0, 2.0, steps=50, dense_steps=5, dense_layers=4, dense_layer_extra=-9.0)
    assert s["speedup"] is None and s["note"]


def test_first_dense_falls_back_and_records_why():
    def run(name):
        if name == "a":
            raise RuntimeError("no kernel for this mask")
        return name.upper()

    rec = {}
    assert measure.first_dense(["a", "b"], run, rec, "dense") == ("b", "B")
    assert "no kernel" in rec["dense_backend_errors"]["dense a"]
    with pytest.raises(RuntimeError, match="no dense backend"):
        measure.first_dense(["a"], run, {}, "dense")


def test_arguments_per_stage():
    b = stages
    a = b.parse_args(["--part", "compiled", "--fraction", "wan14b-compiled=0.5", "--budget-s", "flux=30"])
    assert a.stage_list == ("wan14b-compiled", "hunyuan-compiled", "wan1.3b-compiled", "flux-compiled",
                            "sd35-compiled")
    assert a.fractions == {"wan14b-compiled": 0.5} and a.budgets["flux"] == 30 and a.budgets["hunyuan"] == 150
    assert b.parse_args(["--budget-s", "20"]).budgets["wan14b"] == 20
    assert b.parse_args([]).precision == "input" and b.parse_args(["--precision", "fp8"]).precision == "fp8"
    for bad in (["--stages", "wan99"], ["--fraction", "1.5"], ["--budget-s", "nope=3"], ["--flux-sweep", "1000"],
                ["--precision", "fp4"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)


def test_plan_names_every_stage(capsys):
    assert e2e_main.main(["--estimate", "--part", "all"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in stages.STAGES) and "total" in out


def test_device_script_runs_the_package(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--estimate", "--stages", "flux"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert e.value.code == 0 and capsys.readouterr().out.startswith("flux ")


@pytest.mark.slow
def test_tiny_run_covers_eager_compiled_and_sweep(tmp_path):
    pytest.importorskip("diffusers")
    threads = torch.get_num_threads()
    try:
        rc = e2e_main.main(["--tiny", "--stages", "wan1.3b,hunyuan-compiled,flux,sd35", "--compile-backend", "aot_eager",
                     "--total-budget-s", "600", "--budget-s", "300", "--out", str(tmp_path)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert [s["status"] for s in res["stages"]] == ["done"] * 4
    cases = {c["case"]: c for s in res["stages"] for c in s["cases"]}
    assert set(cases) == {"wan1.3b-480p", "hunyuan-720p", "flux-1024", "flux-2048", "sd35-1024"}
    for key in ("wan1.3b-480p", "flux-1024", "flux-2048"):  # eager: every measurement and what it gives
        c = cases[key]
        assert set(c["forward_ms"]) == {"dense", "pisa", "no_attention", "no_attention_pisa_hooks"}
        d = c["derived"]
        assert {"speedup", "boundary_pct_of_pisa_forward", "schedule"} <= set(d)
        # at these sizes attention's share can fall within the forwards' spread: no bound, a note
        assert {"amdahl_bound", "share_of_bound"} <= set(d) or d.get("bound_note")
        assert set(c["gathers"]["per_kind_ms"]) == {"token", "rope", "untile"}
        assert 0 < c["rel_l1"]["pisa_vs_dense"] < 0.05
    hun = cases["hunyuan-720p"]  # compiled, half the blocks, a key-padding mask
    assert hun["blocks"] == {"measured": 2, "total": 3, "extrapolation": 1.5}
    assert set(hun["compile_s"]) == {"dense", "pisa", "no_attention"}
    drift = hun["rel_l1"]
    assert drift["compiled_pisa_vs_eager_pisa"] < 1e-6 and drift["compiled_dense_vs_eager_dense"] < 1e-6  # aot_eager
    assert 0 < drift["compiled_pisa_vs_compiled_dense"] < 0.05
    assert hun["pisa_calls"]["sparse"] > 0 and "dense" not in hun["pisa_calls"]
    sweep = next(s for s in res["stages"] if s["stage"] == "flux")["min_kv_len"]
    assert [r["image_tokens"] for r in sweep["rows"]] == list(stages.FLUX_SWEEP_TINY) and sweep["default"] == DEFAULT_MIN_KV_LEN


def test_a_failing_step_is_recorded_and_the_stage_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    import contextlib

    @contextlib.contextmanager
    def broken(model, case, args):
        raise RuntimeError("kernel launch failed")
        yield

    monkeypatch.setattr(measure, "pisa_applied", broken)
    threads = torch.get_num_threads()
    try:
        assert e2e_main.main(["--tiny", "--stages", "wan1.3b", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    stage = json.loads((tmp_path / "bench_e2e.json").read_text())["stages"][0]
    case = stage["cases"][0]
    assert stage["status"] == "partial: 2 steps failed"
    assert set(case["errors"]) == {"pisa", "no_attention_pisa_hooks"} and "kernel launch" in case["errors"]["pisa"]
    assert set(case["forward_ms"]) == {"dense", "no_attention"}
    # the steps that ran are still derived from (a tiny CPU model's attention share can fall within
    # the forwards' spread: then the bound is left out with a note)
    d = case["derived"]
    assert "no_attention_forward_ms" in d and ("amdahl_bound" in d or d.get("bound_note"))


@pytest.mark.parametrize("stage", ["wan1.3b", "hunyuan", "flux"])
def test_the_no_attention_forward_runs_no_attention(stage):
    """routed(model) swaps the managed attention for the no-attention op: the model's own
    processors must not run (the stand-in is no removed PISA processor), so the forward differs
    from the dense one."""
    from pisa_attn.bench.e2e.backends import managed_modules, routed

    case, _ = stages.stage_cases(stage, stages.parse_args(["--tiny"]))[0]
    model = dc.build(case, torch.device("cpu"), torch.float32)
    inputs = dc.inputs(case, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        dense = model(**inputs).sample
    calls = []
    with routed(model):
        for module in managed_modules(model):
            proc = module.processor
            proc.original = (lambda o: lambda *a, **k: calls.append(1) or o(*a, **k))(proc.original)
        with torch.no_grad():
            out = model(**inputs).sample
    assert not calls and not torch.equal(out, dense)


def _rec(pisa_calls=None, cold=(), pisa_backend="hopper"):
    rec = {
        "forward_ms": {n: {"ms": ms} for n, ms in
                       (("dense", 100.0), ("pisa", 60.0), ("no_attention", 50.0), ("no_attention_pisa_hooks", 51.0))},
        "attention_call": {"speedup": 7.0, "pisa_ms": 10.0, "pisa_dense_path_ms": 72.0, "dense_backend": "cudnn",
                           "dense_ms": {"cudnn": 70.0}, "pisa_backend": pisa_backend, "cold_only": list(cold)},
    }  # fmt: skip
    if pisa_calls is not None:
        rec["pisa_calls"] = pisa_calls
        rec["pisa_config"] = {"min_kv_len": 8192}
    return rec


def _results(rec, case_key="flux-1024"):
    full = dc.CASES[case_key]
    crec = dict(rec, case=case_key, blocks=stages.blocks_info(full, full), paper=report.paper_numbers(full),
                image_tokens=full.image_tokens, joint_text_tokens=full.joint_text, dense_backend="_native_cudnn")
    crec["derived"] = report.derive(rec, full, full, stages.parse_args([]))
    return {"env": {"device": "cuda", "torch": "2"}, "stages": [{"stage": "flux", "status": "done", "compiled": False,
                                                                  "cases": [crec]}]}  # fmt: skip


def test_derive_gives_no_sparse_estimate_when_no_call_went_sparse():
    """With the default min_kv_len a 1024^2 FLUX forward runs every call dense: no Amdahl bound,
    share or schedule as if it were sparse, and the table says why."""
    full = dc.CASES["flux-1024"]
    args = stages.parse_args([])
    d = report.derive(_rec({"dense": 57, "too_short": 57}), full, full, args)
    assert d["pisa_ran_dense"] and "no PISA call went sparse" in d["dense_note"]
    assert not {"amdahl_bound", "share_of_bound", "schedule"} & set(d)
    out = report.table(_results(_rec({"dense": 57, "too_short": 57})))
    assert "no PISA call went sparse" in out
    assert "all dense" in next(line for line in out.splitlines() if line.startswith("flux "))
    sparse = report.derive(_rec({"sparse": 57}), full, full, args)
    assert {"amdahl_bound", "share_of_bound", "schedule"} <= set(sparse) and "pisa_ran_dense" not in sparse


def test_schedule_estimate_never_exceeds_the_bound_with_attention_free():
    full = dc.CASES["wan14b-720p"]  # 10 dense steps of 50, 1 dense layer of 40
    rec = _rec({"sparse": 40})
    rec["forward_ms"]["pisa"] = {"ms": 10.0}
    rec["attention_call"].update(pisa_ms=68.0, pisa_dense_path_ms=69.0)  # warm steps estimated far below dense
    d = report.derive(rec, full, full, stages.parse_args(["--tiny"]))
    assert d["ideal_bound"] == pytest.approx(2.0)
    assert d["schedule"]["speedup"] is None and d["schedule"]["estimate"] > 2.0 and "exceeds" in d["schedule"]["note"]


def test_warmup_only_attention_call_is_flagged_in_derived_and_table():
    rec = _rec({"sparse": 57}, cold=("cudnn", "pisa"))
    out = report.table(_results(rec))
    assert "attention call (cudnn, pisa) timed by its warm-up only" in out
    row = next(line for line in out.splitlines() if line.startswith("flux "))
    assert "~" in row
    assert _results(rec)["stages"][0]["cases"][0]["derived"]["attention_call_cold_only"] == ["cudnn", "pisa"]


def test_attention_calls_flag_warmup_only_timings(monkeypatch):
    pytest.importorskip("diffusers")
    from pisa_attn.bench.e2e.runner import Stage

    stage = Stage("t", 100, 1e18, torch.device("cpu"), lambda: None, {})

    def cold_measure(fn, **kw):
        return {"ms": 1.0, "times_ms": [1.0], "warmup_ms": [1.0], "cold_only": True}, fn()

    monkeypatch.setattr(stage, "measure", cold_measure)
    case = dc.tiny(dc.CASES["flux-1024"])
    a = measure.attention_calls(stage, case, True, stages.parse_args(["--tiny"]), ("_native_math",))
    assert a["cold_only"] == ["_native_math", "pisa", "pisa_dense_path"]


def test_table_names_the_pisa_backend_that_ran():
    out = report.table(_results(_rec({"sparse": 57}, pisa_backend="reference")))
    assert "PISA be" in out
    assert "reference" in next(line for line in out.splitlines() if line.startswith("flux "))


def test_min_kv_len_is_honoured_under_tiny():
    from pisa_attn.bench.e2e.backends import pisa_settings

    case = dc.tiny(dc.CASES["flux-1024"])
    assert pisa_settings(case, stages.parse_args(["--tiny", "--min-kv-len", "300"]))["min_kv_len"] == 300
    assert pisa_settings(case, stages.parse_args(["--tiny"]))["min_kv_len"] == 0
    assert pisa_settings(case, stages.parse_args([]))["min_kv_len"] is None  # the library default


def test_environment_records_the_pisa_attn_version(monkeypatch):
    import types

    import pisa_attn

    monkeypatch.setitem(sys.modules, "diffusers", types.SimpleNamespace(__version__="0.0-test"))
    env = report.environment(torch.device("cpu"))
    assert env["pisa_attn"] == pisa_attn.__version__ and env["diffusers"] == "0.0-test"


@pytest.mark.parametrize("flag, value", [
    ("--steps", "0"), ("--warmup", "-1"), ("--max-iters", "0"), ("--measure-s", "0"), ("--total-budget-s", "-5"),
    ("--block-size", "0"), ("--block-size", "-16"), ("--flux-sweep", "0"), ("--flux-sweep", "-4"),
    ("--density", "0"), ("--min-kv-len", "-1"), ("--measure-s", "nan"),
])  # fmt: skip
def test_nonpositive_arguments_are_refused_naming_the_argument(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        stages.parse_args([flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
