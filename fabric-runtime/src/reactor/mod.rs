//! The reactor thread: owns every domain (NIC) of one engine, posts what callers submit,
//! polls completion queues, and wakes the futures and counters waiting on them.
//!
//! One loop iteration: take the submission queue (swapping buffers, so no allocation in
//! steady state) → post (a full send queue leaves the rest in a backlog, in order) → poll
//! every domain → complete futures, count immediates, deliver messages. When an iteration
//! found nothing to do, the mode decides: `BusyPoll` spins, `Adaptive` spins until its
//! window since the last activity has passed, `Event` sleeps in `ppoll` on the eventfd and
//! each domain's wait fd, after `arm`ing every domain (so a completion racing the decision
//! to sleep is never missed). A domain with no wait fd turns that sleep into a timed poll.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::counter::CounterCell;
use crate::error::{Error, Result};
use crate::provider::{
    Completion, Domain, LocalSlice, MemoryLocation, Op, PeerHandle, PostError, Registration,
};
use crate::pure::slab::Slab;
use crate::shared::memory::{Backing, RegionShared};
use crate::shared::notify::Notify;
use crate::shared::queue::{OpKind, QueueState, Submission};
use crate::shared::{PeerId, Shared};
use crate::sync::lock;
use crate::sys;
use std::sync::Arc;

/// How the reactor thread waits for work. Chosen when the engine is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReactorMode {
    /// Sleep on the completion queue's wait fd and the submission eventfd when idle: about
    /// zero CPU while nothing happens; a wake-up costs a few microseconds. On providers with
    /// no wait fd (libfabric `shm`, EFA) the reactor cannot sleep on the NIC: for 1 ms after
    /// the last activity it keeps polling (so a transfer in progress, whose target side must
    /// poll for it to progress, is not paced by timer sleeps), then polls at an interval that
    /// backs off from 50 µs to `EngineBuilder::idle_poll_interval` (1 ms by default), so an
    /// arrival on an idle engine is seen within that interval.
    #[default]
    Event,
    /// Spin for `spin` after the last activity, then behave like `Event`.
    Adaptive {
        /// How long to keep spinning after the last completion or submission.
        spin: Duration,
    },
    /// Spin continuously (one core at 100%): the lowest latency, for MoE paths.
    BusyPoll,
}

/// What the reactor thread needs to know of the engine's settings (made by
/// `EngineBuilder::reactor_config`).
#[derive(Debug, Clone)]
pub(crate) struct ReactorConfig {
    pub(crate) mode: ReactorMode,
    pub(crate) pin_core: Option<usize>,
    pub(crate) idle_poll_interval: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) recv_depth: usize,
    pub(crate) send_depth: usize,
    pub(crate) op_timeout: Option<Duration>,
}

/// Tokens with this bit set name a posted receive buffer (low bits: its slot).
const RECV_TAG: u64 = 1 << 63;
/// Most completions taken from one domain per poll call.
const POLL_BATCH: usize = 64;
/// How long an `Event`-mode reactor keeps polling a domain that has no wait fd (shm, EFA)
/// after the last activity, before it falls back to timed polling.
const EVENT_NO_FD_SPIN: Duration = Duration::from_millis(1);
/// How often operation deadlines are checked (and the longest an `Event`-mode reactor with
/// operations in flight sleeps).
const DEADLINE_TICK: Duration = Duration::from_millis(100);

/// An operation the engine has posted and not yet seen complete.
struct InFlight {
    notify: Notify,
    /// Keeps the local region registered and allocated until the NIC is done with it.
    keep: Option<Arc<RegionShared>>,
    /// Send-pool slot to give back (domain, slot).
    send_slot: Option<(usize, u32)>,
    peer: PeerId,
    name: &'static str,
    posted: Instant,
}

/// A registered pool of fixed-size message slots of one domain.
struct Pool {
    backing: Backing,
    reg: Registration,
    slot_size: usize,
    free: Vec<u32>,
}

