"""Fused PISA attention (paper Algorithm 1) with one online softmax for every term.

One program per (query block, batch·head); query blocks vary fastest so the programs resident at
once share one head's keys and values in L2.

* Phase 1: exact attention over the program's index list (ascending key blocks, dynamic count).
* Phase 2 (``zeroth``/``hybrid``): scan of the centroids ``k̄_j`` in groups of ``C``, exact
  blocks masked through the selection bitmask. ``log n_j`` is added to the centroid score, so the
  weight ``n_j α`` (``α = exp(s q·k̄_j − m)``) comes out of the same online-softmax step as an
  exact tile's and multiplies the value means ``V̂_j/n_j`` (the same arithmetic as an exact
  tile, through the same ``_step``). The score is one float16 product of q and the power-of-two-scaled k̄ (see
  ``prepare``), both scales folded back afterwards.
* Phase 3 (``hybrid``): ``ℓ_tail · α_h s (q H̄)`` once (``H̄`` in the input dtype; ``α_h`` the
  weight of the first-order term for the program's query head, one float from ``alpha_ptr``).

Exact and tail scores share the running maximum ``m``; whenever it rises, the accumulator, the
denominator and the tail normaliser ``ℓ_tail`` are all rescaled by the same factor (a tail block
holding the row maximum is handled like any other). Scores are kept in base 2 (``log2 e`` folded
into the scale) so the exponentials are ``exp2``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import tail_weight
from ..kernel_constants import LN2, LOG2E, MODE_IDS
from ..launch import Launcher, spec_class, unrecordable
from ._common import check_token_strides, interpreting, rows_past_int32

LN2_C = tl.constexpr(LN2)


@triton.jit
def _merge_max(m_i, s):
    """The one online-softmax step every term goes through (exact scores and centroid scores
    alike): raise the running max with a new score tile; return the new max, the factor that
    rescales everything accumulated so far (acc, the denominator and the tail normaliser), and
    the tile's weights exp2(s - m)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing seen yet (-inf so far, e.g. a fully masked centroid group) keeps finite
    # arithmetic: exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m_i - m_use), tl.exp2(s - m_use[:, None])


@triton.jit
def _step(m_i, l_i, acc, s, v, LOWP: tl.constexpr, F32: tl.constexpr):
    """One key tile (exact keys, or a group of centroids) into the running (m, l, acc): returns
    them updated plus the rescale factor and the tile's row sums (the tail normaliser needs both)."""
    m_i, rescale, p = _merge_max(m_i, s)
    ps = tl.sum(p, axis=1)
    pv = p.to(LOWP)
    if F32:
        pv = pv.to(tl.float32)
    return m_i, l_i * rescale + ps, acc * rescale[:, None] + tl.dot(pv, v), rescale, ps


