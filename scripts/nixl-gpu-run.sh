#!/usr/bin/env bash
# On a GPU machine (Python 3.12 with torch and numpy, libfabric 1.17, CUDA 13; no network, no
# pip, no cargo), from the repository root, with target/ship-nixl carried (made on the dev
# machine by scripts/nixl-gpu-ship.sh): the NIXL plugin's tests, NIXL's FABRIC, UCX and
# LIBFABRIC backends side by side (benches/nixl/compare.py), and fabric-bench's bw rows beside
# NIXL (UCX).
#
#   usage: scripts/nixl-gpu-run.sh [probe] [tests] [compare] [bench]     (default: all four)
#
#   probe     per backend, in a process of its own: does NIXL list it, load it, make it
#   tests     python3 -m pytest -q fabric-c/nixl/tests, NIXL_TEST_BACKENDS (default FABRIC;
#             VRAM tests run where torch sees a GPU)
#   compare   benches/nixl/compare.py: DRAM over tcp and shm, VRAM over cuda_ipc, then VRAM over
#             tcp; $COMPARE_ARGS replaces "--sizes 64K,1M,16M --seconds 0.25"
#   bench     fabric-bench bw --quick --peer nixl: host over tcp, then GPU over shm
#
# Each step's output goes to $OUT/<step>.log (the device tool's folder) when OUT is set, else
# to target/ship-nixl-out/, and to the terminal. Time limits (s): T_PROBE 30 (per backend),
# T_TESTS 180, T_COMPARE 240, T_BENCH 60 (host) and 2 x T_BENCH (GPU), and the whole run stops
# starting commands after RUN_BUDGET (560) s and cuts the last one short, so that a device
# call of 600 s ends with its logs.
#
# libfabric: the wheel's libplugin_LIBFABRIC.so needs libfabric >= 1.21 (fi_getinfo@FABRIC_1.7),
# shipped as target/ship-nixl/libfabric/ (2.6.0); our libplugin_FABRIC.so and fabric-bench link
# the system's 1.17. Both have the soname libfabric.so.1, and a process holds one library of a
# soname: so libfabric/ goes on LD_LIBRARY_PATH only for the LIBFABRIC backend's processes:
#   - compare.py: NIXL_COMPARE_ENV_LIBFABRIC="LD_LIBRARY_PATH=... FI_TCP_IFACE=eth0" (KEY=VALUE
#     words, for that backend's peer processes: LD_LIBRARY_PATH goes before theirs, the rest
#     replaces what they would set); a compare.py that does not read NIXL_COMPARE_ENV_* is run
#     twice instead: FABRIC,UCX, then LIBFABRIC alone with these set in its environment (its
#     driving process never loads NIXL, only its peers do)
#   - tests: LIBFABRIC entries of NIXL_TEST_BACKENDS run in a pytest of their own, likewise
# and NIXL 1.4.1's LIBFABRIC backend over tcp needs an interface other than lo (see below).
set -u
cd "$(dirname "$0")/.."
root=$PWD
d=target/ship-nixl
py=${FABRIC_PYTHON:-python3}
out=${OUT:-$root/target/ship-nixl-out}
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(probe tests compare bench)
for s in "${steps[@]}"; do
  case $s in probe|tests|compare|bench) ;; *) echo "usage: $0 [probe] [tests] [compare] [bench]" >&2; exit 2 ;; esac
done
t0=$(date +%s)
budget=${RUN_BUDGET:-560}
el() { echo "$(( $(date +%s) - t0 )) s"; }

