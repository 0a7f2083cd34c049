"""State shared by the hooks and the processors: per-transformer settings and per-forward runs.

Each forward call of a managed transformer opens a :class:`Run` (its step, grid and layouts) when
it starts running and publishes it in a context variable; PISA's attention processors, called deep
inside the model, read it from there. Runs are opened and closed by opaque ops (see :mod:`.tiling`), so under
``torch.compile`` this happens when the graph runs, never while it is traced.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import spec
from ..lru import LRU
from ..settings import PisaSettings
from ..layout import TokenOrder
from .models import CallInfo, ModelAdapter
from .schedule import Schedule, StepTracker

LAYOUT_LIMIT = 16  # token layouts kept per managed transformer (one per resolution and text length)


def _mask_key(mask: Tensor) -> tuple:
    """A mask's place in memory, as a key for one forward's cache of its reordered copies: with its
    strides (a transposed view of a square mask shares address and shape), and held alive by the
    cache beside it (a freed mask's address could hold another mask within the forward)."""
    return mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), mask.dtype


@dataclass(frozen=True)
class PisaConfig:
    """What :func:`apply_pisa` set for one managed transformer: the attention settings of its
    sparse calls (one :class:`~pisa_attn.settings.PisaSettings`, ``"bshd"`` layout; its ``alpha``
    is the weight of layers without a calibrated or loaded one), the token tile and the warm-up
    schedule."""

    settings: PisaSettings
    tile: tuple[int, ...]
    schedule: Schedule

    # The settings' fields the integration reads most, by name.
    density = property(lambda self: self.settings.density)
    mode = property(lambda self: self.settings.mode)
    covariance_aware = property(lambda self: self.settings.covariance_aware)
    block_size = property(lambda self: self.settings.block_size)
    query_block = property(lambda self: self.settings.query_block)
    alpha = property(lambda self: self.settings.alpha)

    @functools.cached_property
    def call_settings(self) -> PisaSettings:
        """The settings the calls plan and run with: without ``alpha``, since every call passes its
        layer's weight (Ulysses ranks hold only some heads of a per-head weight)."""
        return self.settings if self.settings.alpha is None else self.settings.replace(alpha=None)


@dataclass(frozen=True)
class Sequence:
    """One self-attention sequence as PISA sees it (tiled order).

    ``layout`` describes the whole sequence; image queries are ``[image_lo, image_hi)``, the text
    tokens (if any) are the rest and keep contiguous; ``keep`` flags key blocks holding text.
    """

    layout: TokenOrder
    text_len: int
    image_lo: int
    image_hi: int
    keep: Tensor | None  # CPU bool [Nk] or None

    @property
    def length(self) -> int:
        return self.layout.num_tokens

    def text_ranges(self) -> list[tuple[int, int]]:
        return [(a, b) for a, b in ((0, self.image_lo), (self.image_hi, self.length)) if b > a]

    def keep_for(self, kv_len: int, block_size: int) -> Tensor | None:
        """Keep flags for the first ``kv_len`` keys (masked trailing text keys dropped)."""
        if self.keep is None:
            return None
        keep = self.keep[: spec.num_blocks(kv_len, block_size)]
        return keep if bool(keep.any()) else None


@dataclass(frozen=True)
class Layouts:
    """Token orders of one (grid, text length): the image stream's and the joint sequence's."""

    image: TokenOrder  # order of the image/video token stream between the boundary hooks
    joint: Sequence  # image + text self-attention (== image-only when the model has no joint text)
    image_only: Sequence  # image-only self-attention (SD3.5's attn2)


