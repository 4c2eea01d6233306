//! Return codes: the one place negative libfabric returns become errors.

use std::ffi::CStr;

use libfabric_sys as sys;

use crate::error::Error;

/// libfabric's text for `errno` (a positive `FI_E*` / errno value).
pub(super) fn strerror(errno: i32) -> String {
    // SAFETY: fi_strerror accepts any int and returns a pointer to a static NUL-terminated
    // string (or to a thread-local buffer for unknown values), valid until the next call on
    // this thread; it is copied out immediately.
    let p = unsafe { sys::fi_strerror(errno) };
    if p.is_null() {
        return format!("libfabric error {errno}");
    }
    // SAFETY: non-null, NUL-terminated, see above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// [`Error::Provider`] for a failed `call` with positive `errno`.
pub(super) fn provider_error(call: &'static str, errno: i32) -> Error {
    Error::Provider { call, errno, message: strerror(errno) }
}

/// Maps a libfabric return code: negative is an error (`-FI_E*`), anything else is returned.
pub(super) fn check(call: &'static str, ret: isize) -> Result<isize, Error> {
    if ret < 0 {
        Err(provider_error(call, i32::try_from(-ret).unwrap_or(i32::MAX)))
    } else {
        Ok(ret)
    }
}

/// What an `fi_*` call returns when a queue is full (try again after reading the CQ).
pub(super) const EAGAIN: isize = -(sys::FI_EAGAIN as isize);
/// What an `fi_cq_read*` returns when an error entry waits (read it with `fi_cq_readerr`).
pub(super) const EAVAIL: isize = -(sys::FI_EAVAIL as isize);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_maps_negative_codes() {
        assert_eq!(check("x", 3).unwrap(), 3);
        match check("fi_x", -(sys::FI_EAGAIN as isize)) {
            Err(Error::Provider { call, errno, message }) => {
                assert_eq!(call, "fi_x");
                assert_eq!(errno, sys::FI_EAGAIN as i32);
                assert!(!message.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }
}
