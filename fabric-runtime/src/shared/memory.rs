//! Memory a region owns ([`Backing`]) and the state all clones of one region share
//! ([`RegionShared`]): its registrations, and the engine to hand both back to when the last
//! user (a `MemoryRegion` clone or an in-flight operation) lets go.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::Error;
use crate::provider::{MemoryLocation, Registration};

use super::Shared;

/// Whatever keeps memory the engine did not allocate itself allocated (an engine
/// `DeviceBuffer`, a caller's owner object): dropped once nothing may touch the memory.
#[cfg(feature = "cuda")]
pub(crate) type Keeper = Arc<dyn std::any::Any + Send + Sync>;

/// Memory that a region owns. It is freed only after every NIC registration of it has been
/// closed (by the reactor, see `Shared::retire`), never while a NIC may touch it.
///
/// Host memory is its own anonymous mapping (`mmap`, so an absurd size is an error, never an
/// abort). When it is freed its virtual range stays reserved for the life of the process
/// (`sys::retire_mapping`): a stale descriptor names an address that nothing will ever
/// occupy again, which is what keeps its writes out of new regions on providers that
/// address remote memory by virtual address and do not check keys (shm's CMA path). See
/// `docs/security.md`.
pub(crate) struct Backing {
    ptr: NonNull<u8>,
    len: usize,
    kind: BackingKind,
}

