"""Opt-in per-layer error telemetry for :func:`apply_pisa` (``telemetry=`` argument).

For a sampled subset of managed self-attention calls it also computes exact attention and logs,
per (layer, step): the tail mass ρ (dense softmax mass on the blocks PISA approximates), the
weight α of the first-order tail term the layer uses (calibrated, loaded or the default), the
relative L1 error of PISA vs dense and of keep-or-drop sparse attention vs dense at the same
density. Dense calls (warm-up layers/steps, short sequences) are measured too, as "what PISA
would cost here". :func:`report` prints a per-layer table and can save a layer x step heat-map;
that is how a user picks a density or extra dense layers. Measuring costs a dense attention (and
a drop run) per sampled call, so sample sparingly on large models.
"""

from __future__ import annotations

import logging
import math
import numbers
import random
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from ..attention import pisa_attention
from .. import metrics, spec
from .._log import log_once
from ..layout import block_floor
from ..settings import as_bool
from . import hooks
from .models import transformers_of
from .paths import check_output_path

ATTR = "_pisa_telemetry"


@dataclass(frozen=True)
class TelemetryConfig:
    """Which calls to measure and what to keep.

    sample_rate: probability that a call is measured (seeded with ``seed``), in (0, 1].
    every:       measure every n-th call instead (calls 0, n, 2n, ... per transformer; when n
                 divides the managed layers per forward, always the same layers).
    drop:        also measure keep-or-drop sparse attention at the same density.
    include_dense: also measure calls that ran dense (what PISA would cost there).
    max_records: records kept; later sampled calls are counted but not measured.
    """

    sample_rate: float = 1.0
    every: int | None = None
    seed: int = 0
    drop: bool = True
    include_dense: bool = True
    max_records: int = 10_000

    def __post_init__(self):
        for name in ("drop", "include_dense"):  # a truthy string such as "no" must not read as True
            object.__setattr__(self, name, as_bool(name, getattr(self, name)))
        # numpy scalars are numbers too (np.float32 is no float subclass): kept as Python numbers
        r = self.sample_rate
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0.0 < float(r) <= 1.0:
            raise ValueError(f"sample_rate must be a float in (0, 1], got {r!r}")
        object.__setattr__(self, "sample_rate", float(r))
        e = self.every
        if e is not None and (isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 1):
            raise ValueError(f"every must be None or a positive int, got {self.every!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        m = self.max_records
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
            raise ValueError(f"max_records must be a positive int, got {self.max_records!r}")
        for name in ("every", "seed", "max_records"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))


def as_config(cfg) -> TelemetryConfig:
    """``True`` (every call), a sampling rate in (0, 1], or a :class:`TelemetryConfig`."""
    if isinstance(cfg, TelemetryConfig):
        return cfg
    if cfg is True:
        return TelemetryConfig()
    if isinstance(cfg, numbers.Real) and not isinstance(cfg, bool):
        if not 0.0 < float(cfg) <= 1.0:  # named as the caller wrote it, not as the config field
            raise ValueError(f"telemetry must be True, a sampling rate in (0, 1] or a TelemetryConfig, got {cfg!r}")
        return TelemetryConfig(sample_rate=float(cfg))
    raise TypeError(f"telemetry must be True, a sampling rate in (0, 1] or a TelemetryConfig, got {cfg!r}")


