"""PISA in diffusers transformers at the paper's scale: one transformer forward, dense vs PISA, same run.

Each case builds the REAL transformer config with random weights (bf16, on the GPU) and times ONE
forward on the fastest dense diffusers backend (cuDNN SDPA via ``_native_cudnn`` where it runs;
every native backend is timed on one attention call at the model's exact shape and the fastest
one runs the dense forward) and on PISA at the paper's density with no warm-up
(``dense_layers=0, dense_steps=0``):

=================  ======================================  ========================  =========  ========
case               model, size                             tokens (self-attention)   density    warm-up
=================  ======================================  ========================  =========  ========
wan14b-720p        Wan2.1-14B, 720p 81 frames              21x45x80 = 75 600         12.5 %     1 / 10
hunyuan-720p       HunyuanVideo 13B, 720p 129 frames       33x45x80 = 118 800 + 256  12.5 %     1 / 10
flux-1024          FLUX.1-dev, 1024x1024                   64x64 = 4 096 + 512       15 %       4 / 0
flux-2048          FLUX.1-dev, 2048x2048                   128x128 = 16 384 + 512    15 %       4 / 0
wan1.3b-480p       Wan2.1-1.3B, 480p 81 frames             21x30x52 = 32 760         12.5 %     1 / 15
=================  ======================================  ========================  =========  ========

(warm-up: dense transformer blocks / dense steps of 50, the paper's appendix D.) Per case:

* **speed-up** of the PISA forward over the dense one, and its **share of the Amdahl bound**
  ``T_dense / (T_rest + (T_dense - T_rest) / r)``: ``T_rest`` is the forward with the managed
  self-attention calls replaced by an opaque op that returns an uninitialised tensor (its inputs
  are still computed, so nothing around attention is optimised away), ``r`` the attention call's
  own speed-up at the model's exact shape (dense backend vs PISA's sparse path, text handling
  included).
* **the paper's schedule** as a weighted 50-step estimate from the measured forwards (warm-up
  steps dense; the warm-up layers' calls at their measured dense cost), beside the paper's own
  end-to-end numbers (whole generations against its own dense baseline).
* **boundary cost**: the forward with PISA's tiling hooks and no attention minus the forward with
  no attention (permutations, run bookkeeping), and the gathers alone timed at the model's
  shapes, as % of the PISA forward (target < 3 %).
* **output**: rel-L1 (``mean|a - b| / mean|b|``) of PISA vs dense; in the compiled stages also
  compiled vs eager, for dense and PISA (does compiling move dense as much as it moves PISA?).

Stages (``--part`` or ``--stages``), in order of value; each has its own time budget (``--budget-s``)
and is skipped or cut cleanly when it would overrun it or the run's (``--total-budget-s``):
``wan14b``, ``hunyuan`` (eager), ``wan14b-compiled``, ``hunyuan-compiled``, ``flux`` (eager, both
sizes, plus the attention-call sweep that explains ``min_kv_len``), ``wan1.3b``, ``wan1.3b-compiled``,
``flux-compiled``. Compiled stages run ``torch.compile(transformer, fullgraph=True)`` (compile time
reported separately) on a share of the blocks (``--fraction``; default 0.1 for the 13-14B models and
FLUX, all 30 blocks for Wan-1.3B, where compile drift is the question): per-block cost is uniform,
so ratios hold and per-forward times are extrapolated (marked ``*``, ``derived.blocks`` in the JSON).
``--fraction wan14b=0.5`` is how an eager stage builds fewer blocks when a dense forward is too slow.

Estimated device time on one H100 (``--plan`` prints it for the chosen stages, no GPU needed):
attention 4 L^2 H D per layer and the GEMMs at 600 TFLOP/s, elementwise work calibrated on
Wan-1.3B; whole-model compiles a guess of 20 s + 1.5 s per block each, replaced by the first
measured one (``e2e_estimates``). Budgets (``--budget-s``) are the defaults:

=================  =====================================================  ========  ======
stage              what dominates                                         estimate  budget
=================  =====================================================  ========  ======
wan14b             dense forward 12.5 s (4.7 PFLOP of attention) x2,      ~75 s     130 s
                   PISA ~6.7 s x2, no-attention 4.7 s x4, calls ~10 s
                   (first stage: also the PISA kernels' first compile)
hunyuan            dense 22.5 s (10.5 PFLOP) x2, PISA ~9.4 s x2,          ~105 s    150 s
                   no-attention 5.0 s x4, calls ~14 s
wan14b-compiled    3 compiles of 4 blocks (~26 s each) + forwards         ~100 s    110 s
hunyuan-compiled   3 compiles of 6 blocks (~29 s each) + forwards         ~115 s    120 s
flux               2 sizes x 4 kinds of forward (0.2-1 s), call sweep     ~30 s     60 s
wan1.3b            4 kinds of forward x ~0.6 s                            ~10 s     40 s
wan1.3b-compiled   3 compiles of 30 blocks (~65 s each): compile drift    ~205 s    200 s
flux-compiled      2 sizes x 3 compiles of 6 blocks (2048 first)          ~185 s    110 s
=================  =====================================================  ========  ======

One 10-minute device call (``--part all``, run budget 540 s) gets everything down to ``wan1.3b``
(~7.5 min) and what fits of ``wan1.3b-compiled``; a second call runs the rest
(``--stages wan1.3b-compiled,flux-compiled``, ~6.5 min). ``--part eager`` (~4 min) and
``--part compiled`` split the same work the other way.

Device (diffusers travels as a wheel; the device has torch, triton, transformers, accelerate,
safetensors)::

    mkdir -p .whl && python -m pip download --no-deps --only-binary=:all: diffusers==0.42.1 -d .whl
    bash benchmarks/run_e2e.sh all          # one device call, carry .whl
    bash benchmarks/run_e2e.sh compiled --stages wan1.3b-compiled,flux-compiled   # the rest

CPU check of every code path with tiny models of the same classes::

    python benchmarks/bench_e2e.py --tiny --part all

Writes ``<name>.json`` (default ``bench_e2e``) to ``--out`` (default ``$OUT`` or ``./out``) after
every step, so a cut run keeps what it measured, and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gc
import json
import logging
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from dataclasses import replace

import torch

from pisa_attn.bench import dit_cases as dc
from pisa_attn.bench import e2e_estimates as est
from pisa_attn.metrics import rel_l1

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
}
PARTS = {
    "all": tuple(STAGES),
    "eager": tuple(s for s, (_, c) in STAGES.items() if not c),
    "compiled": tuple(s for s, (_, c) in STAGES.items() if c),
}
BUDGET_S = {
    "wan14b": 130, "hunyuan": 150, "wan14b-compiled": 110, "hunyuan-compiled": 120, "flux": 60,
    "flux-compiled": 110, "wan1.3b": 40, "wan1.3b-compiled": 200,
}  # fmt: skip
# Dense diffusers backends tried on one attention call; the fastest runs the dense forwards.
DENSE_BACKENDS = {
    "cuda": ("_native_cudnn", "_native_flash", "_native_efficient", "native", "_flash_3", "flash"),
    "cpu": ("_native_math", "native"),
}
FLUX_SWEEP = (1024, 2304, 4096, 9216, 16384)  # image tokens (512-2048 px squares), + 512 text
FLUX_SWEEP_TINY = (64, 144, 256)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models of the same classes on the CPU (every code path)")
    p.add_argument("--part", choices=tuple(PARTS), default="eager", help="stage set (default eager)")
    p.add_argument("--stages", default=None, help=f"comma-separated stages, overrides --part: {', '.join(STAGES)}")
    p.add_argument("--budget-s", default=None,
                   help="per-stage time budget: seconds for every stage, or stage=seconds,... over the defaults")
    p.add_argument("--total-budget-s", type=float, default=540.0, help="the whole run (default 540 of a 600 s call)")
    p.add_argument("--fraction", default=None,
                   help="share of the blocks to build: a number for every stage, or stage=share,... "
                        "(default: all blocks eager; the cases' compile fraction compiled)")  # fmt: skip
    p.add_argument("--density", type=float, default=None, help="override every case's density")
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "zeroth", "first", "drop"))
    p.add_argument("--block-size", type=int, default=None, help="default 64 (16 with --tiny)")
    p.add_argument("--steps", type=int, default=50, help="denoising steps of the schedule estimate")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards before the timed ones")
    p.add_argument("--measure-s", type=float, default=2.0, help="timed forwards continue while under this many seconds")
    p.add_argument("--max-iters", type=int, default=5, help="most timed forwards per measurement")
    p.add_argument("--flux-sweep", default=None, help="image-token counts of the min_kv_len attention sweep")
    p.add_argument("--plan", action="store_true", help="print the stages' estimated device time and exit")
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
    if args.density is not None and not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    if args.block_size is None:
        args.block_size = 16 if args.tiny else 64
    if args.steps < 1 or args.warmup < 0 or args.max_iters < 1:
        p.error("--steps and --max-iters must be >= 1, --warmup >= 0")
    default_sweep = FLUX_SWEEP_TINY if args.tiny else FLUX_SWEEP
    args.flux_sweep = default_sweep if args.flux_sweep is None else _ints(p, "--flux-sweep", args.flux_sweep)
    if any(math.isqrt(n) ** 2 != n for n in args.flux_sweep):
        p.error("--flux-sweep token counts must be squares (square images)")
    return args


def _ints(p, flag, text) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        p.error(f"{flag} must be comma-separated ints, got {text!r}")


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


class _QuietBackendWarning(logging.Filter):
    """Drops diffusers' warning on every ``set_attention_backend`` call (one per forward here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Attention backends are an experimental feature" not in record.getMessage()


