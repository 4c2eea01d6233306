#!/usr/bin/env bash
# Prepares, on the dev machine, what `fabric-bench bw --peer nixl,nccl` needs on a GPU machine
# that has Python 3.12 and torch but no network (docs/gpu.md, "NIXL and NCCL beside the engine"):
#
#   target/gpu-peers/site          NIXL 1.5.1 (the nixl-cu13 wheel for cp312), trimmed to its
#                                  Python package, the UCX plugin, UCX's cma (host memory between
#                                  processes) and cuda (cuda_copy, cuda_ipc) transports, and what
#                                  they link (/work/shared/tools/trim-wheel.sh), stripped
#   target/gpu-peers/fabric-bench  the release binary, stripped (when it is built; --build builds it)
#
# and, with --numpy, target/gpu-peers-numpy/site: numpy for cp312 (nixl_cu13 imports it; torch
# images have it, so only if the GPU machine lacks it). It is too large to travel in the same
# call as the rest: carry it in a call of its own first (a warm machine keeps it).
#
# NCCL needs nothing from here: it is the GPU machine's torch.distributed.
#
#   usage: scripts/gpu-peers-fetch.sh [--build] [--numpy] [--python 3.12]
#   then, on the GPU machine, from the repository root (carry target/gpu-peers):
#     scripts/gpu-peers-run.sh          or by hand:
#     PYTHONPATH=target/gpu-peers/site target/gpu-peers/fabric-bench bw --peer nixl,nccl --location cuda ...
#
# The wheels are downloaded once into target/gpu-peers-wheels (not carried). Everything is under
# target/, which git ignores.
set -euo pipefail
cd "$(dirname "$0")/.."
py=3.12 build=0 numpy=0
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=1 ;;
    --numpy) numpy=1 ;;
    --python) py=$2; shift ;;
    *) echo "usage: $0 [--build] [--numpy] [--python 3.12]" >&2; exit 2 ;;
  esac
  shift
done
trim=${TRIM_WHEEL:-/work/shared/tools/trim-wheel.sh}
[ -x "$trim" ] || [ -f "$trim" ] || { echo "$trim not found (set TRIM_WHEEL)" >&2; exit 1; }
wheels=target/gpu-peers-wheels
out=target/gpu-peers
tag=cp${py/./}
mkdir -p "$wheels"

fetch() { # fetch SPEC: the manylinux_2_28 x86_64 binary wheel of SPEC for CPython $py
  pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 "$1" -d "$wheels"
}

whl=$(ls "$wheels"/nixl_cu13-1.5.1-"$tag"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  fetch nixl-cu13==1.5.1
  whl=$(ls "$wheels"/nixl_cu13-1.5.1-"$tag"-*.whl | head -1)
fi
# Requires-Dist of nixl-cu13 1.5.1: torch (the GPU machine's; imported only for GPU memory
# and by NCCL's side) and numpy (--numpy).
unzip -p "$whl" 'nixl_cu13-1.5.1.dist-info/METADATA' | grep '^Requires-Dist' || true

rm -rf "$out/site"
# The UCX plugin NIXL loads (libnixl.so's plugins/ folder), the UCX modules for host memory
# between two processes (cma) and for GPU memory (cuda: cuda_copy, cuda_ipc; ucm_cuda's
# memory hooks); trim-wheel.sh adds every library they link (libucp, libuct, libucs, libnixl
# and its grpc/etcd/protobuf) and the .la files UCX finds its modules by.
bash "$trim" "$whl" "$out/site" nixl_cu13 \
  .nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so \
  nixl_cu13.libs/ucx/libuct_cma.so.0.0.0 \
  nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0 \
  nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0
# The distribution's metadata, so that importlib.metadata (the rows' "NIXL 1.5.1") finds it.
mkdir -p "$out/site/nixl_cu13-1.5.1.dist-info"
unzip -p "$whl" 'nixl_cu13-1.5.1.dist-info/METADATA' >"$out/site/nixl_cu13-1.5.1.dist-info/METADATA"

if [ "$numpy" = 1 ]; then
  np=$(ls "$wheels"/numpy-*-"$tag"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$np" ]; then
    fetch 'numpy<2.6'
    np=$(ls "$wheels"/numpy-*-"$tag"-*.whl | head -1)
  fi
  rm -rf target/gpu-peers-numpy/site
  mkdir -p target/gpu-peers-numpy/site
  unzip -q "$np" -d target/gpu-peers-numpy/site
  find target/gpu-peers-numpy/site -type d -name tests -prune -exec rm -rf {} +
  find target/gpu-peers-numpy/site -name '*.so*' -exec strip --strip-unneeded {} \;
  echo "numpy: $(du -sh target/gpu-peers-numpy/site | cut -f1) in target/gpu-peers-numpy/site"
fi

if [ "$build" = 1 ]; then
  nice cargo build --release -p fabric-bench
fi
if [ -f target/release/fabric-bench ]; then
  strip -o "$out/fabric-bench" target/release/fabric-bench
else
  echo "no target/release/fabric-bench: build it (--build), or bring the binary another way" >&2
fi
echo "carry target/gpu-peers: $(du -sh "$out" | cut -f1) ($(du -sh "$out/site" | cut -f1) NIXL)"
