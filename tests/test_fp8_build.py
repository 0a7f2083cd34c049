"""The low-precision pair kernel builds for sm_90a on a machine without a GPU (Gluon, Triton's
ptxas) in every precision, as tests/test_hopper_build.py does for the input-precision kernel;
subprocess for the same reason."""

from __future__ import annotations

import pytest
from sm90_build import DEVICE_TOOLCHAIN, FULL, SMEM_LIMIT, build, ci_subset

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

# (head dim, mode, even Lk, dtype, exact-loop schedule: False sequential (the default), True
# pipelined, precision, query blocks per CTA: None the precision's default for the mode)
SHAPES = {
    "D128-hybrid-bf16": (128, "hybrid", True, "bfloat16", False),
    "D128-drop-ragged-bf16": (128, "drop", False, "bfloat16", False),
    "D64-zeroth-ragged-fp16": (64, "zeroth", False, "float16", False),
    "D128-hybrid-ragged-bf16-pipelined": (128, "hybrid", False, "bfloat16", True),
    "D128-drop-ragged-bf16-pipelined": (128, "drop", False, "bfloat16", True),
    "D128-hybrid-ragged-bf16": (128, "hybrid", False, "bfloat16", False),
    "D128-drop-bf16": (128, "drop", True, "bfloat16", False),
    "D64-hybrid-fp16": (64, "hybrid", True, "float16", False),
}
PRECISIONS = ("fp8", "int8-fp8", "int8-int8", "int8")
# INT8 P·V runs in the sequential loop only
VARIANTS = {f"{p}-{n}": (*v, p, "online") for p in PRECISIONS for n, v in SHAPES.items()
            if not (p == "int8-int8" and v[4])}
# P·V in the input dtype: the exact loop under the bound of its scores, where registers are
# tightest (three consumers at 160; pairs with a tail, at 240, built without spills too)
VARIANTS["int8-D128-drop-bf16-bound"] = (*SHAPES["D128-drop-bf16"], "int8", "bound")
VARIANTS["int8-D128-drop-ragged-bf16-bound"] = (*SHAPES["D128-drop-ragged-bf16"], "int8", "bound")
# P·V in the input dtype, three consumers with the tail over the exact ring (an option: 16-bit
# value slots under the tail's value tiles)
ALIAS = {"int8-D128-hybrid-bf16-three-alias": (*SHAPES["D128-hybrid-bf16"], "int8", "bound")}
VARIANTS.update(ALIAS)
# CI's subset: each precision in another shape, so that every mode, both head dims and dtypes, even
# and ragged, both loops and the bound build once (int8's online loop is int8-fp8's with 16-bit P·V;
# a three-consumer hybrid kernel takes ptxas 11 s on two cores at D 64, 25 s at D 128; keep-or-drop
# 5-10 s).
VARIANTS = ci_subset(VARIANTS, ("fp8-D64-hybrid-fp16", "int8-fp8-D128-drop-ragged-bf16-pipelined",
                                "int8-int8-D64-zeroth-ragged-fp16", "int8-D128-drop-ragged-bf16-bound"))


def _query_group(name: str) -> int:
    from pisa_attn.ops.hopper.fp8 import query_group_for

    if name in ALIAS:
        return 3
    d, mode, even_k = VARIANTS[name][:3]
    return query_group_for(mode, 64 if even_k else 65, 64, VARIANTS[name][5])


