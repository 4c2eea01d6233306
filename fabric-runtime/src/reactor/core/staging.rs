//! The reactor's staged-GPU half: the engine's pool of pinned bounce slots, CUDA copies it
//! waits for without blocking (gates), and the dispatch of their completions to the two
//! ends of a staged transfer (`staging_send.rs`: the writer's jobs; `staging_pull.rs`: the
//! owner's pulls and local reads into staged GPU memory).
//!
//! ```text
//!  gate:  copies on the device's stream ─► event ─► (polled every pass) ─► what follows
//!
//!  writer, staged GPU source, per chunk:
//!    slot ◄─ pool ─► D2H copy into the slot (gate) ─► write / PULL from the slot ─► slot back
//!  owner of a staged GPU destination, per chunk of a PULL:
//!    slot ◄─ pool ─► RDMA read into the slot ─► H2D copy (gate) ─► slot back; last: count, ACK
//! ```
//!
//! A chunk that finds no free slot waits (its job or pull is pumped again whenever a slot
//! comes back), so memory stays bounded and a transfer completes with a pool of one slot.
//! A child module of `core`, so it works on [`Core`]'s fields. Nothing here blocks, except
//! [`Core::close_staging`] at shutdown, which waits for the copy engines before the memory
//! they use may go.

use std::any::Any;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::staging_pull::PullState;
use super::staging_send::{Awaiting, Job};
use super::Core;
use crate::cuda::{self, Event, EventStatus, Stream};
use crate::error::{Error, Result};
use crate::provider::Domain;
use crate::pure::control::PullSource;
use crate::pure::staging::{Slot, SlotPool};
use crate::shared::memory::RegionShared;
use crate::shared::notify::{InternalFailures, Notify};
use crate::shared::queue::{CopyDir, CudaCopy, Submission};
use crate::sync::lock;

/// Internal tags: the kind in the top four bits.
const KIND_SHIFT: u32 = 60;
const LOW: u64 = (1 << KIND_SHIFT) - 1;
/// A PULL we sent (low bits: its op id).
pub(super) const TAG_PULL_SENT: u64 = 1;
/// A chunk read of a pull (low bits: pull id, chunk index).
pub(super) const TAG_READ: u64 = 2;
/// An ACK we sent.
pub(super) const TAG_ACK_SENT: u64 = 3;
/// A chunk write of a staged job (low bits: job id, chunk index).
pub(super) const TAG_CHUNK: u64 = 4;
/// In a tag, an id (job or pull) above these bits, a chunk index below.
pub(super) const IDX_BITS: u32 = 32;
/// Ids wrap at this mask (far more than can be in flight at once).
pub(super) const ID_MASK: u64 = (1 << (KIND_SHIFT - IDX_BITS)) - 1;

pub(super) type Keep = Vec<Arc<dyn Any + Send + Sync>>;

/// What a gate releases once its copies are done.
pub(super) enum GateThen {
    /// Handle these submissions, then complete `done` (if any).
    Submit(Vec<Submission>, Option<Notify>),
    /// Chunk `idx` of a staged job is in its bounce slot.
    JobChunk { job: u64, idx: u64 },
    /// Chunk `idx` of a pull is in GPU memory.
    PullChunk { pull: u64, idx: u64 },
}

struct Gate {
    /// `None`: copies already done (emulated device memory, `cuda::is_emulated`).
    event: Option<Event>,
    then: GateThen,
    /// The memory the copies touch, until the event is ready.
    keep: Keep,
}

/// The engine's bounce slots: one pinned buffer registered with every NIC, cut into equal
/// slots (`pure::staging::SlotPool` does the accounting).
pub(super) struct Pool {
    region: Arc<RegionShared>,
    slots: SlotPool,
    /// The taken slots, by index.
    held: Vec<Option<Slot>>,
    /// Slots holding a staged source's chunk until a peer's pull of it is ACKed.
    held_for_pulls: usize,
}

