"""Ring and Ulysses PISA on 2 gloo CPU ranks equal single-process PISA on the whole sequence
(3 and 4 ranks, Ulysses x ring: test_parallel_four_ranks.py, which reuses these cases).

All cases run inside one spawn (process start dominates); each case is then asserted on its own.
Inputs are float64 so that a different block selection (an O(1e-2) change) cannot hide under the
tolerance; ring partials merge through float32 LSEs (the reference returns float32 LSE), hence
ring's 1e-5.
"""

from __future__ import annotations

import os

import re

import pytest
import torch

from pisa_attn import pisa_attention
from pisa_attn.spec import num_blocks
from pisa_attn.ops.merge import merge
from pisa_attn import PisaSettings
from pisa_attn.parallel import ring_pisa_attention, ulysses_pisa_attention, unified_pisa_attention
from local_ranks import run_ranks

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest sets it without a GPU; ranks inherit it

BS = 16


def spec(algo, total, mode="hybrid", *, shards=None, cov=False, h=4, hk=4, layout="bhsd", perm=False, keep=None,
         q_subset=False, exact_q=False, dtype=torch.float64, alpha=None, query_block=None,
         settings=False):  # fmt: skip
    """One case. shards: per-rank lengths (None: even); perm: PISA on a random token order;
    keep: None, "flat" [Nk] or "head" [B, H, Nk]; q_subset: ring queries are a subset (q_perm);
    exact_q: the queries before q_perm's (and 5 of its own) attend exactly (exact_queries);
    alpha: the first-order weight (a float or a list, one per query head); query_block: tokens per
    selection row; settings: pass the parallel entry one PisaSettings instead of keyword arguments."""
    return dict(algo=algo, total=total, mode=mode, shards=shards, cov=cov, h=h, hk=hk, layout=layout, perm=perm,
                keep=keep, q_subset=q_subset, exact_q=exact_q, dtype=dtype, alpha=alpha, query_block=query_block,
                settings=settings)  # fmt: skip


CASES = {
    "ring-hybrid-aligned": spec("ring", 256),
    "ring-first-cov-gqa-ragged": spec("ring", 200, "first", cov=True, hk=2),
    "ring-zeroth-mqa-uneven": spec("ring", 200, "zeroth", shards=[64, 136], h=2, hk=1),
    "ring-drop-cov-unaligned-keep": spec("ring", 150, "drop", shards=[130, 20], cov=True, keep="head"),
    "ring-hybrid-bshd-perm-keep": spec("ring", 232, cov=True, hk=2, layout="bshd", perm=True, keep="flat"),
    "ring-hybrid-query-subset": spec("ring", 208, cov=True, perm=True, keep="flat", q_subset=True),
    "ring-hybrid-float32": spec("ring", 192, cov=True, dtype=torch.float32),
    "ring-zeroth-subset-exact-queries": spec("ring", 200, "zeroth", shards=[120, 80], hk=2, layout="bshd", perm=True,
                                          keep="flat", q_subset=True, exact_q=True),
    "ulysses-hybrid": spec("ulysses", 256),
    "ulysses-first-cov-ragged": spec("ulysses", 200, "first", shards=[72, 128], cov=True, hk=2),
    "ulysses-zeroth-mqa": spec("ulysses", 160, "zeroth", hk=1, layout="bshd", keep="head"),
    "ulysses-drop-perm": spec("ulysses", 150, "drop", shards=[100, 50], cov=True, h=2, hk=2, perm=True, keep="flat"),
    "ring-hybrid-alpha-per-head-gqa": spec("ring", 200, hk=2, alpha=[0.0, 0.3, 1.0, 0.6]),
    "ulysses-first-alpha-per-head": spec("ulysses", 160, "first", hk=2, alpha=[0.1, 0.9, 0.4, 1.0]),
    "ring-hybrid-query-block-unaligned-settings": spec("ring", 200, shards=[48, 152], query_block=2 * BS,
                                                       alpha=[0.2, 0.4, 0.6, 0.8], settings=True),
    "ulysses-hybrid-query-block-settings": spec("ulysses", 160, hk=2, query_block=4 * BS, settings=True),
    "ulysses-hybrid-alpha-one-value": spec("ulysses", 160, hk=2, alpha=[0.5]),  # broadcasts, not cut per rank
}
TOL = {"ring": 1e-5, "ulysses": 1e-12, "unified": 1e-5}