class Run:
    """One forward call of a managed transformer."""

    def __init__(self, state: "PisaState", step: int, info: CallInfo, layouts: Layouts) -> None:
        self.state = state
        self.step = step
        self.info = info
        self.layouts = layouts
        self.key_lens: dict[tuple, list[int] | None] = {}  # per attention mask: valid keys per row
        self.masks: dict[tuple, tuple[Tensor, Tensor]] = {}  # per attention mask and sequence: (it, tiled)

    def sequence(self, q_len: int, kv_len: int) -> Sequence | None:
        """The managed sequence a call belongs to, or None (cross-attention, text refiner, ...)."""
        if q_len != kv_len:
            return None
        for seq in (self.layouts.joint, self.layouts.image_only):
            if seq.length == q_len:
                return seq
        return None

    def tiled_mask(self, mask: Tensor, seq: Sequence, batch: int) -> Tensor:
        """``mask`` (over ``seq`` in the model's token order) reordered like the tokens, once per
        forward (one mask serves every layer)."""
        key = (*_mask_key(mask), seq.layout)
        if key not in self.masks:
            self.masks[key] = (mask, seq.layout.mask_to_tiled(mask, batch))
        return self.masks[key][1]

    def image_mask(self, mask: Tensor, q_len: int, kv_len: int) -> Tensor:
        """The mask of a call PISA does not manage, with its dims that index the image/video
        tokens (queries of a cross-attention, say) reordered like those tokens."""
        image = self.layouts.image
        n = image.num_tokens
        if image.is_identity or mask.dim() < 2 or n not in (q_len, kv_len):
            return mask
        key = (*_mask_key(mask), q_len, kv_len)
        if key not in self.masks:
            out = mask
            if kv_len == n and out.shape[-1] == n:
                out = image.to_tiled(out, out.dim() - 1)
            if q_len == n and out.shape[-2] == n:
                out = image.to_tiled(out, out.dim() - 2)
            self.masks[key] = (mask, out)
        return self.masks[key][1]

    def dense_reason(self, layer: int, kv_len: int) -> str | None:
        """The schedule's decision for a call of managed layer ``layer`` (see :class:`Schedule`)."""
        return self.state.config.schedule.dense_reason(self.state.blocks[layer], self.step, kv_len)


