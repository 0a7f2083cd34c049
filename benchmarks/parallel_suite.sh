#!/usr/bin/env bash
# One device call for context parallelism on N GPUs: GPU checks of the ring's per-step pieces and
# parallel_equivalence.py, then bench_parallel.py under torchrun (1-GPU PISA baseline first, then every kind), logs under $OUT.
#   NPROC=2 OUT=/tmp/out bash benchmarks/parallel_suite.sh           # Wan-1.3B 480p
#   NPROC=4 OUT=/tmp/out bash benchmarks/parallel_suite.sh           # Wan-14B 720p
#   BENCH_ARGS="--layers 20 --dense" ...                               # extra bench_parallel.py flags
# The environment (NCCL_NVLS_ENABLE=0 and the other multicast switches included) is passed through
# unchanged to torchrun and every rank. diffusers may travel as a wheel in .whl/ (as for gpu_suite.sh).
set -o pipefail
OUT=${OUT:-out}
NPROC=${NPROC:-2}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log() { tee -a "$OUT/parallel.log"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" 2>&1 | log
env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>&1 | log

timeout "${T_CHECKS:-90}" python3 -m pytest tests/gpu/test_gpu_parallel.py -q -s -p no:cacheprovider 2>&1 | log
# ring and Ulysses against one process on the kernels, at every grid-dependency level (no diffusers)
OUT="$OUT" timeout "${T_EQUIV:-180}" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  benchmarks/parallel_equivalence.py 2>&1 | tail -n 40 | log
timeout "${T_BENCH:-560}" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  benchmarks/bench_parallel.py --out "$OUT" --total-limit "${T_BUDGET:-500}" ${BENCH_ARGS:-} 2>&1 | log
