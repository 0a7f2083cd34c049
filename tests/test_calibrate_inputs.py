"""Bad input on the calibration path: every case a one-line error naming the entry or argument,
exit 2, no traceback, no fit started, nothing written; no NaN ever reaches a table."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from pisa_attn import alpha_table as at
from pisa_attn import calibration as cal
from pisa_attn.bench import calibrate as bc

pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402


def _entry(step=0, layer=0):
    return {"step": step, "layer": layer, "scale": 0.125, "image_range": [0, 128]}


def _write(path, tensors=None, entries=None, meta_entries="default"):
    g = torch.Generator().manual_seed(0)
    tensors = tensors if tensors is not None else {
        f"step0.layer0.{p}": torch.randn(1, 2, 128, 16, generator=g) for p in "qkv"}
    entries = {"step0.layer0": _entry()} if entries is None else entries
    meta = {"format": "pisa-attn-qkv", "version": "1", "model": '"flux"',
            "entries": json.dumps(entries) if meta_entries == "default" else meta_entries}
    if meta["entries"] is None:
        del meta["entries"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return str(path)


def _run(capsys, *args) -> str:
    code = bc.main([*map(str, args), "--block-size", "32", "--rows", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1
    return err


@pytest.fixture
def no_fit(monkeypatch):
    """Fails the test if any fit starts: the checks come first."""
    def boom(*a, **k):
        raise AssertionError("a fit started before the input was checked")
    monkeypatch.setattr(cal, "fit_rules", boom)


def _tensors(**parts):
    g = torch.Generator().manual_seed(1)
    out = {f"step0.layer0.{p}": torch.randn(1, 2, 128, 16, generator=g) for p in "qkv"}
    out.update({f"step0.layer0.{p}": x for p, x in parts.items()})
    return out


@pytest.mark.parametrize("case,parts,match", [
    ("nan", {"q": torch.full((1, 2, 128, 16), float("nan"))}, "NaN"),
    ("inf", {"v": torch.full((1, 2, 128, 16), float("inf"))}, "NaN or infinite"),
    ("int", {"k": torch.ones(1, 2, 128, 16, dtype=torch.int32)}, "floating"),
    ("rank3", {p: torch.randn(2, 128, 16) for p in "qkv"}, "rank 4"),
    ("klens", {"v": torch.randn(1, 2, 96, 16)}, "k and v"),
    ("heads", {"q": torch.randn(1, 3, 128, 16)}, "does not fit"),
    ("empty", {"q": torch.randn(1, 2, 0, 16)}, "empty"),
    ("fp64-int", {"v": torch.ones(1, 2, 128, 16, dtype=torch.int64)}, "floating"),
])
def test_bad_tensors_are_refused_naming_the_entry(tmp_path, capsys, no_fit, case, parts, match):
    path = _write(tmp_path / f"{case}.safetensors", _tensors(**parts))
    err = _run(capsys, path, "--out", tmp_path / "a.json")
    assert "step0.layer0" in err and match in err
    assert not (tmp_path / "a.json").exists()


@pytest.mark.parametrize("part", ["q", "v"])
def test_an_entry_without_its_tensors_is_refused(tmp_path, capsys, no_fit, part):
    tensors = _tensors()
    del tensors[f"step0.layer0.{part}"]
    path = _write(tmp_path / "m.safetensors", tensors)
    err = _run(capsys, path, "--out", tmp_path / "a.json")
    assert "step0.layer0" in err and repr([part]) in err
    assert not (tmp_path / "a.json").exists()


def test_a_fit_that_cannot_be_made_is_an_error_not_the_default(tmp_path, capsys):
    """Density 1: every key block exact, no tail on any fitted row, nothing to fit a weight on.
    The command fails naming the layer and writes nothing (no default weights passed off as fitted)."""
    path = _write(tmp_path / "ok.safetensors")
    code = bc.main([path, "--out", str(tmp_path / "a.json"), "--block-size", "32", "--rows", "0", "--density", "1.0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "layer 0" in err and "no weight can be fitted" in err
    assert not (tmp_path / "a.json").exists()


def test_choose_rules_refuses_a_head_without_tail_unless_told():
    zero, one = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    cc = torch.tensor([1.0, 0.0], dtype=torch.float64)  # head 1: no first-order term on any row
    fit = cal.RowFit(cal.AlphaStats(one * 0.5, cc, one, one), zero, 4)
    with pytest.raises(ValueError, match=r"layer 3 of 't'.*heads \[1\]"):
        cal.choose_rules({"t": {3: {False: fit}}})
    chosen, _ = cal.choose_rules({"t": {3: {False: fit}}}, over="layer")  # pooled: the layer has a term
    assert chosen["t"][3] is fit
    chosen, _ = cal.choose_rules({"t": {3: {False: fit}}}, require_tail=False)  # the online calibration
    assert chosen["t"][3].stats.alpha("head", default=0.75).tolist() == [0.5, 0.75]


@pytest.mark.parametrize("case,entries,match", [
    ("missing", None, "'entries'"),
    ("list", json.dumps(["step0.layer0"]), "'entries'"),
    ("nostep", json.dumps({"step0.layer0": {"layer": 0}}), "'step'"),
    ("badlayer", json.dumps({"step0.layer0": {"step": 0, "layer": "x"}}), "'layer'"),
    ("notobj", json.dumps({"step0.layer0": [0, 0]}), "info object"),
    # Infinity is valid JSON to Python's reader: a malformed layout, not an OverflowError traceback
    ("text-inf", json.dumps({"step0.layer0": {"step": 0, "layer": 0,
                                              "token_layout": {"segments": [{"text": float("inf")}]}}}), "text"),
    ("offset-inf", json.dumps({"step0.layer0": {"step": 0, "layer": 0, "token_layout": {
        "segments": [{"grid": [8, 16]}], "tile": [4, 8], "offset": float("inf")}}}), "offset"),
    ("text-float", json.dumps({"step0.layer0": {"step": 0, "layer": 0,
                                                "token_layout": {"segments": [{"text": 64.7}]}}}), "text"),
    # a list is no name: the layout would be unhashable, a TypeError traceback when first used
    ("text-label", json.dumps({"step0.layer0": {"step": 0, "layer": 0, "token_layout": {
        "segments": [{"grid": [8, 15]}, {"text": 8, "name": ["suffix"]}], "tile": [4, 8]}}}), "name"),
    # a [B, L, H, D] file whose entry records [B, H, L, D]: it would load as L heads
    ("shape", json.dumps({"step0.layer0": {"step": 0, "layer": 0, "shape": [1, 128, 2, 16]}}), "shape"),
])
def test_bad_metadata_is_refused(tmp_path, capsys, no_fit, case, entries, match):
    path = _write(tmp_path / f"{case}.safetensors", meta_entries=entries)
    err = _run(capsys, path, "--out", tmp_path / "a.json")
    assert match in err


@pytest.mark.parametrize("version", ["true", "1.0"])
def test_a_version_that_only_equals_one_is_refused(tmp_path, version):
    # the alpha table's reader refuses these too: a format version is an integer
    from pisa_attn.qkv_file import read_qkv_file

    path = str(tmp_path / "v.safetensors")
    meta = {"format": "pisa-attn-qkv", "version": version, "entries": json.dumps({"step0.layer0": _entry()})}
    save_file({f"step0.layer0.{p}": torch.zeros(1, 2, 128, 16) for p in "qkv"}, path, metadata=meta)
    with pytest.raises(ValueError, match="version"):
        read_qkv_file(path)


def test_bad_image_range_and_scale(tmp_path, capsys, no_fit):
    path = _write(tmp_path / "r.safetensors", entries={"step0.layer0": {**_entry(), "image_range": [0, 999]}})
    assert "image_range" in _run(capsys, path, "--out", tmp_path / "a.json")
    path = _write(tmp_path / "s.safetensors", entries={"step0.layer0": {**_entry(), "scale": -1}})
    assert "scale" in _run(capsys, path, "--out", tmp_path / "a.json")


@pytest.mark.parametrize("device,match", [("tpu", "device"), ("cuda:7", "device"), ("", "device")])
def test_unknown_or_missing_device(tmp_path, capsys, no_fit, device, match):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that device")
    path = _write(tmp_path / "ok.safetensors")
    assert match in _run(capsys, path, "--out", tmp_path / "a.json", "--device", device)


def test_unwritable_out_is_refused_before_the_fit(tmp_path, capsys, no_fit):
    path = _write(tmp_path / "ok.safetensors")
    assert "does not exist" in _run(capsys, path, "--out", tmp_path / "nope" / "a.json")
    assert "is a directory" in _run(capsys, path, "--out", tmp_path)


def test_core_install_without_safetensors(tmp_path, capsys, monkeypatch, no_fit):
    path = _write(tmp_path / "ok.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors -> ImportError
    assert "safetensors" in _run(capsys, path, "--out", tmp_path / "a.json")


def test_a_good_capture_fits_and_writes_finite_weights(tmp_path, capsys):
    path = _write(tmp_path / "ok.safetensors")
    assert bc.main([path, "--out", str(tmp_path / "a.json"), "--block-size", "32", "--rows", "0",
                    "--density", "0.25"]) == 0
    table = at.load(str(tmp_path / "a.json"))
    layer = table.layers()[0]
    assert len(layer.alpha) == 2 and all(0.0 <= a <= 1.0 for a in layer.alpha)
    assert isinstance(layer.covariance_aware, bool)  # chosen per layer
    assert "selection" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [1, 20])
def test_rows_is_the_count_of_rows_fitted_per_call(tmp_path, rows):
    """--rows N fits N query rows of each call (sampling draws whole runs of rows: cut to N)."""
    path = _write(tmp_path / "ok.safetensors")
    table = bc.calibrate_file(path, density=0.25, block_size=32, rows=rows)
    assert table.layers()[0].rows == rows  # one call, batch 1


def test_table_refuses_empty_layer_maps_and_bad_rules():
    good = {"format": at.FORMAT, "version": at.VERSION, "transformers": {"transformer": {"0": {"alpha": [0.5]}}}}
    assert at.from_json(good).layers()[0].covariance_aware is None  # old tables: the settings' rule
    # a second transformer without fitted layers (Wan2.2's expert that ran no warm-up step) loads
    two = at.from_json({**good, "transformers": {**good["transformers"], "transformer_2": {}}})
    assert two.layers("transformer_2") == {} and two.layers("transformer")[0].alpha == (0.5,)
    for bad, match in (({"transformer": {}}, "no weights"), ({"transformer": []}, "an object"),
                       ({"transformer": {"0": {"alpha": [0.5], "covariance_aware": "yes"}}}, "covariance_aware")):
        with pytest.raises(ValueError, match=match):
            at.from_json({**good, "transformers": bad})


def test_save_refuses_a_table_load_would_refuse_and_leaves_the_file(tmp_path):
    path = tmp_path / "alpha.json"
    good = at.AlphaTable({"transformer": {0: at.LayerAlpha((0.5, 0.25))}}, {"density": 0.15})
    good.save(path)
    before = path.read_text()
    assert at.load(str(path)).layers()[0].alpha == (0.5, 0.25)
    # not JSON: the file was truncated mid-write; NaN: written as a file load refuses
    unserialisable = at.AlphaTable({"transformer": {0: at.LayerAlpha((0.5,))}}, {"density": 0.15, "note": torch.ones(1)})
    nan = at.AlphaTable({"transformer": {0: at.LayerAlpha((float("nan"),))}})
    for bad, error, match in ((unserialisable, TypeError, "not JSON serializable"), (nan, ValueError, "alpha_table")):
        with pytest.raises(error, match=match):
            bad.save(path)
        assert path.read_text() == before
    with pytest.raises(ValueError, match="alpha_table"):
        nan.save(tmp_path / "new.json")
    assert not (tmp_path / "new.json").exists()


def test_a_non_finite_fit_is_an_error_not_a_table():
    nan = torch.tensor([float("nan")], dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    fit = cal.RowFit(cal.AlphaStats(nan, one, one, one), one, 1)
    with pytest.raises(ValueError, match="not finite"):
        at.from_fits({"transformer": {0: fit}}, settings={})
    inf = cal.RowFit(cal.AlphaStats(one, one, torch.tensor([float("inf")], dtype=torch.float64), one), one, 1)
    with pytest.raises(ValueError, match="not finite"):
        at.from_fits({"transformer": {0: inf}}, settings={})


def test_table_settings_and_fit_are_checked_and_a_capture_is_no_table(tmp_path):
    good = {"format": at.FORMAT, "version": at.VERSION, "transformers": {"transformer": {"0": {"alpha": [0.5]}}},
            "settings": {"density": 0.15, "mode": "hybrid", "covariance_aware": False, "block_size": 64}, "fit": "layer"}
    assert at.load(good).fit == "layer"
    for change, match in (({"settings": {"density": "lots"}}, "density"), ({"settings": {"block_size": 24}}, "block_size"),
                          ({"settings": {"covariance_aware": "false"}}, "covariance_aware"), ({"fit": "banana"}, "fit")):
        with pytest.raises(ValueError, match=f"alpha_table.*{match}"):
            at.load({**good, **change})
    binary = tmp_path / "cap.safetensors"
    binary.write_bytes(bytes([0xB0, 0x01, 0xFF, 0x00]) * 8)
    with pytest.raises(ValueError, match="alpha_table.*not a readable JSON file"):
        at.load(str(binary))


def test_non_finite_statistics_are_no_weight():
    """NaN fails the no-tail test as well: without a check it would come out as the default weight."""
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    one = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="not finite"):
        cal.AlphaStats(nan, nan, nan, one).alpha(default=0.75)
    with pytest.raises(ValueError, match="not finite"):
        cal.AlphaStats(nan, nan, nan, one).alpha(over="layer")


def test_calibrate_file_checks_its_arguments(tmp_path):
    path = _write(tmp_path / "a.safetensors")
    for kw, exc, match in ((dict(rows=-1), ValueError, "rows"), (dict(rows=1.5), ValueError, "rows"),
                           (dict(steps=0), TypeError, "steps"), (dict(steps=["0"]), TypeError, "steps"),
                           (dict(choose_selection="no"), TypeError, "choose_selection")):
        with pytest.raises(exc, match=match):
            bc.calibrate_file(path, block_size=32, **kw)


def test_study_checks_a_partner_entry_it_does_not_study(tmp_path):
    """The calibrated variant fits on the same layer at another step: that entry is checked as a
    studied one is (an int32 partner once ran and reported weights of 1)."""
    from pisa_attn.bench.study import StudyConfig, run_study

    g = torch.Generator().manual_seed(0)
    tensors = {f"step{s}.layer0.{p}": torch.randn(1, 2, 128, 16, generator=g) for s in (0, 1) for p in "qkv"}
    for p in "qkv":
        tensors[f"step1.layer0.{p}"] = tensors[f"step1.layer0.{p}"].mul(100).to(torch.int32)
    path = _write(tmp_path / "p.safetensors", tensors, {"step0.layer0": _entry(0), "step1.layer0": _entry(1)})
    cfg = StudyConfig(source=path, size="tiny", entries=("step0.layer0",), block_size=32, plots=False,
                      densities=(0.25,), modes=("hybrid",), covariance=False, tiling_modes=("hybrid",))
    with pytest.raises(ValueError, match="step1.layer0.*floating"):
        run_study(cfg, progress=False)


def test_a_layer_without_a_rule_reads_the_settings_rule_or_the_library_default():
    from pisa_attn import spec

    layers = {"transformer": {0: at.LayerAlpha((0.5,)), 1: at.LayerAlpha((0.5,), covariance_aware=False)}}
    assert at.AlphaTable(layers, {"density": 0.15}).covariance_aware(0) is spec.DEFAULT_COVARIANCE_AWARE
    assert at.AlphaTable(layers, {"covariance_aware": False}).covariance_aware(0) is False
    assert at.AlphaTable(layers, {}).covariance_aware(1) is False


def test_table_model_source_settings_and_names_are_type_checked(tmp_path):
    """'model' and 'source' are strings or null, 'settings' an object or null (not a falsy [] or 0 read as
    none), transformer names strings: anything else is a ValueError naming the field."""
    good = {"format": at.FORMAT, "version": at.VERSION, "transformers": {"transformer": {"0": {"alpha": [0.5]}}}}
    table = at.from_json({**good, "model": "wan", "source": "qkv.safetensors", "settings": None})
    assert (table.model, table.source, table.settings) == ("wan", "qkv.safetensors", {})
    for change, match in (({"model": 3}, "'model' must be a string or null"),
                          ({"model": ["wan"]}, "'model' must be a string or null"),
                          ({"source": {"path": "x"}}, "'source' must be a string or null"),
                          ({"settings": []}, "'settings' must be an object or null"),
                          ({"settings": 0}, "'settings' must be an object or null"),
                          ({"transformers": {0: {"0": {"alpha": [0.5]}}}}, "transformer names must be strings")):
        with pytest.raises(ValueError, match=f"alpha_table {match}"):
            at.from_json({**good, **change})
    with pytest.raises(ValueError, match="'model' must be a string"):  # save refuses what load would
        at.AlphaTable({"transformer": {0: at.LayerAlpha((0.5,))}}, model=7).save(tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
