"""``apply_pisa`` / ``remove_pisa``: put a diffusers transformer's self-attention on PISA and take
it off again.

Everything goes through public entry points: each managed attention module gets a PISA processor
(``set_processor``) that knows its layer index; token tiling and the step counter hang on hooks of
the transformer (PyTorch forward hooks on the transformer, diffusers ``ModelHook``s on its token
modules). Nothing in diffusers (classes, enums, pipeline methods) is changed, and
:func:`remove_pisa` puts every processor, hook and attribute back as it was."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .. import alpha_table as at
from .. import spec
from ..settings import PisaSettings, as_bool
from ..attention import MAX_HEAD_DIM, MIN_HEAD_DIM
from . import hooks
from . import telemetry as tm
from .backend import check_diffusers
from .calibrate import CalibrationConfig, Calibrator
from .calibrate import as_config as calibration_config
from .models import ModelAdapter, adapter_for, transformers_of
from .parallel import check_no_tensor_parallel, context_parallel_config
from .processors import PROCESSORS, PisaProcessor, check_replaceable
from .schedule import DEFAULT_MIN_KV_LEN, Schedule, StepTracker
from .state import PisaConfig, PisaState, set_alive
from .tiling import default_tile, install

_STATE_ATTR = "_pisa_state"


def pisa_state(transformer) -> PisaState | None:
    """The :class:`PisaState` :func:`apply_pisa` attached to ``transformer`` (or to the model a
    ``torch.compile`` wrapper holds), or None."""
    return getattr(transformer, "_orig_mod", transformer).__dict__.get(_STATE_ATTR)


def stats(transformer) -> dict[str, int]:
    """Managed attention calls since the current generation started (its first transformer call,
    the first whose timestep is not below the previous call's): ``dense``, ``sparse`` and
    dense calls per reason (``warmup_step``, ``warmup_layer``, ``few_tokens``). ``transformer``:
    a managed transformer, or a pipeline with one transformer."""
    state = pisa_state(transformer)
    if state is None and not hasattr(transformer, "_orig_mod"):
        try:
            found, pipe = transformers_of(transformer)
        except (TypeError, ValueError):
            found, pipe = [], None
        if pipe is not None and len(found) > 1:
            raise ValueError("this pipeline has two transformers: pass pipe.transformer or pipe.transformer_2")
        if len(found) == 1:
            state = pisa_state(found[0][1])
    if state is None:
        raise ValueError("transformer is not managed by apply_pisa")
    state.catch_up()
    return dict(state.stats)


def _transformers(obj) -> tuple[list, object | None]:
    """(transformers to manage, pipeline or None) for a pipeline or a transformer."""
    found, pipe = transformers_of(obj)
    return [t for _, t in found], pipe


def alpha_table(pipe_or_transformer) -> at.AlphaTable:
    """The per-layer first-order weights of the managed transformer(s), with their fit information:
    the calibrated ones (the fits of this generation's warm-up so far), else the loaded ones.
    ``.save(path)`` writes the file ``apply_pisa(..., alpha_table=path)`` loads. A layer with no
    weights of its own (not fitted, e.g. an expert without warm-up steps) is not in the table: it
    runs ``apply_pisa``'s ``alpha``, so pass the same ``alpha`` with the table to run as this run did."""
    found, _ = transformers_of(pipe_or_transformer)
    out, settings, model, fit = {}, {}, None, "head"
    for name, tr in found:
        state = pisa_state(tr)
        if state is None:
            raise ValueError("transformer is not managed by apply_pisa")
        state.catch_up()  # a second expert not yet called this generation has no fits of it
        model = state.adapter.name
        cfg = state.config
        mine = {"density": cfg.density, "mode": cfg.mode, "covariance_aware": cfg.covariance_aware,
                "block_size": cfg.block_size}
        if settings and mine != settings:
            raise ValueError(f"the transformers run under different settings ({settings} vs {mine}): a table "
                             "holds one; save a table per transformer (alpha_table(pipe.transformer), ...)")
        settings = mine
        layers = {}
        if state.calibrator is not None and state.calibrator.fits:
            fitted = state.calibrator.table(name)
            layers, fit = dict(fitted.layers(name)), fitted.fit  # per head or one weight per layer
        for i, a in state.alphas.items():
            layers.setdefault(i, at.LayerAlpha(tuple(float(x) for x in a.tolist()),
                                               covariance_aware=state.rules.get(i)))
        out[name] = layers
    if not any(out.values()):
        raise ValueError("no calibrated or loaded first-order weights: use apply_pisa(..., calibrate=True) and run "
                         "past the warm-up, or apply_pisa(..., alpha_table=...)")
    return at.AlphaTable(out, settings, model=model, source="apply_pisa", fit=fit)


def _check_tile(tile, ndim: int, block_size: int) -> tuple[int, ...]:
    if tile is None:
        return default_tile(ndim, block_size)
    if not isinstance(tile, (tuple, list)) or len(tile) != ndim:
        raise ValueError(f"tile must be a tuple of {ndim} ints for this {ndim}D model, got {tile!r}")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 1 for t in tile):  # numpy's ints too
        raise ValueError(f"tile entries must be positive ints, got {tile!r}")
    tile = tuple(int(t) for t in tile)
    if math.prod(tile) != block_size:  # the layout puts whole tiles on block boundaries: one tile, one block
        raise ValueError(f"tile must hold block_size = {block_size} tokens (one tile per block), got {tile!r} "
                         f"({math.prod(tile)} tokens)")
    return tile


def _config(adapter: ModelAdapter, transformer, density, dense_layers, dense_steps, tile, mode, cov, block_size,
            min_kv_len, alpha=None, query_block=None, backend="auto", precision="input"):
    d = adapter.defaults(transformer.config)
    if cov is not None:
        cov = as_bool("covariance_aware", cov)  # numpy's bool too, as PisaSettings takes
    settings = PisaSettings(
        density=density, mode=mode, alpha=alpha, block_size=block_size, query_block=query_block,
        covariance_aware=d["covariance_aware"] if cov is None else cov, backend=backend, layout="bshd",
        precision=precision,
    )  # fmt: skip
    schedule = Schedule(
        d["dense_layers"] if dense_layers is None else dense_layers,
        d["dense_steps"] if dense_steps is None else dense_steps,
        min_kv_len,
    )
    return PisaConfig(settings=settings, tile=_check_tile(tile, adapter.ndim, settings.block_size), schedule=schedule)


@dataclass
class _Install:
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
        check_replaceable(adapter.name, name, module)
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


def _install_for(name: str, transformer, settings: dict, table: at.AlphaTable | None, calibration,
                 experts: int = 1) -> _Install:
    adapter = adapter_for(transformer)
    adapter.check(transformer)
    check_no_tensor_parallel(transformer)
    config = _config(adapter, transformer, **settings)
    modules = _managed_modules(transformer, adapter)
    if isinstance(config.alpha, tuple) and len(config.alpha) > 1:  # one value is every head's
        bad = sorted({_heads(m) for _, m in modules} - {len(config.alpha)})
        if bad:
            raise ValueError(f"alpha has {len(config.alpha)} values but {type(transformer).__name__} has attention "
                             f"layers with {bad} heads: give one value per head of every layer, or a float")
    if calibration is not None and config.schedule.dense_steps < 1:
        raise ValueError("calibrate fits the first-order weight on the dense warm-up steps, but this run has "
                         "dense_steps=0: pass dense_steps >= 1 (or load weights with alpha_table=...)")
    alphas, rules = {}, {}
    if table is not None:
        if table.model is not None and table.model != adapter.name:
            raise ValueError(f"alpha_table was fitted on a {table.model!r} model; this is a {adapter.name!r} "
                             "transformer (its layer indices name other layers): calibrate this model")
        _check_table_settings(table, config)
        for layer, entry in table.layers(name, strict=experts > 1).items():
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
        # The table's weights were fitted under its per-layer rules: an explicit rule that differs
        # is neither silently overridden nor run with weights fitted for another selection.
        given = settings["cov"]
        clash = sorted(layer for layer, rule in rules.items() if given is not None and rule != given)
        if clash:
            raise ValueError(f"covariance_aware={given!r} contradicts the selection rule alpha_table fitted layers "
                             f"{clash} under: pass covariance_aware=None to run the table's rules, or refit")
    return _Install(transformer, adapter, config, modules, alphas, rules, calibration)


def _check_table_settings(table: at.AlphaTable, config: PisaConfig) -> None:
    if config.mode not in spec.FIRST_ORDER_MODES:
        raise ValueError(f"alpha_table holds first-order weights, which mode {config.mode!r} does not have")
    fitted = table.settings
    ours = {"density": config.density, "mode": config.mode, "covariance_aware": config.covariance_aware,
            "block_size": config.block_size}
    differ = {k: (fitted[k], v) for k, v in ours.items() if k in fitted and fitted[k] != v}
    if config.query_block not in (None, config.block_size):  # tables are fitted on one selection per block
        differ["query_block"] = (None, config.query_block)
    if differ:
        warnings.warn("alpha_table was fitted under other settings (table vs this run: "
                      + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items())
                      + "); a weight depends on the density and the selection", RuntimeWarning, stacklevel=3)


