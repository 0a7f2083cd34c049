"""Held-out accuracy as a user gets it: ``pisa-attn calibrate`` on one capture, the others evaluated.

For a folder of capture files (one input each, every layer an entry; e.g. DINOv2 from
``benchmarks/extract_dinov2_qkv.py``), this fits the table with the library's own
:func:`pisa_attn.bench.calibrate.calibrate_file` on ``--calib`` (every query row, the selection
rule chosen per layer) and runs ``pisa_attention`` (reference backend, float32) on every other
input and layer, on the image queries with the capture's always-exact blocks, as the diffusers
backend would: keep-or-drop, zeroth and the paper's hybrid (pooled top-k, ``alpha=1``), the
library's defaults (no calibration), and the calibrated table (its weights and rule per layer).
Errors against dense attention of the same rows: rel-L1, signed bias
(``mean_{b,h,c} |mean_t (o − d)| / mean|d|``) and ``1 − cos`` (per head, mean).

    PYTHONPATH=src python benchmarks/calibration_heldout.py --data DIR --calib astronaut --out results.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections import defaultdict

import torch

from pisa_attn import pisa_attention, spec
from pisa_attn.bench.calibrate import calibrate_file
from pisa_attn.layout import block_floor
from pisa_attn.qkv_file import read_qkv_file

BLOCK = 64


def errors(o: torch.Tensor, d: torch.Tensor) -> dict:
    err = (o - d).double()
    scale = d.double().abs().mean()
    cos = torch.nn.functional.cosine_similarity(o.double().flatten(2), d.double().flatten(2), dim=-1)
    return {"rel_l1": float(err.abs().mean() / scale), "bias": float(err.mean(dim=2).abs().mean() / scale),
            "cos": float((1 - cos).mean())}


@torch.no_grad()  # inference only; a caller's grad mode is left as it was
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--calib", default="astronaut", help="the capture (name part) calibration uses")
    p.add_argument("--density", type=float, default=0.125)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    files = sorted(glob.glob(os.path.join(args.data, "*.safetensors")))
    calib = [f for f in files if args.calib in os.path.basename(f)]
    if len(calib) != 1:
        raise SystemExit(f"--calib {args.calib!r} matches {len(calib)} files in {args.data}")
    t0 = time.perf_counter()
    table = calibrate_file(calib[0], density=args.density, block_size=BLOCK, rows=0)
    print(f"calibrated on {os.path.basename(calib[0])} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    variants = {
        "keep-or-drop": lambda layer: dict(mode="drop", covariance_aware=False),
        "zeroth": lambda layer: dict(mode="zeroth", covariance_aware=False),
        "paper hybrid": lambda layer: dict(mode="hybrid", covariance_aware=False, alpha=1.0),
        "default": lambda layer: dict(mode="hybrid"),
        "calibrated": lambda layer: dict(mode="hybrid", covariance_aware=table.covariance_aware(layer),
                                         alpha=torch.tensor(table.layers()[layer].alpha)),
    }
    rows = []
    for path in files:
        if path == calib[0]:
            continue
        name = os.path.basename(path).split(".")[0]
        for e in read_qkv_file(path).entries:
            q, k, v = e.q.float(), e.k.float(), e.v.float()
            lo, hi = e.info.get("image_range") or (0, q.shape[2])
            start = block_floor(lo, BLOCK)
            keep = e.layout.keep_blocks(BLOCK) if e.layout is not None else None
            keep = keep[: spec.num_blocks(k.shape[2], BLOCK)] if keep is not None else None
            qs = q[:, :, start:hi]
            dense = torch.nn.functional.scaled_dot_product_attention(qs, k, v)[:, :, lo - start:]
            res = {}
            for vname, kw in variants.items():
                out = pisa_attention(qs, k, v, density=args.density, block_size=BLOCK, keep_blocks=keep,
                                     backend="reference", **kw(e.layer))
                res[vname] = errors(out[:, :, lo - start:], dense)
            rows.append({"input": name, "layer": e.layer, "errors": res,
                         "covariance_aware": table.covariance_aware(e.layer)})
        print(f"{time.perf_counter() - t0:6.0f}s {name}", file=sys.stderr, flush=True)
    acc = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for vname, m in r["errors"].items():
            for key, x in m.items():
                acc[vname][key].append(x)
    summary = {v: {k: sum(x) / len(x) for k, x in m.items()} for v, m in acc.items()}
    with open(args.out, "w") as f:
        json.dump({"density": args.density, "block_size": BLOCK, "calibration_input": os.path.basename(calib[0]),
                   "default_alpha": spec.DEFAULT_ALPHA, "default_covariance_aware": spec.DEFAULT_COVARIANCE_AWARE,
                   "table": table.to_json(), "summary": summary, "rows": rows}, f, indent=1)
    print("\n| variant | rel-L1 | bias | 1 − cos |\n|---|---|---|---|")
    for vname, m in summary.items():
        print(f"| {vname} | {m['rel_l1']:.4f} | {m['bias']:.4f} | {m['cos']:.2e} |")
    rules = [table.covariance_aware(i) for i in sorted(table.layers())]
    print(f"\nselection chosen per layer: {['cov' if r else 'top-k' for r in rules]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
