"""The weighted first-order tail term (``pisa_attn.calibration``): its endpoints are the reference's
zeroth and first-order modes, it is exactly the reference with ``H̄`` scaled, and the closed-form
fits recover planted weights and minimise their losses (float64, CPU)."""

from __future__ import annotations

import pytest
import torch

from pisa_attn import calibration as cal
from pisa_attn import metrics, spec
from pisa_attn.ops import reference as ref

# (B, H, Hk, L, D, block_size): aligned; ragged last block + GQA.
SHAPES = [(1, 2, 2, 128, 16, 32), (2, 4, 2, 150, 32, 32)]


def shape_id(s) -> str:
    b, h, hk, length, d, bs = s
    return f"B{b}-H{h}-Hk{hk}-L{length}-D{d}-bs{bs}"


def make_qkv(b, h, hk, length, d, seed=0):
    """Locally correlated q/k/v (a smooth walk along the sequence plus noise), so blocks have
    coherent centroids and the tail terms are not vanishingly small."""
    g = torch.Generator().manual_seed(seed)

    def field(heads):
        walk = torch.randn(b, heads, length, d, generator=g, dtype=torch.float64).cumsum(2) / length**0.5
        return 2.0 * walk + 0.5 * torch.randn(b, heads, length, d, generator=g, dtype=torch.float64)

    return field(h), field(hk), field(hk)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", cal.CORRECTION_MODES)
def test_endpoints_are_the_reference_modes(shape, mode):
    b, h, hk, length, d, bs = shape
    q, k, v = make_qkv(b, h, hk, length, d)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=bs, mode=mode)
    stats = ref.block_stats(k, v, bs)
    zeroth, lse0 = ref.pisa_forward(q, k, v, stats, t.selected, mode="zeroth", scale=d**-0.5, block_size=bs)
    full, lse1 = ref.pisa_forward(q, k, v, stats, t.selected, mode=mode, scale=d**-0.5, block_size=bs)
    assert t.corr.abs().max() > 1e-3  # the correction is not trivially zero on this data
    torch.testing.assert_close(t.output(0.0), zeroth, rtol=0, atol=1e-13)
    torch.testing.assert_close(t.output(1.0), full, rtol=0, atol=1e-13)
    # The first-order term leaves the denominator alone: one LSE for every weight.
    torch.testing.assert_close(lse0, lse1, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.lse, lse0, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_weight_is_hbar_scaled_per_head(shape):
    """out(w) = base + w·corr is the reference run with H̄ multiplied by w (per head): the weight
    costs a kernel one multiply and nothing else changes."""
    b, h, hk, length, d, bs = shape
    q, k, v = make_qkv(b, h, hk, length, d, seed=1)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=bs)
    stats = ref.block_stats(k, v, bs)
    w = torch.linspace(-0.5, 1.5, h, dtype=torch.float64)
    x = lambda s: ref.expand_kv_heads(s, h)  # noqa: E731 (per query head, so H̄ can differ per head)
    scaled = ref.BlockStats(kmean=x(stats.kmean), vsum=x(stats.vsum), counts=stats.counts,
                            hbar=x(stats.hbar) * w.view(1, h, 1, 1))
    out, _ = ref.pisa_forward(q, x(k), x(v), scaled, t.selected, mode="hybrid", scale=d**-0.5, block_size=bs)
    torch.testing.assert_close(t.output(w), out, rtol=0, atol=1e-13)


@pytest.mark.parametrize("over", cal.FIT_OVER)
def test_least_squares_recovers_a_planted_weight(over):
    q, k, v = make_qkv(2, 4, 2, 150, 32, seed=2)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=32)
    planted = torch.tensor([0.3, -0.2, 0.9, 1.7], dtype=torch.float64) if over == "head" else torch.tensor(0.45, dtype=torch.float64)
    dense = t.output(planted)
    torch.testing.assert_close(cal.fit_alpha(t, dense, over=over), planted, rtol=0, atol=1e-10)
    torch.testing.assert_close(cal.fit_alpha_l1(t, dense, over=over), planted, rtol=0, atol=1e-10)
    # With noise independent of the correction the fit stays close and is the L2 minimiser.
    g = torch.Generator().manual_seed(3)
    noisy = dense + 0.02 * dense.abs().mean() * torch.randn(dense.shape, generator=g, dtype=torch.float64)
    w = cal.fit_alpha(t, noisy, over=over)
    assert (w - planted).abs().max() < 0.05
    st = cal.alpha_stats(t, noisy)
    total = (lambda a: st.residual(a).sum()) if over == "layer" else (lambda a: st.residual(a))
    for eps in (1e-3, -1e-3):
        assert bool((total(w) <= total(w + eps)).all())


