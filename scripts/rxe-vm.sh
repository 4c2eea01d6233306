#!/usr/bin/env bash
# rxe-vm.sh: run a command against a REAL software RDMA device (Soft-RoCE, rdma_rxe) inside a
# throw-away qemu VM. The development/CI kernel has no InfiniBand support, but Debian's own
# kernel package does: we boot that kernel (unpacked, never installed on the host) under qemu
# TCG with a tiny busybox initramfs, create rxe0 and rxe1 on the VM's two virtio NICs (eth0,
# eth1: an engine with two domains gets one device per domain), and run the command in
# a chroot of the HOST root file system (shared read-only over virtio-9p, tmpfs overlay on top),
# so host-built binaries run unchanged at their host paths. Recipe and measured facts:
# shared/docs/TESTBEDS.md section 2; usage: docs/testbed-rxe.md.
#
# Subcommands
#   rxe-vm.sh setup
#       Idempotent. Installs the Debian packages that are missing, downloads and unpacks the
#       kernel package that linux-image-amd64 depends on, extracts vmlinux, collects the
#       modules and builds the initramfs. Cache: $RXE_VM_DIR (default <repo>/target/rxe-vm),
#       one folder per kernel version; the initramfs is rebuilt when this script changes.
#   rxe-vm.sh run [--timeout SECS] -- CMD [ARGS...]
#       Boots one VM, runs CMD inside (same working directory, selected environment, rxe0 and
#       rxe1 ACTIVE, `ulimit -l unlimited`), streams its stdout+stderr (merged) to our stdout
#       and exits with CMD's exit code. Runs `setup` first if the cache is missing.
#   rxe-vm.sh selftest [--timeout SECS]
#       One VM: shows rxe0 and rxe1 with their RoCEv2 IPv4 GIDs, runs perftest ib_write_bw
#       (64 KiB) over loopback QPs on each device and ib_write_lat (2 B) on rxe0, then the
#       command in $FABRIC_SELFTEST_THEN if set (same VM). Ends with "1 passed, 0 failed" or
#       fails.
#   rxe-vm.sh cargo-runner BINARY [ARGS...]
#       Same as `run -- BINARY ARGS...`, for cargo's runner setting: one VM per test binary:
#         cargo test --config 'target.x86_64-unknown-linux-gnu.runner="scripts/rxe-vm.sh cargo-runner"'
#
# Exit codes of run/cargo-runner: CMD's own code; 124 if the host-side timeout fired (qemu is
# killed); 97 if the VM could not boot, the modules could not load or rxe0 or rxe1 could not be
# created or did not become ACTIVE (a clear message and the tail of the guest console follow on
# stderr). Never "skipped".
#
# Environment
#   RXE_VM_DIR        cache folder (default <repo>/target/rxe-vm)
#   RXE_VM_TIMEOUT    default for --timeout, seconds (default 600)
#   RXE_VM_BOOT_LIMIT seconds for a guest to reach its /init (default 120); one that does not
#                     is killed and booted again, up to 3 boots, then exit 97
#   RXE_VM_PASS_ENV   extra variable names (space or comma separated) passed into the guest.
#                     Always passed: PATH HOME USER LANG LC_ALL TERM RUST_* FABRIC_* FI_* IBV_*
#                     RDMAV_* CARGO_MANIFEST_DIR CARGO_PKG_NAME CARGO_TARGET_TMPDIR.
#   RXE_VM_KEEP=1     keep the per-run folder (console.log, out.log, job.sh) and print its path
#   RXE_VM_QUIET=1    no summary line on stderr
#   RXE_VM_APPEND     extra kernel command line (e.g. "loglevel=7" to see the boot in console.log)
# Inside the guest these are set:
#   RXE_VM_GUEST=1
#   RXE_VM_DEVICE=rxe0              RXE_VM_GUEST_IP=10.0.2.15   (eth0, /24: rxe0's address)
#   RXE_VM_DEVICES="rxe0 rxe1"      RXE_VM_GUEST_IPS="10.0.2.15 10.0.3.15"
#                                   (same order: rxe1 sits on eth1, 10.0.3.15/24)
# Pick GIDs by type/address, never by a hard-coded index.
#
# Network: one qemu user-mode network per NIC (10.0.2.0/24 and 10.0.3.0/24), each with
# restrict=on and no host forwards, so no packet can leave the VM; the RDMA traffic is each
# device talking to its own address (loopback QPs on rxe0, loopback QPs on rxe1). A QP on rxe0
# and one on rxe1 do NOT connect (ibv_modify_qp to RTR fails with ETIMEDOUT): pair QPs on the
# same device only.
# Writes inside the guest go to a tmpfs overlay and are discarded when the VM exits.
set -euo pipefail

