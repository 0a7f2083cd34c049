"""The Hopper pair kernel builds for sm_90a on a machine without a GPU (Gluon, Triton's ptxas).

Compiled in a subprocess: the test session runs Triton's interpreter (TRITON_INTERPRET=1), under
which ``triton.language`` functions cannot be compiled.
"""

from __future__ import annotations

import pytest
from sm90_build import FULL, SMEM_LIMIT, build, ci_subset, run_script

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

# (head dim, mode, even Lk, dtype, pairing table, exact-loop schedule: False sequential (the
# default), True pipelined; stream codes in shared memory, union entries per pair: 2048 codes in 8
# TMA chunks; 4100 past the limit and 8 (under one 32-code chunk) are read from global memory;
# query blocks per CTA; the tail's maximum: "auto" compiles both the fixed and the online scan; the
# exact loop's maximum: "auto" (bfloat16: both loops, fixed from the keys' maxima or online) or
# "online")
VARIANTS = {
    "D128-hybrid-bf16": (128, "hybrid", True, "bfloat16", True, False, True, 128, 2),
    "D128-hybrid-bf16-online-tail": (128, "hybrid", True, "bfloat16", True, False, True, 128, 2, "online"),
    "D128-drop-ragged-bf16-adjacent": (128, "drop", False, "bfloat16", False, False, True, 2048, 2),
    "D64-zeroth-ragged-fp16": (64, "zeroth", False, "float16", True, False, True, 36, 2),
    "D128-hybrid-bf16-pipelined": (128, "hybrid", True, "bfloat16", True, True, True, 256, 2),
    "D64-drop-ragged-fp16-pipelined": (64, "drop", False, "float16", True, True, True, 8, 2),
    "D128-hybrid-bf16-global-codes": (128, "hybrid", True, "bfloat16", True, False, False, 128, 2),
    "D128-drop-bf16-long-stream-pipelined": (128, "drop", True, "bfloat16", True, True, True, 4100, 2),
    "D128-drop-bf16-three": (128, "drop", True, "bfloat16", False, False, True, 192, 3),
    "D128-hybrid-bf16-three": (128, "hybrid", True, "bfloat16", False, False, True, 192, 3),
    "D64-zeroth-ragged-fp16-three": (64, "zeroth", False, "float16", False, False, True, 36, 3),
    "D128-zeroth-bf16-three": (128, "zeroth", True, "bfloat16", False, False, True, 192, 3),
    "D64-hybrid-fp16-three": (64, "hybrid", True, "float16", False, False, True, 192, 3),
    "D128-hybrid-bf16-three-online-tail": (128, "hybrid", True, "bfloat16", False, False, True, 192, 3, "online"),
    "D128-drop-ragged-bf16-three": (128, "drop", False, "bfloat16", False, False, True, 192, 3),
    "D128-hybrid-ragged-bf16-three": (128, "hybrid", False, "bfloat16", False, False, True, 192, 3),
    "D128-hybrid-ragged-bf16-three-online-tail": (128, "hybrid", False, "bfloat16", False, False, True, 192, 3,
                                                  "online"),
    "D128-drop-bf16-three-online-exact": (128, "drop", True, "bfloat16", False, False, True, 192, 3, "auto", "online"),
    "D128-hybrid-bf16-three-online-exact": (128, "hybrid", True, "bfloat16", False, False, True, 192, 3, "auto",
                                            "online"),
    "D128-hybrid-bf16-online-exact": (128, "hybrid", True, "bfloat16", True, False, True, 128, 2, "auto", "online"),
}
# CI's subset: every mode, head dim, dtype, even and ragged, both loops, pairs and three consumers
# (with the first-order term beside the exact ring), adjacent pairs, staged and global codes, and
# each maximum's online scan, once (options combined in few variants: a three-consumer hybrid
# kernel takes ptxas 15-26 s a build on two cores, a ragged one the most)
VARIANTS = ci_subset(VARIANTS, ("D128-hybrid-bf16", "D128-drop-ragged-bf16-adjacent", "D64-drop-ragged-fp16-pipelined",
                                "D64-zeroth-ragged-fp16-three", "D128-hybrid-bf16-three-online-tail",
                                "D128-drop-bf16-three-online-exact"))


