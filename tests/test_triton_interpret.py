"""The Triton kernels against the PyTorch reference at small shapes (interpreter on CPU, or a GPU).

Attention is compared under the SAME selection (the kernel's index list converted to the
reference's bool mask); selection itself is compared separately (overlap with ``torch.topk``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from pisa_attn import pisa_attention, spec  # noqa: E402
from pisa_attn.attention import make_plan  # noqa: E402
from pisa_attn.ops import reference as ref  # noqa: E402
from pisa_attn.ops.selection import Selection, bits_to_mask  # noqa: E402
from selection_masks import idx_to_mask  # noqa: E402
from pisa_attn.ops.stages import run_plan, select_plan  # noqa: E402
from pisa_attn.ops.triton import op  # noqa: E402
from pisa_attn.ops.merge import merge  # noqa: E402
from pisa_attn.ops.reference import BACKEND as REF  # noqa: E402
from pisa_attn.ops.triton.op import BACKEND as TRITON  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_TOL = 1e-2  # rel-L1 for bfloat16 outputs (P is rounded to bf16 before PV, as in flash/cuDNN)


def rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


def make_qkv(b, h, hk, lq, lk, d, dtype=torch.bfloat16, layout="bhsd", seed=0):
    """[B, H, L, D] views; for 'bshd' they are transposes of [B, L, H, D] buffers (strided reads)."""
    g = torch.Generator().manual_seed(seed)

    def t(heads, length):
        x = torch.randn(b, length, heads, d, generator=g) if layout == "bshd" else torch.randn(b, heads, length, d, generator=g)
        x = x.to(dtype).to(DEV)
        return x.transpose(1, 2) if layout == "bshd" else x

    return t(h, lq), t(hk, lk), t(hk, lk)


def ref_with_selection(q, k, v, selection, mode, scale, bs):
    """The reference backend's prepare and attend stages in float64 under a given selection."""
    q, k, v = (x.double() for x in (q, k, v))
    stats = REF.prepare(q, k, v, bs)
    return REF.attend(q, k, v, stats, selection, mode=mode, scale=scale, block_size=bs)


def plan_for(q, k, density, bs, mode, cov=False):
    return make_plan(q, k, density, bs, mode, cov, None, "triton")


def check_selection(s: Selection, nk: int):
    """idx and bits name the same set; returns it as a mask."""
    mask = idx_to_mask(s.idx, s.cnt, nk)
    assert torch.equal(mask, bits_to_mask(s.bits, nk))
    return mask


CASES = [
    # id, (B, H, Hk, Lq, Lk, D, bs, layout, density), modes
    ("B1-H2-L200-D32-bs32-bhsd", (1, 2, 2, 200, 200, 32, 32, "bhsd", 0.3), ("hybrid", "zeroth", "drop")),
    ("B2-H2-Hk1-L150-D64-bs32-bshd-gqa", (2, 2, 1, 150, 150, 64, 32, "bshd", 0.4), ("hybrid",)),
    ("B1-H1-Lq100-Lk230-D32-bs16-bshd", (1, 1, 1, 100, 230, 32, 16, "bshd", 0.25), ("zeroth",)),
]
PARAMS = [pytest.param(case, mode, id=f"{name}-{mode}") for name, case, modes in CASES for mode in modes]


@pytest.mark.parametrize("case,mode", PARAMS)
def test_attention_matches_reference_under_same_selection(case, mode):
    b, h, hk, lq, lk, d, bs, layout, density = case
    q, k, v = make_qkv(b, h, hk, lq, lk, d, layout=layout, seed=lq + lk)
    p = plan_for(q, k, density, bs, mode)
    stats, s, (out, lse) = run_plan(TRITON, q, k, v, p)
    check_selection(s, p.n_kv_blocks)
    assert (s.cnt == p.n_select).all()
    o_ref, lse_ref = ref_with_selection(q, k, v, s, mode, p.scale, bs)
    assert torch.isfinite(out).all()
    assert rel_l1(out, o_ref) < BF16_TOL
    assert (lse.double() - lse_ref).abs().max().item() < 2e-2
    if layout == "bshd":  # output allocated in q's physical layout: the transpose back is free
        assert out.transpose(1, 2).is_contiguous()


