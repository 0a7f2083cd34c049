"""The statistics and selection kernels (Triton's interpreter on the CPU, or a GPU) against the
PyTorch reference at small shapes: ragged lengths, GQA, query blocks of 1, 2 and 4 blocks,
``hbar_exclude``, the covariance term, keep blocks, both selection paths and the workspaces."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from pisa_attn.ops import reference as ref  # noqa: E402
from pisa_attn.ops.selection import bits_to_mask  # noqa: E402
from selection_masks import idx_to_mask  # noqa: E402
from pisa_attn.ops.triton import pairs as PU  # noqa: E402
from pisa_attn.ops.triton import prepare as P  # noqa: E402
from pisa_attn.ops.triton import select as S  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


def qkv(b, h, hk, lq, lk, d, dtype=torch.bfloat16, seed=0, k_shift=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g) + k_shift  # a common key component: centring matters
    v = torch.randn(b, hk, lk, d, generator=g) + 0.5 * k
    return tuple(x.to(dtype).to(DEV) for x in (q, k, v))


PREP_CASES = [
    # id, (B, H, Hk, Lq, Lk, D, bs, query_block, dtype)
    pytest.param((2, 2, 1, 203, 203, 32, 32, None, torch.bfloat16), id="B2-H2-Hk1-L203-D32-bs32-gqa-ragged"),
    pytest.param((1, 2, 2, 100, 230, 16, 16, 32, torch.float16), id="B1-H2-Lq100-Lk230-D16-bs16-qb32-fp16"),
    pytest.param((1, 1, 1, 300, 130, 32, 16, 64, torch.bfloat16), id="B1-H1-Lq300-Lk130-D32-bs16-qb64"),
]


@pytest.mark.parametrize("case", PREP_CASES)
@pytest.mark.parametrize("exclude", ["none", "some", "all"])
def test_prepare_matches_reference(case, exclude):
    b, h, hk, lq, lk, d, bs, qb, dtype = case
    q, k, v = qkv(b, h, hk, lq, lk, d, dtype, seed=lq + lk, k_shift=3.0)
    nk = -(-lk // bs)
    ex = None
    if exclude == "some":
        ex = torch.zeros(1, hk, nk, dtype=torch.bool)
        ex[0, :, 1::3] = True
        ex = ex.to(DEV)
    elif exclude == "all":
        ex = torch.ones(b, 1, nk, dtype=torch.bool, device=DEV)
    st = P.prepare(q, k, v, bs, with_hdev=True, query_block=qb, hbar_exclude=ex)
    rs = ref.prepare(q.double(), k.double(), v.double(), bs, with_hdev=True, query_block=qb, hbar_exclude=ex)
    assert st.qmean.shape == rs.qmean.shape
    torch.testing.assert_close(st.qmean.double(), rs.qmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.kmean.double(), rs.kmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.vbar.double() * rs.counts[:, None], rs.vsum, rtol=1e-2, atol=2e-2)
    ks = st.kscale.double()
    assert torch.equal(torch.exp2(torch.log2(ks).round()), ks)  # one power of two per head
    torch.testing.assert_close(st.kbar.double() * ks[..., None, None], rs.kmean, rtol=1e-3, atol=1e-6)
    # the per-channel centroid maxima that bound the tail's scores (every block, excluded or not)
    torch.testing.assert_close(st.kbound.double(), rs.kmean.abs().amax(2), rtol=1e-5, atol=1e-5)
    if exclude == "all":
        assert not st.hbar.any() and not st.hbar_lp.any()
    else:
        # The GPU path rounds the centred keys to the input dtype once before the product (bf16:
        # 2^-9 relative, 4e-3 here at these few blocks); the interpreter keeps them in float32.
        tol = 6e-3 if DEV == "cuda" and dtype == torch.bfloat16 else 3e-3
        assert rel_l1(st.hbar, rs.hbar) < tol
        hs = st.hscale.double()
        assert torch.equal(torch.exp2(torch.log2(hs).round()), hs)  # one power of two per head
        # largest entry at most 2^14 (float16's range), and not far below (the scale comes from a bound)
        amax = st.hbar_lp.double().abs().amax(dim=(-2, -1))
        assert (amax <= 2**14).all() and (amax >= 2**8).all(), amax
        assert rel_l1(st.hbar_lp.double() * hs[..., None, None], rs.hbar) < 1e-2
    assert rel_l1(st.hdev, rs.hdev) < 3e-3
    assert torch.isfinite(st.hbar).all() and torch.isfinite(st.hdev).all()


def test_prepare_after_a_shape_whose_workspace_slices_are_aligned():
    """Prepare's partial sums are slices of one workspace, 16-byte aligned or not by B·Hk: both
    shapes in one process, the second served by the launches cached for the first (keyed by
    alignment too)."""
    for hk in (4, 1):
        q, k, v = qkv(1, hk, hk, 256, 256, 64, seed=hk)
        st = P.prepare(q, k, v, 64, with_hdev=True)
        rs = ref.prepare(q.double(), k.double(), v.double(), 64, with_hdev=True)
        torch.testing.assert_close(st.vbar.double() * rs.counts[:, None], rs.vsum, rtol=1e-2, atol=2e-2)
        assert rel_l1(st.hbar, rs.hbar) < 6e-3 and rel_l1(st.hdev, rs.hdev) < 3e-3, hk


@pytest.mark.parametrize("mag", [1.0, 30.0])
def test_kbound_bounds_every_tail_score(mag):
    """What the Hopper kernel fixes the tail's maximum with: per row, ``s·Σ_d |q_d|·kbound_d +
    log2 BS`` (base 2) is at least every centroid score ``q·k̄_j·s + log2 n_j``, from the statistics
    prepare writes (ragged last block, GQA, keys with a common component, 30x magnitudes)."""
    import math

    b, h, hk, lq, lk, d, bs = 2, 4, 2, 150, 203, 32, 32
    q, k, v = qkv(b, h, hk, lq, lk, d, seed=5, k_shift=2.0)
    q, k = q * mag, k * mag
    st = P.prepare(q, k, v, bs)
    s = d**-0.5 * math.log2(math.e)
    rep = h // hk
    kb = st.kbar.double() * st.kscale.double()[..., None, None]  # the centroids the tail scans
    n = torch.full((st.kbar.shape[2],), float(bs), dtype=torch.float64, device=DEV)
    n[-1] = lk - (st.kbar.shape[2] - 1) * bs
    scores = torch.einsum("bhld,bhjd->bhlj", q.double(), kb.repeat_interleave(rep, 1)) * s + n.log2()
    bound = (q.double().abs() * st.kbound.double().repeat_interleave(rep, 1)[:, :, None]).sum(-1) * s + math.log2(bs)
    # float16 centroids round to 2^-11 relative: the bound holds to that
    slack = 1e-3 * (q.double().abs() * st.kbound.double().repeat_interleave(rep, 1)[:, :, None]).sum(-1) * s
    assert (bound + slack >= scores.amax(-1)).all()
    if mag == 1.0:  # tight enough to be used (the kernel's slack); at 30x it is not, and the kernel
        assert (bound - scores.amax(-1)).median() < 64  # keeps the online maximum (a GPU test)


@pytest.mark.parametrize("case", PREP_CASES)
def test_prepare_kmax_is_the_keys_channel_maxima(case):
    """``with_kmax``: the per-channel maxima of ``|k|`` over each kv head's keys (what bounds the
    Hopper kernel's exact scores), exact; the other statistics bit for bit those without it; it is
    refused beside ``quant`` (one register tile holds either maxima)."""
    b, h, hk, lq, lk, d, bs, qb, dtype = case
    q, k, v = qkv(b, h, hk, lq, lk, d, dtype, seed=lq + 2 * lk, k_shift=1.5)
    st = P.prepare(q, k, v, bs, with_hdev=True, query_block=qb, with_kmax=True)
    base = P.prepare(q, k, v, bs, with_hdev=True, query_block=qb)
    assert base.kmax is None and st.kmax.dtype == torch.float32
    assert torch.equal(st.kmax, k.float().abs().amax(2))
    for f in ("qmean", "kmean", "kbar", "kscale", "vbar", "hbar", "hbar_lp", "hscale", "hdev", "kbound"):
        assert torch.equal(getattr(st, f), getattr(base, f)), f
    ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=bs, query_block=qb, with_kmax=True)
    assert P.prepare(q, k, v, bs, query_block=qb, with_kmax=True, ws=ws).kmax.data_ptr() == ws.kmax.data_ptr()
    with pytest.raises(ValueError, match="ws"):
        P.prepare(q, k, v, bs, query_block=qb, with_kmax=True, ws=P.stats_workspace(
            q.shape, k.shape, q.dtype, q.device, block_size=bs, query_block=qb))
    with pytest.raises(ValueError, match="with_kmax"):
        P.prepare(q, k, v, bs, with_kmax=True, quant="fp8")


def test_reference_hbar_exclude_is_the_mean_of_the_other_blocks():
    """The reference's H̄ with excluded blocks, against every H_j materialised."""
    b, hk, lk, d, bs = 2, 2, 150, 8, 16
    _, k, v = qkv(b, 1, hk, 1, lk, d, torch.float64, seed=3, k_shift=2.0)
    nk = -(-lk // bs)
    ex = torch.rand(b, 1, nk, generator=torch.Generator().manual_seed(4)).to(DEV) < 0.4
    st = ref.prepare(k[:, :1], k, v, bs, with_hdev=True, hbar_exclude=ex)
    hj = torch.stack([
        torch.einsum("bhld,bhle->bhde", k[:, :, j * bs:(j + 1) * bs] - k[:, :, j * bs:(j + 1) * bs].mean(2, keepdim=True),
                     v[:, :, j * bs:(j + 1) * bs]) for j in range(nk)], 2)  # [B, Hk, Nk, D, D]
    keep = (~ex).double().expand(b, hk, nk)
    want = (hj * keep[..., None, None]).sum(2) / keep.sum(-1)[..., None, None]
    torch.testing.assert_close(st.hbar, want)
    torch.testing.assert_close(st.hdev, torch.linalg.matrix_norm(hj - want[:, :, None], ord="fro"))


@pytest.fixture(scope="module")
def hdev_stats():
    """Keys, values and prepare's statistics (default tuning) shared by every split below."""
    b, hk, lk, d, bs = 3, 2, 150, 16, 16  # 10 key blocks a head, the last ragged; 60 in the launch
    _, k, v = qkv(b, 1, hk, 1, lk, d, seed=11, k_shift=2.0)
    return k, v, bs, P.prepare(k[:, :1], k, v, bs, with_hdev=True)


@pytest.mark.parametrize("waves", [1, 2, 3, 40])
def test_hdev_runs_across_heads(monkeypatch, waves, hdev_stats):
    """The covariance pass splits the launch's key blocks, numbered head after head, into equal
    runs that may cross from one head into the next (ragged last blocks included): every split
    gives the same ||H_j − H̄|| as the reference's, and the same values bit for bit."""
    k, v, bs, st = hdev_stats  # B 3, Hk 2, 150 keys: 10 key blocks a head, the last ragged; 60 in the launch
    rs = ref.block_stats(k.double(), v.double(), bs, with_hdev=True)
    assert rel_l1(st.hdev, rs.hdev) < 2e-3
    monkeypatch.setitem(P.STATS_TUNING, "hdev_waves", waves)
    other = P.deviation(k, v, st, st.hbar, bs)
    assert torch.equal(other, st.hdev)


def test_workspace_is_written_and_nothing_else():
    q, k, v = qkv(1, 2, 1, 130, 130, 32, seed=7)
    ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=32, with_hdev=True)
    st = P.prepare(q, k, v, 32, with_hdev=True, ws=ws)
    fresh = P.prepare(q, k, v, 32, with_hdev=True)
    for f in ("qmean", "kmean", "kbar", "kscale", "vbar", "hbar", "hbar_lp", "hscale", "hdev", "kbound"):
        assert getattr(st, f).data_ptr() == getattr(ws, f).data_ptr(), f
        assert torch.equal(getattr(st, f), getattr(fresh, f)), f
    lean = P.prepare(q, k, v, 32, with_hdev=True, ws=ws, lean=True)
    assert lean.hbar is None and ws.hbar is not None  # lean drops it from the result, not the workspace
    lean.for_attend()
    assert ws.qmean is not None and ws.kmean is not None
    small = P.stats_workspace(q.shape, (1, 1, 40, 32), q.dtype, q.device, block_size=32)
    with pytest.raises(ValueError, match="ws"):
        P.prepare(q, k, v, 32, ws=small)