def _lengths(total: int, shards, world: int) -> list[int]:
    return shards or [total // world + (r < total % world) for r in range(world)]


def _run_case(rank, world, c, groups=None):
    """One case on this rank (``rank``/``world`` within the case's ranks); ``groups``: the process
    groups the entry takes (default group: none), e.g. {"ulysses_group": .., "ring_group": ..}."""
    total, h, dtype = c["total"], c["h"], c["dtype"]
    g = torch.Generator().manual_seed(total * 7 + h)
    q = torch.randn(2, h, total, 32, generator=g, dtype=dtype)
    k = torch.randn(2, c["hk"], total, 32, generator=g, dtype=dtype) * 1.5
    v = torch.randn(2, c["hk"], total, 32, generator=g, dtype=dtype)
    order = torch.randperm(total, generator=g) if c["perm"] else torch.arange(total)
    q_order = order[total // 5 :] if c["q_subset"] else order  # e.g. the image queries after the text
    n_kv = num_blocks(total, BS)
    keep = None
    if c["keep"] == "flat":
        keep = torch.zeros(n_kv, dtype=torch.bool)
        keep[1] = True
    elif c["keep"] == "head":
        keep = torch.rand(2, h, n_kv, generator=g) < 0.2
    kw = dict(density=0.3, block_size=BS, mode=c["mode"], covariance_aware=c["cov"], keep_blocks=keep)
    if c.get("alpha") is not None:
        kw["alpha"] = torch.tensor(c["alpha"], dtype=torch.float64) if isinstance(c["alpha"], list) else c["alpha"]
    if c.get("query_block") is not None:
        kw["query_block"] = c["query_block"]

    # Single process on the (permuted) global sequence, scattered back to the original positions.
    got_q = pisa_attention(
        q[:, :, q_order], k[:, :, order], v[:, :, order], return_lse=True, backend="reference", **kw
    )
    want = torch.zeros_like(q)
    want_lse = torch.full((2, h, total), float("-inf"))
    want[:, :, q_order], want_lse[:, :, q_order] = got_q
    exact = None
    if c["exact_q"]:  # the queries before q_order, and 5 of q_order's, attend every key exactly
        exact = order[: total // 5 + 5]
        kx, vx = (x.repeat_interleave(h // c["hk"], dim=1) for x in (k, v))
        s = q[:, :, exact] @ kx.transpose(-1, -2) * q.shape[-1] ** -0.5
        want[:, :, exact], want_lse[:, :, exact] = torch.softmax(s, -1) @ vx, torch.logsumexp(s, -1).float()

    lens = _lengths(total, c["shards"], world)
    sl = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
    local = [x[:, :, sl] for x in (q, k, v)]
    if c["layout"] == "bshd":
        local = [x.transpose(1, 2) for x in local]
    extra = {"perm": order if c["perm"] else None}
    if c["q_subset"]:
        extra["q_perm"] = q_order
    if exact is not None:
        extra["exact_queries"] = exact
    fn = {"ring": ring_pisa_attention, "ulysses": ulysses_pisa_attention, "unified": unified_pisa_attention}[c["algo"]]
    if c.get("settings"):  # one settings object (its alpha a per-head tuple) instead of the keywords
        loose = {n: kw.pop(n) for n in ("density", "block_size", "mode", "covariance_aware", "query_block", "alpha")
                 if n in kw}
        if isinstance(loose.get("alpha"), torch.Tensor):
            loose["alpha"] = tuple(loose["alpha"].tolist())
        kw["settings"] = PisaSettings(layout=c["layout"], **loose)
        out, lse = fn(*local, return_lse=True, **extra, **kw, **(groups or {}))
    else:
        out, lse = fn(*local, layout=c["layout"], return_lse=True, **extra, **kw, **(groups or {}))
    if c["layout"] == "bshd":
        out = out.transpose(1, 2)
    assert out.dtype == dtype and out.shape == want[:, :, sl].shape
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse[:, :, sl]))  # left-out queries: -inf
    fin = torch.isfinite(want_lse[:, :, sl])
    return float((out - want[:, :, sl]).abs().max()), float((lse - want_lse[:, :, sl])[fin].abs().max())


def _expect_error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _error_cases(rank, world):
    x = torch.randn(1, 3, 32, 16)
    res = {"heads-not-divisible": _expect_error(lambda: ulysses_pisa_attention(x, x, x, block_size=16))}
    d = 16 if rank == 0 else 32
    y = torch.randn(1, 2, 32, d)
    res["ranks-disagree"] = _expect_error(lambda: ring_pisa_attention(y, y, y, block_size=16))
    z = torch.randn(1, 2, 32, 16, requires_grad=True)
    t = torch.randn(1, 2, 32, 16)
    res["needs-grad"] = _expect_error(lambda: ring_pisa_attention(z, z, z, block_size=16))
    a = torch.tensor([0.3, 0.6], requires_grad=True)  # its gradient would stop at the collectives
    res["alpha-needs-grad"] = _expect_error(lambda: ring_pisa_attention(t, t, t, block_size=16, alpha=a))
    res["ulysses-alpha-needs-grad"] = _expect_error(lambda: ulysses_pisa_attention(t, t, t, block_size=16, alpha=a))
    # errors of one rank, or settings that differ: every rank raises (none is left in a collective)
    u = torch.randn(1, 2, 32 if rank == 0 else 0, 16)
    res["one-rank-empty"] = _expect_error(lambda: ring_pisa_attention(u, u, u, block_size=16))
    res["settings-disagree"] = _expect_error(lambda: ring_pisa_attention(t, t, t, block_size=16,
                                                                         density=0.3 if rank == 0 else 0.5))
    # a setting one rank refuses (a density out of range, low precision on sharded keys): every rank raises
    res["ring-one-rank-bad-setting"] = _expect_error(lambda: ring_pisa_attention(t, t, t, block_size=16,
                                                                                 density=1.5 if rank == 1 else 0.5))
    res["ring-one-rank-fp8"] = _expect_error(lambda: ring_pisa_attention(
        t, t, t, settings=PisaSettings(block_size=16, precision="fp8" if rank == 1 else "input")))
    res["ulysses-one-rank-bad-setting"] = _expect_error(lambda: ulysses_pisa_attention(
        t, t, t, block_size=16, mode="hybrid" if rank == 0 else "nope"))
    keep = torch.ones(1, 4, 4, dtype=torch.bool)
    res["keep-heads"] = _expect_error(lambda: ulysses_pisa_attention(t, t, t, block_size=16, keep_blocks=keep))
    w = torch.randn(1, 2, 32, 16)
    bad = torch.zeros(64, dtype=torch.long)
    res["bad-perm"] = _expect_error(lambda: ulysses_pisa_attention(w, w, w, block_size=16, perm=bad))
    res["ring-bad-perm"] = _expect_error(lambda: ring_pisa_attention(w, w, w, block_size=16, perm=torch.arange(63)))
    res["ring-truthy-flag"] = _expect_error(lambda: ring_pisa_attention(w, w, w, block_size=16, return_lse="no"))
    res["ring-list-q-perm"] = _expect_error(lambda: ring_pisa_attention(w, w, w, block_size=16, q_perm=[0, 1]))
    res["ulysses-truthy-flag"] = _expect_error(
        lambda: ulysses_pisa_attention(w, w, w, block_size=16, covariance_aware="no")
    )
    return res


def _ring_on_triton(rank, world):
    """Public ring on the Triton kernels (interpreter) vs one process on the kernels, bfloat16: a
    token permutation, shards that are not block aligned, a kept block, covariance-aware. LSE to
    float32 rounding, output to bfloat16 rounding (the ring's partials stay float32, then one
    rounding; one process rounds once too, but against its own running maxima)."""
    g = torch.Generator().manual_seed(3)
    total, bs = 150, 16
    q, k, v = (torch.randn(1, 2, total, 32, generator=g).bfloat16() for _ in range(3))
    order = torch.randperm(total, generator=g)
    keep = torch.zeros(num_blocks(total, bs), dtype=torch.bool)
    keep[2] = True
    kw = dict(density=0.3, block_size=bs, covariance_aware=True, keep_blocks=keep, return_lse=True, backend="triton")
    want = torch.zeros_like(q, dtype=torch.float32)
    want_lse = torch.zeros(1, 2, total)
    want[:, :, order], want_lse[:, :, order] = (
        x.float() for x in pisa_attention(q[:, :, order], k[:, :, order], v[:, :, order], **kw)
    )
    bounds = [0, 70, total]
    sl = slice(bounds[rank], bounds[rank + 1])
    out, lse = ring_pisa_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], perm=order, **kw)
    err = ((out.double() - want[:, :, sl].double()).abs().sum() / want[:, :, sl].double().abs().sum()).item()
    return err, float((lse - want_lse[:, :, sl]).abs().max()), str(out.dtype)


def _ring_shard_fields(rank, world):
    """A backend whose prepare writes a shard field (the keys' maxima, as the Hopper backend's)
    only from 80 keys on, ring shards of 70 and 80 keys: with the backend's ``shard_prepare`` every
    rank writes it, the ranks gather the same layout and every attend reads its own shard's maxima.
    Returns (rel-L1 against one process, largest |kmax - max |k|| over the attends, attends)."""
    import dataclasses

    from pisa_attn import attention
    from pisa_attn.ops.triton import op

    base, seen = op.BACKEND, []

    def prepare(q, k, v, block_size, *, with_kmax=None, **kw):
        return base.prepare(q, k, v, block_size, with_kmax=k.shape[2] >= 80 if with_kmax is None else with_kmax, **kw)

    def attend(q, k, v, stats, sel, **kw):
        if stats.kmax is not None:
            seen.append(float((stats.kmax - k.float().abs().amax(2)).abs().max()))
        return base.attend(q, k, v, stats, sel, **kw)

    def shard_prepare(dtype, lens):
        return dict(with_kmax=any(n >= 80 for n in lens))

    be = dataclasses.replace(base, prepare=prepare, attend=attend, shard_prepare=shard_prepare)
    g = torch.Generator().manual_seed(5)
    total, bs = 150, 16
    q, k, v = (torch.randn(1, 2, total, 32, generator=g).bfloat16() for _ in range(3))
    kw = dict(density=0.3, block_size=bs, backend="triton")
    want = pisa_attention(q, k, v, **kw).double()
    sl = slice(*[(0, 70), (70, total)][rank])
    saved = attention._BACKENDS.get("triton")
    attention._BACKENDS["triton"] = be
    try:
        out = ring_pisa_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], **kw)
    finally:
        attention._BACKENDS["triton"] = saved if saved is not None else base
    err = ((out.double() - want[:, :, sl]).abs().sum() / want[:, :, sl].abs().sum()).item()
    return err, max(seen, default=float("inf")), len(seen)