def test_prepare_matches_reference_ragged_gqa():
    b, h, hk, l, d, bs = 2, 2, 1, 203, 32, 32
    q, k, v = make_qkv(b, h, hk, l, l, d, layout="bshd", seed=3)
    stats = TRITON.prepare(q, k, v, bs, with_hdev=True)  # run_plan's prepare stage (cov=True)
    rs = ref.block_stats(k.double(), v.double(), bs, with_hdev=True)
    counts = rs.counts[:, None]
    torch.testing.assert_close(stats.qmean.double(), ref.block_means(q.double(), bs, torch.float64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.kmean.double(), rs.kmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.vbar.double() * counts, rs.vsum, rtol=1e-2, atol=2e-2)
    assert rel_l1(stats.hbar, rs.hbar) < 2e-3  # tf32 on GPU; exact fp32 under the interpreter
    assert rel_l1(stats.hdev, rs.hdev) < 2e-3
    # Tail-scan centroids: float16 times one power of two per head, 11 significant bits.
    ks = stats.kscale.double()
    assert ks.shape == rs.kmean.shape[:2] and torch.equal(torch.exp2(torch.log2(ks).round()), ks)
    torch.testing.assert_close(stats.kbar.double() * ks[..., None, None], rs.kmean, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("q_mag,k_mag", [(1e-6, 1e6), (1e5, 1e-5)], ids=["tiny-q-huge-k", "huge-q-tiny-k"])
def test_tail_scan_far_outside_float16_range(q_mag, k_mag):
    """Centroids and queries are rescaled by powers of two before the float16 tail product: inputs
    whose values overflow or underflow float16 still give the reference's answer."""
    b, h, lq, l, d, bs = 1, 2, 48, 160, 32, 16  # 3 query blocks against 10 key blocks
    q, k, v = make_qkv(b, h, h, lq, l, d, seed=5)
    q, k = (q.float() * q_mag).bfloat16(), (k.float() * k_mag).bfloat16()
    p = plan_for(q, k, 0.25, bs, "hybrid")
    _, s, (out, lse) = run_plan(TRITON, q, k, v, p)
    check_selection(s, p.n_kv_blocks)
    o_ref, lse_ref = ref_with_selection(q, k, v, s, "hybrid", p.scale, bs)
    assert torch.isfinite(out).all()
    assert rel_l1(out, o_ref) < BF16_TOL
    assert (lse.double() - lse_ref).abs().max().item() < 2e-2


def test_selection_matches_topk_with_keep_blocks_cov():
    cov = True
    b, h, hk, l, d, bs = 1, 2, 1, 320, 32, 16
    q, k, v = make_qkv(b, h, hk, l, l, d, seed=5)
    nk = spec.num_blocks(l, bs)
    keep = torch.zeros(b, h, nk, dtype=torch.bool)
    keep[0, 0, [0, 7]] = True
    keep[0, 1, 19] = True
    keep = keep.to(DEV)
    p = plan_for(q, k, 0.2, bs, "hybrid", cov=cov)
    stats, s = select_plan(TRITON, q, k, v, p, keep, n_keep_max=2)
    idx, cnt = s.idx, s.cnt
    mask = check_selection(s, nk)
    rs = ref.block_stats(k.double(), v.double(), bs, with_hdev=cov)
    scores = ref.selection_scores(ref.block_means(q.double(), bs, torch.float64), rs.kmean, p.scale, rs.hdev)
    expect = ref.select_blocks(scores, p.n_select, keep)
    assert (mask & keep[:, :, None, :]).sum() == keep.sum() * mask.shape[2]  # keep blocks always exact
    assert torch.equal(cnt, expect.sum(-1).int())
    assert (mask & expect).sum().item() / expect.sum().item() > 0.98  # near-ties may resolve differently
    ascending = (idx[..., 1:] > idx[..., :-1]) | (torch.arange(1, idx.shape[-1], device=idx.device) >= cnt[..., None])
    assert ascending.all()
    kw = dict(n_select=p.n_select, width=idx.shape[-1], scale=p.scale, hdev=stats.hdev, keep=keep)
    # A small score scratch (several query chunks, one GEMM + top-k launch each) changes nothing.
    chunked = TRITON.select(stats.qmean, stats.kmean, scratch_elems=3 * h * nk, **kw)
    assert torch.equal(check_selection(chunked, nk), mask) and torch.equal(chunked.bits, s.bits)
    # The reference's chunked torch.topk selection (the kernels' path past their size limit) agrees.
    t_mask = check_selection(ref.select(stats.qmean, stats.kmean, scratch_elems=7 * b * h * nk, **kw), nk)
    assert (t_mask & mask).sum().item() / mask.sum().item() > 0.98


def test_mask_selection_roundtrip():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 5, 70, generator=g) < 0.3
    s = Selection.from_mask(mask, 70)
    assert torch.equal(check_selection(s, 70), mask) and torch.equal(s.to_mask(70), mask)
    # Restricted to blocks [lo, hi): the same set, re-based.
    part = s.blocks(33, 61)
    assert torch.equal(check_selection(part, 28), mask[..., 33:61])
    assert part.idx.shape[-1] == 28


@pytest.mark.parametrize("peak", ["tail", "exact"])
@pytest.mark.parametrize("mode", ["hybrid", "zeroth"])
def test_running_max_in_either_phase(mode, peak):
    """The row maximum sits in a late tail group (after the exact blocks) or in the exact block: the
    accumulator, the denominator and the tail normaliser must all be rescaled whenever the running
    max rises (the public kernel forgot the tail normaliser)."""
    bs, d, lq, l = 16, 32, 64, 600  # 38 key blocks: three tail groups of 16 under the interpreter
    g = torch.Generator().manual_seed(11)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    q = 2.0 * u + 0.3 * torch.randn(1, 1, lq, d, generator=g)
    k = 0.3 * torch.randn(1, 1, l, d, generator=g)
    v = torch.randn(1, 1, l, d, generator=g)
    if peak == "tail":
        k[:, :, 35 * bs : 36 * bs] += 20.0 * u  # block 35 (third group): the row maximum
    else:  # the exact block tops a tail that still carries real mass
        k[:, :, 10 * bs : 11 * bs] += 20.0 * u
    k[:, :, 3 * bs : 4 * bs] += 8.0 * u  # block 3 (first group): a smaller tail peak
    # H̄ ≠ 0 so the first-order term (weighted by the tail normaliser) matters.
    for j in (3, 35):
        kj = k[:, :, j * bs : (j + 1) * bs]
        v[:, :, j * bs : (j + 1) * bs] += 6.0 * (kj - kj.mean(2, keepdim=True))
    q, k, v = (x.bfloat16().to(DEV) for x in (q, k, v))
    nk, nq = spec.num_blocks(l, bs), spec.num_blocks(lq, bs)
    mask = torch.zeros(1, 1, nq, nk, dtype=torch.bool, device=DEV)
    mask[..., 10] = True  # every query block: exact set = {10}
    p = plan_for(q, k, 1 / nk, bs, mode)
    stats = TRITON.prepare(q, k, v, bs)
    out, lse = TRITON.attend(q, k, v, stats, Selection.from_mask(mask, 1), mode=mode, scale=p.scale, block_size=bs,
                             n_select=1)
    o_ref, lse_ref = ref_with_selection(q, k, v, Selection.from_mask(mask, 1), mode, p.scale, bs)
    s_exact = (q.double() @ k.double()[:, :, 10 * bs : 11 * bs].transpose(-1, -2)).amax(-1) * p.scale
    s_tail = (q.double() @ stats.kmean.double()[:, :, [3, 35]].transpose(-1, -2)).amax(-1) * p.scale
    gap = s_tail - s_exact if peak == "tail" else s_exact - s_tail
    assert (gap > (5 if peak == "tail" else 1)).float().mean() > 0.9  # adversarial for most rows
    assert rel_l1(out, o_ref) < BF16_TOL
    assert (lse.double() - lse_ref).abs().max().item() < 2e-2


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide", "ignore:divide by zero encountered in log2")
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("mode", ["hybrid", "zeroth", "drop"])
def test_sharded_keys_merge_to_the_unsharded_call(backend, mode):
    """Attend to three K/V shards (the ragged last block in the last one) with the global selection
    re-based per shard and the global H̄: the merged partials equal the unsharded attend stage."""
    be = REF if backend == "reference" else TRITON
    dtype = torch.float64 if backend == "reference" else torch.bfloat16
    b, h, hk, lq, lk, d, bs = 1, 2, 2, 32, 230, 32, 16  # 15 key blocks, the last of 6 tokens; Hk > 1
    q, k, v = make_qkv(b, h, hk, lq, lk, d, dtype=dtype, seed=31)
    p = make_plan(q, k, 0.2, bs, mode, False, None, backend)
    stats, sel = select_plan(be, q, k, v, p)
    whole = be.attend(q, k, v, stats, sel, mode=mode, scale=p.scale, block_size=bs, n_select=p.n_select,
                      out_dtype=torch.float32)
    parts = []
    for lo, hi in ((0, 4), (4, 9), (9, 15)):
        ks, vs = (x[:, :, lo * bs : min(hi * bs, lk)] for x in (k, v))
        shard = stats.blocks(lo, hi).with_hbar(stats.hbar)
        parts.append(be.attend(q, ks, vs, shard, sel.blocks(lo, hi), mode=mode, scale=p.scale, block_size=bs,
                               n_select=p.n_select, out_dtype=torch.float32))
    if mode == "drop":  # some rows have no exact block in some shard: (unspecified, -inf), ignored
        # (the interpreter warns about the kernel's 0/0 there)
        assert any(torch.isneginf(lse).any() for _, lse in parts)
    out, lse = merge(parts)
    assert torch.isfinite(out).all()
    if backend == "reference":
        torch.testing.assert_close(out, whole[0].float(), rtol=1e-6, atol=1e-6)
    else:  # the kernel rounds P to bfloat16 against each shard's own running maximum
        assert rel_l1(out, whole[0]) < 2e-3
    torch.testing.assert_close(lse, whole[1], rtol=1e-5, atol=1e-5)


def test_deviation_against_a_given_hbar():
    """||H_j − H̄|| against a passed-in H̄ (a sharded caller's global one) is prepare's own hdev when
    given prepare's H̄, and follows the H̄ it is given."""
    q, k, v = make_qkv(1, 2, 2, 64, 100, 32, seed=13)
    stats = TRITON.prepare(q, k, v, 16, with_hdev=True)
    assert torch.equal(TRITON.deviation(k, v, stats, stats.hbar, 16), stats.hdev)
    other = torch.randn_like(stats.hbar)
    rs = REF.prepare(q.double(), k.double(), v.double(), 16)
    want = REF.deviation(k.double(), v.double(), rs, other.double(), 16)
    assert rel_l1(TRITON.deviation(k, v, stats, other, 16), want) < 2e-3


def test_public_api_triton_matches_reference_backend():
    layout = "bshd"
    b, h, l, d = 1, 2, 130, 32
    q, k, v = make_qkv(b, h, h, l, l, d, layout=layout, seed=21)
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    keep = torch.zeros(spec.num_blocks(l, 32), dtype=torch.bool)
    keep[0] = True
    kw = dict(density=0.3, block_size=32, layout=layout, keep_blocks=keep, return_lse=True, mode="hybrid")
    out_t, lse_t = pisa_attention(q, k, v, backend="triton", **kw)
    out_r, lse_r = pisa_attention(q, k, v, backend="reference", **kw)
    assert out_t.shape == q.shape and out_t.dtype == q.dtype
    assert rel_l1(out_t, out_r) < BF16_TOL  # random data: top-k selections coincide
    assert (lse_t - lse_r).abs().max().item() < 2e-2


@pytest.fixture
def overflow_checked(monkeypatch):
    """Triton's interpreter asserting that no 8-32-bit integer add, subtract or multiply overflows:
    its ``debug`` option on (device asserts are dropped without it; the suite skips the check's
    computation for speed: tests/interpreter_patch.py). Returns the switch: ``checks(False)`` puts
    the suite's options back for the rest of the test."""
    interp = pytest.importorskip("triton.runtime.interpreter")
    if DEV != "cpu" or not hasattr(interp, "interpreter_builder"):
        pytest.skip("Triton's interpreter runs the kernels only without a GPU")
    builder = interp.interpreter_builder

    def checks(on: bool) -> None:
        monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=on, debug=on))

    checks(True)
    return checks


