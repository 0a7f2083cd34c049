"""Tail variants on real and DiT-like attention: size, signed bias and direction of the error.

For every input set (DINOv2 capture files, one per image, every layer an entry; DiT-like heads of
:func:`pisa_attn.data.dit_qkv`, with and without sink keys) and every layer, at one density, in
float64 with the library's reference, this measures against dense attention:

* ``rel_l1``: ``mean|o − d| / mean|d|``;
* ``bias``: ``mean_{b,h,c} |mean_t (o − d)| / mean|d|``, the part of the error that is one offset
  shared by all query rows of a head (what adds up over layers instead of averaging out);
* ``cos``: ``1 − cos(o, d)`` per head (flattened over rows and channels), mean over heads.

Variants: the selection rule (``topk``: pooled top-k; ``cov``: covariance-aware, eq. 9) times the
tail: ``drop``, ``zeroth``, ``hybrid`` with the paper's ``H̄`` (mean over all key blocks),
``H̄`` without the always-exact blocks (``-keep``), without the always-exact and the sink-like
blocks (``-sink``: ``||H_j − H̄|| > SINK_RATIO ×`` the median), each row's own tail ``H̄``
(``row``), and the exact block-wise first order (``first``, dense cost), each at ``alpha`` 1 (the
paper's weight), the library default and the per-layer fit of the calibration input (least squares
per head, clamped to ``calibration.FIT_BOUNDS``).
The calibration input of a set is its first one; every table averages the others (held out).

    PYTHONPATH=src python benchmarks/calibration_bias.py --dinov2 DIR --out benchmarks/results/calibration_bias_dinov2.json --no-dit
    PYTHONPATH=src python benchmarks/calibration_bias.py --out benchmarks/results/calibration_bias_dit.json
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

from pisa_attn import calibration as cal
from pisa_attn import metrics, spec
from pisa_attn.data import dit_qkv
from pisa_attn.ops import reference as ref

BLOCK = 64
SINK_RATIO = 4.0
HBARS = ("all", "-keep", "-sink", "row")


def sink_blocks(hdev: torch.Tensor, ratio: float = SINK_RATIO) -> torch.Tensor:
    """Bool ``[B, Hk, Nk]``: blocks whose ``||H_j − H̄||`` exceeds ``ratio`` times the head's median."""
    med = hdev.median(dim=-1, keepdim=True).values
    return hdev > ratio * med


def errors(o: torch.Tensor, d: torch.Tensor) -> dict:
    err = (o - d).double()
    scale = d.abs().mean()
    bias = err.mean(dim=2).abs().mean() / scale
    on, dn = o.double().flatten(2), d.double().flatten(2)
    cos = torch.nn.functional.cosine_similarity(on.flatten(2), dn.flatten(2), dim=-1)
    return {"rel_l1": float(err.abs().mean() / scale), "bias": float(bias), "cos": float((1 - cos).mean())}


def variants(q, k, v, keep, density: float):
    """Yield ``(name, TailTerms-like (base, corr) or output)`` for every variant of one layer."""
    scale = q.shape[-1] ** -0.5
    base_stats = ref.block_stats(k, v, BLOCK, with_hdev=True)
    n_sel = spec.num_selected(density, base_stats.kmean.shape[2])
    nk = base_stats.kmean.shape[2]
    keep3 = None if keep is None else keep.reshape(1, 1, nk)
    sink = sink_blocks(base_stats.hdev)
    excl = {"all": None, "-keep": keep3, "-sink": sink if keep3 is None else sink | keep3, "row": keep3}
    qmean = ref.block_means(q, BLOCK, torch.float64)
    for rule in ("topk", "cov"):
        scores = ref.selection_scores(qmean, base_stats.kmean, scale, base_stats.hdev if rule == "cov" else None)
        sel = ref.select_blocks(scores, n_sel, keep)
        kw = dict(scale=scale, block_size=BLOCK)
        o0, _ = ref.pisa_forward(q, k, v, base_stats, sel, mode="zeroth", **kw)
        od, _ = ref.pisa_forward(q, k, v, base_stats, sel, mode="drop", **kw)
        yield f"{rule}/drop", o0 * 0 + od, None
        yield f"{rule}/zeroth", o0, None
        for hb in HBARS:
            if hb != "all" and excl[hb] is None and hb != "row":
                continue
            st = base_stats if excl[hb] is None else ref.block_stats(k, v, BLOCK, hbar_exclude=excl[hb])
            full, _ = ref.pisa_forward(q, k, v, st, sel, mode="hybrid", hbar_scope="row" if hb == "row" else "global",
                                       **kw)
            yield f"{rule}/hybrid{hb}", o0, full - o0
        # exact block-wise first order (dense cost): the bound of what a better H̄ could give
        first, _ = ref.pisa_forward(q, k, v, base_stats, sel, mode="first", **kw)
        yield f"{rule}/first", o0, first - o0


