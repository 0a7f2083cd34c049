"""Fused PISA attention (paper Algorithm 1) with one online softmax for every term.

One program per (query block, batch·head); query blocks vary fastest so the programs resident at
once share one head's keys and values in L2.

* Phase 1: exact attention over the program's index list (ascending key blocks, dynamic count).
* Phase 2 (``zeroth``/``hybrid``): scan of the centroids ``k̄_j`` in groups of ``C``, exact
  blocks masked through the selection bitmask. Weights ``α = exp(s q·k̄_j − m)`` enter the
  denominator as ``n_j α`` and the numerator as ``n_j α · V̂_j/n_j``.
* Phase 3 (``hybrid``): ``ℓ_tail · s (q H̄)`` once (``H̄`` in the input dtype).

Exact and tail scores share the running maximum ``m``; whenever it rises, the accumulator, the
denominator and the tail normaliser ``ℓ_tail`` are all rescaled by the same factor (a tail block
holding the row maximum is handled like any other). Scores are kept in base 2 (``log2 e`` folded
into the scale) so the exponentials are ``exp2``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import LN2, LOG2E, interpreting

MODE_IDS = {"drop": 0, "zeroth": 1, "hybrid": 2}
LN2_C = tl.constexpr(LN2)


@triton.jit
def _merge_max(m_i, s):
    """The one online-softmax step every term goes through (exact scores and centroid scores
    alike): raise the running max with a new score tile; return the new max, the factor that
    rescales everything accumulated so far (acc, the denominator and the tail normaliser), and
    the tile's weights exp2(s - m)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    return m_new, tl.exp2(m_i - m_new), tl.exp2(s - m_new[:, None])


