//! The engine's few system calls: an eventfd that submitters write to wake the reactor,
//! `ppoll` for the reactor to sleep on it and the NICs' wait fds, and CPU affinity. All of
//! this module's unsafe code is here.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use crate::error::Error;

/// Runs a libc call and maps `-1` to the thread's `errno` (the `syscall!` of mio).
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: each call site states, in its own `SAFETY:` comment, why its arguments
        // satisfy the callee's contract.
        let res = unsafe { libc::$fn($($arg),*) };
        if res == -1 { Err(io::Error::last_os_error()) } else { Ok(res) }
    }};
}

/// A non-blocking eventfd: `notify` makes it readable, `drain` resets it.
#[derive(Debug)]
pub(crate) struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    pub(crate) fn new() -> Result<EventFd, Error> {
        // SAFETY: eventfd takes no pointers.
        let fd = syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)).map_err(|e| {
            Error::Provider { call: "eventfd", errno: e.raw_os_error().unwrap_or(0), message: e.to_string() }
        })?;
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub(crate) fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: the pointer is to a live u64 of the 8 bytes passed. EAGAIN (counter
        // saturated) still leaves the fd readable, which is all we need.
        let _ = syscall!(write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8));
    }

    pub(crate) fn drain(&self) {
        let mut buf: u64 = 0;
        // SAFETY: the pointer is to a live, writable u64 of the 8 bytes passed.
        let _ = syscall!(read(self.fd.as_raw_fd(), (&mut buf as *mut u64).cast(), 8));
    }

    pub(crate) fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A new descriptor (close-on-exec) for the open file that `fd` names, owned by the caller:
/// it stays valid, and names the same file, after the owner of `fd` closes its own.
pub(crate) fn dup_fd(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC takes an integer argument only; on a closed or invalid `fd`
    // it fails with EBADF, which is returned.
    let new = syscall!(fcntl(fd, libc::F_DUPFD_CLOEXEC, 0))?;
    // SAFETY: `new` was just returned by fcntl and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Sleeps until one of `fds` is readable or `timeout` passes (`None`: no timeout). Returns
/// the number of readable fds; their `revents` are set.
pub(crate) fn wait(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `fds` is a live slice of pollfd of the length passed; `ts_ptr` is null or
    // points to a live timespec; a null sigmask keeps the current one.
    match syscall!(ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ts_ptr, std::ptr::null())) {
        Ok(n) => Ok(n as usize),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(e),
    }
}

/// Pins the calling thread to CPU `core`.
pub(crate) fn pin_to_core(core: usize) -> io::Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("core {core} out of range")));
    }
    // SAFETY: cpu_set_t is plain data for which all-zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `core` is below CPU_SETSIZE (checked), so CPU_SET stays inside `set`.
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is a live cpu_set_t of the size passed.
    syscall!(sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)).map(|_| ())
}

/// Sets the calling thread's timer slack (how late the kernel may end its timed sleeps, to
/// batch wake-ups; 50 µs by default for ordinary threads) to `ns` nanoseconds.
pub(crate) fn set_timer_slack(ns: u64) -> io::Result<()> {
    // SAFETY: PR_SET_TIMERSLACK takes an integer argument and no pointers; it affects only
    // the calling thread.
    syscall!(prctl(libc::PR_SET_TIMERSLACK, ns as libc::c_ulong, 0, 0, 0)).map(|_| ())
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: the kernel's last tick (1-4 ms resolution),
/// read from the vDSO without the TSC read and scaling of `Instant::now()`. For gates that
/// run on every reactor pass and only need to know whether ~100 ms have passed.
pub(crate) fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a live timespec the call writes; CLOCK_MONOTONIC_COARSE always exists on
    // Linux >= 2.6.32, so the call cannot fail (a failure leaves 0, which only makes the
    // gate open early).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The page size (4096 if `sysconf` cannot tell).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf takes no pointers.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// CPUs this process may use, whatever the calling thread's own affinity: the CPUs online,
/// capped by a cgroup v2 CPU quota where one is set (`cpu.max` of the process's cgroup, as
/// containers set it). Not `std::thread::available_parallelism`, which counts the calling
/// thread's affinity mask: a caller pinned to one core (as a latency-critical loop is) would
/// read 1 on a machine of many.
pub(crate) fn machine_cpus() -> usize {
    // SAFETY: sysconf takes no pointers.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let online = usize::try_from(online).ok().filter(|&n| n > 0).unwrap_or(1);
    let quota = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_v2_path(&c))
        .and_then(|path| std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cpu.max")).ok())
        .and_then(|m| cpu_max_quota(&m));
    quota.map_or(online, |q| q.min(online))
}

/// The cgroup v2 path in `/proc/self/cgroup` (its `0::` line).
fn cgroup_v2_path(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|l| l.strip_prefix("0::")).map(|p| p.trim().to_string())
}

