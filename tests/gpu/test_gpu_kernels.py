"""GPU checks of the kernel backends (Triton; Hopper where the GPU is sm_90) at real sizes
(skipped without CUDA).

Against the float64 reference under the kernel's own selection, with outputs poisoned (NaN) before
each run; density 1 against SDPA's own bf16 error; the tail-maximum adversarial case; selection
overlap with ``torch.topk``; ``torch.compile(fullgraph=True)``; CUDA graph capture.

    PYTHONPATH=src python -m pytest tests/gpu -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pisa_attn import pisa_attention, spec  # noqa: E402
from pisa_attn.attention import get_backend, make_plan  # noqa: E402
from pisa_attn.ops import reference as ref  # noqa: E402
from pisa_attn.ops.selection import Selection, bits_to_mask  # noqa: E402
from selection_masks import idx_to_mask  # noqa: E402

BF16_TOL = 1e-2


def _hopper_reason():
    if not torch.cuda.is_available():
        return "no CUDA"
    try:
        return get_backend("hopper").unsupported_reason(torch.empty(1, 1, 64, 128, device="cuda",
                                                                    dtype=torch.bfloat16), "hybrid", 64)
    except ValueError as e:
        return str(e)


KERNELS = ["triton", pytest.param("hopper", marks=pytest.mark.skipif(_hopper_reason() is not None,
                                                                        reason=f"hopper: {_hopper_reason()}"))]


def rel_l1(a, b):
    return ((a.double() - b.double()).abs().sum() / b.double().abs().sum()).item()


def qkv(b, h, hk, lq, lk, d, dtype, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(heads, length):
        shape = (b, length, heads, d) if layout == "bshd" else (b, heads, length, d)
        x = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
        return x.transpose(1, 2) if layout == "bshd" else x

    return t(h, lq), t(hk, lk), t(hk, lk)


def launcher(backend):
    """The attention launcher of a kernel backend (it takes preallocated, poisoned outputs)."""
    if backend == "hopper":
        from pisa_attn.ops.hopper import attention as attn
    else:
        from pisa_attn.ops.triton import attention as attn
    return attn.attention


def stages(q, k, v, plan, keep=None, n_keep_max=0, poison=True, backend="triton"):
    """The backend's prepare + select, then its attention launcher with NaN-poisoned out / lse
    (every element must be written)."""
    from pisa_attn.ops.triton import attention as attn

    be = get_backend(backend)
    stats = be.prepare(q, k, v, plan.block_size, with_hdev=plan.covariance_aware)
    width = spec.selection_width(plan.n_kv_blocks, plan.n_select, n_keep_max)
    sel = be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=width, scale=plan.scale,
                    hdev=stats.hdev, keep=keep)
    out = attn._alloc_like_layout(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    if poison:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    launcher(backend)(q, k, v, *stats.tail(), *sel, mode=plan.mode, scale=plan.scale, block_size=plan.block_size,
                      n_select=plan.n_select, out=out, lse=lse)
    return stats, sel, out, lse


def check_selection(s: Selection, nk: int):
    mask = idx_to_mask(s.idx, s.cnt, nk)
    assert torch.equal(mask, bits_to_mask(s.bits, nk))
    return mask


CASES = {
    # B, H, Hk, Lq, Lk, D, dtype, layout, density
    "B1-H4-Hk2-L8229-D128-bf16-bshd-gqa-ragged": (1, 4, 2, 8229, 8229, 128, torch.bfloat16, "bshd", 0.125),
    "B2-H2-Lq4096-Lk6000-D64-fp16-bhsd": (2, 2, 2, 4096, 6000, 64, torch.float16, "bhsd", 0.25),
    "B1-H2-L16384-D128-bf16-bhsd-d5": (1, 2, 2, 16384, 16384, 128, torch.bfloat16, "bhsd", 0.05),
}


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("mode", ["hybrid", "zeroth", "drop"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_fp64_reference(name, mode, backend):
    b, h, hk, lq, lk, d, dtype, layout, density = CASES[name]
    q, k, v = qkv(b, h, hk, lq, lk, d, dtype, layout, seed=len(name) + len(mode))
    plan = make_plan(q, k, density, 64, mode, False, None, backend)
    _, sel, out, lse = stages(q, k, v, plan, backend=backend)
    mask = check_selection(sel, plan.n_kv_blocks)
    assert (sel.cnt == plan.n_select).all()
    stats64 = ref.block_stats(k.double(), v.double(), 64)
    o_ref, lse_ref = ref.pisa_forward(q.double(), k.double(), v.double(), stats64, mask, mode=mode,
                                      scale=plan.scale, block_size=64)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # poisoned: every element written
    err = rel_l1(out, o_ref)
    lse_err = (lse.double() - lse_ref).abs().max().item()
    print(f"\n[{backend} {name} {mode}] rel-L1 {err:.2e}  max|dLSE| {lse_err:.2e}")
    assert err < (BF16_TOL if dtype == torch.bfloat16 else 2e-3)
    assert lse_err < 1e-2


@pytest.mark.parametrize("backend", KERNELS)
def test_alpha_per_query_head_matches_fp64_reference(backend, monkeypatch):
    """The first-order weight of each QUERY head (GQA: heads of one kv head differ): weight 0 is the
    zeroth-order kernel bit for bit, weight 1 the unweighted kernel bit for bit, every head matches
    the float64 reference with the same weights. One kernel configuration for every launch: the
    autotuner may give the modes different tail-group sizes, which sum in another order."""
    monkeypatch.setenv("PISA_ATTN_AUTOTUNE", "0")
    b, h, hk, lq, lk, d, dtype, layout, density = CASES["B1-H4-Hk2-L8229-D128-bf16-bshd-gqa-ragged"]
    q, k, v = qkv(b, h, hk, lq, lk, d, dtype, layout, seed=17)
    v = (v.float() + 2.0 * k.float()).to(dtype)  # values along the keys' deviations: H̄ matters
    plan = make_plan(q, k, density, 64, "hybrid", False, None, backend)
    w = torch.tensor([0.0, 1.0, 0.5, 0.75], device="cuda")
    # One prepare (H̄ is summed with atomics: its last bits may differ between runs), three launches.
    be = get_backend(backend)
    stats = be.prepare(q, k, v, 64)
    sel = be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=plan.n_select, scale=plan.scale)

    def launch(mode, alpha=None):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        launcher(backend)(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                          n_select=plan.n_select, out=out, lse=lse, alpha=alpha)
        return out, lse

    out_w, lse_w = launch("hybrid", w)
    out_1, lse_1 = launch("hybrid")
    out_0, _ = launch("zeroth")
    assert torch.isfinite(out_w).all()
    assert torch.equal(out_w[:, 0], out_0[:, 0]) and torch.equal(out_w[:, 1], out_1[:, 1])
    assert torch.equal(lse_w, lse_1)
    mask = check_selection(sel, plan.n_kv_blocks)
    stats64 = ref.block_stats(k.double(), v.double(), 64)
    o_ref, _ = ref.pisa_forward(q.double(), k.double(), v.double(), stats64, mask, mode="hybrid", scale=plan.scale,
                                block_size=64, alpha=w.double())
    o_paper, _ = ref.pisa_forward(q.double(), k.double(), v.double(), stats64, mask, mode="hybrid", scale=plan.scale,
                                  block_size=64)
    for i in range(h):
        err = rel_l1(out_w[:, i], o_ref[:, i])
        print(f"\n[{backend} alpha={w[i].item():.2f} head {i}] rel-L1 {err:.2e} "
              f"(vs the paper's output: {rel_l1(out_w[:, i], o_paper[:, i]):.2e})")
        assert err < BF16_TOL


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graph_replays_a_changed_alpha(backend):
    """A device alpha tensor is read by the captured kernel: changing it in place changes the
    replayed output as an eager call with the new weights would (no re-capture, no recompile)."""
    q, k, v = _bshd_inputs()
    v = (v.float() + 2.0 * k.float()).to(v.dtype)
    w = torch.full((q.shape[2],), 0.25, device="cuda")

    def call(a):
        return pisa_attention(q, k, v, density=0.125, layout="bshd", backend=backend, alpha=a)

    call(w)  # warm-up: compile + autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call(w)
    w.copy_(torch.linspace(0.0, 1.0, w.numel(), device="cuda"))
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = call(w.clone())
    assert rel_l1(static_out, want) < 1e-3
    assert rel_l1(static_out, call(0.25)) > 10 * rel_l1(static_out, want)  # the new weights were used


@pytest.mark.parametrize("backend", KERNELS)
def test_density_one_within_sdpa_noise(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv(1, 4, 4, 4096, 4096, 128, torch.bfloat16, "bhsd", seed=1)
    out = pisa_attention(q, k, v, density=1.0, backend=backend)
    dense = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * 128**-0.5, -1) @ v.double()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ours, theirs = rel_l1(out, dense), rel_l1(sdpa, dense)
    print(f"\n[{backend} density 1] ours {ours:.2e}  sdpa flash {theirs:.2e}")
    assert ours <= 1.5 * theirs + 1e-4


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("mode", ["hybrid", "zeroth"])
def test_tail_maximum_adversarial(mode, backend):
    """Later tail groups hold each row's maximum, far above every exact score."""
    d, lq, lk, bs = 128, 2048, 16384, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g, device="cuda"), dim=0)
    q = 3.0 * u + 0.5 * torch.randn(1, 2, lq, d, generator=g, device="cuda")
    k = 0.5 * torch.randn(1, 2, lk, d, generator=g, device="cuda")
    v = torch.randn(1, 2, lk, d, generator=g, device="cuda")
    k[:, :, 200 * bs : 201 * bs] += 12.0 * u  # group 3 (of 64 centroids): the row maximum
    k[:, :, 5 * bs : 6 * bs] += 5.0 * u  # group 0: a smaller peak that sets the first maximum
    blk = k[:, :, 200 * bs : 201 * bs]
    v[:, :, 200 * bs : 201 * bs] += 2.0 * (blk - blk.mean(2, keepdim=True))  # H_j ≠ 0
    q, k, v = (x.bfloat16() for x in (q, k, v))
    nk, nq = lk // bs, lq // bs
    mask = torch.zeros(1, 2, nq, nk, dtype=torch.bool, device="cuda")
    mask[..., 100:104] = True
    stats = get_backend("triton").prepare(q, k, v, bs)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    launcher(backend)(q, k, v, *stats.tail(), *Selection.from_mask(mask, 4), mode=mode, scale=d**-0.5,
                      block_size=bs, n_select=4, out=out, lse=lse)
    stats64 = ref.block_stats(k.double(), v.double(), bs)
    o_ref, lse_ref = ref.pisa_forward(q.double(), k.double(), v.double(), stats64, mask, mode=mode,
                                      scale=d**-0.5, block_size=bs)
    err, lse_err = rel_l1(out, o_ref), (lse.double() - lse_ref).abs().max().item()
    print(f"\n[{backend} tail max {mode}] rel-L1 {err:.2e}  max|dLSE| {lse_err:.2e}")
    assert err < BF16_TOL and lse_err < 1e-2


