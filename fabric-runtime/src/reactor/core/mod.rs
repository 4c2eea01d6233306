//! The reactor's state and one pass of its loop ([`Core::turn`]): take the submission
//! queue, post, poll every domain, complete (`complete.rs`). The reactor thread (`reactor/mod.rs`) runs
//! passes and decides how to wait between them; in `ReactorMode::Inline` the awaiting
//! caller runs them too, under the same lock, so a domain still has one user at a time.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ReactorConfig;
use crate::counter::CounterCell;
use crate::error::{Error, Result};
use crate::provider::{
    Completion, Domain, LocalSlice, MemoryLocation, Op, PeerHandle, PostError, Registration,
};
use crate::pure::int_map::IntMap;
use crate::pure::slab::Slab;
use crate::shared::memory::{Backing, RegionShared};
use crate::shared::notify::Notify;
use crate::shared::queue::{OpKind, QueueState, Submission};
use crate::shared::stats::{bump, OpCounters, ReactorCounters};
use crate::shared::{PeerId, Shared};
use crate::sync::lock;
use crate::sys;

// The GPU half of the reactor (gates on CUDA events, the staging pool, the pull protocol):
// a child module, so it works on `Core`'s fields directly.
#[cfg(feature = "cuda")]
mod gpu;
// Preparing an `Event`-mode sleep, waking from it, and whether a sleep still covers what a
// caller posted directly (a child module: it works on `Core`'s fields).
mod sleep;
// Shutdown (drain, cancel, close the NIC objects, free memory): a child module, so it works
// on `Core`'s fields directly.
mod close;
// The completion half of a pass (poll the domains, count arrivals, finish operations,
// deliver messages) and operation deadlines: a child module, so it works on `Core`'s fields.
mod complete;
// Adding, removing and failing peers; Hello and Revoke: a child module too.
mod peers;
// Bringing back a peer marked down that answers again, without blocking (a child module).
mod revive;
// Owners vouching for descriptors before they are used, where a bad key is refused silently
// (a child module).
mod vouch;
// Where a bad key is refused silently (shm): freed regions stay registered until their
// peers acknowledge the revocation, and writers acknowledge once what they posted is done
// (a child module).
mod drain;

/// Tokens with this bit set name a posted receive buffer (low bits: its slot).
const RECV_TAG: u64 = 1 << 63;
/// Most completions taken from one domain per poll call.
const POLL_BATCH: usize = 64;
/// How long an `Event`-mode reactor keeps polling a domain that has no wait fd (shm, EFA)
/// after the last activity, before it falls back to timed polling.
pub(crate) const EVENT_NO_FD_SPIN: Duration = Duration::from_millis(1);
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
    /// For the statistics: the NIC it was posted on and its bytes.
    nic: usize,
    bytes: u64,
    /// Failed by `op_timeout` (and counted as an error then); still held for the NIC.
    expired: bool,
    /// One of the engine's own control messages ([`Submission::is_internal`]): not in the
    /// statistics.
    internal: bool,
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

/// A live user registration on one NIC, and the length it covers (what an owner vouches
/// for: `vouch.rs`).
#[derive(Clone, Copy)]
struct LiveReg {
    reg: Registration,
    len: u64,
}

struct PeerState {
    handles: Vec<PeerHandle>,
    /// Added only because it said `Hello` (it holds our descriptors; the application never
    /// asked for it): its going down is logged at debug, not as a warning (a peer that shuts
    /// down cleanly goes down too).
    passive: bool,
    failed: Option<String>,
    /// Removed by `Engine::remove_peer`: its handles are given back, its id is not reused.
    removed: bool,
    /// Its engine's incarnation (0: unknown, an older build's address).
    incarnation: u64,
    /// Operations the NIC refused for now (full queue, connection still being set up), in
    /// order, with the time they were submitted.
    pending: VecDeque<(Instant, Submission)>,
    /// This peer's entry of `Engine::stats`.
    stats: Arc<OpCounters>,
}

