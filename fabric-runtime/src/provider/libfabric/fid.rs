//! The owning wrappers: an `fi_info` list freed with `fi_freeinfo`, and every other libfabric
//! object closed with `fi_close` when its owner drops.

use std::ptr::{self, NonNull};

use libfabric_sys as sys;

use super::error::{check, provider_error};
use crate::error::Error;

/// An owned `fi_info` list, freed with `fi_freeinfo` (which also frees the strings in it:
/// those must come from `malloc`, hence `libc::strdup`).
pub(super) struct Info(pub(super) NonNull<sys::fi_info>);

impl Info {
    /// A zeroed `fi_info` with all attribute structs allocated (`fi_allocinfo`).
    pub(super) fn alloc() -> Result<Info, Error> {
        // SAFETY: fi_allocinfo has no preconditions; it returns NULL on allocation failure.
        let p = unsafe { sys::fabric_shim_fi_allocinfo() };
        NonNull::new(p).map(Info).ok_or_else(|| provider_error("fi_allocinfo", libc::ENOMEM))
    }

    pub(super) fn as_ptr(&self) -> *mut sys::fi_info {
        self.0.as_ptr()
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: self.0 came from fi_allocinfo or fi_getinfo and is freed exactly once here.
        unsafe { sys::fi_freeinfo(self.0.as_ptr()) }
    }
}

/// A libfabric object type whose first member is its `struct fid`.
pub(super) trait FidObject {
    /// # Safety
    ///
    /// `this` must point to a live object of this type.
    unsafe fn fid(this: *mut Self) -> *mut sys::fid;
}

macro_rules! fid_object {
    ($($t:ty),*) => {$(
        impl FidObject for $t {
            unsafe fn fid(this: *mut Self) -> *mut sys::fid {
                // SAFETY: the caller guarantees `this` is live; addr_of_mut! creates no
                // reference.
                unsafe { ptr::addr_of_mut!((*this).fid) }
            }
        }
    )*};
}
fid_object!(sys::fid_fabric, sys::fid_domain, sys::fid_ep, sys::fid_cq, sys::fid_av, sys::fid_mr);

/// An open libfabric object, closed with `fi_close` on drop (errors are logged: drop never
/// panics).
pub(super) struct Fid<T: FidObject> {
    ptr: NonNull<T>,
    what: &'static str,
}

impl<T: FidObject> Fid<T> {
    /// Wraps the object an `fi_*_open`-style call just returned.
    pub(super) fn new(ptr: *mut T, what: &'static str) -> Result<Fid<T>, Error> {
        NonNull::new(ptr).map(|ptr| Fid { ptr, what }).ok_or_else(|| Error::Provider {
            call: what,
            errno: 0,
            message: "provider returned a NULL object".into(),
        })
    }

    pub(super) fn as_ptr(&self) -> *mut T {
        self.ptr.as_ptr()
    }

    pub(super) fn fid(&self) -> *mut sys::fid {
        // SAFETY: the object stays open as long as self exists.
        unsafe { T::fid(self.ptr.as_ptr()) }
    }
}

impl<T: FidObject> Drop for Fid<T> {
    fn drop(&mut self) {
        // SAFETY: the object is open and closed exactly once, here; everything bound to it
        // has been closed before (field order of LibfabricDomain).
        let ret = unsafe { sys::fabric_shim_fi_close(self.fid()) };
        if let Err(e) = check("fi_close", ret as isize) {
            tracing::warn!(object = self.what, error = %e, "closing a libfabric object failed");
        }
    }
}
