"""The whole call (plan/run; hybrid and keep-or-drop, Gaussian and DiT-like inputs, B2-H16-D128 bf16,
12.5 %) with two and three query blocks per CTA of the Hopper kernel: a fresh plan per setting
(a plan's run keeps the launches it recorded), timed in 3 interleaved rounds (median), cuDNN SDPA
in the same run.

    PYTHONPATH=src LENGTHS="32768 65536" OUT=out python3 benchmarks/query_group_whole.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E  # noqa: E402  (the inputs and timing of the exact-loop benchmark)

from pisa_attn import PisaSettings  # noqa: E402
from pisa_attn.ops.hopper import attention as gattn  # noqa: E402

DEFAULTS = dict(gattn.QUERY_GROUP)


def main() -> None:
    rows = []
    for L in [int(x) for x in os.environ.get("LENGTHS", "32768 65536").split()]:
        t_cudnn = E.cudnn_ms(L)
        for source in ("random", "dit"):
            q, k, v = E.qkv(source, L)
            for mode in ("hybrid", "drop"):
                ts = E.whole_rounds(q, k, v, {nc: (lambda nc=nc: gattn.QUERY_GROUP.__setitem__(mode, nc),
                                                   PisaSettings(density=0.125, mode=mode, backend="hopper"))
                                              for nc in (2, 3)}, est_ms=t_cudnn * 0.16)
                gattn.QUERY_GROUP.update(DEFAULTS)
                for nc in (2, 3):
                    t = statistics.median(ts[nc])
                    rows.append(dict(L=L, source=source, mode=mode, query_group=nc, whole_ms=t, rounds=ts[nc],
                                     cudnn_ms=t_cudnn, speedup=t_cudnn / t))
                    print(f"{L:>6} {source:6} {mode:6} query_group {nc}: {t:.3f} ms {t_cudnn / t:.2f}x  rounds "
                          + " ".join(f"{x:.3f}" for x in ts[nc]), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    E.write_rows("query_group_whole.json", rows)


if __name__ == "__main__":
    main()
