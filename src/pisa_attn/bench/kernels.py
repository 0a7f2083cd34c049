"""``pisa-attn bench``: kernel latency of PISA against dense and block-sparse attention (CUDA).

For every ``B-H-D`` config, sequence length and density it times, on the same inputs (``--data
random``: Gaussian q/k/v, whose block selections are nearly independent between query blocks;
``--data dit``: the DiT-like generator of :mod:`pisa_attn.data` on a ``(L/1024, 32, 32)`` grid,
whose neighbouring query blocks share most of their exact blocks, as in real DiTs):
cuDNN SDPA, flash SDPA, FlexAttention keep-or-drop over the SAME blocks PISA selects (64x64,
compiled), PISA ``drop`` and PISA ``hybrid`` (the whole call, prepare + selection + attention, as
``run(plan, q, k, v, out=)`` on a plan that owns its workspace), the
phase breakdown of the hybrid call, and the peak extra memory of one PISA call beyond q, k, v, o.
Writes JSON (and optionally a PNG plot and a markdown table).

    pisa-attn bench --configs 2-16-128 --lengths 4096,32768 --densities 0.125
    python -m pisa_attn.bench.kernels --out results.json --plot speedup.png
"""

from __future__ import annotations

import argparse
import datetime
import time
import json
import os
import sys
from dataclasses import dataclass

import torch

from .. import spec
from ..settings import PisaSettings
from . import argtypes as at

DEFAULT_CONFIGS = "2-16-128,1-40-128,2-24-64"
DEFAULT_LENGTHS = "4096,8192,16384,32768,65536"
DEFAULT_DENSITIES = "0.05,0.125,0.25,0.5"
COLUMNS = ("sdpa_cudnn", "sdpa_flash", "flex", "pisa_drop", "pisa_hybrid")


@dataclass(frozen=True)
class Config:
    batch: int
    heads: int
    head_dim: int

    @classmethod
    def parse(cls, text: str) -> "Config":
        try:
            b, h, d = (int(x) for x in text.split("-"))
        except ValueError:
            raise ValueError(f"config must look like B-H-D (e.g. 2-16-128), got {text!r}") from None
        if min(b, h, d) < 1:
            raise ValueError(f"config values must be positive, got {text!r}")
        return cls(b, h, d)

    def __str__(self) -> str:
        return f"{self.batch}-{self.heads}-{self.head_dim}"


def parse_list(text: str, kind, name: str) -> list:
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be a comma-separated list, got {text!r}") from None
    if not out:
        raise ValueError(f"--{name} is empty")
    return out


def ideal_ms(dense_ms: float, density: float, block_size: int = 64) -> float:
    """Floor of a PISA call relative to dense attention: exact part + one centroid per key block."""
    return dense_ms * (density + 1.0 / block_size)


# ----------------------------------------------------------------------------------------------
# timing


MIN_SAMPLES = 10


def bench_ms(fn, rep_ms: float = 60.0, min_samples: int = MIN_SAMPLES) -> float:
    """Median device time of ``fn()`` in ms (events; L2 flushed before each run by do_bench) over
    at least about ``min_samples`` runs: do_bench times ``rep / estimate`` runs, so a fixed
    ``rep`` gave one sample of a call slower than it (dense attention at 64K), whose median is
    then one noisy reading; the budget grows with one timed call's length instead."""
    from triton.testing import do_bench

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = start.elapsed_time(end)
    return float(do_bench(fn, warmup=max(15.0, 2 * est), rep=max(rep_ms, (min_samples + 2) * est),
                          return_mode="median"))


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return run


_FLEX = {}


def _flex_fn(dynamic: bool):
    if dynamic not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[dynamic]