def test_selection_overlap_and_keep_blocks():
    q, k, v = qkv(1, 4, 4, 16384, 16384, 128, torch.bfloat16, "bshd", seed=3)
    nk = 256
    keep = torch.zeros(nk, dtype=torch.bool)
    keep[:3] = True  # e.g. text tokens
    keep_dev = keep.reshape(1, 1, nk).cuda()
    for cov in (False, True):
        plan = make_plan(q, k, 0.125, 64, "hybrid", cov, None, "triton")
        stats, sel, out, _ = stages(q, k, v, plan, keep_dev, n_keep_max=3)
        cnt = sel.cnt
        mask = check_selection(sel, nk)
        chunked = get_backend("triton").select(
            stats.qmean, stats.kmean, n_select=plan.n_select, width=sel.idx.shape[-1], scale=plan.scale,
            hdev=stats.hdev, keep=keep_dev, scratch_elems=4 * 5 * nk,  # 5 query blocks per chunk
        )  # fmt: skip
        assert torch.equal(check_selection(chunked, nk), mask)
        rs = ref.block_stats(k.float(), v.float(), 64, with_hdev=cov)
        scores = ref.selection_scores(ref.block_means(q.float(), 64), rs.kmean, plan.scale, rs.hdev)
        expect = ref.select_blocks(scores, plan.n_select, keep_dev)
        overlap = (mask & expect).sum().item() / expect.sum().item()
        print(f"\n[selection cov={cov}] overlap with torch.topk on fp32 scores: {overlap:.5f}")
        assert mask[..., :3].all() and torch.equal(cnt, expect.sum(-1).int())
        assert overlap > 0.995
        if cov:
            assert rel_l1(stats.hdev, rs.hdev) < 5e-3
        assert rel_l1(stats.hbar, rs.hbar) < 5e-3


