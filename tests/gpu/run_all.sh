#!/usr/bin/env bash
# One device call for the Triton kernels: GPU correctness tests, diagnostics and/or the benchmark.
#   STEPS="tests diag bench" OUT=/tmp/out bash tests/gpu/run_all.sh
#   PYTEST_K="L8229 or selection" (a pytest -k filter), BENCH_ARGS="--cases 2-16-128:32768:0.125"
#   SHARD=1/2, then SHARD=2/2: every second test of the suite (in collection order), for two device
#   calls: on a fresh machine the whole suite with its compiles runs past one call's 10 minutes.
#   XDIST=8: that many pytest-xdist workers on the one GPU (the compiles are CPU-bound and run in
#   parallel; the tests' tensors are small beside the GPU's memory).
# Everything lands under $OUT (logs, JSON, PNG, markdown); a short summary is printed last.
set -o pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-out}
STEPS=${STEPS:-"tests diag"}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader || true
rc=0
if [[ " $STEPS " == *" tests "* ]]; then
  # Fixed kernel config (no autotuning) keeps compile time down; autotuning is exercised by bench.
  files=(tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_plan_run.py tests/gpu/test_gpu_calibration.py
         tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fuzz.py tests/gpu/test_gpu_parallel.py tests/test_stats_select.py)
  filter=(${PYTEST_K:+-k "$PYTEST_K"})
  workers=(${XDIST:+-n "$XDIST"})
  if [[ -n "$SHARD" ]]; then  # "i/n": tests i, i + n, ... of the collection (compile-heavy ones spread out)
    mapfile -t files < <(python3 -m pytest "${files[@]}" "${filter[@]}" --collect-only -q -p no:cacheprovider \
      2>/dev/null | grep "::" | awk -v i="${SHARD%/*}" -v n="${SHARD#*/}" 'NR % n == i % n')
    filter=()
    echo "shard $SHARD: ${#files[@]} tests"
  fi
  PISA_ATTN_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-300}" python3 -m pytest "${files[@]}" "${filter[@]}" "${workers[@]}" -q -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [[ " $STEPS " == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-400}" python3 -m pisa_attn.bench.kernels ${BENCH_ARGS:-} --out "$OUT/bench_kernels.json" \
    --plot "$OUT/bench_speedup.png" --markdown "$OUT/bench_kernels.md" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
if [[ " $STEPS " == *" diag "* ]]; then
  timeout "${DIAG_TIMEOUT:-300}" python3 tests/gpu/diagnose.py --lengths "${DIAG_LENGTHS:-32768}" --out "$OUT/diag.json" 2>&1 \
    | tee "$OUT/diag.log" || rc=1
fi
echo "=== summary ==="
[[ -f "$OUT/gpu_tests.log" ]] && grep -E "^\[|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -40
[[ -f "$OUT/bench.log" ]] && grep -E "^ *[0-9]+-[0-9]+-[0-9]+ L=" "$OUT/bench.log"
[[ -f "$OUT/diag.log" ]] && sed -n '/=== diagnose summary/,$p' "$OUT/diag.log"
exit $rc
