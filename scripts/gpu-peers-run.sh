#!/usr/bin/env bash
# On a GPU machine (Python 3.12 with torch, no cargo, no network), from the repository root,
# with target/gpu-peers carried (scripts/gpu-peers-fetch.sh made it on the dev machine):
# fabric-bench's bw rows beside NIXL 1.5.1 (UCX) and NCCL (torch.distributed) in the same run,
# host memory and GPU 0 -> GPU 1 (docs/gpu.md, "NIXL and NCCL beside the engine").
#   usage: scripts/gpu-peers-run.sh [PROVIDER [WINDOW [SIZES]]]     default: shm 16 4M,64M,256M
# The JSON goes to $OUT (the device tool's folder) when set, else to target/gpu-peers.
set -u
cd "$(dirname "$0")/.."
d=target/gpu-peers
prov=${1:-shm} win=${2:-16} sizes=${3:-4M,64M,256M}
out=${OUT:-$d}
py=${FABRIC_PYTHON:-python3}
export PYTHONPATH=$d/site${PYTHONPATH:+:$PYTHONPATH}
# numpy, where the machine lacks it (scripts/gpu-peers-fetch.sh --numpy, carried earlier).
if ! $py -c 'import numpy' 2>/dev/null && [ -d target/gpu-peers-numpy/site ]; then
  PYTHONPATH=$PYTHONPATH:target/gpu-peers-numpy/site
fi
export FI_TCP_IFACE=lo FABRIC_REQUIRE_CUDA=1
t0=$(date +%s)
nvidia-smi -L 2>&1 | head -4
$py -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), "GPUs")' 2>&1 | tail -1
$py -c 'import numpy; print("numpy", numpy.__version__)' 2>&1 | tail -1
for p in nixl nccl; do
  printf '%s probe: ' $p
  NIXL_LOG_LEVEL=WARN $py benches/src/peers/peers.py probe $p --cuda 0,1 2>&1 | tail -1
done
echo "== bw --location cuda --provider $prov --window $win --sizes $sizes --peer nixl,nccl ($(( $(date +%s) - t0 )) s)"
timeout 500 $d/fabric-bench bw --location cuda --provider "$prov" --window "$win" --sizes "$sizes" \
  --buffer hot --peer nixl,nccl --json "$out/peers-$prov-w$win.json" 2>&1 \
  | grep -Eiv "^\[bw\]|^$" | tail -60
echo "== done in $(( $(date +%s) - t0 )) s"