def _bshd_inputs():
    q, k, v = qkv(2, 8, 8, 4096, 4096, 128, torch.bfloat16, "bshd", seed=5)
    return [x.transpose(1, 2) for x in (q, k, v)]  # [B, L, H, D] tensors, layout="bshd"


def _public(q, k, v, backend="triton"):
    return pisa_attention(q, k, v, density=0.125, layout="bshd", backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
def test_torch_compile_fullgraph_registered_op(backend):
    q, k, v = _bshd_inputs()
    plan = make_plan(q.transpose(1, 2), k.transpose(1, 2), 0.125, 64, "hybrid", False, None, backend)
    forward = get_backend(backend).forward

    def f(q, k, v):
        out, lse = forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan)
        return out.transpose(1, 2), lse

    eager = f(q, k, v)
    got = torch.compile(f, fullgraph=True)(q, k, v)
    # H̄ is summed with atomics, so runs may differ in the last bits of the first-order term.
    assert rel_l1(got[0], eager[0]) < 1e-3 and rel_l1(got[1], eager[1]) < 1e-5


@pytest.mark.parametrize("backend", KERNELS)
def test_torch_compile_fullgraph_public_api(backend):
    q, k, v = _bshd_inputs()
    eager = _public(q, k, v, backend)
    got = torch.compile(lambda q, k, v: _public(q, k, v, backend), fullgraph=True)(q, k, v)
    assert rel_l1(got, eager) < 1e-3


@pytest.mark.parametrize("backend", KERNELS)
def test_cuda_graph_capture_public_api(backend):
    q, k, v = _bshd_inputs()
    sq, sk, sv = (x.clone() for x in (q, k, v))
    _public(sq, sk, sv, backend)  # warm-up: compile + autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _public(sq, sk, sv, backend)
    q2, k2, v2 = (torch.randn_like(x) for x in (q, k, v))
    for s_, n_ in ((sq, q2), (sk, k2), (sv, v2)):
        s_.copy_(n_)
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(static_out).all()
    assert rel_l1(static_out, _public(q2, k2, v2, backend)) < 1e-3


def test_sharded_keys_merge_at_real_size():
    """Three K/V shards attended with the global selection and H̄, merged: the unsharded call up to
    the kernel's bfloat16 rounding of probabilities (the LSE to float32 rounding)."""
    from pisa_attn.ops.merge import merge
    from pisa_attn.ops.stages import run_plan

    be = get_backend("triton")
    q, k, v = qkv(1, 4, 2, 4096, 8229, 128, torch.bfloat16, "bshd", seed=9)
    plan = make_plan(q, k, 0.125, 64, "hybrid", False, None, "triton")
    stats, sel, _ = run_plan(be, q, k, v, plan)
    kw = dict(mode="hybrid", scale=plan.scale, block_size=64, n_select=plan.n_select, out_dtype=torch.float32)
    whole, whole_lse = be.attend(q, k, v, stats, sel, **kw)
    parts, nk = [], plan.n_kv_blocks
    for lo, hi in ((0, 40), (40, 100), (100, nk)):
        ks, vs = (x[:, :, lo * 64 : hi * 64] for x in (k, v))
        parts.append(be.attend(q, ks, vs, stats.blocks(lo, hi).with_hbar(stats.hbar), sel.blocks(lo, hi), **kw))
    out, lse = merge(parts)
    err, lse_err = rel_l1(out, whole), (lse - whole_lse).abs().max().item()
    print(f"\n[3 shards vs whole] rel-L1 {err:.2e}  max|dLSE| {lse_err:.2e}")
    assert err < 3e-3 and lse_err < 1e-4


