//! GPU memory in the engine: regions in CUDA memory (allocated by the engine or owned by the
//! user), the path each takes (GPUDirect, staged, CUDA IPC), the blocking copies of
//! `read_at`/`write_at`, and the transfers whose bytes cross a staging shadow or an IPC
//! mapping. The reactor's half is `reactor/staging.rs`; the protocol is in `docs/gpu.md`.
//!
//! ```text
//!  source            destination (its descriptor)     what happens
//!  host / GPUDirect  host / GPUDirect                 RDMA write (as for host memory)
//!  staged GPU        host / GPUDirect                 D2H into the shadow (gate), RDMA write
//!  any               staged GPU                       [D2H,] PULL ─► peer reads, H2D, counts, ACK
//!  any               GPU on this host (IPC)           copy engine into the IPC mapping, imm-only write
//! ```

use std::any::Any;
use std::sync::Arc;

use super::op::OpFuture;
use super::region::{MemoryRegion, RemoteRegion};
use super::transfer::Transfers;
use super::Engine;
use crate::cuda::{self, DeviceBuffer, MemoryKind, PinnedHostBuffer, Stream};
use crate::error::{Error, Result};
use crate::provider::MemoryLocation;
use crate::pure::control::{Pull, PullSource};
use crate::pure::descriptor::GpuRegion;
use crate::pure::staging::GpuPath;
use crate::shared::memory::{Backing, GpuMemory, RegionShared};
use crate::shared::notify::{Notify, OpState};
use crate::shared::queue::{CopyDir, CudaCopy, OpKind, OpReq, Submission};

