"""The whole hybrid call (plan/run, the defaults, B2-H16-D128 bf16, 12.5 %, Gaussian and DiT-like
inputs) with the hdev pass's equal runs of key blocks in one wave (``hdev_waves`` 1, the default)
and two, 3 interleaved rounds (median), cuDNN SDPA in the same run. The committed
``h200_hdev_split_whole.json`` measured the earlier pass, whose runs stopped at a head's end
(``hdev_split``: runs as long as the stats launch's, or half as long).

    PYTHONPATH=src LENGTHS="32768 65536" OUT=out python3 benchmarks/hdev_split_whole.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E  # noqa: E402  (the inputs and timing of the exact-loop benchmark)

from pisa_attn import PisaSettings  # noqa: E402
from pisa_attn.ops.triton import prepare as P  # noqa: E402

WAVES = (1, 2)


def main() -> None:
    rows = []
    for L in [int(x) for x in os.environ.get("LENGTHS", "32768 65536").split()]:
        t_cudnn = E.cudnn_ms(L)
        for source in ("random", "dit"):
            q, k, v = E.qkv(source, L)
            ts = E.whole_rounds(q, k, v, {s: (lambda s=s: P.STATS_TUNING.__setitem__("hdev_waves", s),
                                              PisaSettings(density=0.125, backend="hopper")) for s in WAVES},
                                est_ms=t_cudnn * 0.16)
            P.STATS_TUNING["hdev_waves"] = 1
            for s in WAVES:
                t = statistics.median(ts[s])
                rows.append(dict(L=L, source=source, hdev_waves=s, whole_ms=t, rounds=ts[s], cudnn_ms=t_cudnn,
                                 speedup=t_cudnn / t))
                print(f"{L:>6} {source:6} hybrid hdev_waves {s}: {t:.3f} ms {t_cudnn / t:.2f}x (cuDNN {t_cudnn:.2f})"
                      "  rounds " + " ".join(f"{x:.3f}" for x in ts[s]), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    E.write_rows("hdev_waves_whole.json", rows)


if __name__ == "__main__":
    main()
