//! Errors a caller can act on: one variant per failed operation, with its context.

use std::fmt;
use std::path::PathBuf;

/// Which side of a transfer a bounds error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The local (source or destination) region.
    Local,
    /// The remote region named by a descriptor.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Everything that can go wrong in this crate.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A range falls outside its registered region. Nothing was posted.
    #[error("{side} range {offset}+{len} is out of bounds of a {region_len}-byte region")]
    OutOfBounds { side: Side, offset: u64, len: u64, region_len: u64 },

    /// The peer id was never added to this engine.
    #[error("unknown peer {peer}")]
    UnknownPeer { peer: u32 },

    /// The peer could not be reached (refused, reset, timed out, or marked failed).
    #[error("peer {peer} is unreachable: {message}")]
    PeerUnreachable { peer: u32, message: String },

    /// The peer refused this operation's access to its memory: the remote key or address is
    /// not registered there (the region was freed, or the descriptor is forged or corrupt).
    /// Only this operation failed; nothing was written through it, and the peer stays up.
    /// With `op` `"descriptor"`: `Engine::remote_region` asked the owner to vouch for the
    /// descriptor (shm) and it refused, so nothing was ever posted.
    #[error("peer {peer} refused the {op}: {message}")]
    RemoteAccess { peer: u32, op: &'static str, message: String },

    /// The transport tore down its connection to a live peer (libfabric `tcp;ofi_rxm` after
    /// a bad key, a verbs RC queue pair in the error state) and this operation was lost with
    /// it: whether its bytes landed is unknown, so send them again if they matter. The peer
    /// stays up; the connection is re-established for later operations.
    #[error("peer {peer}: the {op} was lost with its connection: {message}")]
    ConnectionLost { peer: u32, op: &'static str, message: String },

    /// Bytes that should be a descriptor or an address are not one (truncated, bad magic,
    /// unknown version).
    #[error("malformed {what}: {reason}")]
    Malformed { what: &'static str, reason: String },

    /// A descriptor or address of a peer that is gone: its process was found dead, it was
    /// removed (`Engine::remove_peer`), or a later incarnation of it (a restarted process at
    /// the same transport address) has been added since; or the descriptor of a region its
    /// owner has freed (the owner revoked it). Nothing was written.
    #[error("stale {what}: {reason}")]
    Stale { what: &'static str, reason: String },

    /// A well-formed descriptor or address from a transport this engine does not speak.
    #[error("foreign {what}: made by transport {found:?}, this engine uses {expected:?}")]
    Foreign { what: &'static str, found: String, expected: String },

    /// The provider exists but cannot deliver a 32-bit immediate with a remote write.
    #[error("provider {provider:?} cannot deliver remote CQ data (immediates): {reason}")]
    NoRemoteCqData { provider: String, reason: String },

    /// No provider of that name is available on this machine.
    #[error("provider {provider:?} is not available: {reason}")]
    ProviderNotFound { provider: String, reason: String },

    /// The operation completed with an error at the NIC. `message` is the provider's text.
    #[error("{op} failed: {message} (errno {errno})")]
    Completion { op: &'static str, errno: i32, message: String },

    /// A call into the provider failed.
    #[error("{call} failed: {message} (errno {errno})")]
    Provider { call: &'static str, errno: i32, message: String },

    /// Registering memory failed.
    #[error("registering {len} bytes of {location} memory failed: {message}")]
    RegisterMemory { len: usize, location: String, message: String },

    /// A message is larger than the transport's two-sided limit.
    #[error("message of {len} bytes exceeds the {max}-byte limit")]
    MessageTooLarge { len: usize, max: usize },

    /// The engine was shut down (or its reactor thread is gone).
    #[error("the engine has shut down")]
    Shutdown,

    /// Arrivals of immediate `imm` were refused before its counter existed: the engine's
    /// counter table was full (`limit` counters, `EngineBuilder::max_counters`). The counter's
    /// count is short, so a wait it cannot satisfy from what it holds fails with this rather
    /// than wait for arrivals that were dropped; `Engine::retire_counter(imm)` starts it
    /// afresh. `docs/imm-counter.md`, "A bounded table".
    #[error(
        "arrivals of immediate {imm} were refused: the engine's counter table was full ({limit} counters)"
    )]
    CounterLimit { imm: u32, limit: usize },

    /// The counter of immediate `imm` was retired (`Engine::retire_counter`): this handle's
    /// waits that were not granted before, and any later one, fail with this. A new
    /// `Engine::imm_counter(imm)` is a new counter.
    #[error("the counter of immediate {imm} was retired")]
    CounterRetired { imm: u32 },

    /// The request is valid but not implemented for this transport or memory kind.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A CUDA driver or NVRTC call failed. `code` is the `CUresult` (or `nvrtcResult`) value;
    /// `message` is its name and description, plus NVRTC's compile log where there is one.
    /// (A machine without a CUDA driver gets [`Error::Unsupported`] instead.)
    #[error("{call} failed: {message} (CUDA error {code})")]
    Cuda { call: &'static str, code: i32, message: String },

    /// `register_cuda` was given a range that is not CUDA device memory of `ordinal` inside
    /// one allocation. Nothing was registered.
    #[error("{ptr:#x}+{len} is not device memory of CUDA device {ordinal}: {reason}")]
    NotDeviceMemory { ptr: u64, len: usize, ordinal: u32, reason: String },

    /// The builder was given an invalid configuration.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A sysfs file that topology detection reads is unreadable or malformed.
    #[error("topology: {path}: {message}")]
    Sysfs { path: PathBuf, message: String },

    /// A topology override (`FABRIC_TOPOLOGY`) does not parse, or names a GPU, NIC, NUMA
    /// node or CPU that this machine does not have. `token` is the offending piece.
    #[error("topology override: bad token {token:?}: {reason}")]
    TopologyOverride { token: String, reason: String },
}

impl Error {
    /// Whether making the same call again, unchanged, can succeed once a transient condition
    /// passes, with nothing else for the caller to fix:
    ///
    /// - [`Error::ConnectionLost`]: the transport re-establishes the connection for later
    ///   operations (whether this one's bytes landed is unknown: send them again);
    /// - [`Error::PeerUnreachable`]: after the peer is back (a [`PeerEvent::Up`] for it, once
    ///   its address is added again: `docs/faults.md`);
    /// - a provider call or completion that failed with `EAGAIN`, `EBUSY`, `EINTR`,
    ///   `ETIMEDOUT` or `ENOMEM`.
    ///
    /// Everything else is not: bad input (`OutOfBounds`, `Malformed`, `Foreign`, `Config`,
    /// `MessageTooLarge`), a refusal (`RemoteAccess`), a descriptor or peer that is gone for
    /// good (`Stale`: fetch a new descriptor), or an engine state the caller must change
    /// first (`Shutdown`, `CounterLimit`, `CounterRetired`, `UnknownPeer`).
    ///
    /// [`PeerEvent::Up`]: crate::PeerEvent
    pub fn is_retryable(&self) -> bool {
        const TRANSIENT: [i32; 5] = [libc::EAGAIN, libc::EBUSY, libc::EINTR, libc::ETIMEDOUT, libc::ENOMEM];
        match self {
            Error::ConnectionLost { .. } | Error::PeerUnreachable { .. } => true,
            Error::Provider { errno, .. } | Error::Completion { errno, .. } => {
                TRANSIENT.contains(&errno.abs())
            }
            _ => false,
        }
    }

    /// The peer the error is about, for the errors that name one (`UnknownPeer`,
    /// `PeerUnreachable`, `RemoteAccess`, `ConnectionLost`), as the id this engine gave it.
    #[cfg(not(loom))]
    pub fn peer(&self) -> Option<crate::PeerId> {
        match self {
            Error::UnknownPeer { peer }
            | Error::PeerUnreachable { peer, .. }
            | Error::RemoteAccess { peer, .. }
            | Error::ConnectionLost { peer, .. } => Some(crate::PeerId(*peer)),
            _ => None,
        }
    }
}

/// Short for `Result<T, fabric_runtime::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn retryable_errors_are_the_transient_ones() {
        let lost = Error::ConnectionLost { peer: 3, op: "write", message: String::new() };
        assert!(lost.is_retryable());
        assert_eq!(lost.peer(), Some(crate::PeerId(3)));
        assert!(Error::PeerUnreachable { peer: 1, message: String::new() }.is_retryable());
        let busy = Error::Provider { call: "fi_writedata", errno: -libc::EAGAIN, message: String::new() };
        assert!(busy.is_retryable());
        let inval = Error::Completion { op: "write", errno: libc::EINVAL, message: String::new() };
        assert!(!inval.is_retryable());
        let refused = Error::RemoteAccess { peer: 2, op: "write", message: String::new() };
        assert!(!refused.is_retryable());
        assert_eq!(refused.peer(), Some(crate::PeerId(2)));
        for e in [
            Error::Shutdown,
            Error::OutOfBounds { side: Side::Local, offset: 0, len: 1, region_len: 0 },
            Error::Stale { what: "descriptor", reason: String::new() },
            Error::CounterRetired { imm: 1 },
            Error::UnknownPeer { peer: 9 },
        ] {
            assert!(!e.is_retryable(), "{e}");
        }
        assert_eq!(Error::Shutdown.peer(), None);
        assert_eq!(Error::UnknownPeer { peer: 9 }.peer(), Some(crate::PeerId(9)));
    }
}
