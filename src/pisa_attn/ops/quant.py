"""The FP8 exact phase's quantised math in PyTorch: what is rounded where (the statement the FP8
Hopper kernel, :mod:`pisa_attn.ops.hopper.fp8`, and the quantisation kernel,
:mod:`pisa_attn.ops.triton.quantize`, are tested against).

Only the exact blocks' two products run in FP8 e4m3 (3 mantissa bits, largest finite 448); the
centroid tail, the first-order term, the online softmax and every accumulation stay as in the
input-precision kernel (float32 accumulators, float16/bfloat16 tensor-core operands).

Every scale is a power of two, ``2^(floor(log2 amax) − 7)``: the largest entry of what a scale
covers lands in ``[128, 256)`` (every entry above ``amax·2^-14`` is a normal e4m3 number), and
dividing by it is exact, so the one rounding is the cast to e4m3 (round to nearest even). A zero
``amax`` gets the scale ``2^-126`` (the result is 0 either way; never a division by zero).

* **Keys**, per kv head, smoothed by one vector ``μ`` (the mean of the head's block centroids):
  ``k8_n = e4m3((k_n − μ) / σ_j)`` with one scale ``σ_j`` per key block (a per-token scale was
  0.5 % more accurate on DiT-like inputs and cost a vector of loads per block in the kernel). Smoothing shifts every
  exact score of query row ``t`` by the same constant ``s·q_t·μ`` (one number per row, whatever
  the key block), which the kernel adds back in float32 from the unquantised ``q``: the scores,
  the softmax and the log-sum-exp are those of the unsmoothed keys, up to the rounding of ``k − μ``.
  (A per-block mean ``k̄_j`` smooths a little better but needs ``q_t·k̄_j`` per exact block and
  row inside the loop; measured on DiT-like and DINOv2 inputs in notes/fp8.md.)
* **Queries**: ``q8_t = e4m3(q_t / ρ_t)``, one scale per query row (computed in the kernel's
  registers; a row scale multiplies a whole row of scores, a free per-row factor).
* **Scores** of an exact block: ``S_tn = s·(q8_t·k8_n)·ρ_t·σ_j + s·q_t·μ`` (float32 accumulation).
* **Probabilities**: ``P8_tn = e4m3(256·exp(S_tn − m_t))`` (``exp ≤ 1``, so ``256·p ≤ 256 < 448``;
  the factor keeps probabilities down to ``2^-14`` normal); the denominator sums the unrounded
  ``exp(S_tn − m_t)``. ``m_t`` is the running maximum when the block is processed: the kernel
  takes a row's exact blocks in ascending block order before any tail block, so it is the
  largest exact score of blocks ``≤ j``; the product is rescaled exactly to the row's final
  maximum afterwards.
* **Values**, per kv head and channel ``d``: ``v8_nd = e4m3(v_nd / τ_d)``, stored transposed
  ``[B, Hk, D, Lk']`` (the K-major layout an FP8 wgmma B operand needs), ``Lk'`` = ``Lk`` rounded
  up to whole blocks (zeros past ``Lk``). One scale per channel for the whole head lets every
  exact block add into one float32 accumulator (each block's product from zero); the exact part
  of the numerator is
  ``(Σ_j P8_j · v8_j) ⊙ τ / 256``, scaled once after the exact blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec import expand_kv_heads, num_blocks

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = 256.0
"""Probabilities are multiplied by this before their cast to e4m3 (and the product divided back)."""
MIN_EXP = -126


def pow2_scale(amax: Tensor) -> Tensor:
    """``2^(floor(log2 amax) − 7)`` elementwise (float32), ``2^-126`` where that would be smaller."""
    _, e = torch.frexp(amax.float())  # amax = m·2^e, m in [0.5, 1): floor(log2 amax) = e − 1
    e = torch.where(amax > 0, e - 8, torch.full_like(e, MIN_EXP)).clamp_min(MIN_EXP)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e)


def to_e4m3(x: Tensor) -> Tensor:
    """Round to e4m3 (nearest even), saturating at ±448 as the kernels' conversion does."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def head_key_mean(kbar: Tensor, kscale: Tensor) -> Tensor:
    """``μ`` ``[B, Hk, D]`` float32: the mean over key blocks of the statistics' float16
    centroids ``kbar`` ``[B, Hk, Nk, D]`` times their per-head power of two ``kscale`` ``[B, Hk]``.
    Any vector works as long as quantisation and the add-back use the same one."""
    return kbar.float().mean(2) * kscale.float()[..., None]


