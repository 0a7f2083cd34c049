"""Does a weighted first-order tail term help on real attention? Calibrate on one input, test on others.

``run`` measures, per input file (one per image, every layer an entry; see
``benchmarks/extract_dinov2_qkv.py``), per layer, per density and exact-set rule, in float64 with
the library's reference (:mod:`pisa_attn.calibration` on :mod:`pisa_attn.ops.reference`):

* rel-L1 (``mean|o − dense| / mean|dense|``, all query rows, all heads) of drop / zeroth / hybrid /
  exact block-wise first order, and the per-head error sums ``E_h(w) = Σ|o⁰ + w·c − dense|`` on a
  grid of weights ``w`` for both first-order terms (hybrid's global ``H̄`` and the exact ``H_j``);
  the error of any per-head or shared weight is read off these curves (convex, piecewise linear
  between grid points: interpolation error far below the digits reported);
* the least-squares statistics of :class:`pisa_attn.calibration.AlphaStats` and the L1-optimal
  weights per head / per layer;
* the dense softmax mass on the tail per head.

Exact-set rules: ``topk`` (the paper's pooled top-k), ``cov`` (covariance-aware), ``cls`` (the
CLS block always exact, top-(k−1) others: equal budget), ``cls+1`` (CLS block on top of top-k, one
more block), ``sink`` (per head the block with the largest mean pooled probability over query
blocks always exact, equal budget), ``heads`` (equal total budget ``H·k`` per query block, spent
across heads by pooled probability, at least one block per head).

``report`` turns the JSONL into the markdown tables of ``notes/`` with an honest split: weights
fitted on ``--calib`` inputs, errors reported on the others. ``synthetic`` checks DiT-like heads
(:func:`pisa_attn.data.dit_qkv`).

    PYTHONPATH=src python benchmarks/calibration_study.py run --data /path/to/data --out /tmp/cal.jsonl
    PYTHONPATH=src python benchmarks/calibration_study.py report /tmp/cal.jsonl --calib astronaut
    PYTHONPATH=src python benchmarks/calibration_study.py synthetic --alpha 0.5
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import torch

from pisa_attn import calibration as cal
from pisa_attn import metrics, spec
from pisa_attn.ops import reference as ref

BLOCK = 64
GRID = torch.linspace(-1.0, 2.0, 301, dtype=torch.float64)  # weights w the error curves are sampled at
MAIN_DENSITIES = (0.05, 0.125, 0.25)
EXTRA_RULES = ("cls", "cls+cov", "cls+1", "sink", "heads")  # at the headline density only
HEADLINE = 0.125


# --- exact-set rules ---------------------------------------------------------------------------
def selection(rule: str, q, stats: ref.BlockStats, density: float, keep_cls) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    qmean = ref.block_means(q, BLOCK, stats.kmean.dtype)
    cov = rule in ("cov", "cls+cov")
    scores = ref.selection_scores(qmean, stats.kmean, scale, stats.hdev if cov else None)
    n = spec.num_selected(density, stats.kmean.shape[2])
    if rule in ("topk", "cov"):
        return ref.select_blocks(scores, n)
    if rule in ("cls", "cls+cov"):
        return ref.select_blocks(scores, n - 1, keep_cls)
    if rule == "cls+1":
        return ref.select_blocks(scores, n, keep_cls)
    prob = _pooled_prob(scores, stats.counts)
    if rule == "sink":
        sink = prob.mean(dim=2).argmax(dim=-1)  # [B, H]
        keep = torch.zeros(prob.shape[0], prob.shape[1], prob.shape[-1], dtype=torch.bool)
        keep.scatter_(-1, sink[..., None], True)
        return ref.select_blocks(scores, n - 1, keep)
    if rule == "heads":
        return _head_budget(prob, n)
    raise ValueError(f"unknown rule {rule!r}")


def _pooled_prob(scores, counts):
    """Per (head, query block) softmax over key blocks of the pooled scores, weighted by block size."""
    return torch.softmax(scores + torch.log(counts.to(scores.dtype)), dim=-1)


def _head_budget(prob, n):
    """``H·n`` exact blocks per query block spent across heads by pooled probability (≥ 1 per head)."""
    b, h, nq, nk = prob.shape
    sel = torch.zeros_like(prob, dtype=torch.bool)
    first = prob.argmax(dim=-1, keepdim=True)
    sel.scatter_(-1, first, True)
    rest = prob.masked_fill(sel, -1.0).permute(0, 2, 1, 3).reshape(b, nq, h * nk)
    extra = h * (n - 1)
    if extra > 0:
        idx = rest.topk(extra, dim=-1).indices
        flat = torch.zeros(b, nq, h * nk, dtype=torch.bool).scatter_(-1, idx, True)
        sel |= flat.reshape(b, nq, h, nk).permute(0, 2, 1, 3)
    return sel


# --- measurements ------------------------------------------------------------------------------
def error_curve(base, corr, dense) -> torch.Tensor:
    """``E_h(w) = Σ|base + w·corr − dense|`` per head for every ``w`` of GRID: ``[len(GRID), H]``.

    Exact at the grid points without a pass per point: ``|r − w c| = |c|·|r/c − w|``, so with the
    ratios sorted, ``E(w) = Σ_{z<w} |c|(w − z) + Σ_{z≥w} |c|(z − w)`` from two prefix sums."""
    r = (dense - base).transpose(0, 1).reshape(base.shape[1], -1)
    c = corr.transpose(0, 1).reshape(base.shape[1], -1)
    out = []
    for rh, ch in zip(r, c):
        nz = ch != 0
        const = rh[~nz].abs().sum()
        z, wt = rh[nz] / ch[nz], ch[nz].abs()
        z, order = z.sort()
        wt = wt[order]
        cw = torch.cat([wt.new_zeros(1), wt.cumsum(0)])  # Σ|c| over the i smallest ratios
        cz = torch.cat([wt.new_zeros(1), (wt * z).cumsum(0)])
        i = torch.searchsorted(z, GRID)  # ratios below each grid weight
        below = GRID * cw[i] - cz[i]
        above = (cz[-1] - cz[i]) - GRID * (cw[-1] - cw[i])
        out.append(const + below + above)
    return torch.stack(out, dim=1)


def measure_entry(q, k, v, keep_cls) -> dict:
    """Every number the report needs for one layer of one input."""
    stats = ref.block_stats(k, v, BLOCK, with_hdev=True)
    configs = [(d, r) for d in MAIN_DENSITIES for r in ("topk", "cov")] + [(HEADLINE, r) for r in EXTRA_RULES]
    sels = {c: selection(c[1], q, stats, c[0], keep_cls) for c in configs}
    dense_pass = metrics.dense_pass(q, k, v, block_size=BLOCK, masks=tuple(sels.values()))
    dense = dense_pass.out
    abs_dense = dense.abs().sum(dim=(0, 2, 3))  # [H]
    out = {"abs_dense": abs_dense.tolist(), "configs": []}
    for ((d, rule), sel), tail in zip(sels.items(), dense_pass.tail_mass):
        rec = {"density": d, "rule": rule, "exact_blocks": float(sel.double().sum(-1).mean()),
               "tail_mass": tail.mean(dim=(0, 2)).tolist()}
        main = rule in ("topk", "cov")
        modes = ("hybrid", "first") if main else ("hybrid",)
        base = None
        for mode in modes:
            if base is None:
                t = cal.tail_terms(q, k, v, selected=sel, mode=mode, stats=stats)
                base = t.base
            else:  # the zeroth part is the same for both modes: only the full output is new
                full, lse = ref.pisa_forward(q, k, v, stats, sel, mode=mode, scale=q.shape[-1] ** -0.5, block_size=BLOCK)
                t = cal.TailTerms(base, full - base, lse, sel)
            st = cal.alpha_stats(t, dense)
            rec[mode] = {
                "curve": error_curve(t.base, t.corr, dense).tolist(),
                "cr": st.cr.tolist(), "cc": st.cc.tolist(), "rr": st.rr.tolist(),
                "l1_head": cal.fit_alpha_l1(t, dense, over="head").tolist(),
                "l1_layer": float(cal.fit_alpha_l1(t, dense, over="layer")),
            }
        rec["zeroth"] = (base - dense).abs().sum(dim=(0, 2, 3)).tolist()
        if main:
            drop, _ = ref.pisa_forward(q, k, v, stats, sel, mode="drop", scale=q.shape[-1] ** -0.5, block_size=BLOCK)
            rec["drop"] = (drop - dense).abs().sum(dim=(0, 2, 3)).tolist()
        out["configs"].append(rec)
    return out


def cmd_run(a) -> int:
    from pisa_attn.qkv_file import read_qkv_file

    torch.set_num_threads(a.threads)
    files = sorted(glob.glob(os.path.join(a.data, "*.safetensors")))
    if a.images:
        want = a.images.split(",")
        files = [f for f in files if any(f"_{w}_" in os.path.basename(f) for w in want)]
    done = set()
    if os.path.exists(a.out):
        with open(a.out) as fh:
            done = {(r["input"], r["layer"]) for r in map(json.loads, fh)}
    with open(a.out, "a") as fh:
        for path in files:
            name = os.path.basename(path).split("_")[2]  # dinov2_vits14_<image>_<size>.safetensors
            for e in read_qkv_file(path).entries:
                if (name, e.layer) in done:
                    continue
                t0 = time.process_time()
                q, k, v = (x.double() for x in (e.q, e.k, e.v))
                keep = e.layout.keep_blocks(BLOCK)
                rec = {"input": name, "file": os.path.basename(path), "layer": e.layer, **measure_entry(q, k, v, keep)}
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                print(f"{name} layer {e.layer}: {time.process_time() - t0:.1f} s CPU", flush=True)
    return 0


# --- report ------------------------------------------------------------------------------------
def _interp(curve: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head error at per-head weights ``w`` ([H]) from a ``[G, H]`` curve (clamped to GRID)."""
    w = w.clamp(float(GRID[0]), float(GRID[-1]))
    pos = (w - GRID[0]) / (GRID[1] - GRID[0])
    i0 = pos.floor().long().clamp(0, GRID.numel() - 2)
    f = pos - i0
    h = torch.arange(curve.shape[1])
    return curve[i0, h] * (1 - f) + curve[i0 + 1, h] * f


