//! What the `shm` provider needs to survive a peer that dies: noticing it, and one-sided
//! endpoints that a dead peer cannot block.
//!
//! **Liveness.** An shm address is `"fi_shm://PID:UID:N"`: the peer's process id. When a
//! peer is added, a pidfd of that process is opened; every [`CHECK_EVERY`] the domain's
//! poll asks which pidfds became readable (one `poll` call for all of them). A dead peer's
//! operations in flight fail at once (`ECONNRESET`, "shm peer process PID exited") and a
//! [`Completion::PeerDown`] follows, so nothing waits for `op_timeout`. This assumes the
//! peers share this process's pid namespace, as shm's own CMA path does; set
//! `FABRIC_SHM_LIVENESS=0` where they do not.
//!
//! **One one-sided endpoint per peer.** libfabric 1.17's shm completes a sender's writes
//! over 4 KiB (and reads) from one response queue per endpoint, strictly in order, and stops
//! at the first entry its peer has not answered (`smr_progress_resp`). A peer killed before
//! answering leaves its entry unanswered forever, so no later write of that endpoint, to
//! *any* peer, would complete. So writes and reads to a peer go out on an endpoint of that
//! peer's own, opened when the peer is added and bound to the domain's AV and CQ: a dead
//! peer blocks only its own endpoint, which is closed when the peer is found dead or
//! removed (its operations are failed first; once it is closed the provider touches their
//! memory no more). The main endpoint keeps the address peers know, the receives and the
//! two-sided sends (the receiver names the sender by it); up to 4 KiB a message never
//! waits in the response queue. A message over 4 KiB in flight to a peer that dies can hold
//! back later large messages until `op_timeout` (see `docs/faults.md`).
//!
//! **A dead peer's region lock (libfabric < 1.18).** 1.17's shm takes the peer's region
//! spinlock with a blocking `pthread_spin_lock` in every post, and the peer holds it while
//! it processes its command queue: a peer killed there leaves it held, and a post to it
//! (or one already waiting for it) spins forever on the reactor thread. Each peer's lock
//! word is mapped here ([`PeerLock`]) and a thread of its own ([`lock_doctor`]) sets it back
//! to unlocked once it has seen it held twice, 5 ms apart, with its owner's pidfd readable.
//! 1.18 and later have no such lock in the post path; nothing is mapped there.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use libfabric_sys as sys;

use super::fid::Fid;
use super::LibfabricDomain;
use crate::provider::{Completion, FailCause, PeerHandle};
use crate::pure::int_map::IntMap;

/// The CQ binding of a one-sided endpoint: shm refuses to enable an endpoint without a
/// receive CQ, though this one never has a receive posted nor an address anyone writes to.
pub(super) const RMA_EP_CQ_FLAGS: u64 = (sys::FI_TRANSMIT | sys::FI_RECV) as u64;
/// How often the peers' pidfds (and tcp's liveness connections) are checked, at most; the
/// reactor's polling paces it.
pub(super) const CHECK_EVERY: Duration = Duration::from_millis(5);
/// Polls between two looks at the clock.
const POLLS_PER_CLOCK: u32 = 16;

/// Paces the periodic liveness work of a domain's poll: a look at the clock every few
/// polls, the work at most every [`CHECK_EVERY`].
pub(super) struct Tick {
    polls: u32,
    next: Instant,
}

impl Tick {
    pub(super) fn new() -> Tick {
        Tick { polls: 0, next: Instant::now() }
    }

    /// The domain is about to sleep: the first poll after it looks at the clock (a
    /// sleeping reactor polls once per wake-up, so waiting for the 16th poll would put the
    /// check 16 wake-ups off).
    pub(super) fn slept(&mut self) {
        self.polls = POLLS_PER_CLOCK - 1;
    }

    /// Whether the work is due now.
    pub(super) fn due(&mut self) -> bool {
        self.polls = self.polls.wrapping_add(1);
        if !self.polls.is_multiple_of(POLLS_PER_CLOCK) {
            return false;
        }
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        self.next = now + CHECK_EVERY;
        true
    }
}

/// The process id in an shm address (`"fi_shm://PID:..."`), if it has one.
pub(super) fn shm_pid(addr: &[u8]) -> Option<libc::pid_t> {
    let rest = addr.strip_prefix(b"fi_shm://")?;
    let end = rest.iter().position(|&b| b == b':')?;
    let digits = std::str::from_utf8(&rest[..end]).ok()?;
    digits.parse::<libc::pid_t>().ok().filter(|&p| p > 0)
}

