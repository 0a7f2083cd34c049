"""benchmarks/ncu_opcodes.py on a small ncu source-page CSV: opcodes without modifiers or
predicates, executed instructions and stall samples summed per opcode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ncu_opcodes  # noqa: E402

CSV = '''"Kernel Name","_fp8_pair_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"0x00","      LDC R1, c[0x0][0x28]","3","2","100"
"0x10","      I2FP.F32.S32 R4, R4","7","1","2000"
"0x20","@!P0  BRA 0x7f00","50","50","300"
"0x30","      I2FP.F32.S32 R5, R5","1","0","2000"
"0x40","      FFMA R6, R4, R5, R6","0","0","5000"
"0x50","","","",""
'''


def test_opcode_strips_predicates_and_modifiers():
    assert ncu_opcodes.opcode("@!P0  BRA 0x7f00") == "BRA"
    assert ncu_opcodes.opcode("      LDG.E.64 R4, desc[UR4][R2.64]") == "LDG"
    assert ncu_opcodes.opcode("   ") == ""


def test_histogram_sums_per_opcode(tmp_path):
    (tmp_path / "a.csv").write_text(CSV)
    (tmp_path / "b.csv").write_text(CSV.replace('"5000"', '"1"'))
    out = tmp_path / "o.json"
    assert ncu_opcodes.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    a = res["a"]
    assert a["kernel"] == "_fp8_pair_kernel"
    assert a["total_warp_instructions"] == 9400 and a["stall_samples"] == 61
    assert list(a["by_opcode"]) == ["FFMA", "I2FP", "BRA", "LDC"]  # most executed first
    assert a["by_opcode"]["I2FP"] == {"executed": 4000, "stall_samples": 8}
    assert res["b"]["by_opcode"]["FFMA"]["executed"] == 1


def test_histogram_refuses_a_csv_without_counters(tmp_path):
    (tmp_path / "x.csv").write_text('"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(ValueError, match="Instructions Executed"):
        ncu_opcodes.histogram(str(tmp_path / "x.csv"))