class Table:
    """The JSONL, indexed: rows[(input, layer, density, rule)] -> record with tensors."""

    def __init__(self, path: str):
        self.rows, self.abs = {}, {}
        with open(path) as fh:
            for r in map(json.loads, fh):
                self.abs[(r["input"], r["layer"])] = torch.tensor(r["abs_dense"], dtype=torch.float64)
                for c in r["configs"]:
                    for mode in ("hybrid", "first"):
                        if mode in c:
                            m = c[mode]
                            m["curve"] = torch.tensor(m["curve"], dtype=torch.float64)
                            m["stats"] = cal.AlphaStats(*(torch.tensor(m[x], dtype=torch.float64) for x in ("cr", "cc", "rr")),
                                                        torch.zeros(len(m["cr"]), dtype=torch.float64))
                    self.rows[(r["input"], r["layer"], c["density"], c["rule"])] = c
        self.layers = sorted({k[1] for k in self.rows})
        # An input still being measured (run is resumable) is left out until it has every layer.
        self.inputs = sorted(i for i in {k[0] for k in self.rows} if all((i, l) in self.abs for l in self.layers))

    def err(self, inp, layer, d, rule, variant: str, w=None, mode="hybrid") -> float:
        """rel-L1 of one layer: variant 'drop'/'zeroth' or a weighted mode with per-head ``w``."""
        c = self.rows[(inp, layer, d, rule)]
        a = self.abs[(inp, layer)].sum()
        if variant in ("drop", "zeroth"):
            return float(sum(c[variant]) / a)
        curve = c[mode]["curve"]
        w = torch.as_tensor(w, dtype=torch.float64).expand(curve.shape[1])
        return float(_interp(curve, w).sum() / a)

    def stats(self, inputs, layer, d, rule, mode="hybrid") -> cal.AlphaStats:
        out = None
        for i in inputs:
            s = self.rows[(i, layer, d, rule)][mode]["stats"]
            out = s if out is None else out + s
        return out


