#!/usr/bin/env bash
# Every figure of docs/performance.md: gradients in float32 and float64 on all cores,
# plain and serial pinned to one core (the baseline of parallel efficiency), then NUTS
# wall times (warmup included) on all cores, and in float32 on one core.
# Usage: bash benchmarks/run_all.sh [outdir]   (on an otherwise idle machine; ~30 min)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
rm -f "$out"/gradients.jsonl "$out"/nuts.jsonl "$out"/nuts_1core.jsonl
py=${PYTHON:-.venv/bin/python}
nuts="--warmup 150 --samples 150 --repeats ${NUTS_REPEATS:-1}"
for dtype in float32 float64; do
  $py benchmarks/bench_gradients.py --dtype $dtype --json "$out/gradients.jsonl"
  taskset -c 0 $py benchmarks/bench_gradients.py --dtype $dtype --only plain,serial \
    --json "$out/gradients.jsonl"
done
for dtype in float32 float64; do
  $py benchmarks/bench_nuts.py --dtype $dtype $nuts --json "$out/nuts.jsonl"
done
taskset -c 0 $py benchmarks/bench_nuts.py --dtype float32 $nuts --variants plain,serial,thread \
  --json "$out/nuts_1core.jsonl"
$py benchmarks/report.py "$out/gradients.jsonl" "$out/nuts.jsonl" "$out/nuts_1core.jsonl"
