"""The Hopper kernel's exact loop with its maximum fixed at a per-row bound of the exact scores
(``exact_max="bound"``: ``s·Σ_d |q_d|·max_n |k_nd|``, from the keys' per-channel maxima prepare
writes) against the online maximum, on a GPU, cuDNN SDPA in the same run:

* ``--attend L ...``: the attention kernel alone on one top-k selection (keep-or-drop and hybrid,
  three query blocks per CTA), 3 interleaved rounds, median; the outputs' rel-L1 and largest LSE
  difference between the two; the exact phase's share of cuDNN's throughput on the computed blocks;
* ``--whole L ...``: the whole default call (plan/run, covariance-aware hybrid and keep-or-drop)
  with :data:`EXACT_MAX` set to each, 3 interleaved rounds; and prepare alone with and without the
  keys' maxima.

B2-H16-D128 bf16, 12.5 %, Gaussian and DiT-like q/k/v (``exact_loop.qkv``). ``--precision int8``:
the same for the low-precision kernel with P·V in the input dtype (its bound from the quantisation
pass's ``max |k − μ|``, :data:`pisa_attn.ops.hopper.fp8.EXACT_MAX`), the bf16 kernel at its default
timed in the same rounds (``bf16_ms``).

    PYTHONPATH=src python3 benchmarks/exact_max.py --attend 32768 65536 --whole 4096 8192 32768 \\
        --out benchmarks/results/h100_exact_max.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import exact_loop as el

from pisa_attn import PisaSettings
from pisa_attn.ops.hopper import attention as gattn
from pisa_attn.ops.hopper import fp8 as lowk
from pisa_attn.ops.triton import prepare as P
from pisa_attn.ops.triton.quantize import quantize

VARIANTS = ("online", "bound")


def rel_l1(a, b) -> float:
    return ((a.float() - b.float()).abs().mean() / b.float().abs().mean()).item()


def attend_rows(L: int, rounds: int = 3, precision: str = "input") -> list:
    rows = []
    t_cudnn = el.cudnn_ms(L)
    lowp = precision != "input"
    for source in ("random", "dit"):
        q, k, v = el.qkv(source, L)
        stats, sel, n_sel = el.selection(q, k, v, 0.125)
        nk = stats.kbar.shape[2]
        frac = sel.cnt.sum().item() / (el.B * el.H * sel.bits.shape[2] * nk)
        kmax = P.prepare(q, k, v, 64, with_kmax=True).kmax
        qz = quantize(k, v, stats.kbar, stats.kscale, 64, precision=precision) if lowp else None
        fns, res = [], {}
        for mode in ("drop", "hybrid"):
            for em in (*VARIANTS, "bf16") if lowp else VARIANTS:
                o = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], device="cuda")
                if em == "bf16" or not lowp:  # the input-precision kernel (at its default beside a low precision)
                    fn = lambda m=mode, em=em, o=o, lse=lse: gattn.attention(  # noqa: E731
                        q, k, v, *stats.tail(), *sel, mode=m, scale=q.shape[-1] ** -0.5, block_size=64,
                        n_select=n_sel, out=o, lse=lse, exact_max=None if em == "bf16" else em, kmax=kmax,
                        kbound=stats.kbound)
                else:
                    fn = lambda m=mode, em=em, o=o, lse=lse: lowk.attention(  # noqa: E731
                        q, qz, *stats.tail(), *sel, mode=m, scale=q.shape[-1] ** -0.5, block_size=64, lk=L, out=o,
                        lse=lse, v=v, kbound=stats.kbound, exact_max=em)
                fn()
                torch.cuda.synchronize()
                res[mode, em] = (o.clone(), lse.clone())
                fns.append(((mode, em), fn, []))
        for _ in range(rounds):
            for _, fn, ts in fns:
                ts.append(el.ms(fn, est_ms=t_cudnn * frac))
        for mode in ("drop", "hybrid"):
            (oo, lo), (ob, lb) = res[mode, "online"], res[mode, "bound"]
            t = {em: statistics.median(ts) for (m, em), _, ts in fns if m == mode}
            r = dict(L=L, source=source, mode=mode, precision=precision, cudnn_ms=t_cudnn, computed_fraction=frac,
                     online_ms=t["online"], bound_ms=t["bound"], speedup=t["online"] / t["bound"],
                     rel_l1_bound_vs_online=rel_l1(ob, oo), max_dlse=(lb - lo).abs().max().item(),
                     finite=bool(torch.isfinite(ob).all() and torch.isfinite(lb).all()),
                     rounds={em: ts for (m, em), _, ts in fns if m == mode})
            if lowp:
                r["bf16_ms"] = t["bf16"]
                r["x_bf16_online"], r["x_bf16_bound"] = t["bf16"] / t["online"], t["bf16"] / t["bound"]
            if mode == "drop":
                r["share_online"] = frac * t_cudnn / t["online"]
                r["share_bound"] = frac * t_cudnn / t["bound"]
            rows.append(r)
            print(f"{L:>6} {source:6} {mode:6} {precision} attend online {t['online']:.3f} bound {t['bound']:.3f} ms "
                  + (f"(bf16 {t['bf16']:.3f}) " if lowp else "") +
                  f"({r['speedup']:.3f}x) rel-L1 {r['rel_l1_bound_vs_online']:.1e} dLSE {r['max_dlse']:.1e}"
                  + (f" | share {r['share_online']:.3f} -> {r['share_bound']:.3f}" if mode == "drop" else ""),
                  flush=True)
    return rows


def whole_rows(L: int, rounds: int = 3, precision: str = "input") -> list:
    rows = []
    t_cudnn = el.cudnn_ms(L)
    mod = gattn if precision == "input" else lowk
    default = mod.EXACT_MAX
    for source in ("random", "dit"):
        q, k, v = el.qkv(source, L)
        tp = {}
        for km in (False, True):
            ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=64, with_hdev=True, with_kmax=km)
            fn = lambda ws=ws, km=km: P.prepare(q, k, v, 64, with_hdev=True, lean=True, ws=ws, with_kmax=km)  # noqa
            fn()
            tp[km] = statistics.median(el.ms(fn, est_ms=0.3) for _ in range(rounds))
        for mode in ("hybrid", "drop"):
            st = PisaSettings(density=0.125, mode=mode, backend="hopper", precision=precision)
            variants = {em: ((lambda em=em: setattr(mod, "EXACT_MAX", em)), st) for em in VARIANTS}
            if precision != "input":  # the bf16 call at its defaults in the same rounds
                variants["bf16"] = (lambda: setattr(mod, "EXACT_MAX", default),
                                    PisaSettings(density=0.125, mode=mode, backend="hopper"))
            try:
                ts = el.whole_rounds(q, k, v, variants, est_ms=t_cudnn * 0.15, rounds=rounds)
            finally:
                mod.EXACT_MAX = default
            r = dict(L=L, source=source, mode=mode, precision=precision, cudnn_ms=t_cudnn, rounds=ts,
                     prepare_ms=tp[False], prepare_kmax_ms=tp[True], **{f"{em}_ms": statistics.median(ts[em]) for em in ts})
            r.update({f"x_cudnn_{em}": t_cudnn / r[f"{em}_ms"] for em in ts})
            rows.append(r)
            print(f"{L:>6} {source:6} {mode:6} {precision} whole online {r['online_ms']:.3f} ({r['x_cudnn_online']:.2f}x) "
                  f"bound {r['bound_ms']:.3f} ({r['x_cudnn_bound']:.2f}x)"
                  + (f" bf16 {r['bf16_ms']:.3f} ({r['x_cudnn_bf16']:.2f}x)" if "bf16" in ts else "")
                  + f" | prepare {tp[False]:.3f} with kmax {tp[True]:.3f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attend", type=int, nargs="*", default=[32768, 65536])
    ap.add_argument("--whole", type=int, nargs="*", default=[4096, 8192, 32768])
    ap.add_argument("--precision", default="input", choices=("input", "int8"),
                    help="the kernel whose exact loop is timed (int8: Q·Kᵀ in int8, P·V in the input dtype)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "exact_max.json"))
    args = ap.parse_args()
    res = dict(el.toolchain(cudnn=False), shape="B2-H16-D128", dtype="bfloat16", density=0.125,
               precision=args.precision, attend=[], whole=[])
    for L in args.attend:
        res["attend"] += attend_rows(L, args.rounds, args.precision)
    for L in args.whole:
        res["whole"] += whole_rows(L, args.rounds, args.precision)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