def _route_attention(state: PisaState, modules) -> None:
    """Give each managed module a PISA processor that knows its layer (undone by ``state.restore``)."""
    cls = PROCESSORS[state.adapter.name]
    pairs = []
    for layer, (_, module) in enumerate(modules):
        inner = module.processor
        if isinstance(inner, PisaProcessor) and inner.orphaned():  # left by diffusers (see processors)
            inner = inner.original
        proc = cls(inner, state.handle, layer)
        module.set_processor(proc)
        state.restore.append(lambda m=module, p=proc: _restore_processor(m, p))
        pairs.append((module, proc))
    state.processors = tuple(pairs)


def _restore_processor(module, proc) -> None:
    """Put back the processor ``proc`` replaced, with what diffusers set on ``proc`` meanwhile
    (``enable_parallelism``, ``set_attention_backend``), as it would have set it on the original."""
    if module.processor is not proc:  # the user replaced it since: theirs stays
        return
    original = proc.original
    for attr in ("_parallel_config", "_attention_backend"):
        # diffusers sets these only on processors that have them
        if hasattr(original, attr) and getattr(proc, attr) is not getattr(original, attr):
            setattr(original, attr, getattr(proc, attr))
    module.set_processor(original)


def _install(state: PisaState) -> None:
    """Route the processors and register the hooks of ``state``; ``_pisa_state`` is set last, once
    everything is in place. A failure undoes what was done and leaves the state unset."""
    set_alive(state, True)
    try:
        _route_attention(state, _managed_modules(state.transformer, state.adapter))
        install(state)
        if state.calibrator is not None:
            state.calibrator.attach(state.transformer)
            state.restore.append(state.calibrator.detach)
    except BaseException:
        _undo(state)
        raise
    state.transformer.__dict__[_STATE_ATTR] = state


