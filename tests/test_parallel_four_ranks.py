"""Four gloo CPU ranks in ONE spawn (process start and the diffusers import dominate): the core
entry points and the diffusers backend under ring x4, Ulysses x4 and Ulysses 2 x ring 2, and
three-rank cases on a subgroup; each equals one process. Cases assert apart.

Core cases are float64 on the reference (tolerances as in test_parallel_core.py); the Triton case
runs the kernels through the interpreter in bfloat16 with an empty K/V shard (fewer key blocks
than ranks); diffusers cases use the tiny FLUX and Wan with 4 heads (float32, 2e-5).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from local_ranks import run_ranks
from test_parallel_core import INTERPRETED, _check, _run_case, spec

HERE = os.path.dirname(os.path.abspath(__file__))

CASES4 = {
    # 3 key blocks over 4 ranks: one rank holds no key block and no query block (it only relays).
    "ring4-hybrid-empty-shard": spec("ring", 40, cov=True, h=2, hk=2),
    "ring4-drop-uneven-perm-keep": spec("ring", 190, "drop", shards=[90, 7, 60, 33], perm=True, keep="head"),
    "ulysses4-zeroth-gqa-uneven": spec("ulysses", 150, "zeroth", shards=[40, 30, 50, 30], hk=2, perm=True),
    "unified-hybrid-perm-keep": spec("unified", 200, cov=True, hk=2, layout="bshd", perm=True, keep="head",
                                     alpha=[0.2, 1.0, 0.0, 0.7]),
    "unified-zeroth-uneven-subset-exact": spec("unified", 170, "zeroth", shards=[50, 33, 47, 40], perm=True,
                                              keep="flat", q_subset=True, exact_q=True),
}
CASES3 = {
    "ring3-hybrid-unaligned": spec("ring", 230, shards=[90, 60, 80], cov=True, h=3, hk=3),
    "ring3-first-perm": spec("ring", 192, "first", h=3, hk=1, layout="bshd", perm=True, keep="flat"),
    "ulysses3-hybrid-perm": spec("ulysses", 180, cov=True, h=6, hk=2, perm=True, keep="head"),
}


# The two-rank tests run every kind on both families; four ranks add the 2 x 2 grid (both families)
# and the ring and Ulysses degrees of four, each on one family.
DIFFUSERS4 = {"flux": ("ulysses", "unified", "ring-uneven"), "wan": ("ring", "unified")}


def _ring_triton_empty_shard(rank, world):
    """Kernels (interpreter), bfloat16, 3 key blocks on 4 ranks: prepare on an empty K/V shard and
    select with no local query block must run; equal to one process on the kernels."""
    from pisa_attn import pisa_attention
    from pisa_attn.parallel import ring_pisa_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g).bfloat16() for _ in range(3))
    kw = dict(density=0.5, block_size=16, return_lse=True, backend="triton")
    want, want_lse = pisa_attention(q, k, v, **kw)
    sl = slice(10 * rank, 10 * rank + 10)
    out, lse = ring_pisa_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], **kw)
    ref = want[:, :, sl].double()
    return float((out.double() - ref).abs().sum() / ref.abs().sum()), float((lse - want_lse[:, :, sl]).abs().max())


def _core(rank, world):
    import torch.distributed as dist

    # Ulysses groups {0,1}, {2,3}; ring groups {0,2}, {1,3}: rank = ring_rank * 2 + ulysses_rank.
    # Every rank creates every group, in the same order.
    uly = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    three = dist.new_group([0, 1, 2])
    uly_again = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # the Ulysses groups' ranks, other objects
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # ring peers at other Ulysses positions
    singles = [dist.new_group([r]) for r in range(world)]
    pair = dist.new_group([0, 1])
    groups = {"ulysses_group": uly[rank // 2], "ring_group": ring[rank % 2]}
    res = {}
    for name, c in CASES4.items():
        res[name] = _run_case(rank, world, c, groups if c["algo"] == "unified" else None)
    for name, c in CASES3.items():
        res[name] = _run_case(rank, 3, c, {"group": three}) if rank < 3 else None
    if INTERPRETED:
        res["ring4-triton-empty-shard"] = _ring_triton_empty_shard(rank, world)
    res["unified-errors"] = _unified_errors(rank, groups)
    res["unified-errors"]["same-ranks"] = _unified_errors(
        rank, {"ulysses_group": uly[rank // 2], "ring_group": uly_again[rank // 2]}, only="empty")
    res["unified-errors"]["crossed"] = _unified_errors(
        rank, {"ulysses_group": uly[rank // 2], "ring_group": crossed[0 if rank in (0, 3) else 1]}, only="empty")
    # a 1 x 2 grid on ranks 0 and 1 of four (ranks 2 and 3 take no part): a grid of a subset
    res["unified-subset"] = _unified_subset(rank, singles[rank], pair) if rank < 2 else None
    return res


def _unified_subset(rank, single, pair):
    from pisa_attn import pisa_attention
    from pisa_attn.parallel import unified_pisa_attention

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
    kw = dict(density=0.3, block_size=16, backend="reference")
    sl = slice(32 * rank, 32 * rank + 32)
    out = unified_pisa_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], ulysses_group=single, ring_group=pair, **kw)
    return float((out - pisa_attention(q, k, v, **kw)[:, :, sl]).abs().max())


def _unified_errors(rank, groups, only=None):
    """Input one rank refuses (an empty shard, grad, a setting), a malformed seq_lens, settings that
    differ between the ranks of one Ulysses group and a batch that differs between two ranks of
    one Ulysses group: every rank of the grid raises (none waits in a
    collective). Returns each case's error, 'ok' when it ran."""
    from pisa_attn.parallel import unified_pisa_attention

    def run(fn):
        try:
            with torch.enable_grad():
                fn()
            return "ok"
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"

    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 4, 40, 16, generator=g, dtype=torch.float64)
    empty = x[:, :, :0] if rank == 3 else x
    grad = x.clone().requires_grad_(rank == 0)
    kw = dict(block_size=16, backend="reference", **groups)
    if only == "empty":  # valid input: what the groups alone make of it
        return run(lambda: unified_pisa_attention(x, x, x, **kw))
    return {
        "empty": run(lambda: unified_pisa_attention(empty, empty, empty, **kw)),
        "grad": run(lambda: unified_pisa_attention(grad, x, x, **kw)),
        "seq-lens": run(lambda: unified_pisa_attention(x, x, x, seq_lens=[-1, 41, 40, 40], **kw)),
        "settings": run(lambda: unified_pisa_attention(x, x, x, density=0.25 if rank == 0 else 0.5, **kw)),
        # one Ulysses group's ranks disagree on the batch: the other group must not wait in the ring
        "shape": run(lambda: unified_pisa_attention(*(x.expand(2, -1, -1, -1) if rank == 1 else x,) * 3, **kw)),
        "one-bad-setting": run(lambda: unified_pisa_attention(x, x, x, density=1.5 if rank == 2 else 0.5, **kw)),
    }


