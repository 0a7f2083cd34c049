"""The PyTorch reference (``ops/reference.py``) and ``pisa_attention(backend="reference")`` against
the independent float64 brute force of the paper's equations (``tests/brute.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from brute import MODES, brute_dense, brute_pisa, brute_selection, paper
from pisa_attn import make_plan, pisa_attention, spec, tail_weight
from pisa_attn.ops import reference as ref
from pisa_attn.ops.selection import Selection
from pisa_attn.ops.stages import run_plan

# (B, H, Hk, Lq, Lk, D, block_size): aligned, ragged + Lq≠Lk + GQA, MQA with a 1-token tail block.
SHAPES = [(1, 2, 2, 64, 64, 32, 16), (2, 4, 2, 100, 150, 32, 16), (1, 4, 1, 97, 65, 64, 32)]


def shape_id(s) -> str:
    b, h, hk, lq, lk, d, bs = s
    return f"B{b}-H{h}-Hk{hk}-Lq{lq}-Lk{lk}-D{d}-bs{bs}"


def make_qkv(b, h, hk, lq, lk, d, *, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_selection(b, h, nq, nk, seed=0) -> torch.Tensor:
    """Random exact sets with at least one block per row (the API always selects >= 1)."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.rand(b, h, nq, nk, generator=g) < 0.35
    first = torch.randint(nk, (b, h, nq, 1), generator=g)
    return sel.scatter(-1, first, True)


def forward_with(q, k, v, sel, mode, block_size, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    stats = ref.block_stats(k, v, block_size)
    return ref.pisa_forward(q, k, v, stats, sel, mode=mode, scale=scale, block_size=block_size)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
def test_forward_matches_brute_for_given_selection(shape, mode, dtype, tol):
    b, h, hk, lq, lk, d, bs = shape
    q, k, v = make_qkv(b, h, hk, lq, lk, d, dtype=dtype)
    sel = random_selection(b, h, -(-lq // bs), -(-lk // bs))
    out, lse = forward_with(q, k, v, sel, mode, bs)
    want, want_lse = brute_pisa(q, k, v, sel, mode=mode, block_size=bs)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("density", [0.2, 0.5])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_end_to_end_matches_brute(shape, density, mode):
    b, h, hk, lq, lk, d, bs = shape
    q, k, v = make_qkv(b, h, hk, lq, lk, d, seed=1)
    _, _, selected = ref.pisa_reference(q, k, v, density=density, block_size=bs, mode=mode)
    want_sel = brute_selection(q, k, density=density, block_size=bs)
    assert torch.equal(selected, want_sel)
    out, lse = pisa_attention(
        q, k, v, density=density, block_size=bs, mode=mode, backend="reference", return_lse=True, **paper(mode)
    )
    want, want_lse = brute_pisa(q, k, v, want_sel, mode=mode, block_size=bs)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_ragged_B1_H2_L1000_D64(mode):
    """L=1000 with block 64: the last block holds 40 tokens (its mean, sum and weight use 40)."""
    q, k, v = make_qkv(1, 2, 2, 1000, 1000, 64, dtype=torch.float32, seed=2)
    out = pisa_attention(q, k, v, density=0.25, block_size=64, mode=mode, backend="reference", **paper(mode))
    sel = brute_selection(q, k, density=0.25, block_size=64)
    want, _ = brute_pisa(q, k, v, sel, mode=mode, block_size=64)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["zeroth", "first"])
def test_one_token_tail_block_is_exact(mode):
    """A 1-token block equals its centroid, so its Taylor term is exact - but only if the
    denominator weight is the true count 1 (not block_size) and H_j = 0 for it."""
    q, k, v = make_qkv(1, 2, 2, 65, 65, 32, dtype=torch.float64, seed=3)
    sel = torch.zeros(1, 2, 2, 2, dtype=torch.bool)
    sel[..., 0] = True  # block 0 exact, the ragged 1-token block 1 in the tail
    out, lse = forward_with(q, k, v, sel, mode, 64)
    want, want_lse = brute_dense(q, k, v)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)


def tail_max_inputs(dtype):
    """Queries alternate ±u on top of a shared w; key block 0 is along w, the ragged last block
    along u. Pooled scores pick block 0 (the ±u halves cancel in q̄), but for the +u rows the
    last (tail) block's centroid score (~800) is far above every exact score (~50): exp would
    overflow without one shared running maximum."""
    d, bs, lq, lk = 32, 16, 64, 5 * 16 + 5
    g = torch.Generator().manual_seed(4)
    u = torch.zeros(d, dtype=torch.float64)
    w = torch.zeros(d, dtype=torch.float64)
    u[0], w[1] = 1.0, 1.0
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(lq // 2)
    q = (d**0.5) * (5.0 * w + 20.0 * sign[:, None] * u) + 0.1 * torch.randn(lq, d, generator=g, dtype=torch.float64)
    k = 0.3 * torch.randn(lk, d, generator=g, dtype=torch.float64)
    k[:bs] += 10.0 * w
    k[-5:] += 40.0 * u
    v = torch.randn(lk, d, generator=g, dtype=torch.float64)
    return tuple(x.expand(1, 2, -1, -1).to(dtype) for x in (q, k, v)), bs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-3)], ids=["fp64", "fp32"])
