"""The weight ``alpha`` of PISA's first-order tail term: checks, and the ``[H]`` tensor kernels read.

PISA's output is ``exact + zeroth-order tail + alpha · first-order term`` per query head (the
term only enters the numerator, so the output is affine in ``alpha``; see
:mod:`pisa_attn.calibration`). ``alpha = 1`` is the paper, ``0`` is zeroth order.

A kernel reads one float per query head from a ``[H]`` tensor, so a new value never recompiles
anything and a call stays capturable in a CUDA graph. Values given on the host (a number, or a CPU
tensor) are checked there for free and live on the device once per (device, dtype, values): no
copy and no host synchronisation after the first call with them. A tensor on the device is used as
it is; checking its values costs one host read (skipped while compiling or capturing). A tensor
that requires grad (with autograd enabled) is used itself, so the weight is differentiated.
"""

from __future__ import annotations


import torch
from torch import Tensor

from . import spec
from .settings import as_float

# key -> (tensor, its version counter when cached): a caller may change a returned tensor in place
_CACHE: dict[tuple, tuple[Tensor, int]] = {}
_CACHE_LIMIT = 1024


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _indexed(device: torch.device) -> torch.device:
    """``device`` with the index a tensor made on it gets: an accelerator device without one
    means the current device of its type, which ``set_device`` changes between calls."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    if acc is not None and getattr(acc.current_accelerator(), "type", None) == device.type:
        return torch.device(device.type, acc.current_device_index())
    return device


def host_values(alpha, heads: int) -> tuple[float, ...] | None:
    """``alpha`` (a number, numpy's included; a sequence or a CPU tensor of one value or one per
    head) as ``heads`` checked floats; None for a tensor on another device (its values are not
    read here). ValueError/TypeError naming ``alpha``."""
    if isinstance(alpha, Tensor):
        check_tensor_shape(alpha, heads)
        if alpha.device.type != "cpu":
            return None
        values = tuple(float(x) for x in alpha.reshape(-1).tolist())
    elif isinstance(alpha, (list, tuple)):  # as PisaSettings takes it
        values = tuple(as_float("alpha", x, "a float or a sequence of floats (one per query head)") for x in alpha)
        if len(values) not in (1, heads):
            raise ValueError(f"alpha must be a float or hold {heads} values (one per query head), got {len(values)}")
    else:
        values = (as_float("alpha", alpha, "None, a float, a sequence of floats or a tensor of one value per "
                           "query head"),)
    values = values * heads if len(values) == 1 else values
    spec.check_alpha_values(values, alpha)
    return values


def check_tensor_shape(alpha: Tensor, heads: int) -> None:
    if not alpha.is_floating_point():
        raise TypeError(f"alpha must be a floating tensor, got dtype {alpha.dtype}")
    # [1] broadcasts as a float does (PisaSettings keeps a one-value tensor that way)
    if not (alpha.dim() == 0 or (alpha.dim() == 1 and alpha.numel() in (1, heads))):
        raise ValueError(f"alpha must be a float or have shape [{heads}] (one value per query head), got shape "
                         f"{tuple(alpha.shape)}")


def check(alpha, mode: str, heads: int) -> None:
    """The host-side checks of :func:`resolve` alone (no tensor is made)."""
    if alpha is None:
        return
    if mode not in spec.FIRST_ORDER_MODES:
        raise ValueError(f"alpha weights the first-order tail term, which mode {mode!r} does not have "
                         f"(modes with one: {spec.FIRST_ORDER_MODES}); pass alpha=None")
    if isinstance(alpha, Tensor) and torch.compiler.is_compiling():
        check_tensor_shape(alpha, heads)  # no host read of its values inside a graph
    else:
        host_values(alpha, heads)


def resolve(alpha, *, mode: str, heads: int, device, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """The ``[heads]`` weight tensor on ``device`` a call of ``mode`` passes to the kernels, or None
    for a mode without a first-order term. ``alpha=None`` means :data:`pisa_attn.spec.DEFAULT_ALPHA`.

    ValueError/TypeError naming ``alpha`` for a non-finite value, a shape other than a scalar or
    ``[heads]``, a device other than the CPU or ``device``, or any ``alpha`` in a mode without a
    first-order term (``"zeroth"``, ``"drop"``).
    """
    device = torch.device(device)
    spec.check_mode(mode)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if mode not in spec.FIRST_ORDER_MODES:
        check(alpha, mode, heads)
        return None
    if alpha is None:
        alpha = spec.DEFAULT_ALPHA
    if torch.compiler.is_compiling():  # traced: build it in the graph (shapes checked, values not read)
        if isinstance(alpha, Tensor):
            check_tensor_shape(alpha, heads)
            return alpha.to(device=device, dtype=dtype).reshape(-1).expand(heads).contiguous()
        return torch.tensor(host_values(alpha, heads), dtype=dtype, device=device)
    values = host_values(alpha, heads)
    if isinstance(alpha, Tensor) and alpha.requires_grad and torch.is_grad_enabled():
        # differentiated (the reference backend; the kernels refuse it): the tensor itself, not its values
        if alpha.device.type != "cpu" and alpha.device != device:
            raise ValueError(f"alpha must be on the CPU or on q's device ({device}), got {alpha.device}")
        return alpha.to(device=device, dtype=dtype).reshape(-1).expand(heads)
    if values is None:  # a tensor on a device
        if alpha.device != device:
            raise ValueError(f"alpha must be on the CPU or on q's device ({device}), got {alpha.device}")
        if not _capturing(device) and not bool((alpha.abs() <= spec.ALPHA_LIMIT).all()):  # NaN fails too
            raise ValueError(f"alpha must be finite and within ±{spec.ALPHA_LIMIT:g}, got a tensor with values "
                             "outside")
        return alpha.to(dtype).reshape(-1).expand(heads).contiguous()
    return weights(values, device, dtype)


def weights(values: tuple[float, ...], device, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``[len(values)]`` tensor of ``values`` on ``device``, made once and cached (not cached
    when first asked for during CUDA-graph capture: its contents exist only in the graph). A
    cached tensor changed in place since (its version counter moved) is made again."""
    device = _indexed(torch.device(device))
    key = (device, dtype, values)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]._version == hit[1]:
        return hit[0]
    capturing = _capturing(device)
    # A normal tensor even under inference_mode: the cache outlives the mode, and an inference
    # tensor cannot be saved for backward by a later differentiated call with the same weight.
    with torch.inference_mode(False):
        if len(set(values)) <= 1:
            out = torch.full((len(values),), values[0] if values else 0.0, dtype=dtype, device=device)
        elif capturing:  # no host-to-device copy inside a capture: one fill per head
            out = torch.empty(len(values), dtype=dtype, device=device)
            for i, x in enumerate(values):
                out[i].fill_(x)
        else:
            out = torch.tensor(values, dtype=dtype).to(device)
    if not capturing:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = (out, out._version)
    return out


def ones(heads: int, device, dtype: torch.dtype = torch.float32) -> Tensor:
    """Weight 1 for every head: the term as the paper writes it (what a stage called without
    ``alpha`` computes)."""
    return weights((1.0,) * heads, device, dtype)
