"""The public API: :func:`plan` / :func:`run` (FlashInfer-style) and :func:`pisa_attention`.

``plan(q, k, settings)`` makes every shape-only decision once (backend, block counts, the number
of exact blocks, the selection width) and owns a workspace sized for the shape (statistics,
selection, pair stream, log-sum-exp); ``run(plan, q, k, v)`` then checks only that the tensors are
the ones planned for (shapes, dtypes, device) and issues prepare -> select -> attend of the chosen
backend (:mod:`pisa_attn.ops.stages`) into that workspace: no allocation but the output, no host
synchronisation. :func:`pisa_attention` is settings (cached by its keyword arguments) -> a cached
plan -> run.

The hot path: the first checked run of a call signature (shapes, dtypes, devices and strides of
the tensors, which outputs are given or returned) on the kernel backends is recorded, and later
runs with that signature replay its launches with the call's pointers swapped in
(:mod:`pisa_attn.ops.bound`): one tuple lookup, the output's allocation and the launches. A
signature that does not match the plan never finds a recording, so it meets the checks. A CPU
``keep_blocks`` mask is copied to the device once per distinct value and kept in the plan; under
``torch.compile`` the registered op runs on a plan cached by its arguments and replays it too.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import spec, tail_weight
from ._log import log_once
from .lru import LRU
from .ops import fused as _fused
from .ops.selection import Selection, check_keep_blocks, check_selection, keep_row_bound
from .ops.stages import Backend, run_planned
from .settings import BACKENDS, LAYOUTS, PisaSettings, as_bool, as_int, check_not_both, from_loose
from .settings import UNPASSED as _U

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MIN_HEAD_DIM, MAX_HEAD_DIM = spec.MIN_HEAD_DIM, spec.MAX_HEAD_DIM
# The Hopper backend with low-precision exact blocks, per precision (spec.PRODUCT_FORMATS)
LOWP_BACKENDS = {"fp8": "hopper_fp8", "int8-fp8": "hopper_int8_fp8", "int8-int8": "hopper_int8_int8",
                 "int8": "hopper_int8"}
FP8_BACKEND = LOWP_BACKENDS["fp8"]
INFERENCE_ONLY = ("hopper", *LOWP_BACKENDS.values(), "triton")  # backends whose kernels have no backward


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
    as_bool("return_lse", return_lse)
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
    if min(b, h, hk, lq, lk) < 1:  # no batch, head or token
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if h % hk:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk}) (GQA)")


def normalize_keep_blocks(keep_blocks, batch: int, heads: int, n_kv_blocks: int, device) -> tuple[Tensor | None, int]:
    """Validate ``keep_blocks``; return it as bool [B|1, H|1, Nk] on ``device`` and the largest
    number of kept blocks in any row (read on the host: free for a CPU mask, one sync otherwise)."""
    keep = check_keep_blocks(keep_blocks, batch, heads, n_kv_blocks, device)
    if keep is None:
        return None, 0
    return keep.to(device, non_blocking=True), keep_row_bound(keep, n_kv_blocks)


def get_backend(name: str) -> Backend:
    """The stage implementation called ``name`` (``"reference"``, ``"triton"`` or ``"hopper"``);
    ValueError when it cannot be loaded (Triton not installed, or without Gluon for ``"hopper"``)."""
    if torch.compiler.is_compiling():
        # traced: the module attribute, not the cache, whose contents a guard would watch (a first
        # compiled call that loads the backend would otherwise compile its frame twice)
        return _load_backend(name)
    be = _BACKENDS.get(name)
    if be is None:
        be = _BACKENDS[name] = _load_backend(name)
    return be


def _load_backend(name: str) -> Backend:
    if name == "reference":
        from .ops import reference

        return reference.BACKEND
    if name == "triton":
        try:
            from .ops.triton import op
        except ImportError as e:  # triton not installed
            raise ValueError(f"the triton backend is unavailable: triton cannot be imported ({e})") from None
        return op.BACKEND
    if name == "hopper" or name in LOWP_BACKENDS.values():
        try:
            from .ops.hopper import op
        except ImportError as e:  # no triton, or a triton without Gluon
            raise ValueError(f"the hopper backend is unavailable: its Gluon kernel cannot be imported ({e})") from None
        return op.BACKEND if name == "hopper" else op.LOWP_BACKENDS[name]
    raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {name!r}")


_BACKENDS: dict[str, Backend] = {}


def _reason(name: str, q: Tensor, mode: str, block_size: int) -> str | None:
    try:
        return get_backend(name).unsupported_reason(q, mode, block_size)
    except ValueError as e:
        return str(e)


def _choose_backend(backend: str, q: Tensor, mode: str, block_size: int, precision: str = "input",
                    warn: bool = True) -> str:
    if precision != "input":  # the low-precision kernel or an error, never another precision
        if backend not in ("auto", "hopper"):
            raise ValueError(f"precision={precision!r} runs on the hopper backend only, got backend={backend!r}")
        name = LOWP_BACKENDS[precision]
        reason = _reason(name, q, mode, block_size)
        if reason is not None:
            raise ValueError(f"precision={precision!r} is not supported for this call: {reason}")
        return name
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
    if warn:
        log_once(f"pisa_attention: using the PyTorch reference on CUDA because {reason}", logging.WARNING)
    return "reference"


def backend_for(settings: PisaSettings, q: Tensor, warn: bool = True) -> str:
    """The backend a call with ``settings`` on ``[B, H, L, D]`` queries like ``q`` runs (``"auto"``
    resolved); ValueError when a forced backend cannot serve it. ``warn``: log (once) when auto
    falls back to the reference on CUDA, as a call does."""
    return _choose_backend(settings.backend, q, settings.mode, settings.block_size, settings.precision, warn)


def _check_inference_only(backend: str, tensors) -> None:
    if backend in INFERENCE_ONLY and torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in tensors):
        raise ValueError(
            f"the {backend} backend is inference-only (its kernels have no backward), but q/k/v or alpha require "
            "grad: call under torch.no_grad() / torch.inference_mode(), or pass backend='reference' for gradients"
        )


# ---------------------------------------------------------------- plan
@dataclass(frozen=True, eq=False)
class PisaPlan:
    """One planned attention shape: the shape-only facts of a call and the workspace it runs in.

    Made by :func:`plan`; run by :func:`run`. ``q_shape``/``kv_shape`` are in the settings' layout
    (``[B, H, L, D]`` for ``"bhsd"``, ``[B, L, H, D]`` for ``"bshd"``). The workspace (statistics,
    selection and its score buffer of up to 4 % of the bytes of q, k, v and o
    (:data:`pisa_attn.ops.triton.op.SCORE_SCRATCH_FRACTION`), pair stream, log-sum-exp, and the
    low precisions' copies of K and V) is reused by every run of the plan: runs of one plan are
    ordered on one CUDA stream (a plan is not for concurrent use from several streams).
    """

    settings: PisaSettings
    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
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
    backend: str  # "hopper", "hopper_fp8", "triton" or "reference": what actually runs
    max_keep: int = 0  # the most always-exact blocks (keep_blocks) of any row a run may bring
    width: int = 1  # static width of the selection's index list: n_select + max_keep, at most Nk
    alpha: Tensor | None = None  # [H] weights of the first-order term from the settings (None: no such term)
    workspace: object = None  # the backend's buffers (None: the backend allocates per call)
    # recorded runs (pisa_attn.ops.bound), by the call's strides and outputs; see _bound_run
    # (not init fields: a dataclasses.replace of a plan starts with its own, empty)
    programs: dict = field(default_factory=dict, repr=False, init=False)
    # device copies of CPU keep_blocks masks, by value (filled once per distinct mask); see _planned_keep
    keeps: dict = field(default_factory=dict, repr=False, init=False)

    @property
    def layout(self) -> str:
        return self.settings.layout


def _shape_of(name: str, x) -> tuple[int, ...]:
    if isinstance(x, Tensor):
        _check_tensor(name, x)
        return tuple(x.shape)
    if isinstance(x, torch.Size) or (isinstance(x, (tuple, list)) and all(
            spec.is_int(n) for n in x)):
        shape = tuple(int(n) for n in x)
        if len(shape) != 4:
            raise ValueError(f"{name} must have rank 4 ([B, H, L, D] or [B, L, H, D]), got shape {shape}")
        if min(shape) < 0:
            raise ValueError(f"{name} must be a shape of non-negative sizes, got {shape}")
        return shape
    raise TypeError(f"{name} must be a torch.Tensor or a shape (4 ints), got {type(x).__name__}")


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` backed by one element: what the backend checks read (dtype, device,
    head dim), without allocating the shape."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)


def plan(q, k, settings: PisaSettings | None = None, *, dtype: torch.dtype | None = None, device=None,
         max_keep: int = 0, workspace: bool = True) -> PisaPlan:
    """Plan attention for one shape: every shape-only decision, and a workspace sized for it.

    Args:
        q: the query tensor or its shape, ``[B, H, Lq, D]`` (``layout="bhsd"``) or ``[B, Lq, H, D]``
            (``"bshd"``).
        k: the key tensor or its shape (``[B, Hk, Lk, D]`` / ``[B, Lk, Hk, D]``; ``v`` has the same).
        settings: a :class:`PisaSettings` (default ``PisaSettings()``).
        dtype, device: of q, k and v; default those of ``q`` when it is a tensor (required with shapes).
        max_keep: the most always-exact blocks (``keep_blocks``) of any query row that a run will
            pass; sizes the selection's index list. 0: runs take no ``keep_blocks``.
        workspace: allocate the workspace now (False: a plan whose runs allocate their buffers).

    Returns:
        a :class:`PisaPlan` for :func:`run`. ValueError/TypeError naming the argument for bad input.
    """
    if settings is None:
        settings = PisaSettings()
    if not isinstance(settings, PisaSettings):
        raise TypeError(f"settings must be a PisaSettings, got {type(settings).__name__}")
    q_shape, kv_shape = _shape_of("q", q), _shape_of("k", k)
    if dtype is None:
        if not isinstance(q, Tensor):
            raise TypeError("dtype must be given when q is a shape")
        dtype = q.dtype
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    if device is None:
        if not isinstance(q, Tensor):
            raise TypeError("device must be given when q is a shape")
        device = q.device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must name a torch device, got {device!r} ({e})") from None
    if device.type == "cpu":
        device = torch.device("cpu")  # tensors on the CPU carry no index
    elif device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # as tensors made on "cuda" are
    if device.type == "cuda" and (not torch.cuda.is_available() or (
            device.index is not None and device.index >= torch.cuda.device_count())):
        raise ValueError(f"device {device} is not available here ({torch.cuda.device_count()} CUDA devices)")
    if isinstance(q, Tensor) and (q.dtype != dtype or q.device != device):
        raise ValueError(f"q is {q.dtype} on {q.device}, but the plan was asked for {dtype} on {device}")
    for name, x in (("k", k),):
        if isinstance(x, Tensor) and (x.dtype != dtype or x.device != device):
            raise ValueError(f"{name} is {x.dtype} on {x.device}, but the plan is for {dtype} on {device} "
                             "(q's, or dtype= / device=)")
    max_keep = _max_keep(max_keep)
    workspace = as_bool("workspace", workspace)
    lay = settings.layout
    qh, kh = (_stand_in(to_bhsd_shape(s, lay), dtype, device) for s in (q_shape, kv_shape))
    _validate_shapes(qh, kh, kh)
    return _make_plan(settings, q_shape, kv_shape, qh, kh, max_keep, workspace and not torch.compiler.is_compiling())


def _max_keep(x) -> int:
    n = as_int("max_keep", x, "a non-negative int")
    if n < 0:
        raise ValueError(f"max_keep must be a non-negative int, got {x!r}")
    return n


def to_bhsd_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return shape if layout == "bhsd" else (shape[0], shape[2], shape[1], shape[3])


def _make_plan(s: PisaSettings, q_shape, kv_shape, qh: Tensor, kh: Tensor, max_keep: int,
               with_workspace: bool) -> PisaPlan:
    """The plan of validated ``[B, H, L, D]`` inputs ``qh``/``kh`` (tensors or stand-ins)."""
    b, h, lq, d = qh.shape
    hk, lk = kh.shape[1], kh.shape[2]
    bs = s.block_size
    nk = spec.num_blocks(lk, bs)
    n_select = spec.num_selected(s.density, nk)
    backend = _choose_backend(s.backend, qh, s.mode, bs, s.precision)
    alpha_values = s.alpha_values(h)
    alpha_dtype = torch.float64 if qh.dtype == torch.float64 else torch.float32
    alpha = None if alpha_values is None or torch.compiler.is_compiling() else \
        tail_weight.weights(alpha_values, qh.device, alpha_dtype)
    p = PisaPlan(
        settings=s, q_shape=tuple(q_shape), kv_shape=tuple(kv_shape), dtype=qh.dtype, device=qh.device,
        batch=b, heads=h, kv_heads=hk, q_len=lq, kv_len=lk, head_dim=d, block_size=bs,
        n_q_blocks=spec.num_blocks(lq, bs), n_kv_blocks=nk, n_select=n_select, mode=s.mode,
        covariance_aware=s.covariance_aware, scale=float(d**-0.5 if s.scale is None else s.scale),
        query_block=bs * s.query_factor, backend=backend, max_keep=max_keep,
        width=spec.selection_width(nk, n_select, max_keep), alpha=alpha,
    )  # fmt: skip
    if with_workspace:
        be = get_backend(backend)
        if be.workspace is not None:
            object.__setattr__(p, "workspace", be.workspace(p, qh, kh))
    return p


def make_plan(q: Tensor, k: Tensor, density, block_size, mode, covariance_aware, scale, backend,
              query_block=None, precision="input") -> PisaPlan:
    """A plan without a workspace from ``[B, H, L, D]`` tensors and loose settings (what the tools
    use to learn which backend a call runs); checked as :func:`plan` checks."""
    s = PisaSettings(density=density, block_size=block_size, mode=mode, covariance_aware=covariance_aware,
                     scale=scale, backend=backend, query_block=query_block, precision=precision)
    return plan(q, k, s, workspace=False)


# ---------------------------------------------------------------- run
def run(p: PisaPlan, q: Tensor, k: Tensor, v: Tensor, *, out: Tensor | None = None, lse: Tensor | None = None,
        keep_blocks: Tensor | None = None, selection: Selection | None = None, alpha=None,
        return_lse: bool = False, return_selection: bool = False):
    """Attention on a plan: ``q, k, v`` of the planned shapes, dtype, device and layout.

    Args:
        p: from :func:`plan`.
        q, k, v: ``[B, H, Lq, D]`` / ``[B, Hk, Lk, D]`` (``"bhsd"``) or ``[B, Lq, H, D]`` /
            ``[B, Lk, Hk, D]`` (``"bshd"``), exactly the planned shapes.
        out: optional output (q's shape, layout and dtype) to write into; else one is allocated.
        lse: optional float32 ``[B, H, Lq]`` to write the log-sum-exp into.
        keep_blocks: bool ``[Nk]`` or ``[B|1, H|1, Nk]``, always-exact key blocks; at most
            ``p.max_keep`` per row (the plan's selection width).
        selection: a :class:`pisa_attn.ops.selection.Selection` (e.g. returned by an earlier run)
            to attend under instead of selecting: ``idx [B, H, Nq, W]``, ``cnt [B, H, Nq]``,
            ``bits [B, H, Nq, ceil(Nk / 32)]``, int32 on the plan's device; ``keep_blocks`` must
            then be None (the selection lists every exact block). Eager calls only.
        alpha: per-call weight of the first-order term (a float, a sequence or an ``[H]``
            tensor of one value per query head), overriding the
            settings' (default: the settings' alpha, itself :data:`pisa_attn.spec.DEFAULT_ALPHA`
            when unset).
        return_lse, return_selection: also return the lse / a copy of the selection used
            (``return_selection``: eager calls only).

    Returns:
        ``out``; or a tuple ``(out, lse)``, ``(out, selection)`` or ``(out, lse, selection)``.

    ValueError/TypeError naming the argument when a tensor does not match the plan. The kernel
    backends issue no host synchronisation and allocate nothing but ``out`` (and ``lse`` when it
    is asked for and not given); the returned selection is a copy. Outside CUDA-graph capture a
    given ``selection`` is checked with one host read, as are the values of a CUDA ``alpha`` tensor
    and the row counts of a CUDA ``keep_blocks``.
    """
    if not isinstance(p, PisaPlan):
        raise TypeError(f"plan must be a PisaPlan (from pisa_attn.plan), got {type(p).__name__}")
    # the flags pick the return type: no truthy values
    return_lse, return_selection = as_bool("return_lse", return_lse), as_bool("return_selection", return_selection)
    if selection is not None and keep_blocks is not None:
        raise ValueError("keep_blocks has no effect with selection= (the selection lists every exact block): put the "
                         "kept blocks in the selection, or leave selection out")
    if return_selection and torch.compiler.is_compiling():
        raise ValueError("return_selection=True is not supported under torch.compile: run the call eagerly")
    if selection is None and p.workspace is not None:
        weights = _weights_or_none(p, alpha) if alpha is not None else p.alpha
        keep = None if keep_blocks is None else _planned_keep(p, keep_blocks)
        if (keep is not None or keep_blocks is None) and (
                weights is not None or (alpha is None and p.mode not in spec.FIRST_ORDER_MODES)):
            res = _bound_run(p, q, k, v, out, lse, weights, return_lse, keep)
            if res is not None:
                o, l_, sel = res
                if not (return_lse or return_selection):
                    return o
                return (o,) + ((l_,) if return_lse else ()) + (
                    (Selection(*(x.clone() for x in sel)),) if return_selection else ())
    _check_run(p, q, k, v, out, lse)
    lay = p.layout
    qh, kh, vh = (x if lay == "bhsd" else x.transpose(1, 2) for x in (q, k, v))
    if out is not None:
        out = out if lay == "bhsd" else out.transpose(1, 2)
    keep = None
    if keep_blocks is not None:
        keep, n_keep = normalize_keep_blocks(keep_blocks, p.batch, p.heads, p.n_kv_blocks, p.device)
        if n_keep > p.max_keep and not torch.compiler.is_compiling():
            raise ValueError(f"keep_blocks keeps up to {n_keep} blocks in a row, the plan was made for max_keep="
                             f"{p.max_keep}: plan with max_keep >= {n_keep}")
    if selection is not None:
        _check_selection(selection, p)
    weights = _weights(p, alpha)
    _check_inference_only(p.backend, (q, k, v, weights))
    o, l_, sel = _run(p, qh, kh, vh, out, lse, keep, weights, selection, return_lse)
    o = o if lay == "bhsd" else o.transpose(1, 2)
    if not (return_lse or return_selection):
        return o
    res = (o,) + ((l_,) if return_lse else ()) + ((Selection(*(x.clone() for x in sel)),) if return_selection else ())
    return res


def _weights_or_none(p: PisaPlan, alpha) -> Tensor | None:
    """A per-call ``alpha`` resolved, or None when it is bad input (the checked path says why)."""
    try:
        return _weights(p, alpha)
    except (TypeError, ValueError):
        return None


_RECORD_TRIES = 3  # recordings refused for one call signature before it stays on the checked path
_PROGRAM_LIMIT = 64  # programs (and refusal counts) kept per plan


def _planned_keep(p: PisaPlan, keep_blocks) -> Tensor | None:
    """The plan's device copy of a CPU ``keep_blocks`` mask (``[B|1, H|1, Nk]``, contiguous), found
    by the mask's value: checked, copied and counted once per distinct value, so a run with it
    issues no copy and no host read of the device. None when the mask cannot take this path (a
    device tensor, tracing, more kept blocks than the plan's ``max_keep``): the checked path then
    serves (and refuses) it."""
    key = _keep_value(keep_blocks)
    if key is None:
        return None
    keep = p.keeps.get(key)
    if keep is None:
        keep, n_keep = normalize_keep_blocks(keep_blocks, p.batch, p.heads, p.n_kv_blocks, p.device)
        if n_keep > p.max_keep:
            return None
        # a copy the plan owns (on a CPU plan .to() would return the caller's tensor itself)
        keep = keep.to(p.device, copy=True).contiguous()
        if len(p.keeps) >= _KEEP_LIMIT:
            p.keeps.clear()
        p.keeps[key] = keep
    return keep


_KEEP_LIMIT = 16  # distinct keep masks kept per plan


def _keep_value(keep_blocks):
    """A CPU bool mask's value as a dict key (shape and bytes), or None (a device tensor, not a
    bool tensor, tracing). By value, not identity: a new view of the same flags
    (``Sequence.keep_for``) finds it, a mask changed in place or a new one at a reused address
    does not."""
    if torch.compiler.is_compiling():
        return None
    try:
        if keep_blocks.device.type != "cpu" or keep_blocks.dtype != torch.bool:
            return None
        return keep_blocks.shape, keep_blocks.numpy().tobytes()
    except (AttributeError, TypeError, RuntimeError):
        return None  # not a tensor, or one numpy cannot read: the checks say so


def _bound_run(p: PisaPlan, q, k, v, out, lse, weights, want_lse: bool, keep: Tensor | None = None):
    """The hot path of a planned run: ``(out, lse, selection)`` in the plan's layout from the
    launches recorded for this call signature (:mod:`pisa_attn.ops.bound`), or None when the call
    goes the checked way (first calls, tracing, grad, unaligned or mismatching tensors).

    The signature is the tuple of what decides the launches: shapes, dtypes, devices, strides of
    q, k, v (and of ``out``/``lse``/``keep``/the weights when given), whether an lse is returned,
    and whether the weights are the plan's. A run whose tensors do not match the plan never finds a program here
    (programs are stored only after a checked run), so it reaches the checks."""
    if torch.compiler.is_compiling():
        return None  # one registered op in a graph (see _run); no data pointers while tracing
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               q.stride(), k.stride(), v.stride(), None if out is None else (out.shape, out.dtype, out.device,
                                                                              out.stride()),
               None if lse is None else (lse.shape, lse.dtype, lse.device, lse.stride()), want_lse,
               weights is p.alpha, None if keep is None else (keep.shape, keep.stride(), keep.dtype, keep.device),
               # the kernels index the weights without strides and check their dtype and device on the
               # checked path only (the registered op takes any tensor)
               None if weights is None else (weights.shape, weights.stride(), weights.dtype, weights.device))
        # the kernels are specialised on 16-byte alignment: a program serves aligned pointers only
        aligned = not ((q.data_ptr() | k.data_ptr() | v.data_ptr() | (0 if out is None else out.data_ptr())
                        | (0 if lse is None else lse.data_ptr()) | (0 if weights is None else weights.data_ptr())
                        | (0 if keep is None else keep.data_ptr())) & 15)
    except (AttributeError, TypeError):
        return None  # not tensors: the checks say so
    if out is not None or lse is not None:  # the program's key holds no pointers: aliasing is per call
        try:
            _check_no_overlap(q, k, v, out, lse)
        except ValueError:
            return None  # the checked path raises
    prog = p.programs.get(key)
    if prog is None or prog is False or not aligned or (torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, weights))) or (
            (out is not None and out.requires_grad) or (lse is not None and lse.requires_grad)):
        if prog is None and aligned:
            return _record(p, key, q, k, v, out, lse, weights, want_lse, keep)
        return None
    return prog(q, k, v, out, lse, weights, keep)


def _record(p: PisaPlan, key, q, k, v, out, lse, weights, want_lse, keep=None):
    """Run checked, recording the launches; store the program when they can be replayed."""
    from .ops import bound

    if len(p.programs) >= _PROGRAM_LIMIT:  # many call signatures (strides) on one plan: start over
        p.programs.clear()
    if p.programs.get(("tries", key), 0) >= _RECORD_TRIES:
        p.programs[key] = False
        return None
    lay = p.layout
    try:
        _check_run(p, q, k, v, out, lse)
    except (TypeError, ValueError):
        return None  # the checked path raises
    _check_inference_only(p.backend, (q, k, v, weights))
    be = _BACKENDS.get(p.backend) or get_backend(p.backend)
    qh, kh, vh = (x if lay == "bhsd" else x.transpose(1, 2) for x in (q, k, v))
    alpha_t = weights if weights is not None else tail_weight.ones(p.heads, p.device)
    # The output (and a returned lse) are allocated here, so that they are the call's tensors
    # in the recording, exactly as the stages would allocate them.
    from .ops.triton.attention import _alloc_like_layout

    o_h = _alloc_like_layout(qh) if out is None else (out if lay == "bhsd" else out.transpose(1, 2))
    l_in = lse if lse is not None else (torch.empty(p.batch, p.heads, p.q_len, device=p.device, dtype=torch.float32)
                                        if want_lse else None)
    (o, l_, sel), rec = bound.record(run_planned, be, qh, kh, vh, p, p.workspace, keep=keep, alpha=alpha_t, out=o_h,
                                     lse=l_in, want_lse=want_lse)
    o = o if lay == "bhsd" else o.transpose(1, 2)
    prog = None
    if rec.ok and o.data_ptr() == o_h.data_ptr() and (l_in is None or l_.data_ptr() == l_in.data_ptr()):
        try:
            replay = bound.bind(rec.launches, (qh, kh, vh, o_h, alpha_t, l_in, keep),
                                bound.tensors_of(p.workspace) + ([l_] if l_in is None else []))
        except Exception as e:  # noqa: BLE001 - the checked run already computed this call's result
            # A launch the binder cannot take would fail again on every recording: stop recording it.
            warnings.warn(f"pisa_attn: recorded kernel launches could not be bound for replay ({type(e).__name__}: "
                          f"{e}); calls with this signature take the checked path", RuntimeWarning, stacklevel=3)
            p.programs[key] = False
            return o, l_, sel
        if replay is not None:
            prog = _Program(p, replay, o, l_ if l_in is None else None, sel, out is None, want_lse and lse is None,
                            weights is None)
    if prog is None:
        tries = p.programs.get(("tries", key), 0) + 1
        p.programs[("tries", key)] = tries
    else:
        p.programs[key] = prog
    return o, l_, sel


class _Program:
    """One recorded run of a plan: allocates what the call returns new, swaps the call's
    pointers into the bound launches (:func:`pisa_attn.ops.bound.bind`)."""

    __slots__ = ("replay", "out_shape", "out_t", "dtype", "device", "index", "lse", "lse_shape", "sel",
                 "new_out", "new_lse", "ones")

    def __init__(self, p: PisaPlan, replay, o: Tensor, ws_lse, sel, new_out: bool, new_lse: bool, ones: bool):
        self.replay = replay
        # the output as allocated: its physical shape, and whether the caller's view is its transpose
        self.out_t = o.stride(1) < o.stride(2)
        self.out_shape = tuple(o.transpose(1, 2).shape) if self.out_t else tuple(o.shape)
        self.dtype, self.device = p.dtype, p.device
        self.index = None if p.device.type != "cuda" else (
            p.device.index if p.device.index is not None else torch.cuda.current_device())
        self.lse, self.lse_shape = ws_lse, (p.batch, p.heads, p.q_len)
        self.sel, self.new_out, self.new_lse = sel, new_out, new_lse
        self.ones = tail_weight.ones(p.heads, p.device) if ones else None

    def __call__(self, q, k, v, out, lse, weights, keep=None):
        if out is None:
            raw = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            out = raw.transpose(1, 2) if self.out_t else raw
        if lse is None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if self.new_lse else self.lse
        stream = torch._C._cuda_getCurrentRawStream(self.index) if self.index is not None else 0
        self.replay(stream, q, k, v, out, self.ones if weights is None else weights, lse, keep)
        return out, lse, self.sel


def _check_run(p: PisaPlan, q, k, v, out, lse) -> None:
    """The checks of a run's tensors against its plan (ValueError/TypeError naming the argument)."""
    for name, x, shape in (("q", q, p.q_shape), ("k", k, p.kv_shape), ("v", v, p.kv_shape)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, the plan was made for {shape} "
                             f"(layout {p.layout!r}): make a plan for this shape")
        if x.dtype != p.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, the plan was made for {p.dtype}")
        if x.device != p.device:
            raise ValueError(f"{name} is on {x.device}, the plan was made for {p.device}")
    if out is not None:
        _check_out("out", out, p.q_shape, p.dtype, p.device)
    if lse is not None:
        _check_out("lse", lse, (p.batch, p.heads, p.q_len), torch.float32, p.device, contiguous=True)
    _check_no_overlap(q, k, v, out, lse)


def _check_no_overlap(q, k, v, out, lse) -> None:
    """ValueError when ``out`` or ``lse`` shares memory with q, k, v or each other: the stages read
    q, k and v again after outputs are written (a key block's statistics, the next query block's
    keys), so an aliased output is a wrong answer, not an in-place one. Interleaved views of one
    buffer count as overlapping (``torch._C._overlaps`` cannot tell them apart cheaply)."""
    if torch.compiler.is_compiling():
        return  # no storage to compare while tracing; the eager call checks it
    for name, x in (("out", out), ("lse", lse)):
        if x is None:
            continue
        for other, y in (("q", q), ("k", k), ("v", v)) + ((("out", out),) if name == "lse" and out is not None else ()):
            if torch._C._overlaps(x, y):
                raise ValueError(f"{name} shares memory with {other}: pass an output buffer of its own")


def _weights(p: PisaPlan, alpha) -> Tensor | None:
    """The ``[H]`` first-order weights of a run: the plan's (from its settings) unless ``alpha``
    overrides them for this call."""
    if alpha is None:
        if p.alpha is not None or p.mode not in spec.FIRST_ORDER_MODES:
            return p.alpha
        # a plan made while tracing: the settings' values as a constant of the graph
        return torch.tensor(p.settings.alpha_values(p.heads), device=p.device,
                            dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
    return tail_weight.resolve(alpha, mode=p.mode, heads=p.heads, device=p.device,
                               dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)


def _check_out(name: str, x, shape, dtype, device, contiguous: bool = False) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype or x.device != device:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)} on {device}, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if contiguous and not x.is_contiguous():  # the kernels write it by row index, without strides
        raise ValueError(f"{name} must be contiguous (the kernels write it without strides), got strides "
                         f"{tuple(x.stride())}")
    if x.requires_grad:
        raise ValueError(f"{name} must not require grad (it is written in place; the kernels are inference-only)")
    if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(x) == 1:  # 1: an expanded view
        raise ValueError(f"{name} has elements sharing memory (an expanded view?): pass a buffer of its own")


def _check_selection(sel, p: PisaPlan) -> None:
    check_selection(sel, p.batch, p.heads, p.n_q_blocks, p.n_kv_blocks, p.device, contiguous=True)
    if p.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # no host read inside a graph capture: the eager calls before it were checked
    # Contents, one host read: the kernels index K/V tiles with the first cnt entries of idx (out
    # of range: reads past the tensors), the reference reads bits; all must describe one set.
    nk, w = p.n_kv_blocks, sel.idx.shape[-1]
    cnt = sel.cnt.long()
    valid = torch.arange(w, device=p.device) < cnt[..., None]
    idx = sel.idx.long()
    in_range = ((idx >= 0) & (idx < nk) | ~valid).all() & ((cnt >= 0) & (cnt <= w)).all()
    # entries past cnt go to a spare column, so they set nothing
    listed = torch.zeros(*sel.cnt.shape, nk + 1, dtype=torch.bool, device=p.device).scatter_(
        -1, torch.where(valid, idx.clamp(0, nk - 1), nk), True)[..., :nk]
    ok = in_range & (listed.sum(-1) == cnt).all() & (listed == sel.to_mask(nk)).all()
    if not bool(ok):
        raise ValueError(f"selection does not describe one set of key blocks per row: every cnt must be in [0, {w}], "
                         f"the first cnt entries of idx distinct blocks in [0, {nk}), and bits exactly those blocks "
                         "(as a Selection returned by run(..., return_selection=True) is)")


def _run(p: PisaPlan, q: Tensor, k: Tensor, v: Tensor, out, lse, keep, weights, selection, want_lse: bool):
    """The hot path on ``[B, H, L, D]`` views already checked against the plan."""
    be = get_backend(p.backend)  # loaded when the plan was made
    if torch.compiler.is_compiling():  # one registered op (its fake matches), no workspace in a graph
        if selection is not None:
            raise ValueError("selection= is not supported under torch.compile: run the call eagerly")
        # a traced mask's count is unknown (run's check skipped): the static bound, every block,
        # sizes the index list, as in pisa_attention, so no kept block is cut off
        o, l_ = be.forward(q, k, v, p, keep, p.n_kv_blocks if keep is not None else 0, weights)
        if out is not None:
            o = out.copy_(o)
        if lse is not None:
            l_ = lse.copy_(l_)
        return o, l_, None
    return run_planned(be, q, k, v, p, p.workspace, keep=keep, alpha=weights, out=out, lse=lse,
                       selection=selection, want_lse=want_lse)


# ---------------------------------------------------------------- the registered op's implementation
# Plans hold their workspaces (clear_plans): the recent shapes' only; settings and kept-block
# counts are small.
_PLAN_LIMIT, _SETTINGS_LIMIT = 64, 256
_OP_PLANS = LRU(_PLAN_LIMIT)


def _op_run(be: Backend, q, k, v, keep, alpha, n_select, width, mode, scale, block_size, covariance_aware,
            query_block):
    """``torch.ops.pisa_attn.pisa_fwd`` as a compiled graph calls it: a plan of the op's arguments
    (cached, with its workspace) and its recorded launches, as an eager planned run; fresh
    ``(out, lse)``. ``[B, H, L, D]`` views; ``keep`` the device mask the graph made."""
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, n_select, width, mode, scale, block_size, covariance_aware,
           query_block, be.name, _stream_key(q.device))
    p = _OP_PLANS.get(key)
    if p is None:
        p = _op_plan(be, q, k, n_select, width, mode, scale, block_size, covariance_aware, query_block)
        _OP_PLANS[key] = p
    res = _bound_run(p, q, k, v, None, None, alpha, True, keep)
    if res is None:
        res = run_planned(be, q, k, v, p, p.workspace, keep=keep, alpha=alpha, want_lse=True)
    return res[0], res[1]


