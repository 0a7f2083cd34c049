"""``pisa-attn`` command line and the ``demo`` logic, at tiny sizes."""

from __future__ import annotations

import json
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pisa_attn import cli, pisa_attention
from pisa_attn.bench import demo
from pisa_attn.data import dit_qkv
from pisa_attn.spec import DEFAULT_ALPHA

TINY = ["--grid", "2", "8", "8", "--heads", "2", "--head-dim", "32", "--block-size", "16", "--repeats", "1"]


def tiny_config(**kw) -> demo.DemoConfig:
    base = dict(grid=(2, 8, 8), heads=2, head_dim=32, block_size=16, repeats=1, densities=(0.25, 0.5))
    return demo.DemoConfig(**{**base, **kw})


# ---------------------------------------------------------------- demo logic
def test_run_demo_reports_measured_errors():
    cfg = tiny_config()
    steps = []
    result = demo.run_demo(cfg, steps.append)
    assert len(steps) == demo.num_steps(cfg) == 1 + 4 * 2
    assert [(r.method, r.density) for r in result.rows] == [("dense", None)] + [
        (m, d) for d in (0.25, 0.5) for m in demo.METHODS
    ]
    assert result.tokens == 128 and result.grid == (2, 8, 8) and result.dtype == "float32"
    dense = result.rows[0]
    assert dense.rel_l1 == 0.0 and dense.max_abs == 0.0 and dense.time_ms > 0
    # Recompute one row independently: the table holds real measurements of the same workload.
    data = dit_qkv((2, 8, 8), heads=2, head_dim=32, seed=0)
    want = F.scaled_dot_product_attention(data.q, data.k, data.v)
    for row in result.rows[1:]:
        out = pisa_attention(data.q, data.k, data.v, density=row.density, block_size=16, mode=row.method)
        assert row.rel_l1 == pytest.approx(((out - want).abs().mean() / want.abs().mean()).item(), rel=1e-6)
        assert row.max_abs == pytest.approx((out - want).abs().max().item(), rel=1e-6)
        assert row.rel_l1 > 0 and row.time_ms > 0 and row.backend == "reference"
        assert row.exact_blocks == f"{round(row.density * 8)}/8"


def test_run_demo_density_one_is_dense_for_every_mode():
    result = demo.run_demo(tiny_config(densities=(1.0,), seed=3))
    for row in result.rows:
        assert row.rel_l1 < 1e-6 and row.max_abs < 1e-5


def test_run_demo_text_tokens_use_keep_blocks():
    result = demo.run_demo(tiny_config(text_tokens=20, densities=(0.25,), modes=("hybrid",)))
    assert result.tokens == 148
    assert result.rows[1].exact_blocks == "3/10"  # top-k = round(0.25 · 10); text blocks come on top
    keep = dit_qkv((2, 8, 8), heads=2, head_dim=32, text_tokens=20).keep_blocks(16)
    assert keep.shape == (10,) and 2 <= int(keep.sum()) <= 3
    plain = pisa_attention(*tiny_text_qkv(), density=0.25, block_size=16)
    kept = pisa_attention(*tiny_text_qkv(), density=0.25, block_size=16, keep_blocks=keep)
    dense = F.scaled_dot_product_attention(*tiny_text_qkv())
    want = (kept - dense).abs().mean() / dense.abs().mean()
    assert result.rows[1].rel_l1 == pytest.approx(want.item(), rel=1e-6)
    assert not torch.allclose(plain, kept)


def test_run_demo_float64_is_measured_against_float64_dense():
    """A float64 run's reference is float64 dense: a float32 one would put its own rounding into
    every row (dense included) as if it were the method's error."""
    result = demo.run_demo(tiny_config(dtype="float64", densities=(1.0,), modes=("hybrid",)))
    dense, full = result.rows
    assert dense.rel_l1 == 0.0 and dense.max_abs == 0.0
    assert full.rel_l1 < 1e-12 and full.max_abs < 1e-12  # density 1: exact up to float64 rounding


def tiny_text_qkv():
    d = dit_qkv((2, 8, 8), heads=2, head_dim=32, text_tokens=20)
    return d.q, d.k, d.v