def test_hbar_exclude_is_checked():
    q, k, v = qkv(1, 1, 1, 64, 64, 16, seed=1)
    with pytest.raises(TypeError, match="hbar_exclude"):
        P.prepare(q, k, v, 16, hbar_exclude=torch.zeros(1, 1, 4, device=DEV))
    with pytest.raises(ValueError, match="hbar_exclude"):
        P.prepare(q, k, v, 16, hbar_exclude=torch.zeros(1, 1, 5, dtype=torch.bool, device=DEV))


SEL_CASES = {
    # id: (B, H, Hk, L, D, bs, repeat, n_select)
    "B1-H4-Hk2-L277-D32-bs16-gqa": (1, 4, 2, 17 * 16 + 5, 32, 16, 1, 5),  # 18 query rows: two programs of 16
    "B2-H2-L256-D16-bs16-qb32": (2, 2, 2, 16 * 16, 16, 16, 2, 3),
    "B1-H2-Hk1-L592-D32-bs16-qb64": (1, 2, 1, 37 * 16, 32, 16, 4, 4),
}
SEL_PARAMS = [pytest.param(SEL_CASES[name], path, id=f"{path}-{name}") for name, path in (
    ("B1-H4-Hk2-L277-D32-bs16-gqa", "one-kernel"), ("B1-H4-Hk2-L277-D32-bs16-gqa", "two-kernel-chunked"),
    ("B2-H2-L256-D16-bs16-qb32", "two-kernel"), ("B1-H2-Hk1-L592-D32-bs16-qb64", "one-kernel"),
    ("B1-H2-Hk1-L592-D32-bs16-qb64", "two-kernel-chunked"))]


