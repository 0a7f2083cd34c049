"""How the int8 Q·Kᵀ's error grows with the logits' spread, and what finer key scales would buy:
the exact part of keep-or-drop (12.5 %, the reference backend's selection) in float64 with q and/or
k rounded to int8 codes (:func:`pisa_attn.ops.quant.to_int8`, scale ``amax / 127``), against the
same attention unrounded. Keys are smoothed by their head mean first, as the kernel does.

Columns: q rounded per row alone; k rounded per block (64 rows, the kernel's), per 16 rows and per
row alone; q per row with k per block (the kernel's ``int8``) or k per row. Inputs: Gaussian and
DiT-like q/k/v (bf16-rounded), q and k scaled by ``mag``.

    PYTHONPATH=src python benchmarks/int8_score_rounding.py --out benchmarks/results/int8_score_rounding.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform

import torch

from pisa_attn import PisaSettings, plan, run
from pisa_attn.data import dit_qkv
from pisa_attn.ops import quant

COLUMNS = ("q/row", "k/block", "k/16 rows", "k/row", "q/row + k/block", "q/row + k/row")


def inputs(data: str, d: int, mag: float, length: int, heads: int):
    if data == "gauss":
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, heads, length, d, generator=g) for _ in range(3))
    else:
        x = dit_qkv((length // 256, 16, 16), heads=heads, head_dim=d, batch=1, seed=1, device="cpu")
        q, k, v = x.q[:, :, :length], x.k[:, :, :length], x.v[:, :, :length]
    return q.mul(mag).bfloat16().double(), k.mul(mag).bfloat16().double(), v.bfloat16().double()


def rounded(x, amax):
    sc, inv = quant.int8_scale(amax)
    return quant.to_int8(x, inv).double() * sc.double()


def rounded_keys(k, mu, rows: int):
    kc = k - mu[:, :, None, :]
    b, h, n, d = kc.shape
    amax = kc.view(b, h, n // rows, rows * d).abs().amax(-1).repeat_interleave(rows, 2)[..., None]
    return rounded(kc, amax) + mu[:, :, None, :]


def attend(q, k, v, keep, scale):
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


def rel_l1(a, b) -> float:
    return ((a - b).abs().sum() / b.abs().sum()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--mags", type=float, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    print("data  D   mag | " + " | ".join(COLUMNS))
    for data, d, mag in itertools.product(("gauss", "dit"), (64, 128), a.mags):
        q, k, v = inputs(data, d, mag, a.length, a.heads)
        p = plan(q, k, PisaSettings(density=0.125, mode="drop", backend="reference"))
        _, sel = run(p, q, k, v, return_selection=True)
        keep = sel.to_mask(p.n_kv_blocks).repeat_interleave(64, 2).repeat_interleave(64, 3)
        keep = keep[:, :, :q.shape[2], :k.shape[2]]
        scale = d ** -0.5
        want = attend(q, k, v, keep, scale)
        mu = k.mean(2)
        qr = rounded(q, q.abs().amax(-1, keepdim=True))
        errs = [rel_l1(attend(qr, k, v, keep, scale), want)]
        errs += [rel_l1(attend(q, rounded_keys(k, mu, r), v, keep, scale), want) for r in (64, 16, 1)]
        errs += [rel_l1(attend(qr, rounded_keys(k, mu, r), v, keep, scale), want) for r in (64, 1)]
        print(f"{data:5s} {d:3d} {mag:4g} | " + " | ".join(f"{e:.2e}" for e in errs), flush=True)
        rows.append({"data": data, "head_dim": d, "mag": mag, **dict(zip(COLUMNS, errs))})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "python": platform.python_version(), "length": a.length,
                       "heads": a.heads, "density": 0.125, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