@dataclass
class Telemetry:
    """What :func:`attach` keeps on a transformer (still readable after :func:`detach`)."""

    config: TelemetryConfig
    calls: int = 0  # managed calls observed
    eligible: int = 0  # calls the sampling considered (all, or sparse only without include_dense)
    sampled: int = 0  # calls the sampling picked
    records: list[dict] = field(default_factory=list)
    skipped: int = 0  # sampled calls not measured because max_records was reached
    failed: int = 0  # sampled calls whose measurement raised (the forward went on without it)
    first_error: str | None = None  # the first such error, "Type: message"
    active: bool = True
    _rng: random.Random = field(default=None, repr=False)
    _remove: object = field(default=None, repr=False)

    def __getstate__(self) -> dict:
        # A copy (pickle, deepcopy, torch.save of its transformer) holds the records, not the hook:
        # the removal closure does not pickle, and a copy is attached to nothing.
        return {**self.__dict__, "_remove": None, "active": False}

    def observe(self, call: hooks.AttentionCall) -> None:
        self.calls += 1
        cfg = self.config
        if call.dense and not cfg.include_dense:
            return
        index = self.eligible
        self.eligible += 1
        if cfg.every is not None:
            if index % cfg.every:
                return
        elif cfg.sample_rate < 1.0 and self._rng.random() >= cfg.sample_rate:
            return
        self.sampled += 1
        if len(self.records) >= cfg.max_records:
            self.skipped += 1
            return
        try:
            record = measure(call, drop=cfg.drop)
        except Exception as e:  # noqa: BLE001 - a diagnostic (a dense pass per call) never fails the forward
            # e.g. out of memory for the dense reference on a large layer: counted, reported, skipped
            self.failed += 1
            if self.first_error is None:
                self.first_error = f"{type(e).__name__}: {e}"
            log_once(f"telemetry: a sampled call could not be measured and was skipped ({type(e).__name__}); "
                     "report() counts such calls and shows the first error", logging.WARNING)
            return
        self.records.append({"call": index, **record})


def attach(transformer, config=True) -> Telemetry:
    """Start measuring ``transformer``'s managed attention calls (replaces earlier telemetry)."""
    cfg = as_config(config)
    detach(transformer)
    tel = Telemetry(cfg, _rng=random.Random(cfg.seed))
    tel._remove = hooks.add_observer(transformer, tel.observe)
    # on the model, not a torch.compile wrapper of it: where get() (and the observer) look
    getattr(transformer, "_orig_mod", transformer).__dict__[ATTR] = tel
    return tel


def detach(transformer) -> Telemetry | None:
    """Stop measuring; the records stay readable by :func:`report` / :func:`get`."""
    tel = get(transformer)
    if tel is not None and tel.active:
        tel._remove()
        tel.active = False
    return tel


def get(transformer) -> Telemetry | None:
    return getattr(transformer, "_orig_mod", transformer).__dict__.get(ATTR)


@torch.no_grad()
def measure(call: hooks.AttentionCall, drop: bool = True) -> dict:
    """Tail mass and errors of one call, on the queries PISA handles (the image queries) and the
    valid keys of each batch row and the softmax scale, as the managed calls run them."""
    lo, hi = call.meta.get("image_range") or (0, call.q.shape[2])
    lens = call.meta.get("key_lens")
    bs = call.block_size
    start = block_floor(lo, bs)  # query blocks on the key blocks' grid, as the managed calls run them
    cut = lo - start  # leading rows (text) computed for the blocks' sake, not measured
    heads = call.q.shape[1]
    groups = defaultdict(list)
    for row in range(call.q.shape[0]):
        groups[call.k.shape[2] if not lens else int(lens[row])].append(row)
    err = {"pisa": [0.0, 0.0], "drop": [0.0, 0.0]}
    bias = [0.0, 0, 0]  # Σ_{b,h,c} |mean_t (pisa − dense)|, its count, the element count
    tail_sum = torch.zeros(heads, dtype=torch.float64)
    n_rows = 0
    for n, rows in groups.items():
        idx = torch.tensor(rows, device=call.q.device)
        q = call.q.index_select(0, idx)[:, :, start:hi]
        k, v = (x.index_select(0, idx)[:, :, :n] for x in (call.k, call.v))
        keep = None
        if call.keep_blocks is not None:
            keep = call.keep_blocks[: spec.num_blocks(n, bs)]
            keep = keep if bool(keep.any()) else None
        kw = dict(density=call.density, block_size=bs, covariance_aware=call.covariance_aware, keep_blocks=keep,
                  scale=call.scale, query_block=call.query_block)
        sel = metrics.select(q, k, v, **kw)
        dense = metrics.dense_pass(q, k, v, block_size=bs, masks=(sel.selected,), scale=call.scale)
        run_kw = dict(kw, backend=call.backend, precision=call.precision)  # as the sparse calls run
        if call.dense:  # what PISA would have given here (with the weight the layer has now)
            alpha = None if call.alpha is None else torch.tensor(call.alpha, dtype=torch.float64)
            pisa = pisa_attention(q, k, v, mode=call.mode, alpha=alpha, **run_kw)[:, :, cut:]
        else:
            pisa = call.out.index_select(0, idx)[:, :, lo:hi]
        outs = {"pisa": pisa}
        if drop:
            outs["drop"] = pisa if call.mode == "drop" else pisa_attention(q, k, v, mode="drop", **run_kw)[:, :, cut:]
        d = dense.out[:, :, cut:].double()
        for name, o in outs.items():
            err[name][0] += float((o.double() - d).abs().sum())
            err[name][1] += float(d.abs().sum())
        e = pisa.double() - d  # the signed error's offset shared by the rows (what adds up over layers)
        bias[0] += float(e.mean(dim=2).abs().sum())
        bias[1] += e.shape[0] * e.shape[1] * e.shape[3]
        bias[2] += e.numel()
        tail_sum += dense.tail_mass[0][:, :, cut:].double().sum(dim=(0, 2)).cpu()
        n_rows += len(rows) * (hi - lo)
    per_head = (tail_sum / max(1, n_rows)).tolist()
    return {
        "layer": call.layer, "step": call.step, "dense": call.dense, "dense_reason": call.meta.get("dense_reason"),
        "density": call.density, "mode": call.mode, "tokens": call.k.shape[2],
        "tail_mass": sum(per_head) / len(per_head), "tail_mass_per_head": per_head,
        "alpha": None if call.alpha is None else sum(call.alpha) / len(call.alpha),
        "alpha_per_head": None if call.alpha is None else list(call.alpha),
        "rel_l1_pisa": err["pisa"][0] / max(err["pisa"][1], 1e-300),
        "bias_pisa": (bias[0] / max(bias[1], 1)) / max(err["pisa"][1] / max(bias[2], 1), 1e-300),
        "covariance_aware": call.covariance_aware,
        "rel_l1_drop": err["drop"][0] / max(err["drop"][1], 1e-300) if drop else None,
    }


