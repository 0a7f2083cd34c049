"""The accuracy study (``pisa-attn study``) at CI size, and the measurements it is built on."""

import argparse
import json
import math

import pytest
import torch

from pisa_attn import pisa_attention
from pisa_attn import metrics
from pisa_attn.bench.study import MODES, StudyConfig, add_parser, main, run_study
from pisa_attn.bench.study_sources import Sample, SyntheticSource, halving_grids, synthetic_grid
from pisa_attn.data import dit_qkv
from pisa_attn.ops import reference as ref


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    result = run_study(StudyConfig(size="tiny"), out=str(out), progress=False)
    return result, out


def test_tiny_study_writes_json_and_plots(tiny_study):
    result, out = tiny_study
    on_disk = json.loads((out / "study.json").read_text())
    for key in ("config", "source", "density_sweep", "length_sweep", "scores", "tail_mass", "tiling", "summary"):
        assert key in on_disk, key
    weighted = ["hybrid-default", "hybrid-calibrated", "hybrid-default+cov", "hybrid-calibrated+cov"]
    variants = [m for m in MODES] + [f"{m}+cov" for m in MODES] + weighted
    assert on_disk["variants"] == variants
    assert set(on_disk["density_sweep"]["rel_l1"]) == set(variants)
    assert set(on_disk["length_sweep"]["rel_l1"]) == set(variants)
    for key in ("block_mean", "block_mean_shifted", "token", "token_shifted"):
        h = on_disk["scores"][key]
        assert len(h["edges"]) == len(h["selected"]) + 1 == len(h["tail"]) + 1
        assert sum(h["selected"]) == h["selected_stats"]["n"] > 0 and sum(h["tail"]) == h["tail_stats"]["n"] > 0
    assert set(result["plots"]) == {"density.png", "length.png", "scores.png", "tail_mass.png", "tiling.png"}
    for name in result["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["runtime_s"] < 60


def test_study_trends_the_math_guarantees(tiny_study):
    result, _ = tiny_study
    ds = result["density_sweep"]
    dens = ds["densities"]
    i1 = dens.index(1.0)
    for name, errs in ds["rel_l1"].items():
        assert errs[i1] < 1e-5, name  # density 1: every block exact
        assert all(e > 1e-4 for j, e in enumerate(errs) if j != i1), name  # sparse: a real error
    for j, d in enumerate(dens):
        if d < 1.0:  # the generator's default heads: PISA's tail terms never lose to dropping the tail
            assert ds["rel_l1"]["drop"][j] >= ds["rel_l1"]["hybrid"][j]
            assert ds["rel_l1"]["drop+cov"][j] >= ds["rel_l1"]["hybrid+cov"][j]
    tail = ds["tail_mass"]["topk"]
    assert all(a >= b - 1e-9 for a, b in zip(tail, tail[1:]))  # nested top-k sets
    assert tail[i1] == 0.0
    # Jensen: a centroid exponential never exceeds its block's mean exponential.
    assert all(e <= t + 1e-9 for e, t in zip(ds["tail_estimate"]["topk"], tail))
    tm = result["tail_mass"]
    assert len(tm["per_head"]["topk"]) == result["config"]["heads"]
    assert 0.0 < tm["estimate_ratio"]["topk"] <= 1.0
    tl = result["tiling"]
    assert tl["compactness"]["tiled"]["one_tile"] == 1.0 and tl["compactness"]["raster"]["one_tile"] == 0.0
    assert tl["tiled"]["rel_l1"]["hybrid"][i1] < 1e-5 and tl["raster"]["rel_l1"]["hybrid"][i1] < 1e-5


def test_cli_subcommand_runs_and_writes(tmp_path):
    parser = argparse.ArgumentParser(prog="pisa-attn")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["study", "--size", "tiny", "--out", str(tmp_path), "--modes", "drop,hybrid",
                              "--no-covariance", "--densities", "0.25,1", "--length", "256", "--lengths", "256",
                              "--heads", "2", "--no-plots", "--no-progress"])
    assert args.func(args) == 0
    r = json.loads((tmp_path / "study.json").read_text())
    assert r["variants"] == ["drop", "hybrid", "hybrid-default", "hybrid-calibrated"]
    assert r["density_sweep"]["length"] == 256
    assert r["length_sweep"]["lengths"] == [256] and r["plots"] == []
    assert r["config"]["heads"] == 2 and r["config"]["covariance"] is False


