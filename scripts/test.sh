#!/usr/bin/env bash
# The whole test suite: install what is needed, then the unit, integration and doc tests
# (real libfabric tcp/shm/udp on loopback) and the loom model check of the counter.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
export FI_TCP_IFACE=lo   # libfabric traffic stays on loopback
cargo test --workspace --all-targets
cargo test --workspace --doc
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release -p fabric-runtime --no-default-features --lib counter::loom_tests
