"""GPU checks of the calibration fit (skipped without CUDA): the fit a calibrated layer call runs
on CUDA (the Triton fit, :mod:`pisa_attn.ops.triton.fit`: the kernels' prepare and select stages,
one pass of the sampled rows over k and v, one merge) against the reference fit in float64 on the
same bfloat16 values, at Wan2.1-1.3B's and FLUX.1's attention shapes, on keys with a few sink-like
blocks (large ``||H_j − H̄||``) where the covariance-aware rule is clearly the better one.

    PYTHONPATH=src python -m pytest tests/gpu/test_gpu_calibration.py -q -s
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pisa_attn import calibration as cal  # noqa: E402
from pisa_attn.diffusers.calibrate import sample_rows  # noqa: E402

# Clamped weights (what calibration uses): |fast − reference| <= ALPHA_TOL per head. The fit's inputs
# differ by the kernels' bfloat16 value means, TF32 products with H̄ and the bfloat16 softmax
# weights of the value product; an unclamped weight of a head whose correction barely moves the
# output is ill-conditioned and only printed.
ALPHA_TOL = 0.02


def sink_qkv(h: int, lq: int, lk: int, d: int, seed: int, sinks: int = 8):
    """Locally correlated float64 q/k/v (a smooth walk plus noise) with ``sinks`` key blocks whose
    keys and values share a large zero-mean component: their centroid term is poor, their
    ``||H_j − H̄||`` large. Rounded to bfloat16 (the fit's input) and back."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def field(n):
        walk = torch.randn(1, h, n, d, generator=g, device="cuda", dtype=torch.float64).cumsum(2) / n**0.5
        return 2.0 * walk + 0.5 * torch.randn(1, h, n, d, generator=g, device="cuda", dtype=torch.float64)

    q, k, v = field(lq), field(lk), field(lk)
    for j in torch.randperm(lk // 64, generator=torch.Generator().manual_seed(seed))[:sinks].tolist():
        u = torch.randn(1, h, 64, d, generator=g, device="cuda", dtype=torch.float64)
        u = u - u.mean(2, keepdim=True)
        k[:, :, j * 64 : (j + 1) * 64] += 1.5 * u
        v[:, :, j * 64 : (j + 1) * 64] += 6.0 * u
    return tuple(x.bfloat16() for x in (q, k, v))


# (name, heads, image tokens, text tokens before them, head dim)
SHAPES = [("wan-B1-H12-L32760-D128", 12, 32760, 0, 128), ("flux-B1-H24-L4608-T512-D128", 24, 4608, 512, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_fast_fit_agrees_with_the_reference_fit(shape):
    _, h, n_img, text, d = shape
    lk = n_img + text
    q, k, v = sink_qkv(h, lk, lk, d, seed=7)
    keep = None
    if text:
        keep = torch.zeros(-(-lk // 64), dtype=torch.bool, device="cuda")
        keep[: text // 64] = True
    rows = sample_rows(random.Random(0), text, lk, 64, 32)
    plan = cal.row_plan(lk, 64, rows, (text, lk))
    kw = dict(density=0.125, rules=(False, True), mode="hybrid", scale=d**-0.5, block_size=64, keep_blocks=keep)
    assert cal.fast_fit_supported(q, "hybrid", 64, kv_len=lk)
    # past the fit kernel's key blocks the reference fit serves (the kernel would refuse)
    assert not cal.fast_fit_supported(q, "hybrid", 16, kv_len=16 * 4097)
    assert cal.fast_fit_supported(q, "hybrid", 16, kv_len=16 * 4096)
    graphs = cal.FitGraphs()
    fast = graphs.sums(q, k, v, plan, **kw).clone()  # compiles the kernels
    torch.cuda.synchronize()
    host_keep = None if keep is None else keep.cpu()  # as a layout gives them
    graphs.sums(q, k, v, plan, **{**kw, "keep_blocks": host_keep})  # copies the host blocks once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host synchronisation in the fit would raise
    try:
        fast_again = graphs.sums(q, k, v, plan, **kw)
        from_host = graphs.sums(q, k, v, plan, **{**kw, "keep_blocks": host_keep})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(fast, fast_again) and torch.equal(fast, from_host)  # deterministic: no atomics
    assert len(graphs) == 0  # no graph, no static copy of k and v
    n = len(plan.pos)
    got = cal.row_fits(fast, (False, True), rows=n, elems=n * d)
    want = cal.fit_rules(q.double(), k.double(), v.double(), density=0.125, rows=rows, measured=(text, lk),
                         block_size=64, keep_blocks=keep)  # the reference, float64
    errs = {}
    for rule in (False, True):
        st = want[rule].stats
        a_got, a_want = (x.stats.alpha("head", bounds=cal.FIT_BOUNDS) for x in (got[rule], want[rule]))
        free = [x.stats.alpha("head") for x in (got[rule], want[rule])]
        dev = (a_got - a_want).abs().max().item()
        free_dev = ((free[0] - free[1]).abs() / free[1].abs().clamp_min(1.0)).max().item()
        # what the fast weights cost on the reference's own rows, over the best clamped weights
        excess = float(st.residual(a_got).sum() / st.residual(a_want).sum()) - 1
        tm = ((got[rule].tail_mass - want[rule].tail_mass).abs() / want[rule].tail_mass).max().item()
        print(f"\n{shape[0]} rule cov={rule}: clamped weights max |diff| {dev:.2e}, squared-error excess "
              f"{excess:.1e}, unclamped max rel. diff {free_dev:.1e} (weights {free[1].min().item():.2f}.."
              f"{free[1].max().item():.2f}), tail mass {tm:.1e}")
        assert dev <= ALPHA_TOL
        assert excess <= 1e-2
        assert tm <= 1e-2
        errs[rule] = float(st.residual(a_want).sum())
    assert errs[True] < 0.7 * errs[False]  # a clear case: covariance-aware wins by far
    _, chosen = cal.choose_rules({"t": {0: got}})
    assert chosen["t"][0] is True


def test_side_stream_fits_equal_the_same_stream_fits():
    """Calibration's fits on a side stream (``CalibrationConfig.side_stream``) give the model's-stream
    sums bit for bit, with no host synchronisation, while the model's stream frees each call's
    q/k/v right after the call and writes NaN into new tensors of their size (the caching allocator
    must not hand their memory out before the side stream has read it)."""
    from pisa_attn.diffusers.calibrate import CalibrationConfig, Calibrator
    from pisa_attn.diffusers.hooks import AttentionCall
    from pisa_attn.diffusers.schedule import Schedule

    h, text, lk, d = 24, 512, 4608 + 512, 128
    base = sink_qkv(h, lk, lk, d, seed=3)
    keep = torch.zeros(-(-lk // 64), dtype=torch.bool)
    keep[: text // 64] = True  # on the host, as a layout gives them
    sums = {}
    for side in (False, True):
        cal_ = Calibrator(CalibrationConfig(side_stream=side), Schedule(dense_steps=2, min_kv_len=0))
        for step in range(2):
            for layer in range(3):
                if step or layer:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    q, k, v = (x.clone() for x in base)
                    cal_.observe(AttentionCall(model="flux", layer=layer, step=step, q=q, k=k, v=v, out=q, dense=True,
                                               density=0.125, mode="hybrid", covariance_aware=False, block_size=64,
                                               keep_blocks=keep,
                                               meta={"dense_reason": "warmup_step", "image_range": (text, lk)}))
                    del q, k, v
                    junk = [torch.full_like(x, float("nan")) for x in base]  # the freed memory, reused at once
                    del junk
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        assert bool(cal_._pending) == side and bool(cal_._streams) == side
        fits = cal_.fits  # joins
        assert not cal_._pending
        sums[side] = {i: s[0].clone() for i, s in cal_._sums.items()}
        assert all(torch.isfinite(s).all() for s in sums[side].values())
        assert len(fits) == 3
    for i in range(3):
        assert torch.equal(sums[True][i], sums[False][i]), i


@pytest.mark.parametrize("outlier", [60.0, 120.0])
def test_fast_fit_keeps_the_tail_under_a_far_outlier_token(outlier):
    """B1-H4-L4096-D128: in every head one key token scores ``outlier`` above all the tokens and
    centroids PISA sees (its block in the tail); the kernel's sums are those of the float64
    reference (shifted by the dense maximum, they underflowed to 'no tail')."""
    from pisa_attn.ops.triton import fit as tfit

    h, lk, d = 4, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q = 0.3 * torch.randn(1, h, lk, d, generator=g, device="cuda")
    q[..., 0] = 4.0
    k = 0.3 * torch.randn(1, h, lk, d, generator=g, device="cuda")
    v = torch.randn(1, h, lk, d, generator=g, device="cuda")
    blk = 40  # its block: the other keys far below, so its centroid stays in the tail
    k[:, :, blk * 64 : (blk + 1) * 64, 0] = -40.0
    k[:, :, blk * 64 + 7, 0] = outlier * d**0.5 / 4.0
    q, k, v = (x.bfloat16() for x in (q, k, v))
    rows = list(range(0, lk, 128))
    plan = cal.row_plan(lk, 64, rows)
    kw = dict(density=0.125, rules=(False, True), scale=d**-0.5, block_size=64)
    got = tfit.fit_sums(q, torch.tensor(plan.pos, dtype=torch.int32, device="cuda"),
                        torch.tensor([a for a, _ in plan.spans], dtype=torch.int32, device="cuda"),
                        plan.which(q.device), k, v, None, **kw)
    want = cal._fit_sums(*plan.gather(q.double()), plan.which(q.device), k.double(), v.double(), None,
                         mode="hybrid", **kw)
    assert want[:, 1].min() > 0.1  # a first-order term to fit
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