def test_weighted_variants_are_honest(tiny_study):
    """hybrid is the paper (alpha 1); hybrid-default runs spec.DEFAULT_ALPHA; hybrid-calibrated uses
    weights fitted on ANOTHER input (the generator's next seed), recorded in the JSON."""
    from pisa_attn import calibration as cal
    from pisa_attn import spec

    result, _ = tiny_study
    c = result["calibration"]
    assert c["on"] == "synthetic draw with seed 1" and result["alpha_default"] == spec.DEFAULT_ALPHA
    cfg = StudyConfig(size="tiny").resolved()
    src = SyntheticSource(heads=cfg.heads, head_dim=cfg.head_dim, seed=0, text_tokens=0, dtype=torch.float32,
                          device="cpu")
    (s,) = src.fixed(cfg.length)
    (other,) = SyntheticSource(heads=cfg.heads, head_dim=cfg.head_dim, seed=1, text_tokens=0, dtype=torch.float32,
                               device="cpu").fixed(cfg.length)
    i = cfg.densities.index(0.2)
    alpha = torch.tensor(c["alpha"][s.name]["topk"][i])
    fitted = cal.fit_rows(other.q, other.k, other.v, density=0.2, block_size=64).stats.alpha(
        default=spec.DEFAULT_ALPHA, bounds=cal.FIT_BOUNDS)
    torch.testing.assert_close(alpha.double(), fitted, rtol=1e-6, atol=1e-6)
    own = cal.fit_rows(s.q, s.k, s.v, density=0.2, block_size=64).stats.alpha()
    assert not torch.allclose(alpha.double(), own, atol=1e-4)  # not fitted on the evaluated input
    dense = torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v)
    ds = result["density_sweep"]["rel_l1"]
    for name, a in (("hybrid", 1.0), ("hybrid-default", None), ("hybrid-calibrated", alpha)):
        out = pisa_attention(s.q, s.k, s.v, density=0.2, block_size=64, alpha=a, covariance_aware=False)  # "topk" rows
        assert ds[name][i] == pytest.approx(metrics.rel_l1(out, dense), rel=1e-5), name


def test_study_without_weighted_variants():
    r = run_study(StudyConfig(size="tiny", modes=("zeroth", "hybrid"), covariance=False, weights=(), densities=(0.25,),
                              lengths=(512,), plots=False), progress=False)
    assert r["variants"] == ["zeroth", "hybrid"] and r["calibration"] is None


def test_fp8_flag_is_the_fp8_precision():
    """--fp8 is ``--precision fp8``; low precisions need the hybrid mode."""
    assert StudyConfig(fp8=True).resolved().low_precisions == ("fp8",)
    with pytest.raises(ValueError, match="fp8"):
        StudyConfig(modes=("zeroth",), fp8=True).resolved()


def test_low_precision_variants_beside_the_default():
    """--precision NAME (repeatable) adds hybrid-NAME per low precision, in its quantised math;
    INT8 Q·Kᵀ with P·V in the input dtype stays closest to the default."""
    from pisa_attn import spec
    from pisa_attn.ops.quant import lowp_pisa_forward

    cfg = StudyConfig(size="tiny", modes=("hybrid",), covariance=False, weights=("default",), densities=(0.25,),
                      lengths=(512,), precisions=("int8", "int8-fp8", "int8-int8"), fp8=True, plots=False)
    assert cfg.resolved().low_precisions == ("fp8", "int8", "int8-fp8", "int8-int8")
    r = run_study(cfg, progress=False)
    for p in spec.PRODUCT_FORMATS:
        assert f"hybrid-{p}" in r["variants"]
    c = cfg.resolved()
    (s,) = SyntheticSource(heads=c.heads, head_dim=c.head_dim, seed=0, text_tokens=0, dtype=torch.float32,
                           device="cpu").fixed(c.length)
    stats = ref.block_stats(s.k, s.v, 64)
    sel = metrics.select(s.q, s.k, s.v, density=0.25, block_size=64, covariance_aware=False, stats=stats)
    alpha = torch.full((c.heads,), spec.DEFAULT_ALPHA)
    out, _ = lowp_pisa_forward(s.q, s.k, s.v, stats.kmean, stats.vsum, stats.hbar, sel.selected, mode="hybrid",
                               scale=c.head_dim ** -0.5, block_size=64, alpha=alpha, precision="int8")
    dense = torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v)
    ds = r["density_sweep"]["rel_l1"]
    assert ds["hybrid-int8"][0] == pytest.approx(metrics.rel_l1(out, dense), rel=1e-5)
    gap = {p: abs(ds[f"hybrid-{p}"][0] - ds["hybrid-default"][0]) for p in spec.PRODUCT_FORMATS}
    assert gap["int8"] < gap["fp8"]
    assert 0 < gap["fp8"] < 0.3 * ds["hybrid-default"][0]  # the rounding shows, and is small beside PISA's own
    with pytest.raises(ValueError, match="precisions must be a subset"):
        StudyConfig(precisions=("int4",)).resolved()


