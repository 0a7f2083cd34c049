"""The whole call (plan/run, eager) with the kernels of its chain (statistics, selection, the
query-block stream, the attention kernel) launched plainly, as programmatic dependents that wait for
the kernel before (``wait``), and as dependents that also let the next one launch early
(``trigger``): ``pisa_attn.ops.triton.grid.GRID_DEPENDENCY``; ``wait-plain`` is ``wait`` with the
attention kernel launched plainly (its Triton predecessors as dependents). Covariance-aware hybrid
and keep-or-drop on the Hopper backend, interleaved rounds (medians), cuDNN SDPA in the same run;
B2-H16-D128 bf16, 12.5 %.

    PYTHONPATH=src python3 benchmarks/grid_dependency.py --lengths 4096 8192 32768
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as el  # noqa: E402

from pisa_attn import PisaSettings, plan, run  # noqa: E402
from pisa_attn.ops.hopper import attention as hopper_attention  # noqa: E402
from pisa_attn.ops.triton import grid  # noqa: E402

LEVELS = (*grid.LEVELS, "wait-plain")


def _apply(level: str):
    """The chain's level, and whether the attention kernel follows it (all but ``wait-plain``)."""
    grid.GRID_DEPENDENCY = level.split("-")[0]
    hopper_attention.grid_dependency = (lambda device: 0) if level.endswith("plain") else grid.grid_dependency


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 32768])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sources", nargs="+", default=["random"])
    ap.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS,
                    help="the first is the reference the others' outputs are compared with")
    a = ap.parse_args(argv)
    rows = []
    saved = grid.GRID_DEPENDENCY
    try:
        for L in a.lengths:
            t_cudnn = el.cudnn_ms(L)
            for source in a.sources:
                q, k, v = el.qkv(source, L)
                variants = {}
                for name, settings in (("cov", PisaSettings(backend="hopper", covariance_aware=True)),
                                       ("drop", PisaSettings(backend="hopper", mode="drop"))):
                    for lvl in a.levels:
                        variants[f"{name}-{lvl}"] = (lambda lvl=lvl: _apply(lvl), settings)
                ts = el.whole_rounds(q, k, v, variants, t_cudnn / 5, a.rounds)
                out = {}
                for key in variants:  # each level's output against the first level's
                    _apply(key.split("-", 1)[1])
                    out[key] = run(plan(q, k, variants[key][1]), q, k, v)
                same = {key: bool(torch.equal(out[key], out[key.split("-")[0] + "-" + a.levels[0]])) for key in out}
                med = {key: statistics.median(x) for key, x in ts.items()}
                rows.append(dict(L=L, source=source, cudnn_ms=t_cudnn, ms=med, rounds_ms=ts, same_as_first=same))
                print(f"{L} {source} cuDNN {t_cudnn:.3f} ms: " + " ".join(
                    f"{key} {t:.4f} ({t_cudnn / t:.2f}x)" for key, t in med.items()) + f" same {same}", flush=True)
    finally:
        grid.GRID_DEPENDENCY = saved
        hopper_attention.grid_dependency = grid.grid_dependency
    el.write_rows("grid_dependency.json", rows)


if __name__ == "__main__":
    main()
