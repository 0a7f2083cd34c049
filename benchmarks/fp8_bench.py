"""The low precisions (``fp8``, ``int8-fp8``, ``int8-int8``, ``int8``) against the bf16 Hopper kernel and cuDNN,
in one run on one GPU.

    PYTHONPATH=src python3 benchmarks/fp8_bench.py --out benchmarks/results/h100_fp8.json
        [--lengths 4096 32768 65536] [--precisions fp8 int8-fp8 int8-int8 int8] [--accuracy-only | --speed-only]

Speed (B2-H16-D128 bf16, Gaussian q/k/v, density 12.5 %, device ms by ``triton.testing.do_bench``,
median, L2 flushed before each call): cuDNN SDPA; whole planned hybrid calls (``run``) per
precision at the default settings (covariance-aware selection); the exact phase alone on one
selection: the bf16 pair kernel and the low-precision pair kernel (quantised K/V given) in drop
mode (exact blocks only) and hybrid mode (with the tail); prepare as the planned call runs it,
without and with the quantised copies of K/V (what the copies add to it), and the standalone
quantisation pass (a second and third read of K/V) beside it.
Accuracy: rel-L1 and 1 − cos against float64 dense attention per precision (hybrid, 12.5 %) on
DiT-like inputs (:func:`pisa_attn.data.dit_qkv`), Gaussian inputs and the real DINOv2 layers in
``--qkv-file`` (each on its own selection; the growth over input-precision PISA also on the same
selection); no NaN/inf at 10x and 30x DiT-like q/k. A short table is printed last.
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


LOWP = ("fp8", "int8-fp8", "int8-int8", "int8")
PRECISIONS = ("input", *LOWP)


def speed(lengths, density: float, precisions=LOWP) -> list[dict]:
    from pisa_attn.ops.hopper import fp8 as lowk
    from pisa_attn.ops.triton.prepare import prepare as tprepare
    from pisa_attn.ops.triton.prepare import stats_workspace
    from pisa_attn.ops.triton.quantize import quantize
    from pisa_attn.spec import PRODUCT_FORMATS

    rows = []
    hop = get_backend("hopper")
    for L in lengths:
        g = torch.Generator(device="cuda").manual_seed(L)
        q, k, v = (torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        row = dict(L=L)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v))
        sel = None
        for prec in ("input", *precisions):  # whole planned hybrid calls
            p = plan(q, k, PisaSettings(density=density, mode="hybrid", backend="hopper", precision=prec))
            _, s_ = run(p, q, k, v, out=out, return_selection=True)
            sel = s_ if prec == "input" else sel
            row[f"{prec}_hybrid_ms"] = bench_ms(lambda p=p: run(p, q, k, v, out=out))
            row[f"{prec}_hybrid_x_cudnn"] = row["cudnn_ms"] / row[f"{prec}_hybrid_ms"]
        # The exact phase alone, on one selection (the bf16 hybrid plan's, with its statistics):
        # drop mode = exact blocks only, hybrid = with the tail; low precision without its pass.
        stats = hop.prepare(q, k, v, 64)
        scale = 128 ** -0.5
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        for mode in ("drop", "hybrid"):
            row[f"attend_input_{mode}_ms"] = bench_ms(lambda m=mode: hop.attend(
                q, k, v, stats, sel, mode=m, scale=scale, block_size=64, out=out, lse=lse))
        # Prepare as the planned call runs it (covariance-aware, into a workspace): the copies of K/V
        # cost what prepare(quant=) adds over prepare; the standalone pass beside it.
        for prec in ("input", *precisions):
            pws = stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=64, with_hdev=True,
                                  quant=None if prec == "input" else prec)
            row[f"prepare_{prec}_ms"] = bench_ms(lambda pws=pws, prec=prec: tprepare(
                q, k, v, 64, with_hdev=True, lean=True, ws=pws, quant=None if prec == "input" else prec))
            del pws
        for prec in precisions:
            qz = quantize(k, v, stats.kbar, stats.kscale, 64, precision=prec)
            vv = v if PRODUCT_FORMATS[prec][1] == "input" else None
            row[f"quantize_{prec}_ms"] = bench_ms(lambda qz=qz, prec=prec: quantize(
                k, v, stats.kbar, stats.kscale, 64, ws=qz, precision=prec))
            row[f"prepare_quant_{prec}_ms"] = row[f"prepare_{prec}_ms"] - row["prepare_input_ms"]
            for mode in ("drop", "hybrid"):
                t = bench_ms(lambda m=mode, qz=qz, vv=vv: lowk.attention(
                    q, qz, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, lk=L, out=out, lse=lse, v=vv,
                    kbound=stats.kbound))
                row[f"attend_{prec}_{mode}_ms"] = t
                row[f"attend_{prec}_{mode}_speedup"] = row[f"attend_input_{mode}_ms"] / t
                row[f"attend_{prec}_{mode}_with_quantize_speedup"] = row[f"attend_input_{mode}_ms"] / (
                    t + row[f"quantize_{prec}_ms"])
            del qz
        # Where a hybrid call's GPU time goes, kernel by kernel (torch.profiler, 10 calls).
        for prec in ("input", *precisions):
            p = plan(q, k, PisaSettings(density=density, backend="hopper", precision=prec))
            row[f"{prec}_hybrid_kernels_ms"] = kernel_times(lambda p=p: run(p, q, k, v, out=out), 10)
        rows.append(row)
        print(f"L={L:6d} cuDNN {row['cudnn_ms']:.3f} ms | whole hybrid: " + " | ".join(
            f"{prec} {row[f'{prec}_hybrid_ms']:.3f} ({row[f'{prec}_hybrid_x_cudnn']:.2f}x)"
            for prec in ("input", *precisions)), flush=True)
        for mode in ("drop", "hybrid"):
            print(f"         attend {mode}: input {row[f'attend_input_{mode}_ms']:.3f} | " + " | ".join(
                f"{prec} {row[f'attend_{prec}_{mode}_ms']:.3f} ({row[f'attend_{prec}_{mode}_speedup']:.2f}x)"
                for prec in precisions), flush=True)
        print("         quantisation pass: " + " | ".join(f"{prec} {row[f'quantize_{prec}_ms']:.3f}"
                                                         for prec in precisions), flush=True)
        print(f"         prepare: input {row['prepare_input_ms']:.3f} | " + " | ".join(
            f"{prec} {row[f'prepare_{prec}_ms']:.3f} (+{row[f'prepare_quant_{prec}_ms']:.3f})" for prec in precisions),
            flush=True)
        for prec in ("input", *precisions):
            kernels = list(row[f"{prec}_hybrid_kernels_ms"].items())[:6]
            print(f"         {prec} hybrid kernels (ms): " + ", ".join(f"{k_} {t:.3f}" for k_, t in kernels))
        del q, k, v, out, stats
        torch.cuda.empty_cache()
    return rows


def _accuracy_case(name, q, k, v, scale, density, precisions=LOWP) -> dict:
    truth = dense64(q, k, v, scale)
    res = dict(case=name, shape=list(q.shape), kv_heads=k.shape[1])
    for prec in ("input", *precisions):
        p = plan(q, k, PisaSettings(density=density, backend="hopper", precision=prec, scale=scale))
        o, sel = run(p, q, k, v, return_selection=True)
        of = o.double()
        res[f"{prec}_rel_l1"] = rel_l1(o, truth)
        res[f"{prec}_one_minus_cos"] = (1 - F.cosine_similarity(of.flatten(), truth.flatten(), dim=0)).item()
        res[f"{prec}_finite"] = bool(torch.isfinite(o).all())
        if prec != "input":
            res[f"{prec}_growth"] = res[f"{prec}_rel_l1"] / res["input_rel_l1"] - 1.0
            pb = plan(q, k, PisaSettings(density=density, backend="hopper", scale=scale))
            same = run(pb, q, k, v, selection=sel)
            res[f"{prec}_vs_input_same_selection"] = rel_l1(o, same)
            res[f"{prec}_growth_same_selection"] = res[f"{prec}_rel_l1"] / rel_l1(same, truth) - 1.0
    print(f"{name:34s} input {res['input_rel_l1']:.4e} | " + " | ".join(
        f"{prec} {res[f'{prec}_rel_l1']:.4e} ({100 * res[f'{prec}_growth']:+.2f}%, same sel "
        f"{100 * res[f'{prec}_growth_same_selection']:+.2f}%)" for prec in precisions), flush=True)
    return res


def magnitude_check(precisions=LOWP) -> list[dict]:
    """No NaN/inf at 10x and 30x the DiT-like q/k (scores 100x and 900x), every precision."""
    from pisa_attn.data import dit_qkv

    rows = []
    d = dit_qkv((4, 32, 32), heads=8, head_dim=128, batch=1, dtype=torch.bfloat16, device="cuda")
    for mag in (10.0, 30.0):
        q, k = (d.q.float() * mag).bfloat16(), (d.k.float() * mag).bfloat16()
        for prec in ("input", *precisions):
            o = run(plan(q, k, PisaSettings(backend="hopper", precision=prec)), q, k, d.v)
            rows.append(dict(mag=mag, precision=prec, finite=bool(torch.isfinite(o).all())))
    print("magnitude 10x/30x finite: " + ", ".join(f"{r['precision']}@{r['mag']:g}x {r['finite']}" for r in rows))
    return rows


def accuracy(density: float, qkv_file: str | None, precisions=LOWP) -> list[dict]:
    from pisa_attn.data import dit_qkv

    rows = []
    for grid, heads in (((4, 32, 32), 16), ((16, 32, 32), 8)):
        d = dit_qkv(grid, heads=heads, head_dim=128, batch=1, dtype=torch.bfloat16, device="cuda")
        rows.append(_accuracy_case(f"dit-{'x'.join(map(str, grid))}-H{heads}-D128", d.q, d.k, d.v, 128 ** -0.5,
                                   density, precisions))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 16, 4096, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows.append(_accuracy_case("gaussian-L4096-H16-D128", q, k, v, 128 ** -0.5, density, precisions))
    if qkv_file and os.path.exists(qkv_file):
        from pisa_attn.qkv_file import read_qkv_file

        for e in read_qkv_file(qkv_file).entries:
            q, k, v = (x.to("cuda", torch.bfloat16) for x in (e.q, e.k, e.v))
            scale = float(e.info.get("scale") or q.shape[-1] ** -0.5)
            rows.append(_accuracy_case(f"dinov2-{e.name}", q, k, v, scale, density, precisions))
    return rows


# Schedule variants of the low-precision kernel (keyword arguments of ``fp8.attention``; ``pv_flip``:
# the P·V accumulation other than the format's default): ``--variants`` picks among them.
VARIANTS = {
    "default": {},
    "pingpong": dict(pingpong=True),
    "pipelined": dict(pipeline=True),
    "pipelined_pingpong": dict(pipeline=True, pingpong=True),
    "pipelined_pv_flip": dict(pipeline=True, pv_flip=True),
    "pipelined_pingpong_pv_flip": dict(pipeline=True, pingpong=True, pv_flip=True),
    "lookahead1": dict(lookahead=1),
    "lookahead2": dict(lookahead=2),
    "pv_accumulate": dict(pv_accumulate=True),
    "stages_2_3": dict(stages=(2, 3), modes=("hybrid",), v16=True),
    "stages_5_1": dict(stages=(5, 1), modes=("drop",), v16=True),
    "pv_accumulate_stages_5_1": dict(pv_accumulate=True, stages=(5, 1), modes=("drop",), v16=True),
    # query blocks per CTA, and the tail's maximum fixed where the bound allows (the default) or online
    "pairs": dict(query_group=2),
    "triples": dict(query_group=3),
    "pairs_online": dict(query_group=2, tail_max="online", modes=("hybrid",)),
    # the sequential loop's codes and key scales read ahead from global memory, not from the slot
    "global_codes": dict(slot_meta=False),
    "pairs_global_codes": dict(query_group=2, slot_meta=False),
    "triples_global_codes": dict(query_group=3, slot_meta=False),
    "triples_online": dict(query_group=3, tail_max="online", modes=("hybrid",)),
    # the tail's slots laid over the exact ring's (8-bit values, or int8's 16-bit value slots), at the
    # default or other depths
    "pairs_alias": dict(query_group=2, tail_alias=True, modes=("hybrid",)),
    "triples_alias": dict(query_group=3, tail_alias=True, modes=("hybrid",)),
    "triples_alias_6_3": dict(query_group=3, tail_alias=True, stages=(6, 3), modes=("hybrid",)),
    "pairs_separate": dict(query_group=2, tail_alias=False, modes=("hybrid",)),
    "triples_separate": dict(query_group=3, tail_alias=False, modes=("hybrid",)),
    "triples_alias_slot": dict(query_group=3, tail_alias=True, slot_meta=True, modes=("hybrid",)),
    "pairs_separate_zeroth": dict(query_group=2, tail_alias=False, modes=("zeroth",)),
    "triples_separate_zeroth": dict(query_group=3, tail_alias=False, modes=("zeroth",)),
    "triples_alias_zeroth": dict(query_group=3, tail_alias=True, modes=("zeroth",)),
}
SCHEDULES = ("default", "pingpong", "pipelined", "pipelined_pingpong", "pipelined_pv_flip",
             "pipelined_pingpong_pv_flip", "lookahead1", "lookahead2")


def sweep(L: int, density: float, precisions=LOWP, variants=tuple(VARIANTS), trim: int = 0, rounds: int = 1) -> dict:
    """The exact phase (drop and hybrid attend, same selection) per precision under schedule
    variants of the low-precision kernel (:data:`VARIANTS`: the default, the consumers in turns,
    the pipelined loop, P·V accumulated in the wgmma, other ring depths for P·V in the input
    dtype), beside cuDNN SDPA and the bf16 kernel in the same run. ``trim``: keys and values
    ``trim`` tokens shorter than the queries (a ragged key length). ``rounds``: the variants timed
    in turn that many times, each reported as the median over rounds (``*_rounds_ms``: every round)."""
    from pisa_attn.ops.hopper import fp8 as lowk
    from pisa_attn.ops.triton.quantize import quantize
    from pisa_attn.spec import PRODUCT_FORMATS

    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lk = L - trim
    k, v = k[:, :, :lk].contiguous(), v[:, :, :lk].contiguous()
    out = torch.empty_like(q)
    hop = get_backend("hopper")
    p = plan(q, k, PisaSettings(density=density, backend="hopper"))
    _, sel = run(p, q, k, v, out=out, return_selection=True)
    stats = hop.prepare(q, k, v, 64)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    res = dict(L=L, Lk=lk)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["cudnn_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v))
    print(f"sweep L={L} cuDNN SDPA {res['cudnn_ms']:.3f} ms", flush=True)
    for mode in ("drop", "hybrid", "zeroth"):
        if mode == "zeroth" and not any("zeroth" in VARIANTS[n].get("modes", ()) for n in variants):
            continue
        res[f"input_{mode}_ms"] = bench_ms(lambda m=mode: hop.attend(
            q, k, v, stats, sel, mode=m, scale=128 ** -0.5, block_size=64, out=out, lse=lse))
    for prec in precisions:
        qz = quantize(k, v, stats.kbar, stats.kscale, 64, precision=prec)
        vv = v if PRODUCT_FORMATS[prec][1] == "input" else None
        times, failed = {}, set()
        for _ in range(rounds):
            for name in variants:
                kw = dict(VARIANTS[name])
                modes = kw.pop("modes", ("drop", "hybrid"))
                if kw.pop("v16", False) and vv is None:
                    continue
                if kw.pop("pv_flip", False):
                    kw["pv_accumulate"] = not lowk.PV_ACCUMULATE[vv is None]
                for mode in modes:
                    if (name, mode) in failed:
                        continue
                    try:
                        t = bench_ms(lambda m=mode, kw=kw: lowk.attention(
                            q, qz, *stats.tail(), *sel, mode=m, scale=128 ** -0.5, block_size=64, lk=lk, out=out,
                            lse=lse, v=vv, kbound=stats.kbound, **kw))
                    except Exception as e:  # a variant that does not build or fit is reported, not fatal
                        print(f"sweep {prec} {name} {mode}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        failed.add((name, mode))
                        continue
                    times.setdefault(f"{prec}_{name}_{mode}", []).append(t)
        for key, ts in times.items():
            t = sorted(ts)[len(ts) // 2]
            mode = key.rsplit("_", 1)[1]
            res[f"{key}_ms"] = t
            if rounds > 1:
                res[f"{key}_rounds_ms"] = ts
            print(f"sweep L={L} {key:40s} {t:.3f} ms ({res[f'input_{mode}_ms'] / t:.2f}x "
                  f"the bf16 kernel {res[f'input_{mode}_ms']:.3f})", flush=True)
        del qz
    del q, k, v, out, stats
    torch.cuda.empty_cache()
    return res


def table(res) -> None:
    """The short summary, printed last."""
    precs = res["precisions"]
    print("\n=== accuracy: rel-L1 vs float64 dense (growth over input-precision PISA) ===")
    for r in res.get("accuracy", []):
        print(f"{r['case'][:30]:30s} input {r['input_rel_l1']:.4f} | " + " | ".join(
            f"{p} {r[f'{p}_rel_l1']:.4f} {100 * r[f'{p}_growth']:+5.1f}%" for p in precs))
    print("=== speed (ms; x = cuDNN / call; exact phase: speed-up over the bf16 kernel, drop mode) ===")
    for r in res.get("speed", []):
        print(f"L={r['L']:6d} cuDNN {r['cudnn_ms']:.3f} | bf16 {r['input_hybrid_ms']:.3f} "
              f"({r['input_hybrid_x_cudnn']:.2f}x) | " + " | ".join(
                  f"{p} {r[f'{p}_hybrid_ms']:.3f} ({r[f'{p}_hybrid_x_cudnn']:.2f}x) exact "
                  f"{r[f'attend_{p}_drop_speedup']:.2f}x q {r[f'prepare_quant_{p}_ms']:.3f} "
                  f"(alone {r[f'quantize_{p}_ms']:.3f})" for p in precs))


def sweep_table(rows) -> None:
    """The sweep's short summary: ms per variant and mode, x = the bf16 kernel / variant."""
    for r in rows:
        print(f"=== sweep L={r['L']} Lk={r.get('Lk', r['L'])}: cuDNN {r['cudnn_ms']:.3f} ms | bf16 kernel drop {r['input_drop_ms']:.3f} "
              f"hybrid {r['input_hybrid_ms']:.3f} ===")
        for key in sorted(k_ for k_ in r if k_.endswith("_ms") and not k_.endswith("_rounds_ms")
                          and k_.split("_")[0] in LOWP):
            mode = key[:-3].rsplit("_", 1)[1]
            print(f"  {key[:-3]:44s} {r[key]:7.3f} ms ({r[f'input_{mode}_ms'] / r[key]:.2f}x)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 32768, 65536])
    ap.add_argument("--density", type=float, default=0.125)
    ap.add_argument("--qkv-file", default=QKV_FILE)
    ap.add_argument("--speed-only", action="store_true")
    ap.add_argument("--accuracy-only", action="store_true")
    ap.add_argument("--precisions", nargs="+", default=list(LOWP), choices=LOWP)
    ap.add_argument("--sweep", type=int, nargs="+", default=None, metavar="L",
                    help="also time the exact phase under schedule variants at these lengths")
    ap.add_argument("--rounds", type=int, default=1, help="the sweep's variants timed in turn this many times")
    ap.add_argument("--sweep-trim", type=int, default=0, metavar="N",
                    help="the sweep's keys and values N tokens shorter than the queries (a ragged key length)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="the sweep's schedule variants")
    ap.add_argument("--schedule", default="default", choices=SCHEDULES,
                    help="the low-precision kernel's schedule for --ncu and the whole calls")
    ap.add_argument("--ncu", type=int, default=None, metavar="L",
                    help="only run one hybrid call per precision (input first) at length L (for ncu)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_bench.json"))
    a = ap.parse_args(argv)
    if a.schedule != "default":
        from pisa_attn.ops.hopper import fp8 as lowk

        kw = VARIANTS[a.schedule]
        lowk.PIPELINE = bool(kw.get("pipeline", False))
        lowk.PINGPONG = bool(kw.get("pingpong", False))
        if "lookahead" in kw:
            lowk.LOOKAHEAD = {f: kw["lookahead"] for f in lowk.LOOKAHEAD}
        if kw.get("pv_flip"):
            lowk.PV_ACCUMULATE = {f: not acc for f, acc in lowk.PV_ACCUMULATE.items()}
    if a.ncu:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, 16, a.ncu, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for prec in ("input", *a.precisions):
            p = plan(q, k, PisaSettings(density=a.density, backend="hopper", precision=prec))
            run(p, q, k, v)
        torch.cuda.synchronize()
        return
    from exact_loop import toolchain  # the card and toolchain header of every result file

    res = dict(toolchain(cudnn=False),
               shape="B2-H16-D128", dtype="bfloat16", density=a.density, precisions=a.precisions,
               schedule=a.schedule)
    print(f"{res['device']}, torch {res['torch']}, triton {res['triton']}", flush=True)
    if not a.speed_only:
        res["accuracy"] = accuracy(a.density, a.qkv_file, a.precisions)
        res["magnitude"] = magnitude_check(a.precisions)
    if not a.accuracy_only:
        res["speed"] = speed(a.lengths, a.density, a.precisions)
    if a.sweep:
        res["sweep"] = [sweep(L, a.density, a.precisions, a.variants, a.sweep_trim, a.rounds) for L in a.sweep]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")
    table(res)
    if a.sweep:
        sweep_table(res["sweep"])


if __name__ == "__main__":
    main()