enum BackingKind {
    /// `sys::map_zeroed` memory; the length of the mapping (`len` rounded up to pages).
    Mapped(usize),
    /// Pinned host memory: the staging pool's bounce slots (what the NICs see of staged
    /// GPU transfers).
    #[cfg(feature = "cuda")]
    Pinned(#[allow(dead_code)] crate::cuda::PinnedHostBuffer),
    /// GPU memory registered with the NIC itself (GPUDirect): `ptr` is a device address.
    /// `Some`: what keeps it allocated (the engine's allocation of `alloc_in`, or the
    /// caller's owner of `register_cuda_owned`), dropped after the registration is closed;
    /// `None`: the caller keeps it (`register_cuda`).
    #[cfg(feature = "cuda")]
    Device(#[allow(dead_code)] Option<Keeper>),
    /// Host memory the user owns (`Engine::register_host`): the owner keeps it allocated and
    /// is dropped with the backing, after every registration of it has been closed. Its
    /// range is not retired (it is not ours): see `docs/security.md`.
    External(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>),
}

// SAFETY: `Backing` uniquely owns its allocation (like a `Box<[u8]>`), or holds its `Send`
// owner (`External`); moving it between threads is sound.
unsafe impl Send for Backing {}
// SAFETY: shared access only hands out the pointer; all reads and writes through it go
// through raw-pointer copies documented on `MemoryRegion`.
unsafe impl Sync for Backing {}

impl Backing {
    /// Zeroed memory of `len` bytes aligned to `align` (a power of two, at most the page
    /// size). `len == 0`, a size that overflows when rounded up to pages, one larger than the
    /// machine's physical memory (it could never be backed, and NICs that pin would fail
    /// late), or one the kernel refuses (`ENOMEM`) is an error, never an abort.
    pub(crate) fn zeroed(len: usize, align: usize) -> Result<Backing, Error> {
        Backing::mapped(len, align, false)
    }

    /// Zeroed, page-aligned host memory of `len` bytes for a user's region: with `huge`
    /// (`EngineBuilder::huge_pages`, on by default), from 2 MiB up it is aligned to huge
    /// pages and advised to use them (`sys::map_zeroed`).
    pub(crate) fn host(len: usize, huge: bool) -> Result<Backing, Error> {
        Backing::mapped(len, crate::sys::page_size(), huge)
    }

    fn mapped(len: usize, align: usize, huge: bool) -> Result<Backing, Error> {
        if len == 0 {
            return Err(Error::Config("cannot register an empty region".into()));
        }
        let page = crate::sys::page_size();
        if !align.is_power_of_two() || align > page {
            return Err(Error::Config(format!("bad region alignment {align} (a power of two up to {page})")));
        }
        let oom = |message: String| Error::RegisterMemory { len, location: "host".into(), message };
        // At most isize::MAX bytes, like any Rust allocation (slices of it must be valid).
        let map_len = len
            .checked_next_multiple_of(page)
            .filter(|&m| m <= isize::MAX as usize)
            .ok_or_else(|| oom("size overflows the address space".into()))?;
        if let Some(phys) = crate::sys::physical_memory().filter(|&p| map_len as u64 > p) {
            return Err(oom(format!("larger than the machine's {phys} bytes of memory")));
        }
        let ptr = crate::sys::map_zeroed(map_len, huge).map_err(|e| oom(format!("out of memory: {e}")))?;
        Ok(Backing { ptr, len, kind: BackingKind::Mapped(map_len) })
    }

    /// The bytes of `v` in memory of their own (copied, so that the range can be reserved
    /// when the region goes, which a `Vec`'s heap memory cannot be).
    pub(crate) fn from_vec(v: Vec<u8>, huge: bool) -> Result<Backing, Error> {
        let b = Backing::host(v.len(), huge)?;
        // SAFETY: `b` is a fresh mapping of at least `v.len()` bytes, disjoint from `v`.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), b.as_ptr(), v.len()) };
        Ok(b)
    }

    /// The caller's host memory at `ptr`, kept allocated by `owner` (`Engine::register_host`).
    /// `len == 0` or a null `ptr` is [`Error::Config`].
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be valid, writable host memory for as long as `owner` lives.
    pub(crate) unsafe fn external(
        ptr: u64,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Backing, Error> {
        if len == 0 {
            return Err(Error::Config("cannot register an empty region".into()));
        }
        if ptr.checked_add(len as u64).is_none_or(|end| end > isize::MAX as u64) {
            return Err(Error::Config(format!("{ptr:#x}+{len} overflows the address space")));
        }
        let ptr = NonNull::new(ptr as *mut u8).ok_or_else(|| Error::Config("a null pointer".into()))?;
        Ok(Backing { ptr, len, kind: BackingKind::External(owner) })
    }

    /// Pinned host memory the NICs read and write (the staging pool).
    #[cfg(feature = "cuda")]
    pub(crate) fn pinned(buf: crate::cuda::PinnedHostBuffer) -> Backing {
        let ptr = NonNull::new(buf.as_ptr()).expect("PinnedHostBuffer pointer is non-null");
        Backing { ptr, len: buf.len(), kind: BackingKind::Pinned(buf) }
    }

    /// GPU memory handed to the NIC directly (GPUDirect). `ptr` is a device address, never
    /// dereferenced on the host.
    #[cfg(feature = "cuda")]
    pub(crate) fn device(ptr: u64, len: usize, owned: Option<Keeper>) -> Backing {
        let ptr = NonNull::new(ptr as *mut u8).unwrap_or(NonNull::dangling());
        Backing { ptr, len, kind: BackingKind::Device(owned) }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        match self.kind {
            // SAFETY: exactly the mapping made in `zeroed`, retired once, never used again.
            BackingKind::Mapped(map_len) => unsafe { crate::sys::retire_mapping(self.ptr.as_ptr(), map_len) },
            // The buffers free themselves when the kind is dropped, after this.
            #[cfg(feature = "cuda")]
            BackingKind::Pinned(_) | BackingKind::Device(_) => {}
            // The owner is dropped after this, when the kind is.
            BackingKind::External(_) => {}
        }
    }
}

/// The GPU side of a region in CUDA memory.
#[cfg(feature = "cuda")]
pub(crate) struct GpuMemory {
    pub(crate) ordinal: u32,
    /// Device address of byte 0.
    pub(crate) ptr: u64,
    /// Length in bytes (a staged region's backing is only its small host anchor).
    pub(crate) len: usize,
    /// The device's primary context (`None`: emulated device memory, `_host`).
    pub(crate) ctx: Option<Arc<crate::cuda::Context>>,
    pub(crate) path: crate::pure::staging::GpuPath,
    /// What keeps the memory allocated: `alloc_in`'s allocation, or the caller's owner of
    /// `register_cuda_owned` (`None`: `register_cuda`, the caller keeps it). Dropped with
    /// the region state, which every operation using the region holds until its last copy
    /// or NIC access; a GPUDirect backing holds a second reference until its registrations
    /// are closed, so the owner goes with whichever of the two is last.
    pub(crate) _owned: Option<Keeper>,
    /// CUDA IPC export of the range, for peers on this host (`None` if the driver refused).
    pub(crate) ipc: Option<crate::cuda::IpcExport>,
    /// Tests without a GPU (feature `gpu-emulation`): the host memory standing in for the
    /// device memory at `ptr`.
    pub(crate) _host: Option<Backing>,
    /// The stream of the blocking copies (`read_at`, `write_at`), created at the first: one
    /// per call cost more than a small copy itself.
    pub(crate) blocking: std::sync::OnceLock<crate::cuda::Stream>,
}

#[cfg(feature = "cuda")]
impl GpuMemory {
    /// A blocking copy between `len` bytes of the device memory at `device_off` and the host
    /// buffer at `host` (`to_device`: host to device), for `read_at` / `write_at` / `to_vec`
    /// of a GPU region (setup calls, not a data path: it waits for the copy engine).
    ///
    /// # Safety
    ///
    /// `device_off..+len` lies inside the region (the caller bounds-checked it), and `host`
    /// is valid for `len` bytes (of reads, or of writes when copying to the host) until the
    /// call returns.
    pub(crate) unsafe fn copy_blocking(
        &self,
        to_device: bool,
        device_off: u64,
        host: *mut u8,
        len: usize,
    ) -> Result<(), Error> {
        use crate::cuda;
        if len == 0 {
            return Ok(());
        }
        let dev = self.ptr + device_off;
        let Some(ctx) = &self.ctx else {
            let (dst, src) = if to_device { (dev, host as u64) } else { (host as u64, dev) };
            // SAFETY: emulated device memory is host memory of the region's length; both
            // ranges are valid for `len` bytes (this function's contract).
            unsafe { cuda::emulated_copy(dst, src, len) };
            return Ok(());
        };
        let stream = match self.blocking.get() {
            Some(s) => s,
            None => {
                let s = cuda::Stream::new(ctx)?;
                self.blocking.get_or_init(|| s)
            }
        };
        // SAFETY: both ranges are valid for `len` bytes (this function's contract); the
        // stream is synchronized before the call returns, so neither is used after it.
        unsafe {
            if to_device {
                stream.copy_h2d_raw(dev, host, len)?;
            } else {
                stream.copy_d2h_raw(host, dev, len)?;
            }
        }
        stream.synchronize()
    }
}

pub(crate) struct RegionShared {
    /// `Some` until `Drop` hands it to the reactor together with the registrations.
    backing: Option<Backing>,
    pub(crate) regs: Vec<Registration>,
    pub(crate) location: MemoryLocation,
    /// GPU regions: the device memory (the backing is then the device memory itself with
    /// GPUDirect, or, staged, a 4 KiB host anchor whose registrations give the region its
    /// keys: imm-only writes land there, bytes go through the engine's staging pool).
    #[cfg(feature = "cuda")]
    pub(crate) gpu: Option<GpuMemory>,
    shared: Arc<Shared>,
}

impl RegionShared {
    pub(crate) fn new(
        backing: Backing,
        regs: Vec<Registration>,
        location: MemoryLocation,
        shared: Arc<Shared>,
    ) -> Self {
        RegionShared {
            backing: Some(backing),
            regs,
            location,
            #[cfg(feature = "cuda")]
            gpu: None,
            shared,
        }
    }

    /// A region of GPU memory (see [`GpuMemory`]).
    #[cfg(feature = "cuda")]
    pub(crate) fn new_gpu(
        backing: Backing,
        regs: Vec<Registration>,
        location: MemoryLocation,
        shared: Arc<Shared>,
        gpu: GpuMemory,
    ) -> Self {
        RegionShared { backing: Some(backing), regs, location, gpu: Some(gpu), shared }
    }

    /// Whether the region is GPU memory that the NICs reach through the staging pool.
    #[cfg(feature = "cuda")]
    pub(crate) fn staged(&self) -> Option<&GpuMemory> {
        self.gpu.as_ref().filter(|g| g.path == crate::pure::staging::GpuPath::Staged)
    }

    /// Length in bytes of the region's memory (host, or GPU).
    pub(crate) fn len(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.len;
        }
        self.backing().len()
    }

    pub(crate) fn engine(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub(crate) fn backing(&self) -> &Backing {
        // Only `Drop` takes it.
        self.backing.as_ref().expect("region backing present until drop")
    }
}

impl Drop for RegionShared {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if self.staged().is_some() {
            if let Some(r) = self.regs.first() {
                self.shared.gpu.forget_staged(r.remote_key, self);
            }
        }
        if let Some(b) = self.backing.take() {
            self.shared.retire(std::mem::take(&mut self.regs), b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_sizes_and_alignments_are_errors() {
        assert!(matches!(Backing::zeroed(0, 4096), Err(Error::Config(_))));
        assert!(matches!(Backing::zeroed(4096, 3), Err(Error::Config(_))));
        assert!(matches!(Backing::zeroed(4096, 1 << 20), Err(Error::Config(_))));
        for len in [usize::MAX, usize::MAX - 4095, isize::MAX as usize + 1, 1 << 40] {
            let r = Backing::zeroed(len, 4096);
            assert!(matches!(r, Err(Error::RegisterMemory { len: l, .. }) if l == len), "{len}");
        }
        assert!(matches!(Backing::from_vec(Vec::new(), true), Err(Error::Config(_))));
    }

    #[test]
    fn host_memory_from_two_mib_up_is_aligned_to_huge_pages_and_usable_to_its_last_byte() {
        let huge = crate::sys::HUGE_PAGE;
        for (len, on, align) in [
            (2 * huge + 4096, true, huge),
            (huge, true, huge),
            (huge - 4096, true, 4096),
            (2 * huge, false, 4096),
        ] {
            let b = Backing::host(len, on).unwrap();
            assert_eq!(b.addr() % align as u64, 0, "{len} huge={on}");
            assert_eq!(b.len(), len);
            // SAFETY: the backing owns `len` writable bytes; nothing else uses them.
            let bytes = unsafe { std::slice::from_raw_parts_mut(b.as_ptr(), len) };
            assert!(bytes.iter().all(|&x| x == 0), "{len}: zeroed");
            bytes[len - 1] = 7;
            bytes[0] = 9;
            assert_eq!((bytes[0], bytes[len - 1]), (9, 7));
        }
    }

    #[test]
    fn mapped_memory_is_zeroed_aligned_and_vectors_are_copied() {
        let b = Backing::zeroed(5000, 4096).unwrap();
        assert_eq!(b.addr() % 4096, 0);
        assert_eq!(b.len(), 5000);
        // SAFETY: the backing owns 5000 readable bytes; nothing else uses them.
        assert!(unsafe { std::slice::from_raw_parts(b.as_ptr(), 5000) }.iter().all(|&x| x == 0));
        let v: Vec<u8> = (0..=255).collect();
        let b = Backing::from_vec(v.clone(), false).unwrap();
        // SAFETY: as above, 256 bytes.
        assert_eq!(unsafe { std::slice::from_raw_parts(b.as_ptr(), 256) }, &v[..]);
    }

    #[test]
    fn external_memory_keeps_its_owner_until_the_backing_goes() {
        assert!(matches!(
            // SAFETY: refused before anything reads it.
            unsafe { Backing::external(0x1000, 0, Box::new(())) },
            Err(Error::Config(_))
        ));
        // SAFETY: refused before anything reads it.
        assert!(matches!(unsafe { Backing::external(0, 8, Box::new(())) }, Err(Error::Config(_))));
        // SAFETY: refused before anything reads it.
        assert!(matches!(unsafe { Backing::external(u64::MAX - 4, 8, Box::new(())) }, Err(Error::Config(_))));
        let owner = Arc::new(vec![7u8; 64]);
        let ptr = owner.as_ptr() as u64;
        // SAFETY: the vector lives as long as its `Arc`, which the backing holds.
        let b = unsafe { Backing::external(ptr, 64, Box::new(owner.clone())) }.unwrap();
        assert_eq!((b.addr(), b.len(), Arc::strong_count(&owner)), (ptr, 64, 2));
        drop(b);
        assert_eq!(Arc::strong_count(&owner), 1);
    }
}
