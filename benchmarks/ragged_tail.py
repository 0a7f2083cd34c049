"""The tail's cost (hybrid minus keep-or-drop attend) at an even key length and at two ragged ones
(L - 37, L - 63) in one process, with the tail's maximum fixed ("auto") and online, and each
against the kernel before (``ops/hopper/_before.py``, as in ``kernel_ab.py``); B2-H16-D128 bf16
Gaussian inputs, three query blocks, 3 interleaved rounds.

    PYTHONPATH=src OUT=DIR LS=32768 python3 benchmarks/ragged_tail.py
"""
import os
import statistics
import sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E
from pisa_attn.ops.hopper import attention as gattn
from pisa_attn.metrics import rel_l1
rows = []
for L in [int(x) for x in os.environ.get("LS", "32768").split()]:
    g = torch.Generator(device="cuda").manual_seed(L)
    base = [torch.randn(2, 16, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for trim in (0, 37, 64 - 1):
        q, k, v = (x[:, :, : L - trim].contiguous() for x in base)
        stats, sel, n_sel = E.selection(q, k, v, 0.125)
        fns = {}
        from pisa_attn.ops.hopper import _before as before
        for name, mode, tm, mod in (("drop", "drop", "auto", gattn), ("hyb-auto", "hybrid", "auto", gattn),
                                    ("hyb-online", "hybrid", "online", gattn), ("before-drop", "drop", "auto", before),
                                    ("before-hyb", "hybrid", "auto", before)):
            out = torch.empty_like(q); lse = torch.empty(q.shape[:3], device="cuda")
            fns[name] = (lambda m=mode, tm=tm, out=out, lse=lse, mod=mod: mod.attention(
                q, k, v, *stats.tail(), *sel, mode=m, scale=128 ** -0.5, block_size=64, n_select=n_sel, out=out,
                lse=lse, kbound=stats.kbound, query_group=3, tail_max=tm), out)
            fns[name][0]()
        torch.cuda.synchronize()
        ts = {n: [] for n in fns}
        for _ in range(3):
            for n, (fn, _) in fns.items():
                ts[n].append(E.ms(fn, est_ms=5.0 * (L / 32768) ** 2))
        r = dict(L=L, lk=L - trim, **{n: statistics.median(t) for n, t in ts.items()},
                 auto_vs_online=rel_l1(fns["hyb-auto"][1], fns["hyb-online"][1]),
                 drop_vs_before=rel_l1(fns["drop"][1], fns["before-drop"][1]),
                 hyb_vs_before=rel_l1(fns["hyb-auto"][1], fns["before-hyb"][1]))
        r["tail_auto"] = r["hyb-auto"] - r["drop"]; r["tail_online"] = r["hyb-online"] - r["drop"]
        rows.append(r); print({a: (round(b, 4) if isinstance(b, float) else b) for a, b in r.items()}, flush=True)
E.write_rows("ragged_tail.json", rows)