# ---- unpack the bundle (once per bundle) -----------------------------------------------------
[ -f "$d/bundle.tar.xz" ] || { echo "no $d/bundle.tar.xz: run scripts/nixl-gpu-ship.sh on the dev machine and carry $d" >&2; exit 1; }
if [ "$(cat "$d/.unpacked" 2>/dev/null)" != "$(cat "$d/bundle.sha256")" ] || [ ! -x "$d/fabric-bench" ]; then
  rm -rf "$d/site" "$d/libfabric" "$d/libplugin_FABRIC.so" "$d/fabric-bench"
  if ! tar -C "$d" -xJf "$d/bundle.tar.xz" 2>/dev/null; then
    "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$d/bundle.tar.xz" "$d" \
      || { echo "could not unpack $d/bundle.tar.xz" >&2; exit 1; }
  fi
  cp "$d/bundle.sha256" "$d/.unpacked"
  echo "unpacked $d/bundle.tar.xz ($(du -sh "$d" | cut -f1))"
fi

# ---- the environment ---------------------------------------------------------------------------
site=$root/$d/site
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export NIXL_FABRIC_PLUGIN=$root/$d/libplugin_FABRIC.so   # the tests' and compare.py's FABRIC plugin
export FI_TCP_IFACE=lo
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
wheel_libs=$site/.nixl_cu13.mesonpy.libs:$site/nixl_cu13.libs
has_lib() { ldconfig -p 2>/dev/null | grep "^[[:space:]]*$1 " >/dev/null; }
# The LIBFABRIC backend's libraries: libfabric 2.6.0 and libhwloc; libudev where the machine has
# none; libcudart.so.13 where the loader does not find it (torch's own, else the toolkit's).
lf=$root/$d/libfabric
has_lib libudev.so.1 || lf=$lf:$root/$d/libfabric/fallback
cudart=
if ! has_lib libcudart.so.13; then
  for c in $("$py" -c 'import importlib.util as u
s = u.find_spec("nvidia")
print(*(s.submodule_search_locations or []) if s else "")' 2>/dev/null); do
    for f in "$c"/cu13/lib/libcudart.so.13 "$c"/cuda_runtime/lib/libcudart.so.13; do
      [ -f "$f" ] && { cudart=$(dirname "$f"); break 2; }
    done
  done
  if [ -z "$cudart" ]; then
    for c in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64; do
      [ -f "$c/libcudart.so.13" ] && { cudart=$c; break; }
    done
  fi
  [ -n "$cudart" ] && lf=$lf:$cudart
fi
# NIXL 1.4.1's LIBFABRIC backend cannot use tcp on the loopback interface: with FI_TCP_IFACE=lo
# (or a machine with lo only) libfabric's tcp lists a generic domain "tcp" (FI_SOCKADDR_IP),
# which NIXL's topology takes as its device, and fi_enable fails ("Unsupported address format",
# EBADF). Traffic goes to loopback or to addresses of a network namespace of our own only: the
# compare and LIBFABRIC test steps run inside a namespace made here, with lo and a dummy
# interface fab0 (10.77.0.1/24) that LIBFABRIC's processes use; FABRIC and UCX stay on that
# namespace's lo. Where no namespace can be made, LIBFABRIC's rows are skipped.
ns=() iface=
if ip netns add fabric-nixl-$$ 2>/dev/null; then
  trap_ns() { ip netns delete "fabric-nixl-$$" 2>/dev/null || true; }
  if ip netns exec "fabric-nixl-$$" sh -c 'ip link set lo up && ip link add fab0 type dummy &&
       ip addr add 10.77.0.1/24 dev fab0 && ip link set fab0 up' 2>/dev/null; then
    ns=(ip netns exec "fabric-nixl-$$") iface=fab0
  fi
else
  trap_ns() { :; }
fi
export NIXL_COMPARE_ENV_LIBFABRIC="LD_LIBRARY_PATH=$lf${iface:+ NIXL_LIBFABRIC_IFACE=$iface}"
# A plugin folder with all three (the tests and compare.py make their own the same way).
tmp=$(mktemp -d "${TMPDIR:-/tmp}/nixl-gpu-run-XXXXXX")
trap 'rm -rf "$tmp"; trap_ns' EXIT
pdir=$tmp/plugins
mkdir "$pdir"
ln -s "$NIXL_FABRIC_PLUGIN" "$pdir/libplugin_FABRIC.so"
for b in UCX LIBFABRIC; do ln -s "$site/.nixl_cu13.mesonpy.libs/plugins/libplugin_$b.so" "$pdir/"; done
# probe.py BACKEND: an agent with BACKEND alone; why not, where it cannot be made.
cat >"$tmp/probe.py" <<'EOF'
import ctypes, os, sys
from nixl_cu13._api import nixl_agent, nixl_agent_config
b = sys.argv[1]
a = nixl_agent("probe-" + b, nixl_agent_config(backends=[]))
print(b, "listed" if b in a.get_plugin_list() else f"NOT listed ({a.get_plugin_list()})", end="; ")
try:
    a.create_backend(b, {"provider": "tcp"} if b == "FABRIC" else {})
    print("made; memory types", a.get_backend_mem_types(b), "; params", a.get_backend_params(b))
except Exception as e:
    try:
        ctypes.CDLL(os.path.join(os.environ["NIXL_PLUGIN_DIR"], f"libplugin_{b}.so"))
        why = ""
    except OSError as e2:
        why = f"; dlopen: {e2}"
    print(f"NOT made: {e}{why}")
    sys.exit(1)
os._exit(0)
EOF

run() { # run STEP TIMEOUT CMD...: the command's output to the terminal and $out/STEP.log
  local step=$1 lim=$2 left; shift 2
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 15 ]; then
    echo "== $step: not run: the run's budget of $budget s is spent: $*" | tee -a "$out/$step.log"
    return 124
  fi
  [ "$lim" -gt "$left" ] && lim=$left
  echo "== $step ($(el), at most $lim s): $*" | tee -a "$out/$step.log"
  timeout -k 10 "$lim" "$@" 2>&1 | tee -a "$out/$step.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "== $step: TIMED OUT after $lim s" | tee -a "$out/$step.log"
  echo "== $step: rc $rc ($(el))" | tee -a "$out/$step.log"
  return "$rc"
}

