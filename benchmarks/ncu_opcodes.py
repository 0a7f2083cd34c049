"""Executed warp instructions and sampled stalls per SASS opcode, from ncu's source page.

    ncu --section SourceCounters --section WarpStateStats -k regex:fp8_pair -c 1 -o rep python3 ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > fp8.csv
    python3 benchmarks/ncu_opcodes.py fp8.csv int8-int8.csv --out opcodes.json

Each CSV is one kernel (ncu's first line names it, the second holds the column names). Opcodes
drop their modifiers (``I2FP.F32.S32`` -> ``I2FP``) and predicates (``@!P0 BRA`` -> ``BRA``), so
two builds of a kernel compare by what kind of work they execute: conversions, FMAs, loads.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections import Counter

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"


def opcode(sass: str) -> str:
    """``@!P0 LDG.E.64 R4, desc[...]`` -> ``LDG``; '' for a line without an instruction."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def histogram(path: str) -> dict:
    """One kernel's totals and every opcode's executed warp instructions and stall samples, most
    executed first."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next((i for i, r in enumerate(rows) if "Source" in r and EXECUTED in r), None)
    if header is None:
        raise ValueError(f"{path}: no '{EXECUTED}' column (ncu --page source --csv --print-source sass)")
    cols = rows[header]
    src, ex = cols.index("Source"), cols.index(EXECUTED)
    st = cols.index(SAMPLES) if SAMPLES in cols else None
    executed, stalls = Counter(), Counter()
    for r in rows[header + 1:]:
        if len(r) <= ex or not r[ex].strip().isdigit():
            continue
        op = opcode(r[src])
        executed[op] += int(r[ex])
        if st is not None and r[st].strip().isdigit():
            stalls[op] += int(r[st])
    kernel = rows[0][1] if rows and len(rows[0]) > 1 and header > 0 else ""
    return dict(kernel=kernel, total_warp_instructions=sum(executed.values()), stall_samples=sum(stalls.values()),
                by_opcode={op: dict(executed=n, stall_samples=stalls[op]) for op, n in executed.most_common()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", help="ncu source-page CSVs, one kernel each (label: the file's stem)")
    ap.add_argument("--out", help="write the histograms as JSON here")
    a = ap.parse_args(argv)
    res = {os.path.splitext(os.path.basename(p))[0]: histogram(p) for p in a.csv}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    # the 15 opcodes with the most executed instructions in any of the kernels
    peak = Counter()
    for h in res.values():
        for op, c in h["by_opcode"].items():
            peak[op] = max(peak[op], c["executed"])
    ops = [op for op, _ in peak.most_common(15)]
    print("opcode      " + "".join(f"{label[:14]:>16s}" for label in res) + "   (executed warp instructions, M)")
    for op in ["total", *ops]:
        vals = [h["total_warp_instructions"] if op == "total" else h["by_opcode"].get(op, {}).get("executed", 0)
                for h in res.values()]
        print(f"{op:10s}  " + "".join(f"{v / 1e6:16.1f}" for v in vals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