@pytest.mark.parametrize("backend", KERNELS)
def test_token_offsets_past_int32(backend):
    """Views whose token index times token stride passes 2^31 elements (as a sequence-first
    ``[L, B, H, D]`` tensor at video lengths and batch 8 gives): the same bits as contiguous copies.
    Each view lies in its own 4.3 GB storage, of which only the viewed rows are written."""
    lk, h, d = 16448, 2, 128
    stride = 2**31 // 16000 // 8 * 8  # rows from about 16 000 on pass 2^31 (16-byte aligned rows)
    g = torch.Generator(device="cuda").manual_seed(11)
    views = []
    for _ in range(3):
        big = torch.empty((lk - 1) * stride + h * d, device="cuda", dtype=torch.bfloat16)
        x = big.as_strided((1, lk, h, d), (0, stride, d, 1))  # bshd view
        x.copy_(torch.randn(1, lk, h, d, generator=g, device="cuda", dtype=torch.bfloat16))
        views.append(x)
    kw = dict(density=0.125, mode="hybrid", layout="bshd", backend=backend, return_lse=True)
    out, lse = pisa_attention(*views, **kw)
    want, want_lse = pisa_attention(*(x.contiguous() for x in views), **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    del views
    torch.cuda.empty_cache()


@pytest.mark.parametrize("case", [(2, 16, 16, 4096, 128, "bhsd", 128), (1, 8, 2, 8229, 64, "bshd", 256),
                                  (1, 4, 4, 4288, 128, "bhsd", 256)],
                         ids=["B2-H16-L4096-D128-bhsd-qb128", "B1-H8-Hk2-L8229-D64-bshd-gqa-ragged-qb256",
                              "B1-H4-L4288-D128-bhsd-qb256"])
def test_statistics_match_fp64_reference(case):
    """One-read statistics at real sizes against float64: means, centroids, H̄ with and without
    excluded blocks, ||H_j − H̄||, the float16 centroids; the workspace path writes the same bits."""
    from pisa_attn.ops.triton import prepare as P

    b, h, hk, l, d, layout, qb = case
    q, k, v = qkv(b, h, hk, l, l, d, torch.bfloat16, layout, seed=23)
    k = (k.float() + 2.0).bfloat16()  # a common key component: centring must be accurate
    nk = -(-l // 64)
    ex = torch.rand(b, 1, nk, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)) < 0.3
    ws = P.stats_workspace(q.shape, k.shape, q.dtype, q.device, block_size=64, query_block=qb, with_hdev=True)
    for excl in (None, ex):
        st = P.prepare(q, k, v, 64, with_hdev=True, query_block=qb, hbar_exclude=excl)
        rs = ref.prepare(q.double(), k.double(), v.double(), 64, with_hdev=True, query_block=qb, hbar_exclude=excl)
        errs = dict(qmean=rel_l1(st.qmean, rs.qmean), kmean=rel_l1(st.kmean, rs.kmean),
                    vbar=rel_l1(st.vbar.double() * rs.counts[:, None], rs.vsum), hbar=rel_l1(st.hbar, rs.hbar),
                    hdev=rel_l1(st.hdev, rs.hdev),
                    kbar=rel_l1(st.kbar.double() * st.kscale.double()[..., None, None], rs.kmean))
        print(f"\n[stats exclude={excl is not None}] " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
        assert errs["qmean"] < 1e-6 and errs["kmean"] < 1e-6 and errs["kbar"] < 1e-3
        assert errs["vbar"] < 5e-3 and errs["hbar"] < 5e-3 and errs["hdev"] < 5e-3
        got = P.prepare(q, k, v, 64, with_hdev=True, query_block=qb, hbar_exclude=excl, ws=ws)
        for f in ("qmean", "kmean", "kbar", "kscale", "vbar", "hbar", "hbar_lp", "hscale", "hdev"):
            assert torch.equal(getattr(got, f), getattr(st, f)), f  # deterministic: no atomics


@pytest.mark.parametrize("nk_blocks", [64, 128])
def test_selection_paths_agree_at_real_size(nk_blocks, monkeypatch):
    """The one-kernel selection and the score-GEMM + top-k path give the same selection (both 3xTF32),
    and it overlaps the float64 reference's top-k almost everywhere."""
    from pisa_attn.ops.triton import prepare as P
    from pisa_attn.ops.triton import select as S

    q, k, v = qkv(2, 16, 16, nk_blocks * 64, nk_blocks * 64, 128, torch.bfloat16, "bhsd", seed=nk_blocks)
    st = P.prepare(q, k, v, 64, with_hdev=True)
    n_sel = max(1, nk_blocks // 8)
    kw = dict(n_select=n_sel, width=n_sel, scale=128 ** -0.5, hdev=st.hdev)
    sels = {}
    for name, max_nkp in (("one", 256), ("two", 0)):
        monkeypatch.setitem(S.FUSED, "max_nkp", max_nkp)
        monkeypatch.setitem(S.FUSED, "warps", 8 if nk_blocks > 64 else 4)
        sels[name] = S.select(st.qmean, st.kmean, **kw)
    assert torch.equal(sels["one"].bits, sels["two"].bits) and torch.equal(sels["one"].idx, sels["two"].idx)
    want = ref.select(st.qmean.double(), st.kmean.double(), **{**kw, "hdev": st.hdev.double()}).to_mask(nk_blocks)
    mask = bits_to_mask(sels["one"].bits, nk_blocks)
    overlap = ((mask & want).sum() / want.sum()).item()
    print(f"\n[selection Nk={nk_blocks}] overlap with float64 top-k {overlap:.6f}")
    assert overlap > 0.999


HOPPER_ONLY = pytest.mark.skipif(_hopper_reason() is not None, reason=f"hopper: {_hopper_reason()}")


@HOPPER_ONLY
@pytest.mark.parametrize("source", ["dit-T4-30x52-H4-D128-ragged", "gauss-B1-H4-Hk2-L8229-D128-gqa-ragged"])
@pytest.mark.parametrize("mode", ["hybrid", "drop"])
def test_hopper_pairing_is_bit_identical(source, mode):
    """In the ascending stream order, whatever query blocks share a CTA (adjacent, or matched by
    shared exact blocks in groups of 4 or 8), every block's output and LSE are bit for bit the
    same; the default order with matched pairs matches the float64 reference. The matching must
    also change the pairs on DiT-like heads."""
    from pisa_attn import data
    from pisa_attn.ops.hopper import attention as gattn
    from pisa_attn.ops.triton.pairs import pair_match

    if source.startswith("dit"):
        d = data.dit_qkv((4, 30, 52), heads=4, head_dim=128, seed=1, dtype=torch.bfloat16, device="cuda")
        q, k, v = d.q, d.k, d.v
    else:
        q, k, v = qkv(1, 4, 2, 8229, 8229, 128, torch.bfloat16, "bshd", seed=11)
    plan = make_plan(q, k, 0.125, 64, mode, False, None, "hopper")
    be = get_backend("hopper")
    stats = be.prepare(q, k, v, 64)
    width = spec.selection_width(plan.n_kv_blocks, plan.n_select, 0)
    sel = be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=width, scale=plan.scale)
    outs = {}
    for group, order in ((2, "ascending"), (4, "ascending"), (8, "ascending"), (8, "owners"), (2, "owners")):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                        n_select=plan.n_select, out=out, lse=lse, pair_group=group, pair_order=order,
                        query_group=2)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        outs[group, order] = (out, lse)
    for group in (4, 8):
        assert torch.equal(outs[group, "ascending"][0], outs[2, "ascending"][0]), group
        assert torch.equal(outs[group, "ascending"][1], outs[2, "ascending"][1]), group
    mask = bits_to_mask(sel.bits, plan.n_kv_blocks)
    o_ref, lse_ref = ref.pisa_forward(q.double(), k.double(), v.double(), ref.block_stats(k.double(), v.double(), 64),
                                      mask, mode=mode, scale=plan.scale, block_size=64)
    for key in ((8, "owners"), (2, "owners"), (8, "ascending")):
        assert rel_l1(outs[key][0], o_ref) < BF16_TOL, key
        assert (outs[key][1].double() - lse_ref).abs().max().item() < 1e-2, key
    if source.startswith("dit"):
        qpair = pair_match(sel.bits.contiguous(), 8)
        first = torch.arange(0, qpair.shape[2] * 2, 2, device="cuda", dtype=torch.int32)
        assert not torch.equal(qpair[..., 0], first.expand_as(qpair[..., 0]))


def _uneven_mask(b, h, nq, nk, device):
    """An exact-set mask whose pairs own very different counts: even query blocks select a long
    run of key blocks, odd ones three, so one consumer of a pair owns many consecutive stream
    entries while its partner holds a block (the pipelined loop must release it in time)."""
    mask = torch.zeros(b, h, nq, nk, dtype=torch.bool, device=device)
    mask[:, :, 0::2, : nk // 2] = True
    mask[:, :, 1::2, nk - 3:] = True
    mask[:, :, 1::2, 0] = True  # one block shared
    return mask


def _stream_case(source: str, mode: str, seed: int):
    """Inputs named by a test id, their plan, statistics, selection (the kernel's own, or the uneven
    mask) and the float64 reference output and LSE under that selection."""
    from pisa_attn import data

    if source.startswith("dit"):
        d = data.dit_qkv((4, 30, 52), heads=4, head_dim=128, seed=2, dtype=torch.bfloat16, device="cuda")
        q, k, v = d.q, d.k, d.v
    elif source.startswith("gauss-B1"):
        q, k, v = qkv(1, 4, 2, 8229, 8229, 128, torch.bfloat16, "bshd", seed=seed)
    elif source.startswith("gauss-B2"):
        q, k, v = qkv(2, 2, 2, 4096, 6000, 64, torch.float16, "bhsd", seed=seed + 1)
    elif source.startswith("gauss30"):  # 30x a unit-variance input: scores in the thousands
        q, k, v = qkv(1, 2, 2, 4096, 4096, 128, torch.bfloat16, "bhsd", seed=seed + 4)
        q, k = q * 30, k * 30
    elif source.startswith("mixed30"):  # head 0 at 30x, head 1 as given
        q, k, v = qkv(1, 2, 2, 4096, 4096, 128, torch.bfloat16, "bhsd", seed=seed + 5)
        scale = torch.tensor([30.0, 1.0], device=q.device, dtype=q.dtype)[None, :, None, None]
        q, k = q * scale, k * scale
    elif "D128" in source:
        q, k, v = qkv(1, 2, 2, 4096, 4096, 128, torch.bfloat16, "bhsd", seed=seed + 2)
    else:
        q, k, v = qkv(1, 2, 2, 4000, 4100, 64, torch.float16, "bhsd", seed=seed + 3)
    plan = make_plan(q, k, 0.125, 64, mode, False, None, "hopper")
    be = get_backend("hopper")
    stats = be.prepare(q, k, v, 64)
    nk = plan.n_kv_blocks
    if source.startswith("uneven"):
        sel = Selection.from_mask(_uneven_mask(q.shape[0], q.shape[1], -(-q.shape[2] // 64), nk, q.device))
    else:
        width = spec.selection_width(nk, plan.n_select, 0)
        sel = be.select(stats.qmean, stats.kmean, n_select=plan.n_select, width=width, scale=plan.scale)
    mask = bits_to_mask(sel.bits, nk)
    o_ref, lse_ref = ref.pisa_forward(q.double(), k.double(), v.double(), ref.block_stats(k.double(), v.double(), 64),
                                      mask, mode=mode, scale=plan.scale, block_size=64)
    return q, k, v, plan, stats, sel, o_ref, lse_ref


@HOPPER_ONLY
@pytest.mark.parametrize("source", ["gauss-B1-H4-Hk2-L8229-D128-bf16-gqa-ragged", "gauss-B2-H2-Lq4096-Lk6000-D64-fp16",
                                    "dit-T4-30x52-H4-D128-bf16", "uneven-B1-H2-L4096-D128-bf16",
                                    "uneven-B1-H2-Lq4000-Lk4100-D64-fp16"])
@pytest.mark.parametrize("mode", ["hybrid", "drop"])
def test_hopper_pipelined_loop_is_bit_identical(source, mode):
    """The pipelined exact loop (Q·Kᵀ and softmax of a block under the previous block's P·V; pairs)
    does the sequential loop's operations in the same order: bit for bit the same output and LSE, in
    both stream orders, with 3 to 5 ring slots, and within the bf16 bound of the float64
    reference (both with the online maximum: the pipelined loop has no fixed one)."""
    from pisa_attn.ops.hopper import attention as gattn

    q, k, v, plan, stats, sel, o_ref, lse_ref = _stream_case(source, mode, seed=12)
    for order in ("owners", "ascending"):
        outs = {}
        for pipe, st in ((False, None), (True, None), (True, 3), (True, 4), (True, 5)):
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:3], float("nan"), device="cuda")
            gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                            n_select=plan.n_select, out=out, lse=lse, pair_order=order, pipeline=pipe, stages=st,
                            query_group=2, exact_max="online")
            torch.cuda.synchronize()
            outs[pipe, st] = (out, lse)
        base_out, base_lse = outs[False, None]
        assert torch.isfinite(base_out).all() and torch.isfinite(base_lse).all()
        for key, (out, lse) in outs.items():
            assert torch.equal(out, base_out), (order, key, rel_l1(out, base_out))
            assert torch.equal(lse, base_lse), (order, key)
        assert rel_l1(base_out, o_ref) < BF16_TOL, order
        assert (base_lse.double() - lse_ref).abs().max().item() < 1e-2, order


@HOPPER_ONLY
@pytest.mark.parametrize("source", ["gauss-B1-H4-Hk2-L8229-D128-bf16-gqa-ragged", "uneven-B1-H2-L4096-D128-bf16",
                                    "uneven-B1-H2-Lq4000-Lk4100-D64-fp16"])
def test_hopper_stream_protocols_are_bit_identical(source, monkeypatch):
    """The stream codes of pairs read from global memory or staged in shared memory (in one chunk,
    in several, or past the chunk limit), sequential or pipelined, 3 or 4 slots, both stream orders:
    bit for bit the same output and LSE, within the bf16 bound of the float64 reference."""
    from pisa_attn.ops.hopper import attention as gattn

    mode = "hybrid"  # the exact loop and the tail (drop runs the same exact loop)
    q, k, v, plan, stats, sel, o_ref, lse_ref = _stream_case(source, mode, seed=21)
    # (codes, pipeline, slots, chunk width, chunk limit): chunks of 32 codes split the uneven
    # masks' 64-entry streams into two TMA copies; a limit of 1 chunk sends them to global memory
    # (the Gaussian selection's 32 entries still fit one chunk).
    variants = ((False, False, None, 256, 8), (True, False, None, 256, 8), (True, False, None, 32, 8),
                (True, False, None, 32, 1), (True, True, 4, 256, 8))
    for order in ("owners", "ascending"):
        outs = {}
        for codes, pipe, st, chunk, limit in variants:
            monkeypatch.setattr(gattn, "CODE_CHUNK", chunk)
            monkeypatch.setattr(gattn, "CODES_MAX_CHUNKS", limit)
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:3], float("nan"), device="cuda")
            gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                            n_select=plan.n_select, out=out, lse=lse, pair_order=order, pipeline=pipe, stages=st,
                            codes=codes, query_group=2, exact_max="online")
            torch.cuda.synchronize()
            outs[codes, pipe, st, chunk, limit] = (out, lse)
        base_out, base_lse = outs[variants[0]]
        assert torch.isfinite(base_out).all() and torch.isfinite(base_lse).all()
        for key, (out, lse) in outs.items():
            assert torch.equal(out, base_out), (order, key, rel_l1(out, base_out))
            assert torch.equal(lse, base_lse), (order, key)
        assert rel_l1(base_out, o_ref) < BF16_TOL, order
        assert (base_lse.double() - lse_ref).abs().max().item() < 1e-2, order


