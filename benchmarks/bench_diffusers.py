"""PISA in diffusers transformers: one full forward on PISA vs the fastest dense backend, same run.

* Wan2.1-1.3B-shaped ``WanTransformer3DModel`` (real config, random weights, bf16), 480p 81 frames:
  latent 21x60x104 -> 21x30x52 = 32,760 video tokens (+512 text tokens in cross-attention).
  Target: >= 3.3x (the paper reports 3.06x end to end without warm-up).
* FLUX.1-shaped ``FluxTransformer2DModel`` (19 double + 38 single blocks, 12B parameters, bf16) at
  1024x1024: 4,096 image + 512 text tokens. Target: >= 1.3x. ``--flux-blocks 4,8`` builds fewer
  blocks when memory or time is short (the table says how many; the ratio is per forward).

PISA runs at ``--density`` (default 0.125) with no warm-up (``dense_layers=0, dense_steps=0``) and
the model's tiling; dense runs every available diffusers backend (cuDNN, flash, ...) and keeps the
fastest. Also timed: one attention call at the model's shape (dense kernel vs the backend's
sparse path, text handling included), and the relative error of the PISA forward vs dense.

    python benchmarks/bench_diffusers.py                 # GPU: both models
    python benchmarks/bench_diffusers.py --tiny          # CPU check with tiny models

Writes ``bench_diffusers.json`` to ``--out`` (default ``$OUT`` or ``./out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

from pisa_attn.bench.model_configs import FLUX_DEV, FLUX_TINY, WAN_1_3B, WAN_TINY

# Latent (frames, height, width) / packed token grid, and text tokens.
WAN_SHAPE, WAN_SHAPE_TINY = ((21, 60, 104), 512), ((3, 12, 20), 8)
FLUX_SHAPE, FLUX_SHAPE_TINY = ((64, 64), 512), ((16, 16), 16)
TARGETS = {"wan": 3.3, "flux": 1.3}
DENSE_BACKENDS_GPU = ("_native_cudnn", "_native_flash", "flash", "_flash_3", "native", "_native_efficient")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (a check that the script runs)")
    p.add_argument("--models", default="wan,flux", help="comma-separated: wan, flux")
    p.add_argument("--density", type=float, default=0.125)
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "zeroth", "drop"))
    p.add_argument("--block-size", type=int, default=None, help="default 64 (16 with --tiny)")
    p.add_argument("--flux-blocks", default=None, help="double,single blocks of the FLUX model (default 19,38)")
    p.add_argument("--iters", type=int, default=3, help="timed forwards per configuration (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed forwards first (Triton compile, autotune, cuDNN plans)")
    p.add_argument("--out", default=os.environ.get("OUT", "./out"), help="directory for bench_diffusers.json")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or any(m not in TARGETS for m in args.models):
        p.error(f"--models must name wan and/or flux, got {args.models}")
    if not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.block_size is None:
        args.block_size = 16 if args.tiny else 64
    if args.flux_blocks is not None:
        try:
            d, s = (int(x) for x in args.flux_blocks.split(","))
        except ValueError:
            p.error(f"--flux-blocks must be 'double,single', got {args.flux_blocks!r}")
        if d < 1 or s < 0:
            p.error("--flux-blocks needs >= 1 double block and >= 0 single blocks")
        args.flux_blocks = (d, s)
    return args


# --- models and inputs ---------------------------------------------------------------------------
def build(kind: str, cfg: dict, device, dtype):
    """A transformer with random weights created directly on ``device`` in ``dtype`` (no fp32 copy)."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    cls = WanTransformer3DModel if kind == "wan" else FluxTransformer2DModel
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(**cfg)
    finally:
        torch.set_default_dtype(previous)
    # As from_pretrained(torch_dtype=...) does: the model's precision-sensitive tensors stay fp32.
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if keep & set(name.split(".")) and t.is_floating_point():
            t.data = t.data.float()
    return model.eval().requires_grad_(False)


