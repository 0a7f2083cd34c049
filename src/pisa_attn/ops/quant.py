"""The low-precision exact phase's quantised math in PyTorch: what is rounded where (the statement
the Hopper kernel, :mod:`pisa_attn.ops.hopper.fp8`, and the quantisation pass,
:mod:`pisa_attn.ops.triton.quantize`, are tested against).

Only the exact blocks' two products are quantised, each in one format
(:data:`pisa_attn.spec.PRODUCT_FORMATS`): ``Q·Kᵀ`` in FP8 e4m3 (``"fp8"``) or INT8 (``"int8-fp8"``,
``"int8-int8"``, ``"int8"``), ``P·V`` in FP8 e4m3 (``"fp8"``, ``"int8-fp8"``), INT8
(``"int8-int8"``) or the input dtype (``"int8"``). The
centroid tail, the first-order term, the online softmax and every accumulation stay as in the
input-precision kernel (float32 accumulators, float16/bfloat16 tensor-core operands).

**e4m3** (3 mantissa bits, largest finite 448): every scale is a power of two,
``2^(floor(log2 amax) − 7)``: the largest entry of what a scale covers lands in ``[128, 256)``
(every entry above ``amax·2^-14`` is a normal e4m3 number), and dividing by it is exact, so the
one rounding is the cast to e4m3 (round to nearest even). A zero ``amax`` gets the scale
``2^-126`` (the result is 0 either way; never a division by zero).

**int8** (symmetric, ``[-127, 127]``): the scale of what a scale covers is ``amax / 127`` and the
codes are ``round(x · (127 / amax))`` (both quotients one float32 division rounded to nearest,
the product rounded to float32, then ``trunc(y ± 0.5)`` with the sum in float32: half away from
zero, except that the sum itself may round up, e.g. 0.49999997 → 1; clamped to ±127); a zero ``amax`` gives scale 0 and codes 0. The products are exact in the int32
accumulator (``|Σ| ≤ 128·127² < 2^24``, so also exact as float32) and the scales multiply the
float32 result.

* **Keys**, per kv head, smoothed by one vector ``μ`` (the mean of the head's block centroids):
  ``k8_n = Q((k_n − μ) / σ_j)`` (``k − μ`` in float32) with one scale ``σ_j`` per key block (a
  per-token scale was 0.5 % more accurate with e4m3 on DiT-like inputs and cost a vector of loads
  per block in the kernel). Smoothing shifts every exact score of query row ``t`` by the same
  constant ``s·q_t·μ`` (one number per row, whatever the key block), which the kernel adds back
  in float32 from the unquantised ``q``: the scores, the softmax and the log-sum-exp are those
  of the unsmoothed keys, up to the rounding of ``k − μ``. (A per-block mean ``k̄_j`` smooths
  better, most for e4m3 scores, but needs ``q_t·k̄_j`` per exact block and row inside the loop;
  measured on DiT-like inputs in notes/fp8.md.)
* **Queries**: ``q8_t = Q(q_t / ρ_t)``, one scale per query row (computed in the kernel's
  registers from ``q`` in float32; a row scale multiplies a whole row of scores, a free per-row
  factor). The kernel's int8 ``127 / amax`` is the GPU's fast float32 division (within 2 ulp of
  the reference's): a code can differ by one where ``q_t·127/amax`` lands within that of a
  half-integer.
* **Scores** of an exact block: ``S_tn = s·(q8_t·k8_n)·ρ_t·σ_j + s·q_t·μ`` (float32).
* **Probabilities**: ``P_tn = R(256·exp(S_tn − m_t)) / 256`` with ``R`` the cast to e4m3 or, for
  ``P·V`` in the input dtype, to the input dtype (``exp ≤ 1``, so ``256·p ≤ 256 < 448``; the factor
  keeps e4m3 probabilities down to ``2^-14`` normal, and is exact in 16 bits); for INT8 ``P·V``
  ``P_tn = round(255·exp(S_tn − b_tj)) / 255`` (to nearest, ties to even), an unsigned 8-bit
  code against ``b_tj``, the row's largest score in this block (every block's largest
  probability is the code 255; the block's product is then rescaled by ``exp(b_tj − m_t)`` in
  float32: an absolute step of 1/255 of the block's own maximum, where codes against the running
  maximum waste their range on blocks below it and signed codes ``round(127·p)`` have half the
  resolution; measured in notes/fp8.md). The kernel feeds the signed wgmma ``c − 128`` and adds
  ``128·Σ_n v8_nd`` per block back to the int32 sum, the same integer. The denominator
  sums the unrounded ``exp(S_tn − m_t)``. ``m_t`` is the running maximum when the block is
  processed: the kernel takes a row's exact blocks in ascending block order before any tail
  block, so it is the largest exact score of blocks ``≤ j``; the product is rescaled exactly to
  the row's final maximum afterwards. One exception: where the kernel holds the exact loop's
  maximum at the per-row bound of the scores (``"int8"`` from
  :data:`pisa_attn.ops.hopper.attention.EXACT_MIN_KEYS` keys, when the bound is within its slack
  of the first block's maximum), ``P`` is rounded to the input dtype against that bound instead;
  the two differ by that dtype's rounding of ``p`` (the GPU tests compare them at that tolerance).
* **Values** in e4m3, per kv head and channel ``d``: ``v8_nd = e4m3(v_nd / τ_d)``, stored
  transposed ``[B, Hk, D, Lk']`` (the K-major layout an FP8 wgmma B operand needs), ``Lk'`` =
  ``Lk`` rounded up to whole blocks (zeros past ``Lk``). One scale per channel for the whole head
  lets every exact block add into one float32 accumulator (each block's product from zero); the
  exact part of the numerator is ``(Σ_j P8_j · v8_j) ⊙ τ``, scaled once after the exact blocks.
  In INT8 the same layout with one scale per key block and channel, ``v8_nd = Q(v_nd / τ_jd)``
  with ``τ_jd = amax_jd / 127`` (the keys' rounding): each block's product is scaled as it is
  added (it is added from zero anyway), and a block's codes use their full range. In the input
  dtype the values are ``v`` as given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec import PRODUCT_FORMATS, check_mode, check_precision, expand_kv_heads, num_blocks

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = 256.0
"""Probabilities are multiplied by this before their cast to e4m3 or the input dtype (and the
product divided back)."""
P_SCALES = {"e4m3": P_SCALE, "input": P_SCALE, "int8": 255.0}
"""The factor per ``P·V`` format: INT8 probabilities are the codes ``round(255·p)``."""
MIN_EXP = -126
INT8_MAX = 127.0
# The smallest amax an int8 scale is taken from: 127 / amax stays finite (float32) above it; a
# smaller nonzero amax (bfloat16 only) is quantised against it, with correspondingly fewer levels.
INT8_MIN_AMAX = 2.0**-121


def pow2_scale(amax: Tensor) -> Tensor:
    """``2^(floor(log2 amax) − 7)`` elementwise (float32), ``2^-126`` where that would be smaller."""
    _, e = torch.frexp(amax.float())  # amax = m·2^e, m in [0.5, 1): floor(log2 amax) = e − 1
    e = torch.where(amax > 0, e - 8, torch.full_like(e, MIN_EXP)).clamp_min(MIN_EXP)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e)


def to_e4m3(x: Tensor) -> Tensor:
    """Round to e4m3 (nearest even), saturating at ±448 as the kernels' conversion does."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def int8_scale(amax: Tensor) -> tuple[Tensor, Tensor]:
    """``(amax / 127, 127 / amax)`` in float32 (each one rounded division), ``(0, 0)`` where
    ``amax`` is 0; ``amax`` is taken as at least :data:`INT8_MIN_AMAX`."""
    a = amax.float()
    pos = a > 0
    safe = torch.where(pos, a.clamp_min(INT8_MIN_AMAX), torch.ones_like(a))
    c = torch.full_like(a, INT8_MAX)
    return torch.where(pos, safe / c, 0.0), torch.where(pos, c / safe, 0.0)


