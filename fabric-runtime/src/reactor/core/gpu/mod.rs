//! The reactor's GPU half: CUDA copies it waits for without blocking (gates, `gates.rs`), the
//! engine's pool of pinned bounce slots (`pool.rs`), and the dispatch of their completions:
//! an IPC write's follow-ups, and the two ends of a staged transfer (`send.rs`: the writer's
//! jobs; `pull.rs`: the owner's pulls and local reads into staged GPU memory).
//!
//! ```text
//!  gate:  copies on a stream of the device ─► event ─► (oldest per stream, every pass) ─► what follows
//!
//!  writer, staged GPU source, per chunk:
//!    slot ◄─ pool ─► D2H copy into the slot (gate) ─► write / PULL from the slot ─► slot back
//!  owner of a staged GPU destination, per chunk of a PULL:
//!    slot ◄─ pool ─► RDMA read into the slot ─► H2D copy (gate) ─► slot back; last: count, ACK
//!  writer, CUDA IPC: copies into the peer's mapping (gate) ─► one imm-only write
//! ```
//!
//! A chunk that finds no free slot waits (its job or pull is pumped again whenever a slot
//! comes back), so memory stays bounded and a transfer completes with a pool of one slot.
//! Imports go one way: this file uses `gates`, `pool`, `send` and `pull`; those two use
//! `gates` and `pool`, never this file. A child module of `core`, so it works on [`Core`]'s
//! fields. Nothing here blocks, except [`Core::close_staging`] at shutdown, which waits for
//! the copy engines before the memory they use may go.

mod gates;
mod pool;
mod pull;
mod send;

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use self::gates::{
    untag, Done, GateTimes, Gates, IDX_BITS, TAG_ACK_SENT, TAG_CHUNK, TAG_PULL_SENT, TAG_READ,
};
pub(super) use self::gates::{GateThen, Keep, Lane};
use self::pool::Pool;
use self::pull::PullState;
use self::send::{Awaiting, Job};
use super::Core;
use crate::cuda::Event;
use crate::error::{Error, Result};
use crate::provider::Domain;
use crate::shared::notify::{InternalFailures, Notify};
use crate::shared::queue::CudaCopy;
use crate::sync::lock;

/// After a gate starts or finishes, how long an `Event` reactor keeps polling (yielding its
/// core) rather than sleeping: CUDA events wake nobody, so a copy's end is seen within
/// microseconds only by a reactor that looks. Past this window (a long copy), it sleeps
/// [`GATE_SLEEP`] at a time.
pub(super) const GATE_POLL_WINDOW: Duration = Duration::from_millis(2);
/// The sleep of an `Event` reactor while copies have been in flight for longer than
/// [`GATE_POLL_WINDOW`].
pub(super) const GATE_SLEEP: Duration = Duration::from_micros(20);

/// The GPU state of one reactor. Field order is drop order: the gates (whose streams' drop
/// waits for their copies) before the pool that holds the copies' memory.
#[derive(Default)]
pub(super) struct Staging {
    gates: Gates,
    /// Gates done by the last poll, to dispatch (kept to reuse its allocation).
    done: Vec<Done>,
    pool: Option<Pool>,
    /// Writer side: sent PULLs waiting for their ACK, by op id.
    awaiting: HashMap<u64, Awaiting>,
    next_op: u64,
    /// Writer side: staged jobs in progress.
    jobs: BTreeMap<u64, Job>,
    next_job: u64,
    /// Owner side (and local reads): pulls in progress.
    pulls: BTreeMap<u64, PullState>,
    next_pull: u64,
    failures: Arc<InternalFailures>,
}

impl Staging {
    /// Whether a pass has staging work to look at.
    pub(super) fn active(&self) -> bool {
        self.gates.len() > 0 || !self.pulls.is_empty() || !self.awaiting.is_empty() || !self.jobs.is_empty()
    }

    /// Whether sent PULLs wait for their ACK.
    pub(super) fn awaits_acks(&self) -> bool {
        !self.awaiting.is_empty()
    }