def _settings_alpha_float64(rank, world):
    """A per-head alpha given in settings= keeps float64 through Ulysses: the one-process call's bits."""
    from pisa_attn import PisaSettings

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g, dtype=torch.float64) for _ in range(3))
    s = PisaSettings(density=0.25, block_size=16, backend="reference", alpha=(0.1, 0.7))
    sl = slice(64 * rank, 64 * rank + 64)
    one = pisa_attention(q, k, v, settings=s)[:, :, sl]
    return float((ulysses_pisa_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], settings=s) - one).abs().max())


def _orders_made_in_inference_mode(rank, world):
    """perm and q_perm made under torch.inference_mode() (as inside a pipeline call): inference
    tensors have no version counter, so the order caches key them by value; equal to one process."""
    res = {}
    with torch.inference_mode():
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
        perm = torch.randperm(64, generator=g)
        kw = dict(block_size=16, density=0.3, backend="reference")
        want = torch.empty_like(q)
        want[:, :, perm] = pisa_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], **kw)
        sl = slice(32 * rank, 32 * rank + 32)
        for name, fn in (("ring", ring_pisa_attention), ("ulysses", ulysses_pisa_attention)):
            for _ in range(2):  # the second call reads the cache
                out = fn(q[:, :, sl], k[:, :, sl], v[:, :, sl], perm=perm, **kw)
            res[name] = float((out - want[:, :, sl]).abs().max())
    return res


