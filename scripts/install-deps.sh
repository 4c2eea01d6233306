#!/usr/bin/env bash
# Installs what fabric needs on Debian/Ubuntu: libfabric (headers + tools), libibverbs and
# librdmacm (headers + user-space providers), clang for bindgen, iperf3 (a benchmark
# baseline), protoc (etcd-client generates its gRPC code at build time) and etcd-server (the
# EtcdStore test starts a real etcd), and python3 with venv (the Python package's tests
# build it into a virtual environment, scripts/python-tests.sh), and g++ (fabric-moe/emu runs
# the GPU kernels as C++ on the CPU, in CI). Runs apt-get only when
# something is missing. Needs root (or sudo).
set -euo pipefail
pkgs=(libfabric-dev libfabric-bin iperf3 libibverbs-dev librdmacm-dev ibverbs-providers pkg-config libclang-dev clang
      protobuf-compiler etcd-server python3 python3-venv g++)
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null; then
  echo "cargo not found: installing Rust with rustup"
  command -v curl >/dev/null || { $SUDO apt-get install -y -qq curl ca-certificates; }
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  echo "Rust installed: open a new shell (or 'source \$HOME/.cargo/env') to use cargo directly"
fi
pkg-config --atleast-version=1.17 libfabric || { echo "libfabric >= 1.17 is required" >&2; exit 1; }