def test_cli_precision_flags(tmp_path):
    """--precision is repeatable and --fp8 still adds hybrid-fp8."""
    parser = argparse.ArgumentParser(prog="pisa-attn")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["study", "--size", "tiny", "--out", str(tmp_path), "--modes", "hybrid",
                              "--no-covariance", "--weights", "default", "--densities", "0.25", "--length", "256",
                              "--lengths", "256", "--heads", "2", "--no-plots", "--no-progress",
                              "--precision", "int8", "--precision", "int8-fp8", "--fp8"])
    assert args.func(args) == 0
    r = json.loads((tmp_path / "study.json").read_text())
    assert r["variants"] == ["hybrid", "hybrid-default", "hybrid-fp8", "hybrid-int8", "hybrid-int8-fp8"]
    with pytest.raises(SystemExit):
        parser.parse_args(["study", "--precision", "input"])


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(densities=(0.0, 0.5)), "densities"),
        (dict(density=1.5), "density"),
        (dict(modes=("hybrid", "bogus")), "modes"),
        (dict(source="/nonexistent/x.safetensors"), "source"),
        (dict(size="huge"), "size"),
        (dict(heads=0), "heads"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(block_size=48), "block_size"),
        (dict(head_dim=33), "head_dim"),
        (dict(weights=("calibrated", "oracle")), "weights"),
        (dict(calib_source="/nonexistent/x.safetensors"), "calib_source"),
    ],
)
def test_bad_config_names_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        StudyConfig(**kwargs).resolved()


def test_main_rejects_bad_list():
    with pytest.raises(SystemExit):
        main(["--densities", "a,b"])


def test_synthetic_grid_and_halving():
    assert synthetic_grid(4096) == (4, 32, 32) and synthetic_grid(512) == (2, 16, 16)
    assert synthetic_grid(64) == (1, 8, 8)
    with pytest.raises(ValueError, match="multiples of 64"):
        synthetic_grid(100)
    assert halving_grids((8, 16, 16), 3, 0) == [(8, 16, 16), (4, 16, 16), (2, 16, 16)]
    assert halving_grids((16, 16), 5, 64) == [(16, 16), (8, 16), (8, 8)]


def _brute_tail(q, k, selected, bs):
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    tok_block = torch.arange(k.shape[2]) // bs
    exact = selected.index_select(2, torch.arange(q.shape[2]) // bs).index_select(-1, tok_block)
    return p.masked_fill(exact, 0).sum(-1)


def test_dense_pass_matches_brute_force():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 32) for _ in range(3))  # ragged last block
    stats = ref.block_stats(k, v, 64)
    sel = metrics.select(q, k, v, density=0.3, block_size=64)
    dp = metrics.dense_pass(q, k, v, block_size=64, masks=(sel.selected,), kmean=stats.kmean)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(dp.out, sdpa, atol=1e-5)
    assert torch.allclose(dp.tail_mass[0].double(), _brute_tail(q, k, sel.selected, 64), atol=1e-6)
    assert bool((dp.tail_estimate[0] <= dp.tail_mass[0] + 1e-6).all())
    out = pisa_attention(q, k, v, density=0.3, mode="drop", backend="reference")
    assert math.isclose(metrics.rel_l1(out, dp.out),
                        float((out - dp.out).abs().mean() / dp.out.abs().mean()), rel_tol=1e-5)
    assert metrics.rel_l1(dp.out, dp.out) == 0.0