impl Engine {
    /// `alloc_in(len, Cuda { ordinal })`: a new zeroed device allocation, registered.
    pub(super) async fn alloc_cuda(&self, len: usize, ordinal: u32) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::Config("cannot register an empty region".into()));
        }
        let ctx = cuda::context(ordinal as usize)?;
        let buf = Arc::new(DeviceBuffer::new(&ctx, len)?);
        self.register_device(buf.device_ptr(), len, ordinal, ctx, Some(buf)).await
    }

    /// Registers `len` bytes of CUDA device memory at `ptr` on device `ordinal`, owned by
    /// the caller (a `cudaMalloc` range, a PyTorch tensor's `data_ptr()`), with every NIC:
    /// GPUDirect where every NIC can register GPU memory, else staged through a pinned host
    /// shadow of `len` bytes ([`MemoryRegion::gpu_path`] says which).
    ///
    /// Errors: [`Error::NotDeviceMemory`] if the range is not device memory of `ordinal`
    /// inside one allocation (checked with `cuda::pointer_info`); [`Error::Unsupported`]
    /// without a CUDA driver.
    ///
    /// # Safety
    ///
    /// The range must stay allocated until the returned region and every clone of it are
    /// dropped **and** every transfer that uses it has completed (the engine holds the
    /// region until then; the memory itself is the caller's to keep).
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register`].
    pub async unsafe fn register_cuda(&self, ptr: u64, len: usize, ordinal: u32) -> Result<MemoryRegion> {
        let bad = |reason: String| Error::NotDeviceMemory { ptr, len, ordinal, reason };
        if len == 0 {
            return Err(bad("an empty range".into()));
        }
        let info = cuda::pointer_info(ptr)?;
        if info.kind != MemoryKind::Device {
            return Err(bad(format!("the driver says it is {:?} memory", info.kind)));
        }
        if info.ordinal != Some(ordinal as usize) {
            return Err(bad(format!("it belongs to device {:?}", info.ordinal)));
        }
        match info.allocation {
            Some(a) if a.contains(ptr, len) => {}
            Some(a) => {
                return Err(bad(format!("it runs past its allocation {:#x}+{}", a.base, a.len)));
            }
            None => return Err(bad("the driver does not know its allocation".into())),
        }
        let ctx = cuda::context(ordinal as usize)?;
        self.register_device(ptr, len, ordinal, ctx, None).await
    }

    /// The path GPU memory of device `ordinal` takes on this engine's NICs: the path of its
    /// first GPU region, or found by registering a 4 KiB probe allocation.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the probe, if any, is freed.
    pub async fn gpu_path(&self, ordinal: u32) -> Result<GpuPath> {
        if let Some(p) = crate::sync::lock(&self.shared().gpu.paths).get(&ordinal) {
            return Ok(*p);
        }
        Ok(self.alloc_cuda(4096, ordinal).await?.inner.gpu.as_ref().map_or(GpuPath::Staged, |g| g.path))
    }

    async fn register_device(
        &self,
        ptr: u64,
        len: usize,
        ordinal: u32,
        ctx: Arc<cuda::Context>,
        owned: Option<Arc<DeviceBuffer>>,
    ) -> Result<MemoryRegion> {
        let location = MemoryLocation::Cuda { ordinal };
        let direct = self.register_raw(Backing::device(ptr, len, owned.clone()), location).await;
        let (regs, backing, path) = match direct {
            Ok((regs, backing)) => (regs, backing, GpuPath::GpuDirect),
            Err(Error::Unsupported(why)) | Err(Error::RegisterMemory { message: why, .. }) => {
                tracing::debug!(ordinal, len, %why, "a NIC cannot register GPU memory: staging through pinned host memory");
                let shadow = PinnedHostBuffer::new(&ctx, len)?;
                let (regs, backing) =
                    self.register_raw(Backing::pinned(shadow), MemoryLocation::Host).await?;
                (regs, backing, GpuPath::Staged)
            }
            Err(e) => return Err(e),
        };
        tracing::debug!(ordinal, len, path = %path, "registered a GPU region");
        crate::sync::lock(&self.shared().gpu.paths).entry(ordinal).or_insert(path);
        let ipc = match &owned {
            Some(b) => b.ipc_export(0, len),
            None => cuda::ipc_export(ptr, len),
        }
        .map_err(|e| tracing::debug!(error = %e, "no CUDA IPC export for a GPU region"))
        .ok();
        let key = regs.first().map(|r| r.remote_key);
        let gpu = GpuMemory { ordinal, ptr, ctx, path, _owned: owned, ipc };
        let inner = Arc::new(RegionShared::new_gpu(backing, regs, location, self.shared().clone(), gpu));
        if let (GpuPath::Staged, Some(key)) = (path, key) {
            self.shared().gpu.track_staged(key, &inner);
        }
        Ok(MemoryRegion { inner })
    }
}

/// A blocking copy for `read_at` / `write_at` / `to_vec` of a GPU region (setup calls).
pub(super) fn copy_blocking(
    g: &GpuMemory,
    dir: CopyDir,
    device_off: u64,
    host: *mut u8,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let stream = Stream::new(&g.ctx)?;
    let dev = g.ptr + device_off;
    // SAFETY: the caller bounds-checked `device_off..+len` against the region and passes a
    // host buffer of `len` bytes; the stream is synchronized before either goes away.
    unsafe {
        match dir {
            CopyDir::HostToDevice => stream.copy_h2d_raw(dev, host, len)?,
            _ => stream.copy_d2h_raw(host, dev, len)?,
        }
    }
    stream.synchronize()
}

impl MemoryRegion {
    /// For a GPU region, how its NICs reach it ([`GpuPath::GpuDirect`] or
    /// [`GpuPath::Staged`]); `None` for host memory.
    pub fn gpu_path(&self) -> Option<GpuPath> {
        self.inner.gpu.as_ref().map(|g| g.path)
    }

    /// For a GPU region: the device address of byte 0.
    pub fn device_ptr(&self) -> Option<u64> {
        self.inner.gpu.as_ref().map(|g| g.ptr)
    }

    pub(super) fn gpu_descriptor(&self) -> Option<GpuRegion> {
        let g = self.inner.gpu.as_ref()?;
        Some(GpuRegion {
            ordinal: g.ordinal,
            staged: g.path == GpuPath::Staged,
            ipc: g.ipc.map(|e| e.to_bytes().to_vec()),
            host: owner_id(self.inner.engine().gpu.host_id.as_deref()),
        })
    }
}

impl RemoteRegion {
    /// For a GPU region, the path a write from this engine takes: [`GpuPath::Ipc`] when the
    /// owner is on this host and offers a CUDA IPC export (and `cuda_ipc` is on), else the
    /// owner's NIC path; `None` for host memory.
    pub fn gpu_path(&self) -> Option<GpuPath> {
        let g = self.desc.gpu.as_ref()?;
        if self.ipc.is_some() {
            return Some(GpuPath::Ipc);
        }
        Some(if g.staged { GpuPath::Staged } else { GpuPath::GpuDirect })
    }
}

/// The `host` of a GPU descriptor: this boot's id, `#`, this process's id (empty when the
/// kernel gives no boot id). Peers compare the boot id to know they share a host, and the
/// process id to know they are not the exporting process itself, which CUDA IPC refuses
/// (`cuIpcOpenMemHandle` in the exporter fails with `CUDA_ERROR_INVALID_CONTEXT`).
fn owner_id(boot: Option<&[u8]>) -> Vec<u8> {
    let Some(boot) = boot else { return Vec::new() };
    let mut v = boot.to_vec();
    v.extend_from_slice(format!("#{}", std::process::id()).as_bytes());
    v
}