@triton.jit
def _tail_phase(q, m_i, l_i, acc, l_tail, kbar_ptr, kscale_ptr, vbar_ptr, bits_ptr, row, NW, stat_base, n_exact,
                NK, LK, qk_scale, offs_d, BS: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
                EVEN_K: tl.constexpr, LOG2_BS: tl.constexpr, LOWP: tl.constexpr, F32: tl.constexpr,
                S_TAIL: tl.constexpr):
    """Phase 2: the centroids of every key block outside the row's exact set, in groups of C,
    through the same online-softmax step as the exact tiles; returns (m, l, acc, Σ_tail α)."""
    if n_exact < NK:
        # q in float16, scaled by a power of two so its largest entry sits in [2^13, 2^14):
        # bf16 -> fp16 is then exact (8 mantissa bits into 11) whatever the magnitude.
        qf = q.to(tl.float32)
        qmax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
        q_s = tl.where(qmax > 0, tl.exp2(tl.ceil(tl.log2(qmax)) - 14.0), 1.0)
        q16 = (qf / q_s).to(tl.float16)
        if F32:
            q16 = q16.to(tl.float32)
        offs_c = tl.arange(0, C)
        sc_scale = qk_scale * q_s * tl.load(kscale_ptr + stat_base // NK)  # all scales: powers of 2
        for g0 in tl.range(0, NK, C, num_stages=S_TAIL):
            cj = g0 + offs_c
            cvalid = cj < NK
            # The group's bits from one or two scalar words: the mask is then built from aranges
            # and scalars in the score tile's own layout (a per-column gather needed a layout
            # conversion through shared memory every group).
            w0 = g0 // 32
            pos = g0 % 32 + offs_c
            word = tl.load(bits_ptr + row * NW + w0)
            if C > 32:  # then C and g0 are multiples of 64: bits 32.. come from the next word
                word_hi = tl.load(bits_ptr + row * NW + w0 + 1, mask=w0 + 1 < NW, other=-1)
                word = tl.where(pos < 32, word, word_hi)
            tail = (((word >> (pos % 32)) & 1) == 0) & cvalid
            kb = tl.load(kbar_ptr + (stat_base + cj)[:, None] * D + offs_d[None, :], mask=cvalid[:, None], other=0.0)
            vb = tl.load(vbar_ptr + (stat_base + cj)[:, None] * D + offs_d[None, :], mask=cvalid[:, None], other=0.0)
            if F32:
                kb = kb.to(tl.float32)
                vb = vb.to(tl.float32)
            # s·q·k̄_j + log2 n_j (base 2): the weight is n_j α straight from the softmax step.
            sc = tl.dot(q16, tl.trans(kb)) * sc_scale
            if EVEN_K:
                sc = sc + LOG2_BS
            else:
                n_j = tl.maximum(tl.minimum(LK - cj * BS, BS), 1).to(tl.float32)  # 1: padding columns
                sc = sc + tl.log2(n_j)[None, :]
            sc = tl.where(tail[None, :], sc, float("-inf"))
            m_i, l_i, acc, rescale, ps = _step(m_i, l_i, acc, sc, vb, LOWP, F32)
            # l_tail holds BS·Σα: every block but a ragged last one has n_j = BS.
            l_tail = l_tail * rescale + ps
            if not EVEN_K:
                if g0 + C >= NK:  # the group holding the ragged last block
                    n_last = (LK - (NK - 1) * BS).to(tl.float32)
                    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
                    a_last = tl.sum(tl.where((cj == NK - 1)[None, :], tl.exp2(sc - m_use[:, None]), 0.0), axis=1)
                    l_tail += a_last * (BS / n_last - 1.0)
    return m_i, l_i, acc, l_tail


@triton.jit
def _rows(base, row0, r, stride, ROW64: tl.constexpr):
    """``[len(r), 1]`` pointers to rows ``row0 + r``. ``ROW64``: the first row's offset in int64 (a
    view whose row index times token stride passes 2^31 elements: sequence-first layouts at video
    lengths), the rest in int32 as otherwise (which measured 4-7 % faster than int64 bases here)."""
    if ROW64:
        return base + tl.cast(row0, tl.int64) * stride + r[:, None] * stride
    else:
        return base + (row0 + r)[:, None] * stride


# Shape scalars are not specialised (no recompiles across lengths/densities); strides still are.
@triton.jit(do_not_specialize=["H", "HK", "LQ", "LK", "NQ", "NK", "W", "NW", "L_BUCKET", "DENS_BUCKET"])
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, kbar_ptr, kscale_ptr, vbar_ptr, hbar_ptr, hscale_ptr, alpha_ptr,
    idx_ptr, cnt_ptr, bits_ptr, o_ptr, lse_ptr,
    sqb, sqh, sql, sqd,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    sob, soh, sol, sod,
    H, HK, LQ, LK, NQ, NK, W, NW,
    qk_scale, scale,
    L_BUCKET, DENS_BUCKET,  # autotuning keys only
    BS: tl.constexpr, D: tl.constexpr, C: tl.constexpr, MODE: tl.constexpr, LOG2_BS: tl.constexpr,
    EVEN_K: tl.constexpr, F32: tl.constexpr,
    S_EXACT: tl.constexpr = None, S_TAIL: tl.constexpr = None, ROW64: tl.constexpr = False,
):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // (H // HK)
    offs_m = i * BS + tl.arange(0, BS)
    offs_n = tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    q = tl.load(_rows(q_ptr + b * sqb + h * sqh, i * BS, offs_n, sql, ROW64) + offs_d[None, :] * sqd,
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
    l_tail = tl.zeros([BS], dtype=tl.float32)  # Σ_tail α (without n_j): the first order's weight
    stat_base = (b * HK + hk) * NK
    for t in tl.range(0, n_exact, num_stages=S_EXACT):
        j = tl.load(idx_ptr + row * W + t)
        cols = j * BS + offs_n
        k_rows = _rows(k_base, j * BS, offs_n, skl, ROW64)
        v_rows = _rows(v_base, j * BS, offs_n, svl, ROW64)
        if EVEN_K:
            kt = tl.load(k_rows + offs_d[None, :] * skd)
            vt = tl.load(v_rows + offs_d[None, :] * svd)
        else:
            kt = tl.load(k_rows + offs_d[None, :] * skd, mask=(cols < LK)[:, None], other=0.0)
            vt = tl.load(v_rows + offs_d[None, :] * svd, mask=(cols < LK)[:, None], other=0.0)
        if F32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt)) * qk_scale
        if not EVEN_K:
            s = tl.where((cols < LK)[None, :], s, float("-inf"))
        m_i, l_i, acc, _, _ = _step(m_i, l_i, acc, s, vt, LOWP, F32)
    if MODE > 0:
        m_i, l_i, acc, l_tail = _tail_phase(
            q, m_i, l_i, acc, l_tail, kbar_ptr, kscale_ptr, vbar_ptr, bits_ptr, row, NW, stat_base, n_exact,
            NK, LK, qk_scale, offs_d, BS, D, C, EVEN_K, LOG2_BS, LOWP, F32, S_TAIL)
    if MODE == 2:
        hbv = tl.load(hbar_ptr + (b * HK + hk) * D * D + offs_d[:, None] * D + offs_d[None, :])
        if F32:
            hbv = hbv.to(tl.float32)
        qh = tl.dot(q, hbv)
        a_h = tl.load(alpha_ptr + h)  # the first-order weight of this query head
        hs = tl.load(hscale_ptr + b * HK + hk)  # H̄ was stored divided by it (a power of two)
        acc += (l_tail * (scale * a_h * hs / BS))[:, None] * qh

    if MODE == 0:  # keep-or-drop: a row given no exact block has l = 0 (out 0, lse -inf)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    else:
        out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2_C
    rvalid = offs_m < LQ
    tl.store(_rows(o_ptr + b * sob + h * soh, i * BS, offs_n, sol, ROW64) + offs_d[None, :] * sod,
             out.to(o_ptr.dtype.element_ty), mask=rvalid[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * LQ + offs_m, lse, mask=rvalid)


FIXED_CONFIG = {"C": 64, "num_warps": 4, "num_stages": 2, "S_EXACT": 3, "S_TAIL": 2}


def _configs():
    if interpreting():
        return [triton.Config({"C": 16}, num_warps=4, num_stages=1)]
    # 4 warps (8 were 2x slower on H100/H200); the exact loop likes 3 stages, the tail scan few
    # buffers so that two programs fit per SM, hence per-loop depths (S_EXACT, S_TAIL).
    tail = [dict(C=64, S_EXACT=2, S_TAIL=2)] + [dict(C=c, S_EXACT=3, S_TAIL=t) for c, t in ((64, 2), (64, 1), (32, 2))]
    return ([triton.Config({"C": 64}, num_warps=4, num_stages=s) for s in (2, 3)]
            + [triton.Config(kw, num_warps=4, num_stages=2) for kw in tail])


def _prune(configs, named_args, **kwargs):
    mode = kwargs.get("MODE", named_args.get("MODE", 2))
    if mode == 0:  # no tail scan: C and S_TAIL are irrelevant
        keep = [c for c in configs if "S_TAIL" not in c.kwargs]
    else:
        keep = [c for c in configs if "S_TAIL" in c.kwargs]
    return keep or configs


_attn_tuned = triton.autotune(
    configs=_configs(),
    key=["L_BUCKET", "DENS_BUCKET", "BS", "D", "MODE", "EVEN_K"],
    prune_configs_by={"early_config_prune": _prune},
)(_attn_kernel)


def _alloc_like_layout(q: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Output with q's physical layout (and ``dtype``, default q's): a [B, L, H, D] buffer when q
    is such a transposed view, so the caller's transpose back to that layout is free."""
    b, h, lq, d = q.shape
    dtype = dtype or q.dtype
    if q.stride(1) < q.stride(2):
        return torch.empty(b, lq, h, d, device=q.device, dtype=dtype).transpose(1, 2)
    return torch.empty(b, h, lq, d, device=q.device, dtype=dtype)


def out_buffers(q: Tensor, out: Tensor | None, lse: Tensor | None,
                dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)) -> tuple[Tensor, Tensor]:
    """A kernel call's ``out`` (q's shape, one of ``dtypes``, any strides) and ``lse`` (float32
    ``[B, H, Lq]``, contiguous: written by row index), on q's device: made when None (``out`` in
    q's layout and dtype), else checked (ValueError naming the buffer: the kernels write them by
    q's shape, past a smaller one)."""
    b, h, lq, _ = q.shape
    if out is None:
        out = _alloc_like_layout(q)
    elif out.shape != q.shape or out.dtype not in dtypes or out.device != q.device:
        raise ValueError(f"out must be of q's shape {tuple(q.shape)}, one of {[str(t) for t in dtypes]}, on "
                         f"{q.device}: got {out.dtype} {tuple(out.shape)} on {out.device}")
    if lse is None:
        lse = torch.empty(b, h, lq, device=q.device, dtype=torch.float32)
    elif lse.shape != (b, h, lq) or lse.dtype != torch.float32 or lse.device != q.device or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous float32 [B, H, Lq] = {[b, h, lq]} tensor on {q.device}: got "
                         f"{lse.dtype} {tuple(lse.shape)} on {lse.device}, strides {tuple(lse.stride())}")
    return out, lse


