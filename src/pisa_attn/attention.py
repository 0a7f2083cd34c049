"""Public entry point: validation, layout handling and backend dispatch for PISA attention.

``pisa_attention`` = :func:`validate` -> :func:`make_plan` (shape-only) -> :func:`run`, which is
prepare -> select -> attend of the chosen backend (:mod:`pisa_attn.ops.stages`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from . import spec, tail_weight
from .ops.stages import Backend

log = logging.getLogger("pisa_attn")

LAYOUTS = ("bhsd", "bshd")
BACKENDS = ("auto", "hopper", "triton", "reference")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
INFERENCE_ONLY = ("hopper", "triton")  # backends whose kernels have no backward

_logged: set[str] = set()


def _log_once(msg: str, level: int = logging.INFO) -> None:
    if msg not in _logged:
        _logged.add(msg)
        log.log(level, msg)


@dataclass(frozen=True)
class PisaPlan:
    """Shape-only facts of one call (cheap, no device work): what :func:`pisa_attention` will run.

    Everything data-dependent (statistics, selection, attention) happens in the run step, which
    issues no host synchronisation, so a call can be captured in a CUDA graph.
    """

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    block_size: int
    n_q_blocks: int
    n_kv_blocks: int
    n_select: int
    mode: str
    covariance_aware: bool
    scale: float
    query_block: int  # tokens per selection row (block_size: the paper's per-block selection)
    backend: str  # "hopper", "triton" or "reference": what actually runs


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have rank 4 ([B, H, L, D] or [B, L, H, D]), got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {x.dtype}")


def validate(q, k, v, *, density, block_size, mode, scale=None, layout="bhsd", backend="auto",
             covariance_aware=False, return_lse=False, query_block=None, alpha=None) -> tuple[Tensor, Tensor, Tensor]:
    """Check a call's tensors and settings (ValueError/TypeError naming the argument); return
    ``q, k, v`` as ``[B, H, L, D]`` views. ``keep_blocks`` is checked by :func:`normalize_keep_blocks`,
    which needs the block count."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    spec.check_mode(mode)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not (k.dtype == q.dtype and v.dtype == q.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (k.device == q.device and v.device == q.device):
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    spec.check_settings(density=density, block_size=block_size, mode=mode, covariance_aware=covariance_aware,
                        scale=scale, query_block=query_block)
    spec.check_flag("return_lse", return_lse)
    qh, kh, vh = (to_bhsd(x, layout) for x in (q, k, v))
    _validate_shapes(qh, kh, vh)
    tail_weight.check(alpha, mode, qh.shape[1])
    return qh, kh, vh


def to_bhsd(x: Tensor, layout: str) -> Tensor:
    """``[B, H, L, D]`` view of a ``layout`` tensor (a view: kernels read strides); its own inverse."""
    return x if layout == "bhsd" else x.transpose(1, 2)


def _validate_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    b, h, lq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    bk, hk, lk, dk = k.shape
    if bk != b:
        raise ValueError(f"batch size of k/v ({bk}) must equal that of q ({b})")
    if dk != d:
        raise ValueError(f"head dim of k/v ({dk}) must equal that of q ({d})")
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM):
        raise ValueError(f"head dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d}")
    if hk < 1 or h % hk:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk}) (GQA)")
    if lq < 1 or lk < 1 or b < 1:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")


def normalize_keep_blocks(keep_blocks, batch: int, heads: int, n_kv_blocks: int, device) -> tuple[Tensor | None, int]:
    """Validate ``keep_blocks``; return it as bool [B|1, H|1, Nk] on ``device`` and the largest
    number of kept blocks in any row (read on the host: free for a CPU mask, one sync otherwise)."""
    if keep_blocks is None:
        return None, 0
    if not isinstance(keep_blocks, Tensor):
        raise TypeError(f"keep_blocks must be a bool tensor or None, got {type(keep_blocks).__name__}")
    if keep_blocks.dtype != torch.bool:
        raise TypeError(f"keep_blocks must have dtype torch.bool, got {keep_blocks.dtype}")
    if keep_blocks.device != device and keep_blocks.device.type != "cpu":
        raise ValueError(f"keep_blocks must be on the CPU or on q's device ({device}), got {keep_blocks.device}")
    shape = tuple(keep_blocks.shape)
    ok = (len(shape) == 1 and shape[0] == n_kv_blocks) or (
        len(shape) == 3 and shape[0] in (1, batch) and shape[1] in (1, heads) and shape[2] == n_kv_blocks
    )
    if not ok:
        raise ValueError(
            f"keep_blocks must have shape [{n_kv_blocks}] or broadcastable [{batch}, {heads}, {n_kv_blocks}] "
            f"(one flag per key block), got {shape}"
        )
    keep = keep_blocks.reshape(1, 1, n_kv_blocks) if len(shape) == 1 else keep_blocks
    if torch.compiler.is_compiling() or (keep.is_cuda and torch.cuda.is_current_stream_capturing()):
        # No host read while tracing or capturing: the static bound (every block) sizes the index list.
        n_keep_max = n_kv_blocks
    else:
        n_keep_max = int(keep.sum(-1).max())
    return keep.to(device, non_blocking=True), n_keep_max