/// CPUs a cgroup v2 `cpu.max` ("QUOTA PERIOD", or "max PERIOD") allows, rounded up; `None`
/// without a quota or on anything unreadable.
fn cpu_max_quota(cpu_max: &str) -> Option<usize> {
    let mut it = cpu_max.split_whitespace();
    let quota: u64 = it.next()?.parse().ok()?;
    let period: u64 = it.next()?.parse().ok().filter(|&p| p > 0)?;
    Some(quota.div_ceil(period).max(1) as usize)
}

/// Bytes of physical memory of the machine (`None` if `sysconf` cannot tell).
pub(crate) fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf takes no pointers.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    u64::try_from(pages).ok().filter(|&p| p > 0).map(|p| p.saturating_mul(page_size() as u64))
}

/// The transparent huge page size (x86-64, and arm64 with 4 KiB pages): a mapping that asks
/// for huge pages starts on a multiple of it.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Maps `len` (a non-zero multiple of the page size) bytes of zeroed, page-aligned,
/// read-write anonymous memory. An error (`ENOMEM`), never an abort, when it cannot.
///
/// With `huge`, a mapping of at least [`HUGE_PAGE`] bytes starts on a huge-page boundary and
/// is advised `MADV_HUGEPAGE`: the kernel backs each whole 2 MiB of it with one transparent
/// huge page where it can (THP `always` or `madvise`, and a free huge page at the first
/// touch), and with small pages otherwise; either way the memory behaves the same. What it
/// changes is the cost of every walk over the pages: shm's `process_vm_readv` copy, `ibv_reg_mr`
/// pinning, the TLB (`docs/performance.md`, "Huge pages").
pub(crate) fn map_zeroed(len: usize, huge: bool) -> io::Result<std::ptr::NonNull<u8>> {
    if !huge || len < HUGE_PAGE {
        return map_anonymous(len);
    }
    // Over-map by one huge page, then give back the parts before the first boundary and
    // after `len` bytes from it.
    let span = len.checked_add(HUGE_PAGE).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
    let start = map_anonymous(span)?.as_ptr() as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let head = aligned - start;
    let tail = span - head - len;
    // SAFETY: `start..aligned` and `aligned+len..start+span` lie inside the mapping just made
    // (head + len + tail == span), begin on page boundaries (`start`, `aligned` and `len`
    // are page multiples) and are used by nobody; the kept range is untouched.
    unsafe {
        unmap_unused(start, head);
        unmap_unused(aligned + len, tail);
    }
    // SAFETY: advice on a range of our own fresh mapping; it changes how the range is
    // backed, never what it holds. A kernel without THP refuses it (`EINVAL`): small pages.
    if unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), len, "no transparent huge pages for a region");
    }
    std::ptr::NonNull::new(aligned as *mut u8).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))
}

/// An anonymous private read-write mapping of `len` bytes at an address of the kernel's
/// choosing.
fn map_anonymous(len: usize) -> io::Result<std::ptr::NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing; no
    // existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    std::ptr::NonNull::new(p.cast()).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))
}

/// Unmaps `len` bytes at `addr` (nothing when `len` is 0). A failure leaves the range mapped
/// and untouched: address space, no memory.
///
/// # Safety
///
/// `addr..addr+len` must be page-aligned, part of a mapping of ours, and unused.
unsafe fn unmap_unused(addr: usize, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: the caller's contract.
    if unsafe { libc::munmap(addr as *mut libc::c_void, len) } != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), len, "could not unmap the slack of a mapping");
    }
}

