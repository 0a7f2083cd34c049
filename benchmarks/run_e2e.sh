#!/usr/bin/env bash
# The paper-scale end-to-end benchmark in one device call (see benchmarks/bench_e2e.py).
#   bash benchmarks/run_e2e.sh eager|compiled|all [more bench_e2e.py arguments]
# Carry .whl/ (the diffusers wheel). Writes $OUT/e2e_<part>.json (after every step) and
# $OUT/e2e_<part>.log; the table is the log's last lines.
set -o pipefail
PART=${1:-eager}
shift || true
source benchmarks/device_env.sh
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/e2e_$PART.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv,noheader 2>&1 | tee -a "$OUT/e2e_$PART.log"
python3 benchmarks/bench_e2e.py --part "$PART" --out "$OUT" --name "e2e_$PART" "$@" 2>&1 | tee -a "$OUT/e2e_$PART.log"
