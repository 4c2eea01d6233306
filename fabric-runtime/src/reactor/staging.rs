//! The reactor's staged-GPU half: CUDA copies it waits for without blocking (gates), and
//! both ends of the pull protocol (`pure::control`).
//!
//! ```text
//!  gate:  copies on the device's stream ─► event ─► (polled every pass) ─► post `then`
//!
//!  pull, at the owner of the staged GPU destination:
//!   PULL ─► read chunk 0..k (≤ 4 in flight, round-robin over NICs) into the shadow
//!        └► read k done ─► H2D copy of chunk k (gate) ─► all copied ─► count imm ─► ACK
//!  at the sender: PULL sent (source kept alive) ─► ACK ─► the caller's future completes
//! ```
//!
//! A child module of `core`, so it works on [`Core`]'s fields. Nothing here blocks, except
//! [`Core::close_staging`] at shutdown, which waits for the copy engines before the memory
//! they use may go.

use std::any::Any;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::Core;
use crate::cuda::{self, Event, EventStatus, Stream};
use crate::error::{Error, Result};
use crate::provider::{Domain, RemoteSlice};
use crate::pure::control::{Ack, Pull, PullSource};
use crate::pure::descriptor::EngineAddress;
use crate::pure::staging::ChunkPlan;
use crate::shared::memory::RegionShared;
use crate::shared::notify::{InternalFailures, Notify};
use crate::shared::queue::{CopyDir, CudaCopy, OpKind, OpReq, Submission};
use crate::shared::PeerId;
use crate::sync::lock;

/// Chunk reads of one pull in flight at once (the shadow holds every chunk, so this bounds
/// NIC work, not memory).
const PULL_READS_IN_FLIGHT: u32 = 4;
/// Internal tags: the kind in the top two bits.
const KIND_SHIFT: u32 = 62;
const LOW: u64 = (1 << KIND_SHIFT) - 1;
const TAG_PULL_SENT: u64 = 1;
const TAG_READ: u64 = 2;
const TAG_ACK_SENT: u64 = 3;
/// A read's tag: pull id above these bits, chunk index below.
const CHUNK_BITS: u32 = 30;

pub(super) type Keep = Vec<Arc<dyn Any + Send + Sync>>;

/// What a gate releases once its copies are done.
pub(super) enum GateThen {
    /// Handle these submissions, then complete `done` (if any).
    Submit(Vec<Submission>, Option<Notify>),
    /// A chunk of a pull is in GPU memory.
    PullChunk { pull: u64 },
}

struct Gate {
    event: Event,
    then: GateThen,
    /// The memory the copies touch, until the event is ready.
    keep: Keep,
}

/// A sender's pull waiting for its ACK.
struct Awaiting {
    notify: Notify,
    peer: PeerId,
    sent: Instant,
    /// The source the receiver reads: kept until the ACK (or shutdown).
    _keep: Arc<RegionShared>,
}

/// A receiver's pull in progress.
struct PullState {
    peer: PeerId,
    op: u64,
    region: Arc<RegionShared>,
    sources: Vec<PullSource>,
    dst_off: u64,
    imm: Option<u32>,
    plan: ChunkPlan,
    next: u64,
    reads: u32,
    copies: u32,
    done: u64,
    error: Option<String>,
}

/// The staging state of one reactor. Field order is drop order: streams (whose drop waits
/// for their copies) before the gates that hold the copies' memory.
#[derive(Default)]
pub(super) struct Staging {
    streams: HashMap<usize, Stream>,
    gates: Vec<Gate>,
    awaiting: HashMap<u64, Awaiting>,
    next_op: u64,
    pulls: HashMap<u64, PullState>,
    next_pull: u64,
    failures: Arc<InternalFailures>,
}

impl Staging {
    /// Whether a pass has staging work to look at.
    pub(super) fn active(&self) -> bool {
        !self.gates.is_empty() || !self.pulls.is_empty() || !self.awaiting.is_empty()
    }

    /// Whether sent PULLs wait for their ACK.
    pub(super) fn awaits_acks(&self) -> bool {
        !self.awaiting.is_empty()
    }

    /// Whether copies are in flight (the reactor must not sleep long: events wake nobody).
    pub(super) fn has_gates(&self) -> bool {
        !self.gates.is_empty()
    }

    fn internal(&self, kind: u64, low: u64) -> Notify {
        Notify::Internal(kind << KIND_SHIFT | (low & LOW), self.failures.clone())
    }
}

