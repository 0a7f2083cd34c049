"""``apply_pisa`` / ``remove_pisa``: put a diffusers transformer's self-attention on PISA and take
it off again (processor routing, boundary hooks, warm-up schedule, telemetry, pipeline hook)."""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .. import alpha_table as at
from .. import spec, tail_weight
from ..attention import MAX_HEAD_DIM, MIN_HEAD_DIM
from . import hooks
from . import telemetry as tm
from .backend import register
from .calibrate import CalibrationConfig, Calibrator
from .calibrate import as_config as calibration_config
from .models import ModelAdapter, adapter_for, transformers_of
from .schedule import DEFAULT_MIN_KV_LEN, Schedule, StepTracker
from .state import PisaConfig, PisaState
from .tiling import default_tile, install

_STATE_ATTR = "_pisa_state"
_PIPE_ATTR = "_pisa_pipeline_states"


def pisa_state(transformer) -> PisaState | None:
    """The :class:`PisaState` :func:`apply_pisa` attached to ``transformer`` (or to the model a
    ``torch.compile`` wrapper holds), or None."""
    return getattr(transformer, "_orig_mod", transformer).__dict__.get(_STATE_ATTR)


def stats(transformer) -> dict[str, int]:
    """Managed attention calls since the current generation started: ``dense``, ``sparse`` and
    dense calls per reason (``warmup_step``, ``warmup_layer``, ``few_tokens``)."""
    state = pisa_state(transformer)
    if state is None:
        raise ValueError("transformer is not managed by apply_pisa")
    return dict(state.stats)


def _transformers(obj) -> tuple[list, object | None]:
    """(transformers to manage, pipeline or None) for a pipeline or a transformer."""
    found, pipe = transformers_of(obj)
    return [t for _, t in found], pipe


def alpha_table(pipe_or_transformer) -> at.AlphaTable:
    """The per-layer first-order weights of the managed transformer(s), with their fit information:
    the calibrated ones (the fits of this generation's warm-up so far), else the loaded ones.
    ``.save(path)`` writes the file ``apply_pisa(..., alpha_table=path)`` loads."""
    found, _ = transformers_of(pipe_or_transformer)
    out, settings = {}, {}
    for name, tr in found:
        state = pisa_state(tr)
        if state is None:
            raise ValueError("transformer is not managed by apply_pisa")
        cfg = state.config
        settings = {"density": cfg.density, "mode": cfg.mode, "covariance_aware": cfg.covariance_aware,
                    "block_size": cfg.block_size}
        layers = {}
        if state.calibrator is not None and state.calibrator.fits:
            layers = dict(state.calibrator.table(name).layers(name))
        for i, a in state.alphas.items():
            layers.setdefault(i, at.LayerAlpha(tuple(float(x) for x in a.tolist()),
                                               covariance_aware=state.rules.get(i)))
        out[name] = layers
    if not any(out.values()):
        raise ValueError("no calibrated or loaded first-order weights: use apply_pisa(..., calibrate=True) and run "
                         "past the warm-up, or apply_pisa(..., alpha_table=...)")
    return at.AlphaTable(out, settings, model=None, source="apply_pisa")