def quantize_kv(k: Tensor, v: Tensor, mu: Tensor, block_size: int):
    """``(k8 [B, Hk, Lk', D], sigma [B, Hk, Nk], v8t [B, Hk, D, Lk'], tau [B, Hk, D])`` from
    ``[B, Hk, Lk, D]`` keys and values (see the module docstring); ``Lk'`` = ``Nk·block_size``,
    rows past ``Lk`` are zero."""
    b, hk, lk, d = k.shape
    nk = num_blocks(lk, block_size)
    lkp = nk * block_size
    pad = lkp - lk
    kc = k.float() - mu.float()[:, :, None, :]
    kc = torch.nn.functional.pad(kc, (0, 0, 0, pad))
    sigma = pow2_scale(kc.view(b, hk, nk, block_size * d).abs().amax(-1))
    k8 = to_e4m3(kc / sigma.repeat_interleave(block_size, 2)[..., None])
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, pad))
    tau = pow2_scale(vf.abs().amax(2))
    v8 = to_e4m3(vf / tau[:, :, None, :])
    return k8, sigma, v8.transpose(2, 3).contiguous(), tau


def quantize_rows(q: Tensor) -> tuple[Tensor, Tensor]:
    """``(q8, rho)``: one power-of-two scale per row of ``q`` ``[..., D]``."""
    rho = pow2_scale(q.float().abs().amax(-1))
    return to_e4m3(q.float() / rho[..., None]), rho


def dequantized_kv(k8: Tensor, sigma: Tensor, v8t: Tensor, tau: Tensor, lk: int, block_size: int):
    """The float32 keys (still smoothed: without ``μ``) and values the FP8 products see, ``Lk`` rows."""
    kd = k8.float() * sigma.repeat_interleave(block_size, 2)[..., None]
    vd = v8t.float().transpose(2, 3) * tau[:, :, None, :]
    return kd[:, :, :lk], vd[:, :, :lk]


def fp8_pisa_forward(q: Tensor, k: Tensor, v: Tensor, kmean: Tensor, vsum: Tensor, hbar: Tensor, selected: Tensor,
                     *, mode: str, scale: float, block_size: int, alpha: Tensor | None = None,
                     mu: Tensor | None = None, rows_per_chunk: int = 1024) -> tuple[Tensor, Tensor]:
    """PISA with the exact blocks in the quantised math above: ``(out [B, H, Lq, D] float32, lse)``.

    ``kmean``/``vsum`` ``[B, Hk, Nk, D]``, ``hbar`` ``[B, Hk, D, D]`` (float32 statistics, as
    :func:`pisa_attn.ops.reference.block_stats` returns them), ``selected`` bool ``[B, H, Nq, Nk]``,
    ``mu`` ``[B, Hk, D]`` (default: the mean of ``kmean``). The tail is computed in float32 from
    the statistics (the kernel reads their float16/bfloat16 copies)."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    nk = num_blocks(lk, block_size)
    if mu is None:
        mu = kmean.float().mean(2)
    k8, sigma, v8t, tau = quantize_kv(k, v, mu, block_size)
    kd, vd = dequantized_kv(k8, sigma, v8t, tau, lk, block_size)
    kd, vd = expand_kv_heads(kd, h), expand_kv_heads(vd, h)
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
        q8, rho = quantize_rows(qc)
        sel = selected.index_select(2, torch.arange(r0, r1, device=q.device) // block_size)
        exact_tok = sel.index_select(-1, tok_block)
        s = (q8.float() @ kd.transpose(-1, -2)) * rho[..., None] * scale + (qc @ mux.transpose(-1, -2)) * scale
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
        # rounded against the running maximum over exact blocks 0..j, then rescaled to m exactly
        sp = torch.nn.functional.pad(s, (0, nk * block_size - lk), value=float("-inf"))
        sp = sp.view(*s.shape[:3], nk, block_size)
        m_run = sp.amax(-1).cummax(-1).values
        m_run = torch.where(torch.isfinite(m_run), m_run, m[..., None].expand_as(m_run))  # no exact block yet
        p8 = to_e4m3(P_SCALE * torch.exp(sp - m_run[..., None])).float() / P_SCALE
        p8 = (p8 * torch.exp(m_run - m[..., None])[..., None]).flatten(-2)[..., :lk]
        num = p8 @ vd
        if use_tail:
            a = torch.exp(c - m[..., None])
            denom = denom + a @ counts
            num = num + a @ vsx
            if mode == "hybrid":
                qh = (qc @ hbx) * scale
                w = 1.0 if alpha is None else alpha.float().to(q.device).view(1, h, 1, 1)
                num = num + a.sum(-1, keepdim=True) * qh * w
        out[:, :, r0:r1] = num / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        lse[:, :, r0:r1] = m + torch.log(denom)
    return out, lse
