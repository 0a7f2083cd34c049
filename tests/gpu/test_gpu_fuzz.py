"""Seeded random configurations of the public plan/run API against the float64 reference under the
same selection (skipped without CUDA).

The feature tests each vary one thing; these draw many at once (batch, GQA ratio, Lq != Lk, ragged
and sub-block lengths, head dim, dtype, layout, padded strides, mode, density, covariance-aware
selection, pooled query blocks, always-exact blocks, per-head alpha, scale, input magnitude,
low-precision exact blocks) so that their interplay is exercised. Each case: the kernel backend's
``run`` with its selection returned and NaN-poisoned ``out`` / ``lse``; the ``reference`` backend in
float64 under that selection; rel-L1 of the output and max |ΔLSE| within the dtype's tolerance,
every element finite.

    PYTHONPATH=src:tests python -m pytest tests/gpu/test_gpu_fuzz.py -q -s
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pisa_attn import PisaSettings, plan, run  # noqa: E402
from pisa_attn.attention import get_backend  # noqa: E402
from test_gpu_fp8 import BACKENDS, references  # noqa: E402
from test_gpu_kernels import KERNELS, rel_l1  # noqa: E402

# More cases or other seeds for a longer search: PISA_ATTN_FUZZ_CASES=320 PISA_ATTN_FUZZ_SEED=7000
N_CASES = int(os.environ.get("PISA_ATTN_FUZZ_CASES", 64))
FUZZ_SEED = int(os.environ.get("PISA_ATTN_FUZZ_SEED", 1000))
LENGTHS = (37, 64, 200, 1000, 2061, 4096, 5000, 8229, 12295)
# bf16 and fp16 outputs against float64 (the feature tests' bounds).
TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3}
# Low precisions: the kernel against the quantised math tightly; that math against float64 as far
# as its rounding goes, which grows with the logits' spread for the 8-bit scores (Gaussian q/k at
# 4x magnitude, int8: up to 3.1e-2 rel-L1, |LSE| ~14-43 off by up to 0.53; notes/fp8.md) and is
# larger with e4m3 probabilities (3 mantissa bits on a flat softmax: fp8 up to 1.0e-1).
# The kernel against the quantised math: e4m3 probabilities are rounded against the kernel's
# running maximum and the reference's final one (fp8 up to 5.2e-3 over 320 more seeds, the others
# up to 2.9e-3).
TOL_QUANT = {"int8": 5e-3, "int8-int8": 5e-3, "int8-fp8": 5e-3, "fp8": 1e-2}
TOL_LOWP = {"int8": 4e-2, "int8-int8": 4e-2, "int8-fp8": 6e-2, "fp8": 1.5e-1}
# Low precision: relative to |LSE|. A peaked row's LSE moves with its largest score's rounding,
# three mantissa bits for e4m3 scores: fp8 up to 7.0e-2 at 4x magnitude (LSE 50-110; its kernel
# within 7.5e-4 of the quantised math's LSE), the int8 scores up to 2.3e-2.
LSE_TOL = 2e-2
LSE_TOL_LOWP = {"int8": 5e-2, "int8-int8": 5e-2, "int8-fp8": 5e-2, "fp8": 1e-1}


def _draw(i: int) -> dict:
    r = random.Random(FUZZ_SEED + i)
    hk = r.choice((1, 2, 3))
    lk = r.choice(LENGTHS)
    c = {
        "seed": i,
        "b": r.choice((1, 1, 2, 3)),
        "hk": hk,
        "h": hk * r.choice((1, 1, 2, 3)),
        "lk": lk,
        "lq": lk if r.random() < 0.5 else r.choice(LENGTHS),
        "d": r.choice((32, 64, 128, 128, 128)),
        "dtype": r.choice((torch.bfloat16, torch.bfloat16, torch.float16)),
        "layout": r.choice(("bhsd", "bshd")),
        "padded": r.random() < 0.25,  # row stride past D (a slice of a wider tensor)
        "mode": r.choice(("hybrid", "hybrid", "hybrid", "zeroth", "drop", "first")),
        "density": r.choice((0.02, 0.05, 0.125, 0.125, 0.3, 0.6, 1.0)),
        "cov": r.random() < 0.6,
        "query_block": r.choice((None, None, None, 128)),
        "keep": r.random() < 0.25,
        "alpha": r.choice((None, None, 0.0, 1.0, "per-head")),
        "scale": r.choice((None, None, 0.05)),
        "mag": r.choice((1.0, 1.0, 4.0)),
        "lowp": r.choice((None, None, None, None, "int8", "int8", "fp8", "int8-fp8", "int8-int8")),
    }
    if c["mode"] not in ("hybrid", "first"):
        c["alpha"] = None
    if c["mode"] == "first" or c["d"] not in (64, 128):  # what the low-precision kernel runs
        c["lowp"] = None
    return c


def _id(c: dict) -> str:
    parts = [f"B{c['b']}-H{c['h']}-Hk{c['hk']}-Lq{c['lq']}-Lk{c['lk']}-D{c['d']}",
             "bf16" if c["dtype"] == torch.bfloat16 else "fp16", c["layout"], c["mode"], f"d{c['density']}"]
    parts += [name for name, on in (("padded", c["padded"]), ("cov", c["cov"]), ("qb128", c["query_block"]),
                                    ("keep", c["keep"]), (c["lowp"], c["lowp"])) if on]
    if c["alpha"] is not None:
        parts.append(f"a{c['alpha']}")
    if c["scale"] is not None:
        parts.append(f"s{c['scale']}")
    if c["mag"] != 1.0:
        parts.append(f"x{c['mag']:g}")
    return "-".join(parts)


CASES = [_draw(i) for i in range(N_CASES)]


def _tensor(c: dict, heads: int, length: int, g: torch.Generator, mag: float) -> torch.Tensor:
    d = c["d"]
    width = 2 * d if c["padded"] else d
    shape = (c["b"], length, heads, width) if c["layout"] == "bshd" else (c["b"], heads, length, width)
    x = (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * mag).to(c["dtype"])
    return x[..., :d]


def _inputs(c: dict, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = _tensor(c, c["h"], c["lq"], g, c["mag"])
    k = _tensor(c, c["hk"], c["lk"], g, c["mag"])
    v = _tensor(c, c["hk"], c["lk"], g, 1.0)
    return q, k, v


def _settings(c: dict, backend: str) -> PisaSettings:
    alpha = c["alpha"]
    if alpha == "per-head":
        alpha = tuple(round(0.25 + 0.5 * j / max(1, c["h"] - 1), 3) for j in range(c["h"]))
    return PisaSettings(density=c["density"], mode=c["mode"], alpha=alpha, covariance_aware=c["cov"],
                        query_block=c["query_block"], scale=c["scale"], backend=backend, layout=c["layout"],
                        precision=c["lowp"] if (c["lowp"] and backend == "hopper") else "input")


def _keep(c: dict):
    """Always-exact blocks: the first key block (a text prefix) and every seventh, on the CPU."""
    nk = -(-c["lk"] // 64)
    keep = torch.zeros(nk, dtype=torch.bool)
    keep[0] = True
    keep[::7] = True
    return keep, int(keep.sum())


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_random_configuration_matches_fp64_reference(case, backend):
    c = case
    q, k, v = _inputs(c, seed=c["seed"])
    qh = q if c["layout"] == "bhsd" else q.transpose(1, 2)
    s = _settings(c, backend)
    reason = get_backend(backend).unsupported_reason(qh, c["mode"], s.block_size)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    keep, n_keep = _keep(c) if c["keep"] else (None, 0)
    p = plan(q, k, s, max_keep=n_keep)
    assert p.backend == (backend if s.precision == "input" else BACKENDS[s.precision]), p.backend
    out = torch.full_like(q, float("nan"))
    lse = torch.full((c["b"], c["h"], c["lq"]), float("nan"), device="cuda", dtype=torch.float32)
    got, sel = run(p, q, k, v, out=out, lse=lse, keep_blocks=keep, return_selection=True)
    assert got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # poisoned: every element written

    q64, k64, v64 = (x.double() for x in (q, k, v))
    p64 = plan(q64, k64, s.replace(backend="reference", precision="input"), max_keep=n_keep)
    want, want_lse = run(p64, q64, k64, v64, selection=sel, return_lse=True)
    err = rel_l1(out, want)
    lowp = s.precision != "input"
    dl = (lse.double() - want_lse).abs()
    lse_err = (dl / want_lse.abs().clamp_min(1.0) if lowp else dl).max().item()
    tol = TOL_LOWP[s.precision] if lowp else TOL[c["dtype"]]
    print(f"\n[{backend} {_id(c)}] rel-L1 {err:.2e}  max|dLSE| {lse_err:.2e}")
    if lowp:
        qh, kh, vh = (x if c["layout"] == "bhsd" else x.transpose(1, 2) for x in (q, k, v))
        oq, _ = references(qh, kh, vh, p, sel, precision=s.precision)
        got_h = out if c["layout"] == "bhsd" else out.transpose(1, 2)
        err_q = rel_l1(got_h, oq)
        print(f"[{backend} {_id(c)}] rel-L1 to the quantised math {err_q:.2e}")
        assert err_q < TOL_QUANT[s.precision]
    assert err < tol
    assert lse_err < (LSE_TOL_LOWP[s.precision] if lowp else LSE_TOL)
    if keep is not None:  # the kept blocks are in every row's selection
        rows = sel.to_mask(p.n_kv_blocks)
        assert rows[..., keep.to(rows.device)].all()


def _joint_draw(i: int) -> dict:
    r = random.Random(FUZZ_SEED + 1000 + i)
    hk = r.choice((2, 4))
    return {"seed": i, "grid": (r.randint(6, 40), r.randint(6, 40)), "text_len": r.choice((1, 77, 226, 333, 512, 601)),
            "text": r.choice(("before", "after")), "tile": r.choice(((8, 8), (4, 8))), "b": r.choice((1, 2, 3)),
            "hk": hk, "h": hk * r.choice((1, 2)), "d": r.choice((64, 128)), "masked": r.random() < 0.5,
            "planned": r.random() < 0.5}


JOINT = [_joint_draw(i) for i in range(max(8, N_CASES // 8))]


def _joint_id(c: dict) -> str:
    return (f"B{c['b']}-H{c['h']}-Hk{c['hk']}-G{c['grid'][0]}x{c['grid'][1]}-T{c['text_len']}-{c['text']}"
            f"-tile{c['tile'][0]}x{c['tile'][1]}-D{c['d']}" + "-masked" * c["masked"] + "-planned" * c["planned"])


@pytest.mark.parametrize("density", [1.0, 0.15])
@pytest.mark.parametrize("case", JOINT, ids=[_joint_id(c) for c in JOINT])
def test_random_joint_call_layouts(case, density):
    """The diffusers integration's joint text + image call on random grids, text lengths and sides,
    tiles, GQA and key-padding rows: every text row exact; at density 1 every image row is dense
    attention (an independent check of the rows, offsets and kept text blocks); below it the image
    rows are the float64 reference under the selection of a call on the same slice."""
    from pisa_attn.diffusers import calls
    from pisa_attn.diffusers.tiling import build_layouts

    c = case
    seq = build_layouts(c["grid"], c["text_len"], c["text"], c["tile"], 64).joint
    n = seq.length
    g = torch.Generator(device="cuda").manual_seed(c["seed"])
    q = torch.randn(c["b"], n, c["h"], c["d"], generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(c["b"], n, c["hk"], c["d"], generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = None
    if c["masked"]:  # padded text keys at the end of the sequence, some rows full
        lens = [n - (random.Random(c["seed"] + row).randint(1, 60) if row % 2 else 0) for row in range(c["b"])]
    s = PisaSettings(density=density, layout="bshd")
    out = calls.sparse_attention(q, k, v, seq, lens, s, plans={} if c["planned"] else None)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    start = seq.image_lo // 64 * 64
    for row in range(c["b"]):
        nk = n if lens is None else lens[row]
        qr, kr, vr = q[row:row + 1], k[row:row + 1, :nk], v[row:row + 1, :nk]
        dense = calls.dense_attention(qr.float(), kr.float(), vr.float(), None, None, c["h"] != c["hk"])
        for a, b in seq.text_ranges():
            assert rel_l1(out[row:row + 1, a:b], dense[:, a:b]) < 5e-3, (row, a, b)
        lo, hi = seq.image_lo, seq.image_hi
        if density == 1.0:
            assert rel_l1(out[row:row + 1, lo:hi], dense[:, lo:hi]) < 1e-2, row
            continue
        qi = qr[:, start:hi]
        p = plan(qi, kr, s, max_keep=64)
        keep = seq.keep_for(nk, 64)
        _, sel = run(p, qi, kr, vr, keep_blocks=keep, return_selection=True)
        q64, k64, v64 = (x.double() for x in (qi, kr, vr))
        p64 = plan(q64, k64, s.replace(backend="reference"), max_keep=64)
        want = run(p64, q64, k64, v64, selection=sel)
        assert rel_l1(out[row:row + 1, lo:hi], want[:, lo - start:]) < 1e-2, row
