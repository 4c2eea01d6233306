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
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use libfabric_sys as sys;

mod lock;

use lock::{lock_doctor, shm_post_takes_peer_lock, spin_unlocked_value, PeerLock};

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
/// domain removes its address under the write lock before it closes anything. Before that,
/// a closing domain has every other domain here take it out of its AV ([`Removal`]).
static LOCAL: RwLock<Vec<Local>> = RwLock::new(Vec::new());

/// The read guard of [`LOCAL`] that a post or an `fi_enable` holds.
pub(super) type LocalGuard = std::sync::RwLockReadGuard<'static, Vec<Local>>;

fn local() -> LocalGuard {
    LOCAL.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn local_mut() -> std::sync::RwLockWriteGuard<'static, Vec<Local>> {
    LOCAL.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One open shm domain of this process, in [`LOCAL`].
pub(super) struct Local {
    addr: Vec<u8>,
    /// Where other domains ask it to take them out of its AV.
    inbox: Arc<Inbox>,
    /// It is asking the others to forget it ([`LibfabricDomain::shm_before_close`]): no
    /// domain adds it as a new peer any more, posts to it still go.
    closing: bool,
}

/// Whether `addr` is an open shm endpoint of this process (closing or not).
fn is_open(g: &[Local], addr: &[u8]) -> bool {
    g.iter().any(|l| l.addr == addr)
}

/// How long a closing domain waits for the other domains of the process to take it out of
/// their AV: a domain whose reactor is stuck must not hang the close.
const REMOVAL_WAIT: Duration = Duration::from_secs(1);

/// A domain's requests from closing domains of the process, served on its own reactor
/// thread by its next poll ([`LibfabricDomain::shm_serve_removals`]).
#[derive(Default)]
struct Inbox {
    pending: std::sync::atomic::AtomicBool,
    requests: Mutex<Vec<Removal>>,
}

/// A closing domain asks another of the process to take it out of its AV, while its
/// regions are still mapped. libfabric 1.17's shm keeps, for a peer in this process, a
/// pointer to that peer's own region, in the AV's map: for the peers in the AV, and for
/// every endpoint that sent it a message (a connection request adds the sender's region to
/// the map, outside the AV: here the closing domain's one-sided endpoint to this domain).
/// Progress (responses, signals), `fi_enable` (`smr_exchange_all_peers`) and closing the
/// AV (`smr_map_del` unmaps a region that is no longer an open endpoint of the process,
/// reading its size through the pointer) would all go through a pointer to a region
/// unmapped, or mapped again for something else. `fi_av_remove` while the region is mapped
/// takes it out of the map without touching it.
struct Removal {
    /// The closing domain's address (its main endpoint), as this domain's peers know it.
    main: Vec<u8>,
    /// The names of its one-sided endpoints to this domain: not in this domain's AV, only in
    /// its map; put in the AV and taken out again.
    extra: Vec<Vec<u8>>,
    done: Arc<Latch>,
}

/// Counts the domains that have not served a [`Removal`] yet; the closing domain waits for
/// zero, [`REMOVAL_WAIT`] at most.
struct Latch {
    state: Mutex<LatchState>,
    zero: std::sync::Condvar,
}

struct LatchState {
    left: usize,
    /// The closing domain stopped waiting: its endpoints may be closed, and a removal
    /// served now would go through their pointers (`smr_map_del` of an endpoint that is no
    /// longer open unmaps it): too late, nothing is done.
    expired: bool,
}

impl Latch {
    fn new(n: usize) -> Latch {
        Latch { state: Mutex::new(LatchState { left: n, expired: false }), zero: std::sync::Condvar::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LatchState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits up to `d` for zero; whether it is zero. `last`: on a timeout, the waiting
    /// ends (later removals are not done).
    fn wait(&self, d: Duration, last: bool) -> bool {
        let g = self.lock();
        let (mut g, _) = self
            .zero
            .wait_timeout_while(g, d, |s| s.left > 0)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if g.left > 0 && last {
            g.expired = true;
        }
        g.left == 0
    }
}

/// See [`ShmState::retired`].
struct Retired {
    addr: Vec<u8>,
    ep: Option<Fid<sys::fid_ep>>,
    /// The peer's operations in flight when it was taken out of the AV (its handle may be
    /// another peer's by the time they are failed).
    ops: Vec<(std::ptr::NonNull<super::ctx::OpCtx>, u64)>,
}

/// One watched peer.
struct Watched {
    peer: PeerHandle,
    pid: libc::pid_t,
    /// `None`: the process was already gone when the peer was added.
    pidfd: Option<OwnedFd>,
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
    /// Where closing domains of the process ask this one to forget them ([`Removal`]).
    inbox: Arc<Inbox>,
    /// In-process peers taken out of the AV while they close ([`Removal`]): their
    /// one-sided endpoint and operations in flight, closed and failed once the peer's
    /// address is gone from [`LOCAL`] (as when such a peer is found closed), not while the
    /// peer may still have that endpoint's region in its map.
    retired: Vec<Retired>,
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
        let inbox = self.inbox.clone();
        local_mut().push(Local { addr: address.to_vec(), inbox, closing: false });
        self.registered = Some(address.to_vec());
    }

    /// Takes this domain's address out of [`LOCAL`]; waits for posts to it in flight in
    /// other domains of the process. Before the domain closes anything.
    pub(super) fn unregister_local(&mut self) {
        if let Some(a) = self.registered.take() {
            let mut g = local_mut();
            if let Some(i) = g.iter().position(|x| x.addr == a) {
                g.swap_remove(i);
            }
        }
    }

    /// For a post to `peer`: `Ok(None)` when it is not in this process; for an in-process
    /// peer, the read lock of [`LOCAL`], to hold until the post returns, or an error when
    /// the peer has closed or is out of the AV (it is closing: [`Removal`]).
    pub(super) fn local_guard(&self, peer: PeerHandle) -> Result<Option<LocalGuard>, crate::error::Error> {
        if self.local_peers.is_empty() && self.local_gone.is_empty() {
            return Ok(None);
        }
        let closed = || crate::error::Error::PeerUnreachable {
            peer: peer as u32,
            message: "an shm peer in this process closed its endpoint".into(),
        };
        if self.local_gone.contains_key(&peer) || self.av_dropped.contains(&peer) {
            return Err(closed());
        }
        let Some(addr) = self.local_peers.get(&peer) else { return Ok(None) };
        let g = local();
        if is_open(&g, addr) {
            Ok(Some(g))
        } else {
            Err(closed())
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
            closed.extend(self.local_peers.iter().filter(|(_, a)| !is_open(&g, a)).map(|(&p, _)| p));
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
    /// of this process that is not open, or is closing, is refused (`Error::Stale`), and this domain's
    /// in-process peers that closed are taken out of the AV first (they stay down).
    pub(super) fn shm_prepare_add(&mut self, addr: &[u8]) -> Result<LocalGuard, crate::error::Error> {
        let g = local();
        let me = std::process::id() as libc::pid_t;
        if shm_pid(addr) == Some(me) && !g.iter().any(|l| l.addr == addr && !l.closing) {
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
            .filter(|(p, a)| !shm.av_dropped.contains(p) && !is_open(&g, a))
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
        // A handle that the AV gives out again: nothing of the peer that had it applies.
        shm.av_dropped.remove(&peer);
        shm.local_gone.remove(&peer);
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
            if !is_open(&local(), &addr) {
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

    /// Before this domain closes anything (its `Drop`, on its reactor thread): every other
    /// open shm domain of the process takes it out of its AV while its regions are still
    /// mapped ([`Removal`]), on its own reactor thread, and this one waits for them,
    /// [`REMOVAL_WAIT`] at most (a domain whose reactor is stuck is logged and not waited
    /// for). Meanwhile no domain adds it as a new peer (it is marked closing in [`LOCAL`]),
    /// and this one serves the requests of the others that close too. No lock is held
    /// while waiting. Their peer goes down as before, once this domain's address is gone
    /// from [`LOCAL`]; from the removal on, posts to it fail.
    pub(super) fn shm_before_close(&mut self) {
        let Some(shm) = self.shm.as_ref() else { return };
        let Some(me) = shm.registered.clone() else { return };
        // Our one-sided endpoints to in-process peers, by the peer's address: only that
        // peer has their region in its map (a connection request put it there).
        let mut ours: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for (peer, ep) in shm.rma_eps.iter() {
            if let Some(addr) = shm.local_peers.get(peer) {
                match super::address::getname(ep) {
                    Ok(name) => ours.push((addr.clone(), name)),
                    Err(e) => {
                        tracing::debug!(peer = *peer, error = %e, "no name of a one-sided shm endpoint")
                    }
                }
            }
        }
        let latch = {
            let mut g = local_mut();
            let n = g.iter().filter(|l| l.addr != me).count();
            if n == 0 {
                return;
            }
            let latch = Arc::new(Latch::new(n));
            for l in g.iter_mut() {
                if l.addr == me {
                    l.closing = true;
                    continue;
                }
                let extra = ours.iter().filter(|(a, _)| *a == l.addr).map(|(_, n)| n.clone()).collect();
                let r = Removal { main: me.clone(), extra, done: latch.clone() };
                l.inbox.requests.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(r);
                l.inbox.pending.store(true, std::sync::atomic::Ordering::Release);
            }
            latch
        };
        let start = Instant::now();
        loop {
            self.shm_serve_removals();
            let last = start.elapsed() >= REMOVAL_WAIT;
            if latch.wait(Duration::from_millis(1), last) {
                tracing::debug!(waited = ?start.elapsed(), "the process's other shm domains took this one out of their AV");
                break;
            }
            if last {
                tracing::warn!(
                    left = latch.lock().left,
                    "shm domains of this process did not take a closing one out of their AV within 1 s (a reactor stuck?); closing anyway"
                );
                break;
            }
        }
    }

    /// Serves the [`Removal`]s that closing domains of the process left in this domain's
    /// inbox: their peers go out of the AV (and stay out: `av_dropped`, posts to them fail),
    /// and so do the names of their one-sided endpoints to us. On this domain's thread: in
    /// its polls, and while it closes. One atomic load when there is nothing.
    pub(super) fn shm_serve_removals(&mut self) {
        let Some(shm) = self.shm.as_ref() else { return };
        if !shm.inbox.pending.swap(false, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let requests = std::mem::take(
            &mut *shm.inbox.requests.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for r in requests {
            let done = r.done.clone();
            // Under the latch: the closing domain does not close its endpoints meanwhile.
            let mut st = done.lock();
            if !st.expired {
                self.forget_local(&r);
            } else {
                tracing::warn!("a closing shm domain of this process stopped waiting; it stays in the AV");
            }
            st.left = st.left.saturating_sub(1);
            if st.left == 0 {
                done.zero.notify_all();
            }
        }
    }

    /// [`LibfabricDomain::shm_serve_removals`] for one request, its endpoints still open.
    fn forget_local(&mut self, r: &Removal) {
        let Some(shm) = self.shm.as_mut() else { return };
        let peers: Vec<PeerHandle> = shm
            .local_peers
            .iter()
            .chain(shm.local_gone.iter())
            .filter(|(p, a)| **a == r.main && !shm.av_dropped.contains(p))
            .map(|(&p, _)| p)
            .collect();
        shm.av_dropped.extend(peers.iter().copied());
        let in_flight = if peers.is_empty() { Vec::new() } else { self.ctxs.in_flight() };
        let Some(shm) = self.shm.as_mut() else { return };
        for &p in &peers {
            // It goes down now (its handle may be given to a new peer once out of the AV);
            // its one-sided endpoint is closed, and its operations failed, later (`retired`).
            if let Some(a) = shm.local_peers.remove(&p) {
                shm.local_gone.insert(p, a);
            }
            shm.locks.remove(&p);
            let ops = in_flight.iter().filter(|o| o.peer() == Some(p)).map(|o| (o.slot, o.token)).collect();
            shm.retired.push(Retired { addr: r.main.clone(), ep: shm.rma_eps.remove(&p), ops });
        }
        for p in peers {
            tracing::debug!(peer = p, "an shm peer of this process is closing: out of the AV, down");
            let message = "an shm peer in this process closed its endpoint".to_owned();
            self.overflow.push_back(Completion::PeerDown { peer: p, message });
            // `fi_av_remove` of a peer still open: shm (1.17 `smr_map_del`) takes it out of
            // the map without unmapping or writing to its region.
            self.av_remove(p);
        }
        for name in &r.extra {
            self.forget_name(name);
        }
    }

    /// Takes the region named `name` (an open endpoint of this process that is not our
    /// peer, only in the map: it sent us messages) out of this domain's map: inserted into
    /// the AV, which finds it in the map, and removed again.
    fn forget_name(&mut self, name: &[u8]) {
        if name.last() != Some(&0) {
            return; // shm names are NUL-terminated strings; never read past the slice
        }
        let mut fi_addr: sys::fi_addr_t = sys::FI_ADDR_NOTAVAIL;
        // SAFETY: av is open; name is one NUL-terminated shm address (checked above), read up
        // to its NUL; fi_addr receives one entry; FI_AV_TABLE inserts synchronously.
        let ret = unsafe {
            sys::fabric_shim_fi_av_insert(
                self.av.as_ptr(),
                name.as_ptr().cast(),
                1,
                &mut fi_addr,
                0,
                std::ptr::null_mut(),
            )
        };
        if ret == 1 && fi_addr != sys::FI_ADDR_NOTAVAIL {
            self.av_remove(fi_addr);
        } else {
            tracing::debug!(ret, "a closing shm endpoint of this process could not be taken out of the map");
        }
    }

    /// The periodic shm work of a poll: peers whose process exited go down.
    pub(super) fn shm_maintenance(&mut self, out: &mut std::collections::VecDeque<Completion>) {
        let Some(shm) = self.shm.as_mut() else { return };
        if !shm.retired.is_empty() {
            let g = local();
            let (gone, keep): (Vec<Retired>, Vec<Retired>) =
                std::mem::take(&mut shm.retired).into_iter().partition(|r| !is_open(&g, &r.addr));
            drop(g);
            shm.retired = keep;
            for r in gone {
                // As `shm_drop_peer`: failed, then the endpoint holding them closed.
                for (slot, token) in r.ops {
                    if self.ctxs.holds(slot, token) {
                        self.ctxs.abandon(slot);
                        out.push_back(Completion::Failed {
                            token,
                            errno: libc::ECONNRESET,
                            message: "an shm peer in this process closed its endpoint".to_owned(),
                            cause: FailCause::of_errno(libc::ECONNRESET),
                        });
                    }
                }
                drop(r.ep);
            }
        }
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
