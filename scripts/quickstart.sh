#!/usr/bin/env bash
# The main job: install what is needed, then move real bytes between two processes over
# libfabric's tcp provider on loopback. Extra arguments go to the example
# (for example: --provider shm --size 256).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo run --release --example quickstart -- "$@"
