//! GPU memory in the engine: regions in CUDA memory (allocated by the engine or owned by the
//! user), the path each takes (GPUDirect, staged, CUDA IPC), the blocking copies of
//! `read_at`/`write_at`, the staging pool, and the writes whose bytes cross bounce slots or
//! an IPC mapping (`ipc.rs`: every shape through CUDA IPC as one gate of copies; `staged.rs`:
//! paged writes, scatters and reads with a staged end). The reactor's half is
//! `reactor/core/gpu/`; the protocol is in `docs/gpu.md`. Imports go one way: this folder
//! uses the rest of the engine (`region.rs`, `transfer.rs`, `op.rs`), which never names it.
//!
//! ```text
//!  source            destination (its descriptor)     what happens
//!  host / GPUDirect  host / GPUDirect                 RDMA write (as for host memory)
//!  staged GPU        host / GPUDirect                 per chunk: slot, D2H (gate), RDMA write
//!  host / GPUDirect  staged GPU                       PULL ─► owner reads into its slots, H2D
//!  staged GPU        staged GPU                       per chunk: slot, D2H, PULL of the slot
//!  any               GPU on this host (IPC)           copy engine into the IPC mapping, imm-only write
//! ```

mod ipc;
pub(super) mod signal;
mod staged;

use std::sync::Arc;

use self::staged::piece_src;
use super::op::OpFuture;
use super::region::{MemoryRegion, RemoteRegion};
use super::transfer::Transfers;
use super::Engine;
use crate::cuda::{self, DeviceBuffer, MemoryKind, PinnedHostBuffer};
use crate::error::{Error, Result};
use crate::provider::MemoryLocation;
use crate::pure::descriptor::GpuRegion;
use crate::pure::staging::GpuPath;
use crate::shared::memory::{Backing, GpuMemory, Keeper, RegionShared};
use crate::shared::queue::{OpKind, Piece, PieceDst, PieceSrc};

