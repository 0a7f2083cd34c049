"""The bf16 Hopper attend kernel against a copy of an earlier one (``ops/hopper/_before.py``, not
committed: ``git show REV:src/pisa_attn/ops/hopper/attention.py > src/pisa_attn/ops/hopper/_before.py``),
each with its own defaults (the keys' maxima given as the default call gives them), on one top-k
selection per case: keep-or-drop and hybrid, ROUNDS
interleaved rounds (default 8), median and minimum, and whether the outputs and LSE are the same bits.
Cases ``L:source`` (B2-H16-D128 bf16; ``wan720``: a Wan2.1-720p-like B1-H16-L75600 DiT-like head set).

    PYTHONPATH=src OUT=DIR python3 benchmarks/kernel_ab.py   # writes DIR/kernel_ab.json
"""
import inspect
import os
import statistics
import sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E
from pisa_attn import data
from pisa_attn.ops.hopper import attention as gattn
from pisa_attn.ops.hopper import _before as before
rows = []
R = int(os.environ.get("ROUNDS", "8"))


def tail_for(mod, stats):
    """The statistics a kernel reads: a copy from before H̄'s per-head scale takes H̄ itself."""
    if "hscale" in inspect.signature(mod.attention).parameters:
        return stats.tail()
    return stats.kbar, stats.kscale, stats.vbar, (stats.hbar_lp.float() * stats.hscale[..., None, None]).to(q.dtype)



for case in os.environ.get("CASES", "32768:random 32768:dit 65536:random 65536:dit wan720:dit").split():
    L, source = case.split(":")
    if L == "wan720":
        d = data.dit_qkv((21, 45, 80), heads=16, head_dim=128, batch=1, seed=7, dtype=torch.bfloat16, device="cuda")
        q, k, v = d.q, d.k, d.v
    else:
        q, k, v = E.qkv(source, int(L))
    stats, sel, n_sel = E.selection(q, k, v, 0.125)
    fns, outs = {}, {}
    for name, mod in (("now", gattn), ("before", before)):
        for mode in ("drop", "hybrid"):
            out = torch.empty_like(q); lse = torch.empty(q.shape[:3], device="cuda")
            fns[name, mode] = lambda mod=mod, m=mode, out=out, lse=lse: mod.attention(
                q, k, v, *tail_for(mod, stats), *sel, mode=m, scale=128 ** -0.5, block_size=64, n_select=n_sel, out=out,
                lse=lse, kbound=stats.kbound, kmax=getattr(stats, "kmax", None))
            fns[name, mode](); outs[name, mode] = (out, lse)
    torch.cuda.synchronize()
    same = {m: all(torch.equal(a, b) for a, b in zip(outs["now", m], outs["before", m])) for m in ("drop", "hybrid")}
    # where the bits differ: the outputs' rel-L1 to each other (both against float64 are the GPU tests' job)
    diff = {m: ((outs["now", m][0].float() - outs["before", m][0].float()).abs().mean()
                / outs["before", m][0].float().abs().mean()).item() for m in ("drop", "hybrid")}
    ts = {n: [] for n in fns}
    est = 4.6 * (q.shape[0] * q.shape[1] * q.shape[2] ** 2) / (2 * 16 * 32768 ** 2)
    for _ in range(R):
        for n, fn in fns.items():
            ts[n].append(E.ms(fn, est_ms=est))
    for mode in ("drop", "hybrid"):
        a, b = ts["now", mode], ts["before", mode]
        r = dict(case=L, source=source, lk=k.shape[2], mode=mode, now_ms=statistics.median(a),
                 before_ms=statistics.median(b), now_min=min(a), before_min=min(b), now_rounds=a, before_rounds=b,
                 bit_identical=same[mode], rel_l1_now_vs_before=diff[mode])
        rows.append(r)
        print(f"{L:7} {source:6} {mode:6} now {r['now_ms']:.3f} (min {r['now_min']:.3f}) before {r['before_ms']:.3f} "
              f"(min {r['before_min']:.3f}) ratio {r['now_ms'] / r['before_ms']:.3f} / "
              f"{r['now_min'] / r['before_min']:.3f}"
              f" same bits {same[mode]} (rel-L1 {diff[mode]:.1e})", flush=True)
    E.write_rows("kernel_ab.json", rows)