SCRIPT_PATH=$(readlink -f "${BASH_SOURCE[0]}")
REPO_ROOT=$(cd "$(dirname "$SCRIPT_PATH")/.." && pwd)
RXE_VM_DIR=${RXE_VM_DIR:-$REPO_ROOT/target/rxe-vm}

# Host packages (the guest runs the host's own binaries and libraries through the chroot).
PKGS=(qemu-system-x86 busybox-static rdma-core ibverbs-utils ibverbs-providers libibverbs-dev
      librdmacm-dev rdmacm-utils perftest iproute2 cpio kmod xz-utils)
# Guest modules; their dependencies are added in load order by `modprobe --show-depends`.
# crc32_generic: rxe needs a crc32 implementation when the device is created.
KMODS=(virtio_pci virtio_net virtio_console 9pnet_virtio 9p overlay crc32_generic
       udp_tunnel ip6_udp_tunnel ib_core ib_uverbs rdma_rxe rdma_ucm)
# The guest's NICs, their addresses (each qemu user-net's default guest address, net/24) and
# the Soft-RoCE device on each, by position: rxe0 on eth0 (10.0.2.15), rxe1 on eth1 (10.0.3.15).
# GUEST_IP (rxe0's) stays the primary address: RXE_VM_GUEST_IP predates the second device.
NETDEVS=(eth0 eth1)
GUEST_IPS=(10.0.2.15 10.0.3.15)
RXE_DEVS=(rxe0 rxe1)
GUEST_IP=${GUEST_IPS[0]}
INFRA_FAIL=97

log() { echo "rxe-vm: $*" >&2; }
die() { echo "rxe-vm: ERROR: $*" >&2; exit "$INFRA_FAIL"; }
usage_err() { echo "rxe-vm: usage: $*" >&2; exit 2; }

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------

ensure_packages() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
  fi
}

# Prints the concrete kernel package, e.g. linux-image-6.1.0-28-amd64.
resolve_kernel_pkg() {
  local pkg
  pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
        awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }') || true
  if [ -z "$pkg" ]; then   # no package lists yet
    $SUDO apt-get update -qq >&2
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
          awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }') || true
  fi
  [ -n "$pkg" ] || die "cannot resolve the kernel package that linux-image-amd64 depends on"
  echo "$pkg"
}