def test_sample_raster_and_crop_keep_tokens():
    g = dit_qkv((4, 8, 8), heads=2, head_dim=32, seed=3)
    s = Sample("x", g.q, g.k, g.v, g.token_layout)
    raw = dit_qkv((4, 8, 8), heads=2, head_dim=32, seed=3, tiled=False)
    assert torch.equal(s.raster().q, raw.q)
    crop = s.crop((2, 8, 8))  # the first two frames: the first 128 raster tokens
    assert crop.length == 128 and crop.layout.grid_shape == (2, 8, 8)
    assert torch.equal(crop.raster().k, raw.k[:, :, :128])
    assert s.query_range() == (0, 256)


def test_synthetic_source_reuses_fixed_sample():
    src = SyntheticSource(heads=2, head_dim=32, seed=0, text_tokens=0, dtype=torch.float32, device="cpu")
    (fixed,) = src.fixed(256)
    sweep = dict(src.sweep((128, 256)))
    assert sweep[256][0] is fixed and sweep[128][0].length == 128


def test_study_runs_image_queries_on_the_key_block_grid():
    # A captured [text][image] sequence whose 13 text tokens end mid-block: the study measures the
    # image queries as the diffusers backend runs them (query blocks on the key blocks' grid).
    from pisa_attn import layout as lay
    from pisa_attn.bench.study import _Study

    g = dit_qkv((6, 10), heads=2, head_dim=32, text_tokens=13, tiled=False, seed=3)
    joint = lay.make_layout((6, 10), tile=(4, 4), text_before=13, order="compact_inplace")
    q, k, v = (joint.to_tiled(x, 2) for x in (g.q, g.k, g.v))
    sample = Sample("misaligned", q, k, v, joint)
    lo, hi = sample.query_range()
    assert (lo, hi) == (13, 73)
    study = _Study(StudyConfig(size="tiny", block_size=16).resolved(), progress=False)
    got = study.evaluate(sample, [0.25], ["zeroth"], (False,))["rel_l1"]["zeroth"][0]
    keep = joint.keep_blocks(16)
    whole = pisa_attention(q, k, v, density=0.25, block_size=16, mode="zeroth", keep_blocks=keep, covariance_aware=False)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert got == pytest.approx(metrics.rel_l1(whole[:, :, lo:hi], dense[:, :, lo:hi]), rel=1e-5)


def test_synthetic_partner_has_the_samples_grid_with_text_tokens():
    """The calibrated variant's input is another draw of the studied sample's grid (text tokens come
    on top of the image tokens the generator is given)."""
    src = SyntheticSource(heads=2, head_dim=32, seed=0, text_tokens=100, dtype=torch.float32, device="cpu")
    (sample,) = src.fixed(512)
    partner = src.calibration().partner(sample)
    assert partner.length == sample.length == 612 and partner.layout.grid_shape == sample.layout.grid_shape
    assert not torch.equal(partner.q, sample.q)


def test_an_unreadable_calibration_capture_is_refused_before_work(tmp_path):
    pytest.importorskip("safetensors")
    from pisa_attn.bench.study import check_before_work

    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a capture")
    cfg = StudyConfig(source=str(bad), calib_source=str(bad))
    with pytest.raises(ValueError, match="calib_source: path .* is not a readable .safetensors file"):
        check_before_work(cfg, None)


def test_a_calibration_capture_of_another_family_is_not_used(tmp_path):
    """FLUX and SD3 captures share head count and grid rank (as FLUX.1 and SD3.5-medium do): the
    model family recorded in the capture keeps one from calibrating the other."""
    pytest.importorskip("diffusers")
    pytest.importorskip("safetensors")
    from diffusers_tiny import prompt_kwargs, tiny_pipeline
    from pisa_attn.bench.study_sources import CapturedSource
    from pisa_attn.diffusers.capture import capture_qkv

    paths = {}
    for fam in ("flux", "sd3"):
        pipe = tiny_pipeline(fam)
        paths[fam] = str(tmp_path / f"{fam}.safetensors")
        with torch.no_grad(), capture_qkv(pipe, layers=[0], steps=range(2), path=paths[fam]):
            pipe(**prompt_kwargs(fam), num_inference_steps=2)
    src = CapturedSource(paths["flux"], dtype=torch.float32, device="cpu")
    (sample,) = src.fixed()[:1]
    assert src.calibration(paths["sd3"]).partner(sample) is None
    assert src.calibration(paths["flux"]).partner(sample) is not None  # another step of the same file


