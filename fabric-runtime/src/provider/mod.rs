//! The backend contract: what every NIC family must supply.
//!
//! A backend drives one **domain**, which is one NIC (one libfabric domain + `FI_EP_RDM`
//! endpoint, or one ibverbs device + protection domain + its queue pairs). The engine never
//! talks to a NIC any other way, so a new NIC family is one new module implementing [`Domain`].
//!
//! Required of every backend:
//!
//! * **An address** ([`Domain::address`]): plain bytes that can be sent to a peer by any
//!   means (TCP, a key-value store, a file) and handed to that peer's [`Domain::add_peer`].
//! * **Memory registration** ([`Domain::register`]): pins a host range and returns a
//!   [`Registration`], which is plain data (a local descriptor word, a remote key, an opaque
//!   handle) so that regions, descriptors and the engine stay independent of the backend.
//!   [`Domain::deregister`] gives it back.
//! * **Posting** ([`Domain::post`], then [`Domain::flush`]): one-sided writes with or without a 32-bit immediate,
//!   imm-only (zero-byte) writes, and small two-sided sends and receives. Every posted
//!   operation carries a `u64` token chosen by the engine, and produces **exactly one** local
//!   completion carrying that token (success or failure), unless the post itself returned an
//!   error, in which case it produces none. A full send queue is [`PostError::Again`]
//!   (backpressure: the engine retries after polling), never a hard error.
//! * **Completion semantics** ([`Domain::delivery_complete`]): whether a write's local
//!   completion means its data has been placed in the target's memory, not merely sent.
//!   `Arrivals::One` across several NICs relies on it (see `docs/transfers.md`); a backend
//!   that cannot promise it says `false` (the default), and the engine refuses those
//!   transfers instead of letting an arrival overtake its data.
//! * **How a bad key is refused** ([`Domain::refuses_bad_keys_silently`]): a backend whose
//!   target may drop an access through an unknown key without a failed completion at the
//!   writer says so, and the engine then checks descriptors with their owners first.
//! * **Polling** ([`Domain::poll`]): drains completions into typed [`Completion`]s: a local
//!   operation done, a local operation failed (with the provider's message), a remote
//!   immediate arrived, a two-sided message received, a peer found dead. A failed
//!   operation says how far its failure reaches ([`FailCause`]): a refused remote access or
//!   a connection the transport re-establishes fails that operation only; only a lost peer
//!   marks the peer down.
//! * **Reviving a peer the engine marked down** ([`Domain::revive_peer`], [`Domain::revival`]),
//!   when the application adds it again: settled at once where the backend can tell (tcp,
//!   shm), or started at once and settled later, within a bound of the backend's own, where
//!   it takes a round trip (verbs). Never blocking: the reactor thread calls these.
//! * **Sleeping** ([`Domain::wait_fd`], [`Domain::arm`], [`Domain::ack_wakeup`]): a backend that
//!   can wake a sleeping thread offers a file descriptor that becomes readable when
//!   completions may be available. The reactor calls `arm` right before sleeping; `arm`
//!   returns `false` if completions are already pending (the libfabric `fi_trywait`, the
//!   verbs `ibv_req_notify_cq` + re-poll idiom), in which case the reactor polls instead of
//!   sleeping. After the fd became readable the reactor calls `ack_wakeup` once, then polls.
//!   A backend without a wait fd (libfabric `shm`, EFA) returns `None`, and the reactor
//!   falls back to timed polling (see `ReactorMode`).
//!
//! Threading: a `Domain` is owned by exactly one reactor thread and is only ever called from
//! it (`&mut self` everywhere), which matches libfabric's `FI_THREAD_DOMAIN` and lets verbs
//! skip locking. It must be `Send` so it can be moved to that thread once.
//!
//! Dispatch is static: the reactor is generic over `D: Domain`; `dyn` is used nowhere on the
//! post or poll paths.

use std::fmt;
use std::os::fd::RawFd;

use crate::error::Error;

#[cfg(feature = "faults")]
pub mod faults;
#[cfg(feature = "libfabric")]
pub mod libfabric;
#[cfg(feature = "verbs")]
pub mod verbs;

/// The index of a peer inside one backend domain (a libfabric `fi_addr_t`, or the index of a
/// verbs queue pair). Chosen by the backend in [`Domain::add_peer`].
pub type PeerHandle = u64;