def measure(q, k, v, keep, density, fitted: dict | None, layer_key) -> tuple[dict, dict]:
    """Errors of every variant (weights 1, default, and ``fitted[layer_key][variant]``) and this
    input's own least-squares weights per variant."""
    dense = metrics.dense_pass(q, k, v, block_size=BLOCK).out
    res, fits = {}, {}
    for name, o0, corr in variants(q, k, v, keep, density):
        if corr is None:
            res[name] = errors(o0, dense)
            continue
        terms = cal.TailTerms(base=o0, corr=corr, lse=None, selected=None)
        w_own = cal.alpha_stats(terms, dense).alpha("head", default=spec.DEFAULT_ALPHA, bounds=cal.FIT_BOUNDS)
        fits[name] = w_own.tolist()
        for tag, w in (("a1", 1.0), ("adef", spec.DEFAULT_ALPHA)):
            res[f"{name}@{tag}"] = errors(terms.output(w), dense)
        if fitted is not None and name in fitted.get(layer_key, {}):
            w = torch.tensor(fitted[layer_key][name], dtype=torch.float64)
            res[f"{name}@fit"] = errors(terms.output(w), dense)
    return res, fits


def dinov2_sets(root: str, layers=None, images=None):
    from pisa_attn.qkv_file import read_qkv_file

    files = sorted(glob.glob(os.path.join(root, "*.safetensors")))
    first = [f for f in files if "astronaut" in os.path.basename(f)]
    files = first + [f for f in files if f not in first]
    for path in files:
        name = os.path.basename(path).split(".")[0]
        if images and not any(i in name for i in images):
            continue
        for e in read_qkv_file(path).entries:
            if layers and e.layer not in layers:
                continue
            keep = e.layout.keep_blocks(BLOCK) if e.layout is not None else None
            yield "dinov2", name, e.layer, e.q.double(), e.k.double(), e.v.double(), keep


def dit_sets(seeds=(0, 1, 2, 3)):
    """DiT-like heads: video 4x16x16, image 24x24 + 64 text tokens, and video with sink keys
    (the keep mask does not name the sinks: an unseen model's sinks are not known in advance)."""
    for seed in seeds:
        d = dit_qkv((4, 16, 16), heads=8, head_dim=64, seed=seed, dtype=torch.float64)
        yield "dit-video", f"seed{seed}", 0, d.q, d.k, d.v, None
        d = dit_qkv((24, 24), heads=8, head_dim=64, seed=seed, text_tokens=64, dtype=torch.float64)
        yield "dit-image+text", f"seed{seed}", 0, d.q, d.k, d.v, d.token_layout.keep_blocks(BLOCK)
        d = dit_qkv((4, 16, 16), heads=8, head_dim=64, seed=seed, sink_keys=4, dtype=torch.float64)
        yield "dit-video+sinks", f"seed{seed}", 0, d.q, d.k, d.v, None


@torch.no_grad()  # inference only; a caller's grad mode is left as it was
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dinov2", default=None, help="folder of DINOv2 capture files (extract_dinov2_qkv.py)")
    p.add_argument("--density", type=float, default=0.125)
    p.add_argument("--no-dit", action="store_true")
    p.add_argument("--layers", default="", help="DINOv2 layers to use (comma list; default all)")
    p.add_argument("--images", default="", help="DINOv2 images to use (comma list; default all)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sources = []
    if args.dinov2:
        layers = [int(x) for x in args.layers.split(",") if x]
        sources.append(dinov2_sets(args.dinov2, layers, [x for x in args.images.split(",") if x]))
    if not args.no_dit:
        sources.append(dit_sets())
    rows = []
    fitted: dict[str, dict] = defaultdict(dict)  # set -> {layer: {variant: weights}}
    calib_input: dict[str, str] = {}
    t0 = time.perf_counter()
    for src in sources:
        for set_name, inp, layer, q, k, v, keep in src:
            calib_input.setdefault(set_name, inp)
            is_calib = calib_input[set_name] == inp
            res, fits = measure(q, k, v, keep, args.density, None if is_calib else fitted[set_name], layer)
            if is_calib:
                fitted[set_name][layer] = fits
            rows.append({"set": set_name, "input": inp, "layer": layer, "calibration": is_calib, "errors": res})
            print(f"{time.perf_counter() - t0:6.0f}s {set_name} {inp} layer {layer}", file=sys.stderr, flush=True)
    summary = summarize(rows)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "density": args.density, "block_size": BLOCK, "sink_ratio": SINK_RATIO,
                   "default_alpha": spec.DEFAULT_ALPHA, "calibration_inputs": calib_input,
                   "summary": summary, "rows": rows}, f, indent=1)
    print_summary(summary)
    return 0


def summarize(rows) -> dict:
    """Held-out mean of every metric per set and variant."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if r["calibration"]:
            continue
        for var, m in r["errors"].items():
            for key, x in m.items():
                acc[r["set"]][var][key].append(x)
    return {s: {var: {key: sum(x) / len(x) for key, x in m.items()} for var, m in vs.items()} for s, vs in acc.items()}


def print_summary(summary) -> None:
    for s, vs in summary.items():
        print(f"\n## {s} (held-out mean)\n\n| variant | rel-L1 | bias | 1 − cos |\n|---|---|---|---|")
        for var, m in vs.items():
            print(f"| {var} | {m['rel_l1']:.4f} | {m['bias']:.4f} | {m['cos']:.2e} |")


if __name__ == "__main__":
    raise SystemExit(main())