# --- report ------------------------------------------------------------------------------------
def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def _selection(rules) -> str:
    """The selection rule of a layer's records: ``cov`` (covariance-aware), ``top-k`` or ``mixed``."""
    seen = {bool(x) for x in rules if x is not None}
    return "-" if not seen else "mixed" if len(seen) > 1 else ("cov" if seen.pop() else "top-k")


def summarize(tel: Telemetry) -> dict:
    """Per-layer means and the layer x step grids of one transformer's records."""
    by_layer, by_cell = defaultdict(list), defaultdict(list)
    for r in tel.records:
        by_layer[r["layer"]].append(r)
        by_cell[(r["layer"], r["step"])].append(r)
    layers = sorted(by_layer)
    steps = sorted({s for _, s in by_cell})
    rows = []
    for layer in layers:
        rs = by_layer[layer]
        rows.append({
            "layer": layer, "samples": len(rs), "dense_fraction": _mean([float(r["dense"]) for r in rs]),
            "tail_mass": _mean([r["tail_mass"] for r in rs]), "alpha": _mean([r.get("alpha") for r in rs]),
            "rel_l1_pisa": _mean([r["rel_l1_pisa"] for r in rs]), "bias_pisa": _mean([r.get("bias_pisa") for r in rs]),
            "selection": _selection([r.get("covariance_aware") for r in rs]),
            "rel_l1_pisa_max": max(r["rel_l1_pisa"] for r in rs), "rel_l1_drop": _mean([r["rel_l1_drop"] for r in rs]),
        })

    def grid(key):
        return [[_mean([r[key] for r in by_cell.get((layer, s), [])]) for s in steps] for layer in layers]

    return {
        "config": asdict(tel.config), "calls": tel.calls, "eligible": tel.eligible, "sampled": tel.sampled,
        "records": len(tel.records), "skipped": tel.skipped, "failed": tel.failed, "first_error": tel.first_error,
        "layers": rows,
        "heatmap": {"layers": layers, "steps": steps, "rel_l1_pisa": grid("rel_l1_pisa"),
                    "tail_mass": grid("tail_mass")},
    }


