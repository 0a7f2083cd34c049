"""What ``apply_pisa(..., calibrate=True)`` adds to a dense warm-up step.

One warm-up step is one transformer forward with every managed attention layer dense (the schedule's
``warmup_step``). It is timed with and without the calibration observer (which samples ``--rows``
query rows per call and fits the first-order weight on them in float32, see
``pisa_attn.diffusers.calibrate``); the difference is the calibration's cost.

    python benchmarks/calibration_cost.py --tiny                 # CPU: a small Wan-like model, several lengths
    python benchmarks/calibration_cost.py                        # GPU: Wan2.1-1.3B (32,760 tokens), FLUX.1 (4,608)
    python benchmarks/calibration_cost.py --tiny --count-ops     # ops and host reads per calibrated layer call
    python benchmarks/calibration_cost.py --tune                 # GPU: sweep the fit kernel's launch settings first

``rN`` is the default calibration (``N`` rows, the selection rule chosen per layer: both rules
fitted from one pass of the rows; on CUDA with bf16 inputs each call is the Triton fit,
``pisa_attn.ops.triton.fit``, launched directly on a side stream), ``rNf`` the same with the
run's rule only (``choose_selection=False``), ``rNo`` (GPU) the default on the model's own stream
(``side_stream=False``). The minimum over the timed rounds is the steady state;
``first_ms`` is each setting's first forward (kernel compilation included). ``--count-ops``
counts, per calibrated call (``Calibrator.observe``), the aten ops dispatched, those that are not
views (what launches kernels on a GPU) and those that read a value back to the host (a
synchronisation on a GPU); on the CPU that is the reference arithmetic.

On a GPU the script also times one calibrated layer call's fit alone at each model's layer shape
(``fit_calls``): microseconds per call (host enqueue and end to end), launches, the device time per
kernel (``torch.profiler``: where the time goes) and the weights against the reference arithmetic
in float32 on the same values; ``gathered_*`` the same kernels on copies of the sampled rows and
their query blocks (``RowPlan.gather``: two concatenations per call) instead of q in place.

Random weights from the real configs (``pisa_attn.bench.model_configs``), bf16 on the GPU, float32
on the CPU. Writes ``calibration_cost.json`` to ``--out`` (default ``$OUT`` or ``./out``) and
prints a table last. Target: overhead <= 5% of a warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from pisa_attn.bench.model_configs import FLUX_DEV, WAN_1_3B

# CPU model: Wan-shaped, small enough for a few forwards per length on one core.
WAN_CPU = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=16, out_channels=16,
    text_dim=64, freq_dim=64, ffn_dim=1024, num_layers=2, rope_max_seq_len=256,
)  # fmt: skip
# latent grids (frames, height, width) -> tokens after the (1, 2, 2) patch
CPU_GRIDS = {1024: (1, 64, 64), 2048: (2, 64, 64), 4096: (4, 64, 64), 8192: (8, 64, 64)}


def build(kind: str, cfg: dict, device, dtype):
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
    return model.eval().requires_grad_(False)


def inputs(kind: str, cfg: dict, grid, text: int, device, dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    if kind == "wan":
        return dict(hidden_states=r(1, cfg["in_channels"], *grid), timestep=torch.tensor([500.0], device=device),
                    encoder_hidden_states=r(1, text, cfg["text_dim"]))
    h, w = grid
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    out = dict(hidden_states=r(1, h * w, cfg["in_channels"]), encoder_hidden_states=r(1, text, cfg["joint_attention_dim"]),
               pooled_projections=r(1, cfg["pooled_projection_dim"]),
               timestep=torch.tensor([0.5], device=device, dtype=dtype),
               img_ids=ids.reshape(h * w, 3).to(device), txt_ids=torch.zeros(text, 3, device=device))
    if cfg.get("guidance_embeds"):
        out["guidance"] = torch.tensor([3.5], device=device, dtype=dtype)
    return out


def forward_ms(model, x, device, host: list | None = None) -> float:
    """ms of one forward (the same timestep every time: every call is warm-up step 0); ``host``
    gets the ms until the forward returned (all its work enqueued)."""
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(**x)
        if host is not None:
            host.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def sync_count(model, x, device) -> int:
    """Host synchronisations torch reports during one forward (``set_sync_debug_mode("warn")``)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.inference_mode():
                model(**x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in seen)


