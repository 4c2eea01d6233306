#!/bin/bash
# Device run of the staging pool (docs/gpu.md): on a GPU machine (no cargo there), from a
# folder holding this script and, built on a dev machine and stripped:
#   gpu          (cargo test -p integration-tests --test gpu --release --no-run: gpu-<hash>)
#   gpu_signal   (same, --test gpu_signal)
#   fabric-bench (cargo build --release -p fabric-bench)
# Every GPU test, gpu_signal, the throughput report, and the bench's staged rows.
set -u
cd "$(dirname "$0")"
export FI_TCP_IFACE=lo FABRIC_REQUIRE_CUDA=1
nvidia-smi -L 2>&1 | head -2
t0=$(date +%s)
echo "== gpu tests (all but the report)"
timeout 170 ./gpu --test-threads 1 --skip gpu_throughput_report 2>&1 \
  | grep -E "^test |panicked|GB/s|test result|Error|error|left:|right:" | grep -v "gpu_child" | grep -Ev "; [1-9][0-9] filtered out" | head -70
echo "== gpu_signal ($(( $(date +%s) - t0 )) s)"
timeout 30 ./gpu_signal --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | head -10
echo "== throughput report ($(( $(date +%s) - t0 )) s)"
timeout 60 ./gpu --exact gpu_throughput_report --nocapture 2>&1 | grep -E "^\||panicked" | head -20
for p in shm tcp; do
  echo "== bench $p ($(( $(date +%s) - t0 )) s)"
  timeout 45 ./fabric-bench bw --location cuda --provider $p --sizes 16M,64M --window 4 2>&1 \
    | grep -Ei "staged|ipc|ceiling|host|error|skipped" | head -16
done
echo "== bench shm, pool 8M / 1M chunks ($(( $(date +%s) - t0 )) s)"
timeout 30 ./fabric-bench bw --location cuda --provider shm --sizes 64M --window 4 --staging-pool 8M --staging-chunk 1M 2>&1 \
  | grep -Ei "staged|error" | head -6
echo "== done in $(( $(date +%s) - t0 )) s"
