"""The Hopper backend of the stage contract: the Triton prepare and select, and the Gluon pair
kernel (:mod:`.attention`) for attend. Inference only.

It runs on sm_90 GPUs (H100, H200) with a Triton that ships Gluon (3.6 or newer), for float16 /
bfloat16, head dims 64 and 128 and 64-token blocks; ``backend="auto"`` prefers it there.

``LOWP_BACKENDS`` (``"hopper_fp8"``, ``"hopper_int8_fp8"``, ``"hopper_int8_int8"``,
``"hopper_int8"``: what ``precision="fp8"``, ``"int8-fp8"``, ``"int8-int8"``, ``"int8"`` run)
share select and attend with the low-precision pair kernel (:mod:`.fp8`); their prepare also
writes the quantised copies of K (and V) (:mod:`pisa_attn.ops.triton.quantize`), the values'
``|v|`` maximum taken from the statistics' own read of V.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from ..._log import log_once
from ...spec import PRODUCT_FORMATS
from .. import fused as _fused
from ..selection import Selection, check_selection
from ..stages import Backend
from ..triton import attention as _tattn
from ..triton import op as _top
from ..triton import quantize as _quant
from . import attention as _gattn
from . import fp8 as _fp8

HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64,)


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unsupported_reason(q: Tensor, mode: str, block_size: int) -> str | None:
    """None when the pair kernel handles this call (``q`` a ``[B, H, L, D]`` view), else why not."""
    reason = _top.unsupported_reason(q, mode, block_size)
    if reason is not None:
        return reason
    if not q.is_cuda:
        return "the Hopper kernel runs on CUDA tensors only (no interpreter)"
    idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if _capability(idx) != (9, 0):
        return f"the GPU is sm_{''.join(map(str, _capability(idx)))}, the Hopper kernel is built for sm_90"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (the Hopper kernel is built for head dims {HEAD_DIMS})"
    if block_size not in BLOCK_SIZES:
        return f"block_size {block_size} (the Hopper kernel is built for block sizes {BLOCK_SIZES})"
    return None


def _tma_named(reason: str, **tensors: Tensor) -> str:
    """``reason`` (:func:`pisa_attn.ops.hopper.attention.tma_unsupported_reason` of ``tensors``)
    prefixed with the name of the first tensor TMA cannot read, so the message names the argument."""
    name = next((n for n, x in tensors.items() if _gattn.tma_unsupported_reason(x) is not None), None)
    return reason if name is None else f"{name}: {reason}"


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    stats: _top.Stats,
    selection: Selection,
    *,
    mode: str,
    scale: float,
    block_size: int,
    n_select: int | None = None,
    out_dtype: torch.dtype | None = None,
    alpha: Tensor | None = None,
    out: Tensor | None = None,
    lse: Tensor | None = None,
    ws: _top.Workspace | None = None,
) -> tuple[Tensor, Tensor]:
    """The pair kernel under ``selection``: (out in ``out_dtype``, default q's, lse fp32).

    The pair kernel reads q, k, v through TMA and writes an output of q's dtype; a call it cannot
    serve that way (a float32 partial, a head dim that is not contiguous or a stride that is not a
    multiple of 16 bytes) runs the Triton kernel, which computes the same function.
    ``out``/``lse``: buffers to write into; ``ws``: the plan's workspace (its pair stream buffers).
    """
    # the pair kernel indexes the selection by q's and k's block shapes, as the Triton kernel does
    check_selection(selection, q.shape[0], q.shape[1], -(-q.shape[2] // block_size), -(-k.shape[2] // block_size),
                    q.device, contiguous=True)
    if out is None:
        out = _tattn._alloc_like_layout(q, out_dtype)
    tma = _gattn.tma_unsupported_reason(q, k, v, out)
    if tma is not None:
        tma = _tma_named(tma, q=q, k=k, v=v, out=out)
        log_once(f"pisa_attn hopper backend: the Triton attention kernel (the same function, slower) runs a call "
                 f"the Hopper kernel cannot read through TMA ({tma}); pass contiguous q/k/v/out to run the Hopper "
                 "kernel", logging.WARNING)
    # the pair kernel stores the tile in q's dtype: a buffer of another (a float32 partial) is the Triton kernel's
    if (out_dtype not in (None, q.dtype)) or out.dtype != q.dtype or tma is not None:
        return _top.attend(q, k, v, stats, selection, mode=mode, scale=scale, block_size=block_size,
                           n_select=n_select, out_dtype=out_dtype, alpha=alpha, out=out, lse=lse)
    # the kernel checks the workspace's stream buffers against the launch's shapes
    pairs = None if ws is None else ws.pairs
    return _gattn.attention(q, k, v, *stats.tail(), *selection, mode=mode, scale=scale, block_size=block_size,
                            n_select=selection.idx.shape[-1] if n_select is None else n_select, out=out, lse=lse,
                            alpha=alpha, pairs=pairs, kbound=stats.kbound, kmax=getattr(stats, "kmax", None))


def prepare(q: Tensor, k: Tensor, v: Tensor, block_size: int, *, with_kmax: bool | None = None,
            **kwargs) -> _top.Stats:
    """The Triton prepare, with the keys' per-channel maxima where the pair kernel's exact loop
    fixes its maximum from them (``with_kmax=None``: :func:`pisa_attn.ops.hopper.attention.uses_kmax`
    for ``k``'s length)."""
    if with_kmax is None:
        with_kmax = _gattn.uses_kmax(k.dtype, k.shape[2])
    return _top.prepare(q, k, v, block_size, with_kmax=with_kmax, **kwargs)


def shard_prepare(dtype: torch.dtype, lengths: list[int]) -> dict:
    """prepare's keywords on every rank of a sharded sequence: the keys' maxima on every rank when
    the exact loop reads them for any shard (the kernel reads them for its own shard's length
    only), so the ranks' statistics have the same fields."""
    return dict(with_kmax=any(_gattn.uses_kmax(dtype, n) for n in lengths))


def workspace(plan, q: Tensor, k: Tensor) -> _top.Workspace:
    """The Triton backend's workspace plus the stream buffers of the kernel's query group (and room
    for the keys' maxima its exact loop reads)."""
    return _top.workspace(plan, q, k, pairs=_gattn.query_group_for(plan.mode, k.shape[2], plan.block_size),
                          kmax=_gattn.uses_kmax(k.dtype, k.shape[2]))


def forward(q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None, n_keep_max: int | None = None,
            alpha: Tensor | None = None):
    """One call on one device (through the registered op when traced): (out, lse)."""
    return _fused.forward(BACKEND, q, k, v, plan, keep, n_keep_max, alpha)


BACKEND = _fused.register(
    Backend("hopper", prepare, _top.select, attend, _top.deviation, forward, unsupported_reason,
            _top.score_scratch, workspace, shard_prepare))


# --------------------------------------------- precision="fp8", "int8-fp8", "int8-int8", "int8"
def fp8_unsupported_reason(q: Tensor, mode: str, block_size: int) -> str | None:
    """None when the low-precision pair kernel handles this call, else why not."""
    if mode == "first":  # not the input kernels' reason: that one sends the call to the reference
        return "mode='first' has no low-precision kernel: use 'hybrid', 'zeroth' or 'drop', or precision='input'"
    reason = unsupported_reason(q, mode, block_size)
    if reason is None and q.shape[-1] not in _fp8.HEAD_DIMS:
        reason = f"head dim {q.shape[-1]} (the low-precision kernel is built for head dims {_fp8.HEAD_DIMS})"
    return reason


def attend_lowp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    stats: _top.Stats,
    selection: Selection,
    *,
    mode: str,
    scale: float,
    block_size: int,
    n_select: int | None = None,
    out_dtype: torch.dtype | None = None,
    alpha: Tensor | None = None,
    out: Tensor | None = None,
    lse: Tensor | None = None,
    ws: _top.Workspace | None = None,
    precision: str = "fp8",
) -> tuple[Tensor, Tensor]:
    """The low-precision pair kernel under ``selection``: (out in q's dtype, lse fp32). It reads the
    quantised copies of k (and v) that ``prepare(..., quant=precision)`` wrote (``stats.quant``);
    statistics without them (another prepare, a shard's) are quantised here
    (:func:`pisa_attn.ops.triton.quantize.quantize`). There is no other low-precision kernel to
    run a call this one cannot serve: such a call is a ValueError naming ``precision``."""
    del n_select
    # the kernel indexes the selection by q's and k's block shapes, as the input kernel does
    check_selection(selection, q.shape[0], q.shape[1], -(-q.shape[2] // block_size), -(-k.shape[2] // block_size),
                    q.device, contiguous=True)
    if out is None:
        out = _tattn._alloc_like_layout(q, out_dtype)
    if out_dtype not in (None, q.dtype):
        raise ValueError(f"precision={precision!r} writes the output in q's dtype ({q.dtype}), not {out_dtype} "
                         "(a float32 partial for a sharded call is not supported in low precision)")
    if out.dtype != q.dtype:
        raise ValueError(f"out: precision={precision!r} writes the output in q's dtype ({q.dtype}), got a {out.dtype} "
                         "buffer")
    v_in = PRODUCT_FORMATS[precision][1] == "input"  # P·V reads v itself through TMA
    reason = _gattn.tma_unsupported_reason(q, out) if not v_in else _gattn.tma_unsupported_reason(q, v, out)
    if reason is not None:
        reason = _tma_named(reason, q=q, v=v, out=out) if v_in else _tma_named(reason, q=q, out=out)
        raise ValueError(f"precision={precision!r} needs q{', v' if v_in else ''} and out readable through TMA: "
                         f"{reason}")
    quant = getattr(stats, "quant", None)
    if quant is None:
        quant = _quant.quantize(k, v, stats.kbar, stats.kscale, block_size, precision=precision)
    else:
        _quant.checked(quant, k, block_size, precision, "stats.quant")
    # the kernel checks the workspace's stream buffers against the launch's shapes
    pairs = None if ws is None else ws.pairs
    return _fp8.attention(q, quant, *stats.tail(), *selection, mode=mode, scale=scale, block_size=block_size,
                          lk=k.shape[2], out=out, lse=lse, alpha=alpha, pairs=pairs, v=v if v_in else None,
                          kbound=stats.kbound)


def _lowp_backend(precision: str, name: str) -> Backend:
    """The Hopper backend whose attend runs the exact blocks in ``precision``; its prepare also
    writes the quantised copies of K (and V) the attend reads (``stats.quant``)."""

    def prepare_p(q: Tensor, k: Tensor, v: Tensor, block_size: int, **kwargs):
        return _top.prepare(q, k, v, block_size, quant=precision, **kwargs)

    def attend_p(*args, **kwargs):
        return attend_lowp(*args, precision=precision, **kwargs)

    def workspace_p(plan, q: Tensor, k: Tensor) -> _top.Workspace:
        return _top.workspace(plan, q, k, pairs=_fp8.query_group_for(plan.mode, k.shape[2], plan.block_size, precision),
                              quant=precision)

    def forward_p(q: Tensor, k: Tensor, v: Tensor, plan, keep: Tensor | None = None, n_keep_max: int | None = None,
                  alpha: Tensor | None = None):
        return _fused.forward(be, q, k, v, plan, keep, n_keep_max, alpha)

    be = _fused.register(Backend(name, prepare_p, _top.select, attend_p, _top.deviation, forward_p,
                                 fp8_unsupported_reason, _top.score_scratch, workspace_p))
    return be


# precision -> backend (the names pisa_attn.attention.LOWP_BACKENDS gives them)
LOWP_BACKENDS = {n: _lowp_backend(p, n) for p, n in
                 (("fp8", "hopper_fp8"), ("int8-fp8", "hopper_int8_fp8"), ("int8-int8", "hopper_int8_int8"),
                  ("int8", "hopper_int8"))}
FP8_BACKEND = LOWP_BACKENDS["hopper_fp8"]
