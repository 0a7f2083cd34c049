"""``pisa-attn study``: what a density costs in accuracy, on the synthetic generator or captured q/k/v.

Reproduces the paper's ablation data (relative L1 error vs density and vs length for drop / zeroth /
hybrid / first, with and without covariance-aware selection), the Figure-3 distributions of
pre-softmax scores of selected vs tail blocks, the tail mass ρ_t per head, and the effect of token
tiling. ``--out DIR`` receives ``study.json`` and, with matplotlib installed, PNG plots.

``hybrid`` and ``first`` are the paper's terms (first-order weight α = 1). Two weighted hybrid
variants sit beside them: ``hybrid-default`` (α = :data:`pisa_attn.spec.DEFAULT_ALPHA`, what
``pisa_attention`` does without calibration) and ``hybrid-calibrated`` (α per head fitted by least
squares on ANOTHER input -- the synthetic generator's next seed, the same layer at another
captured step, or ``--calib-source`` -- and evaluated on this one: an honest split).

Run as ``pisa-attn study`` or ``python -m pisa_attn.bench.study``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

from .. import __version__
from .. import calibration as cal
from .. import metrics, spec
from ..attention import make_plan, pisa_attention
from ..ops import reference as ref
from ..ops.quant import lowp_pisa_forward
from . import argtypes as at
from .study_sources import CapturedSource, Sample, SyntheticSource, synthetic_grid

MODES = ("drop", "zeroth", "hybrid", "first")
WEIGHTS = ("default", "calibrated")  # weighted hybrid variants (see the module docstring)
SIZES = ("tiny", "default", "paper")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# Preset sizes. "default" is the CPU size (a few minutes on two cores); "paper" is the paper's
# setting (32K tokens, 4K-64K sweep), the default with --device cuda; "tiny" is for CI.
PRESETS = {
    "tiny": dict(length=512, lengths=(256, 512), densities=(0.1, 0.2, 0.5, 1.0), heads=4, token_rows=64),
    "default": dict(length=4096, lengths=(1024, 2048, 4096, 8192), densities=(0.05, 0.1, 0.2, 0.3, 0.5),
                    heads=4, token_rows=256),
    "paper": dict(length=32768, lengths=(4096, 8192, 16384, 32768, 65536),
                  densities=(0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5), heads=8, token_rows=512),
}


@dataclass
class StudyConfig:
    """Everything the study does. ``None`` fields take the value of the ``size`` preset."""

    source: str = "synthetic"  # "synthetic" or a .safetensors capture file
    size: str | None = None  # tiny / default / paper; None: "default" on CPU, "paper" on CUDA
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    length: int | None = None  # density sweep length (synthetic)
    lengths: tuple[int, ...] | None = None  # length sweep (synthetic; captured: number of crops)
    densities: tuple[float, ...] | None = None
    density: float = 0.2  # length sweep, score distributions and per-head tail mass
    modes: tuple[str, ...] = MODES
    covariance: bool = True  # also run covariance-aware selection
    weights: tuple[str, ...] = WEIGHTS  # weighted hybrid variants (with "hybrid" in modes)
    calib_source: str | None = None  # capture file the calibrated variant fits on (captured sources; the
    # studied file itself means the default: another step of it, never the evaluated input)
    tiling_modes: tuple[str, ...] = ("drop", "zeroth", "hybrid")
    heads: int | None = None  # heads, head_dim, text_tokens: the synthetic source's (a capture has its own)
    head_dim: int | None = None  # None: 64
    text_tokens: int | None = None  # None: 0
    seed: int = 0
    block_size: int = 64
    entries: tuple[str, ...] | None = None  # captured entries ("step0.layer3"); None: the first few
    max_entries: int = 4
    token_rows: int | None = None  # query rows sampled for per-token score histograms
    bins: int = 60
    plots: bool = True
    fp8: bool = False  # shorthand for "fp8" in precisions
    # also the default hybrid with the exact blocks in these low precisions' quantised math
    # (spec.PRODUCT_FORMATS: "fp8", "int8-fp8", "int8"), variants "hybrid-<precision>"
    precisions: tuple[str, ...] = ()

    @property
    def low_precisions(self) -> tuple[str, ...]:
        """``precisions``, with ``"fp8"`` first when ``fp8`` is set (no repeats)."""
        return tuple(dict.fromkeys((("fp8",) if self.fp8 is True else ()) + tuple(self.precisions)))

    def resolved(self) -> StudyConfig:
        """Presets filled in and every field validated (ValueError/TypeError naming the field)."""
        self._check_types()
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        cuda = str(self.device).startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} requested but CUDA is not available")
        size = self.size or ("paper" if cuda else "default")
        if size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {size!r}")
        p = PRESETS[size]
        synthetic = self.source == "synthetic"
        given = [n for n in ("heads", "head_dim", "text_tokens") if getattr(self, n) is not None]
        if not synthetic and given:
            raise ValueError(f"{', '.join(given)} describe the synthetic source; a capture ({self.source!r}) "
                             "carries its own heads, head dim and text tokens: leave them out")
        c = replace(
            self,
            size=size,
            dtype=self.dtype or ("bfloat16" if cuda else "float32"),
            length=self.length if self.length is not None else p["length"],
            lengths=tuple(self.lengths) if self.lengths is not None else p["lengths"],
            densities=tuple(self.densities) if self.densities is not None else p["densities"],
            # a capture's are its own: None in the resolved config (and the study's JSON)
            heads=self.heads if self.heads is not None or not synthetic else p["heads"],
            head_dim=self.head_dim if self.head_dim is not None or not synthetic else 64,
            text_tokens=self.text_tokens if self.text_tokens is not None or not synthetic else 0,
            token_rows=self.token_rows if self.token_rows is not None else p["token_rows"],
            modes=tuple(self.modes),
            weights=tuple(self.weights),
            tiling_modes=tuple(self.tiling_modes),
            entries=tuple(self.entries) if self.entries else None,
            precisions=tuple(self.precisions) if isinstance(self.precisions, (list, tuple)) else self.precisions,
        )
        c._validate()
        return c

    def _check_types(self) -> None:
        """The types presets and later checks rely on: a string where a bool is expected would be
        truthy, a string where a list is expected a list of its characters."""
        for name in ("covariance", "plots", "fp8"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, optional in (("source", False), ("device", False), ("size", True), ("dtype", True),
                               ("calib_source", True)):
            v = getattr(self, name)
            if not (isinstance(v, str) or (optional and v is None)):
                raise TypeError(f"{name} must be a str{' or None' if optional else ''}, got {v!r} ({type(v).__name__})")
        for name in ("lengths", "densities", "modes", "weights", "tiling_modes", "entries", "precisions"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (list, tuple)):
                raise TypeError(f"{name} must be a list or tuple, got {v!r} ({type(v).__name__})")
        if self.entries is not None and any(not isinstance(e, str) for e in self.entries):
            raise TypeError(f"entries must be entry names (str), got {self.entries!r}")

    def _validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        synthetic = self.source == "synthetic"  # heads, head_dim, text_tokens: None for a capture
        for name in ("length", "heads", "head_dim", "block_size", "max_entries", "token_rows", "bins"):
            v = getattr(self, name)
            if v is None and not synthetic and name in ("heads", "head_dim"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size!r}")
        if synthetic and (not 16 <= self.head_dim <= 256 or self.head_dim % 2):
            raise ValueError(f"head_dim must be even and in [16, 256], got {self.head_dim!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if (synthetic or self.text_tokens is not None) and (
                isinstance(self.text_tokens, bool) or not isinstance(self.text_tokens, int) or self.text_tokens < 0):
            raise ValueError(f"text_tokens must be a non-negative int, got {self.text_tokens!r}")
        if not self.densities or any(not _is_density(d) for d in self.densities):
            raise ValueError(f"densities must be a non-empty list of floats in (0, 1], got {self.densities!r}")
        if not _is_density(self.density):
            raise ValueError(f"density must be a float in (0, 1], got {self.density!r}")
        if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be a non-empty list of positive ints, got {self.lengths!r}")
        for name in ("modes", "tiling_modes"):
            bad = [m for m in getattr(self, name) if m not in MODES]
            if bad or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty subset of {MODES}, got {getattr(self, name)!r}")
        if self.source != "synthetic" and not os.path.isfile(self.source):
            raise ValueError(f"source must be 'synthetic' or an existing .safetensors file, got {self.source!r}")
        if self.source == "synthetic" and self.entries:
            raise ValueError(f"entries pick entries of a capture file: they need a captured source, got "
                             f"entries={self.entries!r} with source 'synthetic'")
        if self.source == "synthetic":
            for name, ns in (("length", (self.length,)), ("lengths", self.lengths)):
                for n in ns:
                    try:
                        synthetic_grid(n)
                    except ValueError:
                        raise ValueError(f"{name} of the synthetic source must be multiples of 64 tokens "
                                         f"(>= 64), got {n!r}") from None
        if not isinstance(self.fp8, bool):
            raise TypeError(f"fp8 must be a bool, got {self.fp8!r}")
        if not isinstance(self.precisions, tuple) or any(p not in spec.PRODUCT_FORMATS for p in self.precisions):
            raise ValueError(f"precisions must be a subset of {tuple(spec.PRODUCT_FORMATS)}, got {self.precisions!r}")
        if self.low_precisions and "hybrid" not in self.modes:
            raise ValueError(f"fp8 / precisions add variants of the default hybrid: they need 'hybrid' in modes, "
                             f"got {self.modes!r}")
        if any(w not in WEIGHTS for w in self.weights):
            raise ValueError(f"weights must be a subset of {WEIGHTS}, got {self.weights!r}")
        if self.calib_source is not None and (self.source == "synthetic" or not os.path.isfile(self.calib_source)):
            raise ValueError(f"calib_source must be an existing capture file, for a captured source, got "
                             f"{self.calib_source!r} (source {self.source!r})")


def _is_density(d) -> bool:
    return not isinstance(d, bool) and isinstance(d, (int, float)) and 0.0 < float(d) <= 1.0


def variant(mode: str, cov: bool) -> str:
    return f"{mode}+cov" if cov else mode


def _paper(mode: str) -> dict:
    """The paper's term for the ``modes`` variants: first-order weight 1 where there is one."""
    return {"alpha": 1.0} if mode in spec.FIRST_ORDER_MODES else {}


