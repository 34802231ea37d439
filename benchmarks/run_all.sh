#!/usr/bin/env bash
# Every figure of docs/performance.md: gradients in float32 and float64, on all cores
# and pinned to one core (plain only: the baseline of parallel efficiency), then NUTS.
# Usage: bash benchmarks/run_all.sh [outdir]   (run on an otherwise idle machine)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
rm -f "$out"/gradients.jsonl "$out"/nuts.jsonl
py=${PYTHON:-.venv/bin/python}
for dtype in float32 float64; do
  $py benchmarks/bench_gradients.py --dtype $dtype --json "$out/gradients.jsonl"
  taskset -c 0 $py benchmarks/bench_gradients.py --dtype $dtype --only plain --json "$out/gradients.jsonl"
done
for dtype in float32 float64; do
  $py benchmarks/bench_nuts.py --dtype $dtype --json "$out/nuts.jsonl"
done
$py benchmarks/report.py "$out/gradients.jsonl" "$out/nuts.jsonl"
