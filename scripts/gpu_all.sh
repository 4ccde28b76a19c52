#!/usr/bin/env bash
# Everything a lent GPU should measure, in one call (run from the repository root; at most BUDGET_S seconds, then
# the packing):
#   bash scripts/gpu_all.sh
# 1. builds the CPU+CUDA kernels (XMC_SPARSE_BACKEND=compiled: a failed CUDA build is an error here),
# 2. runs every `cuda`-marked test,
# 3. the layer benchmark at the headline shape (670,091 labels, 16,384 inputs, 32, batch 32; squared-hinge and BCE
#    gradients), float32 and bf16 inputs, the op on its thread-per-label kernels (XMC_SPARSE_KERNELS=threads)
#    beside the warp-per-label ones (uniform-rows; and their forward with 2 or 4 connections' gathers in flight,
#    uniform-rows-unroll2/4; their kernels with 4 batch rows per lane, uniform-rows-vec (every phase) and
#    uniform-rows-vec-bf16 (forward, weight gradient)), torch CSR and dense, with the L2 read bandwidth of the probe
#    kernel; its last line names the faster kernels per phase; then each of those kernels once under ncu, where
#    the machine has it (step `counters`, scripts/gpu_kernel_counters.py: L1, L2 and DRAM throughput, occupancy,
#    warp stalls),
# 4. memory: 20,000 points of the pipeline at Amazon-670K's shape with a rewiring every 50 steps, graphed and
#    eager (trainer.cuda_graph=false), each with what was allocated at its peak (trainer.memory_report),
# 5. the whole-model step, dense beside uniform (eager, CUDA graph, Lightning; 32-true and bf16-mixed), Amazon-670K
#    shapes, and a profile of the uniform step each way (the device's idle time per step and what the host did
#    meanwhile, the top kernels, a Chrome trace); then at 32-true with the warp-per-label kernels
#    (XMC_SPARSE_KERNELS=rows, results in results/bench/rows-kernels/),
# 6. one full epoch of the pipeline at Amazon-670K's shape (uniform, 32k intermediate layer, graph step), at each
#    of EPOCH_PRECISIONS (default "32-true bf16-mixed"), with a profile of 20 of its steps (trainer.profile_steps:
#    where the real loop leaves the GPU idle), on the op's default kernels; after the 32-true one the same with
#    the thread-per-label kernels in every phase (epoch-threads-32-true), the warp-per-label ones in every phase
#    (epoch-rows-32-true) and, where the layer benchmark found those faster in a mix of phases other than the
#    default's, that mix (epoch-mixed-32-true, XMC_SPARSE_KERNELS=rows:<phases>, or with the vector kernels where
#    they were faster, e.g. rows:backward_input+vec:forward,backward_weight); then the dense model's epoch at
#    32-true (the dense/uniform ratio; about 2.5 minutes); the step's wall time over each epoch, by quarter
#    (step-times.md, scripts/step_times.py: early steps are slower),
# 7. with BIBTEX=1: Bibtex through the pipeline, seed 0, float32 and bf16-mixed on the default kernels, float32
#    on the thread-per-label and on the warp-per-label kernels in every phase (P@k against each other and the CPU
#    runs), if its files are carried
#    in .gpu_data/Bibtex (XMC_SHARED_DATA): mkdir -p .gpu_data/Bibtex && cp ../shared/data/Bibtex/*_xc.txt
#    .gpu_data/Bibtex/ (.gpu_data and .whl listed in .git/info/exclude, both named in the call's carry).
# Steps, in this order (SKIP="model epoch-bf16-mixed ..." skips them by name): env build tests layer counters
#   memory-graph-true memory-graph-false model model-rows epoch-32-true epoch-threads-32-true epoch-rows-32-true
#   epoch-mixed-32-true epoch-bf16-mixed epoch-dense-32-true bibtex-32-true bibtex-bf16-mixed bibtex-threads-32-true
#   bibtex-rows-32-true.
# Each step has its own timeout (together about 2,000 s), all share a deadline of BUDGET_S seconds (470 by default,
# from the script's start, the wheels' install included), and a failing step does not stop the next (the script
# then exits with 1): the deadline skips the steps that no longer fit, so a call that needs the later ones SKIPs
# earlier ones. DRY_RUN=1 lists each step's command (SKIP applied, no deadline) and runs nothing. LAYER_CASES: the
# layer benchmark's cases (default 2).
# Logs (steps.log: each step's exit status and seconds), results and the MLflow store are packed into
# $OUT/gpu_all.tgz (few files come back); a summary is printed last. hydra and mlflow: carry .whl/ from
# ../shared/gpu/wheels.sh.
# Records' git_commit: the lent machine's copy of the tree carries stale git metadata, so pass the commit sent,
# spelled out here: XMC_GIT_COMMIT=<git rev-parse --short=12 HEAD> bash scripts/gpu_all.sh
# The dense epoch takes about 2.5 minutes; DENSE_POINTS=50000 trains it on fewer points, enough for its step time
# (the same in every phase of training) beside the uniform model's (step-times.md).
# A shorter call: BUDGET_S=240 EPOCH_POINTS=100000 EPOCH_PRECISIONS=32-true TESTS="tests/test_step_graph.py ..." \
#   bash scripts/gpu_all.sh
# What the README's targets table lists as not yet run, in one call (step times of the H200 call at 228b070:
# build 47 s, tests 130 s, layer 21 s, counters 31 s, an epoch 73 s, the dense one on 50,000 points 78 s; carry .whl):
# the vector kernels in the tests, timed per phase and under the counters, and an epoch on the benchmark's fastest
# mix where that is not the default (epoch-mixed-32-true), beside the default's and the dense model's (about 520 s:
# the vector kernels add `cuda` tests and kernels under ncu; run it with a 600 s limit):
#   BUDGET_S=575 DENSE_POINTS=50000 SKIP="memory-graph-true memory-graph-false model model-rows
#   epoch-threads-32-true epoch-rows-32-true epoch-bf16-mixed" bash scripts/gpu_all.sh
# Then, as time allows, the model step on the layer step's choice (its last line):
#   XMC_SPARSE_KERNELS=<that choice> python3 -m xmc_repro.bench --model --device cuda --steps 50
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/xmc_gpu_all}"
LOGS=/tmp/xmc_gpu_logs
BUDGET_S=${BUDGET_S:-470}
DRY_RUN=${DRY_RUN:-0}
if [ "$DRY_RUN" != 1 ]; then
  # /tmp and the ignored checkpoints/ and results/ outlive a call on a warm machine: report this call's files only
  rm -rf "$LOGS"
  mkdir -p "$OUT" "$LOGS" results/bench
  touch "$LOGS/.started"