def measure(kind: str, cfg: dict, grid, text: int, device, dtype, args) -> dict:
    """Without and with calibration (each ``--rows`` setting), interleaved round by round so that
    drift and other load hit every setting alike; the minimum over rounds is reported."""
    import pisa_attn.diffusers as pd

    model = build(kind, cfg, device, dtype)
    x = inputs(kind, cfg, grid, text, device, dtype)
    common = dict(density=args.density, dense_steps=1 << 30, dense_layers=0, min_kv_len=0)
    settings = {"base": None}
    for n in args.rows:
        settings.update({f"r{n}": pd.CalibrationConfig(rows=n),
                         f"r{n}f": pd.CalibrationConfig(rows=n, choose_selection=False)})
        if device.type == "cuda":
            settings[f"r{n}o"] = pd.CalibrationConfig(rows=n, side_stream=False)
    times = {name: [] for name in settings}
    host = {name: [] for name in settings}
    first = {}
    layers = 0
    for i in range(args.warmup + args.iters):
        for name, calibration in settings.items():
            pd.apply_pisa(model, calibrate=calibration or False, **common)
            enq: list = []
            ms = forward_ms(model, x, device, enq)
            first.setdefault(name, ms)
            if i >= args.warmup:
                times[name].append(ms)
                host[name].append(enq[0])
            if calibration is not None:
                layers = len(pd.pisa_state(model).calibrator.fits)
    syncs = {}
    if device.type == "cuda":
        for name, calibration in settings.items():
            pd.apply_pisa(model, calibrate=calibration or False, **common)
            syncs[name] = sync_count(model, x, device)
    pd.remove_pisa(model)
    from pisa_attn.diffusers.calibrate import GRAPHS

    GRAPHS.clear()  # the next model's shapes start from nothing
    base = min(times["base"])
    row = {"model": kind, "grid": list(grid), "text": text, "step_ms": base, "layers": layers,
           "times_ms": times, "first_ms": first, "host_ms": {n: min(t) for n, t in host.items() if t},
           "syncs_per_forward": syncs}
    if device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for n in args.rows:
        for tag in (t for t in (f"r{n}", f"r{n}f", f"r{n}o") if t in times):
            row[f"calibrated_ms_{tag}"] = min(times[tag])
            row[f"overhead_{tag}"] = row[f"calibrated_ms_{tag}"] / base - 1
    row["tokens"] = int(torch.tensor(grid).prod()) // (4 if kind == "wan" else 1) + (text if kind == "flux" else 0)
    row["heads"], row["head_dim"] = model.config.num_attention_heads, model.config.attention_head_dim
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


VIEW_OPS = ("view", "permute", "unsqueeze", "squeeze", "alias", "slice", "select", "expand", "transpose",
            "t.default", "narrow", "unbind", "split", "as_strided", "reshape", "detach", "_unsafe_view")
HOST_READS = ("_local_scalar_dense", "nonzero", "is_nonzero", "item", "equal")


