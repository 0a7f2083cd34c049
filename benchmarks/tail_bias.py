"""The uncalibrated tail on real and DiT-like attention: size, signed bias and direction of the error.

Every input set (DINOv2 ViT-S/14 captures, one file per image, 12 layers; Whisper tiny.en encoder
captures, one file per utterance, 4 layers; DiT-like heads of :func:`pisa_attn.data.dit_qkv`:
video, image + text, video with sink keys), every layer, one density, float64 with the library's
reference, against dense attention:

* ``rel_l1``: ``mean|o − d| / mean|d|``;
* ``bias``: ``mean_{b,h,c} |mean_t (o − d)| / mean|d|``, the offset shared by all query rows of a
  head (it adds up over layers where row-wise errors average out);
* ``bias_share``: ``Σ_c (mean_t e)² / mean_t Σ_c e²`` per head, mean over heads: the part of the
  squared error that is that one offset;
* ``cos``: ``1 − cos(o, d)`` per head (flattened), mean over heads.

Variants (no fitting: nothing here is calibrated): selection ``topk`` (pooled q̄·k̄) or ``cov``
(covariance-aware, eq. 9) times the tail: ``drop``; ``zeroth``; ``hybrid`` at weight ``a1`` (the
paper's 1) or ``adef`` (:data:`pisa_attn.spec.DEFAULT_ALPHA`), with H̄ over all blocks (the
paper), ``-sink`` (without the always-exact and sink-like blocks, ``||H_j − H̄|| > 4x`` the
median), ``-glob`` (also without the blocks at least half of the query blocks compute exactly:
H̄ over the blocks it is applied to), or each row's own tail (``row``); the block weight of the
tail with the spread of q·k inside the block (``+gauss``, ``+trace``, ``+taylor``, ``+taylor-trace``:
:data:`reference.TAIL_SPREADS`);
``first`` (exact block-wise first order, dense cost: the bound of what a better H̄ can give).

The first input of each set is the development input (``dev``); the tables average the others.

    PYTHONPATH=src python benchmarks/tail_bias.py --dinov2 DIR --whisper DIR --out benchmarks/results/tail_bias.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calibration_bias import BLOCK, SINK_RATIO, dit_sets, sink_blocks  # noqa: E402

from pisa_attn import metrics, spec  # noqa: E402
from pisa_attn.ops import reference as ref  # noqa: E402

GLOBAL_SHARE = 0.5  # "-glob": blocks exact for at least this share of the query blocks
# The columns of the summary table: (label, variant).
TABLE = (
    ("keep-or-drop", "topk/drop"),
    ("zeroth", "topk/zeroth"),
    ("paper hybrid", "topk/hybrid@a1"),
    ("default (cov, α=0.75)", "cov/hybrid@adef"),
    ("cov, α=1", "cov/hybrid@a1"),
    ("cov, zeroth", "cov/zeroth"),
    ("cov, α=0.75, H̄ -glob", "cov/hybrid-glob@adef"),
    ("cov, α=0.75, +trace", "cov/hybrid+trace@adef"),
    ("cov, α=0.75, +gauss", "cov/hybrid+gauss@adef"),
    ("cov, α=0.75, +taylor", "cov/hybrid+taylor@adef"),
    ("cov, α=0.75, +taylor-trace", "cov/hybrid+taylor-trace@adef"),
)


def errors(o: torch.Tensor, d: torch.Tensor) -> dict:
    err = (o - d).double()
    scale = d.double().abs().mean()
    off = err.mean(dim=2)  # [B, H, D]
    share = (off * off).sum(-1) / (err * err).sum(-1).mean(-1).clamp_min(1e-300)
    on, dn = o.double().flatten(2), d.double().flatten(2)
    cos = torch.nn.functional.cosine_similarity(on, dn, dim=-1)
    return {"rel_l1": float(err.abs().mean() / scale), "bias": float(off.abs().mean() / scale),
            "bias_share": float(share.mean()), "cos": float((1 - cos).mean())}


def globally_exact(sel: torch.Tensor, hk: int, share: float = GLOBAL_SHARE) -> torch.Tensor:
    """Bool ``[B, Hk, Nk]``: key blocks in the exact set of at least ``share`` of the query blocks
    (of the query heads that read the kv head)."""
    b, h, nq, nk = sel.shape
    freq = sel.double().mean(2).reshape(b, hk, h // hk, nk).mean(2)
    return freq >= share


def outputs(q, k, v, keep, density: float):
    """Yield ``(variant, output)`` for every variant of one layer."""
    scale = q.shape[-1] ** -0.5
    hk = k.shape[1]
    st = ref.block_stats(k, v, BLOCK, with_hdev=True, with_kcov=True)
    nk = st.kmean.shape[2]
    n_sel = spec.num_selected(density, nk)
    keep3 = None if keep is None else keep.reshape(1, 1, nk)
    sink = sink_blocks(st.hdev)
    qmean = ref.block_means(q, BLOCK, torch.float64)
    kw = dict(scale=scale, block_size=BLOCK)
    alphas = (("a1", 1.0), ("adef", spec.DEFAULT_ALPHA))
    for rule in ("topk", "cov"):
        scores = ref.selection_scores(qmean, st.kmean, scale, st.hdev if rule == "cov" else None)
        sel = ref.select_blocks(scores, n_sel, keep)
        yield f"{rule}/drop", ref.pisa_forward(q, k, v, st, sel, mode="drop", **kw)[0]
        no_sink = sink if keep3 is None else sink | keep3
        excl = {"": None, "-sink": no_sink, "-glob": no_sink | globally_exact(sel, hk)}
        spreads = ref.TAIL_SPREADS if rule == "cov" else ("none",)
        for sp in spreads:
            tag = "" if sp == "none" else f"+{sp}"
            o0 = ref.pisa_forward(q, k, v, st, sel, mode="zeroth", tail_spread=sp, **kw)[0]
            yield f"{rule}/zeroth{tag}", o0
            hbars = excl if (rule == "cov" and sp == "none") else {"": None}
            for hb, ex in hbars.items():
                sx = st if ex is None else ref.block_stats(k, v, BLOCK, hbar_exclude=ex, with_kcov=sp != "none")
                full = ref.pisa_forward(q, k, v, sx, sel, mode="hybrid", tail_spread=sp, **kw)[0]
                for a_tag, a in alphas:
                    yield f"{rule}/hybrid{hb}{tag}@{a_tag}", o0 + a * (full - o0)
        if rule == "cov":
            row = ref.pisa_forward(q, k, v, ref.block_stats(k, v, BLOCK, hbar_exclude=keep3), sel, mode="hybrid",
                                   hbar_scope="row", **kw)[0]
            o0 = ref.pisa_forward(q, k, v, st, sel, mode="zeroth", **kw)[0]
            first = ref.pisa_forward(q, k, v, st, sel, mode="first", **kw)[0]
            for a_tag, a in alphas:
                yield f"cov/hybrid-row@{a_tag}", o0 + a * (row - o0)
                yield f"cov/first@{a_tag}", o0 + a * (first - o0)


def capture_sets(kind: str, root: str, pattern: str, first_name: str, layers=None):
    """``(set, input, layer, q, k, v, keep)`` of every entry of the capture files under ``root``,
    the file whose name holds ``first_name`` first (the development input)."""
    from pisa_attn.qkv_file import check_entry, read_qkv_file

    files = sorted(glob.glob(os.path.join(root, pattern)))
    if not files:
        raise SystemExit(f"no {pattern} under {root!r}")
    first = [f for f in files if first_name in os.path.basename(f)]
    for path in first + [f for f in files if f not in first]:
        name = os.path.basename(path).split(".")[0]
        for e in read_qkv_file(path).entries:
            if layers and e.layer not in layers:
                continue
            check_entry(e)
            keep = e.layout.keep_blocks(BLOCK) if e.layout is not None else None
            if keep is not None and not bool(keep.any()):
                keep = None
            yield kind, name, e.layer, e.q.double(), e.k.double(), e.v.double(), keep


@torch.no_grad()  # inference only; a caller's grad mode is left as it was
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dinov2", default=None, help="folder of DINOv2 captures (extract_dinov2_qkv.py)")
    p.add_argument("--whisper", default=None, help="folder of Whisper captures (extract_whisper_qkv.py)")
    p.add_argument("--no-dit", action="store_true")
    p.add_argument("--density", type=float, default=0.125)
    p.add_argument("--layers", default="", help="layers to use (comma list; default all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = [int(x) for x in args.layers.split(",") if x]
    sources = []
    if args.dinov2:
        sources.append(capture_sets("dinov2", args.dinov2, "dinov2_*.safetensors", "astronaut", layers))
    if args.whisper:
        sources.append(capture_sets("whisper", args.whisper, "whisper_*.safetensors", "harvard1", layers))
    if not args.no_dit:
        sources.append(dit_sets())
    rows, dev = [], {}
    t0 = time.perf_counter()
    for src in sources:
        for set_name, inp, layer, q, k, v, keep in src:
            dev.setdefault(set_name, inp)
            dense = metrics.dense_pass(q, k, v, block_size=BLOCK).out
            res = {name: errors(o, dense) for name, o in outputs(q, k, v, keep, args.density)}
            rows.append({"set": set_name, "input": inp, "layer": layer, "dev": dev[set_name] == inp, "errors": res})
            print(f"{time.perf_counter() - t0:6.0f}s {set_name} {inp} layer {layer}", file=sys.stderr, flush=True)
    summary, per_layer = summarize(rows)
    with open(args.out, "w") as f:
        json.dump({"density": args.density, "block_size": BLOCK, "sink_ratio": SINK_RATIO,
                   "global_share": GLOBAL_SHARE, "default_alpha": spec.DEFAULT_ALPHA, "dev_inputs": dev,
                   "device": "cpu", "torch": torch.__version__, "summary": summary, "per_layer": per_layer,
                   "rows": rows}, f, indent=1)
    print_tables(summary)
    return 0


def _mean(xs):
    return sum(xs) / len(xs)


def summarize(rows) -> tuple[dict, dict]:
    """Held-out (non-dev) mean of every metric per set and variant, and per set, layer and variant."""
    acc = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    lay = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    for r in rows:
        if r["dev"]:
            continue
        for var, m in r["errors"].items():
            for key, x in m.items():
                acc[r["set"]][var][key].append(x)
                lay[r["set"]][str(r["layer"])][var][key].append(x)
    summary = {s: {v: {k: _mean(x) for k, x in m.items()} for v, m in vs.items()} for s, vs in acc.items()}
    per_layer = {s: {layer: {v: {k: _mean(x) for k, x in m.items()} for v, m in vs.items()}
                     for layer, vs in ls.items()} for s, ls in lay.items()}
    return summary, per_layer


def print_tables(summary) -> None:
    print("\nheld-out mean: rel-L1 / signed bias / 1 − cos (x100)\n")
    print("| set | " + " | ".join(label for label, _ in TABLE) + " |")
    print("|---" * (len(TABLE) + 1) + "|")
    for s, vs in summary.items():
        cells = [f"{vs[v]['rel_l1']:.3f} / {vs[v]['bias']:.3f} / {100 * vs[v]['cos']:.2f}" for _, v in TABLE]
        print(f"| {s} | " + " | ".join(cells) + " |")
    for s, vs in summary.items():
        print(f"\n## {s}\n\n| variant | rel-L1 | bias | bias share | 1 − cos (x100) |\n|---|---|---|---|---|")
        for var, m in vs.items():
            print(f"| {var} | {m['rel_l1']:.4f} | {m['bias']:.4f} | {m['bias_share']:.3f} | {100 * m['cos']:.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
