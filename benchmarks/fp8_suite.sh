#!/usr/bin/env bash
# One device call for the low precisions (fp8, int8-fp8, int8): build + GPU tests, then the benchmark (JSON under $OUT).
#   OUT=/tmp/out STEPS="tests bench ncu" BENCH_ARGS="--lengths 32768" bash benchmarks/fp8_suite.sh
set -o pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-out}
STEPS=${STEPS:-"tests bench"}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
rc=0
if [[ " $STEPS " == *" tests "* ]]; then
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest tests/gpu/test_gpu_fp8.py -q -s -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/fp8_tests.log" || rc=1
fi
if [[ " $STEPS " == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/fp8_bench.py ${BENCH_ARGS:-} --out "$OUT/fp8_bench.json" 2>&1 \
    | tee "$OUT/fp8_bench.log" || rc=1
fi
if [[ " $STEPS " == *" ncu "* ]]; then
  # the two attention kernels at one length: bound by what (SOL), memory, warp stalls
  timeout "${NCU_TIMEOUT:-200}" ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section ComputeWorkloadAnalysis -k regex:"pair_attn|fp8_pair" -c "${NCU_COUNT:-2}" python3 benchmarks/fp8_bench.py --ncu "${NCU_LENGTH:-32768}" ${NCU_ARGS:-} \
    2>&1 | tee "$OUT/fp8_ncu.log" || rc=1
fi
echo "=== summary ==="
[[ -f "$OUT/fp8_tests.log" ]] && grep -E "^\[|FAILED|ERROR|passed|failed|Error" "$OUT/fp8_tests.log" | tail -45
exit $rc