def test_residual_and_l1_fit_are_their_losses_minimisers():
    q, k, v = make_qkv(1, 2, 2, 128, 16, seed=4)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=32)
    dense = metrics.dense_pass(q, k, v, block_size=32).out
    st = cal.alpha_stats(t, dense)
    for a in (0.0, 0.4, 1.0):
        direct = ((dense - t.output(a)) ** 2).sum(dim=(0, 2, 3))
        torch.testing.assert_close(st.residual(a), direct, rtol=1e-10, atol=0)
    w1 = cal.fit_alpha_l1(t, dense, over="head")
    grid = torch.linspace(-1, 2, 601, dtype=torch.float64)
    l1 = torch.stack([(dense - t.output(a)).abs().sum(dim=(0, 2, 3)) for a in grid])  # [G, H]
    best = l1.min(dim=0).values
    at_fit = (dense - t.output(w1)).abs().sum(dim=(0, 2, 3))
    assert bool((at_fit <= best * (1 + 1e-12)).all())


def test_stats_pool_by_addition():
    """Fitting on two inputs at once equals adding their statistics (how layers/inputs pool)."""
    q, k, v = make_qkv(2, 2, 2, 128, 16, seed=5)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=32)
    dense = metrics.dense_pass(q, k, v, block_size=32).out
    both = cal.alpha_stats(t, dense)
    parts = [cal.alpha_stats(cal.TailTerms(t.base[i : i + 1], t.corr[i : i + 1], t.lse[i : i + 1], t.selected[i : i + 1]),
                             dense[i : i + 1]) for i in range(2)]
    pooled = parts[0] + parts[1]
    for name in ("cr", "cc", "rr", "n"):
        torch.testing.assert_close(getattr(pooled, name), getattr(both, name), rtol=1e-12, atol=0)
    layer = both.alpha("layer")
    assert layer.dim() == 0
    torch.testing.assert_close(layer, both.cr.sum() / both.cc.sum(), rtol=0, atol=0)


def test_rows_subset_and_no_tail_default():
    q, k, v = make_qkv(1, 2, 2, 128, 16, seed=6)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=32)
    dense = metrics.dense_pass(q, k, v, block_size=32).out
    sub = cal.fit_alpha(t, dense, rows=slice(0, 64))
    direct = cal.fit_alpha(cal.TailTerms(t.base[:, :, :64], t.corr[:, :, :64], t.lse[:, :, :64], t.selected), dense[:, :, :64])
    torch.testing.assert_close(sub, direct, rtol=0, atol=0)
    # density 1: every block exact, no tail, no correction: the weight is unconstrained -> default.
    full = cal.tail_terms(q, k, v, density=1.0, block_size=32)
    assert float(full.corr.abs().max()) == 0.0
    assert cal.fit_alpha(full, dense).tolist() == [1.0, 1.0]
    assert cal.fit_alpha(full, dense, over="layer", default=0.5).item() == 0.5
    assert cal.fit_alpha_l1(full, dense, default=0.25).tolist() == [0.25, 0.25]
    # the default of a head without tail is given as is, not clamped with the fitted weights
    st = cal.AlphaStats(torch.tensor([0.0, 3.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64),
                        torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    assert st.alpha(default=1.5, bounds=cal.FIT_BOUNDS).tolist() == [1.5, cal.FIT_BOUNDS[1]]


def test_alpha_reference_matches_terms():
    q, k, v = make_qkv(1, 4, 2, 150, 32, seed=7)
    w = torch.tensor([0.0, 0.5, 1.0, 0.25], dtype=torch.float64)
    out, lse, sel = cal.pisa_alpha_reference(q, k, v, density=0.25, alpha=w, block_size=32, covariance_aware=True)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=32, covariance_aware=True)
    torch.testing.assert_close(out, t.output(w), rtol=0, atol=0)
    ref_out, ref_lse, ref_sel = ref.pisa_reference(q, k, v, density=0.25, block_size=32, covariance_aware=True)
    assert torch.equal(sel, ref_sel)
    torch.testing.assert_close(out[:, 2], ref_out[:, 2], rtol=0, atol=1e-13)  # w = 1: the paper
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)