logging.getLogger("diffusers.models.modeling_utils").addFilter(_QuietBackendWarning())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- time limits ---------------------------------------------------------------------------------
class StageTimeout(BaseException):
    """Raised by the stage alarm (a BaseException: library code catching Exception lets it pass)."""


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise :class:`StageTimeout` in the main thread after ``seconds``, and again every 2 s (one
    raised inside a finaliser is swallowed), until the block exits."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise StageTimeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 2.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Stage:
    """One stage's clock, timer and bookkeeping (steps that ran, steps skipped for time)."""

    def __init__(self, name: str, budget_s: float, run_deadline: float, device, save, shared: dict,
                 est_scale: float = 1.0) -> None:  # fmt: skip
        self.name = name
        self.est_scale = est_scale  # estimates are for the real models on a GPU; ~0 for the tiny ones
        self.start = time.monotonic()
        self.deadline = min(self.start + budget_s, run_deadline)
        self.device = device
        self.save = save
        self.current = "start"
        self.calibration = 1.0  # measured / estimated forward time, once a forward ran
        self.shared = shared  # what later stages of the run plan from (the compile-time scale)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return seconds * self.est_scale <= self.left()

    def step(self, rec: dict, label: str, est_s: float, fn):
        """``fn()``, or None when ``est_s`` does not fit the time left (recorded as skipped) or
        ``fn`` raised (recorded under ``errors``, traceback on stderr: the next steps still run)."""
        if not self.fits(est_s):
            need = est_s * self.est_scale
            rec.setdefault("skipped", []).append(f"{label} (needs ~{need:.0f} s, {self.left():.0f} s left)")
            log(f"{self.name}: skip {label}: needs ~{need:.0f} s, {self.left():.0f} s left")
            self.save()
            return None
        self.current = f"{rec.get('case', '')} {label}".strip()
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:
            msg = str(e).splitlines()[0][:300] if str(e) else ""
            rec.setdefault("errors", {})[label] = f"{type(e).__name__}: {msg}"
            log(f"{self.name}: {self.current} failed: {type(e).__name__}: {msg}")
            traceback.print_exc()
            out = None
            torch._dynamo.reset()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        rec.setdefault("step_s", {})[label] = round(time.monotonic() - t0, 2)
        self.save()
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn) -> tuple[float, object]:
        """(ms, output) of one call (CUDA events on the GPU)."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out

    def measure(self, fn, *, warmup: int, min_iters: int = 1, max_iters: int = 5, target_s: float = 2.0):
        """({ms: median of the timed calls, times_ms, warmup_ms, cold_only}, last output).

        After ``warmup`` untimed calls, timed calls continue while their total is under
        ``target_s`` (at least ``min_iters``, at most ``max_iters``) and another one fits the
        stage's time; when none fits, the warm-up calls are the measurement (``cold_only``)."""
        cold, times, out = [], [], None
        for _ in range(warmup):
            t, out = self.timed(fn)
            cold.append(t)
        while len(times) < max_iters:
            last_s = (times or cold or [0.0])[-1] / 1e3
            if len(times) >= min_iters and sum(times) / 1e3 >= target_s:
                break
            if (times or cold) and not self.fits(last_s):
                break
            t, out = self.timed(fn)
            times.append(t)
        cold_only = not times
        use = times or cold
        return {"ms": statistics.median(use), "times_ms": use, "warmup_ms": cold, "cold_only": cold_only}, out