/// This process's open shm endpoints, by address. An engine may have peers in its own
/// process (two engines of one program; the tests do it all the time), which the pid watch
/// cannot tell dead: when such a peer closes, libfabric 1.17 unmaps its region, and a post
/// to it touches the unmapped region (seen: SIGSEGV in `pthread_spin_lock` under
/// `smr_generic_rma`, when the engine's own `Revoke` went to an engine of the same process
/// that had shut down). So a domain registers its address here while it is open, a post to
/// an in-process peer holds the read lock and fails if the peer's address is gone, and a
/// domain removes its address under the write lock before it closes anything.
static LOCAL: RwLock<Vec<Vec<u8>>> = RwLock::new(Vec::new());

fn local() -> std::sync::RwLockReadGuard<'static, Vec<Vec<u8>>> {
    LOCAL.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One watched peer.
struct Watched {
    peer: PeerHandle,
    pid: libc::pid_t,
    /// `None`: the process was already gone when the peer was added.
    pidfd: Option<OwnedFd>,
}

/// libfabric < 1.18 only: the spinlock in the header of a peer's shm region, mapped here
/// with the peer's pidfd, so that a lock its dead owner left held can be released
/// ([`lock_doctor`]). libfabric 1.17's `struct smr_region` (`include/ofi_shm.h`): `version`
/// u8 at 0 (`SMR_VERSION` 4), `pid` i32 at 4, `lock` (`pthread_spinlock_t`) at 24. The peer
/// holds that lock while it processes its command queue, and a sender takes it with a
/// blocking `pthread_spin_lock` in every post to it: a peer killed inside that section left
/// the sender's post spinning forever (docs/faults.md).
struct PeerLock {
    /// The first page of the peer's region, mapped shared, read-write.
    map: std::ptr::NonNull<libc::c_void>,
    /// The peer's process: readable once it has exited.
    pidfd: OwnedFd,
    pid: libc::pid_t,
    /// The value of an unlocked `pthread_spinlock_t` here.
    unlocked: i32,
}

const SMR_LOCK_OFFSET: usize = 24;
const SMR_PID_OFFSET: usize = 4;
const SMR_VERSION_1_17: u8 = 4;
const LOCK_VIEW_LEN: usize = 4096;
/// How often the doctor looks, and how many looks in a row must find the lock held with its
/// owner dead before it is released.
const DOCTOR_EVERY: Duration = Duration::from_millis(5);
const DOCTOR_STRIKES: u32 = 2;

