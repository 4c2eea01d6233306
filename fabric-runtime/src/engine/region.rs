//! Registered memory as users see it: local regions the engine owns, and remote regions
//! named by descriptors.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::error::{Error, Side};
use crate::provider::MemoryLocation;
use crate::pure::descriptor::{DomainKey, RegionDescriptor};
use crate::shared::memory::RegionShared;
use crate::shared::PeerId;

/// A range of memory (host, or a CUDA device's: see [`MemoryRegion::location`]) registered
/// with every NIC of an engine.
///
/// Cheap to clone (all clones share one registration). The memory is deregistered and freed
/// when the last clone is dropped **and** no operation that uses it is in flight: every
/// posted operation holds a reference until its completion. On shm it is deregistered (and
/// freed) only once the peers have acknowledged its revocation, at most 1 s later, so that a
/// peer's write racing the free lands instead of being lost (`docs/faults.md`, "Draining").
///
/// Reading and writing the bytes: remote peers write into this memory at any time, so this
/// type never hands out `&[u8]`/`&mut [u8]` safely; use [`MemoryRegion::read_at`],
/// [`MemoryRegion::write_at`] and [`MemoryRegion::to_vec`] (copies), or the unsafe
/// [`MemoryRegion::as_slice`] when you know no transfer targets the range.
#[derive(Clone)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<RegionShared>,
}

impl MemoryRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Always false: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start address of the memory: a host address for host memory, the device address for
    /// GPU memory (see also `MemoryRegion::device_ptr`). Never dereference it on the host
    /// for a GPU region.
    pub fn as_ptr(&self) -> *const u8 {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.inner.gpu {
            return g.ptr as *const u8;
        }
        self.inner.backing().as_ptr()
    }

    /// Where the memory lives.
    pub fn location(&self) -> MemoryLocation {
        self.inner.location
    }

    pub(crate) fn check(&self, offset: u64, len: u64) -> Result<(), Error> {
        check_range(Side::Local, offset, len, self.len() as u64)
    }

    /// Copies `buf.len()` bytes from the region at `offset` into `buf`. For a GPU region
    /// this is a blocking CUDA copy from device memory (a setup or verification call, not a
    /// data path: it waits for the copy engine).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.check(offset, buf.len() as u64)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.inner.gpu {
            // SAFETY: the range was checked above; `buf` is ours for the call.
            return unsafe { g.copy_blocking(false, offset, buf.as_mut_ptr(), buf.len()) };
        }
        // SAFETY: the range is inside the allocation (checked); the copy goes through raw
        // pointers so no reference to NIC-written memory is created.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset as usize), buf.as_mut_ptr(), buf.len())
        };
        Ok(())
    }

    /// Copies `data` into the region at `offset`. For a GPU region this is a blocking CUDA
    /// copy into device memory (as [`MemoryRegion::read_at`]).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.check(offset, data.len() as u64)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.inner.gpu {
            // SAFETY: the range was checked above; `data` is only read, for the call.
            return unsafe { g.copy_blocking(true, offset, data.as_ptr().cast_mut(), data.len()) };
        }
        // SAFETY: as in `read_at`; the region owns its memory, so writing through the
        // pointer is writing to memory we own.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.as_ptr().cast_mut().add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Copies the whole region into a new vector (for a GPU region, a blocking CUDA copy).
    ///
    /// # Panics
    ///
    /// If the CUDA copy of a GPU region fails (use [`MemoryRegion::read_at`] to get the
    /// error instead); never for host memory.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        if let Err(e) = self.read_at(0, &mut v) {
            panic!("MemoryRegion::to_vec: {e}");
        }
        v
    }

    /// The region's bytes as a slice, without copying.
    ///
    /// # Safety
    ///
    /// The region must be host memory ([`MemoryLocation::Host`]), and no transfer (local
    /// operation or remote write) may modify it while the slice is alive.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the pointer and length describe our allocation; the caller promises no
        // concurrent writes.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// The descriptor a peer needs to write into (or read from) this region: the transport,
    /// the length, and one (NIC address, base, key) entry per NIC. Turn it into bytes with
    /// [`RegionDescriptor::to_bytes`].
    ///
    /// Whoever holds the descriptor can read and write the whole region until it is freed;
    /// after that, writes through it fail at the writer and never reach memory allocated
    /// later (`docs/security.md` says what each provider enforces).
    pub fn descriptor(&self) -> RegionDescriptor {
        let shared = self.inner.engine();
        RegionDescriptor {
            transport: shared.transport.clone(),
            len: self.len() as u64,
            domains: self
                .inner
                .regs
                .iter()
                .zip(&shared.address.domains)
                .map(|(r, a)| DomainKey { address: a.clone(), base: r.remote_base, key: r.remote_key })
                .collect(),
            #[cfg(feature = "cuda")]
            gpu: self.gpu_descriptor(),
            #[cfg(not(feature = "cuda"))]
            gpu: None,
            incarnation: shared.address.incarnation,
        }
    }
}