@triton.jit
def _times_2_pow_16(x_ptr):
    import triton.language as tl

    tl.store(x_ptr, tl.load(x_ptr) * 65536)


def test_overflow_check_is_on_under_the_fixture(overflow_checked):
    x = torch.full((1,), 1 << 20, dtype=torch.int32)
    with pytest.raises(Exception, match="overflow"):
        _times_2_pow_16[(1,)](x)


def test_whole_call_under_the_overflow_check_equals_the_unchecked_call(overflow_checked):
    """Every kernel of one call (statistics, selection with kept blocks, the attend over a ragged
    GQA input, hybrid with the covariance term) computes no 8-32-bit integer past its range, and
    passes its own device asserts."""
    q, k, v = make_qkv(1, 2, 1, 70, 113, 16, layout="bshd", seed=5)
    keep = torch.zeros(spec.num_blocks(113, 32), dtype=torch.bool)
    keep[3] = True
    kw = dict(density=0.3, block_size=32, keep_blocks=keep, return_lse=True, mode="hybrid", covariance_aware=True,
              backend="triton")  # fmt: skip
    checked = pisa_attention(q, k, v, **kw)
    overflow_checked(False)
    for a, b in zip(checked, pisa_attention(q, k, v, **kw)):
        assert torch.equal(a, b)


