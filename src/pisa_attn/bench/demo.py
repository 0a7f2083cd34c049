"""``pisa-attn demo``: every PISA mode against dense attention on a synthetic DiT-like workload.

Generates seeded DiT-like q/k/v (:func:`pisa_attn.data.dit_qkv`, tokens in tiled order), runs dense
attention (``scaled_dot_product_attention``) and PISA's ``drop``, ``zeroth``, ``hybrid`` and
``first`` modes at a few densities, and reports the relative L1 error and max abs error against a
float32 dense result (float64 for float64 inputs), plus the median wall time.

The modes, from plain block sparsity to the accuracy bound:
  drop    the selected key blocks only (keep-or-drop block sparsity)
  zeroth  + every tail block through its mean key and value sum (block-wise zeroth order)
  hybrid  + one shared first-order term with H-bar: PISA, the paper's method (the term weighted by
          pisa_attention's default alpha, 0.75; the paper's weight is 1)
  first   + every tail block's own first-order term (same weight; dense cost, reference only)

The default (1024 tokens, 13 measurements) takes 4-10 s on a two-core CPU, imports included,
depending on what else the machine runs.
On CPU PISA runs the PyTorch reference, which computes every score to state the math exactly:
its time says nothing about PISA's speed, so each method runs once (--repeats 1). ``--device cuda``
runs the GPU kernels where supported (``--backend auto``: the Hopper kernel on sm_90, else the
Triton kernels; the ``backend`` column says which one ran), timed as the median of 3 runs after a
warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

from ..attention import BACKENDS, make_plan, pisa_attention
from ..metrics import rel_l1
from ..spec import DEFAULT_ALPHA, MODES
from . import argtypes

METHODS = ("drop", "zeroth", "hybrid", "first")  # from plain block-sparse to the accuracy bound
# The table's one-line key to the methods.
LEGEND = ("drop: selected blocks only · zeroth: + tail block means · hybrid: + shared first-order term "
          f"(PISA, weight {DEFAULT_ALPHA:g}) · first: + per-block first order (weight {DEFAULT_ALPHA:g}, dense cost)")
DEFAULT_DENSITIES = (0.0625, 0.125, 0.25)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class DemoConfig:
    length: int = 1024
    grid: tuple[int, ...] | None = None  # overrides ``length``
    image: bool = False  # (h, w) image grid instead of a (t, h, w) video grid
    heads: int = 4
    head_dim: int = 64
    batch: int = 1
    text_tokens: int = 0
    densities: tuple[float, ...] = DEFAULT_DENSITIES
    modes: tuple[str, ...] = METHODS
    block_size: int = 64
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    repeats: int | None = None  # timed runs per method; None: 1 on CPU, 3 on CUDA
    backend: str = "auto"

    def validate(self) -> None:
        """ValueError naming the bad field (before any work is done)."""
        for name in ("length", "heads", "head_dim", "batch"):
            _positive(name, getattr(self, name))
        if self.repeats is not None:
            _positive("repeats", self.repeats)
        if not (16 <= self.head_dim <= 256 and self.head_dim % 2 == 0):
            raise ValueError(f"head_dim must be even and in [16, 256], got {self.head_dim}")
        if isinstance(self.text_tokens, bool) or not isinstance(self.text_tokens, int) or self.text_tokens < 0:
            raise ValueError(f"text_tokens must be an int >= 0, got {self.text_tokens!r}")
        if self.grid is not None:
            if self.image:  # image picks the grid from length: beside an explicit grid it would do nothing
                raise ValueError(f"image picks an (h, w) grid from length; grid={tuple(self.grid)} gives the grid "
                                 "itself (two numbers for an image): pass one of them")
            if len(self.grid) not in (2, 3):
                raise ValueError(f"grid must be (h, w) or (t, h, w), got {tuple(self.grid)}")
            for i, g in enumerate(self.grid):
                _positive(f"grid[{i}]", g)
        if math.prod(self.resolved_grid()) < 2:  # the generator sets the text's scale from the image tokens' spread
            raise ValueError(f"the image grid must hold at least 2 tokens, got {self.resolved_grid()}")
        if not self.densities:
            raise ValueError("densities must not be empty")
        for d in self.densities:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d <= 1.0:
                raise ValueError(f"density must be in (0, 1], got {d!r}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {self.modes!r}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {bs!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not a valid torch device ({e})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available on this machine")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            # else the data generator fails with a CUDA traceback
            raise ValueError(f"device {self.device!r} requested but this machine has "
                             f"{torch.cuda.device_count()} CUDA devices")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32

    def resolved_repeats(self) -> int:
        """CPU runs the reference, whose time is not PISA's speed: one run is enough there."""
        if self.repeats is not None:
            return self.repeats
        return 3 if torch.device(self.device).type == "cuda" else 1

    def resolved_grid(self) -> tuple[int, ...]:
        return tuple(self.grid) if self.grid is not None else grid_for_length(self.length, 2 if self.image else 3)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class DemoRow:
    method: str
    density: float | None  # None for dense
    exact_blocks: str  # "k/N" exact key blocks per query block (k excludes text keep blocks)
    rel_l1: float
    max_abs: float
    time_ms: float
    backend: str