_MISSING = object()
# What apply_pisa keeps in a transformer's __dict__ besides its state (put back as it was on failure).
_TRANSFORMER_KEYS = (tm.ATTR, hooks.ATTR)


class _Saved:
    """The parts of a transformer's ``__dict__`` that apply_pisa changes, to put back."""

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
    query_block: int | None = None,
    backend: str = "auto",
    precision: str = "input",
):
    """Run the self-attention of a diffusers pipeline's transformer(s) (or of one transformer) on PISA.

    Args:
        pipe_or_transformer: a FLUX.1 / SD3 / Wan2.1 / HunyuanVideo pipeline (its ``transformer`` and
            ``transformer_2`` are managed) or one of their transformer models.
        density: fraction of key blocks computed exactly (``pisa_attention``'s ``density``).
        dense_layers: the first transformer blocks whose attention layers always run dense.
        dense_steps: the first denoising steps that run dense.
        tile: token tile, ``(h, w)`` / ``(t, h, w)`` of ``block_size`` tokens (one tile per block);
            default 8x8 / 4x4x4.
        mode: ``"hybrid"``, ``"zeroth"``, ``"first"`` or ``"drop"``.
        covariance_aware: covariance-aware block selection; None: the model family's default,
            or with ``calibrate=True`` each layer's rule chosen by the fit (an explicit value is
            kept: the fit then runs under it alone), or with ``alpha_table`` the rule each layer was
            fitted under (an explicit value that contradicts one is a ValueError).
        block_size: tokens per query/key block.
        min_kv_len: calls with fewer keys run dense (too few tokens for sparsity to pay).
        telemetry: passed to ``pisa_attn.diffusers.telemetry.attach``; None or False: off (as
            ``calibrate=False``).
        alpha: weight of the first-order tail term (``pisa_attention``'s ``alpha``): a float or a
            CPU tensor of one value per head; None: :data:`pisa_attn.spec.DEFAULT_ALPHA`. The
            weight of layers that ``calibrate`` / ``alpha_table`` give none.
        calibrate: fit the weight per layer and head on each generation's dense warm-up steps
            (needs ``dense_steps >= 1``) and use it from the first sparse step on: ``True``, or a
            :class:`~pisa_attn.diffusers.calibrate.CalibrationConfig` (rows sampled per call, per
            head or per layer). :func:`alpha_table` returns the fitted weights (to save and reuse).
        alpha_table: weights per layer and head to use (a JSON path from ``pisa-attn calibrate``
            or :meth:`AlphaTable.save`, its dict, or an :class:`~pisa_attn.alpha_table.AlphaTable`).
        query_block: tokens per selection row (``pisa_attention``'s ``query_block``; one process
            only: context parallelism selects per block).
        backend: ``pisa_attention``'s ``backend`` for the sparse calls.
        precision: ``pisa_attention``'s ``precision`` for the sparse calls (``"fp8"``, ``"int8-fp8"``,
            ``"int8-int8"``, ``"int8"``: the exact blocks' products quantised on the Hopper kernel;
            dense calls stay in the input dtype).

    The attention settings become one :class:`~pisa_attn.settings.PisaSettings` (validated once,
    here); each call shape gets one plan (:func:`pisa_attn.plan`), shared by the layers of that
    shape, and every sparse call runs on it.

    ``None`` means the model's default from the paper's appendix D (Wan2.1-1.3B: 1 block / 15 steps,
    Wan2.1-14B and HunyuanVideo: 1 / 10, FLUX.1 and SD3.5: 4 / 0; covariance-aware selection for the
    image models only). Applying again replaces the previous settings. Returns its argument.

    All arguments and every transformer are checked before anything changes; when applying fails,
    the pipeline and its transformers are left exactly as they were (an earlier apply_pisa included).
    """
    check_diffusers()
    found, pipe = transformers_of(pipe_or_transformer)
    transformers = [t for _, t in found]
    tel = None if telemetry is None or telemetry is False else tm.as_config(telemetry)
    calibration = calibration_config(calibrate)
    if calibration is not None and covariance_aware is not None and calibration.choose_selection:
        if calibrate is not True:
            raise ValueError("calibrate=CalibrationConfig(choose_selection=True) chooses each layer's selection rule "
                             "and covariance_aware= fixes it: pass one of them (or choose_selection=False)")
        calibration = dataclasses.replace(calibration, choose_selection=False)  # the rule given is kept
    table = None if alpha_table is None else at.load(alpha_table)
    if calibration is not None and table is not None:
        raise ValueError("give calibrate or alpha_table, not both (calibrate fits the weights alpha_table would set)")
    if calibration is not None and query_block is not None and query_block != block_size:
        raise ValueError("calibrate=True fits the weight against one selection per block_size rows, not the "
                         f"query_block={query_block!r} selection the sparse calls would run: calibrate without "
                         "query_block, or pass alpha / alpha_table")
    if (calibration is not None or table is not None) and mode not in spec.FIRST_ORDER_MODES:
        what = "calibrate" if calibration is not None else "alpha_table"
        raise ValueError(f"{what} sets the first-order weight, which mode {mode!r} does not have "
                         f"(modes with one: {spec.FIRST_ORDER_MODES})")
    settings = dict(density=density, dense_layers=dense_layers, dense_steps=dense_steps, tile=tile, mode=mode,
                    cov=covariance_aware, block_size=block_size, min_kv_len=min_kv_len, alpha=alpha,
                    query_block=query_block, backend=backend, precision=precision)  # fmt: skip
    if table is not None and pipe is None and len(table.transformers) > 1:
        raise ValueError(f"alpha_table holds weights for {sorted(table.transformers)}: pass the pipeline (each "
                         "transformer takes its own entry), or a table of one transformer")
    if (calibration is not None or tel is not None) and any(context_parallel_config(t) is not None for t in transformers):
        # enabled after apply_pisa, the first call refuses them (parallel_attention)
        raise ValueError("attention observers (calibrate=True, telemetry) are not supported under context "
                         "parallelism: calibrate offline (pisa-attn calibrate) and pass alpha_table=")
    installs = [_install_for(name, tr, settings, table, calibration, len(found)) for name, tr in found]

    saved = [_Saved(tr, _TRANSFORMER_KEYS) for tr in transformers]
    previous = [(pisa_state(tr), tm.get(tr)) for tr in transformers]
    active = [t is not None and t.active for _, t in previous]
    new: list[PisaState] = []
    # shared: Wan2.2's two experts count one sequence of denoising steps, also when one is applied again
    tracker = next((old.tracker for old, _ in previous if old is not None), None) or StepTracker()
    try:
        for inst in installs:
            tr = inst.transformer
            remove_pisa(tr)
            state = PisaState(tr, inst.adapter, inst.config, tracker, blocks=inst.blocks, alphas=inst.alphas,
                              rules=inst.rules)
            if inst.calibration is not None:
                a = inst.config.alpha
                default = spec.DEFAULT_ALPHA if a is None else a[0] if isinstance(a, tuple) and len(a) == 1 else a
                state.calibrator = Calibrator(inst.calibration, inst.config.schedule, default)
            new.append(state)
            _install(state)
            if tel is not None:
                tm.attach(tr, tel)
        scheduler = getattr(pipe, "scheduler", None) if pipe is not None else next(
            (old.pipe_scheduler for old, _ in previous if old is not None and old.pipe_scheduler is not None), None)
        for state in new:  # a transformer applied again alone keeps its pipeline's scheduler
            state.pipe_scheduler = scheduler
        if new and scheduler is not None:
            _hook_scheduler(new[0], scheduler, tracker)
    except BaseException as error:
        _roll_back(new, saved, previous, active, error)
        raise
    return pipe_or_transformer