impl Pool {
    fn new(region: Arc<RegionShared>, slots: u32, slot_len: u64) -> Result<Pool> {
        let slots = SlotPool::new(slots, slot_len)?;
        if slots.buffer_len() > region.len() as u64 {
            return Err(Error::Config("the staging pool buffer is smaller than its slots".into()));
        }
        Ok(Pool { region, held: (0..slots.capacity()).map(|_| None).collect(), slots, held_for_pulls: 0 })
    }

    pub(super) fn region(&self) -> &Arc<RegionShared> {
        &self.region
    }

    pub(super) fn slot_len(&self) -> u64 {
        self.slots.slot_len()
    }

    /// A free slot's index. A chunk that will wait for a peer's pull (`for_pull`) may not
    /// take the last free slot of a pool of two or more: that one stays for incoming pulls,
    /// so two engines writing GPU to GPU into each other cannot hold all each other's slots.
    pub(super) fn acquire(&mut self, for_pull: bool) -> Option<u32> {
        if for_pull && self.slots.capacity() > 1 && self.slots.available() <= 1 {
            return None;
        }
        let slot = self.slots.acquire()?;
        let i = slot.index();
        self.held[i as usize] = Some(slot);
        if for_pull {
            self.held_for_pulls += 1;
        }
        Some(i)
    }

    pub(super) fn release(&mut self, index: u32, for_pull: bool) {
        if let Some(slot) = self.held.get_mut(index as usize).and_then(Option::take) {
            if let Err(e) = self.slots.release(slot) {
                tracing::error!(error = %e, "staging slot accounting");
            }
            if for_pull {
                self.held_for_pulls = self.held_for_pulls.saturating_sub(1);
            }
        }
    }

    /// Host address of slot `index`.
    pub(super) fn addr(&self, index: u32) -> u64 {
        self.region.backing().addr() + u64::from(index) * self.slots.slot_len()
    }

    /// Where a peer reads slot `index`, per NIC.
    pub(super) fn sources(&self, index: u32) -> Vec<PullSource> {
        let off = u64::from(index) * self.slots.slot_len();
        self.region
            .regs
            .iter()
            .map(|r| PullSource { addr: r.remote_base.wrapping_add(off), key: r.remote_key })
            .collect()
    }
}

/// The staging state of one reactor. Field order is drop order: streams (whose drop waits
/// for their copies) before the gates and the pool that hold the copies' memory.
#[derive(Default)]
pub(super) struct Staging {
    streams: HashMap<usize, Stream>,
    gates: Vec<Gate>,
    pub(super) pool: Option<Pool>,
    /// Writer side: sent PULLs waiting for their ACK, by op id.
    pub(super) awaiting: HashMap<u64, Awaiting>,
    pub(super) next_op: u64,
    /// Writer side: staged jobs in progress.
    pub(super) jobs: BTreeMap<u64, Job>,
    pub(super) next_job: u64,
    /// Owner side (and local reads): pulls in progress.
    pub(super) pulls: BTreeMap<u64, PullState>,
    pub(super) next_pull: u64,
    failures: Arc<InternalFailures>,
}

impl Staging {
    /// Whether a pass has staging work to look at.
    pub(super) fn active(&self) -> bool {
        !self.gates.is_empty() || !self.pulls.is_empty() || !self.awaiting.is_empty() || !self.jobs.is_empty()
    }

    /// Whether sent PULLs wait for their ACK.
    pub(super) fn awaits_acks(&self) -> bool {
        !self.awaiting.is_empty()
    }

    /// Whether copies are in flight (the reactor must not sleep long: events wake nobody).
    pub(super) fn has_gates(&self) -> bool {
        !self.gates.is_empty()
    }

