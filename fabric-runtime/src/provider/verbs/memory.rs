//! Memory registration: host memory with `ibv_reg_mr_iova2` (relaxed ordering when the device
//! takes it), GPU memory through a dma-buf (see "Memory" in the module docs).

use std::ffi::c_int;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use rdma_sys as sys;

use super::error::check_ptr;
use super::owned::{reg_mr, Mr};
use super::VerbsDomain;
use crate::error::Error;
use crate::provider::{MemoryLocation, Registration};

impl VerbsDomain {
    /// Registers `addr..addr+len` (host memory with `ibv_reg_mr_iova2`, GPU memory through a
    /// dma-buf). The body of [`Domain::register`](crate::provider::Domain::register).
    ///
    /// # Safety
    ///
    /// As for [`Domain::register`](crate::provider::Domain::register): the range must stay
    /// allocated until [`deregister_memory`](Self::deregister_memory) has returned for it.
    pub(super) unsafe fn register_memory(
        &mut self,
        addr: u64,
        len: usize,
        location: MemoryLocation,
    ) -> Result<Registration, Error> {
        let reg_err =
            |e: Error| Error::RegisterMemory { len, location: location.to_string(), message: e.to_string() };
        if let MemoryLocation::Cuda { ordinal } = location {
            let fd = dmabuf_fd(ordinal, addr, len).map_err(|e| match e {
                Error::Unsupported(_) => e,
                e => reg_err(e),
            })?;
            // The kernel takes its own reference to the dma-buf; `fd` is closed after.
            return self.reg_dmabuf(fd.as_raw_fd(), 0, len, addr).map_err(reg_err);
        }
        let base = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        let relaxed = sys::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
        let mr = if self.relaxed_ordering {
            // SAFETY: the caller of `register_memory` guarantees that addr..addr+len stays
            // allocated until the registration is given back.
            let first = unsafe { reg_mr(&self.pd, addr, len, base | relaxed) };
            match first {
                Ok(mr) => Ok(mr),
                Err(e) => {
                    tracing::debug!(error = %e, "registration with relaxed ordering refused; retrying without");
                    // SAFETY: as above.
                    let r = unsafe { reg_mr(&self.pd, addr, len, base) };
                    if r.is_ok() {
                        self.relaxed_ordering = false;
                    }
                    r
                }
            }
        } else {
            // SAFETY: as above.
            unsafe { reg_mr(&self.pd, addr, len, base) }
        };
        Ok(self.keep_mr(mr.map_err(reg_err)?, addr))
    }

    /// Gives back a registration made by `register_memory` (the MR is deregistered when
    /// dropped); an unknown handle is logged and ignored.
    pub(super) fn deregister_memory(&mut self, reg: Registration) {
        if self.mrs.remove(&reg.handle).is_none() {
            tracing::warn!(
                handle = reg.handle,
                "deregister of a handle this domain did not register; ignored"
            );
        }
    }

    /// Registers a dma-buf (GPU memory exported by its driver) with `ibv_reg_dmabuf_mr`.
    fn reg_dmabuf(&mut self, fd: RawFd, offset: u64, len: usize, iova: u64) -> Result<Registration, Error> {
        let access = (sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0) as c_int;
        // SAFETY: pd is live; fd is a dma-buf fd that the caller keeps open for the call
        // (the kernel takes its own reference).
        let p = unsafe { sys::ibv_reg_dmabuf_mr(self.pd.as_ptr(), offset, len, iova, fd, access) };
        let mr = Mr { ptr: check_ptr("ibv_reg_dmabuf_mr", p)?, _pd: self.pd.clone() };
        Ok(self.keep_mr(mr, iova))
    }

    /// Keeps `mr` until it is deregistered; its keys and handle as a [`Registration`].
    fn keep_mr(&mut self, mr: Mr, remote_base: u64) -> Registration {
        // SAFETY: the MR is live.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        let handle = mr.as_ptr() as u64;
        self.mrs.insert(handle, mr);
        Registration { local: lkey.into(), remote_key: rkey.into(), handle, remote_base }
    }
}

/// A dma-buf fd for GPU memory, from the CUDA driver (`cuMemGetHandleForAddressRange`,
/// cargo feature `cuda`). The engine registers a GPU region GPUDirect where this and
/// `ibv_reg_dmabuf_mr` succeed on every NIC, and stages it otherwise (`docs/gpu.md`).
#[cfg(feature = "cuda")]
fn dmabuf_fd(ordinal: u32, addr: u64, len: usize) -> Result<OwnedFd, Error> {
    crate::cuda::dmabuf_fd(ordinal as usize, addr, len)
}

/// Without the `cuda` feature there is no dma-buf source.
#[cfg(not(feature = "cuda"))]
fn dmabuf_fd(ordinal: u32, _addr: u64, _len: usize) -> Result<OwnedFd, Error> {
    Err(Error::Unsupported(format!(
        "registering cuda:{ordinal} memory with verbs needs the cargo feature `cuda` (the dma-buf comes from the CUDA driver)"
    )))
}
