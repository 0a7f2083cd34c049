"""The Hopper pair kernel's exact loop: which query blocks share a CTA (adjacent, or matched by
shared exact blocks), measured against cuDNN SDPA in the same run.

For each length and input (Gaussian q/k/v, the DiT-like generator; B2-H16-D128 bf16, density
12.5 %, the paper's top-k selection computed once): the attend kernel alone (pairing and union
launches included) in keep-or-drop and hybrid mode for every pairing variant, the share of
cuDNN's throughput on the computed blocks (``computed fraction · t_cuDNN / t_drop``), the pair
overlap (the share of a block's exact blocks its partner also selects) and K/V tiles loaded per
block computed; the centroid tail (hybrid − drop) against its bound; the whole hybrid call
(``plan``/``run``, default settings) with adjacent and matched pairs. With ``--dino FILE`` also
the pair overlap of real DINOv2 heads (their 1370 tokens are too few to time).

    PYTHONPATH=src python3 benchmarks/exact_loop.py --out benchmarks/results/h100_exact_loop.json
    PYTHONPATH=src python3 benchmarks/exact_loop.py --ncu   # one launch per variant, for ncu -k regex:pair

``--schedules`` instead compares the exact loop's schedules on one selection per (length, input):
the sequential loop and the pipelined one (each block's Q·Kᵀ and softmax under the previous
block's P·V) of the bf16 pair kernel, with 3 and 4 ring slots, and of the FP8 kernel (quantised
K/V given), drop and hybrid, cuDNN SDPA in the same run, outputs compared across schedules.

    PYTHONPATH=src python3 benchmarks/exact_loop.py --schedules --lengths 32768 65536 \
        --out benchmarks/results/h100_pipeline.json

``--loop-variants`` compares the bf16 kernel's CTA shapes on one selection per (length, input):
two query blocks per CTA (pairs; owners and ascending stream order) and three (4 or 3 ring slots);
drop and hybrid,
outputs compared with the first variant, cuDNN SDPA in the same run; with ``--whole`` also the
whole call.

    PYTHONPATH=src python3 benchmarks/exact_loop.py --loop-variants --whole --lengths 4096 8192 32768 65536 \
        --out benchmarks/results/h100_exact_loop_v2.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pisa_attn import PisaSettings, data, plan, run, spec
from pisa_attn.attention import get_backend
from pisa_attn.metrics import rel_l1
from pisa_attn.ops.hopper import attention as gattn
from pisa_attn.ops.selection import bits_to_mask
from pisa_attn.ops.triton.pairs import pair_match, pair_union

B, H, D = 2, 16, 128
# (name, group, stream order): group 2 = adjacent pairs, 4 / 8 = the best matching in groups of 4 / 8
# query blocks; orders: pisa_attn.ops.triton.pairs.ORDERS.
VARIANTS = (("adjacent-owners", 2, "owners"), ("adjacent-ascending", 2, "ascending"), ("match4-owners", 4, "owners"),
            ("match8-owners", 8, "owners"), ("match8-ascending", 8, "ascending"))
DIT_GRIDS = {4096: (1, 64, 64), 8192: (2, 64, 64), 16384: (4, 64, 64), 32768: (8, 64, 64), 65536: (16, 64, 64)}


def qkv(source: str, L: int):
    if source == "random":
        g = torch.Generator(device="cuda").manual_seed(L)
        return tuple(torch.randn(B, H, L, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    d = data.dit_qkv(DIT_GRIDS[L], heads=H, head_dim=D, batch=1, seed=L, dtype=torch.bfloat16, device="cuda")
    return tuple(x.expand(B, -1, -1, -1).contiguous() for x in (d.q, d.k, d.v))


def ms(fn, est_ms: float = 1.0) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=max(25, 3 * est_ms), rep=max(100, 12 * est_ms), return_mode="median")


def attend_rounds(fns: dict, est_ms: float, rounds: int = 3) -> dict:
    """Each of ``fns`` (key -> callable) run once, then timed in ``rounds`` interleaved rounds (a
    slow spell of the card hits every case): key -> ms list."""
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    ts = {key: [] for key in fns}
    for _ in range(rounds):
        for key, f in fns.items():
            ts[key].append(ms(f, est_ms=est_ms))
    return ts


def selected_inputs(lengths, density: float = 0.125, sources=("random", "dit")):
    """Per length (cuDNN timed first) and input source: ``(L, cudnn ms, source, q, k, v, stats,
    selection, n_select)`` on the library's top-k selection."""
    for L in lengths:
        t_cudnn = cudnn_ms(L)
        for source in sources:
            q, k, v = qkv(source, L)
            yield (L, t_cudnn, source, q, k, v, *selection(q, k, v, density))


