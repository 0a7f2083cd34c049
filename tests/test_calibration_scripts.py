"""The accuracy scripts of benchmarks/ on a tiny capture folder: they run, and their numbers are
the library's (held-out rows only, the calibrated table the one pisa-attn calibrate writes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("safetensors")

import calibration_bias  # noqa: E402
import calibration_heldout  # noqa: E402

from pisa_attn import layout as lay  # noqa: E402
from pisa_attn.data import dit_qkv  # noqa: E402
from pisa_attn.qkv_file import layout_to_json, write_qkv_file  # noqa: E402


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """Three 'images' of a 1-token CLS + 16x16 grid, two layers each, in the extraction's format."""
    root = tmp_path_factory.mktemp("caps")
    order = lay.make_layout((16, 16), tile=(8, 8), text_before=1, order="compact_inplace")
    for i, name in enumerate(("astronaut", "coffee", "camera")):
        tensors, entries = {}, {}
        for layer in range(2):
            g = dit_qkv((16, 16), heads=2, head_dim=32, text_tokens=1, tiled=False, seed=10 * i + layer)
            q, k, v = (order.to_tiled(x, 2) for x in (g.q, g.k, g.v))
            key = f"step0.layer{layer}"
            tensors.update({f"{key}.q": q, f"{key}.k": k, f"{key}.v": v})
            entries[key] = {"step": 0, "layer": layer, "image_range": [1, 257], "scale": 32**-0.5,
                            "token_layout": layout_to_json(order)}
        write_qkv_file(str(root / f"x_{name}_518.safetensors"), tensors, entries, model="test", dtype="float32")
    return root


def test_heldout_script(captures, tmp_path):
    out = tmp_path / "h.json"
    assert calibration_heldout.main(["--data", str(captures), "--calib", "astronaut", "--density", "0.25",
                                     "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {r["input"] for r in d["rows"]} == {"x_coffee_518", "x_camera_518"} and len(d["rows"]) == 4
    s = d["summary"]
    assert set(s) == {"keep-or-drop", "zeroth", "paper hybrid", "default", "calibrated"}
    assert all(0 < m["bias"] <= m["rel_l1"] and 0 <= m["cos"] < 1 for m in s.values())
    assert s["zeroth"]["rel_l1"] < s["keep-or-drop"]["rel_l1"]
    assert sorted(d["table"]["transformers"]["transformer"]) == ["0", "1"]


def test_bias_script(captures, tmp_path):
    out = tmp_path / "b.json"
    assert calibration_bias.main(["--no-dit", "--dinov2", str(captures), "--layers", "0", "--density", "0.25",
                                  "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    rows = [r for r in d["rows"] if not r["calibration"]]
    assert len(rows) == 2 and "cov/hybridall@fit" in rows[0]["errors"]
    assert "topk/hybridrow@a1" in d["summary"]["dinov2"]
    hdev = torch.tensor([1.0, 1.0, 1.0, 9.0])
    assert calibration_bias.sink_blocks(hdev[None, None]).tolist() == [[[False, False, False, True]]]