# Unpacks the kernel package into $1/root (once per kernel version) and runs depmod there.
unpack_kernel() {
  local kdir=$1 kpkg=$2 kv=$3 deb
  [ -f "$kdir/.unpacked" ] && return 0
  log "downloading and unpacking $kpkg (not installed on the host)"
  rm -rf "$kdir/root" "$kdir/deb"
  mkdir -p "$kdir/deb"
  (cd "$kdir/deb" && apt-get download -qq -o APT::Sandbox::User=root "$kpkg" >&2) || die "apt-get download $kpkg failed"
  deb=$(ls "$kdir"/deb/*.deb)
  dpkg-deb -x "$deb" "$kdir/root"
  rm -rf "$kdir/deb"
  [ -d "$kdir/root/lib/modules/$kv" ] || die "no lib/modules/$kv in $kpkg"
  # The package ships no modules.dep (its postinst makes it): make it in the scratch root.
  depmod -b "$kdir/root" "$kv" 2>/dev/null
  touch "$kdir/.unpacked"
}

# vmlinuz is a bzImage wrapping an xz stream; the uncompressed ELF vmlinux boots through its PVH
# entry and saves ~5 s of in-guest decompression under TCG. Falls back to vmlinuz on failure.
extract_vmlinux() {
  local kdir=$1 kv=$2 vmlinuz off
  vmlinuz="$kdir/root/boot/vmlinuz-$kv"
  [ -f "$vmlinuz" ] || die "no boot/vmlinuz-$kv in the kernel package"
  [ -s "$kdir/vmlinux" ] || [ -f "$kdir/.no-vmlinux" ] || {
    off=$(LC_ALL=C grep -obUaP -m1 '\xFD7zXZ\x00' "$vmlinuz" 2>/dev/null | head -n1 | cut -d: -f1) || true
    if [ -n "$off" ] &&
       { tail -c +"$((off + 1))" "$vmlinuz" || true; } | xz -dc --single-stream > "$kdir/vmlinux.tmp" 2>/dev/null &&
       [ "$(head -c4 "$kdir/vmlinux.tmp" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then
      mv "$kdir/vmlinux.tmp" "$kdir/vmlinux"
    else
      log "could not extract vmlinux from vmlinuz; will boot vmlinuz (about 5 s slower)"
      rm -f "$kdir/vmlinux.tmp"; touch "$kdir/.no-vmlinux"
    fi
  }
  if [ -s "$kdir/vmlinux" ]; then echo "$kdir/vmlinux"; else echo "$vmlinuz"; fi > "$kdir/kernel.path"
}

# The guest's PID 1. Busybox only until the chroot; reports through the `ctl` 9p share:
#   ctl/status = "exit RC READY_UPTIME END_UPTIME" | "fail REASON".
# Keep it free of fork-heavy loops: every exec is slow under TCG.
write_init() {
  cat > "$1" <<'INIT'
#!/bin/busybox sh
# PID 1 of the rxe test VM (generated by scripts/rxe-vm.sh; do not edit here).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
say() { read -r up _ < /proc/uptime; echo "rxe-vm-guest [${up}s]: $*" > /dev/console; }
CTL=0
finish() {  # $1: status line for the host
  say "$1"
  if [ "$CTL" = 1 ]; then echo "$1" > /mnt/ctl/status; sync; umount /mnt/ctl; fi
  poweroff -f
}
fail() { finish "fail $*"; }

# Modules in dependency order (see /modules.order); a failure is reported, later checks decide.
while read -r m; do
  insmod "/lib/modules/$m" || say "insmod $m failed"
done < /modules.order

say "modules loaded"
# Control share first, so that every later failure reaches the host. Each 9p tag mounts once.
mount -t 9p -o trans=virtio,version=9p2000.L ctl /mnt/ctl && CTL=1 || fail "mount of the ctl share"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /mnt/host ||
  fail "mount of the host root over 9p"
mount -t tmpfs -o mode=0755 tmpfs /mnt/rw || fail "tmpfs"
mkdir -p /mnt/rw/upper /mnt/rw/work
mount -t overlay overlay -o lowerdir=/mnt/host,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work /mnt/root ||
  fail "overlay mount"
R=/mnt/root
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm $R/run/rxe-vm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount --bind /mnt/ctl $R/run/rxe-vm

# One Soft-RoCE device per NIC. @LINKS@ is "DEV:NETDEV:ADDR ..." (rxe0:eth0:10.0.2.15
# rxe1:eth1:10.0.3.15). The address goes on first, so each device's GID table gets its RoCEv2
# IPv4 GID as soon as it exists.
ip link set lo up
DEVS=""
CMDS=""
for l in @LINKS@; do
  dev=${l%%:*}; rest=${l#*:}; nd=${rest%%:*}; addr=${rest#*:}
  ip link set "$nd" up || fail "no $nd (virtio_net): the NIC for $dev is missing"
  ip addr add "$addr/24" dev "$nd" || fail "ip addr add $addr/24 dev $nd"
  DEVS="$DEVS $dev"
  CMDS="${CMDS}link add $dev type rxe netdev $nd
"
done
# All devices with ONE run of the host's iproute2 `rdma` (batch mode, stops at the first error):
# each exec of a dynamic binary costs up to a second under TCG on a loaded host. Its error
# message goes to the console; the first device that is missing names the failed command.
echo "$CMDS" | PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot $R rdma -b - > /dev/console 2>&1
for l in @LINKS@; do
  dev=${l%%:*}; rest=${l#*:}; nd=${rest%%:*}
  [ -d /sys/class/infiniband/$dev ] || fail "rdma link add $dev type rxe netdev $nd"
done
# Every port ACTIVE; the devices come up concurrently, so the later ones are usually ready by
# the time the first is.
for dev in $DEVS; do
  state=""
  for i in 1 2 3 4 5 6 7 8 9 10; do
    read -r state < /sys/class/infiniband/$dev/ports/1/state || state=""
    case "$state" in *ACTIVE*) break ;; esac
    sleep 0.5
  done
  case "$state" in *ACTIVE*) ;; *) fail "$dev port 1 not ACTIVE (state: $state)" ;; esac
done
read -r ready _ < /proc/uptime
say "$DEVS ACTIVE at ${ready}s"

# The job's output goes to the virtio-serial port named rxe-vm.out (a host file).
out=""
for p in /sys/class/virtio-ports/*; do
  read -r n < "$p/name" && [ "$n" = rxe-vm.out ] && out="/dev/${p##*/}"
done
[ -n "$out" ] && [ -c "$out" ] || fail "no virtio-serial port rxe-vm.out for the job's output"
chroot $R /bin/bash /run/rxe-vm/job.sh > "$out" 2>&1 < /dev/null
rc=$?
read -r end _ < /proc/uptime
finish "exit $rc $ready $end"
INIT
  local links="" i
  for i in "${!RXE_DEVS[@]}"; do links+="${links:+ }${RXE_DEVS[i]}:${NETDEVS[i]}:${GUEST_IPS[i]}"; done
  sed -i "s/@LINKS@/$links/g" "$1"
  chmod 755 "$1"
}