fi
export XMC_SPARSE_CACHE="${XMC_SPARSE_CACHE:-$HOME/.cache/xmc_repro/sparse_ops}"
export PYTHONUNBUFFERED=1 MLFLOW_TRACKING_URI="sqlite:///$LOGS/gpu_runs.db"
[ -d .gpu_data ] && export XMC_SHARED_DATA="$PWD/.gpu_data"
if [ "$DRY_RUN" != 1 ] && ! python3 -c "import hydra, mlflow" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
fi
export PYTHONPATH="$HOME/site:$PWD"
status=()
step() {  # step NAME SECONDS CMD...: run with a timeout (capped by the deadline), log to $LOGS/NAME.log
  local name=$1 secs=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) status+=("$name: skipped (SKIP)"); return;; esac
  if [ "$DRY_RUN" = 1 ]; then printf '[%s] %ss:' "$name" "$secs"; printf ' %q' "$@"; echo; return; fi
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 15 ]; then status+=("$name: skipped, deadline"); return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "+ [$name] $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > >(tee "$LOGS/$name.log" | grep -v -E "INFO|Tip|pytree") 2>&1
  status+=("$name: exit $? after $((SECONDS - t0)) s")
}

step env 20 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())";
  nproc; echo "commit given: ${XMC_GIT_COMMIT:-none}; git HEAD here: $(git log -1 --format=%h 2>/dev/null)"'
