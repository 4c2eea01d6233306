//! Batches: many writes (or many reads) between any local and remote regions, checked
//! completely, posted as one group and resolved as one [`OpFuture`]. This is the shape of a
//! NIXL request (a list of local and a list of remote descriptors, each in its own
//! registered region), where paged writes and scatters need one source region and one
//! geometry.

use std::sync::Arc;

use super::op::OpFuture;
use super::region::{MemoryRegion, RemoteRegion};
use super::transfer::Transfers;
use crate::error::{Error, Result};
use crate::shared::memory::RegionShared;
use crate::shared::notify::{GroupState, Notify, OpState};
use crate::shared::queue::{OpKind, OpReq, Submission};

/// One piece of a batch: `len` bytes between `local` at `local_off` and `remote` at
/// `remote_off`, in the batch's direction.
#[derive(Debug, Clone, Copy)]
pub struct BatchEntry<'r> {
    /// The local region: the source of a write, the destination of a read.
    pub local: &'r MemoryRegion,
    /// Offset in `local`.
    pub local_off: u64,
    /// The peer's region: the destination of a write, the source of a read.
    pub remote: &'r RemoteRegion,
    /// Offset in `remote`.
    pub remote_off: u64,
    /// Bytes to move (0: the entry is skipped).
    pub len: u64,
}

/// Entries of a batch that continue each other on both sides, as one transfer.
struct Run<'r> {
    keep: Arc<RegionShared>,
    remote: &'r RemoteRegion,
    local_off: u64,
    remote_off: u64,
    len: u64,
}

/// The direction of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchOp {
    /// Local bytes into the remote regions ([`Transfers::write`] per entry).
    Write,
    /// Remote bytes into the local regions ([`Transfers::read`] per entry).
    Read,
}

impl BatchEntry<'_> {
    /// Whether the NICs reach both ends of this entry directly (host memory, or GPU memory
    /// registered GPUDirect): what [`Transfers::batch`] takes. Staged GPU regions and GPU
    /// regions reached through CUDA IPC take their own paths ([`Transfers::write`],
    /// [`Transfers::read`], [`Transfers::scatter`]).
    pub fn is_direct(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            use crate::pure::staging::GpuPath;
            let direct = |p: Option<GpuPath>| matches!(p, None | Some(GpuPath::GpuDirect));
            direct(self.local.gpu_path()) && direct(self.remote.gpu_path())
        }
        #[cfg(not(feature = "cuda"))]
        true
    }
}

