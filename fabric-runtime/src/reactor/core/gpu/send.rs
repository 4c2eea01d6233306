//! The writer's side of a staged transfer: a [`StagedJob`]'s pieces cut into chunks of one
//! bounce slot, each chunk of a staged GPU source copied device-to-host into its slot and
//! written (or offered to the owner with a PULL) as soon as its copy's event is ready, while
//! the copy engine moves the next chunk; a slot goes back when its write completes (or its
//! PULL is ACKed).
//!
//! ```text
//!  chunk k:   slot ─► D2H ─► write / PULL ─► done ─► slot back
//!  chunk k+1:        slot ─► D2H ─► write / PULL ─► ...
//!  last chunk of a piece with an imm: posted once every earlier chunk is done, so the imm
//!  is counted only when the whole piece has landed (in GPU memory, for a PULL)
//!  all done ─► follow-ups (imm-only writes, zero-length PULLs) ─► the caller's future
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::gates::{GateThen, Keep, Lane, IDX_BITS, ID_MASK, TAG_CHUNK, TAG_PULL_SENT};
use crate::error::{Error, Result};
use crate::provider::{Domain, RemoteSlice};
use crate::pure::control::{Ack, Pull};
use crate::pure::descriptor::EngineAddress;
use crate::reactor::core::Core;
use crate::shared::memory::RegionShared;
use crate::shared::notify::{GroupState, Notify};
use crate::shared::queue::{
    CopyDir, CudaCopy, OpReq, Piece, PieceDst, PieceSrc, StagedJob, Submission, Then,
};
use crate::shared::PeerId;

/// What an ACK completes.
pub(crate) enum Waiter {
    /// Chunk `idx` of job `job` (its slot goes back).
    Chunk { job: u64, idx: u64 },
    /// A follow-up PULL, or a whole transfer.
    Done(Notify),
}

/// A sent PULL waiting for its ACK.
pub(crate) struct Awaiting {
    waiter: Waiter,
    peer: PeerId,
    sent: Instant,
    /// The caller was told already (timed out); the entry only keeps its slot.
    told: bool,
    /// A push's destination, which the owner writes until its ACK.
    keep: Option<Arc<RegionShared>>,
}

impl Awaiting {
    /// Shutdown: fails the caller; returns the memory a peer may still write.
    pub(crate) fn fail_at_shutdown(self) -> Option<Arc<RegionShared>> {
        if let Waiter::Done(n) = self.waiter {
            n.fail(Error::Shutdown);
        }
        self.keep
    }
}

/// PULLs of one job waiting for their ACK at once (bounds the owner's receive queue when
/// the pieces need no slot: a registered source's pages).
const PULLS_IN_FLIGHT: usize = 16;

#[derive(Clone, Copy)]
struct Work {
    piece: usize,
    off: u64,
    len: u64,
    /// The piece's last chunk: carries its imm.
    last: bool,
    /// Posted only once every earlier chunk of the job is done (its copy into a slot
    /// may run before).
    barrier: bool,
}

/// A staged job in progress.
pub(crate) struct Job {
    ordinal: usize,
    pieces: Vec<Piece>,
    chunks: Vec<Work>,
    then: Vec<Then>,
    keep: Keep,
    local: Option<Arc<RegionShared>>,
    notify: Notify,
    /// A push served for a peer: ACK `op` to `peer` when done, instead of `notify`.
    ack: Option<(PeerId, u64)>,
    next: usize,
    in_flight: usize,
    done: usize,
    /// Which chunks are done, and how many from the first are (what a barrier waits for).
    finished: Vec<bool>,
    prefix: usize,
    /// Barrier chunks ready in their slot, waiting for the earlier chunks.
    parked: Vec<u64>,
    /// The slot each chunk in flight holds.
    slots: HashMap<u64, u32>,
    error: Option<Error>,
}

impl Job {
    fn needs_slot(&self, w: &Work) -> bool {
        w.len > 0 && matches!(self.pieces[w.piece].src, PieceSrc::Device(_))
    }

    fn for_pull(&self, w: &Work) -> bool {
        matches!(self.pieces[w.piece].dst, PieceDst::Pull { .. })
    }

    /// Shutdown: fails the caller and gives back what the job held.
    pub(crate) fn close(self) -> Keep {
        // A push we serve: its reader's own shutdown or timeout tells it.
        self.notify.fail(Error::Shutdown);
        let mut keep = self.keep;
        if let Some(l) = self.local {
            keep.push(l);
        }
        keep
    }
}

