"""``precision="int8"`` (P·V in the input dtype) with a tail: three query blocks per CTA with the
tail's slots laid over the exact ring (16-bit value slots) against the other layouts, on a GPU,
the bf16 kernel and cuDNN SDPA in the same run:

* attend alone on one top-k selection, hybrid (and keep-or-drop for reference): pairs with a tail
  ring of their own (``pairs``), three with their own (``three``, 2 + 2 slots at D = 128), three
  over the exact ring at 6 + 3 and 4 + 2 slots (``three-alias``, ``three-alias-4``), pairs over it
  (``pairs-alias``); 3 interleaved rounds, median; outputs of the layouts compared bit for bit;
* the whole default call (plan/run) with int8 hybrid on pairs and on three over the ring, beside
  the bf16 call.

B2-H16-D128 bf16, 12.5 %, Gaussian and DiT-like q/k/v (``exact_loop.qkv``).

    PYTHONPATH=src python3 benchmarks/int8_tail_ring.py --lengths 16384 32768 65536 \\
        --out benchmarks/results/h100_int8_tail_ring.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import exact_loop as el

from pisa_attn import PisaSettings
from pisa_attn.metrics import rel_l1
from pisa_attn.ops.hopper import attention as gattn
from pisa_attn.ops.hopper import fp8 as lowk
from pisa_attn.ops.triton.quantize import quantize

LAYOUTS = {  # keyword arguments of fp8.attention
    "pairs": dict(query_group=2, tail_alias=False),
    "three": dict(query_group=3, tail_alias=False),
    "three-alias": dict(query_group=3, tail_alias=True),
    "three-alias-4": dict(query_group=3, tail_alias=True, stages=(4, 2)),
    "pairs-alias": dict(query_group=2, tail_alias=True),
}


def attend_rows(L: int, rounds: int) -> list:
    rows = []
    t_cudnn = el.cudnn_ms(L)
    for source in ("random", "dit"):
        q, k, v = el.qkv(source, L)
        stats, sel, n_sel = el.selection(q, k, v, 0.125)
        qz = quantize(k, v, stats.kbar, stats.kscale, 64, precision="int8")
        kmax = k.abs().amax(2).float()  # the bf16 kernel's bound, once (prepare's with_kmax= in a call)
        fns, res = {}, {}
        for mode in ("hybrid", "drop"):
            for name in ("bf16", *LAYOUTS):
                if mode == "drop" and name not in ("bf16", "pairs", "three"):
                    continue
                o = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], device="cuda")
                if name == "bf16":
                    fn = lambda m=mode, o=o, lse=lse: gattn.attention(  # noqa: E731
                        q, k, v, *stats.tail(), *sel, mode=m, scale=q.shape[-1] ** -0.5, block_size=64,
                        n_select=n_sel, out=o, lse=lse, kmax=kmax, kbound=stats.kbound)
                else:
                    kw = LAYOUTS[name] if mode != "drop" else dict(query_group=LAYOUTS[name]["query_group"])
                    fn = lambda m=mode, o=o, lse=lse, kw=kw: lowk.attention(  # noqa: E731
                        q, qz, *stats.tail(), *sel, mode=m, scale=q.shape[-1] ** -0.5, block_size=64, lk=L, out=o,
                        lse=lse, v=v, kbound=stats.kbound, **kw)
                fns[mode, name] = fn
                res[mode, name] = (o, lse)
        ts = el.attend_rounds(fns, est_ms=t_cudnn * 0.15, rounds=rounds)
        med = {key: statistics.median(t) for key, t in ts.items()}
        for mode in ("hybrid", "drop"):
            names = [n for (m, n) in fns if m == mode]
            o_ref = res[mode, "three" if mode == "hybrid" else "pairs"][0]
            r = dict(L=L, source=source, mode=mode, cudnn_ms=t_cudnn, rounds={n: ts[mode, n] for n in names},
                     **{f"{n}_ms": med[mode, n] for n in names},
                     rel_l1_int8_vs_bf16=rel_l1(res[mode, "pairs"][0], res[mode, "bf16"][0]))
            if mode == "hybrid":
                # the same products in the same order: pairs and three each bit for bit over either ring
                r["alias_bitwise"] = all(torch.equal(res[mode, a][0], res[mode, b][0])
                                         and torch.equal(res[mode, a][1], res[mode, b][1])
                                         for a, b in (("three", "three-alias"), ("three", "three-alias-4"),
                                                      ("pairs", "pairs-alias")))
                r["rel_l1_three_vs_pairs"] = rel_l1(o_ref, res[mode, "pairs"][0])
            rows.append(r)
            print(f"{L:>6} {source:6} {mode:6} attend ms " + " ".join(f"{n} {med[mode, n]:.3f}" for n in names)
                  + (f" | bitwise {r['alias_bitwise']}" if mode == "hybrid" else ""), flush=True)
    return rows


def whole_rows(L: int, rounds: int) -> list:
    rows = []
    t_cudnn = el.cudnn_ms(L)
    qg, ta = dict(lowk.QUERY_GROUP), set(lowk.TAIL_ALIAS)

    def restore():
        lowk.QUERY_GROUP.update(qg)
        lowk.TAIL_ALIAS.clear()
        lowk.TAIL_ALIAS.update(ta)

    def layout(three: bool):
        def apply():
            restore()
            lowk.QUERY_GROUP["int8", True] = 3 if three else 2
            (lowk.TAIL_ALIAS.add if three else lowk.TAIL_ALIAS.discard)(("int8", 3))
        return apply

    for source in ("random", "dit"):
        q, k, v = el.qkv(source, L)
        st8 = PisaSettings(density=0.125, backend="hopper", precision="int8")
        variants = {"bf16": (layout(False), PisaSettings(density=0.125, backend="hopper")),
                    "int8-pairs": (layout(False), st8), "int8-three-alias": (layout(True), st8)}
        try:
            ts = el.whole_rounds(q, k, v, variants, est_ms=t_cudnn * 0.15, rounds=rounds)
        finally:
            restore()
        r = dict(L=L, source=source, mode="hybrid", cudnn_ms=t_cudnn, rounds=ts,
                 **{f"{n}_ms": statistics.median(t) for n, t in ts.items()})
        r.update({f"x_cudnn_{n}": t_cudnn / r[f"{n}_ms"] for n in ts})
        rows.append(r)
        print(f"{L:>6} {source:6} whole hybrid " + " ".join(
            f"{n} {r[f'{n}_ms']:.3f} ({r[f'x_cudnn_{n}']:.2f}x)" for n in ts), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--whole", type=int, nargs="*", default=None,
                    help="lengths of the whole-call rows (default: --lengths)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "int8_tail_ring.json"))
    args = ap.parse_args()
    res = dict(el.toolchain(), shape="B2-H16-D128", dtype="bfloat16", density=0.125, precision="int8",
               attend=[], whole=[])
    for L in args.lengths:
        res["attend"] += attend_rows(L, args.rounds)
    for L in args.lengths if args.whole is None else args.whole:
        res["whole"] += whole_rows(L, args.rounds)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