impl PeerLock {
    /// Maps the header of the region named in `addr` (`"fi_shm://NAME"`), if it is a 1.17
    /// region of process `pid`.
    fn open(addr: &[u8], pid: libc::pid_t, pidfd: &OwnedFd, unlocked: i32) -> Option<PeerLock> {
        let name = addr.strip_prefix(b"fi_shm://")?;
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        let cname = std::ffi::CString::new(name).ok()?;
        let pidfd = pidfd.try_clone().ok()?;
        // SAFETY: cname is NUL-terminated; opening an existing object creates nothing.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is an open shm object of 16 MiB (libfabric's region); its first page is
        // mapped shared; the fd can be closed once mapped.
        let map = unsafe {
            let m = libc::mmap(
                std::ptr::null_mut(),
                LOCK_VIEW_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            m
        };
        if map == libc::MAP_FAILED {
            return None;
        }
        let lock = PeerLock { map: std::ptr::NonNull::new(map)?, pidfd, pid, unlocked };
        // SAFETY: both offsets are inside the mapped page and aligned for their types.
        let (version, owner) = unsafe {
            let base = lock.map.as_ptr().cast::<u8>();
            (base.read_volatile(), base.add(SMR_PID_OFFSET).cast::<i32>().read_volatile())
        };
        (version == SMR_VERSION_1_17 && owner == pid).then_some(lock)
    }

    fn word(&self) -> &std::sync::atomic::AtomicI32 {
        // SAFETY: the page stays mapped for self's life; the word is 4-aligned; libfabric's
        // `pthread_spin_*` change it with atomic instructions only.
        unsafe {
            &*self.map.as_ptr().cast::<u8>().add(SMR_LOCK_OFFSET).cast::<std::sync::atomic::AtomicI32>()
        }
    }

    fn held(&self) -> bool {
        self.word().load(std::sync::atomic::Ordering::Acquire) != self.unlocked
    }

    fn owner_exited(&self) -> bool {
        let mut p = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
    }

    /// Releases the lock if it is still held: only for an owner that exited.
    fn release(&self) -> bool {
        let held = self.word().load(std::sync::atomic::Ordering::Acquire);
        held != self.unlocked
            && self
                .word()
                .compare_exchange(
                    held,
                    self.unlocked,
                    std::sync::atomic::Ordering::Release,
                    std::sync::atomic::Ordering::Relaxed,
                )
                .is_ok()
    }
}

impl Drop for PeerLock {
    fn drop(&mut self) {
        // SAFETY: the page was mapped by `open` and is unmapped once.
        unsafe { libc::munmap(self.map.as_ptr(), LOCK_VIEW_LEN) };
    }
}

// SAFETY: the mapping is shared memory, used only through atomics; the fd is a plain fd.
unsafe impl Send for PeerLock {}
// SAFETY: as above.
unsafe impl Sync for PeerLock {}

/// The value of an unlocked `pthread_spinlock_t` in this C library (glibc on x86-64: 1, its
/// assembly lock decrements; the generic C one: 0), found by initialising one.
fn spin_unlocked_value() -> i32 {
    let mut lock: libc::pthread_spinlock_t = 0;
    // SAFETY: a local spinlock, initialised and destroyed here.
    unsafe {
        libc::pthread_spin_init(&mut lock, libc::PTHREAD_PROCESS_SHARED);
        let v = std::ptr::read_volatile(&lock);
        libc::pthread_spin_destroy(&mut lock);
        v
    }
}

/// Whether the libfabric loaded is older than 1.18, whose shm took the peer's region lock in
/// every post (1.18 replaced that queue by a lock-free one).
fn shm_post_takes_peer_lock() -> bool {
    super::version() < (1, 18)
}

/// The peer locks the doctor watches, for every domain of this process; `running`: whether
/// its thread is up.
struct Doctor {
    locks: Vec<(Weak<PeerLock>, u32)>,
    running: bool,
}

static DOCTOR: Mutex<Doctor> = Mutex::new(Doctor { locks: Vec::new(), running: false });

/// Hands a peer lock to the doctor: a thread of its own (the reactor may be the thread
/// stuck in the post), which every [`DOCTOR_EVERY`] looks at each lock, and releases one
/// that it finds held [`DOCTOR_STRIKES`] times in a row while its owner's pidfd says the
/// owner exited. Nothing else ever releases it: the owner is dead, and its region is read
/// by nobody but the senders still posting to it, whose operations then fail at the
/// pidfd check. The thread ends when no lock is left to watch.
fn lock_doctor(lock: &Arc<PeerLock>) {
    let mut d = DOCTOR.lock().unwrap_or_else(|p| p.into_inner());
    d.locks.push((Arc::downgrade(lock), 0));
    if d.running {
        return;
    }
    let spawned = std::thread::Builder::new().name("fabric-shm-locks".into()).spawn(|| loop {
        std::thread::sleep(DOCTOR_EVERY);
        let mut d = DOCTOR.lock().unwrap_or_else(|p| p.into_inner());
        d.locks.retain(|(w, _)| w.strong_count() > 0);
        if d.locks.is_empty() {
            d.running = false;
            return;
        }
        for (w, strikes) in d.locks.iter_mut() {
            let Some(lock) = w.upgrade() else { continue };
            if !(lock.held() && lock.owner_exited()) {
                *strikes = 0;
                continue;
            }
            *strikes += 1;
            if *strikes >= DOCTOR_STRIKES && lock.release() {
                *strikes = 0;
                tracing::warn!(pid = lock.pid, "released the shm region lock that a dead peer left held");
            }
        }
    });
    match spawned {
        Ok(_) => d.running = true,
        Err(e) => tracing::warn!(error = %e, "no thread to watch the shm peers' region locks"),
    }
}

/// The shm state of a [`LibfabricDomain`]: peer liveness and the one-sided endpoints.
#[derive(Default)]
pub(super) struct ShmState {
    /// Each peer's one-sided endpoint.
    rma_eps: IntMap<PeerHandle, Fid<sys::fid_ep>>,
    watched: Vec<Watched>,
    /// Each peer's process id, kept after it is found dead (`revive_peer` looks again).
    pids: IntMap<PeerHandle, libc::pid_t>,
    /// Plain writes and reads (no immediate) in posting order, with their tokens, until
    /// their completion is read: shm's fast RMA path (CMA straight into the peer's memory,
    /// in the post call) reports a failed copy as an error entry *without* the operation's
    /// context (libfabric 1.17 `smr_generic_rma`), written in the post call like a success
    /// would be. So the CQ gives the fast path's results in posting order, and such an
    /// entry belongs to the oldest of these still in flight (see [`ShmState::take_failed_fast`]).
    fast: std::collections::VecDeque<(std::ptr::NonNull<super::ctx::OpCtx>, u64)>,
    /// Peers in this process, by their address (see [`LOCAL`]).
    local_peers: IntMap<PeerHandle, Vec<u8>>,
    /// Those found closed (kept for `revive_peer`).
    local_gone: IntMap<PeerHandle, Vec<u8>>,
    /// In-process peers whose closed endpoint was taken out of the AV before this domain
    /// enabled an endpoint (`shm_prepare_add`): they stay down.
    av_dropped: std::collections::HashSet<PeerHandle>,
    /// Our own address while it is registered in [`LOCAL`].
    registered: Option<Vec<u8>>,
    liveness_off: bool,
    /// The pidfd check's `poll` buffers, reused (a check in a pass allocates nothing).
    scratch: crate::sys::PollScratch,
    /// libfabric < 1.18 (and `FABRIC_SHM_LOCK_RELEASE` not 0): each peer's region lock,
    /// watched by [`lock_doctor`] while it is here.
    locks: IntMap<PeerHandle, Arc<PeerLock>>,
    /// The unlocked value of a `pthread_spinlock_t`; `None`: the locks are not watched.
    lock_unlocked: Option<i32>,
}

impl ShmState {
    pub(super) fn new() -> ShmState {
        let liveness_off = !crate::env::switch("FABRIC_SHM_LIVENESS", true);
        let watch_locks = !liveness_off
            && crate::env::switch("FABRIC_SHM_LOCK_RELEASE", true)
            && shm_post_takes_peer_lock();
        let lock_unlocked = watch_locks.then(spin_unlocked_value);
        ShmState { liveness_off, lock_unlocked, ..Default::default() }
    }