@HOPPER_ONLY
@pytest.mark.parametrize("source", ["gauss-B1-H4-Hk2-L8229-D128-bf16-gqa-ragged", "gauss-B2-H2-Lq4096-Lk6000-D64-fp16",
                                    "dit-T4-30x52-H4-D128-bf16", "uneven-B1-H2-L4096-D128-bf16",
                                    "uneven-B1-H2-Lq4000-Lk4100-D64-fp16"])
@pytest.mark.parametrize("mode", ["hybrid", "zeroth", "drop"])
def test_hopper_three_query_blocks_per_cta(source, mode):
    """Three query blocks per CTA (three consumers, each owner's blocks in ascending order) compute
    what pairs compute in the ascending order: bit for bit in keep-or-drop mode and, with the
    tail's online maximum, the LSE in the modes with a tail (the output within 1e-6: the
    first-order term takes q from its float16 copy); with the tail's fixed maximum (three
    consumers sum it from q's float16 copy in shared memory) within 1e-5; with 3 and 4 ring slots, and within the bf16
    bound of the float64 reference."""
    from pisa_attn.ops.hopper import attention as gattn

    q, k, v, plan, stats, sel, o_ref, lse_ref = _stream_case(source, mode, seed=41)
    for tail_max in ("online", "auto") if mode != "drop" else ("online",):
        outs = {}
        for group, st in ((2, None), (3, None), (3, 3)):
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:3], float("nan"), device="cuda")
            gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                            n_select=plan.n_select, out=out, lse=lse, pair_order="ascending", stages=st,
                            query_group=group, kbound=stats.kbound, tail_max=tail_max, exact_max="online")
            torch.cuda.synchronize()
            outs[group, st] = (out, lse)
        base_out, base_lse = outs[2, None]
        assert torch.isfinite(base_out).all() and torch.isfinite(base_lse).all()
        for key, (out, lse) in outs.items():
            if mode == "drop":
                assert torch.equal(lse, base_lse) and torch.equal(out, base_out), (key, rel_l1(out, base_out))
            elif tail_max == "online":
                assert torch.equal(lse, base_lse), key
                assert rel_l1(out, base_out) < 1e-6, key
            else:
                assert (lse - base_lse).abs().max().item() < 1e-5, key
                assert rel_l1(out, base_out) < 1e-5, key
            assert rel_l1(out, o_ref) < BF16_TOL, key
        assert (base_lse.double() - lse_ref).abs().max().item() < 1e-2


