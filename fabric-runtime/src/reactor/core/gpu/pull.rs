//! The owner's side of a write into staged GPU memory (the pull protocol,
//! `pure::control`), and local reads into staged GPU memory, which run the same way:
//! each chunk is read (RDMA read) into a bounce slot, copied host-to-device from it, and
//! its slot goes back after the copy's event; the read of chunk k+1 overlaps the copy of
//! chunk k (at most [`PULL_READS_IN_FLIGHT`] reads per pull, round-robin over the NICs).
//!
//! ```text
//!  PULL ─► check region (by key) and bounds
//!       ─► slot ─► read chunk k ─► H2D (gate) ─► slot back    (k = 0, 1, ...)
//!       ─► every copy done ─► count imm ─► ACK        (a local read: its future completes)
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::gates::{GateThen, Keep, Lane, IDX_BITS, ID_MASK, TAG_ACK_SENT, TAG_READ};
use crate::error::{Error, Result};
use crate::provider::{Domain, RemoteSlice};
use crate::pure::control::{Ack, Pull, PullSource};
use crate::pure::descriptor::EngineAddress;
use crate::pure::staging::ChunkPlan;
use crate::reactor::core::Core;
use crate::shared::memory::RegionShared;
use crate::shared::notify::Notify;
use crate::shared::queue::{CopyDir, CudaCopy, OpKind, OpReq, Submission};
use crate::shared::PeerId;

/// Chunk reads of one pull in flight at once (each holds a bounce slot).
const PULL_READS_IN_FLIGHT: u32 = 4;

/// How a pull ends.
pub(crate) enum Finish {
    /// A peer's PULL: count `imm` (on success), then ACK `op`.
    Ack { op: u64, imm: Option<u32> },
    /// A local read into staged memory: complete the caller's future.
    Local(Notify),
}

/// A pull in progress.
pub(crate) struct PullState {
    peer: PeerId,
    region: Arc<RegionShared>,
    sources: Vec<PullSource>,
    dst_off: u64,
    plan: ChunkPlan,
    next: u64,
    reads: u32,
    copies: u32,
    done: u64,
    /// The slot each chunk in flight holds.
    slots: HashMap<u64, u32>,
    error: Option<String>,
    finish: Finish,
}

impl PullState {
    /// Shutdown: fails a local caller and gives back the region.
    pub(crate) fn close(self) -> Arc<RegionShared> {
        if let Finish::Local(n) = self.finish {
            n.fail(Error::Shutdown);
        }
        self.region
    }
}

impl<D: Domain> Core<D> {
    /// Receiver: a peer asks us to pull its bytes into one of our staged GPU regions.
    pub(crate) fn on_pull(&mut self, data: &[u8]) {
        let pull = match Pull::from_bytes(data) {
            Ok(p) => p,
            Err(e) => return tracing::warn!(error = %e, "dropped a malformed PULL"),
        };
        let peer = match EngineAddress::from_bytes(&pull.sender).and_then(|a| self.peer_of(a)) {
            Ok(p) => p,
            Err(e) => return tracing::warn!(error = %e, "cannot reach the sender of a PULL; dropped"),
        };
        let region = match self.check_pull(&pull) {
            Ok(r) => r,
            Err(message) => return self.send_ack(peer, pull.op, Some(message)),
        };
        let finish = Finish::Ack { op: pull.op, imm: pull.imm };
        if let Err(e) = self.start_pull(peer, region, pull.sources, pull.dst_off, pull.len, finish) {
            // Only a failed start comes back (the finish was handed back inside it).
            tracing::warn!(error = %e, "a pull could not start");
        }
    }

    pub(crate) fn check_pull(&self, pull: &Pull) -> std::result::Result<Arc<RegionShared>, String> {
        let region = self
            .shared
            .gpu
            .staged(pull.dst_key)
            .ok_or_else(|| format!("no staged GPU region with key {:#x} (dropped?)", pull.dst_key))?;
        if region.regs.first().map(|r| r.remote_base) != Some(pull.dst_base) {
            return Err(format!("no staged GPU region at base {:#x}", pull.dst_base));
        }
        let len = region.len() as u64;
        if pull.dst_off.checked_add(pull.len).is_none_or(|end| end > len) {
            return Err(format!(
                "range {}+{} is out of bounds of a {len}-byte region",
                pull.dst_off, pull.len
            ));
        }
        if pull.len > 0 && pull.sources.is_empty() {
            return Err("a PULL without sources".into());
        }
        Ok(region)
    }

    /// A local read of `len` bytes from `sources` (a peer's host or GPUDirect region) into
    /// staged `region` at `dst_off` (a `Submission::ReadStaged`).
    pub(crate) fn start_read(
        &mut self,
        peer: PeerId,
        region: Arc<RegionShared>,
        dst_off: u64,
        len: u64,
        sources: Vec<PullSource>,
        notify: Notify,
    ) {
        let _ = self.start_pull(peer, region, sources, dst_off, len, Finish::Local(notify));
    }