def whole_rounds(q, k, v, variants: dict, est_ms: float, rounds: int = 3) -> dict:
    """The whole call (plan/run) of each variant, timed in ``rounds`` interleaved rounds: ``variants``
    maps a key to ``(apply, settings)``, ``apply()`` setting the variant's module state before its
    plan and before each of its timings (the caller restores the defaults). Returns key -> ms list."""
    out = torch.empty_like(q)
    plans = {}
    for key, (apply, settings) in variants.items():
        apply()
        plans[key] = plan(q, k, settings)
        run(plans[key], q, k, v, out=out)
    ts = {key: [] for key in variants}
    for _ in range(rounds):
        for key, (apply, _) in variants.items():
            apply()
            ts[key].append(ms(lambda p=plans[key]: run(p, q, k, v, out=out), est_ms=est_ms))
    return ts


def toolchain(cudnn: bool = True) -> dict:
    """The card and the toolchain versions every result file starts with."""
    import triton

    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    from triton.backends.nvidia.compiler import get_ptxas

    env["ptxas"] = get_ptxas(90).version  # Triton 3.9 builds sm_90 with CUDA 13's, 3.6 with 12's
    if cudnn:
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def write_rows(name: str, rows: list) -> None:
    """``rows`` as ``$OUT/name`` (default ``.``), with the card and toolchain versions."""
    import json
    import os

    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(dict(toolchain(), rows=rows), f, indent=1)


def cudnn_ms(L: int) -> float:
    """Dense cuDNN SDPA on Gaussian B2-H16-D128 bf16 inputs of length ``L`` (the baseline of every row)."""
    q, k, v = qkv("random", L)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t = ms(lambda: F.scaled_dot_product_attention(q, k, v), 2.5e-8 * L * L)  # est.: ~660 TFLOP/s
    print(f"\nL={L}: cuDNN SDPA {t:.3f} ms", flush=True)
    return t


def selection(q, k, v, density):
    be = get_backend("hopper")
    stats = be.prepare(q, k, v, 64)
    nk = stats.kbar.shape[2]
    n_sel = spec.num_selected(density, nk)
    sel = be.select(stats.qmean, stats.kmean, n_select=n_sel, width=spec.selection_width(nk, n_sel, 0),
                    scale=q.shape[-1] ** -0.5)
    return stats, sel, n_sel


def pairing_stats(bits, nk: int, group: int, width: int) -> dict:
    """Pair overlap (mean over query blocks of shared / own exact blocks) and K/V tiles the stream
    loads per block computed."""
    bits = bits.contiguous()
    nq = bits.shape[2]
    if group > 2:
        qpair = pair_match(bits, group).long()
    else:
        first = torch.arange(0, nq, 2, device=bits.device)
        qpair = torch.stack([first, first + 1], -1).expand(*bits.shape[:2], -1, -1)
    mask = bits_to_mask(bits, nk)
    pad = torch.cat([mask, torch.zeros_like(mask[:, :, :1])], 2)  # row Nq: the partner "none"
    a = torch.gather(pad, 2, qpair[..., 0, None].expand(-1, -1, -1, nk))
    b = torch.gather(pad, 2, qpair[..., 1, None].expand(-1, -1, -1, nk))
    shared = (a & b).sum(-1).float()
    real_b = qpair[..., 1] < nq
    ratios = torch.cat([(shared / a.sum(-1).clamp_min(1)).flatten(), (shared / b.sum(-1).clamp_min(1))[real_b]])
    overlap = ratios.mean().item()
    _, ucnt = pair_union(bits, nk, width, qpair=qpair.int().contiguous() if group > 2 else None)
    return dict(overlap=overlap, loads_per_computed=(ucnt.sum() / mask.sum()).item())


