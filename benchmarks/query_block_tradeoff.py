"""What sharing one selection between query blocks costs in accuracy and buys in time.

1. Selection overlap of neighbouring 64-row query blocks (the share of a block's exact key blocks
   its pair neighbour also selects: what the Hopper kernel loads once for both), on Gaussian q/k
   (the kernel benchmark's inputs), the DiT-like generator and, with ``--dino FILE``, real DINOv2
   q/k/v (a file of layers 0, 5 and 11 written by ``benchmarks/extract_dinov2_qkv.py``).
2. Error (rel-L1 vs dense, float64 reference) of ``query_block`` 64 (the paper's per-block
   selection) against 128 and 256, hybrid and drop, on the DiT-like generator and DINOv2.
3. With ``--timings bench.json`` (``pisa-attn bench --query-block 128`` output), an error-versus-time
   chart: each density's point at query_block 64 and 128.

    PYTHONPATH=src python benchmarks/query_block_tradeoff.py --out out [--dino FILE] [--timings results.json]

CPU only for parts 1-2 (a few minutes on two cores); writes query_block_tradeoff.json (+ .png).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from pisa_attn import data, metrics, pisa_attention, spec
from pisa_attn.ops import reference as ref

DENSITIES = (0.05, 0.125, 0.25)
PAPER = {"alpha": 1.0}  # the paper's first-order weight (hybrid mode)


def pair_overlap(q: torch.Tensor, k: torch.Tensor, density: float, block_size: int = 64) -> float:
    sel = metrics.select(q, k, k, density=density, block_size=block_size).selected
    nq = sel.shape[2] // 2 * 2
    a, b = sel[:, :, 0:nq:2], sel[:, :, 1:nq:2]
    return ((a & b).sum(-1).float() / a.sum(-1).clamp_min(1)).mean().item()


def sources(dino: str | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    yield "gaussian L4096", *(torch.randn(1, 4, 4096, 64, generator=g, dtype=torch.float64) for _ in range(3))
    d = data.dit_qkv((4, 30, 52), heads=4, head_dim=64, seed=seed, dtype=torch.float64)
    yield "DiT-like video 4x30x52", d.q, d.k, d.v
    d = data.dit_qkv((48, 48), heads=4, head_dim=64, seed=seed, dtype=torch.float64)
    yield "DiT-like image 48x48", d.q, d.k, d.v
    if dino is not None:
        from safetensors.torch import load_file

        f = load_file(dino)
        for layer in (0, 5, 11):
            q, k, v = (f[f"step0.layer{layer}.{n}"].double() for n in "qkv")
            yield f"DINOv2 layer {layer}", *(x if x.dim() == 4 else x[None] for x in (q, k, v))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--timings", default=None, help="a pisa-attn bench JSON with the --query-block 128 column")
    ap.add_argument("--dino", default=None,
                    help="DINOv2 q/k/v of layers 0, 5 and 11 (benchmarks/extract_dinov2_qkv.py); default: none")
    a = ap.parse_args()
    for flag, path in (("--dino", a.dino), ("--timings", a.timings)):
        if path is not None and not os.path.isfile(path):
            ap.error(f"{flag}: no such file: {path}")
    if a.dino is None:
        print("no --dino file: Gaussian and DiT-like inputs only", flush=True)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    rows = []
    for name, q, k, v in sources(a.dino):
        dense = metrics.dense_pass(q, k, v, block_size=64).out
        for density in DENSITIES:
            r = dict(source=name, L=q.shape[2], density=density, overlap=pair_overlap(q, k, density))
            for qb in (64, 128, 256):
                for mode in ("hybrid", "drop"):
                    out = pisa_attention(q, k, v, density=density, mode=mode, query_block=qb,
                                         **(PAPER if mode == "hybrid" else {}))
                    r[f"{mode}_qb{qb}"] = metrics.rel_l1(out, dense)
            rows.append(r)
            print(f"{name:24s} d={density:.3f} overlap {r['overlap']:.2f} | hybrid qb64 {r['hybrid_qb64']:.4f} "
                  f"qb128 {r['hybrid_qb128']:.4f} qb256 {r['hybrid_qb256']:.4f} | drop qb64 {r['drop_qb64']:.4f} "
                  f"qb128 {r['drop_qb128']:.4f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    res = dict(rows=rows)
    if a.timings:
        with open(a.timings) as f:
            res["timings"] = [t for t in json.load(f)["rows"] if "pisa_hybrid_qb128" in t]
        plot(res, os.path.join(a.out, "query_block_tradeoff.png"))
    with open(os.path.join(a.out, "query_block_tradeoff.json"), "w") as f:
        json.dump(res, f, indent=1)


def plot(res: dict, path: str) -> None:
    """Error (DiT-like video, hybrid) against kernel time (the bench JSON's 32K rows) per density."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    err = {(r["density"], qb): r[f"hybrid_qb{qb}"] for r in res["rows"] if r["source"].startswith("DiT-like video")
           for qb in (64, 128)}
    fig, ax = plt.subplots(figsize=(5, 4))
    for t in res["timings"]:
        if t["length"] != 32768 or (t["density"], 64) not in err:
            continue
        xs = [t["pisa_hybrid"], t["pisa_hybrid_qb128"]]
        ys = [err[(t["density"], 64)], err[(t["density"], 128)]]
        ax.plot(xs, ys, "-o", label=f"{100 * t['density']:g}%")
        ax.annotate("64", (xs[0], ys[0]), fontsize=7)
        ax.annotate("128", (xs[1], ys[1]), fontsize=7)
    ax.set_xlabel("PISA hybrid, ms (2-16-128, L=32K, Gaussian inputs)")
    ax.set_ylabel("rel-L1 vs dense (DiT-like video heads)")
    ax.set_title("query_block 64 (paper) vs 128", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    spec.query_block_factor(128, 64)  # the installed library knows query_block
    main()
