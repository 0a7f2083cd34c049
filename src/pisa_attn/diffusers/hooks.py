"""Observer hooks on PISA-managed attention calls (the contract between PISA's attention processors and
the tools that watch it: Q/K/V capture and per-layer error telemetry).

A managed call builds an :class:`AttentionCall` only when a model has observers, so watching costs
nothing when nobody watches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor


@dataclass
class AttentionCall:
    """One self-attention call of a transformer that :func:`apply_pisa` manages.

    ``q``/``k``/``v``/``out`` are ``[B, H, L, D]`` in the token order PISA sees (tiled: image/video
    tokens reordered into 2D/3D tiles, text tokens kept contiguous), post-norm and post-RoPE.
    ``scale`` is the softmax scale the call used (``None`` when constructing: ``1 / sqrt(D)``, the
    default of SDPA and :func:`pisa_attn.pisa_attention`); observers recomputing attention must use it.
    ``meta["key_lens"]``: valid (leading, unmasked) keys per batch row, or None when all are valid;
    set on dense and sparse calls alike. ``alpha``: the first-order weight per query head the call
    used (sparse) or its layer uses now (dense), None in modes without that term.
    """

    model: str  # adapter name: "flux", "sd3", "wan", "hunyuan", ...
    layer: int  # index of the attention layer in the transformer's forward order
    step: int  # denoising step (0-based), as the warm-up schedule counts it
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    dense: bool  # ran dense (warm-up layer/step, too few tokens, ...)
    density: float
    mode: str
    covariance_aware: bool
    block_size: int
    keep_blocks: Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # grid, text segments, tile, key_lens, ...
    scale: float | None = None  # a float after construction (see the class docstring)
    alpha: tuple[float, ...] | None = None
    query_block: int | None = None  # rows per selection (None: block_size), as the sparse calls select
    backend: str = "auto"  # the sparse calls' backend and precision: recomputing PISA must match them
    precision: str = "input"

    def __post_init__(self):
        self.scale = float(self.q.shape[-1] ** -0.5 if self.scale is None else self.scale)


Observer = Callable[[AttentionCall], None]
ATTR = "_pisa_observers"


def add_observer(model, fn: Observer) -> Callable[[], None]:
    """Register ``fn`` on ``model`` (a transformer, or the ``torch.compile`` wrapper of one);
    returns a function that removes it."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    obs = getattr(model, "_orig_mod", model).__dict__.setdefault(ATTR, [])
    obs.append(fn)

    def remove() -> None:
        if fn in obs:
            obs.remove(fn)
        owner = getattr(model, "_orig_mod", model).__dict__
        if not obs and owner.get(ATTR) is obs:  # the last one: the model as it was before
            del owner[ATTR]

    return remove


def observers(model) -> list[Observer]:
    return getattr(model, "_orig_mod", model).__dict__.get(ATTR, [])


def notify(model, call: AttentionCall) -> None:
    for fn in list(observers(model)):
        fn(call)
