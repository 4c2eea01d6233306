#!/usr/bin/env bash
# Prepares, on the dev machine, everything the NIXL plugin's GPU runs need on a GPU machine that
# has Python 3.12 with torch and numpy, the system's libfabric 1.17, a CUDA 13 driver and
# toolkit, but no network, no pip and no cargo (scripts/nixl-gpu-run.sh runs it there):
#
#   site/                  NIXL 1.4.1 (the nixl-cu13 wheel for cp312), trimmed by trim-wheel.sh
#                          ($TRIM_WHEEL) to its Python package, the UCX plugin and UCX's cma and
#                          cuda modules (tcp and posix/sysv shared memory are inside libuct), the
#                          LIBFABRIC plugin, and what they link; with pytest, pluggy, iniconfig,
#                          packaging and pygments (pure Python) unpacked beside it
#   libfabric/             libfabric 2.x (v2.6.0 built here: providers tcp, rxm, shm; CUDA by
#                          dlopen when CUDA headers are found) and Debian's libhwloc.so.15, which
#                          the wheel's libplugin_LIBFABRIC.so needs (it wants fi_getinfo@FABRIC_1.7:
#                          libfabric >= 1.21, which 1.17 lacks); libfabric/fallback/libudev.so.1
#                          for a machine without one (libhwloc links it); fi_info
#   libplugin_FABRIC.so    fabric-c/nixl/build.sh's release build, stripped
#   fabric-bench           the release binary, stripped
#   MANIFEST               what is inside, sizes, versions
#
# These 55-70 MiB (the plugin's size varies with the build) do not fit the device's carry
# limit beside anything else, so target/ship-nixl/ holds them as one xz tarball (bundle.tar.xz,
# ~11-14 MiB) plus MANIFEST; scripts/nixl-gpu-run.sh unpacks it in place on first use (so run
# this script again before carrying if the run script has run here). The unpacked tree is also
# kept in target/ship-nixl-tree/ (not carried) for inspection.
#
# libfabric 2.x has the soname libfabric.so.1, as 1.17 has: one process cannot hold both.
# FABRIC's plugin and fabric-bench link the system's 1.17, so only the processes of the
# LIBFABRIC backend get libfabric/ on LD_LIBRARY_PATH (scripts/nixl-gpu-run.sh).
#
#   usage: scripts/nixl-gpu-ship.sh [--no-build] [--python 3.12]
#     --no-build    take target/nixl-plugin/libplugin_FABRIC.so and target/release/fabric-bench
#                   as they are (default: build both, release)
#     --python X.Y  the CPython the wheel is for (3.12 for the GPU machine; 3.11 to try the run
#                   script on this machine)
#   then carry target/ship-nixl and run scripts/nixl-gpu-run.sh on the GPU machine.
#
# Environment: NIXL_SRC (NIXL's source tree for build.sh's headers; default
# /work/shared/nixl-1.4.1), TRIM_WHEEL, LIBFABRIC_TAG (v2.6.0), LIBFABRIC_SRC_DIR (where the
# tag is exported and built; default /work/build/libfabric-src-TAG-ship-nixl), CUDA_HOME (a
# folder whose include/ has cuda.h, cuda_runtime.h, crt/host_config.h and nvml.h; default:
# /usr/local/cuda if complete, else assembled from the nvidia-cuda-runtime, nvidia-cuda-crt
# and nvidia-nvml-dev 13.0 wheels into target/ship-nixl-cuda; NO_CUDA=1 builds libfabric
# without CUDA), JOBS, SHIP_MAX_MIB (55).
# Downloads (pip download, apt-get download) are cached in target/ship-nixl-wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export PATH="$HOME/.cargo/bin:$PATH"
py=3.12 build=1
while [ $# -gt 0 ]; do
  case $1 in
    --no-build) build=0 ;;
    --python) py=$2; shift ;;
    *) echo "usage: $0 [--no-build] [--python 3.12]" >&2; exit 2 ;;
  esac
  shift
done
die() { echo "nixl-gpu-ship: FAILED: $*" >&2; exit 1; }
note() { echo "nixl-gpu-ship: $*" >&2; }

trim=${TRIM_WHEEL:-/work/shared/tools/trim-wheel.sh}
[ -f "$trim" ] || die "$trim not found (set TRIM_WHEEL)"
nixl_src=${NIXL_SRC:-/work/shared/nixl-1.4.1}
lf_tag=${LIBFABRIC_TAG:-v2.6.0}
max_mib=${SHIP_MAX_MIB:-55}
nixl_ver=1.4.1
tag=cp${py/./}
wheels=target/ship-nixl-wheels
tree=target/ship-nixl-tree
ship=target/ship-nixl
mkdir -p "$wheels"

