//! Memory a region owns ([`Backing`]) and the state all clones of one region share
//! ([`RegionShared`]): its registrations, and the engine to hand both back to when the last
//! user (a `MemoryRegion` clone or an in-flight operation) lets go.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::Error;
use crate::provider::{MemoryLocation, Registration};

use super::Shared;

/// Memory that a region owns. It is freed only after every NIC registration of it has been
/// closed (by the reactor, see `Shared::retire`), never while a NIC may touch it.
pub(crate) struct Backing {
    ptr: NonNull<u8>,
    len: usize,
    kind: BackingKind,
}

enum BackingKind {
    Aligned(Layout),
    Vec(usize /* capacity */),
}

// SAFETY: `Backing` uniquely owns its allocation (like a `Box<[u8]>`); moving it between
// threads is sound.
unsafe impl Send for Backing {}
// SAFETY: shared access only hands out the pointer; all reads and writes through it go
// through raw-pointer copies documented on `MemoryRegion`.
unsafe impl Sync for Backing {}

impl Backing {
    /// Zeroed memory of `len` bytes aligned to `align` (a power of two).
    pub(crate) fn zeroed(len: usize, align: usize) -> Result<Backing, Error> {
        if len == 0 {
            return Err(Error::Config("cannot register an empty region".into()));
        }
        let layout = Layout::from_size_align(len, align)
            .map_err(|e| Error::Config(format!("bad region layout ({len} bytes, align {align}): {e}")))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(Error::RegisterMemory {
            len,
            location: "host".into(),
            message: "out of memory".into(),
        })?;
        Ok(Backing { ptr, len, kind: BackingKind::Aligned(layout) })
    }

    pub(crate) fn from_vec(v: Vec<u8>) -> Result<Backing, Error> {
        if v.is_empty() {
            return Err(Error::Config("cannot register an empty region".into()));
        }
        let mut v = std::mem::ManuallyDrop::new(v);
        let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
        // A Vec's pointer is never null.
        let ptr = NonNull::new(ptr).expect("Vec pointer is non-null");
        Ok(Backing { ptr, len, kind: BackingKind::Vec(cap) })
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
            // SAFETY: allocated in `zeroed` with exactly this layout, freed once.
            BackingKind::Aligned(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: these are the parts of a Vec taken apart in `from_vec`; rebuilt once.
            BackingKind::Vec(cap) => unsafe {
                drop(Vec::from_raw_parts(self.ptr.as_ptr(), self.len, cap));
            },
        }
    }
}

pub(crate) struct RegionShared {
    /// `Some` until `Drop` hands it to the reactor together with the registrations.
    backing: Option<Backing>,
    pub(crate) regs: Vec<Registration>,
    pub(crate) location: MemoryLocation,
    shared: Arc<Shared>,
}

impl RegionShared {
    pub(crate) fn new(
        backing: Backing,
        regs: Vec<Registration>,
        location: MemoryLocation,
        shared: Arc<Shared>,
    ) -> Self {
        RegionShared { backing: Some(backing), regs, location, shared }
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
        if let Some(b) = self.backing.take() {
            self.shared.retire(std::mem::take(&mut self.regs), b);
        }
    }
}
