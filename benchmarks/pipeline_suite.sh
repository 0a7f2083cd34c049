#!/usr/bin/env bash
# One device call for the exact loop's schedules (sequential vs pipelined, bf16 and FP8 kernels):
# the GPU tests of the pipelined loop first (a deadlock shows as a timeout there), the schedule
# benchmark at 32K/64K on Gaussian and DiT-like inputs with cuDNN SDPA, then the Hopper and FP8
# GPU tests at the default schedule. Everything lands under $OUT; a summary prints last.
#   OUT=/tmp/out bash benchmarks/pipeline_suite.sh   (SKIP_TESTS=1: no default-schedule tests;
#   PIPE_K: the -k filter of the first tests)
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 PISA_ATTN_AUTOTUNE=0
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout "${T_PIPE:-170}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_fp8.py \
  -k "${PIPE_K:-pipelined}" > "$OUT/tests_pipelined.log" 2>&1
timeout "${T_BENCH:-240}" python3 benchmarks/exact_loop.py --schedules --lengths ${LENGTHS:-32768 65536} \
  --out "$OUT/h100_pipeline.json" > "$OUT/bench.log" 2>&1
if [[ -z "$SKIP_TESTS" ]]; then
  timeout "${T_TESTS:-170}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_fp8.py \
    -k "(hopper or fp8) and not pipelined" > "$OUT/tests_gpu.log" 2>&1
fi
echo "=== summary ==="
grep -E "passed|failed|FAILED|Error|Timeout" "$OUT/tests_pipelined.log" | tail -8
grep -E "passed|failed|FAILED|Error" "$OUT/tests_gpu.log" 2>/dev/null | tail -8
sed -n '/^ *L input *schedule/,$p' "$OUT/bench.log"
tail -3 "$OUT/bench.log"