def test_inference_only_error_at_the_forward_call():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, seed=2)
    with pytest.raises(ValueError, match="inference-only"):
        pisa_attention(q.requires_grad_(), k, v, block_size=32, backend="triton")
    with torch.no_grad():
        assert pisa_attention(q, k, v, block_size=32, backend="triton").shape == q.shape


def test_density_one_is_dense_attention():
    q, k, v = make_qkv(1, 2, 1, 96, 96, 32, dtype=torch.float16, seed=8)
    out = pisa_attention(q, k, v, density=1.0, block_size=32, backend="triton")
    kx, vx = (x.double().repeat_interleave(2, 1) for x in (k, v))
    dense = torch.softmax(q.double() @ kx.transpose(-1, -2) * 32**-0.5, -1) @ vx
    assert rel_l1(out, dense) < 2e-3


@pytest.mark.parametrize("mag", [100.0, 3000.0])
@pytest.mark.parametrize("density", [1.0, 0.25])
def test_float16_hbar_past_its_range_is_exact(density, mag):
    """A key and value channel sharing one large component (std 100: H̄ ~1.6e5 at 16-key blocks,
    past float16's 65504; std 3000: 1.4e8): the kernels read H̄ divided by one power of two per
    head, so the first-order term is as exact as in bfloat16. Density 1 is dense attention, below
    it the float64 reference under the same selection; nothing is non-finite."""
    from pisa_attn import PisaSettings, plan, run

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    c = torch.randn(1, 2, 64, generator=g) * mag
    k[..., 0], v[..., 0] = c, c
    q, k, v = q.half(), k.half(), v.half()
    hbar = ref.block_stats(k.double(), v.double(), 16).hbar.abs().amax(dim=(-2, -1))
    assert (hbar > 65504).all()  # past float16's range in every head
    s = PisaSettings(density=density, block_size=16, backend="triton")
    out, sel = run(plan(q, k, s), q, k, v, return_selection=True)
    assert torch.isfinite(out).all()
    q64, k64, v64 = (x.double() for x in (q, k, v))
    if density == 1.0:
        want = torch.softmax(q64 @ k64.transpose(-1, -2) * 16**-0.5, -1) @ v64
    else:
        want = run(plan(q64, k64, s.replace(backend="reference")), q64, k64, v64, selection=sel)
    assert rel_l1(out, want) < 2e-3


