"""The Triton attention and prepare kernels against copies of earlier ones, in one process: the
statistics and outputs bit for bit, and interleaved timings (5 rounds of 10 calls, medians) at
B2-H16-D128 bf16, 12.5 %, keep-or-drop and hybrid, 32K (both layouts) and 8K. The copies are not
committed:

    git show REV:src/pisa_attn/ops/triton/attention.py > src/pisa_attn/ops/triton/_before_attention.py
    git show REV:src/pisa_attn/ops/triton/prepare.py > src/pisa_attn/ops/triton/_before_prepare.py
    PYTHONPATH=src OUT=DIR python3 benchmarks/row_offsets_ab.py     # writes DIR/int64_ab.json
"""
import json
import os
import statistics

import torch
from pisa_attn.ops.triton import attention as new_a, prepare as new_p
from pisa_attn.ops.triton import _before_attention as old_a, _before_prepare as old_p
from pisa_attn.ops.triton import select as tsel
from pisa_attn import spec

def t_ms(fn, reps=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps

rows = []
for L, layout in ((32768, "bhsd"), (32768, "bshd"), (8192, "bhsd")):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 16, L, 128) if layout == "bhsd" else (2, L, 16, 128)
    q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    st_new = new_p.prepare(q, k, v, 64)
    st_old = old_p.prepare(q, k, v, 64)
    same_stats = all(torch.equal(getattr(st_new, f), getattr(st_old, f)) for f in ("qmean", "kmean", "kbar", "vbar", "hbar_lp", "hscale"))
    nk = -(-L // 64); n_sel = spec.num_selected(0.125, nk)
    sel = tsel.select(st_new.qmean, st_new.kmean, n_select=n_sel, width=n_sel, scale=128 ** -0.5)
    res = dict(L=L, layout=layout, same_stats=same_stats)
    for mode in ("hybrid", "drop"):
        kw = dict(mode=mode, scale=128 ** -0.5, block_size=64, n_select=n_sel)
        on, ln = new_a.attention(q, k, v, *st_new.tail(), *sel, **kw)
        oo, lo = old_a.attention(q, k, v, *st_new.tail(), *sel, **kw)
        res[f"{mode}_same"] = bool(torch.equal(on, oo) and torch.equal(ln, lo))
        tn, to = [], []
        for _ in range(5):
            tn.append(t_ms(lambda: new_a.attention(q, k, v, *st_new.tail(), *sel, **kw)))
            to.append(t_ms(lambda: old_a.attention(q, k, v, *st_new.tail(), *sel, **kw)))
        res[f"{mode}_ms_new"], res[f"{mode}_ms_old"] = statistics.median(tn), statistics.median(to)
    pn, po = [], []
    for _ in range(5):
        pn.append(t_ms(lambda: new_p.prepare(q, k, v, 64, with_hdev=True)))
        po.append(t_ms(lambda: old_p.prepare(q, k, v, 64, with_hdev=True)))
    res["prepare_ms_new"], res["prepare_ms_old"] = statistics.median(pn), statistics.median(po)
    rows.append(res)
    print(res, flush=True)
env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
json.dump(dict(env, rows=rows), open(os.path.join(os.environ.get("OUT", "."), "int64_ab.json"), "w"), indent=1)
for r in rows:
    print(f"{r['L']:>6} {r['layout']} stats same {r['same_stats']} | hybrid {r['hybrid_ms_old']:.3f} -> {r['hybrid_ms_new']:.3f} same {r['hybrid_same']} | drop {r['drop_ms_old']:.3f} -> {r['drop_ms_new']:.3f} same {r['drop_same']} | prepare {r['prepare_ms_old']:.3f} -> {r['prepare_ms_new']:.3f}")
