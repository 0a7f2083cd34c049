"""Performance diagnostics for the kernel notes (GPU): where the time goes and what would move it.

At B-H-D 2-16-128, bf16, 12.5% density, for each length: dense SDPA (cuDNN, flash); each phase;
the attention kernel under every config (autotune set plus per-loop pipelining depths); the kernel
with every query block reading the SAME key blocks; Triton vs torch.topk selection; the copy
bandwidth. Prints a table last and writes JSON to ``--out``.

    PYTHONPATH=src python tests/gpu/diagnose.py --lengths 4096,32768 --out $OUT/diag.json

``--once`` launches every kernel config once, untimed, for Nsight Compute (fixed configs, so set
``PISA_ATTN_AUTOTUNE=0`` to keep autotuning launches out of the report):

    PISA_ATTN_AUTOTUNE=0 ncu --set full -k regex:'_kv_stats|_q_mean|_topk|_attn|gemm' -o $OUT/prof \
        python tests/gpu/diagnose.py --once --lengths 4096,32768
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pisa_attn import spec
from pisa_attn.bench import kernels as bk
from pisa_attn.ops import reference as ref
from pisa_attn.ops.triton import attention as attn
from pisa_attn.ops.triton import prepare as prep
from pisa_attn.ops.triton import select as sel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the selection mask helper
from selection_masks import idx_to_mask  # noqa: E402

CONFIGS = [dict(C=c, num_warps=4, num_stages=s) for c, s in ((64, 2), (64, 3), (32, 2))] + [
    dict(C=c, num_warps=4, num_stages=2, S_EXACT=3, S_TAIL=t) for c, t in ((64, 2), (64, 1), (32, 2))
]


def copy_bandwidth() -> float:
    x = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")  # 512 MB
    y = torch.empty_like(x)
    ms = bk.bench_ms(lambda: y.copy_(x), 50)
    return 2 * x.numel() / ms / 1e9  # TB/s, read + write


def run_length(length: int, density: float, rep: float, once: bool = False) -> dict:
    cfg = bk.Config(2, 16, 128)
    res = {"length": length, "density": density}
    if not once:
        res.update(bk.bench_dense(cfg, length, torch.bfloat16, "bhsd", rep))
    q, k, v = bk._inputs(cfg, length, torch.bfloat16, "bhsd")
    plan = bk._plan(q, k, density, "hybrid")
    res["n_select"] = plan.n_select
    stats = prep.prepare(q, k, v, 64)
    width = spec.selection_width(plan.n_kv_blocks, plan.n_select)
    kw = dict(n_select=plan.n_select, width=width, scale=plan.scale)
    idx, cnt, bits = sel.select(stats.qmean, stats.kmean, **kw)
    if once:
        return _attention_configs(res, q, k, v, stats, plan, idx, cnt, bits, rep, once)
    res["t_prepare"] = bk.bench_ms(lambda: prep.prepare(q, k, v, 64), rep)
    res["t_prepare_cov"] = bk.bench_ms(lambda: prep.prepare(q, k, v, 64, with_hdev=True), rep)
    res["t_select"] = bk.bench_ms(lambda: sel.select(stats.qmean, stats.kmean, **kw), rep)
    for warps in (1, 2, 4, 8):  # top-k program width (rows spread over fewer warps: fewer barriers)
        old = sel.TOPK_WARPS["warps"]
        sel.TOPK_WARPS["warps"] = warps
        res[f"t_select_w{warps}"] = bk.bench_ms(lambda: sel.select(stats.qmean, stats.kmean, **kw), rep)
        sel.TOPK_WARPS["warps"] = old
    # The reference's chunked torch.topk selection (the kernels' path past MAX_FUSED_BLOCKS).
    res["t_select_torch"] = bk.bench_ms(lambda: ref.select(stats.qmean, stats.kmean, scratch_elems=1 << 24, **kw), rep)
    t_idx, t_cnt, _ = ref.select(stats.qmean, stats.kmean, scratch_elems=1 << 24, **kw)
    a, b_ = idx_to_mask(idx, cnt, plan.n_kv_blocks), idx_to_mask(t_idx, t_cnt, plan.n_kv_blocks)
    res["select_agreement"] = (a & b_).sum().item() / b_.sum().item()
    return _attention_configs(res, q, k, v, stats, plan, idx, cnt, bits, rep, once)


def _attention_configs(res, q, k, v, stats, plan, idx, cnt, bits, rep, once):
    def att(mode, ii=idx, cc=cnt, bb=bits, config=None):
        return lambda: attn.attention(q, k, v, *stats.tail(), ii, cc, bb, mode=mode,
                                      scale=plan.scale, block_size=64, n_select=plan.n_select, config=config)

    for mode in ("drop", "hybrid"):
        for c in CONFIGS:
            if mode == "drop" and (c["C"] == 32 or "S_TAIL" in c):
                continue
            name = f"attn_{mode}_C{c['C']}_w{c['num_warps']}_s{c['num_stages']}"
            if "S_EXACT" in c:
                name += f"_e{c['S_EXACT']}t{c['S_TAIL']}"
            try:
                att(mode, config=c)()
                res[name] = None if once else bk.bench_ms(att(mode, config=c), rep)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for one config
                res[name] = None
                res[name + "_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    # Where the hybrid-minus-drop time goes: the tail scan alone (empty exact sets), zeroth order.
    tail_cfg = dict(C=64, num_warps=4, num_stages=2, S_EXACT=3, S_TAIL=2)
    none_cnt, none_bits = torch.zeros_like(cnt), torch.zeros_like(bits)
    for mode in ("hybrid", "zeroth"):
        for name, fn in ((f"attn_{mode}_best", att(mode, config=tail_cfg)),
                         (f"attn_{mode}_tail_only", att(mode, idx, none_cnt, none_bits, config=tail_cfg))):
            fn()
            res[name] = None if once else bk.bench_ms(fn, rep)
    if once:
        return res
    same_idx = idx[:, :, :1].expand_as(idx).contiguous()  # every query block reads one list
    same_bits = bits[:, :, :1].expand_as(bits).contiguous()
    res["attn_drop_same_list"] = bk.bench_ms(att("drop", same_idx, cnt, same_bits, config=dict(C=64, num_warps=4, num_stages=2)), rep)
    # FLOPs of the exact part: 4 * rows * keys * D per head
    exact_flops = 4 * 2 * 16 * res["length"] * plan.n_select * 64 * 128
    drop_times = [v_ for k_, v_ in res.items() if k_.startswith("attn_drop_C") and isinstance(v_, float)]
    if drop_times:
        res["exact_tflops_drop_best"] = exact_flops / min(drop_times) / 1e9
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="32768")
    p.add_argument("--density", type=float, default=0.125)
    p.add_argument("--rep-ms", type=float, default=50.0)
    p.add_argument("--out", default=None)
    p.add_argument("--once", action="store_true", help="launch each kernel config once, untimed (for ncu)")
    args = p.parse_args()
    env = bk.environment()
    if not args.once:
        env["copy_tbps"] = copy_bandwidth()
    print(env, flush=True)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        t0 = time.time()
        r = run_length(length, args.density, args.rep_ms, args.once)
        r["wall_s"] = time.time() - t0
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": env, "rows": rows}, f, indent=1)
    print("\n=== diagnose summary (ms) ===")
    keys = sorted({k for r in rows for k in r if isinstance(r.get(k), float)})
    for key in keys:
        print(f"{key:32s} " + " ".join(f"{r.get(key, float('nan')):10.4f}" for r in rows))


if __name__ == "__main__":
    main()