def _check_tile(tile, ndim: int, block_size: int) -> tuple[int, ...]:
    if tile is None:
        return default_tile(ndim, block_size)
    if not isinstance(tile, (tuple, list)) or len(tile) != ndim:
        raise ValueError(f"tile must be a tuple of {ndim} ints for this {ndim}D model, got {tile!r}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tile):
        raise ValueError(f"tile entries must be positive ints, got {tile!r}")
    return tuple(tile)


def _check_alpha(alpha, mode: str):
    """``apply_pisa``'s ``alpha``: a float or one value per head (CPU), as host floats."""
    if alpha is None:
        return None
    tail_weight.check(alpha, mode, alpha.numel() if isinstance(alpha, torch.Tensor) and alpha.dim() == 1 else 1)
    if isinstance(alpha, torch.Tensor):
        if alpha.device.type != "cpu":
            raise ValueError(f"apply_pisa's alpha must be a float or a CPU tensor, got a tensor on {alpha.device}")
        return tuple(float(x) for x in alpha.reshape(-1).tolist()) if alpha.dim() == 1 else float(alpha)
    return float(alpha)


def _config(adapter: ModelAdapter, transformer, density, dense_layers, dense_steps, tile, mode, cov, block_size,
            min_kv_len, alpha=None):
    spec.check_settings(density=density, block_size=block_size, mode=mode)
    d = adapter.defaults(transformer.config)
    if cov is not None and not isinstance(cov, bool):
        raise TypeError(f"covariance_aware must be a bool or None, got {type(cov).__name__}")
    schedule = Schedule(
        d["dense_layers"] if dense_layers is None else dense_layers,
        d["dense_steps"] if dense_steps is None else dense_steps,
        min_kv_len,
    )
    return PisaConfig(
        density=float(density),
        mode=mode,
        covariance_aware=d["covariance_aware"] if cov is None else cov,
        block_size=block_size,
        tile=_check_tile(tile, adapter.ndim, block_size),
        schedule=schedule,
        alpha=_check_alpha(alpha, mode),
    )


@dataclass
class _Plan:
    """Everything :func:`apply_pisa` will do to one transformer, checked before anything is done."""

    transformer: Any
    adapter: ModelAdapter
    config: PisaConfig
    modules: list[tuple[str, Any]]  # the managed self-attention modules (name, module)
    alphas: dict  # layer -> CPU float64 [H] weights from an alpha table
    rules: dict  # layer -> covariance_aware chosen for it in an alpha table
    calibration: CalibrationConfig | None

    @property
    def blocks(self) -> tuple[int, ...]:
        """Transformer block of each managed module, forward order: its parent module's rank among
        the parents (SD3.5's attn and attn2 share a block)."""
        parents = [name.rpartition(".")[0] for name, _ in self.modules]
        index = {p: i for i, p in enumerate(dict.fromkeys(parents))}
        return tuple(index[p] for p in parents)


def _managed_modules(transformer, adapter: ModelAdapter) -> list[tuple[str, Any]]:
    """The adapter's self-attention modules; ValueError when one cannot be routed to the backend."""
    found = []
    for name, module in transformer.named_modules():
        if not any(fnmatch.fnmatchcase(name, p) for p in adapter.attention):
            continue
        proc = module.processor
        if not hasattr(proc, "_attention_backend"):
            raise ValueError(
                f"attention module {name!r} uses {type(proc).__name__}, which does not call diffusers' attention "
                f"dispatcher, so PISA cannot run it (reset custom or fused attention processors first)"
            )
        heads = module.heads
        head_dim = getattr(module, "head_dim", None) or module.inner_dim // heads
        if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(
                f"PISA runs head dims in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]; attention module {name!r} has head dim "
                f"{head_dim} ({heads} heads)"
            )
        found.append((name, module))
    if not found:
        raise ValueError(f"no self-attention modules matching {adapter.attention} in {type(transformer).__name__}")
    for kind in ("token_module", "rope_module", "untile_module"):
        sub = getattr(adapter, kind)
        try:
            if sub is not None:
                transformer.get_submodule(sub)
        except AttributeError:
            raise ValueError(f"{type(transformer).__name__} has no submodule {sub!r} (the adapter's {kind})") from None
    return found


def _heads(module) -> int:
    return int(module.heads)


def _plan(name: str, transformer, settings: dict, table: at.AlphaTable | None, calibration) -> _Plan:
    adapter = adapter_for(transformer)
    adapter.check(transformer)
    config = _config(adapter, transformer, **settings)
    modules = _managed_modules(transformer, adapter)
    if isinstance(config.alpha, tuple):
        bad = sorted({_heads(m) for _, m in modules} - {len(config.alpha)})
        if bad:
            raise ValueError(f"alpha has {len(config.alpha)} values but {type(transformer).__name__} has attention "
                             f"layers with {bad} heads: give one value per head of every layer, or a float")
    if calibration is not None and config.schedule.dense_steps < 1:
        raise ValueError("calibrate fits the first-order weight on the dense warm-up steps, but this run has "
                         "dense_steps=0: pass dense_steps >= 1 (or load weights with alpha_table=...)")
    alphas, rules = {}, {}
    if table is not None:
        _check_table_settings(table, config)
        for layer, entry in table.layers(name).items():
            if layer >= len(modules):
                raise ValueError(f"alpha_table has layer {layer}, but {type(transformer).__name__} has "
                                 f"{len(modules)} managed attention layers (0..{len(modules) - 1})")
            heads = _heads(modules[layer][1])
            if len(entry.alpha) != heads:
                raise ValueError(f"alpha_table layer {layer} has {len(entry.alpha)} weights; the layer "
                                 f"({modules[layer][0]}) has {heads} heads")
            alphas[layer] = torch.tensor(entry.alpha, dtype=torch.float64)
            if entry.covariance_aware is not None:
                rules[layer] = entry.covariance_aware
    return _Plan(transformer, adapter, config, modules, alphas, rules, calibration)


def _check_table_settings(table: at.AlphaTable, config: PisaConfig) -> None:
    if config.mode not in spec.FIRST_ORDER_MODES:
        raise ValueError(f"alpha_table holds first-order weights, which mode {config.mode!r} does not have")
    fitted = table.settings
    ours = {"density": config.density, "mode": config.mode, "covariance_aware": config.covariance_aware,
            "block_size": config.block_size}
    differ = {k: (fitted[k], v) for k, v in ours.items() if k in fitted and fitted[k] != v}
    if differ:
        warnings.warn("alpha_table was fitted under other settings (table vs this run: "
                      + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items())
                      + "); a weight depends on the density and the selection", RuntimeWarning, stacklevel=3)


