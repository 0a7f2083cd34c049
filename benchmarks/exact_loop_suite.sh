#!/usr/bin/env bash
# One device call for the pair kernel's exact loop: its loop variants against cuDNN SDPA
# (benchmarks/exact_loop.py --loop-variants --whole: LENGTHS at 12.5 %, DiT-like and Gaussian
# inputs; D5=1 adds 32K at 5 %), an ncu profile of the attend kernel (sequential vs pipelined
# loop, 32K, drop), then GPU tests: TESTS_FIRST (a pytest -k expression) before the benchmark,
# the kernel and plan/run test files after it (SKIP_TESTS=1: none).
#   OUT=/tmp/out LENGTHS="32768 65536" TESTS_FIRST="protocols or pipelined" bash benchmarks/exact_loop_suite.sh
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [[ -n "$TESTS_FIRST" ]]; then
  timeout "${T_FIRST:-150}" python3 -m pytest tests/gpu/test_gpu_kernels.py -q -p no:cacheprovider -k "$TESTS_FIRST" \
    > "$OUT/gpu_tests_first.log" 2>&1
  tail -3 "$OUT/gpu_tests_first.log"
fi
timeout "${T_BENCH:-240}" python3 benchmarks/exact_loop.py --loop-variants --whole --lengths ${LENGTHS:-4096 8192 32768 65536} \
  --out "$OUT/exact_loop.json" > "$OUT/bench.log" 2>&1
if [[ -n "$D5" ]]; then
  timeout 90 python3 benchmarks/exact_loop.py --loop-variants --lengths 32768 --density 0.05 \
    --out "$OUT/exact_loop_d5.json" >> "$OUT/bench.log" 2>&1
fi
if [[ -z "$SKIP_NCU" ]] && command -v ncu > /dev/null; then
  NCU=(ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
       --section SchedulerStats -k regex:_pair_attn -c 4)
  timeout "${T_NCU:-150}" "${NCU[@]}" --metrics sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active \
    python3 benchmarks/exact_loop.py --ncu > "$OUT/ncu.txt" 2>&1
  if grep -q "Failed to find metric\|==ERROR==" "$OUT/ncu.txt"; then  # without the tensor-pipe metric
    timeout "${T_NCU:-150}" "${NCU[@]}" python3 benchmarks/exact_loop.py --ncu > "$OUT/ncu.txt" 2>&1
  fi
fi
if [[ -z "$SKIP_TESTS" ]]; then
  timeout "${T_TESTS:-240}" python3 -m pytest tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_plan_run.py -q \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
fi
echo "=== summary ==="
sed -n '/^ *L input/,$p' "$OUT/bench.log" 2>/dev/null
grep -E "ncu launch|Duration|L2 Cache Throughput|DRAM Throughput|Compute \(SM\) Throughput|pipe_tensor|Issue Slots Busy|No Eligible|Stall" \
  "$OUT/ncu.txt" 2>/dev/null | head -60
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_first.log" "$OUT/gpu_tests.log" 2>/dev/null | tail -12