def count_ops(kind: str, cfg: dict, grid, text: int, device, dtype, args) -> dict:
    """Ops per calibrated layer call of one warm-up forward, with and without the rule choice."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    import pisa_attn.diffusers as pd
    from pisa_attn.diffusers.calibrate import Calibrator

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            self.ops[str(func)] += 1
            return func(*a, **(kw or {}))

    model = build(kind, cfg, device, dtype)
    x = inputs(kind, cfg, grid, text, device, dtype)
    out = {}
    observe = Calibrator.observe
    for tag, choose in (("choose", True), ("fixed", False)):
        seen = []

        def counted(self, call, _seen=seen):
            with Count() as c:
                observe(self, call)
            _seen.append(c.ops)

        Calibrator.observe = counted
        try:
            pd.apply_pisa(model, calibrate=pd.CalibrationConfig(rows=args.rows[0], choose_selection=choose),
                          density=args.density, dense_steps=1 << 30, dense_layers=0, min_kv_len=0)
            forward_ms(model, x, device)
            pd.remove_pisa(model)
        finally:
            Calibrator.observe = observe
        calls = [c for c in seen if c]
        total = [sum(c.values()) for c in calls]
        kernels = [sum(v for k, v in c.items() if not any(f"aten.{o}" in k for o in VIEW_OPS)) for c in calls]
        reads = [sum(v for k, v in c.items() if any(f"aten.{o}." in k for o in HOST_READS)) for c in calls]
        out[tag] = {"calls": len(calls), "ops_per_call": max(total, default=0),
                    "non_view_ops_per_call": max(kernels, default=0), "host_reads_per_call": max(reads, default=0)}
    return {"model": kind, "grid": list(grid), "rows": args.rows[0], **out}


def _fit_case(kind: str, device, dtype, args):
    """(q, k, v, plan, settings) of one calibrated layer call at ``kind``'s layer shape."""
    import random

    from pisa_attn import calibration as cal
    from pisa_attn.diffusers.calibrate import sample_rows

    h, lq, d, text = FIT_SHAPES[kind]
    lk = lq + text
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, lk, d, generator=g, device=device, dtype=dtype) for _ in range(3))
    keep = torch.zeros(-(-lk // 64), dtype=torch.bool, device=device)
    keep[: text // 64] = True  # the text blocks, always exact
    plan = cal.row_plan(lk, 64, sample_rows(random.Random(0), text, lk, 64, args.rows[0]), (text, lk))
    kw = dict(density=args.density, rules=(False, True), mode="hybrid", scale=d**-0.5, block_size=64,
              keep_blocks=keep if text else None)
    return q, k, v, plan, kw


FIT_SHAPES = {"wan": (WAN_1_3B["num_attention_heads"], 32760, WAN_1_3B["attention_head_dim"], 0),
              "flux": (FLUX_DEV["num_attention_heads"], 4096, FLUX_DEV["attention_head_dim"], 512)}
"""(heads, image tokens, head dim, text tokens) of one calibrated layer call: FLUX 1024² is 4096 image
and 512 text tokens (4608 keys)."""


def _kernel_times(fn) -> dict[str, float]:
    """Device microseconds per kernel name of one call of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        t = getattr(e, "device_time", 0.0) or 0.0
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and t > 0:
            kernels[e.name[:60]] = kernels.get(e.name[:60], 0.0) + t
    return kernels


def tune_fit(device, dtype, args) -> tuple[dict, list]:
    """The rows kernel's launch settings (``pisa_attn.ops.triton.fit.FIT_TUNING``: waves of key
    chunks, warps) that give the least device time of the rows and merge kernels summed over the
    Wan and FLUX layer shapes (profiler, after a compiling call). Sets the winner for the rest
    of the run and returns ``(winner, [(settings, {shape: us})...])``."""
    from pisa_attn import calibration as cal
    from pisa_attn.ops.triton import fit as tfit

    cases = {kind: _fit_case(kind, device, dtype, args) for kind in FIT_SHAPES}
    default = dict(tfit.FIT_TUNING)
    sweep = []
    for waves in (1, 2, 4):
        for warps in (4, 8):
            tfit.FIT_TUNING.update(waves=waves, warps=warps)
            graphs = cal.FitGraphs()
            us = {}
            for kind, (q, k, v, plan, kw) in cases.items():
                graphs.sums(q, k, v, plan, **kw)
                t = _kernel_times(lambda: graphs.sums(q, k, v, plan, **kw))  # noqa: B023
                us[kind] = round(sum(x for n, x in t.items() if n.startswith(("_rows_kernel", "_merge_kernel"))), 1)
            sweep.append(({"waves": waves, "warps": warps}, us))
            print(f"fit tuning waves={waves} warps={warps}: rows+merge {us} us", flush=True)
    best = min(sweep, key=lambda x: sum(x[1].values()))[0]
    tfit.FIT_TUNING.clear()
    tfit.FIT_TUNING.update({**default, **best})
    return dict(tfit.FIT_TUNING), sweep


def sdpa_cudnn_us(q, k, v, reps: int = 20) -> float:
    """The layer's dense attention (torch SDPA, cuDNN backend) on the same q/k/v: median µs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        f(q, k, v)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f(q, k, v)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    return round(sorted(times)[len(times) // 2], 1)


def fit_calls(device, dtype, args) -> list[dict]:
    """One calibrated layer call's fit alone (``FitGraphs.sums``, the layer's own key/value shapes,
    both rules): microseconds per call (host enqueue, end to end), CUDA launches per call, device
    time per kernel (profiler) and the clamped weights' largest difference to the reference
    arithmetic in float32 on the same values."""
    from pisa_attn import calibration as cal

    out = []
    for kind in FIT_SHAPES:
        q, k, v, plan, kw = _fit_case(kind, device, dtype, args)
        h, d = q.shape[1], q.shape[3]
        graphs = cal.FitGraphs()
        row = {"model": kind, "heads": h, "tokens": k.shape[2], "head_dim": d, "rows": len(plan.pos),
               "kernel_fit": cal.fast_fit_supported(q, "hybrid", 64)}
        sums = graphs.sums(q, k, v, plan, **kw).clone()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        host, total = [], []
        for _ in range(args.iters * 4):
            t0 = time.perf_counter()
            graphs.sums(q, k, v, plan, **kw)
            t1 = time.perf_counter()
            sync()
            host.append((t1 - t0) * 1e6)
            total.append((time.perf_counter() - t0) * 1e6)
        row["host_us"], row["us"] = min(host), min(total)
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                graphs.sums(q, k, v, plan, **kw)
                sync()
            names = [e.name for e in prof.events()]
            row["launches"] = sum(n in ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaLaunchKernelExC",
                                        "cuLaunchKernel", "cuLaunchKernelEx") for n in names)
            kernels = _kernel_times(lambda: graphs.sums(q, k, v, plan, **kw))  # noqa: B023
            row["device_us"] = round(sum(kernels.values()), 1)
            row["kernels_us"] = sorted(([n, round(t, 1)] for n, t in kernels.items()), key=lambda x: -x[1])
            row["sdpa_cudnn_us"] = sdpa_cudnn_us(q, k, v)
            # the same kernels on gathered copies of the rows and their blocks (index tensors made once)
            from pisa_attn.ops.triton import fit as tfit

            nb, r = len(plan.spans), len(plan.pos)
            idx = dict(which=plan.which(device).to(torch.int32), rows=torch.arange(r, device=device, dtype=torch.int32),
                       starts=torch.arange(nb, device=device, dtype=torch.int32) * 64)
            fkw = {n: kw[n] for n in ("density", "rules", "scale", "block_size", "keep_blocks")}

            def gathered():
                qb, qr = plan.gather(q)
                return tfit.fit_sums(qr, idx["rows"], idx["starts"], idx["which"], k, v, q_blocks=qb, **fkw)

            g_sums = gathered()
            kernels = _kernel_times(gathered)
            row["gathered_device_us"] = round(sum(kernels.values()), 1)
            row["gathered_kernels_us"] = sorted(([n, round(t, 1)] for n, t in kernels.items()), key=lambda x: -x[1])
            row["gathered_sums_equal"] = bool(torch.equal(g_sums, sums))
        # the reference arithmetic (float32 inputs take it) on the same values
        ref = cal._fit_sums(*plan.gather(q.float()), plan.which(device), k.float(), v.float(),
                            kw["keep_blocks"], **{n: kw[n] for n in ("density", "rules", "mode", "scale", "block_size")})
        n = len(plan.pos)
        got, want = (cal.row_fits(x, (False, True), rows=n, elems=n * d) for x in (sums, ref))
        row["alpha_max_abs_diff"] = max(float((got[r].stats.alpha("head", bounds=cal.FIT_BOUNDS)
                                               - want[r].stats.alpha("head", bounds=cal.FIT_BOUNDS)).abs().max())
                                        for r in (False, True))
        row["sums_max_rel_diff"] = float(((sums - ref).abs() / ref.abs().clamp_min(1e-30)).max())
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU: a small Wan-like model at --lengths")
    p.add_argument("--lengths", default="1024,2048,4096", help="CPU token counts (of 1024, 2048, 4096, 8192)")
    p.add_argument("--models", default="wan,flux", help="GPU models: wan (1.3B, 32,760 tokens), flux (dev, 4,608)")
    p.add_argument("--flux-blocks", default="19,38", help="double,single blocks of the FLUX model")
    p.add_argument("--rows", default="32", help="query rows sampled per call (comma list)")
    p.add_argument("--density", type=float, default=0.15)
    p.add_argument("--iters", type=int, default=5, help="timed rounds (minimum reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--out", default=os.environ.get("OUT", "./out"))
    p.add_argument("--count-ops", action="store_true", help="count ops and host reads per calibrated call instead")
    p.add_argument("--no-fit-calls", action="store_true", help="skip the one-call fit timing (GPU)")
    p.add_argument("--tune", action="store_true",
                   help="GPU: first sweep the rows kernel's launch settings and run with the fastest")
    args = p.parse_args(argv)
    args.rows = [int(x) for x in args.rows.split(",")]
    if args.count_ops:
        torch.set_num_threads(args.threads)
        n = int(args.lengths.split(",")[0])
        res = count_ops("wan", WAN_CPU, CPU_GRIDS[n], 16, torch.device("cpu"), torch.float32, args)
        print(json.dumps(res, indent=1))
        return 0
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.set_num_threads(args.threads)
    rows = []
    calls, tuning, sweep = [], None, []
    if cuda and args.tune:
        tuning, sweep = tune_fit(device, dtype, args)
    if cuda:
        from pisa_attn.ops.triton import fit as tfit

        tuning = dict(tfit.FIT_TUNING)
    if cuda and not args.no_fit_calls:
        calls = fit_calls(device, dtype, args)
    if cuda:
        d, s = (int(x) for x in args.flux_blocks.split(","))
        shapes = {"wan": (WAN_1_3B, (21, 60, 104)), "flux": ({**FLUX_DEV, "num_layers": d, "num_single_layers": s},
                                                           (64, 64))}
        for kind in args.models.split(","):
            rows.append(measure(kind, *shapes[kind][:1], shapes[kind][1], 512, device, dtype, args))
            print(json.dumps(rows[-1]), flush=True)
    else:
        for n in (int(x) for x in args.lengths.split(",")):
            rows.append(measure("wan", WAN_CPU, CPU_GRIDS[n], 16, device, dtype, args))
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    import triton

    env = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
           "torch": torch.__version__, "triton": triton.__version__, "threads": torch.get_num_threads(),
           "fit_tuning": tuning, "fit_tuning_sweep_us": sweep}
    with open(os.path.join(args.out, "calibration_cost.json"), "w") as f:
        json.dump({"environment": env, "density": args.density, "rows": rows, "fit_calls": calls},
                  f, indent=1)
    print(f"\n=== calibration cost per dense warm-up step ({env['device']}) ===")
    tags = [t for n in args.rows for t in (f"r{n}", f"r{n}f", f"r{n}o") if rows and f"calibrated_ms_{t}" in rows[0]]
    head = f"{'model':6s} {'tokens':>7s} {'H x D':>8s} {'step ms':>9s} " + " ".join(
        f"{t + ' ms':>9s} {'+%':>6s}" for t in tags)
    print(head)
    for r in rows:
        cells = " ".join(f"{r[f'calibrated_ms_{t}']:9.1f} {100 * r[f'overhead_{t}']:5.1f}%" for t in tags)
        print(f"{r['model']:6s} {r['tokens']:7d} {r['heads']:>3d}x{r['head_dim']:<4d} {r['step_ms']:9.1f} {cells}")
        print(f"       host enqueue ms {r.get('host_ms')}; synchronisations per forward {r.get('syncs_per_forward')}")
    for c in calls:
        print(f"one fit ({c['model']}, {c['tokens']} keys, {c['rows']} rows): {c['us']:.0f} us end to end, host "
              f"{c['host_us']:.0f} us, {c.get('launches', '?')} launches, device {c.get('device_us', 0):.0f} us; "
              f"clamped weights vs reference max |diff| {c['alpha_max_abs_diff']:.1e}; the layer's dense attention "
              f"(cuDNN SDPA) {c.get('sdpa_cudnn_us', 0):.0f} us; gathered rows device "
              f"{c.get('gathered_device_us', 0):.0f} us (sums equal: {c.get('gathered_sums_equal')})")
        for name, t in c.get("kernels_us", [])[:8]:
            print(f"    {t:8.1f} us  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
