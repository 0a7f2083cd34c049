"""The prepare kernels build for sm_90 on a machine without a GPU, specialised as launches on
contiguous tensors are, and their loops over key blocks keep their values in registers and load
through ``cp.async`` stages (the full blocks' loop has no masks and no ragged-block path).

Compiled in a subprocess: the test session runs Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
from sm90_build import build, ci_subset

# (kernel, head dim, dtype, |v| maxima for the low-precision copies, hbar_exclude[, |k| maxima])
VARIANTS = {
    "stats-D128-bf16": ("stats", 128, "bfloat16", False, False),
    "stats-D128-fp16": ("stats", 128, "float16", False, False),
    "stats-D128-bf16-exclude": ("stats", 128, "bfloat16", False, True),
    "stats-D128-bf16-vmax": ("stats", 128, "bfloat16", True, False),
    "stats-D128-fp16-exclude-vmax": ("stats", 128, "float16", True, True),
    "stats-D128-bf16-kmax": ("stats", 128, "bfloat16", False, False, True),
    "stats-D64-bf16-kmax": ("stats", 64, "bfloat16", False, False, True),
    "stats-D64-bf16": ("stats", 64, "bfloat16", False, False),
    "hdev-D128-bf16": ("hdev", 128, "bfloat16", False, False),
    "hdev-D128-fp16": ("hdev", 128, "float16", False, False),
    "hdev-D64-bf16": ("hdev", 64, "bfloat16", False, False),
}
# CI's subset: both kernels, head dims and dtypes, and each option of the statistics once
VARIANTS = ci_subset(VARIANTS, ("stats-D128-fp16-exclude-vmax", "stats-D64-bf16-kmax", "hdev-D128-bf16",
                                "hdev-D64-bf16"))


@pytest.fixture(scope="module")
def built():
    return build("from pisa_attn.ops.triton.prepare import compile_for_sm90",
                 "compile_for_sm90(args[0], args[1], getattr(torch, args[2]), vmax=args[3], exclude=args[4], "
                 "kmax=len(args) > 5 and args[5])",
                 VARIANTS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prepare_kernel_builds_without_spills(built, name):
    r = built[name]
    assert r["sm90a"] and r["cubin"] > 0
    assert r["wgmma"] > 0  # the block sums and H_j are tensor-core products
    assert r["cp_async"] > 0  # the block loop's loads go through pipeline stages
    assert r["spills"] == 0
    assert r["grid_wait"] == 1  # launched as a programmatic dependent: it waits for the kernel before
