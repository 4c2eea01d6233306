#!/usr/bin/env bash
# The NIXL backend plugin's tests (fabric-c/nixl/tests), driven through NIXL's own Python API:
# a venv in target/nixl-venv with nixl-cu13 1.4.1, pytest and numpy from PyPI, the plugin built
# by fabric-c/nixl/build.sh into target/nixl-plugin/libplugin_FABRIC.so, then pytest: two agents
# in two processes over loopback, every byte checked, notifications counted, a killed peer,
# requests released in flight, agents made and torn down again, transfers inside one agent,
# and GPU memory where torch sees a GPU. NIXL_TEST_BACKENDS picks the backends, each
# BACKEND[:tcp|shm] (default FABRIC; UCX while build.sh does not exist), e.g. "FABRIC,UCX".
# Without NIXL's headers ($NIXL_PREFIX/include, $NIXL_SRC, or the NIXL 1.4.1 header tree that
# CI's machine keeps beside the repository, ../shared/nixl-1.4.1) it prints one "skipped: "
# line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
export FI_TCP_IFACE=lo
# The headers the plugin builds against: a NIXL install ($NIXL_PREFIX) or NIXL's source tree
# ($NIXL_SRC for build.sh).
if [ -n "${NIXL_PREFIX:-}" ] && [ -f "$NIXL_PREFIX/include/nixl.h" ]; then
  :
elif [ -n "${NIXL_SRC:-}" ] && [ -f "$NIXL_SRC/src/api/cpp/nixl.h" ]; then
  :
elif [ -f ../shared/nixl-1.4.1/src/api/cpp/nixl.h ]; then
  export NIXL_SRC="${NIXL_SRC:-$(cd ../shared/nixl-1.4.1 && pwd)}"
else
  echo "skipped: the NIXL plugin tests: NIXL's headers not found (\$NIXL_PREFIX/include/nixl.h, \$NIXL_SRC/src/api/cpp/nixl.h or ../shared/nixl-1.4.1/src/api/cpp/nixl.h)"
  exit 0
fi
venv="$PWD/target/nixl-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
# nixl-cu13 requires torch (5 GB with its CUDA libraries), which only the VRAM tests use:
# installed without it, and torch added where nvidia-smi sees a GPU.
"${pip[@]}" pytest numpy
"${pip[@]}" --no-deps nixl-cu13==1.4.1
if nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" torch || echo "torch not installed: the VRAM tests will skip"
fi
plugin=target/nixl-plugin/libplugin_FABRIC.so
# A debug build: after scripts/test.sh's cargo test the libraries are built already (release
# for figures: NIXL_PLUGIN_PROFILE=release, or fabric-c/nixl/build.sh alone).
if [ "${NIXL_PLUGIN_PROFILE:-debug}" = release ]; then
  bash fabric-c/nixl/build.sh
else
  bash fabric-c/nixl/build.sh --debug
fi
if [ -f "$plugin" ]; then
  backends=${NIXL_TEST_BACKENDS:-FABRIC}
else
  echo "no $plugin (fabric-c/nixl/build.sh missing or skipped): testing NIXL's UCX backend only"
  backends=${NIXL_TEST_BACKENDS:-UCX}
fi
NIXL_TEST_BACKENDS=$backends "$venv/bin/python" -m pytest -q -rfEs -p no:cacheprovider fabric-c/nixl/tests
