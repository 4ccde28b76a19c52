#!/usr/bin/env bash
# Amazon-670K-shaped training check on a GPU machine, in one call (run from the repository root):
#   bash scripts/gpu_train_check.sh
# 1. builds the sparse op and runs its cuda tests (rewiring must match the CPU exactly),
# 2. scripts/gpu_memory_probe.py: memory per phase of a step and plain-loop step times,
# 3. one epoch of the synthetic stand-in through the pipeline, uniform (32 per label, 32k intermediate
#    layer) first, then dense on the same data: peak memory and seconds per epoch in the run summaries.
# POINTS sets the training points (default: all 490,449 of the stand-in; the model's size does not depend
# on it). The pipeline runs share a deadline of BUDGET_S seconds from the start of the script.
# The GPU image lacks hydra and mlflow: carry .whl/ built by ../shared/gpu/wheels.sh.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/xmc_gpu_train}
mkdir -p "$OUT"
if ! python3 -c "import hydra, mlflow" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
fi
export PYTHONPATH="$HOME/site:$PWD" MLFLOW_TRACKING_URI="sqlite:///$OUT/gpu_runs.db" PYTHONUNBUFFERED=1
export XMC_SPARSE_CACHE="${XMC_SPARSE_CACHE:-$HOME/.cache/xmc_repro/sparse_ops}"
POINTS=${POINTS:-490449}
BUDGET_S=${BUDGET_S:-560}
status=()
step() {  # step NAME SECONDS CMD...: run with a timeout, log to $OUT/NAME.log, remember the exit code
  local name=$1 secs=$2; shift 2
  echo "+ [$name] $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > >(tee "$OUT/$name.log" | grep -v -E "INFO|Tip|pytree|warn") 2>&1
  status+=("$name: exit $? after $((SECONDS - t0)) s")
}
left() { local s=$((BUDGET_S - SECONDS)); echo $((s > 1 ? s : 1)); }

step build 90 env XMC_SPARSE_BACKEND=compiled python3 -c "
import time; t = time.time()
from xmc_repro.sparse import op
print(op.ensure_registered(), f'first load (compile) {time.time() - t:.0f} s')"
step tests 60 python3 -m pytest -m cuda tests/test_sparse_op.py tests/test_sparse_layers.py tests/test_losses.py \
  -q -p no:cacheprovider
step probe 90 python3 scripts/gpu_memory_probe.py
common="dataset=synthetic_amazon670k dataset.num_train=$POINTS dataset.num_test=10000 trainer.max_epochs=1
  trainer.progress_bar=false trainer.train_eval_max_points=10000 table=gpu_check"
step uniform "$(( $(left) < 230 ? $(left) : 230 ))" python3 -m xmc_repro $common model=uniform model.intermediate=32768
step dense "$(left)" python3 -m xmc_repro $common model=dense

echo
echo "================ summary ================"
printf '%s\n' "${status[@]}"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -2
sed -n '/^== /,$p' "$OUT/probe.log"
for run in uniform dense; do echo "-- $run"; grep -v -E "INFO|Tip|pytree|warn" "$OUT/$run.log" | tail -14; done
