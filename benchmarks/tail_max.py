"""The tail under a fixed maximum, and three query blocks per CTA with a tail (H100/H200).

Attend alone on one top-k selection (B2-H16-D128 bf16, 12.5 %, Gaussian and DiT-like inputs), the
Hopper kernel with two or three query blocks per CTA and the tail's maximum online or fixed
(``tail_max``), hybrid and keep-or-drop; then the whole hybrid call (plan/run) with the previous
defaults (pairs, online maximum) and the present ones, and the whole keep-or-drop call. Every row
timed in 3 interleaved rounds (median), cuDNN SDPA in the same run; outputs compared with the
first variant's (rel-L1, LSE).

    PYTHONPATH=src LENGTHS="32768 65536" OUT=out python3 benchmarks/tail_max.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import exact_loop as E  # noqa: E402  (the inputs, selection and timing of the exact-loop benchmark)

from pisa_attn import PisaSettings, plan, run  # noqa: E402
from pisa_attn.metrics import rel_l1  # noqa: E402
from pisa_attn.ops.hopper import attention as gattn  # noqa: E402

# (name, kernel keyword arguments, modes)
ATTEND = [
    ("pairs-online", dict(query_group=2, tail_max="online"), ("drop", "hybrid")),
    ("pairs-fixed", dict(query_group=2, tail_max="auto"), ("hybrid",)),
    ("triples-online", dict(query_group=3, tail_max="online"), ("drop", "hybrid")),
    ("triples-fixed", dict(query_group=3, tail_max="auto"), ("hybrid",)),
]
# (name, mode, query blocks per CTA for that mode, tail maximum): the whole call
WHOLE = [
    ("hybrid-before", "hybrid", 2, "online"),
    ("hybrid-now", "hybrid", None, None),
    ("drop-now", "drop", None, None),
]


def _settings(mode: str, group: int | None, tail_max: str | None):
    """Sets the kernel's module defaults for one whole-call row (None: the present default)."""
    gattn.QUERY_GROUP[mode] = DEFAULT_GROUP[mode] if group is None else group
    gattn.TAIL_MAX = DEFAULT_TAIL if tail_max is None else tail_max


DEFAULT_GROUP = dict(gattn.QUERY_GROUP)
DEFAULT_TAIL = gattn.TAIL_MAX


def bench(L: int, source: str, rows: list) -> None:
    t_cudnn = E.cudnn_ms(L)
    q, k, v = E.qkv(source, L)
    stats, sel, n_sel = E.selection(q, k, v, 0.125)
    nk = stats.kbar.shape[2]
    frac = sel.cnt.sum().item() / (E.B * E.H * sel.bits.shape[2] * nk)
    fns, mine, ref = [], [], {}
    for name, kw, modes in ATTEND:
        for mode in modes:
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)

            def fn(m=mode, out=out, lse=lse, kw=kw):
                gattn.attention(q, k, v, *stats.tail(), *sel, mode=m, scale=q.shape[-1] ** -0.5, block_size=64,
                                n_select=n_sel, out=out, lse=lse, kbound=stats.kbound, **kw)

            fn()
            torch.cuda.synchronize()
            base = ref.setdefault(mode, (out.clone(), lse.clone()))
            row = dict(L=L, source=source, kind="attend", variant=name, mode=mode, density=0.125,
                       computed_fraction=frac, cudnn_ms=t_cudnn, finite=bool(torch.isfinite(out).all()),
                       rel_l1_to_first=rel_l1(out.float(), base[0].float()),
                       lse_max_diff_to_first=(lse - base[1]).abs().max().item(), rounds=[])
            mine.append(row)
            fns.append((row, fn))
    for name, mode, group, tail in WHOLE:
        _settings(mode, group, tail)
        p = plan(q, k, PisaSettings(density=0.125, mode=mode, backend="hopper"))
        out = torch.empty_like(q)

        def fn(p=p, out=out, mode=mode, group=group, tail=tail):
            _settings(mode, group, tail)
            run(p, q, k, v, out=out)

        fn()
        row = dict(L=L, source=source, kind="whole", variant=name, mode=mode, density=0.125, cudnn_ms=t_cudnn,
                   rounds=[])
        mine.append(row)
        fns.append((row, fn))
    _settings("hybrid", None, None)
    _settings("drop", None, None)
    for _ in range(3):
        for row, fn in fns:
            row["rounds"].append(E.ms(fn, est_ms=t_cudnn * frac * 1.2))
    _settings("hybrid", None, None)
    for row in mine:
        row["ms"] = statistics.median(row["rounds"])
        row["speedup"] = t_cudnn / row["ms"]
        print(f"{L:>6} {source:7} {row['kind']:6} {row['variant']:15} {row['mode']:6} {row['ms']:8.3f} ms "
              f"{row['speedup']:5.2f}x | " + " ".join(f"{t:.3f}" for t in row["rounds"]), flush=True)
    rows += mine
    del q, k, v, stats, sel, fns, ref
    torch.cuda.empty_cache()


def main() -> None:
    rows: list = []
    for L in [int(x) for x in os.environ.get("LENGTHS", "32768 65536").split()]:
        for source in ("random", "dit"):
            bench(L, source, rows)
    E.write_rows("tail_max.json", rows)
    print("\n     L input   kind   variant         mode         ms  x cuDNN")
    for r in rows:
        print(f"{r['L']:>6} {r['source']:7} {r['kind']:6} {r['variant']:15} {r['mode']:6} {r['ms']:8.3f} "
              f"{r['speedup']:5.2f}x")


if __name__ == "__main__":
    main()
