"""The low precisions' quantised math (:mod:`pisa_attn.ops.quant`, the Hopper kernel's statement)
on the CPU: the default hybrid (covariance-aware selection, α = 0.75, 12.5 %) with its exact
blocks' products in each low precision, against float64 dense attention, beside the same hybrid
in the input precision's math (float32) on the same selection.

Metrics per case and precision (``tail_bias.errors``): rel-L1, signed bias (the offset shared by
all rows of a head, per channel, over mean |dense|), 1 − cos; and the growth of rel-L1 over the
input precision. Cases: DiT-like inputs (:func:`pisa_attn.data.dit_qkv`, the GPU benchmark's two
shapes), Gaussian q/k/v, and the real DINOv2 layers of ``--qkv-file``; q/k/v rounded to bf16
first, as the kernels see them. No GPU: the numbers are the math's, the GPU tests hold the
kernels to it (``QREF_TOL`` in tests/gpu/test_gpu_fp8.py).

    PYTHONPATH=src python benchmarks/lowp_reference_accuracy.py \\
        --out benchmarks/results/lowp_reference_accuracy.json [--cases dit4k dit16k gaussian dinov2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from tail_bias import errors

from pisa_attn import metrics, spec
from pisa_attn.data import dit_qkv
from pisa_attn.ops import quant
from pisa_attn.ops import reference as ref

QKV_FILE = "/work/shared/data/dinov2_vits14_astronaut_l0_5_11.safetensors"
CASES = ("dit4k", "dit16k", "gaussian", "dinov2")


def setup(name: str, q, k, v, scale: float, density: float):
    """q/k/v rounded to bf16 (float32), their statistics, the default selection, float64 dense
    attention, the default α and the result row holding the input precision's errors."""
    q, k, v = (x.bfloat16().float() for x in (q, k, v))
    st = ref.block_stats(k, v, 64, with_hdev=True)
    mask = metrics.select(q, k, v, density=density, block_size=64, covariance_aware=True, scale=scale,
                          stats=st).selected
    h = q.shape[1]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.double(), spec.expand_kv_heads(k.double(), h), spec.expand_kv_heads(v.double(), h), scale=scale)
    alpha = torch.full((h,), spec.DEFAULT_ALPHA)
    base, _ = ref.pisa_forward(q, k, v, st, mask, mode="hybrid", scale=scale, block_size=64, alpha=alpha)
    row = {"case": name, "shape": list(q.shape), "density": density, "input": errors(base, dense)}
    return q, k, v, st, mask, dense, alpha, row


def case(name: str, q, k, v, scale: float, density: float, precisions) -> dict:
    t0 = time.time()
    q, k, v, st, mask, dense, alpha, row = setup(name, q, k, v, scale, density)
    for prec in precisions:
        out, _ = quant.lowp_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, mask, mode="hybrid", scale=scale,
                                         block_size=64, alpha=alpha, precision=prec)
        e = errors(out, dense)
        e["growth"] = e["rel_l1"] / row["input"]["rel_l1"] - 1
        row[prec] = e
    row["seconds"] = time.time() - t0
    print(f"{name:24s} input {row['input']['rel_l1']:.4e} | " + " | ".join(
        f"{p} {row[p]['rel_l1']:.4e} ({100 * row[p]['growth']:+.2f}%)" for p in precisions), flush=True)
    return row


def inputs(cases, qkv_file: str = QKV_FILE):
    """(name, q, k, v, scale) per case in ``cases`` (:data:`CASES`), generated or read on demand."""
    if "dit4k" in cases:
        d = dit_qkv((4, 32, 32), heads=16, head_dim=128)
        yield "dit-4x32x32-H16-D128", d.q, d.k, d.v, 128**-0.5
    if "dit16k" in cases:
        d = dit_qkv((16, 32, 32), heads=8, head_dim=128)
        yield "dit-16x32x32-H8-D128", d.q, d.k, d.v, 128**-0.5
    if "gaussian" in cases:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, 4096, 128, generator=g) for _ in range(3))
        yield "gaussian-L4096-H8-D128", q, k, v, 128**-0.5
    if "dinov2" in cases and os.path.exists(qkv_file):
        from pisa_attn.qkv_file import read_qkv_file

        for e in read_qkv_file(qkv_file).entries:
            yield f"dinov2-{e.name}", e.q, e.k, e.v, float(e.info.get("scale") or e.q.shape[-1] ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--precisions", nargs="+", default=list(spec.PRODUCT_FORMATS), choices=list(spec.PRODUCT_FORMATS))
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--qkv-file", default=QKV_FILE)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = [case(name, q, k, v, scale, args.density, args.precisions)
            for name, q, k, v, scale in inputs(args.cases, args.qkv_file)]
    res = {"note": __doc__.split("\n\n")[0].replace("\n", " "), "device": f"CPU ({platform.processor() or 'x86-64'}, "
           f"{os.cpu_count()} cores)", "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("\n| case | input rel-L1 | " + " | ".join(args.precisions) + " |")
    print("|---|---|" + "---|" * len(args.precisions))
    for r in rows:
        print(f"| {r['case']} | {r['input']['rel_l1']:.4f} | " + " | ".join(
            f"{r[p]['rel_l1']:.4f} ({100 * r[p]['growth']:+.1f} %)" for p in args.precisions) + " |")


if __name__ == "__main__":
    main()
