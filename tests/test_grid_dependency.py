"""Programmatic dependent launch of the statistics → selection → stream chain: on only where it can
run (a CUDA device of compute capability 9 or more, not under the interpreter), and each kernel of
the chain waits for the grid before it exactly when built for it (``PDL``)."""

from __future__ import annotations

import pytest
import torch

from pisa_attn.ops.triton import grid
from pisa_attn.ops.triton.pairs import _triple_union_kernel
from sm90_build import run_script


def test_levels_only_where_they_can_run(monkeypatch):
    assert grid.grid_dependency(torch.device("cpu")) == 0
    monkeypatch.setattr(grid, "_major", lambda index: 9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert grid.grid_dependency(torch.device("cuda", 0)) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name, lvl in grid.LEVELS.items():
        monkeypatch.setattr(grid, "GRID_DEPENDENCY", name)
        assert grid.grid_dependency(torch.device("cuda", 0)) == lvl == grid.level()
    monkeypatch.setattr(grid, "_major", lambda index: 8)
    assert grid.grid_dependency(torch.device("cuda", 0)) == 0
    monkeypatch.setattr(grid, "GRID_DEPENDENCY", "on")
    with pytest.raises(ValueError, match="GRID_DEPENDENCY"):
        grid.level()


def test_the_wait_is_the_kernels_first_act_only_with_pdl():
    """Level 0 builds no grid control, 1 the wait, 2 the wait and the trigger, the wait before any
    load."""
    # the union stream's kernel (the chain's last) built for sm_90 at each level
    script = """
import json, re
from pisa_attn.ops.triton._common import compile_sm90
from pisa_attn.ops.triton.pairs import _triple_union_kernel as fn
out = {}
for pdl in (0, 1, 2):
    k = compile_sm90(fn, dict(bits_ptr="*i32", uidx_ptr="*i32", ucnt_ptr="*i32"), dict(R=4, NKP=128, PDL=pdl),
                     num_warps=4)
    ptx = k.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    out[str(pdl)] = dict(wait=len(re.findall(r"griddepcontrol\\.wait", ptx)),
                         trigger=len(re.findall(r"griddepcontrol\\.launch_dependents", ptx)),
                         first=body.find("griddepcontrol.wait"), load=body.find("ld.global"))
print(json.dumps(out))
"""
    import json

    assert "PDL" in _triple_union_kernel.arg_names
    r = json.loads(run_script(script).stdout.strip().splitlines()[-1])
    assert (r["0"]["wait"], r["0"]["trigger"]) == (0, 0)
    assert (r["1"]["wait"], r["1"]["trigger"]) == (1, 0)
    assert (r["2"]["wait"], r["2"]["trigger"]) == (1, 1)
    for lvl in ("1", "2"):
        assert 0 <= r[lvl]["first"] < r[lvl]["load"]  # before the kernel reads anything