    /// The endpoint that one-sided operations to `peer` go out on.
    pub(super) fn rma_ep(&self, peer: PeerHandle) -> Option<*mut sys::fid_ep> {
        self.rma_eps.get(&peer).map(Fid::as_ptr)
    }

    /// Registers this domain's address among the process's open shm endpoints ([`LOCAL`]).
    pub(super) fn register_local(&mut self, address: &[u8]) {
        LOCAL.write().unwrap_or_else(std::sync::PoisonError::into_inner).push(address.to_vec());
        self.registered = Some(address.to_vec());
    }

    /// Takes this domain's address out of [`LOCAL`]; waits for posts to it in flight in
    /// other domains of the process. Before the domain closes anything.
    pub(super) fn unregister_local(&mut self) {
        if let Some(a) = self.registered.take() {
            let mut g = LOCAL.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(i) = g.iter().position(|x| *x == a) {
                g.swap_remove(i);
            }
        }
    }

    /// For a post to `peer`: `Ok(None)` when it is not in this process; for an in-process
    /// peer, the read lock of [`LOCAL`], to hold until the post returns, or an error when
    /// the peer has closed.
    pub(super) fn local_guard(
        &self,
        peer: PeerHandle,
    ) -> Result<Option<std::sync::RwLockReadGuard<'static, Vec<Vec<u8>>>>, crate::error::Error> {
        if self.local_peers.is_empty() {
            return Ok(None);
        }
        let Some(addr) = self.local_peers.get(&peer) else { return Ok(None) };
        let g = local();
        if g.iter().any(|a| a == addr) {
            Ok(Some(g))
        } else {
            Err(crate::error::Error::PeerUnreachable {
                peer: peer as u32,
                message: "an shm peer in this process closed its endpoint".into(),
            })
        }
    }

