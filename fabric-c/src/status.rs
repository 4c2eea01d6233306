//! Status codes, the thread's last error message, and the boundary every exported function
//! runs its body behind (no panic crosses into C).

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use fabric_async::Error;

/// What a call of the C API returns. `FABRIC_STATUS_OK` (0) and `FABRIC_STATUS_IN_PROGRESS` (1) are not
/// errors; every error is negative, and `fabric_last_error()` gives its message on the
/// thread that made the call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricStatus {
    /// Done.
    Ok = 0,
    /// An operation is still running (`fabric_op_test`).
    InProgress = 1,
    /// A bad argument: a null pointer, an unknown option, an invalid value.
    ErrInvalid = -1,
    /// An offset and length outside a region.
    ErrOutOfBounds = -2,
    /// A peer id this engine never gave.
    ErrUnknownPeer = -3,
    /// The peer is gone (its process died, or it was removed): nothing more reaches it.
    ErrPeerUnreachable = -4,
    /// The peer refused an access (a revoked or forged key, a range outside its region).
    ErrRemoteAccess = -5,
    /// The connection to the peer failed under this operation.
    ErrConnectionLost = -6,
    /// Bytes that are not what they claim (a descriptor, an address).
    ErrMalformed = -7,
    /// A descriptor of a region its owner freed, or of a peer that is gone.
    ErrStale = -8,
    /// A descriptor or address of another transport or NIC count.
    ErrForeign = -9,
    /// The NIC, the provider or a completion reported an error.
    ErrProvider = -10,
    /// Memory registration failed.
    ErrRegister = -11,
    /// A message longer than `fabric_engine_max_msg_size`.
    ErrMessageTooLarge = -12,
    /// The engine was shut down.
    ErrShutdown = -13,
    /// An immediate counter was refused (the engine's counter limit) or retired.
    ErrCounter = -14,
    /// Not supported here (a CUDA call without a driver, a transfer shape).
    ErrUnsupported = -15,
    /// A CUDA driver call failed, or a pointer is not device memory.
    ErrCuda = -16,
    /// A wait ran out of time (`fabric_op_wait`); the operation goes on.
    ErrTimeout = -17,
    /// A caller's buffer is too small; the length needed was written.
    ErrBufferTooSmall = -18,
    /// Nothing to take now (`fabric_try_recv`).
    ErrAgain = -19,
    /// A bug in fabric, caught at the boundary; the message says where.
    ErrInternal = -20,
}

/// An error on its way out: the code and the message.
pub(crate) struct Failure {
    pub(crate) status: FabricStatus,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(status: FabricStatus, message: impl Into<String>) -> Self {
        Failure { status, message: message.into() }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Failure::new(FabricStatus::ErrInvalid, message)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure { status: code_of(&e), message: e.to_string() }
    }
}

/// The code of an engine error.
pub(crate) fn code_of(e: &Error) -> FabricStatus {
    use FabricStatus as S;
    match e {
        Error::OutOfBounds { .. } => S::ErrOutOfBounds,
        Error::UnknownPeer { .. } => S::ErrUnknownPeer,
        Error::PeerUnreachable { .. } => S::ErrPeerUnreachable,
        Error::RemoteAccess { .. } => S::ErrRemoteAccess,
        Error::ConnectionLost { .. } => S::ErrConnectionLost,
        Error::Malformed { .. } => S::ErrMalformed,
        Error::Stale { .. } => S::ErrStale,
        Error::Foreign { .. } => S::ErrForeign,
        Error::RegisterMemory { .. } => S::ErrRegister,
        Error::MessageTooLarge { .. } => S::ErrMessageTooLarge,
        Error::Shutdown => S::ErrShutdown,
        Error::CounterLimit { .. } | Error::CounterRetired { .. } => S::ErrCounter,
        Error::Unsupported(_) => S::ErrUnsupported,
        Error::Cuda { .. } | Error::NotDeviceMemory { .. } => S::ErrCuda,
        Error::Config(_) | Error::TopologyOverride { .. } => S::ErrInvalid,
        _ => S::ErrProvider,
    }
}

