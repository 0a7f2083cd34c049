"""One source tree's host cost per eager call, for comparing two trees (this one and an earlier
commit's) across processes.

    git archive REV src | tar -x -C DIR
    for t in DIR . DIR .; do PYTHONPATH= python3 benchmarks/host_tree_ab.py $t; done

B2-H16-D128 bf16, density 0.125, backend auto, at 4K and 32K: ``run(plan, q, k, v, out=)`` and
``pisa_attention``. Per call: host µs while calls are queued without a sync (200 at 4K, 40 at 32K,
after 20 warm-up calls), and wall ms with a sync after the batch. Prints one JSON line.
"""

import json
import os
import sys
import time

root = sys.argv[1]
sys.path.insert(0, os.path.join(os.path.abspath(root), "src"))

import torch  # noqa: E402

import pisa_attn  # noqa: E402
from pisa_attn import PisaSettings, pisa_attention, plan, run  # noqa: E402

if not pisa_attn.__file__.startswith(os.path.abspath(root)):
    raise SystemExit(f"pisa_attn came from {pisa_attn.__file__}, not from {root}")
torch.manual_seed(0)
res = {}
for L in (4096, 32768):
    q, k, v = (torch.randn(2, 16, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    p = plan(q, k, PisaSettings(density=0.125))
    out = torch.empty_like(q)
    for name, fn in (("run", lambda: run(p, q, k, v, out=out)),
                     ("pisa_attention", lambda: pisa_attention(q, k, v, density=0.125))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 200 if L == 4096 else 40
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        res[f"{name}-{L}"] = (round(host, 1), round((time.perf_counter() - t0) / n * 1e3, 4))
print(json.dumps({"tree": root, **res}))
