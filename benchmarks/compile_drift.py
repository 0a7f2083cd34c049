"""Does whole-model ``torch.compile`` move PISA's output more than it moves dense attention's?

One Wan2.1-1.3B-shaped transformer forward (real config, random weights, bf16, 480p 81 frames:
32,760 video tokens, PISA at ``--density`` with no warm-up) run four ways from the same weights and
inputs: eager dense, eager PISA, compiled dense, compiled PISA (``torch.compile(transformer,
fullgraph=True)``, per ``--backends``: ``inductor`` changes the numerics of everything around
attention (fused norms, RoPE, casts), ``aot_eager`` traces the same graph but runs the same kernels
as eager). Prints the rel-L1 (``mean|a - b| / mean|b|``) of every pair that tells the causes apart:

* ``inductor dense`` vs ``eager dense``: what compiling alone moves (bf16 rounding in other places);
* ``inductor pisa`` vs ``inductor dense``: PISA's own error under compile, to compare with
  ``eager pisa`` vs ``eager dense``; equal means compiled PISA is as accurate as eager PISA;
* ``aot_eager pisa`` vs ``eager pisa``: the integration under compile with eager numerics, which
  must be ~0 (same selection, same kernels).

    python benchmarks/compile_drift.py                  # GPU (about 5 minutes on an H100)
    python benchmarks/compile_drift.py --tiny           # CPU check with a tiny model

Writes ``compile_drift.json`` to ``--out`` (default ``$OUT`` or ``./out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_diffusers import WAN_SHAPE, WAN_SHAPE_TINY, build, inputs  # noqa: E402

from pisa_attn.bench.model_configs import WAN_1_3B, WAN_TINY  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny Wan on the CPU (a check that the script runs)")
    p.add_argument("--density", type=float, default=0.125)
    p.add_argument("--backends", default=None, help="torch.compile backends (default inductor,aot_eager; "
                   "aot_eager with --tiny)")  # fmt: skip
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 (float32 with --tiny)")
    p.add_argument("--out", default=os.environ.get("OUT", "./out"))
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"
    if args.backends is None:
        args.backends = "aot_eager" if args.tiny else "inductor,aot_eager"
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    return args


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().mean() / b.abs().mean())


def main(argv=None) -> int:
    args = parse_args(argv)
    import pisa_attn.diffusers as pd

    device = "cpu" if args.tiny else "cuda"
    dtype = getattr(torch, args.dtype)
    cfg, shape = (WAN_TINY, WAN_SHAPE_TINY) if args.tiny else (WAN_1_3B, WAN_SHAPE)
    bs = 16 if args.tiny else 64
    model = build("wan", cfg, device, dtype)
    x = inputs("wan", cfg, shape, device, dtype)
    settings = dict(density=args.density, block_size=bs, min_kv_len=0, dense_layers=0, dense_steps=0)

    def forward(fn) -> torch.Tensor:
        with torch.no_grad():
            out = fn(**x).sample
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    outs, seconds, stats = {}, {}, {}

    def record(name: str, fn, managed: bool) -> None:
        t0 = time.perf_counter()
        first = forward(fn)  # compiles when fn is compiled
        seconds[name] = time.perf_counter() - t0
        outs[name] = forward(fn)
        if not torch.equal(first, outs[name]):
            print(f"note: {name}: two forwards differ by {rel_l1(first, outs[name]):.2e}", file=sys.stderr)
        if managed:
            stats[name] = pd.stats(model)
        print(f"{name}: done in {seconds[name]:.1f} s", file=sys.stderr, flush=True)

    record("eager dense", model, False)
    pd.apply_pisa(model, **settings)
    record("eager pisa", model, True)
    pd.remove_pisa(model)
    for backend in args.backends:
        torch._dynamo.reset()
        record(f"{backend} dense", torch.compile(model, backend=backend, fullgraph=True), False)
        torch._dynamo.reset()
        pd.apply_pisa(model, **settings)
        record(f"{backend} pisa", torch.compile(model, backend=backend, fullgraph=True), True)
        pd.remove_pisa(model)
    torch._dynamo.reset()

    pairs = [("eager pisa", "eager dense")]
    for b in args.backends:
        pairs += [(f"{b} dense", "eager dense"), (f"{b} pisa", f"{b} dense"), (f"{b} pisa", "eager dense"),
                  (f"{b} pisa", "eager pisa")]  # fmt: skip
    rows = [{"a": a, "b": b, "rel_l1": rel_l1(outs[a], outs[b])} for a, b in pairs]
    result = {
        "model": "wan-tiny" if args.tiny else "wan2.1-1.3B-shaped 480p (32760 tokens)",
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": settings,
        "first_forward_s": seconds,
        "pisa_calls": stats,
        "rel_l1": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "compile_drift.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{result['model']}, {result['dtype']}, {result['device']}, density {args.density} (wrote {path})")
    print(f"{'a':>18s}  vs  {'b':<18s} rel-L1")
    for r in rows:
        print(f"{r['a']:>18s}  vs  {r['b']:<18s} {r['rel_l1']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
