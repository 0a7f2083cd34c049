"""Ring and Ulysses PISA on 2 (and 3) gloo CPU ranks equal single-process PISA on the whole sequence.

All cases run inside one spawn per world size (process start dominates); each case is then
asserted on its own. Inputs are float64 so that a different block selection (an O(1e-2) change)
cannot hide under the tolerance; ring partials merge through float32 LSEs (the reference returns
float32 LSE), hence ring's 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch

from pisa_attn import pisa_attention
from pisa_attn.spec import num_blocks
from pisa_attn.ops.merge import merge
from pisa_attn.parallel import ring_pisa_attention, ulysses_pisa_attention
from pisa_attn.parallel.launch import run_local

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest sets it without a GPU; ranks inherit it

BS = 16


def spec(algo, total, mode="hybrid", *, shards=None, cov=False, h=4, hk=4, layout="bhsd", perm=False, keep=None,
         q_subset=False, dtype=torch.float64):  # fmt: skip
    """One case. shards: per-rank lengths (None: even); perm: PISA on a random token order;
    keep: None, "flat" [Nk] or "head" [B, H, Nk]; q_subset: ring queries are a subset (q_perm)."""
    return dict(algo=algo, total=total, mode=mode, shards=shards, cov=cov, h=h, hk=hk, layout=layout, perm=perm,
                keep=keep, q_subset=q_subset, dtype=dtype)  # fmt: skip


CASES = {
    "ring-hybrid-aligned": spec("ring", 256),
    "ring-first-cov-gqa-ragged": spec("ring", 200, "first", cov=True, hk=2),
    "ring-zeroth-mqa-uneven": spec("ring", 200, "zeroth", shards=[64, 136], h=2, hk=1),
    "ring-drop-cov-unaligned-keep": spec("ring", 150, "drop", shards=[130, 20], cov=True, keep="head"),
    "ring-hybrid-bshd-perm-keep": spec("ring", 232, cov=True, hk=2, layout="bshd", perm=True, keep="flat"),
    "ring-hybrid-query-subset": spec("ring", 208, cov=True, perm=True, keep="flat", q_subset=True),
    "ring-hybrid-float32": spec("ring", 192, cov=True, dtype=torch.float32),
    "ulysses-hybrid": spec("ulysses", 256),
    "ulysses-first-cov-ragged": spec("ulysses", 200, "first", shards=[72, 128], cov=True, hk=2),
    "ulysses-zeroth-mqa": spec("ulysses", 160, "zeroth", hk=1, layout="bshd", keep="head"),
    "ulysses-drop-perm": spec("ulysses", 150, "drop", shards=[100, 50], cov=True, h=2, hk=2, perm=True, keep="flat"),
}
CASES3 = {
    "ring3-hybrid-unaligned": spec("ring", 230, shards=[90, 60, 80], cov=True, h=3, hk=3),
    "ring3-first-perm": spec("ring", 192, "first", h=3, hk=1, layout="bshd", perm=True, keep="flat"),
    "ulysses3-hybrid-perm": spec("ulysses", 180, cov=True, h=6, hk=2, perm=True, keep="head"),
}
TOL = {"ring": 1e-5, "ulysses": 1e-12}


def _lengths(total: int, shards, world: int) -> list[int]:
    return shards or [total // world + (r < total % world) for r in range(world)]


def _run_case(rank, world, c):
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

    # Single process on the (permuted) global sequence, scattered back to the original positions.
    got_q = pisa_attention(
        q[:, :, q_order], k[:, :, order], v[:, :, order], return_lse=True, backend="reference", **kw
    )
    want = torch.zeros_like(q)
    want_lse = torch.full((2, h, total), float("-inf"))
    want[:, :, q_order], want_lse[:, :, q_order] = got_q

    lens = _lengths(total, c["shards"], world)
    sl = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
    local = [x[:, :, sl] for x in (q, k, v)]
    if c["layout"] == "bshd":
        local = [x.transpose(1, 2) for x in local]
    extra = {"perm": order if c["perm"] else None}
    if c["q_subset"]:
        extra["q_perm"] = q_order
    fn = ring_pisa_attention if c["algo"] == "ring" else ulysses_pisa_attention
    out, lse = fn(*local, layout=c["layout"], return_lse=True, **extra, **kw)
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
    res["needs-grad"] = _expect_error(lambda: ring_pisa_attention(z, z, z, block_size=16))
    w = torch.randn(1, 2, 32, 16)
    bad = torch.zeros(64, dtype=torch.long)
    res["bad-perm"] = _expect_error(lambda: ulysses_pisa_attention(w, w, w, block_size=16, perm=bad))
    res["ring-bad-perm"] = _expect_error(lambda: ring_pisa_attention(w, w, w, block_size=16, perm=torch.arange(63)))
    res["ring-truthy-flag"] = _expect_error(lambda: ring_pisa_attention(w, w, w, block_size=16, return_lse="no"))
    res["ulysses-truthy-flag"] = _expect_error(
        lambda: ulysses_pisa_attention(w, w, w, block_size=16, covariance_aware="no")
    )
    return res


def _ring_on_triton_stages(rank, world):
    """The ring's steps with the Triton backend's stages (one argument) equal one process on the
    kernels: LSE to float32 rounding, output to bfloat16 rounding (the kernel rounds probabilities
    to bfloat16 against each shard's own running maximum; the ring's output is bfloat16)."""
    from pisa_attn import make_plan
    from pisa_attn.attention import get_backend
    from pisa_attn.ops.stages import run_plan
    from pisa_attn.parallel import ring

    be = get_backend("triton")
    g = torch.Generator().manual_seed(3)
    total, bs = 160, 16
    q, k, v = (torch.randn(1, 2, total, 32, generator=g).bfloat16() for _ in range(3))
    keep = torch.zeros(1, 1, total // bs, dtype=torch.bool)
    keep[..., 2] = True
    plan = make_plan(q, k, 0.3, bs, "hybrid", True, None, "triton")
    stats, sel, _ = run_plan(be, q, k, v, plan, keep, n_keep_max=1)
    want, want_lse = be.attend(q, k, v, stats, sel, mode="hybrid", scale=plan.scale, block_size=bs,
                               n_select=plan.n_select, out_dtype=torch.float32)
    bounds = [0, 96, total]  # block-aligned, uneven
    sl = slice(bounds[rank], bounds[rank + 1])
    out, lse = ring._ring_aligned(q[:, :, sl], k[:, :, sl], v[:, :, sl], bounds, None, be, density=0.3, block_size=bs,
                                  mode="hybrid", covariance_aware=True, scale=plan.scale, keep=keep, n_keep_max=1)
    err = ((out.double() - want[:, :, sl].double()).abs().sum() / want[:, :, sl].double().abs().sum()).item()
    return err, float((lse - want_lse[:, :, sl]).abs().max())


def _worker(rank, world, cases, with_errors):
    res = {name: _run_case(rank, world, spec) for name, spec in cases.items()}
    if with_errors:
        res["errors"] = _error_cases(rank, world)
        if INTERPRETED:
            res["ring-triton"] = _ring_on_triton_stages(rank, world)
    return res


@pytest.fixture(scope="module")
def two_ranks():
    return run_local(_worker, 2, CASES, True)


@pytest.fixture(scope="module")
def three_ranks():
    return run_local(_worker, 3, CASES3, False)


def _check(results, name, algo):
    for rank, res in enumerate(results):
        err_out, err_lse = res[name]
        assert err_out < TOL[algo] and err_lse < TOL[algo], (name, rank, err_out, err_lse)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_single_process(two_ranks, name):
    _check(two_ranks, name, CASES[name]["algo"])


@pytest.mark.parametrize("name", list(CASES3))
def test_three_ranks_equal_single_process(three_ranks, name):
    _check(three_ranks, name, CASES3[name]["algo"])


@pytest.mark.parametrize(
    "case, words",
    [
        ("heads-not-divisible", "divisible by the group size"),
        ("ranks-disagree", "every rank must hold the same"),
        ("needs-grad", "inference-only"),
        ("bad-perm", "permutation"),
        ("ring-bad-perm", "one entry per global token"),
    ],
)
def test_clear_errors(two_ranks, case, words):
    for res in two_ranks:
        msg = res["errors"][case]
        assert msg.startswith("ValueError") and words in msg, msg


@pytest.mark.parametrize("case, words", [("ring-truthy-flag", "return_lse"), ("ulysses-truthy-flag", "covariance_aware")])
def test_flags_must_be_booleans(two_ranks, case, words):
    for res in two_ranks:
        msg = res["errors"][case]
        assert msg.startswith("TypeError") and words in msg, msg


@pytest.mark.skipif(not INTERPRETED, reason="the gloo ranks run the Triton kernels through the CPU interpreter")
def test_ring_steps_run_on_the_triton_stages(two_ranks):
    for rank, res in enumerate(two_ranks):
        err_out, err_lse = res["ring-triton"]
        assert err_out < 4e-3 and err_lse < 1e-5, (rank, err_out, err_lse)


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