def _op_plan(be: Backend, q: Tensor, k: Tensor, n_select: int, width: int, mode: str, scale: float, block_size: int,
             covariance_aware: bool, query_block: int) -> PisaPlan:
    """The plan (``"bhsd"``, with a workspace) whose runs compute what the op's arguments ask:
    its selection width and number of selected blocks are the op's, not derived from a density."""
    b, h, lq, d = q.shape
    precision = next((p for p, n in LOWP_BACKENDS.items() if n == be.name), "input")
    s = PisaSettings(block_size=block_size, mode=mode, covariance_aware=covariance_aware, scale=scale,
                     backend="hopper" if precision != "input" else be.name, precision=precision,
                     query_block=None if query_block == block_size else query_block)
    p = PisaPlan(
        settings=s, q_shape=tuple(q.shape), kv_shape=tuple(k.shape), dtype=q.dtype, device=q.device, batch=b,
        heads=h, kv_heads=k.shape[1], q_len=lq, kv_len=k.shape[2], head_dim=d, block_size=block_size,
        n_q_blocks=spec.num_blocks(lq, block_size), n_kv_blocks=spec.num_blocks(k.shape[2], block_size),
        n_select=n_select, mode=mode, covariance_aware=covariance_aware, scale=scale, query_block=query_block,
        backend=be.name, max_keep=max(0, width - n_select), width=width,
    )  # fmt: skip
    if be.workspace is not None:
        object.__setattr__(p, "workspace", be.workspace(p, q, k))
    return p