impl Engine {
    /// `alloc_in(len, Cuda { ordinal })`: a new zeroed device allocation, registered.
    pub(super) async fn alloc_cuda(&self, len: usize, ordinal: u32) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::Config("cannot register an empty region".into()));
        }
        let ctx = cuda::context(ordinal as usize)?;
        let buf = Arc::new(DeviceBuffer::new(&ctx, len)?);
        self.register_device(buf.device_ptr(), len, ordinal, Some(ctx), DeviceOwner::Engine(buf), None).await
    }

    /// Registers `len` bytes of CUDA device memory at `ptr` on device `ordinal`, owned by
    /// the caller (a `cudaMalloc` range, a PyTorch tensor's `data_ptr()`), with every NIC:
    /// GPUDirect where every NIC can register GPU memory, else staged through the engine's
    /// pool of pinned bounce slots ([`EngineBuilder::staging_pool`]; no host memory of
    /// `len` bytes) ([`MemoryRegion::gpu_path`] says which).
    ///
    /// [`EngineBuilder::staging_pool`]: crate::EngineBuilder::staging_pool
    ///
    /// Errors: [`Error::NotDeviceMemory`] if the range is not device memory of `ordinal`
    /// inside one allocation (checked with `cuda::pointer_info`); [`Error::Unsupported`]
    /// without a CUDA driver.
    ///
    /// [`Engine::register_cuda_owned`] is the same with an owner that the engine keeps for
    /// as long as it needs the memory, which is easier to get right.
    ///
    /// # Safety
    ///
    /// The range must stay allocated until the returned region and every clone of it are
    /// dropped **and** every transfer that uses it has completed (the engine holds the
    /// region until then; the memory itself is the caller's to keep).
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register_copy`].
    pub async unsafe fn register_cuda(&self, ptr: u64, len: usize, ordinal: u32) -> Result<MemoryRegion> {
        self.check_device_range(ptr, len, ordinal)?;
        let ctx = cuda::context(ordinal as usize)?;
        self.register_device(ptr, len, ordinal, Some(ctx), DeviceOwner::Caller(None), None).await
    }

    /// Registers `len` bytes of CUDA device memory at `ptr` on device `ordinal` that
    /// `owner` keeps allocated (a PyTorch tensor or its storage, a CuPy array, a
    /// `cudaMalloc` wrapper), in place, as [`Engine::register_cuda`] does. The engine drops
    /// `owner` only once nothing of it may touch the memory any more: after the returned
    /// region and all its clones are dropped, every operation that uses it has completed
    /// (its last copy-engine copy or NIC access) and every NIC registration of it has been
    /// closed. This is [`Engine::register_host`] for device memory; the Python package
    /// registers CUDA tensors this way.
    ///
    /// `owner` is dropped on whichever thread lets go last (often the reactor's), and
    /// also when registration fails.
    ///
    /// A peer on this host that writes through CUDA IPC maps the whole allocation that
    /// contains the range (`docs/gpu.md`); as with host memory registered in place, the
    /// range is not reserved once the region is freed (`docs/security.md`).
    ///
    /// Errors: as for [`Engine::register_cuda`].
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be device memory of `ordinal` that stays allocated, and is
    /// not moved or freed by other means, for as long as `owner` lives. (The range itself
    /// is checked against the driver's view of the allocation.)
    ///
    /// # Cancel safety
    ///
    /// As for [`Engine::register_copy`]: a registration that completes after the future was
    /// dropped is closed again, and `owner` dropped after that.
    pub async unsafe fn register_cuda_owned(
        &self,
        ptr: u64,
        len: usize,
        ordinal: u32,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<MemoryRegion> {
        let owner: Keeper = Arc::new(owner);
        self.check_device_range(ptr, len, ordinal)?;
        let ctx = cuda::context(ordinal as usize)?;
        self.register_device(ptr, len, ordinal, Some(ctx), DeviceOwner::Caller(Some(owner)), None).await
    }

    /// `register_cuda`'s checks: `ptr..+len` is non-empty device memory of `ordinal`
    /// inside one allocation.
    fn check_device_range(&self, ptr: u64, len: usize, ordinal: u32) -> Result<()> {
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
            Some(a) if a.contains(ptr, len) => Ok(()),
            Some(a) => Err(bad(format!("it runs past its allocation {:#x}+{}", a.base, a.len))),
            None => Err(bad("the driver does not know its allocation".into())),
        }
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

    /// Registers device memory (`ctx` its device's context), or, with `host` (feature
    /// `gpu-emulation`, no context), host memory standing in for it, always staged.
    async fn register_device(
        &self,
        ptr: u64,
        len: usize,
        ordinal: u32,
        ctx: Option<Arc<cuda::Context>>,
        owner: DeviceOwner,
        host: Option<Backing>,
    ) -> Result<MemoryRegion> {
        let location = MemoryLocation::Cuda { ordinal };
        let keep: Option<Keeper> = match &owner {
            DeviceOwner::Engine(b) => Some(b.clone()),
            DeviceOwner::Caller(k) => k.clone(),
        };
        let direct = match &ctx {
            Some(_) => self.register_raw(Backing::device(ptr, len, keep.clone()), location).await,
            None => Err(Error::Unsupported("emulated device memory is always staged".into())),
        };
        let (regs, backing, path) = match direct {
            Ok((regs, backing)) => (regs, backing, GpuPath::GpuDirect),
            Err(Error::Unsupported(why)) | Err(Error::RegisterMemory { message: why, .. }) => {
                tracing::debug!(ordinal, len, %why, "a NIC cannot register GPU memory: staging through the pinned pool");
                self.staging_pool(ctx.as_ref()).await?;
                // A small host anchor gives the region its keys (imm-only writes land there);
                // its bytes travel through the engine's staging pool, never a shadow.
                let anchor = Backing::zeroed(STAGED_ANCHOR, STAGED_ANCHOR)?;
                let (regs, backing) = self.register_raw(anchor, MemoryLocation::Host).await?;
                (regs, backing, GpuPath::Staged)
            }
            Err(e) => return Err(e),
        };
        tracing::debug!(ordinal, len, path = %path, "registered a GPU region");
        crate::sync::lock(&self.shared().gpu.paths).entry(ordinal).or_insert(path);
        let ipc = match (&owner, &ctx) {
            (_, None) => Err(Error::Unsupported("emulated device memory".into())),
            (DeviceOwner::Engine(b), _) => b.ipc_export(0, len),
            (DeviceOwner::Caller(_), _) => cuda::ipc_export(ptr, len),
        }
        .map_err(|e| tracing::debug!(error = %e, "no CUDA IPC export for a GPU region"))
        .ok();
        let key = regs.first().map(|r| r.remote_key);
        let gpu = GpuMemory {
            ordinal,
            ptr,
            len,
            ctx,
            path,
            _owned: keep,
            ipc,
            _host: host,
            blocking: Default::default(),
        };
        let inner = Arc::new(RegionShared::new_gpu(backing, regs, location, self.shared().clone(), gpu));
        if let (GpuPath::Staged, Some(key)) = (path, key) {
            self.shared().gpu.track_staged(key, &inner);
        }
        Ok(MemoryRegion { inner })
    }
}

#[cfg(feature = "gpu-emulation")]
impl Engine {
    /// Not API (feature `gpu-emulation`, for tests on machines without a GPU): a region
    /// whose "device memory" is `len` zeroed bytes of host memory, registered as a staged
    /// GPU region (location `Cuda { ordinal: EMULATED_ORDINAL }`, `GpuPath::Staged`):
    /// every transfer into or out of it takes the staging pool and the pull protocol, with
    /// its copies done by `memcpy` on the reactor thread instead of a CUDA stream.
    #[doc(hidden)]
    pub async fn alloc_emulated_staged(&self, len: usize) -> Result<MemoryRegion> {
        let host = Backing::zeroed(len, 4096)?;
        let ptr = host.addr();
        self.register_device(ptr, len, cuda::EMULATED_ORDINAL, None, DeviceOwner::Caller(None), Some(host))
            .await
    }
}

/// Who keeps a GPU region's device memory allocated.
enum DeviceOwner {
    /// The engine's own allocation (`alloc_in`).
    Engine(Arc<DeviceBuffer>),
    /// The caller: through an owner the engine keeps (`register_cuda_owned`), or by
    /// `register_cuda`'s contract (`None`).
    Caller(Option<Keeper>),
}

/// Host bytes a staged GPU region registers: its keys (and where imm-only writes land).
const STAGED_ANCHOR: usize = 4096;

impl Engine {
    /// Allocates and registers the engine's pool of pinned bounce slots
    /// (`EngineBuilder::staging_pool`), once: the first staged GPU region does it. The
    /// memory is portable pinned memory, so one pool serves every device.
    /// Without a context (emulated device memory) the pool is plain host memory.
    async fn staging_pool(&self, ctx: Option<&Arc<cuda::Context>>) -> Result<()> {
        let g = &self.shared().gpu;
        let mut ready = g.pool_init.lock().await;
        if *ready {
            return Ok(());
        }
        let bytes = g.chunk * u64::from(g.slots);
        let len = usize::try_from(bytes)
            .map_err(|_| Error::Config(format!("a staging pool of {bytes} bytes does not fit in memory")))?;
        let backing = match ctx {
            Some(ctx) => Backing::pinned(PinnedHostBuffer::new(ctx, len)?),
            None => Backing::zeroed(len, 4096)?,
        };
        let (regs, backing) = self.register_raw(backing, MemoryLocation::Host).await?;
        let region = RegionShared::new(backing, regs, MemoryLocation::Host, self.shared().clone());
        *crate::sync::lock(&g.pool) = Some(Arc::new(region));
        *ready = true;
        tracing::debug!(slots = g.slots, chunk = g.chunk, "allocated the staging pool");
        Ok(())
    }
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

impl Transfers<'_> {
    /// A write whose bytes cross bounce slots or an IPC mapping, or `None` when it is a
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
                Some(GpuPath::Ipc) => self.ipc_write(src, &[(dst, vec![(src_off, dst_off, len)])], imm),
                Some(GpuPath::Staged) => self.pull_write(src, src_off, dst, dst_off, len, imm),
                _ => self.staged_source_write(src, src_off, dst, dst_off, len, imm),
            }
        })();
        Some(r.unwrap_or_else(OpFuture::failed))
    }

    /// Staged GPU source into host or GPUDirect memory: the usual shards (and arrivals),
    /// each moved through bounce slots chunk by chunk by the reactor.
    fn staged_source_write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        // Without a local region the shards' local addresses are offsets in the transfer.
        let plan = self.contiguous(None, dst, dst_off, len, imm, OpKind::Write)?;
        let dev = src.inner.staged().map_or(0, |g| g.ptr) + src_off;
        self.staged_writes(src, plan, |off| PieceSrc::Device(dev + off))
    }

    /// Into a staged GPU region: the owner pulls (see `pure::control`), chunk by chunk.
    fn pull_write(
        &self,
        src: &MemoryRegion,
        src_off: u64,
        dst: &RemoteRegion,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<OpFuture> {
        let pull = self.pull_template(dst, dst_off, len, imm)?;
        let piece = Piece { src: piece_src(src, src_off), len, dst: PieceDst::Pull { peer: dst.peer, pull } };
        self.run_job(src, vec![piece], Vec::new())
    }

    /// Refuses the synchronous path (`post_write_imm`) with bytes when either end is staged
    /// GPU memory or an IPC destination: it posts one operation, with no copy.
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
                "{what} with a staged GPU region or a CUDA IPC destination: the synchronous path posts one NIC operation and cannot copy (use write_imm)"
            )));
        }
        Ok(())
    }
}