def _route_attention(state: PisaState, modules, member) -> None:
    """Point the managed self-attention processors at the pisa backend; record how to undo it."""
    seen: set[int] = set()
    for _, module in modules:
        proc = module.processor
        if id(proc) in seen:
            continue
        seen.add(id(proc))
        had, old = "_attention_backend" in proc.__dict__, proc.__dict__.get("_attention_backend")
        proc._attention_backend = member
        state.restore.append(lambda p=proc, h=had, o=old: setattr(p, "_attention_backend", o) if h else delattr(p, "_attention_backend"))


def _install(state: PisaState, member) -> None:
    """Route the processors and register the boundary hooks of ``state`` (undone by :func:`_undo`,
    also after a partial install)."""
    try:
        _route_attention(state, _managed_modules(state.transformer, state.adapter), member)
        install(state)
        if state.calibrator is not None:
            state.calibrator.attach(state.transformer)
    except BaseException:
        _undo(state)
        raise
    state.transformer.__dict__[_STATE_ATTR] = state


def _hook_pipeline(pipe, states: list[PisaState]) -> None:
    """Start a new generation (step 0) whenever the pipeline opens its denoising progress bar,
    which every diffusers pipeline does once per call before its first transformer call."""
    original = type(pipe).progress_bar

    def progress_bar(*args, **kwargs):
        for s in states:
            s.new_generation()
        return original(pipe, *args, **kwargs)

    pipe.__dict__["progress_bar"] = progress_bar
    pipe.__dict__[_PIPE_ATTR] = states


_MISSING = object()
# What apply_pisa keeps in a transformer's / pipeline's __dict__ (put back as it was on failure).
_TRANSFORMER_KEYS = (_STATE_ATTR, tm.ATTR, hooks.ATTR)
_PIPE_KEYS = ("progress_bar", _PIPE_ATTR)


class _Saved:
    """The parts of a transformer or pipeline ``__dict__`` that apply_pisa changes, to put back."""

    def __init__(self, obj, keys) -> None:
        self.obj = obj
        self.values = {k: obj.__dict__.get(k, _MISSING) for k in keys}
        self.lists = {k: list(v) for k, v in self.values.items() if isinstance(v, list)}  # observers

    def restore(self) -> None:
        for k, v in self.values.items():
            if v is _MISSING:
                self.obj.__dict__.pop(k, None)
            else:
                self.obj.__dict__[k] = v
                if k in self.lists:
                    v[:] = self.lists[k]