def alpha_arg(alpha: Tensor | None, heads: int, device) -> Tensor:
    """The ``[H]`` float32 weight tensor a kernel reads (weight 1 when None)."""
    if alpha is None:
        return tail_weight.ones(heads, device)
    if alpha.dtype != torch.float32 or alpha.numel() != heads or alpha.device != device:
        raise ValueError(f"alpha must be a float32 tensor of {heads} weights on {device}, got {alpha.dtype} "
                         f"{tuple(alpha.shape)} on {alpha.device}")
    return alpha.contiguous()


def autotune_key(lk: int, density: float) -> tuple[int, int]:
    """Shape classes that change the best config: length (<=8K, <=32K, longer) and density (<20%)."""
    return (0 if lk <= 8192 else 1 if lk <= 32768 else 2), (0 if density < 0.2 else 1)


def attention(
    q: Tensor, k: Tensor, v: Tensor,
    kbar: Tensor, kscale: Tensor, vbar: Tensor, hbar: Tensor, hscale: Tensor,
    idx: Tensor, cnt: Tensor, bits: Tensor,
    *, mode: str, scale: float, block_size: int, n_select: int,
    out: Tensor | None = None, lse: Tensor | None = None, config: dict | None = None, alpha: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the fused kernel for a given selection; returns (out [B,H,Lq,D], lse [B,H,Lq] fp32).

    ``out``/``lse`` may be passed in (tests poison them); ``config`` ({C, num_warps, num_stages})
    bypasses autotuning, as does ``PISA_ATTN_AUTOTUNE=0``. ``alpha``: ``[H]`` float32 weights of
    the first-order term per query head (None: 1, the paper's term).
    """
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    nq, nk = -(-lq // block_size), -(-lk // block_size)
    out, lse = out_buffers(q, out, lse)
    check_token_strides(q=q, k=k, v=v, out=out)
    row64 = rows_past_int32(q, k, v, out)
    alpha = alpha_arg(alpha, h, q.device)
    args = (
        q, k, v, kbar, kscale, vbar, hbar, hscale, alpha, idx, cnt, bits, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, hk, lq, lk, nq, nk, idx.shape[-1], bits.shape[-1],
        scale * LOG2E, scale,
        *autotune_key(lk, n_select / nk),
    )
    meta = dict(BS=block_size, D=d, MODE=MODE_IDS[mode], EVEN_K=lk % block_size == 0,
                LOG2_BS=math.log2(block_size), F32=interpreting(), ROW64=row64)
    grid = (nq, b * h)
    if interpreting():
        # small groups: several per row
        unrecordable("the attention kernel runs under the interpreter")
        _attn_kernel[grid](*args, **meta, **{"C": 16, "num_warps": 4, **(config or {})})
    elif config is not None or os.environ.get("PISA_ATTN_AUTOTUNE", "1") == "0":
        cfg = FIXED_CONFIG if config is None else {"C": 64, "num_warps": 4, "num_stages": 2, **config}
        key = ("fixed", tuple(sorted(cfg.items())), q.dtype, meta["MODE"], meta["EVEN_K"], row64, block_size, d,
               spec_class(*args[:30]))
        _launch_attn(key, grid, args, {**meta, **cfg})
    else:
        # Tuned once per shape class by the autotuner; then launched through a Launcher with the
        # chosen config (the autotuner re-binds every argument on each call: tens of µs of host time).
        key = (q.dtype, meta["MODE"], meta["EVEN_K"], row64, block_size, d, args[-2:], spec_class(*args[:30]))
        tuned = _TUNED.get(key)
        if tuned is None:
            unrecordable("the attention kernel is being autotuned")
            _attn_tuned[grid](*args, **meta)
            best = getattr(_attn_tuned, "best_config", None)
            if best is not None:
                _TUNED[key] = {**meta, **best.all_kwargs()}
        else:
            _launch_attn(key, grid, args, tuned)
    return out, lse


_launch_attn = Launcher(_attn_kernel)
_TUNED: dict = {}  # launch key -> the autotuner's config (constexprs and launch options) for it