impl Pool {
    fn slot(&self, i: u32) -> LocalSlice {
        LocalSlice {
            addr: self.backing.addr() + i as u64 * self.slot_size as u64,
            len: self.slot_size,
            desc: self.reg.local,
        }
    }
}

struct PeerState {
    handles: Vec<PeerHandle>,
    failed: Option<String>,
    /// Operations the NIC refused for now (full queue, connection still being set up), in
    /// order, with the time they were submitted.
    pending: VecDeque<(Instant, Submission)>,
}

struct Reactor<D: Domain> {
    domains: Vec<D>,
    shared: Arc<Shared>,
    cfg: ReactorConfig,
    /// In-flight operations by token (generational: a stale completion finds nothing).
    slab: Slab<InFlight>,
    /// Peers with pending operations, in the order they got some. Each peer's operations
    /// stay in order; a stuck peer does not hold back the others.
    pending_peers: VecDeque<PeerId>,
    items: Vec<Submission>,
    completions: Vec<Completion>,
    peers: Vec<PeerState>,
    peer_by_addr: HashMap<Vec<u8>, PeerId>,
    /// Per domain: backend handle → peer id (to name the sender of a message).
    handle_to_peer: Vec<HashMap<PeerHandle, PeerId>>,
    counters: HashMap<u32, Arc<CounterCell>>,
    /// Registrations of live user regions, per domain, by handle: closed at shutdown.
    live: Vec<HashMap<u64, Registration>>,
    recv_pools: Vec<Pool>,
    send_pools: Vec<Pool>,
    /// Something was posted since the domains were last flushed.
    unflushed: bool,
    /// The `ppoll` set of `sleep`, kept between sleeps (no allocation per sleep).
    pollfds: Vec<libc::pollfd>,
}

/// Opens the message pools, then moves the domains to a new reactor thread.
pub(crate) fn spawn<D: Domain>(
    mut domains: Vec<D>,
    shared: Arc<Shared>,
    cfg: ReactorConfig,
) -> Result<JoinHandle<()>> {
    let slot = shared.max_msg_size;
    let mut recv_pools = Vec::new();
    let mut send_pools = Vec::new();
    for d in domains.iter_mut() {
        for (depth, pools) in [(cfg.recv_depth, &mut recv_pools), (cfg.send_depth, &mut send_pools)] {
            let backing = Backing::zeroed(slot * depth, 4096)?;
            // SAFETY: the backing is owned by the pool, which the reactor deregisters before
            // dropping (see `Reactor::close`).
            let reg = unsafe { d.register(backing.addr(), backing.len(), MemoryLocation::Host)? };
            pools.push(Pool { backing, reg, slot_size: slot, free: (0..depth as u32).rev().collect() });
        }
    }
    let n = domains.len();
    let mut r = Reactor {
        domains,
        shared,
        cfg,
        slab: Slab::default(),
        pending_peers: VecDeque::new(),
        items: Vec::with_capacity(1024),
        completions: Vec::with_capacity(POLL_BATCH),
        peers: Vec::new(),
        peer_by_addr: HashMap::new(),
        handle_to_peer: vec![HashMap::new(); n],
        counters: HashMap::new(),
        live: vec![HashMap::new(); n],
        recv_pools,
        send_pools,
        unflushed: false,
        pollfds: Vec::with_capacity(1 + n),
    };
    r.post_all_recvs()?;
    for d in r.domains.iter_mut() {
        d.flush();
    }
    std::thread::Builder::new().name("fabric-reactor".into()).spawn(move || r.run()).map_err(|e| {
        Error::Provider {
            call: "spawn reactor thread",
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        }
    })
}

fn is_peer_errno(errno: i32) -> bool {
    matches!(
        errno,
        libc::ECONNREFUSED
            | libc::ECONNRESET
            | libc::ECONNABORTED
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::ETIMEDOUT
            | libc::ENOTCONN
            | libc::EPIPE
            | libc::EHOSTDOWN
    )
}

