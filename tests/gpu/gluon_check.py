"""Device check of the Hopper pair kernel: correctness against the Triton kernel and the float64
reference under one selection, then timing against cuDNN SDPA and the Triton kernel.

    PYTHONPATH=src python3 tests/gpu/gluon_check.py [--quick] --out OUT
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from pisa_attn import spec
from pisa_attn.attention import get_backend, make_plan
from pisa_attn.ops import reference as ref
from pisa_attn.ops.gluon import attention as gattn
from pisa_attn.ops.selection import Selection, bits_to_mask
from pisa_attn.ops.triton import attention as tattn


def rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


def qkv(b, h, hk, lq, lk, d, dtype, layout, seed, tailmax=False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(heads, length):
        shape = (b, length, heads, d) if layout == "bshd" else (b, heads, length, d)
        x = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
        return x.transpose(1, 2) if layout == "bshd" else x

    q, k, v = t(h, lq), t(hk, lk), t(hk, lk)
    if tailmax:  # a far key block aligned with every query: the row maximum sits in the tail
        k[:, :, -64:] += 3.0 * q.mean(dim=(1, 2), keepdim=True)[:, :, :1].to(k.dtype)
    return q, k, v


def run_stages(q, k, v, plan, keep=None, n_keep_max=0):
    be = get_backend("triton")
    stats = be.prepare(q, k, v, plan.block_size, with_hdev=plan.covariance_aware)
    width = spec.selection_width(plan.n_kv_blocks, plan.n_select, n_keep_max)
    s = be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=width, scale=plan.scale,
                  hdev=stats.hdev, keep=keep)
    return stats, s


def attend(which, q, k, v, stats, s, plan, poison=True, **kw):
    out = tattn._alloc_like_layout(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    if poison:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    fn = gattn.attention if which == "gluon" else tattn.attention
    fn(q, k, v, *stats.tail(), *s, mode=plan.mode, scale=plan.scale, block_size=plan.block_size,
       n_select=plan.n_select, out=out, lse=lse, **kw)
    return out, lse


CASES = [
    # name, B, H, Hk, Lq, Lk, D, dtype, layout, density, tailmax
    ("B1-H2-L130-D64-bf16-tiny", 1, 2, 2, 130, 130, 64, torch.bfloat16, "bhsd", 0.5, False),
    ("B2-H4-L4096-D128-bf16", 2, 4, 4, 4096, 4096, 128, torch.bfloat16, "bhsd", 0.125, False),
    ("B1-H4-Hk2-L8229-D128-bf16-bshd-gqa-ragged", 1, 4, 2, 8229, 8229, 128, torch.bfloat16, "bshd", 0.125, False),
    ("B2-H2-Lq4096-Lk6000-D64-fp16", 2, 2, 2, 4096, 6000, 64, torch.float16, "bhsd", 0.25, False),
    ("B1-H2-Lq4032-Lk4096-D128-bf16-oddNq", 1, 2, 2, 4032 + 17, 4096, 128, torch.bfloat16, "bhsd", 0.125, False),
    ("B1-H2-L16384-D128-bf16-d5", 1, 2, 2, 16384, 16384, 128, torch.bfloat16, "bhsd", 0.05, False),
    ("B1-H2-L4096-D128-bf16-tailmax", 1, 2, 2, 4096, 4096, 128, torch.bfloat16, "bhsd", 0.125, True),
]


def check(quick):
    rows = []
    for (name, b, h, hk, lq, lk, d, dtype, layout, density, tailmax) in CASES[: 3 if quick else None]:
        q, k, v = qkv(b, h, hk, lq, lk, d, dtype, layout, seed=len(name), tailmax=tailmax)
        for mode in ("hybrid", "zeroth", "drop"):
            plan = make_plan(q, k, density, 64, mode, False, None, "triton")
            keep = None
            n_keep = 0
            if name.endswith("ragged") and mode == "hybrid":
                keep = torch.zeros(plan.n_kv_blocks, dtype=torch.bool)
                keep[:2] = True
                keep = keep.reshape(1, 1, -1).to("cuda")
                n_keep = 2
            stats, s = run_stages(q, k, v, plan, keep, n_keep)
            t0 = time.time()
            og, lg = attend("gluon", q, k, v, stats, s, plan)
            torch.cuda.synchronize()
            t_first = time.time() - t0
            ot, lt = attend("triton", q, k, v, stats, s, plan)
            mask = bits_to_mask(s.bits, plan.n_kv_blocks)
            st64 = ref.block_stats(k.double(), v.double(), 64)
            o64, l64 = ref.pisa_forward(q.double(), k.double(), v.double(), st64, mask, mode=mode,
                                        scale=plan.scale, block_size=64)
            r = dict(case=name, mode=mode, nan=bool(og.isnan().any() or lg.isnan().any()),
                     gluon_vs_f64=rel_l1(og, o64), triton_vs_f64=rel_l1(ot, o64), gluon_vs_triton=rel_l1(og, ot),
                     dlse_gluon=(lg.double() - l64).abs().max().item(), first_call_s=round(t_first, 2))
            r["ok"] = (not r["nan"]) and r["gluon_vs_f64"] < 1e-2 and r["dlse_gluon"] < 1e-2
            rows.append(r)
            print(f"{name:44s} {mode:6s} nan={r['nan']!s:5} g/f64={r['gluon_vs_f64']:.2e} t/f64={r['triton_vs_f64']:.2e} "
                  f"g/t={r['gluon_vs_triton']:.2e} dlse={r['dlse_gluon']:.1e} {'OK' if r['ok'] else 'FAIL'}", flush=True)
    return rows


def dit_inputs(L, seed=0):
    from pisa_attn import data

    d = data.dit_qkv((L // 1024, 32, 32), heads=16, head_dim=128, batch=2, seed=seed, dtype=torch.bfloat16,
                     device="cuda")
    return d.q, d.k, d.v


def pair_shared(s):
    """The selection of every even query block given to its odd neighbour too (query_block=128)."""
    idx, cnt, bits = (x.clone() for x in s)
    nq = idx.shape[2] // 2 * 2
    for x in (idx, cnt, bits):
        x[:, :, 1:nq:2] = x[:, :, 0:nq:2]
    return Selection(idx, cnt, bits)


def overlap_of(s, nk):
    m = bits_to_mask(s.bits, nk)
    nq = m.shape[2] // 2 * 2
    a, b = m[:, :, 0:nq:2], m[:, :, 1:nq:2]
    return ((a & b).sum(-1).float() / a.sum(-1).clamp_min(1)).mean().item()


def bench(lengths, densities, kinds, dit_lengths=(8192, 32768)):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    rows = []
    for kind in kinds:
        for L in (dit_lengths if kind == "dit" else lengths):
            q, k, v = dit_inputs(L) if kind == "dit" else qkv(2, 16, 16, L, L, 128, torch.bfloat16, "bhsd", seed=L)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                t_cudnn = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
            for density in densities.get(L, [0.125]) if kind == "random" else [0.125]:
                for mode in ("hybrid", "drop"):
                    plan = make_plan(q, k, density, 64, mode, False, None, "triton")
                    stats, s = run_stages(q, k, v, plan)
                    r = dict(data=kind, L=L, density=density, mode=mode, cudnn_ms=t_cudnn,
                             overlap=overlap_of(s, plan.n_kv_blocks))
                    r["triton_attend_ms"] = ms(lambda: attend("triton", q, k, v, stats, s, plan, poison=False))
                    r["gluon_attend_ms"] = ms(lambda: attend("gluon", q, k, v, stats, s, plan, poison=False))
                    r["gluon_attend_qsmem_ms"] = ms(lambda: attend("gluon", q, k, v, stats, s, plan, poison=False,
                                                                   q_reg=False))
                    s2 = pair_shared(s)
                    r["qb128_triton_attend_ms"] = ms(lambda: attend("triton", q, k, v, stats, s2, plan, poison=False))
                    r["qb128_gluon_attend_ms"] = ms(lambda: attend("gluon", q, k, v, stats, s2, plan, poison=False))
                    r["prep_select_ms"] = ms(lambda: run_stages(q, k, v, plan))
                    for which in ("triton", "gluon"):
                        def full():
                            st, ss = run_stages(q, k, v, plan)
                            return attend(which, q, k, v, st, ss, plan, poison=False)

                        r[f"{which}_total_ms"] = ms(full)
                    rows.append(r)
                    print(f"{kind:6s} L={L:6d} d={density:.3f} {mode:6s} ov={r['overlap']:.2f} cudnn={t_cudnn:8.3f} | attend "
                          f"triton={r['triton_attend_ms']:.3f} gluon={r['gluon_attend_ms']:.3f} (qsmem "
                          f"{r['gluon_attend_qsmem_ms']:.3f}) qb128 t={r['qb128_triton_attend_ms']:.3f} "
                          f"g={r['qb128_gluon_attend_ms']:.3f} | prep+sel={r['prep_select_ms']:.3f} | total "
                          f"triton={r['triton_total_ms']:.3f} ({t_cudnn / r['triton_total_ms']:.2f}x) gluon="
                          f"{r['gluon_total_ms']:.3f} ({t_cudnn / r['gluon_total_ms']:.2f}x)", flush=True)
    return rows


def host_us(fn, n=100):
    """Host time per call: n calls queued without synchronising (the GPU is not the bottleneck
    while this exceeds the GPU time per call)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def host_times():
    from pisa_attn import pisa_attention

    q, k, v = qkv(2, 16, 16, 4096, 4096, 128, torch.bfloat16, "bhsd", seed=1)
    plan = make_plan(q, k, 0.125, 64, "hybrid", False, None, "triton")
    r = {}
    r["pisa_attention_us"] = host_us(lambda: pisa_attention(q, k, v, density=0.125))
    for which in ("triton", "gluon"):
        def full():
            st, ss = run_stages(q, k, v, plan)
            return attend(which, q, k, v, st, ss, plan, poison=False)
        r[f"{which}_stages_us"] = host_us(full)
    stats, s = run_stages(q, k, v, plan)
    r["prep_select_us"] = host_us(lambda: run_stages(q, k, v, plan))
    r["gluon_attend_us"] = host_us(lambda: attend("gluon", q, k, v, stats, s, plan, poison=False))
    r["triton_attend_us"] = host_us(lambda: attend("triton", q, k, v, stats, s, plan, poison=False))
    print("host us per call (4K):", {k_: round(v_, 1) for k_, v_ in r.items()}, flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    ap.add_argument("--out", default="out")
    ap.add_argument("--data", default="random,dit")
    a = ap.parse_args()
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(info, flush=True)
    res = dict(info=info, check=[] if a.no_check else check(a.quick))
    if not a.no_bench:
        lengths = [int(x) for x in a.lengths.split(",")]
        res["host"] = host_times()
        res["bench"] = bench(lengths, {32768: [0.05, 0.125, 0.5], 16384: [0.125, 0.5]}, a.data.split(","))
    import os
    os.makedirs(a.out, exist_ok=True)
    with open(f"{a.out}/gluon_check{'_bench' if a.no_check else ''}.json", "w") as f:
        json.dump(res, f, indent=1)
    bad = [r for r in res["check"] if not r["ok"]]
    print(f"=== {len(res['check']) - len(bad)} ok, {len(bad)} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