@dataclass
class DemoResult:
    config: DemoConfig
    grid: tuple[int, ...]
    tokens: int
    dtype: str
    device: str
    rows: list[DemoRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "grid": list(self.grid),
            "tokens": self.tokens,
            "dtype": self.dtype,
            "device": self.device,
            "torch": torch.__version__,
            "rows": [asdict(r) for r in self.rows],
        }


def grid_for_length(length: int, rank: int = 3) -> tuple[int, ...]:
    """A token grid of about ``length`` tokens: ``(t, h, w)`` with square frames whose side is a
    multiple of 4 (the 4x4x4 tile) and ``t ≈ h / 4`` (video latents are short in time), or a
    near-square ``(h, w)`` image."""
    _positive("length", length)
    if rank == 2:
        h = max(1, round(math.sqrt(length)))
        return (h, max(1, round(length / h)))
    if rank != 3:
        raise ValueError(f"rank must be 2 or 3, got {rank!r}")
    side = max(4, 4 * round((4 * length) ** (1 / 3) / 4))
    return (max(1, round(length / side**2)), side, side)


def num_steps(cfg: DemoConfig) -> int:
    """Measurements ``run_demo`` makes (dense + every mode at every density): the progress total."""
    return 1 + len(cfg.modes) * len(cfg.densities)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> tuple[torch.Tensor, float]:
    """(output of the last run, median wall time in ms over ``repeats`` runs).

    CUDA gets one untimed warm-up run first (Triton compiles a kernel on its first call); the CPU
    reference has no JIT, so every run is timed and the demo stays quick.
    """
    if device.type == "cuda":
        fn()
    times, out = [], None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return out, statistics.median(times)


def run_demo(cfg: DemoConfig, on_step: Callable[[str], None] | None = None) -> DemoResult:
    """Run the demo; ``on_step(label)`` is called after each of :func:`num_steps` measurements."""
    from ..data import dit_qkv  # the generator pulls in layout tables; keep `import` of this module cheap

    cfg.validate()
    device = torch.device(cfg.device)
    dtype = cfg.resolved_dtype()
    grid = cfg.resolved_grid()
    data = dit_qkv(grid, heads=cfg.heads, head_dim=cfg.head_dim, batch=cfg.batch, text_tokens=cfg.text_tokens,
                   seed=cfg.seed, dtype=dtype, device=device)
    q, k, v = data.q, data.k, data.v
    keep = data.keep_blocks(cfg.block_size)
    step = on_step or (lambda label: None)

    repeats = cfg.resolved_repeats()
    dense, dense_ms = _timed(lambda: F.scaled_dot_product_attention(q, k, v), device, repeats)
    # Errors are measured against float32 dense, so a low-precision dense row shows its own rounding
    # (float64 dense for float64 inputs: a float32 reference would add its rounding to every row).
    wide = torch.promote_types(dtype, torch.float32)
    truth = dense if dtype == wide else F.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide))
    rows = [_row("dense", None, "all", dense, truth, dense_ms, "sdpa")]
    step("dense")
    for density in cfg.densities:
        for mode in cfg.modes:
            kw = dict(density=density, block_size=cfg.block_size, mode=mode, keep_blocks=keep, backend=cfg.backend)
            plan = make_plan(q, k, density, cfg.block_size, mode, False, None, cfg.backend)
            out, ms = _timed(lambda: pisa_attention(q, k, v, **kw), device, repeats)
            rows.append(_row(mode, density, f"{plan.n_select}/{plan.n_kv_blocks}", out, truth, ms, plan.backend))
            step(f"{mode} @ {density:g}")
    dtype_name = str(dtype).removeprefix("torch.")
    return DemoResult(replace(cfg, repeats=repeats), grid, q.shape[2], dtype_name, _device_name(device), rows)