def _worker(rank, world, cases, with_errors):
    res = {name: _run_case(rank, world, spec) for name, spec in cases.items()}
    if with_errors:
        res["inference-orders"] = _orders_made_in_inference_mode(rank, world)
        res["settings-alpha-f64"] = _settings_alpha_float64(rank, world)
        res["errors"] = _error_cases(rank, world)
        if INTERPRETED:
            res["ring-triton"] = _ring_on_triton(rank, world)
            res["ring-shard-fields"] = _ring_shard_fields(rank, world)
    return res


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_worker, 2, CASES, True)


def _check(results, name, algo):
    for rank, res in enumerate(results):
        err_out, err_lse = res[name]
        assert err_out < TOL[algo] and err_lse < TOL[algo], (name, rank, err_out, err_lse)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_single_process(two_ranks, name):
    _check(two_ranks, name, CASES[name]["algo"])


@pytest.mark.parametrize(
    "case, words",
    [
        ("heads-not-divisible", "divisible by the group size"),
        ("ranks-disagree", "every rank must hold the same"),
        ("needs-grad", "inference-only"),
        ("alpha-needs-grad", "alpha requires grad"),
        ("ulysses-alpha-needs-grad", "alpha requires grad"),
        ("bad-perm", "permutation"),
        ("ring-bad-perm", "one entry per global token"),
        ("one-rank-empty", "empty input|rank 1 refused its inputs"),
        ("settings-disagree", "same settings"),
        ("ring-one-rank-bad-setting", "density must be in|rank 1 refused its inputs"),
        ("ring-one-rank-fp8", "precision='fp8' is not supported by ring|rank 1 refused its inputs"),
        ("ulysses-one-rank-bad-setting", "mode must be|rank 1 refused its inputs"),
        ("keep-heads", "keep_blocks must have 1 or H = 2 heads"),
    ],
)
def test_clear_errors(two_ranks, case, words):
    for res in two_ranks:
        msg = res["errors"][case]
        assert msg.startswith("ValueError") and re.search(words, msg), msg