# The initramfs cache key: kernel version + hash of this script (which generates /init).
initramfs_stamp() { echo "$1 $(sha256sum < "$SCRIPT_PATH" | cut -c1-16)"; }

build_initramfs() {
  local kdir=$1 kv=$2 stamp ir n=0 m line path base deps
  stamp=$(initramfs_stamp "$kv")
  [ -s "$kdir/initramfs.cpio.gz" ] && [ "$(cat "$kdir/initramfs.stamp" 2>/dev/null)" = "$stamp" ] && return 0
  log "building the initramfs for $kv"
  ir="$kdir/initramfs.d"
  rm -rf "$ir"
  mkdir -p "$ir"/{bin,dev,proc,sys,tmp,lib/modules,mnt/ctl,mnt/host,mnt/rw,mnt/root}
  cp /bin/busybox "$ir/bin/busybox"
  # Modules with their dependencies, in load order, de-duplicated; decompressed for insmod.
  declare -A seen=()
  : > "$ir/modules.order"
  for m in "${KMODS[@]}"; do
    deps=$(modprobe -d "$kdir/root" -S "$kv" --show-depends "$m" 2>&1) ||
      die "module $m not found for $kv: $deps"
    while read -r line; do
      case "$line" in
        insmod\ *) path=$(awk '{print $2}' <<< "$line") ;;
        *) continue ;;   # "builtin X": nothing to load
      esac
      [ -n "${seen[$path]:-}" ] && continue
      seen[$path]=1
      n=$((n + 1))
      base=$(basename "$path"); base=${base%.xz}; base=${base%.zst}; base=${base%.gz}
      base=$(printf '%02d-%s' "$n" "$base")
      case "$path" in
        *.xz) xz -dc "$path" > "$ir/lib/modules/$base" ;;
        *.zst) zstd -qdc "$path" > "$ir/lib/modules/$base" ;;
        *.gz) gzip -dc "$path" > "$ir/lib/modules/$base" ;;
        *) cp "$path" "$ir/lib/modules/$base" ;;
      esac
      echo "$base" >> "$ir/modules.order"
    done <<< "$deps"
  done
  write_init "$ir/init"
  (cd "$ir" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) | gzip -1 > "$kdir/initramfs.cpio.gz.tmp"
  mv "$kdir/initramfs.cpio.gz.tmp" "$kdir/initramfs.cpio.gz"
  echo "$stamp" > "$kdir/initramfs.stamp"
  log "modules: $(tr '\n' ' ' < "$ir/modules.order")"
}

