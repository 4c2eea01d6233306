#!/bin/bash
# Device run of the fast GPU path (docs/gpu.md): on a GPU machine (no cargo
# there), from a folder holding this script and, built on a dev machine and stripped:
#   gpu          (cargo test -p integration-tests --test gpu --release --no-run: gpu-<hash>)
#   gpu_signal   (same, --test gpu_signal)
#   fabric-bench (cargo build --release -p fabric-bench)
#   kv_transfer  (cargo build --release -p fabric-examples --examples)
# and, optional, site/ (the trimmed NIXL wheel, scripts/gpu-peers-fetch.sh) for --peer nixl,
# and ft/ (fabtests 1.17's fi_rma_bw, built from libfabric's source) for the host rows.
# Every GPU test on every GPU, the IPC breakdown, the bench's GPU rows at KV sizes, and
# kv_transfer in host and GPU memory. PEERS=nixl,nccl adds the peers' rows to the bench;
# SKIP_TESTS=1 and SKIP_BENCH=1 leave those parts out.
set -u
cd "$(dirname "$0")"
export FI_TCP_IFACE=lo FABRIC_REQUIRE_CUDA=1
[ -d site ] && export PYTHONPATH="$PWD/site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L 2>&1 | head -4
n=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$n" -ge 2 ] && export FABRIC_REQUIRE_GPUS=2
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 )) s"; }
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== gpu tests (all but the reports)"
  timeout 240 ./gpu --test-threads 1 --skip gpu_throughput_report --skip gpu_ipc_breakdown 2>&1 \
    | grep -E "^test |panicked|GB/s|writes in|x .* B in|test result|Error|error|left:|right:" \
    | grep -v "_child" | grep -Ev "; [1-9][0-9] filtered out" | head -80
  if [ "$n" -ge 2 ]; then
    echo "== gpu tests on one GPU (CUDA_VISIBLE_DEVICES=0) ($(since))"
    CUDA_VISIBLE_DEVICES=0 FABRIC_REQUIRE_GPUS=1 timeout 200 ./gpu --test-threads 1 --skip gpu_throughput_report \
      --skip gpu_ipc_breakdown 2>&1 | grep -E "test result|panicked|FAILED" | head -10
  fi
  echo "== gpu_signal ($(since))"
  timeout 30 ./gpu_signal --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | head -10
fi
echo "== IPC breakdown ($(since))"
timeout 60 ./gpu --exact batch::gpu_ipc_breakdown --nocapture 2>&1 | grep -E "breakdown|panicked" | head -6
peers=${PEERS:+--peer $PEERS}
# fabtests' fi_rma_bw beside the host rows, when built and carried in ft/ (docs/performance.md).
[ -x ft/fi_rma_bw ] && peers="$peers --fabtests ./ft"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench shm, window 16 ($(since))"
  timeout 200 ./fabric-bench bw --location cuda --provider shm --sizes 64K,1M,4M,16M,64M --window 16 $peers 2>&1 \
    | grep -Eiv "^\s*$|progress|^\[bw\]" | tail -90
fi
echo "== kv_transfer host / cuda ($(since))"
for loc in host cuda; do
  timeout 60 ./kv_transfer --provider shm --location $loc 2>&1 | grep -Ei "p50|GB/s|verified|error|fail" | head -6
done
echo "== done in $(since)"