def variants(t: Table, calib, d, rule):
    """name -> function(input, layer) -> rel-L1, with weights fitted on ``calib`` inputs only."""
    ls_head = {l: t.stats(calib, l, d, rule).alpha("head") for l in t.layers}
    ls_layer = {l: t.stats(calib, l, d, rule).alpha("layer") for l in t.layers}
    first_layer = {l: t.stats(calib, l, d, rule, "first").alpha("layer") for l in t.layers} if "first" in t.rows[(calib[0], 0, d, rule)] else None
    pooled = None
    for l in t.layers:
        s = t.stats(calib, l, d, rule)
        pooled = s if pooled is None else pooled + s
    ls_global = pooled.alpha("layer")
    l1_head = {l: torch.tensor(t.rows[(calib[0], l, d, rule)]["hybrid"]["l1_head"]) for l in t.layers}
    l1_layer = {l: t.rows[(calib[0], l, d, rule)]["hybrid"]["l1_layer"] for l in t.layers}
    v = {
        "zeroth": lambda i, l: t.err(i, l, d, rule, "zeroth"),
        "hybrid (w=1)": lambda i, l: t.err(i, l, d, rule, "hybrid", 1.0),
        "w per head (LS)": lambda i, l: t.err(i, l, d, rule, "hybrid", ls_head[l]),
        "w per layer (LS)": lambda i, l: t.err(i, l, d, rule, "hybrid", ls_layer[l]),
        "w global (LS)": lambda i, l: t.err(i, l, d, rule, "hybrid", ls_global),
        "w per head (LS) in [0, 1]": lambda i, l: t.err(i, l, d, rule, "hybrid", ls_head[l].clamp(0, 1)),
        "w=0.6 (no calibration)": lambda i, l: t.err(i, l, d, rule, "hybrid", 0.6),
        "w per head (L1)": lambda i, l: t.err(i, l, d, rule, "hybrid", l1_head[l]),
        "w per layer (L1)": lambda i, l: t.err(i, l, d, rule, "hybrid", l1_layer[l]),
        "w per head, same input (oracle)": lambda i, l: t.err(i, l, d, rule, "hybrid", t.stats([i], l, d, rule).alpha("head")),
    }
    if first_layer is not None:
        v = {"drop": lambda i, l: t.err(i, l, d, rule, "drop"), **v,
             "first (w=1, dense cost)": lambda i, l: t.err(i, l, d, rule, "first", 1.0, "first"),
             "first, w per layer (LS)": lambda i, l: t.err(i, l, d, rule, "first", first_layer[l], "first")}
    return v, {"ls_head": ls_head, "ls_layer": ls_layer, "ls_global": float(ls_global)}


