"""The low-precision exact phase's quantisation pass: e4m3 or int8 copies of K and e4m3 or int8
copies of V (math: :mod:`pisa_attn.ops.quant`).

Up to three launches after the statistics (they read the statistics' float16 centroids; the
planned low-precision call runs the first and last inside ``prepare(..., quant=)``, which takes
the ``|v|`` maximum from its own read of V):

* ``_mu_kernel`` (one program per kv head): the smoothing vector ``μ``, the mean of the head's
  centroids ``kbar · kscale``, and a zeroed per-channel maximum of ``|v|``;
* ``_vmax_kernel`` (a kv head and a run of its key blocks): that maximum, by integer atomic max
  of the float bits (non-negative floats order as their bit patterns);
* ``_quant_kernel`` (one program per kv head and key block): one read of the block's keys and
  values, one write of ``k8 = Q((k − μ)/σ_j)`` ``[B, Hk, Lk', D]`` (e4m3 or int8) with its
  per-block scale ``σ`` ``[B, Hk, Nk]``, and of ``v8`` transposed ``[B, Hk, D, Lk']``: e4m3 with
  the per-channel scales ``τ`` ``[B, Hk, D]`` of the ``|v|`` pass, or int8 with one scale per
  block and channel ``τ`` ``[B, Hk, Nk, D]`` from the block's own rows, and the block's code sums
  per channel ``[B, Hk, Nk, D]`` (int32; the kernel's offset P codes need them); with values in the
  input dtype also ``max |k − μ|`` per channel over the head (atomic max of the bits, as ``|v|``
  above: the bound of the exact loop's scores). ``Lk'`` is
  ``Lk`` rounded up to whole blocks: the rows past ``Lk`` are written as zeros, so the attention
  kernel's TMA boxes never leave a tensor.

When ``P·V`` runs in the input dtype (``precision="int8"``) there is no ``|v|`` pass and no value
copy: only the keys are read and written; int8 values (``"int8-int8"``) need no ``|v|`` pass
either.

e4m3 scales are powers of two built from the exponent bits (exact division, no ``log2``); int8
scales are ``amax/127`` and ``127/amax`` by correctly rounded division (``div_rn``): the kernels
and the reference round the same numbers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...spec import PRODUCT_FORMATS
from ..launch import Launcher, spec_class
from ._common import check_token_strides


@triton.jit
def _pow2_scale(amax):
    """(``2^(floor(log2 amax) − 7)``, its reciprocal); ``2^-126`` (and ``2^126``) for tiny or 0."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127 - 7
    e = tl.where(amax > 0, tl.maximum(e, -126), -126)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _int8_scale(amax):
    """(``amax / 127``, ``127 / amax``), each correctly rounded; (0, 0) for 0; ``amax`` at least
    2^-121 (``quant.INT8_MIN_AMAX``: ``127 / amax`` stays finite)."""
    pos = amax > 0
    safe = tl.where(pos, tl.maximum(amax, 3.761581922631320e-37), 1.0)
    return tl.where(pos, tl.math.div_rn(safe, 127.0), 0.0), tl.where(pos, tl.math.div_rn(127.0, safe), 0.0)


@triton.jit(do_not_specialize=["NK"])
def _mu_kernel(kbar_ptr, kscale_ptr, mu_ptr, vmax_ptr, kcmax_ptr, NK, D: tl.constexpr, TJ: tl.constexpr,
               ZERO_VMAX: tl.constexpr, ZERO_KCMAX: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D)
    if ZERO_VMAX:
        tl.store(vmax_ptr + bh * D + offs_d, tl.zeros([D], dtype=tl.int32))
    if ZERO_KCMAX:
        tl.store(kcmax_ptr + bh * D + offs_d, tl.zeros([D], dtype=tl.int32))
    rows = tl.arange(0, TJ)
    acc = tl.zeros([D], dtype=tl.float32)
    for j0 in range(0, NK, TJ):
        j = j0 + rows
        kb = tl.load(kbar_ptr + (bh * NK + j[:, None]) * D + offs_d[None, :], mask=(j < NK)[:, None], other=0.0)
        acc += tl.sum(kb.to(tl.float32), axis=0)
    tl.store(mu_ptr + bh * D + offs_d, acc / tl.maximum(NK, 1) * tl.load(kscale_ptr + bh))