/// Whether a writer of this engine can open `g`'s IPC export: same boot, another process.
pub(super) fn ipc_usable(shared: &crate::shared::Shared, g: &GpuRegion) -> Option<cuda::IpcExport> {
    let (boot, pid) = match g.host.iter().position(|&b| b == b'#') {
        Some(i) => {
            (&g.host[..i], std::str::from_utf8(&g.host[i + 1..]).ok().and_then(|p| p.parse::<u32>().ok()))
        }
        None => (&g.host[..], None),
    };
    if !shared.gpu.ipc_enabled || boot.is_empty() || shared.gpu.host_id.as_deref() != Some(boot) {
        return None;
    }
    if pid == Some(std::process::id()) {
        // Our own export: CUDA IPC cannot open it here; the region's NIC path serves.
        return None;
    }
    if !matches!(cuda::available(), Ok(n) if n > 0) {
        return None;
    }
    cuda::IpcExport::from_bytes(g.ipc.as_deref()?).ok()
}

type Keep = Vec<Arc<dyn Any + Send + Sync>>;

impl Transfers<'_> {
    /// A write whose bytes cross a staging shadow or an IPC mapping, or `None` when it is a
    /// plain RDMA write (both ends host or GPUDirect). Ranges are checked here.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gpu_write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Option<OpFuture> {
        let dst_path = dst.gpu_path();
        let src_staged = src.inner.staged().is_some();
        if !src_staged && !matches!(dst_path, Some(GpuPath::Staged | GpuPath::Ipc)) {
            return None;
        }
        let r = (|| {
            self.check_remote(dst)?;
            self.check_local(src)?;
            dst.check(dst_off, len)?;
            src.check(src_off, len)?;
            match dst_path {
                Some(GpuPath::Ipc) => self.ipc_write(src, src_off, dst, dst_off, len, imm),
                Some(GpuPath::Staged) => self.pull_write(src, src_off, dst, dst_off, len, imm),
                _ => self.staged_source_write(src, src_off, dst, dst_off, len, imm),
            }
        })();
        Some(r.unwrap_or_else(OpFuture::failed))
    }

    /// The D2H copy of a staged source's range into its shadow (same offsets).
    fn d2h(src: &MemoryRegion, src_off: u64, len: u64) -> Option<(usize, CudaCopy)> {
        let g = src.inner.staged()?;
        Some((
            g.ordinal as usize,
            CudaCopy {
                dir: CopyDir::DeviceToHost,
                dst: src.inner.backing().addr() + src_off,
                src: g.ptr + src_off,
                len: len as usize,
            },
        ))
    }

    /// `then` behind the D2H copy of `src`'s range into its shadow, or `Err(then)` when there
    /// is nothing to copy (a host or GPUDirect source, or zero bytes).
    fn behind_d2h(
        src: &MemoryRegion,
        src_off: u64,
        len: u64,
        then: Vec<Submission>,
    ) -> std::result::Result<Submission, Vec<Submission>> {
        match Self::d2h(src, src_off, len) {
            Some((ordinal, copy)) if len > 0 => Ok(Submission::Gated {
                ordinal,
                copies: vec![copy],
                then,
                done: None,
                keep: vec![src.inner.clone() as Arc<dyn Any + Send + Sync>],
                after: None,
            }),
            _ => Err(then),
        }
    }

    /// Submits `then` behind the D2H copy of a staged source, or directly.
    fn after_source_copy(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        len: u64,
        then: Vec<Submission>,
    ) -> Result<()> {
        match Self::behind_d2h(src, src_off, len, then) {
            Ok(gate) => self.hand(vec![gate]),
            Err(then) => self.hand(then),
        }
    }

    /// Staged GPU source into host or GPUDirect memory: the usual shards, posted from the
    /// shadow once the D2H copy is done.
    fn staged_source_write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        let plan = self.contiguous(Some((src, src_off)), dst, dst_off, len, imm, OpKind::Write)?;
        let Some((subs, state)) = self.prepare(plan)? else { return Ok(OpFuture::done()) };
        // One gate per shard: shard k is posted once its own D2H copy is done, while the
        // copy engine moves shard k+1 (the copies run in order on the device's stream).
        let shadow = src.inner.backing().addr();
        let gated = subs
            .into_iter()
            .map(|s| match &s {
                // An imm-only shard (len 0, no local address) has nothing to copy.
                Submission::Op { req, .. } if req.len > 0 => {
                    let (off, len) = (req.local_addr - shadow, req.len as u64);
                    Self::behind_d2h(src, off, len, vec![s]).unwrap_or_else(|mut s| s.remove(0))
                }
                _ => s,
            })
            .collect();
        self.hand(gated)?;
        Ok(OpFuture::pending(state).driven_by(self.engine.driver()))
    }

    /// Into a staged GPU region: the peer pulls (see `pure::control`).
    fn pull_write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        let key0 =
            dst.desc.domains.first().ok_or_else(|| Error::Config("a descriptor without NICs".into()))?;
        let sources = src
            .inner
            .regs
            .iter()
            .map(|r| PullSource { addr: r.remote_base.wrapping_add(src_off), key: r.remote_key })
            .collect();
        let pull = Pull {
            op: 0,
            dst_key: key0.key,
            dst_base: key0.base,
            dst_off,
            len,
            imm,
            sources,
            sender: self.shared().address.to_bytes(),
        };
        let state = Arc::new(OpState::default());
        let s = Submission::Pull {
            peer: dst.peer,
            pull: Box::new(pull),
            keep: src.inner.clone(),
            notify: Notify::Future(state.clone()),
        };
        self.after_source_copy(src, src_off, len, vec![s])?;
        Ok(OpFuture::pending(state).driven_by(self.engine.driver()))
    }

    /// Into a GPU region of a process on this host: the copy engine writes its IPC mapping;
    /// then an imm-only write (if `imm`) so the owner counts it.
    fn ipc_write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        let export = dst.ipc.as_ref().ok_or_else(|| Error::Unsupported("CUDA IPC to this region".into()))?;
        let dst_ordinal = dst.desc.gpu.as_ref().map_or(0, |g| g.ordinal);
        let ordinal = src.inner.gpu.as_ref().map_or(dst_ordinal, |g| g.ordinal) as usize;
        let mapping = self.shared().gpu.ipc_mapping(export, ordinal)?;
        let target = cuda::DeviceMemory::device_ptr(&*mapping) + dst_off;
        let copy = match &src.inner.gpu {
            Some(g) => CudaCopy {
                dir: CopyDir::DeviceToDevice,
                dst: target,
                src: g.ptr + src_off,
                len: len as usize,
            },
            None => CudaCopy {
                dir: CopyDir::HostToDevice,
                dst: target,
                src: src.inner.backing().addr() + src_off,
                len: len as usize,
            },
        };
        let state = Arc::new(OpState::default());
        let done = Notify::Future(state.clone());
        let (then, done) = match imm {
            Some(imm) => {
                let nic = self.opts.nic_of(0, self.shared().nics, self.shared().next_start());
                let req = OpReq {
                    domain: nic,
                    peer: dst.peer,
                    kind: OpKind::Write,
                    local_addr: 0,
                    len: 0,
                    remote: crate::provider::RemoteSlice {
                        addr: dst.desc.domains[nic].base,
                        key: dst.desc.domains[nic].key,
                    },
                    imm: Some(imm),
                };
                (vec![Submission::Op { req, keep: None, notify: done }], None)
            }
            None => (Vec::new(), Some(done)),
        };
        let keep: Keep = vec![src.inner.clone(), mapping];
        let s = Submission::Gated {
            ordinal,
            copies: if len > 0 { vec![copy] } else { Vec::new() },
            then,
            done,
            keep,
            after: None,
        };
        self.hand(vec![s])?;
        Ok(OpFuture::pending(state).driven_by(self.engine.driver()))
    }

    /// Refuses shapes that do not stage yet (paged writes, scatter, reads, the synchronous
    /// path) when either end is staged GPU memory or an IPC destination.
    pub(super) fn refuse_staged(
        &self,
        what: &str,
        local: Option<&MemoryRegion>,
        remote: Option<&RemoteRegion>,
    ) -> Result<()> {
        let local_staged = local.is_some_and(|r| r.inner.staged().is_some());
        let remote_staged =
            remote.is_some_and(|r| matches!(r.gpu_path(), Some(GpuPath::Staged | GpuPath::Ipc)));
        if local_staged || remote_staged {
            return Err(Error::Unsupported(format!(
                "{what} with a staged GPU region or a CUDA IPC destination (use write / write_imm)"
            )));
        }
        Ok(())
    }
}
