#!/bin/bash
# Device run of the GPUDirect path through libfabric (docs/gpu.md "GPUDirect through
# libfabric"): the GPU tests against a libfabric built --with-cuda (scripts/libfabric-source.sh
# with CUDA_HOME set), loaded through LD_LIBRARY_PATH, with FABRIC_LIBFABRIC_HMEM=1 (the
# engine asks for FI_HMEM and registers CUDA memory with fi_mr_regattr). From a folder holding
# this script and, built on a dev machine:
#   gpu          (cargo test -p integration-tests --test gpu --release --no-run: gpu-<hash>)
#   lf/          (the libfabric install: lib/libfabric.so.1, bin/fi_info)
#   fabric-bench (optional: cargo build --release -p fabric-bench; SKIP_BENCH=1 leaves it out)
# libfabric 1.17 dlopens "libcudart.so" and "libcuda.so" by those names: a folder of links to
# the machine's versioned libraries is made here and put on LD_LIBRARY_PATH.
set -u
cd "$(dirname "$0")"
export FI_TCP_IFACE=lo FABRIC_REQUIRE_CUDA=1
links="$PWD/cuda-links"
mkdir -p "$links"
cudart=$(ls /usr/local/cuda/lib64/libcudart.so* 2>/dev/null | sort | tail -1)
[ -z "$cudart" ] && cudart=$(python3 -c 'import nvidia.cuda_runtime, os, glob; d=os.path.dirname(nvidia.cuda_runtime.__file__); print(sorted(glob.glob(d+"/lib/libcudart.so*"))[-1])' 2>/dev/null)
cuda=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
echo "libcudart: ${cudart:-none}; libcuda: ${cuda:-none}"
[ -n "$cudart" ] && ln -sf "$cudart" "$links/libcudart.so"
[ -n "$cuda" ] && ln -sf "$cuda" "$links/libcuda.so"
export LD_LIBRARY_PATH="$PWD/lf/lib:$links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi -L 2>&1 | head -4
n=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$n" -ge 2 ] && export FABRIC_REQUIRE_GPUS=2
echo "== libfabric: $(lf/bin/fi_info --version | head -1); loaded by the tests: $(ldd ./gpu | awk '/libfabric/{print $3}')"
# The providers that offer FI_HMEM here: the tests expect their GPU regions registered with
# the NIC (GpuDirect), the others staged.
expect=""
for p in shm tcp; do
  fp=$p; [ $p = tcp ] && fp="tcp;ofi_rxm"
  if lf/bin/fi_info -p "$fp" -c FI_HMEM >/dev/null 2>&1; then expect="$expect${expect:+,}$p"; fi
done
echo "-- providers offering FI_HMEM: ${expect:-none}"
echo "== gpu tests, FABRIC_LIBFABRIC_HMEM=1 (GPU regions registered with libfabric)"
FABRIC_LIBFABRIC_HMEM=1 FABRIC_EXPECT_GPUDIRECT=$expect timeout 300 ./gpu --test-threads 1 \
  --skip gpu_throughput_report --skip gpu_ipc_breakdown 2>&1 \
  | grep -E "^test |panicked|GB/s|writes in|test result|Error|error|left:|right:" \
  | grep -v "_child" | head -80
if [ -x ./fabric-bench ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench: GPU0 -> GPU1 staged, GPUDirect (FI_HMEM) and CUDA IPC over shm, window 16"
  timeout 240 ./fabric-bench bw --location cuda --provider shm --sizes 64K,1M,4M,16M,64M --window 16 2>&1 \
    | grep -E "GPU->GPU|GPUDirect|skipped" | grep -v "per gate" | head -40
fi