@dataclass
class PisaState:
    """Everything :func:`apply_pisa` attached to one transformer (removed by :func:`remove_pisa`)."""

    transformer: Any
    adapter: ModelAdapter
    config: PisaConfig
    tracker: StepTracker = field(default_factory=StepTracker)
    restore: list = field(default_factory=list)  # callables undoing what apply_pisa did, in order
    scheduler: Any = None  # the pipeline scheduler this state hooked when applied (None: none)
    pipe_scheduler: Any = None  # the scheduler of the pipeline it was applied with (kept when applied again alone)
    # (grid, text_len) -> Layouts, the recent ones (their index tensors live on the device)
    layouts: LRU = field(default_factory=lambda: LRU(LAYOUT_LIMIT))
    read_cache: dict = field(default_factory=dict)  # the adapter's read_grid cache
    stats: Counter = field(default_factory=Counter)  # calls per outcome since the last generation start
    runs: list = field(default_factory=list)  # (context token, run) of forwards in progress
    blocks: tuple[int, ...] = ()  # transformer block of each managed layer (layer index -> block)
    alphas: dict = field(default_factory=dict)  # layer -> CPU [H] first-order weights (a loaded table)
    rules: dict = field(default_factory=dict)  # layer -> covariance_aware chosen by a loaded table
    calibrator: Any = None  # a .calibrate.Calibrator when apply_pisa(calibrate=...)
    handle: int = field(init=False)  # how the opaque ops (ints in a graph) find this state
    tiling: tuple | None = None  # (perm, inv_perm) of the forward being run or traced
    generation: int = -1  # the tracker's generation this state's stats and fits belong to
    plans: dict = field(default_factory=dict)  # the attention plan of each call shape (layers share them)
    variants: dict = field(default_factory=dict)  # (covariance_aware, scale) -> settings (see settings_for)
    processors: tuple = ()  # (module, its PISA processor) of each managed layer, in layer order
    replaced: int = 0  # how many of them had another processor when that was last warned about
    capture_owned: bool = False  # applied by an open capture_qkv, which removes it on close

    def __post_init__(self) -> None:
        self.handle = next(_HANDLES)
        _STATES[self.handle] = self

    def __deepcopy__(self, memo):
        # The processors find their state by handle and the undo steps close over this
        # transformer's modules: a copy would run, and remove_pisa would undo, on the original.
        raise TypeError(_NO_COPY)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NO_COPY)

    def check_processors(self) -> None:
        """Warn (once per count) when processors of managed layers were replaced since apply_pisa
        (``fuse_qkv_projections``, ``set_attn_processor``): those layers no longer run PISA."""
        lost = sum(module.processor is not proc for module, proc in self.processors)
        if lost and lost != self.replaced:
            warnings.warn(f"PISA runs on {len(self.processors) - lost} of the {len(self.processors)} attention layers "
                          f"it manages in {type(self.transformer).__name__}: the processors of {lost} were replaced "
                          "after apply_pisa (fuse_qkv_projections, set_attn_processor). Call remove_pisa before "
                          "such a change and apply_pisa after it", RuntimeWarning, stacklevel=2)
        self.replaced = lost

    def new_generation(self) -> None:
        """Forget the stats and the fits of the last generation."""
        self.generation = self.tracker.generation
        self.stats.clear()
        if self.calibrator is not None:
            self.calibrator.reset()

    def catch_up(self) -> None:
        """Start the tracker's generation if this transformer has not yet: its first call does, and so
        does a read of its stats or fits (Wan2.2's second expert is not called before the first's
        steps are done, and its numbers until then are the last generation's)."""
        if self.generation != self.tracker.generation:
            self.new_generation()

    def alpha_for(self, layer: int, freeze: bool = True):
        """The first-order weight of managed layer ``layer``: its calibrated weights (``freeze``:
        fitting them now if this generation has not yet; a sparse call needs them), else its
        loaded ones, else the configured ``alpha``. A CPU tensor, a float, or None (the default /
        no first-order term). Never a device read."""
        if self.config.mode not in spec.FIRST_ORDER_MODES:
            return None
        cal = self.calibrator
        if cal is not None:
            fitted = cal.freeze() if freeze else cal.frozen
            if fitted is not None and layer in fitted:
                return fitted[layer]
        if layer in self.alphas:
            return self.alphas[layer]
        a = self.config.alpha
        return torch.tensor(a, dtype=torch.float64) if isinstance(a, tuple) else a

    def covariance_for(self, layer: int, freeze: bool = True) -> bool:
        """The selection rule of managed layer ``layer``: the one calibration chose for it (this
        generation's, frozen with the weights), else a loaded table's, else the configured one."""
        cal = self.calibrator
        if cal is not None and self.config.mode in spec.FIRST_ORDER_MODES:
            if freeze:
                cal.freeze()
            if cal.frozen_rules is not None and layer in cal.frozen_rules:
                return cal.frozen_rules[layer]
        return self.rules.get(layer, self.config.covariance_aware)

    def settings_for(self, layer: int, scale: float | None = None) -> PisaSettings:
        """The settings a sparse call of managed layer ``layer`` runs with: the transformer's
        (:attr:`PisaConfig.call_settings`) with the layer's selection rule (:meth:`covariance_for`)
        and, when given, the call's softmax ``scale``. Each variant is made once."""
        s = self.config.call_settings
        cov = self.covariance_for(layer)
        scale = s.scale if scale is None else float(scale)
        if cov == s.covariance_aware and scale == s.scale:
            return s
        key = (cov, scale)
        if key not in self.variants:
            self.variants[key] = s.replace(covariance_aware=cov, scale=scale)
        return self.variants[key]

    def alpha_values(self, layer: int, heads: int) -> tuple[float, ...] | None:
        """:meth:`alpha_for` (without freezing) as ``heads`` floats; None without a first-order term."""
        if self.config.mode not in spec.FIRST_ORDER_MODES:
            return None
        a = self.alpha_for(layer, freeze=False)
        if a is None:
            a = spec.DEFAULT_ALPHA
        if isinstance(a, Tensor):
            values = tuple(float(x) for x in a.reshape(-1).tolist())
            return values * heads if len(values) == 1 else values
        return (float(a),) * heads


_NO_COPY = ("a transformer managed by PISA cannot be deep-copied or pickled (its attention processors and "
            "hooks belong to this instance): call pisa_attn.diffusers.remove_pisa on it first, copy or save it, "
            "then apply_pisa to each model")