# --- attention backends ----------------------------------------------------------------------------
_NULL = None


def null_backend():
    """The diffusers backend member of the no-attention op (registered once)."""
    global _NULL
    if _NULL is not None:
        return _NULL
    from diffusers.models import attention_dispatch as ad

    @torch.library.custom_op("pisa_bench::no_attention", mutates_args=())
    def no_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # Opaque to the compiler: q, k, v are still computed; the uninitialised result costs nothing.
        b, lq, h, _ = query.shape
        return query.new_empty(b, lq, h, value.shape[-1])

    @no_attention.register_fake
    def _(query, key, value):
        b, lq, h, _ = query.shape
        return query.new_empty(b, lq, h, value.shape[-1])

    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 _parallel_config=None):  # fmt: skip
        return torch.ops.pisa_bench.no_attention(query, key, value)

    member = _enum_member(ad.AttentionBackendName, "PISA_BENCH_NO_ATTENTION", "pisa_bench_no_attention")
    ad._AttentionBackendRegistry.register(member, constraints=[])(dispatch)
    _NULL = member
    return member


def _enum_member(enum_cls, name: str, value: str):
    """Add a member to a ``str`` Enum after class creation: this benchmark's no-attention backend
    (a measuring device in this script's process only; the library registers nothing)."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)  # before the map: EnumType forbids reassigning members
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def managed_processors(model) -> list:
    """The attention processors of the modules PISA manages (the adapter's self-attention)."""
    import pisa_attn.diffusers as pd

    adapter = pd.adapter_for(model)
    procs = {}
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in adapter.attention):
            procs[id(module.processor)] = module.processor
    return list(procs.values())


@contextlib.contextmanager
def routed(model, member):
    """The managed self-attention processors on ``member``, put back on exit (PISA's processors,
    which compute their own attention, on the no-attention op)."""
    from pisa_attn.diffusers.processors import PisaProcessor

    missing = object()
    procs = managed_processors(model)
    saved = [(p, p.__dict__.get("_attention_backend", missing)) for p in procs]
    for p in procs:
        p._attention_backend = member
        if isinstance(p, PisaProcessor):
            p.attention = lambda q, k, v, mask: torch.ops.pisa_bench.no_attention(q, k, v).flatten(2, 3)
    try:
        yield
    finally:
        for p, old in saved:
            p.__dict__.pop("attention", None)
            if old is missing:
                p.__dict__.pop("_attention_backend", None)
            else:
                p._attention_backend = old


@contextlib.contextmanager
def dense_backend(model, name: str):
    """Every attention module of ``model`` on the diffusers backend ``name``."""
    from diffusers.models import attention_dispatch as ad

    model.set_attention_backend(name)
    try:
        yield
    finally:
        model.reset_attention_backend()
        ad._AttentionBackendRegistry.set_active_backend(ad.AttentionBackendName.NATIVE)


def pisa_settings(case: dc.Case, args) -> dict:
    return dict(
        density=case.density, mode=args.mode, dense_layers=0, dense_steps=0, block_size=args.block_size,
        min_kv_len=0 if args.tiny else None,
    )  # fmt: skip


@contextlib.contextmanager
def pisa_applied(model, case: dc.Case, args):
    import pisa_attn.diffusers as pd

    kw = pisa_settings(case, args)
    if kw["min_kv_len"] is None:
        kw.pop("min_kv_len")  # the library default
    pd.apply_pisa(model, **kw)
    try:
        yield pd.pisa_state(model)
    finally:
        pd.remove_pisa(model)


# --- one attention call ------------------------------------------------------------------------------
def family_adapter(family: str):
    import pisa_attn.diffusers as pd

    return next(a for a in pd.ADAPTERS if a.name == family)


def sequence(case: dc.Case, block_size: int):
    import pisa_attn.diffusers as pd

    adapter = family_adapter(case.family)
    tile = pd.default_tile(len(case.grid), block_size)
    return pd.build_layouts(case.grid, case.joint_text, adapter.text, tile, block_size)