def inputs(kind: str, cfg: dict, shape, device, dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    grid, text = shape
    if kind == "wan":
        f, h, w = grid
        return dict(
            hidden_states=r(1, cfg["in_channels"], f, h, w), timestep=torch.tensor([500.0], device=device),
            encoder_hidden_states=r(1, text, cfg["text_dim"]),
        )  # fmt: skip
    h, w = grid
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    out = dict(
        hidden_states=r(1, h * w, cfg["in_channels"]), encoder_hidden_states=r(1, text, cfg["joint_attention_dim"]),
        pooled_projections=r(1, cfg["pooled_projection_dim"]), timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=ids.reshape(h * w, 3).to(device), txt_ids=torch.zeros(text, 3, device=device),
    )  # fmt: skip
    if cfg.get("guidance_embeds"):
        out["guidance"] = torch.tensor([3.5], device=device, dtype=dtype)
    return out


def token_counts(kind: str, cfg: dict, shape) -> tuple[tuple[int, ...], int]:
    grid, text = shape
    if kind == "wan":
        pt, ph, pw = cfg["patch_size"]
        return (grid[0] // pt, grid[1] // ph, grid[2] // pw), 0  # text is cross-attention only
    return tuple(grid), text


# --- timing -------------------------------------------------------------------------------------
def _timer(device):
    if device.type == "cuda":

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), out

    else:

        def run(fn):
            t0 = time.perf_counter()
            out = fn()
            return (time.perf_counter() - t0) * 1e3, out

    return run


def time_ms(fn, device, warmup: int, iters: int):
    """(median ms, last output) of ``fn()``."""
    timer = _timer(device)
    out = None
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t, out = timer(fn)
            times.append(t)
    return statistics.median(times), out


def dense_forward(model, x, device, args) -> tuple[dict, torch.Tensor]:
    """Time every available dense backend; returns ({backend: ms or error}, fastest output)."""
    from diffusers.models import attention_dispatch as ad

    results, best, best_out = {}, None, None
    names = DENSE_BACKENDS_GPU if device.type == "cuda" else ("native",)
    for name in names:
        try:
            model.set_attention_backend(name)
            ms, out = time_ms(lambda: model(**x).sample, device, args.warmup, args.iters)
        except Exception as e:  # a backend this machine lacks (package, GPU arch): recorded, not fatal
            results[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            continue
        finally:
            model.reset_attention_backend()
            ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)
        results[name] = ms
        if best is None or ms < results[best]:
            best, best_out = name, out
    if best is None:
        raise RuntimeError(f"no dense attention backend ran: {results}")
    return results, best_out


def attention_only(kind, grid, text, heads, head_dim, device, dtype, args) -> dict:
    """One attention call at the model's shape: fastest dense SDPA kernel vs the backend's sparse path."""
    import pisa_attn.diffusers as pd
    from pisa_attn.diffusers.calls import sparse_attention
    from pisa_attn.diffusers.models import FLUX, WAN

    adapter = FLUX if kind == "flux" else WAN
    seq = pd.build_layouts(grid, text, adapter.text, pd.default_tile(len(grid), args.block_size), args.block_size).joint
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, seq.length, heads, head_dim, generator=g).to(device, dtype) for _ in range(3))
    settings = (args.density, args.mode, adapter.image_model, args.block_size)
    pisa_ms, _ = time_ms(lambda: sparse_attention(q, k, v, seq, None, None, settings), device, args.warmup, args.iters)
    dense = {}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kernels = {"sdpa": None}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        kernels = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, backend in kernels.items():

        def call(backend=backend):
            if backend is None:
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
            with torch.nn.attention.sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)

        try:
            dense[name], _ = time_ms(call, device, args.warmup, max(args.iters, 5))
        except RuntimeError as e:
            dense[name] = f"unavailable: {str(e).splitlines()[0][:120]}"
    timed = {n: t for n, t in dense.items() if isinstance(t, float)}
    best = min(timed, key=timed.get)
    return {"tokens": seq.length, "dense_ms": dense, "dense_best": best, "pisa_ms": pisa_ms, "speedup": timed[best] / pisa_ms}


def _model_config(kind: str, args) -> tuple[dict, tuple]:
    if kind == "wan":
        return (WAN_TINY, WAN_SHAPE_TINY) if args.tiny else (WAN_1_3B, WAN_SHAPE)
    cfg, shape = (FLUX_TINY, FLUX_SHAPE_TINY) if args.tiny else (FLUX_DEV, FLUX_SHAPE)
    if args.flux_blocks is not None:
        cfg = dict(cfg, num_layers=args.flux_blocks[0], num_single_layers=args.flux_blocks[1])
    return cfg, shape


