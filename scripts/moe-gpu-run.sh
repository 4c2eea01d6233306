#!/bin/bash
# Device run of fabric-moe (docs/moe.md), under 6 minutes: on a GPU
# machine (no cargo there), from a folder holding this script and, built on a dev machine
# and stripped (scripts/moe-gpu-ship.sh makes the folder):
#   moe_gpu_test      (cargo test -p integration-tests --test moe_gpu --release --no-run)
#   moe_gpu           (cargo build --release -p fabric-examples --example moe_gpu)
#   moe_gpu_nccl.py   (examples/moe_gpu_nccl.py: the NCCL all_to_all_single baseline)
# Runs the tests with the two ranks on two GPUs (and both on GPU 0), then on one GPU only
# (CUDA_VISIBLE_DEVICES=0), then the example (decode shape: 128 tokens x 7168 bf16 per
# rank, 256 experts, top-8, every step checked), over NVLink and through the proxy
# transport (--transport proxy, shm engine), and the NCCL baseline of the same bytes.
# STEPS=N changes the timed steps of both (default 200). Then, on two GPUs, the prefill
# shape (4096 tokens per rank; rank-major rows, then expert-major) and its NCCL baseline
# (PREFILL=0 leaves them out).
set -u
cd "$(dirname "$0")"
export FI_TCP_IFACE=lo FABRIC_REQUIRE_CUDA=1
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 )) s"; }
nvidia-smi -L 2>&1 | head -4
n=$(nvidia-smi -L 2>/dev/null | wc -l)
# NVRTC: the loader finds a toolkit's (/usr/local/cuda, $CUDA_HOME); else the pip wheel's.
if [ -z "${FABRIC_NVRTC:-}" ] && ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1 \
    && ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
  f=$(python3 -c 'import glob, site, os
for d in site.getsitepackages():
    for p in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so.*"))
                    + glob.glob(os.path.join(d, "nvidia", "*", "*", "lib", "libnvrtc.so.*"))):
        if "builtins" not in p and ".alt." not in p:
            print(p); raise SystemExit' 2>/dev/null)
  # NVRTC opens libnvrtc-builtins by name: its folder goes on the search path too.
  [ -n "$f" ] && export FABRIC_NVRTC=$f LD_LIBRARY_PATH="$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    && echo "FABRIC_NVRTC=$f"
fi
# Test lines, the per-case lines, skips and results; a panic with the line of its message.
show() {
  awk '/panicked/ { print; if ((getline l) > 0) print l; next }
       /^test |^moe |test result|skipped|rank [01]|[Ee]rror|left:|right:/ && !/moe_child/ { print }' | head -60
}
if [ "$n" -ge 2 ]; then
  echo "== moe_gpu tests, ranks on GPU 0 and GPU 1 (and both on GPU 0) ($(since))"
  FABRIC_REQUIRE_GPUS=2 timeout -k 5 120 ./moe_gpu_test --test-threads 1 --nocapture 2>&1 | show
fi
echo "== moe_gpu tests on one GPU (CUDA_VISIBLE_DEVICES=0) ($(since))"
CUDA_VISIBLE_DEVICES=0 timeout -k 5 110 ./moe_gpu_test --test-threads 1 --nocapture 2>&1 | show
echo "== example moe_gpu, decode shape ($(since))"
timeout -k 5 45 ./moe_gpu --steps "${STEPS:-200}" 2>&1 | grep -v "^\s*$" | head -20
echo "== example moe_gpu, decode shape, --transport proxy ($(since))"
timeout -k 5 60 ./moe_gpu --steps "${STEPS:-200}" --transport proxy --provider shm 2>&1 | grep -v "^\s*$" | head -20
echo "== NCCL all_to_all_single of the same bytes ($(since))"
timeout -k 5 45 python3 moe_gpu_nccl.py --steps "${STEPS:-200}" 2>&1 | grep -Ev "^\s*$|Warning|warn\(" | tail -8
if [ "${PREFILL:-1}" = 1 ] && [ "$n" -ge 2 ]; then
  # Prefill: 4096 tokens per rank (112 MiB sent per step), experts bounded to 1024 rows
  # each (the default, every token of every rank, would be 15 GB per rank).
  echo "== example moe_gpu, prefill shape, rank-major rows ($(since))"
  timeout -k 5 150 ./moe_gpu --tokens 4096 --capacity 1024 --steps 20 --warmup 3 --layout rank-major 2>&1 | grep -v "^\s*$" | head -20
  echo "== example moe_gpu, prefill shape, expert-major rows ($(since))"
  timeout -k 5 150 ./moe_gpu --tokens 4096 --capacity 1024 --steps 20 --warmup 3 2>&1 | grep -v "^\s*$" | head -20
  echo "== NCCL all_to_all_single, prefill bytes ($(since))"
  timeout -k 5 60 python3 moe_gpu_nccl.py --tokens 4096 --steps 50 2>&1 | grep -Ev "^\s*$|Warning|warn\(" | tail -8
fi
echo "== done in $(since)"
