#!/usr/bin/env bash
# The Python package's tests (python/tests): a venv in target/pyenv with maturin, pytest and
# numpy from PyPI, a debug build of the extension installed in it (`maturin develop`, which
# shares target/debug with cargo), then pytest: two processes over tcp and shm, counters,
# cancellation, timeouts, errors, a killed peer, buffer lifetimes, and the examples on host
# memory. Called by scripts/test.sh; runs alone too (after scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
export FI_TCP_IFACE=lo
venv="$PWD/target/pyenv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2" pytest numpy
VIRTUAL_ENV="$venv" "$venv/bin/maturin" develop -q -m python/Cargo.toml
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