@triton.jit(do_not_specialize=["HK", "LK", "NK", "PER", "CHUNKS"])
def _vmax_kernel(v_ptr, vmax_ptr, svb, svh, svl, svd, HK, LK, NK, PER, CHUNKS, BS: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    c = pid % CHUNKS
    bh = pid // CHUNKS
    b = (bh // HK).to(tl.int64)
    h = (bh % HK).to(tl.int64)
    offs_d = tl.arange(0, D)
    # elementwise over the run, one reduction across the tile's rows at the end
    m = tl.zeros([BS, D], dtype=tl.float32)
    for j in range(c * PER, tl.minimum(NK, c * PER + PER)):
        r = tl.arange(0, BS)
        rows = j * BS + r
        # the block's first row in int64: row x token stride passes 2^31 in sequence-first layouts
        v_blk = v_ptr + b * svb + h * svh + tl.cast(j * BS, tl.int64) * svl
        v = tl.load(v_blk + r[:, None] * svl + offs_d[None, :] * svd, mask=(rows < LK)[:, None], other=0.0)
        m = tl.maximum(m, tl.abs(v.to(tl.float32)))
    tl.atomic_max(vmax_ptr + bh.to(tl.int64) * D + offs_d, tl.max(m, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _to_int8(x, inv):
    """``x·inv`` to int8: half away from zero (the cast truncates), clamped to the symmetric range."""
    y = x * inv
    return tl.minimum(tl.maximum(y + tl.where(y >= 0, 0.5, -0.5), -127.0), 127.0).to(tl.int8)


@triton.jit(do_not_specialize=["HK", "LK", "LKP", "NK"])
def _quant_kernel(
    k_ptr, v_ptr, mu_ptr, vmax_ptr, k8_ptr, sig_ptr, v8_ptr, tau_ptr, vcs_ptr, kcmax_ptr,
    skb, skh, skl, skd, svb, svh, svl, svd,
    HK, LK, LKP, NK,
    BS: tl.constexpr, D: tl.constexpr, K_INT8: tl.constexpr, WITH_V: tl.constexpr, V_INT8: tl.constexpr,
    KCMAX: tl.constexpr = False,
):
    pid = tl.program_id(0)
    j = pid % NK
    bh = pid // NK
    b = (bh // HK).to(tl.int64)
    h = (bh % HK).to(tl.int64)
    bh = bh.to(tl.int64)
    r = tl.arange(0, BS)
    rows = j * BS + r
    row0 = tl.cast(j * BS, tl.int64)  # the block's first row: row x token stride passes 2^31 in sequence-first layouts
    offs_d = tl.arange(0, D)
    valid = (rows < LK)[:, None]
    k = tl.load(k_ptr + b * skb + h * skh + row0 * skl + r[:, None] * skl + offs_d[None, :] * skd, mask=valid,
                other=0.0)
    mu = tl.load(mu_ptr + bh * D + offs_d)
    kc = tl.where(valid, k.to(tl.float32) - mu[None, :], 0.0)
    kabs = tl.max(tl.abs(kc), axis=0)
    kmax = tl.max(kabs, axis=0)
    if KCMAX:  # max |k − μ| per channel over the head: non-negative floats order as their bits
        tl.atomic_max(kcmax_ptr + bh * D + offs_d, kabs.to(tl.int32, bitcast=True))
    if K_INT8:
        sig, sig_inv = _int8_scale(kmax)
        k8 = _to_int8(kc, sig_inv)
    else:
        sig, sig_inv = _pow2_scale(kmax)
        k8 = (kc * sig_inv).to(tl.float8e4nv)
    tl.store(k8_ptr + (bh * LKP + rows[:, None]) * D + offs_d[None, :], k8)
    tl.store(sig_ptr + bh * NK + j, sig)
    if WITH_V:
        v = tl.load(v_ptr + b * svb + h * svh + row0 * svl + r[:, None] * svl + offs_d[None, :] * svd, mask=valid,
                    other=0.0)
        if V_INT8:  # one scale per block and channel, from this block's rows (padding rows are 0)
            vf = v.to(tl.float32)
            tau, tau_inv = _int8_scale(tl.max(tl.abs(vf), axis=0))
            v8 = _to_int8(vf, tau_inv[None, :])
            tl.store(tau_ptr + (bh * NK + j) * D + offs_d, tau)
            tl.store(vcs_ptr + (bh * NK + j) * D + offs_d, tl.sum(v8.to(tl.int32), axis=0))
        else:
            tau, tau_inv = _pow2_scale(tl.load(vmax_ptr + bh * D + offs_d).to(tl.float32, bitcast=True))
            v8 = (v.to(tl.float32) * tau_inv[None, :]).to(tl.float8e4nv)
            if j == 0:  # one program per head writes the head's value scales
                tl.store(tau_ptr + bh * D + offs_d, tau)
        tl.store(v8_ptr + (bh * D + offs_d[:, None]) * LKP + rows[None, :], tl.trans(v8))  # the K-major B operand


@dataclass
class Quantized:
    """The quantised copies of one call's keys (and values) and their scales (see the module
    docstring). Without value copies (``precision="int8"``) ``v8t``, ``tau``, ``vmax`` and ``vcs``
    are empty; ``vmax`` is used for e4m3 values only, ``vcs`` for int8 values only."""

    mu: Tensor  # [B, Hk, D] float32
    k8: Tensor  # [B, Hk, Lk', D] float8_e4m3fn or int8
    sigma: Tensor  # [B, Hk, Nk] float32
    v8t: Tensor  # [B, Hk, D, Lk'] float8_e4m3fn or int8
    tau: Tensor  # float32 [B, Hk, D] (e4m3 values) or [B, Hk, Nk, D] (int8 values)
    vmax: Tensor  # [B, Hk, D] int32: the bits of max |v| per channel (scratch)
    vcs: Tensor  # [B, Hk, Nk, D] int32: per block and channel, the sum of the int8 value codes
    # [B, Hk, D] int32: the bits of max |k − μ| per channel over the head (P·V in the input dtype
    # only: the bound of the exact loop's scores)
    kcmax: Tensor


_K_DTYPES = {"e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def _check_precision(precision) -> None:
    if precision not in PRODUCT_FORMATS:
        raise ValueError(f"precision must be a low precision {tuple(PRODUCT_FORMATS)}, got {precision!r}")


def _buffers(b: int, hk: int, lk: int, d: int, block_size: int, precision: str) -> dict:
    """``{field: (shape, dtype)}`` of :class:`Quantized` for ``precision``: what
    :func:`quant_workspace` allocates and :func:`quantize` checks a given workspace against."""
    qk_fmt, pv_fmt = PRODUCT_FORMATS[precision]
    nk = -(-lk // block_size)
    lkp = nk * block_size
    nv = 0 if pv_fmt == "input" else b  # value copies
    ne = b if pv_fmt == "e4m3" else 0  # the |v| pass's scratch
    ni = b if pv_fmt == "int8" else 0  # int8 values' per-block scales and code sums
    nb = b if needs_kcmax(precision) else 0
    f32, i32 = torch.float32, torch.int32
    return dict(mu=((b, hk, d), f32), k8=((b, hk, lkp, d), _K_DTYPES[qk_fmt]), sigma=((b, hk, nk), f32),
                v8t=((nv, hk, d, lkp), torch.int8 if ni else torch.float8_e4m3fn),
                tau=((ni, hk, nk, d) if ni else (nv, hk, d), f32), vmax=((ne, hk, d), i32), vcs=((ni, hk, nk, d), i32),
                kcmax=((nb, hk, d), i32))


def quant_workspace(b: int, hk: int, lk: int, d: int, block_size: int, device, precision: str = "fp8") -> Quantized:
    """Buffers of :func:`quantize` for ``precision`` (:data:`pisa_attn.spec.PRODUCT_FORMATS`)."""
    _check_precision(precision)
    return Quantized(**{name: torch.empty(shape, device=device, dtype=dtype)
                        for name, (shape, dtype) in _buffers(b, hk, lk, d, block_size, precision).items()})


_launch_mu = Launcher(_mu_kernel)
_launch_vmax = Launcher(_vmax_kernel)
_launch_quant = Launcher(_quant_kernel)
VMAX_BLOCKS = 8  # key blocks per program of the |v| maximum (fewer atomics)
QUANT_WARPS = 4  # per program of the pass (one key block): 8 or 16 were 20-25 % slower at D = 128 (H200)


def formats(precision: str) -> dict:
    """The pass's constexprs for ``precision``: which formats the key and value copies take."""
    qk_fmt, pv_fmt = PRODUCT_FORMATS[precision]
    return dict(K_INT8=qk_fmt == "int8", WITH_V=pv_fmt != "input", V_INT8=pv_fmt == "int8")


def needs_vmax(precision: str) -> bool:
    """Whether the values' scales come from a per-channel ``max |v|`` over the head (e4m3 values;
    int8 values are scaled per block from the block alone)."""
    return PRODUCT_FORMATS[precision][1] == "e4m3"


def needs_kcmax(precision: str) -> bool:
    """Whether the pass takes the keys' per-channel ``max |k − μ|`` (P·V in the input dtype, whose
    exact loop may fix its maximum at the bound of its scores)."""
    return PRODUCT_FORMATS[precision][1] == "input"


def checked(ws: Quantized, k: Tensor, block_size: int, precision: str, name: str = "ws") -> Quantized:
    """``ws`` if its buffers are those of ``[B, Hk, Lk, D]`` keys ``k`` in ``precision``, else a
    ValueError naming ``name``."""
    b, hk, lk, d = k.shape
    if not isinstance(ws, Quantized):
        raise TypeError(f"{name} must be a quant_workspace (Quantized), got {type(ws).__name__}")
    if any(getattr(ws, f).shape != shape or getattr(ws, f).dtype != dtype
           for f, (shape, dtype) in _buffers(b, hk, lk, d, block_size, precision).items()):
        raise ValueError(f"{name}: a quant_workspace made for other shapes or another precision than {precision!r}")
    return ws


def launch_mu(kbar: Tensor, kscale: Tensor, ws: Quantized, precision: str, *, zero_vmax: bool) -> None:
    """``μ`` into ``ws.mu`` (and, with ``zero_vmax``, a zeroed ``|v|`` maximum for the atomics of
    :func:`quantize`'s own ``|v|`` pass)."""
    b, hk, nk, d = kbar.shape
    zero = zero_vmax and needs_vmax(precision)
    kc = needs_kcmax(precision)
    _launch_mu((d,), (b * hk,), (kbar, kscale, ws.mu, ws.vmax if zero else ws.sigma, ws.kcmax if kc else ws.sigma,
                                 nk),
               dict(D=d, TJ=32, ZERO_VMAX=zero, ZERO_KCMAX=kc), num_warps=4)


def launch_quant(k: Tensor, v: Tensor, ws: Quantized, precision: str, block_size: int) -> None:
    """The copies of K (and V) into ``ws``, one program per key block, once ``ws.mu`` (and for
    e4m3 values ``ws.vmax``) hold their values."""
    b, hk, lk, d = k.shape
    nk = -(-lk // block_size)
    fm = formats(precision)
    # the (empty) buffers a precision does not write stand in by a written one (never touched)
    vmax = ws.vmax if needs_vmax(precision) else ws.sigma
    v8t, tau = (ws.v8t, ws.tau) if fm["WITH_V"] else (ws.k8, ws.sigma)
    vcs = ws.vcs if fm["V_INT8"] else ws.sigma
    kc = needs_kcmax(precision)
    check_token_strides(k=k, v=v)
    strides = (*k.stride(), *v.stride())
    _launch_quant((k.dtype, v.dtype, block_size, d, precision, spec_class(k, v, *strides)), (b * hk * nk,),
                  (k, v, ws.mu, vmax, ws.k8, ws.sigma, v8t, tau, vcs, ws.kcmax if kc else ws.sigma, *strides, hk, lk,
                   nk * block_size, nk),
                  dict(BS=block_size, D=d, KCMAX=kc, **fm), num_warps=QUANT_WARPS,
                  enable_fp_fusion=False)  # each rounding where the reference has it (no a·b + 0.5 in one FMA)


def quantize(k: Tensor, v: Tensor, kbar: Tensor, kscale: Tensor, block_size: int,
             ws: Quantized | None = None, precision: str = "fp8") -> Quantized:
    """Quantised keys (and values) of ``[B, Hk, Lk, D]`` views (any strides) for the low-precision
    attention kernel, in the formats of ``precision`` (:data:`pisa_attn.spec.PRODUCT_FORMATS`);
    ``kbar``/``kscale``: the statistics' float16 centroids and their per-head scale. ``ws``: a
    :func:`quant_workspace` of these shapes and this precision to write into.

    The planned low-precision backends get the same copies from ``prepare(..., quant=precision)``
    (:mod:`.prepare`), whose first read of V already gives the ``|v|`` maximum; this standalone
    pass reads V for it itself."""
    _check_precision(precision)
    b, hk, lk, d = k.shape
    nk = -(-lk // block_size)
    # the kernels index v, kbar and kscale by k's shape: another shape reads past them
    for name, x, shape in (("v", v, k.shape), ("kbar", kbar, (b, hk, nk, d)), ("kscale", kscale, (b, hk))):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)} for k of shape {tuple(k.shape)} and block_size "
                             f"{block_size}, got {tuple(x.shape)}")
    # μ's pass reads the centroids and their scales as contiguous arrays (a view would give another mean)
    kbar, kscale = kbar.contiguous(), kscale.contiguous()
    if ws is None:
        ws = quant_workspace(b, hk, lk, d, block_size, k.device, precision)
    checked(ws, k, block_size, precision)
    if b * hk == 0 or nk == 0:
        ws.mu.zero_()
        return ws
    check_token_strides(k=k, v=v)
    launch_mu(kbar, kscale, ws, precision, zero_vmax=True)
    if needs_vmax(precision):
        chunks = -(-nk // VMAX_BLOCKS)
        _launch_vmax((v.dtype, block_size, d, spec_class(v, *v.stride())), (b * hk * chunks,),
                     (v, ws.vmax, *v.stride(), hk, lk, nk, VMAX_BLOCKS, chunks), dict(BS=block_size, D=d),
                     num_warps=4 if d <= 64 else 8)
    launch_quant(k, v, ws, precision, block_size)
    return ws
