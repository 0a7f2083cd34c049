"""The LSE merge of attention partials in one pass (reference: :func:`pisa_attn.ops.merge.merge_torch`).

A ring step's partial is as large as the local output; merging N of them with elementwise torch
ops reads and writes the running result once per op. This kernel reads every partial once and
writes the merged output once, in the caller's dtype: per row, ``m = max_r lse_r``,
``w_r = exp(lse_r − m)``, ``out = Σ_r w_r·out_r / Σ_r w_r``, ``lse = m + log Σ_r w_r``. A partial
with ``lse_r = -inf`` has weight 0 and its output is never used (it may be NaN); a row with no
term anywhere comes out as ``(0, -inf)``, a row with ``+inf`` partials as their mean, lse +inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import next_pow2


@triton.jit
def _merge_kernel(
    outs, lses, out_ptr, lse_ptr,
    ROWS, H, L, D,
    s_b, s_h, s_l, s_d,
    l_b, l_h, l_l,
    o_b, o_h, o_l, o_d,
    e_b, e_h, e_l,
    N: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BR + tl.arange(0, BR).to(tl.int64)
    rv = r < ROWS
    b = r // (H * L)
    h = (r // L) % H
    l = r % L
    offs_d = tl.arange(0, BD)
    m2 = rv[:, None] & (offs_d < D)[None, :]
    lse_off = b * l_b + h * l_h + l * l_l
    m = tl.full([BR], float("-inf"), tl.float32)
    for i in tl.static_range(N):
        m = tl.maximum(m, tl.load(lses[i] + lse_off, mask=rv, other=float("-inf")))
    # No term anywhere (m = -inf): shift by 0 so every weight is 0. An overflowed partial (m = +inf)
    # outweighs every finite one: the +inf partials weigh 1 each, the rest 0 (not inf - inf = NaN).
    pos = m == float("inf")
    m_use = tl.where((m == float("-inf")) | pos, 0.0, m)
    tot = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, BD], tl.float32)
    part_off = (b * s_b + h * s_h + l * s_l)[:, None] + offs_d[None, :] * s_d
    for i in tl.static_range(N):
        li = tl.load(lses[i] + lse_off, mask=rv, other=float("-inf"))
        w = tl.where(pos, tl.where(li == m, 1.0, 0.0), tl.exp(li - m_use))
        o = tl.load(outs[i] + part_off, mask=m2, other=0.0).to(tl.float32)
        acc += tl.where(w[:, None] > 0, w[:, None] * o, 0.0)  # a weightless partial may hold NaN
        tot += w
    out = tl.where(tot[:, None] > 0, acc / tl.where(tot > 0, tot, 1.0)[:, None], 0.0)
    tl.store(out_ptr + (b * o_b + h * o_h + l * o_l)[:, None] + offs_d[None, :] * o_d,
             out.to(out_ptr.dtype.element_ty), mask=m2)
    lse = tl.where(pos, m, m_use + tl.log(tot))  # log 0 = -inf: no term anywhere
    tl.store(lse_ptr + b * e_b + h * e_h + l * e_l, lse, mask=rv)


def supports(parts: Sequence[tuple[Tensor, Tensor]]) -> bool:
    """True when :func:`merge` takes these partials: one shape and strides for every output, one
    shape (the outputs' without the head dim) and strides for every LSE, one device for all,
    float16/bfloat16/float32 outputs, float32 LSEs."""
    o0, l0 = parts[0]
    return all(
        o.shape == o0.shape and o.stride() == o0.stride() and o.device == o0.device and l.shape == o0.shape[:-1]
        and l.stride() == l0.stride() and l.device == o0.device and l.dtype == torch.float32 and o.dim() == 4
        and o.dtype in (torch.float16, torch.bfloat16, torch.float32)
        for o, l in parts
    )  # fmt: skip


def merge(parts: Sequence[tuple[Tensor, Tensor]], out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Merge ``[(out [B, H, L, D], lse [B, H, L]), ...]`` (see :func:`supports`) in one launch;
    ``out`` in ``out_dtype`` (default float32) and ``lse`` float32, each in its partials' memory
    layout where they are dense (``empty_like``), else contiguous: written through its own strides."""
    o0, l0 = parts[0]
    b, h, lq, d = o0.shape
    out = torch.empty_like(o0, dtype=out_dtype or torch.float32)
    lse = torch.empty_like(l0)
    rows = b * h * lq
    br = 64 if d <= 128 else 32
    grid = (triton.cdiv(rows, br),)
    if rows:
        _merge_kernel[grid](
            tuple(o for o, _ in parts), tuple(l for _, l in parts), out, lse,
            rows, h, lq, d, *o0.stride(), *l0.stride(), *out.stride(), *lse.stride(),
            N=len(parts), BR=br, BD=next_pow2(max(d, 16)), num_warps=4,
        )  # fmt: skip
    return out, lse
