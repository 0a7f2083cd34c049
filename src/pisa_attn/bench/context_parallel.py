"""PISA under diffusers context parallelism: 1 GPU vs N GPUs on Wan2.1-shaped transformers.

Random weights (seeded, identical on every rank), bf16, one transformer forward at a sparse step
(``dense_steps=0``; the model's 1 dense warm-up layer stays). Shapes:

* ``wan1.3b-480p``: Wan2.1-1.3B, 480p 81 frames (latent 21x60x104 -> 32,760 tokens), 12 heads x 128;
* ``wan14b-720p``: Wan2.1-14B, 720p 81 frames (latent 21x90x160 -> 75,600 tokens), 40 heads x 128,
  40 layers (``--layers N`` builds N; see below).

Per shape, rank 0 first runs PISA on its GPU alone (the baseline, and the reference output); then
all ranks run each context-parallel kind on the same model: ``ring`` (ring x N on the kernels),
``ulysses`` (Ulysses x N) and ``unified`` (Ulysses 2 x ring N/2, N >= 4). Each row gives the
median forward time, the speed-up over 1-GPU PISA and the difference from its output, and one
extra forward under :func:`pisa_attn.parallel.phases.record` splits the time per rank (mean over
ranks, ms per forward): ``attend`` (kernel time of the attention partials, or of the whole PISA call
under Ulysses), ``wait`` (the compute stream stalled on ring transfers the attend did not hide),
``merge``, ``stats`` (prepare + the one all-gather of statistics), ``select``, ``redist`` (token
moves to block-aligned shards and back), ``a2a`` / ``permute`` (Ulysses), ``other`` (the rest of
the forward: linear layers, norms, diffusers' own split/gather). ``calls`` counts kernel attends
per forward (ring: layers x N per query group).

Before the parallel rows, rank 0 times the kernels alone for one layer (``kernel split``): this
rank's share of the queries against all keys in one attend, against the N key shards in N
attends, and the merge: what splitting the keys costs the kernels, without communication.

``--dense`` adds two yardsticks: dense attention on 1 GPU and with diffusers' own Ulysses (the
difference any context parallelism shows in bf16, and the scale of PISA's own approximation).

Every stage has its own time limit (``--stage-limit``, warm-up included) and the whole run a
budget (``--total-limit``). A timed forward (or the phase forward) starts only when one more
forward of the mean time fits both; a forward in flight is never cut. What the limits did is kept
per row (``limits``: timed forwards asked and run, which limit cut them, whether the phase split
was recorded) and printed as ``note:`` lines under the table; a stage that would not start at all
is listed as skipped. Rank 0 rewrites ``bench_parallel.json`` in ``--out`` (default ``$OUT`` or ``.``)
after every stage and prints a short table last.

    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py                 # wan1.3b-480p
    torchrun --nproc-per-node 4 benchmarks/bench_parallel.py                 # wan14b-720p
    python benchmarks/bench_parallel.py --tiny                               # CPU check: 2 gloo ranks, tiny Wan

(``benchmarks/bench_parallel.py`` is this module's device script.)

``--layers N`` (fewer transformer blocks, same shapes): times are then N-layer forwards; the
attention's share is that of the full model except that the one dense layer weighs 1/N instead of
1/L, and the fixed part (patch/text/time embedding, output projection, diffusers' split and
gather) is the same, so a full-model time is about ``t_N + (L - N) * (t_N - t_fixed) / (N - 1)``;
the JSON keeps ``layers`` and ``full_layers`` for that.

NCCL runs as the machine configures it (NVLink multicast stays off: this script never touches
NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST or NVSHMEM_DISABLE_NVLS; torchrun passes the
environment to every rank).
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

from .. import spec
from .._files import write_replacing
from . import argtypes as at
from .model_configs import WAN_1_3B, WAN_14B, WAN_TINY

# name -> (diffusers config, latent (frames, height, width), text tokens)
SHAPES = {
    "wan1.3b-480p": (WAN_1_3B, (21, 60, 104), 512),
    "wan14b-720p": (WAN_14B, (21, 90, 160), 512),
}
TINY = (WAN_TINY, (3, 12, 20), 8)
KINDS = ("ulysses", "ring", "unified")
NVLS_SWITCHES = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")  # recorded, never set
PHASES = ("attend", "wait", "merge", "stats", "select", "redist", "a2a", "permute")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_parallel.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU: tiny Wan, gloo ranks (spawned unless under torchrun)")
    p.add_argument("--shapes", default=None,
                   help=f"comma list of {sorted(SHAPES)}; default: wan1.3b-480p on 2 GPUs, wan14b-720p on 4+")
    p.add_argument("--kinds", default=None, help="comma list of ulysses, ring, unified (default: all that fit N)")
    p.add_argument("--layers", type=at.int_at_least(2), default=None, help="transformer blocks to build, >= 2: the first is PISA's dense warm-up layer (default: the model's)")
    p.add_argument("--dense", action="store_true", help="also dense attention on 1 GPU and under diffusers' Ulysses")
    p.add_argument("--density", type=at.density, default=0.15)
    p.add_argument("--mode", default="hybrid", choices=spec.MODES)
    p.add_argument("--iters", type=at.int_at_least(1), default=3, help="timed forwards per configuration")
    p.add_argument("--warmup", type=at.int_at_least(0), default=1, help="untimed forwards first (Triton compile, autotune)")
    p.add_argument("--no-phases", action="store_true", help="skip the extra forward that splits the time")
    p.add_argument("--no-split", action="store_true", help="skip the one-GPU kernel split (1 attend vs N shards)")
    p.add_argument("--stage-limit", type=at.positive_float, default=180.0, help="seconds per stage (cuts timed iterations)")
    p.add_argument("--total-limit", type=at.positive_float, default=540.0, help="seconds for the whole run (skips stages)")
    p.add_argument("--world", type=at.int_at_least(2), default=2, help="ranks to spawn with --tiny outside torchrun")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for bench_parallel.json")
    args = p.parse_args(argv)
    if args.shapes is not None:
        args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        bad = [s for s in args.shapes if s not in SHAPES]
        if bad or not args.shapes:
            p.error(f"--shapes must name some of {sorted(SHAPES)}, got {args.shapes}")
    if args.kinds is not None:
        args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        bad = [k for k in args.kinds if k not in KINDS]
        if bad or not args.kinds:
            p.error(f"--kinds must name some of {KINDS}, got {args.kinds}")
    return args


# --- setup ---------------------------------------------------------------------------------------
def _setup(args):
    """Device and dtype of this rank (the process group is already initialised)."""
    if args.tiny:  # the test-only CPU patch for diffusers' context parallelism lives with the tests
        tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests")
        if not os.path.isfile(os.path.join(tests, "cpu_context_parallel.py")):
            raise SystemExit("bench_parallel.py: error: --tiny needs the repository's tests/ (a source checkout)")
        sys.path.insert(0, tests)
        from cpu_context_parallel import allow_cpu_context_parallel

        allow_cpu_context_parallel()
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        raise SystemExit("bench_parallel.py: error: needs CUDA GPUs (or --tiny for the CPU check)")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local), torch.bfloat16


def _inputs(shape, device, dtype) -> dict:
    cfg, (f, h, w), n_text = shape
    g = torch.Generator().manual_seed(1)  # CPU generator: identical inputs on every rank and device
    return dict(
        hidden_states=torch.randn(1, cfg["in_channels"], f, h, w, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(1, n_text, cfg["text_dim"], generator=g).to(device, dtype),
        timestep=torch.tensor([500.0], device=device),
        return_dict=False,
    )


def _model(shape, device, dtype, layers):
    from diffusers import WanTransformer3DModel

    cfg = dict(shape[0])
    if layers is not None:
        cfg["num_layers"] = layers
    torch.manual_seed(0)  # same weights on every rank
    with torch.device(device):
        model = WanTransformer3DModel(**cfg).eval()
    # As from_pretrained(torch_dtype=...) loads it: the model's float32-sensitive modules stay float32.
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        if not keep.intersection(name.split(".")):
            p.data = p.data.to(dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the float32 originals: free them for the activations at 75K tokens
    return model


def _pisa(model, args, on: bool):
    from pisa_attn.diffusers import apply_pisa, remove_pisa

    if not on:
        return remove_pisa(model)
    extra = dict(block_size=16, min_kv_len=0) if args.tiny else {}
    return apply_pisa(model, density=args.density, mode=args.mode, dense_steps=0, **extra)


def _parallel(model, kind: str | None, world: int):
    """Switch the model's context parallelism to ``kind`` (None: off). diffusers applies it once
    per model; switching removes its hooks and config first, so one model serves every row."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import remove_context_parallel

    if getattr(model, "_parallel_config", None) is not None:
        remove_context_parallel(model, model._cp_plan)
        model._parallel_config = None
        for m in model.modules():
            proc = getattr(m, "processor", None)
            if proc is not None and hasattr(proc, "_parallel_config"):
                proc._parallel_config = None
    if kind is None:
        return
    degrees = {"ulysses": dict(ulysses_degree=world), "ring": dict(ring_degree=world),
               "unified": dict(ulysses_degree=2, ring_degree=world // 2)}[kind]  # fmt: skip
    model.enable_parallelism(config=ContextParallelConfig(**degrees))


def _label(kind: str, world: int) -> str:
    return {"ulysses": f"ulysses x{world}", "ring": f"ring x{world}", "unified": f"ulysses2 x ring{world // 2}"}[kind]


# --- timing --------------------------------------------------------------------------------------
class Clock:
    """Stage and run budgets; every decision is rank 0's, broadcast, so all ranks agree."""

    def __init__(self, args, device):
        self.args, self.device, self.t0 = args, device, time.monotonic()

    def left(self) -> float:
        return self.args.total_limit - (time.monotonic() - self.t0)

    def agree(self, flag: bool, group=None) -> bool:
        if group is False:  # rank 0 alone
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(t, src=0)
        return bool(t.item())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward(model, inputs, device) -> tuple[torch.Tensor, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = model(**inputs)[0]
    _sync(device)
    return out, (time.perf_counter() - t0) * 1e3


def _left(args, clock: Clock, start: float) -> tuple[float, str]:
    """Seconds this stage may still use, and the limit that sets them (the stage's or the run's)."""
    stage = args.stage_limit - (time.monotonic() - start)
    total = clock.left()
    if stage <= total:
        return stage, f"the stage limit (--stage-limit {args.stage_limit:g} s)"
    return total, f"the run's budget (--total-limit {args.total_limit:g} s)"


def _run_stage(model, inputs, args, clock: Clock, alone: bool, phases: bool):
    """Warm-up, timed forwards (as many of ``--iters`` as fit the stage limit and the run's
    budget), then one forward under the phase recorder (when it fits too). ``alone``: rank 0 only
    (no collective decisions). Returns the output, the times (ms), the phase split (or None) and
    what the limits did (``limits``: kept in the row and printed under the table)."""
    from pisa_attn.parallel import phases as ph

    start, times, out = time.monotonic(), [], None
    group = False if alone else None
    limits = dict(iters_asked=args.iters, iters_run=0, iters_cut_by=None,
                  phases="recorded" if phases else "not asked")
    for _ in range(args.warmup):
        out, _ = _forward(model, inputs, clock.device)
    for i in range(args.iters):
        if i:
            left, which = _left(args, clock, start)
            if not clock.agree(statistics.mean(times) / 1e3 < left, group):  # times in ms, limits in s
                limits["iters_cut_by"] = which
                break
        if not alone:
            dist.barrier()
        out, ms = _forward(model, inputs, clock.device)
        times.append(ms)
    limits["iters_run"] = len(times)
    split = None
    if phases:
        left, which = _left(args, clock, start)
        if clock.agree(statistics.mean(times) / 1e3 < left, group):
            with ph.record() as rec:
                _, ms = _forward(model, inputs, clock.device)
            split = dict(rec.totals(), forward=ms, calls=rec.counts().get("attend", 0))
        else:
            limits["phases"] = f"cut by {which}"
    return out, times, split, limits


def kernel_split(shape, world: int, args, device, dtype, reps: int = 5) -> dict:
    """On one GPU, what the ring asks of the kernels for one layer of this shape: this rank's
    queries (1/N of the sequence, all heads) against all keys in ONE attend, against the N key
    shards in N attends (the global selection restricted to each), and the merge of the N
    partials. Random q/k/v (the time does not depend on the values); CUDA-event median of ``reps``."""
    from pisa_attn.attention import get_backend, make_plan
    from pisa_attn.ops.merge import merge

    cfg, (f, h, w), _ = shape
    heads, d, bs = cfg["num_attention_heads"], cfg["attention_head_dim"], 16 if args.tiny else 64
    n = f * (h // 2) * (w // 2)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, -(-n // world), d, generator=g, device=device).to(dtype)
    k, v = (torch.randn(1, heads, n, d, generator=g, device=device).to(dtype) for _ in range(2))
    plan = make_plan(q, k, args.density, bs, args.mode, False, None, "auto")
    be = get_backend(plan.backend)
    stats = be.prepare(q, k, v, bs)
    width = min(plan.n_kv_blocks, plan.n_select)
    sel = be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=width, scale=plan.scale)
    nk = plan.n_kv_blocks
    bounds = [r * nk // world for r in range(world)] + [nk]
    shards = [(k[:, :, a * bs : b * bs], v[:, :, a * bs : b * bs], stats.blocks(a, b).with_hbar(stats.hbar),
               sel.blocks(a, b), max(1, round(plan.n_select * (b - a) / nk))) for a, b in zip(bounds, bounds[1:])]
    kw = dict(mode=args.mode, scale=plan.scale, block_size=bs)

    def one():
        return be.attend(q, k, v, stats, sel, n_select=plan.n_select, **kw)

    def parts():
        return [be.attend(q, ks, vs, st, se, n_select=ns, **kw) for ks, vs, st, se, ns in shards]

    held = parts()

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    return dict(backend=plan.backend, queries=q.shape[2], keys=n, shards=world, attend_one_ms=timed(one),
                attend_shards_ms=timed(parts), merge_ms=timed(lambda: merge(held, out_dtype=dtype)))


def _split_summary(splits: list[dict]) -> dict:
    """Mean over ranks of each phase; ``other`` = forward minus the phases."""
    keys = sorted({k for s in splits for k in s})
    mean = {k: statistics.mean(s.get(k, 0.0) for s in splits) for k in keys}
    mean["other"] = mean["forward"] - sum(mean.get(k, 0.0) for k in PHASES)
    mean["forward_max"] = max(s["forward"] for s in splits)
    return mean


def _row(config: str, times: list[float], out=None, ref=None, base_ms=None, split=None, limits=None) -> dict:
    row = dict(config=config, ms=statistics.median(times), times_ms=times, limits=limits)
    if ref is not None:
        diff = (out.float() - ref.float()).abs()
        row.update(
            speedup=base_ms / row["ms"], max_abs_diff=float(diff.max()),
            rel_l1=float(diff.sum() / ref.float().abs().sum()), finite=bool(torch.isfinite(out).all()),
        )  # fmt: skip
    if split is not None:
        row["phases_ms"] = split
    return row


# --- the benchmark -------------------------------------------------------------------------------
def _fits(kind: str, heads: int, world: int) -> bool:
    """Ulysses splits heads (all of them over N ranks, or over 2 in the unified grid)."""
    if kind == "ulysses":
        return heads % world == 0
    if kind == "unified":
        return world >= 4 and world % 2 == 0 and heads % 2 == 0
    return True


def _default_kinds(world: int) -> list[str]:
    kinds = ["ulysses", "ring"]
    if world >= 4 and world % 2 == 0:
        kinds.append("unified")
    return kinds


def bench_shape(name: str, shape, rank: int, world: int, args, clock: Clock, device, dtype, emit) -> dict:
    """All rows of one shape; ``emit(res)`` is called by rank 0 after every stage."""
    cfg, (f, h, w), n_text = shape
    heads = cfg["num_attention_heads"]
    kinds = args.kinds or _default_kinds(world)
    res = dict(
        shape=name, latent=[f, h, w], tokens=f * (h // 2) * (w // 2), text_tokens=n_text, heads=heads,
        head_dim=cfg["attention_head_dim"], layers=args.layers or cfg["num_layers"], full_layers=cfg["num_layers"],
        rows=[], skipped=[],
    )  # fmt: skip
    inputs = _inputs(shape, device, dtype)
    model = _model(shape, device, dtype, args.layers)
    refs, base = {}, {}
    baselines = ([False] if args.dense else []) + [True]
    with torch.no_grad():
        # 1 GPU: rank 0 alone (the others wait at the barrier).
        for pisa in baselines:
            label = f"{'pisa' if pisa else 'dense'} 1 GPU"
            if not clock.agree(clock.left() > 0):
                res["skipped"].append(label)
                continue
            if rank == 0:
                _pisa(model, args, pisa)
                refs[pisa], times, _, limits = _run_stage(model, inputs, args, clock, alone=True, phases=False)
                base[pisa] = statistics.median(times)
                res["rows"].append(_row(label, times, limits=limits))
                emit(res)
            dist.barrier()
        if not args.no_split and clock.agree(clock.left() > 0):
            if rank == 0:
                res["kernel_split"] = kernel_split(shape, world, args, device, dtype)
                emit(res)
            dist.barrier()
        runs = [(True, kind) for kind in kinds] + ([(False, "ulysses")] if args.dense else [])
        for pisa, kind in runs:
            label = f"{'pisa' if pisa else 'dense'} {_label(kind, world)}"
            go = rank != 0 or (_fits(kind, heads, world) and pisa in refs and clock.left() > 0)
            if not clock.agree(go):
                res["skipped"].append(label)
                continue
            _pisa(model, args, pisa)
            _parallel(model, kind, world)
            out, times, split, limits = _run_stage(model, inputs, args, clock, alone=False,
                                                   phases=pisa and not args.no_phases)
            _parallel(model, None, world)
            splits = [None] * world
            dist.all_gather_object(splits, split)
            if rank == 0:
                summary = _split_summary(splits) if split is not None else None
                res["rows"].append(_row(label, times, out, refs[pisa], base[pisa], summary, limits))
                emit(res)
    if rank == 0 and True in refs and False in refs:
        res["pisa_vs_dense_1gpu_max_abs"] = float((refs[True].float() - refs[False].float()).abs().max())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def bench_rank(rank: int, world: int, args) -> dict | None:
    """Run every requested shape on an initialised process group; rank 0 returns the results."""
    device, dtype = _setup(args)
    clock = Clock(args, device)
    shapes = [("tiny", TINY)] if args.tiny else [(s, SHAPES[s]) for s in (args.shapes or _default_shapes(world))]
    res = dict(
        benchmark="bench_parallel", world=world, dtype=str(dtype).replace("torch.", ""), density=args.density,
        mode=args.mode, iters=args.iters, warmup=args.warmup,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        **_versions(device), nccl_env={k: os.environ.get(k) for k in NVLS_SWITCHES},
        shapes=[],
    )  # fmt: skip

    def emit(partial):  # rank 0 rewrites the JSON after every stage: a cut-off run keeps its rows
        if rank == 0:
            _write(dict(res, shapes=res["shapes"] + [partial]), args)

    for name, shape in shapes:
        res["shapes"].append(bench_shape(name, shape, rank, world, args, clock, device, dtype, emit))
        if rank == 0:
            _write(res, args)
    return res if rank == 0 else None


def _versions(device) -> dict:
    """The versions a result depends on (None where this machine has none)."""
    import pisa_attn

    try:
        import diffusers
    except ImportError:  # recorded as absent; the forwards themselves need it
        diffusers = None
    cuda = device.type == "cuda"
    nccl = torch.cuda.nccl.version() if cuda and dist.is_nccl_available() else None
    return dict(
        torch=torch.__version__, triton=_triton_version(), pisa_attn=pisa_attn.__version__,
        diffusers=diffusers and diffusers.__version__, cuda=torch.version.cuda if cuda else None,
        cudnn=torch.backends.cudnn.version() if cuda else None,
        nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
    )  # fmt: skip


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _default_shapes(world: int) -> list[str]:
    return ["wan1.3b-480p"] if world < 4 else ["wan14b-720p"]


def table(res: dict) -> str:
    lines = [f"PISA context parallelism, {res['world']} ranks, {res['device']}, torch {res['torch']}, "
             f"triton {res.get('triton')}, {res['dtype']}, density {res['density']} {res['mode']}"]  # fmt: skip
    cols = ("attend", "wait", "merge", "stats", "select", "redist", "a2a", "other")
    for sh in res["shapes"]:
        lines.append(
            f"{sh['shape']}: {sh['tokens']} tokens, {sh['heads']} heads x {sh['head_dim']}, "
            f"{sh['layers']}/{sh['full_layers']} layers"
            + (f"; skipped: {', '.join(sh['skipped'])}" if sh["skipped"] else "")
        )
        lines.append(f"  {'config':<24}{'ms':>9}{'speedup':>8}{'max|d|':>9}{'relL1':>9}  "
                     + "".join(f"{c:>8}" for c in cols) + f"{'calls':>6}")  # fmt: skip
        ks = sh.get("kernel_split")
        if ks:
            extra = ks["attend_shards_ms"] / ks["attend_one_ms"] - 1
            lines.append(f"  kernel split ({ks['backend']}, one layer, {ks['queries']} queries x {ks['keys']} keys): "
                         f"1 attend {ks['attend_one_ms']:.2f} ms, {ks['shards']} shard attends "
                         f"{ks['attend_shards_ms']:.2f} ms ({extra:+.0%}), merge {ks['merge_ms']:.2f} ms")
        for r in sh["rows"]:
            sp = ("",) * 3
            if "speedup" in r:
                sp = (f"{r['speedup']:.2f}x", f"{r['max_abs_diff']:.3g}", f"{r['rel_l1']:.2e}")
            ph = r.get("phases_ms") or {}
            parts = "".join(f"{ph[c]:>8.1f}" if c in ph else f"{'':>8}" for c in cols)
            calls = f"{int(ph['calls']):>6}" if "calls" in ph else ""
            lines.append(f"  {r['config']:<24}{r['ms']:>9.1f}{sp[0]:>8}{sp[1]:>9}{sp[2]:>9}  {parts}{calls}")
        lines += [f"  note: {n}" for n in limit_notes(sh)]
    return "\n".join(lines)


def limit_notes(shape_result: dict) -> list[str]:
    """One line per row whose timed forwards or phase forward a time limit cut."""
    notes = []
    for r in shape_result["rows"]:
        lim = r.get("limits") or {}
        if lim.get("iters_cut_by"):
            notes.append(f"{r['config']}: {lim['iters_run']} of {lim['iters_asked']} timed forwards, "
                         f"{lim['iters_cut_by']} cut the rest")
        if str(lim.get("phases", "")).startswith("cut"):
            notes.append(f"{r['config']}: no per-phase split, {lim['phases']}")
    return notes


def _write(res: dict, args) -> None:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_parallel.json")

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(res, fh, indent=2)

    write_replacing(path, write)


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
            raise SystemExit("bench_parallel.py: error: launch with torchrun --nproc-per-node N "
                             "(or use --tiny for the CPU check)")
        from pisa_attn.parallel.launch import run_local

        res = run_local(_spawned, args.world, args)[0]
    if res is not None:
        _write(res, args)
        print(table(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