@pytest.fixture(scope="module")
def built():
    variants = {n: (*v, _query_group(n), True if n in ALIAS else None) for n, v in VARIANTS.items()}
    return build("from pisa_attn.ops.hopper.fp8 import compile_for_sm90",
                 "compile_for_sm90(args[0], args[1], args[2], getattr(torch, args[3]), pipeline=args[4], "
                 "precision=args[5], exact_max=args[6], query_group=args[7], tail_alias=args[8])", variants)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_lowp_kernel_builds_for_sm90a(built, name):
    r = built[name]
    mode, pipelined, precision = VARIANTS[name][1], VARIANTS[name][4], VARIANTS[name][5]
    assert r["sm90a"] and r["cubin"] > 0
    assert r["shared"] <= SMEM_LIMIT
    # The exact phase's products in their formats (per consumer Q·Kᵀ + P·V, each issued in
    # several wgmma instructions); the tail's products in 16 bits; TMA copies; the register
    # hand-over; nothing spilled.
    qk = r["s8_wgmma"] if precision.startswith("int8") else r["fp8_wgmma"]
    assert qk >= 2
    if precision == "fp8":
        assert r["s8_wgmma"] == 0 and r["fp8_wgmma"] >= 4
    elif precision == "int8-fp8":
        assert r["fp8_wgmma"] >= 2  # P·V
    elif precision == "int8-int8":
        assert r["fp8_wgmma"] == 0 and r["s8_wgmma"] >= 4  # Q·Kᵀ and P·V
    else:
        assert r["fp8_wgmma"] == 0 and r["wgmma"] > r["s8_wgmma"]  # P·V in 16 bits
    assert r["wgmma"] > r["fp8_wgmma"] + r["s8_wgmma"] or (mode == "drop" and precision != "int8")  # 16-bit ones
    assert r["tma"] >= 4
    assert r["setmaxnreg"] > 0
    assert r["local"] == 0
    assert r["grid_wait"] == 1  # launched as a programmatic dependent: it waits for the kernel before
    assert r["grid_wait_first"]  # before its barriers are set up and before any load
    # ptxas's SASS: the sequential loop spills nothing and waits for its products in groups (a
    # ragged build keeps one 64-bit value in local memory from the prologue to the epilogue; three
    # consumers with a tail spill a few values outside the hot loops, as the input-precision
    # kernel); the pipelined loop's two accumulators and held P do spill (one reason it measures
    # slower and is not the default).
    # Register allocation differs between ptxas releases: the counts hold for the GPU machines'
    # (Triton 3.6, ``make build-device``); another must still not serialise a hot loop (Triton
    # 3.9's spills a few values of the 160-register loops, which 3.6's does not).
    if not pipelined:
        assert r["loop_serialized"] == 0
        if DEVICE_TOOLCHAIN:
            assert r["loop_spills"] == 0
            from pisa_attn.ops.hopper.fp8 import slot_meta_for

            nc, even_k = _query_group(name), VARIANTS[name][2]
            allowed = 0 if even_k and (nc == 2 or mode == "drop") else 2 if nc == 2 else 16
            # the codes through the slots with three consumers: one prologue value kept in local
            # memory and read back once per partition (5 accesses, none in a loop)
            if slot_meta_for(precision, nc, mode, even_k, pipelined) and nc == 3:
                allowed += 5
            # three consumers with a tail and e4m3 P·V: about 70 values a consumer go through local
            # memory between the exact loop and the tail (the accumulator's change of layout, the
            # tail's set-up at 160 registers), once per tile, none in a loop
            if nc == 3 and mode != "drop" and (precision in ("fp8", "int8-fp8") or name in ALIAS):
                allowed = 240
            assert r["spills"] <= allowed
    assert (r["wait1"] > 0) == pipelined  # the pipelined loop's wait for the scores alone


_PINGPONG_SCRIPT = """
import json, re, sys, torch
from pisa_attn.ops.hopper.fp8 import compile_for_sm90
res = {}
for name, (prec, mode, pipe) in json.loads(sys.argv[1]).items():
    for pp in (False, True):
        k = compile_for_sm90(128, mode, True, torch.bfloat16, pipeline=pipe, precision=prec, pingpong=pp)
        ptx = k.asm["ptx"]
        res[f"{name}-{pp}"] = dict(shared=k.metadata.shared, cubin=len(k.asm["cubin"]),
                                   arrive=len(re.findall(r"mbarrier\\.arrive\\.shared", ptx)),
                                   wait=len(re.findall(r"mbarrier\\.try_wait", ptx)),
                                   wgmma=len(re.findall(r"wgmma\\.mma_async", ptx)),
                                   local=len(re.findall(r"\\b(?:ld|st)\\.local\\b", ptx)))
print(json.dumps(res))
"""
PINGPONG = {"fp8-hybrid-sequential": ("fp8", "hybrid", False), "int8-drop-pipelined": ("int8", "drop", True)}


# The consumers' turns are a module switch kept to reproduce a measurement (off: slower everywhere),
# not an option of any call: built with every variant (`make build-device`), not in CPU CI's subset,
# whose time goes to what calls can reach.
@pytest.mark.skipif(not FULL, reason="a measurement's switch, built by make build-device (PISA_ATTN_FULL_BUILD=1)")
def test_lowp_pingpong_builds_for_sm90a():
    """The consumers' turns (PINGPONG) build for sm_90a under both exact loops: per consumer one
    more mbarrier wait (its turn) and more arrivals (the hand-overs, one per branch of an entry),
    the same products, nothing spilled, the same shared memory but for the two turn barriers."""
    import json

    from sm90_build import run_script

    res = json.loads(run_script(_PINGPONG_SCRIPT, json.dumps(PINGPONG)).stdout.strip().splitlines()[-1])
    for name in PINGPONG:
        off, on = res[f"{name}-False"], res[f"{name}-True"]
        assert on["cubin"] > 0 and on["local"] == 0
        assert on["wgmma"] == off["wgmma"]
        assert on["wait"] == off["wait"] + 2  # one turn wait per consumer
        assert on["arrive"] >= off["arrive"] + 4  # at least two hand-overs per consumer
        assert off["shared"] <= on["shared"] <= min(off["shared"] + 16, SMEM_LIMIT)


def test_int8_pv_pipelined_is_refused():
    """INT8 P·V sums each block in int32 from zero: no pipelined build (refused before compiling)."""
    from pisa_attn.ops.hopper.fp8 import compile_for_sm90

    with pytest.raises(ValueError, match="pipeline"):
        compile_for_sm90(128, "hybrid", precision="int8-int8", pipeline=True)