def forwards(kind: str, cfg: dict, shape, device, dtype, args) -> dict:
    """Full forwards: every dense backend, then PISA (the model is freed on return)."""
    import pisa_attn.diffusers as pd

    t0 = time.perf_counter()
    model = build(kind, cfg, device, dtype)
    x = inputs(kind, cfg, shape, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"[{kind}] built {params / 1e9:.2f}B parameters in {time.perf_counter() - t0:.1f} s", flush=True)
    dense_ms, dense_out = dense_forward(model, x, device, args)
    best = min((n for n, t in dense_ms.items() if isinstance(t, float)), key=dense_ms.get)
    print(f"[{kind}] dense: {dense_ms}", flush=True)
    min_kv = 0 if args.tiny else pd.DEFAULT_MIN_KV_LEN
    pd.apply_pisa(
        model, density=args.density, dense_layers=0, dense_steps=0, mode=args.mode, block_size=args.block_size,
        min_kv_len=min_kv,
    )  # fmt: skip
    try:
        pisa_ms, pisa_out = time_ms(lambda: model(**x).sample, device, args.warmup, args.iters)
        counts = pd.stats(model)
        used = pd.pisa_state(model).config
    finally:
        pd.remove_pisa(model)
    rel = float((pisa_out.float() - dense_out.float()).norm() / dense_out.float().norm())
    print(f"[{kind}] PISA: {pisa_ms:.1f} ms, calls {counts}, rel. error vs dense {rel:.4f}", flush=True)
    return {
        "parameters": params,
        "covariance_aware": used.covariance_aware,
        "tile": list(used.tile),
        "dense_forward_ms": dense_ms,
        "dense_best": best,
        "pisa_forward_ms": pisa_ms,
        "speedup": dense_ms[best] / pisa_ms,
        "pisa_calls": counts,
        "rel_error_vs_dense": rel,
    }


def bench_model(kind: str, device, dtype, args) -> dict:
    cfg, shape = _model_config(kind, args)
    grid, text = token_counts(kind, cfg, shape)
    print(f"[{kind}] grid {grid}, text tokens {text}", flush=True)
    res = forwards(kind, cfg, shape, device, dtype, args)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    attn = attention_only(kind, grid, text, cfg["num_attention_heads"], cfg["attention_head_dim"], device, dtype, args)
    print(f"[{kind}] one attention call: {attn}", flush=True)
    return {
        "model": kind,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        "blocks": cfg["num_layers"] + cfg.get("num_single_layers", 0),
        "grid": list(grid),
        "text_tokens": text,
        "density": args.density,
        "mode": args.mode,
        "block_size": args.block_size,
        "target": TARGETS[kind],
        **res,
        "attention_call": attn,
    }


def environment(device) -> dict:
    import diffusers

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__, "device": str(device)}
    if device.type == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(0), triton=triton.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return env


def table(res: dict) -> str:
    head = (
        f"{'model':<6} {'tokens':>7} {'blocks':>6} {'dense backend':>14} {'dense ms':>9} {'PISA ms':>9} "
        f"{'speedup':>8} {'target':>7} {'attn dense':>10} {'attn PISA':>10} {'attn x':>7} {'rel err':>8}"
    )
    lines = [f"PISA density {res['density']} ({res['env'].get('gpu', res['env']['device'])}), one transformer forward", head, "-" * len(head)]
    for r in res["results"]:
        a = r["attention_call"]
        tokens = a["tokens"]
        ok = "ok" if r["speedup"] >= r["target"] else "MISS"
        lines.append(
            f"{r['model']:<6} {tokens:>7} {r['blocks']:>6} {r['dense_best']:>14} {r['dense_forward_ms'][r['dense_best']]:>9.1f} "
            f"{r['pisa_forward_ms']:>9.1f} {r['speedup']:>7.2f}x {r['target']:>5.1f}x{'' if res['tiny'] else ' ' + ok} "
            f"{a['dense_ms'][a['dense_best']]:>10.2f} {a['pisa_ms']:>10.2f} {a['speedup']:>6.2f}x {r['rel_error_vs_dense']:>8.4f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if not args.tiny and device.type != "cuda":
        print("bench_diffusers: no CUDA device; use --tiny for the CPU check", file=sys.stderr)
        return 2
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    res = {"tiny": args.tiny, "density": args.density, "env": environment(device), "results": []}
    for kind in args.models:
        res["results"].append(bench_model(kind, device, dtype, args))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_diffusers.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2)
    print(f"wrote {path}")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
