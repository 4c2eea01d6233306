//! Memory registration: `fi_mr_reg`, honouring the `mr_mode` the provider asked for (keys
//! chosen by us without `FI_MR_PROV_KEY`, the endpoint binding of `FI_MR_ENDPOINT`, the
//! descriptor of `FI_MR_LOCAL`, virtual addresses with `FI_MR_VIRT_ADDR`).

use std::ffi::c_void;
use std::ptr::{self, NonNull};

use libfabric_sys as sys;

use super::error::{check, provider_error};
use super::fid::FidObject;
use super::LibfabricDomain;
use crate::error::Error;
use crate::provider::{MemoryLocation, Registration};

/// Access flags of every registration: local send/recv/read/write and remote read/write.
const MR_ACCESS: u64 =
    (sys::FI_SEND | sys::FI_RECV | sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE)
        as u64;

impl LibfabricDomain {
    /// Registers `addr..addr+len` with `fi_mr_reg` (bound to the endpoint and enabled where the
    /// provider's `mr_mode` asks for it). The body of
    /// [`Domain::register`](crate::provider::Domain::register).
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
        let device = match location {
            MemoryLocation::Host => None,
            // GPU memory with the provider itself: only where it granted FI_HMEM (a libfabric
            // built with CUDA; Debian's is not, and its FI_HMEM_CUDA registration gives -38).
            MemoryLocation::Cuda { ordinal } if self.hmem => Some(ordinal),
            _ => {
                return Err(Error::Unsupported(format!(
                    "registering {location} memory with libfabric (FI_HMEM not asked or not granted)"
                )))
            }
        };
        let reg_err =
            |e: Error| Error::RegisterMemory { len, location: location.to_string(), message: e.to_string() };
        // Without FI_MR_PROV_KEY the application picks the keys; unique per domain.
        let requested_key = if self.mr_needs(sys::FI_MR_PROV_KEY) { 0 } else { self.next_key };
        let mut mr = ptr::null_mut();
        let ret = match device {
            // SAFETY: the caller guarantees addr..addr+len is valid until deregister; domain
            // is open.
            None => unsafe {
                sys::fabric_shim_fi_mr_reg(
                    self.domain.as_ptr(),
                    addr as *const c_void,
                    len,
                    MR_ACCESS,
                    0,
                    requested_key,
                    0,
                    &mut mr,
                    ptr::null_mut(),
                )
            },
            // SAFETY: as for fi_mr_reg, and the range is device memory of that ordinal (the
            // engine registers only its own or validated `register_cuda` memory this way).
            // The shim builds the `fi_mr_attr` (iface FI_HMEM_CUDA) against the headers of
            // the libfabric it is compiled with.
            Some(ordinal) => unsafe {
                sys::fabric_shim_fi_mr_reg_cuda(
                    self.domain.as_ptr(),
                    addr as *const c_void,
                    len,
                    MR_ACCESS,
                    requested_key,
                    ordinal as i32,
                    &mut mr,
                )
            },
        };
        check(if device.is_some() { "fi_mr_regattr(FI_HMEM_CUDA)" } else { "fi_mr_reg" }, ret as isize)
            .map_err(reg_err)?;
        let mr = NonNull::new(mr).ok_or_else(|| reg_err(provider_error("fi_mr_reg", libc::EINVAL)))?;
        let close = |mr: NonNull<sys::fid_mr>| {
            // SAFETY: mr was just opened and is not known to anyone else.
            unsafe { sys::fabric_shim_fi_close(sys::fid_mr::fid(mr.as_ptr())) };
        };
        if self.mr_needs(sys::FI_MR_ENDPOINT) {
            // SAFETY: mr and ep are open objects of this domain.
            let r = unsafe {
                check("fi_mr_bind", sys::fabric_shim_fi_mr_bind(mr.as_ptr(), self.ep.fid(), 0) as isize)
                    .and_then(|_| check("fi_mr_enable", sys::fabric_shim_fi_mr_enable(mr.as_ptr()) as isize))
            };
            if let Err(e) = r {
                close(mr);
                return Err(reg_err(e));
            }
        }
        if !self.mr_needs(sys::FI_MR_PROV_KEY) {
            self.next_key = self.next_key.wrapping_add(1);
        }
        // SAFETY: mr is open and registered (and enabled where needed).
        let (desc, key) =
            unsafe { (sys::fabric_shim_fi_mr_desc(mr.as_ptr()), sys::fabric_shim_fi_mr_key(mr.as_ptr())) };
        if key == sys::FI_KEY_NOTAVAIL {
            close(mr);
            return Err(reg_err(provider_error("fi_mr_key", sys::FI_ENOKEY as i32)));
        }
        let handle = mr.as_ptr() as u64;
        self.mrs.insert(handle, mr);
        // The contract: `local` is 0 when the provider needs no descriptor. Device memory
        // needs one under FI_MR_HMEM (it tells the provider the buffer's interface).
        let needs_desc =
            self.mr_needs(sys::FI_MR_LOCAL) || (device.is_some() && self.mr_needs(sys::FI_MR_HMEM));
        Ok(Registration {
            local: if needs_desc { desc as u64 } else { 0 },
            remote_key: key,
            handle,
            remote_base: if self.mr_needs(sys::FI_MR_VIRT_ADDR) { addr } else { 0 },
        })
    }

    /// Closes a registration made by `register_memory`; an unknown handle is logged and
    /// ignored.
    pub(super) fn deregister_memory(&mut self, reg: Registration) {
        let Some(mr) = self.mrs.remove(&reg.handle) else {
            tracing::warn!(
                handle = reg.handle,
                "deregister of a handle this domain did not register; ignored"
            );
            return;
        };
        // SAFETY: mr is one of our open registrations, removed from the table so it is closed
        // exactly once.
        let ret = unsafe { sys::fabric_shim_fi_close(sys::fid_mr::fid(mr.as_ptr())) };
        if let Err(e) = check("fi_close(mr)", ret as isize) {
            tracing::warn!(error = %e, "deregistering memory failed");
        }
    }
}