class _SchedulerHook:
    """A scheduler method that tells ``tracker`` (``reset`` or ``stepped``) while active, then runs.
    Wrappers of several states (pipelines sharing a scheduler) form a chain through ``before``."""

    def __init__(self, inner, before, tell) -> None:
        functools.update_wrapper(self, inner)  # pipelines read its signature (retrieve_timesteps)
        self.inner, self.before, self.tell, self.active = inner, before, tell, True

    def __call__(self, *args, **kwargs):
        if self.active:
            self.tell()
        return self.inner(*args, **kwargs)


def _hook_scheduler(state: PisaState, scheduler, tracker: StepTracker) -> None:
    """Count steps where the pipeline drives its scheduler (every diffusers pipeline does):
    ``set_timesteps`` (once per call) starts a new generation, so one starting at or below the last
    timestep of the previous (img2img, a lower strength, an interrupted run) gets its warm-up too;
    ``step`` (once per denoising step) ends a step, so equal timesteps of two steps count as two.
    The wrappers are attributes of the scheduler instance, removed with ``state`` in whatever order
    states sharing the scheduler go (a scheduler set later, or a transformer called by hand, falls
    back to the timestep rule of :class:`StepTracker`)."""
    for name, tell in (("set_timesteps", tracker.reset), ("step", tracker.stepped)):
        original = getattr(scheduler, name, None)
        if callable(original):
            _wrap(state, scheduler, name, _SchedulerHook(original, scheduler.__dict__.get(name, _MISSING), tell))
            state.scheduler = scheduler