@pytest.fixture(scope="module")
def built():
    return build("from pisa_attn.ops.hopper.attention import compile_for_sm90",
                 "compile_for_sm90(args[0], args[1], args[2], getattr(torch, args[3]), has_qpair=args[4], "
                 "pipeline=args[5], codes=args[6], union_entries=args[7], query_group=args[8], "
                 "tail_max=args[9] if len(args) > 9 else 'auto', exact_max=args[10] if len(args) > 10 else None)",
                 VARIANTS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_pair_kernel_builds_for_sm90a(built, name):
    r = built[name]
    mode = VARIANTS[name][1]
    assert r["sm90a"] and r["cubin"] > 0
    assert r["shared"] <= SMEM_LIMIT
    # Tensor-core products, TMA copies and the register hand-over between partitions are there;
    # nothing spilled to local memory (two consumers: nowhere; three, at 160 registers each: with
    # the device's toolchain (Triton 3.6's ptxas) in no loop, a ragged Lk included; with CUDA 13's
    # ptxas (Triton 3.9's), whose consumers read the query tile from shared memory, nowhere in
    # keep-or-drop; the code around the tail's loop may keep a few values on the stack) and no hot
    # loop serialised by a spilled operand.
    assert r["wgmma"] >= (16 if mode == "drop" else 32)
    assert r["tma"] >= 3 + VARIANTS[name][8]  # q (one per query block), k, v in, o out
    assert r["setmaxnreg"] > 0
    assert r["local"] == 0  # in the PTX
    assert r["grid_wait"] == 1  # launched as a programmatic dependent: it waits for the kernel before
    assert r["grid_wait_first"]  # before its barriers are set up and before any load
    device_ptxas = r["triton"].split(".")[:2] == ["3", "6"]
    even_or_d64 = VARIANTS[name][2] or VARIANTS[name][0] == 64
    # The exact loop under the bound of its scores (bfloat16, sequential loop, unless "online"):
    # newer ptxas (Triton 3.9's) keeps a few of its values on the stack, outside the loops for
    # pairs and 2 in the three-consumer keep-or-drop loop; the device's none in any loop.
    bound = VARIANTS[name][3] == "bfloat16" and not VARIANTS[name][5] and VARIANTS[name][10:11] != ("online",)
    if VARIANTS[name][8] == 2:
        if device_ptxas or not bound:
            assert r["spills"] == 0  # in ptxas's SASS
        assert r["loop_spills"] == 0
    elif device_ptxas:
        assert r["loop_spills"] == 0
    elif mode == "drop":
        assert r["spills"] == 0
    if device_ptxas or even_or_d64:
        assert r["loop_serialized"] == 0
    # The pipelined loop waits for the scores alone while the previous block's P·V runs.
    assert (r["wait1"] > 0) == VARIANTS[name][5]
    # Staged stream codes: one 2D TMA per chunk of up to 256 codes (besides the tiles' 3D/4D ones)
    # and no global load of a code in any loop; past 8 chunks the codes stay in global memory.
    codes, entries = VARIANTS[name][6], VARIANTS[name][7]
    staged = codes and 32 <= entries <= 2048
    assert r["tma2d"] == (-(-entries // min(256, 1 << (entries.bit_length() - 1))) if staged else 0)


@pytest.mark.skipif(not FULL, reason="compares two builds of one kernel; make build-device builds both")
def test_staged_stream_codes_leave_no_global_code_load(built):
    """The loader and both consumers read the stream from shared memory: each of the three
    partitions drops (at least) its two global loads of a code (the first entry and the one-ahead
    read)."""
    staged = built["D128-hybrid-bf16"]["ld_global"]
    assert staged <= built["D128-hybrid-bf16-global-codes"]["ld_global"] - 6


PAIRS_SCRIPT = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pisa_attn.ops.triton import pairs as P
i32 = dict.fromkeys(("NQ", "NQ2", "NK", "NW", "W2", "N_PAIRS"), "i32")
ptrs = dict.fromkeys(("bits_ptr", "qpair_ptr", "uidx_ptr", "ucnt_ptr"), "*i32")
def build(fn, constexprs, warps):
    sig = {n: ("constexpr" if n in constexprs else ptrs.get(n) or i32[n]) for n in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
full = sys.argv[1] == "1"
for g in (4, 8) if full else (8,):
    build(P._pair_match_kernel, dict(G=g, NWP=32, NM=P.n_matchings(g), NMP=triton.next_power_of_2(P.n_matchings(g))), 4)
for i, order in enumerate(P.ORDERS.values()):
    for has_qpair in (True, False) if full else (True,) if i == 0 else ():
        build(P._pair_union_kernel, dict(R=2, NKP=512, HAS_QPAIR=has_qpair, ORDER=order), 1)
print("built")
"""


def test_pair_stream_kernels_build_for_sm90():
    """The pairing and union kernels compile (the interpreter accepts code the compiler refuses)."""
    # CI: each kernel once, with the pairing table and one group size (every order, table and size
    # under FULL; the orders differ in one constexpr branch each, ~3 s of ptxas apiece)
    assert "built" in run_script(PAIRS_SCRIPT, "1" if FULL else "0").stdout


def test_tail_options_are_checked():
    """A tail option the kernel does not know, or per-channel bounds of other shapes, are refused
    before anything runs."""
    import torch

    from pisa_attn.ops.hopper import attention as gattn

    x = torch.zeros(1, 2, 128, 64)
    kbar = torch.zeros(1, 2, 2, 64, dtype=torch.float16)
    kw = dict(mode="hybrid", scale=0.125, block_size=64, n_select=1)
    none = (None,) * 7  # kscale, vbar, hbar, hscale, idx, cnt, bits
    with pytest.raises(ValueError, match="tail_max"):
        gattn.attention(x, x, x, kbar, *none, tail_max="fast", **kw)
    with pytest.raises(ValueError, match="kbound"):
        gattn.attention(x, x, x, kbar, *none, kbound=torch.zeros(1, 2, 32), **kw)


def test_query_tile_and_options_follow_the_ptxas(monkeypatch):
    """Three consumers read the query tile from shared memory where CUDA 13's ptxas builds them,
    and keep-or-drop takes its extra options there; pairs keep the tile in registers and take no
    option; ``Q_REG`` overrides the tile's place."""
    from pisa_attn.ops.hopper import attention as gattn

    assert gattn._ptxas_major((None, None)) >= 12
    for major, three in ((12, True), (13, False)):
        monkeypatch.setattr(gattn, "_ptxas_major", lambda env, major=major: major)
        assert gattn.query_tile_in_registers(3) is three
        assert gattn.query_tile_in_registers(2) is True
        for mode in ("drop", "zeroth", "hybrid"):
            assert gattn.ptxas_options(mode, 2) is None
            expect = gattn.PTXAS13_OPTIONS.get(mode) if major >= 13 else None
            assert gattn.ptxas_options(mode, 3) == expect
    assert gattn.PTXAS13_OPTIONS == {"drop": "--register-usage-level=0"}
    for forced in (True, False):
        monkeypatch.setattr(gattn, "Q_REG", forced)
        assert gattn.query_tile_in_registers(2) is forced and gattn.query_tile_in_registers(3) is forced
