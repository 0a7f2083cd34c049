"""The low-precision pair kernel builds for sm_90a on a machine without a GPU (Gluon, Triton's
ptxas) in every precision, as tests/test_hopper_build.py does for the input-precision kernel;
subprocess for the same reason."""

from __future__ import annotations

import pytest
from sm90_build import SMEM_LIMIT, build

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

# (head dim, mode, even Lk, dtype, exact-loop schedule: False sequential (the default), True
# pipelined, precision)
SHAPES = {
    "D128-hybrid-bf16": (128, "hybrid", True, "bfloat16", False),
    "D128-drop-ragged-bf16": (128, "drop", False, "bfloat16", False),
    "D64-zeroth-ragged-fp16": (64, "zeroth", False, "float16", False),
    "D128-hybrid-ragged-bf16-pipelined": (128, "hybrid", False, "bfloat16", True),
}
PRECISIONS = ("fp8", "int8-fp8", "int8")
VARIANTS = {f"{p}-{n}": (*v, p) for p in PRECISIONS for n, v in SHAPES.items()}


@pytest.fixture(scope="module")
def built():
    return build("from pisa_attn.ops.hopper.fp8 import compile_for_sm90",
                 "compile_for_sm90(args[0], args[1], args[2], getattr(torch, args[3]), pipeline=args[4], "
                 "precision=args[5])", VARIANTS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_lowp_kernel_builds_for_sm90a(built, name):
    r = built[name]
    mode, pipelined, precision = VARIANTS[name][1], VARIANTS[name][4], VARIANTS[name][5]
    assert r["sm90a"] and r["cubin"] > 0
    assert r["shared"] <= SMEM_LIMIT
    # The exact phase's products in their formats (two consumers x (Q·Kᵀ + P·V), each issued in
    # several wgmma instructions); the tail's products in 16 bits; TMA copies; the register
    # hand-over; nothing spilled.
    qk = r["s8_wgmma"] if precision.startswith("int8") else r["fp8_wgmma"]
    assert qk >= 2
    if precision == "fp8":
        assert r["s8_wgmma"] == 0 and r["fp8_wgmma"] >= 4
    elif precision == "int8-fp8":
        assert r["fp8_wgmma"] >= 2  # P·V
    else:
        assert r["fp8_wgmma"] == 0 and r["wgmma"] > r["s8_wgmma"]  # P·V in 16 bits
    assert r["wgmma"] > r["fp8_wgmma"] + r["s8_wgmma"] or (mode == "drop" and precision != "int8")
    assert r["tma"] >= 4
    assert r["setmaxnreg"] > 0
    assert r["local"] == 0
    assert (r["wait1"] > 0) == pipelined  # the pipelined loop's wait for the scores alone
