#!/usr/bin/env bash
# Builds libfabric from source (a release tag) with only the providers fabric uses on a
# machine without RDMA hardware: tcp (with ofi_rxm), shm, and udp (with ofi_rxd, which the
# backend's own tests use). The result goes to
# target/libfabric-<tag>/ (git-ignored); the script ends by printing the environment that
# builds and runs fabric against it. CI does not use this: it builds against the
# distribution's libfabric (1.17 on Debian 12). See docs/faults.md ("libfabric versions").
#
#   scripts/libfabric-source.sh TAG [SOURCE]
#
#   TAG     a libfabric release tag, e.g. v2.6.0 or v1.17.0
#   SOURCE  a libfabric source folder (an unpacked release or a checkout at TAG), or a git
#           repository or bare mirror of libfabric, from which TAG is exported into
#           /work/build/libfabric-src-TAG (LIBFABRIC_SRC_DIR overrides the folder).
#           Default: /work/.mirror/ofiwg+libfabric/repo.
#
# Environment: JOBS (make -j, default 2), NICE (default 15), PROVIDERS (default
# "tcp rxm shm udp rxd"), LIBFABRIC_PREFIX (default <repo>/target/libfabric-TAG), CUDA_HOME
# (--with-cuda=CUDA_HOME --enable-cuda-dlopen when CUDA_HOME/include/cuda.h exists;
# otherwise --without-cuda).
# Needs a C toolchain and autoconf, automake and libtool (apt-get install -y autoconf
# automake libtool) for a git source, which has no configure script yet.
set -euo pipefail

tag="${1:?usage: $0 TAG [SOURCE]}"
source="${2:-/work/.mirror/ofiwg+libfabric/repo}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${LIBFABRIC_PREFIX:-$repo_root/target/libfabric-$tag}"
jobs="${JOBS:-2}"
nice_level="${NICE:-15}"
providers="${PROVIDERS:-tcp rxm shm udp rxd}"

# A git repository or bare mirror: export the tag into a folder of its own, outside this repo.
if [ -f "$source/configure.ac" ]; then
    src="$source"
else
    gitdir="$source"
    [ -d "$source/.git" ] && gitdir="$source/.git"
    git --git-dir="$gitdir" rev-parse --verify -q "$tag^{commit}" >/dev/null \
        || { echo "$source is neither a libfabric source folder nor a repository with tag $tag" >&2; exit 1; }
    src="${LIBFABRIC_SRC_DIR:-/work/build/libfabric-src-$tag}"
    if [ ! -f "$src/configure.ac" ]; then
        echo "exporting $tag from $gitdir into $src" >&2
        mkdir -p "$src"
        git --git-dir="$gitdir" archive "$tag" | tar -x -C "$src"
    fi
fi
[ -f "$src/configure.ac" ] || { echo "$src is not a libfabric source folder" >&2; exit 1; }
case "$src/" in
    "$repo_root"/*) echo "refusing to build inside the repository ($src): use a folder outside it" >&2; exit 1 ;;
esac

# With CUDA, libfabric loads libcuda and libcudart at run time (--enable-cuda-dlopen): only
# the headers are needed to build (a CUDA toolkit, or the include/ folder of the
# nvidia-cuda-runtime wheel), and the result runs on machines with and without a GPU.
cuda_opt=--without-cuda
if [ -n "${CUDA_HOME:-}" ] && [ -f "$CUDA_HOME/include/cuda.h" ]; then
    cuda_opt="--with-cuda=$CUDA_HOME --enable-cuda-dlopen"
elif [ -f /usr/local/cuda/include/cuda.h ]; then
    cuda_opt="--with-cuda=/usr/local/cuda --enable-cuda-dlopen"
fi

enable=()
for p in $providers; do enable+=("--enable-$p"); done

start=$(date +%s)
cd "$src"
if [ ! -x configure ]; then
    for t in autoreconf libtoolize automake; do
        command -v "$t" >/dev/null || { echo "$t missing: apt-get install -y autoconf automake libtool" >&2; exit 1; }
    done
    nice -n "$nice_level" ./autogen.sh >&2
fi
# A folder configured before (maybe with other providers): start clean, since the build
# does no dependency tracking.
if [ -f Makefile ]; then nice -n "$nice_level" make -s distclean >&2 || true; fi
# --enable-only: every provider not named is left out (verbs, efa, psm*, sockets, udp,
# hooks...), which keeps the build to a few minutes on two cores.
nice -n "$nice_level" ./configure --prefix="$prefix" --enable-only "${enable[@]}" \
    $cuda_opt --disable-static --disable-dependency-tracking -q >&2
# Everything but the environment lines below goes to stderr: `eval "$(scripts/...)"` works.
nice -n "$nice_level" make -j"$jobs" -s >&2
nice -n "$nice_level" make -s install >&2
end=$(date +%s)

echo "libfabric $tag installed in $prefix ($((end - start)) s; providers: $providers; $cuda_opt)" >&2
"$prefix/bin/fi_info" --version >&2 || true
cat <<EOF
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
export LD_LIBRARY_PATH=$prefix/lib
# and a target folder of its own, so the 1.17 build is kept:
export CARGO_TARGET_DIR=$repo_root/target/lf-$tag
EOF
