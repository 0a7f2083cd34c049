"""Independent float64 brute force of the paper's equations (no code shared with ``ops/reference``).

Literal loops over query blocks ``i`` and key blocks ``j`` (paper Sec. 3.2-3.3, scale ``s`` written
out, ``n_j`` = true token count of key block ``j``):

    D_t = Σ_{j∈S} Σ_n exp(s q_t·k_jn)        + Σ_{j∈U} n_j exp(s q_t·k̄_j)                 (eq. 3)
    N_t = Σ_{j∈S} Σ_n exp(s q_t·k_jn) v_jn   + Σ_{j∈U} exp(s q_t·k̄_j) Σ_n v_jn            (eqs. 4, 5)
          "first":  + Σ_{j∈U} exp(s q_t·k̄_j) s q_t H_j,  H_j = Σ_n (k_jn − k̄_j)ᵀ v_jn     (eq. 6)
          "hybrid": + (Σ_{j∈U} exp(s q_t·k̄_j)) s q_t H̄,  H̄ = (1/N) Σ_j H_j            (eq. 7)
          "drop":   the exact terms only.
    The first-order term (either form) is multiplied by ``alpha_h`` per query head (default 1: the
    paper's equations).

Every exponent is shifted by the row maximum over all terms (a mathematically neutral rewrite) so
large finite inputs stay finite. Meant for tiny shapes only.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

MODES = ("hybrid", "zeroth", "first", "drop")


def _f64(x: Tensor) -> Tensor:
    return x.detach().to("cpu", torch.float64)


def _blocks(x: Tensor, block_size: int) -> list[Tensor]:
    """[L, D] -> list of [n_j, D] row blocks (the last one may be short)."""
    return [x[s : s + block_size] for s in range(0, x.shape[0], block_size)]


def paper(mode: str) -> dict:
    """``pisa_attention`` keyword arguments for the paper's equations in ``mode``: pooled top-k
    selection and weight 1 on the first-order term (the API's defaults are
    ``spec.DEFAULT_COVARIANCE_AWARE`` and ``spec.DEFAULT_ALPHA``)."""
    return {"covariance_aware": False, **({"alpha": 1.0} if mode in ("hybrid", "first") else {})}


def brute_pisa(
    q: Tensor, k: Tensor, v: Tensor, selected: Tensor, *, mode: str, block_size: int, scale: float | None = None,
    alpha=1.0,
) -> tuple[Tensor, Tensor]:
    """q [B, H, Lq, D], k/v [B, Hk, Lk, D], selected bool [B, H, Nq, Nk] -> (out, lse) float64.
    ``alpha``: the first-order weight, a number or one per query head."""
    if mode not in MODES:
        raise ValueError(mode)
    q, k, v = _f64(q), _f64(k), _f64(v)
    sel = selected.detach().cpu().bool()
    b_, h_, lq, d = q.shape
    group = h_ // k.shape[1]
    s = d**-0.5 if scale is None else scale
    weight = [float(x) for x in torch.as_tensor(alpha, dtype=torch.float64).reshape(-1).expand(h_)]
    out = torch.zeros(b_, h_, lq, d, dtype=torch.float64)
    lse = torch.zeros(b_, h_, lq, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            kb = _blocks(k[b, h // group], block_size)
            vb = _blocks(v[b, h // group], block_size)
            kbar = [kj.mean(0) for kj in kb]
            vhat = [vj.sum(0) for vj in vb]
            hj = [(kj - kbar_j).T @ vj for kj, kbar_j, vj in zip(kb, kbar, vb)]
            hbar = sum(hj) / len(hj)
            for i, qi in enumerate(_blocks(q[b, h], block_size)):
                r0 = i * block_size
                o, l = _query_block(qi, kb, vb, kbar, vhat, hj, hbar, sel[b, h, i], mode, s, weight[h])
                out[b, h, r0 : r0 + qi.shape[0]] = o
                lse[b, h, r0 : r0 + qi.shape[0]] = l
    return out, lse


def _query_block(qi, kb, vb, kbar, vhat, hj, hbar, sel_row, mode, s, weight=1.0):
    """Eqs. 3-7 for the queries ``qi`` [m, D] of one query block."""
    exact = [j for j in range(len(kb)) if sel_row[j]]
    tail = [] if mode == "drop" else [j for j in range(len(kb)) if not sel_row[j]]
    exact_scores = {j: s * qi @ kb[j].T for j in exact}  # [m, n_j]
    tail_scores = {j: s * qi @ kbar[j] for j in tail}  # [m]
    parts = [x.amax(-1) for x in exact_scores.values()] + list(tail_scores.values())
    m = torch.stack(parts, -1).amax(-1)  # row maximum over every term
    den = torch.zeros(qi.shape[0], dtype=torch.float64)
    num = torch.zeros_like(qi)
    for j in exact:
        p = torch.exp(exact_scores[j] - m[:, None])
        den += p.sum(-1)
        num += p @ vb[j]
    alpha_sum = torch.zeros_like(den)
    for j in tail:
        alpha = torch.exp(tail_scores[j] - m)  # α_tj, shifted
        den += kb[j].shape[0] * alpha
        num += alpha[:, None] * vhat[j]
        if mode == "first":
            num += weight * alpha[:, None] * (s * qi @ hj[j])
        alpha_sum += alpha
    if mode == "hybrid":
        num += weight * alpha_sum[:, None] * (s * qi @ hbar)
    return num / den[:, None], m + torch.log(den)


def brute_dense(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Plain softmax attention in float64 with GQA: (out [B, H, Lq, D], lse [B, H, Lq])."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q.shape[-1] ** -0.5 if scale is None else scale
    scores = s * q @ k.transpose(-1, -2)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def brute_n_select(density: float, n_kv_blocks: int) -> int:
    """``max(1, round(density · N))``, rounding halves up, capped at N, on the decimal density
    (exact arithmetic: 0.29 · 50 = 14.5 rounds to 15)."""
    exact = Fraction(repr(float(density))) * n_kv_blocks
    return max(1, min(n_kv_blocks, math.floor(exact + Fraction(1, 2))))


def brute_selection(
    q: Tensor,
    k: Tensor,
    *,
    density: float,
    block_size: int,
    scale: float | None = None,
    keep_blocks: Tensor | None = None,
) -> Tensor:
    """Top-k key blocks per query block by the pooled score ``s q̄_i·k̄_j``; kept blocks are added on
    top and do not count against k. Returns bool [B, H, Nq, Nk]."""
    q, k = _f64(q), _f64(k)
    b_, h_, _, d = q.shape
    group = h_ // k.shape[1]
    s = d**-0.5 if scale is None else scale
    nq = -(-q.shape[2] // block_size)
    nk = -(-k.shape[2] // block_size)
    n_sel = brute_n_select(density, nk)
    keep = torch.zeros(b_, h_, nk, dtype=torch.bool)
    if keep_blocks is not None:  # [Nk] or broadcastable [B, H, Nk]
        keep = keep | keep_blocks.cpu().bool().expand(b_, h_, nk)
    out = torch.zeros(b_, h_, nq, nk, dtype=torch.bool)
    for b in range(b_):
        for h in range(h_):
            kbar = torch.stack([kj.mean(0) for kj in _blocks(k[b, h // group], block_size)])
            for i, qi in enumerate(_blocks(q[b, h], block_size)):
                scores = s * kbar @ qi.mean(0)
                candidates = [j for j in range(nk) if not keep[b, h, j]]
                ranked = sorted(candidates, key=lambda j: -scores[j].item())
                for j in ranked[:n_sel]:
                    out[b, h, i, j] = True
                out[b, h, i] |= keep[b, h]
    return out
