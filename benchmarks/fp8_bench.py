"""``precision="fp8"`` against the bf16 Hopper kernel and cuDNN, in one run on one GPU.

    PYTHONPATH=src python3 benchmarks/fp8_bench.py --out benchmarks/results/h100_fp8.json
        [--lengths 4096 32768 65536] [--accuracy-only | --speed-only]

Speed (B2-H16-D128 bf16, Gaussian q/k/v, density 12.5 %, device ms by ``triton.testing.do_bench``,
median, L2 flushed before each call): cuDNN SDPA; whole planned calls (``run``) of bf16 and FP8
PISA, hybrid and drop, at the default settings (covariance-aware selection); the exact phase alone
on one selection: the bf16 pair kernel, the FP8 pair kernel (quantised K/V given), the quantisation
pass, both in drop mode (exact blocks only) and hybrid mode (with the tail).
Accuracy: rel-L1 against float64 dense attention of bf16 and FP8 PISA (hybrid, 12.5 %) on
DiT-like inputs (:func:`pisa_attn.data.dit_qkv`), Gaussian inputs and the real DINOv2 layers in
``--qkv-file`` (each on its own selection; the FP8-vs-bf16 difference on the FP8 run's selection).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pisa_attn import PisaSettings, plan, run
from pisa_attn.attention import get_backend
from pisa_attn.bench.kernels import bench_ms

QKV_FILE = "/work/shared/data/dinov2_vits14_astronaut_l0_5_11.safetensors"


def rel_l1(a, b) -> float:
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


def dense64(q, k, v, scale):
    """float64 dense attention in query chunks (no [L, L] matrix of the whole call)."""
    out = torch.empty(q.shape, device=q.device, dtype=torch.float64)
    kd, vd = k.double(), v.double()
    if kd.shape[1] != q.shape[1]:
        kd = kd.repeat_interleave(q.shape[1] // kd.shape[1], 1)
        vd = vd.repeat_interleave(q.shape[1] // vd.shape[1], 1)
    for r in range(0, q.shape[2], 1024):
        s = (q[:, :, r:r + 1024].double() @ kd.transpose(-1, -2)) * scale
        out[:, :, r:r + 1024] = torch.softmax(s, -1) @ vd
    return out


def kernel_times(fn, n: int) -> dict[str, float]:
    """GPU ms per call of every CUDA kernel ``fn`` runs (``n`` calls profiled)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dt and e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key[:60]] = out.get(e.key[:60], 0.0) + dt / n / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def speed(lengths, density: float) -> list[dict]:
    from pisa_attn.ops.hopper import fp8 as fp8k
    from pisa_attn.ops.triton.quantize import quantize

    rows = []
    hop = get_backend("hopper")
    for L in lengths:
        g = torch.Generator(device="cuda").manual_seed(L)
        q, k, v = (torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        row = dict(L=L)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v))
        sels = {}
        for prec in ("input", "fp8"):
            for mode in ("hybrid", "drop"):
                p = plan(q, k, PisaSettings(density=density, mode=mode, backend="hopper", precision=prec))
                _, sel = run(p, q, k, v, out=out, return_selection=True)
                sels[mode] = sel
                row[f"{prec}_{mode}_ms"] = bench_ms(lambda p=p: run(p, q, k, v, out=out))
                row[f"{prec}_{mode}_x_cudnn"] = row["cudnn_ms"] / row[f"{prec}_{mode}_ms"]
        # The exact phase alone, on one selection (the bf16 hybrid plan's, with its statistics).
        stats = hop.prepare(q, k, v, 64)
        scale = 128 ** -0.5
        qz = quantize(k, v, stats.kbar, stats.kscale, 64)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        row["quantize_ms"] = bench_ms(lambda: quantize(k, v, stats.kbar, stats.kscale, 64, ws=qz))
        for mode in ("drop", "hybrid"):
            sel = sels["hybrid"]
            row[f"attend_bf16_{mode}_ms"] = bench_ms(lambda m=mode: hop.attend(
                q, k, v, stats, sel, mode=m, scale=scale, block_size=64, out=out, lse=lse))
            row[f"attend_fp8_kernel_{mode}_ms"] = bench_ms(lambda m=mode: fp8k.attention(
                q, qz, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, lk=L, out=out, lse=lse))
            row[f"attend_fp8_speedup_{mode}"] = row[f"attend_bf16_{mode}_ms"] / row[f"attend_fp8_kernel_{mode}_ms"]
            row[f"attend_fp8_with_quantize_speedup_{mode}"] = row[f"attend_bf16_{mode}_ms"] / (
                row[f"attend_fp8_kernel_{mode}_ms"] + row["quantize_ms"])
        # Where an FP8 hybrid call's GPU time goes, kernel by kernel (torch.profiler, 10 calls).
        p = plan(q, k, PisaSettings(density=density, backend="hopper", precision="fp8"))
        row["fp8_hybrid_kernels_ms"] = kernel_times(lambda: run(p, q, k, v, out=out), 10)
        p = plan(q, k, PisaSettings(density=density, backend="hopper"))
        row["input_hybrid_kernels_ms"] = kernel_times(lambda: run(p, q, k, v, out=out), 10)
        rows.append(row)
        calls = " | ".join(f"{name} hybrid {row[f'{prec}_hybrid_ms']:.3f} ({row[f'{prec}_hybrid_x_cudnn']:.2f}x) drop "
                           f"{row[f'{prec}_drop_ms']:.3f} ({row[f'{prec}_drop_x_cudnn']:.2f}x)"
                           for name, prec in (("bf16", "input"), ("fp8", "fp8")))
        print(f"L={L:6d} cuDNN {row['cudnn_ms']:.3f} ms | {calls}", flush=True)
        print(f"         exact phase (drop) bf16 {row['attend_bf16_drop_ms']:.3f} fp8 "
              f"{row['attend_fp8_kernel_drop_ms']:.3f} ({row['attend_fp8_speedup_drop']:.2f}x) | attend hybrid bf16 "
              f"{row['attend_bf16_hybrid_ms']:.3f} fp8 "
              f"{row['attend_fp8_kernel_hybrid_ms']:.3f} ({row['attend_fp8_speedup_hybrid']:.2f}x) | quantize "
              f"{row['quantize_ms']:.3f}", flush=True)
        for name, prec in (("fp8", "fp8"), ("bf16", "input")):
            kernels = row[f"{prec}_hybrid_kernels_ms"].items()
            print(f"         {name} hybrid kernels (ms): " + ", ".join(f"{k_} {t:.3f}" for k_, t in kernels))
        del q, k, v, out, stats, qz
        torch.cuda.empty_cache()
    return rows


