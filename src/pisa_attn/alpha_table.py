"""A table of first-order weights per attention layer and head (JSON), and how it is built.

``pisa-attn calibrate FILE`` writes one from a q/k/v capture; ``apply_pisa(..., calibrate=True)``
fits one during a run's dense warm-up; ``apply_pisa(..., alpha_table=PATH_OR_DICT)`` loads one.
Layers are the managed self-attention calls of one transformer forward in order (the ``layer``
of :func:`pisa_attn.diffusers.capture_qkv`), per transformer of a pipeline::

    {"format": "pisa-attn-alpha", "version": 1, "model": "wan",
     "settings": {"density": 0.15, "mode": "hybrid", "covariance_aware": false, "block_size": 64},
     "fit": "head", "source": "qkv.safetensors",
     "transformers": {"transformer": {"3": {"alpha": [0.41, 0.66, ...], "tail_mass": 0.38,
                                            "rows": 2048, "residual_vs_paper": 0.81}, ...}}}

``settings`` are those the weights were fitted under (a weight depends on the density and the
selection). A layer may carry its own ``"covariance_aware": true|false``: the selection rule
calibration chose for it (it overrides ``settings`` for that layer; absent: ``settings``').
``tail_mass`` (mean dense softmax mass on the approximated blocks), ``rows`` (query
rows fitted on) and ``residual_vs_paper`` (squared error at the fitted weight over that at weight
1, on the fitted rows) are information only.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field

import torch

from . import calibration as cal
from . import spec
from ._files import write_replacing

FORMAT = "pisa-attn-alpha"
VERSION = 1


@dataclass(frozen=True)
class LayerAlpha:
    alpha: tuple[float, ...]  # one weight per query head
    tail_mass: float | None = None
    rows: int | None = None
    residual_vs_paper: float | None = None
    covariance_aware: bool | None = None  # the layer's selection rule (None: the table's settings)


@dataclass
class AlphaTable:
    """Weights per transformer (``"transformer"``, ``"transformer_2"``) and layer."""

    transformers: dict[str, dict[int, LayerAlpha]]
    settings: dict = field(default_factory=dict)
    fit: str = "head"
    model: str | None = None
    source: str | None = None

    def layers(self, name: str = "transformer", *, strict: bool = False) -> dict[int, LayerAlpha]:
        """The layers of transformer ``name``; a table of one transformer serves any name, unless
        ``strict`` (a pipeline with two experts: each needs its own entry)."""
        if name in self.transformers:
            return self.transformers[name]
        if len(self.transformers) == 1 and not strict:
            return next(iter(self.transformers.values()))
        raise ValueError(f"alpha_table has no weights for {name!r} (it has {sorted(self.transformers)})")

    def covariance_aware(self, layer: int, name: str = "transformer") -> bool:
        """The selection rule of ``layer``: its own when calibration chose one, else the settings'."""
        x = self.layers(name).get(layer)
        if x is not None and x.covariance_aware is not None:
            return x.covariance_aware
        return bool(self.settings.get("covariance_aware", spec.DEFAULT_COVARIANCE_AWARE))  # the library default

    def to_json(self) -> dict:
        def layer(x: LayerAlpha) -> dict:
            d = {"alpha": [_plain(a) for a in x.alpha]}
            for key in ("tail_mass", "rows", "residual_vs_paper", "covariance_aware"):
                if getattr(x, key) is not None:
                    d[key] = _plain(getattr(x, key))
            return d

        return {"format": FORMAT, "version": VERSION, "model": self.model,
                "settings": {k: _plain(v) for k, v in self.settings.items()},
                "fit": self.fit, "source": self.source,
                "transformers": {t: {str(i): layer(x) for i, x in sorted(ls.items())}
                                 for t, ls in self.transformers.items()}}

    def save(self, path) -> str:
        """Write the table as JSON; a table :func:`load` would refuse is refused here (ValueError
        naming ``alpha_table``), and a failure leaves an existing file as it was."""
        d = self.to_json()
        from_json(d)
        text = json.dumps(d, indent=1, allow_nan=False)  # whole before the file is opened

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                f.write(text)

        return write_replacing(path, write)


