"""The selection kernels build for sm_90 on a machine without a GPU, and their threshold search
keeps its values in registers: a spill there made the covariance-aware selection at 4K 17x slower
(the fused kernel spilled the covariance term's ``[R, NKP]`` tile).

Compiled in a subprocess: the test session runs Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
from sm90_build import build, ci_subset

# (key blocks, covariance-aware, kept blocks): 50 and 64 blocks take the fused kernel (scores and
# top-k in one), 100 to 1024 the top-k kernel after the score GEMM (2 threshold bits per step up
# to 128 padded blocks, 1 beyond; the covariance term is the score GEMM's there, below).
VARIANTS = {f"NK{nk}-{'cov' if cov else 'topk'}{'-keep' if keep else ''}": (nk, cov, keep, None)
            for nk in (50, 64) for cov in (False, True) for keep in (False, True)}
VARIANTS.update({f"NK{nk}-topk{'-keep' if keep else ''}": (nk, False, keep, None)
                 for nk in (100, 256, 1024) for keep in (False, True)})
# the fused kernel with 16 rows a program (a short call's launch, one wave)
VARIANTS.update({f"NK{nk}-{'cov' if cov else 'topk'}-keep-R16": (nk, cov, True, 16)
                 for nk in (50, 64) for cov in (False, True)})
# CI's subset: both kernels, the fused one at both row counts and with and without the covariance
# term, kept blocks and none, the top-k's two and one threshold bits per step
VARIANTS = ci_subset(VARIANTS, ("NK50-topk", "NK64-cov-keep-R16", "NK100-topk-keep", "NK1024-topk"))


@pytest.fixture(scope="module")
def built():
    return build("from pisa_attn.ops.triton.select import compile_for_sm90",
                 "compile_for_sm90(args[0], cov=args[1], keep=args[2], rows=args[3])", VARIANTS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_selection_kernel_builds_without_spills(built, name):
    r = built[name]
    assert r["cubin"] > 0
    assert r["local"] == 0  # no local memory in the PTX
    assert r["spills"] == 0  # nor from ptxas's register allocation (SASS)
    assert r["grid_wait"] == 1  # launched as a programmatic dependent: it waits for the kernel before


@pytest.fixture(scope="module")
def built_scores():
    return build("from pisa_attn.ops.triton.select import compile_scores_for_sm90",
                 "compile_scores_for_sm90(cov=args[0])", {"scores": (False,), "scores-cov": (True,)})


@pytest.mark.parametrize("name", ["scores", "scores-cov"])
def test_score_gemm_builds_without_spills(built_scores, name):
    r = built_scores[name]
    assert r["cubin"] > 0 and r["local"] == 0 and r["spills"] == 0
    assert r["grid_wait"] == 1