    /// Whether copies are in flight (the reactor must not sleep long: events wake nobody).
    pub(super) fn has_gates(&self) -> bool {
        self.gates.len() > 0
    }

    /// Whether an idle reactor should poll rather than sleep: copies are in flight and a
    /// gate started or finished within [`GATE_POLL_WINDOW`].
    pub(super) fn copies_fresh(&self) -> bool {
        // The clock is read only while copies are in flight (this runs on idle passes).
        self.gates.len() > 0 && self.gates.last_change.is_some_and(|t| t.elapsed() < GATE_POLL_WINDOW)
    }

    pub(super) fn internal(&self, kind: u64, low: u64) -> Notify {
        Notify::Internal(gates::tag(kind, low), self.failures.clone())
    }
}

impl<D: Domain> Core<D> {
    /// The bounce pool, taken over from the engine at first use.
    fn pool(&mut self) -> Result<&mut Pool> {
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

    /// Enqueues `copies` on a stream of device `ordinal` (`lane`); `then` runs once they are
    /// done. `handed`: when the engine handed the operation over (its wait in the queue is
    /// counted in `EngineStats::gpu`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_gate(
        &mut self,
        ordinal: usize,
        lane: Lane,
        after: Option<&Event>,
        copies: &[CudaCopy],
        then: GateThen,
        keep: Keep,
        handed: Option<Instant>,
    ) {
        let streams = self.shared.gpu.streams;
        let g = &self.shared.stats.gpu;
        crate::shared::stats::bump(&g.gates, 1);
        crate::shared::stats::bump(&g.copies, copies.len() as u64);
        if let Some(t) = handed {
            crate::shared::stats::bump(&g.handoff_ns, t.elapsed().as_nanos() as u64);
        }
        let mut times = GateTimes::default();
        let r = self.staging.gates.start(ordinal, streams, lane, after, copies, then, keep, &mut times);
        crate::shared::stats::bump(&g.enqueue_ns, times.enqueue_ns);
        if let Err(b) = r {
            let (then, keep, e) = *b;
            tracing::warn!(ordinal, error = %e, "staging copy failed");
            self.gate_done(then, Err(e));
            drop(keep);
        }
    }

    fn gate_done(&mut self, then: GateThen, result: Result<()>) {
        match (then, result) {
            (GateThen::Submit(subs, done), Ok(())) => {
                let t = (!subs.is_empty()).then(Instant::now);
                for s in subs {
                    self.handle(s);
                }
                if let Some(t) = t {
                    crate::shared::stats::bump(
                        &self.shared.stats.gpu.signal_ns,
                        t.elapsed().as_nanos() as u64,
                    );
                }
                if let Some(n) = done {
                    for s in n.complete(Ok(())) {
                        self.handle(s.into());
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
        if self.staging.gates.len() > 0 {
            let mut done = std::mem::take(&mut self.staging.done);
            let mut times = GateTimes::default();
            self.staging.gates.poll(&mut done, &mut times);
            let g = &self.shared.stats.gpu;
            crate::shared::stats::bump(&g.copy_ns, times.copy_ns);
            crate::shared::stats::bump(&g.poll_ns, times.poll_ns);
            crate::shared::stats::bump(&g.queries, times.queries);
            busy |= !done.is_empty();
            for d in done.drain(..) {
                self.gate_done(d.then, d.result);
                drop(d.keep);
            }
            self.staging.done = done;
        }
        busy
    }

    /// The completion of an operation posted with [`Notify::Internal`].
    pub(super) fn internal_done(&mut self, tag: u64, result: Result<()>) {
        let (kind, low) = untag(tag);
        let (id, idx) = (low >> IDX_BITS, low & ((1 << IDX_BITS) - 1));
        match kind {
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
        let mut keep: Keep = Vec::new();
        for (then, held) in self.staging.gates.close() {
            if let GateThen::Submit(subs, done) = then {
                for s in subs {
                    s.fail(Error::Shutdown);
                }
                if let Some(n) = done {
                    n.fail(Error::Shutdown);
                }
            }
            keep.extend(held);
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