def _selection_name(cov: bool) -> str:
    return "cov" if cov else "topk"


class _Study:
    def __init__(self, cfg: StudyConfig, progress: bool):
        self.cfg = cfg
        self.covs = (False, True) if cfg.covariance else (False,)
        self.backend = "auto" if str(cfg.device).startswith("cuda") else "reference"
        self.progress = progress
        self.bar = None
        self.partners = None  # where the calibrated variant fits its weights (set by run)
        self._alphas: dict = {}

    # --- one sample ---------------------------------------------------------------------------
    def weighted(self, modes) -> tuple[str, ...]:
        """The weighted hybrid variants this study runs."""
        if "hybrid" not in modes:
            return ()
        return tuple(w for w in self.cfg.weights if w != "calibrated" or self.partners is not None)

    def calibrated_alpha(self, partner: Sample, density: float, cov: bool):
        """Per-head least-squares weight fitted on ``partner`` (every query row PISA runs, its text
        blocks kept exact), clamped to [0, 1]: what the calibrated variant uses."""
        key = (id(partner), density, cov)
        if key not in self._alphas:
            bs = self.cfg.block_size
            run, cut = partner.query_rows(bs)
            fit = cal.fit_rows(partner.q[:, :, run], partner.k, partner.v, density=density, block_size=bs,
                               measured=(cut.start, cut.stop), covariance_aware=cov,
                               keep_blocks=partner.keep_blocks(bs))
            self._alphas[key] = (partner, fit.stats.alpha(default=spec.DEFAULT_ALPHA, bounds=cal.FIT_BOUNDS).float())
        return self._alphas[key][1]

    def evaluate(self, s: Sample, densities, modes, covs, tail_densities=(), weighted: bool = True) -> dict:
        """rel-L1 of every (mode, selection, density) and the per-head tail mass of every
        (selection, density in densities ∪ tail_densities) on one sample; with ``hybrid`` in
        ``modes`` and ``weighted`` also its weighted variants (``hybrid-calibrated`` only when the
        sample has a calibration partner)."""
        bs = self.cfg.block_size
        keep = s.keep_blocks(bs)
        run, cut = s.query_rows(bs)
        q = s.q[:, :, run]
        stats = ref.block_stats(s.k, s.v, bs, with_hdev=any(covs))
        all_d = list(dict.fromkeys([*densities, *tail_densities]))
        sels = {(d, c): metrics.select(q, s.k, s.v, density=d, block_size=bs, covariance_aware=c,
                                       keep_blocks=keep, stats=stats) for d in all_d for c in covs}
        dense = metrics.dense_pass(q, s.k, s.v, block_size=bs, masks=tuple(x.selected for x in sels.values()),
                                   kmean=stats.kmean)
        self._tick(f"dense L={s.length}")
        tail = {(d, c): t[:, :, cut].mean(dim=(0, 2)).tolist() for (d, c), t in zip(sels, dense.tail_mass)}
        estimate = {(d, c): t[:, :, cut].mean(dim=(0, 2)).tolist() for (d, c), t in zip(sels, dense.tail_estimate)}
        exact = dense.out[:, :, cut]
        rel, rel_head = {}, {}
        for c in covs:
            for m in modes:
                name = variant(m, c)
                rel[name], rel_head[name] = [], []
                for d in densities:
                    out = pisa_attention(q, s.k, s.v, density=d, block_size=bs, mode=m, covariance_aware=c,
                                         keep_blocks=keep, backend=self.backend, **_paper(m))[:, :, cut]
                    rel[name].append(metrics.rel_l1(out, exact))
                    rel_head[name].append(metrics.rel_l1_per_head(out, exact).tolist())
                    self._tick(f"{name} d={d:g} L={s.length}")
        partner = self.partners.partner(s) if self.partners is not None and weighted else None
        alphas = {}
        for c in covs:
            for w in self.weighted(modes) if weighted else ():
                if w == "calibrated" and partner is None:
                    continue
                name = variant(f"hybrid-{w}", c)
                rel[name], rel_head[name] = [], []
                for d in densities:
                    alpha = None if w == "default" else self.calibrated_alpha(partner, d, c)
                    if alpha is not None:
                        alphas.setdefault(_selection_name(c), []).append(alpha.tolist())
                    out = pisa_attention(q, s.k, s.v, density=d, block_size=bs, mode="hybrid", covariance_aware=c,
                                         keep_blocks=keep, backend=self.backend, alpha=alpha)[:, :, cut]
                    rel[name].append(metrics.rel_l1(out, exact))
                    rel_head[name].append(metrics.rel_l1_per_head(out, exact).tolist())
                    self._tick(f"{name} d={d:g} L={s.length}")
        for prec in (self.cfg.low_precisions if weighted and "hybrid" in modes else ()):
            # The default hybrid (alpha = spec.DEFAULT_ALPHA) with the exact blocks' Q·Kᵀ and P·V in
            # this precision's formats, as ops/quant.py states the Hopper kernel's math (PyTorch,
            # any device).
            alpha = torch.full((q.shape[1],), spec.DEFAULT_ALPHA, dtype=torch.float32, device=q.device)
            for c in covs:
                name = variant(f"hybrid-{prec}", c)
                rel[name], rel_head[name] = [], []
                for d in densities:
                    out, _ = lowp_pisa_forward(q, s.k, s.v, stats.kmean, stats.vsum, stats.hbar, sels[(d, c)].selected,
                                               mode="hybrid", scale=q.shape[-1] ** -0.5, block_size=bs, alpha=alpha,
                                               precision=prec)
                    out = out[:, :, cut]
                    rel[name].append(metrics.rel_l1(out, exact))
                    rel_head[name].append(metrics.rel_l1_per_head(out, exact).tolist())
                    self._tick(f"{name} d={d:g} L={s.length}")
        return {"rel_l1": rel, "rel_l1_per_head": rel_head, "tail": tail, "estimate": estimate, "sels": sels,
                "alpha": alphas, "partner": None if partner is None else partner.name}

    def _tick(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    # --- sections -----------------------------------------------------------------------------
    def run(self, source) -> dict:
        cfg = self.cfg
        fixed = source.fixed(cfg.length)
        sweep = source.sweep(cfg.lengths, min_tokens=4 * cfg.block_size)
        tiled = [s for s in fixed if s.layout is not None and not s.layout.is_identity]
        # The density sweep's tiled results serve the tiling comparison when they cover it.
        reuse = len(tiled) == len(fixed) and set(cfg.tiling_modes) <= set(cfg.modes)
        if "calibrated" in cfg.weights and "hybrid" in cfg.modes:
            self.partners = source.calibration(cfg.calib_source) if cfg.calib_source else source.calibration()
        n_var = (len(cfg.modes) + len(self.weighted(cfg.modes)) + len(cfg.low_precisions)) * len(self.covs)
        total = len(fixed) * (1 + n_var * len(cfg.densities))
        total += sum(len(ss) for _, ss in sweep if not self._reuses(ss, fixed)) * (1 + n_var)
        total += len(tiled) * (1 + len(cfg.tiling_modes) * len(cfg.densities)) * (1 if reuse else 2)
        from tqdm.auto import tqdm

        with tqdm(total=total, desc="pisa-attn study", unit="run", disable=not self.progress, file=sys.stderr) as bar:
            self.bar = bar
            t0 = time.perf_counter()
            fixed_evals = [self.evaluate(s, cfg.densities, cfg.modes, self.covs, (cfg.density,)) for s in fixed]
            t1 = time.perf_counter()
            sweep_evals = [(n, self._sweep_point(ss, fixed, fixed_evals)) for n, ss in sweep]
            t2 = time.perf_counter()
            tiling = self.tiling(tiled, fixed_evals if reuse else None)
            t3 = time.perf_counter()
            scores = self.scores(fixed, fixed_evals)
            t4 = time.perf_counter()
        self.bar = None
        result = {
            "backends": self._backends(fixed[0]),
            "alpha_default": spec.DEFAULT_ALPHA,
            "calibration": self._calibration_section(fixed, fixed_evals),
            "density_sweep": self._density_section(fixed, fixed_evals),
            "length_sweep": self._length_section(sweep_evals, [ss for _, ss in sweep]),
            "scores": scores,
            "tail_mass": self._tail_section(fixed, fixed_evals),
            "tiling": tiling,
            "timings_s": {"density_sweep": t1 - t0, "length_sweep": t2 - t1, "tiling": t3 - t2, "scores": t4 - t3},
        }
        return result

    def _backends(self, s: Sample) -> dict:
        """What actually ran per mode ("triton" or "reference": auto falls back per mode)."""
        c = self.cfg
        out = {variant(m, cov): make_plan(s.q, s.k, c.density, c.block_size, m, cov, None, self.backend).backend
               for cov in self.covs for m in c.modes}
        for cov in self.covs:
            for w in self.weighted(c.modes):
                out[variant(f"hybrid-{w}", cov)] = out[variant("hybrid", cov)]
        return out

    def _calibration_section(self, fixed, evals) -> dict | None:
        """Where the calibrated variant fitted its weights, and the weights (per sample, selection,
        density: one per head)."""
        if "calibrated" not in self.cfg.weights or "hybrid" not in self.cfg.modes:
            return None
        if self.partners is None or any(e["partner"] is None for e in evals):
            missing = [s.name for s, e in zip(fixed, evals) if e["partner"] is None]
            return {"skipped": f"no calibration input for {missing}: pass calib_source (another capture of "
                               f"the same model) or capture several steps"}
        return {"on": self.partners.note, "fit": "least squares per head, clamped to [0, 1]",
                "densities": list(self.cfg.densities),
                "partners": {s.name: e["partner"] for s, e in zip(fixed, evals)},
                "alpha": {s.name: e["alpha"] for s, e in zip(fixed, evals)}}

    def _reuses(self, samples, fixed) -> bool:
        return (self.cfg.density in self.cfg.densities and len(samples) == len(fixed)
                and all(a is b for a, b in zip(samples, fixed)))

    def _sweep_point(self, samples, fixed, fixed_evals) -> list[dict]:
        """Length-sweep evaluations; the density sweep's own samples are not run twice."""
        cfg = self.cfg
        if self._reuses(samples, fixed):
            i = cfg.densities.index(cfg.density)
            return [{**e, "rel_l1": {k: [v[i]] for k, v in e["rel_l1"].items()}} for e in fixed_evals]
        return [self.evaluate(s, (cfg.density,), cfg.modes, self.covs) for s in samples]

    def _density_section(self, fixed, evals) -> dict:
        cfg = self.cfg
        return {
            "length": fixed[0].length,
            "samples": [s.name for s in fixed],
            "sample_lengths": [s.length for s in fixed],  # "length" is the first's; summarize keeps them apart
            "densities": list(cfg.densities),
            "rel_l1": _mean_dicts([e["rel_l1"] for e in evals]),
            "rel_l1_per_sample": {s.name: e["rel_l1"] for s, e in zip(fixed, evals)},
            "rel_l1_per_head": _mean_dicts([e["rel_l1_per_head"] for e in evals]),
            "tail_mass": self._per_density(evals, "tail", cfg.densities),
            "tail_estimate": self._per_density(evals, "estimate", cfg.densities),
        }

    def _per_density(self, evals, key, densities) -> dict:
        """Mean over samples and heads of a per-head quantity, per selection and density."""
        return {_selection_name(c): [_mean([_mean(e[key][(d, c)]) for e in evals]) for d in densities]
                for c in self.covs}

    def _length_section(self, sweep_evals, samples) -> dict:
        """``lengths``: the sweep's points as asked (synthetic: image tokens); ``tokens``: each
        point's sequence length (text included: the unit of the density sweep's ``length``)."""
        cfg = self.cfg
        names = [n for n in sweep_evals[0][1][0]["rel_l1"] if all(n in e["rel_l1"] for _, evs in sweep_evals
                                                                    for e in evs)] if sweep_evals else []
        rel = {n: [_mean([e["rel_l1"][n][0] for e in evs]) for _, evs in sweep_evals] for n in names}
        tail = {_selection_name(c): [self._per_density(evs, "tail", (cfg.density,))[_selection_name(c)][0]
                                     for _, evs in sweep_evals] for c in self.covs}
        return {"density": cfg.density, "lengths": [n for n, _ in sweep_evals],
                "tokens": [ss[0].length if ss else None for ss in samples], "rel_l1": rel, "tail_mass": tail}

    def _tail_section(self, fixed, evals) -> dict:
        d = self.cfg.density
        per_head = {_selection_name(c): _mean_lists([e["tail"][(d, c)] for e in evals]) for c in self.covs}
        est = {_selection_name(c): _mean_lists([e["estimate"][(d, c)] for e in evals]) for c in self.covs}
        lengths = sorted({s.length for s in fixed})
        # The tail mass grows with the length at one density: a mean over lengths compares nothing.
        by_length = {_selection_name(c): {str(n): _mean([_mean(e["tail"][(d, c)]) for s, e in zip(fixed, evals)
                                                         if s.length == n]) for n in lengths} for c in self.covs}
        return {"density": d, "per_head": per_head, "estimate_per_head": est, "lengths": lengths,
                "mean_by_length": by_length,
                "mean": {k: _mean(v) for k, v in per_head.items()},
                "max_head": {k: max(v) for k, v in per_head.items()},
                # Share of the tail mass the block centroids recover (PISA's 0th-order term; 1 = all).
                "estimate_ratio": {k: _mean(est[k]) / max(_mean(v), 1e-30) for k, v in per_head.items()}}

    def tiling(self, tiled: list[Sample], tiled_evals) -> dict | None:
        """Tiled vs raster order at every sweep density (plain top-k selection)."""
        cfg = self.cfg
        if not tiled:
            return None
        if tiled_evals is None:
            tiled_evals = [self.evaluate(s, cfg.densities, cfg.tiling_modes, (False,), weighted=False) for s in tiled]
        raster = [s.raster() for s in tiled]
        raster_evals = [self.evaluate(s, cfg.densities, cfg.tiling_modes, (False,), weighted=False) for s in raster]

        def summary(evals):
            return {"rel_l1": {m: _mean_lists([e["rel_l1"][m] for e in evals]) for m in cfg.tiling_modes},
                    "tail_mass": [_mean([_mean(e["tail"][(d, False)]) for e in evals]) for d in cfg.densities]}

        return {"densities": list(cfg.densities), "modes": list(cfg.tiling_modes),
                "tile": list(tiled[0].layout.tile or ()), "order": tiled[0].layout.order,
                "tiled": summary(tiled_evals), "raster": summary(raster_evals),
                "compactness": {"tiled": tiled[0].layout.compactness(cfg.block_size),
                                "raster": raster[0].layout.compactness(cfg.block_size)}}

    def scores(self, fixed: list[Sample], evals) -> dict:
        """Figure 3: pre-softmax scores of selected vs tail blocks (plain top-k at ``density``),
        raw and shifted by the row maximum (the kernels' safe-exp), block means and tokens."""
        cfg = self.cfg
        bs = cfg.block_size
        parts = {k: ([], []) for k in ("block_mean", "block_mean_shifted", "token", "token_shifted")}
        gen = torch.Generator().manual_seed(cfg.seed)
        for s, e in zip(fixed, evals):
            sel = e["sels"][(cfg.density, False)]
            scores, mask = sel.block_scores.float(), sel.selected
            shifted = scores - scores.amax(dim=-1, keepdim=True)
            for key, x in (("block_mean", scores), ("block_mean_shifted", shifted)):
                parts[key][0].append(x[mask].cpu())
                parts[key][1].append(x[~mask].cpu())
            run, cut = s.query_rows(bs)
            n = cut.stop - cut.start
            rows = cut.start + torch.randperm(n, generator=gen)[: cfg.token_rows].sort().values.to(s.q.device)
            tok, exact = metrics.token_scores(s.q[:, :, run], s.k, mask, block_size=bs, rows=rows)
            for key, x in (("token", tok), ("token_shifted", tok - tok.amax(dim=-1, keepdim=True))):
                parts[key][0].append(x[exact].cpu())
                parts[key][1].append(x[~exact].cpu())
        out = {"density": cfg.density, "selection": "topk", "token_rows": cfg.token_rows}
        for key, (a, b) in parts.items():
            out[key] = histogram(torch.cat(a), torch.cat(b), cfg.bins)
        return out


def histogram(selected: Tensor, tail: Tensor, bins: int) -> dict:
    """Shared-edge histograms (counts) of two score populations, with summary statistics."""
    both = torch.cat([selected, tail]).float()
    lo, hi = (float(both.min()), float(both.max())) if both.numel() else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    edges = torch.linspace(lo, hi, bins + 1)
    return {
        "edges": edges.tolist(),
        "selected": torch.histc(selected.float(), bins, lo, hi).long().tolist() if selected.numel() else [0] * bins,
        "tail": torch.histc(tail.float(), bins, lo, hi).long().tolist() if tail.numel() else [0] * bins,
        "selected_stats": _describe(selected),
        "tail_stats": _describe(tail),
    }


def _describe(x: Tensor) -> dict:
    if x.numel() == 0:
        return {"n": 0}
    x = x.float()
    cap = 1 << 20  # torch.quantile's input limit is 16M: summarise a seeded subsample
    sub = x if x.numel() <= cap else x[torch.randint(x.numel(), (cap,), generator=torch.Generator().manual_seed(0))]
    q = torch.quantile(sub, torch.tensor([0.05, 0.5, 0.95])).tolist()
    return {"n": x.numel(), "mean": float(x.mean()), "std": float(x.std()) if x.numel() > 1 else 0.0,
            "q05": q[0], "median": q[1], "q95": q[2], "frac_negative": float((x < 0).float().mean())}


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs))