def _plain(x):
    """A numpy scalar as the Python value JSON writes (a narrower float as the decimal it prints
    as, as the settings read it); anything else as it is."""
    if type(x).__module__ != "numpy" or not hasattr(x, "item"):
        return x
    if spec.is_numpy_bool(x):
        return bool(x)
    if spec.is_int(x):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(spec.decimal_value(x))
    return x


def _bad(why: str) -> ValueError:
    return ValueError(f"alpha_table {why}")


def _finite_number(x) -> bool:
    # an int is finite however large (math.isfinite would overflow on it)
    return type(x) is int or (type(x) is float and math.isfinite(x))


def _check_query_block(x) -> None:
    if x is not None and (type(x) is not int or x <= 0):
        raise ValueError(f"query_block must be null or a positive integer, got {x!r}")


def from_json(d) -> AlphaTable:
    """Parse and check a table's JSON object (ValueError naming ``alpha_table`` on a bad one)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise _bad(f"must be a {FORMAT!r} JSON object (as pisa-attn calibrate writes), got "
                   f"{type(d).__name__ if not isinstance(d, dict) else 'format=' + repr(d.get('format'))}")
    if type(d.get("version")) is not int or d.get("version") != VERSION:  # not 1.0 or true
        raise _bad(f"has version {d.get('version')!r}; this reader needs {VERSION}")
    ts = d.get("transformers")
    if not isinstance(ts, dict) or not ts:
        raise _bad("has no 'transformers' with weights")
    out: dict[str, dict[int, LayerAlpha]] = {}
    for name, layers in ts.items():
        if not isinstance(name, str):  # JSON's keys are; 0 and "0" would both become "0"
            raise _bad(f"transformer names must be strings, got {name!r}")
        if not isinstance(layers, dict):  # empty: a transformer without fitted layers (its default weight)
            raise _bad(f"entry {name!r} must map layer indices to weights (an object), got {layers!r}")
        parsed, keys = {}, {}
        for key, entry in layers.items():
            try:
                index = int(key)
            except (TypeError, ValueError):
                index = -1
            if index < 0 or str(index) != str(key):  # " 3" or "03" would be a second key for layer 3
                raise _bad(f"layer keys must be non-negative integers, got {key!r} in {name!r}")
            if index in parsed:  # 3 and "3" in a dict made in code: one weight would be lost
                raise _bad(f"has layer {index} of {name!r} twice (keys {keys[index]!r} and {key!r})")
            keys[index] = key
            values = entry.get("alpha") if isinstance(entry, dict) else None
            if (not isinstance(values, list) or not values
                    or any(not _finite_number(x) or abs(x) > spec.ALPHA_LIMIT for x in values)):
                raise _bad(f"layer {key} of {name!r} needs 'alpha': a non-empty list of finite numbers within "
                           f"±{spec.ALPHA_LIMIT:g}, got {values!r}")
            cov = entry.get("covariance_aware")
            if cov is not None and not isinstance(cov, bool):
                raise _bad(f"layer {key} of {name!r}: 'covariance_aware' must be true or false, got {cov!r}")
            for extra, ok in (("tail_mass", _finite_number), ("residual_vs_paper", _finite_number),
                              ("rows", lambda x: type(x) is int and x >= 0)):
                if entry.get(extra) is not None and not ok(entry[extra]):
                    raise _bad(f"layer {key} of {name!r}: {extra!r} must be "
                               f"{'a non-negative integer' if extra == 'rows' else 'a finite number'} or null, "
                               f"got {entry[extra]!r}")
            parsed[index] = LayerAlpha(tuple(float(x) for x in values), entry.get("tail_mass"), entry.get("rows"),
                                       entry.get("residual_vs_paper"), cov)
        out[name] = parsed
    if not any(out.values()):
        raise _bad("has no weights (every transformer's entry is empty)")
    settings = d.get("settings")
    settings = {} if settings is None else settings  # not `or {}`: that would take [], 0 or "" as no settings
    if not isinstance(settings, dict):
        raise _bad(f"'settings' must be an object or null, got {settings!r}")
    checks = {"density": spec.check_density, "block_size": spec.check_block_size, "mode": spec.check_mode,
              "covariance_aware": lambda x: spec.check_flag("covariance_aware", x),
              "precision": spec.check_precision, "scale": spec.check_scale, "query_block": _check_query_block}
    for key, check in checks.items():  # the settings the weights were fitted under, compared with a run's
        if key in settings:
            try:
                check(settings[key])
            except (TypeError, ValueError) as e:
                raise _bad(f"'settings': {e}") from None
    fit = d.get("fit", "head")
    if fit not in cal.FIT_OVER:
        raise _bad(f"'fit' must be one of {cal.FIT_OVER}, got {fit!r}")
    for key in ("model", "source"):  # model is compared with the pipeline's name, so a non-string never matches
        if d.get(key) is not None and not isinstance(d[key], str):
            raise _bad(f"{key!r} must be a string or null, got {d[key]!r}")
    return AlphaTable(out, settings, fit, d.get("model"), d.get("source"))


def _no_duplicate_keys(pairs) -> dict:
    # json.load keeps the last of two equal keys: one layer's weights would be lost silently
    d = {}
    for key, value in pairs:
        if key in d:
            raise ValueError(f"duplicate key {key!r}")
        d[key] = value
    return d


def load(table) -> AlphaTable:
    """An :class:`AlphaTable` from a path to a JSON file, its parsed dict, or a table."""
    if isinstance(table, AlphaTable):  # one built in code gets the checks a file gets
        try:
            d = table.to_json()
        except (AttributeError, TypeError) as e:
            raise _bad(f"object is malformed ({e})") from None
        return from_json(d)
    if isinstance(table, dict):
        return from_json(table)
    if isinstance(table, (str, os.PathLike)):
        try:
            with open(table) as f:
                d = json.load(f, object_pairs_hook=_no_duplicate_keys)
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not text (a capture passed by mistake)
            raise _bad(f"path {str(table)!r} is not a readable JSON file: {e}") from None
        return from_json(d)
    raise TypeError(f"alpha_table must be a path, a dict or an AlphaTable, got {type(table).__name__}")


def from_fits(fits: dict[str, dict[int, cal.RowFit]], *, settings: dict, over: str = "head",
              default: float = 1.0, bounds=cal.FIT_BOUNDS, model: str | None = None,
              source: str | None = None, rules: dict[str, dict[int, bool]] | None = None) -> AlphaTable:
    """The table of least-squares weights of pooled fits (per transformer and layer); a head with
    no tail on the fitted rows gets ``default``. ``rules``: the selection rule (covariance-aware or
    not) chosen per layer, stored with it. ValueError if a fit gives a non-finite weight (a fit
    of non-finite statistics): no NaN is ever written to a table."""
    out: dict[str, dict[int, LayerAlpha]] = {}
    for name, layers in fits.items():
        out[name] = {}
        for layer, fit in sorted(layers.items()):
            heads = fit.stats.cr.numel()
            w = fit.stats.alpha(over, default=default, bounds=bounds).double().reshape(-1).expand(heads)
            if not bool(torch.isfinite(w).all()) or not bool(torch.isfinite(fit.stats.rr).all()):
                raise ValueError(f"the fit of layer {layer} of {name!r} is not finite (non-finite attention "
                                 "statistics): no table written")
            paper = float(fit.stats.residual(1.0).sum())
            ratio = float(fit.stats.residual(w).sum()) / paper if paper > 0 else None
            cov = None if rules is None else rules.get(name, {}).get(layer)
            out[name][layer] = LayerAlpha(tuple(float(x) for x in w.tolist()),
                                          float(fit.mean_tail_mass().mean()), int(fit.rows), ratio, cov)
    return AlphaTable(out, dict(settings), over, model, source)