# Serialises setup/rebuilds between concurrent invocations (e.g. parallel CI jobs).
lock_cache() {
  mkdir -p "$RXE_VM_DIR"
  exec {LOCK_FD}> "$RXE_VM_DIR/.lock"
  flock -w 900 "$LOCK_FD" || die "could not lock $RXE_VM_DIR/.lock"
}

cmd_setup() {
  local kpkg kv kdir
  lock_cache
  ensure_packages
  [ -x /bin/busybox ] && /bin/busybox true ||
    die "/bin/busybox missing (busybox-static)"
  kpkg=$(resolve_kernel_pkg)
  kv=${kpkg#linux-image-}
  kdir="$RXE_VM_DIR/$kv"
  mkdir -p "$kdir"
  unpack_kernel "$kdir" "$kpkg" "$kv"
  extract_vmlinux "$kdir" "$kv"
  build_initramfs "$kdir" "$kv"
  echo "$kv" > "$RXE_VM_DIR/current"
  log "ready: kernel $kv, $(cat "$kdir/kernel.path"), cache $RXE_VM_DIR"
}

# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

# True if the variable $1 is to be passed into the guest.
pass_var() {
  case "$1" in
    PATH|HOME|USER|LANG|LC_ALL|TERM|CARGO_MANIFEST_DIR|CARGO_PKG_NAME|CARGO_TARGET_TMPDIR) return 0 ;;
    RUST_*|FABRIC_*|FI_*|IBV_*|RDMAV_*) return 0 ;;
  esac
  local extra=" ${RXE_VM_PASS_ENV:-} "; extra=${extra//,/ }
  [[ "$extra" == *" $1 "* ]]
}

# Writes the job script run by the guest's bash inside the chroot.
write_job() {
  local job=$1 name; shift
  {
    echo "# generated by scripts/rxe-vm.sh"
    printf 'cd -- %q || { echo "rxe-vm: cannot cd to %q in the guest" >&2; exit 125; }\n' "$PWD" "$PWD"
    while read -r name; do
      pass_var "$name" && printf 'export %s=%q\n' "$name" "${!name}"
    done < <(compgen -e)
    echo "export RXE_VM_GUEST=1 RXE_VM_DEVICE=${RXE_DEVS[0]} RXE_VM_GUEST_IP=$GUEST_IP"
    echo "export RXE_VM_DEVICES='${RXE_DEVS[*]}' RXE_VM_GUEST_IPS='${GUEST_IPS[*]}'"
    echo 'ulimit -l unlimited || echo "rxe-vm: ulimit -l unlimited failed" >&2'
    printf 'exec'; printf ' %q' "$@"; printf '\n'
  } > "$job"
}