{
  echo "== $(date -u +%FT%TZ) on $(hostname); $(head -1 "$d/MANIFEST")"
  sed -n 2,6p "$d/MANIFEST"
  nvidia-smi -L 2>&1 | head -4
  "$py" -c 'import sys, numpy, torch; print("python", sys.version.split()[0], "numpy", numpy.__version__,
  "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), "GPUs")' 2>&1 | tail -1
  echo "libfabric: system $(ldconfig -p | awk '!f && /libfabric\.so\.1 /{print $NF; f=1}') (FABRIC, fabric-bench); LIBFABRIC backend: $NIXL_COMPARE_ENV_LIBFABRIC"
  [ -n "$iface" ] && echo "LIBFABRIC: in network namespace ${ns[3]} on its dummy interface $iface" \
    || echo "LIBFABRIC: no network namespace could be made (ip netns): its rows are skipped"
  has_lib libcudart.so.13 && echo "libcudart.so.13: found by the loader" || echo "libcudart.so.13: ${cudart:-NOT FOUND (the LIBFABRIC plugin will not load)}"
  has_lib libcuda.so.1 || echo "libcuda.so.1: not in ldconfig's cache (the driver's library)"
} 2>&1 | tee "$out/env.log"

rc_all=0
for step in "${steps[@]}"; do
  rc=0
  case $step in
  probe)
    for b in FABRIC UCX LIBFABRIC; do
      penv=(NIXL_PLUGIN_DIR="$pdir" LD_LIBRARY_PATH="$wheel_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        UCX_MODULES=^ib UCX_NET_DEVICES=lo UCX_TLS=tcp,self)
      if [ $b = LIBFABRIC ]; then
        [ -n "$iface" ] || continue
        penv+=(FI_PROVIDER=tcp FI_TCP_IFACE="$iface" LD_LIBRARY_PATH="$lf:$wheel_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
        run probe "${T_PROBE:-30}" "${ns[@]}" env "${penv[@]}" "$py" "$tmp/probe.py" $b || rc=1
      else
        run probe "${T_PROBE:-30}" env "${penv[@]}" "$py" "$tmp/probe.py" $b || rc=1
      fi
    done
    echo "LIBFABRIC plugin, as its processes resolve it:" | tee -a "$out/probe.log"
    LD_LIBRARY_PATH=$lf ldd "$site/.nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so" \
      | grep -E 'libfabric|hwloc|udev|cuda|not found' | tee -a "$out/probe.log"
    ;;
  tests)
    specs=${NIXL_TEST_BACKENDS:-FABRIC}
    lfs=$(echo "$specs" | tr ',' '\n' | grep -E '^ *LIBFABRIC' | paste -sd, -)
    rest=$(echo "$specs" | tr ',' '\n' | grep -vE '^ *LIBFABRIC|^ *$' | paste -sd, -)
    if [ -n "$rest" ]; then
      NIXL_TEST_BACKENDS=$rest run tests "${T_TESTS:-180}" "$py" -m pytest -q -p no:cacheprovider fabric-c/nixl/tests || rc=$?
    fi
    if [ -n "$lfs" ] && [ -n "$iface" ]; then
      NIXL_TEST_BACKENDS=$lfs LD_LIBRARY_PATH=$lf${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} NIXL_LIBFABRIC_IFACE=$iface \
        run tests "${T_TESTS:-180}" "${ns[@]}" "$py" -m pytest -q -p no:cacheprovider fabric-c/nixl/tests || rc=$?
    fi
    ;;
  compare)
    # shellcheck disable=SC2206
    cargs=(${COMPARE_ARGS:---sizes 64K,1M,16M --seconds 0.25})
    T=${T_COMPARE:-240}
    gpu=0; nvidia-smi -L >/dev/null 2>&1 && gpu=1
    # NIXL 1.4.1's LIBFABRIC backend has no shm (its topology knows network providers only:
    # "No network devices found"), and compare.py's cuda_ipc is shm for it: its rows there
    # skip. GPU memory over tcp (FI_HMEM with CUDA) is one more group, for all three.
    run compare "$(( gpu ? T * 3 / 4 : T ))" "${ns[@]}" "$py" benches/nixl/compare.py "${cargs[@]}" --json "$out/compare.json" || rc=$?
    [ $gpu = 1 ] && { run compare "$(( T / 4 ))" "${ns[@]}" "$py" benches/nixl/compare.py "${cargs[@]}" --mem VRAM --transports tcp \
      --json "$out/compare-vram-tcp.json" || rc=$?; }
    ;;
  bench)
    # NIXL here is its UCX backend, found through PYTHONPATH (peers.py; the wheel's own plugin
    # folder, so no NIXL_PLUGIN_DIR).
    run bench "${T_BENCH:-60}" "$d/fabric-bench" bw --quick --provider tcp --buffer hot --peer nixl \
      --json "$out/bench-tcp-host.json" --plot "$out/bw-tcp.png" || rc=$?
    if nvidia-smi -L >/dev/null 2>&1; then
      FABRIC_REQUIRE_CUDA=1 run bench "$(( ${T_BENCH:-60} * 2 ))" "$d/fabric-bench" bw --quick --provider shm --location cuda \
        --buffer hot --peer nixl --json "$out/bench-shm-cuda.json" --plot "$out/bw-shm-cuda.png" || rc=$?
    else
      echo "bench: no GPU (nvidia-smi -L fails): no --location cuda run" | tee -a "$out/bench.log"
    fi
    ;;
  esac
  [ "$rc" = 0 ] || rc_all=1
done
echo "== done in $(el): ${steps[*]} (logs in $out); rc $rc_all"
exit $rc_all