def attend_fn(q, k, v, stats, sel, mode, group, order, n_sel):
    """(a launch of the attend kernel into fixed buffers, its output buffer)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    return (lambda: gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=q.shape[-1] ** -0.5,
                                    block_size=64, n_select=n_sel, out=out, lse=lse, pair_group=group,
                                    pair_order=order, kbound=stats.kbound, kmax=stats.kmax)), out


def bench_length(L: int, sources, density: float, whole: bool, res: dict):
    t_cudnn = cudnn_ms(L)
    for source in sources:
        q, k, v = qkv(source, L)
        stats, sel, n_sel = selection(q, k, v, density)
        nk = stats.kbar.shape[2]
        nq = sel.bits.shape[2]
        frac = sel.cnt.sum().item() / (B * H * nq * nk)
        ref_out = None
        for name, group, order in VARIANTS:
            ps = pairing_stats(sel.bits, nk, group, sel.idx.shape[-1])
            row = dict(L=L, source=source, density=density, variant=name, group=group, order=order,
                       computed_fraction=frac, cudnn_ms=t_cudnn, **ps)
            for mode in ("drop", "hybrid"):
                fn, _ = attend_fn(q, k, v, stats, sel, mode, group, order, n_sel)
                fn()
                torch.cuda.synchronize()
                row[f"{mode}_ms"] = ms(fn, est_ms=t_cudnn * frac)
            # bit-identity across pairings in the ascending order (the kernel's own output)
            fn, o = attend_fn(q, k, v, stats, sel, "hybrid", group, order, n_sel)
            fn()
            if order == "ascending":
                if ref_out is None:
                    ref_out = o.clone()
                row["bit_identical_to_adjacent"] = bool(torch.equal(o, ref_out))
            row["pairing_ms"] = ms(lambda: pair_union(sel.bits, nk, sel.idx.shape[-1], order=order, qpair=(
                pair_match(sel.bits, group) if group > 2 else None)))
            row["share_of_cudnn"] = frac * t_cudnn / row["drop_ms"]
            row["tail_ms"] = row["hybrid_ms"] - row["drop_ms"]
            row["tail_bound_exact_rate_ms"] = row["drop_ms"] / (64 * density)
            tail_flop = 4 * B * H * L * nk * D
            row["tail_bound_cudnn_rate_ms"] = tail_flop / (4 * B * H * L * L * D / t_cudnn)
            res["attend"].append(row)
            print(f"{L:>6} {source:7} {name:16} overlap {row['overlap']:.3f} loads/comp "
                  f"{row['loads_per_computed']:.3f} | drop {row['drop_ms']:.3f} hybrid {row['hybrid_ms']:.3f} "
                  f"pairing {row['pairing_ms']:.3f} ms | share {row['share_of_cudnn']:.3f} | tail "
                  f"{row['tail_ms']:.3f} (bound {row['tail_bound_exact_rate_ms']:.3f} / "
                  f"{row['tail_bound_cudnn_rate_ms']:.3f}) {row.get('bit_identical_to_adjacent', '')}", flush=True)
        if whole:
            for group in (2, 8):
                for mode in ("hybrid", "drop"):
                    gattn.PAIR_GROUP = group
                    try:
                        p = plan(q, k, PisaSettings(density=density, mode=mode, backend="hopper"))
                        out = torch.empty_like(q)
                        fn = lambda p=p, out=out: run(p, q, k, v, out=out)  # noqa: E731
                        fn()
                        t = ms(fn, est_ms=t_cudnn * frac * 1.3)
                    finally:
                        gattn.PAIR_GROUP = DEFAULT_GROUP
                    r = dict(L=L, source=source, density=density, mode=mode, group=group, whole_ms=t,
                             cudnn_ms=t_cudnn, speedup=t_cudnn / t)
                    res["whole"].append(r)
                    print(f"{L:>6} {source:7} whole {mode:6} group {group:2}: {t:.3f} ms  {r['speedup']:.2f}x cuDNN",
                          flush=True)
        del q, k, v, stats, sel
        torch.cuda.empty_cache()


def dino_overlap(path: str, density: float, res: dict):
    from safetensors.torch import load_file

    f = load_file(path)
    for layer in (0, 5, 11):
        q, k, v = (f[f"step0.layer{layer}.{n}"].cuda().to(torch.bfloat16) for n in "qkv")
        q, k, v = (x if x.dim() == 4 else x[None] for x in (q, k, v))
        _, sel, _ = selection(q.contiguous(), k.contiguous(), v.contiguous(), density)
        nk = -(-k.shape[2] // 64)
        for name, group in (("adjacent", 2), ("match4", 4), ("match8", 8)):
            ps = pairing_stats(sel.bits, nk, group, sel.idx.shape[-1])
            res["dino"].append(dict(layer=layer, variant=name, density=density, **ps))
            print(f"DINOv2 layer {layer:2} {name:12} overlap {ps['overlap']:.3f} loads/comp "
                  f"{ps['loads_per_computed']:.3f}", flush=True)


def ncu_launches(L: int = 32768):
    """One attend launch of the default kernel per (input, mode: keep-or-drop, then hybrid) for
    ncu -k regex:pair."""
    for source in ("random", "dit"):
        q, k, v = qkv(source, L)
        stats, sel, n_sel = selection(q, k, v, 0.125)
        for mode in ("drop", "hybrid"):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=q.shape[-1] ** -0.5, block_size=64,
                            n_select=n_sel, out=out, lse=lse, kbound=stats.kbound, kmax=stats.kmax)
            torch.cuda.synchronize()
            print(f"ncu launch: {source} {mode}", flush=True)


# (name, keyword arguments of the pair kernel): query_group = query blocks per CTA (None: the
# kernel's default for the mode), pipeline = the pipelined loop, stages = ring slots (None: the
# kernel's default). The first is the reference of the comparisons.
LOOP_VARIANTS = [
    ("pairs", dict(query_group=2, stages=None)),
    ("triples", dict(query_group=3, stages=None)),
    ("triples-3slots", dict(query_group=3, stages=3)),
    ("pairs-ascending", dict(query_group=2, pair_order="ascending", stages=None)),
]


def bench_loop_variants(L: int, sources, density: float, whole: bool, res: dict, rounds: int = 3,
                        names=None):
    """Each loop variant's attend kernel alone on one top-k selection (adjacent pairs), drop and
    hybrid, timed in ``rounds`` interleaved rounds (every variant once per round; the median of the
    rounds is reported: run-to-run drift hits all variants alike), outputs compared with the first
    variant's (bit for bit and rel-L1); the whole call (plan/run, default settings) once per input."""
    import statistics

    t_cudnn = cudnn_ms(L)
    for source in sources:
        q, k, v = qkv(source, L)
        stats, sel, n_sel = selection(q, k, v, density)
        nk = stats.kbar.shape[2]
        frac = sel.cnt.sum().item() / (B * H * sel.bits.shape[2] * nk)
        ps = pairing_stats(sel.bits, nk, 2, sel.idx.shape[-1])
        scale = q.shape[-1] ** -0.5
        ref, rows, fns = {}, [], []
        for name, kw in LOOP_VARIANTS:
            if names is not None and name not in names:
                continue
            row = dict(L=L, source=source, density=density, variant=name, **kw,
                       computed_fraction=frac, cudnn_ms=t_cudnn, rounds=rounds, **ps)
            for mode in ("drop", "hybrid"):
                out = torch.full_like(q, float("nan"))
                lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
                fn = lambda m=mode, out=out, lse=lse, kw=kw: gattn.attention(  # noqa: E731
                    q, k, v, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, n_select=n_sel, out=out,
                    lse=lse, kbound=stats.kbound, kmax=stats.kmax, **kw)
                fn()
                torch.cuda.synchronize()
                row[f"{mode}_finite"] = bool(torch.isfinite(out).all())
                base = ref.setdefault(mode, (out.clone(), lse.clone()))
                row[f"{mode}_bit_identical_to_first"] = bool(torch.equal(out, base[0]) and torch.equal(lse, base[1]))
                row[f"{mode}_rel_l1_to_first"] = rel_l1(out, base[0])
                row[f"{mode}_ms_rounds"] = []
                fns.append((row, mode, fn))
            rows.append(row)
        for _ in range(rounds):
            for row, mode, fn in fns:
                row[f"{mode}_ms_rounds"].append(ms(fn, est_ms=t_cudnn * frac))
        for row in rows:
            name = row["variant"]
            for mode in ("drop", "hybrid"):
                row[f"{mode}_ms"] = statistics.median(row[f"{mode}_ms_rounds"])
            row["share_of_cudnn"] = frac * t_cudnn / row["drop_ms"]
            row["tail_ms"] = row["hybrid_ms"] - row["drop_ms"]
            row["tail_bound_exact_rate_ms"] = row["drop_ms"] / (64 * density)
            # bf16 tensor-core rate on the computed blocks (4·64·64·D FLOP per block computed)
            row["exact_tflops"] = 4 * 64 * 64 * D * sel.cnt.sum().item() / (row["drop_ms"] * 1e9)
            res["loop_variants"].append(row)
            print(f"{L:>6} {source:7} {name:28} drop {row['drop_ms']:.3f} hybrid {row['hybrid_ms']:.3f} ms | share "
                  f"{row['share_of_cudnn']:.3f} | {row['exact_tflops']:.0f} TFLOP/s | rel-L1 to first "
                  f"{row['drop_rel_l1_to_first']:.1e}/{row['hybrid_rel_l1_to_first']:.1e} | drop rounds "
                  + " ".join(f"{t:.3f}" for t in row["drop_ms_rounds"]), flush=True)
        if whole:  # the whole call with the kernel's defaults
            for mode in ("hybrid", "drop"):
                p = plan(q, k, PisaSettings(density=density, mode=mode, backend="hopper"))
                out = torch.empty_like(q)
                fn = lambda p=p, out=out: run(p, q, k, v, out=out)  # noqa: E731
                fn()
                t = ms(fn, est_ms=t_cudnn * frac * 1.3)
                r = dict(L=L, source=source, density=density, mode=mode, group=DEFAULT_GROUP, protocol="default",
                         whole_ms=t, cudnn_ms=t_cudnn, speedup=t_cudnn / t)
                res["whole"].append(r)
                print(f"{L:>6} {source:7} whole {mode:6}: {t:.3f} ms  {r['speedup']:.2f}x cuDNN", flush=True)
        del q, k, v, stats, sel, ref, fns
        torch.cuda.empty_cache()