    pub(super) fn internal(&self, kind: u64, low: u64) -> Notify {
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

    /// The bounce pool, taken over from the engine at first use.
    pub(super) fn pool(&mut self) -> Result<&mut Pool> {
        if self.staging.pool.is_none() {
            let region = lock(&self.shared.gpu.pool).take().ok_or_else(|| {
                Error::Unsupported("staged GPU transfer without a staging pool (no staged region yet)".into())
            })?;
            let pool = Pool::new(region, self.shared.gpu.slots, self.shared.gpu.chunk)?;
            tracing::debug!(slots = pool.slots.capacity(), slot_len = pool.slot_len(), "staging pool in use");
            self.staging.pool = Some(pool);
        }
        self.staging.pool.as_mut().ok_or_else(|| Error::Unsupported("no staging pool".into()))
    }

    fn enqueue(
        &mut self,
        ordinal: usize,
        after: Option<&Event>,
        copies: &[CudaCopy],
    ) -> Result<Option<Event>> {
        if cuda::is_emulated(ordinal) && after.is_none() {
            for c in copies {
                // SAFETY: as below; emulated device memory is host memory that the gate's
                // `keep` (or the region's operation) holds, and the copy is done here.
                unsafe { cuda::emulated_copy(c.dst, c.src, c.len) };
            }
            return Ok(None);
        }
        let stream = self.stream(ordinal)?;
        if let Some(ev) = after {
            // The device waits, not a thread: what follows on the stream starts once the
            // user's work recorded in `ev` is done.
            stream.wait(ev)?;
        }
        for c in copies {
            // SAFETY: the engine bounds-checked every user range against its region when it
            // planned the transfer, and bounce-slot ranges lie inside the pool; the gate
            // keeps those regions (and IPC mappings, and the pool) until the event recorded
            // below is ready, or the stream is synchronized.
            unsafe {
                match c.dir {
                    CopyDir::HostToDevice => stream.copy_h2d_raw(c.dst, c.src as *const u8, c.len)?,
                    CopyDir::DeviceToHost => stream.copy_d2h_raw(c.dst as *mut u8, c.src, c.len)?,
                    CopyDir::DeviceToDevice => stream.copy_d2d_raw(c.dst, c.src, c.len)?,
                }
            }
        }
        stream.record().map(Some)
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
            (GateThen::JobChunk { job, idx }, Ok(())) => self.dispatch_chunk(job, idx),
            (GateThen::JobChunk { job, idx }, Err(e)) => self.chunk_done(job, idx, Err(e)),
            (GateThen::PullChunk { pull, idx }, r) => self.pull_copy_done(pull, idx, r),
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
            let status = match &self.staging.gates[i].event {
                Some(ev) => ev.query(),
                None => Ok(EventStatus::Ready),
            };
            let r = match status {
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
        let (id, idx) = (low >> IDX_BITS, low & ((1 << IDX_BITS) - 1));
        match tag >> KIND_SHIFT {
            TAG_PULL_SENT => {
                if let Err(e) = result {
                    self.pull_send_failed(low, e);
                }
            }
            TAG_READ => self.pull_read_done(id, idx, result),
            TAG_CHUNK => self.chunk_done(id, idx, result),
            TAG_ACK_SENT => {
                if let Err(e) = result {
                    tracing::warn!(error = %e, "sending the ACK of a pull failed; its sender will time out");
                }
            }
            _ => tracing::warn!(tag, "completion of an unknown internal operation"),
        }
    }

    /// A slot came back (or work arrived): every job and pull takes what it can, in order.
    pub(super) fn pump_all(&mut self) {
        let jobs: Vec<u64> = self.staging.jobs.keys().copied().collect();
        for id in jobs {
            self.pump_job(id);
        }
        let pulls: Vec<u64> = self.staging.pulls.keys().copied().collect();
        for id in pulls {
            self.pump_pull(id);
        }
    }

    /// Shutdown: waits for every copy engine, fails what waited on copies, slots or ACKs,
    /// and returns the memory they held, to be freed after the NIC objects are closed.
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
        let awaiting: Vec<_> = self.staging.awaiting.drain().map(|(_, a)| a).collect();
        for a in awaiting {
            keep.extend(a.fail_at_shutdown().map(|r| r as Arc<dyn Any + Send + Sync>));
        }
        for (_, j) in std::mem::take(&mut self.staging.jobs) {
            keep.extend(j.close());
        }
        for (_, p) in std::mem::take(&mut self.staging.pulls) {
            keep.push(p.close());
        }
        if let Some(p) = self.staging.pool.take() {
            keep.push(p.region);
        }
        // A pool the reactor never took over (no staged transfer ran): break the cycle
        // through `Shared` here.
        if let Some(r) = lock(&self.shared.gpu.pool).take() {
            keep.push(r);
        }
        keep
    }
}
