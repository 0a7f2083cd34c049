#!/usr/bin/env bash
# One device call that checks and times everything (kernels, then diffusers), logging to $OUT/all.log.
#   OUT=/tmp/out bash benchmarks/gpu_suite.sh      (diffusers travels as a wheel in .whl/)
# Writes: gpu_tests.log, bench_kernels.json/.md/.png (2-16-128 grid), bench_kernels_b.json (other
# B-H-D), bench_diffusers.json, all.log. Each stage has its own time limit so later ones still run.
set -o pipefail
source benchmarks/device_env.sh
log() { tee -a "$OUT/all.log"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>&1 | log

# 1. correctness at real sizes against float64 (fixed kernel config: the NB=2 paired-gather path)
PISA_ATTN_AUTOTUNE=0 timeout "${T_TESTS:-150}" python3 -m pytest tests/gpu/test_gpu_kernels.py -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | log

# 2. kernel latency, B2-H16-D128 grid (FlexAttention compiled at 32K only)
A="2-16-128:4096:0.125,2-16-128:8192:0.125,2-16-128:16384:0.125,2-16-128:32768:0.125,2-16-128:65536:0.125"
A="$A,2-16-128:32768:0.05,2-16-128:32768:0.25,2-16-128:32768:0.5,2-16-128:8192:0.5,2-16-128:4096:0.05"
timeout "${T_BENCH_A:-190}" python3 -m pisa_attn.bench.kernels --cases "${CASES_A:-$A}" --flex-lengths 32768 \
  --out "$OUT/bench_kernels.json" --plot "$OUT/bench_kernels.png" --markdown "$OUT/bench_kernels.md" 2>&1 | log

# 3. the other head configurations
B="1-40-128:32768:0.125,2-24-64:32768:0.125,1-40-128:8192:0.125,2-24-64:8192:0.125"
timeout "${T_BENCH_B:-70}" python3 -m pisa_attn.bench.kernels --cases "${CASES_B:-$B}" --no-flex \
  --out "$OUT/bench_kernels_b.json" 2>&1 | log

# 4. diffusers: one transformer forward, eager, Wan2.1-1.3B-shaped (32760 tokens) and FLUX-shaped
#    (4608 and 16896 tokens); the paper-scale models are benchmarks/run_e2e.sh's
timeout "${T_DIFFUSERS:-150}" python3 benchmarks/bench_e2e.py --stages wan1.3b,flux --total-budget-s 125 \
  --out "$OUT" --name bench_diffusers 2>&1 | log

echo "=== summary ===" | log
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -8
[[ -f "$OUT/bench_kernels.md" ]] && cat "$OUT/bench_kernels.md"
grep -A6 "one transformer forward" "$OUT/all.log" | tail -7
