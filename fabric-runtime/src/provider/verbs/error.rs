//! Return codes and work completion statuses: the one place verbs failures become errors.

use std::ffi::{c_int, CStr};
use std::ptr::NonNull;

use rdma_sys as sys;

use crate::error::Error;

pub(super) fn os_error(call: &'static str, errno: i32) -> Error {
    Error::Provider { call, errno, message: std::io::Error::from_raw_os_error(errno).to_string() }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Maps a verbs return code. Verbs calls return `0` on success and either a positive errno
/// (`ibv_post_send`, `ibv_modify_qp`, ...) or `-1` with `errno` set (`ibv_get_cq_event`, ...)
/// or a negative errno on failure; all three are handled here.
pub(super) fn check(call: &'static str, ret: c_int) -> Result<(), Error> {
    match ret {
        0 => Ok(()),
        r if r > 0 => Err(os_error(call, r)),
        -1 => Err(os_error(call, last_errno())),
        r => Err(os_error(call, r.saturating_neg())),
    }
}

/// Maps a pointer-returning verbs call: NULL is a failure with `errno` set.
pub(super) fn check_ptr<T>(call: &'static str, p: *mut T) -> Result<NonNull<T>, Error> {
    NonNull::new(p).ok_or_else(|| {
        let e = last_errno();
        os_error(call, if e == 0 { libc::EIO } else { e })
    })
}

/// An errno-like code for a failed work completion status, so that the engine can tell a
/// dead peer (`ETIMEDOUT`, `ECONNREFUSED`, `ECONNRESET`) from a bad request.
pub(super) fn status_errno(status: u32) -> i32 {
    use sys::ibv_wc_status::*;
    match status {
        IBV_WC_LOC_LEN_ERR => libc::EMSGSIZE,
        IBV_WC_LOC_PROT_ERR | IBV_WC_LOC_ACCESS_ERR => libc::EFAULT,
        IBV_WC_REM_ACCESS_ERR => libc::EACCES,
        IBV_WC_WR_FLUSH_ERR => libc::ECANCELED,
        IBV_WC_REM_INV_REQ_ERR | IBV_WC_LOC_QP_OP_ERR => libc::EINVAL,
        IBV_WC_RETRY_EXC_ERR | IBV_WC_RESP_TIMEOUT_ERR => libc::ETIMEDOUT,
        IBV_WC_RNR_RETRY_EXC_ERR => libc::ECONNREFUSED,
        IBV_WC_REM_ABORT_ERR => libc::ECONNRESET,
        IBV_WC_BAD_RESP_ERR => libc::EPROTO,
        IBV_WC_REM_OP_ERR => libc::EREMOTEIO,
        _ => libc::EIO,
    }
}

/// How far a failed work completion's status reaches (see "Faults" in the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StatusClass {
    /// Flushed: the QP had already gone to the error state (an earlier failure, or ours).
    Flushed,
    /// The responder refused this operation's remote key or range: the operation fails with
    /// `RemoteAccess`; the QPs on both sides went to the error state and are replaced.
    RemoteAccess,
    /// This operation was bad (a local protection or length error, an invalid request or a
    /// remote operation error): it fails on its own; the QP went to the error state and is
    /// replaced.
    Op,
    /// The peer is unreachable (transport or RNR retries exceeded, no response, aborted,
    /// or a status we do not know): the peer is lost.
    PeerLost,
}

/// The class of a failed (not `IBV_WC_SUCCESS`) work completion status.
pub(super) fn status_class(status: u32) -> StatusClass {
    use sys::ibv_wc_status::*;
    match status {
        IBV_WC_WR_FLUSH_ERR => StatusClass::Flushed,
        IBV_WC_REM_ACCESS_ERR => StatusClass::RemoteAccess,
        IBV_WC_LOC_LEN_ERR
        | IBV_WC_LOC_QP_OP_ERR
        | IBV_WC_LOC_PROT_ERR
        | IBV_WC_LOC_ACCESS_ERR
        | IBV_WC_MW_BIND_ERR
        | IBV_WC_REM_INV_REQ_ERR
        | IBV_WC_REM_OP_ERR
        | IBV_WC_BAD_RESP_ERR => StatusClass::Op,
        _ => StatusClass::PeerLost,
    }
}

pub(super) fn status_str(status: u32) -> String {
    // SAFETY: ibv_wc_status_str accepts any value and returns a static NUL-terminated string.
    let p = unsafe { sys::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("work completion status {status}");
    }
    // SAFETY: non-null static C string, see above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_map_to_errnos() {
        use sys::ibv_wc_status::*;
        assert_eq!(status_errno(IBV_WC_RETRY_EXC_ERR), libc::ETIMEDOUT);
        assert_eq!(status_errno(IBV_WC_REM_ACCESS_ERR), libc::EACCES);
        assert_eq!(status_errno(IBV_WC_WR_FLUSH_ERR), libc::ECANCELED);
        assert!(!status_str(IBV_WC_REM_ACCESS_ERR).is_empty());
        assert_eq!(status_class(IBV_WC_REM_ACCESS_ERR), StatusClass::RemoteAccess);
        assert_eq!(status_class(IBV_WC_WR_FLUSH_ERR), StatusClass::Flushed);
        assert_eq!(status_class(IBV_WC_REM_INV_REQ_ERR), StatusClass::Op);
        // A dead peer: the peer_death tests rely on these failing the peer.
        for s in
            [IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_RESP_TIMEOUT_ERR, IBV_WC_REM_ABORT_ERR]
        {
            assert_eq!(status_class(s), StatusClass::PeerLost, "{}", status_str(s));
        }
        assert!(check("x", 0).is_ok());
        assert!(
            matches!(check("x", libc::ENOMEM), Err(Error::Provider { errno, .. }) if errno == libc::ENOMEM)
        );
        assert!(
            matches!(check("x", -libc::EINVAL), Err(Error::Provider { errno, .. }) if errno == libc::EINVAL)
        );
    }
}