def test_bad_arguments_are_named():
    q, k, v = make_qkv(1, 2, 2, 128, 16)
    t = cal.tail_terms(q, k, v, density=0.25, block_size=32)
    with pytest.raises(ValueError, match="alpha"):
        t.output(torch.ones(3))
    with pytest.raises(ValueError, match="alpha"):
        t.output(float("nan"))
    with pytest.raises(TypeError, match="alpha"):
        t.output("0.5")
    with pytest.raises(TypeError, match="alpha"):
        t.output(True)
    with pytest.raises(ValueError, match="mode"):
        cal.tail_terms(q, k, v, density=0.25, block_size=32, mode="zeroth")
    with pytest.raises(ValueError, match="density and selected"):
        cal.tail_terms(q, k, v, block_size=32)
    with pytest.raises(ValueError, match="density and selected"):
        cal.tail_terms(q, k, v, density=0.25, selected=t.selected, block_size=32)
    with pytest.raises(ValueError, match="dense"):
        cal.alpha_stats(t, torch.zeros(1, 2, 100, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="over"):
        cal.fit_alpha(t, t.base, over="model")
    with pytest.raises(ValueError, match="over"):
        cal.fit_alpha_l1(t, t.base, over="model")
    with pytest.raises(ValueError, match="alpha"):
        cal.pisa_alpha_reference(q, k, v, density=0.25, alpha=torch.ones(5), block_size=32)


# --- fits on sampled query rows -----------------------------------------------------------------
@pytest.mark.parametrize("mode", cal.CORRECTION_MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fit_rows_is_the_fit_restricted_to_those_rows(shape, mode):
    """Sampled rows give exactly the statistics of the whole-input fit (tail_terms: two reference
    passes) restricted to them: same selection per query block (a ragged last block included, GQA,
    kept blocks, covariance-aware), same terms, and the dense tail mass."""
    b, h, hk, length, d, bs = shape
    q, k, v = make_qkv(b, h, hk, length, d, seed=8)
    keep = torch.zeros(spec.num_blocks(length, bs), dtype=torch.bool)
    keep[0] = True
    kw = dict(density=0.25, block_size=bs, covariance_aware=True, keep_blocks=keep, mode=mode)
    t = cal.tail_terms(q, k, v, **kw)
    dense = metrics.dense_pass(q, k, v, block_size=bs, masks=(t.selected,))
    rows = [length - 1, 3, 4, 5, 40, 41, 100, 4]  # unsorted, a repeat, runs across a block boundary
    picked = torch.tensor(sorted(set(rows)))
    want = cal.alpha_stats(t, dense.out, rows=picked)
    got = cal.fit_rows(q, k, v, rows=rows, **kw)
    for name in ("cr", "cc", "rr", "n"):
        torch.testing.assert_close(getattr(got.stats, name), getattr(want, name), rtol=1e-10, atol=1e-12)
    assert got.rows == b * picked.numel()
    torch.testing.assert_close(got.tail_mass, dense.tail_mass[0][:, :, picked].sum(dim=(0, 2)), rtol=1e-10, atol=0)
    # measured=[lo, hi): rows outside are left out; all rows = the whole input.
    part = cal.fit_rows(q, k, v, rows=rows, measured=(5, length), **kw)
    torch.testing.assert_close(part.stats.cr, cal.alpha_stats(t, dense.out, rows=picked[picked >= 5]).cr,
                               rtol=1e-10, atol=1e-12)
    whole = cal.fit_rows(q, k, v, **kw)
    torch.testing.assert_close(whole.stats.alpha(), cal.fit_alpha(t, dense.out), rtol=1e-9, atol=1e-12)


def test_fit_rows_chunks_rows_like_one_pass(monkeypatch):
    q, k, v = make_qkv(1, 4, 2, 150, 32, seed=11)
    kw = dict(density=0.25, block_size=32, rows=range(20, 90))
    whole = cal.fit_rows(q, k, v, **kw)
    monkeypatch.setattr(ref, "_SLAB_ELEMS", 1)  # the reference's row terms one row at a time
    monkeypatch.setattr(metrics, "_SLAB", 1)
    part = cal.fit_rows(q, k, v, **kw)
    torch.testing.assert_close(part.stats.cr, whole.stats.cr, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(part.tail_mass, whole.tail_mass, rtol=1e-12, atol=0)


def test_fit_rules_share_one_dense_pass_and_equal_single_rule_fits(monkeypatch):
    q, k, v = make_qkv(1, 4, 2, 150, 32, seed=12)
    kw = dict(density=0.25, block_size=32, rows=range(10, 120))
    calls = []
    dense_pass = metrics.dense_pass
    monkeypatch.setattr(metrics, "dense_pass", lambda *a, **k: calls.append(1) or dense_pass(*a, **k))
    both = cal.fit_rules(q, k, v, rules=(False, True), **kw)
    assert len(calls) == 1 and set(both) == {False, True}
    for rule in (False, True):
        one = cal.fit_rows(q, k, v, covariance_aware=rule, **kw)
        torch.testing.assert_close(both[rule].stats.cr, one.stats.cr, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(both[rule].stats.rr, one.stats.rr, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="rules"):
        cal.fit_rules(q, k, v, rules=(), **kw)


def test_fit_rows_low_precision_inputs_fit_in_float32():
    q, k, v = make_qkv(1, 2, 2, 256, 32, seed=9)
    kw = dict(density=0.25, block_size=32, rows=list(range(64, 96)) + list(range(160, 192)))
    exact = cal.fit_rows(q, k, v, **kw)
    low = cal.fit_rows(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw)
    assert low.stats.cr.dtype == torch.float64  # statistics accumulate in float64
    torch.testing.assert_close(low.stats.alpha(), exact.stats.alpha(), rtol=0, atol=0.05)
    pooled = exact + low
    assert pooled.rows == 2 * exact.rows
    assert bool((pooled.mean_tail_mass() > 0).all() and (pooled.mean_tail_mass() < 1).all())
    with pytest.raises(ValueError, match="rows"):
        cal.fit_rows(q, k, v, density=0.25, block_size=32, rows=[300])
    with pytest.raises(ValueError, match="measured"):
        cal.fit_rows(q, k, v, density=0.25, block_size=32, rows=[0, 1], measured=(100, 200))


def test_sample_rows_are_runs_in_distinct_blocks():
    import random

    from pisa_attn.diffusers.calibrate import CHUNK, sample_rows

    rng = random.Random(0)
    for lo, hi, bs, n in ((13, 300, 64, 32), (0, 50, 16, 100), (5, 6, 64, 32)):
        rows = sample_rows(rng, lo, hi, bs, n)
        assert rows == sorted(set(rows)) and all(lo <= r < hi for r in rows)
        blocks = [r // bs for r in rows]
        assert all(blocks.count(x) <= min(CHUNK, bs) for x in set(blocks))
        assert len(rows) <= max(n, min(CHUNK, bs)) and rows
    # too few blocks for the rows in runs of CHUNK: longer runs (DINOv2: 22 blocks, 512 rows asked
    # once gave 352), all rows when asked for as many
    rows = sample_rows(rng, 1, 1370, 64, 512)
    assert len(rows) >= 500 and rows == sorted(set(rows))
    assert sample_rows(rng, 1, 1370, 64, 5000) == list(range(1, 1370))


def test_fit_bounds_clamp():
    st = cal.AlphaStats(torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), torch.ones(3, dtype=torch.float64),
                        torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    assert st.alpha().tolist() == [2.0, -1.0, 0.5]
    assert st.alpha(bounds=cal.FIT_BOUNDS).tolist() == [1.0, 0.0, 0.5]


def test_reference_alpha_equals_the_split_terms():
    """pisa_forward(alpha=w) is base + w·corr of tail_terms (float64), for both forms."""
    q, k, v = make_qkv(2, 4, 2, 150, 32, seed=10)
    w = torch.tensor([0.0, 0.3, 1.0, 0.8], dtype=torch.float64)
    for mode in cal.CORRECTION_MODES:
        t = cal.tail_terms(q, k, v, density=0.25, block_size=32, mode=mode)
        out, lse = ref.pisa_forward(q, k, v, ref.block_stats(k, v, 32), t.selected, mode=mode, scale=32**-0.5,
                                    block_size=32, alpha=w)
        torch.testing.assert_close(out, t.output(w), rtol=0, atol=1e-13)
        torch.testing.assert_close(lse, t.lse, rtol=0, atol=0)


def test_fit_rules_reads_nothing_back_from_the_device():
    """No host synchronisation in a fit (what a warm-up call on a GPU would wait for): no op that
    reads a value back (item, nonzero, is_nonzero, equal) runs, with kept blocks and both rules."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
             "aten.equal.default", "aten.item.default"}
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = make_qkv(1, 4, 2, 256, 32, seed=13)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[0] = True
    with Watch():
        cal.fit_rules(q, k, v, density=0.25, block_size=32, rows=list(range(40, 56)) + list(range(200, 216)),
                      keep_blocks=keep)
    assert seen and not reads & set(seen)


def test_fit_graphs_static_path_equals_fit_rules_call_by_call():
    """FitGraphs (the path a calibrated call takes; on the CPU its static buffers run op by op)
    gives fit_rules' numbers for every call, also when calls of one shape follow each other with
    new inputs (the static buffers are refilled) and when shapes alternate."""
    graphs = cal.FitGraphs(max_graphs=2)
    kw = dict(density=0.25, block_size=32, mode="hybrid")
    for seed, (length, rows) in enumerate([(150, [40, 41, 42, 100, 101]), (150, [3, 4, 5, 70, 71]),
                                           (128, [96, 97, 98, 99]), (150, [140, 141, 142, 20, 21]),
                                           (150, [33, 34, 35, 64, 65])]):
        q, k, v = make_qkv(1, 4, 2, length, 32, seed=20 + seed)
        keep = torch.zeros(spec.num_blocks(length, 32), dtype=torch.bool)
        keep[seed % 3] = True
        plan = cal.row_plan(length, 32, rows)
        sums = graphs.sums(q, k, v, plan, rules=(False, True), scale=32**-0.5, keep_blocks=keep, **kw)
        got = cal.row_fits(sums, (False, True), rows=len(rows), elems=len(rows) * 32)
        want = cal.fit_rules(q, k, v, rows=rows, rules=(False, True), keep_blocks=keep, **kw)
        for rule in (False, True):
            for name in ("cr", "cc", "rr", "n"):
                torch.testing.assert_close(getattr(got[rule].stats, name), getattr(want[rule].stats, name),
                                           rtol=0, atol=0)
            torch.testing.assert_close(got[rule].tail_mass, want[rule].tail_mass, rtol=0, atol=0)
            assert got[rule].rows == want[rule].rows
    assert len(graphs) == 2  # the most recent shapes only


def test_row_plan_keys_by_layout_not_position():
    a = cal.row_plan(300, 64, [10, 11, 12, 200, 201])
    b = cal.row_plan(300, 64, [70, 71, 72, 130, 131])
    c = cal.row_plan(300, 64, [10, 11, 12, 290, 291])  # the ragged last block (44 rows)
    assert a.shape_key() == b.shape_key() != c.shape_key()
    assert a.runs == ((10, 13), (200, 202)) and a.spans == ((0, 64), (192, 256))
    assert a.which(torch.device("cpu")).tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="rows"):
        cal.row_plan(300, 64, [400])


# (B, H, Hk, Lq, Lk, D, dtype, keep, rules, rows): aligned, both rules; GQA + ragged keys + a kept
# block + two batch rows; one rule (covariance-aware), float16, per-head kept blocks, D 16, 70 rows
# (two row tiles of 64).
FIT_KERNEL_CASES = [
    (1, 2, 2, 128, 384, 64, torch.bfloat16, None, (False, True), [3, 4, 5, 62, 63, 64, 65, 100]),
    (2, 2, 1, 200, 444, 32, torch.bfloat16, "shared", (False, True), [3, 4, 5, 70, 71, 130, 199]),
    (1, 2, 1, 192, 300, 16, torch.float16, "per-head", (True,), list(range(0, 30)) + list(range(64, 84))
     + list(range(140, 160))),
]


def _fit_kernel_id(c) -> str:
    b, h, hk, lq, lk, d, dt, keep, rules, rows = c
    return (f"B{b}-H{h}-Hk{hk}-Lq{lq}-Lk{lk}-D{d}-{str(dt)[6:]}" + (f"-keep-{keep}" if keep else "")
            + "-rules" + "".join("C" if r else "T" for r in rules) + f"-R{len(rows)}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need Triton's interpreter (set without a GPU); "
                    "tests/gpu/test_gpu_calibration.py checks the kernel")
@pytest.mark.parametrize("case", FIT_KERNEL_CASES, ids=_fit_kernel_id)
def test_fit_kernel_equals_the_reference_fit(case):
    """The Triton fit (prepare and select stages, one pass of the rows over the keys, one merge)
    gives the reference's sums on the same low-precision values, computed in float32, up to the
    kernels' input-dtype value means (the tail's Σv) and TF32-free float32 arithmetic here."""
    from pisa_attn.ops.triton import fit as tfit

    b, h, hk, lq, lk, d, dt, keep, rules, rows = case
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, lq, d, generator=g).to(dt)
    k, v = (torch.randn(b, hk, lk, d, generator=g).to(dt) for _ in range(2))
    nk = spec.num_blocks(lk, 64)
    kb = None
    if keep == "shared":
        kb = torch.zeros(nk, dtype=torch.bool)
        kb[0] = True
    elif keep == "per-head":
        kb = torch.zeros(b, h, nk, dtype=torch.bool)
        kb[0, 1, 2] = True
    plan = cal.row_plan(lq, 64, rows)
    qb, qr = plan.gather(q)
    kw = dict(density=0.25, rules=rules, scale=d**-0.5, block_size=64)
    want = cal._fit_sums(qb, qr, plan.which(q.device), k, v, kb, mode="hybrid", **kw)
    nb = len(plan.spans)
    got = tfit.fit_sums(qr, torch.arange(len(plan.pos), dtype=torch.int32), torch.arange(nb, dtype=torch.int32) * 64,
                        plan.which(q.device), k, v, kb, **kw, q_blocks=qb)
    # q read in place: the rows at their positions, the blocks at their first rows
    pos = torch.tensor(plan.pos, dtype=torch.int32)
    starts = torch.tensor([a for a, _ in plan.spans], dtype=torch.int32)
    in_place = tfit.fit_sums(q, pos, starts, plan.which(q.device), k, v, kb, **kw)
    assert torch.equal(in_place, got)
    assert got.shape == want.shape == (len(rules), 4, h) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    torch.testing.assert_close(got[:, 3], want[:, 3], rtol=2e-5, atol=0)  # the tail mass: no value mean in it


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need Triton's interpreter (set without a GPU)")
def test_fit_graphs_take_the_kernel_where_it_is_supported(monkeypatch):
    """A calibrated call on the kernel path (forced here on the CPU through the interpreter) gets
    fit_rules' fits, captures no graph and keeps one row-to-block map per rows layout."""
    monkeypatch.setattr(cal, "fast_fit_supported", lambda qr, mode, bs, kv_len=None: mode == "hybrid")
    graphs = cal.FitGraphs()
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 320, 32, generator=g).bfloat16() for _ in range(3))
    keep = torch.zeros(5, dtype=torch.bool)
    keep[4] = True
    for rows in ([10, 11, 12, 200, 201], [74, 75, 76, 264, 265]):  # one layout, two positions
        plan = cal.row_plan(320, 64, rows)
        sums = graphs.sums(q, k, v, plan, density=0.25, rules=(False, True), mode="hybrid", scale=32**-0.5,
                           block_size=64, keep_blocks=keep)
        monkeypatch.setattr(cal, "fast_fit_supported", lambda qr, mode, bs, kv_len=None: False)
        want = cal.fit_rules(q, k, v, density=0.25, rows=rows, block_size=64, keep_blocks=keep)
        monkeypatch.setattr(cal, "fast_fit_supported", lambda qr, mode, bs, kv_len=None: mode == "hybrid")
        got = cal.row_fits(sums, (False, True), rows=len(rows), elems=len(rows) * 32)
        for rule in (False, True):
            torch.testing.assert_close(got[rule].stats.cr, want[rule].stats.cr, rtol=2e-3, atol=0)
            torch.testing.assert_close(got[rule].tail_mass, want[rule].tail_mass, rtol=2e-5, atol=0)
    assert len(graphs) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need Triton's interpreter (set without a GPU)")
@pytest.mark.parametrize("rules,keep", [((False, True), None), ((True, False), "shared"), ((True,), "per-head")],
                         ids=["TC", "CT-keep", "C-keep-per-head"])
def test_fit_selection_is_the_reference_selection(rules, keep):
    """The fit kernel's selection (one launch for both rules, either order) is the reference's
    top-k of the same statistics, with kept blocks, GQA and 100 key blocks (a padded sort); exactly
    n_select blocks besides the kept ones, ties to the lower block index."""
    from pisa_attn.ops.triton import fit as tfit

    g = torch.Generator().manual_seed(2)
    b, h, hk, nk, d = 1, 2, 1, 100, 32
    q = torch.randn(b, h, 2 * 64 - 9, d, generator=g)  # a ragged last query block
    qmean = ref.block_means(q, 64, torch.float32)
    starts = torch.tensor([0, 64], dtype=torch.int32)
    kmean = torch.randn(b, hk, d, nk, generator=g).transpose(2, 3)  # the prepare stage's layout
    hdev = torch.rand(b, hk, nk, generator=g) * 5
    kb = None
    if keep == "shared":
        kb = torch.zeros(nk, dtype=torch.bool)
        kb[[0, 7]] = True
    elif keep == "per-head":
        kb = torch.zeros(b, h, nk, dtype=torch.bool)
        kb[0, 1, 50] = True
    got = tfit.select_masks(q, starts, kmean, hdev, kb, rules=rules, n_select=12, scale=d**-0.5, block_size=64)
    for i, rule in enumerate(rules):
        scores = ref.selection_scores(qmean, kmean, d**-0.5, hdev if rule else None)
        want = ref.select_blocks(scores, 12, kb)
        assert torch.equal(got[i].bool(), want)
    # ties: every key block alike; the lowest indices win, exactly n_select of them
    flat = torch.ones(1, 1, d, nk).transpose(2, 3)
    tie = tfit.select_masks(q[:1, :1], starts, flat, None, None, rules=(False,), n_select=5, scale=1.0, block_size=64)
    assert [row.nonzero().flatten().tolist() for row in tie[0, 0, 0]] == [[0, 1, 2, 3, 4]] * 2


def test_fit_kernel_chunks_cover_the_keys():
    from pisa_attn.ops.triton import fit as tfit

    for nk, bh, tiles in ((512, 12, 1), (80, 24, 1), (3, 2, 1), (1, 1000, 4), (80, 1, 8)):
        per, chunks = tfit.chunking(bh, tiles, nk, torch.device("cpu"))
        assert (chunks - 1) * per < nk <= chunks * per  # no empty chunk
        assert per == 1 or bh * tiles * chunks >= tfit.FIT_TUNING["waves"] * 4  # the interpreter's 4 "SMs"
    assert [tfit.row_tile(r) for r in (1, 16, 17, 32, 33, 64, 512)] == [16, 16, 32, 32, 64, 64, 64]


def test_fast_fit_only_on_cuda_hybrid():
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    assert not cal.fast_fit_supported(q, "hybrid", 64)  # CPU: the reference


FIT_BUILD_SCRIPT = """
import json, sys, torch
from pisa_attn.ops.triton.fit import compile_for_sm90
res = {}
for name, (d, rows, rules, dtype, nk) in json.loads(sys.argv[1]).items():
    res[name] = {k: len(c.asm["cubin"]) for k, c in compile_for_sm90(d, rows, rules, getattr(torch, dtype), nk).items()}
print(json.dumps(res))
"""


def test_fit_kernels_build_for_sm90():
    """The fit's select, rows and merge kernels compile for sm_90 without a GPU (a subprocess: this
    session runs Triton's interpreter): Wan's shape with both rules; not in CI's subset (10 s and a
    minute of ptxas on two cores), one rule at D 64 in float16 and 512 rows (eight row tiles)
    against 4096 key blocks."""
    import json

    from sm90_build import ci_subset, run_script

    variants = ci_subset({"D128-R32-rules2-bf16-Nk512": (128, 32, 2, "bfloat16", 512),
                          "D64-R40-rules1-fp16-Nk80": (64, 40, 1, "float16", 80),
                          "D128-R512-rules2-bf16-Nk4096": (128, 512, 2, "bfloat16", 4096)},
                         ("D128-R32-rules2-bf16-Nk512",))
    proc = run_script(FIT_BUILD_SCRIPT, json.dumps(variants))
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(res) == set(variants)
    for name, kernels in res.items():
        assert set(kernels) == {"select", "rows", "merge"} and all(n > 0 for n in kernels.values()), name


def test_fit_graphs_copy_host_kept_blocks_once():
    graphs = cal.FitGraphs()
    keep = torch.zeros(10, dtype=torch.bool)
    assert graphs.on_device(keep, torch.device("cpu")) is keep  # already there: no copy, no entry
    assert graphs.on_device(None, "cpu") is None and len(graphs._keep) == 0
    meta = torch.device("meta")
    a = graphs.on_device(keep[:8], meta)
    b = graphs.on_device(keep[:8], meta)  # a new view of the same blocks: the same copy
    c = graphs.on_device(keep[:9], meta)
    assert a is b and c is not a and a.device == meta and len(graphs._keep) == 2


def _warmup_calls(q, k, v, layers: int = 2, steps: int = 2):
    from pisa_attn.diffusers.hooks import AttentionCall

    for step in range(steps):
        for layer in range(layers):
            yield AttentionCall(model="wan", layer=layer, step=step, q=q, k=k, v=v, out=q, dense=True, density=0.25,
                                mode="hybrid", covariance_aware=False, block_size=64,
                                meta={"dense_reason": "warmup_step"})


def test_side_stream_changes_nothing_on_the_cpu():
    """``side_stream`` (the default) on the CPU: no stream, the same sums bit for bit as without it."""
    from pisa_attn.diffusers.calibrate import CalibrationConfig, Calibrator
    from pisa_attn.diffusers.schedule import Schedule

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 320, 32, generator=g) for _ in range(3))
    sums = {}
    for side in (True, False):
        c = Calibrator(CalibrationConfig(rows=20, side_stream=side), Schedule(dense_steps=2, min_kv_len=0))
        for call in _warmup_calls(q, k, v):
            c.observe(call)
        assert c.calls == 4 and not c._streams and not c._pending
        sums[side] = {i: s[0] for i, s in c._sums.items()}
    assert sums[True].keys() == {0, 1}
    for i in (0, 1):
        assert torch.equal(sums[True][i], sums[False][i])
    with pytest.raises(TypeError, match="side_stream"):
        CalibrationConfig(side_stream=1)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(density=0.0), ValueError, "density"), (dict(density=1.5), ValueError, "density"),
    (dict(density=True), TypeError, "density"), (dict(density=float("nan")), ValueError, "density"),
    (dict(block_size=0), ValueError, "block_size"), (dict(scale=-1.0), ValueError, "scale"),
])
def test_fit_helpers_check_their_settings(kw, exc, match):
    """The calibration helpers refuse what pisa_attention refuses, naming the argument."""
    q, k, v = make_qkv(1, 2, 2, 128, 16, seed=5)
    args = {**dict(density=0.25, block_size=32), **kw}
    for fn in (cal.fit_rows, cal.tail_terms, metrics.select):
        with pytest.raises(exc, match=match):
            fn(q, k, v, **args)
    with pytest.raises(ValueError, match="rank 4"):
        cal.fit_rows(q[0], k, v, density=0.25, block_size=32)


