#!/usr/bin/env bash
# Makes target/ship-py/ (git-ignored) for scripts/python-gpu-run.sh on a GPU machine that
# has Python >= 3.11, torch and numpy but no cargo and no network:
#   wheel/    the extension, release, abi3 (one wheel for CPython 3.11 and later)
#   wheels/   pytest and its dependencies (pure Python, resolved for CPython 3.12)
#   fabric-bench, site/   copied from FABRIC_BENCH=path and NIXL_SITE=path when given
#             (a release `fabric-bench`; the trimmed nixl-cu13 folder of
#             scripts/gpu-peers-fetch.sh)
# Needs scripts/python-tests.sh's venv (target/pyenv, with maturin) or makes it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
ship=target/ship-py
venv=$PWD/target/pyenv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2"
rm -rf "$ship/wheel" "$ship/wheels"
mkdir -p "$ship/wheel" "$ship/wheels"
# --auditwheel skip: the wheel links the machine's own libfabric and ibverbs (never bundled).
VIRTUAL_ENV="$venv" "$venv/bin/maturin" build --release --strip --auditwheel skip -m python/Cargo.toml -o "$ship/wheel"
"$venv/bin/pip" download -q --disable-pip-version-check -d "$ship/wheels" --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 pytest
if [ -n "${FABRIC_BENCH:-}" ]; then cp "$FABRIC_BENCH" "$ship/fabric-bench"; fi
if [ -n "${NIXL_SITE:-}" ]; then rm -rf "$ship/site" && cp -r "$NIXL_SITE" "$ship/site"; fi
ls -l "$ship/wheel" "$ship/wheels"
du -sh "$ship"