def test_metrics_select_checks_keep_blocks_as_pisa_attention_does():
    """A mask of the wrong length or dtype is refused by name (a raw torch error, or a float mask
    silently cast to bool, before)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 32, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match="keep_blocks must have shape"):
        metrics.select(q, k, v, density=0.5, block_size=64, keep_blocks=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="keep_blocks must have dtype torch.bool"):
        metrics.select(q, k, v, density=0.5, block_size=64, keep_blocks=torch.full((4,), 0.5))
    keep = torch.tensor([True, False, False, False])
    sel = metrics.select(q, k, v, density=0.25, block_size=64, keep_blocks=keep)
    assert sel.selected[..., 0].all()


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(covariance="no"), "covariance must be a bool"),
        (dict(plots="false"), "plots must be a bool"),
        (dict(fp8=1), "fp8 must be a bool"),
        (dict(source=3), "source must be a str"),
        (dict(dtype=["float32"]), "dtype must be a str or None"),
        (dict(size=1), "size must be a str or None"),
        (dict(device=0), "device must be a str"),
        (dict(calib_source=b"x"), "calib_source must be a str or None"),
        (dict(entries="step0.layer0"), "entries must be a list or tuple"),  # not its characters
        (dict(entries=(3,)), "entries must be entry names"),
        (dict(lengths=256), "lengths must be a list or tuple"),
        (dict(modes="hybrid"), "modes must be a list or tuple"),
    ],
)
def test_config_field_types_are_checked_by_name(kwargs, word):
    """A string where a bool is expected is truthy and a string where a list is expected is a list
    of its characters: both are refused by name, not taken."""
    with pytest.raises(TypeError, match=word):
        StudyConfig(**kwargs).resolved()


def _write_capture(path, steps=(0, 1), image_range=None, lengths=(256, 256)):
    """A capture of random q/k/v without token layout, one layer at ``steps`` (of ``lengths`` tokens)."""
    from pisa_attn.qkv_file import write_qkv_file

    tensors, info = {}, {}
    for step, length in zip(steps, lengths):
        name = f"step{step}.layer0"
        g = torch.Generator().manual_seed(step)
        for part in "qkv":
            tensors[f"{name}.{part}"] = torch.randn(1, 2, length, 32, generator=g)
        info[name] = {"step": step, "layer": 0, "image_range": image_range}
    write_qkv_file(str(path), tensors, info, model="test", dtype="float32")
    return str(path)


def test_calib_source_naming_the_studied_file_stays_held_out(tmp_path):
    """The studied file as calib_source (by another spelling of its path too) calibrates on another
    step, as without calib_source; a copy of it, which holds the studied q/k/v, is not used."""
    pytest.importorskip("safetensors")
    import os
    import shutil

    from pisa_attn.bench.study_sources import CapturedSource

    path = _write_capture(tmp_path / "cap.safetensors")
    src = CapturedSource(path, dtype=torch.float32, device="cpu")
    first = src.fixed()[0]
    assert first.name == "step0.layer0"
    other_spelling = os.path.join(str(tmp_path), ".", "cap.safetensors")
    for calib in (path, other_spelling):
        partners = src.calibration(calib)
        assert partners.partner(first).name == "step1.layer0"  # before: step0.layer0, the evaluated input
        assert "another captured step" in partners.note
    copy = shutil.copy(path, tmp_path / "copy.safetensors")
    assert src.calibration(str(copy)).partner(first) is None
    r = run_study(StudyConfig(source=path, calib_source=path, size="tiny", modes=("hybrid",), covariance=False,
                              weights=("calibrated",), densities=(0.25,), plots=False), progress=False)
    assert r["calibration"]["partners"] == {"step0.layer0": "step1.layer0", "step1.layer0": "step0.layer0"}


def test_a_capture_without_layout_runs_the_queries_of_its_image_range(tmp_path):
    """A layout-less capture's image_range is where PISA ran (the text queries ran densely): the
    study measures those rows, not every row."""
    pytest.importorskip("safetensors")
    from pisa_attn.bench.study import _Study
    from pisa_attn.bench.study_sources import CapturedSource

    path = _write_capture(tmp_path / "cap.safetensors", steps=(0,), image_range=[40, 256])
    (sample,) = CapturedSource(path, dtype=torch.float32, device="cpu").fixed()
    assert sample.layout is None and sample.query_range() == (40, 256)
    assert sample.query_rows(16) == (slice(32, 256), slice(8, 224))
    study = _Study(StudyConfig(size="tiny", block_size=16).resolved(), progress=False)
    got = study.evaluate(sample, [0.25], ["zeroth"], (False,))["rel_l1"]["zeroth"][0]
    q, k, v = sample.q, sample.k, sample.v
    out = pisa_attention(q[:, :, 32:], k, v, density=0.25, block_size=16, mode="zeroth", covariance_aware=False,
                         backend="reference")
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert got == pytest.approx(metrics.rel_l1(out[:, :, 8:], dense[:, :, 40:]), rel=1e-5)


def test_summary_keeps_samples_of_different_lengths_apart(tmp_path):
    """Entries of 256 and 1024 tokens: the summary gives each length its own tail mass and error
    (a mean over both would compare nothing), and says which lengths it holds."""
    pytest.importorskip("safetensors")
    from pisa_attn.bench.study import print_summary

    path = _write_capture(tmp_path / "cap.safetensors", lengths=(256, 1024))
    r = run_study(StudyConfig(source=path, size="tiny", modes=("drop",), covariance=False, weights=(),
                              densities=(0.25,), density=0.25, plots=False), progress=False)
    s = r["summary"]
    assert s["length"] == [256, 1024]
    by_len = r["tail_mass"]["mean_by_length"]["topk"]
    assert set(s["tail_mass"]) == {"topk L=256", "topk L=1024"}
    assert s["tail_mass"]["topk L=256"] == by_len["256"] != by_len["1024"] == s["tail_mass"]["topk L=1024"]
    per = r["density_sweep"]["rel_l1_per_sample"]
    assert s["rel_l1"] == {"drop L=256": per["step0.layer0"]["drop"][0], "drop L=1024": per["step1.layer0"]["drop"][0]}
    print_summary(r)


def test_synthetic_source_reuses_fixed_sample_with_text_tokens():
    """Lengths count image tokens: with text on top the fixed sample is still reused, not drawn
    again (and then evaluated again by the length sweep)."""
    src = SyntheticSource(heads=2, head_dim=32, seed=0, text_tokens=100, dtype=torch.float32, device="cpu")
    (fixed,) = src.fixed(256)
    assert src.fixed(256)[0] is fixed and fixed.length == 356
    sweep = dict(src.sweep((128, 256)))
    assert sweep[256][0] is fixed and sweep[128][0].length == 228


def test_summary_from_the_length_sweep_takes_its_tail_mass_at_the_same_length():
    """A density sweep without the study density: the summary's errors are the length sweep's
    longest point, and so is its tail mass (not the density sweep's, at another length)."""
    r = run_study(StudyConfig(size="tiny", modes=("drop",), covariance=False, weights=(), densities=(0.5,),
                              density=0.25, length=256, lengths=(256, 512), heads=2), progress=False)
    s, ls = r["summary"], r["length_sweep"]
    assert s["length"] == 512 and s["rel_l1"] == {"drop": ls["rel_l1"]["drop"][-1]}
    assert s["tail_mass"] == {"topk": ls["tail_mass"]["topk"][-1]}
    assert ls["tail_mass"]["topk"][0] != ls["tail_mass"]["topk"][-1]  # the lengths differ in tail mass


@pytest.mark.parametrize("flags, given", [(["--heads", "8"], "heads"), (["--head-dim", "64"], "head_dim"),
                                          (["--text-tokens", "0"], "text_tokens")])
def test_a_capture_refuses_the_synthetic_sources_shape(tmp_path, capsys, flags, given):
    """Heads, head dim and text tokens describe the synthetic generator: beside a capture (which has
    its own) they are refused, even at their default values, instead of silently ignored."""
    pytest.importorskip("safetensors")
    path = _write_capture(tmp_path / "cap.safetensors")
    assert main(["--source", path, "--size", "tiny", "--out", str(tmp_path / "o"), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert given in err and "synthetic source" in err
    with pytest.raises(ValueError, match=given):
        StudyConfig(source=path, **{given: int(flags[1])}).resolved()
    c = StudyConfig(source=path, size="tiny").resolved()  # a capture's own: none written as the preset's
    assert (c.heads, c.head_dim, c.text_tokens) == (None, None, None)
    s = StudyConfig(size="tiny").resolved()
    assert (s.heads, s.head_dim, s.text_tokens) == (4, 64, 0)
