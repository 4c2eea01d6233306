//! Writes into GPU regions of other processes on this host, through CUDA IPC: the writer's
//! copy engine writes the peer's GPU memory through its IPC mapping (over NVLink between two
//! GPUs that have it), then one imm-only write per destination region tells its owner.
//!
//! ```text
//!  write_imm, write_paged, scatter ─► one gate: every copy on a stream of the source's device
//!      (one submission, however many blocks) ─► event ready ─► one imm-only write per region
//!  batch (write or read) ─► one gate of copies, either way through the mappings ─► event ready
//! ```
//!
//! A KV request of many small blocks is one gate and one arrival, not a transport operation
//! per block: the owner counts exactly one arrival per destination region (`write_arrivals`,
//! `paged_arrivals` and `scatter_arrivals` say so).

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::cuda;
use crate::engine::batch::{BatchEntry, BatchOp};
use crate::engine::op::OpFuture;
use crate::engine::region::{MemoryRegion, RemoteRegion};
use crate::engine::transfer::{PeerGroup, ScatterEntry, Transfers};
use crate::error::{Error, Result};
use crate::pure::route::PageLayout;
use crate::pure::staging::GpuPath;
use crate::shared::notify::{GroupState, Notify, OpState};
use crate::shared::queue::{CopyDir, CudaCopy, GatedCopies, OpKind, Submission};

type Keep = Vec<Arc<dyn Any + Send + Sync>>;

/// `(source offset, destination offset, length)` of one copy.
type Range3 = (u64, u64, u64);

/// A destination region and the copies into it.
pub(in crate::engine) type Part<'a> = (&'a RemoteRegion, Vec<Range3>);

/// Whether writes into `dst` take CUDA IPC.
pub(in crate::engine) fn via_ipc(dst: &RemoteRegion) -> bool {
    dst.gpu_path() == Some(GpuPath::Ipc)
}

impl Transfers<'_> {
    /// Copies `(src_off, dst_off, len)` of `src` into each destination region through its IPC
    /// mapping, as one gate; then, with `imm`, one imm-only write per destination. Ranges are
    /// the caller's to check.
    pub(in crate::engine) fn ipc_write(
        &self,
        src: &MemoryRegion,
        parts: &[Part<'_>],
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        let t0 = std::time::Instant::now();
        let first_ordinal = parts.first().and_then(|(d, _)| d.desc.gpu.as_ref()).map_or(0, |g| g.ordinal);
        let ordinal = src.inner.gpu.as_ref().map_or(first_ordinal, |g| g.ordinal) as usize;
        let mut keep: Keep = vec![src.inner.clone()];
        let mut copies = Vec::new();
        let mut signals = Vec::new();
        let nics = self.shared().nics;
        for (dst, ranges) in parts {
            let export =
                dst.ipc.as_ref().ok_or_else(|| Error::Unsupported("CUDA IPC to this region".into()))?;
            let mapping = self.shared().gpu.ipc_mapping(export, ordinal)?;
            let base = cuda::DeviceMemory::device_ptr(&*mapping);
            for &(src_off, dst_off, len) in ranges {
                if len == 0 {
                    continue;
                }
                copies.push(match &src.inner.gpu {
                    Some(g) => CudaCopy {
                        dir: CopyDir::DeviceToDevice,
                        dst: base + dst_off,
                        src: g.ptr + src_off,
                        len: len as usize,
                    },
                    None => CudaCopy {
                        dir: CopyDir::HostToDevice,
                        dst: base + dst_off,
                        src: src.inner.backing().addr() + src_off,
                        len: len as usize,
                    },
                });
            }
            keep.push(mapping);
            if let Some(imm) = imm {
                let nic = self.opts.nic_of(0, nics, self.shared().next_start());
                signals.push(Self::req(nic, OpKind::Write, 0, 0, dst, 0, Some(imm)));
            }
        }
        let state = Arc::new(OpState::default());
        let (then, done) = match signals.len() {
            0 => (Vec::new(), Some(Notify::Future(state.clone()))),
            1 => {
                let req = signals.pop().expect("one signal");
                (vec![Submission::Op { req, keep: None, notify: Notify::Future(state.clone()) }], None)
            }
            n => {
                // One future for the signals of every region: it completes when all have.
                let group = GroupState::new(n, Notify::Future(state.clone()), Vec::new());
                let subs = signals
                    .into_iter()
                    .map(|req| Submission::Op { req, keep: None, notify: Notify::Group(group.clone()) })
                    .collect();
                (subs, None)
            }
        };
        self.hand_gate(t0, ordinal, copies, then, done, keep, state)
    }

    /// Hands one gate of copies to the reactor (its planning time, since `t0`, counted) and
    /// gives the future of `state`.
    #[allow(clippy::too_many_arguments)]
    fn hand_gate(
        &self,
        t0: std::time::Instant,
        ordinal: usize,
        copies: Vec<CudaCopy>,
        then: Vec<Submission>,
        done: Option<Notify>,
        keep: Keep,
        state: Arc<OpState>,
    ) -> Result<OpFuture> {
        let handed = std::time::Instant::now();
        let s = Submission::Gated(Box::new(GatedCopies {
            ordinal,
            copies,
            then,
            done,
            keep,
            after: None,
            handed,
        }));
        let g = &self.shared().stats.gpu;
        crate::shared::stats::bump(&g.plan_ns, handed.saturating_duration_since(t0).as_nanos() as u64);
        self.hand(vec![s])?;
        Ok(OpFuture::pending(state).driven_by(self.engine.driver()).without_linger())
    }

    /// `write_paged` into a region reached through CUDA IPC: every page a copy in one gate,
    /// then one imm-only write (exactly one arrival; none for no pages).
    pub(in crate::engine) fn ipc_paged(
        &self,
        src: &MemoryRegion,
        dst: &RemoteRegion,
        layout: &PageLayout,
        src_pages: &[u32],
        dst_pages: &[u32],
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        self.check_remote(dst)?;
        self.check_local(src)?;
        let pages = layout.resolve(src_pages, dst_pages, src.len() as u64, dst.len())?;
        if pages.is_empty() {
            return Ok(OpFuture::done());
        }
        let ranges = pages.into_iter().map(|(so, doff)| (so, doff, layout.page_len)).collect();
        self.ipc_write(src, &[(dst, ranges)], imm)
    }

    /// Whether a scatter takes CUDA IPC: every member with an entry is reached through it.
    pub(in crate::engine) fn ipc_scatter_applies(group: &PeerGroup, entries: &[ScatterEntry]) -> bool {
        !entries.is_empty() && entries.iter().all(|e| group.members().get(e.member).is_some_and(via_ipc))
    }

    /// `scatter` whose members are all reached through CUDA IPC: every entry a copy in one
    /// gate, then one imm-only write per member with an entry (exactly one arrival each).
    pub(in crate::engine) fn ipc_scatter(
        &self,
        src: &MemoryRegion,
        group: &PeerGroup,
        entries: &[ScatterEntry],
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        self.check_local(src)?;
        self.check_entries(Some(src.len() as u64), group, entries)?;
        let mut per: Vec<Vec<Range3>> = vec![Vec::new(); group.len()];
        let mut named = vec![false; group.len()];
        for e in entries {
            named[e.member] = true;
            per[e.member].push((e.src_off, e.dst_off, e.len));
        }
        let parts: Vec<Part<'_>> = group
            .members()
            .iter()
            .zip(per)
            .zip(named)
            .filter(|(_, named)| *named)
            .map(|((m, r), _)| (m, r))
            .collect();
        self.ipc_write(src, &parts, imm)
    }
}

