"""Which rounding costs what in the low-precision exact phase: the quantised hybrid's error under
variants of each product's format, in PyTorch on the CPU (the search behind the library's formats;
the library's own math is :mod:`pisa_attn.ops.quant`).

Each variant rounds the exact blocks' products of the default hybrid (covariance-aware selection,
α = 0.75, 12.5 %) one way; everything else is the input precision's math in float32. The axes:

* Q·Kᵀ: ``int8`` or ``e4m3`` codes (one scale per query row and per key block), keys smoothed by
  one vector per head (``head``: the mean of the block centroids, the library's) or by each
  block's own centroid (``block``: the shift ``s·q·k̄_j`` added back per block).
* P: ``e4m3(256·p)``, signed codes ``round(127·p)`` (``s8``), unsigned ``round(255·p)``
  (``u8``) or bf16 (``input``); p against the running maximum (``run``, the default) or against
  each block's own row maximum (``blk``, the block's product rescaled in float32).
* V: ``e4m3`` or ``int8`` with one scale per head and channel (``head``) or per key block and
  channel (``block``), or bf16 (``input``); optionally shifted by its per-channel mean first
  (``mean``: added back after the softmax, the shift is exact in the tail's sums).

Reported: rel-L1 against float64 dense attention and its growth over the input precision's
hybrid on the same selection, on the cases of ``lowp_reference_accuracy.py``.

    PYTHONPATH=src python benchmarks/lowp_format_study.py --out benchmarks/results/lowp_format_study.json \\
        [--cases dit4k dit16k] [--variants NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass

import torch
from lowp_reference_accuracy import CASES, inputs

from pisa_attn import metrics, spec
from pisa_attn.ops import quant as Q
from pisa_attn.ops import reference as ref
from pisa_attn.spec import expand_kv_heads, num_blocks


@dataclass(frozen=True)
class Fmt:
    qk: str = "int8"  # int8 | e4m3
    k_smooth: str = "head"  # head | block
    p: str = "input"  # e4m3 | s8 | u8 | input
    p_ref: str = "run"  # run | blk
    v: str = "input"  # e4m3 | int8 | input
    v_scale: str = "head"  # head | block
    v_shift: bool = False


VARIANTS = {
    "fp8": Fmt("e4m3", "head", "e4m3", "run", "e4m3"),
    "fp8, K per block": Fmt("e4m3", "block", "e4m3", "run", "e4m3"),
    "fp8, V mean-shifted": Fmt("e4m3", "head", "e4m3", "run", "e4m3", v_shift=True),
    "int8-fp8": Fmt("int8", "head", "e4m3", "run", "e4m3"),
    "int8-fp8, K per block": Fmt("int8", "block", "e4m3", "run", "e4m3"),
    "int8-fp8, V mean-shifted": Fmt("int8", "head", "e4m3", "run", "e4m3", v_shift=True),
    "int8": Fmt("int8", "head", "input", "run", "input"),
    "int8, K per block": Fmt("int8", "block", "input", "run", "input"),
    "P e4m3 alone": Fmt(p="e4m3"),
    "V e4m3 alone": Fmt(v="e4m3"),
    "V int8 per head alone": Fmt(v="int8"),
    "P s8 (running max), V int8 per head": Fmt(p="s8", v="int8"),
    "P u8 (running max), V int8 per head": Fmt(p="u8", v="int8"),
    "P u8 (running max), V int8 per block": Fmt(p="u8", v="int8", v_scale="block"),
    "P s8 (block max), V int8 per head": Fmt(p="s8", p_ref="blk", v="int8"),
    "P s8 (block max), V int8 per block": Fmt(p="s8", p_ref="blk", v="int8", v_scale="block"),
    "P u8 (block max), V int8 per head": Fmt(p="u8", p_ref="blk", v="int8"),
    "P u8 (block max), V int8 per block (int8-int8)": Fmt(p="u8", p_ref="blk", v="int8", v_scale="block"),
    "P u8 (block max) alone": Fmt(p="u8", p_ref="blk"),
}


def _round_p(p: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "e4m3":
        return Q.to_e4m3(256 * p).float() / 256
    if fmt == "s8":
        return torch.round(127 * p) / 127
    if fmt == "u8":
        return torch.floor(255 * p + 0.5) / 255
    return p.bfloat16().float()


def _values(v: torch.Tensor, f: Fmt, bs: int) -> torch.Tensor:
    """The values P·V sees, ``[B, Hk, Lk, D]`` float32."""
    if f.v == "input":
        return v
    b, hk, lk, d = v.shape
    nk = num_blocks(lk, bs)
    vf = torch.nn.functional.pad(v, (0, 0, 0, nk * bs - lk)).view(b, hk, nk, bs, d)
    amax = vf.abs().amax((2, 3) if f.v_scale == "head" else 3, keepdim=True)
    codes, sc = Q.quantize_block_rows(vf, amax, f.v)
    return (codes.float() * sc).view(b, hk, nk * bs, d)[:, :, :lk]


def forward(q, k, v, st, mask, f: Fmt, *, scale: float, alpha: float, bs: int = 64, rows: int = 512):
    """The hybrid with the exact blocks' products rounded as ``f`` says (float32, [B, H, Lq, D])."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    nk = num_blocks(lk, bs)
    counts = torch.full((nk,), float(bs))
    counts[-1] = lk - (nk - 1) * bs
    tok_block = torch.arange(lk) // bs
    if f.k_smooth == "head":
        shift = st.kmean.mean(2, keepdim=True).expand(-1, -1, nk, -1)
    else:
        shift = st.kmean
    shift_tok = shift.repeat_interleave(bs, 2)[:, :, :lk]
    kc = torch.nn.functional.pad(k - shift_tok, (0, 0, 0, nk * bs - lk))
    amax = kc.view(b, k.shape[1], nk, bs * d).abs().amax(-1).repeat_interleave(bs, 2)[..., None]
    k8, sig = Q.quantize_block_rows(kc, amax, f.qk)
    kd = expand_kv_heads((k8.float() * sig)[:, :, :lk], h)
    shx = expand_kv_heads(shift_tok, h)
    vbar = v.mean(2, keepdim=True) if f.v_shift else torch.zeros_like(v[:, :, :1])
    vd = expand_kv_heads(_values(v - vbar, f, bs), h)
    vbx = expand_kv_heads(vbar, h)
    kmx, vsx, hbx = (expand_kv_heads(x, h) for x in (st.kmean, st.vsum, st.hbar))
    vsx = vsx - counts[:, None] * vbx  # the tail's sums of the shifted values
    out = torch.empty(b, h, lq, d)
    for r0 in range(0, lq, rows):
        r1 = min(lq, r0 + rows)
        qc = q[:, :, r0:r1]
        q8, rho = Q.quantize_rows(qc, f.qk)
        sel = mask.index_select(2, torch.arange(r0, r1) // bs)
        exact = sel.index_select(-1, tok_block)
        s = ((q8.float() * rho[..., None]) @ kd.transpose(-1, -2) + qc @ shx.transpose(-1, -2)) * scale
        s = s.masked_fill(~exact, float("-inf"))
        c = ((qc @ kmx.transpose(-1, -2)) * scale).masked_fill(sel, float("-inf"))
        m = torch.maximum(s.amax(-1), c.amax(-1))
        pe = torch.exp(s - m[..., None]).sum(-1)
        sp = torch.nn.functional.pad(s, (0, nk * bs - lk), value=float("-inf")).view(*s.shape[:3], nk, bs)
        r = sp.amax(-1) if f.p_ref == "blk" else sp.amax(-1).cummax(-1).values
        r = torch.where(torch.isfinite(r), r, m[..., None].expand_as(r))
        p8 = _round_p(torch.exp(sp - r[..., None]), f.p) * torch.exp(r - m[..., None])[..., None]
        a = torch.exp(c - m[..., None])
        num = p8.flatten(-2)[..., :lk] @ vd + a @ vsx + a.sum(-1, keepdim=True) * (qc @ hbx) * scale * alpha
        out[:, :, r0:r1] = num / (pe + a @ counts)[..., None] + vbx
    return out


def case(name, q, k, v, scale, density, variants) -> dict:
    q, k, v = (x.bfloat16().float() for x in (q, k, v))
    st = ref.block_stats(k, v, 64, with_hdev=True)
    mask = metrics.select(q, k, v, density=density, block_size=64, covariance_aware=True, scale=scale,
                          stats=st).selected
    h = q.shape[1]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.double(), expand_kv_heads(k.double(), h), expand_kv_heads(v.double(), h), scale=scale)
    base, _ = ref.pisa_forward(q, k, v, st, mask, mode="hybrid", scale=scale, block_size=64,
                               alpha=torch.full((h,), spec.DEFAULT_ALPHA))
    r0 = metrics.rel_l1(base, dense)
    row = {"case": name, "input_rel_l1": r0, "variants": {}}
    print(f"{name}: input rel-L1 {r0:.4e}", flush=True)
    for label in variants:
        o = forward(q, k, v, st, mask, VARIANTS[label], scale=scale, alpha=spec.DEFAULT_ALPHA)
        r = metrics.rel_l1(o, dense)
        row["variants"][label] = {"format": asdict(VARIANTS[label]), "rel_l1": r, "growth": r / r0 - 1}
        print(f"  {label:50s} {r:.4e} ({100 * (r / r0 - 1):+.2f} %)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="+", default=["dit4k"], choices=CASES)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--density", type=float, default=0.125)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = [case(name, q, k, v, scale, args.density, args.variants) for name, q, k, v, scale in inputs(args.cases)]
    res = {"note": __doc__.split("\n\n")[0].replace("\n", " "), "device": f"CPU ({platform.machine()}, "
           f"{os.cpu_count()} cores)", "torch": torch.__version__, "density": args.density, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("\n| variant | " + " | ".join(r["case"] for r in rows) + " |\n|---|" + "---|" * len(rows))
    for label in args.variants:
        print(f"| {label} | " + " | ".join(f"{100 * r['variants'][label]['growth']:+.1f} %" for r in rows) + " |")


if __name__ == "__main__":
    main()