def get_backend(name: str) -> Backend:
    """The stage implementation called ``name`` (``"reference"``, ``"triton"`` or ``"hopper"``);
    ValueError when it cannot be loaded (Triton not installed, or without Gluon for ``"hopper"``)."""
    if name == "reference":
        from .ops import reference

        return reference.BACKEND
    if name == "triton":
        try:
            from .ops.triton import op
        except ImportError as e:  # triton not installed
            raise ValueError(f"the triton backend is unavailable: triton cannot be imported ({e})") from None
        return op.BACKEND
    if name == "hopper":
        try:
            from .ops.gluon import op
        except ImportError as e:  # no triton, or a triton without Gluon
            raise ValueError(f"the hopper backend is unavailable: its Gluon kernel cannot be imported ({e})") from None
        return op.BACKEND
    raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {name!r}")


def _reason(name: str, q: Tensor, mode: str, block_size: int) -> str | None:
    try:
        return get_backend(name).unsupported_reason(q, mode, block_size)
    except ValueError as e:
        return str(e)


def _choose_backend(backend: str, q: Tensor, mode: str, block_size: int) -> str:
    if backend == "reference":
        return "reference"
    if backend in ("triton", "hopper"):
        if backend == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        reason = _reason(backend, q, mode, block_size)
        if reason is not None:
            raise ValueError(f"backend={backend!r} does not support this call: {reason}")
        return backend
    # auto: the Hopper kernel where it runs, else the portable Triton kernels, else PyTorch
    if not q.is_cuda:
        return "reference"
    if _reason("hopper", q, mode, block_size) is None:
        return "hopper"
    reason = _reason("triton", q, mode, block_size)
    if reason is None:
        return "triton"
    _log_once(f"pisa_attention: using the PyTorch reference on CUDA because {reason}", logging.WARNING)
    return "reference"


def _check_inference_only(backend: str, tensors) -> None:
    if backend in INFERENCE_ONLY and torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        raise ValueError(
            f"the {backend} backend is inference-only (its kernels have no backward), but q/k/v require grad: "
            "call under torch.no_grad() / torch.inference_mode(), or pass backend='reference' for gradients"
        )