impl MemoryRegion {
    /// A handle that does not keep the registration alive: a cache of registrations (which
    /// memory is registered already, for views of it) holds these, so that dropping the
    /// last `MemoryRegion` still deregisters the memory.
    pub fn downgrade(&self) -> WeakMemoryRegion {
        WeakMemoryRegion { inner: Arc::downgrade(&self.inner) }
    }
}

/// A [`MemoryRegion`] that may be gone: [`WeakMemoryRegion::upgrade`] gives it back while
/// some clone of it lives.
#[derive(Clone, Debug)]
pub struct WeakMemoryRegion {
    inner: Weak<RegionShared>,
}

impl WeakMemoryRegion {
    /// The region, if a clone of it (or an operation using it) still holds it.
    pub fn upgrade(&self) -> Option<MemoryRegion> {
        self.inner.upgrade().map(|inner| MemoryRegion { inner })
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.as_ptr())
            .field("len", &self.len())
            .field("location", &self.inner.location)
            .finish()
    }
}

pub(crate) fn check_range(side: Side, offset: u64, len: u64, region_len: u64) -> Result<(), Error> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds { side, offset, len, region_len }),
    }
}

/// A peer's registered region, made from its descriptor by `Engine::remote_region`.
#[derive(Clone, Debug)]
pub struct RemoteRegion {
    pub(crate) peer: PeerId,
    /// Identity of the engine that resolved `peer` (peer ids mean nothing elsewhere).
    pub(crate) engine: usize,
    pub(crate) desc: Arc<RegionDescriptor>,
    /// Set when the owner revokes the region (it freed it): shared by every `RemoteRegion`
    /// of this descriptor in this engine (`shared/revoked.rs`).
    pub(crate) revoked: Arc<AtomicBool>,
    /// A GPU region of an engine on this host whose CUDA IPC export this engine can open.
    #[cfg(feature = "cuda")]
    pub(crate) ipc: Option<crate::cuda::IpcExport>,
}

impl RemoteRegion {
    /// Whether writes into this region are pulled by its owner: its NICs reach it through
    /// the staging pool (`docs/gpu.md`).
    #[cfg(feature = "cuda")]
    pub(crate) fn pulled(&self) -> bool {
        self.desc.gpu.as_ref().is_some_and(|g| g.staged)
    }

    /// The peer that owns the region.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.desc.len
    }

    /// Whether the region is empty (never, for descriptors made by this crate).
    pub fn is_empty(&self) -> bool {
        self.desc.len == 0
    }

    /// The descriptor it was made from.
    pub fn descriptor(&self) -> &RegionDescriptor {
        &self.desc
    }

    /// Whether the owner has told this engine that it freed the region: every operation
    /// through it then fails with [`Error::Stale`] before anything is posted. A region freed
    /// a moment ago may not be revoked here yet (the owner's message is on its way); an
    /// operation racing the revocation lands in the freed region on shm (its owner keeps it
    /// until this engine acknowledges the revocation) and fails at the target elsewhere
    /// ([`Error::RemoteAccess`] or [`Error::ConnectionLost`], `docs/faults.md`).
    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    pub(crate) fn check(&self, offset: u64, len: u64) -> Result<(), Error> {
        if self.is_revoked() {
            return Err(revoked_error(self.peer));
        }
        check_range(Side::Remote, offset, len, self.desc.len)
    }
}

/// The error of an operation through a revoked region's descriptor.
pub(crate) fn revoked_error(peer: PeerId) -> Error {
    Error::Stale {
        what: "region descriptor",
        reason: format!("peer {peer} freed the region (it revoked the descriptor)"),
    }
}
