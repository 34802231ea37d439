#!/usr/bin/env bash
# The 16-core CPU and GPU tables of docs/performance.md, on a machine lent by the `device`
# tool (16 cores, one NVIDIA GPU, JAX with CUDA). Writes JSON lines and logs under OUTDIR.
#   bash benchmarks/run_device.sh OUTDIR gradients scaling nuts gpu   # any of the four parts
# gradients, scaling and nuts run on the CPU alone (JAX_PLATFORMS=cpu); gpu runs plain
# NumPyro and the executors with the GPU as JAX's default device.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; shift
mkdir -p "$out"
py=${PYTHON:-python3}
(lscpu; nproc; nvidia-smi -L) > "$out/machine.txt" 2>&1
for part in "$@"; do
  case $part in
  gradients)
    JAX_PLATFORMS=cpu $py benchmarks/bench_gradients.py --dtype float32 --rounds 5 \
      --likelihoods hmm_1k,hmm_10k,hmm_50k,hmm_200k,negbin_1M,logistic_1M \
      --json "$out/gradients_16core.jsonl" 2>&1 | tee "$out/gradients_16core.log" ;;
  scaling)
    JAX_PLATFORMS=cpu $py benchmarks/bench_scaling.py --likelihoods hmm_50k \
      --workers 1,2,4,8,16 --rounds 5 \
      --json "$out/scaling_16core.jsonl" 2>&1 | tee "$out/scaling_16core.log" ;;
  nuts)
    JAX_PLATFORMS=cpu $py benchmarks/bench_nuts.py --models negbin --rows 200000 \
      --chains 1,4 --variants plain,serial,thread --warmup 100 --samples 100 --repeats 1 \
      --max-tree-depth 6 --json "$out/nuts_16core.jsonl" 2>&1 | tee "$out/nuts_16core.log" ;;
  gpu)
    $py benchmarks/bench_device.py --dtype float32 --rounds 7 \
      --likelihoods hmm_50k,hmm_500k,negbin_1M,logistic_1M \
      --json "$out/device_gpu.jsonl" 2>&1 | tee "$out/device_gpu.log"
    $py benchmarks/bench_gradients.py --dtype float32 --rounds 5 --only plain,serial,thread \
      --likelihoods hmm_50k,negbin_1M \
      --json "$out/gradients_gpu.jsonl" 2>&1 | tee "$out/gradients_gpu.log" ;;
  esac
done