def _diffusers(world):
    sys.path.insert(0, HERE)  # diffusers_tiny
    from test_parallel_diffusers import _config, cp_results

    from diffusers import ContextParallelConfig

    runs = {
        "ulysses": ("ulysses", _config("ulysses", world), True, False),
        "ring": ("ring", _config("ring", world), False, False),
        "unified": ("unified", ContextParallelConfig(ulysses_degree=2, ring_degree=2), True, False),
        "ring-uneven": ("ring-uneven", _config("ring", world, anything=True), True, True),
    }
    return {family: cp_results(family, [runs[kind] for kind in kinds], heads=4)
            for family, kinds in DIFFUSERS4.items()}


def _worker(rank, world):
    sys.path.insert(0, HERE)
    from cpu_context_parallel import allow_cpu_context_parallel

    allow_cpu_context_parallel()
    return {"core": _core(rank, world), "diffusers": _diffusers(world)}


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_worker, 4)


@pytest.mark.parametrize("name", list(CASES4))
def test_four_ranks_equal_single_process(four_ranks, name):
    _check([r["core"] for r in four_ranks], name, CASES4[name]["algo"])


@pytest.mark.parametrize("name", list(CASES3))
def test_three_ranks_of_four_equal_single_process(four_ranks, name):
    _check([r["core"] for r in four_ranks[:3]], name, CASES3[name]["algo"])
    assert four_ranks[3]["core"][name] is None


@pytest.mark.skipif(not INTERPRETED, reason="the gloo ranks run the Triton kernels through the CPU interpreter")
def test_ring_on_the_kernels_with_an_empty_shard(four_ranks):
    for rank, res in enumerate(four_ranks):
        err_out, err_lse = res["core"]["ring4-triton-empty-shard"]
        assert err_out < 4e-3 and err_lse < 1e-5, (rank, err_out, err_lse)


@pytest.mark.parametrize("case, words", [("empty", "empty input|another rank refused"),
                                         ("grad", "inference-only|another rank refused"),
                                         ("seq-lens", "seq_lens must list 4 positive ints"),
                                         ("settings", "same settings"),
                                         ("shape", "same batch/heads"),
                                         ("one-bad-setting", "density must be in|another rank refused"),
                                         ("same-ranks", "may share only this rank"),
                                         ("crossed", "same position in its Ulysses group")])
def test_unified_errors_reach_every_rank(four_ranks, case, words):
    import re

    for rank, res in enumerate(four_ranks):
        msg = res["core"]["unified-errors"][case]
        assert msg.startswith("ValueError") and re.search(words, msg), (rank, msg)


@pytest.mark.parametrize("family, kind", [(f, k) for f, kinds in DIFFUSERS4.items() for k in kinds],
                         ids=lambda x: x)
def test_diffusers_four_ranks_equal_single_process(four_ranks, family, kind):
    from test_parallel_diffusers import check_equal

    check_equal([r["diffusers"] for r in four_ranks], family, kind)


def test_unified_on_a_grid_of_some_ranks(four_ranks):
    for rank in (0, 1):
        assert four_ranks[rank]["core"]["unified-subset"] < 1e-6
