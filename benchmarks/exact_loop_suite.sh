#!/usr/bin/env bash
# One device call for the pair kernel's exact loop: the pairing variants against cuDNN SDPA
# (benchmarks/exact_loop.py: 4K-64K at 12.5 % with the whole call, 32K at 5 %, DiT-like and
# Gaussian inputs, DINOv2 pair overlap if DINO names the file), an ncu profile of the attend
# kernel (adjacent vs matched pairs, 32K), then the GPU kernel and plan/run tests.
#   OUT=/tmp/out DINO=path.safetensors bash benchmarks/exact_loop_suite.sh
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout "${T_BENCH:-240}" python3 benchmarks/exact_loop.py --whole --out "$OUT/exact_loop.json" > "$OUT/bench.log" 2>&1
timeout 60 python3 benchmarks/exact_loop.py --lengths 32768 --density 0.05 --out "$OUT/exact_loop_d5.json" \
  > "$OUT/bench_d5.log" 2>&1
if [[ -n "$DINO" ]]; then
  timeout 60 python3 benchmarks/exact_loop.py --lengths --dino "$DINO" --out "$OUT/exact_loop_dino.json" > "$OUT/dino.log" 2>&1
fi
if [[ -z "$SKIP_NCU" ]] && command -v ncu > /dev/null; then
  timeout "${T_NCU:-120}" ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats -k regex:_pair_attn -c 4 \
    python3 benchmarks/exact_loop.py --ncu > "$OUT/ncu.txt" 2>&1
fi
if [[ -z "$SKIP_TESTS" ]]; then
  timeout "${T_TESTS:-200}" python3 -m pytest tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_plan_run.py -q \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
fi
echo "=== summary ==="
for f in bench bench_d5 dino; do sed -n '/^ *L input/,$p;/^DINOv2/p' "$OUT/$f.log" 2>/dev/null; done
grep -E "ncu launch|Duration|L2 Cache Throughput|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Stall" \
  "$OUT/ncu.txt" 2>/dev/null | head -60
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" 2>/dev/null | tail -8
