#!/usr/bin/env bash
# Everything a lent GPU should measure, in one call (run from the repository root; about 8 minutes):
#   bash scripts/gpu_all.sh
# 1. builds the CPU+CUDA kernels (XMC_SPARSE_BACKEND=compiled: a failed CUDA build is an error here),
# 2. runs every `cuda`-marked test (all of tests/ when hydra and mlflow import, else the files that need neither),
# 3. the layer benchmark at the paper's shapes (python -m xmc_repro.bench),
# 4. the whole-model step, dense beside uniform, full Amazon-670K shapes (python -m xmc_repro.bench --model),
#    with the device-to-host syncs of one step.
# Logs and results go to $OUT (results/bench/ is copied there too); a summary is printed last. Each step has its own
# timeout and a failing step does not stop the next. If hydra/mlflow are missing, carry .whl/ from
# ../shared/gpu/wheels.sh and they are installed to $HOME/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/xmc_gpu_all}"
mkdir -p "$OUT" results/bench
export XMC_SPARSE_CACHE="${XMC_SPARSE_CACHE:-$HOME/.cache/xmc_repro/sparse_ops}"
export PYTHONUNBUFFERED=1
if ! python3 -c "import hydra, mlflow" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD"
fi
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
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())";
  which nvcc ninja c++; nproc'
step build 120 env XMC_SPARSE_BACKEND=compiled python3 -c "
import time; t = time.time()
from xmc_repro.sparse import build, op
print(op.ensure_registered(), 'archs', build.cuda_archs(), f'first load (compile) {time.time() - t:.0f} s')"
if python3 -c "import hydra, mlflow" 2>/dev/null; then tests=(tests); else
  tests=(tests/test_sparse_op.py tests/test_sparse_layers.py tests/test_losses.py tests/test_metrics.py tests/test_mach.py)
fi
step tests 100 python3 -m pytest -m cuda "${tests[@]}" -q -p no:cacheprovider
step bench 130 python3 -m xmc_repro.bench --device cuda --out results/bench --budget-s 90
step model 110 python3 -m xmc_repro.bench --model --device cuda --out results/bench
cp -r results/bench "$OUT/" 2>/dev/null

echo
echo "================ summary ================"
printf '%s\n' "${status[@]}"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
sed -n '/^case /,$p' "$OUT/bench.log"
sed -n '/^| model /,$p' "$OUT/model.log"