pipdl() { # pipdl DEST ARGS...: binary wheels for CPython $py, manylinux x86_64
  local d=$1; shift
  pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$py" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$d" "$@"
}

# ---- NIXL's wheel, trimmed ---------------------------------------------------------------------
whl=$(ls "$wheels"/nixl_cu13-$nixl_ver-"$tag"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  pipdl "$wheels" --no-deps "nixl-cu13==$nixl_ver"
  whl=$(ls "$wheels"/nixl_cu13-$nixl_ver-"$tag"-*.whl | head -1)
fi
rm -rf "$tree"
mkdir -p "$tree/libfabric/fallback"
ucx=nixl_cu13.libs/ucx
# Which UCX modules the wheel has (tcp, posix and sysv shared memory are built into libuct; the
# modules are ib*, cma, cuda, ucm_cuda and perftest's): keep cma and the cuda ones.
mods=$(unzip -Z1 "$whl" "$ucx/*.so*" | sed 's|.*/||' | tr '\n' ' ')
note "UCX modules in the wheel: $mods"
entries=(nixl_cu13 .nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so
  .nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so)
for m in libuct_cma libuct_cuda libucm_cuda; do
  f=$(unzip -Z1 "$whl" "$ucx/$m.so*" 2>/dev/null | head -1 || true)
  [ -n "$f" ] || die "the wheel has no $ucx/$m.so*"
  entries+=("$f")
done
bash "$trim" "$whl" "$tree/site" "${entries[@]}" >&2
# The distribution's metadata (importlib.metadata: fabric-bench's rows say "NIXL 1.4.1").
mkdir -p "$tree/site/nixl_cu13-$nixl_ver.dist-info"
unzip -p "$whl" "nixl_cu13-$nixl_ver.dist-info/METADATA" >"$tree/site/nixl_cu13-$nixl_ver.dist-info/METADATA"

# ---- pytest and its pure-Python dependencies ---------------------------------------------------
if ! ls "$wheels"/pytest-*.whl >/dev/null 2>&1; then
  pipdl "$wheels/py$py" pytest
  mv "$wheels/py$py"/*.whl "$wheels"/ && rmdir "$wheels/py$py"
fi
for n in pytest pluggy iniconfig packaging pygments; do
  w=$(ls "$wheels"/"$n"-*-py3-none-any.whl 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$w" ] || die "no $n wheel in $wheels (remove $wheels/pytest-*.whl to fetch again)"
  unzip -q -o "$w" -d "$tree/site"
done
find "$tree/site" -name __pycache__ -prune -exec rm -rf {} +

# ---- libfabric 2.x ----------------------------------------------------------------------------
cuda_home=
if [ -z "${NO_CUDA:-}" ]; then
  has_cuda() { for h in cuda.h cuda_runtime.h crt/host_config.h nvml.h; do [ -f "$1/include/$h" ] || return 1; done; }
  if [ -n "${CUDA_HOME:-}" ]; then
    has_cuda "$CUDA_HOME" || die "CUDA_HOME=$CUDA_HOME lacks include/{cuda.h,cuda_runtime.h,crt/host_config.h,nvml.h}"
    cuda_home=$CUDA_HOME
  elif has_cuda /usr/local/cuda; then
    cuda_home=/usr/local/cuda
  else
    # CUDA 13.0's headers from PyPI: cuda.h and cuda_runtime.h (nvidia-cuda-runtime), crt/
    # (nvidia-cuda-crt), nvml.h (nvidia-nvml-dev). 13.0, the oldest CUDA 13: libfabric dlopens
    # libcudart and libcuda and looks up what the headers name, which any 13.x driver has.
    cuda_home=$root/target/ship-nixl-cuda
    if ! has_cuda "$cuda_home"; then
      mkdir -p "$wheels/cuda"
      for p in nvidia-cuda-runtime nvidia-cuda-crt nvidia-nvml-dev; do
        ls "$wheels/cuda/${p//-/_}"-13.0.*.whl >/dev/null 2>&1 || pipdl "$wheels/cuda" --no-deps "$p==13.0.*"
      done
      rm -rf "$cuda_home" && mkdir -p "$cuda_home"
      for w in "$wheels"/cuda/*.whl; do unzip -q -o "$w" 'nvidia/cu13/include/*' -d "$cuda_home/w"; done
      mv "$cuda_home/w/nvidia/cu13/include" "$cuda_home/include" && rm -rf "$cuda_home/w"
      has_cuda "$cuda_home" || die "the CUDA header wheels did not give $cuda_home/include what libfabric needs"
    fi
  fi
fi
lf_prefix=$root/target/ship-nixl-libfabric-$lf_tag
want="tag=$lf_tag providers=tcp,rxm,shm cuda=${cuda_home:-none}"
if [ ! -f "$lf_prefix/lib/libfabric.so.1" ] || [ "$(cat "$lf_prefix/.ship-nixl" 2>/dev/null)" != "$want" ]; then
  for t in autoreconf libtoolize automake; do
    command -v $t >/dev/null || die "$t missing: apt-get install -y autoconf automake libtool"
  done
  rm -rf "$lf_prefix"
  note "building libfabric $lf_tag into $lf_prefix ($want): a few minutes"
  CUDA_HOME=$cuda_home PROVIDERS="tcp rxm shm" JOBS=${JOBS:-$(nproc)} LIBFABRIC_PREFIX=$lf_prefix \
    LIBFABRIC_SRC_DIR=${LIBFABRIC_SRC_DIR:-/work/build/libfabric-src-$lf_tag-ship-nixl} \
    bash scripts/libfabric-source.sh "$lf_tag" >/dev/null
  echo "$want" >"$lf_prefix/.ship-nixl"
fi
[ -z "$cuda_home" ] && note "WARNING: libfabric $lf_tag built WITHOUT CUDA: NIXL's LIBFABRIC backend will have no VRAM"
# Providers are built into libfabric.so (no lib/libfabric/*-fi.so with --enable-only).
strip --strip-unneeded -o "$tree/libfabric/libfabric.so.1" "$(readlink -f "$lf_prefix/lib/libfabric.so.1")"
strip -o "$tree/libfabric/fi_info" "$lf_prefix/bin/fi_info"
deb=$(ls "$wheels"/libhwloc15_*.deb 2>/dev/null | head -1 || true)
if [ -z "$deb" ]; then
  (cd "$wheels" && apt-get download libhwloc15 >/dev/null 2>&1) || die "apt-get download libhwloc15 failed"
  deb=$(ls "$wheels"/libhwloc15_*.deb | head -1)
fi
rm -rf "$wheels/hwloc" && dpkg-deb -x "$deb" "$wheels/hwloc"
strip --strip-unneeded -o "$tree/libfabric/libhwloc.so.15" "$(readlink -f "$(ls "$wheels"/hwloc/usr/lib/*/libhwloc.so.15)")"
strip --strip-unneeded -o "$tree/libfabric/fallback/libudev.so.1" "$(readlink -f /lib/x86_64-linux-gnu/libudev.so.1)"

