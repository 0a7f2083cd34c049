"""``apply_pisa`` / ``remove_pisa``: put a diffusers transformer's self-attention on PISA and take
it off again (processor routing, boundary hooks, warm-up schedule, telemetry, pipeline hook)."""

from __future__ import annotations

import fnmatch

from .backend import register
from .models import ModelAdapter, adapter_for
from .schedule import DEFAULT_MIN_KV_LEN, Schedule, StepTracker
from .state import PisaConfig, PisaState, validate_settings
from .tiling import default_tile, install

_STATE_ATTR = "_pisa_state"
_PIPE_ATTR = "_pisa_pipeline_states"


def pisa_state(transformer) -> PisaState | None:
    """The :class:`PisaState` :func:`apply_pisa` attached to ``transformer``, or None."""
    return transformer.__dict__.get(_STATE_ATTR)


def stats(transformer) -> dict[str, int]:
    """Managed attention calls since the current generation started: ``dense``, ``sparse`` and
    dense calls per reason (``warmup_step``, ``warmup_layer``, ``few_tokens``)."""
    state = pisa_state(transformer)
    if state is None:
        raise ValueError("transformer is not managed by apply_pisa")
    return dict(state.stats)


def _transformers(obj) -> tuple[list, object | None]:
    """(transformers to manage, pipeline or None) for a pipeline or a transformer."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return [getattr(obj, "_orig_mod", obj)], None  # torch.compile(model) wraps the model
    found = [getattr(obj, name, None) for name in ("transformer", "transformer_2")]
    found = [getattr(t, "_orig_mod", t) for t in found if isinstance(t, torch.nn.Module)]
    if not found:
        raise TypeError(
            f"pipe_or_transformer must be a diffusers pipeline with a transformer or a transformer model, "
            f"got {type(obj).__name__}"
        )
    return found, obj


def _check_tile(tile, ndim: int, block_size: int) -> tuple[int, ...]:
    if tile is None:
        return default_tile(ndim, block_size)
    if not isinstance(tile, (tuple, list)) or len(tile) != ndim:
        raise ValueError(f"tile must be a tuple of {ndim} ints for this {ndim}D model, got {tile!r}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tile):
        raise ValueError(f"tile entries must be positive ints, got {tile!r}")
    return tuple(tile)


def _config(adapter: ModelAdapter, transformer, density, dense_layers, dense_steps, tile, mode, cov, block_size, min_kv_len):
    validate_settings(density, mode, block_size)
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
    )


def _route_attention(state: PisaState, member) -> None:
    """Point the adapter's self-attention processors at the pisa backend (SD3's direct-SDPA
    processors are first replaced by dispatcher-routed ones); record how to undo it."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    from .processors import DispatchJointAttnProcessor

    replaced: dict[int, object] = {}
    seen: set[int] = set()
    n = 0
    for name, module in state.transformer.named_modules():
        if not any(fnmatch.fnmatchcase(name, p) for p in state.adapter.attention):
            continue
        n += 1
        proc = module.processor
        if state.adapter.joint_processor and type(proc) is JointAttnProcessor2_0:
            new = replaced.setdefault(id(proc), DispatchJointAttnProcessor())
            module.set_processor(new)
            state.restore.append(lambda m=module, p=proc: m.set_processor(p))
            proc = new
        if not hasattr(proc, "_attention_backend"):
            raise ValueError(
                f"attention module {name!r} uses {type(proc).__name__}, which does not call diffusers' attention "
                f"dispatcher, so PISA cannot run it (reset custom or fused attention processors first)"
            )
        if id(proc) in seen:
            continue
        seen.add(id(proc))
        had, old = "_attention_backend" in proc.__dict__, proc.__dict__.get("_attention_backend")
        proc._attention_backend = member
        state.restore.append(lambda p=proc, h=had, o=old: setattr(p, "_attention_backend", o) if h else delattr(p, "_attention_backend"))
    if n == 0:
        raise ValueError(f"no self-attention modules matching {state.adapter.attention} in {type(state.transformer).__name__}")


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
):
    """Run the self-attention of a diffusers pipeline's transformer(s) (or of one transformer) on PISA.

    Args:
        pipe_or_transformer: a FLUX.1 / SD3 / Wan2.1 / HunyuanVideo pipeline (its ``transformer`` and
            ``transformer_2`` are managed) or one of their transformer models.
        density: fraction of key blocks computed exactly (``pisa_attention``'s ``density``).
        dense_layers: the first attention layers (forward order) that always run dense.
        dense_steps: the first denoising steps that run dense.
        tile: token tile, ``(h, w)`` / ``(t, h, w)``; default 8x8 / 4x4x4 (``block_size`` tokens).
        mode: ``"hybrid"``, ``"zeroth"``, ``"first"`` or ``"drop"``.
        covariance_aware: covariance-aware block selection.
        block_size: tokens per query/key block.
        min_kv_len: calls with fewer keys run dense (too few tokens for sparsity to pay).
        telemetry: passed to ``pisa_attn.diffusers.telemetry.attach`` when not None.

    ``None`` means the model's default from the paper's appendix D (Wan2.1-1.3B: 1 layer / 15 steps,
    Wan2.1-14B and HunyuanVideo: 1 / 10, FLUX.1 and SD3.5: 4 / 0; covariance-aware selection for the
    image models only). Applying again replaces the previous settings. Returns its argument.
    """
    member = register()
    transformers, pipe = _transformers(pipe_or_transformer)
    tracker = StepTracker()  # shared: Wan2.2's two experts count one sequence of denoising steps
    states = []
    for tr in transformers:
        adapter = adapter_for(tr)
        adapter.check(tr)
        cfg = _config(adapter, tr, density, dense_layers, dense_steps, tile, mode, covariance_aware, block_size, min_kv_len)
        if pisa_state(tr) is not None:
            remove_pisa(tr)
        state = PisaState(tr, adapter, cfg, tracker)
        try:
            _route_attention(state, member)
            install(state)
        except Exception:
            _undo(state)
            raise
        tr.__dict__[_STATE_ATTR] = state
        states.append(state)
        if telemetry is not None:
            from . import telemetry as tm

            tm.attach(tr, telemetry)
    if pipe is not None:
        _unhook_pipeline(pipe)
        _hook_pipeline(pipe, states)
    return pipe_or_transformer


def _undo(state: PisaState) -> None:
    for h in state.handles:
        h.remove()
    for fn in reversed(state.restore):
        fn()
    state.handles.clear()
    state.restore.clear()


def _detach_telemetry(transformer) -> None:
    try:
        from . import telemetry as tm
    except ImportError:  # telemetry's optional dependencies missing: nothing can be attached
        return
    if tm.get(transformer) is not None:
        tm.detach(transformer)


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
        _detach_telemetry(tr)
        _undo(state)
    if pipe is not None:
        _unhook_pipeline(pipe)
    return pipe_or_transformer