    /// A plain write or read (no immediate) was posted with `token` in `slot`; forgets those
    /// whose completion has been read since.
    pub(super) fn posted_fast(
        &mut self,
        ctxs: &super::ctx::CtxPool,
        slot: std::ptr::NonNull<super::ctx::OpCtx>,
        token: u64,
    ) {
        while self.fast.front().is_some_and(|&(s, t)| !ctxs.holds(s, t)) {
            self.fast.pop_front();
        }
        self.fast.push_back((slot, token));
    }

    /// The operation that a sender-side error entry without a context belongs to: the
    /// oldest plain write or read still in flight (see [`ShmState::fast`]), taken off.
    pub(super) fn take_failed_fast(
        &mut self,
        ctxs: &super::ctx::CtxPool,
    ) -> Option<(std::ptr::NonNull<super::ctx::OpCtx>, u64)> {
        while let Some((s, t)) = self.fast.pop_front() {
            if ctxs.holds(s, t) {
                return Some((s, t));
            }
        }
        None
    }

    /// Starts watching the process behind a newly added peer's address.
    fn watch(&mut self, peer: PeerHandle, addr: &[u8]) {
        if self.liveness_off {
            return;
        }
        let Some(pid) = shm_pid(addr) else {
            tracing::debug!(peer, "shm address without a process id; its death is found by op_timeout");
            return;
        };
        self.pids.insert(peer, pid);
        if pid == std::process::id() as libc::pid_t {
            self.local_peers.insert(peer, addr.to_vec());
            return;
        }
        self.watch_pid(peer, pid, Some(addr));
    }

    /// Watches process `pid` as `peer`'s (again); with its address, its region's lock too
    /// (libfabric < 1.18).
    fn watch_pid(&mut self, peer: PeerHandle, pid: libc::pid_t, addr: Option<&[u8]>) {
        if pid == std::process::id() as libc::pid_t {
            return; // ourselves (another domain of this process)
        }
        let pidfd = match crate::sys::pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => None,
            Err(e) => {
                tracing::debug!(peer, pid, error = %e, "no pidfd for an shm peer; its death is found by op_timeout");
                return;
            }
        };
        self.watched.retain(|w| w.peer != peer);
        if let (Some(unlocked), Some(fd), Some(addr)) = (self.lock_unlocked, pidfd.as_ref(), addr) {
            match PeerLock::open(addr, pid, fd, unlocked) {
                Some(lock) => {
                    let lock = Arc::new(lock);
                    lock_doctor(&lock);
                    self.locks.insert(peer, lock);
                }
                None => tracing::debug!(
                    peer,
                    pid,
                    "no view of the shm peer's region lock; a lock it dies holding stays held"
                ),
            }
        }
        self.watched.push(Watched { peer, pid, pidfd });
    }

    /// The watched peers whose process has exited, taken off the watch list: (peer, pid).
    /// Allocates nothing while every peer lives (it runs in reactor passes, which may run on
    /// the synchronous fast path's threads).
    fn take_dead(&mut self) -> Vec<(PeerHandle, libc::pid_t)> {
        let mut closed = Vec::new();
        if !self.local_peers.is_empty() {
            let g = local();
            closed.extend(self.local_peers.iter().filter(|(_, a)| !g.contains(a)).map(|(&p, _)| p));
        }
        for p in &closed {
            if let Some(a) = self.local_peers.remove(p) {
                self.local_gone.insert(*p, a);
            }
        }
        let me = std::process::id() as libc::pid_t;
        if self.watched.is_empty() {
            return closed.into_iter().map(|p| (p, me)).collect();
        }
        let mut dead: Vec<usize> =
            self.watched.iter().enumerate().filter(|(_, w)| w.pidfd.is_none()).map(|(i, _)| i).collect();
        let fds = self.watched.iter().map(|w| w.pidfd.as_ref().map_or(-1, |f| f.as_raw_fd()));
        match self.scratch.readable_now(fds) {
            Ok(ready) => dead.extend(ready.iter().copied().filter(|&i| self.watched[i].pidfd.is_some())),
            Err(e) => tracing::warn!(error = %e, "checking the shm peers' pidfds failed"),
        }
        dead.sort_unstable();
        dead.dedup();
        let mut out = Vec::with_capacity(dead.len() + closed.len());
        out.extend(closed.into_iter().map(|p| (p, me)));
        for i in dead.into_iter().rev() {
            let w = self.watched.swap_remove(i);
            out.push((w.peer, w.pid));
        }
        out
    }
}