@pytest.mark.parametrize(
    "case, words", [("ring-truthy-flag", "return_lse"), ("ulysses-truthy-flag", "covariance_aware"),
                    ("ring-list-q-perm", "q_perm must be")]
)
def test_flags_must_be_booleans(two_ranks, case, words):
    for res in two_ranks:
        msg = res["errors"][case]
        assert msg.startswith("TypeError") and words in msg, msg


@pytest.mark.skipif(not INTERPRETED, reason="the gloo ranks run the Triton kernels through the CPU interpreter")
def test_public_ring_runs_on_the_triton_kernels(two_ranks):
    for rank, res in enumerate(two_ranks):
        err_out, err_lse, dtype = res["ring-triton"]
        assert dtype == "torch.bfloat16" and err_out < 4e-3 and err_lse < 1e-5, (rank, err_out, err_lse)


@pytest.mark.skipif(not INTERPRETED, reason="the gloo ranks run the Triton kernels through the CPU interpreter")
def test_ring_shard_fields_written_on_every_rank(two_ranks):
    """Key shards on both sides of a backend's field threshold (the Hopper backend's keys' maxima
    from 16K keys): each rank attends every shard with that shard's own field."""
    for rank, res in enumerate(two_ranks):
        err, kmax_err, attends = res["ring-shard-fields"]
        assert attends == 2 and kmax_err == 0.0 and err < 4e-3, (rank, err, kmax_err, attends)


def test_orders_made_in_inference_mode(two_ranks):
    for res in two_ranks:
        assert max(res["inference-orders"].values()) < 1e-6, res["inference-orders"]


def test_settings_alpha_keeps_float64(two_ranks):
    assert all(res["settings-alpha-f64"] == 0.0 for res in two_ranks)