@HOPPER_ONLY
@pytest.mark.parametrize("source", ["gauss-B1-H4-Hk2-L8229-D128-bf16-gqa-ragged", "gauss-B2-H2-Lq4096-Lk6000-D64-fp16",
                                    "dit-T4-30x52-H4-D128-bf16"])
@pytest.mark.parametrize("mode", ["hybrid", "drop"])
def test_hopper_query_tile_from_shared_memory_is_bit_identical(source, mode):
    """The query tile read from shared memory in every Q·Kᵀ (``q_reg=False``) instead of held in
    registers: the same products in the same order, so bit for bit the same output and LSE, for
    pairs and three query blocks, the exact loop's maximum online and under its bound."""
    from pisa_attn.ops.hopper import attention as gattn

    q, k, v, plan, stats, sel, o_ref, lse_ref = _stream_case(source, mode, seed=43)
    for group in (2, 3):
        for exact_max in ("online", "bound"):
            outs = {}
            for q_reg in (True, False):
                out = torch.full_like(q, float("nan"))
                lse = torch.full(q.shape[:3], float("nan"), device="cuda")
                gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                                n_select=plan.n_select, out=out, lse=lse, query_group=group, kbound=stats.kbound,
                                kmax=stats.kmax, exact_max=exact_max, q_reg=q_reg)
                torch.cuda.synchronize()
                outs[q_reg] = (out, lse)
            (out_r, lse_r), (out_s, lse_s) = outs[True], outs[False]
            assert torch.isfinite(out_s).all() and torch.isfinite(lse_s).all()
            assert torch.equal(out_s, out_r) and torch.equal(lse_s, lse_r), (group, exact_max, rel_l1(out_s, out_r))
            assert rel_l1(out_s, o_ref) < BF16_TOL, (group, exact_max)