_fused.set_planned(_op_run)


# ---------------------------------------------------------------- pisa_attention
_PLANS = LRU(_PLAN_LIMIT)


def clear_plans() -> None:
    """Drop :func:`pisa_attention`'s cached plans and their workspaces (memory is held per planned
    shape until then, for the 64 most recently used shapes: 8 MiB at 4K tokens, 116 MiB at 64K for
    B2-H16-D128 bf16 on the Triton backend, element counts of its buffers); the registered op's
    plans too."""
    _PLANS.clear()
    _OP_PLANS.clear()
    _KEEP_COUNTS.clear()


def _stream_key(device: torch.device):
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None


def pisa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    density: float = _U["density"],
    block_size: int = _U["block_size"],
    mode: str = _U["mode"],
    covariance_aware: bool | None = None,
    scale: float | None = None,
    layout: str = _U["layout"],
    keep_blocks: Tensor | None = None,
    return_lse: bool = False,
    backend: str = _U["backend"],
    query_block: int | None = None,
    alpha: float | Tensor | None = None,
    settings: PisaSettings | None = None,
    precision: str = _U["precision"],
):
    """Piecewise Sparse Attention: a drop-in for ``F.scaled_dot_product_attention`` in DiTs.

    Every ``block_size`` query block computes its top-``k`` key blocks exactly and approximates the
    remaining (tail) blocks by a Taylor expansion around each block's centroid, inside one online
    softmax (paper Algorithm 1). A thin wrapper: :class:`PisaSettings` from the keyword arguments
    (cached), a cached :func:`plan` per shape, then :func:`run`.

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
        covariance_aware: add ``log(||H_j - H̄||_F + eps)`` to the selection scores (paper eq. 9);
            None: :data:`pisa_attn.spec.DEFAULT_COVARIANCE_AWARE` (True).
        alpha: weight of the first-order tail term (modes ``"hybrid"`` and ``"first"``): a float,
            or one value per query head (a sequence, or an ``[H]`` tensor on the CPU or on q's
            device). ``None``
            means :data:`pisa_attn.spec.DEFAULT_ALPHA` (0.75, which beats the full term on real
            attention); ``1.0`` is the paper's method exactly, ``0.0`` equals ``mode="zeroth"``.
            Per-head values fitted against dense attention come from :mod:`pisa_attn.calibration`
            (or ``apply_pisa(..., calibrate=True)``). Not allowed with ``"zeroth"``/``"drop"``.
            A CPU tensor or a number is read on the host and cached on the device (no sync; CUDA
            graph and ``torch.compile`` friendly); a device tensor's values are checked with one
            host read. A tensor that requires grad is differentiated on the reference backend.
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
        precision: ``"input"`` (the exact blocks in the input dtype), or on the Hopper kernel
            ``"fp8"`` (their two products in FP8 e4m3), ``"int8-fp8"`` (Q·Kᵀ in INT8, P·V in e4m3),
            ``"int8-int8"`` (both in INT8) or ``"int8"`` (Q·Kᵀ in INT8, P·V in the input dtype); the
            tail stays in the input
            dtype; a call the low-precision kernel cannot serve is a ValueError, never another
            precision.
        settings: a :class:`PisaSettings` instead of the loose settings arguments above (which
            must then be left out: passing one, even at its default value, is a ValueError;
            ``alpha`` may still be given per call).

    Returns:
        ``out`` with the shape and layout of ``q``, or ``(out, lse)`` when ``return_lse``.

    The kernels (hopper, triton) are inference-only: a call that would run them on inputs requiring grad
    (with autograd enabled) raises ValueError; the reference backend is differentiable.

    Finite inputs give a finite output where it fits the output dtype: the first-order term is a
    linear correction, not a convex combination of values, so with extreme inputs (sharp scores
    against values near float16's limit) a hybrid output can leave the values' range. NaN or inf
    in ``q``, ``k`` or ``v`` is not looked for (that would read the device every call): it
    propagates as in dense attention, where one non-finite key or value reaches every row (here
    through the block statistics and ``H̄``).
    """
    if return_lse is not True and return_lse is not False:
        return_lse = as_bool("return_lse", return_lse)
    compiling = torch.compiler.is_compiling()
    if settings is None:
        key = (density, block_size, mode, covariance_aware, scale, layout, backend, query_block, precision,
               type(density), type(block_size), type(covariance_aware), type(scale), type(query_block))
        try:
            settings, cache = (None, False) if compiling else (_SETTINGS.get(key), True)
        except TypeError:  # an unhashable argument: PisaSettings names it
            settings, cache = _settings(key[:9]), False
        if settings is None:
            settings = _settings(key[:9])
            if cache:
                _SETTINGS[key] = settings
    else:
        if not isinstance(settings, PisaSettings):
            raise TypeError(f"settings must be a PisaSettings, got {type(settings).__name__}")
        check_not_both(density=density, block_size=block_size, mode=mode, covariance_aware=covariance_aware,
                       scale=scale, layout=layout, backend=backend, query_block=query_block, precision=precision)
        if settings.alpha is not None:
            # The weight is data: one cached plan (and workspace) serves every alpha of a shape.
            if alpha is None:
                alpha = settings.alpha  # a float or a tuple: resolved (and cached) in the input's precision
            base = None if compiling else _WITHOUT_ALPHA.get(settings)
            if base is None:
                base = settings.replace(alpha=None)
                if not compiling:
                    _WITHOUT_ALPHA[settings] = base
            settings = base
    p = pkey = None
    raw_keep = keep_blocks
    # a CPU keep mask seen before: its kept-block count (the plan's max_keep) without reading it
    kval = None if keep_blocks is None else _keep_value(keep_blocks)
    n_seen = 0 if keep_blocks is None else None if kval is None else _KEEP_COUNTS.get(kval)
    if n_seen is not None and not compiling and isinstance(q, Tensor) and isinstance(k, Tensor) \
            and isinstance(v, Tensor):
        pkey = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, settings,
                n_seen, _stream_key(q.device))
        p = _PLANS.get(pkey)
    if p is None:  # a new shape (or kept blocks): the full checks
        qh, kh, _ = _validate_call(q, k, v, settings)
        n_keep = 0
        if keep_blocks is not None:
            keep_blocks, n_keep = normalize_keep_blocks(keep_blocks, qh.shape[0], qh.shape[1],
                                                        spec.num_blocks(kh.shape[2], settings.block_size), q.device)
            if kval is not None:
                _KEEP_COUNTS[kval] = n_keep
            if not compiling:
                pkey = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, settings,
                        n_keep, _stream_key(q.device))
                p = _PLANS.get(pkey)
        if p is None:
            p = _make_plan(settings, tuple(q.shape), tuple(k.shape), qh, kh, n_keep, not compiling)
            if not compiling:
                _PLANS[pkey] = p
    weights = _weights(p, alpha)
    _check_inference_only(p.backend, (q, k, v, weights))
    if n_seen is not None and raw_keep is not None:
        # a CPU mask seen before: the plan's device copy, checked against this plan's shapes (the
        # count found the plan, but the mask may have been checked for another shape)
        keep_blocks = _planned_keep(p, raw_keep)
        if keep_blocks is None:
            keep_blocks, _ = normalize_keep_blocks(raw_keep, p.batch, p.heads, p.n_kv_blocks, p.device)
    if p.workspace is not None and (keep_blocks is None or n_seen is not None):
        res = _bound_run(p, q, k, v, None, None, weights, return_lse, keep_blocks)
        if res is not None:
            return (res[0], res[1]) if return_lse else res[0]
    lay = settings.layout
    qh, kh, vh = (x if lay == "bhsd" else x.transpose(1, 2) for x in (q, k, v))
    out, lse, _ = _run(p, qh, kh, vh, None, None, keep_blocks, weights, None, return_lse)
    out = out if lay == "bhsd" else out.transpose(1, 2)
    return (out, lse) if return_lse else out


_SETTINGS = LRU(_SETTINGS_LIMIT)
_WITHOUT_ALPHA = LRU(_SETTINGS_LIMIT)
_KEEP_COUNTS = LRU(_SETTINGS_LIMIT)  # kept blocks per row of CPU keep masks seen, by value (see _keep_value)


def _settings(values) -> PisaSettings:
    density, block_size, mode, covariance_aware, scale, layout, backend, query_block, precision = values
    return from_loose(density=density, block_size=block_size, mode=mode, covariance_aware=covariance_aware,
                      scale=scale, layout=layout, backend=backend, query_block=query_block, precision=precision)


def _validate_call(q, k, v, s: PisaSettings):
    """The full checks of a call's tensors (once per new shape: plan-cache misses only)."""
    return validate(q, k, v, density=s.density, block_size=s.block_size, mode=s.mode, scale=s.scale,
                    layout=s.layout, backend=s.backend, covariance_aware=s.covariance_aware,
                    query_block=s.query_block)
