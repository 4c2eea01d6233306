#!/usr/bin/env bash
# Installs what fabric needs on Debian/Ubuntu: libfabric (headers + tools), and clang for
# bindgen. Runs apt-get only when something is missing. Needs root (or sudo).
set -euo pipefail
pkgs=(libfabric-dev libfabric-bin pkg-config libclang-dev clang)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust first (https://rustup.rs)" >&2
  exit 1
fi
pkg-config --atleast-version=1.17 libfabric || { echo "libfabric >= 1.17 is required" >&2; exit 1; }