/// The chunks of `pieces`: a staged GPU source in slot-sized chunks, anything else whole.
fn plan(pieces: &[Piece], slot_len: u64) -> Vec<Work> {
    let mut out = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let imm = match &p.dst {
            PieceDst::Write(req) => req.imm.is_some(),
            PieceDst::Pull { pull, .. } => pull.imm.is_some(),
        };
        let start = out.len();
        match p.src {
            PieceSrc::Device(_) if p.len > slot_len => {
                let mut off = 0;
                while off < p.len {
                    let len = slot_len.min(p.len - off);
                    out.push(Work { piece: i, off, len, last: off + len == p.len, barrier: false });
                    off += len;
                }
            }
            _ => out.push(Work { piece: i, off: 0, len: p.len, last: true, barrier: false }),
        }
        if imm && out.len() - start > 1 {
            if let Some(w) = out.last_mut() {
                w.barrier = true;
            }
        }
    }
    out
}

impl<D: Domain> Core<D> {
    /// Starts a staged job (a `Submission::Staged`).
    pub(crate) fn start_job(&mut self, job: StagedJob) {
        self.start_job_acked(job, None);
    }

    /// Starts a staged job that, with `ack`, ends with an ACK to a peer (a push we serve).
    pub(crate) fn start_job_acked(&mut self, job: StagedJob, ack: Option<(PeerId, u64)>) {
        let StagedJob { ordinal, pieces, then, keep, local, notify } = job;
        let fail = |core: &mut Self, notify: Notify, e: Error| match ack {
            Some((peer, op)) => core.send_ack(peer, op, Some(e.to_string())),
            None => notify.fail(e),
        };
        let needs_pool = pieces.iter().any(|p| matches!(p.src, PieceSrc::Device(_)) && p.len > 0);
        let slot_len = if needs_pool {
            match self.pool() {
                Ok(p) => p.slot_len(),
                Err(e) => return fail(self, notify, e),
            }
        } else {
            u64::MAX
        };
        let chunks = plan(&pieces, slot_len);
        if chunks.len() as u64 >= 1 << IDX_BITS {
            let e = Error::Unsupported(format!(
                "a staged transfer of {} chunks; raise the staging chunk size",
                chunks.len()
            ));
            return fail(self, notify, e);
        }
        let id = self.staging.next_job & ID_MASK;
        self.staging.next_job += 1;
        let n = chunks.len();
        let job = Job {
            ordinal,
            pieces,
            chunks,
            then,
            keep,
            local,
            notify,
            ack,
            next: 0,
            in_flight: 0,
            done: 0,
            finished: vec![false; n],
            prefix: 0,
            parked: Vec::new(),
            slots: HashMap::new(),
            error: None,
        };
        self.staging.jobs.insert(id, job);
        self.pump_job(id);
    }

    /// Starts what chunks of job `id` can start (free slots, barriers), or finishes it.
    pub(crate) fn pump_job(&mut self, id: u64) {
        loop {
            let Some(job) = self.staging.jobs.get_mut(&id) else { return };
            if job.error.is_some() || job.next == job.chunks.len() {
                break;
            }
            let w = job.chunks[job.next];
            if job.for_pull(&w) && job.in_flight >= PULLS_IN_FLIGHT {
                break;
            }
            let slot = if job.needs_slot(&w) {
                let for_pull = job.for_pull(&w);
                let Some(pool) = self.staging.pool.as_mut() else { break };
                match pool.acquire(for_pull) {
                    Some(s) => Some(s),
                    None => break, // pumped again when a slot comes back
                }
            } else {
                None
            };
            let Some(job) = self.staging.jobs.get_mut(&id) else { return };
            let idx = job.next as u64;
            job.next += 1;
            job.in_flight += 1;
            match (slot, &job.pieces[w.piece].src) {
                (Some(s), PieceSrc::Device(dev)) => {
                    job.slots.insert(idx, s);
                    let ordinal = job.ordinal;
                    let Some(pool) = self.staging.pool.as_ref() else { return };
                    let copy = CudaCopy {
                        dir: CopyDir::DeviceToHost,
                        dst: pool.addr(s),
                        src: dev + w.off,
                        len: w.len as usize,
                    };
                    let keep: Keep = vec![pool.region().clone()];
                    self.start_gate(
                        ordinal,
                        Lane::Of(id),
                        None,
                        &[copy],
                        GateThen::JobChunk { job: id, idx },
                        keep,
                        None,
                    );
                }
                _ => self.dispatch_chunk(id, idx),
            }
        }
        self.finish_job(id);
    }