step build 150 env XMC_SPARSE_BACKEND=compiled python3 -c "
import time; t = time.time()
from xmc_repro.sparse import build, op
print(op.ensure_registered(), 'archs', build.cuda_archs(), f'first load (compile) {time.time() - t:.0f} s')"
step tests 240 python3 -m pytest -m cuda ${TESTS:-tests} -q -p no:cacheprovider
# the op on its thread-per-label kernels in every phase, beside the warp-per-label ones: which is faster where
step layer 100 env XMC_SPARSE_KERNELS=threads python3 -m xmc_repro.bench --device cuda --out results/bench \
  --max-cases ${LAYER_CASES:-2} \
  --methods uniform,uniform-bf16,uniform-rows,uniform-rows-bf16,uniform-rows-unroll2,uniform-rows-unroll4,uniform-rows-vec,uniform-rows-vec-bf16,csr,dense
# what bounds each of those kernels, from the hardware counters (ncu, where the machine has it; else they only run)
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
step counters 150 env XMC_SPARSE_KERNELS=threads ${NCU:+"$NCU" --kernel-name-base demangled --kernel-name \
  regex:xmc_sparse:: --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section \
  MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy --section LaunchStats} \
  python3 scripts/gpu_kernel_counters.py
for graph in true false; do  # their own MLflow store: diagnostics, not records (recording slows every allocation)
  step "memory-graph-$graph" 90 env MLFLOW_TRACKING_URI="sqlite:///$LOGS/memory_runs.db" python3 -m xmc_repro \
    dataset=synthetic_amazon670k dataset.num_train=20000 dataset.num_test=10000 dataset.rewire_every_n_steps=50 trainer.max_epochs=1 trainer.progress_bar=false \
    trainer.train_eval_max_points=10000 table=gpu_check model=uniform model.intermediate=32768 \
    trainer.cuda_graph=$graph trainer.memory_report=true
done
step model 240 python3 -m xmc_repro.bench --model --device cuda --out results/bench --steps 50 --profile 10
step model-rows 120 env XMC_SPARSE_KERNELS=rows python3 -m xmc_repro.bench --model --device cuda \
  --out results/bench/rows-kernels --steps 50 --precision 32-true
epoch() {  # epoch NAME MODEL PRECISION SECONDS [overrides...]: one epoch of the pipeline at Amazon-670K's shape
  local name=$1 model=$2 precision=$3 secs=$4; shift 4  # KERNELS=rows epoch ...: other kernels than the default
  step "$name" "$secs" env XMC_SPARSE_KERNELS=${KERNELS:-} python3 -m xmc_repro dataset=synthetic_amazon670k \
    dataset.num_train=${POINTS:-${EPOCH_POINTS:-490449}} \
    dataset.num_test=10000 trainer.max_epochs=1 trainer.precision=$precision trainer.progress_bar=false \
    trainer.train_eval_max_points=10000 table=gpu_check model=$model "$@"
}
for precision in ${EPOCH_PRECISIONS:-32-true bf16-mixed}; do
  epoch "epoch-$precision" uniform "$precision" 170 model.intermediate=32768 trainer.profile_steps=20
  [ "$precision" = 32-true ] || continue
  KERNELS=threads epoch epoch-threads-32-true uniform 32-true 170 model.intermediate=32768 trainer.profile_steps=20
  KERNELS=rows epoch epoch-rows-32-true uniform 32-true 170 model.intermediate=32768 trainer.profile_steps=20
  # each phase on the kernels the layer benchmark found faster, when that is a mix other than the default's
  # (rows and/or vec kernels, e.g. rows:backward_input+vec:forward,backward_weight; threads and rows: run above)
  mixed=$(grep -oE "XMC_SPARSE_KERNELS=(rows|vec):[a-z_,:+]+" "$LOGS/layer.log" 2>/dev/null | head -1 | cut -d= -f2)
  [ "$DRY_RUN" = 1 ] && mixed=rows:PHASES  # the layer step's choice
  if [ -n "$mixed" ] && [ "$DRY_RUN" != 1 ]; then  # the op's default kernels (the same per phase): that epoch ran
    python3 -c "import sys; from xmc_repro.sparse.op import kernel_families as k
sys.exit(k(sys.argv[1]) != k(None))" "$mixed" && mixed=
  fi
  [ -n "$mixed" ] && KERNELS=$mixed epoch epoch-mixed-32-true uniform 32-true 170 model.intermediate=32768