pub(crate) struct Core<D: Domain> {
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
    handle_to_peer: Vec<IntMap<PeerHandle, PeerId>>,
    /// The counters this reactor has counted arrivals into: those of the engine's table
    /// (`Shared::counters`) that arrivals reached, so no more than it holds; an entry leaves
    /// with `retire_counter`.
    counters: HashMap<u32, Arc<CounterCell>>,
    /// The counter of the last arrival (`arrive`).
    last_counter: Option<(u32, Arc<CounterCell>)>,
    /// Registrations of live user regions, per domain, by handle: closed at shutdown, and
    /// what this engine vouches for (`vouch.rs`).
    live: Vec<IntMap<u64, LiveReg>>,
    recv_pools: Vec<Pool>,
    send_pools: Vec<Pool>,
    /// Something was posted since the domains were last flushed.
    unflushed: bool,
    /// The `ppoll` set of a sleep, kept between sleeps (no allocation per sleep).
    pub(crate) pollfds: Vec<libc::pollfd>,
    /// When operation deadlines are checked next (`sys::coarse_now_ns`).
    next_deadline_check: u64,
    /// While the reactor thread sleeps: when its timeout runs out (`None`: no timeout),
    /// counted from before its timers were read, so never past the instant a timer it was
    /// prepared with falls due; `ppoll`'s own end is microseconds later.
    armed_until: Option<Instant>,
    /// The reactor thread's fallback sleep while a watcher has the wait fds (`sleep.rs`).
    watch_fallback: Duration,

    /// Shutdown was requested: the reactor thread must run [`Core::close`]; passes do
    /// nothing more.
    pub(crate) closing: bool,
    /// [`Core::close`] has run: the domains are gone.
    closed: bool,
    /// When the current `Event` sleep began (for the reactor's statistics).
    slept_since: Option<Instant>,
    /// Regions freed since the last revocations were sent: (base, key) on NIC 0.
    revoking: Vec<(u64, u64)>,
    /// Revivals of peers marked down that wait for the NICs' outcome (`revive.rs`).
    reviving: Vec<revive::Reviving>,
    /// Descriptors asked about and not answered yet by their owners (`vouch.rs`).
    vouching: Vec<vouch::Vouching>,
    /// The number of the next vouch question.
    next_vouch: u64,
    /// Freed regions kept registered until their peers acknowledge the revocation (shm:
    /// `drain.rs`).
    draining: Vec<drain::Draining>,
    /// Acknowledgements of peers' revocations waiting for our operations to them (`drain.rs`).
    acking: Vec<drain::Acking>,
    /// Keys peers revoked lately, checked when an operation is posted (`drain.rs`).
    recent: drain::Recent,
    /// Staged GPU transfers: CUDA streams, copies waiting for their event, pulls.
    #[cfg(feature = "cuda")]
    staging: gpu::Staging,
}

impl<D: Domain> Core<D> {
    /// Registers the message pools on every domain and posts the receives.
    pub(crate) fn open(mut domains: Vec<D>, shared: Arc<Shared>, cfg: ReactorConfig) -> Result<Self> {
        // A slot holds a user message of `max_msg_size` bytes after its kind byte, and the
        // engine's own control messages (computed by the engine).
        let slot = cfg.msg_slot;
        let mut recv_pools = Vec::new();
        let mut send_pools = Vec::new();
        for d in domains.iter_mut() {
            for (depth, pools) in [(cfg.recv_depth, &mut recv_pools), (cfg.send_depth, &mut send_pools)] {
                let backing = Backing::zeroed(slot * depth, 4096)?;
                // SAFETY: the backing is owned by the pool, which `close` deregisters before
                // the pool is dropped.
                let reg = unsafe { d.register(backing.addr(), backing.len(), MemoryLocation::Host)? };
                pools.push(Pool { backing, reg, slot_size: slot, free: (0..depth as u32).rev().collect() });
            }
        }
        let n = domains.len();
        let mut r = Core {
            domains,
            shared,
            cfg,
            slab: Slab::default(),
            pending_peers: VecDeque::new(),
            items: Vec::with_capacity(1024),
            completions: Vec::with_capacity(POLL_BATCH),
            peers: Vec::new(),
            peer_by_addr: HashMap::new(),
            handle_to_peer: vec![IntMap::default(); n],
            counters: HashMap::new(),
            last_counter: None,
            live: vec![IntMap::default(); n],
            recv_pools,
            send_pools,
            unflushed: false,
            pollfds: Vec::with_capacity(1 + n),
            next_deadline_check: 0,
            armed_until: None,
            watch_fallback: sleep::WATCH_FALLBACK,
            closing: false,
            closed: false,
            slept_since: None,
            revoking: Vec::new(),
            reviving: Vec::new(),
            vouching: Vec::new(),
            next_vouch: 0,
            draining: Vec::new(),
            acking: Vec::new(),
            recent: drain::Recent::default(),
            #[cfg(feature = "cuda")]
            staging: gpu::Staging::default(),
        };
        r.post_all_recvs()?;
        for d in r.domains.iter_mut() {
            d.flush();
        }
        Ok(r)
    }

