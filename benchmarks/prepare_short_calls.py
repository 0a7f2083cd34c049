"""Prepare's launch geometry for short calls (4K-16K keys), A/B in one process: one wave of
statistics programs (the default below ``STATS_TUNING["short_blocks_per_sm"]`` key blocks per SM)
against 2-6 waves, each with the ``||H_j − H̄||`` pass's equal runs in 1, 2 or 4 waves
(``hdev_waves``; the committed ``h100_prepare_short_calls.json`` measured the earlier pass, whose
runs stopped at a head's end, 1, 2 or 4 times shorter than the stats launch's: ``hdev_split``).
Covariance-aware prepare into a workspace as a planned call runs it (the keys' maxima from 16K
keys, as the Hopper backend asks), B2-H16-D128 bf16, Gaussian q/k/v, 3 interleaved rounds; the
statistics launch alone (no covariance pass) once per configuration; checks that H̄ and hdev agree
across configurations.

    PYTHONPATH=src python3 benchmarks/prepare_short_calls.py --out $OUT/prepare_short_calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from pisa_attn.bench.kernels import bench_ms
from pisa_attn.ops.triton import prepare as P


# (short_blocks_per_sm, waves, hdev_waves): the default one wave, then 2-6 waves at every length
CONFIGS = [(P.STATS_TUNING["short_blocks_per_sm"], 1, s) for s in (1, 2, 4)] + [
    (0, w, s) for w in (2, 3, 4, 6) for s in (1, 2, 4)]


def bench(L: int, rounds: int = 3) -> list:
    base = dict(P.STATS_TUNING)
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    km = L >= 16384
    rows, ref = {}, None
    ts = {c: [] for c in CONFIGS}
    try:
        for rnd in range(rounds):
            for c in CONFIGS:
                sb, waves, split = c
                P.STATS_TUNING.update(base)
                P.STATS_TUNING.update(short_blocks_per_sm=sb, waves=waves, hdev_waves=split)
                ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=64, with_hdev=True,
                                       with_kmax=km)
                st = P.prepare(q, k, v, 64, with_hdev=True, ws=ws, with_kmax=km)
                if ref is None:
                    ref = (st.hdev.clone(), st.hbar.clone())
                err = max(((st.hdev - ref[0]).abs().max() / ref[0].abs().max()).item(),
                          ((st.hbar - ref[1]).abs().max() / ref[1].abs().max()).item())
                ts[c].append(bench_ms(lambda ws=ws: P.prepare(q, k, v, 64, with_hdev=True, lean=True, ws=ws,
                                                              with_kmax=km)))
                if rnd == 0:
                    ws2 = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=64, with_kmax=km)
                    geo = P._geometry(2, 16, 16, L, L, 64, 64, 128, q.device, tuple(P.STATS_TUNING.items()))
                    rows[c] = dict(L=L, short_blocks_per_sm=sb, waves=waves, hdev_waves=split, geometry=geo,
                                   rel_err_vs_first=err, stats_launch_ms=bench_ms(
                                       lambda ws2=ws2: P.prepare(q, k, v, 64, lean=True, ws=ws2, with_kmax=km)))
    finally:
        P.STATS_TUNING.update(base)
    for c, r in rows.items():
        r.update(ms=statistics.median(ts[c]), rounds=ts[c])
        print(f"{L:>6} short {c[0]:>2} waves {c[1]} hdev_waves {c[2]} programs/head {r['geometry'][1]}+"
              f"{r['geometry'][3]}: statistics {r['stats_launch_ms'] * 1e3:6.1f} us, with covariance "
              f"{r['ms'] * 1e3:6.1f} us (err {r['rel_err_vs_first']:.1e})", flush=True)
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prepare_short_calls.json"))
    a = ap.parse_args()
    from exact_loop import toolchain  # the card and toolchain header of every result file

    res = dict(toolchain(cudnn=False),
               shape="B2-H16-D128", dtype="bfloat16", rows=[])
    for L in a.lengths:
        res["rows"] += bench(L)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
