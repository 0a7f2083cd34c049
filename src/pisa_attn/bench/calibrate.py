"""``pisa-attn calibrate FILE``: fit the first-order weight per layer and head from a q/k/v capture.

Reads a :func:`pisa_attn.diffusers.capture_qkv` file, samples query rows of every captured call
(image queries, text key blocks kept exact, the call's softmax scale, as the diffusers backend
runs them), fits the least-squares weight of the first-order tail term against dense attention
per layer and head, pooled over the captured steps, and writes the JSON table
``apply_pisa(..., alpha_table=PATH)`` loads (:mod:`pisa_attn.alpha_table`). Unless
``--covariance-aware`` / ``--no-covariance-aware`` fixes it, each layer's selection rule is chosen
too: both rules are fitted on the same rows and the one whose fitted weights leave the smaller
squared error is stored with the layer. Fit at the density you will run with: a weight depends on
it. Every captured entry is checked (finite floating [B, H, L, D] tensors, k and v of one shape)
and ``--out`` is checked before any fitting.

Run as ``pisa-attn calibrate ...`` or ``python -m pisa_attn.bench.calibrate ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from types import SimpleNamespace

from . import argtypes as at

FITS = ("head", "layer")
MODES = ("hybrid", "first")


def _default_covariance(model: str | None, heads: int, head_dim: int) -> bool:
    """The selection ``apply_pisa`` uses by default for ``model`` (its adapter's; False if unknown)."""
    try:
        from ..diffusers.models import ADAPTERS
    except ImportError:  # the adapters' module needs nothing beyond torch; be safe anyway
        return False
    for adapter in ADAPTERS:
        if adapter.name == model:
            cfg = SimpleNamespace(num_attention_heads=heads, attention_head_dim=head_dim)
            return bool(adapter.defaults(cfg)["covariance_aware"])
    return False


def _transformer_of(entry_name: str) -> str:
    """Capture entries of ``transformer_2`` are named ``transformer_2.stepS.layerL``."""
    prefix = entry_name[: entry_name.rfind("step")].rstrip(".")
    return prefix or "transformer"


def calibrate_file(path: str, *, density: float = 0.15, mode: str = "hybrid", covariance_aware: bool | None = None,
                   block_size: int = 64, rows: int = 512, fit: str = "head", steps=None, seed: int = 0,
                   device: str = "cpu", progress=None, choose_selection: bool = True):
    """The :class:`~pisa_attn.alpha_table.AlphaTable` of a capture file (see the module docstring).
    ``rows``: query rows sampled per captured call (0: all); ``steps``: captured steps to use
    (None: all); ``covariance_aware`` None: the capture's model's default selection;
    ``choose_selection``: fit under both selection rules (top-k and covariance-aware) and keep,
    per layer, the one whose fitted weights leave the smaller squared error (stored per layer)."""
    from .. import alpha_table, calibration, spec
    from ..diffusers.calibrate import sample_rows
    from ..layout import block_floor
    from ..qkv_file import check_entry, read_qkv_file

    spec.check_settings(density=density, block_size=block_size, mode=mode)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be an int >= 0 (0: all), got {rows!r}")
    if not isinstance(choose_selection, bool):
        raise TypeError(f"choose_selection must be True or False, got {choose_selection!r}")
    if steps is not None:
        try:
            steps = list(steps)
        except TypeError:
            steps = [None]  # not iterable
        if any(isinstance(s, bool) or not isinstance(s, int) for s in steps):
            raise TypeError("steps must be None or an iterable of ints")
    if mode not in spec.FIRST_ORDER_MODES:
        raise ValueError(f"mode must be one of {spec.FIRST_ORDER_MODES} (a mode with a first-order term), got {mode!r}")
    device = check_device(device)
    f = read_qkv_file(path)
    entries = [e for e in f.entries if steps is None or e.step in set(steps)]
    if not entries:
        raise ValueError(f"{path} has no captured call at steps {sorted(steps) if steps else steps}")
    for e in entries:  # every entry is checked before any fitting
        check_entry(e)
        tile = e.layout.tile if e.layout is not None else None
        if tile and math.prod(tile) != block_size:  # the capture's tiles are the blocks a run would see
            raise ValueError(f"{path}: entry {e.name} is tiled in {tuple(tile)} tiles ({math.prod(tile)} tokens), "
                             f"not blocks of block_size={block_size}: calibrate at block_size={math.prod(tile)}, "
                             "or capture a model managed at that size (apply_pisa(pipe, block_size=...) before capture_qkv)")
    rng = random.Random(seed)
    fits: dict[str, dict[int, dict[bool, calibration.RowFit]]] = {}
    cov = covariance_aware
    for e in entries:
        q, k, v = (x.to(device) for x in (e.q, e.k, e.v))
        if cov is None:
            cov = _default_covariance(f.meta.get("model"), q.shape[1], q.shape[-1])
        n = k.shape[2]
        lo, hi = e.info.get("image_range") or (0, q.shape[2])
        start = block_floor(lo, block_size)
        # sample_rows draws whole runs of rows: cut to the count asked, as the online calibrator does
        sampled = None if rows == 0 or rows >= hi - lo else sample_rows(rng, lo - start, hi - start, block_size,
                                                                        rows)[:rows]
        keep = None
        if e.layout is not None and e.layout.num_text_tokens:
            keep = e.layout.keep_blocks(block_size)[: spec.num_blocks(n, block_size)]
            keep = keep if bool(keep.any()) else None
        rules = (False, True) if choose_selection else (bool(cov),)
        rf = calibration.fit_rules(q[:, :, start:hi], k, v, density=density, rows=sampled,
                                   measured=(lo - start, hi - start), block_size=block_size, mode=mode,
                                   rules=rules, scale=e.info.get("scale"), keep_blocks=keep)
        layers = fits.setdefault(_transformer_of(e.name), {})
        prev = layers.get(e.layer)
        layers[e.layer] = rf if prev is None else {r: prev[r] + rf[r] for r in rf}
        if progress is not None:
            progress(e.name)
    chosen, rule_of = calibration.choose_rules(fits, over=fit, default=spec.DEFAULT_ALPHA)
    settings = {"density": float(density), "mode": mode, "covariance_aware": bool(cov), "block_size": block_size}
    return alpha_table.from_fits(chosen, settings=settings, over=fit, default=spec.DEFAULT_ALPHA,
                                 model=f.meta.get("model"), source=os.path.basename(str(path)),
                                 rules=rule_of if choose_selection else None)


def check_device(device) -> "torch.device":
    """``device`` as a ``torch.device`` that exists here; ValueError naming it otherwise."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA device is available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    return dev


def check_out(path: str, source: str | None = None) -> None:
    """ValueError unless ``path`` can be written (a new or existing file in a writable folder) and
    is not the capture ``source`` it is computed from."""
    folder = os.path.dirname(os.path.abspath(path))
    if source is not None and os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
        raise ValueError(f"--out {path!r} is the capture being read: it would be overwritten by the table")
    if os.path.isdir(path):
        raise ValueError(f"--out {path!r} is a directory")
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--out {path!r} is not writable")


def print_table(table, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=True)
    s = table.settings
    for name, layers in table.transformers.items():
        t = Table(title=f"first-order weight α and selection per layer ({name}; density {s.get('density')}, "
                        f"{s.get('mode')})",
                  caption="selection: cov = covariance-aware (eq. 9), top-k = pooled top-k; residual vs paper: "
                          "squared error at the fitted α over that at α = 1, on the fitted rows")
        for col in ("layer", "selection", "α mean", "α min", "α max", "tail mass ρ", "rows", "residual vs paper"):
            t.add_column(col, justify="right")
        for i, x in sorted(layers.items()):
            ratio = "-" if x.residual_vs_paper is None else f"{x.residual_vs_paper:.3f}"
            rule = "cov" if table.covariance_aware(i, name) else "top-k"
            t.add_row(str(i), rule, f"{sum(x.alpha) / len(x.alpha):.3f}", f"{min(x.alpha):.3f}",
                      f"{max(x.alpha):.3f}", f"{x.tail_mass:.3f}", str(x.rows), ratio)
        console.print(t)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=at.existing_file, help="a capture_qkv .safetensors file")
    p.add_argument("--out", default="alpha_table.json", help="the JSON table to write")
    p.add_argument("--density", type=at.density, default=0.15, help="the density you will run with (apply_pisa's "
                   "default 0.15)")
    p.add_argument("--mode", type=at.one_of(MODES), default="hybrid")
    cov = p.add_mutually_exclusive_group()
    cov.add_argument("--covariance-aware", dest="covariance_aware", action="store_true", default=None,
                     help="covariance-aware selection for every layer (default: the rule that fits each layer best)")
    cov.add_argument("--no-covariance-aware", dest="covariance_aware", action="store_false",
                     help="pooled top-k selection for every layer")
    p.add_argument("--block-size", type=at.block_size, default=64)
    p.add_argument("--rows", type=at.int_at_least(0), default=512,
                   help="query rows sampled per captured call (0: all of them)")
    p.add_argument("--fit", type=at.one_of(FITS), default="head", help="a weight per head or one per layer")
    p.add_argument("--steps", type=at.comma_list(at.int_at_least(0)), default=None,
                   help="captured steps to fit on (default: every captured step)")
    p.add_argument("--seed", type=at.int_at_least(0), default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the float32 reference runs there)")
    p.set_defaults(func=_cmd)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``calibrate`` on an ``argparse`` sub-parser collection (``pisa-attn calibrate``)."""
    p = subparsers.add_parser("calibrate", help="fit the first-order weight per layer/head from a q/k/v capture",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    return p


def _cmd(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        import safetensors  # noqa: F401  (the capture format; not in the core install)
    except ImportError:
        print("pisa-attn calibrate: error: reading a capture needs safetensors (pip install safetensors)",
              file=sys.stderr)
        return 2
    try:
        check_out(args.out, args.file)
        table = calibrate_file(args.file, density=args.density, mode=args.mode, covariance_aware=args.covariance_aware,
                               choose_selection=args.covariance_aware is None,
                               block_size=args.block_size, rows=args.rows, fit=args.fit,
                               steps=args.steps, seed=args.seed, device=args.device,
                               progress=lambda name: print(f"  {name}", file=sys.stderr, flush=True))
    except (ValueError, TypeError, ModuleNotFoundError) as e:
        print(f"pisa-attn calibrate: error: {e}", file=sys.stderr)
        return 2
    print_table(table)
    try:
        table.save(args.out)
    except OSError as e:
        print(f"pisa-attn calibrate: error: --out {args.out!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    n = sum(len(x) for x in table.transformers.values())
    print(f"wrote {args.out} ({n} layers) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pisa_attn.bench.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _configure(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