/// Gives a mapping made by [`map_zeroed`] back: its pages are freed, but the virtual range
/// stays reserved (`PROT_NONE`, no memory behind it) for the rest of the process, so no later
/// allocation can be placed there. A peer holding a stale descriptor of a region that lived
/// there (a virtual address and a key) then faults (`EFAULT`) instead of writing into
/// whatever the process would have put at that address next. If the range cannot be
/// re-mapped, it is left as it is (still reserved, still not reused).
///
/// # Safety
///
/// `ptr..ptr+len` must be exactly a mapping made by [`map_zeroed`], not used afterwards.
pub(crate) unsafe fn retire_mapping(ptr: *mut u8, len: usize) {
    // SAFETY: the caller owns the whole range (a mapping of ours); MAP_FIXED replaces only
    // it, and nobody uses it afterwards.
    let p = unsafe {
        libc::mmap(
            ptr.cast(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        tracing::warn!(
            error = %io::Error::last_os_error(),
            len,
            "could not reserve a retired region's range; its memory stays mapped"
        );
    }
}

/// A pidfd (close-on-exec) for process `pid` of this pid namespace: it becomes readable when
/// that process exits, and keeps naming that process even if its pid is reused later.
pub(crate) fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes two integers and no pointers; it returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Buffers for [`PollScratch::readable_now`], kept by their owner so that a periodic check
/// run in a reactor pass allocates nothing once they have grown to its number of fds (a
/// `BusyPoll` or `Inline` engine runs passes on the threads of the synchronous fast path,
/// which promises no allocation).
#[derive(Default)]
pub(crate) struct PollScratch {
    set: Vec<libc::pollfd>,
    ready: Vec<usize>,
}

impl PollScratch {
    /// Which of `fds` are readable right now (a `poll` with a zero timeout): their indices,
    /// in increasing order.
    pub(crate) fn readable_now(&mut self, fds: impl IntoIterator<Item = RawFd>) -> io::Result<&[usize]> {
        self.set.clear();
        self.ready.clear();
        self.set.extend(fds.into_iter().map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }));
        if self.set.is_empty() {
            return Ok(&self.ready);
        }
        // SAFETY: `set` is a live slice of pollfd of the length passed; timeout 0 never blocks.
        let n = syscall!(poll(self.set.as_mut_ptr(), self.set.len() as libc::nfds_t, 0))?;
        if n > 0 {
            self.ready.extend(self.set.iter().enumerate().filter(|(_, p)| p.revents != 0).map(|(i, _)| i));
        }
        Ok(&self.ready)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The slack set is the slack the kernel reports for the thread (on a thread of its own,
    /// so that the test runner's threads keep theirs).
    #[test]
    fn timer_slack_is_set_for_the_calling_thread() {
        let got = std::thread::spawn(|| {
            set_timer_slack(1000).unwrap();
            // SAFETY: PR_GET_TIMERSLACK takes no pointer; it returns the slack in ns.
            unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) }
        })
        .join()
        .unwrap();
        assert_eq!(got, 1000);
    }

    /// The indices of the readable fds, in order, with the buffers reused from call to call
    /// (a socket pair: one end readable once the other wrote; an empty list polls nothing).
    #[test]
    fn poll_scratch_names_the_readable_fds_by_index() {
        use std::io::Write;
        use std::os::unix::net::UnixStream;
        let (mut a, b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        let mut s = PollScratch::default();
        let fds = [b.as_raw_fd(), c.as_raw_fd()];
        assert!(s.readable_now(fds).unwrap().is_empty(), "nothing written yet");
        a.write_all(b"x").unwrap();
        assert_eq!(s.readable_now(fds).unwrap(), &[0], "b can be read");
        assert_eq!(s.readable_now([c.as_raw_fd(), b.as_raw_fd()]).unwrap(), &[1], "in the order given");
        assert!(s.readable_now([]).unwrap().is_empty(), "no fds");
    }

    #[test]
    fn cpu_quota_and_cgroup_path_are_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_max_quota("max 100000\n"), None, "no quota");
        assert_eq!(cpu_max_quota("200000 100000\n"), Some(2));
        assert_eq!(cpu_max_quota("150000 100000"), Some(2), "rounded up");
        assert_eq!(cpu_max_quota("5000 100000"), Some(1), "at least one");
        assert_eq!(cpu_max_quota("garbage"), None);
        assert_eq!(cpu_max_quota("100 0"), None, "a zero period is not a quota");
        let v2 = "0::/system.slice/job.scope\n";
        assert_eq!(cgroup_v2_path(v2).as_deref(), Some("/system.slice/job.scope"));
        assert_eq!(cgroup_v2_path("12:cpu,cpuacct:/x\n"), None, "cgroup v1 only");
    }

    #[test]
    fn a_thread_pinned_to_one_cpu_still_sees_the_machines_cpus() {
        let all = machine_cpus();
        assert!(all >= 1);
        let on_one = std::thread::spawn(|| {
            // The CPU it runs on now is one it may use (a cpuset need not include cpu 0).
            // SAFETY: sched_getcpu takes no arguments.
            let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).expect("sched_getcpu");
            pin_to_core(cpu).expect("pin to the cpu it runs on");
            (std::thread::available_parallelism().map_or(0, |n| n.get()), machine_cpus())
        })
        .join()
        .unwrap();
        assert_eq!(on_one.0, 1, "std counts the pinned thread's mask");
        assert_eq!(on_one.1, all, "machine_cpus does not");
    }
}
