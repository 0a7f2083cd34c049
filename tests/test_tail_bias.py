"""The tail-bias study script and the Whisper capture extraction, on tiny inputs: they run, their
metrics mean what they say, and the CTranslate2 reader / encoder / capture writer round-trip."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("safetensors")

import extract_whisper_qkv as ew  # noqa: E402
import tail_bias  # noqa: E402

from pisa_attn import layout as lay  # noqa: E402
from pisa_attn.data import dit_qkv  # noqa: E402
from pisa_attn.qkv_file import check_entry, layout_to_json, read_qkv_file, write_qkv_file  # noqa: E402


def test_errors_split_offset_from_row_noise():
    d = torch.randn(1, 2, 50, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    off = tail_bias.errors(d + 0.1, d)  # one offset shared by all rows
    assert off["bias_share"] == pytest.approx(1.0) and off["bias"] == pytest.approx(off["rel_l1"])
    noise = torch.randn(d.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.1
    noise = noise - noise.mean(2, keepdim=True)  # no shared part
    e = tail_bias.errors(d + noise, d)
    assert e["bias"] < 1e-12 and e["bias_share"] < 1e-12 and e["rel_l1"] > 0.01
    assert tail_bias.errors(d, d)["cos"] == pytest.approx(0.0, abs=1e-12)


def test_globally_exact_blocks():
    sel = torch.zeros(1, 4, 4, 5, dtype=torch.bool)  # 4 query heads over 2 kv heads, 4 query blocks
    sel[0, :2, :, 0] = True  # kv head 0: block 0 exact everywhere
    sel[0, 0, :2, 1] = True  # kv head 0: block 1 for a quarter of its rows
    sel[0, 2:, :3, 4] = True  # kv head 1: block 4 for 3/4
    assert tail_bias.globally_exact(sel, 2).tolist() == [[[True, False, False, False, False],
                                                          [False, False, False, False, True]]]


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    root = tmp_path_factory.mktemp("caps")
    order = lay.make_layout((16, 16), tile=(8, 8), text_before=1, order="compact_inplace")
    for i, name in enumerate(("astronaut", "coffee")):
        tensors, entries = {}, {}
        g = dit_qkv((16, 16), heads=2, head_dim=32, text_tokens=1, tiled=False, seed=i)
        tensors.update({f"step0.layer0.{p}": order.to_tiled(getattr(g, p), 2) for p in "qkv"})
        entries["step0.layer0"] = {"step": 0, "layer": 0, "image_range": [1, 257], "scale": 32**-0.5,
                                   "token_layout": layout_to_json(order)}
        write_qkv_file(str(root / f"dinov2_{name}.safetensors"), tensors, entries, model="test", dtype="float32")
    return root


def test_tail_bias_script(captures, tmp_path):
    out = tmp_path / "t.json"
    assert tail_bias.main(["--no-dit", "--dinov2", str(captures), "--density", "0.25", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["dev"] for r in d["rows"]] == [True, False] and d["dev_inputs"] == {"dinov2": "dinov2_astronaut"}
    s = d["summary"]["dinov2"]
    assert all(v in s for _, v in tail_bias.TABLE)
    for m in s.values():
        assert 0 <= m["bias"] <= m["rel_l1"] and 0 <= m["bias_share"] <= 1 and 0 <= m["cos"] < 1
    assert s["topk/zeroth"]["rel_l1"] < s["topk/drop"]["rel_l1"]
    assert s["cov/first@a1"]["rel_l1"] < s["cov/zeroth"]["rel_l1"]
    assert d["per_layer"]["dinov2"]["0"]["topk/drop"] == s["topk/drop"]  # one held-out layer


# --- Whisper extraction ------------------------------------------------------------------------
def _ct2_file(path, tensors: dict[str, np.ndarray]) -> None:
    """A CTranslate2 version-6 file holding ``tensors`` (float16 / int32), as the converter writes it."""
    def string(s):
        return struct.pack("H", len(s) + 1) + s.encode() + b"\0"

    ids = {np.dtype(np.float16): 4, np.dtype(np.int32): 3, np.dtype(np.float32): 0}
    out = struct.pack("I", 6) + string("WhisperSpec") + struct.pack("I", 3) + struct.pack("I", len(tensors))
    for name, x in tensors.items():
        out += string(name) + struct.pack("B", x.ndim) + b"".join(struct.pack("I", n) for n in x.shape)
        out += struct.pack("B", ids[x.dtype]) + struct.pack("I", x.nbytes) + x.tobytes()
    out += struct.pack("I", 0)
    Path(path).write_bytes(out)


def _tiny_whisper(layers=2, width=ew.HEADS * ew.HEAD_DIM, n_ctx=1500, mels=ew.N_MELS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def w(*shape, s=0.05):
        return (rng.standard_normal(shape) * s).astype(np.float16)

    t = {"encoder/conv1/weight": w(width, mels, 3), "encoder/conv1/bias": w(width),
         "encoder/conv2/weight": w(width, width, 3), "encoder/conv2/bias": w(width),
         "encoder/position_encodings/encodings": w(n_ctx, width), "encoder/num_heads": np.array(6, np.int32),
         "encoder/layer_norm/gamma": np.ones(width, np.float16), "encoder/layer_norm/beta": w(width)}
    for i in range(layers):
        p = f"encoder/layer_{i}"
        for ln in ("self_attention", "ffn"):
            t[f"{p}/{ln}/layer_norm/gamma"] = np.ones(width, np.float16)
            t[f"{p}/{ln}/layer_norm/beta"] = w(width)
        t[f"{p}/self_attention/linear_0/weight"] = w(3 * width, width)
        t[f"{p}/self_attention/linear_0/bias"] = w(3 * width)
        t[f"{p}/self_attention/linear_1/weight"], t[f"{p}/self_attention/linear_1/bias"] = w(width, width), w(width)
        t[f"{p}/ffn/linear_0/weight"], t[f"{p}/ffn/linear_0/bias"] = w(64, width), w(64)
        t[f"{p}/ffn/linear_1/weight"], t[f"{p}/ffn/linear_1/bias"] = w(width, 64), w(width)
    return t


def test_ct2_reader_and_encoder_capture(tmp_path):
    raw = _tiny_whisper()
    _ct2_file(tmp_path / "model.bin", raw)
    w = ew.read_ct2(str(tmp_path / "model.bin"))
    assert set(w) == set(raw)
    assert w["encoder/num_heads"].dtype == torch.int32 and int(w["encoder/num_heads"]) == 6
    want = torch.from_numpy(raw["encoder/conv1/weight"].astype(np.float32))
    torch.testing.assert_close(w["encoder/conv1/weight"], want)
    audio = np.sin(np.arange(ew.SR * 2) * 2 * np.pi * 440 / ew.SR).astype(np.float32) * 0.3
    mel = ew.log_mel(audio)
    assert mel.shape == (ew.N_MELS, 3000) and torch.isfinite(mel).all()
    enc, qkvs = ew.encode(w, mel)
    assert enc.shape == (1500, 384) and len(qkvs) == 2
    q, k, v = qkvs[1]
    assert q.shape == k.shape == v.shape == (1, 6, 1500, 64)
    # The captured q/k/v are the layer's projection of its normalised input.
    x = torch.nn.functional.conv1d(mel[None], w["encoder/conv1/weight"], w["encoder/conv1/bias"], padding=1)
    x = torch.nn.functional.conv1d(torch.nn.functional.gelu(x), w["encoder/conv2/weight"], w["encoder/conv2/bias"],
                                   stride=2, padding=1)
    x = torch.nn.functional.gelu(x)[0].T + w["encoder/position_encodings/encodings"]
    h = torch.nn.functional.layer_norm(x, (384,), w["encoder/layer_0/self_attention/layer_norm/gamma"],
                                       w["encoder/layer_0/self_attention/layer_norm/beta"], eps=1e-5)
    qkv0 = h @ w["encoder/layer_0/self_attention/linear_0/weight"].T + w["encoder/layer_0/self_attention/linear_0/bias"]
    torch.testing.assert_close(qkvs[0][1], qkv0[:, 384:768].reshape(1500, 6, 64).transpose(0, 1)[None])
    path = tmp_path / "cap.safetensors"
    ew.write(str(path), qkvs, torch.float32)
    f = read_qkv_file(str(path))
    assert [e.layer for e in f.entries] == [0, 1]
    for e in f.entries:
        check_entry(e)
    assert torch.equal(f.entries[1].k, k) and f.entries[0].layout.num_tokens == 1500


def test_ct2_reader_refuses_other_files(tmp_path):
    p = tmp_path / "m.bin"
    p.write_bytes(struct.pack("I", 5) + b"\0" * 16)
    with pytest.raises(ValueError, match="version 5"):
        ew.read_ct2(str(p))


def test_mel_filters_are_slaney_triangles():
    f = ew.mel_filters()
    assert f.shape == (80, 201) and bool((f >= 0).all())
    peaks = f.argmax(-1)
    assert bool((peaks[1:] >= peaks[:-1]).all())  # centres rise with the band index
    # Slaney normalisation: every triangle has area ~ 1 in Hz (2 / width x width / 2), up to the FFT grid.
    area = f.sum(-1) * (ew.SR / ew.N_FFT)
    assert float(area[10:].min()) > 0.8 and float(area[10:].max()) < 1.2
