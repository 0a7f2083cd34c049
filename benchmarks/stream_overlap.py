"""Can statistics and selection hide under the attend? The whole call split into head chunks, each
chunk's prepare and select issued on a side stream (high or default priority) while the main stream
attends the chunk before it, against the one-launch-per-stage call (``plan``/``run``) and the same
chunks run one after another on one stream, cuDNN SDPA in the same run.

B2-H16-D128 bf16, 12.5 %, covariance-aware hybrid and keep-or-drop, Gaussian and DiT-like q/k/v
(``exact_loop.qkv``); the 32 (batch, head) pairs are viewed as a batch of 32 single-head calls so a
chunk is a contiguous slice. 3 interleaved rounds, median. Also checks each chunked output against
the whole call's (bit-identical unless a chunk's selection breaks a near-tie differently).

    PYTHONPATH=src python3 benchmarks/stream_overlap.py --out $OUT/stream_overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import exact_loop as el

from pisa_attn import PisaSettings, plan, run
from pisa_attn.attention import get_backend
from pisa_attn.ops.stages import _select

BE = get_backend("hopper")


def chunked(chunks, plans, side):
    """Every chunk's prepare + select on ``side`` (None: the current stream), its attend on the
    current stream after the chunk's event; the current stream joins the side stream at the end."""
    main = torch.cuda.current_stream()
    if side is not None:
        side.wait_stream(main)
    staged = []
    for (qc, kc, vc, _), p in zip(chunks, plans):
        ws = p.workspace
        with torch.cuda.stream(side if side is not None else main):
            st = BE.prepare(qc, kc, vc, 64, with_hdev=p.covariance_aware, lean=True, query_block=p.query_block,
                            ws=ws.stats)
            sel = _select(BE, st, p, None, qc, kc, ws.selection)
            ev = torch.cuda.Event()
            ev.record()
        staged.append((st, sel, ev))
    for (qc, kc, vc, oc), p, (st, sel, ev) in zip(chunks, plans, staged):
        if side is not None:
            main.wait_event(ev)
        BE.attend(qc, kc, vc, st, sel, mode=p.mode, scale=p.scale, block_size=64, n_select=p.n_select,
                  alpha=p.alpha, out=oc, lse=p.workspace.lse, ws=p.workspace)
    if side is not None:
        main.wait_stream(side)


def bench(L: int, chunk_counts, rounds: int = 3) -> list:
    rows = []
    t_cudnn = el.cudnn_ms(L)
    streams = {"high": torch.cuda.Stream(priority=-1), "default": torch.cuda.Stream(priority=0)}
    for source in ("random", "dit"):
        q, k, v = el.qkv(source, L)
        for mode in ("hybrid", "drop"):
            st = PisaSettings(density=0.125, mode=mode, backend="hopper")
            out = torch.empty_like(q)
            p0 = plan(q, k, st)
            run(p0, q, k, v, out=out)
            ref = out.clone()
            fns = {"whole": lambda p0=p0, q=q, k=k, v=v, out=out: run(p0, q, k, v, out=out)}
            same = {}
            bh = q.shape[0] * q.shape[1]
            flat = [x.reshape(bh, 1, L, -1) for x in (q, k, v, out)]
            for c in chunk_counts:
                n = bh // c
                chunks = [tuple(x[i * n:(i + 1) * n] for x in flat) for i in range(c)]
                plans = [plan(chunks[0][0], chunks[0][1], st) for _ in range(c)]
                for name, side in ((f"serial{c}", None), (f"side{c}_high", streams["high"]),
                                   (f"side{c}_default", streams["default"])):
                    fn = lambda ch=chunks, ps=plans, s=side: chunked(ch, ps, s)  # noqa: E731
                    out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    same[name] = (out.float() - ref.float()).abs().max().item()
                    fns[name] = fn
            ts = {n: [] for n in fns}
            for _ in range(rounds):
                for n, fn in fns.items():
                    ts[n].append(el.ms(fn, est_ms=t_cudnn * 0.15))
            med = {n: statistics.median(t) for n, t in ts.items()}
            rows.append(dict(L=L, source=source, mode=mode, cudnn_ms=t_cudnn, ms=med, rounds=ts,
                             x_cudnn={n: t_cudnn / t for n, t in med.items()}, max_abs_diff_vs_whole=same))
            print(f"{L:>6} {source:6} {mode:6} " + " ".join(f"{n} {t:.3f} ({t_cudnn / t:.2f}x)" for n, t in med.items()),
                  flush=True)
        del q, k, v, out
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[32768, 65536])
    ap.add_argument("--chunks", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "stream_overlap.json"))
    a = ap.parse_args()
    res = dict(el.toolchain(), shape="B2-H16-D128", dtype="bfloat16", density=0.125, rows=[])
    for L in a.lengths:
        res["rows"] += bench(L, a.chunks)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