def test_rel_l1_needs_one_shape_and_a_zero_reference_reads_inf():
    a = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="one shape"):
        metrics.rel_l1(a[0], a)
    with pytest.raises(ValueError, match="one shape"):
        metrics.rel_l1_per_head(a[:, :, :1], a)
    zero = torch.zeros_like(a)
    assert metrics.rel_l1(a, zero) == float("inf") and metrics.rel_l1(zero, zero) == 0.0
    assert metrics.rel_l1_per_head(zero, zero).tolist() == [0.0, 0.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors need Triton's interpreter (set without a GPU); "
                    "tests/gpu/test_gpu_calibration.py checks the kernel")
@pytest.mark.parametrize("outlier", [50.0, 100.0, 125.0])
def test_fit_kernel_keeps_the_tail_under_a_far_outlier_token(outlier):
    """One key token scoring ``outlier`` (natural units) above everything PISA sees (its block in
    the tail, its centroid low): PISA's sums are shifted by their own maximum, not the dense one,
    or every term of the rule underflows in float32 (the fit then read 'no tail')."""
    from pisa_attn.ops.triton import fit as tfit

    lq, lk, d = 64, 256, 32
    g = torch.Generator().manual_seed(1)
    q = torch.zeros(1, 1, lq, d)
    q[..., 0] = 4.0
    q += 0.01 * torch.randn(q.shape, generator=g)
    k = 0.1 * torch.randn(1, 1, lk, d, generator=g)
    v = torch.randn(1, 1, lk, d, generator=g)
    k[0, 0, 192:200, 0], k[0, 0, 201:256, 0] = -70.0, -10.0
    k[0, 0, 200, 0] = outlier * d**0.5 / 4.0
    q, k, v = (x.bfloat16() for x in (q, k, v))
    plan = cal.row_plan(lq, 64, [0, 1, 2, 3])
    qb, qr = plan.gather(q)
    kw = dict(density=0.25, rules=(False, True), scale=d**-0.5, block_size=64)
    want = cal._fit_sums(qb, qr, plan.which(q.device), k, v, None, mode="hybrid", **kw)
    got = tfit.fit_sums(q, torch.tensor(plan.pos, dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                        plan.which(q.device), k, v, None, **kw)
    assert want[:, 1].min() > 1.0  # a real first-order term
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)


