"""Host time of one eager call (the Python and launch work a caller pays per attention call),
measured as N calls queued without synchronising, plus a cProfile of the hot path.

    PYTHONPATH=src python3 tests/gpu/host_profile.py [--length 4096] [--out OUT]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

from pisa_attn import pisa_attention


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    gpu_done = time.perf_counter()
    return (t1 - t0) / n * 1e6, (gpu_done - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 16, a.length, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    res = {}
    for backend in ("hopper", "triton"):
        for mode in ("hybrid", "drop"):
            fn = lambda: pisa_attention(q, k, v, density=0.125, mode=mode, backend=backend)  # noqa: E731
            host, wall = host_us(fn)
            res[f"{backend}_{mode}"] = dict(host_us=host, wall_us=wall)
            print(f"{backend:6s} {mode:6s} L={a.length}: host {host:7.1f} us/call, wall {wall:7.1f} us/call", flush=True)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    host, wall = host_us(sdpa)
    res["sdpa"] = dict(host_us=host, wall_us=wall)
    print(f"sdpa (default backend): host {host:7.1f} us/call, wall {wall:7.1f}", flush=True)
    pr = cProfile.Profile()
    fn = lambda: pisa_attention(q, k, v, density=0.125)  # noqa: E731
    fn()
    pr.enable()
    for _ in range(200):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue()[:6000])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"host_profile_{a.length}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
