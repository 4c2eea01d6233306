#!/bin/bash
# Runs fabric-moe's kernels on the CPU (no GPU, no CUDA toolkit: a C++20 compiler): the
# PTX helpers of ../src/kernels/ (globaltimer, acquire loads, release stores) are swapped for
# host equivalents, everything else is compiled as written against shim.h, and main.cpp
# checks dispatch and combine of several steps. What it cannot check: the GPU's memory
# model across NVLink, CUDA IPC, launches. Usage: fabric-moe/emu/run.sh
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The parts in the order kernels.rs concatenates them.
k=$here/../src/kernels
cat "$k/common.cu" "$k/dispatch.cu" "$k/combine.cu" "$k/misc.cu" > "$work/kernels.cu"
python3 - "$work/kernels.cu" "$work/kernels_emu.h" <<'PY'
import sys
src = open(sys.argv[1]).read()
def replace_body(signature, body):
    global src
    i = src.index(signature)
    j = src.index("{", i)
    depth, k = 0, j
    while True:
        depth += {"{": 1, "}": -1}.get(src[k], 0)
        if depth == 0:
            break
        k += 1
    src = src[:j] + "{" + body + "}" + src[k + 1:]
replace_body("__device__ __forceinline__ u64 now_ns()",
             " return std::chrono::duration_cast<std::chrono::nanoseconds>("
             "std::chrono::steady_clock::now().time_since_epoch()).count(); ")
replace_body("__device__ __forceinline__ u64 ld_acquire_sys(const u64* p)", " return __atomic_load_n(p, __ATOMIC_ACQUIRE); ")
replace_body("__device__ __forceinline__ void st_release_sys(u64* p, u64 v)", " __atomic_store_n(p, v, __ATOMIC_RELEASE); ")
replace_body("__device__ __forceinline__ u64 ld_acquire_gpu(const u64* p)", " return __atomic_load_n(p, __ATOMIC_ACQUIRE); ")
replace_body("__device__ __forceinline__ void st_release_gpu(u64* p, u64 v)", " __atomic_store_n(p, v, __ATOMIC_RELEASE); ")
import re; src = re.sub(r"#pragma unroll( [0-9]+)?", "", src).replace('extern "C" __global__', "__global__")
# Each __shared__ declaration becomes a reference to its block's storage (shim.h).
src = re.sub(r"__shared__\s+(\w+)\s+(\w+)((?:\[[^\]]+\])*)\s*;",
             lambda m: f"auto& {m[2]} = emu_shared<{m[1]}{m[3]}, __COUNTER__>();", src)
assert "__shared__" not in src, "a __shared__ declaration run.sh cannot rewrite"
open(sys.argv[2], "w").write('#include "shim.h"\n' + src)
PY
cp "$here/shim.h" "$here/main.cpp" "$work/"
${CXX:-g++} -std=c++20 -O1 -pthread -o "$work/emu" "$work/main.cpp"
"$work/emu"