    /// Whether CUDA copies are in flight and one started or finished lately: an idle
    /// reactor then polls instead of sleeping (`gpu::GATE_POLL_WINDOW`).
    pub(crate) fn copies_fresh(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.staging.copies_fresh();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Whether staged GPU writes wait for ACKs (which `op_timeout` also bounds).
    fn staging_waits(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.staging.awaits_acks();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Operations posted and not yet completed.
    pub(crate) fn in_flight(&self) -> usize {
        self.slab.len()
    }

    /// Whether some domain has no wait fd (shm, EFA): it cannot wake a sleeper.
    pub(crate) fn has_fdless_domain(&self) -> bool {
        self.domains.iter().any(|d| d.wait_fd().is_none())
    }

    /// The wait fds of the domains that have one.
    pub(crate) fn wait_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.domains.iter().filter_map(|d| d.wait_fd()).collect()
    }

    /// One pass: check deadlines (at most every `DEADLINE_TICK`), take the submission
    /// queue, retry the backlog, flush, poll every domain, complete what finished and settle
    /// the revivals the NICs have an outcome for.
    /// Returns whether anything happened. Once shutdown is requested it sets `closing` and
    /// does nothing more; the reactor thread then runs [`Core::close`].
    pub(crate) fn turn(&mut self) -> bool {
        if self.closing {
            return false;
        }
        bump(&self.shared.stats.reactor.passes, 1);
        if let Some(limit) = self.cfg.op_timeout {
            if !self.slab.is_empty() || self.has_pending() || self.staging_waits() {
                // The coarse clock gates the precise one: a spinning caller runs this on
                // every pass, with an operation in flight.
                let coarse = sys::coarse_now_ns();
                if coarse >= self.next_deadline_check {
                    self.expire(Instant::now(), limit);
                    self.next_deadline_check = coarse + DEADLINE_TICK.as_nanos() as u64;
                }
            }
        }
        let mut busy = false;
        if self.shared.has_items.load(Ordering::Acquire) {
            if self.take_submissions() {
                return true;
            }
            busy = true;
        }
        if self.has_pending() {
            busy |= self.post_backlog();
        }
        self.flush_posted();
        #[cfg(feature = "cuda")]
        if self.staging.active() {
            busy |= self.poll_staging();
        }
        busy |= self.poll_domains();
        if !self.reviving.is_empty() {
            busy |= self.check_revivals();
        }
        if !self.vouching.is_empty() {
            self.check_vouches();
        }
        if !self.acking.is_empty() {
            busy |= self.send_acks();
        }
        if !self.draining.is_empty() {
            self.check_drains();
        }
        if busy {
            self.watch_fallback = sleep::WATCH_FALLBACK;
        }
        busy
    }
}

impl<D: Domain> Core<D> {
    /// An `Inline` caller's operation, posted now on its thread (`SubmitHere::submit_here`),
    /// after whatever was queued before it. `Ok(true)`: the reactor thread sleeps and its
    /// sleep does not cover the new operation (it needs a timed pass sooner), so the caller
    /// wakes it. Gives `s` back if shutdown was requested (the queue then refuses it too).
    pub(crate) fn submit_here(&mut self, s: Submission) -> std::result::Result<bool, Submission> {
        if self.closing {
            return Err(s);
        }
        if self.shared.has_items.load(Ordering::Acquire) && self.take_submissions() {
            return Err(s);
        }
        self.handle(s);
        self.flush_posted();
        Ok(self.armed_until.is_some() && !self.sleep_covers_posts())
    }

    /// Hands what was posted since the last flush to the NICs (verbs rings its doorbell
    /// here).
    fn flush_posted(&mut self) {
        if self.unflushed {
            self.unflushed = false;
            for d in self.domains.iter_mut() {
                d.flush();
            }
        }
    }

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
        let t = self.clock();
        // SAFETY: the pool memory is registered with domain `d` and lives until `close`,
        // after the domain is gone.
        let posted = unsafe { self.domains[d].post(token, &Op::Recv { local }) };
        ReactorCounters::charge(&self.shared.stats.reactor.post_ns, t);
        match posted {
            Ok(()) => Ok(()),
            Err(PostError::Again) => {
                // Receive queue full: keep the slot and try again on the next message.
                self.recv_pools[d].free.push(slot);
                Ok(())
            }
            Err(PostError::Failed(e)) => Err(e),
        }
    }

