"""The end-to-end benchmark's stages: which cases each one runs, its time budget, the command
line, and the device-time estimate (``--estimate``; estimates from :mod:`pisa_attn.bench.e2e_estimates`)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import replace

from ... import spec
from .. import argtypes as at
from .. import dit_cases as dc
from .. import e2e_estimates as est


# stage -> (cases, compiled)
STAGES: dict[str, tuple[tuple[str, ...], bool]] = {
    "wan14b": (("wan14b-720p",), False),
    "hunyuan": (("hunyuan-720p",), False),
    "wan14b-compiled": (("wan14b-720p",), True),
    "hunyuan-compiled": (("hunyuan-720p",), True),
    "flux": (("flux-1024", "flux-2048"), False),
    "wan1.3b": (("wan1.3b-480p",), False),
    "wan1.3b-compiled": (("wan1.3b-480p",), True),
    "flux-compiled": (("flux-2048", "flux-1024"), True),
    "sd35": (("sd35-1024",), False),
    "sd35-compiled": (("sd35-1024",), True),
}


PARTS = {
    "all": tuple(STAGES),
    "eager": tuple(s for s, (_, c) in STAGES.items() if not c),
    "compiled": tuple(s for s, (_, c) in STAGES.items() if c),
}


BUDGET_S = {
    "wan14b": 130, "hunyuan": 150, "wan14b-compiled": 110, "hunyuan-compiled": 120, "flux": 60,
    "flux-compiled": 110, "wan1.3b": 40, "wan1.3b-compiled": 200, "sd35": 50, "sd35-compiled": 110,
}  # fmt: skip


# Dense diffusers backends tried on one attention call; the fastest runs the dense forwards.
DENSE_BACKENDS = {
    "cuda": ("_native_cudnn", "_native_flash", "_native_efficient", "native", "_flash_3", "flash"),
    "cpu": ("_native_math", "native"),
}


FLUX_SWEEP = (1024, 2304, 4096, 9216, 16384)  # image tokens (512-2048 px squares), + 512 text


FLUX_SWEEP_TINY = (64, 144, 256)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_e2e.py",
        description="PISA in diffusers transformers at the paper's scale: one transformer forward, dense vs PISA, "
                    "same run (see benchmarks/bench_e2e.py).")
    p.add_argument("--tiny", action="store_true", help="tiny models of the same classes on the CPU (every code path)")
    p.add_argument("--part", choices=tuple(PARTS), default="eager", help="stage set (default eager)")
    p.add_argument("--stages", default=None, help=f"comma-separated stages, overrides --part: {', '.join(STAGES)}")
    p.add_argument("--budget-s", default=None,
                   help="per-stage time budget: seconds for every stage, or stage=seconds,... over the defaults")
    p.add_argument("--total-budget-s", type=at.positive_float, default=540.0, help="the whole run (default 540 of a 600 s call)")
    p.add_argument("--fraction", default=None,
                   help="share of the blocks to build: a number for every stage, or stage=share,... "
                        "(default: all blocks eager; the cases' compile fraction compiled)")  # fmt: skip
    p.add_argument("--density", type=at.density, default=None, help="override every case's density")
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "zeroth", "first", "drop"))
    p.add_argument("--precision", default="input", choices=spec.PRECISIONS,
                   help="the exact blocks' precision (the low ones: the Hopper kernel only)")
    p.add_argument("--min-kv-len", type=at.int_at_least(0), default=None,
                   help="apply_pisa's min_kv_len for the PISA forwards (default: the library's; 0 runs every "
                        "managed call sparse)")
    p.add_argument("--block-size", type=at.block_size, default=None, help="default 64 (16 with --tiny)")
    p.add_argument("--steps", type=at.int_at_least(1), default=50, help="denoising steps of the schedule estimate")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--warmup", type=at.int_at_least(0), default=1, help="untimed forwards before the timed ones")
    p.add_argument("--measure-s", type=at.positive_float, default=2.0, help="timed forwards continue while under this many seconds")
    p.add_argument("--max-iters", type=at.int_at_least(1), default=5, help="most timed forwards per measurement")
    p.add_argument("--flux-sweep", type=at.comma_list(at.int_at_least(1)), default=None, help="image-token counts of the min_kv_len attention sweep")
    p.add_argument("--estimate", action="store_true", help="print the stages' estimated device time and exit")
    p.add_argument("--out", default=os.environ.get("OUT", "./out"))
    p.add_argument("--name", default="bench_e2e", help="JSON file stem")
    args = p.parse_args(argv)
    names = PARTS[args.part] if args.stages is None else tuple(s.strip() for s in args.stages.split(",") if s.strip())
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        p.error(f"--stages must name stages among {', '.join(STAGES)}; got {args.stages!r}")
    args.stage_list = names
    args.budgets = _per_stage(p, "--budget-s", args.budget_s, dict(BUDGET_S), float, lambda v: v > 0)
    args.fractions = _per_stage(p, "--fraction", args.fraction, {}, float, lambda v: 0 < v <= 1)
    if args.block_size is None:
        args.block_size = 16 if args.tiny else 64
    default_sweep = FLUX_SWEEP_TINY if args.tiny else FLUX_SWEEP
    args.flux_sweep = default_sweep if args.flux_sweep is None else args.flux_sweep
    if any(math.isqrt(n) ** 2 != n for n in args.flux_sweep):
        p.error("--flux-sweep token counts must be squares (square images)")
    return args


def _per_stage(p, flag, text, defaults: dict, conv, ok) -> dict:
    """``"x"`` (every stage) or ``"stage=x,..."`` over ``defaults``."""
    if text is None:
        return defaults
    out = dict(defaults)
    try:
        if "=" not in text:
            v = conv(text)
            out = {s: v for s in STAGES}
        else:
            for item in text.split(","):
                k, v = item.split("=")
                if k.strip() not in STAGES:
                    raise ValueError(f"unknown stage {k.strip()!r}")
                out[k.strip()] = conv(v)
    except ValueError as e:
        p.error(f"{flag}: {e}")
    if not all(ok(v) for v in out.values()):
        p.error(f"{flag}: value out of range in {text!r}")
    return out


def blocks_info(case: dc.Case, full: dc.Case) -> dict:
    return {"measured": case.blocks, "total": full.blocks, "extrapolation": full.blocks / case.blocks}


def attention_call_s(case: dc.Case) -> float:
    """Estimated seconds of one dense self-attention call of the case."""
    return est.forward_seconds(case)["attention"] / case.blocks


def stage_cases(name: str, args) -> list[tuple[dc.Case, dc.Case]]:
    """(measured case, full case) pairs of a stage, after --tiny, --density and --fraction."""
    keys, compiled = STAGES[name]
    out = []
    for key in keys:
        full = dc.CASES[key]
        if args.tiny:
            full = dc.tiny(full)
        if args.density is not None:
            full = replace(full, density=args.density)
        fraction = args.fractions.get(name, full.compile_fraction if compiled else 1.0)
        out.append((dc.reduced(full, fraction), full))
    return out


def build_s(case: dc.Case) -> float:
    """Estimated seconds to build the case's model (random init on the device)."""
    return 5.0 + 0.5 * est.forward_flops(case)["linear"] / 1e15


def probe_s(case: dc.Case, n_dense: int) -> float:
    """Estimated seconds of the attention-call measurements (about 5 calls per kernel)."""
    return 2.0 + 5 * (n_dense + 2) * attention_call_s(case)


def estimate_seconds(name: str, args) -> float:
    """Estimated seconds of a stage on an H100 (see the module docstring)."""
    _, compiled = STAGES[name]
    total, built = 0.0, None
    for case, _ in stage_cases(name, args):
        f = est.forward_seconds(case)
        n = args.warmup + 1
        if case.config != built:
            total += build_s(case)
            built = case.config
        total += probe_s(case, len(DENSE_BACKENDS["cuda"]))
        if compiled:
            compiles = 3 * est.compile_seconds(case.blocks)
            total += f["dense"] + f["pisa"] + compiles + 2 * (f["dense"] + f["pisa"] + f["rest"])
        else:
            total += n * (f["dense"] + f["pisa"] + 2 * f["rest"])
    if name == "flux":
        base = dc.CASES["flux-1024"]
        total += sum(probe_s(replace(base, latent=(math.isqrt(t),) * 2), 2) for t in args.flux_sweep)
    return total