def _mean_lists(lists):
    """Element-wise mean of equally shaped nested lists of floats."""
    first = lists[0]
    if isinstance(first, list):
        return [_mean_lists([x[i] for x in lists]) for i in range(len(first))]
    return _mean(lists)


def _mean_dicts(dicts):
    """Element-wise means of the keys every dict has (a variant a sample could not run is left out)."""
    return {k: _mean_lists([d[k] for d in dicts]) for k in dicts[0] if all(k in d for d in dicts)}


def build_source(cfg: StudyConfig):
    dtype = DTYPES[cfg.dtype]
    if cfg.source == "synthetic":
        return SyntheticSource(heads=cfg.heads, head_dim=cfg.head_dim, seed=cfg.seed, text_tokens=cfg.text_tokens,
                               dtype=dtype, device=cfg.device)
    return CapturedSource(cfg.source, entries=cfg.entries, max_entries=cfg.max_entries, dtype=dtype, device=cfg.device)


def check_before_work(cfg: StudyConfig, out: str | None) -> None:
    """ValueError, before any work, when a dependency is missing (safetensors for a capture,
    matplotlib for plots) or ``out`` cannot receive study.json."""
    if cfg.source != "synthetic" and at.missing_modules("safetensors"):
        raise ValueError("reading a capture needs safetensors, which is not installed: pip install safetensors")
    if cfg.calib_source is not None:
        from ..qkv_file import read_qkv_file

        try:
            read_qkv_file(cfg.calib_source)  # its index only: a file that is not a capture says so now
        except ValueError as e:
            raise ValueError(f"calib_source: {e}") from None
    if out is None:
        return
    try:
        at.output_dir(out)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"out: {e}") from None
    if cfg.plots and at.missing_modules("matplotlib"):
        raise ValueError("the plots need matplotlib, which is not installed: pip install 'pisa-attn[plot]', "
                         "or run without plots (plots=False, --no-plots)")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out: cannot create the directory {out!r}: {e}") from None