@pytest.mark.parametrize(
    "length,rank,want",
    [(1024, 3, (4, 16, 16)), (2048, 3, (5, 20, 20)), (32768, 3, (12, 52, 52)), (10, 3, (1, 4, 4)), (1024, 2, (32, 32))],
    ids=lambda x: str(x),
)
def test_grid_for_length(length, rank, want):
    assert demo.grid_for_length(length, rank) == want


@pytest.mark.parametrize("length", [100, 777, 5000, 60000])
def test_grid_for_length_is_close_to_request(length):
    t, h, w = demo.grid_for_length(length)
    assert h == w and h % 4 == 0 and abs(t * h * w - length) <= 0.3 * length


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(densities=(0.0,)), "density"),
        (dict(densities=()), "densities"),
        (dict(modes=("second",)), "modes"),
        (dict(block_size=24), "block_size"),
        (dict(heads=0), "heads"),
        (dict(head_dim=33), "head_dim"),
        (dict(grid=(4, 4, 4, 4)), "grid"),
        (dict(dtype="int8"), "dtype"),
        (dict(backend="cuda"), "backend"),
        (dict(device="tpu"), "device"),
        (dict(text_tokens=-1), "text_tokens"),
        (dict(grid=(8, 8), image=True), "image"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_demo_config_errors_name_the_field(change, name):
    with pytest.raises(ValueError, match=name):
        tiny_config(**change).validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_demo_cuda_without_cuda_is_a_clear_error(capsys):
    assert cli.main(["demo", "--device", "cuda", *TINY]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_demo_cuda_index_past_the_devices_is_a_clear_error(capsys, monkeypatch):
    # cuda:N beyond the machine's GPUs: one line naming the device, not a traceback from the data
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device 'cuda:3'"):
        tiny_config(device="cuda:3").validate()
    tiny_config(device="cuda:0").validate()  # the one device there is
    assert cli.main(["demo", "--device", "cuda:3", *TINY]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda:3'" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_demo_on_cuda_names_the_backend_that_ran():
    from pisa_attn import make_plan

    result = demo.run_demo(demo.DemoConfig(grid=(4, 16, 16), heads=2, repeats=2, device="cuda"))
    data = dit_qkv((4, 16, 16), heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda")
    for row in result.rows[1:]:
        plan = make_plan(data.q, data.k, row.density, 64, row.method, False, None, "auto")
        assert row.backend == plan.backend and torch.isfinite(torch.tensor(row.rel_l1))
    assert result.rows[0].rel_l1 < 1e-2  # bf16 dense vs fp32 dense: rounding only


# ---------------------------------------------------------------- command line
def test_demo_command_prints_table_and_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    rc = cli.main(["demo", *TINY, "--density", "0.25", "0.5", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("method", "density", "rel-L1", "max abs", "time (ms)", "dense", *demo.METHODS):
        assert word in text
    assert f"hybrid: + shared first-order term (PISA, weight {DEFAULT_ALPHA:g})" in " ".join(text.split())  # legend
    data = json.loads(out_json.read_text())
    assert data["grid"] == [2, 8, 8] and len(data["rows"]) == 9
    assert data["config"]["densities"] == [0.25, 0.5]
    assert {r["method"] for r in data["rows"]} == {"dense", *demo.METHODS}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args,name",
    [
        (["--density", "0"], "density"),
        (["--density", "1.5"], "density"),
        (["--density", "x"], "density"),
        (["--block-size", "24"], "block-size"),
        (["--heads", "0"], "heads"),
        (["--length", "-5"], "length"),
        (["--modes", "second"], "modes"),
        (["--bogus"], "unrecognized"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_demo_bad_arguments_exit_2_naming_the_flag(args, name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *args])
    assert e.value.code == 2
    assert name in capsys.readouterr().err


def test_demo_times_one_run_per_method_on_cpu():
    """The CPU time is the reference's, not PISA's speed: the default does not repeat it."""
    assert demo.DemoConfig().resolved_repeats() == 1 and demo.DemoConfig(repeats=4).resolved_repeats() == 4
    assert demo.run_demo(tiny_config(repeats=None, densities=(0.5,), modes=("drop",))).config.repeats == 1
    with pytest.raises(ValueError, match="repeats"):
        tiny_config(repeats=0).validate()


def test_a_command_error_shows_that_command_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pisa-attn demo" in err and "pisa-attn demo: error: unrecognized arguments: --bogus" in err


def test_demo_grid_of_one_token_is_refused(capsys):
    assert cli.main(["demo", "--grid", "1", "1", "1", "--text-tokens", "5"]) == 2
    assert "at least 2 tokens" in capsys.readouterr().err


def test_calibrate_covariance_flags_exclude_each_other(tmp_path, capsys):
    f = tmp_path / "c.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(SystemExit) as e:
        cli.main(["calibrate", str(f), "--covariance-aware", "--no-covariance-aware"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_generate_names_a_local_folder_that_is_no_pipeline(tmp_path, capsys):
    pytest.importorskip("diffusers")
    rc, err = run_cli(["generate", "--model", str(tmp_path), "--prompt", "p", "--out", "x.png"], capsys)
    assert rc != 0 and "not a diffusers pipeline folder" in err and "huggingface-cli" not in err


def test_demo_config_error_returns_2(capsys):
    assert cli.main(["demo", "--head-dim", "300", *TINY[:6]]) == 2
    assert "head_dim" in capsys.readouterr().err


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 0
    text = capsys.readouterr().out
    assert "usage: pisa-attn" in text
    for cmd in cli.COMMANDS:
        assert cmd.name in text


def test_missing_modules_do_not_break_the_others(tmp_path, monkeypatch, capsys):
    (tmp_path / "needs_missing_dep.py").write_text("import pisa_no_such_dependency_xyz\n")
    (tmp_path / "no_add_parser.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = (
        cli.Command("ghost", "pisa_attn.no_such_module", "not written yet", "nothing"),
        cli.Command("heavy", "needs_missing_dep", "optional dependency missing", "the xyz extra"),
        cli.Command("odd", "no_add_parser", "module without add_parser", "nothing"),
    )
    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + broken)
    assert cli.main([]) == 0
    listing = capsys.readouterr().out
    assert all(c.name in listing for c in (*broken, *cli.COMMANDS))
    assert cli.main(["ghost", "--any", "flags"]) == 1
    assert "pisa_attn.no_such_module is not part of this installation" in capsys.readouterr().err
    assert cli.main(["heavy"]) == 1
    err = capsys.readouterr().err
    assert "pisa_no_such_dependency_xyz" in err and "the xyz extra" in err
    assert cli.main(["odd"]) == 1
    assert "add_parser" in capsys.readouterr().err
    assert cli.main(["demo", *TINY, "--density", "0.5", "--modes", "hybrid"]) == 0  # unaffected


def test_python_m_entry_point_prints_help_without_importing_subcommands(monkeypatch, capsys):
    imported = []
    real = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: imported.append(name) or real(name))
    monkeypatch.setattr(sys, "argv", ["pisa-attn"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("pisa_attn", run_name="__main__")  # what `python -m pisa_attn` runs
    assert e.value.code == 0 and "usage: pisa-attn" in capsys.readouterr().out
    assert imported == []
    cli.build_parser(["demo", "--length", "64"])
    assert imported == ["pisa_attn.bench.demo"]  # only the chosen command's module


# ---------------------------------------------------------------- study options: checked before any work
@pytest.mark.parametrize(
    "args,words",
    [
        (["--block-size", "48"], ["--block-size", "power of two"]),
        (["--density", "2"], ["--density", "(0, 1]"]),
        (["--densities", "0.1,3"], ["--densities", "(0, 1]"]),
        (["--modes", "hybrid,foo"], ["--modes", "'foo'"]),
        (["--source", "no/such/capture.safetensors"], ["--source", "no such file"]),
        (["--head-dim", "300"], ["--head-dim", "[16, 256]"]),
        (["--lengths", "0"], ["--lengths", ">= 1"]),
        (["--bogus"], ["unrecognized"]),
    ],
    ids=lambda x: x[0].lstrip("-") if isinstance(x, list) else None,
)
def test_study_bad_options_exit_2_before_any_work(args, words, capsys, monkeypatch):
    from pisa_attn.bench import study

    monkeypatch.setattr(study, "run_study", lambda *a, **k: pytest.fail("the study started"))
    with pytest.raises(SystemExit) as e:
        cli.main(["study", "--size", "tiny", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err


def test_study_config_error_returns_2_before_any_work(capsys, monkeypatch):
    from pisa_attn.bench import study

    monkeypatch.setattr(study, "run_study", lambda *a, **k: pytest.fail("the study started"))
    assert cli.main(["study", "--device", "tpu"]) == 2
    assert "pisa-attn study: error: device must be" in capsys.readouterr().err


def test_version_and_help_do_not_import_torch():
    probe = """
import sys
from pisa_attn import cli
for argv in (["--version"], ["--help"]):
    try:
        cli.main(argv)
    except SystemExit:
        pass
print("torch imported:", "torch" in sys.modules)
"""
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout.startswith(f"pisa-attn {cli.__version__}\n") and "usage: pisa-attn" in run.stdout
    assert run.stdout.rstrip().endswith("torch imported: False")


def test_readme_cpu_example_runs_as_written(capsys):
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)  # the first example: the CPU one
    assert "cuda" not in code
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    claimed = re.search(r"# (\d\.\d+)\s*$", code.strip()).group(1)  # the value its last line promises
    assert printed == f"rel-L1 vs dense: {claimed}"


# ---------------------------------------------------------------- every misuse: one `error:` line, no traceback
def run_cli(argv, capsys) -> tuple[int, str]:
    """``pisa-attn ARGV`` as the console script runs it: the exit code and stderr. Any other
    exception propagates, so a test that gets one fails (a user would have seen a traceback)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse (code 2) or a command's SystemExit("... error: ...")
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            rc = 1
        else:
            rc = e.code or 0
    return rc, capsys.readouterr().err


def assert_clear_error(rc: int, err: str, *words: str) -> None:
    assert rc != 0, err
    assert "Traceback" not in err and "error:" in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and all(w in lines[0] for w in words), err


def write_capture(path, entries=("step0.layer0", "step1.layer0")):
    """A two-entry capture file of random q/k/v (no layout), as capture_qkv writes them."""
    from pisa_attn.qkv_file import write_qkv_file

    tensors, info = {}, {}
    for i, name in enumerate(entries):
        g = torch.Generator().manual_seed(i)
        for part in "qkv":
            tensors[f"{name}.{part}"] = torch.randn(1, 2, 256, 32, generator=g)
        info[name] = {"step": i, "layer": 0}
    write_qkv_file(str(path), tensors, info, model="test", dtype="float32")
    return path


def test_demo_backend_the_device_cannot_run_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    rc, err = run_cli(["demo", "--backend", "hopper", "--device", "cpu"], capsys)
    assert_clear_error(rc, err, "backend='hopper'")
    rc, err = run_cli(["demo", "--backend", "triton", "--device", "cpu"], capsys)  # float32: no Triton kernel
    assert_clear_error(rc, err, "backend='triton'", "dtype")
    # The suite runs Triton's interpreter (conftest); a user's CPU does not. Triton is imported
    # already, so the setting changes only what pisa_attention decides.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, err = run_cli(["demo", "--backend", "triton", "--device", "cpu", "--dtype", "bfloat16"], capsys)
    assert_clear_error(rc, err, "backend='triton'", "TRITON_INTERPRET")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_demo_output_paths_are_checked_first(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    rc, err = run_cli(["demo", flag, str(tmp_path / "no" / "such" / "dir" / "x.out")], capsys)
    assert_clear_error(rc, err, flag, "does not exist")
    rc, err = run_cli(["demo", flag, str(tmp_path)], capsys)
    assert_clear_error(rc, err, flag, "is a directory")


def test_demo_plot_without_matplotlib_is_refused_before_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on the core install
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    rc, err = run_cli(["demo", "--plot", str(tmp_path / "x.png")], capsys)
    assert_clear_error(rc, err, "--plot", "matplotlib", "pisa-attn[plot]")


def test_generate_on_the_core_install_names_what_is_missing(tmp_path, capsys, monkeypatch):
    for name in ("diffusers", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    rc, err = run_cli(["generate", "--model", "m", "--prompt", "p", "--out", str(tmp_path / "x.png")], capsys)
    assert_clear_error(rc, err, "diffusers", "transformers", "pisa-attn[diffusers]")


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--density", "2"], ["--density", "(0, 1]"]),
        (["--block-size", "48"], ["--block-size", "power of two"]),
        (["--seed", "-1"], ["--seed", ">= 0"]),
        (["--device", "tpu"], ["--device", "'tpu'"]),
        (["--out", "x.bmp"], ["--out must end"]),
    ],
    ids=lambda x: x[0].lstrip("-") if isinstance(x, list) else None,
)
def test_generate_bad_values_are_one_error_line(extra, words, capsys):
    pytest.importorskip("diffusers")
    argv = ["generate", "--model", "org/none", "--prompt", "p", "--out", "x.png", *extra]
    rc, err = run_cli(argv, capsys)
    assert_clear_error(rc, err, *words)


@pytest.fixture
def no_study(monkeypatch):
    from pisa_attn.bench import study

    monkeypatch.setattr(study, "run_study", lambda *a, **k: pytest.fail("the study started"))
    monkeypatch.setattr(study._Study, "run", lambda *a, **k: pytest.fail("the study started"))
    return study


def test_study_source_that_is_no_capture(tmp_path, capsys, no_study):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a capture\n")
    rc, err = run_cli(["study", "--source", str(notes), "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, "notes.txt", "not a readable .safetensors file")


@pytest.mark.parametrize("flag,value", [("--length", "7"), ("--lengths", "256,100")])
def test_study_synthetic_lengths_are_checked_first(flag, value, tmp_path, capsys, no_study):
    rc, err = run_cli(["study", "--size", "tiny", flag, value, "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, flag.lstrip("-"), "multiples of 64")


def test_study_out_that_is_a_file(tmp_path, capsys, no_study):
    taken = tmp_path / "taken"
    taken.write_text("")
    rc, err = run_cli(["study", "--size", "tiny", "--out", str(taken)], capsys)
    assert_clear_error(rc, err, "--out", "not a directory")
    rc, err = run_cli(["study", "--size", "tiny", "--out", str(taken / "below")], capsys)
    assert_clear_error(rc, err, "--out", "is a file")


def test_study_unknown_entries(tmp_path, capsys, no_study):
    cap = write_capture(tmp_path / "cap.safetensors")
    rc, err = run_cli(["study", "--source", str(cap), "--entries", "step9.layer9", "--out", str(tmp_path / "o")],
                      capsys)
    assert_clear_error(rc, err, "step9.layer9", "step0.layer0")
    rc, err = run_cli(["study", "--size", "tiny", "--entries", "step0.layer0", "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, "entries", "captured source")


def test_study_capture_without_safetensors(tmp_path, capsys, no_study, monkeypatch):
    cap = write_capture(tmp_path / "cap.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    rc, err = run_cli(["study", "--source", str(cap), "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, "safetensors")


def test_study_plots_asked_without_matplotlib(tmp_path, capsys, no_study, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, err = run_cli(["study", "--size", "tiny", "--plots", "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, "matplotlib", "--no-plots")
    assert not (tmp_path / "o").exists()


def test_study_on_the_core_install_writes_json_without_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "o"
    rc, err = run_cli(["study", "--size", "tiny", "--out", str(out), "--modes", "hybrid", "--no-covariance",
                       "--no-weights", "--densities", "0.25", "--length", "256", "--lengths", "256", "--heads", "1",
                       "--no-progress"], capsys)
    assert rc == 0 and "Traceback" not in err
    assert "matplotlib is not installed: writing study.json without plots" in err
    data = json.loads((out / "study.json").read_text())
    assert data["plots"] == [] and data["config"]["plots"] is False
    assert sorted(p.name for p in out.iterdir()) == ["study.json"]


# ---------------------------------------------------------------- --help: plain text, accepted values listed
@pytest.mark.parametrize(
    "command,words",
    [
        ("demo", ["{hybrid,zeroth,first,drop}", "a power of two >= 16", "an integer >= 0", "(default 64)"]),
        ("study", ["one of drop, zeroth, hybrid, first", "a power of two >= 16", "an integer >= 0", "default: 0.2"]),
        ("calibrate", ["one of head, layer", "one of hybrid, first", "a power of two >= 16", "an integer >= 0"]),
        ("generate", ["{hybrid,zeroth,first,drop}", "a power of two >= 16", "an integer >= 0"]),
        ("bench", ["{128,256}", "{bf16,fp16}", "default: 60.0"]),
    ],
)
def test_help_is_plain_and_lists_accepted_values(command, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for markup in ("``", ":func:", ":class:", ":data:", ":mod:"):
        assert markup not in text, (command, markup)
    flat = " ".join(text.split())
    for w in words:
        assert w in flat, (command, w)


def test_readme_context_parallel_example_runs_as_written(tmp_path):
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### Context parallelism"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "cp_example.py"  # run_local spawns: the ranks import the script's functions
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    diff = float(re.fullmatch(r"max \|difference\| from one process: (\S+)\n", run.stdout).group(1))
    assert diff < 1e-4


@pytest.mark.parametrize(
    "args,words",
    [
        (["--lengths", "abc"], ["--lengths", "comma-separated"]),
        (["--densities", "0.1,2"], ["densities must be in (0, 1]"]),
        (["--cases", "2-16-128:4096"], ["--cases items look like"]),
        (["--cases", "2-16-128:abc:0.1"], ["--cases items look like", "abc"]),
        (["--query-block", "100"], ["--query-block", "invalid choice"]),
        (["--rep-ms", "0"], ["--rep-ms must be a positive finite number"]),
        (["--no-flex", "--flex-dynamic"], ["--flex-dynamic", "--no-flex"]),
        (["--no-flex", "--flex-lengths", "4096"], ["--flex-lengths", "--no-flex"]),
        (["--out", "/nonexistent_dir_pisa/r.json"], ["--out", "does not exist"]),
        (["--cases", "2-16-128:4096:0.1", "--lengths", "8192"], ["--lengths", "--cases"]),
        (["--cases", "2-16-128:4096:0.1", "--densities", "0.5"], ["--densities", "--cases"]),
        (["--cases", "2-16-128:4096:0.1", "--configs", "1-2-64"], ["--configs", "--cases"]),
    ],
    ids=lambda x: x[0].lstrip("-") if isinstance(x, list) else None,
)
def test_bench_misuse_is_one_error_line_before_any_gpu_work(args, words, capsys):
    rc, err = run_cli(["bench", *args], capsys)
    assert_clear_error(rc, err, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_bench_without_cuda_is_one_error_line(capsys, monkeypatch):
    rc, err = run_cli(["bench", "--lengths", "4096"], capsys)
    assert_clear_error(rc, err, "needs a CUDA GPU")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, err = run_cli(["bench", "--plot", "x.png"], capsys)
    assert_clear_error(rc, err, "--plot", "matplotlib")


def test_top_level_unknown_option_is_an_error(capsys):
    rc, err = run_cli(["--bogus"], capsys)
    assert_clear_error(rc, err, "unrecognized arguments: --bogus")


def test_study_out_that_cannot_be_created(tmp_path, capsys, no_study, monkeypatch):
    def refuse(path, exist_ok=False):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(no_study.os, "makedirs", refuse)
    rc, err = run_cli(["study", "--size", "tiny", "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, "cannot create the directory", "Permission denied")


def test_readme_plan_run_example_runs_as_written():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "plan(q, k, s)" in c)
    import torch

    from pisa_attn import pisa_attention
    from pisa_attn.data import dit_qkv

    qkv = dit_qkv((2, 8, 16), heads=2, head_dim=32)  # the snippet's q, k, v, here on the CPU
    scope = {"q": qkv.q, "k": qkv.k, "v": qkv.v}
    exec(compile(code, "README.md", "exec"), scope)
    want = pisa_attention(qkv.q, qkv.k, qkv.v, density=0.125)
    torch.testing.assert_close(scope["out"], want, rtol=0, atol=0)


def _capture_of(path, parts: dict, info: dict | None = None):
    """A one-entry capture ``step0.layer0`` of the given q/k/v tensors (and entry info)."""
    from pisa_attn.qkv_file import write_qkv_file

    tensors = {f"step0.layer0.{p}": x for p, x in parts.items()}
    write_qkv_file(str(path), tensors, {"step0.layer0": {"step": 0, "layer": 0, **(info or {})}}, model="test",
                   dtype="float32")
    return path


def _qkv(h=2, length=256, d=32):
    g = torch.Generator().manual_seed(0)
    return {p: torch.randn(1, h, length, d, generator=g) for p in "qkv"}


def _bad_captures():
    nan = _qkv()
    nan["q"][0, 0, 3, 1] = float("nan")
    ints = _qkv()
    ints["k"] = ints["k"].to(torch.int32)
    return [
        ("nan", nan, None, "NaN"),
        ("int-keys", ints, None, "floating"),
        ("rank3", {p: x[0] for p, x in _qkv().items()}, None, "rank 4"),
        ("kv-lengths", {**_qkv(), "v": _qkv(length=128)["v"]}, None, "one shape"),
        ("head-dim-8", _qkv(d=8), None, "head dim"),
        ("short-layout", _qkv(), {"token_layout": {"segments": [{"grid": [4, 41]}], "tile": [2, 8]}}, "164 tokens"),
        ("bad-layout", _qkv(), {"token_layout": {"segments": 5}}, "malformed token layout"),
    ]


@pytest.mark.parametrize("parts,info,word", [c[1:] for c in _bad_captures()], ids=[c[0] for c in _bad_captures()])
def test_study_checks_every_captured_entry_before_work(parts, info, word, tmp_path, capsys, no_study):
    cap = _capture_of(tmp_path / "cap.safetensors", parts, info)
    rc, err = run_cli(["study", "--source", str(cap), "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, "step0.layer0", word)


def test_study_entries_of_other_head_counts_are_refused(tmp_path, capsys, no_study):
    from pisa_attn.qkv_file import write_qkv_file

    tensors = {}
    for name, h in (("step0.layer0", 4), ("step1.layer0", 2)):
        tensors.update({f"{name}.{p}": x for p, x in _qkv(h=h).items()})
    info = {"step0.layer0": {"step": 0, "layer": 0}, "step1.layer0": {"step": 1, "layer": 0}}
    write_qkv_file(str(tmp_path / "cap.safetensors"), tensors, info, model="test", dtype="float32")
    rc, err = run_cli(["study", "--source", str(tmp_path / "cap.safetensors"), "--out", str(tmp_path / "o")], capsys)
    assert_clear_error(rc, err, "one number of query heads", "[2, 4]")


def test_calibrate_refuses_to_overwrite_its_capture(tmp_path, capsys):
    cap = write_capture(tmp_path / "cap.safetensors")
    size = cap.stat().st_size
    rc, err = run_cli(["calibrate", str(cap), "--out", str(cap)], capsys)
    assert_clear_error(rc, err, "--out", "capture being read")
    assert cap.stat().st_size == size


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_plot_format_is_checked_first(command, tmp_path, capsys):
    rc, err = run_cli([command, "--plot", str(tmp_path / "speed.xyz")], capsys)
    assert rc == 2 and "'xyz'" in err and "png" in err and "Traceback" not in err


def test_demo_plot_and_json_must_differ(tmp_path, capsys):
    rc, err = run_cli(["demo", "--length", "64", "--plot", str(tmp_path / "a.png"), "--json", str(tmp_path / "a.png")],
                      capsys)
    assert_clear_error(rc, err, "--plot and --json are the same file")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--data", "dit", "--lengths", "1000"], ["multiples of 1024"]),
        (["--configs", "1-2-8"], ["head dim"]),
        (["--rep-ms", "inf"], ["--rep-ms"]),
        (["--precision", "fp8", "--backend", "triton"], ["fp8", "hopper"]),
        (["--lengths", "4096", "--flex-lengths", "12345"], ["--flex-lengths", "12345"]),
    ],
)
def test_bench_values_are_checked_before_the_gpu(args, words, capsys, monkeypatch):
    from pisa_attn.bench import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU check, to the values
    monkeypatch.setattr(kernels, "run_bench", lambda *a, **k: pytest.fail("the benchmark started"))
    rc, err = run_cli(["bench", *args], capsys)
    assert_clear_error(rc, err, *words)


@pytest.mark.parametrize("args, words", [([], ["2-4-32", "reference", "not timed"]),
                                         (["--backend", "hopper"], ["2-4-32", "hopper"]),
                                         (["--precision", "int8"], ["2-4-32", "int8"])])
def test_bench_refuses_configs_no_kernel_runs_before_the_gpu_works(args, words, capsys, monkeypatch):
    """A config whose calls the kernels cannot run (a head dim the forced backend or precision does
    not take, or auto falling back to the reference) is one error before anything is timed, not an
    error row per case after the dense baselines ran. CPU tensors stand in for the device's: no
    kernel backend takes them without the interpreter."""
    from pisa_attn.bench import kernels

    check = kernels.check_kernels_run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "check_kernels_run", lambda *a, **k: check(*a, **k, device="cpu"))
    monkeypatch.setattr(kernels, "run_bench", lambda *a, **k: pytest.fail("the benchmark started"))
    rc, err = run_cli(["bench", "--configs", "2-4-32", "--lengths", "4096", *args], capsys)
    assert_clear_error(rc, err, *words)


def test_bench_check_passes_what_a_kernel_runs(monkeypatch):
    pytest.importorskip("triton")
    from pisa_attn.bench import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels take CPU tensors
    kernels.check_kernels_run({kernels.Config(2, 4, 32)}, torch.float16, "triton", "input", None, device="cpu")


def test_plot_formats_are_those_written_without_external_programs():
    import argparse

    from pisa_attn.bench import argtypes

    with pytest.raises(argparse.ArgumentTypeError, match="'pgf' is not one of"):
        argtypes.plot_file("/tmp/plot.pgf")  # needs TeX, found only after the work
    assert argtypes.plot_file("/tmp/plot.svg") == "/tmp/plot.svg"


def test_bench_dense_keeps_the_eager_time_when_graph_capture_fails(monkeypatch):
    """The CUDA-graph column is timed on its own: a capture that fails is reported as such and
    leaves cuDNN's eager time in the row."""
    from pisa_attn.bench import kernels

    def no_graph(fn, rep_ms):
        raise RuntimeError("capture failed\nsecond line")

    monkeypatch.setattr(kernels, "_inputs", lambda *a, **kw: (None, None, None))
    monkeypatch.setattr(kernels, "_sdpa", lambda backend: lambda q, k, v: None)
    monkeypatch.setattr(kernels, "bench_ms", lambda fn, rep_ms: 1.5)
    monkeypatch.setattr(kernels, "graph_ms", no_graph)
    row = kernels.bench_dense(kernels.Config.parse("2-16-128"), 4096, torch.bfloat16, "bhsd", 10.0, graphs=True)
    assert row["sdpa_cudnn"] == 1.5 and row["sdpa_flash"] == 1.5
    assert row["sdpa_cudnn_graph"] is None and row["sdpa_cudnn_graph_error"] == "capture failed"


def test_bench_times_the_lean_call_on_a_planned_workspace():
    """The timed PISA call is run(plan, q, k, v, out=) on a plan with its workspace: the result
    of pisa_attention, written into one output buffer on every call."""
    from pisa_attn import pisa_attention
    from pisa_attn.bench import kernels

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 32, generator=g).half() for _ in range(3))
    p, call = kernels._timed_call(q, k, v, 0.25, "hybrid", "triton")
    assert p.workspace is not None
    first = call()
    assert call() is first
    torch.testing.assert_close(first, pisa_attention(q, k, v, density=0.25, block_size=64, covariance_aware=False,
                                                     backend="triton"), rtol=0, atol=0)


def test_bench_case_refuses_to_time_the_reference_as_pisa(monkeypatch):
    """A case the kernels cannot run (auto falls back to the PyTorch reference: here CPU tensors,
    on a GPU a head dim like 96) is an error of that case, not the reference's time reported as
    PISA's latency beside the dense baselines."""
    from pisa_attn.bench import kernels

    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 2, 256, 32, generator=g) for _ in range(3)]
    monkeypatch.setattr(kernels, "_inputs", lambda *a, **kw: qkv)
    monkeypatch.setattr(kernels, "bench_ms", lambda fn, rep_ms=60.0: 1.0)
    monkeypatch.setattr(kernels, "peak_extra_bytes", lambda fn, out_bytes: 0)
    with pytest.raises(ValueError, match="reference"):
        kernels.bench_case(kernels.Config(1, 2, 32), 256, 0.25, torch.float32, "bhsd", 10.0, with_flex=False,
                           phases=False)
