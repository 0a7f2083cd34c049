"""The prepare kernels build for sm_90 on a machine without a GPU, and their loops over key blocks
keep their values in registers (the full blocks' loop has no masks and no ragged-block path).

Compiled in a subprocess: the test session runs Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
from sm90_build import build

# (kernel, head dim, dtype, |v| maxima for the low-precision copies, hbar_exclude[, |k| maxima])
VARIANTS = {
    "stats-D128-bf16": ("stats", 128, "bfloat16", False, False),
    "stats-D128-fp16": ("stats", 128, "float16", False, False),
    "stats-D128-bf16-exclude": ("stats", 128, "bfloat16", False, True),
    "stats-D128-bf16-vmax": ("stats", 128, "bfloat16", True, False),
    "stats-D128-bf16-kmax": ("stats", 128, "bfloat16", False, False, True),
    "stats-D64-bf16-kmax": ("stats", 64, "bfloat16", False, False, True),
    "stats-D64-bf16": ("stats", 64, "bfloat16", False, False),
    "hdev-D128-bf16": ("hdev", 128, "bfloat16", False, False),
    "hdev-D128-fp16": ("hdev", 128, "float16", False, False),
    "hdev-D64-bf16": ("hdev", 64, "bfloat16", False, False),
}


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
    maxima = VARIANTS[name][3] or (len(VARIANTS[name]) > 5 and VARIANTS[name][5])
    if not maxima or VARIANTS[name][1] == 64:
        assert r["spills"] == 0
    # With the |v| maxima (the low-precision copies' scales) or the |k| maxima (the Hopper kernel's
    # exact-score bound) an 8-warp program holds a [BS, D] tile more: at D = 128 ptxas spills a few
    # values, inside the loop too; only the build is checked.