@HOPPER_ONLY
def test_hopper_three_query_blocks_refuse_pair_options():
    """Options that only pairs have are refused with three query blocks per CTA, naming them."""
    from pisa_attn.ops.hopper import attention as gattn

    q, k, v, plan, stats, sel, _, _ = _stream_case("uneven-B1-H2-L4096-D128-bf16", "drop", seed=3)
    kw = dict(mode="drop", scale=plan.scale, block_size=64, n_select=plan.n_select, query_group=3)
    for bad in (dict(pair_group=8), dict(pipeline=True), dict(pair_order="owners")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            gattn.attention(q, k, v, *stats.tail(), *sel, **kw, **bad)
    with pytest.raises(ValueError, match="query_group"):
        gattn.attention(q, k, v, *stats.tail(), *sel, **{**kw, "query_group": 4})


@HOPPER_ONLY
@pytest.mark.parametrize("source", ["gauss-B1-H4-Hk2-L8229-D128-bf16-gqa-ragged", "gauss-B2-H2-Lq4096-Lk6000-D64-fp16",
                                    "dit-T4-30x52-H4-D128-bf16", "gauss30-B1-H2-L4096-D128-bf16"])
@pytest.mark.parametrize("mode", ["hybrid", "zeroth"])
def test_hopper_tail_fixed_maximum(source, mode):
    """The tail's maximum fixed before the scan (``tail_max="auto"``) and kept online compute the
    same function: both within the bf16 bound of the float64 reference, with two and three query
    blocks per CTA. Where the bound is loose (scores in the thousands) the kernel keeps the online
    maximum: bit for bit the online result; on bfloat16 DiT-like heads it fixes it (the sums then
    round differently, so equal bits would mean the fixed path never ran)."""
    from pisa_attn.ops.hopper import attention as gattn

    q, k, v, plan, stats, sel, o_ref, lse_ref = _stream_case(source, mode, seed=5)
    for group in (2, 3):
        outs = {}
        for tail_max in ("auto", "online"):
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:3], float("nan"), device="cuda")
            gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                            n_select=plan.n_select, out=out, lse=lse, query_group=group, kbound=stats.kbound,
                            tail_max=tail_max, exact_max="online")
            torch.cuda.synchronize()
            assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (group, tail_max)
            assert rel_l1(out, o_ref) < BF16_TOL, (group, tail_max, rel_l1(out, o_ref))
            assert (lse.double() - lse_ref).abs().max().item() < 1e-2, (group, tail_max)
            outs[tail_max] = (out, lse)
        same = torch.equal(outs["auto"][0], outs["online"][0]) and torch.equal(outs["auto"][1], outs["online"][1])
        if source.startswith("gauss30"):
            assert same, group
        elif source.startswith("dit"):
            assert not same, group
        print(f"\n[{source} {mode} group {group}] fixed vs online rel-L1 "
              f"{rel_l1(outs['auto'][0], outs['online'][0]):.1e}")


