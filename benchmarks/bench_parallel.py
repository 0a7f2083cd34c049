"""PISA under diffusers context parallelism: 1 GPU vs N GPUs on a Wan2.1-1.3B-shaped transformer.

Random weights (seeded, identical on every rank), 480p 81 frames (latent 21x60x104, 32,760 tokens),
one transformer forward at a sparse step (``dense_steps=0``; the model's 1 dense warm-up layer).
For each context-parallel kind (Ulysses, ring) the output is compared with the 1-GPU PISA output.
Two yardsticks come with it: dense attention 1 GPU vs diffusers' own Ulysses (the difference any
context parallelism shows in this dtype) and 1-GPU PISA vs dense (the scale of PISA's approximation).

    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py            # 2 GPUs (NCCL as set by the machine)
    python benchmarks/bench_parallel.py --tiny                          # CPU check: 2 gloo ranks, tiny Wan

Rank 0 prints a table last and writes ``bench_parallel.json`` to ``--out`` (default ``$OUT`` or ``.``).
The ring rows run PISA's PyTorch reference per ring step (fp32 math; the Triton kernels have no
per-shard entry yet), so they show exactness, not the speed Ulysses shows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from pisa_attn.bench.model_configs import WAN_1_3B, WAN_TINY

# (latent frames, latent height, latent width, text tokens): 480x832, 81 frames -> 21x60x104 latents.
SHAPE_480P = (21, 60, 104, 512)
SHAPE_TINY = (3, 12, 20, 8)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU: tiny Wan, 2 gloo ranks (spawned unless under torchrun)")
    p.add_argument("--kinds", default="ulysses,ring", help="context-parallel kinds to run (ulysses, ring)")
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--mode", default="hybrid")
    p.add_argument("--iters", type=int, default=3, help="timed forwards per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards first (Triton compile, autotune)")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn with --tiny outside torchrun")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for bench_parallel.json")
    args = p.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in ("ulysses", "ring")]
    if bad or not args.kinds:
        p.error(f"--kinds must name ulysses and/or ring, got {args.kinds}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def _setup(args):
    """Device and dtype of this rank (the process group is already initialised)."""
    if args.tiny:
        from pisa_attn.diffusers.parallel import allow_cpu_context_parallel

        allow_cpu_context_parallel()
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        raise SystemExit("bench_parallel.py needs CUDA GPUs (or --tiny for the CPU check)")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local), torch.bfloat16


def _inputs(args, device, dtype) -> dict:
    f, h, w, n_text = SHAPE_TINY if args.tiny else SHAPE_480P
    cfg = WAN_TINY if args.tiny else WAN_1_3B
    g = torch.Generator().manual_seed(1)  # CPU generator: identical inputs on every rank and device
    return dict(
        hidden_states=torch.randn(1, cfg["in_channels"], f, h, w, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(1, n_text, cfg["text_dim"], generator=g).to(device, dtype),
        timestep=torch.tensor([500.0], device=device),
        return_dict=False,
    )


def _model(args, device, dtype, pisa: bool):
    from diffusers import WanTransformer3DModel

    from pisa_attn.diffusers import apply_pisa

    torch.manual_seed(0)  # same weights on every rank (and in every build)
    with torch.device(device):
        model = WanTransformer3DModel(**(WAN_TINY if args.tiny else WAN_1_3B)).eval()
    # As from_pretrained(torch_dtype=...) loads it: the model's float32-sensitive modules stay float32.
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        if not keep.intersection(name.split(".")):
            p.data = p.data.to(dtype)
    if pisa:
        extra = dict(block_size=16, min_kv_len=0) if args.tiny else {}
        apply_pisa(model, density=args.density, mode=args.mode, dense_steps=0, **extra)
    return model


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(model, inputs, args, device, group=None) -> tuple[torch.Tensor, list[float]]:
    times, out = [], None
    for i in range(args.warmup + args.iters):
        if group is not None:
            dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        out = model(**inputs)[0]
        _sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return out, times


def _row(config: str, times: list[float], out=None, ref=None, base_ms=None) -> dict:
    row = dict(config=config, ms=statistics.median(times), times_ms=times)
    if ref is not None:
        diff = (out.float() - ref.float()).abs()
        row.update(
            speedup=base_ms / row["ms"], max_abs_diff=float(diff.max()),
            rel_l1=float(diff.sum() / ref.float().abs().sum()), finite=bool(torch.isfinite(out).all()),
        )  # fmt: skip
    return row


def bench_rank(rank: int, world: int, args) -> dict | None:
    """Run the benchmark on an initialised process group; rank 0 returns the results.

    Rows: dense (diffusers' native attention) on 1 rank and with diffusers' own Ulysses (the
    context-parallel noise floor in this dtype: same math, other matmul shapes), then PISA on 1
    rank and with each requested kind. Speed-up and differences are against the same attention on
    1 rank.
    """
    from diffusers import ContextParallelConfig

    device, dtype = _setup(args)
    inputs = _inputs(args, device, dtype)
    rows, refs = [], {}
    with torch.no_grad():
        if rank == 0:  # the 1-rank baselines, alone on rank 0's device
            for pisa in (False, True):
                refs[pisa], times = _time(_model(args, device, dtype, pisa), inputs, args, device)
                rows.append(_row(f"{'pisa' if pisa else 'dense'} 1 rank", times))
        dist.barrier()
        runs = [(False, "ulysses")] + [(True, kind) for kind in args.kinds]
        for pisa, kind in runs:
            model = _model(args, device, dtype, pisa)
            degree = {"ulysses_degree": world} if kind == "ulysses" else {"ring_degree": world}
            model.enable_parallelism(config=ContextParallelConfig(**degree))
            out, times = _time(model, inputs, args, device, group=dist.group.WORLD)
            del model
            if rank == 0:
                base = rows[1 if pisa else 0]["ms"]
                rows.append(_row(f"{'pisa' if pisa else 'dense'} {kind} x{world}", times, out, refs[pisa], base))
    if rank != 0:
        return None
    f, h, w, n_text = SHAPE_TINY if args.tiny else SHAPE_480P
    return dict(
        benchmark="bench_parallel",
        model="Wan2.1-1.3B-shaped (random weights)" if not args.tiny else "tiny Wan (random weights)",
        latent=[f, h, w], tokens=f * (h // 2) * (w // 2), text_tokens=n_text, dtype=str(dtype).replace("torch.", ""),
        density=args.density, mode=args.mode, world=world, iters=args.iters, warmup=args.warmup,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, pisa_vs_dense_1rank=float((refs[True].float() - refs[False].float()).abs().max()),
        rows=rows,
    )  # fmt: skip


def table(res: dict) -> str:
    lines = [
        f"{res['model']}, {res['tokens']} tokens, density {res['density']} {res['mode']}, {res['dtype']}, "
        f"{res['device']}",
        f"1-rank PISA vs dense (max abs): {res['pisa_vs_dense_1rank']:.3g}",
        f"{'config':<18} {'ms':>10} {'speedup':>8} {'max|diff|':>10} {'rel L1':>9}",
    ]
    for r in res["rows"]:
        extra = ("", "", "")
        if "speedup" in r:
            extra = (f"{r['speedup']:.2f}x", f"{r['max_abs_diff']:.3g}", f"{r['rel_l1']:.2e}")
        lines.append(f"{r['config']:<18} {r['ms']:>10.1f} {extra[0]:>8} {extra[1]:>10} {extra[2]:>9}")
    return "\n".join(lines)


def _finish(res: dict, args) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_parallel.json"), "w") as fh:
        json.dump(res, fh, indent=2)
    print(table(res), flush=True)


def _spawned(rank, world, args):
    return bench_rank(rank, world, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        if not args.tiny and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL binds a device
        dist.init_process_group("gloo" if args.tiny else "nccl")
        try:
            res = bench_rank(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        if not args.tiny:
            raise SystemExit("launch with torchrun --nproc-per-node N (or use --tiny for the CPU check)")
        from pisa_attn.parallel.launch import run_local

        res = run_local(_spawned, args.world, args)[0]
    if res is not None:
        _finish(res, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