@pytest.mark.parametrize(
    "d,dtype,mode,bs,needle",
    [(96, torch.bfloat16, "hybrid", 64, "head dim 96"), (64, torch.float32, "hybrid", 64, "float32"),
     (64, torch.bfloat16, "first", 64, "first"), (64, torch.bfloat16, "hybrid", 256, "block_size 256")],
    ids=["D96", "fp32", "first", "bs256"],
)
def test_unsupported_reason(d, dtype, mode, bs, needle):
    q = torch.zeros(1, 1, 8, d, dtype=dtype, device=DEV)
    reason = op.unsupported_reason(q, mode, bs)
    assert reason is not None and needle in reason
    assert op.unsupported_reason(torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16, device=DEV), "drop", 64) is None


def test_batch_times_heads_past_the_grid_limit_is_refused():
    """B·H sits on a launch grid's second axis (at most 65 535): past it the kernels refuse the call
    by name instead of failing at launch; an explicit backend says so as a ValueError."""
    q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16, device=DEV).expand(2, 32768, 64, 64)
    assert "batch x heads = 65536" in op.unsupported_reason(q, "hybrid", 64)
    assert op.unsupported_reason(q[:, :32767], "hybrid", 64) is None
    with pytest.raises(ValueError, match="batch x heads = 65536"):
        pisa_attention(q, q, q, backend="triton")