@HOPPER_ONLY
@pytest.mark.parametrize("source", ["gauss-B1-H4-Hk2-L8229-D128-bf16-gqa-ragged", "gauss-B2-H2-Lq4096-Lk6000-D64-fp16",
                                    "dit-T4-30x52-H4-D128-bf16", "uneven-B1-H2-L4096-D128-bf16",
                                    "gauss30-B1-H2-L4096-D128-bf16", "mixed30-B1-H2-L4096-D128-bf16"])
@pytest.mark.parametrize("mode", ["hybrid", "zeroth", "drop"])
def test_hopper_exact_fixed_maximum(source, mode):
    """The exact loop's maximum fixed at the per-row bound ``s·Σ|q_d|·max|k_d|`` (``exact_max=
    "bound"``, the keys' maxima as prepare writes them) and the online one compute the same function: both within the bf16
    bound of the float64 reference, with two and three query blocks per CTA, the tail's maximum
    fixed or online. The bound is used on bfloat16 Gaussian and DiT-like heads (the sums then round
    differently, so equal bits would mean the fixed path never ran); where it is loose (scores in
    the thousands: every head, or one of two) the loop keeps the online maximum, bit for bit the
    online result there; float16 always keeps it."""
    from pisa_attn.ops.hopper import attention as gattn

    from pisa_attn.ops.triton import prepare as P

    q, k, v, plan, stats, sel, o_ref, lse_ref = _stream_case(source, mode, seed=7)
    fp16 = q.dtype == torch.float16
    kmax = P.prepare(q, k, v, 64, with_kmax=True).kmax
    assert torch.equal(kmax, k.float().abs().amax(2))
    for group in (2, 3):
        for tail_max in ("auto", "online") if mode != "drop" else ("auto",):
            outs = {}
            for exact_max in ("bound", "online"):
                out = torch.full_like(q, float("nan"))
                lse = torch.full(q.shape[:3], float("nan"), device="cuda")
                gattn.attention(q, k, v, *stats.tail(), *sel, mode=mode, scale=plan.scale, block_size=64,
                                n_select=plan.n_select, out=out, lse=lse, query_group=group, kbound=stats.kbound,
                                tail_max=tail_max, exact_max=exact_max, kmax=kmax)
                torch.cuda.synchronize()
                key = (group, tail_max, exact_max)
                assert torch.isfinite(out).all() and torch.isfinite(lse).all(), key
                assert rel_l1(out, o_ref) < BF16_TOL, (key, rel_l1(out, o_ref))
                assert (lse.double() - lse_ref).abs().max().item() < 1e-2, key
                outs[exact_max] = (out, lse)
            (fo, fl), (oo, ol) = outs["bound"], outs["online"]
            if source.startswith("gauss30") or fp16:
                assert torch.equal(fo, oo) and torch.equal(fl, ol), (group, tail_max)
            elif source.startswith("mixed30"):  # head 0 falls back, head 1 fixes its maximum
                assert torch.equal(fo[:, 0], oo[:, 0]) and torch.equal(fl[:, 0], ol[:, 0]), (group, tail_max)
                assert not torch.equal(fo[:, 1], oo[:, 1]), (group, tail_max)
            else:
                assert not torch.equal(fo, oo), (group, tail_max)
            assert rel_l1(fo, oo) < 5e-3, (group, tail_max)
            print(f"\n[{source} {mode} group {group} tail {tail_max}] exact fixed vs online rel-L1 "
                  f"{rel_l1(fo, oo):.1e}, max |dLSE| {(fl - ol).abs().max().item():.1e}")
