"""GPU time per kernel of one whole hybrid call (plan/run, torch.profiler over 10 calls), with and
without covariance-aware selection, at a Wan2.1-720p-like shape (B1-H16-L75600 DiT-like) and on
B2-H16-D128 Gaussian inputs at 64K and 32K.

    PYTHONPATH=src OUT=DIR python3 benchmarks/call_kernels.py   # writes DIR/call_kernels.json
"""
import os
import sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E
from phase_table import kernel_times
from pisa_attn import PisaSettings, plan, run, data
res = {}
cases = {"wan720": None, "65536": None, "32768": None}
for case in cases:
    if case == "wan720":
        d = data.dit_qkv((21, 45, 80), heads=16, head_dim=128, batch=1, seed=7, dtype=torch.bfloat16, device="cuda")
        q, k, v = d.q, d.k, d.v
    else:
        q, k, v = E.qkv("random", int(case))
    for cov in (True, False):
        p = plan(q, k, PisaSettings(density=0.125, backend="hopper", covariance_aware=cov))
        out = torch.empty_like(q)
        fn = lambda: run(p, q, k, v, out=out)
        for _ in range(3):
            fn()
        kt = kernel_times(fn, 10)
        tot = sum(t for t, _ in kt.values())
        res[f"{case}-cov{int(cov)}"] = kt
        print(f"\n{case} cov={cov} shape {list(q.shape)} total GPU {tot:.3f} ms")
        for name, (t, c) in sorted(kt.items(), key=lambda x: -x[1][0]):
            print(f"  {t:8.3f} ms  x{c}  {name[:90]}")
E.write_rows("call_kernels.json", res)  # {case: {kernel: (ms per call, launches per call)}}
