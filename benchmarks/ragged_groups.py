"""A ragged key length (Lk not a multiple of 64, as in most video models' token counts) on the bf16
Hopper kernel: two or three query blocks per CTA, against a kernel before a change
(``ops/hopper/_before.py`` when present, a copy of an earlier ``attention.py``; three), on one
selection per case: the attend kernel alone (drop, hybrid), then the whole hybrid call (plan/run)
with each. B2-H16-D128 bf16 Gaussian and DiT-like inputs at L - TRIM (default 37; 0 for an even
length) and a Wan2.1-720p-like B1-H16-L75600 DiT-like case, 12.5 %, ROUNDS interleaved rounds
(default 3; median), cuDNN SDPA (at the same length) in the same run; outputs compared.

    PYTHONPATH=src CASES="32768 65536" TRIM=37 OUT=out python3 benchmarks/ragged_groups.py
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E  # noqa: E402

from pisa_attn import PisaSettings, data  # noqa: E402
from pisa_attn.metrics import rel_l1  # noqa: E402
from pisa_attn.ops.hopper import attention as gattn  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "3"))
TRIM = int(os.environ.get("TRIM", "37"))
DENSITY = 0.125
try:
    before = importlib.import_module("pisa_attn.ops.hopper._before")
except ImportError:
    before = None


def inputs(case: str, source: str):
    if case == "wan720":  # 21 x 45 x 80 latent tokens (Wan2.1 at 1280x720, 81 frames), 16 heads
        d = data.dit_qkv((21, 45, 80), heads=16, head_dim=128, batch=1, seed=7, dtype=torch.bfloat16, device="cuda")
        return d.q, d.k, d.v
    L = int(case)
    if source == "random":
        g = torch.Generator(device="cuda").manual_seed(L)
        return tuple(torch.randn(E.B, E.H, L - TRIM, E.D, generator=g, device="cuda", dtype=torch.bfloat16)
                     for _ in range(3))
    q, k, v = E.qkv("dit", L)
    return tuple(x[:, :, : L - TRIM].contiguous() for x in (q, k, v))


def cudnn_ms(q, k, v) -> float:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return E.ms(lambda: F.scaled_dot_product_attention(q, k, v), 2.5e-8 * q.shape[2] ** 2 * q.shape[0] * q.shape[1] / 32)


def bench(case: str, source: str, whole: bool) -> list:
    q, k, v = inputs(case, source)
    t_cudnn = cudnn_ms(q, k, v)
    print(f"\n{case} {source} Lk={k.shape[2]} B{q.shape[0]}-H{q.shape[1]}: cuDNN SDPA {t_cudnn:.3f} ms", flush=True)
    stats, sel, n_sel = E.selection(q, k, v, DENSITY)
    frac = sel.cnt.sum().item() / (q.shape[0] * q.shape[1] * sel.bits.shape[2] * stats.kbar.shape[2])
    scale = q.shape[-1] ** -0.5
    kernels = [("pairs", gattn, 2), ("three", gattn, 3)] + ([("before-three", before, 3)] if before else [])
    fns, outs = {}, {}
    for name, mod, nc in kernels:
        for mode in ("drop", "hybrid"):
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            fn = lambda mod=mod, m=mode, nc=nc, out=out, lse=lse: mod.attention(  # noqa: E731
                q, k, v, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, n_select=n_sel, out=out, lse=lse,
                kbound=stats.kbound, query_group=nc)
            fn()
            torch.cuda.synchronize()
            fns[name, mode], outs[name, mode] = fn, out
    ts = {key: [] for key in fns}
    for _ in range(ROUNDS):
        for key, fn in fns.items():
            ts[key].append(E.ms(fn, est_ms=t_cudnn * frac))
    rows = []
    for name, _, nc in kernels:
        row = dict(case=case, source=source, lk=k.shape[2], batch=q.shape[0], heads=q.shape[1], kernel=name,
                   query_group=nc, computed_fraction=frac, cudnn_ms=t_cudnn)
        for mode in ("drop", "hybrid"):
            row[f"{mode}_ms"] = statistics.median(ts[name, mode])
            row[f"{mode}_rounds"] = ts[name, mode]
            row[f"{mode}_finite"] = bool(torch.isfinite(outs[name, mode]).all())
            row[f"{mode}_rel_l1_to_pairs"] = rel_l1(outs[name, mode], outs["pairs", mode])
        row["share_of_cudnn"] = frac * t_cudnn / row["drop_ms"]
        rows.append(row)
        print(f"  attend {name:12} drop {row['drop_ms']:.3f} hybrid {row['hybrid_ms']:.3f} ms | share "
              f"{row['share_of_cudnn']:.3f} | vs pairs {row['drop_rel_l1_to_pairs']:.1e} / "
              f"{row['hybrid_rel_l1_to_pairs']:.1e}", flush=True)
    if whole:
        # With the kernel before: its attention() in place of this one (each plan records its own launches).
        default, attend = gattn.query_group_for, gattn.attention

        def variant(nc, fn):
            def apply():
                gattn.query_group_for = lambda mode, lk, bs: nc
                gattn.attention = fn
            return apply, PisaSettings(density=DENSITY, backend="hopper")

        variants = {"pairs": variant(2, attend), "three": variant(3, attend)}
        if before:
            variants["before-three"] = variant(3, before.attention)
        tw = E.whole_rounds(q, k, v, variants, est_ms=t_cudnn * 0.16, rounds=ROUNDS)
        gattn.query_group_for, gattn.attention = default, attend
        for name in variants:
            t = statistics.median(tw[name])
            rows.append(dict(case=case, source=source, lk=k.shape[2], kernel="whole-" + name,
                             query_group=2 if name == "pairs" else 3, whole_ms=t, rounds=tw[name], cudnn_ms=t_cudnn,
                             speedup=t_cudnn / t))
            print(f"  whole hybrid {name:12}: {t:.3f} ms {t_cudnn / t:.2f}x", flush=True)
    return rows


def main() -> None:
    rows = []
    for case in os.environ.get("CASES", "32768 65536 wan720").split():
        for source in (("dit",) if case == "wan720" else ("random", "dit")):
            rows += bench(case, source, whole=True)
            torch.cuda.empty_cache()
            E.write_rows("ragged_groups.json", rows)


if __name__ == "__main__":
    main()
