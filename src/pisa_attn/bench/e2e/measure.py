"""What the benchmark measures per case: one attention call at the model's exact shape (every
dense backend, PISA's sparse and dense paths), the boundary gathers, and the forwards of the eager
and compiled variants."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import replace

import torch

from ...metrics import rel_l1
from .. import dit_cases as dc
from .. import e2e_estimates as est
from .backends import dense_backend, family_adapter, pisa_applied, routed, sequence, stacked
from .report import derive, summary
from .runner import Stage, log
from .stages import probe_s


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
    dense, cold = {}, []  # cold: what only warm-up calls timed (compile and autotune included)
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
            if m["cold_only"]:
                cold.append(name)
        except Exception as e:  # a backend this machine lacks (package, GPU arch, mask support)
            dense[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    timed = {n: t for n, t in dense.items() if isinstance(t, float)}
    if not timed:
        raise RuntimeError(f"no dense attention backend ran: {dense}")
    order = sorted(timed, key=timed.get)
    best = order[0]
    lens = None if mask is None else key_lengths(mask, 1, seq.length)
    settings = PisaSettings(density=case.density, mode=args.mode, covariance_aware=cov, block_size=args.block_size,
                            layout="bshd", precision=args.precision)
    plans: dict = {}  # planned once, as apply_pisa does per call shape
    pisa, _ = stage.measure(lambda: sparse_attention(q, k, v, seq, lens, settings, plans=plans), **kw)
    path, _ = stage.measure(lambda: dense_attention(q, k, v, mask, None, False), **kw)
    cold += [n for n, m in (("pisa", pisa), ("pisa_dense_path", path)) if m["cold_only"]]
    return {
        "cold_only": cold,
        "tokens": seq.length,
        "dense_ms": dense,
        "dense_backend": best,
        "dense_order": order,
        "pisa_ms": pisa["ms"],
        "pisa_backend": _choose_backend("auto", q.transpose(1, 2), args.mode, args.block_size, args.precision),
        "pisa_dense_path_ms": path["ms"],
        "speedup": timed[best] / pisa["ms"],
    }


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
    guess = est.forward_seconds(case)
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

    r = stage.step(rec, "dense", n_fwd * guess["dense"], lambda: first_dense(a["dense_order"], dense, rec, "dense"))
    if r is not None:
        best, (fw["dense"], outs["dense"]) = r
        stage.calibration = fw["dense"]["ms"] / 1e3 / guess["dense"]
    rec["dense_backend"] = best
    cal = stage.calibration
    pisa_est = cal * (guess["rest"] + guess["attention"] / a["speedup"])

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
        with dense_backend(model, best), routed(model), boundary_shapes(model, shapes):
            return stage.measure(forward_fn(model, x), **forward_kw(args))[0]

    m = stage.step(rec, "no_attention", n_fwd * cal * guess["rest"], no_attention)
    if m is not None:
        fw["no_attention"] = m

    def hooks_only():
        with dense_backend(model, best), pisa_applied(model, case, args), routed(model):
            return stage.measure(forward_fn(model, x), **forward_kw(args))[0]

    m = stage.step(rec, "no_attention_pisa_hooks", n_fwd * cal * guess["rest"], hooks_only)
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
    guess = est.forward_seconds(case)
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

    r = stage.step(rec, "eager_dense", guess["dense"], lambda: first_dense(order, eager_dense, rec, "eager dense"))
    if r is not None:
        name, (eager["dense"], outs["eager_dense"]) = r
        order.remove(name)
        order.insert(0, name)
        stage.calibration = eager["dense"] / 1e3 / guess["dense"]
    cal = stage.calibration
    pisa_est = cal * (guess["rest"] + guess["attention"] / a["speedup"])

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
        "pisa": lambda backend: stacked(dense_backend(model, backend), pisa_applied(model, case, args)),
        "no_attention": lambda backend: stacked(dense_backend(model, backend), routed(model)),
    }
    variants = {"dense": cal * guess["dense"], "pisa": pisa_est, "no_attention": cal * guess["rest"]}
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
                     "pisa_ms": a["pisa_ms"], "speedup": a["speedup"],
                     "cold_only": bool({a["dense_backend"], "pisa"} & set(a["cold_only"]))})  # fmt: skip
    faster = [r["speedup"] > 1 for r in rows]
    crossover = None
    for i in range(len(rows)):
        if all(faster[i:]):
            crossover = rows[i]["keys"]
            break
    rec["min_kv_len"] = {"default": DEFAULT_MIN_KV_LEN, "rows": rows, "pisa_faster_from_keys": crossover}
    log(f"{stage.name}: min_kv_len sweep: {[(r['keys'], round(r['speedup'], 2)) for r in rows]}; PISA faster from "
        f"{crossover} keys (default min_kv_len {DEFAULT_MIN_KV_LEN})")  # fmt: skip