# ---- our plugin and fabric-bench ------------------------------------------------------------
if [ "$build" = 1 ]; then
  [ -f "$nixl_src/src/api/cpp/backend/backend_plugin.h" ] || die "no NIXL headers in $nixl_src (set NIXL_SRC)"
  NIXL_SRC=$nixl_src nice bash fabric-c/nixl/build.sh >&2
  nice cargo build --release -q -p fabric-bench
fi
[ -f target/nixl-plugin/libplugin_FABRIC.so ] || die "no target/nixl-plugin/libplugin_FABRIC.so"
[ -f target/release/fabric-bench ] || die "no target/release/fabric-bench"
# Fully stripped: the dynamic symbol table stays, and with it nixl_plugin_init/fini.
strip -o "$tree/libplugin_FABRIC.so" target/nixl-plugin/libplugin_FABRIC.so
nm -D --defined-only "$tree/libplugin_FABRIC.so" | grep ' T nixl_plugin_init$' >/dev/null \
  || die "the stripped plugin does not export nixl_plugin_init"
strip -o "$tree/fabric-bench" target/release/fabric-bench

# ---- checks: what each piece resolves to ---------------------------------------------------
plugins=$tree/site/.nixl_cu13.mesonpy.libs/plugins
lfdir=$root/$tree/libfabric
soname() { readelf -d "$1" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'; }
sys_lf=$(ldconfig -p | awk '!f && /libfabric\.so\.1 /{print $NF; f=1}')
note "libfabric sonames: $lf_tag $(soname "$tree/libfabric/libfabric.so.1"), system $(soname "$(readlink -f "$sys_lf")") ($(readlink -f "$sys_lf"))"
objdump -T "$tree/libfabric/libfabric.so.1" | grep -E '\(?FABRIC_1\.7\)? +fi_getinfo$' >/dev/null || die "libfabric $lf_tag has no fi_getinfo@FABRIC_1.7"
need=$(objdump -T "$plugins/libplugin_LIBFABRIC.so" | grep -o '(FABRIC_[0-9.]*)' | sort -uV | tr -d '()' | tr '\n' ' ')
note "libplugin_LIBFABRIC.so needs libfabric symbol versions: $need"
# With libfabric/ on LD_LIBRARY_PATH, the LIBFABRIC plugin lacks only CUDA's libraries.
miss=$(LD_LIBRARY_PATH=$lfdir ldd "$plugins/libplugin_LIBFABRIC.so" | awk '/not found/{print $1}' | sort | tr '\n' ' ')
[ "$miss" = "libcuda.so.1 libcudart.so.13 " ] || die "libplugin_LIBFABRIC.so with LD_LIBRARY_PATH=libfabric/ misses: $miss"
LD_LIBRARY_PATH=$lfdir ldd "$plugins/libplugin_LIBFABRIC.so" | grep "libfabric.so.1 => $lfdir/libfabric.so.1" >/dev/null \
  || die "libplugin_LIBFABRIC.so does not resolve libfabric.so.1 to $lfdir"
# Without it, it would get the system's 1.17 and fail on FABRIC_1.7 (what the run script avoids).
for f in "$tree/libplugin_FABRIC.so" "$tree/fabric-bench" "$tree/libfabric/fi_info"; do
  miss=$(LD_LIBRARY_PATH=$( [ "$f" = "$tree/libfabric/fi_info" ] && echo "$lfdir") ldd "$f" | awk '/not found/{print $1}' | tr '\n' ' ')
  [ -z "$miss" ] || die "$f misses: $miss"
done
ldd "$tree/libplugin_FABRIC.so" | grep "libfabric.so.1 => $(dirname "$sys_lf")" >/dev/null || die "libplugin_FABRIC.so does not take the system's libfabric"
for f in "$plugins/libplugin_UCX.so" "$tree"/site/nixl_cu13.libs/ucx/*.so.*; do
  miss=$(ldd "$f" | awk '/not found/{print $1}' | grep -Ev '^(libcuda\.so\.1|libcudart\.so\.13|libnvidia-ml\.so\.1)$' | tr '\n' ' ' || true)
  [ -z "$miss" ] || die "$f misses: $miss"
done
glibc=$(find "$tree" -name '*.so*' -o -name fabric-bench -o -name fi_info | xargs objdump -T 2>/dev/null \
  | grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1)

# ---- MANIFEST, the tarball, the size check -------------------------------------------------
{
  echo "target/ship-nixl, made $(date -u +%FT%TZ) by scripts/nixl-gpu-ship.sh on $(hostname)"
  echo "repo $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- fabric-c benches 2>/dev/null || echo ' (+ uncommitted changes in fabric-c/benches)')"
  echo "wheel $(basename "$whl") (site/: $(find "$tree/site" -type f | wc -l) files)"
  echo "pytest & co: $(cd "$tree/site" && ls -d *.dist-info | grep -v nixl | sed 's/\.dist-info//' | tr '\n' ' ')"
  echo "libfabric $lf_tag ($want), soname $(soname "$tree/libfabric/libfabric.so.1"); libhwloc $(basename "$deb")"
  echo "newest glibc symbol needed: $glibc"
  echo
  (cd "$tree" && find . -type f ! -name MANIFEST -printf '%s %P\n' | sort -k2 | awk '{printf "%10d %s\n", $1, $2}')
} >"$tree/MANIFEST"
rm -rf "$ship" && mkdir -p "$ship"
cp "$tree/MANIFEST" "$ship/MANIFEST"
tar -C "$tree" -cf - . | xz -9e -T"${JOBS:-$(nproc)}" >"$ship/bundle.tar.xz"
sha256sum "$ship/bundle.tar.xz" | cut -d' ' -f1 >"$ship/bundle.sha256"

mib() { echo "$(( ($1 + 1048575) / 1048576 ))"; }
sz() { du -sb "$1" | cut -f1; }
echo "unpacked: $(mib "$(sz "$tree")") MiB: site $(mib "$(sz "$tree/site")"), libfabric $(mib "$(sz "$tree/libfabric")"), libplugin_FABRIC.so $(mib "$(sz "$tree/libplugin_FABRIC.so")"), fabric-bench $(mib "$(sz "$tree/fabric-bench")") (newest glibc symbol: $glibc)"
total=$(sz "$ship")
echo "carry $ship: $(mib "$total") MiB ($total bytes; the bundle xz-packed, unpacked by scripts/nixl-gpu-run.sh)"
if [ "$total" -gt $((max_mib * 1048576)) ]; then
  echo "nixl-gpu-ship: FAILED: $ship is $(mib "$total") MiB, over the ${max_mib} MiB limit" >&2
  exit 1
fi
