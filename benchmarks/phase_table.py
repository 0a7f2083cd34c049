"""Where one PISA call's time goes, by phase, on a GPU: per-kernel GPU time (torch.profiler) summed
into attend / statistics / selection / other, the host time of one eager call (calls queued
without synchronising), the eager and CUDA-graph wall time per call, and cuDNN SDPA in the same run.

    PYTHONPATH=src python3 benchmarks/phase_table.py --out benchmarks/results/phase_table_h100.json
        [--lengths 4096 8192 32768 65536] [--backends hopper triton] [--modes hybrid drop]

Shapes: B2-H16-D128 bf16, density 12.5 %, Gaussian q/k/v (the issue's setting). Prints one table
row per (length, backend, mode) and writes every kernel's time to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from pisa_attn import PisaSettings, pisa_attention, plan, run
from pisa_attn.bench.kernels import capture_graph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as el  # noqa: E402

# Kernel name substrings -> phase (first match wins; anything else is "other": memsets, copies).
# The union of a CTA's exact blocks (``_pair_union`` / ``_triple_union``) and any copy are "other".
PHASES = (
    ("attend", ("_attn_kernel", "_pair_attn_kernel", "attend")),
    ("selection", ("_topk", "_scores_kernel", "_select_kernel", "gemm", "cutlass", "matmul", "dot_kernel")),
    ("statistics", ("_kv_means", "_hbar", "_q_mean", "_hdev", "_stats_kernel", "_finish_kernel", "prepare")),
)


def phase_of(kernel: str) -> str:
    for name, keys in PHASES:
        if any(k in kernel for k in keys):
            return name
    return "other"


def kernel_times(fn, n: int) -> dict[str, tuple[float, int]]:
    """GPU ms per call and launches per call of every CUDA kernel ``fn`` runs (``n`` calls profiled)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dt and e.device_type == torch.autograd.DeviceType.CUDA:
            t, c = out.get(e.key, (0.0, 0))
            out[e.key] = (t + dt / n / 1e3, c + e.count // n)
    return out


def eager_times(fn, n: int) -> tuple[float, float]:
    """(host µs per call while queueing, wall ms per call until the GPU is done), ``n`` calls back to back."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e3


def graph_ms(fn, n: int) -> float | None:
    """Wall ms per replay of ``fn`` captured in a CUDA graph (None when capture fails)."""
    try:
        g = capture_graph(fn, warmup=3)
        g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / n
    except Exception as e:  # noqa: BLE001 -- reported in the table, the benchmark goes on
        print(f"   CUDA graph capture failed: {type(e).__name__}: {e}")
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 32768, 65536])
    ap.add_argument("--backends", nargs="+", default=["hopper", "triton"])
    ap.add_argument("--modes", nargs="+", default=["hybrid", "drop"])
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--covariance-aware", choices=("off", "on", "both"), default="both",
                    help="selection rule of the hybrid/zeroth cases: top-k (off), covariance-aware (on) or both")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "phase_table.json"))
    a = ap.parse_args(argv)
    res = dict(el.toolchain(cudnn=False), shape="B2-H16-D128", dtype="bfloat16", density=a.density, rows=[])
    print(f"{res['device']}, torch {res['torch']}, triton {res['triton']} (ptxas {res['ptxas']}), B2-H16-D128 bf16, "
          f"density {a.density}")
    print(f"{'L':>6} {'case':16} {'GPU ms':>8} {'attend':>8} {'stats':>8} {'select':>8} {'other':>8} "
          f"{'host us':>8} {'eager ms':>9} {'graph ms':>9} {'x cuDNN':>8}")
    for L in a.lengths:
        g = torch.Generator(device="cuda").manual_seed(L)
        q, k, v = (torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        cases = [("cudnn", lambda: F.scaled_dot_product_attention(q, k, v))]
        rules = {"off": (False,), "on": (True,), "both": (False, True)}[a.covariance_aware]
        for backend in a.backends:
            for mode in a.modes:
                for cov in rules if mode != "drop" else (False,):
                    name = f"{backend}-{mode}{'-cov' if cov else ''}"
                    try:
                        s = PisaSettings(density=a.density, mode=mode, backend=backend, covariance_aware=cov)
                        p = plan(q, k, s)
                    except ValueError as e:
                        print(f"   {name}: not run ({e})")
                        continue
                    cases.append((name, lambda p=p: run(p, q, k, v, out=out)))
                    if mode == a.modes[0] and not cov:  # the public one-call API on the same settings
                        cases.append((f"{name}-api", lambda s=s: pisa_attention(q, k, v, settings=s)))
        cudnn_eager = None
        for name, fn in cases:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                kern = kernel_times(fn, 20)
                host_us, eager_ms = eager_times(fn, a.iters)
                graph = graph_ms(fn, a.iters)
            by_phase = {ph: 0.0 for ph in ("attend", "statistics", "selection", "other")}
            for kname, (t, _) in kern.items():
                by_phase[phase_of(kname)] += t
            if name == "cudnn":
                cudnn_eager = eager_ms
            row = dict(L=L, case=name, gpu_ms=sum(t for t, _ in kern.values()), phases_ms=by_phase,
                       host_us_per_eager_call=host_us, eager_ms=eager_ms, graph_ms=graph,
                       speedup_vs_cudnn_eager=(cudnn_eager / eager_ms) if cudnn_eager else None,
                       kernels=sorted(([kn, t, c] for kn, (t, c) in kern.items()), key=lambda r: -r[1]))
            res["rows"].append(row)
            graph_txt = f"{graph:9.4f}" if graph is not None else f"{'-':>9}"
            print(f"{L:>6} {name:16} {row['gpu_ms']:8.4f} {by_phase['attend']:8.4f} {by_phase['statistics']:8.4f} "
                  f"{by_phase['selection']:8.4f} {by_phase['other']:8.4f} {host_us:8.1f} {eager_ms:9.4f} {graph_txt} "
                  f"{row['speedup_vs_cudnn_eager'] or 0:8.2f}", flush=True)
        del q, k, v, out
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
