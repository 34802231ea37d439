#!/usr/bin/env bash
# The checks a session with the accelerator machine runs (issues 38 and 40), in one call:
#
#   bash benchmarks/device_check.sh $OUT            (the device tool; carry .whl)
#   PARTS="gpu cpu" bash benchmarks/device_check.sh $OUT
#
# .whl holds what the machine's image lacks (numpyro 0.22, dask and distributed with their
# pure-Python needs). Each part runs in its own process under `timeout -s ABRT`, with
# PYTHONFAULTHANDLER set, so that a hang prints every thread's stack and the next part
# still runs. Records go to $OUT/*.jsonl, everything printed to $OUT/log.txt.
set -u
OUT=${1:-/tmp/out}
PARTS=${PARTS:-"env gpu gpubench cpu scaling hosts"}
# also: "hang" (benchmarks/inflight.py: operations queued on a host-route result),
# "rowcores" (benchmarks/row_forms.py on 2, 4, 8 and 16 cores), "trust" (the hang and traced-state tests on 16 cores), "nuts" (NUTS end to end),
# "demo" (`parallel-backend demo` on 16 cores; .whl needs arviz 1.3 and its parts),
# "sets" (benchmarks/sets_forms.py: vectorized chains by width, jax 0.11, 2 and 16 cores)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# parallel_backend.plugins is plugins/ (pyproject's package-dir): a link in this copy does it
[ -e parallel_backend/plugins ] || ln -s ../plugins parallel_backend/plugins
export PYTHONPATH=$PWD:$PYTHONPATH
M="h100-16core"
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return;; esac
  echo "== $name ($(date +%T), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -s ABRT "$limit" "$@"
  echo "== $name: rc=$? in $((SECONDS - t0)) s"
}
{
part env 30 bash -c 'lscpu | grep -E "Model name|^CPU\(s\)|L2"; nvidia-smi -L;
  python3 -c "import sys, jax, numpyro, numpy; print(sys.version.split()[0], jax.__version__, numpyro.__version__, numpy.__version__, jax.devices())";
  command -v ip tc || echo "no ip/tc"'
part gpu 80 python3 -m pytest -p no:cacheprovider -n 0 -m gpu -q tests/device/test_device.py
part gpubench 90 python3 -m benchmarks device --likelihoods hmm_50k,negbin_1M --rounds 3 \
  --variants device,device_graph --machine "$M gpu" --out "$OUT/device.jsonl"
part cpu 140 env JAX_PLATFORMS=cpu python3 -m benchmarks gradients \
  --likelihoods hmm_50k,grouped_200k,mixture_200k,logistic_200k --rounds 3 \
  --variants serial,thread --machine "$M" --out "$OUT/gradients.jsonl"
part scaling 80 env JAX_PLATFORMS=cpu python3 -m benchmarks scaling --likelihoods hmm_50k \
  --workers 1,4,16 --rounds 2 --machine "$M" --out "$OUT/scaling.jsonl"
part hosts 130 env JAX_PLATFORMS=cpu python3 -m benchmarks.netcluster.bench hosts \
  --hosts 1,2,4,8 --sequences 4000 --block 250 --calls 20 --budget 3 --out "$OUT/hosts.jsonl"
part hang 200 bash -c 'for v in "hmm_1k 40 --no-fit --pending" "hmm_10k 200 --no-fit --pending" \
  "hmm_1k 40 --pending" "hmm_1k 40"; do
  timeout -s KILL 50 env JAX_PLATFORMS=cpu python3 -m benchmarks.inflight $v --limit 40 2>&1 |
    grep -E "^hmm|done|InFlightLimit|Timeout"; echo "rc=${PIPESTATUS[0]}"; done'
part rowcores 200 bash -c 'for c in 1 3 7 15; do
  JAX_PLATFORMS=cpu taskset -c 0-$c python3 -m benchmarks.row_forms mixture_200k,mixture:1000000; done'
part trust 240 env JAX_PLATFORMS=cpu python3 -m pytest -p no:cacheprovider -n 4 -q \
  tests/integration/test_no_hang.py tests/integration/test_traced_state.py \
  tests/integration/test_row_loops.py tests/unit/test_blocks.py tests/unit/test_reproducible.py
part nuts 200 env JAX_PLATFORMS=cpu python3 -m benchmarks nuts \
  --likelihoods hmm:50000,mixture:200000 --variants thread --repeats 1 --warmup 20 \
  --samples 20 --max-tree-depth 4 --machine "$M" --out "$OUT/nuts.jsonl"
part sets 240 bash -c 'for c in 1 15; do
  JAX_PLATFORMS=cpu taskset -c 0-$c python3 -m benchmarks.sets_forms 200000 4,8,20,40; done'
part demo 300 env JAX_PLATFORMS=cpu python3 -c \
  "import sys; from parallel_backend.plugins.cli import main; sys.exit(main(['demo', '--no-progress']))"
} 2>&1 | tee "$OUT/log.txt"