/// What the backend gives back for a registered memory range. Plain data, copied freely.
///
/// * `local`: what a post needs to name this memory locally (a libfabric `fi_mr_desc`
///   pointer as an integer, or a verbs `lkey`). `0` when the provider needs none.
/// * `remote_key`: what a peer needs to write into this memory (libfabric `fi_mr_key`,
///   verbs `rkey`).
/// * `handle`: whatever the backend needs to deregister it (a `fid_mr` or `ibv_mr` pointer).
/// * `remote_base`: the address a peer must use for byte 0 of this range: the virtual address
///   when the provider uses `FI_MR_VIRT_ADDR` (and always on verbs), `0` otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    pub local: u64,
    pub remote_key: u64,
    pub handle: u64,
    pub remote_base: u64,
}

/// Where memory lives. A backend registers [`MemoryLocation::Cuda`] memory only if its NIC
/// can reach GPU memory itself (verbs: `ibv_reg_dmabuf_mr`); otherwise it returns
/// [`Error::Unsupported`] and the engine stages the region through pinned host memory
/// (`docs/gpu.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MemoryLocation {
    /// Ordinary host memory.
    #[default]
    Host,
    /// Memory of CUDA device `ordinal` (cargo feature `cuda`).
    Cuda { ordinal: u32 },
}

/// A local memory range to transmit from or receive into.
#[derive(Debug, Clone, Copy)]
pub struct LocalSlice {
    pub addr: u64,
    pub len: usize,
    /// `Registration::local` of the region containing it.
    pub desc: u64,
}

/// A remote memory range to write into.
#[derive(Debug, Clone, Copy)]
pub struct RemoteSlice {
    /// Already includes the region's `remote_base`: the exact address to put on the wire.
    pub addr: u64,
    pub key: u64,
}

/// One operation handed to [`Domain::post`].
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// One-sided write of `local` into `remote` at `peer`. `imm: Some(v)` carries the 32-bit
    /// immediate `v` that appears as [`Completion::Imm`] at the target. `local.len == 0` with
    /// an immediate is an imm-only write.
    Write { peer: PeerHandle, local: LocalSlice, remote: RemoteSlice, imm: Option<u32> },
    /// One-sided read of `remote` at `peer` into `local`.
    Read { peer: PeerHandle, local: LocalSlice, remote: RemoteSlice },
    /// Two-sided send of a small message.
    Send { peer: PeerHandle, local: LocalSlice },
    /// Post a receive buffer for any peer's [`Op::Send`].
    Recv { local: LocalSlice },
}

/// Why [`Domain::post`] did not take an operation.
#[derive(Debug)]
pub enum PostError {
    /// The queue is full right now: poll completions and post again. Not an error.
    Again,
    /// The operation was rejected; it will produce no completion.
    Failed(Error),
}

/// Where the revival of a peer stands ([`Domain::revival`]).
#[derive(Debug)]
pub enum Revival {
    /// The backend still waits for the peer's answer: ask again after the next poll.
    Pending,
    /// The peer answered: it is reachable again.
    Up,
    /// It did not answer within the backend's bound, or reviving it failed: it stays down.
    Failed(Error),
}

/// A typed completion, produced by [`Domain::poll`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// The operation posted with `token` finished locally (a write's source may be reused).
    /// For a `Recv`, see [`Completion::Recv`] instead.
    Done { token: u64 },
    /// The operation posted with `token` failed. `message` is the provider's own text;
    /// `cause` says how far the failure reaches (this operation, its connection, its peer).
    Failed { token: u64, errno: i32, message: String, cause: FailCause },
    /// A remote peer's write carrying immediate `imm` has landed in our memory.
    Imm { imm: u32 },
    /// The receive posted with `token` got a message of `len` bytes from `src` (the sender's
    /// handle, if the backend can tell).
    Recv { token: u64, len: usize, src: Option<PeerHandle> },
    /// The backend learned that `peer` is gone (shm: its process exited), with or without
    /// operations in flight to it. Those it had in flight were (or are, in the same poll)
    /// each reported as [`Completion::Failed`]; the engine fails whatever it still holds for
    /// the peer and marks it down.
    PeerDown { peer: PeerHandle, message: String },
}