impl LibfabricDomain {
    /// Before a peer goes into this domain's AV and an endpoint is enabled (`fi_enable`).
    /// libfabric 1.17 keeps, for a peer in this process, a pointer to that peer's own region
    /// (it maps nothing of its own), and enabling an endpoint looks at every peer of the AV
    /// (`smr_exchange_all_peers`): a peer of this process whose endpoint closed, or closes
    /// meanwhile, left a dangling pointer there, and `fi_enable` died of SIGSEGV
    /// (`tests/shm_reuse.rs`: engines made and dropped pair after pair in one process). So
    /// the returned guard holds [`LOCAL`] until the endpoint is enabled (no endpoint of this
    /// process closes meanwhile; a closing one takes `LOCAL` for writing first), an address
    /// of this process that is not open is refused (`Error::Stale`), and this domain's
    /// in-process peers that closed are taken out of the AV first (they stay down).
    pub(super) fn shm_prepare_add(
        &mut self,
        addr: &[u8],
    ) -> Result<std::sync::RwLockReadGuard<'static, Vec<Vec<u8>>>, crate::error::Error> {
        let g = local();
        let me = std::process::id() as libc::pid_t;
        if shm_pid(addr) == Some(me) && !g.iter().any(|a| a.as_slice() == addr) {
            return Err(crate::error::Error::Stale {
                what: "engine address",
                reason: "an shm endpoint of this process that has closed".into(),
            });
        }
        let Some(shm) = self.shm.as_mut() else { return Ok(g) };
        let closed: Vec<PeerHandle> = shm
            .local_peers
            .iter()
            .chain(shm.local_gone.iter())
            .filter(|(p, a)| !shm.av_dropped.contains(p) && !g.contains(a))
            .map(|(&p, _)| p)
            .collect();
        for p in closed {
            tracing::debug!(
                peer = p,
                "an shm peer of this process closed: out of the AV before an endpoint is enabled"
            );
            if let Some(shm) = self.shm.as_mut() {
                shm.av_dropped.insert(p);
            }
            self.av_remove(p);
        }
        Ok(g)
    }

    /// A new shm peer: its own one-sided endpoint, and a watch on its process.
    pub(super) fn shm_add_peer(&mut self, peer: PeerHandle, addr: &[u8]) -> Result<(), crate::error::Error> {
        let ep = self.open_endpoint(RMA_EP_CQ_FLAGS)?;
        let shm = self.shm.as_mut().expect("an shm domain");
        shm.rma_eps.insert(peer, ep);
        shm.watch(peer, addr);
        Ok(())
    }

    /// `Domain::revive_peer` on shm: the peer's process must still run (a pidfd of it opens);
    /// then it gets a one-sided endpoint and a watch again.
    pub(super) fn shm_revive_peer(&mut self, peer: PeerHandle) -> Result<(), crate::error::Error> {
        let shm = self.shm.as_mut().expect("an shm domain");
        if shm.av_dropped.contains(&peer) {
            return Err(crate::error::Error::PeerUnreachable {
                peer: peer as u32,
                message: "an shm peer in this process closed its endpoint".into(),
            });
        }
        if let Some(addr) = shm.local_gone.remove(&peer) {
            if !local().contains(&addr) {
                shm.local_gone.insert(peer, addr);
                return Err(crate::error::Error::PeerUnreachable {
                    peer: peer as u32,
                    message: "an shm peer in this process closed its endpoint".into(),
                });
            }
            shm.local_peers.insert(peer, addr);
        } else if let Some(&pid) = shm.pids.get(&peer) {
            if let Err(e) = crate::sys::pidfd_open(pid) {
                if e.raw_os_error() == Some(libc::ESRCH) {
                    return Err(crate::error::Error::PeerUnreachable {
                        peer: peer as u32,
                        message: format!("shm peer process {pid} has exited"),
                    });
                }
            }
            if !shm.watched.iter().any(|w| w.peer == peer) {
                shm.watch_pid(peer, pid, None);
            }
        }
        if self.shm.as_ref().is_some_and(|s| !s.rma_eps.contains_key(&peer)) {
            let _local = self.shm_prepare_add(&[])?;
            let ep = self.open_endpoint(RMA_EP_CQ_FLAGS)?;
            self.shm.as_mut().expect("an shm domain").rma_eps.insert(peer, ep);
        }
        Ok(())
    }

    /// A peer is gone (dead or removed): its operations in flight fail with `errno` and
    /// `message`, then its one-sided endpoint is closed. Those completions go to `out`.
    pub(super) fn shm_drop_peer(
        &mut self,
        peer: PeerHandle,
        errno: i32,
        message: &str,
        out: &mut std::collections::VecDeque<Completion>,
    ) {
        let Some(shm) = self.shm.as_mut() else { return };
        shm.watched.retain(|w| w.peer != peer);
        let ep = shm.rma_eps.remove(&peer);
        for op in self.ctxs.in_flight().into_iter().filter(|o| o.peer() == Some(peer)) {
            // Nothing will answer for this memory any more: once the endpoint holding it is
            // closed (below; sends on the main endpoint: the peer is gone) the provider
            // does not touch it again.
            self.ctxs.abandon(op.slot);
            out.push_back(Completion::Failed {
                token: op.token,
                errno,
                message: message.to_owned(),
                cause: FailCause::of_errno(errno),
            });
        }
        drop(ep);
        // Watched until its endpoint is closed (libfabric 1.17 may take the lock there too).
        if let Some(shm) = self.shm.as_mut() {
            shm.locks.remove(&peer);
        }
    }

    /// The periodic shm work of a poll: peers whose process exited go down.
    pub(super) fn shm_maintenance(&mut self, out: &mut std::collections::VecDeque<Completion>) {
        let Some(shm) = self.shm.as_mut() else { return };
        for (peer, pid) in shm.take_dead() {
            let message = if pid == std::process::id() as libc::pid_t {
                "an shm peer in this process closed its endpoint".to_owned()
            } else {
                format!("shm peer process {pid} exited")
            };
            // The engine says it at warn for the peers it was asked to add (`Completion::PeerDown`).
            tracing::debug!(peer, pid, "shm peer process exited; failing its operations");
            self.shm_drop_peer(peer, libc::ECONNRESET, &message, out);
            out.push_back(Completion::PeerDown { peer, message });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake 1.17 region header in /dev/shm, its lock left held by a process that exited:
    /// the view opens, sees it held and its owner gone, and releases it; a region of
    /// another pid is not opened.
    #[test]
    fn a_dead_owners_region_lock_is_released() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id() as libc::pid_t;
        let pidfd = crate::sys::pidfd_open(pid).expect("pidfd");
        child.wait().expect("wait");
        let unlocked = spin_unlocked_value();
        let name = format!("fabric-lock-test-{}", std::process::id());
        let cname = std::ffi::CString::new(name.clone()).unwrap();
        let mut page = vec![0u8; LOCK_VIEW_LEN];
        page[0] = SMR_VERSION_1_17;
        page[SMR_PID_OFFSET..SMR_PID_OFFSET + 4].copy_from_slice(&pid.to_ne_bytes());
        page[SMR_LOCK_OFFSET..SMR_LOCK_OFFSET + 4].copy_from_slice(&(1 - unlocked).to_ne_bytes());
        // SAFETY: a new shm object of this test, written through its own fd, then closed.
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
            assert!(fd >= 0, "shm_open");
            assert_eq!(libc::write(fd, page.as_ptr().cast(), page.len()), page.len() as isize);
            libc::close(fd);
        }
        let addr = format!("fi_shm://{name}\0");
        assert!(PeerLock::open(addr.as_bytes(), pid + 1, &pidfd, unlocked).is_none(), "another pid's region");
        let lock = PeerLock::open(addr.as_bytes(), pid, &pidfd, unlocked).expect("the view opens");
        assert!(lock.held() && lock.owner_exited());
        assert!(lock.release());
        assert!(!lock.held() && !lock.release());
        // SAFETY: the object this test created.
        unsafe { libc::shm_unlink(cname.as_ptr()) };
    }

    #[test]
    fn pid_of_an_shm_address() {
        assert_eq!(shm_pid(b"fi_shm://1234:1000:0\0"), Some(1234));
        assert_eq!(shm_pid(b"fi_shm://1:0:7"), Some(1));
        assert_eq!(shm_pid(b"fi_shm://0:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://-5:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://x:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://99999999999:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://123"), None);
        assert_eq!(shm_pid(b"fi_ns://123:0:0"), None);
        assert_eq!(shm_pid(b""), None);
    }
}
