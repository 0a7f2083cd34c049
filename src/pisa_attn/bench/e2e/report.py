"""What the numbers say: per-case speed-up, Amdahl bound and its share, boundary cost, the
paper's schedule estimate (:func:`derive`), and the table printed at the end of a run."""

from __future__ import annotations

import platform

import torch

from .. import dit_cases as dc
from .. import e2e_estimates as est
from .stages import blocks_info


def _ms(fw: dict, name: str) -> float | None:
    m = fw.get(name)
    # a row whose only calls were the warm-up (compile and autotune included) is no measurement
    return None if not m or m.get("cold_only") else m["ms"]


def derive(rec: dict, case: dc.Case, full: dc.Case, args) -> dict:
    """Speed-up, Amdahl bound and share, boundary cost and the schedule estimate of one case."""
    fw, a = rec.get("forward_ms", {}), rec.get("attention_call")
    dense, pisa, rest, hooks = (_ms(fw, n) for n in ("dense", "pisa", "no_attention", "no_attention_pisa_hooks"))
    ext = full.blocks / case.blocks
    out: dict = {"blocks": blocks_info(case, full)}
    cold = sorted(n for n, m in fw.items() if isinstance(m, dict) and m.get("cold_only"))
    if cold:
        out["warmup_only"] = cold  # left out of every number below
    calls = rec.get("pisa_calls")
    # apply_pisa keeps calls shorter than min_kv_len dense: a PISA forward none of whose calls went
    # sparse is a dense forward, and a sparse bound or schedule would describe a run that never was
    all_dense = calls is not None and not calls.get("sparse")
    if all_dense:
        out["pisa_ran_dense"] = True
        out["dense_note"] = (f"no PISA call went sparse ({dict(calls)}; min_kv_len "
                             f"{rec.get('pisa_config', {}).get('min_kv_len', '?')}): no sparse bound or schedule")
    elif calls is not None and calls.get("dense"):
        out["sparse_call_share"] = calls["sparse"] / (calls["sparse"] + calls["dense"])
    if a and a.get("cold_only"):
        out["attention_call_cold_only"] = list(a["cold_only"])
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
        out["attention_share_of_dense"] = (dense - rest) / dense
        if rest >= dense:  # attention's share is below the forwards' spread: no bound to give
            out["ideal_bound"] = None
            out["bound_note"] = "the forward without attention was not faster than the dense one"
        else:
            out["ideal_bound"] = dense / rest if rest > 0 else None
        if a and out["ideal_bound"] is not None and not all_dense:
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
    if dense and pisa and a and not all_dense:
        dense_path = a["pisa_dense_path_ms"]
        sched = est.schedule_speedup(
            dense * ext, pisa * ext, steps=args.steps, dense_steps=full.dense_steps,
            dense_layers=min(full.dense_layers, full.blocks),
            dense_layer_extra=dense_path - a["pisa_ms"],
            dense_step_extra=full.blocks * (dense_path - dense_call),
        )  # fmt: skip
        # No schedule beats every step at the forward without attention (attention free): an
        # estimate above that bound comes from call differences below their noise
        limit = out.get("ideal_bound")
        if sched.get("speedup") is not None and limit is not None and sched["speedup"] > limit:
            sched["estimate"], sched["speedup"] = sched["speedup"], None
            sched["note"] = (f"the estimate {sched['estimate']:.2f}x exceeds the bound with attention free "
                             f"({limit:.2f}x): left out")
        out["schedule"] = sched
    return out


def summary(rec: dict) -> str:
    d = rec.get("derived", {})
    parts = []
    for k, fmt in (("speedup", "speed-up {:.2f}x"), ("amdahl_bound", "bound {:.2f}x"), ("share_of_bound", "share {:.0%}"),
                   ("boundary_pct_of_pisa_forward", "boundary {:.2f}%")):  # fmt: skip
        if d.get(k) is not None:
            parts.append(fmt.format(d[k]))
    if d.get("schedule", {}).get("speedup") is not None:
        parts.append(f"{d['schedule']['steps']}-step schedule {d['schedule']['speedup']:.2f}x")
    for k, v in rec.get("rel_l1", {}).items():
        parts.append(f"{k} {v:.4f}")
    return ", ".join(parts) or "no result"


def paper_numbers(case: dc.Case) -> dict | None:
    p = case.paper
    if p is None:
        return None
    return {"speedup": p.speedup, "speedup_no_warmup": p.speedup_no_warmup, "dense_s": p.dense_s, "pisa_s": p.pisa_s,
            "setting": p.setting}  # fmt: skip


def environment(device) -> dict:
    import diffusers

    import pisa_attn

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "pisa_attn": pisa_attn.__version__, "device": str(device)}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return env


def _f(v, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"


def table(results: dict) -> str:
    head = (f"{'stage':<17} {'case':<13} {'tokens':>7} {'blocks':>6} {'dense':>7} {'dense ms':>9} {'PISA ms':>9} {'speedup':>7} "
            f"{'attn r':>6} {'PISA be':>9} {'bound':>6} {'share':>6} {'sched.':>6} {'paper':>11} {'bound.%':>7} {'rel-L1':>7}")  # fmt: skip
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
            for why in (d.get("dense_note"), d.get("bound_note"), d.get("schedule", {}).get("note")):
                if why:
                    notes.append(f"{s['stage']} {c['case']}: {why}")
            if d.get("warmup_only"):
                notes.append(f"{s['stage']} {c['case']}: {', '.join(d['warmup_only'])} timed by their warm-up only "
                             "(compile included): left out")
            a = c.get("attention_call") or {}
            cold = a.get("cold_only")
            if cold:
                notes.append(f"{s['stage']} {c['case']}: attention call ({', '.join(cold)}) timed by its warm-up only "
                             "(compile and autotune included; marked ~): not steady state")
            tokens = c["image_tokens"] + c["joint_text_tokens"]
            lines.append(
                f"{s['stage']:<17} {c['case']:<13} {tokens:>7} {b['measured']:>3}/{b['total']:<2} "
                f"{c.get('dense_backend', '-').removeprefix('_native_')[:7]:>7} "
                f"{_f(d.get('dense_forward_ms'), '.1f', 8)}{star}{_f(d.get('pisa_forward_ms'), '.1f', 8)}{star}"
                f"{_f(d.get('speedup'), '.2f', 6)}x {_f(d.get('attention_ratio'), '.2f', 5)}{'~' if cold else 'x'} "
                f"{'all dense' if d.get('pisa_ran_dense') else a.get('pisa_backend', '-')[:9]:>9} "
                f"{_f(d.get('amdahl_bound'), '.2f', 5)}x "
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
                f"{r['keys']} keys {r['speedup']:.2f}{'~' if r.get('cold_only') else 'x'}" for r in m["rows"]) +
                ("; PISA faster at no length of the sweep" if m["pisa_faster_from_keys"] is None
                 else f"; PISA faster from {m['pisa_faster_from_keys']} keys") +
                f"; default min_kv_len {m['default']}")  # fmt: skip
    lines.append("attn r: one attention call dense/PISA at the model's shape; bound: Amdahl bound with r; share: speed-up / "
                 "bound; sched.: the paper's warm-up schedule over the steps; paper: its speed-ups with / without warm-up; "
                 "bound.%: boundary hooks as % of the PISA forward; PISA be: the PISA kernel backend that ran (reference: "
                 "the PyTorch fallback; all dense: no call went sparse); ~: timed by warm-up calls only")  # fmt: skip
    return "\n".join(lines + notes)