/// How far a failed operation's failure reaches: the backend knows, the engine acts on it.
///
/// Only [`FailCause::PeerLost`] marks the peer down (`PeerEvent::Down`, every later
/// operation to it fails). The others fail the one operation and leave the peer up: a bad
/// remote access (a stale, revoked or forged descriptor) must not cut two healthy processes
/// apart (`docs/faults.md`, "A bad remote access fails that operation, and only it").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailCause {
    /// This operation failed (a bad request, a local error); its peer and connection are
    /// fine. The engine reports [`Error::Completion`].
    Op,
    /// The target refused the access: the remote key or address is not registered there
    /// (any more). The engine reports [`Error::RemoteAccess`].
    RemoteAccess,
    /// The transport tore its connection to a live peer down (rxm after a bad key, an RC
    /// queue pair in the error state) and lost this operation with it; the backend
    /// re-establishes the connection for later operations. The engine reports
    /// [`Error::ConnectionLost`].
    ConnectionLost,
    /// The peer is unreachable (its process died, refused, timed out): the engine marks it
    /// down and reports [`Error::PeerUnreachable`].
    PeerLost,
}

impl FailCause {
    /// The cause a plain errno implies: [`FailCause::PeerLost`] for the connection-type
    /// errnos of `is_peer_errno`, else [`FailCause::Op`]. Backends that know better (a
    /// remote access error, a connection lost to a live peer) say so instead.
    pub fn of_errno(errno: i32) -> FailCause {
        if is_peer_errno(errno) {
            FailCause::PeerLost
        } else {
            FailCause::Op
        }
    }
}

