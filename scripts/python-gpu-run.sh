#!/usr/bin/env bash
# Device run of the Python package (docs/python.md) on a GPU machine without cargo
# or network: the repository tree plus target/ship-py/, made on a dev machine by
# scripts/python-gpu-ship.sh:
#   target/ship-py/wheel/fabric_rdma-*-abi3-*.whl   the extension, release (abi3: CPython >= 3.11)
#   target/ship-py/wheels/*.whl                pytest and its pure-Python dependencies
#   target/ship-py/fabric-bench                (optional) release fabric-bench, for `rtt`
#   target/ship-py/site/                       (optional) the trimmed NIXL wheel (nixl_cu13)
# FABRIC_BENCH=path and NIXL_SITE=path override the last two. The machine's own Python
# (torch, numpy) runs everything: the wheels are unpacked into a temporary folder put first
# on PYTHONPATH (no pip, no venv needed).
#
# Runs, each step bounded and the whole within BUDGET seconds (default 450):
#   1. pytest python/tests (test_gpu.py moves torch CUDA tensors: GPU0 -> GPU1 with two GPUs)
#   2. examples/kv_transfer.py and rl_weights.py with torch CUDA tensors (cuda:0 -> cuda:1
#      with two GPUs, else cuda:0 -> cuda:0)
#   3. bench/rtt.py on shm in busy_poll and inline mode, beside `fabric-bench rtt --provider shm`
#   4. bench/bw.py on host memory and on CUDA tensors, with NIXL's Python API beside it
# Everything goes to $OUT/py.log (and stdout). Exit status: pytest's, else the first failure.
# STEPS (default "pytest examples rtt bw") picks steps; PYTEST_ARGS (default python/tests)
# what pytest runs; BW_DEVICES ("host cuda"), BW_MODES ("event", the engine's default) and
# BW_WRAP (a prefix such as "taskset -c 0-15") shape bw.py's runs.
set -u
cd "$(dirname "$0")/.."
root=$PWD
ship=$root/target/ship-py
out=${OUT:-$root/target/py-out}
mkdir -p "$out"
exec > >(tee "$out/py.log") 2>&1
export FI_TCP_IFACE=lo
py=${PYTHON:-python3}
budget=${BUDGET:-450}
t0=$(date +%s)
since() { echo "$(($(date +%s) - t0)) s"; }
# step TIMEOUT NAME CMD...: runs CMD bounded by TIMEOUT and by what is left of the budget.
status=0
step() {
  local limit=$1 name=$2
  shift 2
  local left=$((budget - ($(date +%s) - t0)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "== $name: skipped, out of time ($(since))"
    return
  fi
  echo "== $name (limit ${limit} s, at $(since))"
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  [ $rc = 124 ] && echo "!! $name: timed out after ${limit} s"
  [ $rc != 0 ] && echo "!! $name: exit status $rc" && [ $status = 0 ] && status=$rc
  return 0
}

echo "== machine"
nvidia-smi -L 2>&1 | head -8
$py --version
whl=$(ls "$ship"/wheel/fabric_rdma-*.whl 2>/dev/null | head -1)
if [ -z "$whl" ]; then
  echo "!! no wheel in $ship/wheel: build it with scripts/python-gpu-ship.sh"
  exit 1
fi
site=$(mktemp -d)/site
# A wheel is a zip of the files to put on sys.path: unpacking it installs it.
$py - "$site" "$whl" "$ship"/wheels/*.whl <<'PY' || exit 1
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
    print("unpacked", w.rsplit("/", 1)[-1])
PY
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
$py - <<'PY'
import fabric_rdma, numpy
print("fabric", fabric_rdma.__version__, "from", fabric_rdma.__file__, "| numpy", numpy.__version__)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
except Exception as e:
    print("torch: not importable:", e)
PY
ngpu=$($py -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$ngpu" -ge 2 ]; then src=cuda:0 dst=cuda:1; else src=cuda:0 dst=cuda:0; fi

steps=${STEPS:-pytest examples rtt bw}
has() { [[ " $steps " == *" $1 "* ]]; }
pytest_rc=0
if has pytest; then
  # shellcheck disable=SC2086
  step 210 "pytest ${PYTEST_ARGS:-python/tests}" $py -m pytest -q -p no:cacheprovider -rs --durations=8 \
    ${PYTEST_ARGS:-python/tests}
  pytest_rc=$status
fi

has examples && step 50 "kv_transfer $src -> $dst" $py python/examples/kv_transfer.py --provider shm --decoders 2 \
  --requests 40 --layers 8 --blocks 256 --block-kib 64 --device $src --decode-device $dst
has examples && step 50 "rl_weights $src -> $dst" $py python/examples/rl_weights.py --provider shm --workers 2 \
  --model-mib 256 --tensors 64 --versions 3 --device $src --worker-device $dst

bench=${FABRIC_BENCH:-$ship/fabric-bench}
has rtt && for mode in busy_poll inline; do
  step 40 "rtt.py shm $mode" $py python/bench/rtt.py --provider shm --mode $mode --iters 10000 --warmup 1000
done
if ! has rtt; then
  :
elif [ -x "$bench" ]; then
  step 60 "fabric-bench rtt --provider shm (Rust)" "$bench" rtt --provider shm --rounds 3
else
  echo "== fabric-bench rtt: skipped (no release fabric-bench at $bench; FABRIC_BENCH=path)"
fi

nixl=${NIXL_SITE:-$ship/site}
if [ -d "$nixl" ]; then
  bwpath="$nixl:$PYTHONPATH"
else
  echo "== NIXL: no site folder at $nixl (NIXL_SITE=path): bw.py runs fabric alone"
  bwpath=$PYTHONPATH
fi
has bw && for dev in ${BW_DEVICES:-host cuda}; do
  for mode in ${BW_MODES:-event}; do
    # NIXL's INFO lines are noise here; its errors still show.
    # shellcheck disable=SC2086
    step 100 "bw.py $dev $mode ${BW_WRAP:-} (fabric vs NIXL)" env PYTHONPATH="$bwpath" NIXL_LOG_LEVEL=WARN \
      ${BW_WRAP:-} $py python/bench/bw.py --provider shm --mode $mode --device $dev
  done
done

echo "== done in $(since): pytest exit status $pytest_rc, first failure $status"
exit $status