def run_study(config: StudyConfig | None = None, out: str | None = None, progress: bool = True,
              source=None) -> dict:
    """Run the study; with ``out`` write ``study.json`` and (``config.plots``) the PNG plots there.
    ``source`` is :func:`build_source` of the config, when the caller has built it already."""
    if config is not None and not isinstance(config, StudyConfig):
        raise TypeError(f"config must be a StudyConfig or None, got {type(config).__name__}")
    cfg = (config or StudyConfig()).resolved()
    check_before_work(cfg, out)
    t0 = time.perf_counter()
    source = build_source(cfg) if source is None else source
    body = _Study(cfg, progress).run(source)
    result = {
        "version": 1,
        "config": _jsonable(asdict(cfg)),
        "source": source.describe(),
        "environment": {"pisa_attn": __version__, "torch": torch.__version__, "python": platform.python_version(),
                        "device": _device_name(cfg.device)},
        "modes": list(cfg.modes),
        "variants": list(body["density_sweep"]["rel_l1"]),
        **body,
    }
    result["summary"] = summarize(result)
    result["runtime_s"] = time.perf_counter() - t0
    if out is not None:
        os.makedirs(out, exist_ok=True)
        result["plots"] = []
        if cfg.plots:
            from .plots import plot_study

            result["plots"] = plot_study(result, out)
        with open(os.path.join(out, "study.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


def summarize(result: dict) -> dict:
    """Key numbers: every variant's rel-L1 at the study density (fixed length) and the mean ρ_t.
    Studied samples of several lengths (a capture's entries) are summarised per length, keys
    ``"<name> L=<tokens>"``: error and tail mass at one density depend on the length."""
    ds = result["density_sweep"]
    d = result["config"]["density"]
    tm = result["tail_mass"]
    lengths = sorted(set(ds.get("sample_lengths") or [ds["length"]]))
    if len(lengths) > 1:
        out = {"density": d, "length": lengths,
               "tail_mass": {f"{k} L={n}": v for k, per in tm["mean_by_length"].items() for n, v in per.items()}}
        if d in ds["densities"]:
            i = ds["densities"].index(d)
            per_sample = [(n, ds["rel_l1_per_sample"][name]) for n, name in zip(ds["sample_lengths"], ds["samples"])]
            out["rel_l1"] = {f"{v} L={n}": _mean(r[v][i] for m, r in per_sample if m == n)
                             for v in ds["rel_l1"] for n in lengths}
        else:  # the length sweep needs one length (it is skipped) and the density sweep skips d
            out["rel_l1"] = {}
        return out
    out = {"density": d, "length": ds["length"], "tail_mass": tm["mean"]}
    if d in ds["densities"]:
        i = ds["densities"].index(d)
        out["rel_l1"] = {v: ds["rel_l1"][v][i] for v in ds["rel_l1"]}
    elif result["length_sweep"]["lengths"]:  # the length sweep runs at the study density
        ls = result["length_sweep"]
        out["length"] = (ls.get("tokens") or ls["lengths"])[-1]  # tokens: the density sweep's unit
        out["rel_l1"] = {v: ls["rel_l1"][v][-1] for v in ls["rel_l1"]}
        # the tail mass of that same point: the density sweep's is at another length
        out["tail_mass"] = {k: v[-1] for k, v in ls["tail_mass"].items()}
    else:  # a capture without layout and a density sweep that skips the study density
        out["rel_l1"] = {}
    return out


def _device_name(device: str) -> str:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result["summary"]
    tokens = "/".join(map(str, s["length"])) if isinstance(s["length"], list) else s["length"]
    t = Table(title=f"rel-L1 vs dense, density {s['density']:g}, {tokens} tokens",
              caption=f"mean tail mass ρ: {', '.join(f'{k} {v:.3f}' for k, v in s['tail_mass'].items())}")
    t.add_column("variant")
    t.add_column("rel-L1", justify="right")
    for v, e in s["rel_l1"].items():
        t.add_row(v, f"{e:.4f}")
    Console(stderr=True).print(t)


# --- command line ------------------------------------------------------------------------------
def _configure(p: argparse.ArgumentParser) -> None:
    """The study's options; every value is checked here, so a bad one stops the command before work."""
    d = StudyConfig()
    p.add_argument("--source", type=at.existing_file_or("synthetic"), default=d.source,
                   help="'synthetic' (DiT-like generator) or a capture .safetensors")
    p.add_argument("--out", type=at.output_dir, default="pisa-study", help="directory for study.json and the PNG plots")
    p.add_argument("--device", default=d.device, help="cpu (PyTorch reference) or cuda (Triton kernels)")
    p.add_argument("--size", choices=SIZES, default=None, help="preset: tiny (CI), default (CPU), paper (CUDA default)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    p.add_argument("--length", type=at.int_at_least(1), default=None,
                   help="tokens of the density sweep (synthetic source; a multiple of 64)")
    p.add_argument("--lengths", type=at.comma_list(at.int_at_least(1)), default=None,
                   help="comma-separated lengths of the length sweep (synthetic source; a capture sweeps as many "
                        "halvings of its grid as lengths are given)")
    p.add_argument("--densities", type=at.comma_list(at.density), default=None,
                   help="comma-separated densities in (0, 1] of the density sweep")
    p.add_argument("--density", type=at.density, default=d.density,
                   help="density in (0, 1] of the length sweep and score plots")
    p.add_argument("--modes", type=at.comma_list(at.one_of(MODES)), default=d.modes,
                   help="comma-separated subset of drop,zeroth,hybrid,first")
    p.add_argument("--no-covariance", dest="covariance", action="store_false", help="skip covariance-aware selection")
    p.add_argument("--weights", type=at.comma_list(at.one_of(WEIGHTS)), default=d.weights,
                   help="weighted hybrid variants: default (alpha = spec.DEFAULT_ALPHA), calibrated (alpha per head "
                        "fitted on another input)")
    p.add_argument("--no-weights", dest="weights", action="store_const", const=(), help="no weighted variants")
    p.add_argument("--calib-source", type=at.existing_file, default=None,
                   help="capture file (another input of the same model) the calibrated variant fits on; default: "
                        "the same layer at another captured step. The studied file itself (by any path) keeps that "
                        "default, and a partner holding the studied q/k/v (a copy) is not used: the fit stays held out")
    p.add_argument("--heads", type=at.int_at_least(1), default=None,
                   help="heads of the synthetic source (default: the size preset's)")
    p.add_argument("--head-dim", type=at.head_dim, default=None, help="of the synthetic source: even, 16-256 "
                                                                        "(default 64)")
    p.add_argument("--text-tokens", type=at.int_at_least(0), default=None,
                   help="text tokens of the synthetic source (default 0)")
    p.add_argument("--seed", type=at.int_at_least(0), default=d.seed)
    p.add_argument("--block-size", type=at.block_size, default=d.block_size, help="a power of two >= 16")
    p.add_argument("--entries", type=at.comma_list(str), default=None,
                   help="captured entries to study, e.g. step0.layer3")
    p.add_argument("--max-entries", type=at.int_at_least(1), default=d.max_entries,
                   help="captured entries used when --entries is not given")
    p.add_argument("--plots", dest="plots", action="store_true", default=None,
                   help="draw the PNG plots (needs matplotlib; default: when matplotlib is installed)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="write study.json only")
    p.add_argument("--precision", dest="precisions", action="append", default=[],
                   choices=tuple(spec.PRODUCT_FORMATS), metavar="NAME",
                   help="also the default hybrid with its exact blocks in this low precision's quantised math "
                        f"(ops/quant.py), beside the input precision; repeatable: {', '.join(spec.PRODUCT_FORMATS)}")
    p.add_argument("--fp8", action="store_true", help="the same as --precision fp8")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=_cmd)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``study`` on an ``argparse`` sub-parser collection (``pisa-attn study``)."""
    p = subparsers.add_parser("study", help="accuracy study: rel-L1 vs density/length, tail mass, tiling",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    return p


def _cmd(args: argparse.Namespace) -> int:
    fields = StudyConfig.__dataclass_fields__
    kw = {k: v for k, v in vars(args).items() if k in fields}
    skip_plots = args.plots is None and bool(at.missing_modules("matplotlib"))
    kw["plots"] = not skip_plots if args.plots is None else args.plots
    cfg = StudyConfig(**kw)
    try:  # the combined checks (device, presets, output, capture file and entries), before any work
        cfg = cfg.resolved()
        check_before_work(cfg, args.out)
        source = build_source(cfg)
    except ValueError as e:
        print(f"pisa-attn study: error: {e}", file=sys.stderr)
        return 2
    if skip_plots:
        print("pisa-attn study: matplotlib is not installed: writing study.json without plots "
              "(pip install 'pisa-attn[plot]' for them)", file=sys.stderr)
    result = run_study(cfg, out=args.out, progress=args.progress, source=source)
    print_summary(result)
    print(f"wrote {os.path.join(args.out, 'study.json')} and {len(result['plots'])} plots "
          f"in {result['runtime_s']:.1f} s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pisa_attn.bench.study", description=at.plain(__doc__),
                                formatter_class=at.HelpFormatter)
    _configure(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
