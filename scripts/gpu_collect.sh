#!/usr/bin/env bash
# Files what one `scripts/gpu_all.sh` call brought back (run from the repository root):
#   bash scripts/gpu_collect.sh FILES_AT LOGS_NAME
# FILES_AT: the folder holding gpu_all.tgz; LOGS_NAME: the folder under results/bench/ for this call's logs
# (e.g. nvidia-h100-rows). It
# 1. unpacks the logs into results/bench/LOGS_NAME/ (the epochs' step profiles, step times, memory reports and
#    steps.log, each step's exit status and seconds, included),
# 2. copies the benchmark results the call changed (<card>.*, <card>-model*, rows-kernels/) into results/bench/,
#    replacing the earlier files of that card (the call's copy of results/bench holds the checkout's files besides
#    its own: those equal to HEAD's are left out, so the calls of one session can be collected one after another),
# 3. copies the call's finished table runs into results/records/ (its MLflow store gpu_runs.db), and
# 4. rerenders the results (dvc repro).
# It prints what changed; the README's numbers are yours to update.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bash scripts/gpu_collect.sh FILES_AT LOGS_NAME" >&2; exit 2; }
files_at=$1 name=$2
[ -f "$files_at/gpu_all.tgz" ] || { echo "$files_at/gpu_all.tgz not found: pass the folder the run tool named files_at" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf "$files_at/gpu_all.tgz" -C "$tmp"
logs=$tmp/xmc_gpu_logs
dest=results/bench/$name
mkdir -p "$dest"
find "$logs" -maxdepth 1 -type f \( -name '*.log' -o -name 'profile-*' -o -name 'memory-peak-*' -o -name 'step-times.md' \) -exec cp {} "$dest/" \;
# results/bench came along from the checkout: only what the call changed is copied (a later call's copy of the
# committed files would otherwise undo an earlier call's results)
if [ -d "$logs/bench" ]; then
  (cd "$logs/bench" && find . -type f ! -name README.md -printf '%P\n') | while read -r f; do  # README: by hand
    git show "HEAD:results/bench/$f" 2>/dev/null | cmp -s - "$logs/bench/$f" && continue
    mkdir -p "$(dirname "results/bench/$f")" && cp "$logs/bench/$f" "results/bench/$f"
  done
fi
if [ -f "$logs/gpu_runs.db" ]; then
  python3 -m xmc_repro.report records add "sqlite:///$logs/gpu_runs.db"
fi
dvc repro
git status --short results/