pub(crate) type Outcome = Result<FabricStatus, Failure>;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last(message: &str) {
    // A message with a NUL byte is cut there rather than lost.
    let cut = message.split('\0').next().unwrap_or_default();
    let c = CString::new(cut).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

/// Runs `body` as an exported function's: its status out, its error's message kept for
/// `fabric_last_error`, and a panic turned into `FABRIC_STATUS_ERR_INTERNAL` (never unwound into C).
pub(crate) fn boundary(body: impl FnOnce() -> Outcome) -> FabricStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(s)) => s,
        Ok(Err(f)) => {
            set_last(&f.message);
            f.status
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_last(&format!("internal error in fabric: {what}"));
            FabricStatus::ErrInternal
        }
    }
}

/// Runs `body`, whose result C cannot take (a `void` function): a panic is kept as the
/// thread's last error and swallowed.
pub(crate) fn boundary_void(body: impl FnOnce()) {
    let _ = boundary(|| {
        body();
        Ok(FabricStatus::Ok)
    });
}

/// The message of the last error returned on the calling thread (empty if none). Valid until
/// the next failing call on this thread.
#[no_mangle]
pub extern "C" fn fabric_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// A status code's name (`"FABRIC_STATUS_ERR_PEER_UNREACHABLE"`); a static string.
#[no_mangle]
pub extern "C" fn fabric_status_name(status: FabricStatus) -> *const c_char {
    use FabricStatus as S;
    let s: &'static std::ffi::CStr = match status {
        S::Ok => c"FABRIC_STATUS_OK",
        S::InProgress => c"FABRIC_STATUS_IN_PROGRESS",
        S::ErrInvalid => c"FABRIC_STATUS_ERR_INVALID",
        S::ErrOutOfBounds => c"FABRIC_STATUS_ERR_OUT_OF_BOUNDS",
        S::ErrUnknownPeer => c"FABRIC_STATUS_ERR_UNKNOWN_PEER",
        S::ErrPeerUnreachable => c"FABRIC_STATUS_ERR_PEER_UNREACHABLE",
        S::ErrRemoteAccess => c"FABRIC_STATUS_ERR_REMOTE_ACCESS",
        S::ErrConnectionLost => c"FABRIC_STATUS_ERR_CONNECTION_LOST",
        S::ErrMalformed => c"FABRIC_STATUS_ERR_MALFORMED",
        S::ErrStale => c"FABRIC_STATUS_ERR_STALE",
        S::ErrForeign => c"FABRIC_STATUS_ERR_FOREIGN",
        S::ErrProvider => c"FABRIC_STATUS_ERR_PROVIDER",
        S::ErrRegister => c"FABRIC_STATUS_ERR_REGISTER",
        S::ErrMessageTooLarge => c"FABRIC_STATUS_ERR_MESSAGE_TOO_LARGE",
        S::ErrShutdown => c"FABRIC_STATUS_ERR_SHUTDOWN",
        S::ErrCounter => c"FABRIC_STATUS_ERR_COUNTER",
        S::ErrUnsupported => c"FABRIC_STATUS_ERR_UNSUPPORTED",
        S::ErrCuda => c"FABRIC_STATUS_ERR_CUDA",
        S::ErrTimeout => c"FABRIC_STATUS_ERR_TIMEOUT",
        S::ErrBufferTooSmall => c"FABRIC_STATUS_ERR_BUFFER_TOO_SMALL",
        S::ErrAgain => c"FABRIC_STATUS_ERR_AGAIN",
        S::ErrInternal => c"FABRIC_STATUS_ERR_INTERNAL",
    };
    s.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_an_internal_error_with_its_message() {
        let s = boundary(|| panic!("boom"));
        assert_eq!(s, FabricStatus::ErrInternal);
        // SAFETY: fabric_last_error returns a valid NUL-terminated string of this thread.
        let m = unsafe { std::ffi::CStr::from_ptr(fabric_last_error()) };
        assert!(m.to_str().unwrap().contains("boom"), "{m:?}");
    }

    #[test]
    fn errors_map_to_their_codes() {
        assert_eq!(code_of(&Error::Shutdown), FabricStatus::ErrShutdown);
        let e = Error::PeerUnreachable { peer: 3, message: "gone".into() };
        assert_eq!(code_of(&e), FabricStatus::ErrPeerUnreachable);
        let s = boundary(|| Err(Failure::from(e)));
        assert_eq!(s, FabricStatus::ErrPeerUnreachable);
        // SAFETY: as above.
        let m = unsafe { std::ffi::CStr::from_ptr(fabric_last_error()) };
        assert!(m.to_str().unwrap().contains("gone"), "{m:?}");
    }
}