cmd_run() {
  local timeout=${RXE_VM_TIMEOUT:-600}
  while (($#)); do
    case "$1" in
      --timeout) timeout=${2:?--timeout needs seconds}; shift 2 ;;
      --timeout=*) timeout=${1#--timeout=}; shift ;;
      --) shift; break ;;
      *) usage_err "run [--timeout SECS] -- CMD [ARGS...] (unexpected '$1')" ;;
    esac
  done
  (($#)) || usage_err "run [--timeout SECS] -- CMD [ARGS...] (no command)"
  [[ "$timeout" =~ ^[0-9]+$ ]] || usage_err "--timeout SECS: not a number of seconds: $timeout"

  local kv kdir kernel
  if [ ! -s "$RXE_VM_DIR/current" ]; then
    log "no VM cache in $RXE_VM_DIR: running setup first"
    cmd_setup
  else
    ensure_packages   # cheap when all are there; the guest runs the host's rdma-core etc.
  fi
  kv=$(cat "$RXE_VM_DIR/current")
  kdir="$RXE_VM_DIR/$kv"
  # This script changed since the initramfs was built (its /init is generated here): rebuild.
  if [ "$(cat "$kdir/initramfs.stamp" 2>/dev/null)" != "$(initramfs_stamp "$kv")" ]; then
    lock_cache
    build_initramfs "$kdir" "$kv"   # returns at once if another invocation just rebuilt it
    flock -u "$LOCK_FD"
  fi
  kernel=$(cat "$kdir/kernel.path" 2>/dev/null) || true
  [ -s "$kernel" ] && [ -s "$kdir/initramfs.cpio.gz" ] || die "VM cache incomplete: run '$0 setup'"
  command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing: run '$0 setup'"

  # Per-run folder: shared read-write with the guest as 9p tag `ctl`.
  CTL_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm.XXXXXX")
  trap 'cleanup_run' EXIT
  write_job "$CTL_DIR/job.sh" "$@"
  : > "$CTL_DIR/out.log"

  # One NIC per device, each on its own user-net (restrict=on, no forwards: nothing leaves the
  # VM) whose subnet holds the guest's address. The MACs are qemu's default sequence written out,
  # so that they (and the link-local GIDs derived from them) are known and distinct.
  local nic_args=() i
  for i in "${!NETDEVS[@]}"; do
    nic_args+=(-netdev "user,id=n$i,restrict=on,net=${GUEST_IPS[i]%.*}.0/24"
               -device "virtio-net-pci,netdev=n$i,mac=52:54:00:12:34:$((56 + i)),romfile=")
  done
  local t0 t1 qrc=0 status="" tail_pid watch_pid attempt
  local boot_limit=${RXE_VM_BOOT_LIMIT:-120}
  [[ "$boot_limit" =~ ^[0-9]+$ ]] && ((boot_limit > 0)) ||
    die "RXE_VM_BOOT_LIMIT: not a whole number of seconds above 0: $boot_limit"
  for attempt in 1 2 3; do
    qrc=0
    rm -f "$CTL_DIR/status" "$CTL_DIR/boot-hang"
    : > "$CTL_DIR/out.log"
    : > "$CTL_DIR/console.log"
    t0=$(date +%s.%N)
    # Hard host-side limit: timeout kills qemu (TERM, then KILL 5 s later).
    timeout --kill-after=5 "$timeout" qemu-system-x86_64 \
      -accel tcg,thread=multi,tb-size=512 -cpu max -machine q35 -m 2G -smp 2 \
      -nographic -nodefaults -no-reboot -monitor none \
      -serial "file:$CTL_DIR/console.log" \
      -kernel "$kernel" -initrd "$kdir/initramfs.cpio.gz" \
      -append "console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init ${RXE_VM_APPEND:-}" \
      "${nic_args[@]}" \
      -virtfs local,path=/,mount_tag=hostroot,readonly=on,security_model=none,multidevs=remap \
      -virtfs "local,path=$CTL_DIR,mount_tag=ctl,security_model=none" \
      -device virtio-serial-pci \
      -chardev "file,id=jobout,path=$CTL_DIR/out.log" \
      -device virtserialport,chardev=jobout,name=rxe-vm.out \
      < /dev/null > "$CTL_DIR/qemu.log" 2>&1 &
    QEMU_PID=$!
    # Boot watchdog: the guest's /init says "rxe-vm-guest [...]" on the console within seconds
    # (3-4 s of uptime here). A guest that never gets there (seen once in CI: the console
    # stopped at SeaBIOS's "Booting from ROM..", and the run sat out its whole timeout) is
    # killed after RXE_VM_BOOT_LIMIT seconds and booted again; the job has not started then.
    (
      for ((i = 0; i < boot_limit * 5; i++)); do
        grep -q "rxe-vm-guest" "$CTL_DIR/console.log" 2>/dev/null && exit 0
        kill -0 "$QEMU_PID" 2>/dev/null || exit 0
        sleep 0.2
      done
      touch "$CTL_DIR/boot-hang"
      kill "$QEMU_PID" 2>/dev/null
    ) &
    watch_pid=$!
    # Stream the job's output while the VM runs; tail reads the rest once qemu has exited.
    tail -n +1 -s 0.2 -F --pid="$QEMU_PID" "$CTL_DIR/out.log" 2>/dev/null &
    tail_pid=$!
    wait "$QEMU_PID" || qrc=$?
    QEMU_PID=""
    wait "$tail_pid" || true
    kill "$watch_pid" 2>/dev/null || true
    wait "$watch_pid" 2>/dev/null || true
    t1=$(date +%s.%N)
    status=$(cat "$CTL_DIR/status" 2>/dev/null) || true
    [ -e "$CTL_DIR/boot-hang" ] || break
    log "the guest did not reach its /init within ${boot_limit}s (attempt $attempt of 3; qemu rc $qrc)"
    show_console
    if ((attempt == 3)); then
      RUN_RC=$INFRA_FAIL; return
    fi
    log "booting the VM again"
  done

  local total
  total=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if [ "$qrc" -eq 124 ] || [ "$qrc" -eq 137 ]; then
    log "TIMEOUT: the VM was killed after ${timeout}s (host-side limit); guest status: ${status:-none}"
    show_console
    RUN_RC=124; return
  fi
  case "$status" in
    exit\ *)
      local rc ready end
      read -r _ rc ready end <<< "$status"
      [ -n "${RXE_VM_QUIET:-}" ] ||
        log "exit $rc; ${RXE_DEVS[*]} ready at ${ready}s guest uptime, job ${end}s; total ${total}s wall (kernel $kv)"
      RUN_RC=$rc ;;
    fail\ *)
      log "VM setup FAILED: ${status#fail } (qemu rc $qrc, ${total}s)"
      show_console
      RUN_RC=$INFRA_FAIL ;;
    *)
      log "VM FAILED before reporting a result (qemu rc $qrc, ${total}s)"
      show_console
      RUN_RC=$INFRA_FAIL ;;
  esac
}

