"""The centroid tail under its fixed maximum, sequential or pipelined (each tile's Q·K̄ᵀ and
weights under the previous tile's P·V̄; ``tail_pipeline``), on one selection per (length, input):
the attend kernel alone in keep-or-drop and hybrid mode, the tail's cost (hybrid − drop) against
its bound at the exact loop's own rate (drop / (64 · density)), for the bf16 kernel and the
``fp8`` one (quantised K/V given); then the whole hybrid call (plan/run, defaults) with each
setting. B2-H16-D128 bf16, 12.5 %, Gaussian and DiT-like inputs (a ragged Lk: Gaussian), 3
interleaved rounds (median), cuDNN SDPA in the same run; outputs compared bit for bit.

    PYTHONPATH=src LENGTHS="8192 32768 65536" OUT=out python3 benchmarks/tail_pipeline.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E  # noqa: E402  (the inputs and timing of the exact-loop benchmark)

from pisa_attn import PisaSettings, plan, run  # noqa: E402
from pisa_attn.ops.hopper import attention as gattn  # noqa: E402
from pisa_attn.ops.hopper import fp8 as gfp8  # noqa: E402
from pisa_attn.ops.triton.quantize import quantize  # noqa: E402

ROUNDS = 3
DENSITY = 0.125


def qkv(source: str, L: int):
    if source == "random-ragged":  # Lk not a multiple of 64 (pairs by default in bf16)
        g = torch.Generator(device="cuda").manual_seed(L)
        return tuple(torch.randn(E.B, E.H, L - 37, E.D, generator=g, device="cuda", dtype=torch.bfloat16)
                     for _ in range(3))
    return E.qkv(source, L)


def attend_rows(L: int, source: str, t_cudnn: float) -> list:
    q, k, v = qkv(source, L)
    stats, sel, n_sel = E.selection(q, k, v, DENSITY)
    nk = stats.kbar.shape[2]
    frac = sel.cnt.sum().item() / (E.B * E.H * sel.bits.shape[2] * nk)
    qz = quantize(k, v, stats.kbar, stats.kscale, 64)
    scale = q.shape[-1] ** -0.5
    fns, outs = {}, {}
    for kern in ("bf16", "fp8"):
        for mode, pipe in (("drop", False), ("hybrid", False), ("hybrid", True)):
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            if kern == "bf16":
                fn = lambda m=mode, p=pipe, out=out, lse=lse: gattn.attention(  # noqa: E731
                    q, k, v, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, n_select=n_sel, out=out,
                    lse=lse, kbound=stats.kbound, tail_pipeline=p)
            else:
                fn = lambda m=mode, p=pipe, out=out, lse=lse: gfp8.attention(  # noqa: E731
                    q, qz, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, lk=k.shape[2], out=out,
                    lse=lse, kbound=stats.kbound, tail_pipeline=p)
            fn()
            torch.cuda.synchronize()
            fns[kern, mode, pipe], outs[kern, mode, pipe] = fn, (out, lse)
    ts = {key: [] for key in fns}
    for _ in range(ROUNDS):
        for key, fn in fns.items():
            ts[key].append(E.ms(fn, est_ms=t_cudnn * frac))
    rows = []
    for kern in ("bf16", "fp8"):
        drop = statistics.median(ts[kern, "drop", False])
        seq = statistics.median(ts[kern, "hybrid", False])
        pip = statistics.median(ts[kern, "hybrid", True])
        a, b = outs[kern, "hybrid", False], outs[kern, "hybrid", True]
        row = dict(L=L, lk=k.shape[2], source=source, kernel=kern, computed_fraction=frac, cudnn_ms=t_cudnn,
                   drop_ms=drop, hybrid_seq_ms=seq, hybrid_pipe_ms=pip, tail_seq_ms=seq - drop,
                   tail_pipe_ms=pip - drop, tail_bound_ms=drop / (64 * DENSITY), hybrid_over_drop_seq=seq / drop,
                   hybrid_over_drop_pipe=pip / drop, finite=bool(torch.isfinite(b[0]).all()),
                   bit_identical=bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])),
                   rounds={f"{m}-{'pipe' if p else 'seq'}": ts[kern, m, p] for (kk, m, p) in ts if kk == kern})
        rows.append(row)
        print(f"{L:>6} {source:13} {kern:4} drop {drop:.3f} | hybrid seq {seq:.3f} pipe {pip:.3f} ms | tail "
              f"{seq - drop:.3f} -> {pip - drop:.3f} (bound {drop / (64 * DENSITY):.3f}) | hybrid/drop "
              f"{seq / drop:.3f} -> {pip / drop:.3f} | bit-identical {row['bit_identical']}", flush=True)
    return rows


def whole_rows(L: int, source: str, t_cudnn: float) -> list:
    q, k, v = qkv(source, L)
    out = torch.empty_like(q)
    plans, ts = {}, {}
    for prec in ("input", "fp8"):
        plans[prec] = plan(q, k, PisaSettings(density=DENSITY, backend="hopper", precision=prec))
        for pipe in (False, True):
            gattn.TAIL_PIPELINE = pipe
            run(plans[prec], q, k, v, out=out)
            ts[prec, pipe] = []
    for _ in range(ROUNDS):
        for prec, pipe in ts:
            gattn.TAIL_PIPELINE = pipe
            ts[prec, pipe].append(E.ms(lambda p=plans[prec]: run(p, q, k, v, out=out), est_ms=t_cudnn * 0.16))
    rows = []
    for (prec, pipe), r in ts.items():
        t = statistics.median(r)
        rows.append(dict(L=L, source=source, precision=prec, tail_pipeline=pipe, whole_ms=t, rounds=r,
                         cudnn_ms=t_cudnn, speedup=t_cudnn / t))
        print(f"{L:>6} {source:13} whole {prec:5} tail_pipeline {pipe!s:5}: {t:.3f} ms {t_cudnn / t:.2f}x "
              f"(cuDNN {t_cudnn:.2f})", flush=True)
    return rows


def main() -> None:
    default = gattn.TAIL_PIPELINE
    attend, whole = [], []
    for L in [int(x) for x in os.environ.get("LENGTHS", "8192 32768 65536").split()]:
        t_cudnn = E.cudnn_ms(L)
        for source in ("random", "dit", "random-ragged"):
            attend += attend_rows(L, source, t_cudnn)
            if source != "random-ragged" and L >= 32768:
                whole += whole_rows(L, source, t_cudnn)
            gattn.TAIL_PIPELINE = default
            torch.cuda.empty_cache()
        E.write_rows("tail_pipeline.json", dict(attend=attend, whole=whole))


if __name__ == "__main__":
    main()