    /// Chunk `idx` of job `id` is ready (in its slot, or needs no copy): write it, or offer
    /// it to the owner of a staged destination with a PULL.
    pub(crate) fn dispatch_chunk(&mut self, id: u64, idx: u64) {
        let Some(job) = self.staging.jobs.get_mut(&id) else { return };
        let Some(&w) = job.chunks.get(idx as usize) else { return };
        if job.error.is_some() {
            return self.chunk_done(
                id,
                idx,
                Err(Error::Completion {
                    op: "staged GPU transfer",
                    errno: libc::ECANCELED,
                    message: "an earlier chunk failed".into(),
                }),
            );
        }
        if w.barrier && job.prefix < idx as usize {
            // Its imm may count only once every earlier chunk has landed.
            return job.parked.push(idx);
        }
        let job = &*job;
        let slot = job.slots.get(&idx).copied();
        let piece = &job.pieces[w.piece];
        let pool = self.staging.pool.as_ref();
        let sub = match &piece.dst {
            PieceDst::Write(req) => {
                let (local_addr, keep) = match (slot, &piece.src, pool) {
                    (Some(s), _, Some(pool)) => (pool.addr(s), Some(pool.region().clone())),
                    (None, PieceSrc::Registered { addr, .. }, _) if w.len > 0 => {
                        (addr + w.off, job.local.clone())
                    }
                    _ => (0, None),
                };
                let req = OpReq {
                    domain: req.domain,
                    peer: req.peer,
                    kind: req.kind,
                    local_addr,
                    len: w.len as usize,
                    remote: RemoteSlice { addr: req.remote.addr.wrapping_add(w.off), key: req.remote.key },
                    imm: if w.last { req.imm } else { None },
                };
                let notify = self.staging.internal(TAG_CHUNK, id << IDX_BITS | idx);
                Submission::Op { req, keep, notify }
            }
            PieceDst::Pull { peer, pull } => {
                let sources = match (slot, &piece.src, pool) {
                    (Some(s), _, Some(pool)) => pool.sources(s),
                    (None, PieceSrc::Registered { sources, .. }, _) => sources
                        .iter()
                        .map(|s| crate::pure::control::PullSource {
                            addr: s.addr.wrapping_add(w.off),
                            key: s.key,
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                let p = Pull {
                    dst_off: pull.dst_off + w.off,
                    len: w.len,
                    imm: if w.last { pull.imm } else { None },
                    sources,
                    ..(**pull).clone()
                };
                let peer = *peer;
                return self.send_pull(peer, p, Waiter::Chunk { job: id, idx });
            }
        };
        self.handle(sub);
    }

    /// Chunk `idx` of job `id` is done (written, or pulled and ACKed), or failed.
    pub(crate) fn chunk_done(&mut self, id: u64, idx: u64, result: Result<()>) {
        let Some(job) = self.staging.jobs.get_mut(&id) else { return };
        job.in_flight = job.in_flight.saturating_sub(1);
        let for_pull = job.chunks.get(idx as usize).is_some_and(|w| job.for_pull(w));
        let slot = job.slots.remove(&idx);
        match result {
            Ok(()) => {
                job.done += 1;
                if let Some(f) = job.finished.get_mut(idx as usize) {
                    *f = true;
                }
                while job.finished.get(job.prefix).copied().unwrap_or(false) {
                    job.prefix += 1;
                }
            }
            Err(e) => {
                job.error.get_or_insert(e);
            }
        }
        // Parked barrier chunks whose earlier chunks are done go now (or fail with the job).
        let (prefix, failed) = (job.prefix, job.error.is_some());
        let ready: Vec<u64> = if failed {
            std::mem::take(&mut job.parked)
        } else {
            let (go, wait) = job.parked.iter().partition(|&&i| prefix >= i as usize);
            job.parked = wait;
            go
        };
        if let (Some(s), Some(pool)) = (slot, self.staging.pool.as_mut()) {
            pool.release(s, for_pull);
        }
        for i in ready {
            self.dispatch_chunk(id, i);
        }
        if slot.is_some() {
            self.pump_all();
        } else {
            self.pump_job(id);
        }
    }

    /// Job `id` is finished when nothing of it is in flight and it failed or moved every
    /// chunk: then its follow-ups run (on success), or its caller is told.
    fn finish_job(&mut self, id: u64) {
        let Some(job) = self.staging.jobs.get(&id) else { return };
        let finished = job.error.is_some() || job.done == job.chunks.len();
        if job.in_flight > 0 || !finished {
            return;
        }
        let Some(job) = self.staging.jobs.remove(&id) else { return };
        if let Some((peer, op)) = job.ack {
            return self.send_ack(peer, op, job.error.map(|e| e.to_string()));
        }
        if let Some(e) = job.error {
            return job.notify.fail(e);
        }
        let mut then = job.then;
        let notifies: Vec<Notify> = match then.len() {
            0 => {
                for s in job.notify.complete(Ok(())) {
                    self.handle(s.into());
                }
                return;
            }
            1 => vec![job.notify],
            n => {
                let g = GroupState::new(n, job.notify, Vec::new());
                (0..n).map(|_| Notify::Group(g.clone())).collect()
            }
        };
        for (t, notify) in then.drain(..).zip(notifies) {
            match t {
                Then::Op(req) => self.handle(Submission::Op { req, keep: None, notify }),
                Then::Pull { peer, pull } => self.send_pull(peer, *pull, Waiter::Done(notify)),
            }
        }
    }

    /// Sends `pull` to `peer`; its ACK completes `waiter`.
    fn send_pull(&mut self, peer: PeerId, pull: Pull, waiter: Waiter) {
        self.send_request(peer, pull, waiter, None);
    }

    /// Reader of a staged GPU region: asks its owner to write it into `keep` (a
    /// `Submission::Push`); the ACK completes `notify`.
    pub(crate) fn send_push(&mut self, peer: PeerId, push: Pull, keep: Arc<RegionShared>, notify: Notify) {
        self.send_request(peer, push, Waiter::Done(notify), Some(keep));
    }

    /// Sends a PULL (`keep` none) or a push request (`keep`: its destination, held until
    /// the ACK) to `peer`; its ACK completes `waiter`.
    fn send_request(
        &mut self,
        peer: PeerId,
        mut pull: Pull,
        waiter: Waiter,
        keep: Option<Arc<RegionShared>>,
    ) {
        let op = self.staging.next_op & ID_MASK;
        self.staging.next_op += 1;
        pull.op = op;
        let push = keep.is_some();
        self.staging.awaiting.insert(op, Awaiting { waiter, peer, sent: Instant::now(), told: false, keep });
        let data = Bytes::from(if push { pull.to_push_bytes() } else { pull.to_bytes() });
        let notify = self.staging.internal(TAG_PULL_SENT, op);
        self.handle(Submission::Send { peer, data, notify });
    }

    /// A PULL could not be sent.
    pub(crate) fn pull_send_failed(&mut self, op: u64, e: Error) {
        if let Some(a) = self.staging.awaiting.remove(&op) {
            self.complete_waiter(a.waiter, Err(e));
        }
    }

    fn complete_waiter(&mut self, waiter: Waiter, result: Result<()>) {
        match waiter {
            Waiter::Chunk { job, idx } => self.chunk_done(job, idx, result),
            Waiter::Done(n) => {
                for s in n.complete(result) {
                    self.handle(s.into());
                }
            }
        }
    }

    /// Fails the PULLs whose ACK has not come within `limit` (`op_timeout`) and marks their
    /// peer failed, as for any operation. As for a timed-out operation, the entry (and the
    /// slot or source the peer may still read) stays until a late ACK or shutdown.
    pub(crate) fn expire_acks(&mut self, now: Instant, limit: Duration) {
        let mut failed = Vec::new();
        for a in self.staging.awaiting.values_mut() {
            if a.told || now.duration_since(a.sent) < limit {
                continue;
            }
            a.told = true;
            let early = match &mut a.waiter {
                Waiter::Done(n) => Some(std::mem::replace(n, Notify::None)),
                Waiter::Chunk { job, .. } => {
                    failed.push((a.peer, None, Some(*job)));
                    None
                }
            };
            if let Some(n) = early {
                failed.push((a.peer, Some(n), None));
            }
        }
        for (peer, notify, job) in failed {
            let message = format!("no ACK for a staged GPU write within {limit:?}; peer marked failed");
            tracing::warn!(peer = peer.0, %message, "staged write timed out");
            if let Some(p) = self.peers.get_mut(peer.0 as usize) {
                p.failed.get_or_insert_with(|| message.clone());
            }
            let e = Error::PeerUnreachable { peer: peer.0, message };
            if let Some(n) = notify {
                n.fail(e);
            } else if let Some(j) = job.and_then(|j| self.staging.jobs.get_mut(&j)) {
                // The caller hears now; the job stays (with its slots) until the ACKs.
                std::mem::replace(&mut j.notify, Notify::None).fail(e.clone());
                j.error.get_or_insert(e);
            }
        }
    }

    /// Owner: a peer reads one of our staged GPU regions (a push request): its bytes are
    /// written into the peer's registered memory chunk by chunk through the pool (on NIC 0,
    /// the endpoint the ACK then goes out on, so the ACK cannot overtake them), then ACKed.
    pub(crate) fn on_push(&mut self, data: &[u8]) {
        let push = match Pull::push_from_bytes(data) {
            Ok(p) => p,
            Err(e) => return tracing::warn!(error = %e, "dropped a malformed push request"),
        };
        let peer = match EngineAddress::from_bytes(&push.sender).and_then(|a| self.peer_of(a)) {
            Ok(p) => p,
            Err(e) => return tracing::warn!(error = %e, "cannot reach the sender of a push request; dropped"),
        };
        let region = match self.check_pull(&push) {
            Ok(r) => r,
            Err(message) => return self.send_ack(peer, push.op, Some(message)),
        };
        let (Some(g), Some(to)) = (region.staged(), push.sources.first()) else {
            // Zero bytes (no sources needed): nothing to write.
            return self.send_ack(peer, push.op, None);
        };
        let req = OpReq {
            domain: 0,
            peer,
            kind: crate::shared::queue::OpKind::Write,
            local_addr: 0,
            len: push.len as usize,
            remote: RemoteSlice { addr: to.addr, key: to.key },
            imm: None,
        };
        let piece =
            Piece { src: PieceSrc::Device(g.ptr + push.dst_off), len: push.len, dst: PieceDst::Write(req) };
        let job = StagedJob {
            ordinal: g.ordinal as usize,
            pieces: vec![piece],
            then: Vec::new(),
            keep: vec![region.clone()],
            local: None,
            notify: Notify::None,
        };
        self.start_job_acked(job, Some((peer, push.op)));
    }

    /// Sender: the ACK of one of our pulls.
    pub(crate) fn on_ack(&mut self, data: &[u8]) {
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
        self.complete_waiter(a.waiter, result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pure::control::PullSource;
    use crate::shared::queue::OpKind;

    fn write(imm: Option<u32>) -> PieceDst {
        PieceDst::Write(OpReq {
            domain: 0,
            peer: PeerId(0),
            kind: OpKind::Write,
            local_addr: 0,
            len: 0,
            remote: RemoteSlice { addr: 0, key: 0 },
            imm,
        })
    }

    #[test]
    fn pieces_are_cut_into_slots_and_an_imm_waits_for_its_piece() {
        let pieces = vec![
            Piece { src: PieceSrc::Device(0), len: 10, dst: write(Some(1)) },
            Piece { src: PieceSrc::Device(0), len: 4, dst: write(Some(1)) },
            Piece { src: PieceSrc::Device(0), len: 9, dst: write(None) },
            Piece { src: PieceSrc::Device(0), len: 0, dst: write(Some(2)) },
            Piece {
                src: PieceSrc::Registered { addr: 0, sources: vec![PullSource { addr: 0, key: 0 }] },
                len: 100,
                dst: write(Some(3)),
            },
        ];
        let w = plan(&pieces, 4);
        let shape: Vec<(usize, u64, u64, bool, bool)> =
            w.iter().map(|w| (w.piece, w.off, w.len, w.last, w.barrier)).collect();
        assert_eq!(
            shape,
            vec![
                (0, 0, 4, false, false),
                (0, 4, 4, false, false),
                (0, 8, 2, true, true),
                (1, 0, 4, true, false),
                (2, 0, 4, false, false),
                (2, 4, 4, false, false),
                (2, 8, 1, true, false),
                (3, 0, 0, true, false),
                (4, 0, 100, true, false),
            ]
        );
        for p in [0usize, 1, 2] {
            let total: u64 = w.iter().filter(|c| c.piece == p).map(|c| c.len).sum();
            assert_eq!(total, pieces[p].len);
        }
    }
}