    /// Takes and handles every queued submission. Returns true if shutdown was requested
    /// (and sets `closing`, which the reactor thread acts on).
    fn take_submissions(&mut self) -> bool {
        let t = self.clock();
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
        ReactorCounters::charge(&self.shared.stats.reactor.take_ns, t);
        self.closing |= closing;
        if !self.revoking.is_empty() && !self.closing {
            self.send_revocations();
        }
        closing
    }

    /// Whether the engine shut down or was asked to.
    pub(crate) fn shutting_down(&self) -> bool {
        self.closing || self.shared.closing()
    }

    /// Registers `len` bytes at `addr` with every domain, and records them as live (what
    /// owners vouch for). On an error nothing stays registered. On the reactor thread for a
    /// `Submission::Register`, or on a caller's thread (`register_now`).
    pub(crate) fn register(
        &mut self,
        addr: u64,
        len: usize,
        location: MemoryLocation,
    ) -> Result<Vec<Registration>> {
        let mut regs = Vec::with_capacity(self.domains.len());
        for d in self.domains.iter_mut() {
            // SAFETY: the caller's backing stays allocated until this registration is
            // closed: the region that will own it retires it through the reactor.
            match unsafe { d.register(addr, len, location) } {
                Ok(r) => regs.push(r),
                Err(e) => {
                    tracing::warn!(len, %location, error = %e, "registration failed");
                    for (d, r) in regs.into_iter().enumerate() {
                        self.domains[d].deregister(r);
                    }
                    return Err(e);
                }
            }
        }
        tracing::debug!(addr = format_args!("{addr:#x}"), len, %location, "memory registered");
        for (d, r) in regs.iter().enumerate() {
            self.live[d].insert(r.handle, LiveReg { reg: *r, len: len as u64 });
        }
        Ok(regs)
    }