impl<D: Domain> Reactor<D> {
    fn post_all_recvs(&mut self) -> Result<()> {
        for d in 0..self.domains.len() {
            let slots: Vec<u32> = std::mem::take(&mut self.recv_pools[d].free);
            for s in slots {
                self.post_recv(d, s)?;
            }
        }
        Ok(())
    }

    fn post_recv(&mut self, d: usize, slot: u32) -> Result<()> {
        let local = self.recv_pools[d].slot(slot);
        let token = RECV_TAG | (d as u64) << 32 | slot as u64;
        // SAFETY: the pool memory is registered with domain `d` and lives until `close`,
        // after the domain is gone.
        match unsafe { self.domains[d].post(token, &Op::Recv { local }) } {
            Ok(()) => Ok(()),
            Err(PostError::Again) => {
                // Receive queue full: keep the slot and try again on the next message.
                self.recv_pools[d].free.push(slot);
                Ok(())
            }
            Err(PostError::Failed(e)) => Err(e),
        }
    }

    fn run(mut self) {
        if let Some(core) = self.cfg.pin_core {
            if let Err(e) = sys::pin_to_core(core) {
                tracing::warn!(core, error = %e, "could not pin the fabric reactor thread");
            }
        }
        let mut last_activity = Instant::now();
        let mut idle_interval = Duration::from_micros(50);
        // How long to keep polling after the last activity before sleeping: Adaptive's
        // window; in Event mode, only when a domain has no wait fd (shm, EFA), which is
        // otherwise polled on a timer, so a transfer in progress is not paced by timer sleeps.
        let spin_after_activity = match self.cfg.mode {
            ReactorMode::Adaptive { spin } => spin,
            ReactorMode::Event if self.domains.iter().any(|d| d.wait_fd().is_none()) => EVENT_NO_FD_SPIN,
            _ => Duration::ZERO,
        };
        let spins = !spin_after_activity.is_zero();
        let mut next_deadline_check = Instant::now();
        loop {
            if let Some(limit) = self.cfg.op_timeout {
                if !self.slab.is_empty() || self.has_pending() {
                    let now = Instant::now();
                    if now >= next_deadline_check {
                        self.expire(now, limit);
                        next_deadline_check = now + DEADLINE_TICK;
                    }
                }
            }
            let mut busy = false;
            if self.shared.has_items.load(Ordering::Acquire) {
                let closing = self.take_submissions();
                if closing {
                    break;
                }
                busy = true;
            }
            if self.has_pending() {
                busy |= self.post_backlog();
            }
            if self.unflushed {
                self.unflushed = false;
                for d in self.domains.iter_mut() {
                    d.flush();
                }
            }
            busy |= self.poll_domains();
            if busy {
                idle_interval = Duration::from_micros(50);
                if spins {
                    last_activity = Instant::now();
                }
                continue;
            }
            let in_window = spins && last_activity.elapsed() < spin_after_activity;
            match self.cfg.mode {
                ReactorMode::BusyPoll => std::hint::spin_loop(),
                // Event mode's window on a domain without a wait fd polls, but yields the core
                // on every empty pass: a caller waiting to run (the task that will submit the
                // next operation) goes first, instead of waiting for the end of a timeslice.
                ReactorMode::Event if in_window => std::thread::yield_now(),
                _ if in_window => std::hint::spin_loop(),
                _ => {
                    self.sleep(idle_interval);
                    idle_interval = (idle_interval * 2).min(self.cfg.idle_poll_interval);
                }
            }
        }
        self.close();
    }

    /// Takes and handles every queued submission. Returns true if shutdown was requested.
    fn take_submissions(&mut self) -> bool {
        let closing = {
            let mut q = lock(&self.shared.queue);
            self.shared.has_items.store(false, Ordering::Release);
            std::mem::swap(&mut q.items, &mut self.items);
            q.state != QueueState::Open
        };
        let mut items = std::mem::take(&mut self.items);
        for s in items.drain(..) {
            self.handle(s);
        }
        self.items = items;
        closing
    }

