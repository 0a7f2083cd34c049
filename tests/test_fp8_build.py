"""The FP8 pair kernel builds for sm_90a on a machine without a GPU (Gluon, Triton's ptxas), as
tests/test_hopper_build.py does for the input-precision kernel; subprocess for the same reason."""

from __future__ import annotations

import pytest
from sm90_build import SMEM_LIMIT, build

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

# (head dim, mode, even Lk, dtype, exact-loop schedule: False sequential (the default), True pipelined)
VARIANTS = {
    "D128-hybrid-bf16": (128, "hybrid", True, "bfloat16", False),
    "D128-drop-ragged-bf16": (128, "drop", False, "bfloat16", False),
    "D64-zeroth-ragged-fp16": (64, "zeroth", False, "float16", False),
    "D128-hybrid-ragged-bf16-pipelined": (128, "hybrid", False, "bfloat16", True),
}


@pytest.fixture(scope="module")
def built():
    return build("from pisa_attn.ops.hopper.fp8 import compile_for_sm90",
                 "compile_for_sm90(args[0], args[1], args[2], getattr(torch, args[3]), pipeline=args[4])", VARIANTS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fp8_kernel_builds_for_sm90a(built, name):
    r = built[name]
    mode = VARIANTS[name][1]
    assert r["sm90a"] and r["cubin"] > 0
    assert r["shared"] <= SMEM_LIMIT
    # Both exact-phase products on FP8 tensor cores (two consumers x (Q·Kᵀ + P·V)); the tail's
    # products in 16 bits; TMA copies; the register hand-over; nothing spilled.
    assert r["fp8_wgmma"] >= 4
    assert r["wgmma"] > r["fp8_wgmma"] or mode == "drop"
    assert r["tma"] >= 4
    assert r["setmaxnreg"] > 0
    assert r["local"] == 0
    assert (r["wait1"] > 0) == VARIANTS[name][4]  # the pipelined loop's wait for the scores alone
