"""Prepare's launch geometry, A/B in one process: ``STATS_TUNING["waves"]`` (programs of the stats
launch per SM) and ``["hdev_waves"]`` (waves of the ``||H_j − H̄||`` pass's equal runs of key
blocks), covariance-aware prepare into a workspace as a planned call runs it, B2-H16-D128 bf16,
Gaussian q/k/v, two interleaved rounds; checks that H̄ and hdev do not change.

    PYTHONPATH=src OUT=DIR python3 benchmarks/prepare_tuning.py   # writes DIR/prep_waves.json

Measured (BENCHMARKS.md): benchmarks/results/h200_prepare_hdev_split.json + .log, on the earlier
hdev pass whose runs stopped at a head's end (then ``hdev_split``: runs 1 or 2 times shorter than
the stats launch's).
"""

import json
import os

import torch

from pisa_attn.bench.kernels import bench_ms
from pisa_attn.ops.triton import prepare as P

print(torch.cuda.get_device_name(), torch.__version__)
res = []
CONFIGS = [(2, 1), (2, 2), (3, 1), (4, 1), (4, 2)]
for L in (4096, 8192, 32768, 65536):
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = None
    line = []
    for rnd in range(2):
        for waves, split in CONFIGS:
            P.STATS_TUNING["waves"], P.STATS_TUNING["hdev_waves"] = waves, split
            ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=64, with_hdev=True)
            st = P.prepare(q, k, v, 64, with_hdev=True, ws=ws)
            if ref is None:
                ref = (st.hdev.clone(), st.hbar.clone())
            err = max(((st.hdev - ref[0]).abs().max() / ref[0].abs().max()).item(),
                      ((st.hbar - ref[1]).abs().max() / ref[1].abs().max()).item())
            t = bench_ms(lambda ws=ws: P.prepare(q, k, v, 64, with_hdev=True, lean=True, ws=ws))
            res.append(dict(L=L, round=rnd, waves=waves, hdev_waves=split, ms=t, err=err))
            line.append(f"w{waves}s{split} {t:.3f}")
            del ws, st
    print(L, " | ".join(line), flush=True)
    torch.cuda.empty_cache()
P.STATS_TUNING["waves"], P.STATS_TUNING["hdev_waves"] = 2, 1
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "prep_waves.json"), "w"), indent=1)
