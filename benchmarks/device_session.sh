#!/usr/bin/env bash
# One session on a machine lent by the `device` tool (one NVIDIA GPU, 16 cores): where
# DeviceExecutor stalled on the GPU (issue 38), the GPU against plain NumPyro, and the
# 16-core CPU tables of docs/performance.md. Every step has a hard time limit, so the
# whole script ends in about 7 minutes whatever hangs; at most 8 files go to OUTDIR.
#   bash benchmarks/device_session.sh OUTDIR          # on the device machine
#   SMALL=1 bash benchmarks/device_session.sh /tmp/s  # a dry run at tiny sizes (any CPU)
#   PARTS="stall gpu cpu" (the default) picks the parts to run.
# On the device: numpyro>=0.22 travels as a wheel in .whl/ (its image has 0.21).
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
mkdir -p "$out"
py=${PYTHON:-python3}
small=${SMALL:-}
parts=" ${PARTS:-stall gpu cpu} "
log=$out/session.log
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
exec > >(tee -a "$log") 2>&1

# step NAME SECONDS CMD...: run CMD with a hard limit, its output into the log.
step() {
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s) $(date +%T)"
  local t0=$SECONDS
  timeout -k 5 "$secs" "$@"
  echo "== $name: rc=$? in $((SECONDS - t0))s"
}

if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if [ -z "$small" ]; then
  if ! $py -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
    echo "editable install failed: parallel_backend from a copy on PYTHONPATH"
    rm -rf /tmp/pbsrc && mkdir -p /tmp/pbsrc && cp -r parallel_backend /tmp/pbsrc/ \
      && cp -r plugins /tmp/pbsrc/parallel_backend/plugins \
      && export PYTHONPATH=/tmp/pbsrc${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
(lscpu; nproc; nvidia-smi; nvidia-smi -L; $py -c "import jax, numpyro, numpy; \
print('python', __import__('sys').version.split()[0], 'jax', jax.__version__, \
'numpyro', numpyro.__version__, 'numpy', numpy.__version__, jax.devices())"; \
git log -1 --format='commit %H %s') > "$out/machine.txt" 2>&1
tail -n 2 "$out/machine.txt"

# (a) The stall: every case in its own process at once (a stalled one uses nothing);
# each prints every thread's stack and exits after its --timeout. The same cases again
# with XLA's GPU autotuning off ("_noautotune").
n_hmm=50000; [ -n "$small" ] && n_hmm=600
stall=$out/stall.jsonl
if [[ $parts == *" stall "* ]]; then
echo "== stall cases $(date +%T)"
pids=()  # a bare `wait` would also wait for the tee above, forever
for flags in "" "--xla_gpu_autotune_level=0"; do
  tag=${flags:+_noautotune}
  for c in jax_same jax_inner_cpu jax_outer_cpu jax_compile_inside jax_compiled_before; do
    [ -n "$flags" ] && [ $c != jax_compile_inside ] && continue
    XLA_FLAGS=$flags timeout -k 5 40 $py benchmarks/device_stall.py $c --timeout 30 \
      > "$out/.stall_$c$tag" 2>&1 &
    pids+=($!)
  done
  for c in host_route host_made auto; do
    [ -n "$flags" ] && [ $c != host_route ] && continue
    XLA_FLAGS=$flags timeout -k 5 70 $py benchmarks/device_stall.py $c --n $n_hmm \
      --timeout 60 > "$out/.stall_$c$tag" 2>&1 &
    pids+=($!)
  done
done
if [ -z "$small" ]; then
  timeout -k 5 70 $py -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" \
    -m gpu --timeout 60 tests/device/test_device.py > "$out/.stall_pytest_gpu" 2>&1 &
  pids+=($!)
fi
wait "${pids[@]}"
for f in "$out"/.stall_*; do
  echo "---- ${f##*/.stall_}"
  grep '^{' "$f" | tail -n 1 >> "$stall"
  cat "$f"
  rm -f "$f"
done
fi

# (b) The GPU against plain NumPyro (the GPU is JAX's default device).
scale=1; [ -n "$small" ] && scale=0.01
[[ $parts == *" gpu "* ]] && step gpu_bench_device 150 $py benchmarks/bench_device.py --dtype float32 --rounds 5 \
  --scale $scale --likelihoods hmm_50k,negbin_1M --json "$out/gpu_device.jsonl"

# (c) 16 cores, CPU only: per gradient in a loop of 2, then thread scaling against plain
# pinned to as many cores (one process per worker count, most telling first, while the
# session is under 400 s).
[[ $parts == *" cpu "* ]] || { echo "== done $(date +%T) after ${SECONDS}s"; exit 0; }
step cpu_gradients 100 env JAX_PLATFORMS=cpu $py benchmarks/bench_gradients.py \
  --dtype float32 --rounds 3 --loop 2 --scale $scale --only plain,serial,thread,thread_host \
  --likelihoods hmm_50k,negbin_1M,logistic_1M --json "$out/cpu_gradients.jsonl"
cores=$(nproc)
scaling=hmm_50k,negbin_1M; [ -n "$small" ] && scaling=hmm_1k,negbin_1k
for w in $(printf '%s\n' 1 "$cores" 4 8 2 | awk -v c="$cores" '$1 <= c && !seen[$1]++'); do
  [ $SECONDS -lt 400 ] || { echo "== cpu_scaling_w$w skipped: session at ${SECONDS}s"; continue; }
  step "cpu_scaling_w$w" 45 env JAX_PLATFORMS=cpu $py benchmarks/bench_scaling.py \
    --likelihoods $scaling --workers $w --rounds 3 --json "$out/cpu_scaling.jsonl"
done
echo "== done $(date +%T) after ${SECONDS}s"