done
POINTS=${DENSE_POINTS:-} epoch epoch-dense-32-true dense 32-true 240  # DENSE_POINTS=50000: its step time, sooner
for d in checkpoints/*/; do  # the epochs' step profiles, named by run
  [ "$DRY_RUN" = 1 ] && break
  run=$(basename "$d")
  [ "$d/profile.txt" -nt "$LOGS/.started" ] && cp "$d/profile.txt" "$LOGS/profile-$run.txt" && cp "$d/profile-trace.json.gz" "$LOGS/profile-trace-$run.json.gz"
  [ "$d/memory-peak.txt" -nt "$LOGS/.started" ] && cp "$d/memory-peak.txt" "$LOGS/memory-peak-$run.txt"
done
if [ -n "${XMC_SHARED_DATA:-}" ] && [ "${BIBTEX:-0}" = 1 ]; then
  for run in :32-true :bf16-mixed threads:32-true rows:32-true; do  # kernels (empty: the default):precision
    kernels=${run%%:*} precision=${run#*:}
    name=bibtex-${kernels:+$kernels-}$precision
    step "$name" 60 env XMC_SPARSE_KERNELS=$kernels python3 -m xmc_repro \
      dataset=bibtex model=uniform model.intermediate=1024 seed=0 trainer.progress_bar=false \
      trainer.precision=$precision table=gpu_check
  done
fi
[ "$DRY_RUN" = 1 ] && exit 0
python3 scripts/step_times.py "$MLFLOW_TRACKING_URI" > "$LOGS/step-times.md" 2> "$LOGS/step-times.err"
printf '%s\n' "${status[@]}" > "$LOGS/steps.log"
cp -r results/bench "$LOGS/" 2>/dev/null
tar czf "$OUT/gpu_all.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
# A file over 16 MiB does not come back from the lent machine: repack without the Chrome traces, the largest part
if [ "$(stat -c %s "$OUT/gpu_all.tgz")" -gt $((15 * 1024 * 1024)) ]; then
  echo "gpu_all.tgz over 15 MiB: packed again without the profiles' Chrome traces"
  tar czf "$OUT/gpu_all.tgz" --exclude='*trace*.json.gz' -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
fi

echo
echo "================ summary ================"
printf '%s\n' "${status[@]}"
grep -E "passed|failed|error" "$LOGS/tests.log" | tail -3
sed -n '/^| model /,$p' "$LOGS/model.log" "$LOGS/model-rows.log" 2>/dev/null
find results/bench -maxdepth 1 -name "*-model-profile.txt" -newer "$LOGS/.started" -exec cat {} + | grep -E "^==|^device span|^host during|^  +[0-9.]+  |^blocking"
grep -E "peak GPU|^allocated at|MiB .* blocks" "$LOGS"/memory-graph-*.log
for p in 32-true threads-32-true rows-32-true mixed-32-true bf16-mixed dense-32-true; do [ -f "$LOGS/epoch-$p.log" ] && grep -E "^epoch |peak GPU|MLflow run|^profile of|^device span|^host during|^  +[0-9.]+  |^blocking" "$LOGS/epoch-$p.log" | tail -20; done
cat "$LOGS/step-times.md"
sed -n '/^case /,$p' "$LOGS/layer.log"
# ncu heads each kernel with its demangled name: `void xmc_sparse::rows::forward_kernel<...>(...)` for a template
grep -E "^  (void )?[a-z_:]*(forward|backward_input|backward_weight)(_vec)?_kernel|^launched|^==(PROF|ERROR|WARNING)==|^    (Duration|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued)" "$LOGS/counters.log" 2>/dev/null
for p in 32-true bf16-mixed threads-32-true rows-32-true; do [ -f "$LOGS/bibtex-$p.log" ] && grep -E "test|seconds per epoch" "$LOGS/bibtex-$p.log" | tail -3; done
# the exit status: 1 when a step failed or ran out of time (the summary's first lines say which), else 0
case " ${status[*]} " in *": exit "[1-9]*) exit 1;; esac
exit 0
