"""What the centroid tail and the first-order term cost in the Hopper attend at short lengths: the
attend kernel alone on one top-k selection in keep-or-drop, zeroth (the tail without the first-order
term) and hybrid mode, the tail's maximum fixed where allowed (``auto``) or online, three or two
query blocks per CTA; medians of 3 interleaved rounds, cuDNN SDPA in the same run. B2-H16-D128 bf16,
density 12.5 %, Gaussian and DiT-like inputs. ``--cases hybrid-`` keeps the cases whose name holds
one of the given strings; ``--whole`` also times the whole default call (plan/run) with the tail's
maximum ``auto`` and ``online`` (the library's ``TAIL_MAX``), interleaved; ``--q-smem`` times each
case with the query tile in registers (``-qr``) and in shared memory (``-qs``) instead of the
library's choice (:func:`query_tile_in_registers`), with ``--whole`` the whole call under both too.

    PYTHONPATH=src python3 benchmarks/tail_costs.py --out benchmarks/results/h100_tail_costs.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as el  # noqa: E402

from pisa_attn import PisaSettings  # noqa: E402
from pisa_attn.ops.hopper import attention as gattn  # noqa: E402


def cases(q, k, v, stats, sel, n_sel, q_smem=False):
    """``q_smem``: each case with the query tile held in registers (``-qr``) and read from shared
    memory in every product (``-qs``) instead of the library's choice."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    fns = {}
    for mode in ("drop", "zeroth", "hybrid"):
        for tail_max in ("auto",) if mode == "drop" else ("auto", "online"):
            for group in (3, 2):
                for q_reg in (True, False) if q_smem else (None,):
                    fns[f"{mode}-{tail_max}-g{group}" + {None: "", True: "-qr", False: "-qs"}[q_reg]] = (
                        lambda mode=mode, tail_max=tail_max, group=group, q_reg=q_reg: gattn.attention(
                            q, k, v, *stats.tail(), *sel, mode=mode, scale=q.shape[-1] ** -0.5, block_size=64,
                            n_select=n_sel, out=out, lse=lse, query_group=group, kbound=stats.kbound,
                            kmax=stats.kmax, tail_max=None if mode == "drop" else tail_max, q_reg=q_reg))
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=None, help="keep cases whose name holds one of these")
    ap.add_argument("--whole", action="store_true", help="also the whole default call, tail maximum auto/online")
    ap.add_argument("--q-smem", action="store_true",
                    help="each case with the query tile in registers (-qr) and in shared memory (-qs)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tail_costs.json"))
    a = ap.parse_args(argv)
    rows = []
    for L, t_cudnn, source, q, k, v, stats, sel, n_sel in el.selected_inputs(a.lengths):
        fns = cases(q, k, v, stats, sel, n_sel, a.q_smem)
        if a.cases:
            fns = {key: f for key, f in fns.items() if any(c in key for c in a.cases)}
        ts = el.attend_rounds(fns, t_cudnn / 6, a.rounds)
        if a.whole:
            def setting(tail_max, q_reg):
                return lambda: (setattr(gattn, "TAIL_MAX", tail_max), setattr(gattn, "Q_REG", q_reg))

            variants = {f"whole-{m}": (setting(m, gattn.Q_REG), PisaSettings(backend="hopper"))
                        for m in ("auto", "online")}
            if a.q_smem:
                variants["whole-auto-qr"] = (setting("auto", True), PisaSettings(backend="hopper"))
                variants["whole-auto-qs"] = (setting("auto", False), PisaSettings(backend="hopper"))
            saved = gattn.TAIL_MAX, gattn.Q_REG
            try:
                ts.update(el.whole_rounds(q, k, v, variants, t_cudnn / 5, a.rounds))
            finally:
                gattn.TAIL_MAX, gattn.Q_REG = saved
        med = {key: sorted(v)[len(v) // 2] for key, v in ts.items()}
        rows.append(dict(L=L, source=source, cudnn_ms=t_cudnn, ms=med, rounds_ms=ts))
        print(f"{L} {source}: " + " ".join(f"{key} {t * 1e3:.1f}" for key, t in med.items()) + " (us)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(el.toolchain(), shape="B2-H16-D128", dtype="bfloat16", density=0.125,
                       timing="attend kernel alone, eager call, triton.testing.do_bench median", rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