# --- the weight alpha of the first-order term (per query head) ------------------------------------
ALPHA_CASES = [
    # id, (B, H, Hk, Lq, Lk, D, bs, layout, density): GQA (4 query heads on 1 kv head), ragged blocks
    pytest.param((1, 4, 1, 80, 166, 32, 32, "bshd", 0.3), id="B1-H4-Hk1-Lq80-Lk166-D32-bs32-bshd-gqa"),
    pytest.param((2, 2, 2, 64, 64, 64, 16, "bhsd", 0.25), id="B2-H2-L64-D64-bs16-bhsd"),
]


@pytest.mark.parametrize("case", ALPHA_CASES)
def test_alpha_per_query_head_matches_reference(case):
    """The kernel's first-order weight is per QUERY head (GQA heads sharing a kv head differ), is
    affine in the output (α = 0 is the zeroth-order kernel bit for bit, α = 1 the paper's), and
    matches the reference with the same weights under the same selection."""
    b, h, hk, lq, lk, d, bs, layout, density = case
    q, k, v = make_qkv(b, h, hk, lq, lk, d, layout=layout, seed=41)
    # H̄ must matter: give the values a component along the keys' deviations.
    v = (v.float() + 2.0 * k.float()).to(v.dtype)
    p = plan_for(q, k, density, bs, "hybrid")
    stats, sel = select_plan(TRITON, q, k, v, p)
    w = torch.tensor([0.0, 1.0, 0.5, -0.75][:h], dtype=torch.float32, device=DEV)
    kw = dict(scale=p.scale, block_size=bs, n_select=p.n_select)
    out_w, lse_w = TRITON.attend(q, k, v, stats, sel, mode="hybrid", alpha=w, **kw)
    out_1, lse_1 = TRITON.attend(q, k, v, stats, sel, mode="hybrid", **kw)  # no alpha: weight 1
    out_0, lse_0 = TRITON.attend(q, k, v, stats, sel, mode="zeroth", **kw)
    assert torch.equal(lse_w, lse_1) and torch.equal(lse_w, lse_0)  # the term has no denominator share
    assert torch.equal(out_w[:, 0], out_0[:, 0])  # α = 0: the zeroth-order output
    assert torch.equal(out_w[:, 1], out_1[:, 1])  # α = 1: the paper's output
    ones = TRITON.attend(q, k, v, stats, sel, mode="hybrid", alpha=torch.ones(h, device=DEV), **kw)[0]
    assert torch.equal(ones, out_1)
    # Affine per head: out(w) − out(0) = w_h · (out(1) − out(0)), up to the output rounding.
    corr = (out_1.double() - out_0.double())
    assert corr.abs().amax(dim=(0, 2, 3)).min() > 1e-2  # the term is not negligible in any head
    want = out_0.double() + w.double().view(1, h, 1, 1) * corr
    assert rel_l1(out_w, want) < 5e-3
    o_ref, lse_ref = REF.attend(*(x.double() for x in (q, k, v)), REF.prepare(q.double(), k.double(), v.double(), bs),
                                sel, mode="hybrid", scale=p.scale, block_size=bs, alpha=w.double())
    assert rel_l1(out_w, o_ref) < BF16_TOL
    assert (lse_w.double() - lse_ref).abs().max().item() < 2e-2