def report(pipe_or_transformer, heatmap: str | None = None, *, console=None) -> dict:
    """Print a per-layer table of the telemetry of ``pipe_or_transformer`` (a pipeline: each of
    its transformers) and, with ``heatmap`` (a .png path), save layer x step heat-maps of rel-L1
    and tail mass. Returns ``{transformer name: summary}``. ValueError when nothing was recorded;
    a bad ``heatmap`` path (or a missing matplotlib) is refused before anything prints."""
    if heatmap is not None:
        heatmap = _check_heatmap(heatmap)
    from rich.console import Console
    from rich.table import Table

    found = [(n, get(t)) for n, t in transformers_of(pipe_or_transformer)[0]]
    found = [(n, t) for n, t in found if t is not None]
    if not found:
        raise ValueError("no telemetry on this pipeline/transformer: use apply_pisa(..., telemetry=rate) first")
    out = {name: summarize(tel) for name, tel in found}
    if all(s["records"] == 0 for s in out.values()):
        failed = {name: s["first_error"] for name, s in out.items() if s["failed"]}
        if failed:
            raise ValueError(f"telemetry measured no call: every sampled call failed to measure, first {failed}")
        raise ValueError("telemetry is attached but recorded no call yet: run the pipeline first")
    console = console or Console()
    for name, s in out.items():
        t = Table(title=f"PISA telemetry, {name}: {s['records']} measured of {s['calls']} calls "
                        f"(density {_densities(found, name)})")
        for col in ("layer", "samples", "dense", "selection", "tail mass ρ", "α (mean)", "rel-L1 PISA", "max",
                    "bias PISA", "rel-L1 drop", "PISA/drop"):
            t.add_column(col, justify="right")
        for r in s["layers"]:
            ratio = r["rel_l1_pisa"] / r["rel_l1_drop"] if r["rel_l1_drop"] and r["rel_l1_drop"] > 0 else math.nan
            t.add_row(str(r["layer"]), str(r["samples"]), f"{r['dense_fraction']:.0%}", r.get("selection", "-"),
                      f"{r['tail_mass']:.4f}", _fmt(r.get("alpha"), 3), f"{r['rel_l1_pisa']:.4f}",
                      f"{r['rel_l1_pisa_max']:.4f}", _fmt(r.get("bias_pisa")), _fmt(r["rel_l1_drop"]), _fmt(ratio, 2))
        console.print(t)
        if s["failed"]:
            console.print(f"{s['failed']} sampled call(s) could not be measured and were skipped; "
                          f"the first: {s['first_error']}")
    if heatmap is not None:
        save_heatmap(out, heatmap)
    return out


def _check_heatmap(path) -> str:
    path = check_output_path(path, "heatmap")
    try:
        import matplotlib.figure
    except ImportError:
        raise ImportError("report(heatmap=...) needs matplotlib: pip install 'pisa-attn[plot]'") from None
    # pgf needs a TeX installation: it would fail only after the table was printed
    formats = set(matplotlib.figure.Figure().canvas.get_supported_filetypes()) - {"pgf"}
    suffix = path.rpartition(".")[2].lower() if "." in path.rpartition("/")[2] else ""
    if suffix not in formats:
        raise ValueError(f"heatmap {path!r} must end in an image format matplotlib writes "
                         f"({', '.join('.' + f for f in sorted(formats))})")
    return path


def _densities(found, name) -> str:
    tel = dict(found)[name]
    return ", ".join(f"{d:g}" for d in sorted({r["density"] for r in tel.records})) or "-"


def _fmt(x, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def save_heatmap(summaries: dict, path: str) -> None:
    """Layer x step heat-maps (rel-L1 of PISA, tail mass) per transformer into one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(summaries)
    fig = Figure(figsize=(11, 0.5 + 3.2 * n))
    FigureCanvasAgg(fig)  # headless without pyplot: the user's matplotlib backend stays as it was
    axes = fig.subplots(n, 2, squeeze=False)
    for (name, s), row in zip(summaries.items(), axes):
        hm = s["heatmap"]
        for ax, key, label in ((row[0], "rel_l1_pisa", "rel-L1 PISA vs dense"), (row[1], "tail_mass", "tail mass ρ")):
            data = torch.tensor(hm[key], dtype=torch.float64).numpy() if hm["layers"] else [[math.nan]]
            im = ax.imshow(data, aspect="auto", origin="lower", cmap="magma", interpolation="nearest")
            ax.set_xlabel("denoising step")
            ax.set_ylabel("attention layer")
            ax.set_xticks(range(len(hm["steps"])), [str(x) for x in hm["steps"]], fontsize=6)
            ax.set_yticks(range(len(hm["layers"])), [str(x) for x in hm["layers"]], fontsize=6)
            ax.set_title(f"{name}: {label}", fontsize=9)
            fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