impl<D: Domain> Core<D> {
    fn stream(&mut self, ordinal: usize) -> Result<&Stream> {
        Ok(match self.staging.streams.entry(ordinal) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(Stream::new(&cuda::context(ordinal)?)?),
        })
    }

    fn enqueue(&mut self, ordinal: usize, after: Option<&Event>, copies: &[CudaCopy]) -> Result<Event> {
        let stream = self.stream(ordinal)?;
        if let Some(ev) = after {
            // The device waits, not a thread: what follows on the stream starts once the
            // user's work recorded in `ev` is done.
            stream.wait(ev)?;
        }
        for c in copies {
            // SAFETY: the engine bounds-checked every range against its region when it
            // planned the transfer; the gate keeps those regions (and IPC mappings) until
            // the event recorded below is ready, or the stream is synchronized.
            unsafe {
                match c.dir {
                    CopyDir::HostToDevice => stream.copy_h2d_raw(c.dst, c.src as *const u8, c.len)?,
                    CopyDir::DeviceToHost => stream.copy_d2h_raw(c.dst as *mut u8, c.src, c.len)?,
                    CopyDir::DeviceToDevice => stream.copy_d2d_raw(c.dst, c.src, c.len)?,
                }
            }
        }
        stream.record()
    }

    /// Enqueues `copies` on device `ordinal`'s stream; `then` runs once they are done.
    pub(super) fn start_gate(
        &mut self,
        ordinal: usize,
        after: Option<&Event>,
        copies: &[CudaCopy],
        then: GateThen,
        keep: Keep,
    ) {
        match self.enqueue(ordinal, after, copies) {
            Ok(event) => self.staging.gates.push(Gate { event, then, keep }),
            Err(e) => {
                tracing::warn!(ordinal, error = %e, "staging copy failed");
                // Some copies may be queued: wait for them before the memory may go.
                if let Some(s) = self.staging.streams.get(&ordinal) {
                    let _ = s.synchronize();
                }
                self.gate_done(then, Err(e));
                drop(keep);
            }
        }
    }

    fn gate_done(&mut self, then: GateThen, result: Result<()>) {
        match (then, result) {
            (GateThen::Submit(subs, done), Ok(())) => {
                for s in subs {
                    self.handle(s);
                }
                if let Some(n) = done {
                    for s in n.complete(Ok(())) {
                        self.handle(s);
                    }
                }
            }
            (GateThen::Submit(subs, done), Err(e)) => {
                for s in subs {
                    s.fail(e.clone());
                }
                if let Some(n) = done {
                    n.fail(e);
                }
            }
            (GateThen::PullChunk { pull }, r) => self.pull_copy_done(pull, r),
        }
    }

    /// One pass over the staging work: ready copies, and internal operations that failed
    /// outside the completion path. Never blocks.
    pub(super) fn poll_staging(&mut self) -> bool {
        let mut busy = false;
        let failed = std::mem::take(&mut *lock(&self.staging.failures));
        for (tag, e) in failed {
            busy = true;
            self.internal_done(tag, Err(e));
        }
        let mut i = 0;
        while i < self.staging.gates.len() {
            let r = match self.staging.gates[i].event.query() {
                Ok(EventStatus::NotReady) => {
                    i += 1;
                    continue;
                }
                Ok(EventStatus::Ready) => Ok(()),
                Err(e) => Err(e),
            };
            busy = true;
            // In order: the gates of one stream complete in order, and so are handled.
            let g = self.staging.gates.remove(i);
            self.gate_done(g.then, r);
            drop(g.keep);
        }
        busy
    }

    /// The completion of an operation posted with [`Notify::Internal`].
    pub(super) fn internal_done(&mut self, tag: u64, result: Result<()>) {
        let low = tag & LOW;
        match tag >> KIND_SHIFT {
            TAG_PULL_SENT => {
                if let Err(e) = result {
                    if let Some(a) = self.staging.awaiting.remove(&low) {
                        a.notify.fail(e);
                    }
                }
            }
            TAG_READ => self.pull_read_done(low >> CHUNK_BITS, low & ((1 << CHUNK_BITS) - 1), result),
            TAG_ACK_SENT => {
                if let Err(e) = result {
                    tracing::warn!(error = %e, "sending the ACK of a pull failed; its sender will time out");
                }
            }
            _ => tracing::warn!(tag, "completion of an unknown internal operation"),
        }
    }

    /// Sender: sends `pull` to `peer` and waits for its ACK, keeping the source.
    pub(super) fn send_pull(
        &mut self,
        peer: PeerId,
        mut pull: Pull,
        keep: Arc<RegionShared>,
        notify: Notify,
    ) {
        let op = self.staging.next_op & LOW;
        self.staging.next_op += 1;
        pull.op = op;
        self.staging.awaiting.insert(op, Awaiting { notify, peer, sent: Instant::now(), _keep: keep });
        let data = Bytes::from(pull.to_bytes());
        let notify = self.staging.internal(TAG_PULL_SENT, op);
        self.handle(Submission::Send { peer, data, notify });
    }

    /// Sender: fails the pulls whose ACK has not come within `limit` (`op_timeout`) and
    /// marks their peer failed, as for any operation. As for a timed-out operation, the
    /// entry (and so the source the peer may still read) stays until a late ACK or
    /// shutdown.
    pub(super) fn expire_acks(&mut self, now: Instant, limit: Duration) {
        let mut failed = Vec::new();
        for a in self.staging.awaiting.values_mut() {
            if matches!(a.notify, Notify::None) || now.duration_since(a.sent) < limit {
                continue;
            }
            failed.push((a.peer, std::mem::replace(&mut a.notify, Notify::None)));
        }
        for (peer, notify) in failed {
            let message = format!("no ACK for a staged GPU write within {limit:?}; peer marked failed");
            tracing::warn!(peer = peer.0, %message, "staged write timed out");
            if let Some(p) = self.peers.get_mut(peer.0 as usize) {
                p.failed.get_or_insert_with(|| message.clone());
            }
            notify.fail(Error::PeerUnreachable { peer: peer.0, message });
        }
    }

    /// Sender: the ACK of one of our pulls.
    pub(super) fn on_ack(&mut self, data: &[u8]) {
        let ack = match Ack::from_bytes(data) {
            Ok(a) => a,
            Err(e) => return tracing::warn!(error = %e, "dropped a malformed ACK"),
        };
        let Some(a) = self.staging.awaiting.remove(&ack.op) else {
            return tracing::warn!(op = ack.op, "ACK for an unknown pull");
        };
        let result = match ack.error {
            None => Ok(()),
            Some(message) => Err(Error::Completion { op: "staged GPU write", errno: libc::EIO, message }),
        };
        for s in a.notify.complete(result) {
            self.handle(s);
        }
    }

    /// Receiver: a peer asks us to pull its bytes into one of our staged GPU regions.
    pub(super) fn on_pull(&mut self, data: &[u8]) {
        let pull = match Pull::from_bytes(data) {
            Ok(p) => p,
            Err(e) => return tracing::warn!(error = %e, "dropped a malformed PULL"),
        };
        let peer = match EngineAddress::from_bytes(&pull.sender).and_then(|a| self.add_peer(a)) {
            Ok(p) => p,
            Err(e) => return tracing::warn!(error = %e, "cannot reach the sender of a PULL; dropped"),
        };
        match self.check_pull(&pull) {
            Err(message) => self.send_ack(peer, pull.op, Some(message)),
            Ok((region, plan)) => {
                let id = self.staging.next_pull & ((1 << (KIND_SHIFT - CHUNK_BITS)) - 1);
                self.staging.next_pull += 1;
                tracing::debug!(
                    op = pull.op,
                    len = pull.len,
                    chunks = plan.count(),
                    "pulling into a staged GPU region"
                );
                self.staging.pulls.insert(
                    id,
                    PullState {
                        peer,
                        op: pull.op,
                        region,
                        sources: pull.sources,
                        dst_off: pull.dst_off,
                        imm: pull.imm,
                        plan,
                        next: 0,
                        reads: 0,
                        copies: 0,
                        done: 0,
                        error: None,
                    },
                );
                self.pump_pull(id);
            }
        }
    }

    fn check_pull(&self, pull: &Pull) -> std::result::Result<(Arc<RegionShared>, ChunkPlan), String> {
        let region = self
            .shared
            .gpu
            .staged(pull.dst_key)
            .ok_or_else(|| format!("no staged GPU region with key {:#x} (dropped?)", pull.dst_key))?;
        if region.regs.first().map(|r| r.remote_base) != Some(pull.dst_base) {
            return Err(format!("no staged GPU region at base {:#x}", pull.dst_base));
        }
        let len = region.backing().len() as u64;
        if pull.dst_off.checked_add(pull.len).is_none_or(|end| end > len) {
            return Err(format!(
                "range {}+{} is out of bounds of a {len}-byte region",
                pull.dst_off, pull.len
            ));
        }
        if pull.len > 0 && pull.sources.is_empty() {
            return Err("a PULL without sources".into());
        }
        let plan = ChunkPlan::new(pull.len, self.shared.gpu.chunk).map_err(|e| e.to_string())?;
        if plan.count() >= 1 << CHUNK_BITS {
            return Err(format!("{} chunks; raise the staging chunk size", plan.count()));
        }
        Ok((region, plan))
    }

    /// Posts the next chunk reads of pull `id`, or finishes it when all is done.
    fn pump_pull(&mut self, id: u64) {
        let nics = self.domains.len();
        loop {
            let Some(p) = self.staging.pulls.get_mut(&id) else { return };
            if p.error.is_none() && p.reads < PULL_READS_IN_FLIGHT && p.next < p.plan.count() {
                let Some(c) = p.plan.get(p.next) else { return };
                p.next += 1;
                p.reads += 1;
                let nic = c.index as usize % p.sources.len().min(nics).max(1);
                let src = p.sources[nic];
                let req = OpReq {
                    domain: nic,
                    peer: p.peer,
                    kind: OpKind::Read,
                    local_addr: p.region.backing().addr() + p.dst_off + c.offset,
                    len: c.len as usize,
                    remote: RemoteSlice { addr: src.addr.wrapping_add(c.offset), key: src.key },
                    imm: None,
                };
                let keep = Some(p.region.clone());
                let notify = self.staging.internal(TAG_READ, id << CHUNK_BITS | c.index);
                self.handle(Submission::Op { req, keep, notify });
                continue;
            }
            let finished = p.error.is_some() || p.done == p.plan.count();
            if p.reads == 0 && p.copies == 0 && finished {
                let Some(p) = self.staging.pulls.remove(&id) else { return };
                if p.error.is_none() {
                    if let Some(imm) = p.imm {
                        let shared = &self.shared;
                        self.counters.entry(imm).or_insert_with(|| shared.counter_cell(imm)).arrive(1);
                    }
                }
                self.send_ack(p.peer, p.op, p.error);
            }
            return;
        }
    }

    fn pull_read_done(&mut self, id: u64, chunk: u64, result: Result<()>) {
        let Some(p) = self.staging.pulls.get_mut(&id) else { return };
        p.reads = p.reads.saturating_sub(1);
        match result {
            Err(e) => {
                p.error.get_or_insert(e.to_string());
            }
            Ok(()) => {
                let (Some(c), Some(g)) = (p.plan.get(chunk), p.region.staged()) else { return };
                let off = p.dst_off + c.offset;
                let copy = CudaCopy {
                    dir: CopyDir::HostToDevice,
                    dst: g.ptr + off,
                    src: p.region.backing().addr() + off,
                    len: c.len as usize,
                };
                let ordinal = g.ordinal as usize;
                let keep: Keep = vec![p.region.clone()];
                p.copies += 1;
                self.start_gate(ordinal, None, &[copy], GateThen::PullChunk { pull: id }, keep);
            }
        }
        self.pump_pull(id);
    }

    fn pull_copy_done(&mut self, id: u64, result: Result<()>) {
        let Some(p) = self.staging.pulls.get_mut(&id) else { return };
        p.copies = p.copies.saturating_sub(1);
        match result {
            Ok(()) => p.done += 1,
            Err(e) => {
                p.error.get_or_insert(e.to_string());
            }
        }
        self.pump_pull(id);
    }

    fn send_ack(&mut self, peer: PeerId, op: u64, error: Option<String>) {
        if let Some(e) = &error {
            tracing::warn!(op, error = %e, "a pull into a staged GPU region failed");
        }
        let data = Bytes::from(Ack { op, error }.to_bytes());
        let notify = self.staging.internal(TAG_ACK_SENT, op);
        self.handle(Submission::Send { peer, data, notify });
    }

    /// Shutdown: waits for every copy engine, fails what waited on copies or ACKs, and
    /// returns the memory they held, to be freed after the NIC objects are closed.
    pub(super) fn close_staging(&mut self) -> Keep {
        for s in self.staging.streams.values() {
            if let Err(e) = s.synchronize() {
                tracing::warn!(error = %e, "waiting for staging copies at shutdown failed");
            }
        }
        let mut keep: Keep = Vec::new();
        for g in std::mem::take(&mut self.staging.gates) {
            if let GateThen::Submit(subs, done) = g.then {
                for s in subs {
                    s.fail(Error::Shutdown);
                }
                if let Some(n) = done {
                    n.fail(Error::Shutdown);
                }
            }
            keep.extend(g.keep);
        }
        for (_, a) in self.staging.awaiting.drain() {
            a.notify.fail(Error::Shutdown);
            keep.push(a._keep);
        }
        for (_, p) in self.staging.pulls.drain() {
            keep.push(p.region);
        }
        keep
    }
}
