#!/usr/bin/env bash
# One device call for the low precisions (fp8, int8-fp8, int8-int8, int8): build + GPU tests, then the benchmark (JSON under $OUT).
#   OUT=/tmp/out STEPS="tests bench ncu" BENCH_ARGS="--lengths 32768" bash benchmarks/fp8_suite.sh
# The GPU test file holds 157 tests (200 s on an H200 with their compiles):
# with the default benchmark they can pass a device call's 10 minutes, so run STEPS=tests and
# STEPS=bench as two calls.
# Schedule sweep (cuDNN and the bf16 kernel in the same run; SWEEP_ARGS: e.g. "--precisions fp8 --rounds 3"),
# then ncu of the best schedule:
#   STEPS="warm tests sweep ncu" SWEEP_LENGTHS="32768 65536" SWEEP_VARIANTS="default pingpong" bash benchmarks/fp8_suite.sh
# ("warm" compiles the sweep's kernels in the background at a short length while the tests run.)
# Instructions per SASS opcode, one precision per ncu run (benchmarks/ncu_opcodes.py):
#   STEPS=opcodes OPCODE_PRECISIONS="fp8 int8-int8" bash benchmarks/fp8_suite.sh
set -o pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-out}
STEPS=${STEPS:-"tests bench"}
SWEEP_VARIANTS=${SWEEP_VARIANTS:-"default pingpong pipelined pipelined_pingpong"}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
rc=0
if [[ " $STEPS " == *" warm "* ]]; then
  python3 benchmarks/fp8_bench.py --speed-only --lengths --sweep 4096 --variants $SWEEP_VARIANTS ${SWEEP_ARGS:-} \
    --out "$OUT/warm.json" > "$OUT/warm.log" 2>&1 &
  warm_pid=$!
fi
if [[ " $STEPS " == *" tests "* ]]; then
  timeout "${TEST_TIMEOUT:-450}" python3 -m pytest tests/gpu/test_gpu_fp8.py -q -s -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/fp8_tests.log" | grep -E "passed|failed|FAILED|Error" || rc=1
fi
[[ -n "${warm_pid:-}" ]] && { wait "$warm_pid" || echo "warm-up failed (see warm.log)"; }
if [[ " $STEPS " == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/fp8_bench.py ${BENCH_ARGS:-} --out "$OUT/fp8_bench.json" 2>&1 \
    | tee "$OUT/fp8_bench.log" || rc=1
fi
if [[ " $STEPS " == *" sweep "* ]]; then
  timeout "${SWEEP_TIMEOUT:-200}" python3 benchmarks/fp8_bench.py --speed-only --lengths --sweep ${SWEEP_LENGTHS:-32768} \
    --variants $SWEEP_VARIANTS ${SWEEP_ARGS:-} --out "$OUT/fp8_sweep.json" 2>&1 | tee "$OUT/fp8_sweep.log" | grep -v "^sweep L=" || rc=1
  # the schedule with the shortest hybrid attend at the first length, summed over the precisions (ncu runs it)
  NCU_SCHEDULE=${NCU_SCHEDULE:-$(python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['sweep'][0]
v = sys.argv[2].split()
t = {n: sum(r.get(f'{p}_{n}_hybrid_ms', 1e9) for p in ('fp8', 'int8-fp8', 'int8-int8', 'int8')) for n in v}
print(min(t, key=t.get))" "$OUT/fp8_sweep.json" "$SWEEP_VARIANTS" 2>/dev/null || echo default)}
  echo "best schedule (hybrid attend, sum over precisions): $NCU_SCHEDULE"
fi
if [[ " $STEPS " == *" ncu "* ]]; then
  # the attention kernels at one length (bf16 first, then each precision): bound by what, issue, warp stalls
  timeout "${NCU_TIMEOUT:-200}" ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section ComputeWorkloadAnalysis -k regex:"pair_attn|fp8_pair" -c "${NCU_COUNT:-2}" python3 benchmarks/fp8_bench.py \
    --ncu "${NCU_LENGTH:-32768}" --schedule "${NCU_SCHEDULE:-default}" ${NCU_ARGS:-} 2>&1 | tee "$OUT/fp8_ncu.log" \
    | grep -E "pair_attn_kernel \(|fp8_pair_kernel \(|Issue Slots Busy|highest-utilized|Warp Cycles Per Issued|Duration" || rc=1
fi
if [[ " $STEPS " == *" opcodes "* ]]; then
  # executed warp instructions and stall samples per SASS opcode of the low-precision kernel, one
  # ncu run per precision (hybrid, NCU_LENGTH); the CSVs stay on the machine, the JSON comes back
  csvs=$(mktemp -d)
  for p in ${OPCODE_PRECISIONS:-fp8 int8-fp8 int8-int8 int8}; do
    timeout "${NCU_TIMEOUT:-200}" ncu --section SourceCounters --section WarpStateStats -k regex:"fp8_pair" -c 1 \
      -o "$csvs/$p" python3 benchmarks/fp8_bench.py --ncu "${NCU_LENGTH:-32768}" --schedule "${NCU_SCHEDULE:-default}" \
      --precisions "$p" > "$csvs/$p.log" 2>&1 || { rc=1; tail -3 "$csvs/$p.log"; }
    ncu -i "$csvs/$p.ncu-rep" --page source --csv --print-source sass > "$csvs/$p.csv" || rc=1
  done
  python3 benchmarks/ncu_opcodes.py "$csvs"/*.csv --out "$OUT/fp8_opcodes.json" | tee "$OUT/fp8_opcodes.log" || rc=1
fi
echo "=== summary ==="
[[ -f "$OUT/fp8_tests.log" ]] && grep -E "^\[|FAILED|ERROR|passed|failed|Error" "$OUT/fp8_tests.log" | tail -45
exit $rc