def test_merge_is_exact_softmax_split():
    """The LSE merge of disjoint key sets equals attention over their union; rows with no term in a
    partial (lse -inf, output possibly NaN as a kernel's 0/0) are ignored; no term anywhere gives (0, -inf)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64) for _ in range(3))
    s = q @ k.transpose(-1, -2)
    full = torch.softmax(s, -1) @ v

    def part(cols):
        return torch.softmax(s[..., cols], -1) @ v[:, :, cols], torch.logsumexp(s[..., cols], -1)

    out, lse = merge([part(slice(0, 3)), part(slice(3, 8))])
    assert torch.allclose(out, full, atol=1e-12) and torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-12)
    out, lse = merge([part(slice(0, 2)), part(slice(2, 5)), part(slice(5, 8))], out_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), full, atol=1e-6)
    nan_out, empty_lse = torch.full_like(full, float("nan")), torch.full_like(lse, float("-inf"))
    out2, lse2 = merge([(nan_out, empty_lse), (nan_out, empty_lse)])
    assert torch.equal(out2, torch.zeros_like(full)) and torch.isneginf(lse2).all()
    out3, _ = merge([(nan_out, empty_lse), part(slice(0, 8))])
    assert torch.allclose(out3, full, atol=1e-12)


@pytest.mark.parametrize("nk", [1, 31, 33, 70])
def test_selection_blocks_is_the_mask_restricted_to_the_shard(nk):
    """Selection.blocks (index-list and bit-shift arithmetic) names the same exact set as the
    bool mask cut to [lo, hi), with the same width; re-based indices stay inside the shard."""
    from pisa_attn.ops.selection import Selection
    from selection_masks import idx_to_mask

    g = torch.Generator().manual_seed(nk)
    for width in (1, 3, nk):
        first = Selection.from_mask(torch.rand(2, 3, 4, nk, generator=g) < 0.3, width)
        mask = idx_to_mask(first.idx, first.cnt, nk)  # at most `width` per row, as select makes them
        sel = Selection.from_mask(mask, width)
        for lo in range(0, nk + 1, 4):
            for hi in range(lo, nk + 1, 7):
                got, want = sel.blocks(lo, hi), Selection.from_mask(mask[..., lo:hi], max(1, min(hi - lo, width)))
                assert got.idx.shape == want.idx.shape and torch.equal(got.cnt, want.cnt), (width, lo, hi)
                assert torch.equal(got.bits, want.bits), (width, lo, hi)
                assert torch.equal(idx_to_mask(got.idx, got.cnt, hi - lo), mask[..., lo:hi]), (width, lo, hi)
                if hi > lo:
                    assert 0 <= got.idx.min() and got.idx.max() < hi - lo


@pytest.mark.skipif(not INTERPRETED, reason="the Triton merge runs through the CPU interpreter here")
def test_triton_merge_writes_its_own_lse_layout():
    """LSE views that are not dense (every other row of a buffer): the merged LSE, a new dense
    tensor, is written through its own strides, not the partials'."""
    from pisa_attn.ops.merge import merge_torch
    from pisa_attn.ops.triton import merge as kernel

    g = torch.Generator().manual_seed(3)
    parts = [(torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 10, generator=g)[..., ::2]) for _ in range(2)]
    assert kernel.supports(parts)
    got, got_lse = kernel.merge(parts)
    want, want_lse = merge_torch(parts)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not INTERPRETED, reason="the Triton merge runs through the CPU interpreter here")
@pytest.mark.parametrize("n, dtype, d", [(1, torch.float32, 16), (3, torch.bfloat16, 32), (4, torch.float32, 48)])
def test_triton_merge_matches_torch_merge(n, dtype, d):
    """One-pass kernel vs the PyTorch merge: partials in a [B, L, H, D] layout, rows with no term in
    some partial (lse -inf, NaN output), rows with no term anywhere; output dtype and layout kept."""
    from pisa_attn.ops.merge import merge_torch
    from pisa_attn.ops.triton import merge as kernel

    g = torch.Generator().manual_seed(n)
    parts = []
    for i in range(n):
        o = torch.randn(2, 3, 70, d, generator=g).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.randn(2, 3, 70, generator=g) * 3
        lse[0, 0, : 5 + i] = float("-inf")  # rows 0-4: no term anywhere; 5..: no term in some partials
        o[0, 0, : 5 + i] = float("nan")
        parts.append((o, lse))
    assert kernel.supports(parts)
    out_dtype = dtype if dtype != torch.float32 else None
    got, got_lse = kernel.merge(parts, out_dtype)
    want, want_lse = merge_torch(parts, out_dtype)
    assert got.dtype == want.dtype and got.stride() == parts[0][0].stride()
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse)) and torch.isfinite(got).all()
    fin = torch.isfinite(want_lse)
    assert (got_lse - want_lse)[fin].abs().max() < 1e-6
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # one bfloat16 rounding apart at most
    assert ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1)).max() <= tol


def test_from_mask_cuts_bits_with_the_index_list():
    """A row with more exact blocks than the width keeps its first ``width`` blocks in idx, cnt
    and bits alike (a kernel reads the list for exact blocks and the bits for the tail)."""
    from pisa_attn.ops.selection import Selection

    mask = torch.ones(1, 1, 2, 40, dtype=torch.bool)
    mask[0, 0, 1, ::3] = False
    sel = Selection.from_mask(mask, 5)
    listed = torch.zeros_like(mask).scatter_(-1, sel.idx.long(), True)
    assert torch.equal(sel.to_mask(40), listed) and sel.cnt.tolist() == [[[5, 5]]]


@pytest.mark.parametrize("bad, kw", [(0, {}), (True, {}), (2, {"start_method": "fork"})],
                         ids=["no-ranks", "bool-ranks", "fork"])
def test_run_local_refuses_bad_arguments_before_starting_a_rank(bad, kw):
    from pisa_attn.parallel.launch import run_local

    with pytest.raises(ValueError, match="start_method" if kw else "world_size"):
        run_local(_worker, bad, **kw)