@functools.lru_cache(maxsize=None)
def _sel_inputs(case):
    """q, k, v and their statistics for a SEL_CASES case, computed once for all its paths."""
    b, h, hk, l, d, bs, rep, n_sel = case
    q, k, v = qkv(b, h, hk, l, l, d, seed=l)
    return q, k, v, P.prepare(q, k, v, bs, with_hdev=True, query_block=bs * rep)


@pytest.mark.parametrize("case,path", SEL_PARAMS)
def test_selection_paths_match_the_reference(case, path, monkeypatch):
    """Both selection paths (scores and top-k in one kernel; a score GEMM then the top-k kernel, in
    one chunk or several) against the reference's torch.topk on the same statistics, with the
    covariance term and keep blocks."""
    b, h, hk, l, d, bs, rep, n_sel = case
    q, k, v, st = _sel_inputs(case)  # prepared once per case (before any tuning is patched)
    nk = -(-l // bs)
    keep = torch.zeros(1, h, nk, dtype=torch.bool)
    keep[0, 1, [3, nk - 1]] = True
    keep = keep.to(DEV)
    monkeypatch.setitem(S.FUSED, "max_nkp", 64 if path == "one-kernel" else 0)
    scratch = 3 * b * h * nk if path.endswith("chunked") else None
    kw = dict(n_select=n_sel, width=n_sel + 2, scale=d ** -0.5, hdev=st.hdev, keep=keep, repeat=rep, n_q_blocks=nk)
    sel = S.select(st.qmean, st.kmean, scratch_elems=scratch, **kw)
    mask = idx_to_mask(sel.idx, sel.cnt, nk)
    assert torch.equal(mask, bits_to_mask(sel.bits, nk))
    want = ref.select(st.qmean.double(), st.kmean.double(), **{**kw, "hdev": st.hdev.double()}).to_mask(nk)
    assert torch.equal(sel.cnt, want.sum(-1, dtype=torch.int32))
    assert (mask & want).sum().item() / want.sum().item() > 0.98  # 3xTF32 scores: a near-tie may flip
    assert (mask[:, 1, :, 3] & mask[:, 1, :, nk - 1]).all()  # keep blocks always exact
    ascending = (sel.idx[..., 1:] > sel.idx[..., :-1]) | (torch.arange(1, sel.idx.shape[-1], device=DEV) >= sel.cnt[..., None])
    assert ascending.all()
    if path == "two-kernel":  # one threshold bit per search step: the same selection
        monkeypatch.setitem(S.TOPK_WARPS, "two_bit_max_nkp", 0)
        assert torch.equal(S.select(st.qmean, st.kmean, scratch_elems=scratch, **kw).bits, sel.bits)
    if path == "one-kernel":  # 16 or 64 rows a program (a short call takes 16): the same selection
        for r in (16, 64):
            monkeypatch.setitem(S.FUSED, "rows", r)
            monkeypatch.setitem(S.FUSED, "short_rows", r)
            again = S.select(st.qmean, st.kmean, scratch_elems=scratch, **kw)
            assert torch.equal(again.bits, sel.bits) and torch.equal(idx_to_mask(again.idx, again.cnt, nk), mask), r
    # The workspace path writes the same selection into its own buffers.
    ws = S.selection_workspace(b, h, nk, nk, n_sel + 2, DEV, repeat=rep, scratch_elems=scratch, pairs=True)
    again = S.select(st.qmean, st.kmean, scratch_elems=scratch, ws=ws, **kw)
    assert again.bits.data_ptr() == ws.sel.bits.data_ptr()
    assert torch.equal(again.bits, sel.bits) and torch.equal(again.cnt, sel.cnt)
    with pytest.raises(ValueError, match="ws"):
        S.select(st.qmean, st.kmean, ws=S.selection_workspace(b, h, nk, nk, n_sel + 3, DEV, repeat=rep), **kw)
    uidx, ucnt = PU.pair_union(again.bits, nk, n_sel + 2, out=ws.union)
    assert uidx.data_ptr() == ws.union[0].data_ptr()
    u2, c2 = PU.pair_union(sel.bits, nk, n_sel + 2)
    assert torch.equal(ucnt, c2)
    valid = torch.arange(uidx.shape[-1], device=DEV) < ucnt[..., None]
    assert torch.equal(torch.where(valid, uidx, 0), torch.where(valid, u2, 0))


@pytest.mark.parametrize("nk,path", [(50, "one-kernel"), (50, "two-kernel-1bit"), (50, "two-kernel-2bit"),
                                     (129, "two-kernel-1bit"), (129, "two-kernel-2bit")])
@pytest.mark.parametrize("scores", ["distinct", "ties"])
def test_topk_is_the_order_statistic_with_ties_to_the_lowest_blocks(nk, path, scores, monkeypatch):
    """The top-k is exactly the ``n_select`` largest scores, ties at the threshold to the lowest
    block indices, whether the search settles early (distinct scores) or runs every step (ties):
    scores made exact (one-hot query means pick one channel of the key means)."""
    b, h, nq, d, n_sel = 1, 2, 20, 16, 7 if nk < 64 else 17  # every channel's row, 4 of them twice
    g = torch.Generator().manual_seed(7 if scores == "ties" else 8)
    vals = (torch.randint(0, 5, (b, h, d, nk), generator=g) / 4.0 if scores == "ties"
            else torch.randn(b, h, d, nk, generator=g))
    qmean = torch.zeros(b, h, nq, d)
    qmean[..., torch.arange(nq), torch.arange(nq) % d] = 1.0
    monkeypatch.setitem(S.FUSED, "max_nkp", 64 if path == "one-kernel" else 0)
    monkeypatch.setitem(S.TOPK_WARPS, "two_bit_max_nkp", 1 << 20 if path.endswith("2bit") else 0)
    sel = S.select(qmean.to(DEV), vals.to(DEV).transpose(2, 3), n_select=n_sel, width=n_sel, scale=0.25)
    s = vals[:, :, torch.arange(nq) % d, :]  # [b, h, nq, nk]: row i's scores are channel i % d
    order = torch.sort(-s, dim=-1, stable=True).indices  # descending, equal scores by block index
    want = torch.zeros(b, h, nq, nk, dtype=torch.bool).scatter_(-1, order[..., :n_sel], True)
    assert torch.equal(idx_to_mask(sel.idx, sel.cnt, nk).cpu(), want)
    assert torch.equal(bits_to_mask(sel.bits, nk).cpu(), want)
    if scores == "ties":  # the case must put ties across the threshold, or it tests nothing more
        kth = torch.gather(s, -1, order[..., n_sel - 1:n_sel])
        assert ((s == kth).sum(-1) > (want & (s == kth)).sum(-1)).any()