    fn handle(&mut self, s: Submission) {
        match s {
            Submission::Op { .. } | Submission::Send { .. } => {
                let peer = s.peer();
                match self.peers.get_mut(peer.0 as usize) {
                    Some(p) if !p.pending.is_empty() => p.pending.push_back((Instant::now(), s)),
                    _ => {
                        if let Some(again) = self.try_post(s) {
                            self.defer(peer, Instant::now(), again);
                        }
                    }
                }
            }
            Submission::Register { backing, location, reply } => {
                let mut regs = Vec::with_capacity(self.domains.len());
                let mut err = None;
                for d in self.domains.iter_mut() {
                    // SAFETY: `backing` stays allocated until this registration is closed:
                    // the region that will own it retires it through the reactor.
                    match unsafe { d.register(backing.addr(), backing.len(), location) } {
                        Ok(r) => regs.push(r),
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                }
                if let Some(e) = err {
                    for (d, r) in regs.into_iter().enumerate() {
                        self.domains[d].deregister(r);
                    }
                    let _ = reply.send(Err(e));
                    return;
                }
                for (d, r) in regs.iter().enumerate() {
                    self.live[d].insert(r.handle, *r);
                }
                if let Err(Ok((regs, backing))) = reply.send(Ok((regs, backing))) {
                    // The caller stopped waiting: undo.
                    self.deregister(regs, backing);
                }
            }
            Submission::Deregister { regs, backing } => self.deregister(regs, backing),
            Submission::AddPeer { address, reply } => {
                let _ = reply.send(self.add_peer(address));
            }
        }
    }

    fn deregister(&mut self, regs: Vec<Registration>, backing: Backing) {
        for (d, r) in regs.into_iter().enumerate() {
            if self.live[d].remove(&r.handle).is_some() {
                self.domains[d].deregister(r);
            }
        }
        drop(backing);
    }

    fn add_peer(&mut self, address: crate::pure::descriptor::EngineAddress) -> Result<PeerId> {
        let key = address.to_bytes();
        if let Some(&id) = self.peer_by_addr.get(&key) {
            return Ok(id);
        }
        let mut handles = Vec::with_capacity(self.domains.len());
        for (d, a) in self.domains.iter_mut().zip(&address.domains) {
            handles.push(d.add_peer(a)?);
        }
        let id = PeerId(self.peers.len() as u32);
        for (d, h) in handles.iter().enumerate() {
            self.handle_to_peer[d].insert(*h, id);
        }
        self.peers.push(PeerState { handles, failed: None, pending: VecDeque::new() });
        self.peer_by_addr.insert(key, id);
        self.shared.npeers.store(self.peers.len() as u32, Ordering::Release);
        Ok(id)
    }

    /// Posts an operation. Returns it back if the NIC queue is full.
    fn try_post(&mut self, s: Submission) -> Option<Submission> {
        let (domain, peer) = match &s {
            Submission::Op { req, .. } => (req.domain, req.peer),
            Submission::Send { peer, .. } => (0, *peer),
            _ => unreachable!("only operations are posted"),
        };
        let handle = match self.peers.get(peer.0 as usize) {
            None => {
                s.fail(Error::UnknownPeer { peer: peer.0 });
                return None;
            }
            Some(PeerState { failed: Some(msg), .. }) => {
                let e = Error::PeerUnreachable { peer: peer.0, message: msg.clone() };
                s.fail(e);
                return None;
            }
            Some(p) => p.handles[domain],
        };
        let token = self.slab.next_token();
        let (op, send_slot, name) = match &s {
            Submission::Op { req, keep, .. } => {
                let desc = keep.as_ref().map_or(0, |k| k.regs[domain].local);
                let local = LocalSlice { addr: req.local_addr, len: req.len, desc };
                let op = match req.kind {
                    OpKind::Write => Op::Write { peer: handle, local, remote: req.remote, imm: req.imm },
                    OpKind::Read => Op::Read { peer: handle, local, remote: req.remote },
                };
                (op, None, req.kind.name(req.imm))
            }
            Submission::Send { data, .. } => {
                let pool = &mut self.send_pools[domain];
                let Some(slot) = pool.free.pop() else { return Some(s) };
                let mut local = pool.slot(slot);
                local.len = data.len();
                // SAFETY: the slot is inside the pool's allocation and free (no operation
                // uses it); `data.len() <= max_msg_size == slot_size` (checked on submit).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), local.addr as *mut u8, data.len()) };
                (Op::Send { peer: handle, local }, Some((domain, slot)), "send")
            }
            _ => unreachable!(),
        };
        // SAFETY: local memory is either a user region kept alive by `keep` (stored in the
        // slab until the completion) or a pool slot owned by the reactor; both are
        // registered with `domain`.
        match unsafe { self.domains[domain].post(token, &op) } {
            Ok(()) => {
                let (notify, keep) = match s {
                    Submission::Op { notify, keep, .. } => (notify, keep),
                    Submission::Send { notify, .. } => (notify, None),
                    _ => unreachable!(),
                };
                self.slab.insert(InFlight { notify, keep, send_slot, peer, name, posted: Instant::now() });
                self.unflushed = true;
                None
            }
            Err(PostError::Again) => {
                if let Some((d, slot)) = send_slot {
                    self.send_pools[d].free.push(slot);
                }
                Some(s)
            }
            Err(PostError::Failed(e)) => {
                if let Some((d, slot)) = send_slot {
                    self.send_pools[d].free.push(slot);
                }
                s.fail(e);
                None
            }
        }
    }

    /// Queues an operation the NIC refused for now behind the peer's other pending ones.
    fn defer(&mut self, peer: PeerId, since: Instant, s: Submission) {
        let p = &mut self.peers[peer.0 as usize];
        if p.pending.is_empty() {
            self.pending_peers.push_back(peer);
        }
        p.pending.push_back((since, s));
    }

    /// Retries pending operations, peer by peer. Stops early when several peers in a row
    /// are refused (the NIC queue itself is full).
    fn post_backlog(&mut self) -> bool {
        let mut posted = false;
        let mut refused = 0;
        for _ in 0..self.pending_peers.len() {
            let Some(peer) = self.pending_peers.pop_front() else { break };
            let mut blocked = false;
            while let Some((since, s)) = self.peers[peer.0 as usize].pending.pop_front() {
                if let Some(again) = self.try_post(s) {
                    self.peers[peer.0 as usize].pending.push_front((since, again));
                    blocked = true;
                    break;
                }
                posted = true;
            }
            if blocked {
                self.pending_peers.push_back(peer);
                refused += 1;
                if refused >= 4 {
                    break;
                }
            }
        }
        posted
    }

    fn has_pending(&self) -> bool {
        !self.pending_peers.is_empty()
    }

    fn poll_domains(&mut self) -> bool {
        let mut any = false;
        for d in 0..self.domains.len() {
            let mut comps = std::mem::take(&mut self.completions);
            match self.domains[d].poll(&mut comps, POLL_BATCH) {
                Ok(0) => {}
                Ok(_) => {
                    any = true;
                    for c in comps.drain(..) {
                        self.complete(d, c);
                    }
                }
                Err(e) => tracing::error!(domain = d, error = %e, "polling the completion queue failed"),
            }
            self.completions = comps;
        }
        any
    }

    fn complete(&mut self, d: usize, c: Completion) {
        match c {
            Completion::Imm { imm } => {
                let shared = &self.shared;
                self.counters.entry(imm).or_insert_with(|| shared.counter_cell(imm)).arrive(1);
            }
            Completion::Done { token } => {
                if let Some(op) = self.slab.remove(token) {
                    self.finish(op, Ok(()));
                } else {
                    tracing::warn!(token, "completion for an unknown operation");
                }
            }
            Completion::Failed { token, errno, message } => {
                if token & RECV_TAG != 0 {
                    tracing::debug!(errno, %message, "a posted receive failed (cancelled at shutdown?)");
                    return;
                }
                let Some(op) = self.slab.remove(token) else {
                    tracing::warn!(token, errno, %message, "failure for an unknown operation");
                    return;
                };
                let e = if is_peer_errno(errno) {
                    let peer = op.peer;
                    if let Some(p) = self.peers.get_mut(peer.0 as usize) {
                        p.failed = Some(message.clone());
                    }
                    Error::PeerUnreachable { peer: peer.0, message }
                } else {
                    Error::Completion { op: op.name, errno, message }
                };
                self.finish(op, Err(e));
            }
            Completion::Recv { token, len, src } => {
                let slot = (token & 0xffff_ffff) as u32;
                let pool = &self.recv_pools[d];
                let local = pool.slot(slot);
                let len = len.min(pool.slot_size);
                // SAFETY: the NIC has completed this receive, so the slot holds `len` bytes
                // and nothing writes to it until it is posted again below.
                let data = Bytes::copy_from_slice(unsafe {
                    std::slice::from_raw_parts(local.addr as *const u8, len)
                });
                let from = src.and_then(|h| self.handle_to_peer[d].get(&h).copied());
                let waker = lock(&self.shared.inbox).push((from, data));
                if let Some(w) = waker {
                    w.wake();
                }
                if let Err(e) = self.post_recv(d, slot) {
                    tracing::error!(error = %e, "re-posting a receive buffer failed");
                }
                self.unflushed = true;
            }
        }
    }

    /// Fails every operation that has waited longer than `limit` for its completion and
    /// marks its peer failed. The slab entry stays (keeping its memory alive) until the
    /// provider completes or shutdown cancels it.
    fn expire(&mut self, now: Instant, limit: Duration) {
        // Operations that never even reached the NIC (a peer whose connection never comes
        // up keeps refusing them).
        for i in 0..self.pending_peers.len() {
            let peer = self.pending_peers[i];
            let p = &mut self.peers[peer.0 as usize];
            if p.pending.front().is_some_and(|(since, _)| now.duration_since(*since) >= limit) {
                let message = format!("operations could not be posted within {limit:?}; peer marked failed");
                tracing::warn!(peer = peer.0, %message, "operations timed out");
                p.failed.get_or_insert_with(|| message.clone());
                for (_, s) in p.pending.drain(..) {
                    s.fail(Error::PeerUnreachable { peer: peer.0, message: message.clone() });
                }
            }
        }
        let peers = &self.peers;
        self.pending_peers.retain(|p| !peers[p.0 as usize].pending.is_empty());
        for op in self.slab.iter_mut() {
            if matches!(op.notify, Notify::None) || now.duration_since(op.posted) < limit {
                continue;
            }
            let message = format!("no completion for a {} within {limit:?}; peer marked failed", op.name);
            tracing::warn!(peer = op.peer.0, %message, "operation timed out");
            if let Some(p) = self.peers.get_mut(op.peer.0 as usize) {
                p.failed.get_or_insert_with(|| message.clone());
            }
            let notify = std::mem::replace(&mut op.notify, Notify::None);
            notify.fail(Error::PeerUnreachable { peer: op.peer.0, message });
        }
    }

    fn finish(&mut self, op: InFlight, result: Result<()>) {
        if let Some((d, slot)) = op.send_slot {
            self.send_pools[d].free.push(slot);
        }
        let next = op.notify.complete(result);
        drop(op.keep);
        for s in next {
            // The imm-only writes of an `Arrivals::One` transfer: its shards are all done.
            self.handle(s);
        }
    }

    /// Sleeps until a submission or a completion may be there (or the poll interval of a
    /// domain without a wait fd passes).
    fn sleep(&mut self, idle_interval: Duration) {
        let mut fds = std::mem::take(&mut self.pollfds);
        fds.clear();
        fds.push(libc::pollfd { fd: self.shared.wake.raw(), events: libc::POLLIN, revents: 0 });
        let mut timeout: Option<Duration> = None;
        for d in self.domains.iter_mut() {
            if let Some(t) = d.timer() {
                timeout = Some(timeout.map_or(t, |cur| cur.min(t)));
            }
            match d.wait_fd() {
                Some(fd) => {
                    if !d.arm() {
                        self.pollfds = fds;
                        return; // completions pending: poll again
                    }
                    fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                }
                None => timeout = Some(timeout.map_or(idle_interval, |cur| cur.min(idle_interval))),
            }
        }
        if self.has_pending() {
            // Posts are waiting for queue space; completions will wake us, but stay safe
            // against a provider that frees space without one.
            let t = Duration::from_micros(100);
            timeout = Some(timeout.map_or(t, |cur| cur.min(t)));
        }
        if self.cfg.op_timeout.is_some() && !self.slab.is_empty() {
            // Wake up to check deadlines even if the peer never answers.
            timeout = Some(timeout.map_or(DEADLINE_TICK, |t| t.min(DEADLINE_TICK)));
        }
        {
            let mut q = lock(&self.shared.queue);
            if !q.items.is_empty() || q.state != QueueState::Open {
                drop(q);
                self.pollfds = fds;
                return;
            }
            q.sleeping = true;
        }
        if let Err(e) = sys::wait(&mut fds, timeout) {
            tracing::error!(error = %e, "ppoll failed");
        }
        lock(&self.shared.queue).sleeping = false;
        if fds[0].revents != 0 {
            self.shared.wake.drain();
        }
        let mut i = 1;
        for d in self.domains.iter_mut() {
            if d.wait_fd().is_some() {
                if fds[i].revents != 0 {
                    d.ack_wakeup();
                }
                i += 1;
            }
        }
        self.pollfds = fds;
    }

    /// Shutdown: refuse new work, drain, cancel, close NIC objects, then free memory.
    fn close(mut self) {
        let items = std::mem::take(&mut lock(&self.shared.queue).items);
        for s in items {
            match s {
                Submission::Deregister { regs, backing } => self.deregister(regs, backing),
                other => other.fail(Error::Shutdown),
            }
        }
        for p in self.peers.iter_mut() {
            for (_, s) in p.pending.drain(..) {
                s.fail(Error::Shutdown);
            }
        }
        // Give in-flight operations a chance to finish normally.
        let deadline = Instant::now() + self.cfg.shutdown_grace;
        while !self.slab.is_empty() && Instant::now() < deadline {
            if !self.poll_domains() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        // Follow-ups posted during the grace period may have been queued behind a full NIC.
        for p in self.peers.iter_mut() {
            for (_, s) in p.pending.drain(..) {
                s.fail(Error::Shutdown);
            }
        }
        let mut keep = Vec::new();
        for op in self.slab.drain() {
            keep.push(op.keep);
            op.notify.fail(Error::Shutdown);
        }
        self.shared.close_counters();
        let waiters = {
            let mut inbox = lock(&self.shared.inbox);
            inbox.closed = true;
            inbox.take_waiters()
        };
        for w in waiters {
            w.wake();
        }
        // Close every registration, then the domains; only then free memory.
        for (d, live) in self.live.iter_mut().enumerate() {
            for (_, r) in live.drain() {
                self.domains[d].deregister(r);
            }
        }
        for (d, p) in self.recv_pools.iter().chain(self.send_pools.iter()).enumerate() {
            let d = d % self.domains.len();
            self.domains[d].deregister(p.reg);
        }
        drop(std::mem::take(&mut self.domains));
        let graveyard = {
            let mut q = lock(&self.shared.queue);
            q.state = QueueState::Closed;
            std::mem::take(&mut q.graveyard)
        };
        drop(graveyard);
        drop(keep);
    }
}