_HANDLES = itertools.count(1)
_STATES: weakref.WeakValueDictionary[int, PisaState] = weakref.WeakValueDictionary()


def state_alive(handle: int) -> bool:
    """Whether the state of ``handle`` is applied (not removed by remove_pisa, not collected)."""
    return handle in _STATES


def set_alive(state: PisaState, alive: bool) -> None:
    """Register ``state`` as applied (apply_pisa, a rollback) or not (remove_pisa): processors and
    compiled graphs holding its handle then find it, or know it was removed."""
    if alive:
        _STATES[state.handle] = state
    else:
        _STATES.pop(state.handle, None)


def state_of(handle: int) -> PisaState:
    state = _STATES.get(handle)
    if state is None:
        raise RuntimeError("this PISA state was removed (remove_pisa) after the graph calling it was compiled")
    return state


_RUN: contextvars.ContextVar[Run | None] = contextvars.ContextVar("pisa_run", default=None)


def current_run() -> Run | None:
    return _RUN.get()


def enter_run(run: Run) -> contextvars.Token:
    return _RUN.set(run)


def exit_run(token: contextvars.Token) -> None:
    _RUN.reset(token)


def open_run(run: Run) -> None:
    run.state.runs.append((enter_run(run), run))


def close_run(state: PisaState) -> None:
    """Close ``state``'s innermost run if it is the current one (no-op otherwise)."""
    if state.runs and current_run() is state.runs[-1][1]:
        exit_run(state.runs.pop()[0])


MASKED_BIAS = -1e4
"""An additive mask entry at or below this masks its key (exp(-1e4) is 0 in every float dtype)."""


def key_lengths(mask: Tensor, batch: int, kv_len: int) -> list[int] | None:
    """Valid keys per batch row of a key-padding mask (valid keys first), or None if all are valid.

    Accepts bool masks (True = attend) and additive float masks (0 = attend, -inf = masked) of
    shape [B, Lk] or [B, 1, 1, Lk] (diffusers' key-padding forms). One host read per call.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"attn_mask must be a tensor or None, got {type(mask).__name__}")
    m = mask
    if m.dim() == 4 and m.shape[1] == 1 and m.shape[2] == 1:
        m = m[:, 0, 0]
    if m.dim() != 2 or m.shape[-1] != kv_len or m.shape[0] not in (1, batch):
        raise ValueError(
            f"PISA's attention supports only key-padding attention masks ([B, Lk] or [B, 1, 1, Lk]) on sparse "
            f"calls and on calls observers (capture, telemetry) watch, got shape {tuple(mask.shape)} for {batch} "
            f"rows and {kv_len} keys"
        )
    valid = m if m.dtype == torch.bool else m == 0
    lens = valid.sum(-1)
    prefix = torch.arange(kv_len, device=m.device)[None, :] < lens[:, None]
    # An additive mask's masked entries must mask: -inf or at most MASKED_BIAS (diffusers' -10000 or
    # dtype minimum); a soft bias in between has no key count that expresses it.
    soft = torch.zeros((), dtype=torch.bool, device=m.device) if m.dtype == torch.bool else (
        (m != 0) & (m > MASKED_BIAS)).any()
    *lens_list, ok, is_soft = torch.cat([lens, (prefix == valid).all()[None], soft[None]]).tolist()  # one read
    if is_soft:
        raise ValueError(
            "attention_mask holds additive biases other than 0 (attend) and -inf or <= -1e4 (masked): PISA's "
            "sparse calls honour key-padding masks only (the kernel reads a key count per row, not a bias)"
        )
    if not ok:
        raise ValueError(
            "PISA's attention supports attention masks whose valid keys form a prefix of each row in the order "
            "PISA runs the tokens in (after its token tiling when apply_pisa manages the model): the sparse kernel "
            "reads a key count per row, not a mask"
        )
    lens_list = lens_list * batch if len(lens_list) == 1 else lens_list
    if min(lens_list) < 1:
        raise ValueError("attention mask leaves a row with no valid key")
    return None if min(lens_list) == kv_len else lens_list
