#!/usr/bin/env bash
# One-shot GPU check of the uniform sparse op, run from the repository root on the GPU machine:
#   bash scripts/gpu_sparse_check.sh
# 1. builds the CPU+CUDA kernels (XMC_SPARSE_BACKEND=compiled: a failed CUDA build is an error here),
# 2. runs the cuda-marked sparse tests, 3. benchmarks the paper's shapes into results/bench/,
# copies everything to $OUT and prints a short summary last. Each step has its own timeout and a
# failing step does not stop the next one; the whole script stays under 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/xmc_gpu_check}"
mkdir -p "$OUT" results/bench
export XMC_SPARSE_CACHE="${XMC_SPARSE_CACHE:-$HOME/.cache/xmc_repro/sparse_ops}"
export PYTHONUNBUFFERED=1
status=()
step() {  # step NAME SECONDS CMD...: run with a timeout, log to $OUT/NAME.log, remember the exit code
  local name=$1 secs=$2; shift 2
  echo "+ [$name] $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  status+=("$name: exit $rc after $((SECONDS - t0)) s")
}

step env 20 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())";
  which nvcc ninja c++; nproc'
step build 110 env XMC_SPARSE_BACKEND=compiled python -c "
import time; t = time.time()
from xmc_repro.sparse import op
print(op.ensure_registered(), f'first load (compile) {time.time() - t:.0f} s')"
step tests 60 python -m pytest -m cuda tests/test_sparse_op.py tests/test_sparse_layers.py -q -p no:cacheprovider
step bench 105 python -m xmc_repro.bench --device cuda --out results/bench --budget-s 60
cp -r results/bench "$OUT/" 2>/dev/null

echo
echo "================ summary ================"
printf '%s\n' "${status[@]}"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
sed -n '/^case /,$p' "$OUT/bench.log"
