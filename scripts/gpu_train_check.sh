#!/usr/bin/env bash
# Amazon-670K-shaped training check on a GPU machine (run from the repository root):
#   the uniform model (32 connections per label, 32k intermediate layer) beside the dense model, one epoch each,
#   on the synthetic stand-in with Amazon-670K's label count and input size; peak memory and seconds per epoch.
# POINTS sets the training points per epoch (the full stand-in has 490,449; the model's size does not depend on it).
# The MLflow store of both runs lands in $OUT/gpu_runs.db.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/xmc_gpu_train}
mkdir -p "$OUT"
if ! python3 -c "import hydra, mlflow" 2>/dev/null; then   # the GPU image lacks them: wheels from ../shared/gpu/wheels.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
fi
export PYTHONPATH="$HOME/site:$PWD" MLFLOW_TRACKING_URI="sqlite:///$OUT/gpu_runs.db" PYTHONUNBUFFERED=1
POINTS=${POINTS:-50000}
common="dataset=synthetic_amazon670k dataset.num_train=$POINTS dataset.num_test=10000 trainer.max_epochs=1
  trainer.progress_bar=false trainer.train_eval_max_points=10000 table=gpu_check"
for model in "model=uniform model.intermediate=32768" "model=dense"; do
  echo "+ python -m xmc_repro $model"
  timeout 110 python3 -m xmc_repro $common $model > >(tee -a "$OUT/train.log" | grep -v -E "INFO|Tip|pytree") 2>&1
done
