"""One frozen, validated object holding every setting of a PISA call: :class:`PisaSettings`.

Made once (validated in ``__post_init__``, ValueError/TypeError naming the field), hashable, so it
keys plan caches. Every entry point (``pisa_attention``, :func:`pisa_attn.plan`, ring, Ulysses,
Ulysses x ring, the diffusers integration) takes one. Data that changes per call (``keep_blocks``,
a device tensor of per-head weights) is passed to the call, not kept here.

numpy scalars are accepted wherever their Python equivalents are (``np.int64`` block sizes,
``np.float32`` densities and scales, ``np.bool_`` flags) and stored as Python values.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch

from . import spec

LAYOUTS = ("bhsd", "bshd")
BACKENDS = ("auto", "hopper", "triton", "reference")


def _type_name(x) -> str:
    return type(x).__name__


_is_numpy_bool = spec.is_numpy_bool


def as_bool(name: str, x) -> bool:
    """A real boolean (or numpy's): a truthy string such as ``"no"`` or the int 1 is an error."""
    if isinstance(x, bool):
        return x
    if _is_numpy_bool(x):
        return bool(x)
    raise TypeError(f"{name} must be True or False, got {x!r} ({_type_name(x)})")


def as_int(name: str, x, what: str) -> int:
    """An integer (Python or numpy), not a bool, not a float; TypeError naming ``name`` otherwise."""
    if spec.is_int(x):
        return int(x)
    raise TypeError(f"{name} must be {what}, got {x!r} ({_type_name(x)})")


def as_float(name: str, x, what: str) -> float:
    """A real number (Python or numpy int/float), not a bool or a tensor; TypeError naming ``name``
    (ValueError for an int too large for a float). A numpy float narrower than 64 bits is read as
    the decimal it prints as (:func:`pisa_attn.spec.decimal_value`)."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool) and not _is_numpy_bool(x):
        try:
            return float(spec.decimal_value(x))
        except OverflowError:
            raise ValueError(f"{name} must be {what}, got an int too large for a float") from None
    raise TypeError(f"{name} must be {what}, got {x!r} ({_type_name(x)})")


def normalize_alpha(alpha, mode: str):
    """``alpha`` as a settings field holds it: None, a float, or a tuple of floats (one per query
    head). Numbers (numpy included), sequences of numbers and CPU tensors are accepted; a tensor
    on another device or one that requires grad is per-call data (``run(..., alpha=)``)."""
    if alpha is None:
        return None
    if mode not in spec.FIRST_ORDER_MODES:
        raise ValueError(f"alpha weights the first-order tail term, which mode {mode!r} does not have "
                         f"(modes with one: {spec.FIRST_ORDER_MODES}); pass alpha=None")
    if isinstance(alpha, torch.Tensor):
        if not alpha.is_floating_point():
            raise TypeError(f"alpha must be a floating tensor, got dtype {alpha.dtype}")
        if alpha.device.type != "cpu" or alpha.requires_grad:
            why = "requires grad" if alpha.requires_grad else f"is on {alpha.device}"
            raise TypeError(f"alpha in PisaSettings is a host value (float or per-head floats); this tensor {why}: "
                            "pass it per call instead (run(..., alpha=tensor) or pisa_attention(..., alpha=tensor))")
        if alpha.dim() > 1:
            raise ValueError(f"alpha must be a float or have shape [H] (one value per query head), got shape "
                             f"{tuple(alpha.shape)}")
        values = tuple(float(x) for x in alpha.reshape(-1).tolist())
        if not values:
            raise ValueError("alpha must not be an empty tensor (one value per query head)")
        value = values[0] if alpha.dim() == 0 else values
    elif isinstance(alpha, (list, tuple)):
        value = tuple(as_float("alpha", x, "a float or a sequence of floats (one per query head)") for x in alpha)
        if not value:
            raise ValueError("alpha must not be an empty sequence (one value per query head)")
    else:
        value = as_float("alpha", alpha, "None, a float or one float per query head")
    values = value if isinstance(value, tuple) else (value,)
    spec.check_alpha_values(values, alpha)
    return value


@dataclass(frozen=True)
class PisaSettings:
    """Every setting of a PISA call, validated once; hashable (keys plan caches).

    Attributes:
        density: fraction of key blocks computed exactly, in (0, 1]: ``k = max(1, density · N)``
            rounded half up (:func:`pisa_attn.spec.num_selected`). ``1.0`` is dense attention.
        mode: ``"hybrid"`` (the paper's method), ``"zeroth"``, ``"first"`` (exact block-wise first
            order; reference only) or ``"drop"`` (keep-or-drop block sparse).
        alpha: weight of the first-order tail term (``hybrid``, ``first``): None (means
            :data:`pisa_attn.spec.DEFAULT_ALPHA`), a float, or one float per query head (a tuple;
            a list or a CPU tensor is converted). Must be None in ``zeroth`` and ``drop``.
        block_size: tokens per query and key block (a power of two >= 16).
        query_block: tokens per selection row: None (= ``block_size``) or 2 or 4 times ``block_size``.
        covariance_aware: add ``log(||H_j - H̄||_F + eps)`` to the selection scores (paper eq. 9).
        scale: softmax scale; None means ``1 / sqrt(D)``.
        backend: ``"auto"``, ``"hopper"``, ``"triton"`` or ``"reference"``.
        layout: ``"bhsd"`` (``[B, H, L, D]``) or ``"bshd"`` (``[B, L, H, D]``) for q, k, v and out.
        precision: ``"input"`` (the exact blocks in the input dtype), or on the Hopper kernel
            ``"fp8"`` (their products in FP8 e4m3), ``"int8-fp8"`` (Q·Kᵀ in INT8, P·V in e4m3),
            ``"int8-int8"`` (both in INT8) or ``"int8"`` (Q·Kᵀ in INT8, P·V in the input dtype);
            :data:`pisa_attn.spec.PRECISIONS`.
    """

    density: float = 0.125
    mode: str = "hybrid"
    alpha: float | tuple[float, ...] | None = None
    block_size: int = 64
    query_block: int | None = None
    covariance_aware: bool = spec.DEFAULT_COVARIANCE_AWARE
    scale: float | None = None
    backend: str = "auto"
    layout: str = "bhsd"
    precision: str = "input"

    def __post_init__(self):
        put = object.__setattr__  # frozen: normalised values are written once, here
        if not isinstance(self.mode, str) or self.mode not in spec.MODES:
            raise ValueError(f"mode must be one of {spec.MODES}, got {self.mode!r}")
        put(self, "mode", str(self.mode))  # a numpy string (np.str_) as the str it equals
        put(self, "density", as_float("density", self.density, "a float in (0, 1]"))
        spec.check_density(self.density)
        bs = self.block_size
        if not spec.is_int(bs):
            raise ValueError(f"block_size must be a power of two >= {spec.MIN_BLOCK_SIZE} (an int), got {bs!r} "
                             f"({_type_name(bs)})")
        bs = int(bs)
        spec.check_block_size(bs)
        put(self, "block_size", bs)
        if self.query_block is not None:
            qb = self.query_block
            if not spec.is_int(qb):
                raise ValueError(f"query_block must be None or an int multiple of block_size, got {qb!r} "
                                 f"({_type_name(qb)})")
            put(self, "query_block", int(qb))
        spec.query_block_factor(self.query_block, self.block_size)
        put(self, "covariance_aware", as_bool("covariance_aware", self.covariance_aware))
        if self.scale is not None:
            if isinstance(self.scale, bool) or not isinstance(self.scale, numbers.Real) or _is_numpy_bool(self.scale):
                raise ValueError(f"scale must be None or a positive finite float, got {self.scale!r} "
                                 f"({_type_name(self.scale)})")
            spec.check_scale(self.scale)
            put(self, "scale", as_float("scale", self.scale, "None or a positive finite float"))
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.layout, str) or self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        put(self, "alpha", normalize_alpha(self.alpha, self.mode))
        spec.check_precision(self.precision)
        for name in ("backend", "layout", "precision"):
            put(self, name, str(getattr(self, name)))
        if self.precision != "input" and self.backend not in ("auto", "hopper"):
            raise ValueError(f"precision={self.precision!r} runs on the hopper backend only, "
                             f"got backend={self.backend!r}")

    # ---------------------------------------------------------------- derived facts
    @property
    def query_factor(self) -> int:
        """Query blocks per selection row (``query_block / block_size``; 1 by default)."""
        return 1 if self.query_block is None else self.query_block // self.block_size

    def alpha_values(self, heads: int) -> tuple[float, ...] | None:
        """The first-order weight of each of ``heads`` query heads (DEFAULT_ALPHA when unset), or
        None in a mode without a first-order term. ValueError when per-head values do not number
        ``heads``."""
        if self.mode not in spec.FIRST_ORDER_MODES:
            return None
        a = spec.DEFAULT_ALPHA if self.alpha is None else self.alpha
        if isinstance(a, tuple):
            if len(a) == 1:
                return a * heads
            if len(a) != heads:
                raise ValueError(f"alpha has {len(a)} values but the call has {heads} query heads "
                                 "(one value per query head)")
            return a
        return (a,) * heads

    def replace(self, **changes) -> "PisaSettings":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


class _Unpassed:
    """An entry point's default for a loose settings keyword: equal to the value (so a signature
    shows it), told apart from the same value passed by the caller by its type."""

    __slots__ = ()


class _UnpassedFloat(float, _Unpassed):
    __slots__ = ()


class _UnpassedInt(int, _Unpassed):
    __slots__ = ()


class _UnpassedStr(str, _Unpassed):
    __slots__ = ()


_MARK = {float: _UnpassedFloat, int: _UnpassedInt, str: _UnpassedStr}
UNPASSED = {f.name: _MARK[type(f.default)](f.default) for f in dataclasses.fields(PisaSettings)
            if type(f.default) in _MARK}
"""The defaults of the loose settings keywords of ``pisa_attention`` and the context-parallel
functions (``density``, ``block_size``, ``mode``, ``backend``, ``layout``, ``precision``);
``covariance_aware``, ``scale`` and ``query_block`` default to None there (the settings'
default). With ``settings=``, any other value of one of them is an error, even one equal to the
default: the caller passed it, and ``settings`` would silently win."""


def _passed(name: str, v) -> bool:
    # None stands for "not passed" only where None is the keyword's own default; ``layout=None``
    # or ``density=None`` is a value, and PisaSettings refuses it (never the default in silence).
    if isinstance(v, _Unpassed):
        return False
    return v is not None or name in UNPASSED


def from_loose(**loose) -> PisaSettings:
    """The settings of an entry point's loose keywords (the defaults for those not passed)."""
    return PisaSettings(**{n: v for n, v in loose.items() if _passed(n, v)})


def check_not_both(**loose) -> None:
    """ValueError when an entry point got ``settings=`` and also loose settings arguments (one
    would silently win)."""
    given = sorted(n for n, v in loose.items() if _passed(n, v))
    if given:
        raise ValueError(f"pass the settings either as settings= or as keyword arguments, not both "
                         f"(got settings= and {', '.join(given)})")