def check_backend(cfg: DemoConfig) -> None:
    """ValueError when ``cfg.backend`` cannot run one of ``cfg.modes`` on ``cfg.device`` (for
    example ``triton`` on a CPU): planned on a small input of the same heads, head dim and dtype,
    before any data is made."""
    if cfg.backend in ("auto", "reference"):
        return
    q = torch.zeros(cfg.batch, cfg.heads, 4 * cfg.block_size, cfg.head_dim, dtype=cfg.resolved_dtype(),
                    device=cfg.device)
    for mode in cfg.modes:
        make_plan(q, q, cfg.densities[0], cfg.block_size, mode, False, None, cfg.backend)


def _row(method, density, exact, out, truth, ms, backend) -> DemoRow:
    max_abs = float((out.to(truth.dtype) - truth).abs().max())
    return DemoRow(method, density, exact, rel_l1(out, truth), max_abs, ms, backend)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


# ---------------------------------------------------------------- output
def make_table(result: DemoResult):
    from rich.table import Table

    cfg = result.config
    grid = "x".join(map(str, result.grid))
    title = (f"PISA vs dense on DiT-like q/k/v: grid {grid} ({result.tokens} tokens), "
             f"B{cfg.batch} H{cfg.heads} D{cfg.head_dim}, block {cfg.block_size}, {result.dtype} on {result.device}")
    table = Table(title=title, title_justify="left", caption=LEGEND, caption_justify="left")
    for name, justify in (("method", "left"), ("density", "right"), ("exact blocks", "right"),
                          ("rel-L1 vs dense", "right"), ("max abs err", "right"), ("time (ms)", "right"),
                          ("backend", "left")):
        table.add_column(name, justify=justify)
    for r in result.rows:
        density = "1" if r.density is None else f"{r.density:g}"
        ms = f"{r.time_ms:.3f}" if r.time_ms < 1 else f"{r.time_ms:.1f}"  # GPU kernels take well under 1 ms
        table.add_row(r.method, density, r.exact_blocks, f"{r.rel_l1:.3e}", f"{r.max_abs:.3e}", ms, r.backend,
                      end_section=r.method == "dense" or r.method == cfg.modes[-1])
    return table


def save_json(result: DemoResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.to_dict(), f, indent=2)
        f.write("\n")