def to_int8(x: Tensor, inv: Tensor) -> Tensor:
    """``x·inv`` (float32) to int8 as ``trunc(y ± 0.5)`` (the sum in float32), clamped to ±127."""
    y = x.float() * inv.float()
    return torch.trunc(y + torch.where(y >= 0, 0.5, -0.5)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_block_rows(x: Tensor, amax: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """``(codes, scale)`` of ``x`` under one scale per entry of ``amax`` (broadcast against ``x``)
    in format ``fmt`` (``"e4m3"`` or ``"int8"``); the codes as float8_e4m3fn or int8."""
    if fmt == "e4m3":
        sc = pow2_scale(amax)
        return to_e4m3(x / sc), sc
    if fmt == "int8":
        sc, inv = int8_scale(amax)
        return to_int8(x, inv), sc
    raise ValueError(f"fmt must be 'e4m3' or 'int8', got {fmt!r}")


def head_key_mean(kbar: Tensor, kscale: Tensor) -> Tensor:
    """``μ`` ``[B, Hk, D]`` float32: the mean over key blocks of the statistics' float16
    centroids ``kbar`` ``[B, Hk, Nk, D]`` times their per-head power of two ``kscale`` ``[B, Hk]``.
    Any vector works as long as quantisation and the add-back use the same one."""
    return kbar.float().mean(2) * kscale.float()[..., None]


def quantize_k(k: Tensor, mu: Tensor, block_size: int, fmt: str = "e4m3") -> tuple[Tensor, Tensor]:
    """``(k8 [B, Hk, Lk', D], sigma [B, Hk, Nk])``: the smoothed keys ``k − μ`` of ``[B, Hk, Lk, D]``
    keys in ``fmt`` (``"e4m3"``: float8_e4m3fn, ``"int8"``: int8), one scale per key block;
    ``Lk'`` = ``Nk·block_size``, rows past ``Lk`` are zero."""
    b, hk, lk, d = k.shape
    nk = num_blocks(lk, block_size)
    kc = k.float() - mu.float()[:, :, None, :]
    kc = torch.nn.functional.pad(kc, (0, 0, 0, nk * block_size - lk))
    amax = kc.reshape(b, hk, nk, block_size * d).abs().amax(-1)  # reshape: k may be a strided view
    k8, sigma = quantize_block_rows(kc, amax.repeat_interleave(block_size, 2)[..., None], fmt)
    return k8, sigma[..., ::block_size, 0]


def smoothed_key_maxima(k: Tensor, mu: Tensor) -> Tensor:
    """``max_n |k_nd − μ_d|`` per channel ``[B, Hk, D]`` float32 over the head's ``[B, Hk, Lk, D]``
    keys: with P·V in the input dtype the exact loop bounds its scores by ``s·σ_q·Σ_d |y_d|·(c_d +
    max c / 127)``, ``c`` this, ``y`` a row's int8 codes and ``σ_q`` their scale (the codes' rounding
    included)."""
    return (k.float() - mu.float()[:, :, None, :]).abs().amax(2)


def quantize_kv(k: Tensor, v: Tensor, mu: Tensor, block_size: int):
    """``(k8 [B, Hk, Lk', D], sigma [B, Hk, Nk], v8t [B, Hk, D, Lk'], tau [B, Hk, D])`` from
    ``[B, Hk, Lk, D]`` keys and values, all in e4m3 (see the module docstring); ``Lk'`` =
    ``Nk·block_size``, rows past ``Lk`` are zero."""
    k8, sigma = quantize_k(k, mu, block_size, "e4m3")
    v8t, tau = quantize_v(v, block_size)
    return k8, sigma, v8t, tau


def quantize_v(v: Tensor, block_size: int, fmt: str = "e4m3") -> tuple[Tensor, Tensor]:
    """``(v8t [B, Hk, D, Lk'], tau)``: values in ``fmt``, transposed, rows past ``Lk`` zero; e4m3
    with one scale per channel and kv head (``tau [B, Hk, D]``), int8 with one per key block and
    channel (``tau [B, Hk, Nk, D]``)."""
    b, hk, lk, d = v.shape
    nk = num_blocks(lk, block_size)
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, nk * block_size - lk))
    if fmt == "int8":
        vb = vf.reshape(b, hk, nk, block_size, d)
        v8, tau = quantize_block_rows(vb, vb.abs().amax(3, keepdim=True), fmt)
        return v8.view(b, hk, nk * block_size, d).transpose(2, 3).contiguous(), tau[:, :, :, 0, :]
    v8, tau = quantize_block_rows(vf, vf.abs().amax(2, keepdim=True), fmt)
    return v8.transpose(2, 3).contiguous(), tau[:, :, 0, :]