DEFAULT_GROUP = gattn.PAIR_GROUP
# (name, kernel, pipelined, ring slots: None = the kernel's default; FP8: (exact, tail) slots per mode).
# A pipelined consumer holds its last block's slot one block longer: deeper rings are compared.
FP8_DEEP = {"drop": (8, 1), "hybrid": (5, 2)}
SCHEDULES = (("bf16-sequential", "bf16", False, None), ("bf16-sequential-4slots", "bf16", False, 4),
             ("bf16-pipelined", "bf16", True, None), ("bf16-pipelined-4slots", "bf16", True, 4),
             ("bf16-pipelined-5slots", "bf16", True, 5), ("fp8-sequential", "fp8", False, None),
             ("fp8-pipelined", "fp8", True, None), ("fp8-sequential-deep", "fp8", False, FP8_DEEP),
             ("fp8-pipelined-deep", "fp8", True, FP8_DEEP))


def bench_schedules(L: int, sources, density: float, res: dict):
    """Each schedule's attend kernel alone on one top-k selection (adjacent pairs, owners order)."""
    from pisa_attn.ops.hopper import fp8 as gfp8
    from pisa_attn.ops.triton.quantize import quantize

    t_cudnn = cudnn_ms(L)
    for source in sources:
        q, k, v = qkv(source, L)
        stats, sel, n_sel = selection(q, k, v, density)
        nk = stats.kbar.shape[2]
        frac = sel.cnt.sum().item() / (B * H * sel.bits.shape[2] * nk)
        qz = quantize(k, v, stats.kbar, stats.kscale, 64)
        scale = q.shape[-1] ** -0.5
        ref = {}
        for name, kern, pipe, slots in SCHEDULES:
            row = dict(L=L, source=source, density=density, schedule=name, kernel=kern, pipelined=pipe,
                       slots=slots, computed_fraction=frac, cudnn_ms=t_cudnn)
            for mode in ("drop", "hybrid"):
                out = torch.full_like(q, float("nan"))
                lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
                if kern == "bf16":
                    fn = lambda m=mode, out=out, lse=lse: gattn.attention(  # noqa: E731
                        q, k, v, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, n_select=n_sel, out=out,
                        lse=lse, pipeline=pipe, stages=slots, kbound=stats.kbound, kmax=stats.kmax)
                else:
                    fn = lambda m=mode, out=out, lse=lse: gfp8.attention(  # noqa: E731
                        q, qz, *stats.tail(), *sel, mode=m, scale=scale, block_size=64, lk=L, out=out, lse=lse,
                        pipeline=pipe, stages=None if slots is None else slots[m])
                fn()
                torch.cuda.synchronize()
                row[f"{mode}_finite"] = bool(torch.isfinite(out).all())
                base = ref.setdefault((kern, mode), out.clone())
                row[f"{mode}_bit_identical_to_sequential"] = bool(torch.equal(out, base))
                row[f"{mode}_rel_l1_to_sequential"] = rel_l1(out, base)
                row[f"{mode}_ms"] = ms(fn, est_ms=t_cudnn * frac)
            row["share_of_cudnn"] = frac * t_cudnn / row["drop_ms"]
            res["schedules"].append(row)
            print(f"{L:>6} {source:7} {name:22} drop {row['drop_ms']:.3f} hybrid {row['hybrid_ms']:.3f} ms | share "
                  f"{row['share_of_cudnn']:.3f} | vs sequential {row['drop_rel_l1_to_sequential']:.1e} / "
                  f"{row['hybrid_rel_l1_to_sequential']:.1e} (bit-identical {row['drop_bit_identical_to_sequential']}"
                  f"/{row['hybrid_bit_identical_to_sequential']})", flush=True)
        del q, k, v, stats, sel, qz, ref
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 32768, 65536])
    ap.add_argument("--sources", nargs="+", default=["random", "dit"])
    ap.add_argument("--density", type=float, nargs="+", default=[0.125])
    ap.add_argument("--whole", action="store_true", help="also time the whole call (plan/run)")
    ap.add_argument("--dino", default=None, help="DINOv2 q/k/v file (pair overlap only)")
    ap.add_argument("--ncu", action="store_true", help="only the launches to profile")
    ap.add_argument("--schedules", action="store_true", help="compare the exact loop's schedules instead")
    ap.add_argument("--loop-variants", action="store_true",
                    help="compare the stream / barrier protocols of the bf16 kernel instead")
    ap.add_argument("--variants", nargs="+", default=None, help="names of --loop-variants to time (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of --loop-variants")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "exact_loop.json"))
    a = ap.parse_args(argv)
    if a.ncu:
        return ncu_launches()
    res = dict(toolchain(), shape=f"B{B}-H{H}-D{D}", dtype="bfloat16",
               default_group=DEFAULT_GROUP, default_pipeline=gattn.PIPELINE, default_codes_smem=gattn.CODES,
               attend=[], whole=[], dino=[], schedules=[], loop_variants=[])
    print(f"{res['device']}, torch {res['torch']}, triton {res['triton']}, cuDNN {res['cudnn']}", flush=True)
    for density in a.density:
        for L in a.lengths:
            if a.schedules:
                bench_schedules(L, a.sources, density, res)
            elif a.loop_variants:
                bench_loop_variants(L, a.sources, density, a.whole, res, a.rounds, a.variants)
            else:
                bench_length(L, a.sources, density, a.whole, res)
        if a.dino:
            dino_overlap(a.dino, density, res)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {a.out}")
    print(f"\n{'L':>6} {'input':7} {'d':>5} {'variant':16} {'overlap':>7} {'drop ms':>8} {'hyb ms':>8} "
          f"{'share':>6} {'tail/bd':>7}")
    for r in res["attend"]:
        print(f"{r['L']:>6} {r['source']:7} {r['density']:5.3f} {r['variant']:16} {r['overlap']:7.3f} "
              f"{r['drop_ms']:8.3f} {r['hybrid_ms']:8.3f} {r['share_of_cudnn']:6.3f} "
              f"{r['tail_ms'] / r['tail_bound_exact_rate_ms']:7.2f}")
    if res["schedules"]:
        print(f"\n{'L':>6} {'input':7} {'schedule':22} {'drop ms':>8} {'hyb ms':>8} {'share':>6} {'x seq drop':>10}")
        seq = {(r["L"], r["source"], r["kernel"]): r for r in res["schedules"] if not r["pipelined"]}
        for r in res["schedules"]:
            base = seq[r["L"], r["source"], r["kernel"]]
            print(f"{r['L']:>6} {r['source']:7} {r['schedule']:22} {r['drop_ms']:8.3f} {r['hybrid_ms']:8.3f} "
                  f"{r['share_of_cudnn']:6.3f} {base['drop_ms'] / r['drop_ms']:10.3f}")
    if res["loop_variants"]:
        print(f"\n{'L':>6} {'input':7} {'variant':28} {'drop ms':>8} {'hyb ms':>8} {'share':>6} {'x first':>7} "
              f"{'TFLOP/s':>7} {'rel-L1':>6}")
        first = {(r["L"], r["source"]): r for r in res["loop_variants"] if r["variant"] == LOOP_VARIANTS[0][0]}
        for r in res["loop_variants"]:
            base = first[r["L"], r["source"]]
            diff = max(r["drop_rel_l1_to_first"], r["hybrid_rel_l1_to_first"])
            print(f"{r['L']:>6} {r['source']:7} {r['variant']:28} {r['drop_ms']:8.3f} {r['hybrid_ms']:8.3f} "
                  f"{r['share_of_cudnn']:6.3f} {base['drop_ms'] / r['drop_ms']:7.3f} {r['exact_tflops']:7.0f} "
                  f"{diff:6.0e}")
    for r in res["whole"]:
        print(f"{r['L']:>6} {r['source']:7} whole {r['mode']:6} g{r['group']:<2} {r.get('protocol', ''):12} "
              f"{r['whole_ms']:8.3f} ms {r['speedup']:5.2f}x")


if __name__ == "__main__":
    main()