# Shape scalars are not specialised (no recompiles across lengths/densities); strides still are.
@triton.jit(do_not_specialize=["H", "HK", "LQ", "LK", "NQ", "NK", "W", "NW", "L_BUCKET", "DENS_BUCKET"])
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, kbar_ptr, kbar_lo_ptr, vbar_ptr, hbar_ptr,
    idx_ptr, cnt_ptr, bits_ptr, o_ptr, lse_ptr,
    sqb, sqh, sql, sqd,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    sob, soh, sol, sod,
    H, HK, LQ, LK, NQ, NK, W, NW,
    qk_scale, scale,
    L_BUCKET, DENS_BUCKET,  # autotuning keys only
    BS: tl.constexpr, D: tl.constexpr, C: tl.constexpr, MODE: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr,
):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // (H // HK)
    offs_m = i * BS + tl.arange(0, BS)
    offs_n = tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
                mask=(offs_m < LQ)[:, None], other=0.0)
    LOWP = q.dtype
    # F32: Triton 3.9's interpreter mis-evaluates bfloat16 tl.dot, so there every dot operand is
    # widened to fp32 after the same low-precision rounding the GPU path applies.
    if F32:
        q = q.to(tl.float32)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    row = bh.to(tl.int64) * NQ + i

    m_i = tl.full([BS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BS], dtype=tl.float32)
    acc = tl.zeros([BS, D], dtype=tl.float32)

    n_exact = tl.load(cnt_ptr + row)
    for t in range(n_exact):
        j = tl.load(idx_ptr + row * W + t)
        cols = j * BS + offs_n
        if EVEN_K:
            kt = tl.load(k_base + cols[:, None] * skl + offs_d[None, :] * skd)
            vt = tl.load(v_base + cols[:, None] * svl + offs_d[None, :] * svd)
        else:
            kt = tl.load(k_base + cols[:, None] * skl + offs_d[None, :] * skd, mask=(cols < LK)[:, None], other=0.0)
            vt = tl.load(v_base + cols[:, None] * svl + offs_d[None, :] * svd, mask=(cols < LK)[:, None], other=0.0)
        if F32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt)) * qk_scale
        if not EVEN_K:
            s = tl.where((cols < LK)[None, :], s, float("-inf"))
        m_i, alpha, p = _merge_max(m_i, s)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p.to(LOWP)
        if F32:
            pv = pv.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, vt)

    if MODE > 0:
        l_tail = tl.zeros([BS], dtype=tl.float32)
        if n_exact < NK:
            stat_base = (b * HK + hk) * NK
            offs_c = tl.arange(0, C)
            for g0 in range(0, NK, C):
                cj = g0 + offs_c
                cvalid = cj < NK
                word = tl.load(bits_ptr + row * NW + cj // 32, mask=cvalid, other=-1)
                tail = (((word >> (cj % 32)) & 1) == 0) & cvalid
                kb = tl.load(kbar_ptr + (stat_base + cj)[:, None] * D + offs_d[None, :], mask=cvalid[:, None], other=0.0)
                vb = tl.load(vbar_ptr + (stat_base + cj)[:, None] * D + offs_d[None, :], mask=cvalid[:, None], other=0.0)
                if F32:
                    kb = kb.to(tl.float32)
                    vb = vb.to(tl.float32)
                sc = tl.dot(q, tl.trans(kb))
                if SPLIT:  # k̄ = hi + lo: centroid scores as accurate as the exact ones
                    kl = tl.load(kbar_lo_ptr + (stat_base + cj)[:, None] * D + offs_d[None, :], mask=cvalid[:, None], other=0.0)
                    if F32:
                        kl = kl.to(tl.float32)
                    sc = tl.dot(q, tl.trans(kl), sc)
                sc = sc * qk_scale
                sc = tl.where(tail[None, :], sc, float("-inf"))
                m_i, alpha, a = _merge_max(m_i, sc)
                n_j = tl.minimum(LK - cj * BS, BS).to(tl.float32)
                an = a * n_j[None, :]
                l_i = l_i * alpha + tl.sum(an, axis=1)
                l_tail = l_tail * alpha + tl.sum(a, axis=1)
                anv = an.to(LOWP)
                if F32:
                    anv = anv.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(anv, vb)
        if MODE == 2:
            hbv = tl.load(hbar_ptr + (b * HK + hk) * D * D + offs_d[:, None] * D + offs_d[None, :])
            if F32:
                hbv = hbv.to(tl.float32)
            qh = tl.dot(q, hbv)
            acc += (l_tail * scale)[:, None] * qh

    out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2_C
    rvalid = offs_m < LQ
    tl.store(o_ptr + b * sob + h * soh + offs_m[:, None] * sol + offs_d[None, :] * sod,
             out.to(o_ptr.dtype.element_ty), mask=rvalid[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * LQ + offs_m, lse, mask=rvalid)


FIXED_CONFIG = {"C": 32, "num_warps": 4, "num_stages": 2}


def _configs():
    if interpreting():
        return [triton.Config({"C": 16}, num_warps=4, num_stages=1)]
    # H100 run 1 (notes): 8 warps lost everywhere (2x slower); the exact loop likes 3 stages; the
    # tail scan wants 2 stages so two programs fit per SM (C=32 keeps its k̄ hi/lo + V̂ buffers at
    # the exact loop's size; C=64 won at D=128, C=32 at D=64).
    # (v3 also offered NB=2, two gathered key blocks per step as [64 x 128] tiles: the autotuner
    # picked NB=1 for every shape on the H100, so it was removed.)
    return [triton.Config({"C": c}, num_warps=4, num_stages=s) for c, s in ((64, 2), (64, 3), (32, 2))]


def _prune(configs, named_args, **kwargs):
    mode = kwargs.get("MODE", named_args.get("MODE", 2))
    if mode == 0:  # no tail scan: C is irrelevant
        keep = [c for c in configs if c.kwargs["C"] == 64]
    else:  # deeper tail buffers do not leave room for two programs per SM
        keep = [c for c in configs if c.num_stages == 2]
    return keep or configs


_attn_tuned = triton.autotune(
    configs=_configs(),
    key=["L_BUCKET", "DENS_BUCKET", "BS", "D", "MODE", "EVEN_K", "SPLIT"],
    prune_configs_by={"early_config_prune": _prune},
)(_attn_kernel)


def _alloc_like_layout(q: Tensor) -> Tensor:
    """Output with q's physical layout: a [B, L, H, D] buffer when q is such a transposed view, so
    the caller's transpose back to that layout is free."""
    b, h, lq, d = q.shape
    if q.stride(1) < q.stride(2):
        return torch.empty(b, lq, h, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    return torch.empty(b, h, lq, d, device=q.device, dtype=q.dtype)


def autotune_key(lk: int, density: float) -> tuple[int, int]:
    """Shape classes that change the best config: length (<=8K, <=32K, longer) and density (<20%)."""
    return (0 if lk <= 8192 else 1 if lk <= 32768 else 2), (0 if density < 0.2 else 1)


def attention(
    q: Tensor, k: Tensor, v: Tensor,
    kbar: Tensor, kbar_lo: Tensor | None, vbar: Tensor, hbar: Tensor,
    idx: Tensor, cnt: Tensor, bits: Tensor,
    *, mode: str, scale: float, block_size: int, n_select: int,
    out: Tensor | None = None, lse: Tensor | None = None, config: dict | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the fused kernel for a given selection; returns (out [B,H,Lq,D], lse [B,H,Lq] fp32).

    ``out``/``lse`` may be passed in (tests poison them); ``config`` ({C, num_warps, num_stages})
    bypasses autotuning, as does ``PISA_ATTN_AUTOTUNE=0``.
    """
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    nq, nk = -(-lq // block_size), -(-lk // block_size)
    if out is None:
        out = _alloc_like_layout(q)
    if lse is None:
        lse = torch.empty(b, h, lq, device=q.device, dtype=torch.float32)
    args = (
        q, k, v, kbar, kbar if kbar_lo is None else kbar_lo, vbar, hbar, idx, cnt, bits, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, hk, lq, lk, nq, nk, idx.shape[-1], bits.shape[-1],
        scale * LOG2E, scale,
        *autotune_key(lk, n_select / nk),
    )
    meta = dict(BS=block_size, D=d, MODE=MODE_IDS[mode], EVEN_K=lk % block_size == 0,
                SPLIT=kbar_lo is not None, F32=interpreting())
    grid = (nq, b * h)
    if interpreting():
        _attn_kernel[grid](*args, **meta, C=16, num_warps=4)  # small groups: several per row
    elif config is not None or os.environ.get("PISA_ATTN_AUTOTUNE", "1") == "0":
        _attn_kernel[grid](*args, **meta, **dict(FIXED_CONFIG, **(config or {})))
    else:
        _attn_tuned[grid](*args, **meta)
    return out, lse