def dequantized_v(v8t: Tensor, tau: Tensor, lk: int, block_size: int) -> Tensor:
    """The float32 values ``[B, Hk, Lk, D]`` the 8-bit ``P·V`` sees (either scale layout)."""
    if tau.dim() == 4:  # per key block and channel
        tau = tau.repeat_interleave(block_size, 2)
    else:
        tau = tau[:, :, None, :]
    return (v8t.float().transpose(2, 3) * tau)[:, :, :lk]


def value_code_sums(v8t: Tensor, block_size: int) -> Tensor:
    """``[B, Hk, Nk, D]`` int32: the sum of each key block's INT8 value codes per channel (what the
    kernel adds back, times 128, to a block's ``(c − 128)·v8`` sum)."""
    b, hk, d, lkp = v8t.shape
    sums = v8t.to(torch.int32).view(b, hk, d, lkp // block_size, block_size).sum(-1, dtype=torch.int32)
    return sums.transpose(2, 3).contiguous()


def quantize_rows(q: Tensor, fmt: str = "e4m3") -> tuple[Tensor, Tensor]:
    """``(q8, rho)``: one scale per row of ``q`` ``[..., D]`` in ``fmt``."""
    qf = q.float()
    q8, rho = quantize_block_rows(qf, qf.abs().amax(-1, keepdim=True), fmt)
    return q8, rho[..., 0]


def dequantized_k(k8: Tensor, sigma: Tensor, lk: int, block_size: int) -> Tensor:
    """The float32 keys (still smoothed: without ``μ``) the quantised ``Q·Kᵀ`` sees, ``Lk`` rows."""
    return (k8.float() * sigma.repeat_interleave(block_size, 2)[..., None])[:, :, :lk]


def dequantized_kv(k8: Tensor, sigma: Tensor, v8t: Tensor, tau: Tensor, lk: int, block_size: int):
    """The float32 keys (still smoothed: without ``μ``) and values the FP8 products see, ``Lk`` rows."""
    return dequantized_k(k8, sigma, lk, block_size), dequantized_v(v8t, tau, lk, block_size)


def lowp_pisa_forward(q: Tensor, k: Tensor, v: Tensor, kmean: Tensor, vsum: Tensor, hbar: Tensor, selected: Tensor,
                      *, mode: str, scale: float, block_size: int, precision: str = "fp8",
                      alpha: Tensor | None = None, mu: Tensor | None = None,
                      rows_per_chunk: int = 1024) -> tuple[Tensor, Tensor]:
    """PISA with the exact blocks in the quantised math above, the products in the formats of
    ``precision`` (:data:`pisa_attn.spec.PRODUCT_FORMATS`): ``(out [B, H, Lq, D] float32, lse)``.

    ``kmean``/``vsum`` ``[B, Hk, Nk, D]``, ``hbar`` ``[B, Hk, D, D]`` (float32 statistics, as
    :func:`pisa_attn.ops.reference.block_stats` returns them), ``selected`` bool ``[B, H, Nq, Nk]``,
    ``mu`` ``[B, Hk, D]`` (default: the mean of ``kmean``). The tail is computed in float32 from
    the statistics (the kernel reads their float16/bfloat16 copies)."""
    check_precision(precision)
    if precision not in PRODUCT_FORMATS:
        raise ValueError(f"precision must be a low precision {tuple(PRODUCT_FORMATS)}, got {precision!r}")
    check_mode(mode)
    if mode == "first":
        raise ValueError("mode='first' has no low-precision math (the kernel refuses it too): use 'hybrid', "
                         "'zeroth' or 'drop'")
    qk_fmt, pv_fmt = PRODUCT_FORMATS[precision]
    b, h, lq, d = q.shape
    if alpha is not None and (not isinstance(alpha, Tensor) or alpha.numel() != h):
        raise ValueError(f"alpha must be a tensor of one weight per query head ({h}), got "
                         f"{tuple(alpha.shape) if isinstance(alpha, Tensor) else type(alpha).__name__}")
    lk = k.shape[2]
    nk = num_blocks(lk, block_size)
    # indexed by q's and k's blocks below: another shape was read in part or broadcast over heads
    nq = num_blocks(lq, block_size)
    if not isinstance(selected, Tensor) or selected.dtype != torch.bool or selected.shape != (b, h, nq, nk):
        got = f"{selected.dtype} {tuple(selected.shape)}" if isinstance(selected, Tensor) else type(selected).__name__
        raise ValueError(f"selected must be a bool [B, H, Nq, Nk] = {[b, h, nq, nk]} tensor, got {got}")
    if mu is None:
        mu = kmean.float().mean(2)
    k8, sigma = quantize_k(k, mu, block_size, qk_fmt)
    k8x = expand_kv_heads(k8.float()[:, :, :lk], h)
    sig_tok = expand_kv_heads(sigma.repeat_interleave(block_size, 2)[:, :, None, :lk], h)
    if pv_fmt != "input":
        v8t, tau = quantize_v(v, block_size, pv_fmt)
        vd = dequantized_v(v8t, tau, lk, block_size)
    else:  # the values as given; P rounded to their dtype
        vd = v.float()
    vd = expand_kv_heads(vd, h)
    mux = expand_kv_heads(mu.float()[:, :, None, :], h)
    kmx, vsx, hbx = (expand_kv_heads(x.float(), h) for x in (kmean, vsum, hbar))
    counts = torch.full((nk,), float(block_size), device=q.device)
    counts[-1] = lk - (nk - 1) * block_size
    tok_block = torch.arange(lk, device=q.device) // block_size
    out = torch.empty(b, h, lq, d, device=q.device)
    lse = torch.empty(b, h, lq, device=q.device)
    for r0 in range(0, lq, rows_per_chunk):
        r1 = min(lq, r0 + rows_per_chunk)
        qc = q[:, :, r0:r1].float()
        q8, rho = quantize_rows(qc, qk_fmt)
        sel = selected.index_select(2, torch.arange(r0, r1, device=q.device) // block_size)
        exact_tok = sel.index_select(-1, tok_block)
        raw = q8.float() @ k8x.transpose(-1, -2)
        s = raw * (sig_tok * (rho[..., None] * scale)) + (qc @ mux.transpose(-1, -2)) * scale
        s = s.masked_fill(~exact_tok, float("-inf"))
        m = s.amax(-1)
        use_tail = mode != "drop"
        if use_tail:
            c = (qc @ kmx.transpose(-1, -2)) * scale
            c = c.masked_fill(sel, float("-inf"))
            m = torch.maximum(m, c.amax(-1))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m[..., None])
        denom = p.sum(-1)
        # rounded against the running maximum over exact blocks 0..j (INT8: the block's own
        # maximum), then rescaled to m exactly
        sp = torch.nn.functional.pad(s, (0, nk * block_size - lk), value=float("-inf"))
        sp = sp.view(*s.shape[:3], nk, block_size)
        m_ref = sp.amax(-1) if pv_fmt == "int8" else sp.amax(-1).cummax(-1).values
        m_ref = torch.where(torch.isfinite(m_ref), m_ref, m[..., None].expand_as(m_ref))  # no exact score there
        ps = P_SCALES[pv_fmt]
        p8 = _round_p(ps * torch.exp(sp - m_ref[..., None]), pv_fmt, v.dtype) / ps
        p8 = (p8 * torch.exp(m_ref - m[..., None])[..., None]).flatten(-2)[..., :lk]
        num = p8 @ vd
        if use_tail:
            a = torch.exp(c - m[..., None])
            denom = denom + a @ counts
            num = num + a @ vsx
            if mode == "hybrid":
                qh = (qc @ hbx) * scale
                w = 1.0 if alpha is None else alpha.float().to(q.device).view(1, h, 1, 1)
                at = a.sum(-1, keepdim=True)  # no tail weight: no first-order term (not 0 * an overflowed q·H̄)
                num = num + torch.where(at > 0, at * qh * w, 0.0)
        out[:, :, r0:r1] = num / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        lse[:, :, r0:r1] = m + torch.log(denom)
    return out, lse


def _round_p(p: Tensor, pv_fmt: str, dtype: torch.dtype) -> Tensor:
    """The scaled probabilities ``P_SCALES[pv_fmt]·p`` as ``P·V`` sees them (float32)."""
    if pv_fmt == "e4m3":
        return to_e4m3(p).float()
    if pv_fmt == "int8":  # to nearest, ties to even (the kernel adds 1.5·2^23 in float32)
        return torch.round(p)
    return p.to(dtype).float() if dtype in (torch.float16, torch.bfloat16) else p