def test_tail_block_holds_row_maximum(mode, dtype, tol):
    (q, k, v), bs = tail_max_inputs(dtype)
    out, lse, sel = ref.pisa_reference(q, k, v, density=0.2, block_size=bs, mode=mode)  # k = 1 block
    assert sel[..., 0].all() and not sel[..., -1].any()
    centroid = (q.double() @ k.double()[..., -5:, :].mean(-2, keepdim=True).transpose(-1, -2)).squeeze(-1) / 32**0.5
    exact_max = (q.double() @ k.double()[..., :bs, :].transpose(-1, -2)).amax(-1) / 32**0.5
    assert (centroid[..., ::2] > exact_max[..., ::2] + 500).all()  # the tail holds the row maximum
    via_api = pisa_attention(q, k, v, density=0.2, block_size=bs, mode=mode, backend="reference", **paper(mode))
    torch.testing.assert_close(via_api, out, atol=0, rtol=0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want, want_lse = brute_pisa(q, k, v, sel, mode=mode, block_size=bs)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_density_one_equals_sdpa(shape, mode):
    b, h, hk, lq, lk, d, bs = shape
    q, k, v = make_qkv(b, h, hk, lq, lk, d, dtype=torch.float32, seed=5)
    out, lse = pisa_attention(q, k, v, density=1.0, block_size=bs, mode=mode, return_lse=True)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    kx = k.repeat_interleave(h // hk, 1)
    torch.testing.assert_close(lse, torch.logsumexp(q @ kx.transpose(-1, -2) * d**-0.5, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("covariance_aware", [False, True], ids=["plain", "cov"])
def test_chunking_gives_identical_results(monkeypatch, covariance_aware):
    b, h, hk, lq, lk, d, bs = 2, 4, 2, 150, 130, 32, 16
    q, k, v = make_qkv(b, h, hk, lq, lk, d, seed=6)
    kw = dict(density=0.3, block_size=bs, covariance_aware=covariance_aware)
    whole = {m: ref.pisa_reference(q, k, v, mode=m, **kw) for m in MODES}
    rows = []
    chunk = ref._chunk

    def spy(qc, kx, *args, **kw):
        rows.append(qc.shape[2])
        return chunk(qc, kx, *args, **kw)

    monkeypatch.setattr(ref, "_chunk", spy)
    monkeypatch.setattr(ref, "_SLAB_ELEMS", b * h * lk * 2 * bs)  # two query blocks per chunk
    for m in MODES:
        rows.clear()
        out, lse, sel = ref.pisa_reference(q, k, v, mode=m, **kw)
        assert len(rows) == 5 and max(rows) == 2 * bs and sum(rows) == lq
        assert torch.equal(sel, whole[m][2])
        torch.testing.assert_close(out, whole[m][0], atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(lse, whole[m][1], atol=1e-6, rtol=1e-7)
    monkeypatch.setattr(ref, "_SLAB_ELEMS", 1)  # floor: one query block per chunk
    rows.clear()
    out, _, _ = ref.pisa_reference(q, k, v, mode="hybrid", **kw)
    assert rows == [bs] * 9 + [lq - 9 * bs]
    torch.testing.assert_close(out, whole["hybrid"][0], atol=1e-13, rtol=1e-13)


def test_long_sequence_chunks_stay_bounded(monkeypatch):
    """The memory bound that lets L=32K run on CPU: no chunk holds more than _SLAB_ELEMS scores
    (checked on the chunk plan at L=32K without running the O(L²) work)."""
    seen = []

    def fake_chunk(qc, kx, vx, kmean, vsum, hbar, counts, sel, tok_block, mode, scale, alpha=None, **kw):
        seen.append(qc.shape[0] * qc.shape[1] * qc.shape[2] * kx.shape[2])
        return torch.zeros_like(qc), torch.zeros(qc.shape[:3], dtype=qc.dtype)

    monkeypatch.setattr(ref, "_chunk", fake_chunk)
    b, h, l, d, bs = 1, 8, 32768, 16, 64
    q = torch.zeros(b, h, l, d)
    stats = ref.block_stats(q[:, :1], q[:, :1], bs)
    sel = torch.ones(b, h, l // bs, l // bs, dtype=torch.bool)
    ref.pisa_forward(q, q[:, :1], q[:, :1], stats, sel, mode="hybrid", scale=0.25, block_size=bs)
    assert len(seen) > 1 and max(seen) <= ref._SLAB_ELEMS
    assert max(seen) < l * l  # never an L×L matrix per head, let alone per batch·head


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_large_magnitude_inputs_never_nan(mode, dtype):
    q, k, v = make_qkv(1, 2, 1, 130, 100, 32, dtype=torch.float32, seed=7)
    q = (q * 30).to(dtype)
    k, v = k.to(dtype), v.to(dtype)
    out, lse = pisa_attention(q, k, v, covariance_aware=False, density=0.25, block_size=16, mode=mode, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    sel = brute_selection(q, k, density=0.25, block_size=16)
    want, _ = brute_pisa(q, k, v, sel, mode=mode, block_size=16, alpha=spec.DEFAULT_ALPHA)  # the API's default
    # fp32 internally: |score| ~ 100 loses ~1e-5 absolute; low-precision inputs add output rounding.
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)], ids=["fp16", "bf16"])
def test_low_precision_inputs_on_cpu(mode, dtype, tol):
    q, k, v = make_qkv(2, 4, 2, 100, 90, 64, dtype=dtype, seed=8)
    out, lse = pisa_attention(q, k, v, density=0.3, block_size=32, mode=mode, return_lse=True, **paper(mode))
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 100)
    sel = brute_selection(q, k, density=0.3, block_size=32)
    want, want_lse = brute_pisa(q, k, v, sel, mode=mode, block_size=32)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


def smooth_tail_qkv(eps: float, seed: int = 9):
    """Keys = per-block centroid + eps·deviation, values driven by the deviation alone: the
    within-block score spread is O(eps) while each block's value spread is O(1), so the paper's
    Taylor expansion is the whole story: the 0th-order tail error is O(eps), the 1st-order O(eps²)."""
    g = torch.Generator().manual_seed(seed)
    b, h, l, d, bs = 1, 2, 512, 32, 64
    q = torch.randn(b, h, l, d, generator=g, dtype=torch.float64)
    centroid = torch.randn(b, h, l // bs, 1, d, generator=g, dtype=torch.float64).expand(-1, -1, -1, bs, -1)
    dev = torch.randn(b, h, l, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, d, generator=g, dtype=torch.float64) * d**-0.5
    return q, centroid.reshape(b, h, l, d) + eps * dev, dev @ w


def test_taylor_terms_converge_at_their_order():
    errs = {}
    for eps in (0.1, 0.05):
        q, k, v = smooth_tail_qkv(eps)
        dense, _ = brute_dense(q, k, v)
        for mode in MODES:
            out = pisa_attention(q, k, v, density=0.25, block_size=64, mode=mode, **paper(mode))
            errs[mode, eps] = ((out - dense).abs().mean() / dense.abs().mean()).item()
        assert errs["drop", eps] > errs["zeroth", eps] > errs["hybrid", eps] > errs["first", eps]
    ratio = {m: errs[m, 0.05] / errs[m, 0.1] for m in MODES}
    assert 0.4 < ratio["zeroth"] < 0.6  # first order in eps
    assert 0.2 < ratio["first"] < 0.3  # second order in eps: the block-wise 1st-order term is exact
    assert 0.4 < ratio["hybrid"] < 0.6  # H̄ replaces H_j: only the mean part of the 1st-order term


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("grid", [(4, 16, 16), (32, 32)], ids=["video-4x16x16", "image-32x32"])
def test_error_ordering_on_dit_data(grid, seed):
    """Paper's ablation order at density 0.125: drop > zeroth > hybrid >= first."""
    from pisa_attn.data import dit_qkv

    d = dit_qkv(grid, heads=4, head_dim=64, seed=seed)
    dense = F.scaled_dot_product_attention(d.q, d.k, d.v)
    err = {}
    for mode in MODES:
        out = pisa_attention(d.q, d.k, d.v, density=0.125, block_size=64, mode=mode)
        err[mode] = ((out - dense).abs().mean() / dense.abs().mean()).item()
    assert err["drop"] > err["zeroth"] > err["hybrid"] >= err["first"], err


# ---------------------------------------------------------------- the stage contract
@pytest.mark.parametrize("cov", [False, True], ids=["plain", "cov"])
def test_stages_compose_to_the_public_call(cov):
    """prepare -> select -> attend of the reference backend is what pisa_attention runs, and the
    select stage is the top-k mask of the pooled scores, as a Selection."""
    q, k, v = make_qkv(2, 4, 2, 100, 150, 32, seed=4)
    keep = torch.zeros(2, 4, 10, dtype=torch.bool)
    keep[0, 1, 3] = True
    plan = make_plan(q, k, 0.3, 16, "hybrid", cov, None, "reference")
    alpha = tail_weight.resolve(None, mode="hybrid", heads=4, device=q.device, dtype=q.dtype)  # the default weight
    stats, sel, (out, lse) = run_plan(ref.BACKEND, q, k, v, plan, keep, n_keep_max=1, alpha=alpha)
    assert isinstance(sel, Selection) and sel.idx.shape[-1] == plan.n_select + 1
    scores = ref.selection_scores(ref.block_means(q, 16, torch.float64), stats.kmean, plan.scale, stats.hdev)
    assert torch.equal(sel.to_mask(10), ref.select_blocks(scores, plan.n_select, keep))
    want = pisa_attention(q, k, v, density=0.3, block_size=16, covariance_aware=cov, keep_blocks=keep, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_select_stage_chunks_bounded_by_scratch():
    """A small score scratch (query-block chunks) selects the same blocks."""
    q, k, v = make_qkv(1, 2, 1, 300, 300, 32, seed=5)
    stats = ref.prepare(q, k, v, 16, with_hdev=True)
    kw = dict(n_select=4, width=6, scale=0.2, hdev=stats.hdev, keep=torch.ones(1, 1, 19, dtype=torch.bool) & (torch.arange(19) < 2))
    whole = ref.select(stats.qmean, stats.kmean, **kw)
    chunked = ref.select(stats.qmean, stats.kmean, scratch_elems=3 * 2 * 19, **kw)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert (whole.cnt == 6).all()


def _block_h(k, v, bs):
    """H_j per key block, explicitly: [B, Hk, N, D, D] (float64)."""
    n = -(-k.shape[2] // bs)
    out = []
    for j in range(n):
        kk, vv = k[:, :, j * bs : (j + 1) * bs].double(), v[:, :, j * bs : (j + 1) * bs].double()
        out.append(torch.einsum("bhnd,bhne->bhde", kk - kk.mean(2, keepdim=True), vv))
    return torch.stack(out, 2)


def test_hbar_exclude_is_the_mean_over_the_other_blocks():
    q, k, v = make_qkv(2, 4, 2, 150, 150, 16, seed=31)  # 10 blocks of 16, the last ragged
    excl = torch.zeros(2, 2, 10, dtype=torch.bool)
    excl[0, 0, 3] = excl[1, 1, [0, 9]] = True
    excl[1, 0] = True  # every block excluded: H̄ = 0
    st = ref.block_stats(k, v, 16, with_hdev=True, hbar_exclude=excl)
    hj, inc = _block_h(k, v, 16), (~excl).double()
    want = (hj * inc[..., None, None]).sum(2) / inc.sum(-1).clamp_min(1)[..., None, None]
    torch.testing.assert_close(st.hbar, want, rtol=1e-12, atol=1e-12)
    assert bool((st.hbar[1, 0] == 0).all())
    torch.testing.assert_close(st.hdev, torch.linalg.matrix_norm(hj - want[:, :, None]), rtol=1e-12, atol=1e-12)
    same = ref.block_stats(k, v, 16, hbar_exclude=torch.zeros(10, dtype=torch.bool))
    torch.testing.assert_close(same.hbar, ref.block_stats(k, v, 16).hbar, rtol=1e-12, atol=1e-13)
    with pytest.raises(ValueError, match="hbar_exclude"):
        ref.block_stats(k, v, 16, hbar_exclude=torch.zeros(9, dtype=torch.bool))
    with pytest.raises(TypeError, match="hbar_exclude"):
        ref.block_stats(k, v, 16, hbar_exclude=torch.zeros(10))


@pytest.mark.parametrize("exclude", [False, True], ids=["all", "excl"])
def test_row_scope_hbar_is_each_rows_own_tail_mean(exclude):
    """hbar_scope="row": the hybrid term of row t uses the mean of H_j over its own tail blocks
    (less the excluded ones), checked against explicit H_j; "global" is unchanged by the option."""
    b, h, hk, length, d, bs = 1, 4, 2, 150, 16, 16
    q, k, v = make_qkv(b, h, hk, length, length, d, seed=32)
    excl = None
    if exclude:
        excl = torch.zeros(1, hk, 10, dtype=torch.bool)
        excl[0, 0, 2] = excl[0, 1, [5, 6]] = True
    st = ref.block_stats(k, v, bs, hbar_exclude=excl)
    scale = d**-0.5
    sel = ref.select_blocks(ref.selection_scores(ref.block_means(q, bs, torch.float64), st.kmean, scale), 3)
    o0, _ = ref.pisa_forward(q, k, v, st, sel, mode="zeroth", scale=scale, block_size=bs)
    o_row, _ = ref.pisa_forward(q, k, v, st, sel, mode="hybrid", scale=scale, block_size=bs, hbar_scope="row")
    o0_r, c_r, _ = ref.row_terms(q, k, v, st, sel.index_select(2, torch.arange(length) // bs), mode="hybrid",
                                 scale=scale, block_size=bs, hbar_scope="row")
    torch.testing.assert_close(o0_r + c_r, o_row, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o0_r, o0, rtol=1e-12, atol=1e-12)
    hj = _block_h(k, v, bs).repeat_interleave(h // hk, 1)[0]  # [H, N, D, D]
    inc = torch.ones(h, 10, dtype=torch.float64) if excl is None else (~excl[0]).double().repeat_interleave(2, 0)
    km = st.kmean.repeat_interleave(h // hk, 1)[0]
    kx = k.repeat_interleave(h // hk, 1)[0]
    tok = torch.arange(length) // bs
    for t in range(0, length, 7):
        tail = ~sel[0, :, t // bs]  # [H, N]
        w = tail.double() * inc
        hrow = (hj * w[..., None, None]).sum(1) / w.sum(-1).clamp_min(1)[:, None, None]
        c = torch.einsum("hd,hnd->hn", q[0, :, t], km) * scale
        s = torch.einsum("hd,hld->hl", q[0, :, t], kx) * scale
        ex = ~tail[:, tok]
        mx = torch.maximum(s.masked_fill(~ex, -torch.inf).amax(-1), c.masked_fill(~tail, -torch.inf).amax(-1))
        a = torch.exp(c.masked_fill(~tail, -torch.inf) - mx[:, None])
        den = torch.exp(s.masked_fill(~ex, -torch.inf) - mx[:, None]).sum(-1) + a @ st.counts
        corr = a.sum(-1)[:, None] * scale * torch.einsum("hd,hde->he", q[0, :, t], hrow) / den[:, None]
        torch.testing.assert_close(o_row[0, :, t] - o0[0, :, t], corr, rtol=1e-10, atol=1e-12)
    glob, _ = ref.pisa_forward(q, k, v, st, sel, mode="hybrid", scale=scale, block_size=bs)
    assert not torch.allclose(glob, o_row)
    with pytest.raises(ValueError, match="hbar_scope"):
        ref.pisa_forward(q, k, v, st, sel, mode="hybrid", scale=scale, block_size=bs, hbar_scope="tail")


@pytest.mark.parametrize("mode", MODES)
def test_row_terms_of_all_rows_are_the_forward(mode):
    q, k, v = make_qkv(2, 4, 2, 100, 120, 32, seed=33)
    st = ref.block_stats(k, v, 16)
    sel = ref.select_blocks(ref.selection_scores(ref.block_means(q, 16, torch.float64), st.kmean, 32**-0.5), 2)
    out, lse = ref.pisa_forward(q, k, v, st, sel, mode=mode, scale=32**-0.5, block_size=16)
    o0, c, lse_r = ref.row_terms(q, k, v, st, sel.index_select(2, torch.arange(100) // 16), mode=mode,
                                 scale=32**-0.5, block_size=16)
    assert (c is None) == (mode in ("zeroth", "drop"))
    torch.testing.assert_close(o0 if c is None else o0 + c, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_r, lse)


def test_block_key_covariance_is_each_blocks_own():
    _, k, v = make_qkv(2, 2, 2, 150, 150, 8, seed=34)  # 10 blocks of 16, the last ragged (6 tokens)
    st = ref.block_stats(k, v, 16, with_kcov=True)
    assert st.kcov.shape == (2, 2, 10, 8, 8)
    for j in (0, 4, 9):
        kk = k[:, :, j * 16 : (j + 1) * 16].double()
        dev = kk - kk.mean(2, keepdim=True)
        torch.testing.assert_close(st.kcov[:, :, j], dev.transpose(-1, -2) @ dev / kk.shape[2], rtol=1e-12, atol=1e-12)
    assert ref.block_stats(k, v, 16).kcov is None
    assert st.blocks(2, 5).kcov.shape == (2, 2, 3, 8, 8)


def _spread_keys(eps: float, d: int = 4, nblocks: int = 3, seed: int = 35):
    """Blocks of 2d keys k̄_j ± eps·e_c: symmetric (no third moment), covariance eps²/d · I."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(nblocks, d, generator=g, dtype=torch.float64)
    offs = torch.cat([torch.eye(d), -torch.eye(d)]).double() * eps  # [2d, d]
    k = (centres[:, None, :] + offs[None]).reshape(1, 1, nblocks * 2 * d, d)
    v = torch.randn(k.shape, generator=g, dtype=torch.float64)
    q = torch.randn(1, 1, 2 * d, d, generator=g, dtype=torch.float64) * 2
    return q, k, v


@pytest.mark.parametrize("mode", ["zeroth", "hybrid", "first"])
def test_tail_spread_corrects_the_tail_mass_to_higher_order(mode):
    """All-tail attention on keys of small spread eps: the paper's tail mass n_j exp(s q·k̄_j) is
    off by O(eps²) (Jensen), the spread-corrected one by O(eps⁴) (symmetric keys); "trace" equals
    "gauss" for isotropic blocks (so does "taylor-trace" "taylor"), and "none" is the paper's output
    bit for bit."""
    d, bs = 4, 8
    errs = {}
    for eps in (0.2, 0.1):
        q, k, v = _spread_keys(eps, d)
        st = ref.block_stats(k, v, bs, with_kcov=True)
        sel = torch.zeros(1, 1, 1, 3, dtype=torch.bool)  # every block in the tail
        dense_lse = torch.logsumexp(q @ k.transpose(-1, -2) * d**-0.5, -1)
        kw = dict(mode=mode, scale=d**-0.5, block_size=bs)
        outs = {sp: ref.pisa_forward(q, k, v, st, sel, tail_spread=sp, **kw) for sp in ref.TAIL_SPREADS}
        for sp, (_, lse) in outs.items():
            errs[sp, eps] = float((lse.double() - dense_lse).abs().max())
        torch.testing.assert_close(outs["trace"][0], outs["gauss"][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(outs["taylor-trace"][0], outs["taylor"][0], rtol=1e-12, atol=1e-12)
        plain, _ = ref.pisa_forward(q, k, v, ref.block_stats(k, v, bs), sel, **kw)
        assert torch.equal(outs["none"][0], plain)
    assert 3.5 < errs["none", 0.2] / errs["none", 0.1] < 4.5  # O(eps²)
    for sp in ("gauss", "taylor"):
        assert errs[sp, 0.2] / errs[sp, 0.1] > 12  # O(eps⁴)
        assert errs[sp, 0.1] < 0.05 * errs["none", 0.1]


def test_tail_spread_row_terms_and_checks():
    q, k, v = make_qkv(1, 4, 2, 100, 120, 16, seed=36)
    st = ref.block_stats(k, v, 16, with_kcov=True)
    sel = ref.select_blocks(ref.selection_scores(ref.block_means(q, 16, torch.float64), st.kmean, 0.25), 2)
    out, lse = ref.pisa_forward(q, k, v, st, sel, mode="hybrid", scale=0.25, block_size=16, tail_spread="gauss")
    o0, c, lse_r = ref.row_terms(q, k, v, st, sel.index_select(2, torch.arange(100) // 16), mode="hybrid",
                                 scale=0.25, block_size=16, tail_spread="gauss")
    torch.testing.assert_close(o0 + c, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_r, lse)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="tail_spread"):
        ref.pisa_forward(q, k, v, st, sel, mode="hybrid", scale=0.25, block_size=16, tail_spread="exact")
    with pytest.raises(ValueError, match="with_kcov"):
        ref.pisa_forward(q, k, v, ref.block_stats(k, v, 16), sel, mode="zeroth", scale=0.25, block_size=16,
                         tail_spread="trace")


@pytest.mark.parametrize("density", [1.0, 0.25])
def test_huge_inputs_give_no_nan(density):
    """float32 q, k, v of magnitude 3e12: q·H̄ overflows float32, yet rows whose tail has no weight
    (all of them at density 1, where the call is dense attention) take no first-order term rather
    than 0·inf = NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 32, generator=g) * 3e12 for _ in range(3))
    out = pisa_attention(q, k, v, density=density, block_size=16, backend="reference")
    assert torch.isfinite(out).all()
    if density == 1.0:
        dense = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        assert ((out.double() - dense).abs().sum() / dense.abs().sum()).item() < 1e-5


def test_tail_weight_resolve_checks_mode_and_heads():
    from pisa_attn import tail_weight

    with pytest.raises(ValueError, match="mode"):
        tail_weight.resolve(None, mode="bogus", heads=2, device="cpu")
    for heads in (0, -1, 2.0):
        with pytest.raises(ValueError, match="heads"):
            tail_weight.resolve(0.5, mode="hybrid", heads=heads, device="cpu")


@pytest.mark.parametrize("mode", MODES)
def test_a_block_longer_than_the_sequence_is_not_padded(mode):
    """A valid block_size (a power of two >= 16, as pisa_attention accepts) far past the sequence is one
    block: the reference gives what a block just covering it gives, with no 2**40-token padding."""
    q, k, v = make_qkv(1, 2, 1, 40, 50, 16)
    for cov in (False, True):
        big = ref.pisa_reference(q, k, v, density=0.5, block_size=2**40, mode=mode, covariance_aware=cov)
        want = ref.pisa_reference(q, k, v, density=0.5, block_size=64, mode=mode, covariance_aware=cov)
        assert all(torch.equal(a, b) for a, b in zip(big, want))
        via_api = pisa_attention(q, k, v, density=0.5, block_size=2**40, mode=mode, covariance_aware=cov,
                                 backend="reference")
        assert torch.equal(via_api, pisa_attention(q, k, v, density=0.5, block_size=64, mode=mode,
                                                   covariance_aware=cov, backend="reference"))
    kcov = ref.block_stats(k, v, 2**40, with_kcov=True).kcov
    assert torch.equal(kcov, ref.block_stats(k, v, 64, with_kcov=True).kcov)