def test_alpha_through_the_public_api_and_default():
    """pisa_attention(alpha=...) on the kernels agrees with the reference backend; the default is
    spec.DEFAULT_ALPHA, a per-head tensor may live on the CPU or the device."""
    q, k, v = make_qkv(1, 4, 2, 80, 80, 32, seed=43)  # 3 blocks of 32, the last ragged
    v = (v.float() + 2.0 * k.float()).to(v.dtype)
    kw = dict(density=0.3, block_size=32)
    w = torch.tensor([0.2, 0.9, 0.0, 1.3])
    out_t = pisa_attention(q, k, v, backend="triton", alpha=w, **kw)
    out_td = pisa_attention(q, k, v, backend="triton", alpha=w.to(DEV), **kw)
    assert torch.equal(out_t, out_td)
    out_r = pisa_attention(q, k, v, backend="reference", alpha=w, **kw)
    assert rel_l1(out_t, out_r) < BF16_TOL
    default = pisa_attention(q, k, v, backend="triton", **kw)
    assert torch.equal(default, pisa_attention(q, k, v, backend="triton", alpha=spec.DEFAULT_ALPHA, **kw))
    paper = pisa_attention(q, k, v, backend="triton", alpha=1.0, **kw)
    assert not torch.equal(default, paper)


def test_a_token_stride_beyond_in_tile_offsets_is_refused():
    """Rows are addressed from an int64 block base with int32 offsets within the tile: a token stride
    whose tile would pass 2^31 elements gets a clear error (no silent wrap)."""
    stride = 2**24
    big = torch.zeros(stride + 64, dtype=torch.float16)
    k = big.as_strided((1, 1, 2, 16), (0, 16, stride, 1))
    q = torch.randn(1, 1, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="k has a token stride of 16777216 elements"):
        pisa_attention(q, k, q, block_size=16, backend="triton")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_stage_calls_given_keep_without_its_count_keep_every_kept_block(backend):
    """``run_plan``, ``select_plan`` and the backends' ``forward`` given ``keep`` without
    ``n_keep_max`` read the count from ``keep``: an index list sized for the top-k alone would drop
    the kept blocks past it."""
    be = TRITON if backend == "triton" else REF
    q, k, v = make_qkv(1, 2, 2, 100, 160, 32, seed=11)
    p = plan_for(q, k, 0.2, 16, "hybrid")
    keep = torch.zeros(1, 2, p.n_kv_blocks, dtype=torch.bool)
    keep[0, 1, :5] = True  # more kept blocks than the top-k's n_select
    assert p.n_select < 5
    _, want_sel, (want, want_lse) = run_plan(be, q, k, v, p, keep, 5)
    _, sel, (out, lse) = run_plan(be, q, k, v, p, keep)
    assert torch.equal(sel.to_mask(p.n_kv_blocks), want_sel.to_mask(p.n_kv_blocks))
    assert sel.to_mask(p.n_kv_blocks)[0, 1, :, :5].all()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    _, sel = select_plan(be, q, k, v, p, keep)
    assert torch.equal(sel.to_mask(p.n_kv_blocks), want_sel.to_mask(p.n_kv_blocks))
    out, lse = be.forward(q, k, v, p, keep)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
