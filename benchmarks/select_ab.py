"""The covariance-aware selection (the library's default) against an earlier ``select.py``, in
interleaved rounds, on the same statistics; B2-H16-D128 bf16 Gaussian q/k/v, density 12.5 %.

    PYTHONPATH=src python3 benchmarks/select_ab.py --baseline DIR [--lengths 8192,32768] [--rounds 7]

DIR holds the earlier ``select.py`` (loaded as a module of ``pisa_attn.ops.triton``). Per length:
``do_bench`` medians (L2 flushed) of each implementation in each round, their medians over the
rounds, GPU time per kernel (torch.profiler, 5 calls), and whether both select the same blocks
(bitmasks and counts equal). Writes ``$OUT/select_ab.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from triton.testing import do_bench

from pisa_attn import spec
from pisa_attn.ops.triton import prepare as P
from pisa_attn.ops.triton import select as S
from pisa_attn.ops.triton.op import score_scratch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_bench import kernel_times  # noqa: E402
from stats_select_bench import load_baseline  # noqa: E402

B, H, D, BS, DENSITY = 2, 16, 128, 64, 0.125


def run_length(L: int, old, rounds: int) -> dict:
    torch.manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    nk = spec.num_blocks(L, BS)
    n_sel = spec.num_selected(DENSITY, nk)
    st = P.prepare(q, k, v, BS, with_hdev=True)
    kw = dict(n_select=n_sel, width=spec.selection_width(nk, n_sel, 0), scale=D ** -0.5, hdev=st.hdev,
              scratch_elems=score_scratch(q, k))
    fns = {"old": lambda: old.select(st.qmean, st.kmean, **kw), "new": lambda: S.select(st.qmean, st.kmean, **kw)}
    a, b = fns["old"](), fns["new"]()
    same = bool(torch.equal(a.bits, b.bits) and torch.equal(a.cnt, b.cnt))
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(do_bench(f, warmup=10, rep=60, return_mode="median"))
    return {"L": L, "n_kv_blocks": nk, "ms": {n: statistics.median(t) for n, t in times.items()}, "rounds": times,
            "same_selection": same, "kernels": {n: kernel_times(f, 5) for n, f in fns.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--lengths", default="8192,16384,32768,65536")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    (old,) = load_baseline(a.baseline, ("select",))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "shape": f"B{B}-H{H}-D{D} bf16, density {DENSITY}", "rows": []}
    x = torch.randn(8192, 8192, device="cuda")
    t0 = time.time()
    while time.time() - t0 < 1.0:  # a busy GPU before the first timing
        x @ x
    for L in (int(s) for s in a.lengths.split(",")):
        r = run_length(L, old, a.rounds)
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "select_ab.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}, {res['shape']}: covariance-aware "
          f"selection, ms (median of {a.rounds} interleaved rounds); per kernel ms")
    for r in res["rows"]:
        print(f"{r['L']:>6} old {r['ms']['old']:.4f} new {r['ms']['new']:.4f} same {r['same_selection']} | "
              + " | ".join(f"{n}: " + ", ".join(f"{k} {v:.4f}" for k, v in r["kernels"][n].items()) for n in r["kernels"]))


if __name__ == "__main__":
    main()