def test_fit_inputs_are_checked_where_they_enter():
    q, k, v = (torch.randn(1, 2, 130, 16) for _ in range(3))
    kw = dict(density=0.25, block_size=64)
    for keep, exc in ((torch.ones(3, dtype=torch.int64), TypeError), (torch.ones(2, 3, dtype=torch.bool), ValueError),
                      (torch.ones(5, dtype=torch.bool), ValueError)):
        with pytest.raises(exc, match="keep_blocks"):
            cal.fit_rows(q, k, v, keep_blocks=keep, **kw)
        with pytest.raises(exc, match="keep_blocks"):
            cal.tail_terms(q, k, v, keep_blocks=keep, **kw)
    mask = torch.zeros(130, dtype=torch.bool)
    mask[[3, 70, 129]] = True
    assert cal.row_plan(130, 64, mask).pos == (3, 70, 129)  # a bool mask is the rows it marks
    assert cal.fit_rows(q, k, v, rows=mask, **kw).rows == cal.fit_rows(q, k, v, rows=[3, 70, 129], **kw).rows == 3
    for rows, exc in (([5, 500], ValueError), ([-1], ValueError), (torch.tensor([2.7]), TypeError),
                      (torch.ones(7, dtype=torch.bool), ValueError)):
        with pytest.raises(exc, match="rows"):
            cal.fit_rows(q, k, v, rows=rows, **kw)
    for sel in (torch.ones(1, 2, 3, 3, dtype=torch.uint8), torch.ones(1, 2, 5, 3, dtype=torch.bool),
                torch.ones(1, 2, 3, 4, dtype=torch.bool)):
        with pytest.raises(ValueError, match="selected"):
            cal.tail_terms(q, k, v, selected=sel, block_size=64)
    terms = cal.tail_terms(q, k, v, **kw)
    assert torch.equal(terms.output(torch.tensor([0.5])), terms.output(0.5))  # one value: every head's
    dense = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v
    bad = dense.clone()
    bad[0, 0, 5, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        cal.fit_alpha_l1(terms, bad)