impl Transfers<'_> {
    /// A batch whose every remote region is reached through CUDA IPC: every entry is one
    /// copy (entries that continue each other on both sides, one copy) of one gate (local memory into the peer's mapping for writes, the mapping into
    /// local memory for reads), and the future completes when the gate's event is ready.
    /// Local GPU regions must all be on one device. No immediates (a batch has none).
    pub(in crate::engine) fn ipc_batch(&self, op: BatchOp, entries: &[BatchEntry<'_>]) -> Result<OpFuture> {
        let t0 = std::time::Instant::now();
        let mut ordinal = None;
        for e in entries {
            if let Some(g) = &e.local.inner.gpu {
                match ordinal {
                    Some(o) if o != g.ordinal => {
                        return Err(Error::Unsupported(format!(
                            "a CUDA IPC batch with local GPU regions on devices {o} and {}",
                            g.ordinal
                        )))
                    }
                    _ => ordinal = Some(g.ordinal),
                }
            }
        }
        let first_remote = entries.first().and_then(|e| e.remote.desc.gpu.as_ref()).map_or(0, |g| g.ordinal);
        let ordinal = ordinal.unwrap_or(first_remote) as usize;
        let mut keep: Keep = Vec::new();
        let mut mapped: HashMap<*const crate::pure::descriptor::RegionDescriptor, u64> = HashMap::new();
        let mut kept: HashSet<*const crate::shared::memory::RegionShared> = HashSet::new();
        let mut copies: Vec<CudaCopy> = Vec::with_capacity(entries.len());
        for e in entries {
            self.check_local(e.local)?;
            self.check_remote(e.remote)?;
            e.local.check(e.local_off, e.len)?;
            e.remote.check(e.remote_off, e.len)?;
            if e.len == 0 {
                continue;
            }
            let base = match mapped.get(&Arc::as_ptr(&e.remote.desc)) {
                Some(&b) => b,
                None => {
                    let export = e
                        .remote
                        .ipc
                        .as_ref()
                        .ok_or_else(|| Error::Unsupported("CUDA IPC to this region".into()))?;
                    let mapping = self.shared().gpu.ipc_mapping(export, ordinal)?;
                    let b = cuda::DeviceMemory::device_ptr(&*mapping);
                    keep.push(mapping);
                    mapped.insert(Arc::as_ptr(&e.remote.desc), b);
                    b
                }
            };
            if kept.insert(Arc::as_ptr(&e.local.inner)) {
                keep.push(e.local.inner.clone());
            }
            let (local, on_device) = match &e.local.inner.gpu {
                Some(g) => (g.ptr + e.local_off, true),
                None => (e.local.inner.backing().addr() + e.local_off, false),
            };
            let remote = base + e.remote_off;
            let len = e.len as usize;
            let (dir, dst, src) = match (op, on_device) {
                (BatchOp::Write, true) => (CopyDir::DeviceToDevice, remote, local),
                (BatchOp::Write, false) => (CopyDir::HostToDevice, remote, local),
                (BatchOp::Read, true) => (CopyDir::DeviceToDevice, local, remote),
                (BatchOp::Read, false) => (CopyDir::DeviceToHost, local, remote),
            };
            // A copy that continues the one before it on both sides joins it.
            match copies.last_mut() {
                Some(c) if c.dir == dir && c.src + c.len as u64 == src && c.dst + c.len as u64 == dst => {
                    c.len += len
                }
                _ => copies.push(CudaCopy { dir, dst, src, len }),
            }
        }
        if copies.is_empty() {
            return Ok(OpFuture::done());
        }
        let state = Arc::new(OpState::default());
        let done = Some(Notify::Future(state.clone()));
        self.hand_gate(t0, ordinal, copies, Vec::new(), done, keep, state)
    }
}