show_console() {
  echo "---- guest console (last 30 lines) ----" >&2
  tail -n 30 "$CTL_DIR/console.log" >&2 2>/dev/null || true
  if [ -s "$CTL_DIR/qemu.log" ]; then
    echo "---- qemu ----" >&2
    tail -n 10 "$CTL_DIR/qemu.log" >&2
  fi
  echo "----" >&2
}

cleanup_run() {
  [ -n "${QEMU_PID:-}" ] && kill "$QEMU_PID" 2>/dev/null || true
  if [ -n "${RXE_VM_KEEP:-}" ]; then
    log "kept $CTL_DIR"
  else
    rm -rf "$CTL_DIR"
  fi
}

# A self-check of the test bed, for CI: each device and its RoCEv2 IPv4 GID (its own address),
# then perftest RDMA WRITE bandwidth (64 KiB) over loopback QPs on each device and latency (2 B)
# on rxe0, all in one VM. A device that exists but cannot move data fails it.
SELFTEST_JOB=$(cat <<'JOB'
set -u
read -r -a devs <<< "$RXE_VM_DEVICES"
read -r -a ips <<< "$RXE_VM_GUEST_IPS"
((${#devs[@]} == 2 && ${#ips[@]} == 2)) ||
  { echo "expected 2 devices and 2 addresses: '$RXE_VM_DEVICES' / '$RXE_VM_GUEST_IPS'"; exit 1; }
for i in "${!devs[@]}"; do
  ibv_devinfo -d "${devs[i]}" | grep -E "hca_id|state|active_mtu|link_layer"
  rdma link show "${devs[i]}/1"
  ibv_devinfo -v -d "${devs[i]}" | grep -F "::ffff:${ips[i]}," ||
    { echo "no RoCE IPv4 GID for ${ips[i]} on ${devs[i]}"; exit 1; }
done
# Waits (up to ~20 s) until a TCP socket listens on port $1, without forking: every exec costs
# tens to hundreds of ms under TCG. Sleeps with read -t on a FIFO nobody writes.
mkfifo /tmp/rxe-selftest.fifo; exec 9<> /tmp/rxe-selftest.fifo
wait_listen() {
  local hex i local st
  printf -v hex ":%04X" "$1"
  for ((i = 0; i < 100; i++)); do
    while read -r _ local _ st _; do
      [[ $local == *"$hex" && $st == 0A ]] && return 0
    done < /proc/net/tcp
    read -t 0.2 -u 9 || true
  done
  return 1
}
# server in the background, client to the device's own address once the server listens
# (perftest's default port 18515): both QPs on the one device.
perf() {  # perf ADDR TOOL ARGS...: prints the client result, fails if either side fails
  local addr=$1; shift
  local log=/tmp/rxe-selftest-$1.log
  "$@" > "$log" 2>&1 &
  local srv=$!
  wait_listen 18515 || { echo "$1 server did not listen"; kill $srv; cat "$log"; return 1; }
  "$@" "$addr" 2>&1 || { echo "$1 client failed"; kill $srv; cat "$log"; return 1; }
  wait $srv || { echo "$1 server failed"; cat "$log"; return 1; }
}
TIMEFORMAT="(%1R s)"
# perftest calibrates the CPU clock by sampling; on a busy TCG host that can fail
# ("Correlation coefficient r^2 < 0.9") and then it prints inf, 0.00 or wrong numbers: retry,
# then only warn (the RDMA transfers themselves worked; only the clock is off).
measure() {  # measure ADDR TOOL ARGS...
  local try out
  for try in 1 2 3; do
    time out=$(perf "$@") || { echo "$out"; return 1; }
    echo "$out" | tail -n 3
    [[ "$out" == *inf* || "$out" == *Correlation* ]] || return 0
    echo "$2: clock calibration failed, numbers above are not valid (try $try of 3)"
  done
}
echo "== ${devs[0]} (${ips[0]})"
measure "${ips[0]}" ib_write_bw -d "${devs[0]}" -F -s 65536 -n 2000 || exit 1
measure "${ips[0]}" ib_write_lat -d "${devs[0]}" -F -s 2 -n 1000 || exit 1
# The second device: a shorter run, only to prove it moves data.
echo "== ${devs[1]} (${ips[1]})"
measure "${ips[1]}" ib_write_bw -d "${devs[1]}" -F -s 65536 -n 1000 || exit 1
# Anything else to measure beside perftest in this same VM (for example the quickstart over
# verbs, so both figures come from one boot).
if [ -n "${FABRIC_SELFTEST_THEN:-}" ]; then
  echo "== $FABRIC_SELFTEST_THEN"
  bash -c "$FABRIC_SELFTEST_THEN" || exit 1
fi
echo "rxe-vm selftest: 1 passed, 0 failed"
JOB
)

usage() {
  sed -n '2,/^set -euo/p' "$SCRIPT_PATH" | sed '$d; s/^# \{0,1\}//'
}

RUN_RC=0
case "${1:-}" in
  setup) shift; cmd_setup "$@" ;;
  run) shift; cmd_run "$@"; exit "$RUN_RC" ;;
  cargo-runner) shift; cmd_run -- "$@"; exit "$RUN_RC" ;;
  selftest) shift; cmd_run "$@" -- bash -o pipefail -c "$SELFTEST_JOB"; exit "$RUN_RC" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