def pisa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float = 0.125,
    block_size: int = 64,
    mode: str = "hybrid",
    covariance_aware: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    keep_blocks: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    query_block: int | None = None,
    alpha: float | Tensor | None = None,
):
    """Piecewise Sparse Attention: a drop-in for ``F.scaled_dot_product_attention`` in DiTs.

    Every ``block_size`` query block computes its top-``k`` key blocks exactly and approximates the
    remaining (tail) blocks by a Taylor expansion around each block's centroid, inside one online
    softmax (paper Algorithm 1).

    Args:
        q: ``[B, H, Lq, D]`` (``layout="bhsd"``) or ``[B, Lq, H, D]`` (``layout="bshd"``).
        k, v: ``[B, Hk, Lk, D]`` / ``[B, Lk, Hk, D]``; ``H`` must be a multiple of ``Hk`` (GQA).
            ``Lq`` may differ from ``Lk``; neither needs to be a multiple of ``block_size``.
        density: fraction of key blocks computed exactly, in (0, 1]: ``k = max(1, density · N)``
            rounded half up, ``N = ceil(Lk / block_size)``. ``1.0`` is dense attention.
        block_size: tokens per query and key block (power of two >= 16).
        mode: ``"hybrid"`` (exact + block-wise 0th order + global 1st-order correction weighted
            by ``alpha``: the paper's method), ``"zeroth"`` (no 1st-order term), ``"first"`` (exact
            block-wise 1st order, weighted by ``alpha``; dense cost), ``"drop"`` (keep-or-drop
            block sparse).
        covariance_aware: add ``log(||H_j - H̄||_F + eps)`` to the selection scores (paper eq. 9).
        alpha: weight of the first-order tail term (modes ``"hybrid"`` and ``"first"``): a float,
            or a tensor of one value per query head (``[H]``, on the CPU or on q's device). ``None``
            means :data:`pisa_attn.spec.DEFAULT_ALPHA` (0.75, which beats the full term on real
            attention); ``1.0`` is the paper's method exactly, ``0.0`` equals ``mode="zeroth"``.
            Per-head values fitted against dense attention come from :mod:`pisa_attn.calibration`
            (or ``apply_pisa(..., calibrate=True)``). Not allowed with ``"zeroth"``/``"drop"``.
            A CPU tensor or a number is read on the host and cached on the device (no sync; CUDA
            graph and ``torch.compile`` friendly); a device tensor's values are checked with one
            host read.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        layout: ``"bhsd"`` or ``"bshd"``; the output has ``q``'s layout.
        keep_blocks: optional bool ``[Nk]`` or broadcastable ``[B, H, Nk]``: key blocks always
            computed exactly (text or sink tokens); they do not count against ``k``. May live on
            the CPU (recommended for CUDA graphs: its count is then read without a device sync).
        query_block: tokens per selection row: ``None`` (= ``block_size``, the paper's per-block
            selection) or 2 or 4 times ``block_size``: consecutive query blocks then share one
            pooled selection (faster on the Hopper kernel, which loads shared blocks once; coarser).
        return_lse: also return the log-sum-exp of the (approximated) softmax denominator,
            ``[B, H, Lq]`` float32, natural log of scaled scores (as flash-attn's softmax_lse).
        backend: ``"auto"`` (the Hopper kernel on sm_90 GPUs where it applies, else the Triton
            kernels for supported CUDA inputs, else the reference), ``"hopper"`` (force the
            warp-specialised sm_90 kernel), ``"triton"`` (force the portable kernels; CPU tensors
            need ``TRITON_INTERPRET=1``), ``"reference"`` (force PyTorch).

    Returns:
        ``out`` with the shape and layout of ``q``, or ``(out, lse)`` when ``return_lse``.

    The kernels (hopper, triton) are inference-only: a call that would run them on inputs requiring grad
    (with autograd enabled) raises ValueError; the reference backend is differentiable.
    """
    qh, kh, vh = validate(q, k, v, density=density, block_size=block_size, mode=mode, scale=scale, layout=layout,
                          backend=backend, covariance_aware=covariance_aware, return_lse=return_lse,
                          query_block=query_block, alpha=alpha)
    p = _cached_plan(qh, kh, density, block_size, mode, covariance_aware, scale, backend, query_block)
    _check_inference_only(p.backend, (q, k, v))
    keep, n_keep_max = normalize_keep_blocks(keep_blocks, p.batch, p.heads, p.n_kv_blocks, q.device)
    weights = tail_weight.resolve(alpha, mode=mode, heads=p.heads, device=q.device,
                                  dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    out, lse = run(qh, kh, vh, p, keep, n_keep_max, weights)
    out = to_bhsd(out, layout)
    return (out, lse) if return_lse else out


_PLANS: dict = {}


def _cached_plan(q: Tensor, k: Tensor, *settings) -> PisaPlan:
    """:func:`make_plan` once per shape and settings (a DiT calls the same shapes every layer)."""
    if torch.compiler.is_compiling():  # symbolic shapes: plan while tracing, nothing to cache
        return make_plan(q, k, *settings)
    key = (q.shape, k.shape, q.dtype, q.device, *settings)
    plan = _PLANS.get(key)
    if plan is None:
        plan = make_plan(q, k, *settings)
        if len(_PLANS) >= 256:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def make_plan(q: Tensor, k: Tensor, density, block_size, mode, covariance_aware, scale, backend,
              query_block=None) -> PisaPlan:
    """The cheap, shape-only planning step ([B, H, L, D] inputs, already validated)."""
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    nk = spec.num_blocks(lk, block_size)
    return PisaPlan(
        batch=b,
        heads=h,
        kv_heads=hk,
        q_len=lq,
        kv_len=lk,
        head_dim=d,
        block_size=block_size,
        n_q_blocks=spec.num_blocks(lq, block_size),
        n_kv_blocks=nk,
        n_select=spec.num_selected(float(density), nk),
        mode=mode,
        covariance_aware=bool(covariance_aware),
        scale=float(d**-0.5 if scale is None else scale),
        query_block=block_size * spec.query_block_factor(query_block, block_size),
        backend=_choose_backend(backend, q, mode, block_size),
    )


def run(
    q: Tensor, k: Tensor, v: Tensor, p: PisaPlan, keep: Tensor | None = None, n_keep_max: int = 0,
    alpha: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The run step: the backend's prepare -> select -> attend on [B, H, L, D] views.

    ``keep`` is a bool [B|1, H|1, Nk] on the device of ``q``; ``n_keep_max`` bounds its per-row
    count (it sizes the static index list: at most ``n_select + n_keep_max`` exact blocks).
    ``alpha``: the ``[H]`` weights of the first-order term as :func:`pisa_attn.tail_weight.resolve`
    returns them (None: weight 1, the paper's term). Like ``keep``, data rather than a plan
    setting: the plan stays shape-only and another value never re-plans or recompiles.
    """
    return get_backend(p.backend).forward(q, k, v, p, keep, n_keep_max, alpha)