def attention_calls(stage: Stage, case: dc.Case, cov: bool, args, dense_names) -> dict:
    """One managed self-attention call at the case's exact shape: every dense diffusers backend,
    PISA's sparse path (text rows and keep blocks as the backend runs them) and PISA's dense path
    (what its warm-up calls run)."""
    from diffusers.models import attention_dispatch as ad

    from pisa_attn.attention import _choose_backend
    from pisa_attn.diffusers.calls import dense_attention, sparse_attention
    from pisa_attn.diffusers.state import key_lengths
    from pisa_attn.settings import PisaSettings

    dev, dtype = stage.device, stage_dtype(stage.device)
    seq = sequence(case, args.block_size).joint
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, seq.length, case.heads, case.head_dim, generator=g).to(dev, dtype) for _ in range(3))
    mask = dc.self_attention_mask(case, dev)
    kw = dict(warmup=1 if dev.type == "cuda" else 0, min_iters=3, max_iters=20, target_s=0.3)
    dense = {}
    reg = ad._AttentionBackendRegistry
    for name in dense_names:
        member = ad.AttentionBackendName(name)
        fn, accepted = reg._backends.get(member), reg._supported_arg_names.get(member, set())
        if mask is not None and "attn_mask" not in accepted:
            dense[name] = "unavailable: takes no attention mask (the dispatcher would drop the model's)"
            continue
        call = {n: t for n, t in dict(query=q, key=k, value=v, attn_mask=mask).items() if n in accepted}
        try:
            m, _ = stage.measure(lambda fn=fn, call=call: fn(**call), **kw)
            dense[name] = m["ms"]
        except Exception as e:  # a backend this machine lacks (package, GPU arch, mask support)
            dense[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    timed = {n: t for n, t in dense.items() if isinstance(t, float)}
    if not timed:
        raise RuntimeError(f"no dense attention backend ran: {dense}")
    order = sorted(timed, key=timed.get)
    best = order[0]
    lens = None if mask is None else key_lengths(mask, 1, seq.length)
    settings = PisaSettings(density=case.density, mode=args.mode, covariance_aware=cov, block_size=args.block_size,
                            layout="bshd")
    plans: dict = {}  # planned once, as apply_pisa does per call shape
    pisa, _ = stage.measure(lambda: sparse_attention(q, k, v, seq, lens, settings, plans=plans), **kw)
    path, _ = stage.measure(lambda: dense_attention(q, k, v, mask, None, False), **kw)
    return {
        "tokens": seq.length,
        "dense_ms": dense,
        "dense_backend": best,
        "dense_order": order,
        "pisa_ms": pisa["ms"],
        "pisa_backend": _choose_backend("auto", q.transpose(1, 2), args.mode, args.block_size),
        "pisa_dense_path_ms": path["ms"],
        "speedup": timed[best] / pisa["ms"],
    }


# --- boundary gathers ----------------------------------------------------------------------------
@contextlib.contextmanager
def boundary_shapes(model, shapes: dict):
    """Record the output shapes of the modules whose outputs PISA's tiling hooks permute."""
    import pisa_attn.diffusers as pd

    adapter = pd.adapter_for(model)
    names = {"token": adapter.token_module, "rope": adapter.rope_module, "untile": adapter.untile_module}
    handles = []
    for kind, sub in names.items():
        if sub is None:
            continue

        def hook(module, args, out, kind=kind):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            shapes[kind] = [(tuple(t.shape), t.dtype) for t in outs if isinstance(t, torch.Tensor)]

        handles.append(model.get_submodule(sub).register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def time_gathers(stage: Stage, case: dc.Case, shapes: dict, args) -> dict:
    """The permutations PISA's tiling hooks apply per forward, each timed alone at its shape."""
    adapter = family_adapter(case.family)
    layout = sequence(case, args.block_size).image
    dev = stage.device
    perm, inv = layout.perm_on(dev), layout.perm_on(dev, inverse=True)
    n = perm.shape[0]
    ops = []
    for shape, dtype in shapes.get("token", []):
        x = torch.randn(shape, device=dev).to(dtype)
        if adapter.token_output == "conv":
            ops.append(("token", lambda x=x: x.flatten(2).index_select(2, perm)))
        else:
            ops.append(("token", lambda x=x: x.index_select(1, perm)))
    d = adapter.rope_dim
    for shape, dtype in shapes.get("rope", []):
        x = torch.randn(shape, device=dev).to(dtype)
        if adapter.rope_text_before:
            t = shape[d] - n
            fn = lambda x=x, t=t: torch.cat([x.narrow(d, 0, t), x.narrow(d, t, n).index_select(d, perm)], d)  # noqa: E731
            ops.append(("rope", fn))
        else:
            ops.append(("rope", lambda x=x: x.index_select(d, perm)))
    for shape, dtype in shapes.get("untile", []):
        x = torch.randn(shape, device=dev).to(dtype)
        ops.append(("untile", lambda x=x: x.index_select(1, inv)))
    out: dict[str, float] = {}
    for kind, fn in ops:
        m, _ = stage.measure(fn, warmup=2 if dev.type == "cuda" else 0, min_iters=5, max_iters=20, target_s=0.05)
        out[kind] = out.get(kind, 0.0) + m["ms"]
    return {"per_kind_ms": out, "total_ms": sum(out.values())}


# --- forwards ------------------------------------------------------------------------------------
def stage_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def forward_fn(model, x):
    def run():
        with torch.no_grad():
            return model(**x).sample

    return run


def forward_kw(args, warmup: int | None = None) -> dict:
    return dict(warmup=args.warmup if warmup is None else warmup, min_iters=1, max_iters=args.max_iters,
                target_s=args.measure_s)  # fmt: skip


def blocks_info(case: dc.Case, full: dc.Case) -> dict:
    return {"measured": case.blocks, "total": full.blocks, "extrapolation": full.blocks / case.blocks}


def first_dense(order, run, rec: dict, label: str):
    """``(backend, run(backend))`` for the first dense backend in ``order`` whose forward runs
    (one that ran a bare attention call can still refuse a call inside the model, e.g. a mask)."""
    errors = {}
    for name in order:
        try:
            return name, run(name)
        except Exception as e:  # recorded; the next backend is tried
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            errors[name] = f"{type(e).__name__}: {msg}"
            rec.setdefault("dense_backend_errors", {})[f"{label} {name}"] = errors[name]
            log(f"{label}: dense backend {name} failed ({errors[name]}); trying the next one")
            torch._dynamo.reset()
    raise RuntimeError(f"{label}: no dense backend ran the forward: {errors}")


def attention_call_s(case: dc.Case) -> float:
    """Estimated seconds of one dense self-attention call of the case."""
    return est.forward_seconds(case)["attention"] / case.blocks


def probe(stage: Stage, case: dc.Case, model, rec: dict, args, dense_names) -> dict | None:
    import pisa_attn.diffusers as pd

    cov = pd.adapter_for(model).defaults(model.config)["covariance_aware"]
    a = stage.step(rec, "attention_calls", probe_s(case, len(dense_names)),
                   lambda: attention_calls(stage, case, cov, args, dense_names))  # fmt: skip
    if a is not None:
        log(f"{stage.name} {case.key}: attention call {a['tokens']} tokens: dense {_fmt_ms(a['dense_ms'])}, PISA "
            f"{a['pisa_ms']:.3f} ms ({a['pisa_backend']}, {a['speedup']:.2f}x), PISA dense path "
            f"{a['pisa_dense_path_ms']:.3f} ms")  # fmt: skip
    return a


def _fmt_ms(d: dict) -> str:
    return ", ".join(f"{k} {v:.3f} ms" if isinstance(v, float) else f"{k} {v[:40]}" for k, v in d.items())


def eager_case(stage: Stage, case: dc.Case, full: dc.Case, model, rec: dict, args, dense_names) -> None:
    dev, dtype = stage.device, stage_dtype(stage.device)
    x = dc.inputs(case, dev, dtype)
    plan = est.forward_seconds(case)
    n_fwd = args.warmup + 1
    a = probe(stage, case, model, rec, args, dense_names)
    if a is None:
        return
    rec["attention_call"] = a
    best = a["dense_backend"]
    fw, outs = rec.setdefault("forward_ms", {}), {}

    def dense(name):
        with dense_backend(model, name):
            return stage.measure(forward_fn(model, x), **forward_kw(args))

    r = stage.step(rec, "dense", n_fwd * plan["dense"], lambda: first_dense(a["dense_order"], dense, rec, "dense"))
    if r is not None:
        best, (fw["dense"], outs["dense"]) = r
        stage.calibration = fw["dense"]["ms"] / 1e3 / plan["dense"]
    rec["dense_backend"] = best
    cal = stage.calibration
    pisa_est = cal * (plan["rest"] + plan["attention"] / a["speedup"])

    def pisa():
        with dense_backend(model, best), pisa_applied(model, case, args) as state:
            m, out = stage.measure(forward_fn(model, x), **forward_kw(args))
            rec["pisa_calls"] = dict(state.stats)
            rec["pisa_config"] = {"covariance_aware": state.config.covariance_aware, "tile": list(state.config.tile),
                                  "min_kv_len": state.config.schedule.min_kv_len}  # fmt: skip
            return m, out

    r = stage.step(rec, "pisa", n_fwd * pisa_est, pisa)
    if r is not None:
        fw["pisa"], outs["pisa"] = r
    if "pisa" in outs and "dense" in outs:
        rec["rel_l1"] = {"pisa_vs_dense": rel_l1(outs["pisa"], outs["dense"])}
    outs.clear()
    shapes: dict = {}

    def no_attention():
        with dense_backend(model, best), routed(model, null_backend()), boundary_shapes(model, shapes):
            return stage.measure(forward_fn(model, x), **forward_kw(args))[0]

    m = stage.step(rec, "no_attention", n_fwd * cal * plan["rest"], no_attention)
    if m is not None:
        fw["no_attention"] = m

    def hooks_only():
        with dense_backend(model, best), pisa_applied(model, case, args), routed(model, null_backend()):
            return stage.measure(forward_fn(model, x), **forward_kw(args))[0]

    m = stage.step(rec, "no_attention_pisa_hooks", n_fwd * cal * plan["rest"], hooks_only)
    if m is not None:
        fw["no_attention_pisa_hooks"] = m
    if shapes:
        rec["gathers"] = stage.step(rec, "gathers", 2.0, lambda: time_gathers(stage, case, shapes, args))
    rec["derived"] = derive(rec, case, full, args)
    log(f"{stage.name} {case.key}: {summary(rec)}")


def compiled_case(stage: Stage, case: dc.Case, full: dc.Case, model, rec: dict, args, dense_names, earlier) -> None:
    import pisa_attn.diffusers as pd

    dev, dtype = stage.device, stage_dtype(stage.device)
    x = dc.inputs(case, dev, dtype)
    plan = est.forward_seconds(case)
    a = earlier.get(case.key)
    if a is None:
        a = probe(stage, case, model, rec, args, dense_names)
        if a is None:
            return
    else:
        rec["attention_call_from"] = "the eager stage of this run"
    rec["attention_call"] = a
    order = list(a["dense_order"])
    fw, outs, compile_s = rec.setdefault("forward_ms", {}), {}, rec.setdefault("compile_s", {})
    eager = rec.setdefault("eager_cold_ms", {})  # one call each: the drift baselines, not timings

    # Eager references at the same block count: the compile-drift baselines.
    def eager_dense(name):
        with dense_backend(model, name):
            return stage.timed(forward_fn(model, x))

    r = stage.step(rec, "eager_dense", plan["dense"], lambda: first_dense(order, eager_dense, rec, "eager dense"))
    if r is not None:
        name, (eager["dense"], outs["eager_dense"]) = r
        order.remove(name)
        order.insert(0, name)
        stage.calibration = eager["dense"] / 1e3 / plan["dense"]
    cal = stage.calibration
    pisa_est = cal * (plan["rest"] + plan["attention"] / a["speedup"])

    def eager_pisa():
        with dense_backend(model, order[0]), pisa_applied(model, case, args):
            return stage.timed(forward_fn(model, x))

    r = stage.step(rec, "eager_pisa", pisa_est, eager_pisa)
    if r is not None:
        eager["pisa"], outs["eager_pisa"] = r

    def compiled_run(ctx, name: str):
        torch._dynamo.reset()
        try:
            with ctx():
                compiled = torch.compile(model, backend=args.compile_backend, fullgraph=True)
                fn = forward_fn(compiled, x)
                stage.sync()
                t0 = time.perf_counter()
                first = fn()
                stage.sync()
                first_s = time.perf_counter() - t0
                m, out = stage.measure(fn, **forward_kw(args, warmup=0))  # the first call warmed it up
                if name == "pisa":
                    rec["pisa_calls"] = pd.stats(model)
        finally:
            torch._dynamo.reset()
        return first_s, m, out, first

    contexts = {  # the model as each compiled variant runs it, on a given dense backend
        "dense": lambda backend: dense_backend(model, backend),
        "pisa": lambda backend: _stacked(dense_backend(model, backend), pisa_applied(model, case, args)),
        "no_attention": lambda backend: _stacked(dense_backend(model, backend), routed(model, null_backend())),
    }
    variants = {"dense": cal * plan["dense"], "pisa": pisa_est, "no_attention": cal * plan["rest"]}
    for name, fwd_s in variants.items():
        need = est.compile_seconds(case.blocks) * stage.shared.get("compile_scale", 1.0) + 2 * fwd_s

        def variant(backend, name=name):
            return compiled_run(lambda: contexts[name](backend), name)

        if name == "dense":
            run = lambda: first_dense(order, variant, rec, "compiled dense")  # noqa: E731
        else:
            run = lambda: (order[0], variant(order[0]))  # noqa: E731
        r = stage.step(rec, f"compiled_{name}", need, run)
        if r is None:
            continue
        backend, (first_s, m, out, first) = r
        if name == "dense":
            order.remove(backend)
            order.insert(0, backend)
        fw[name] = m
        compile_s[name] = round(first_s - m["ms"] / 1e3, 2)
        if name == "dense":  # the model's first compile: later ones are planned from it
            stage.shared["compile_scale"] = compile_s[name] / est.compile_seconds(case.blocks)
        if name != "no_attention":
            outs[f"compiled_{name}"] = out
            if not torch.equal(first, out):
                diff = rel_l1(first, out)
                rec.setdefault("notes", []).append(f"compiled {name}: first and last forward differ by {diff:.2e}")
        log(f"{stage.name} {case.key}: compiled {name}: {m['ms']:.1f} ms, compile {compile_s[name]:.1f} s")
    rec["dense_backend"] = order[0]
    pairs = [("eager_pisa", "eager_dense"), ("compiled_dense", "eager_dense"), ("compiled_pisa", "compiled_dense"),
             ("compiled_pisa", "eager_dense"), ("compiled_pisa", "eager_pisa")]  # fmt: skip
    rec["rel_l1"] = {f"{p}_vs_{q}": rel_l1(outs[p], outs[q]) for p, q in pairs if p in outs and q in outs}
    if "compiled_pisa_vs_compiled_dense" in rec["rel_l1"]:
        rec["rel_l1"]["pisa_vs_dense"] = rec["rel_l1"]["compiled_pisa_vs_compiled_dense"]
    rec["derived"] = derive(rec, case, full, args)
    log(f"{stage.name} {case.key}: {summary(rec)}")


@contextlib.contextmanager
def _stacked(*cms):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(cm) for cm in cms]


# --- what the numbers say --------------------------------------------------------------------------
def _ms(fw: dict, name: str) -> float | None:
    m = fw.get(name)
    return None if not m else m["ms"]


def derive(rec: dict, case: dc.Case, full: dc.Case, args) -> dict:
    """Speed-up, Amdahl bound and share, boundary cost and the schedule estimate of one case."""
    fw, a = rec.get("forward_ms", {}), rec.get("attention_call")
    dense, pisa, rest, hooks = (_ms(fw, n) for n in ("dense", "pisa", "no_attention", "no_attention_pisa_hooks"))
    ext = full.blocks / case.blocks
    out: dict = {"blocks": blocks_info(case, full)}
    if a:
        # The attention call's own speed-up, against the dense backend the forwards ran on.
        used = rec.get("dense_backend", a["dense_backend"])
        dense_call = a["dense_ms"].get(used)
        dense_call = dense_call if isinstance(dense_call, float) else a["dense_ms"][a["dense_backend"]]
        out["attention_ratio"] = dense_call / a["pisa_ms"]
    if dense is not None:
        out["dense_forward_ms"] = dense * ext
    if pisa is not None:
        out["pisa_forward_ms"] = pisa * ext
    if dense and pisa:
        out["speedup"] = dense / pisa
    if dense and rest is not None:
        out["no_attention_forward_ms"] = rest * ext
        out["ideal_bound"] = dense / rest if rest > 0 else None
        out["attention_share_of_dense"] = (dense - rest) / dense
        if a:
            out["amdahl_bound"] = est.amdahl_bound(dense, rest, out["attention_ratio"])
            if pisa:
                out["share_of_bound"] = out["speedup"] / out["amdahl_bound"]
    if hooks is not None and rest is not None and pisa:
        # The hooks run once per forward, whatever the block count: compare with the full forward.
        out["boundary_ms"] = hooks - rest
        out["boundary_pct_of_pisa_forward"] = 100 * (hooks - rest) / (pisa * ext)
    g = rec.get("gathers")
    if g and pisa:
        out["gathers_pct_of_pisa_forward"] = 100 * g["total_ms"] / (pisa * ext)
    if dense and pisa and a:
        dense_path = a["pisa_dense_path_ms"]
        out["schedule"] = est.schedule_speedup(
            dense * ext, pisa * ext, steps=args.steps, dense_steps=full.dense_steps, dense_layers=full.dense_layers,
            dense_layer_extra=dense_path - a["pisa_ms"],
            dense_step_extra=full.blocks * (dense_path - dense_call),
        )  # fmt: skip
    return out


def summary(rec: dict) -> str:
    d = rec.get("derived", {})
    parts = []
    for k, fmt in (("speedup", "speed-up {:.2f}x"), ("amdahl_bound", "bound {:.2f}x"), ("share_of_bound", "share {:.0%}"),
                   ("boundary_pct_of_pisa_forward", "boundary {:.2f}%")):  # fmt: skip
        if d.get(k) is not None:
            parts.append(fmt.format(d[k]))
    if "schedule" in d:
        parts.append(f"{d['schedule']['steps']}-step schedule {d['schedule']['speedup']:.2f}x")
    for k, v in rec.get("rel_l1", {}).items():
        parts.append(f"{k} {v:.4f}")
    return ", ".join(parts) or "no result"


def min_kv_sweep(stage: Stage, args, dense_names, rec: dict) -> None:
    """Attention calls at FLUX's head shape (text before the image) over image sizes: where PISA
    starts to beat dense, against the integration's ``min_kv_len`` default."""
    from pisa_attn.diffusers.schedule import DEFAULT_MIN_KV_LEN

    base = dc.CASES["flux-1024"]
    if args.tiny:
        base = dc.tiny(base)
    rows = []
    for n in args.flux_sweep:
        s = math.isqrt(n)
        case = replace(base, latent=(s, s), density=args.density or base.density)
        a = stage.step(rec, f"sweep_{n}", probe_s(case, len(dense_names)),
                       lambda case=case: attention_calls(stage, case, True, args, dense_names))  # fmt: skip
        if a is None:
            break
        best = a["dense_ms"][a["dense_backend"]]
        rows.append({"image_tokens": n, "keys": a["tokens"], "dense_ms": best, "dense_backend": a["dense_backend"],
                     "pisa_ms": a["pisa_ms"], "speedup": a["speedup"]})  # fmt: skip
    faster = [r["speedup"] > 1 for r in rows]
    crossover = None
    for i in range(len(rows)):
        if all(faster[i:]):
            crossover = rows[i]["keys"]
            break
    rec["min_kv_len"] = {"default": DEFAULT_MIN_KV_LEN, "rows": rows, "pisa_faster_from_keys": crossover}
    log(f"{stage.name}: min_kv_len sweep: {[(r['keys'], round(r['speedup'], 2)) for r in rows]}; PISA faster from "
        f"{crossover} keys (default min_kv_len {DEFAULT_MIN_KV_LEN})")  # fmt: skip


# --- stages ----------------------------------------------------------------------------------------
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


def plan_seconds(name: str, args) -> float:
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


def free(device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_stage(name: str, args, device, results: dict, save, run_deadline: float) -> None:
    rec = {"stage": name, "compiled": STAGES[name][1], "status": "running", "budget_s": args.budgets[name], "cases": []}
    results["stages"].append(rec)
    if run_deadline - time.monotonic() < 5:
        rec["status"] = "skipped: the run's time budget is spent"
        log(f"{name}: skipped, the run's time budget is spent")
        save()
        return
    stage = Stage(name, args.budgets[name], run_deadline, device, save, results["planning"],
                  est_scale=0.01 if args.tiny else 1.0)  # fmt: skip
    dense_names = DENSE_BACKENDS[device.type]
    earlier = {c["case"]: c["attention_call"] for s in results["stages"] for c in s["cases"]
               if "attention_call" in c and "attention_call_from" not in c}  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, model_cfg, measured = None, None, []
    log(f"{name}: start, budget {stage.left():.0f} s")
    try:
        with alarm(stage.left()):
            for case, full in stage_cases(name, args):
                crec = {"case": case.key, "title": full.title, "grid": list(case.grid), "image_tokens": case.image_tokens,
                        "text_tokens": case.text, "joint_text_tokens": case.joint_text, "density": case.density,
                        "mode": args.mode, "blocks": blocks_info(case, full), "paper": _paper(full)}  # fmt: skip
                rec["cases"].append(crec)
                measured.append((crec, case, full))
                if model_cfg != case.config:
                    model = None
                    free(device)

                    def build(case=case):
                        t0 = time.perf_counter()
                        m = dc.build(case, device, stage_dtype(device))
                        n = sum(p.numel() for p in m.parameters())
                        log(f"{name}: built {type(m).__name__} ({n / 1e9:.2f}B parameters, {case.blocks} blocks) in "
                            f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
                        return m

                    model = stage.step(crec, "build", build_s(case), build)
                    if model is None:
                        break
                    model_cfg = case.config
                crec["parameters"] = sum(p.numel() for p in model.parameters())
                if STAGES[name][1]:
                    compiled_case(stage, case, full, model, crec, args, dense_names, earlier)
                else:
                    eager_case(stage, case, full, model, crec, args, dense_names)
            if name == "flux":
                min_kv_sweep(stage, args, dense_names, rec)
        skipped = sum(len(c.get("skipped", [])) for c in rec["cases"]) + len(rec.get("skipped", []))
        failed = sum(len(c.get("errors", {})) for c in rec["cases"]) + len(rec.get("errors", {}))
        problems = [f"{skipped} steps skipped for time"] * bool(skipped) + [f"{failed} steps failed"] * bool(failed)
        rec["status"] = "done" if not problems else "partial: " + ", ".join(problems)
    except StageTimeout:
        rec["status"] = f"cut at its time limit ({stage.deadline - stage.start:.0f} s) during {stage.current}"
        log(f"{name}: {rec['status']}")
    except Exception as e:  # recorded; the next stages still run
        rec["status"] = f"error during {stage.current}: {type(e).__name__}: {e}"
        log(f"{name}: {rec['status']}")
        traceback.print_exc()
    finally:
        for crec, case, full in measured:  # a case the limit cut keeps what it measured
            if "derived" not in crec and crec.get("forward_ms"):
                crec["derived"] = derive(crec, case, full, args)
        rec["elapsed_s"] = round(time.monotonic() - stage.start, 1)
        if device.type == "cuda":
            rec["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        model = None
        free(device)
        save()


def _paper(case: dc.Case) -> dict | None:
    p = case.paper
    if p is None:
        return None
    return {"speedup": p.speedup, "speedup_no_warmup": p.speedup_no_warmup, "dense_s": p.dense_s, "pisa_s": p.pisa_s,
            "setting": p.setting}  # fmt: skip


def environment(device) -> dict:
    import diffusers

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "device": str(device)}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return env


# --- report --------------------------------------------------------------------------------------
def _f(v, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"


def table(results: dict) -> str:
    head = (f"{'stage':<17} {'case':<13} {'tokens':>7} {'blocks':>6} {'dense':>7} {'dense ms':>9} {'PISA ms':>9} {'speedup':>7} "
            f"{'attn r':>6} {'bound':>6} {'share':>6} {'sched.':>6} {'paper':>11} {'bound.%':>7} {'rel-L1':>7}")  # fmt: skip
    lines = [f"PISA end to end, one transformer forward ({results['env'].get('gpu', results['env']['device'])}, "
             f"torch {results['env']['torch']}); ms per full forward (* = extrapolated from the blocks built)", head,
             "-" * len(head)]  # fmt: skip
    notes = []
    for s in results["stages"]:
        if s["status"] != "done":
            notes.append(f"{s['stage']}: {s['status']}")
        for c in s["cases"]:
            d = c.get("derived", {})
            b = c["blocks"]
            star = "*" if b["measured"] != b["total"] else " "
            paper = c.get("paper") or {}
            pw, pn = paper.get("speedup"), paper.get("speedup_no_warmup")
            ptxt = "-" if pw is None else f"{pw:.2f}/{pn:.2f}" if pn else f"{pw:.2f}/-"
            sched = d.get("schedule", {}).get("speedup")
            tokens = c["image_tokens"] + c["joint_text_tokens"]
            lines.append(
                f"{s['stage']:<17} {c['case']:<13} {tokens:>7} {b['measured']:>3}/{b['total']:<2} "
                f"{c.get('dense_backend', '-').removeprefix('_native_')[:7]:>7} "
                f"{_f(d.get('dense_forward_ms'), '.1f', 8)}{star}{_f(d.get('pisa_forward_ms'), '.1f', 8)}{star}"
                f"{_f(d.get('speedup'), '.2f', 6)}x {_f(d.get('attention_ratio'), '.2f', 5)}x {_f(d.get('amdahl_bound'), '.2f', 5)}x "
                f"{_f(None if d.get('share_of_bound') is None else 100 * d['share_of_bound'], '.0f', 5)}% "
                f"{_f(sched, '.2f', 5)}x {ptxt:>11} {_f(d.get('boundary_pct_of_pisa_forward'), '.2f', 7)} "
                f"{_f(c.get('rel_l1', {}).get('pisa_vs_dense'), '.4f', 7)}"
            )  # fmt: skip
            if s["compiled"]:
                cs = c.get("compile_s", {})
                drift = c.get("rel_l1", {})
                notes.append(f"{c['case']} compiled: compile s {cs}; rel-L1 " + ", ".join(f"{k} {v:.4f}" for k, v in drift.items()))
            if c.get("skipped"):
                notes.append(f"{c['case']} ({s['stage']}): skipped {'; '.join(c['skipped'])}")
            for label, err in c.get("errors", {}).items():
                notes.append(f"{c['case']} ({s['stage']}): {label} failed: {err}")
        if s.get("min_kv_len", {}).get("rows"):
            m = s["min_kv_len"]
            notes.append("min_kv_len sweep (FLUX heads, 512 text tokens): " + ", ".join(
                f"{r['keys']} keys {r['speedup']:.2f}x" for r in m["rows"]) +
                f"; PISA faster from {m['pisa_faster_from_keys']} keys; default min_kv_len {m['default']}")  # fmt: skip
    lines.append("attn r: one attention call dense/PISA at the model's shape; bound: Amdahl bound with r; share: speed-up / "
                 "bound; sched.: the paper's warm-up schedule over the steps; paper: its speed-ups with / without warm-up; "
                 "bound.%: boundary hooks as % of the PISA forward")  # fmt: skip
    return "\n".join(lines + notes)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        total = 0.0
        for name in args.stage_list:
            s = plan_seconds(name, args)
            total += s
            cases = ", ".join(f"{c.key} {c.blocks}/{f.blocks} blocks" for c, f in stage_cases(name, args))
            print(f"{name:<17} ~{s:5.0f} s (budget {args.budgets[name]:.0f} s): {cases}")
        print(f"{'total':<17} ~{total:5.0f} s (run budget {args.total_budget_s:.0f} s)")
        return 0
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: a thread pool only waits on busy cores
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device; use --tiny for the CPU check", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    results = {
        "tiny": args.tiny,
        "env": environment(device),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "settings": {"mode": args.mode, "block_size": args.block_size, "steps": args.steps, "warmup": args.warmup,
                     "compile_backend": args.compile_backend, "dense_backends_tried": DENSE_BACKENDS[device.type]},
        "plan_s": {n: round(plan_seconds(n, args)) for n in args.stage_list},
        "planning": {},  # measured / estimated compile time, once a compile ran
        "stages": [],
    }  # fmt: skip

    def save() -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        os.replace(tmp, path)

    run_deadline = time.monotonic() + args.total_budget_s
    log(f"stages {', '.join(args.stage_list)}; estimated {results['plan_s']}; run budget {args.total_budget_s:.0f} s")
    for name in args.stage_list:
        run_stage(name, args, device, results, save, run_deadline)
    save()
    print(f"wrote {path}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