def flex_block_mask(idx: torch.Tensor, cnt: torch.Tensor, lq: int, lk: int, block_size: int):
    """FlexAttention BlockMask with exactly PISA's exact blocks (keep-or-drop)."""
    from torch.nn.attention.flex_attention import BlockMask

    nk = -(-lk // block_size)
    full = torch.zeros(*idx.shape[:-1], nk, dtype=torch.int32, device=idx.device)
    full[..., : idx.shape[-1]] = idx
    return BlockMask.from_kv_blocks(cnt.contiguous(), full, BLOCK_SIZE=block_size, seq_lengths=(lq, lk),
                                    compute_q_blocks=False)


# ----------------------------------------------------------------------------------------------
# one case


def _inputs(cfg: Config, length: int, dtype, layout: str, seed: int = 0, data: str = "random"):
    if data == "dit":
        from pisa_attn import data as dit

        if length % 1024:
            raise ValueError(f"--data dit needs lengths that are multiples of 1024, got {length}")
        d = dit.dit_qkv((length // 1024, 32, 32), heads=cfg.heads, head_dim=cfg.head_dim, batch=cfg.batch, seed=seed,
                        dtype=dtype, device="cuda", layout=layout)
        return [x if layout == "bhsd" else x.transpose(1, 2) for x in (d.q, d.k, d.v)]
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (cfg.batch, length, cfg.heads, cfg.head_dim) if layout == "bshd" else (cfg.batch, cfg.heads, length, cfg.head_dim)
    xs = [torch.randn(shape, generator=g, device="cuda", dtype=dtype) for _ in range(3)]
    return [x.transpose(1, 2) if layout == "bshd" else x for x in xs]  # [B, H, L, D] views


def _plan(q, k, density, mode, block_size=64, backend="auto", query_block=None, precision="input"):
    from pisa_attn.attention import make_plan

    return make_plan(q, k, density, block_size, mode, False, None, backend, query_block, precision)


def _pisa_call(q, k, v, plan):
    """One call on a workspace-less plan: every buffer allocated by the call (what its peak
    memory beyond q, k, v and out is measured on)."""
    from pisa_attn.attention import get_backend

    forward = get_backend(plan.backend).forward
    return lambda: forward(q, k, v, plan)


def _timed_call(q, k, v, density, mode, backend, query_block=None, precision="input"):
    """``(plan, call)``: the lean call a user times, ``run(plan, q, k, v, out=)`` on a plan that
    owns its workspace (eager: no allocation, launches replayed; capturable in a CUDA graph)."""
    from pisa_attn import plan, run

    p = plan(q, k, _plan(q, k, density, mode, backend=backend, query_block=query_block, precision=precision).settings)
    if p.backend == "reference":  # auto's fallback: its time is PyTorch's, not a PISA kernel's latency
        raise _not_timed(backend, q, mode, p.block_size, "this case")
    out = torch.empty_like(q)
    return p, lambda: run(p, q, k, v, out=out)


def _not_timed(backend: str, q, mode: str, block_size: int, what: str) -> ValueError:
    from pisa_attn.attention import _reason

    return ValueError(f"{what}: the kernels do not run its calls (backend {backend!r} falls back to the PyTorch "
                      f"reference, which is not timed: {_reason('triton', q, mode, block_size)})")


def check_kernels_run(configs, dtype, backend: str, precision: str, query_block: int | None,
                      device="cuda") -> None:
    """ValueError naming the config, before anything is timed, where PISA's kernels would not run
    its calls: a head dim the forced backend or precision does not take, or ``auto`` falling back
    to the PyTorch reference (whose time is not a kernel's)."""
    from pisa_attn.attention import backend_for

    for cfg in sorted(configs, key=str):
        q = torch.empty(1, 1, 64, cfg.head_dim, dtype=dtype, device=device)  # a stand-in of the calls' queries
        for mode in ("hybrid", "drop"):
            s = PisaSettings(block_size=64, mode=mode, backend=backend, precision=precision, query_block=query_block)
            try:
                name = backend_for(s, q, warn=False)  # the error below says it
            except ValueError as e:
                raise ValueError(f"config {cfg}: {e}") from None
            if name == "reference":
                raise _not_timed(backend, q, mode, 64, f"config {cfg}")


def pair_overlap(sel, n_kv_blocks: int) -> float:
    """Mean share of a query block's exact blocks that its pair neighbour also computes exactly
    (what the Hopper kernel reads once for both)."""
    m = sel.to_mask(n_kv_blocks)
    nq = m.shape[2] // 2 * 2
    a, b = m[:, :, 0:nq:2], m[:, :, 1:nq:2]
    return ((a & b).sum(-1).float() / a.sum(-1).clamp_min(1)).mean().item()


def peak_extra_bytes(fn, out_bytes: int) -> int:
    """Peak device memory one call allocates beyond its output (run once to warm up first)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res
    return max(0, peak - out_bytes)


def warm_gpu(seconds: float = 1.0) -> None:
    """Busy the GPU for a moment before the first timing: the first case of a fresh process read
    2-4x slow on the H100 (clocks and host caches still cold), whatever it was."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def capture_graph(fn, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """``fn``'s launches captured in a CUDA graph, after ``warmup`` calls on a side stream (kernels
    compiled and autotuned, caches filled: nothing is allocated or compiled during capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn, rep_ms: float) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: the GPU time without Python/launch
    overhead (what a captured or ``torch.compile(mode="reduce-overhead")`` model pays)."""
    fn()  # compile + autotune before capture
    return bench_ms(capture_graph(fn).replay, rep_ms)


def bench_dense(cfg: Config, length: int, dtype, layout: str, rep_ms: float, graphs: bool = False,
                data: str = "random") -> dict:
    from torch.nn.attention import SDPBackend

    q, k, v = _inputs(cfg, length, dtype, layout, data=data)
    row = {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        fn = _sdpa(backend)
        try:
            row[name] = bench_ms(lambda: fn(q, k, v), rep_ms)
        except RuntimeError as e:  # backend unavailable for this shape / build
            row[name] = None
            row[name + "_error"] = str(e).splitlines()[0][:200]
            continue
        if graphs and name == "sdpa_cudnn":
            try:  # its own try: a capture that fails must not discard the eager time above
                row["sdpa_cudnn_graph"] = graph_ms(lambda: fn(q, k, v), rep_ms)
            except RuntimeError as e:
                row["sdpa_cudnn_graph"] = None
                row["sdpa_cudnn_graph_error"] = str(e).splitlines()[0][:200]
    return row


def bench_case(cfg: Config, length: int, density: float, dtype, layout: str, rep_ms: float,
               with_flex: bool = True, flex_dynamic: bool = False, phases: bool = True, graphs: bool = False,
               backend: str = "auto", data: str = "random", query_block: int | None = None,
               precision: str = "input") -> dict:
    from pisa_attn.attention import get_backend

    q, k, v = _inputs(cfg, length, dtype, layout, data=data)
    row: dict = {}
    if query_block:  # the same call with selection per query_block rows (shared by 2 or 4 blocks)
        for mode in ("drop", "hybrid"):
            _, fn = _timed_call(q, k, v, density, mode, backend, query_block, precision)
            fn()
            row[f"pisa_{mode}_qb{query_block}"] = bench_ms(fn, rep_ms)
    for mode in ("drop", "hybrid"):
        plan, fn = _timed_call(q, k, v, density, mode, backend, precision=precision)
        row["backend"] = plan.backend
        fn()  # compile + autotune outside the timed region
        row[f"pisa_{mode}"] = bench_ms(fn, rep_ms)
        if graphs:
            row[f"pisa_{mode}_graph"] = graph_ms(fn, rep_ms)
    plan = _plan(q, k, density, "hybrid", backend=backend, precision=precision)
    be = get_backend(plan.backend)
    out_bytes = q.numel() * q.element_size()
    qkvo = 4 * out_bytes
    row["extra_bytes"] = peak_extra_bytes(_pisa_call(q, k, v, plan), out_bytes)
    row["extra_frac"] = row["extra_bytes"] / qkvo
    row["n_select"] = plan.n_select
    stats = be.prepare(q, k, v, 64)
    width = spec.selection_width(plan.n_kv_blocks, plan.n_select)

    def select():
        return be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=width, scale=plan.scale)

    sel = select()
    row["pair_overlap"] = pair_overlap(sel, plan.n_kv_blocks)
    if phases:
        row["t_prepare"] = bench_ms(lambda: be.prepare(q, k, v, 64), rep_ms)
        row["t_select"] = bench_ms(select, rep_ms)
        row["t_attention"] = bench_ms(lambda: be.attend(q, k, v, stats, sel, mode="hybrid", scale=plan.scale,
                                                        block_size=64, n_select=plan.n_select), rep_ms)
    if with_flex:
        try:
            bm = flex_block_mask(sel.idx, sel.cnt, length, length, 64)
            flex = _flex_fn(flex_dynamic)
            opts = {"BLOCK_M": 64, "BLOCK_N": 64}
            flex(q, k, v, block_mask=bm, kernel_options=opts)
            row["flex"] = bench_ms(lambda: flex(q, k, v, block_mask=bm, kernel_options=opts), rep_ms)
        except Exception as e:  # noqa: BLE001 - a baseline failing must not lose the PISA numbers
            row["flex"] = None
            row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return row


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def grid_cases(configs, lengths, densities) -> list[tuple[Config, int, float]]:
    return [(c, n, d) for c in configs for n in lengths for d in densities]


def parse_cases(text: str) -> list[tuple[Config, int, float]]:
    """``B-H-D:L:density`` items, comma-separated (an explicit list instead of the full grid)."""
    out = []
    for item in parse_list(text, str, "cases"):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"--cases items look like 2-16-128:32768:0.125, got {item!r}")
        try:
            out.append((Config.parse(parts[0]), int(parts[1]), float(parts[2])))
        except ValueError:
            raise ValueError(f"--cases items look like 2-16-128:32768:0.125, got {item!r}") from None
    return out


def run_bench(cases, dtype=torch.bfloat16, layout="bhsd", rep_ms=60.0, with_flex=True, flex_dynamic=False,
              flex_lengths=None, log=print, on_row=None, graphs: bool = False, backend: str = "auto",
              data: str = "random", query_block: int | None = None, precision: str = "input") -> dict:
    """Time every (config, length, density) case; dense baselines are timed once per (config, length)."""
    result = {"meta": {**environment(), "dtype": str(dtype).removeprefix("torch."), "layout": layout,
                       "block_size": 64, "timing": f"triton.testing.do_bench median of >= {MIN_SAMPLES} runs, L2 flushed, ms",
                       "backend": backend, "data": data, "query_block": query_block, "precision": precision},
              "rows": []}
    dense_cache: dict = {}
    warm_gpu()
    for cfg, length, density in cases:
        if (cfg, length) not in dense_cache:
            dense_cache[(cfg, length)] = bench_dense(cfg, length, dtype, layout, rep_ms, graphs, data)
        dense = dense_cache[(cfg, length)]
        row = {"config": str(cfg), "length": length, "density": density, **dense}
        flex = with_flex and (flex_lengths is None or length in flex_lengths)
        try:
            row.update(bench_case(cfg, length, density, dtype, layout, rep_ms, flex, flex_dynamic, graphs=graphs,
                                  backend=backend, data=data, query_block=query_block, precision=precision))
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - record it and keep the other cases
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        base = "sdpa_cudnn" if row.get("sdpa_cudnn") else "sdpa_flash"
        ref = row.get(base)
        if ref:
            row["speedup_baseline"] = base  # flash SDPA only where cuDNN failed for this case
            for col in ("flex", "pisa_drop", "pisa_hybrid", f"pisa_drop_qb{query_block}", f"pisa_hybrid_qb{query_block}"):
                if row.get(col):
                    row[f"speedup_{col}"] = ref / row[col]
            row["ideal_ms"] = ideal_ms(ref, density)
        if row.get("sdpa_cudnn_graph") and row.get("pisa_hybrid_graph"):  # launch overhead removed on both sides
            row["speedup_pisa_hybrid_graph"] = row["sdpa_cudnn_graph"] / row["pisa_hybrid_graph"]
            if row.get("pisa_drop_graph"):
                row["speedup_pisa_drop_graph"] = row["sdpa_cudnn_graph"] / row["pisa_drop_graph"]
        result["rows"].append(row)
        log(format_row(row))
        if on_row is not None:
            on_row(result)
    result["autotune"] = autotune_choices()
    return result


def autotune_choices() -> dict:
    """Configs the attention autotuner picked and its timings per key (for the notes)."""
    from pisa_attn.ops.triton import attention as attn

    tuned = attn._attn_tuned
    out = {}
    for key, cfg in getattr(tuned, "cache", {}).items():
        out[str(key)] = {"best": str(cfg)}
    for cfg, t in (getattr(tuned, "configs_timings", None) or {}).items():
        out.setdefault("last_timings", {})[str(cfg)] = t if isinstance(t, (int, float)) else list(t)
    return out


# ----------------------------------------------------------------------------------------------
# reporting


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def _x(x):
    return "-" if x is None else f"{x:.2f}x"


def format_row(row: dict) -> str:
    cols = " ".join(f"{c}={_f(row.get(c))}" for c in COLUMNS)
    ph = f"prep={_f(row.get('t_prepare'))} sel={_f(row.get('t_select'))} attn={_f(row.get('t_attention'))}"
    return (f"{row.get('backend', '?'):>6s} {row['config']:>9s} L={row['length']:6d} d={row['density']:.3f} "
            f"ov={_f(row.get('pair_overlap'), 2)} | {cols} | "
            f"x{_f(row.get('speedup_pisa_hybrid'), 2)} hybrid, x{_f(row.get('speedup_pisa_drop'), 2)} drop | "
            f"{ph} | extra={_f(100 * row['extra_frac'] if 'extra_frac' in row else None, 2)}%"
            + "".join(f" | {c}={_f(row[c])} x{_f(row.get('speedup_' + c), 2)}" for c in row
                      if c.startswith("pisa_") and "_qb" in c)
            + (f" | graphs: cudnn={_f(row.get('sdpa_cudnn_graph'))} drop={_f(row.get('pisa_drop_graph'))} "
               f"hybrid={_f(row.get('pisa_hybrid_graph'))} x{_f(row.get('speedup_pisa_hybrid_graph'), 2)} hybrid"
               if "pisa_hybrid_graph" in row else ""))


def markdown_table(result: dict) -> str:
    m = result["meta"]
    graphs = any("pisa_hybrid_graph" in r for r in result["rows"])
    lines = [
        f"GPU: {m['gpu']} | torch {m['torch']} | triton {m['triton']} | CUDA {m['cuda']} | {m['dtype']}, "
        f"layout {m['layout']}, block {m['block_size']} | backend {m.get('backend', 'triton')}, "
        f"data {m.get('data', 'random')} | {m['timing']} | {m['date']}",
        "",
        "| B-H-D | L | density | cuDNN ms | flash ms | Flex ms | PISA drop ms | PISA hybrid ms | hybrid speed-up | "
        "drop speed-up | Flex speed-up | " + ("graph: cuDNN / hybrid ms (x) | " if graphs else "")
        + "prep / select / attn ms | extra mem |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if graphs else "") + "---|",
    ]
    for r in result["rows"]:
        vs = " vs flash" if r.get("speedup_baseline") == "sdpa_flash" else ""  # cuDNN failed for this case
        graph = (f"{_f(r.get('sdpa_cudnn_graph'))} / {_f(r.get('pisa_hybrid_graph'))} "
                 f"({_x(r.get('speedup_pisa_hybrid_graph'))}) | ") if graphs else ""
        lines.append(
            f"| {r['config']} | {r['length']} | {100 * r['density']:g}% | {_f(r.get('sdpa_cudnn'))} | "
            f"{_f(r.get('sdpa_flash'))} | {_f(r.get('flex'))} | {_f(r.get('pisa_drop'))} | {_f(r.get('pisa_hybrid'))} | "
            f"{_x(r.get('speedup_pisa_hybrid'))}{vs} | {_x(r.get('speedup_pisa_drop'))}{vs} | "
            f"{_x(r.get('speedup_flex'))}{vs} | {graph}{_f(r.get('t_prepare'))} / {_f(r.get('t_select'))} / "
            f"{_f(r.get('t_attention'))} | {_f(100 * r['extra_frac'] if 'extra_frac' in r else None, 2)}% |"
        )
    return "\n".join(lines) + "\n"


_BASELINES = {"sdpa_cudnn": "cuDNN SDPA", "sdpa_flash": "flash SDPA"}


def plot(result: dict, path: str) -> None:
    """Speed-up over cuDNN SDPA (flash SDPA where cuDNN failed; the axis says which) vs sequence
    length: one panel per config, one line per density."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in result["rows"]))
    densities = sorted({r["density"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, cfg in zip(axes[0], configs):
        for ci, dens in enumerate(densities):
            rows = sorted((r for r in result["rows"] if r["config"] == cfg and r["density"] == dens), key=lambda r: r["length"])
            for col, style in (("pisa_hybrid", "-o"), ("flex", ":x")):
                pts = [(r["length"], r[f"speedup_{col}"]) for r in rows if r.get(f"speedup_{col}")]
                if pts:
                    label = f"{'PISA hybrid' if col == 'pisa_hybrid' else 'Flex (same blocks)'} {100 * dens:g}%"
                    ax.plot(*zip(*pts), style, color=colors[ci % len(colors)], label=label, markersize=4)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        bases = sorted({_BASELINES[r.get("speedup_baseline", "sdpa_cudnn")] for r in result["rows"] if r["config"] == cfg})
        ax.set_ylabel("speed-up vs " + " / ".join(bases))
        ax.set_title(f"B-H-D {cfg}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    m = result["meta"]
    fig.suptitle(f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, {m['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="kernel latency of PISA vs dense attention (CUDA)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(func=run)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated B-H-D triples")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated sequence lengths")
    p.add_argument("--densities", default=DEFAULT_DENSITIES, help="comma-separated densities in (0, 1]")
    p.add_argument("--cases", default=None,
                   help="explicit B-H-D:L:density list instead of the configs x lengths x densities grid")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd"))
    p.add_argument("--rep-ms", type=float, default=60.0, help="time budget per measurement (do_bench rep), > 0")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention column (saves compile time)")
    p.add_argument("--flex-dynamic", action="store_true", help="compile FlexAttention with dynamic shapes")
    p.add_argument("--flex-lengths", default=None, help="only time FlexAttention at these lengths (compile time)")
    p.add_argument("--graphs", action="store_true",
                   help="also time cuDNN SDPA and PISA replayed from CUDA graphs (no Python/launch overhead)")
    p.add_argument("--backend", default="auto", choices=("auto", "hopper", "triton"),
                   help="PISA kernel backend (auto: hopper on sm_90, else triton)")
    p.add_argument("--precision", default="input", choices=spec.PRECISIONS,
                   help="precision of PISA's exact blocks (the low ones run the Hopper kernel's low-precision "
                        "exact phase, pisa_attn.spec.PRECISIONS)")
    p.add_argument("--data", default="random", choices=("random", "dit"),
                   help="Gaussian q/k/v, or the DiT-like generator on an (L/1024, 32, 32) grid")
    p.add_argument("--query-block", type=int, choices=(128, 256), default=None,
                   help="also time PISA with selection per this many query rows (128: shared by 2 blocks)")
    p.add_argument("--out", type=at.output_file, default=None, help="write the JSON result here")
    p.add_argument("--plot", type=at.plot_file, default=None,
                   help="write a PNG plot of speed-up vs length here (needs matplotlib)")
    p.add_argument("--markdown", type=at.output_file, default=None, help="write a markdown table here")


def run(args: argparse.Namespace) -> int:
    """Every value, path and dependency is checked before the GPU is: a misuse reads the same anywhere."""
    try:
        if args.cases:
            # the cases replace the grid: a grid flag beside them would be silently ignored
            for flag, value, default in (("configs", args.configs, DEFAULT_CONFIGS),
                                         ("lengths", args.lengths, DEFAULT_LENGTHS),
                                         ("densities", args.densities, DEFAULT_DENSITIES)):
                if value != default:
                    raise ValueError(f"--{flag} sets the grid that --cases replaces: pass one of them")
            cases = parse_cases(args.cases)
        else:
            cases = grid_cases([Config.parse(c) for c in parse_list(args.configs, str, "configs")],
                               parse_list(args.lengths, int, "lengths"), parse_list(args.densities, float, "densities"))
        if args.no_flex and (args.flex_dynamic or args.flex_lengths is not None):
            used = "--flex-dynamic" if args.flex_dynamic else "--flex-lengths"
            raise ValueError(f"{used} times FlexAttention, which --no-flex skips: pass one of them")
        flex_lengths = None if args.flex_lengths is None else set(parse_list(args.flex_lengths, int, "flex-lengths"))
        if any(not (0 < d <= 1) or n < 1 for _, n, d in cases):
            raise ValueError("densities must be in (0, 1] and lengths positive")
        for cfg in {c for c, _, _ in cases}:
            if not spec.MIN_HEAD_DIM <= cfg.head_dim <= spec.MAX_HEAD_DIM:
                raise ValueError(f"head dim must be in [{spec.MIN_HEAD_DIM}, {spec.MAX_HEAD_DIM}], got {cfg}")
        if args.data == "dit" and any(n % 1024 for _, n, _ in cases):
            raise ValueError("--data dit needs lengths that are multiples of 1024 (a grid of 32x32 frames)")
        if flex_lengths is not None and not flex_lengths <= {n for _, n, _ in cases}:
            raise ValueError(f"--flex-lengths {sorted(flex_lengths - {n for _, n, _ in cases})} are not lengths "
                             "of the benchmark")
        if not 0 < args.rep_ms < float("inf"):
            raise ValueError(f"--rep-ms must be a positive finite number, got {args.rep_ms}")
        PisaSettings(backend=args.backend, precision=args.precision, query_block=args.query_block)
        at.distinct_outputs(out=args.out, plot=args.plot, markdown=args.markdown)
        if args.plot and at.missing_modules("matplotlib"):
            raise ValueError("--plot needs matplotlib, which is not installed: pip install 'pisa-attn[plot]'")
        if not torch.cuda.is_available():
            raise ValueError("needs a CUDA GPU (use pisa-attn demo on a CPU)")
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        check_kernels_run({c for c, _, _ in cases}, dtype, args.backend, args.precision, args.query_block)
    except ValueError as e:
        print(f"pisa-attn bench: error: {e}", file=sys.stderr)
        return 2

    def save(result):
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    result = run_bench(cases, dtype, args.layout, args.rep_ms, not args.no_flex, args.flex_dynamic,
                       flex_lengths, on_row=save, graphs=args.graphs, backend=args.backend, data=args.data,
                       query_block=args.query_block, precision=args.precision)
    save(result)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(result))
    if args.plot:
        plot(result, args.plot)
    print(markdown_table(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pisa_attn.bench.kernels", description=at.plain(__doc__),
                                formatter_class=at.HelpFormatter)
    _add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