def _wrap(state: PisaState, scheduler, name: str, wrapper: _SchedulerHook) -> None:
    scheduler.__dict__[name] = wrapper

    def restore() -> None:
        wrapper.active = False
        d = scheduler.__dict__
        top = d.get(name, _MISSING)
        while isinstance(top, _SchedulerHook) and not top.active:  # every removed wrapper on top goes
            top = top.before
        if top is _MISSING:
            d.pop(name, None)
        else:
            d[name] = top

    state.restore.append(restore)


def _roll_back(new: list[PisaState], saved: list[_Saved], previous, active, error: BaseException) -> None:
    """Undo a failed apply_pisa: the new states off, the dict entries back, the previous states
    (an earlier apply_pisa) on again. Each step runs whatever the others do; a previous state that
    cannot be put back stays off (its transformer then runs native attention and says so:
    ``pisa_state`` is None), and the failure is noted on ``error``."""
    for state in reversed(new):
        try:
            _undo(state)
        except Exception as e:  # noqa: BLE001 - keep rolling back; reported on the error
            error.add_note(f"apply_pisa's rollback could not fully undo {type(state.transformer).__name__}: {e!r}")
    for s in saved:
        s.restore()  # telemetry and observer entries (the observer lists in place)
    for (old, old_tel), was_active in zip(previous, active):
        # a transformer the loop never reached still carries its earlier state: installing it
        # again would wrap its processors twice (and diffusers refuses the second tiling hook)
        if old is not None and pisa_state(old.transformer) is not old:
            if old.calibrator is not None:  # the observer lists came back with it: _install attaches it again
                obs = hooks.observers(old.transformer)
                while old.calibrator.observe in obs:
                    obs.remove(old.calibrator.observe)
            try:
                _install(old)
                if old.scheduler is not None:  # its scheduler hooks went with remove_pisa: back too
                    _hook_scheduler(old, old.scheduler, old.tracker)
            except Exception as e:  # noqa: BLE001
                error.add_note(f"apply_pisa could not restore the earlier PISA settings of "
                               f"{type(old.transformer).__name__} ({e!r}): it now runs native attention")
                continue
        if old_tel is not None:
            old_tel.active = was_active


def _undo(state: PisaState) -> None:
    """Take ``state`` off its transformer: first the state (so nothing reports it managed), then
    every change in reverse order, each tried even when an earlier one fails (the first failure is
    raised at the end)."""
    tr = state.transformer
    if tr.__dict__.get(_STATE_ATTR) is state:
        del tr.__dict__[_STATE_ATTR]
    set_alive(state, False)
    failure = None
    while state.restore:
        try:
            state.restore.pop()()
        except Exception as e:  # noqa: BLE001 - undo the rest first
            failure = failure or e
    if failure is not None:
        raise failure


def remove_pisa(pipe_or_transformer):
    """Undo :func:`apply_pisa`: PISA processors and hooks removed, the original processors back,
    telemetry detached (its records stay readable by :func:`report`). Transformers that are not
    managed are left alone. Returns its argument."""
    transformers, _ = _transformers(pipe_or_transformer)
    for tr in transformers:
        state = tr.__dict__.get(_STATE_ATTR)
        if state is None:
            continue
        tm.detach(tr)
        _undo(state)
        if tr.__dict__.get(hooks.ATTR) == []:  # no observer left: no attribute either
            del tr.__dict__[hooks.ATTR]
    return pipe_or_transformer
