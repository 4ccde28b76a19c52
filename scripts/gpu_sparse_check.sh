#!/usr/bin/env bash
# Kept for its name: the build, the `cuda` tests and the benchmarks now run from scripts/gpu_all.sh.
exec bash "$(dirname "$0")/gpu_all.sh" "$@"
