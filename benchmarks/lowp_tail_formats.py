"""The centroid tail in 8-bit formats, on the CPU: would an FP8/INT8 tail cost accuracy?

The low-precision kernels quantise only the exact blocks' two products; their centroid tail runs
in the input precision (scores ``q·k̄ᵀ`` from float16 centroids, ``P·V̄`` in the input dtype). This
script emulates the tail's two products in 8 bits beside that and measures, against float64
dense attention, what each format adds to the default hybrid (covariance-aware selection,
α = :data:`pisa_attn.spec.DEFAULT_ALPHA`, 12.5 %) in each low precision:

* tail ``Q·K̄ᵀ``: ``float32`` (as the kernels' reference; the kernels read float16 centroids with
  one power-of-two scale per head), ``e4m3`` or ``int8``:
  centroids smoothed by the same vector μ as the exact keys (so the row constant ``s·q·μ`` is
  the exact blocks'), one scale per kv head; ``q`` with one scale per row (the exact phase's);
* tail ``P·V̄``: ``float32``, ``input`` (weights rounded to bfloat16, as the kernels) or ``e4m3`` (``R(256·p)/256`` with
  ``p = n_j·exp(c_j − m) ≤ 1``, ``m`` the row's largest ``c_j + ln n_j``; the block means ``v̄_j``
  with one scale per channel and kv head).

The exact part is :func:`pisa_attn.ops.quant.lowp_pisa_forward` in keep-or-drop mode, merged with
the emulated tail by log-sum-exp (every quantity rounded relative to its own maximum, which for
e4m3's relative rounding is the same as rounding against the row's final maximum but for
underflow). The denominator and the first-order weight ``Σ_j exp(c_j − m)`` use the unrounded
weights, as the kernels do. ``--check`` compares the ``float32``/``float32`` emulation with the
library's hybrid reference (the same math in one pass) and exits non-zero beyond 1e-5.

    PYTHONPATH=src python benchmarks/lowp_tail_formats.py \\
        --out benchmarks/results/lowp_tail_formats.json [--cases dit4k dit16k gaussian dinov2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from lowp_reference_accuracy import CASES, QKV_FILE, inputs, setup
from tail_bias import errors

from pisa_attn import spec
from pisa_attn.ops import quant

TAIL_FORMATS = (("float32", "input"), ("int8", "input"), ("e4m3", "input"), ("float32", "e4m3"), ("int8", "e4m3"),
                ("e4m3", "e4m3"))
"""(tail ``Q·K̄ᵀ``, tail ``P·V̄``) formats; the first is the kernels' present tail."""


def tail_part(q: torch.Tensor, st, sel: torch.Tensor, scale: float, alpha: torch.Tensor, qk: str, pv: str,
              block_size: int = 64):
    """``(num, den, m)`` of the tail per query row (float32; num ``[B, H, Lq, D]``): the tail
    blocks' zeroth-order sums and the first-order term, relative to the maximum ``m``."""
    b, h, lq, d = q.shape
    kmx, vsx, hbx = (spec.expand_kv_heads(x.float(), h) for x in (st.kmean, st.vsum, st.hbar))
    counts = st.counts.float()
    mu = spec.expand_kv_heads(st.kmean.float().mean(2)[:, :, None, :], h)  # the exact keys' μ
    qf = q.float()
    if qk == "float32":
        c = (qf @ kmx.transpose(-1, -2)) * scale
    else:
        q8, rho = quant.quantize_rows(qf, qk)
        kc = kmx - mu
        k8, sig = quant.quantize_block_rows(kc, kc.abs().amax((-1, -2), keepdim=True), qk)
        c = (q8.float() @ k8.float().transpose(-1, -2)) * (rho[..., None] * sig * scale)
        c = c + (qf @ mu.transpose(-1, -2)) * scale
    rows = sel.repeat_interleave(block_size, 2)[:, :, :lq]
    c = c.masked_fill(rows, float("-inf"))
    logw = c + counts.log()
    m = logw.amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logw - m[..., None])  # n_j·exp(c_j − m) ≤ 1
    vbar = vsx / counts[:, None]
    if pv == "e4m3":
        v8, tau = quant.quantize_block_rows(vbar, vbar.abs().amax(-2, keepdim=True), "e4m3")
        num = (quant.to_e4m3(quant.P_SCALE * p).float() / quant.P_SCALE) @ (v8.float() * tau)
    elif pv == "input":
        num = p.bfloat16().float() @ vbar
    else:
        num = p @ vbar
    a = torch.exp(c - m[..., None])
    num = num + a.sum(-1, keepdim=True) * ((qf @ hbx) * scale) * alpha.float().view(1, h, 1, 1)
    return num, p.sum(-1), m