    fn handle(&mut self, s: Submission) {
        match s {
            Submission::Op { .. } | Submission::Send { .. } => {
                let peer = s.peer();
                if self.peers.get(peer.0 as usize).is_some_and(|p| !p.pending.is_empty()) {
                    self.defer(peer, Instant::now(), s);
                } else if let Some(again) = self.try_post(s) {
                    self.defer(peer, Instant::now(), again);
                }
            }
            Submission::Register { backing, location, reply } => {
                let regs = match self.register(backing.addr(), backing.len(), location) {
                    Ok(regs) => regs,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                if let Err(Ok((regs, backing))) = reply.send(Ok((regs, backing))) {
                    // The caller stopped waiting: undo.
                    self.deregister(regs, backing);
                }
            }
            Submission::Deregister { regs, backing } => {
                tracing::debug!(
                    addr = format_args!("{:#x}", backing.addr()),
                    len = backing.len(),
                    "memory deregistered"
                );
                if let Some(r) = regs.first().filter(|_| !self.closing) {
                    // Peers holding its descriptor learn that it is stale (`revoke.rs`).
                    self.revoking.push((r.remote_base, r.remote_key));
                }
                self.drain_or_deregister(regs, backing)
            }
            Submission::AddPeer { address, reply } => self.add_peer(address, reply),
            Submission::RemovePeer { peer, reply } => {
                let _ = reply.send(self.remove_peer(peer));
            }
            Submission::RetireCounter { imm, reply } => {
                let _ = reply.send(Ok(self.retire_counter(imm)));
            }
            Submission::Vouch { peer, incarnation, len, regions, reply } => {
                self.vouch(peer, incarnation, len, regions, reply)
            }
            #[cfg(feature = "cuda")]
            Submission::Gated(g) => {
                let crate::shared::queue::GatedCopies { ordinal, copies, then, done, keep, after, handed } =
                    *g;
                self.start_gate(
                    ordinal,
                    gpu::Lane::Next,
                    after.as_deref(),
                    &copies,
                    gpu::GateThen::Submit(then, done),
                    keep,
                    Some(handed),
                )
            }
            #[cfg(feature = "cuda")]
            Submission::Staged(job) => self.start_job(*job),
            #[cfg(feature = "cuda")]
            Submission::Push { peer, push, keep, notify } => self.send_push(peer, *push, keep, notify),
            #[cfg(feature = "cuda")]
            Submission::ReadStaged { peer, region, dst_off, len, sources, notify } => {
                self.start_read(peer, region, dst_off, len, sources, notify)
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

    /// Posts an operation. Returns it back if the NIC queue is full.
    fn try_post(&mut self, s: Submission) -> Option<Submission> {
        let (domain, peer) = match &s {
            Submission::Op { req, .. } => (req.domain, req.peer),
            Submission::Send { peer, .. } => (0, *peer),
            _ => unreachable!("only operations are posted"),
        };
        let handle = match self.peers.get(peer.0 as usize) {
            None => {
                if !s.is_internal() {
                    self.shared.stats.failed(domain, None, false);
                }
                s.fail(Error::UnknownPeer { peer: peer.0 });
                return None;
            }
            Some(PeerState { failed: Some(msg), stats, .. }) => {
                if !s.is_internal() {
                    self.shared.stats.failed(domain, Some(stats), false);
                }
                let e = Error::PeerUnreachable { peer: peer.0, message: msg.clone() };
                s.fail(e);
                return None;
            }
            Some(p) => p.handles[domain],
        };
        let too_long = match &s {
            Submission::Send { data, .. } => {
                Some(data.len()).filter(|&n| n > self.send_pools[domain].slot_size)
            }
            _ => None,
        };
        if let Some(len) = too_long {
            self.shared.stats.failed(domain, Some(&self.peers[peer.0 as usize].stats), false);
            s.fail(Error::MessageTooLarge { len, max: self.send_pools[domain].slot_size });
            return None;
        }
        if let Submission::Op { req, .. } = &s {
            // Its region's revocation arrived while it waited to be posted (`drain.rs`).
            if self.revoked_at_post(peer, domain, req.remote.addr, req.remote.key) {
                self.shared.stats.failed(domain, Some(&self.peers[peer.0 as usize].stats), false);
                s.fail(crate::engine::region::revoked_error(peer));
                return None;
            }
        }
        let token = self.slab.next_token();
        let internal = s.is_internal();
        let (op, send_slot, name, bytes) = match &s {
            Submission::Op { req, keep, .. } => {
                let desc = keep.as_ref().map_or(0, |k| k.regs[domain].local);
                let local = LocalSlice { addr: req.local_addr, len: req.len, desc };
                let op = match req.kind {
                    OpKind::Write => Op::Write { peer: handle, local, remote: req.remote, imm: req.imm },
                    OpKind::Read => Op::Read { peer: handle, local, remote: req.remote },
                };
                (op, None, req.kind.name(req.imm), req.len as u64)
            }
            Submission::Send { data, .. } => {
                let pool = &mut self.send_pools[domain];
                let Some(slot) = pool.free.pop() else { return Some(s) };
                let mut local = pool.slot(slot);
                local.len = data.len();
                // SAFETY: the slot is inside the pool's allocation and free (no operation
                // uses it); `data.len() <= slot_size` (checked above).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), local.addr as *mut u8, data.len()) };
                (Op::Send { peer: handle, local }, Some((domain, slot)), "send", data.len() as u64)
            }
            _ => unreachable!(),
        };
        let t = self.clock();
        // SAFETY: local memory is either a user region kept alive by `keep` (stored in the
        // slab until the completion) or a pool slot owned by the reactor; both are
        // registered with `domain`.
        let posted = unsafe { self.domains[domain].post(token, &op) };
        ReactorCounters::charge(&self.shared.stats.reactor.post_ns, t);
        match posted {
            Ok(()) => {
                let (notify, keep) = match s {
                    Submission::Op { notify, keep, .. } => (notify, keep),
                    Submission::Send { notify, .. } => (notify, None),
                    _ => unreachable!(),
                };
                if !internal {
                    self.shared.stats.posted(domain, &self.peers[peer.0 as usize].stats, bytes);
                }
                self.slab.insert(InFlight {
                    notify,
                    keep,
                    send_slot,
                    peer,
                    name,
                    posted: Instant::now(),
                    nic: domain,
                    bytes,
                    expired: false,
                    internal,
                });
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
                if !internal {
                    self.shared.stats.failed(domain, Some(&self.peers[peer.0 as usize].stats), false);
                }
                tracing::warn!(peer = peer.0, nic = domain, error = %e, "posting an operation failed");
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
        self.shared.stats.backlog(s.nic(), &p.stats, true, 1);
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
                let nic = s.nic();
                if let Some(again) = self.try_post(s) {
                    self.peers[peer.0 as usize].pending.push_front((since, again));
                    blocked = true;
                    break;
                }
                self.shared.stats.backlog(nic, &self.peers[peer.0 as usize].stats, false, 1);
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

    /// The clock, where the reactor times its calls (`EngineBuilder::time_reactor`).
    fn clock(&self) -> Option<Instant> {
        self.cfg.time_calls.then(Instant::now)
    }

    fn has_pending(&self) -> bool {
        !self.pending_peers.is_empty()
    }
}
