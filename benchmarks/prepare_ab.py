"""The statistics launches (prepare) against a copy of an earlier ``prepare.py``
(``ops/triton/_prepare_before.py``, not committed: ``git show REV:src/pisa_attn/ops/triton/prepare.py >
src/pisa_attn/ops/triton/_prepare_before.py``), in one process: prepare into a workspace as a planned
call runs it, with and without the covariance pass and the keys' maxima, 3 interleaved rounds,
median; and whether the per-block statistics are the same bits and how far H̄ and hdev moved.
Shapes: B2-H16 at 4K-64K, FLUX.1-like B1-H24 at 4608 and 16896 keys, Wan2.1-14B-like B1-H40-L75600;
D128 bf16, Gaussian q/k/v.

    PYTHONPATH=src python3 benchmarks/prepare_ab.py --out $OUT/prepare_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from pisa_attn.bench.kernels import bench_ms
from pisa_attn.ops.triton import _prepare_before as before
from pisa_attn.ops.triton import prepare as now

SHAPES = [(2, 16, 4096), (2, 16, 8192), (2, 16, 16384), (2, 16, 32768), (2, 16, 65536), (1, 24, 4608),
          (1, 24, 16896), (1, 40, 75600)]
PER_BLOCK = ("qmean", "kmean", "kbar", "vbar", "kscale", "kbound")


def rel_max(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def bench(B: int, H: int, L: int, rounds: int = 3) -> dict:
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(B, H, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns, ws = {}, {}
    for km in (False, True):
        for cov in (False, True):
            for name, mod in (("before", before), ("now", now)):
                key = (km, cov, name)
                ws[key] = mod.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=64, with_hdev=cov,
                                              with_kmax=km)
                fns[key] = (lambda mod=mod, w=ws[key], cov=cov, km=km:
                            mod.prepare(q, k, v, 64, with_hdev=cov, lean=True, ws=w, with_kmax=km))
                fns[key]()
    torch.cuda.synchronize()
    check = {}
    for km in (False, True):
        for cov in (False, True):
            a, b = ws[(km, cov, "now")], ws[(km, cov, "before")]
            check[f"kmax{int(km)}_cov{int(cov)}"] = dict(
                per_block_bitwise=all(torch.equal(getattr(a, f), getattr(b, f)) for f in PER_BLOCK),
                hbar_rel=rel_max(a.hbar, b.hbar), hdev_rel=rel_max(a.hdev, b.hdev) if cov else 0.0)
    ts = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            ts[key].append(bench_ms(fn))
    ms = {f"kmax{int(km)}_cov{int(cov)}_{name}": statistics.median(t) for (km, cov, name), t in ts.items()}
    print(f"B{B}-H{H}-L{L}: " + " | ".join(
        f"kmax{int(km)} cov{int(cov)} {ms[f'kmax{int(km)}_cov{int(cov)}_before'] * 1e3:.1f} -> "
        f"{ms[f'kmax{int(km)}_cov{int(cov)}_now'] * 1e3:.1f} us" for km in (False, True) for cov in (False, True)),
        flush=True)
    return dict(B=B, H=H, L=L, ms=ms, rounds={"_".join(map(str, key)): t for key, t in ts.items()}, check=check)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prepare_ab.json"))
    a = ap.parse_args()
    from exact_loop import toolchain  # the card and toolchain header of every result file

    res = dict(toolchain(cudnn=False), rows=[])
    for shape in SHAPES:
        res["rows"].append(bench(*shape))
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