def _accuracy_case(name, q, k, v, scale, density) -> dict:
    truth = dense64(q, k, v, scale)
    res = dict(case=name, shape=list(q.shape), kv_heads=k.shape[1])
    outs = {}
    for prec in ("input", "fp8"):
        p = plan(q, k, PisaSettings(density=density, backend="hopper", precision=prec, scale=scale))
        o, sel = run(p, q, k, v, return_selection=True)
        outs[prec] = (o, sel)
        res[f"{prec}_rel_l1"] = rel_l1(o, truth)
        res[f"{prec}_finite"] = bool(torch.isfinite(o).all())
    pb = plan(q, k, PisaSettings(density=density, backend="hopper", scale=scale))
    same = run(pb, q, k, v, selection=outs["fp8"][1])
    res["bf16_same_selection_rel_l1"] = rel_l1(same, truth)
    res["fp8_vs_bf16_same_selection"] = rel_l1(outs["fp8"][0], same)
    res["growth"] = res["fp8_rel_l1"] / res["input_rel_l1"] - 1.0
    res["growth_same_selection"] = res["fp8_rel_l1"] / res["bf16_same_selection_rel_l1"] - 1.0
    print(f"{name:34s} bf16 {res['input_rel_l1']:.4e}  fp8 {res['fp8_rel_l1']:.4e}  growth {100 * res['growth']:+.2f}%"
          f" (same selection {100 * res['growth_same_selection']:+.2f}%)  fp8-vs-bf16 "
          f"{res['fp8_vs_bf16_same_selection']:.2e}", flush=True)
    return res


def accuracy(density: float, qkv_file: str | None) -> list[dict]:
    from pisa_attn.data import dit_qkv

    rows = []
    for grid, heads in (((4, 32, 32), 16), ((16, 32, 32), 8)):
        d = dit_qkv(grid, heads=heads, head_dim=128, batch=1, dtype=torch.bfloat16, device="cuda")
        rows.append(_accuracy_case(f"dit-{'x'.join(map(str, grid))}-H{heads}-D128", d.q, d.k, d.v, 128 ** -0.5,
                                   density))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 16, 4096, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows.append(_accuracy_case("gaussian-L4096-H16-D128", q, k, v, 128 ** -0.5, density))
    if qkv_file and os.path.exists(qkv_file):
        from pisa_attn.qkv_file import read_qkv_file

        for e in read_qkv_file(qkv_file).entries:
            q, k, v = (x.to("cuda", torch.bfloat16) for x in (e.q, e.k, e.v))
            scale = float(e.info.get("scale") or q.shape[-1] ** -0.5)
            rows.append(_accuracy_case(f"dinov2-{e.name}", q, k, v, scale, density))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 65536])
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--qkv-file", default=QKV_FILE)
    ap.add_argument("--speed-only", action="store_true")
    ap.add_argument("--accuracy-only", action="store_true")
    ap.add_argument("--ncu", type=int, default=None, metavar="L",
                    help="only run one bf16 and one FP8 hybrid call at length L (for ncu)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_bench.json"))
    a = ap.parse_args(argv)
    if a.ncu:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, 16, a.ncu, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for prec in ("input", "fp8"):
            p = plan(q, k, PisaSettings(density=a.density, backend="hopper", precision=prec))
            run(p, q, k, v)
        torch.cuda.synchronize()
        return
    import triton

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               shape="B2-H16-D128", dtype="bfloat16", density=a.density)
    print(f"{res['device']}, torch {res['torch']}, triton {res['triton']}", flush=True)
    if not a.speed_only:
        res["accuracy"] = accuracy(a.density, a.qkv_file)
    if not a.accuracy_only:
        res["speed"] = speed(a.lengths, a.density)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