def apply_pisa(
    pipe_or_transformer,
    density: float = 0.15,
    dense_layers: int | None = None,
    dense_steps: int | None = None,
    tile=None,
    mode: str = "hybrid",
    covariance_aware: bool | None = None,
    *,
    block_size: int = 64,
    min_kv_len: int = DEFAULT_MIN_KV_LEN,
    telemetry=None,
    alpha=None,
    calibrate=False,
    alpha_table=None,
):
    """Run the self-attention of a diffusers pipeline's transformer(s) (or of one transformer) on PISA.

    Args:
        pipe_or_transformer: a FLUX.1 / SD3 / Wan2.1 / HunyuanVideo pipeline (its ``transformer`` and
            ``transformer_2`` are managed) or one of their transformer models.
        density: fraction of key blocks computed exactly (``pisa_attention``'s ``density``).
        dense_layers: the first transformer blocks whose attention layers always run dense.
        dense_steps: the first denoising steps that run dense.
        tile: token tile, ``(h, w)`` / ``(t, h, w)``; default 8x8 / 4x4x4 (``block_size`` tokens).
        mode: ``"hybrid"``, ``"zeroth"``, ``"first"`` or ``"drop"``.
        covariance_aware: covariance-aware block selection.
        block_size: tokens per query/key block.
        min_kv_len: calls with fewer keys run dense (too few tokens for sparsity to pay).
        telemetry: passed to ``pisa_attn.diffusers.telemetry.attach`` when not None.
        alpha: weight of the first-order tail term (``pisa_attention``'s ``alpha``): a float or a
            CPU tensor of one value per head; None: :data:`pisa_attn.spec.DEFAULT_ALPHA`. The
            weight of layers that ``calibrate`` / ``alpha_table`` give none.
        calibrate: fit the weight per layer and head on each generation's dense warm-up steps
            (needs ``dense_steps >= 1``) and use it from the first sparse step on: ``True``, or a
            :class:`~pisa_attn.diffusers.calibrate.CalibrationConfig` (rows sampled per call, per
            head or per layer). :func:`alpha_table` returns the fitted weights (to save and reuse).
        alpha_table: weights per layer and head to use (a JSON path from ``pisa-attn calibrate``
            or :meth:`AlphaTable.save`, its dict, or an :class:`~pisa_attn.alpha_table.AlphaTable`).

    ``None`` means the model's default from the paper's appendix D (Wan2.1-1.3B: 1 block / 15 steps,
    Wan2.1-14B and HunyuanVideo: 1 / 10, FLUX.1 and SD3.5: 4 / 0; covariance-aware selection for the
    image models only). Applying again replaces the previous settings. Returns its argument.

    All arguments and every transformer are checked before anything changes; when applying fails,
    the pipeline and its transformers are left exactly as they were (an earlier apply_pisa included).
    """
    member = register()
    found, pipe = transformers_of(pipe_or_transformer)
    transformers = [t for _, t in found]
    tel = None if telemetry is None else tm.as_config(telemetry)
    calibration = calibration_config(calibrate)
    table = None if alpha_table is None else at.load(alpha_table)
    if calibration is not None and table is not None:
        raise ValueError("give calibrate or alpha_table, not both (calibrate fits the weights alpha_table would set)")
    if (calibration is not None or table is not None) and mode not in spec.FIRST_ORDER_MODES:
        what = "calibrate" if calibration is not None else "alpha_table"
        raise ValueError(f"{what} sets the first-order weight, which mode {mode!r} does not have "
                         f"(modes with one: {spec.FIRST_ORDER_MODES})")
    settings = dict(density=density, dense_layers=dense_layers, dense_steps=dense_steps, tile=tile, mode=mode,
                    cov=covariance_aware, block_size=block_size, min_kv_len=min_kv_len, alpha=alpha)  # fmt: skip
    plans = [_plan(name, tr, settings, table, calibration) for name, tr in found]

    saved = [_Saved(tr, _TRANSFORMER_KEYS) for tr in transformers]
    saved += [_Saved(pipe, _PIPE_KEYS)] if pipe is not None else []
    previous = [(pisa_state(tr), tm.get(tr)) for tr in transformers]
    active = [t is not None and t.active for _, t in previous]
    new: list[PisaState] = []
    tracker = StepTracker()  # shared: Wan2.2's two experts count one sequence of denoising steps
    try:
        for plan in plans:
            tr = plan.transformer
            remove_pisa(tr)
            state = PisaState(tr, plan.adapter, plan.config, tracker, blocks=plan.blocks, alphas=plan.alphas,
                              rules=plan.rules)
            if plan.calibration is not None:
                default = plan.config.alpha if isinstance(plan.config.alpha, float) else spec.DEFAULT_ALPHA
                state.calibrator = Calibrator(plan.calibration, plan.config.schedule, default)
            new.append(state)
            _install(state, member)
            if tel is not None:
                tm.attach(tr, tel)
        if pipe is not None:
            _unhook_pipeline(pipe)
            _hook_pipeline(pipe, new)
    except BaseException:
        for state in reversed(new):
            _undo(state)
        for s in saved:
            s.restore()  # state, telemetry and observer entries (the observer lists in place)
        for (old, old_tel), was_active in zip(previous, active):
            if old is not None:
                _install(old, member)
            if old_tel is not None:
                old_tel.active = was_active
        raise
    return pipe_or_transformer


def _undo(state: PisaState) -> None:
    if state.calibrator is not None:
        state.calibrator.detach()
    for h in state.handles:
        h.remove()
    for fn in reversed(state.restore):
        fn()
    state.handles.clear()
    state.restore.clear()


def _unhook_pipeline(pipe) -> None:
    pipe.__dict__.pop("progress_bar", None)
    pipe.__dict__.pop(_PIPE_ATTR, None)


def remove_pisa(pipe_or_transformer):
    """Undo :func:`apply_pisa`: hooks removed, attention processors and backends restored,
    telemetry detached. Transformers that are not managed are left alone. Returns its argument."""
    transformers, pipe = _transformers(pipe_or_transformer)
    for tr in transformers:
        state = tr.__dict__.pop(_STATE_ATTR, None)
        if state is None:
            continue
        tm.detach(tr)
        _undo(state)
    if pipe is not None:
        _unhook_pipeline(pipe)
    return pipe_or_transformer