def tail_formats_forward(q, k, v, st, sel, scale: float, alpha, precision: str, qk: str, pv: str, block_size=64):
    """The hybrid output ``[B, H, Lq, D]`` float32: exact blocks in ``precision``'s quantised math,
    the tail's products in ``qk`` / ``pv``."""
    oe, lse = quant.lowp_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, sel, mode="drop", scale=scale,
                                      block_size=block_size, precision=precision)
    num, den, m = tail_part(q, st, sel, scale, alpha, qk, pv, block_size)
    top = torch.maximum(lse, m)
    we, wt = torch.exp(lse - top), torch.exp(m - top)
    return (oe * we[..., None] + num * wt[..., None]) / (we + den * wt)[..., None]


def case(name: str, q, k, v, scale: float, density: float, precisions, check: bool) -> dict:
    t0 = time.time()
    q, k, v, st, sel, dense, alpha, row = setup(name, q, k, v, scale, density)
    for prec in precisions:
        lib, _ = quant.lowp_pisa_forward(q, k, v, st.kmean, st.vsum, st.hbar, sel, mode="hybrid", scale=scale,
                                         block_size=64, alpha=alpha, precision=prec)
        row[prec] = {"reference": errors(lib, dense)}
        if check:
            f32 = tail_formats_forward(q, k, v, st, sel, scale, alpha, prec, "float32", "float32")
            diff = float((f32 - lib).abs().max() / lib.abs().max())
            row[prec]["check_max_rel"] = diff
            if diff > 1e-5:
                sys.exit(f"{name} {prec}: the emulation differs from quant.lowp_pisa_forward by {diff:.2e}")
        for qk, pv in TAIL_FORMATS:
            out = tail_formats_forward(q, k, v, st, sel, scale, alpha, prec, qk, pv)
            e = errors(out, dense)
            e["growth"] = e["rel_l1"] / row["input"]["rel_l1"] - 1
            row[prec][f"{qk}/{pv}"] = e
    row["seconds"] = time.time() - t0
    print(f"{name:26s} input {row['input']['rel_l1']:.4e} | " + " | ".join(
        f"{p} " + " ".join(f"{f}:{100 * row[p][f]['growth']:+.2f}%" for f in (f"{a}/{b}" for a, b in TAIL_FORMATS))
        for p in precisions), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--precisions", nargs="+", default=["fp8", "int8-fp8", "int8"],
                    choices=list(spec.PRODUCT_FORMATS))
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--qkv-file", default=QKV_FILE)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = [case(name, q, k, v, scale, args.density, args.precisions, args.check)
            for name, q, k, v, scale in inputs(args.cases, args.qkv_file)]
    res = {"note": __doc__.split("\n\n")[0].replace("\n", " "), "device": f"CPU ({platform.processor() or 'x86-64'}, "
           f"{os.cpu_count()} cores)", "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    fmts = [f"{a}/{b}" for a, b in TAIL_FORMATS]
    print("\nrel-L1 growth over the input precision's hybrid, tail Q·K̄ᵀ / P·V̄ formats")
    print("| case | precision | " + " | ".join(fmts) + " |")
    print("|---|---|" + "---|" * len(fmts))
    for r in rows:
        for p in args.precisions:
            print(f"| {r['case']} | {p} | " + " | ".join(
                f"{100 * r[p][f]['growth']:+.2f} %" for f in fmts) + " |")


if __name__ == "__main__":
    main()
