"""The end-to-end benchmark's run: every chosen stage in order, each within its budget, the JSON
rewritten after every step, the table last (``benchmarks/bench_e2e.py`` is its device script)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback

import torch

from ..._files import write_replacing
from .. import dit_cases as dc
from .backends import QuietBackendWarning
from .measure import compiled_case, eager_case, min_kv_sweep, stage_dtype
from .report import derive, environment, paper_numbers, table
from .runner import Stage, StageTimeout, alarm, free, log
from .stages import DENSE_BACKENDS, STAGES, blocks_info, build_s, estimate_seconds, parse_args, stage_cases


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
                        "mode": args.mode, "blocks": blocks_info(case, full), "paper": paper_numbers(full)}  # fmt: skip
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


def main(argv=None) -> int:
    args = parse_args(argv)
    # diffusers warns on every set_attention_backend call, one per forward here.
    logging.getLogger("diffusers.models.modeling_utils").addFilter(QuietBackendWarning())
    if args.estimate:
        total = 0.0
        for name in args.stage_list:
            s = estimate_seconds(name, args)
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
        "settings": {"mode": args.mode, "precision": args.precision, "block_size": args.block_size, "steps": args.steps, "warmup": args.warmup,
                     "min_kv_len": args.min_kv_len,
                     "compile_backend": args.compile_backend, "dense_backends_tried": DENSE_BACKENDS[device.type]},
        "estimate_s": {n: round(estimate_seconds(n, args)) for n in args.stage_list},
        "planning": {},  # measured / estimated compile time, once a compile ran
        "stages": [],
    }  # fmt: skip

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(results, fh, indent=1, default=str)

    def save() -> None:
        write_replacing(path, write)

    run_deadline = time.monotonic() + args.total_budget_s
    log(f"stages {', '.join(args.stage_list)}; estimated {results['estimate_s']}; run budget {args.total_budget_s:.0f} s")
    for name in args.stage_list:
        run_stage(name, args, device, results, save, run_deadline)
    save()
    print(f"wrote {path}")
    print(table(results))
    return 0
