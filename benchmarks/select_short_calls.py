"""The one-kernel selection (scores and top-k together, up to ``FUSED["max_nkp"]`` key blocks) for
short calls: rows per program (``FUSED["rows"]``) and warps, against the two-kernel path (score GEMM
+ top-k), in one process, covariance-aware and not, into a workspace as a planned call runs it, on
the statistics of D128 bf16 Gaussian q/k/v at 12.5 %; 3 interleaved rounds, median; every variant's
selection checked equal to the default's.

    PYTHONPATH=src python3 benchmarks/select_short_calls.py --out $OUT/select_short_calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from pisa_attn.bench.kernels import bench_ms
from pisa_attn.ops.triton import prepare as P
from pisa_attn.ops.triton import select as S

SHAPES = [(2, 16, 2048), (2, 16, 4096), (1, 24, 4096), (4, 24, 4096)]
VARIANTS = [("two_kernel", dict(max_nkp=0))] + [
    (f"fused_r{r}_w{w}", dict(max_nkp=64, rows=r, warps=w)) for r in (16, 32, 64) for w in (1, 2, 4)]


def bench(B: int, H: int, L: int, rounds: int = 3) -> list:
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(B, H, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    st = P.prepare(q, k, v, 64, with_hdev=True)
    nk = -(-L // 64)
    n_sel = max(1, nk // 8)
    scratch = (4 * q.numel() * 2) // 400
    default = dict(S.FUSED)
    rows = []
    try:
        for cov in (False, True):
            kw = dict(n_select=n_sel, width=n_sel, scale=128 ** -0.5, hdev=st.hdev if cov else None)
            ref = S.select(st.qmean, st.kmean, **kw)
            fns, same = {}, {}
            for name, cfg in VARIANTS:
                S.FUSED.update(default)
                S.FUSED.update(cfg)
                ws = S.selection_workspace(B, H, nk, nk, n_sel, q.device, scratch_elems=scratch)
                sel = S.select(st.qmean, st.kmean, ws=ws, **kw)
                same[name] = bool(torch.equal(sel.bits, ref.bits) and torch.equal(sel.cnt, ref.cnt))
                fns[name] = (cfg, ws)
            ts = {name: [] for name in fns}
            for _ in range(rounds):
                for name, (cfg, ws) in fns.items():
                    S.FUSED.update(default)
                    S.FUSED.update(cfg)
                    ts[name].append(bench_ms(lambda ws=ws: S.select(st.qmean, st.kmean, ws=ws, **kw)))
            med = {name: statistics.median(t) for name, t in ts.items()}
            rows.append(dict(B=B, H=H, L=L, cov=cov, us={n: t * 1e3 for n, t in med.items()}, same=same,
                             rounds=ts))
            print(f"B{B}-H{H}-L{L} cov={cov}: " + " ".join(f"{n} {t * 1e3:.1f}" for n, t in med.items())
                  + f" | all same: {all(same.values())}", flush=True)
    finally:
        S.FUSED.clear()
        S.FUSED.update(default)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "select_short_calls.json"))
    a = ap.parse_args()
    from exact_loop import toolchain  # the card and toolchain header of every result file

    res = dict(toolchain(cudnn=False), rows=[])
    for shape in SHAPES:
        res["rows"] += bench(*shape)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