def save_plot(result: DemoResult, path: str) -> None:
    """Relative L1 error vs density, one line per mode (log-log), as a PNG/PDF/SVG by extension."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .plots import LABELS, MODE_COLORS

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)  # headless: no pyplot, no global backend switch
    ax = fig.add_subplot()
    for mode in result.config.modes:
        pts = [(r.density, r.rel_l1) for r in result.rows if r.method == mode and r.rel_l1 > 0]
        if pts:
            # the demo runs the default weight, not the study's α = 1
            label = f"sparse + hybrid (PISA, α = {DEFAULT_ALPHA:g})" if mode == "hybrid" else LABELS.get(mode, mode)
            ax.plot(*zip(*sorted(pts)), marker="o", label=label, color=MODE_COLORS.get(mode))
    floor = result.rows[0].rel_l1
    if floor > 0:  # low-precision dense vs float32 dense: the rounding floor no method can beat
        ax.axhline(floor, color="gray", linestyle=":", label=f"dense in {result.dtype}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("density (fraction of key blocks computed exactly)")
    ax.set_ylabel("relative L1 error vs dense")
    ax.set_title(f"grid {'x'.join(map(str, result.grid))}, H{result.config.heads} D{result.config.head_dim}, "
                 f"{result.dtype}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- command line
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``demo`` on an ``argparse`` sub-parser collection (``pisa-attn demo``)."""
    d = DemoConfig()
    p = subparsers.add_parser("demo", help="accuracy/time of every PISA mode vs dense on DiT-like data (CPU ok)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=argtypes.int_at_least(1), default=d.length,
                   help=f"about this many tokens; picks a t×h×w grid (default {d.length})")
    p.add_argument("--grid", type=argtypes.int_at_least(1), nargs="+", metavar="N",
                   help="explicit token grid T H W (video) or H W (image); overrides --length")
    p.add_argument("--image", action="store_true", help="pick an h×w image grid from --length instead of video")
    p.add_argument("--density", type=argtypes.density, nargs="+", default=list(d.densities), dest="densities",
                   metavar="D", help=f"densities in (0, 1] (default {' '.join(map(str, d.densities))})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(d.modes), help="PISA modes to run")
    p.add_argument("--heads", type=argtypes.int_at_least(1), default=d.heads,
                   help=f"attention heads (default {d.heads})")
    p.add_argument("--head-dim", type=argtypes.int_at_least(16), default=d.head_dim,
                   help=f"head dim, 16-256, even (default {d.head_dim})")
    p.add_argument("--batch", type=argtypes.int_at_least(1), default=d.batch, help=f"batch size (default {d.batch})")
    p.add_argument("--text-tokens", type=argtypes.int_at_least(0), default=d.text_tokens,
                   help="text tokens before the grid, always exact via keep_blocks (default 0)")
    p.add_argument("--block-size", type=argtypes.block_size, default=d.block_size, help=f"(default {d.block_size})")
    p.add_argument("--seed", type=argtypes.int_at_least(0), default=d.seed, help=f"data seed (default {d.seed})")
    p.add_argument("--repeats", type=argtypes.int_at_least(1), default=d.repeats,
                   help="timed runs per method; the median is shown (default: 1 on CPU, 3 on CUDA)")
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default=d.dtype,
                   help="input dtype (default auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend, help="PISA backend (default auto)")
    p.add_argument("--threads", type=argtypes.int_at_least(1), help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--plot", metavar="PATH", type=argtypes.plot_file,
                   help="save error vs density (e.g. out.png; needs matplotlib)")
    p.add_argument("--json", metavar="PATH", type=argtypes.output_file, help="save the config and every row as JSON")
    p.set_defaults(func=main_from_args)
    return p


def main_from_args(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    fields = DemoConfig.__dataclass_fields__
    kw = {k: v for k, v in vars(args).items() if k in fields}
    kw["grid"] = tuple(args.grid) if args.grid else None
    kw["densities"], kw["modes"] = tuple(args.densities), tuple(dict.fromkeys(args.modes))
    cfg = DemoConfig(**kw)
    err = Console(stderr=True)
    try:
        cfg.validate()
        check_backend(cfg)
        if args.plot and argtypes.missing_modules("matplotlib"):
            raise ValueError("--plot needs matplotlib, which is not installed: pip install 'pisa-attn[plot]'")
        argtypes.distinct_outputs(plot=args.plot, json=args.json)
    except ValueError as e:
        print(f"pisa-attn demo: error: {e}", file=sys.stderr)  # one line: no console wrapping
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    columns = (TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("generating data", total=num_steps(cfg))

        def on_step(label: str) -> None:
            progress.update(task, advance=1, description=label)

        result = run_demo(cfg, on_step)
    out = Console()
    out.print(make_table(result))
    if torch.device(cfg.device).type == "cpu":
        out.print("CPU times are the PyTorch reference (all L² scores, the statement of the math), not PISA's "
                  "speed; use --device cuda for the kernels.", style="dim")
    if args.json:
        save_json(result, args.json)
        out.print(f"wrote {args.json}")
    if args.plot:
        save_plot(result, args.plot)
        out.print(f"wrote {args.plot}")
    out.print(f"demo took {time.perf_counter() - t0:.1f} s", style="dim")
    return 0
