//! The owning wrappers: one Rust value per verbs object, destroyed by its `Drop`, holding an
//! `Arc` of each parent that must outlive it (see "Objects and teardown" in the module docs),
//! plus the backend's own receive memory (page-aligned buffers cut into registered slots).

use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as sys;

use super::error::{check, check_ptr, os_error};
use crate::error::Error;

macro_rules! owned {
    ($(#[$m:meta])* $name:ident, $t:ty, $destroy:path, $call:literal { $($field:ident: $ft:ty),* }) => {
        $(#[$m])*
        pub(super) struct $name {
            pub(super) ptr: NonNull<$t>,
            $(pub(super) $field: $ft,)*
        }

        impl $name {
            pub(super) fn as_ptr(&self) -> *mut $t {
                self.ptr.as_ptr()
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: the object is live, owned only by self and destroyed exactly once,
                // here; every object created from it holds an Arc of self and is gone.
                let ret = unsafe { $destroy(self.ptr.as_ptr()) };
                if let Err(e) = check($call, ret) {
                    tracing::warn!(error = %e, "destroying a verbs object failed");
                }
            }
        }

        // SAFETY: libibverbs objects may be used from any thread (the library locks
        // internally where needed); the wrapper only hands out the raw pointer.
        unsafe impl Send for $name {}
        // SAFETY: as above; shared access only reads the pointer.
        unsafe impl Sync for $name {}
    };
}

owned!(
    /// An open device (`ibv_open_device`).
    Context, sys::ibv_context, sys::ibv_close_device, "ibv_close_device" {}
);
owned!(
    /// A protection domain. Keeps the device open.
    Pd, sys::ibv_pd, sys::ibv_dealloc_pd, "ibv_dealloc_pd" { _ctx: Arc<Context> }
);
owned!(
    /// A completion channel: its fd is the domain's wait fd.
    Channel, sys::ibv_comp_channel, sys::ibv_destroy_comp_channel, "ibv_destroy_comp_channel" {
        _ctx: Arc<Context>
    }
);
owned!(
    /// A shared receive queue: the imm SRQ of every data QP, or the message SRQ of every
    /// message QP.
    Srq, sys::ibv_srq, sys::ibv_destroy_srq, "ibv_destroy_srq" { _pd: Arc<Pd> }
);
owned!(
    /// A queue pair. Keeps its CQ, SRQ and PD alive (they must outlive it).
    Qp, sys::ibv_qp, sys::ibv_destroy_qp, "ibv_destroy_qp" {
        _cq: Arc<Cq>, _srq: Option<Arc<Srq>>, _pd: Arc<Pd>
    }
);
owned!(
    /// An address handle (UD destination).
    Ah, sys::ibv_ah, sys::ibv_destroy_ah, "ibv_destroy_ah" { _pd: Arc<Pd> }
);
owned!(
    /// A memory registration. Keeps the PD alive.
    Mr, sys::ibv_mr, sys::ibv_dereg_mr, "ibv_dereg_mr" { _pd: Arc<Pd> }
);

/// The completion queue. Not made with `owned!`: before destroying it, completion events
/// still queued on the channel must be read and acknowledged, or `ibv_destroy_cq` waits for
/// them forever.
pub(super) struct Cq {
    pub(super) ptr: NonNull<sys::ibv_cq>,
    pub(super) channel: Arc<Channel>,
}

impl Cq {
    pub(super) fn as_ptr(&self) -> *mut sys::ibv_cq {
        self.ptr.as_ptr()
    }

    /// Reads and acknowledges every event queued on the (non-blocking) channel.
    pub(super) fn ack_events(&self) {
        let mut n = 0u32;
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: the channel is live and its fd non-blocking, so this returns -1 at
            // once when no event is queued; cq/ctx are valid out-pointers.
            let ret = unsafe { sys::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) };
            if ret != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: exactly n events of this CQ (the only CQ on the channel) were read.
            unsafe { sys::ibv_ack_cq_events(self.as_ptr(), n) };
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.ack_events();
        // SAFETY: every QP using the CQ holds an Arc of it and is gone; all events are acked.
        let ret = unsafe { sys::ibv_destroy_cq(self.ptr.as_ptr()) };
        if let Err(e) = check("ibv_destroy_cq", ret) {
            tracing::warn!(error = %e, "destroying the CQ failed");
        }
    }
}

// SAFETY: see `owned!`.
unsafe impl Send for Cq {}
// SAFETY: see `owned!`.
unsafe impl Sync for Cq {}

/// Page-aligned, zeroed heap memory owned by the backend (the receive slots).
struct Buffer {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

impl Buffer {
    fn zeroed(len: usize) -> Result<Buffer, Error> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| Error::Config(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| os_error("alloc", libc::ENOMEM))?;
        Ok(Buffer { ptr, layout })
    }

    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: plain owned heap memory.
unsafe impl Send for Buffer {}

/// Registered backend memory cut into equal slots. The MR is deregistered before the buffer
/// is freed (field order).
pub(super) struct SlotPool {
    mr: Mr,
    buf: Buffer,
    pub(super) slot_size: usize,
    pub(super) count: usize,
}

impl SlotPool {
    pub(super) fn new(pd: &Arc<Pd>, slot_size: usize, count: usize) -> Result<SlotPool, Error> {
        let buf = Buffer::zeroed(slot_size * count)?;
        let access = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        // SAFETY: `buf` is owned by the pool and declared after `mr`, so it is freed only
        // after the MR is deregistered.
        let mr = unsafe { reg_mr(pd, buf.addr(), slot_size * count, access)? };
        Ok(SlotPool { mr, buf, slot_size, count })
    }

    pub(super) fn sge(&self, slot: usize, len: usize) -> sys::ibv_sge {
        debug_assert!(slot < self.count && len <= self.slot_size);
        // SAFETY: the MR is live.
        let lkey = unsafe { (*self.mr.as_ptr()).lkey };
        sys::ibv_sge { addr: self.buf.addr() + (slot * self.slot_size) as u64, length: len as u32, lkey }
    }

    /// The bytes of `slot`.
    ///
    /// # Safety
    ///
    /// No receive may be posted on the slot (the HCA must not write it meanwhile).
    pub(super) unsafe fn bytes(&self, slot: usize, len: usize) -> &[u8] {
        let len = len.min(self.slot_size);
        // SAFETY: inside the buffer; the caller guarantees nobody writes it meanwhile.
        unsafe {
            std::slice::from_raw_parts((self.buf.addr() + (slot * self.slot_size) as u64) as *const u8, len)
        }
    }
}

/// Registers `addr..addr+len` with `pd`.
///
/// # Safety
///
/// `addr..addr+len` must be valid memory that stays allocated while the returned [`Mr`]
/// exists (the HCA may read and write it until the MR is deregistered).
pub(super) unsafe fn reg_mr(pd: &Arc<Pd>, addr: u64, len: usize, access: u32) -> Result<Mr, Error> {
    // SAFETY: pd is live; the caller guarantees addr..addr+len is valid memory that stays
    // allocated while the MR exists.
    let p = unsafe { sys::ibv_reg_mr_iova2(pd.as_ptr(), addr as *mut c_void, len, addr, access) };
    Ok(Mr { ptr: check_ptr("ibv_reg_mr", p)?, _pd: pd.clone() })
}

pub(super) fn create_srq(pd: &Arc<Pd>, depth: usize) -> Result<Arc<Srq>, Error> {
    let mut attr = sys::ibv_srq_init_attr {
        srq_context: ptr::null_mut(),
        attr: sys::ibv_srq_attr { max_wr: depth as u32, max_sge: 1, srq_limit: 0 },
    };
    // SAFETY: pd is live; attr is valid for the call.
    let p = check_ptr("ibv_create_srq", unsafe { sys::ibv_create_srq(pd.as_ptr(), &mut attr) })?;
    Ok(Arc::new(Srq { ptr: p, _pd: pd.clone() }))
}