def _mean(xs):
    return sum(xs) / len(xs)


def cmd_report(a) -> int:
    t = Table(a.jsonl)
    calib = a.calib.split(",")
    held = [i for i in t.inputs if i not in calib]
    lines = [f"Inputs: {', '.join(t.inputs)}; weights fitted on {', '.join(calib)}, errors on the other "
             f"{len(held)} (held out). rel-L1 over all 1370 query rows and 6 heads, float64 reference.", ""]
    summary = {}
    # 1. headline: per-layer table at 12.5% (topk), held-out mean over inputs
    for d in MAIN_DENSITIES:
        for rule in ("topk", "cov"):
            v, fits = variants(t, calib, d, rule)
            per_layer = {name: [_mean([f(i, l) for i in held]) for l in t.layers] for name, f in v.items()}
            summary[(d, rule)] = {name: _mean(x) for name, x in per_layer.items()}
            if d == HEADLINE:
                lines += [f"### density {d}, selection {rule}: held-out mean per layer", ""]
                names = list(per_layer)
                lines.append("| layer | " + " | ".join(names) + " | fitted w of the layer |")
                lines.append("|" + "---|" * (len(names) + 2))
                for j, l in enumerate(t.layers):
                    lines.append(f"| {l} | " + " | ".join(f"{per_layer[n][j]:.3f}" for n in names)
                                 + f" | {float(fits['ls_layer'][l]):.2f} |")
                lines.append("| mean | " + " | ".join(f"{summary[(d, rule)][n]:.3f}" for n in names)
                             + f" | global {fits['ls_global']:.2f} |")
                lines.append("")
                best0 = [min(per_layer["zeroth"][j], per_layer["hybrid (w=1)"][j]) for j in range(len(t.layers))]
                for n in ("w per head (LS)", "w per head (LS) in [0, 1]", "w per layer (LS)", "w global (LS)",
                          "w=0.6 (no calibration)"):
                    worst = max(per_layer[n][j] / best0[j] - 1 for j in range(len(t.layers)))
                    lines.append(f"- {n}: worst layer vs min(zeroth, hybrid): {100 * worst:+.1f}%")
                lines.append("")
    lines += ["### mean over layers and held-out inputs, by density and selection", ""]
    names = list(summary[(HEADLINE, "topk")])
    lines.append("| density | selection | " + " | ".join(names) + " |")
    lines.append("|" + "---|" * (len(names) + 2))
    for (d, rule), s in summary.items():
        lines.append(f"| {d} | {rule} | " + " | ".join(f"{s[n]:.3f}" if n in s else "" for n in names) + " |")
    lines.append("")
    # 2. selection per layer chosen on the calibration input (w per layer either way)
    for d in MAIN_DENSITIES:
        vt, _ = variants(t, calib, d, "topk")
        vc, _ = variants(t, calib, d, "cov")
        key = "w per layer (LS)"
        chosen = {l: "cov" if _mean([vc[key](i, l) for i in calib]) < _mean([vt[key](i, l) for i in calib]) else "topk"
                  for l in t.layers}
        held_err = _mean([_mean([(vc if chosen[l] == "cov" else vt)[key](i, l) for i in held]) for l in t.layers])
        lines.append(f"- density {d}: w per layer + selection (topk/cov) chosen per layer on the calibration input: "
                     f"held-out mean {held_err:.3f} (cov on {sum(c == 'cov' for c in chosen.values())}/{len(chosen)} layers)")
    lines.append("")
    # 3. uncalibrated default: one w for everything
    lines += [f"### one global weight, no calibration (density {HEADLINE}, topk): mean over layers, every input", ""]
    ws = [0.0, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9, 1.0]
    lines.append("| input | " + " | ".join(f"w={w:g}" for w in ws) + " |")
    lines.append("|" + "---|" * (len(ws) + 1))
    for i in t.inputs:
        e = [_mean([t.err(i, l, HEADLINE, "topk", "hybrid", w) for l in t.layers]) for w in ws]
        lines.append(f"| {i} | " + " | ".join(f"{x:.3f}" for x in e) + " |")
    alls = [_mean([_mean([t.err(i, l, HEADLINE, "topk", "hybrid", w) for l in t.layers]) for i in t.inputs]) for w in ws]
    lines.append("| mean | " + " | ".join(f"{x:.3f}" for x in alls) + " |")
    lines.append("")
    for d in MAIN_DENSITIES:
        for rule in ("topk", "cov"):
            mean = {w: _mean([_mean([t.err(i, l, d, rule, "hybrid", w) for l in t.layers]) for i in t.inputs]) for w in ws}
            ok = [w for w in ws if all(_mean([t.err(i, l, d, rule, "hybrid", w) for l in t.layers])
                                       < _mean([t.err(i, l, d, rule, "hybrid", 1.0) for l in t.layers]) for i in t.inputs)]
            lines.append(f"- density {d}, {rule}: weights beating w=1 on every input: {ok}; mean over inputs "
                         + ", ".join(f"w={w:g} {mean[w]:.3f}" for w in (0.0, 0.5, 0.6, 0.7, 0.8, 1.0)))
    lines.append("")
    # 4. exact-set rules at the headline density
    lines += [f"### exact-set rules at density {HEADLINE}: mean over layers and held-out inputs", ""]
    lines.append("| rule | exact blocks / query block | zeroth | hybrid (w=1) | w per layer (LS) | w=0.5 | tail mass |")
    lines.append("|---|---|---|---|---|---|---|")
    for rule in ("topk", "cov", *EXTRA_RULES):
        v, _ = variants(t, calib, HEADLINE, rule)
        nb = _mean([t.rows[(i, l, HEADLINE, rule)]["exact_blocks"] for i in held for l in t.layers])
        tm = _mean([_mean(t.rows[(i, l, HEADLINE, rule)]["tail_mass"]) for i in held for l in t.layers])
        e = [_mean([_mean([v[n](i, l) for i in held]) for l in t.layers]) for n in ("zeroth", "hybrid (w=1)", "w per layer (LS)")]
        e.append(_mean([_mean([t.err(i, l, HEADLINE, rule, "hybrid", 0.5) for i in held]) for l in t.layers]))
        lines.append(f"| {rule} | {nb:.2f} | " + " | ".join(f"{x:.3f}" for x in e) + f" | {tm:.3f} |")
    lines.append("")
    # 5. leave-one-out: calibrate on each input in turn
    lines += [f"### calibration input rotated (density {HEADLINE}, topk): held-out mean over the other inputs", ""]
    lines.append("| calibrated on | zeroth | hybrid (w=1) | w per head (LS) | w per layer (LS) | w global (LS) |")
    lines.append("|---|---|---|---|---|---|")
    for c in t.inputs:
        v, fits = variants(t, [c], HEADLINE, "topk")
        others = [i for i in t.inputs if i != c]
        e = [_mean([_mean([v[n](i, l) for i in others]) for l in t.layers])
             for n in ("zeroth", "hybrid (w=1)", "w per head (LS)", "w per layer (LS)", "w global (LS)")]
        lines.append(f"| {c} (global w {fits['ls_global']:.2f}) | " + " | ".join(f"{x:.3f}" for x in e) + " |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(text + "\n")
    return 0


# --- synthetic DiT-like heads ------------------------------------------------------------------
def cmd_synthetic(a) -> int:
    from pisa_attn.data import dit_qkv

    torch.set_num_threads(a.threads)
    cases = [("video 4x32x32", (4, 32, 32), 0), ("image 32x32 + 64 text", (32, 32), 64)]
    print("| data | density | drop | zeroth | hybrid (w=1) | " + " | ".join(f"w={w:g}" for w in a.alpha) + " | LS w per layer |")
    print("|" + "---|" * (6 + len(a.alpha)))
    for name, grid, text in cases:
        g = dit_qkv(grid, heads=8, head_dim=64, text_tokens=text, seed=a.seed, dtype=torch.float64, tiled=True)
        for d in MAIN_DENSITIES:
            t = cal.tail_terms(g.q, g.k, g.v, density=d, block_size=BLOCK)
            dense = metrics.dense_pass(g.q, g.k, g.v, block_size=BLOCK).out
            stats = ref.block_stats(g.k, g.v, BLOCK)
            drop, _ = ref.pisa_forward(g.q, g.k, g.v, stats, t.selected, mode="drop", scale=0.125, block_size=BLOCK)
            errs = [metrics.rel_l1(drop, dense), metrics.rel_l1(t.base, dense), metrics.rel_l1(t.output(1.0), dense)]
            errs += [metrics.rel_l1(t.output(w), dense) for w in a.alpha]
            errs.append(metrics.rel_l1(t.output(cal.fit_alpha(t, dense, over="layer")), dense))
            print(f"| {name} | {d} | " + " | ".join(f"{x:.4f}" for x in errs) + " |", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure every input file of --data into a JSONL (resumable)")
    r.add_argument("--data", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--images", default=None, help="comma list of image names (default: every file)")
    r.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("report", help="markdown tables from a run's JSONL")
    s.add_argument("jsonl")
    s.add_argument("--calib", default="astronaut", help="comma list of inputs the weights are fitted on")
    s.add_argument("--md", default=None, help="also write the tables to this file")
    y = sub.add_parser("synthetic", help="DiT-like synthetic heads: hybrid vs fixed weights")
    y.add_argument("--alpha", type=float, nargs="+", default=[0.5])
    y.add_argument("--seed", type=int, default=0)
    y.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    return {"run": cmd_run, "report": cmd_report, "synthetic": cmd_synthetic}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