/// The contract every NIC backend implements. See the module docs.
pub trait Domain: Send + 'static {
    /// Short stable name of the transport, stored in descriptors so that a descriptor from
    /// another transport is refused (`"tcp;ofi_rxm"`, `"shm"`, `"verbs"`).
    fn transport(&self) -> &str;

    /// This domain's address, to be given to peers.
    fn address(&self) -> Vec<u8>;

    /// Largest message [`Op::Send`] accepts, in bytes.
    fn max_msg_size(&self) -> usize;

    /// Whether the local completion of a write (with or without immediate) means its data
    /// has been placed in the target's memory (`FI_DELIVERY_COMPLETE` semantics; verbs RC,
    /// where the completion follows the responder's acknowledgement), rather than only that
    /// the source buffer may be reused or the data has left. Fixed when the domain is
    /// opened. The default, `false`, promises nothing.
    fn delivery_complete(&self) -> bool {
        false
    }

    /// Whether this transport's target may refuse a remote access through a key it does not
    /// know (or a range outside the key's region) **without telling the writer** (libfabric
    /// 1.17's `shm`: a write with immediate up to 4 KiB completes at the writer as if
    /// delivered, a larger one never completes). The engine then has the owner vouch for
    /// every descriptor before it is first used (`Engine::remote_region`, one control round
    /// trip; `pure/revoke.rs`), so that a forged one fails there with a typed error. The
    /// default, `false`: a refused access produces a failed completion ([`FailCause`]).
    fn refuses_bad_keys_silently(&self) -> bool {
        false
    }

    /// Registers `len` bytes at `addr` for local use and remote write (and read) access.
    ///
    /// # Safety
    ///
    /// `addr..addr+len` must be valid memory that stays allocated until [`Domain::deregister`]
    /// has returned for the registration.
    unsafe fn register(
        &mut self,
        addr: u64,
        len: usize,
        location: MemoryLocation,
    ) -> Result<Registration, Error>;

    /// Gives back a registration made by this domain. Must not fail in a way the caller has
    /// to handle; problems are logged.
    fn deregister(&mut self, reg: Registration);

    /// Makes a peer reachable from its [`Domain::address`] bytes.
    fn add_peer(&mut self, addr: &[u8]) -> Result<PeerHandle, Error>;

    /// Forgets a peer added with [`Domain::add_peer`]: its handle is not used again by the
    /// engine. The engine has already failed everything it had for the peer; operations
    /// still in flight to it may complete or fail later as usual. The default does nothing
    /// (the backend keeps the peer's resources until the domain closes).
    fn remove_peer(&mut self, _peer: PeerHandle) {}

    /// Starts bringing back a peer the engine marked down (its operations failed with
    /// [`FailCause::PeerLost`], the backend reported [`Completion::PeerDown`], or an operation
    /// outlived `op_timeout`) when the application adds its address again
    /// (`Engine::add_peer`, same incarnation): the backend re-opens what it keeps per peer (a
    /// liveness watch, a connection).
    ///
    /// A backend that can tell at once whether the peer answers (tcp connects to its liveness
    /// port, shm opens a pidfd of its process) finishes here: `Ok` means the peer is back,
    /// `Err` that it does not answer (its process is gone), and [`Domain::revival`] keeps its
    /// default. A backend whose answer takes a round trip (verbs: a handshake) only starts
    /// here and must not wait: `Ok` means started, and the engine asks [`Domain::revival`]
    /// after each of its passes until the outcome is known. The engine keeps the peer down
    /// meanwhile. The default has nothing to re-open and succeeds.
    fn revive_peer(&mut self, _peer: PeerHandle) -> Result<(), Error> {
        Ok(())
    }

    /// Where the revival of `peer` that [`Domain::revive_peer`] started stands. Asked by the
    /// engine after every pass (after [`Domain::poll`]) while it is [`Revival::Pending`]; it
    /// must become [`Revival::Up`] or [`Revival::Failed`] within a bound of the backend's own
    /// (verbs: `VerbsConfig::revive_timeout`), and [`Domain::timer`] must wake a sleeping
    /// reactor meanwhile. A backend that answers in `revive_peer` keeps the default: `Up`.
    fn revival(&mut self, _peer: PeerHandle) -> Revival {
        Revival::Up
    }

    /// Posts one operation. See [`PostError`] for what a refusal means.
    ///
    /// # Safety
    ///
    /// The memory named by `op` must have been registered with this domain (its `desc` comes
    /// from that registration) and must stay valid until the operation's completion has been
    /// returned by [`Domain::poll`].
    unsafe fn post(&mut self, token: u64, op: &Op) -> Result<(), PostError>;

    /// Hands every operation accepted by [`Domain::post`] since the last call to the NIC.
    ///
    /// A backend may defer ringing the NIC's doorbell in `post` and chain the work requests
    /// of a batch into one submission here (verbs: one `ibv_post_send` with linked work
    /// requests per queue pair). The reactor calls `flush` after every round of posts, before
    /// polling or sleeping. An operation the NIC then refuses still produces its one
    /// completion: a [`Completion::Failed`]. The default does nothing (every post already
    /// reached the NIC).
    fn flush(&mut self) {}

    /// Appends up to `max` completions to `out`; returns how many it appended. Never blocks.
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, Error>;

    /// A file descriptor that becomes readable when completions may be available, or `None`
    /// if the backend cannot wake a sleeping thread.
    fn wait_fd(&self) -> Option<RawFd>;

    /// Prepares to sleep on [`Domain::wait_fd`]. Returns `false` when completions are already
    /// pending and the caller must poll instead of sleeping.
    fn arm(&mut self) -> bool;

    /// Called after `wait_fd` was seen readable, before polling; also by a watcher
    /// (`Engine::completion_wakeups`) that cannot tell which fd woke it, so it must return
    /// at once when nothing is pending.
    fn ack_wakeup(&mut self);

    /// The longest a sleeping caller may wait before calling [`Domain::poll`] again even if
    /// `wait_fd` stays quiet: the backend's own timers (verbs: re-sending a connection
    /// handshake that may have been lost, and its timeout; the next keep-alive probe of an
    /// idle peer). `None` (the default): no timer.
    fn timer(&self) -> Option<std::time::Duration> {
        None
    }
}

/// Whether a completion's `errno` means its peer is unreachable (refused, reset, gone): the
/// engine then marks the peer down. A backend whose provider reports such a cause only as
/// its own error code (libfabric's `prov_errno`) passes that code on instead.
pub(crate) fn is_peer_errno(errno: i32) -> bool {
    matches!(
        errno,
        libc::ECONNREFUSED
            | libc::ECONNRESET
            | libc::ECONNABORTED
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::ETIMEDOUT
            | libc::ENOTCONN
            | libc::EPIPE
            | libc::EHOSTDOWN
    )
}

impl fmt::Display for MemoryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryLocation::Host => f.write_str("host"),
            MemoryLocation::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}
