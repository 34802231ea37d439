#!/usr/bin/env bash
# Every table of docs/performance.md's current section. Run on an otherwise idle machine
# (about 45 minutes on 2 cores):
#   1. one value-and-gradient, float32 and float64, on all cores, then plain and serial
#      pinned to one core (the reference of parallel efficiency);
#   2. thread scaling, workers 1..cores against plain pinned to as many cores;
#   3. NUTS wall time (warmup and compilation included) and ms per gradient inside NUTS;
#   4. the markdown tables (report.py).
# Usage: bash benchmarks/run_all.sh [outdir]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
rm -f "$out"/gradients.jsonl "$out"/scaling.jsonl "$out"/nuts.jsonl
py=${PYTHON:-.venv/bin/python}
for dtype in float32 float64; do
  $py benchmarks/bench_gradients.py --dtype $dtype --json "$out/gradients.jsonl"
  taskset -c 0 $py benchmarks/bench_gradients.py --dtype $dtype --only plain,serial \
    --json "$out/gradients.jsonl"
done
$py benchmarks/bench_scaling.py --likelihoods hmm_5k,newton_200k,gp_10k,negbin_1M \
  --json "$out/scaling.jsonl"
# NUTS: trees of at most 63 leapfrog steps, 100 + 100 iterations, one run per variant.
nuts="--warmup 100 --samples 100 --repeats 1 --max-tree-depth 6 --json $out/nuts.jsonl"
$py benchmarks/bench_nuts.py --models negbin --rows 10000,200000 --chains 1 $nuts
$py benchmarks/bench_nuts.py --models negbin --rows 200000 --chains 4 \
  --variants plain,serial,thread $nuts
$py benchmarks/bench_nuts.py --models logistic,newton --rows 200000 --chains 1 $nuts
$py benchmarks/bench_nuts.py --models hmm --rows 1000 --chains 1 $nuts
$py benchmarks/bench_nuts.py --models negbin --rows 200000 --chains 1 --dtype float64 $nuts
$py benchmarks/report.py "$out/gradients.jsonl" "$out/scaling.jsonl" "$out/nuts.jsonl"