    /// Starts a pull; on a refusal the finish is told (ACK with the error, or the future).
    fn start_pull(
        &mut self,
        peer: PeerId,
        region: Arc<RegionShared>,
        sources: Vec<PullSource>,
        dst_off: u64,
        len: u64,
        finish: Finish,
    ) -> Result<()> {
        let plan = (|| {
            let slot_len = if len > 0 { self.pool()?.slot_len() } else { 1 };
            let plan = ChunkPlan::new(len, slot_len)?;
            if plan.count() >= 1 << IDX_BITS {
                return Err(Error::Unsupported(format!(
                    "{} chunks; raise the staging chunk size",
                    plan.count()
                )));
            }
            Ok(plan)
        })();
        let plan = match plan {
            Ok(p) => p,
            Err(e) => {
                match finish {
                    Finish::Ack { op, .. } => self.send_ack(peer, op, Some(e.to_string())),
                    Finish::Local(n) => n.fail(e.clone()),
                }
                return Err(e);
            }
        };
        let id = self.staging.next_pull & ID_MASK;
        self.staging.next_pull += 1;
        tracing::debug!(len, chunks = plan.count(), "pulling into a staged GPU region");
        self.staging.pulls.insert(
            id,
            PullState {
                peer,
                region,
                sources,
                dst_off,
                plan,
                next: 0,
                reads: 0,
                copies: 0,
                done: 0,
                slots: HashMap::new(),
                error: None,
                finish,
            },
        );
        self.pump_pull(id);
        Ok(())
    }

    /// Posts the next chunk reads of pull `id` (as slots allow), or finishes it.
    pub(crate) fn pump_pull(&mut self, id: u64) {
        let nics = self.domains.len();
        loop {
            let Some(p) = self.staging.pulls.get(&id) else { return };
            if p.error.is_none() && p.reads < PULL_READS_IN_FLIGHT && p.next < p.plan.count() {
                let Some(pool) = self.staging.pool.as_mut() else { break };
                let Some(slot) = pool.acquire(false) else { break };
                let (addr, keep) = (pool.addr(slot), pool.region().clone());
                let Some(p) = self.staging.pulls.get_mut(&id) else { return };
                let Some(c) = p.plan.get(p.next) else { return };
                p.next += 1;
                p.reads += 1;
                p.slots.insert(c.index, slot);
                let nic = c.index as usize % p.sources.len().min(nics).max(1);
                let src = p.sources[nic];
                let req = OpReq {
                    domain: nic,
                    peer: p.peer,
                    kind: OpKind::Read,
                    local_addr: addr,
                    len: c.len as usize,
                    remote: RemoteSlice { addr: src.addr.wrapping_add(c.offset), key: src.key },
                    imm: None,
                };
                let notify = self.staging.internal(TAG_READ, id << IDX_BITS | c.index);
                self.handle(Submission::Op { req, keep: Some(keep), notify });
                continue;
            }
            break;
        }
        let Some(p) = self.staging.pulls.get(&id) else { return };
        let finished = p.error.is_some() || p.done == p.plan.count();
        if p.reads > 0 || p.copies > 0 || !finished {
            return;
        }
        let Some(p) = self.staging.pulls.remove(&id) else { return };
        match p.finish {
            Finish::Ack { op, imm } => {
                if p.error.is_none() {
                    if let Some(imm) = imm {
                        self.arrive(imm);
                    }
                }
                self.send_ack(p.peer, op, p.error);
            }
            Finish::Local(n) => {
                let r = match p.error {
                    None => Ok(()),
                    Some(message) => Err(Error::Completion {
                        op: "read into staged GPU memory",
                        errno: libc::EIO,
                        message,
                    }),
                };
                for s in n.complete(r) {
                    self.handle(s.into());
                }
            }
        }
    }

    /// Gives chunk `idx`'s slot of pull `id` back; every waiter may take it.
    fn release_pull_slot(&mut self, id: u64, idx: u64) {
        let slot = self.staging.pulls.get_mut(&id).and_then(|p| p.slots.remove(&idx));
        if let (Some(s), Some(pool)) = (slot, self.staging.pool.as_mut()) {
            pool.release(s, false);
        }
        self.pump_all();
    }

    pub(crate) fn pull_read_done(&mut self, id: u64, idx: u64, result: Result<()>) {
        let Some(p) = self.staging.pulls.get_mut(&id) else { return };
        p.reads = p.reads.saturating_sub(1);
        if let Err(e) = result {
            p.error.get_or_insert(e.to_string());
            return self.release_pull_slot(id, idx);
        }
        let (Some(c), Some(g), Some(&slot)) = (p.plan.get(idx), p.region.staged(), p.slots.get(&idx)) else {
            p.error.get_or_insert("a pulled chunk without its slot or region".into());
            return self.release_pull_slot(id, idx);
        };
        let Some(pool) = self.staging.pool.as_ref() else { return };
        let copy = CudaCopy {
            dir: CopyDir::HostToDevice,
            dst: g.ptr + p.dst_off + c.offset,
            src: pool.addr(slot),
            len: c.len as usize,
        };
        let ordinal = g.ordinal as usize;
        let keep: Keep = vec![p.region.clone(), pool.region().clone()];
        p.copies += 1;
        self.start_gate(
            ordinal,
            Lane::Of(id),
            None,
            &[copy],
            GateThen::PullChunk { pull: id, idx },
            keep,
            None,
        );
    }

    pub(crate) fn pull_copy_done(&mut self, id: u64, idx: u64, result: Result<()>) {
        let Some(p) = self.staging.pulls.get_mut(&id) else { return };
        p.copies = p.copies.saturating_sub(1);
        match result {
            Ok(()) => p.done += 1,
            Err(e) => {
                p.error.get_or_insert(e.to_string());
            }
        }
        self.release_pull_slot(id, idx);
    }

    pub(crate) fn send_ack(&mut self, peer: PeerId, op: u64, error: Option<String>) {
        if let Some(e) = &error {
            tracing::warn!(op, error = %e, "a pull into a staged GPU region failed");
        }
        let data = Bytes::from(Ack { op, error }.to_bytes());
        let notify = self.staging.internal(TAG_ACK_SENT, op);
        self.handle(Submission::Send { peer, data, notify });
    }
}
