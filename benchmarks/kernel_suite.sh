#!/usr/bin/env bash
# One device call for the kernels: GPU correctness tests of both kernel backends, the host time of
# an eager call, and the kernel benchmark (Hopper backend on random and DiT-like data with the
# query_block=128 column, Triton for comparison); with CALIB_COST=1 also the cost of calibrate=True per
# dense warm-up step. Everything lands under $OUT; a summary prints last.
#   OUT=/tmp/out bash benchmarks/kernel_suite.sh
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh  # PYTHONPATH (src, and the diffusers wheel from .whl/ if carried)
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [[ -z "$SKIP_TESTS" ]]; then
  PISA_ATTN_AUTOTUNE=0 timeout "${T_TESTS:-150}" python3 -m pytest tests/gpu/test_gpu_kernels.py -q -s -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests.log" 2>&1
fi
timeout "${T_HOST:-60}" python3 tests/gpu/host_profile.py --out "$OUT" > "$OUT/host.log" 2>&1
A=${CASES_A:-"2-16-128:4096:0.125,2-16-128:8192:0.125,2-16-128:16384:0.125,2-16-128:32768:0.125,2-16-128:65536:0.125,2-16-128:32768:0.05,2-16-128:32768:0.25,2-16-128:32768:0.5,2-16-128:16384:0.5,2-16-128:8192:0.5"}
timeout "${T_BENCH_A:-260}" python3 -m pisa_attn.bench.kernels --backend hopper --cases "$A" --graphs --query-block 128 \
  --flex-lengths 32768 --out "$OUT/bench_hopper.json" --markdown "$OUT/bench_hopper.md" > "$OUT/bench_hopper.log" 2>&1
timeout "${T_BENCH_T:-70}" python3 -m pisa_attn.bench.kernels --backend triton --no-flex \
  --cases "${CASES_T:-2-16-128:4096:0.125,2-16-128:32768:0.125}" --out "$OUT/bench_triton.json" > "$OUT/bench_triton.log" 2>&1
timeout "${T_BENCH_D:-120}" python3 -m pisa_attn.bench.kernels --backend hopper --data dit --no-flex --query-block 128 \
  --cases "${CASES_D:-2-16-128:8192:0.125,2-16-128:32768:0.125}" --out "$OUT/bench_hopper_dit.json" > "$OUT/bench_dit.log" 2>&1
if [[ -n "$CALIB_COST" ]]; then  # what apply_pisa(calibrate=True) adds to a dense warm-up step (Wan 1.3B, FLUX.1)
  timeout "${T_CALIB:-240}" python3 benchmarks/calibration_cost.py --out "$OUT" > "$OUT/calibration_cost.log" 2>&1
fi
echo "=== summary ==="
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" 2>/dev/null | tail -5
sed -n '1,5p;/Ordered by/,/^$/p' "$OUT/host.log" | head -34 | cut -c1-150
for f in bench_hopper bench_triton bench_dit; do grep -E "L= *[0-9]+ d=" "$OUT/$f.log" | cut -c1-330; done
if [[ -n "$CALIB_COST" ]]; then tail -8 "$OUT/calibration_cost.log"; fi
# Everything in one archive (a device call returns at most 8 files).
(cd "$OUT" && tar czf kernel_suite.tgz --exclude kernel_suite.tgz . && find . -type f ! -name kernel_suite.tgz -delete)
