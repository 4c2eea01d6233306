#!/bin/bash
# Builds what scripts/moe-gpu-run.sh needs, stripped, into $CARGO_TARGET_DIR/ship-moe
# (target/ship-moe by default): the moe_gpu test binary, the moe_gpu example, the NCCL
# baseline script and the run script, and fabric-bench (`./fabric-bench moe` there runs the
# benchmark's rows; it finds moe_gpu_nccl.py beside it). Carry that folder to the GPU machine
# and run ./moe-gpu-run.sh there.
set -eu
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-target}
out=$T/ship-moe
bin=$(cargo test -p integration-tests --test moe_gpu --release --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "moe_gpu" and m.get("executable"):
        print(m["executable"])')
cargo build --release -p fabric-examples --example moe_gpu
cargo build --release -p fabric-bench
rm -rf "$out"
mkdir -p "$out"
strip -o "$out/moe_gpu_test" "$bin"
strip -o "$out/moe_gpu" "$T/release/examples/moe_gpu"
strip -o "$out/fabric-bench" "$T/release/fabric-bench"
cp examples/moe_gpu_nccl.py scripts/moe-gpu-run.sh "$out/"
ls -la "$out"
