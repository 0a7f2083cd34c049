"""The FP8 pair kernel builds for sm_90a on a machine without a GPU (Gluon, Triton's ptxas), as
tests/test_hopper_build.py does for the input-precision kernel; subprocess for the same reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

SMEM_LIMIT = 227 * 1024  # Hopper's shared memory per block
# (head dim, mode, even Lk, dtype, exact-loop schedule: False sequential (the default), True pipelined)
VARIANTS = {
    "D128-hybrid-bf16": (128, "hybrid", True, "bfloat16", False),
    "D128-drop-ragged-bf16": (128, "drop", False, "bfloat16", False),
    "D64-zeroth-ragged-fp16": (64, "zeroth", False, "float16", False),
    "D128-hybrid-ragged-bf16-pipelined": (128, "hybrid", False, "bfloat16", True),
}
SCRIPT = """
import json, re, sys, torch
from pisa_attn.ops.hopper.fp8 import compile_for_sm90
res = {}
for name, (d, mode, even_k, dtype, pipe) in json.loads(sys.argv[1]).items():
    k = compile_for_sm90(d, mode, even_k, getattr(torch, dtype), pipeline=pipe)
    ptx = k.asm["ptx"]
    res[name] = dict(shared=k.metadata.shared, sm90a=".target sm_90a" in ptx,
                     fp8_wgmma=len(re.findall(r"wgmma\\.mma_async[^\\n]*\\.e4m3\\.e4m3", ptx)),
                     wgmma=len(re.findall(r"wgmma\\.mma_async", ptx)),
                     tma=len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)),
                     wait1=len(re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+1;", ptx)),
                     setmaxnreg=len(re.findall(r"setmaxnreg", ptx)),
                     local=len(re.findall(r"\\b(?:ld|st)\\.local\\b", ptx)), cubin=len(k.asm["cubin"]))
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def built():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(VARIANTS)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


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