impl Transfers<'_> {
    /// Moves every entry of `entries` in direction `op` as one transfer: entries that
    /// continue each other on both sides (in the same two regions, each starting where the
    /// one before it ended, on both sides) are merged, each run is sharded over the NICs
    /// like a single [`Transfers::write`] or [`Transfers::read`], all of them are handed to
    /// the reactor at once, and the future resolves when the last one has completed (with
    /// the first error if any failed). No immediates: a batch's
    /// completion is the initiator's to see; announce it with a message or an imm-only
    /// write after the future resolved.
    ///
    /// Where every remote region is GPU memory of another process on this host reached
    /// through CUDA IPC, the batch is one gate of copies through the peers' mappings, either
    /// way (`docs/gpu.md`): GPU to GPU on one host, reads included.
    ///
    /// Everything is checked before anything is posted: that every region belongs to this
    /// engine, both ranges of every entry, and that every entry is direct
    /// ([`BatchEntry::is_direct`]) or, as above, every one through CUDA IPC; otherwise
    /// [`Error::Unsupported`]. Overlapping destination ranges are allowed and land in an
    /// undefined order, as with separate operations.
    ///
    /// # Cancel safety
    ///
    /// As for [`Transfers::write`]: dropping the future recalls nothing, and every region
    /// stays registered and allocated until the NIC is done with it.
    pub fn batch(&self, op: BatchOp, entries: &[BatchEntry<'_>]) -> OpFuture {
        #[cfg(feature = "cuda")]
        if !entries.is_empty()
            && entries.iter().all(|e| e.remote.gpu_path() == Some(crate::pure::staging::GpuPath::Ipc))
        {
            return self.ipc_batch(op, entries).unwrap_or_else(OpFuture::failed);
        }
        match self.batch_plan(op, entries) {
            Ok(ops) => self.submit_batch(ops),
            Err(e) => OpFuture::failed(e),
        }
    }

    fn batch_plan(
        &self,
        op: BatchOp,
        entries: &[BatchEntry<'_>],
    ) -> Result<Vec<(OpReq, Option<Arc<RegionShared>>)>> {
        let nics = self.shared().nics;
        self.opts.validate(nics)?;
        let kind = match op {
            BatchOp::Write => OpKind::Write,
            BatchOp::Read => OpKind::Read,
        };
        // Checked whole first; runs of entries that continue each other on both sides (the
        // same two regions, the next bytes of each) become one transfer.
        let mut runs: Vec<Run<'_>> = Vec::new();
        // Consecutive entries usually share their local region: one check and one clone of
        // its handle per run of them, not per entry.
        let mut last: Option<Arc<RegionShared>> = None;
        for e in entries {
            if !e.is_direct() {
                return Err(Error::Unsupported(
                    "a batch entry with a staged or CUDA IPC end (use write/read/scatter for those)".into(),
                ));
            }
            let keep = match &last {
                Some(keep) if Arc::ptr_eq(keep, &e.local.inner) => keep.clone(),
                _ => {
                    self.check_local(e.local)?;
                    last = Some(e.local.inner.clone());
                    e.local.inner.clone()
                }
            };
            self.check_remote(e.remote)?;
            e.local.check(e.local_off, e.len)?;
            e.remote.check(e.remote_off, e.len)?;
            if e.len == 0 {
                continue;
            }
            if let Some(r) = runs.last_mut() {
                if Arc::ptr_eq(&r.keep, &keep)
                    && Arc::ptr_eq(&r.remote.desc, &e.remote.desc)
                    && r.remote.peer == e.remote.peer
                    && r.local_off + r.len == e.local_off
                    && r.remote_off + r.len == e.remote_off
                {
                    r.len += e.len;
                    continue;
                }
            }
            runs.push(Run {
                keep,
                remote: e.remote,
                local_off: e.local_off,
                remote_off: e.remote_off,
                len: e.len,
            });
        }
        let mut ops = Vec::with_capacity(runs.len());
        for r in runs {
            let base = r.keep.backing().addr() + r.local_off;
            let start = self.shared().next_start();
            for s in self.opts.shards(r.len, nics, start)? {
                let req =
                    Self::req(s.nic, kind, base + s.offset, s.len, r.remote, r.remote_off + s.offset, None);
                ops.push((req, Some(r.keep.clone())));
            }
        }
        Ok(ops)
    }

    fn submit_batch(&self, mut ops: Vec<(OpReq, Option<Arc<RegionShared>>)>) -> OpFuture {
        if ops.is_empty() {
            return OpFuture::done();
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            let bytes: usize = ops.iter().map(|o| o.0.len).sum();
            tracing::debug!(ops = ops.len(), bytes, "batch submitted");
        }
        let state = Arc::new(OpState::default());
        let done = Notify::Future(state.clone());
        let subs: Vec<Submission> = if ops.len() == 1 {
            let (req, keep) = ops.pop().expect("one op");
            vec![Submission::Op { req, keep, notify: done }]
        } else {
            let group = GroupState::new(ops.len(), done, Vec::new());
            ops.into_iter()
                .map(|(req, keep)| Submission::Op { req, keep, notify: Notify::Group(group.clone()) })
                .collect()
        };
        match self.hand(subs) {
            Ok(()) => OpFuture::pending(state).driven_by(self.engine.driver()),
            Err(_) => OpFuture::failed(Error::Shutdown),
        }
    }
}
