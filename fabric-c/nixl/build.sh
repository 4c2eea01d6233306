#!/usr/bin/env bash
# Builds the NIXL backend plugin: target/nixl-plugin/libplugin_FABRIC.so, fabric's C API
# (libfabric_c.a, release) linked in, so the plugin is one file to put in NIXL_PLUGIN_DIR.
# Needs NIXL's C++ headers: $NIXL_PREFIX/include (a NIXL install), else NIXL's source tree
# in $NIXL_SRC (its src/ folder holds api/cpp, core, utils). Without either it prints one
# "skipped:" line and exits 0. Usage: fabric-c/nixl/build.sh [--debug]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
export PATH="$HOME/.cargo/bin:$PATH"
profile=release
[ "${1:-}" = --debug ] && profile=debug

inc=()
if [ -n "${NIXL_PREFIX:-}" ] && [ -f "$NIXL_PREFIX/include/backend/backend_plugin.h" ]; then
  inc=(-I"$NIXL_PREFIX/include" -I"$NIXL_PREFIX/include/backend")
elif [ -n "${NIXL_SRC:-}" ] && [ -f "$NIXL_SRC/src/api/cpp/backend/backend_plugin.h" ]; then
  s="$NIXL_SRC/src"
  inc=(-I"$s/api/cpp" -I"$s/api/cpp/backend" -I"$s/core/telemetry" -I"$s/core" -I"$s/utils")
else
  echo "skipped: the NIXL plugin needs NIXL's C++ headers: set NIXL_PREFIX (a NIXL install) or NIXL_SRC (NIXL's source tree)"
  exit 0
fi

if [ "$profile" = release ]; then
  cargo build --release --workspace --lib -q
else
  cargo build --workspace --lib -q
fi
lib="target/$profile/libfabric_c.a"
out="target/nixl-plugin"
mkdir -p "$out"
# Our common/nixl_log.h first (NIXL's needs Abseil); only nixl_plugin_init/fini exported,
# the C API's symbols kept inside (a process may hold another copy of fabric).
g++ -std=c++20 -O2 -g -fPIC -shared -fvisibility=hidden \
  -I fabric-c/nixl/include "${inc[@]}" -I fabric-c/include \
  -o "$out/libplugin_FABRIC.so" fabric-c/nixl/fabric_backend.cpp \
  -Wl,--exclude-libs,ALL "$lib" \
  $(pkg-config --libs libfabric) -libverbs -lrdmacm -lpthread -ldl -lm
echo "built $out/libplugin_FABRIC.so"
