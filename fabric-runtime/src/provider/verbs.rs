//! The ibverbs backend: reliable-connected (RC) queue pairs on one RDMA device and port.
//!
//! ```text
//!   VerbsDomain ──▶ peers[h]: data QP ──▶ imm_srq ◀── `recv_slots` zero-length receives (no memory)
//!       │                     msg QP  ──▶ msg_srq ◀── `msg_slots` slots of `max_msg_size` (registered)
//!       │                     (both QPs: send + recv CQ ──▶ cq ──events──▶ channel = wait_fd)
//!       ├──▶ ud: UD QP (connection handshake)
//!       ├──▶ mrs (user registrations)
//!       └──▶ pd ──▶ context (device)        PeerHandle = index into `peers`
//! ```
//!
//! # Objects and teardown
//!
//! Every verbs object is wrapped in an owner whose `Drop` destroys it, and a child holds an
//! `Arc` of each parent it needs (QP → CQ, SRQ, PD; CQ → channel → context; MR/AH/SRQ → PD;
//! PD → context), so destruction order — QPs, SRQs, CQ, channel, MRs, PD, device context — is
//! guaranteed by ownership whatever order the fields of [`VerbsDomain`] drop in (their order
//! matches it anyway). Drop never panics; a failed destroy is logged.
//!
//! # Two RC QPs per peer, two SRQs
//!
//! An incoming `RDMA_WRITE_WITH_IMM` (imm-only writes included) consumes one receive of the
//! target QP's receive queue but writes no receive buffer, so a **zero-length** receive
//! (`num_sge = 0`, no memory) is enough for it. An incoming `SEND` is placed in whatever
//! receive is at the head of the queue, and in a zero-length one it is a length error that
//! kills the connection. The two kinds therefore never share a receive queue: each peer has
//!
//! * a **data QP**, attached to the **imm SRQ** (`VerbsConfig::recv_slots` zero-length
//!   receives, shared by every peer's data QP), which carries every write, write with
//!   immediate, imm-only write and read ([`Op::Write`], [`Op::Read`]); and
//! * a **message QP**, attached to the **message SRQ** (`VerbsConfig::msg_slots` slots of
//!   `max_msg_size` bytes in one registered pool, shared by every peer's message QP), which
//!   carries [`Op::Send`] only.
//!
//! With the defaults that is 2048 imm receives that cost no memory, and 64 x 8 KiB = 512 KiB
//! registered for messages (one SRQ serving both kinds needed its 2048 entries to be 8 KiB
//! slots: 16 MiB). [`VerbsDomain::receive_queues`] reports both.
//!
//! * `IBV_WC_RECV_RDMA_WITH_IMM` on the imm SRQ → [`Completion::Imm`]; the SRQ is one
//!   receive short until the next re-post.
//! * `IBV_WC_RECV` (a SEND) on the message SRQ → the bytes are copied into the oldest engine
//!   buffer handed in with [`Op::Recv`] (those are kept in a queue and never posted to the
//!   NIC), which then completes as [`Completion::Recv`] with `src` = the handle of the peer
//!   owning the receiving message QP (both QPNs map to the peer); the slot goes back to the
//!   SRQ. If the engine has no buffer posted, the slot is held (not re-posted) until one
//!   arrives. Cost: one copy of at most `max_msg_size` bytes per two-sided message, which only
//!   carries small control messages.
//!
//! Both SRQs are topped up at the end of every [`Domain::poll`], each with one chained
//! `ibv_post_srq_recv`. A burst of immediates (or messages) larger than what the poller keeps
//! up with makes the receiving HCA answer "receiver not ready" (RNR NAK); RC QPs are set up
//! with `rnr_retry = 7` (retry forever), so the sender waits and retries instead of failing:
//! a burst of 10,000 imm writes slows down but never errors. A SEND larger than the peer's
//! `max_msg_size` (both are in the address) is refused at post time.
//!
//! Ordering: operations on one QP keep their order, so writes and reads to a peer are ordered
//! among themselves and so are sends, but a send is **not** ordered with the writes posted
//! before it (another QP). The engine promises no such order either (libfabric RDM does not
//! have it): wait for a write's completion before sending a message that announces it.
//!
//! The CQ holds every completion of both SRQs, the UD QP and the sends: `cq_depth` must
//! exceed `recv_slots + msg_slots + 2 * UD_SLOTS`, and what is left bounds the send work
//! requests in flight over all QPs (beyond it, and beyond `sq_depth` on one QP, `post`
//! answers [`PostError::Again`]). Posts are chained per QP and handed to the NIC with one
//! `ibv_post_send` per QP in [`Domain::flush`] (one doorbell per QP per flush).
//!
//! An error completion on either QP fails the peer: the first failure completes with its
//! status's errno, the peer is marked failed with that cause, both of its QPs are moved to
//! the error state, and every work request flushed behind it (on either QP) completes as
//! `ECONNRESET` naming the first cause; later posts to the peer fail with
//! [`Error::PeerUnreachable`].
//!
//! # Connection setup: a UD handshake
//!
//! [`Domain::address`] is plain bytes ([`PeerAddr`]): magic, version, active MTU, LID, GID,
//! the QPN and Q_Key of a UD QP, and `max_msg_size`. [`Domain::add_peer`] creates both RC QPs
//! (INIT), returns the peer's handle at once and sends a REQ (our data QPN + PSN and message
//! QPN + PSN) to the peer's UD QP, re-sent every [`HANDSHAKE_RETRY`] from `poll` (and
//! [`Domain::timer`] wakes a sleeping reactor for it) until a REP (the peer's two QPNs and
//! PSNs) arrives; then both QPs go RTR → RTS (path MTU = the smaller active MTU, GRH routing
//! with the chosen GID index), and the peer is Connected only when both are. Posts to a peer
//! still connecting return [`PostError::Again`]; after `VerbsConfig::connect_timeout` they
//! fail with [`Error::PeerUnreachable`]. The address and handshake carry a version (2: two QPs
//! per peer); an address of another version is refused by [`Domain::add_peer`] at once
//! ([`Error::Malformed`] naming both versions), and a handshake of another version is ignored
//! with a warning.
//!
//! A REQ from a peer never added here creates that peer (with a new handle) and is answered
//! at once: a peer may be added on one side only. Simultaneous open (both sides add each
//! other) is resolved without a second pair of QPs: a side that is connecting and receives
//! the other's REQ accepts it (connecting its *existing* QPs to the requester's) only if its
//! own address is the larger; the smaller side ignores the REQ and the larger side answers the
//! smaller side's REQ with a REP carrying the same QPs. Duplicated or late REQs for QPs we are
//! already connected to are answered again with the same REP.
//!
//! # Memory
//!
//! Registration is `ibv_reg_mr_iova2` with `LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ`, plus
//! `RELAXED_ORDERING` (an optional access flag the kernel drops if unsupported; if the
//! registration is still refused, it is retried without, once for the domain's lifetime).
//! `remote_base` is the virtual address. [`MemoryLocation::Cuda`] goes through
//! `ibv_reg_dmabuf_mr`, which needs a dma-buf file descriptor of the GPU range
//! (`cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ...)` of the
//! CUDA driver API); this crate does not link the CUDA driver yet, so the fd source returns
//! [`Error::Unsupported`] and the dma-buf registration itself (compiled, below) is not reached.
//!
//! # Immediates
//!
//! `imm_data` is big-endian on the wire (`__be32` in both `ibv_send_wr` and `ibv_wc`);
//! [`imm_to_wire`] / [`imm_from_wire`] convert, so the target's [`Completion::Imm`] equals what
//! was posted.
//!
//! The bytes of the address ([`PeerAddr`]) and of the handshake messages are pure code, in
//! [`crate::pure::verbs_wire`].
//!
//! All `unsafe` of the verbs backend lives in this module; every verbs return code goes
//! through `check` / `check_ptr`.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use super::{Completion, Domain, LocalSlice, MemoryLocation, Op, PeerHandle, PostError, Registration};
use crate::error::Error;
// The address and handshake bytes are pure code, beside the other wire formats.
use crate::pure::verbs_wire::{Handshake, HsKind, HANDSHAKE_LEN};
pub use crate::pure::verbs_wire::{PeerAddr, ADDR_LEN};

/// Default largest two-sided message, in bytes (the engine's default too).
pub const DEFAULT_MAX_MSG_SIZE: usize = 8192;
/// How often a connecting peer's REQ is re-sent.
pub const HANDSHAKE_RETRY: Duration = Duration::from_millis(100);

/// The transport name stored in descriptors.
const TRANSPORT: &str = "verbs";
/// Q_Key of the handshake UD QPs (high bit clear: not a privileged Q_Key).
const HANDSHAKE_QKEY: u32 = 0x1f4b_5642;
/// UD receive slots for handshake messages, and UD send slots.
const UD_SLOTS: usize = 64;
/// Bytes per UD slot: the 40-byte GRH the HCA puts in front of every UD receive + a message.
const UD_SLOT_SIZE: usize = 128;
const GRH_LEN: usize = 40;
/// Work completions read per `ibv_poll_cq` call.
const CQ_BATCH: usize = 32;

/// wr_id kinds (top byte); the low 32 bits are an index in the kind's own table.
const WR_OP: u64 = 1 << 56;
/// A zero-length receive of the imm SRQ (no index: the entries are interchangeable).
const WR_IMM_RECV: u64 = 2 << 56;
const WR_UD_RECV: u64 = 3 << 56;
const WR_UD_SEND: u64 = 4 << 56;
/// A message slot of the message SRQ.
const WR_MSG_RECV: u64 = 5 << 56;
const WR_KIND_MASK: u64 = 0xff << 56;

extern "C" {
    /// Exported by libibverbs ≥ 1.11 (rdma-core 31); `ibv_query_gid_ex` is its inline wrapper,
    /// which bindgen cannot see.
    fn _ibv_query_gid_ex(
        context: *mut sys::ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut sys::ibv_gid_entry,
        flags: u32,
        entry_size: usize,
    ) -> c_int;
}

/// How to open a [`VerbsDomain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Device name (`"rxe0"`, `"mlx5_0"`); `None`: the first device with an ACTIVE port.
    pub device: Option<String>,
    /// Port number; `None`: the first ACTIVE port of the device.
    pub port: Option<u8>,
    /// GID index; `None`: chosen by type and address (RoCEv2 with an IPv4-mapped address
    /// first, see [`select_gid`]).
    pub gid_index: Option<u32>,
    /// Largest [`Op::Send`] accepted, and the size of each message receive slot.
    pub max_msg_size: usize,
    /// Zero-length receives kept posted on the imm SRQ, which every peer's data QP shares:
    /// one is consumed per `RDMA_WRITE_WITH_IMM` that arrives (capped by the device's
    /// `max_srq_wr`). They name no memory.
    pub recv_slots: usize,
    /// Message receive slots of `max_msg_size` bytes kept posted on the message SRQ, which
    /// every peer's message QP shares: one is consumed per arriving [`Op::Send`] (capped by
    /// the device's `max_srq_wr`). These are the backend's only registered receive memory.
    pub msg_slots: usize,
    /// Send queue depth of each RC QP, data and message QP alike (capped by the device's
    /// `max_qp_wr`).
    pub sq_depth: u32,
    /// Completion queue size (capped by the device's `max_cqe`). It must hold one entry per
    /// receive of both SRQs and of the UD QP, plus every send in flight: what is left after
    /// the receives bounds the sends in flight over all QPs, so that the CQ can never overflow.
    pub cq_depth: u32,
    /// How long a peer may take to answer the connection handshake.
    pub connect_timeout: Duration,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            port: None,
            gid_index: None,
            max_msg_size: DEFAULT_MAX_MSG_SIZE,
            recv_slots: 2048,
            msg_slots: 64,
            sq_depth: 512,
            cq_depth: 16384,
            connect_timeout: Duration::from_secs(30),
        }
    }
}

impl VerbsConfig {
    /// The config for an engine provider name: `"verbs"` or `"verbs:DEVICE"`.
    pub fn from_provider_name(name: &str) -> Option<VerbsConfig> {
        let device = match name.strip_prefix("verbs") {
            Some("") => None,
            Some(rest) => Some(rest.strip_prefix(':').filter(|d| !d.is_empty())?.to_owned()),
            None => return None,
        };
        Some(VerbsConfig { device, ..VerbsConfig::default() })
    }
}

// ---------------------------------------------------------------------------------------------
// Return codes: the one place verbs failures become errors.
// ---------------------------------------------------------------------------------------------

fn os_error(call: &'static str, errno: i32) -> Error {
    Error::Provider { call, errno, message: std::io::Error::from_raw_os_error(errno).to_string() }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Maps a verbs return code. Verbs calls return `0` on success and either a positive errno
/// (`ibv_post_send`, `ibv_modify_qp`, ...) or `-1` with `errno` set (`ibv_get_cq_event`, ...)
/// or a negative errno on failure; all three are handled here.
fn check(call: &'static str, ret: c_int) -> Result<(), Error> {
    match ret {
        0 => Ok(()),
        r if r > 0 => Err(os_error(call, r)),
        -1 => Err(os_error(call, last_errno())),
        r => Err(os_error(call, r.saturating_neg())),
    }
}

/// Maps a pointer-returning verbs call: NULL is a failure with `errno` set.
fn check_ptr<T>(call: &'static str, p: *mut T) -> Result<NonNull<T>, Error> {
    NonNull::new(p).ok_or_else(|| {
        let e = last_errno();
        os_error(call, if e == 0 { libc::EIO } else { e })
    })
}

/// The immediate as it goes into `ibv_send_wr.imm_data` (network byte order).
pub fn imm_to_wire(imm: u32) -> u32 {
    imm.to_be()
}

/// The immediate from `ibv_wc.imm_data` (network byte order) as the sender posted it.
pub fn imm_from_wire(wire: u32) -> u32 {
    u32::from_be(wire)
}

/// An errno-like code for a failed work completion status, so that the engine can tell a
/// dead peer (`ETIMEDOUT`, `ECONNREFUSED`, `ECONNRESET`) from a bad request.
fn status_errno(status: u32) -> i32 {
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

fn status_str(status: u32) -> String {
    // SAFETY: ibv_wc_status_str accepts any value and returns a static NUL-terminated string.
    let p = unsafe { sys::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("work completion status {status}");
    }
    // SAFETY: non-null static C string, see above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

// ---------------------------------------------------------------------------------------------
// GID choice. (The address and handshake bytes are in `pure::verbs_wire`.)
// ---------------------------------------------------------------------------------------------

// A handshake (behind the GRH the HCA prepends) fits one UD receive slot.
const _: () = assert!(GRH_LEN + HANDSHAKE_LEN <= UD_SLOT_SIZE);

/// The type of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    Ib,
    RoceV1,
    RoceV2,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    pub gid_type: GidType,
    pub gid: [u8; 16],
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10] == [0; 10] && gid[10] == 0xff && gid[11] == 0xff
}

fn is_link_local(gid: &[u8; 16]) -> bool {
    gid[0] == 0xfe && gid[1] & 0xc0 == 0x80
}

/// Chooses the GID index to route with: RoCEv2 with an IPv4-mapped address first (routable,
/// what `rdma link add ... type rxe netdev ethX` gives for an IPv4 interface), then RoCEv2
/// with a global IPv6 address, RoCEv2 link-local, InfiniBand, then RoCEv1 in the same order.
/// All-zero (empty) entries are never chosen; ties go to the lowest index.
pub fn select_gid(entries: &[GidEntry]) -> Option<u32> {
    let rank = |e: &GidEntry| -> u32 {
        let addr = if is_ipv4_mapped(&e.gid) {
            0
        } else if !is_link_local(&e.gid) {
            1
        } else {
            2
        };
        match e.gid_type {
            GidType::RoceV2 => addr,
            GidType::Ib => 3,
            GidType::RoceV1 => 4 + addr,
        }
    };
    entries.iter().filter(|e| e.gid != [0; 16]).min_by_key(|e| (rank(e), e.index)).map(|e| e.index)
}

/// Parses a `gid_attrs/types/N` sysfs file ("RoCE v2", "IB/RoCE v1").
fn parse_gid_type(text: &str) -> Option<GidType> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("RoCE v2") {
        Some(GidType::RoceV2)
    } else if t.eq_ignore_ascii_case("IB/RoCE v1") || t.eq_ignore_ascii_case("RoCE v1") {
        Some(GidType::RoceV1)
    } else if t.eq_ignore_ascii_case("IB") {
        Some(GidType::Ib)
    } else {
        None
    }
}

// ---------------------------------------------------------------------------------------------
// Owned verbs objects. Each holds an Arc of its parents so that they outlive it.
// ---------------------------------------------------------------------------------------------

macro_rules! owned {
    ($(#[$m:meta])* $name:ident, $t:ty, $destroy:path, $call:literal { $($field:ident: $ft:ty),* }) => {
        $(#[$m])*
        struct $name {
            ptr: NonNull<$t>,
            $($field: $ft,)*
        }

        impl $name {
            fn as_ptr(&self) -> *mut $t {
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
struct Cq {
    ptr: NonNull<sys::ibv_cq>,
    channel: Arc<Channel>,
}

impl Cq {
    fn as_ptr(&self) -> *mut sys::ibv_cq {
        self.ptr.as_ptr()
    }

    /// Reads and acknowledges every event queued on the (non-blocking) channel.
    fn ack_events(&self) {
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
struct SlotPool {
    mr: Mr,
    buf: Buffer,
    slot_size: usize,
    count: usize,
}

impl SlotPool {
    fn new(pd: &Arc<Pd>, slot_size: usize, count: usize) -> Result<SlotPool, Error> {
        let buf = Buffer::zeroed(slot_size * count)?;
        let access = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        let mr = reg_mr(pd, buf.addr(), slot_size * count, access)?;
        Ok(SlotPool { mr, buf, slot_size, count })
    }

    fn sge(&self, slot: usize, len: usize) -> sys::ibv_sge {
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
    unsafe fn bytes(&self, slot: usize, len: usize) -> &[u8] {
        let len = len.min(self.slot_size);
        // SAFETY: inside the buffer; the caller guarantees nobody writes it meanwhile.
        unsafe {
            std::slice::from_raw_parts((self.buf.addr() + (slot * self.slot_size) as u64) as *const u8, len)
        }
    }
}

fn reg_mr(pd: &Arc<Pd>, addr: u64, len: usize, access: u32) -> Result<Mr, Error> {
    // SAFETY: pd is live; the caller guarantees addr..addr+len is valid memory that stays
    // allocated while the MR exists.
    let p = unsafe { sys::ibv_reg_mr_iova2(pd.as_ptr(), addr as *mut c_void, len, addr, access) };
    Ok(Mr { ptr: check_ptr("ibv_reg_mr", p)?, _pd: pd.clone() })
}

// ---------------------------------------------------------------------------------------------
// The domain.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
enum PeerState {
    /// Our REQ is out; `last` is when it was last sent.
    Connecting {
        since: Instant,
        last: Option<Instant>,
    },
    /// Both QPs are in RTS, towards the peer's data QP `remote_qpn` and message QP.
    Connected {
        remote_qpn: u32,
        remote_msg_qpn: u32,
    },
    Failed(String),
}

/// Which of a peer's two RC QPs an operation travels on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// Writes (with or without immediate), imm-only writes, reads. Receives from the imm SRQ.
    Data = 0,
    /// Two-sided sends. Receives from the message SRQ.
    Msg = 1,
}

/// One RC QP of a peer, with its send-side bookkeeping.
struct PeerQp {
    qp: Qp,
    qpn: u32,
    psn: u32,
    /// Send WRs posted on the QP and not completed (chained ones included).
    outstanding: u32,
    /// Work requests accepted by `post` and not yet handed to the NIC: `flush` links them
    /// and posts them with one `ibv_post_send` (one doorbell per QP for the batch).
    chain: Vec<ChainedWr>,
}

struct Peer {
    /// Indexed by [`Lane`]: the data QP, then the message QP.
    qps: [PeerQp; 2],
    remote: PeerAddr,
    state: PeerState,
    /// To the peer's UD QP, made on first use.
    ah: Option<Ah>,
}

impl Peer {
    fn lane(&mut self, lane: Lane) -> &mut PeerQp {
        &mut self.qps[lane as usize]
    }

    fn has_chain(&self) -> bool {
        self.qps.iter().any(|q| !q.chain.is_empty())
    }
}

/// One deferred send work request. The `next` and `sg_list` pointers are set by `flush`,
/// once the vector no longer moves.
struct ChainedWr {
    wr: sys::ibv_send_wr,
    sge: sys::ibv_sge,
}

/// What a zero-length receive of the imm SRQ looks like: no scatter list, no memory.
const IMM_RECV_WR: sys::ibv_recv_wr =
    sys::ibv_recv_wr { wr_id: WR_IMM_RECV, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 0 };

/// What a domain keeps posted to receive with ([`VerbsDomain::receive_queues`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceiveQueues {
    /// Receives of the imm SRQ (shared by every peer's data QP), kept replenished.
    pub imm_entries: usize,
    /// Scatter entries of each imm receive: 0, they name no memory.
    pub imm_entry_sges: usize,
    /// Message slots of the message SRQ (shared by every peer's message QP).
    pub msg_entries: usize,
    /// Bytes of each message slot (`max_msg_size`).
    pub msg_entry_bytes: usize,
    /// Backend memory registered for receiving: the message slots plus the handshake's UD
    /// slots. Nothing is registered for immediates.
    pub registered_bytes: usize,
}

/// The most work requests chained on one QP before `post` rings the doorbell by itself.
const MAX_CHAIN: usize = 64;

/// One ibverbs device port: a PD, one CQ with a completion channel, two SRQs (zero-length
/// imm receives, message slots), a UD QP for the handshake, and two RC QPs per peer. See the
/// module docs.
///
/// No `Drop` impl is needed: fields drop in declaration order — QPs (peers, UD), SRQs, CQ
/// (acking its pending events first), channel, MRs, PD, device context — and the `Arc`s
/// inside enforce that order in any case. Engine receive buffers were never given to the NIC,
/// so there is nothing to cancel.
pub struct VerbsDomain {
    peers: Vec<Peer>,
    ud_qp: Qp,
    imm_srq: Arc<Srq>,
    msg_srq: Arc<Srq>,
    cq: Arc<Cq>,
    _channel: Arc<Channel>,
    mrs: HashMap<u64, Mr>,
    msg_pool: SlotPool,
    ud_pool: SlotPool,
    pd: Arc<Pd>,
    _ctx: Arc<Context>,

    device: String,
    port: u8,
    gid_index: u32,
    me: PeerAddr,
    address: Vec<u8>,
    cfg: VerbsConfig,
    sq_depth: u32,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    relaxed_ordering: bool,
    wait_fd: RawFd,
    peer_by_addr: HashMap<PeerAddr, usize>,
    peer_by_qpn: HashMap<u32, usize>,
    /// In-flight send-side operations by wr_id index: (engine token, peer index, QP).
    ops: Vec<Option<(u64, usize, Lane)>>,
    free_ops: Vec<u32>,
    /// Send WRs in flight over all QPs, and the most allowed (so the CQ cannot overflow).
    outstanding: usize,
    max_outstanding: usize,
    /// Zero-length receives the imm SRQ is short of (re-posted in one chain by `poll`), and
    /// its depth.
    imm_missing: usize,
    imm_depth: usize,
    /// Scratch for re-posting imm receives (kept to avoid an allocation per poll).
    imm_wrs: Vec<sys::ibv_recv_wr>,
    /// Message slots not on the message SRQ (to re-post), and slots holding a message that
    /// waits for an engine buffer: (slot, len, peer).
    free_slots: Vec<u32>,
    held: VecDeque<(u32, usize, Option<PeerHandle>)>,
    /// Engine receive buffers ([`Op::Recv`]), oldest first.
    engine_recvs: VecDeque<(u64, LocalSlice)>,
    /// UD send slots not in use.
    ud_send_free: Vec<u32>,
    /// Work completions read by `arm` and not yet classified.
    lookahead: VecDeque<Wc>,
    /// Completions classified and not yet returned (over the caller's `max`).
    ready: VecDeque<Completion>,
    /// Peers whose `chain` is not empty.
    chained: Vec<usize>,
}

// SAFETY: every verbs object is owned (see `owned!`); the domain is used by one thread at a
// time (`&mut self` everywhere, not Sync).
unsafe impl Send for VerbsDomain {}

impl fmt::Debug for VerbsDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsDomain")
            .field("device", &self.device)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("ud_qpn", &self.me.ud_qpn)
            .field("peers", &self.peers.len())
            .field("registrations", &self.mrs.len())
            .finish_non_exhaustive()
    }
}

/// The plain fields of an `ibv_wc` we use.
#[derive(Debug, Clone, Copy)]
struct Wc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    vendor_err: u32,
    byte_len: u32,
    imm: u32,
    qp_num: u32,
}

impl Wc {
    fn from_raw(w: &sys::ibv_wc) -> Wc {
        // SAFETY: reading the union's u32 member is always defined (both members are u32).
        let imm = unsafe { w.imm_data_invalidated_rkey_union.imm_data };
        Wc {
            wr_id: w.wr_id,
            status: w.status,
            opcode: w.opcode,
            vendor_err: w.vendor_err,
            byte_len: w.byte_len,
            imm,
            qp_num: w.qp_num,
        }
    }
}

fn not_found(reason: String) -> Error {
    Error::ProviderNotFound { provider: TRANSPORT.into(), reason: format!("no RDMA device: {reason}") }
}

/// A 24-bit random PSN.
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: b is writable for 4 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    let r = if n == 4 {
        u32::from_ne_bytes(b)
    } else {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        t.subsec_nanos() ^ std::process::id()
    };
    r & 0x00ff_ffff
}

/// Device and port chosen by `open`.
struct Chosen {
    ctx: Arc<Context>,
    name: String,
    port: u8,
    attr: sys::ibv_device_attr,
    port_attr: sys::ibv_port_attr,
}

fn query_port(ctx: &Context, port: u8) -> Result<sys::ibv_port_attr, Error> {
    // SAFETY: all-zero is a valid ibv_port_attr (plain integers).
    let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is live; pa is a valid out-struct of the size the library expects.
    check("ibv_query_port", unsafe { sys::___ibv_query_port(ctx.as_ptr(), port, &mut pa) })?;
    Ok(pa)
}

/// Opens the configured device (or the first with an ACTIVE port) and picks the port.
fn choose_device(cfg: &VerbsConfig) -> Result<Chosen, Error> {
    let mut n: c_int = 0;
    // SAFETY: n is a valid out-pointer; the list is freed below.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(not_found(format!("ibv_get_device_list failed: {e} (no RDMA support in this kernel?)")));
    }
    struct List(*mut *mut sys::ibv_device);
    impl Drop for List {
        fn drop(&mut self) {
            // SAFETY: the list came from ibv_get_device_list and is freed once; contexts opened
            // from it stay valid.
            unsafe { sys::ibv_free_device_list(self.0) }
        }
    }
    let list = List(list);
    let mut seen = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds n device pointers.
        let dev = unsafe { *list.0.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a live device of the list; the name is a NUL-terminated string in it.
        let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
        if cfg.device.as_ref().is_some_and(|d| *d != name) {
            seen.push(name);
            continue;
        }
        // SAFETY: dev is a live device of the list.
        let ctx = match check_ptr("ibv_open_device", unsafe { sys::ibv_open_device(dev) }) {
            Ok(p) => Arc::new(Context { ptr: p }),
            Err(e) => {
                tracing::debug!(device = %name, error = %e, "cannot open RDMA device");
                seen.push(format!("{name} (cannot open: {e})"));
                continue;
            }
        };
        // SAFETY: all-zero is a valid ibv_device_attr.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is live, attr a valid out-struct.
        check("ibv_query_device", unsafe { sys::ibv_query_device(ctx.as_ptr(), &mut attr) })?;
        let ports: Vec<u8> = match cfg.port {
            Some(p) => vec![p],
            None => (1..=attr.phys_port_cnt).collect(),
        };
        for port in ports {
            match query_port(&ctx, port) {
                Ok(pa) if pa.state == sys::ibv_port_state::IBV_PORT_ACTIVE => {
                    return Ok(Chosen { ctx, name, port, attr, port_attr: pa });
                }
                Ok(pa) => seen.push(format!("{name} port {port} (state {})", pa.state)),
                Err(e) => seen.push(format!("{name} port {port} ({e})")),
            }
        }
    }
    Err(not_found(if seen.is_empty() {
        match &cfg.device {
            Some(d) => format!("no device named {d:?} (none found)"),
            None => "ibv_get_device_list found none (load a driver: mlx5_ib, or rdma_rxe + `rdma link add`)"
                .into(),
        }
    } else {
        match &cfg.device {
            Some(d) => format!("{d:?} has no ACTIVE port (devices: {})", seen.join(", ")),
            None => format!("no ACTIVE port on any device ({})", seen.join(", ")),
        }
    }))
}

/// The GID table of a port, with types (`ibv_query_gid_ex`, else `ibv_query_gid` + sysfs).
fn gid_table(ctx: &Context, device: &str, port: u8, len: i32) -> Vec<GidEntry> {
    let mut out = Vec::new();
    for index in 0..len.max(0) as u32 {
        // SAFETY: all-zero is a valid ibv_gid_entry.
        let mut e: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is live; e is a valid out-struct of the size passed.
        let ret = unsafe {
            _ibv_query_gid_ex(ctx.as_ptr(), port.into(), index, &mut e, 0, std::mem::size_of_val(&e))
        };
        let entry = if ret == 0 {
            let gid_type = match e.gid_type {
                sys::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
                sys::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
                _ => GidType::Ib,
            };
            // SAFETY: raw is the byte view of the 16-byte GID union.
            Some(GidEntry { index, gid_type, gid: unsafe { e.gid.raw } })
        } else {
            // Older kernels: query the GID and read its type from sysfs.
            // SAFETY: all-zero is a valid ibv_gid.
            let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: ctx is live, gid a valid out-union.
            let r = unsafe { sys::ibv_query_gid(ctx.as_ptr(), port, index as c_int, &mut gid) };
            let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
            let t = std::fs::read_to_string(path).ok().and_then(|t| parse_gid_type(&t));
            match (r, t) {
                // SAFETY: raw is the byte view of the GID union.
                (0, Some(gid_type)) => Some(GidEntry { index, gid_type, gid: unsafe { gid.raw } }),
                _ => None,
            }
        };
        if let Some(e) = entry.filter(|e| e.gid != [0; 16]) {
            out.push(e);
        }
    }
    out
}

impl VerbsDomain {
    /// Opens the device and port, the PD, CQ + channel, the two SRQs (with their receives
    /// posted) and the handshake UD QP.
    ///
    /// Errors: [`Error::ProviderNotFound`] ("no RDMA device: ...") if there is no usable
    /// device or port, [`Error::Config`] for impossible sizes, [`Error::Provider`] if creating
    /// a verbs object fails.
    pub fn open(cfg: &VerbsConfig) -> Result<VerbsDomain, Error> {
        if cfg.max_msg_size == 0 || cfg.recv_slots == 0 || cfg.msg_slots == 0 || cfg.sq_depth == 0 {
            return Err(Error::Config(
                "verbs max_msg_size, recv_slots, msg_slots and sq_depth must be non-zero".into(),
            ));
        }
        let max_msg_size = u32::try_from(cfg.max_msg_size)
            .map_err(|_| Error::Config(format!("max_msg_size {} exceeds 4 GiB", cfg.max_msg_size)))?;
        let Chosen { ctx, name, port, attr, port_attr } = choose_device(cfg)?;
        let gid_index = match cfg.gid_index {
            Some(i) => {
                // The index travels in a u8 field of the address handle and QP attributes
                // (`sgid_index`); an index outside the table would be silently wrong.
                let len = u32::try_from(port_attr.gid_tbl_len).unwrap_or(0).min(256);
                if i >= len {
                    return Err(Error::Config(format!(
                        "GID index {i} is outside {name} port {port}'s GID table (0..{len})"
                    )));
                }
                i
            }
            None => {
                let table = gid_table(&ctx, &name, port, port_attr.gid_tbl_len);
                select_gid(&table)
                    .ok_or_else(|| not_found(format!("{name} port {port} has no usable GID")))?
            }
        };
        // SAFETY: all-zero is a valid ibv_gid.
        let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is live, gid a valid out-union.
        check("ibv_query_gid", unsafe {
            sys::ibv_query_gid(ctx.as_ptr(), port, gid_index as c_int, &mut gid)
        })?;
        // SAFETY: raw is the byte view of the GID union.
        let gid = unsafe { gid.raw };
        if gid == [0u8; 16] {
            return Err(Error::Config(format!("GID index {gid_index} of {name} port {port} is empty")));
        }
        tracing::debug!(device = %name, port, gid_index, gid = ?gid, "verbs device chosen");

        let cap = |v: c_int, want: u64| want.min(u64::try_from(v).unwrap_or(0).max(1));
        let recv_slots = cap(attr.max_srq_wr, cfg.recv_slots as u64) as usize;
        let msg_slots = cap(attr.max_srq_wr, cfg.msg_slots as u64) as usize;
        let sq_depth = cap(attr.max_qp_wr, cfg.sq_depth.into()) as u32;
        let cq_depth = cap(attr.max_cqe, cfg.cq_depth.into()) as usize;
        // Every posted receive (both SRQs, the UD QP) and every UD send can complete at once.
        let reserved = recv_slots + msg_slots + 2 * UD_SLOTS;
        if cq_depth <= reserved {
            return Err(Error::Config(format!(
                "cq_depth {cq_depth} must exceed recv_slots + msg_slots + {} ({reserved})",
                2 * UD_SLOTS
            )));
        }

        // SAFETY: ctx is live.
        let pd_ptr = unsafe { sys::ibv_alloc_pd(ctx.as_ptr()) };
        let pd = Arc::new(Pd { ptr: check_ptr("ibv_alloc_pd", pd_ptr)?, _ctx: ctx.clone() });
        // SAFETY: ctx is live.
        let ch = check_ptr("ibv_create_comp_channel", unsafe { sys::ibv_create_comp_channel(ctx.as_ptr()) })?;
        let channel = Arc::new(Channel { ptr: ch, _ctx: ctx.clone() });
        // SAFETY: the channel is live; fd is its event fd.
        let wait_fd = unsafe { (*channel.as_ptr()).fd };
        // SAFETY: fcntl on a live fd we own (through the channel).
        let flags = unsafe { libc::fcntl(wait_fd, libc::F_GETFL) };
        // SAFETY: as above.
        check("fcntl(O_NONBLOCK)", unsafe { libc::fcntl(wait_fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
        // SAFETY: ctx and channel are live; cq_depth fits c_int (capped by max_cqe).
        let cq = unsafe {
            sys::ibv_create_cq(ctx.as_ptr(), cq_depth as c_int, ptr::null_mut(), channel.as_ptr(), 0)
        };
        let cq = Arc::new(Cq { ptr: check_ptr("ibv_create_cq", cq)?, channel: channel.clone() });

        let imm_srq = create_srq(&pd, recv_slots)?;
        let msg_srq = create_srq(&pd, msg_slots)?;

        let msg_pool = SlotPool::new(&pd, cfg.max_msg_size, msg_slots)?;
        let ud_pool = SlotPool::new(&pd, UD_SLOT_SIZE, 2 * UD_SLOTS)?;
        let ud_qp = create_qp(&pd, &cq, None, sys::ibv_qp_type::IBV_QPT_UD, UD_SLOTS as u32)?;
        // UD: INIT (with Q_Key) → RTR → RTS.
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = port;
        a.qkey = HANDSHAKE_QKEY;
        use sys::ibv_qp_attr_mask as m;
        modify_qp(
            &ud_qp,
            &mut a,
            m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_QKEY.0,
        )?;
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        modify_qp(&ud_qp, &mut a, m::IBV_QP_STATE.0)?;
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = random_psn();
        modify_qp(&ud_qp, &mut a, m::IBV_QP_STATE.0 | m::IBV_QP_SQ_PSN.0)?;
        // SAFETY: the QP is live.
        let ud_qpn = unsafe { (*ud_qp.as_ptr()).qp_num };

        let me = PeerAddr {
            mtu: port_attr.active_mtu as u8,
            lid: port_attr.lid,
            gid,
            ud_qpn,
            qkey: HANDSHAKE_QKEY,
            max_msg_size,
        };
        let mut d = VerbsDomain {
            peers: Vec::new(),
            ud_qp,
            imm_srq,
            msg_srq,
            cq,
            _channel: channel,
            mrs: HashMap::new(),
            msg_pool,
            ud_pool,
            pd,
            _ctx: ctx,
            device: name,
            port,
            gid_index,
            address: me.encode(),
            me,
            cfg: cfg.clone(),
            sq_depth,
            max_rd_atomic: attr.max_qp_init_rd_atom.clamp(1, 16) as u8,
            max_dest_rd_atomic: attr.max_qp_rd_atom.clamp(1, 16) as u8,
            relaxed_ordering: true,
            wait_fd,
            peer_by_addr: HashMap::new(),
            peer_by_qpn: HashMap::new(),
            ops: Vec::new(),
            free_ops: Vec::new(),
            outstanding: 0,
            max_outstanding: cq_depth - reserved,
            imm_missing: recv_slots,
            imm_depth: recv_slots,
            imm_wrs: Vec::with_capacity(recv_slots),
            free_slots: (0..msg_slots as u32).rev().collect(),
            held: VecDeque::new(),
            engine_recvs: VecDeque::new(),
            ud_send_free: (UD_SLOTS as u32..2 * UD_SLOTS as u32).rev().collect(),
            lookahead: VecDeque::new(),
            ready: VecDeque::new(),
            chained: Vec::new(),
        };
        d.replenish_srqs();
        if d.imm_missing > 0 || !d.free_slots.is_empty() {
            return Err(Error::Provider {
                call: "ibv_post_srq_recv",
                errno: libc::ENOMEM,
                message: format!(
                    "{} of {recv_slots} imm receives and {} of {msg_slots} message slots could not be posted",
                    d.imm_missing,
                    d.free_slots.len()
                ),
            });
        }
        for slot in 0..UD_SLOTS {
            d.post_ud_recv(slot)?;
        }
        // SAFETY: the CQ is live. Armed once here so a first event can wake the reactor.
        check("ibv_req_notify_cq", unsafe { sys::ibv_req_notify_cq(d.cq.as_ptr(), 0) })?;
        Ok(d)
    }

    /// The device name, port and GID index in use.
    pub fn device(&self) -> (&str, u8, u32) {
        (&self.device, self.port, self.gid_index)
    }

    /// The receive queues and the memory registered for them (for tests and diagnostics).
    pub fn receive_queues(&self) -> ReceiveQueues {
        ReceiveQueues {
            imm_entries: self.imm_depth,
            imm_entry_sges: IMM_RECV_WR.num_sge as usize,
            msg_entries: self.msg_pool.count,
            msg_entry_bytes: self.msg_pool.slot_size,
            registered_bytes: self.msg_pool.count * self.msg_pool.slot_size
                + self.ud_pool.count * self.ud_pool.slot_size,
        }
    }

    /// Whether the connection to `peer` is up (for tests and diagnostics).
    pub fn is_connected(&self, peer: PeerHandle) -> bool {
        self.peers.get(peer as usize).is_some_and(|p| matches!(p.state, PeerState::Connected { .. }))
    }

    fn post_ud_recv(&mut self, slot: usize) -> Result<(), Error> {
        let mut sge = self.ud_pool.sge(slot, UD_SLOT_SIZE);
        let mut wr = sys::ibv_recv_wr {
            wr_id: WR_UD_RECV | slot as u64,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the UD QP is live; wr and sge are valid for the call; the slot memory is
        // registered and owned by the domain.
        check("ibv_post_recv", unsafe { sys::ibv_post_recv(self.ud_qp.as_ptr(), &mut wr, &mut bad) })
    }

    /// Tops up both SRQs: the imm SRQ with zero-length receives, the message SRQ with every
    /// free message slot; one chain (one `ibv_post_srq_recv`) each.
    fn replenish_srqs(&mut self) {
        self.replenish_imm();
        self.replenish_msg();
    }

    /// Posts the zero-length receives the imm SRQ is short of, in one chain.
    fn replenish_imm(&mut self) {
        let n = self.imm_missing;
        if n == 0 {
            return;
        }
        let wrs = &mut self.imm_wrs;
        wrs.clear();
        // Zero-length: no scatter list, no memory. An RDMA_WRITE_WITH_IMM consumes the entry
        // and places its data by rkey; only the immediate comes back in the completion.
        wrs.resize(n, IMM_RECV_WR);
        let base = wrs.as_mut_ptr();
        for i in 0..n - 1 {
            // SAFETY: i + 1 < n = wrs.len(); the vector does not move until the post returns.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the SRQ is live; the chain lives in `imm_wrs` for the call; the entries name
        // no memory.
        let ret = unsafe { sys::ibv_post_srq_recv(self.imm_srq.as_ptr(), base, &mut bad) };
        let posted = if ret == 0 {
            n
        } else if bad.is_null() {
            0
        } else {
            (bad as usize - base as usize) / std::mem::size_of::<sys::ibv_recv_wr>()
        };
        if let Err(e) = check("ibv_post_srq_recv(imm)", ret) {
            tracing::warn!(error = %e, posted, of = n, "re-posting imm receives failed; will retry");
        }
        self.imm_missing -= posted.min(n);
    }

    /// Posts every free message slot on the message SRQ, in one chain.
    fn replenish_msg(&mut self) {
        if self.free_slots.is_empty() {
            return;
        }
        let n = self.free_slots.len();
        let mut sges: Vec<sys::ibv_sge> =
            self.free_slots.iter().map(|&s| self.msg_pool.sge(s as usize, self.msg_pool.slot_size)).collect();
        let mut wrs: Vec<sys::ibv_recv_wr> = self
            .free_slots
            .iter()
            .map(|&s| sys::ibv_recv_wr {
                wr_id: WR_MSG_RECV | s as u64,
                next: ptr::null_mut(),
                sg_list: ptr::null_mut(),
                num_sge: 1,
            })
            .collect();
        for i in 0..n {
            wrs[i].sg_list = &mut sges[i];
            if i + 1 < n {
                wrs[i].next = &mut wrs[i + 1];
            }
        }
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the SRQ is live; the chain and its SGEs live until the call returns; every
        // slot is registered backend memory not currently posted.
        let ret = unsafe { sys::ibv_post_srq_recv(self.msg_srq.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        if ret == 0 {
            self.free_slots.clear();
            return;
        }
        // Entries from `bad` on were not posted.
        let posted = if bad.is_null() {
            0
        } else {
            (bad as usize - wrs.as_ptr() as usize) / std::mem::size_of::<sys::ibv_recv_wr>()
        };
        if let Err(e) = check("ibv_post_srq_recv(msg)", ret) {
            tracing::warn!(error = %e, posted, of = n, "re-posting message slots failed; will retry");
        }
        self.free_slots.drain(..posted.min(n));
    }

    /// Sends a handshake message to `peer`'s UD QP (best effort: a lost one is re-sent).
    fn send_handshake(&mut self, peer: usize, msg: Handshake) {
        if self.peers[peer].ah.is_none() {
            match self.create_ah(&self.peers[peer].remote) {
                Ok(ah) => self.peers[peer].ah = Some(ah),
                Err(e) => {
                    tracing::warn!(error = %e, "creating an address handle for a peer failed");
                    return;
                }
            }
        }
        let Some(slot) = self.ud_send_free.pop() else {
            tracing::debug!("no UD send slot free; the handshake message will be re-sent");
            return;
        };
        let bytes = msg.encode();
        let mut sge = self.ud_pool.sge(slot as usize, bytes.len());
        // SAFETY: the slot is a free UD send slot inside the registered pool (no WR uses it).
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), sge.addr as *mut u8, bytes.len()) };
        let p = &self.peers[peer];
        let ah = p.ah.as_ref().map_or(ptr::null_mut(), |a| a.as_ptr());
        // SAFETY: all-zero is a valid ibv_send_wr (null pointers, zero integers).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_UD_SEND | u64::from(slot);
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.ud = sys::ud_t { ah, remote_qpn: p.remote.ud_qpn, remote_qkey: p.remote.qkey };
        let mut bad = ptr::null_mut();
        // SAFETY: UD QP and AH are live; wr/sge are valid for the call; the slot stays
        // reserved until its completion.
        let ret = unsafe { sys::ibv_post_send(self.ud_qp.as_ptr(), &mut wr, &mut bad) };
        if let Err(e) = check("ibv_post_send(UD)", ret) {
            tracing::debug!(error = %e, "sending a handshake message failed; it will be re-sent");
            self.ud_send_free.push(slot);
        }
    }

    fn create_ah(&self, remote: &PeerAddr) -> Result<Ah, Error> {
        let mut attr = self.ah_attr(remote);
        // SAFETY: pd is live; attr is valid for the call.
        let p = unsafe { sys::ibv_create_ah(self.pd.as_ptr(), &mut attr) };
        Ok(Ah { ptr: check_ptr("ibv_create_ah", p)?, _pd: self.pd.clone() })
    }

    fn ah_attr(&self, remote: &PeerAddr) -> sys::ibv_ah_attr {
        sys::ibv_ah_attr {
            grh: sys::ibv_global_route {
                dgid: sys::ibv_gid { raw: remote.gid },
                flow_label: 0,
                sgid_index: self.gid_index as u8,
                hop_limit: 64,
                traffic_class: 0,
            },
            dlid: remote.lid,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 1,
            port_num: self.port,
        }
    }

    /// An RC QP in INIT on `srq`.
    fn new_rc_qp(&self, srq: &Arc<Srq>) -> Result<PeerQp, Error> {
        let qp = create_qp(&self.pd, &self.cq, Some(srq), sys::ibv_qp_type::IBV_QPT_RC, self.sq_depth)?;
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = self.port;
        a.qp_access_flags = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        use sys::ibv_qp_attr_mask as m;
        modify_qp(
            &qp,
            &mut a,
            m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0,
        )?;
        // SAFETY: the QP is live.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        Ok(PeerQp { qp, qpn, psn: random_psn(), outstanding: 0, chain: Vec::new() })
    }

    /// A new peer with its data QP (on the imm SRQ) and message QP (on the message SRQ) in
    /// INIT; registered by address and by both QPNs.
    fn new_peer(&mut self, remote: PeerAddr, state: PeerState) -> Result<usize, Error> {
        let data = self.new_rc_qp(&self.imm_srq)?;
        let msg = self.new_rc_qp(&self.msg_srq)?;
        let idx = self.peers.len();
        self.peer_by_addr.insert(remote, idx);
        self.peer_by_qpn.insert(data.qpn, idx);
        self.peer_by_qpn.insert(msg.qpn, idx);
        self.peers.push(Peer { qps: [data, msg], remote, state, ah: None });
        Ok(idx)
    }

    /// Both QPs of `peer`: INIT → RTR → RTS towards the remote data QP `remote_qpn` (from
    /// `remote_psn`) and message QP `remote_msg_qpn` (from `remote_msg_psn`). The peer is
    /// Connected only when both are in RTS.
    fn connect(&mut self, peer: usize, msg: &Handshake) -> Result<(), Error> {
        if msg.msg_qpn == 0 || msg.msg_qpn > 0x00ff_ffff || msg.qpn == 0 || msg.qpn > 0x00ff_ffff {
            return Err(Error::Malformed {
                what: "verbs handshake",
                reason: format!("QPNs {:#x} / {:#x} are not 24-bit QP numbers", msg.qpn, msg.msg_qpn),
            });
        }
        self.connect_qp(peer, Lane::Data, msg.qpn, msg.psn)?;
        self.connect_qp(peer, Lane::Msg, msg.msg_qpn, msg.msg_psn)?;
        self.peers[peer].state = PeerState::Connected { remote_qpn: msg.qpn, remote_msg_qpn: msg.msg_qpn };
        let p = &self.peers[peer];
        tracing::debug!(
            peer,
            qpn = p.qps[0].qpn,
            msg_qpn = p.qps[1].qpn,
            remote_qpn = msg.qpn,
            remote_msg_qpn = msg.msg_qpn,
            "verbs peer connected"
        );
        Ok(())
    }

    /// One QP of `peer`: INIT → RTR → RTS towards the remote RC QP `remote_qpn`.
    fn connect_qp(&self, peer: usize, lane: Lane, remote_qpn: u32, remote_psn: u32) -> Result<(), Error> {
        let p = &self.peers[peer];
        let q = &p.qps[lane as usize];
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = u32::from(self.me.mtu.min(p.remote.mtu));
        a.dest_qp_num = remote_qpn;
        a.rq_psn = remote_psn & 0x00ff_ffff;
        a.max_dest_rd_atomic = self.max_dest_rd_atomic;
        a.min_rnr_timer = 1; // 0.01 ms: retry soon after the receiver re-posts its receives.
        a.ah_attr = self.ah_attr(&p.remote);
        use sys::ibv_qp_attr_mask as m;
        modify_qp(
            &q.qp,
            &mut a,
            m::IBV_QP_STATE.0
                | m::IBV_QP_AV.0
                | m::IBV_QP_PATH_MTU.0
                | m::IBV_QP_DEST_QPN.0
                | m::IBV_QP_RQ_PSN.0
                | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | m::IBV_QP_MIN_RNR_TIMER.0,
        )?;
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14; // 4.096 µs * 2^14 ≈ 67 ms per try
        a.retry_cnt = 7;
        a.rnr_retry = 7; // infinite: a receiver out of receives slows the sender, never fails it
        a.sq_psn = q.psn;
        a.max_rd_atomic = self.max_rd_atomic;
        modify_qp(
            &q.qp,
            &mut a,
            m::IBV_QP_STATE.0
                | m::IBV_QP_TIMEOUT.0
                | m::IBV_QP_RETRY_CNT.0
                | m::IBV_QP_RNR_RETRY.0
                | m::IBV_QP_SQ_PSN.0
                | m::IBV_QP_MAX_QP_RD_ATOMIC.0,
        )
    }

    /// A handshake message (REQ or REP) carrying both of our QPs.
    fn handshake(&self, peer: usize, kind: HsKind, echo_qpn: u32) -> Handshake {
        let [d, m] = &self.peers[peer].qps;
        Handshake { kind, from: self.me, qpn: d.qpn, psn: d.psn, echo_qpn, msg_qpn: m.qpn, msg_psn: m.psn }
    }

    fn reply(&mut self, peer: usize, echo_qpn: u32) {
        let msg = self.handshake(peer, HsKind::Rep, echo_qpn);
        self.send_handshake(peer, msg);
    }

    fn on_handshake(&mut self, msg: Handshake) {
        let from = msg.from;
        let known = self.peer_by_addr.get(&from).copied();
        match (msg.kind, known) {
            (HsKind::Req, None) => {
                // Added on the other side only: accept it as a new peer.
                let r = self
                    .new_peer(
                        from,
                        PeerState::Connecting { since: Instant::now(), last: Some(Instant::now()) },
                    )
                    .and_then(|idx| self.connect(idx, &msg).map(|()| idx));
                match r {
                    Ok(idx) => self.reply(idx, msg.qpn),
                    Err(e) => tracing::warn!(error = %e, "accepting a verbs connection failed"),
                }
            }
            (HsKind::Req, Some(idx)) => match self.peers[idx].state.clone() {
                PeerState::Connected { remote_qpn, remote_msg_qpn }
                    if remote_qpn == msg.qpn && remote_msg_qpn == msg.msg_qpn =>
                {
                    self.reply(idx, msg.qpn)
                }
                PeerState::Connected { remote_qpn, .. } => tracing::warn!(
                    remote_qpn,
                    req_qpn = msg.qpn,
                    "REQ from a connected peer for another QP (peer restarted?); ignored"
                ),
                PeerState::Connecting { .. } => {
                    // Simultaneous open: the larger address accepts, the smaller one waits for
                    // the REP to its own REQ.
                    if self.address.as_slice() >= from.encode().as_slice() {
                        match self.connect(idx, &msg) {
                            Ok(()) => self.reply(idx, msg.qpn),
                            Err(e) => self.fail_peer(idx, format!("connecting the QP failed: {e}")),
                        }
                    }
                }
                PeerState::Failed(_) => {}
            },
            (HsKind::Rep, Some(idx)) => {
                let p = &self.peers[idx];
                if matches!(p.state, PeerState::Connecting { .. }) && msg.echo_qpn == p.qps[0].qpn {
                    if let Err(e) = self.connect(idx, &msg) {
                        self.fail_peer(idx, format!("connecting the QP failed: {e}"));
                    }
                }
            }
            (HsKind::Rep, None) => tracing::debug!("REP from an unknown peer; ignored"),
        }
    }

    /// Marks `peer` failed with its first cause and moves both of its QPs to the error
    /// state: an error completion on one QP fails the peer, so the work still queued on the
    /// other is flushed too (each completes as `ECONNRESET` naming the cause, see `classify`).
    fn fail_peer(&mut self, peer: usize, message: String) {
        let p = &mut self.peers[peer];
        if matches!(p.state, PeerState::Failed(_)) {
            return;
        }
        tracing::warn!(peer, %message, "verbs peer failed");
        p.state = PeerState::Failed(message);
        for q in &p.qps {
            // SAFETY: all-zero is a valid ibv_qp_attr.
            let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
            if let Err(e) = modify_qp(&q.qp, &mut a, sys::ibv_qp_attr_mask::IBV_QP_STATE.0) {
                tracing::debug!(peer, qpn = q.qpn, error = %e, "moving a failed peer's QP to ERR failed");
            }
        }
    }

    /// Re-sends due REQs; fails peers past the connect timeout.
    fn drive_handshakes(&mut self, now: Instant) {
        for idx in 0..self.peers.len() {
            let PeerState::Connecting { since, last } = self.peers[idx].state else { continue };
            if now.duration_since(since) >= self.cfg.connect_timeout {
                let t = self.cfg.connect_timeout;
                self.fail_peer(
                    idx,
                    format!("connection setup timed out after {t:?}: no answer to the handshake"),
                );
                continue;
            }
            if last.map_or(true, |l| now.duration_since(l) >= HANDSHAKE_RETRY) {
                self.peers[idx].state = PeerState::Connecting { since, last: Some(now) };
                let msg = self.handshake(idx, HsKind::Req, 0);
                self.send_handshake(idx, msg);
            }
        }
    }

    /// Delivers held messages into engine receive buffers.
    fn deliver_held(&mut self) {
        while !self.held.is_empty() && !self.engine_recvs.is_empty() {
            let (slot, len, src) = self.held.pop_front().expect("not empty");
            let (token, buf) = self.engine_recvs.pop_front().expect("not empty");
            let n = len.min(buf.len);
            if n < len {
                tracing::warn!(len, buffer = buf.len, "message truncated to the engine's receive buffer");
            }
            // SAFETY: the slot holds a received message and is not posted; the engine buffer
            // was handed in with Op::Recv, whose contract keeps it valid and unused until its
            // completion is returned; the two do not overlap (backend vs engine memory).
            unsafe {
                let src_bytes = self.msg_pool.bytes(slot as usize, n);
                ptr::copy_nonoverlapping(src_bytes.as_ptr(), buf.addr as *mut u8, n);
            }
            self.free_slots.push(slot);
            self.ready.push_back(Completion::Recv { token, len: n, src });
        }
    }

    fn classify(&mut self, wc: Wc) {
        let index = (wc.wr_id & 0xffff_ffff) as usize;
        let ok = wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS;
        match wc.wr_id & WR_KIND_MASK {
            WR_OP => {
                let Some((token, peer, lane)) = self.ops.get_mut(index).and_then(Option::take) else {
                    tracing::warn!(wr_id = wc.wr_id, "completion for an unknown work request; skipped");
                    return;
                };
                self.free_ops.push(index as u32);
                self.outstanding -= 1;
                self.peers[peer].lane(lane).outstanding -= 1;
                if ok {
                    self.ready.push_back(Completion::Done { token });
                } else {
                    let message = format!("{} (vendor error {:#x})", status_str(wc.status), wc.vendor_err);
                    let (errno, message) = if wc.status == sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                        // Flushed because the QP went to the error state earlier: the
                        // connection to this peer is gone (ECONNRESET, so the engine reports
                        // `PeerUnreachable` and marks the peer failed), with the first cause.
                        let cause = match &self.peers[peer].state {
                            PeerState::Failed(m) => m.clone(),
                            _ => "the queue pair left the ready state".into(),
                        };
                        (libc::ECONNRESET, format!("{message}: {cause}"))
                    } else {
                        // Any error completion moves an RC QP to the error state.
                        self.fail_peer(peer, format!("queue pair failed: {message}"));
                        (status_errno(wc.status), message)
                    };
                    self.ready.push_back(Completion::Failed { token, errno, message });
                }
            }
            WR_IMM_RECV => {
                // A zero-length entry: it only ever completes a peer's write with immediate.
                self.imm_missing += 1;
                if !ok {
                    self.recv_failed(&wc);
                } else if wc.opcode == sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                    self.ready.push_back(Completion::Imm { imm: imm_from_wire(wc.imm) });
                } else {
                    tracing::warn!(opcode = wc.opcode, qpn = wc.qp_num, "unexpected receive on the imm SRQ");
                }
            }
            WR_MSG_RECV => {
                if !ok {
                    self.recv_failed(&wc);
                    self.free_slots.push(index as u32);
                } else if wc.opcode == sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                    // Not sent by this backend (immediates travel on the data QP), but harmless.
                    self.free_slots.push(index as u32);
                    self.ready.push_back(Completion::Imm { imm: imm_from_wire(wc.imm) });
                } else {
                    let src = self.peer_by_qpn.get(&wc.qp_num).map(|&i| i as PeerHandle);
                    self.held.push_back((index as u32, wc.byte_len as usize, src));
                    self.deliver_held();
                }
            }
            WR_UD_RECV => {
                if ok {
                    let len = (wc.byte_len as usize).min(UD_SLOT_SIZE);
                    // SAFETY: the UD receive completed, so the HCA is done with the slot until
                    // it is re-posted below.
                    let msg = unsafe { self.ud_pool.bytes(index, len) }
                        .get(GRH_LEN..)
                        .ok_or_else(|| Error::Malformed { what: "verbs handshake", reason: "short".into() })
                        .and_then(Handshake::decode);
                    match msg {
                        Ok(m) => self.on_handshake(m),
                        Err(Error::Malformed { reason, .. }) if reason.starts_with("version") => {
                            tracing::warn!(%reason, "ignoring a handshake from a peer of another fabric version")
                        }
                        Err(e) => tracing::debug!(error = %e, "ignoring a UD message"),
                    }
                }
                if let Err(e) = self.post_ud_recv(index) {
                    tracing::warn!(error = %e, "re-posting a handshake receive failed");
                }
            }
            WR_UD_SEND => {
                if !ok {
                    tracing::debug!(status = %status_str(wc.status), "a handshake send failed");
                }
                self.ud_send_free.push(index as u32);
            }
            _ => tracing::warn!(wr_id = wc.wr_id, "completion with a foreign wr_id; skipped"),
        }
    }

    /// A receive of either SRQ failed: its QP (and so its peer) is gone.
    fn recv_failed(&mut self, wc: &Wc) {
        let status = status_str(wc.status);
        tracing::warn!(%status, qpn = wc.qp_num, "a receive failed");
        if let Some(&p) = self.peer_by_qpn.get(&wc.qp_num) {
            self.fail_peer(p, format!("receive failed: {status} (vendor error {:#x})", wc.vendor_err));
        }
    }

    /// Reads up to `max` work completions from the CQ into `lookahead`-style processing.
    fn read_cq(&mut self, max: usize) -> Result<usize, Error> {
        // SAFETY: all-zero is a valid ibv_wc.
        let mut wcs: [sys::ibv_wc; CQ_BATCH] = std::array::from_fn(|_| unsafe { std::mem::zeroed() });
        let want = max.min(CQ_BATCH) as c_int;
        // SAFETY: the CQ is live; wcs holds at least `want` entries.
        let n = unsafe { sys::ibv_poll_cq(self.cq.as_ptr(), want, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(os_error("ibv_poll_cq", n.saturating_neg()));
        }
        for w in wcs.iter().take(n as usize) {
            self.classify(Wc::from_raw(w));
        }
        Ok(n as usize)
    }

    /// Queues a send-side work request (write, read or send) on the peer's queue pair.
    ///
    /// # Safety
    ///
    /// The contract of [`Domain::post`]: the local memory `op` names is registered with this
    /// domain and stays valid until its completion is polled.
    unsafe fn post_send_op(&mut self, token: u64, op: &Op) -> Result<(), PostError> {
        let fail = |e: Error| Err(PostError::Failed(e));
        let peer = match *op {
            Op::Write { peer, .. } | Op::Read { peer, .. } | Op::Send { peer, .. } => peer,
            Op::Recv { .. } => unreachable!("receives are not sent"),
        };
        let Some(p) = self.peers.get_mut(peer as usize) else {
            return fail(Error::UnknownPeer { peer: peer as u32 });
        };
        match &p.state {
            PeerState::Connected { .. } => {}
            PeerState::Connecting { since, .. } => {
                if since.elapsed() < self.cfg.connect_timeout {
                    return Err(PostError::Again);
                }
                let t = self.cfg.connect_timeout;
                self.fail_peer(peer as usize, format!("connection setup timed out after {t:?}"));
                return self.post_send_op_failed(peer);
            }
            PeerState::Failed(_) => return self.post_send_op_failed(peer),
        }
        let lane = if matches!(op, Op::Send { .. }) { Lane::Msg } else { Lane::Data };
        if p.qps[lane as usize].outstanding >= self.sq_depth || self.outstanding >= self.max_outstanding {
            return Err(PostError::Again);
        }
        let (local, opcode, remote, imm) = match *op {
            Op::Write { local, remote, imm: Some(imm), .. } => {
                (local, sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, Some(remote), Some(imm))
            }
            Op::Write { local, remote, imm: None, .. } => {
                (local, sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE, Some(remote), None)
            }
            Op::Read { local, remote, .. } => {
                (local, sys::ibv_wr_opcode::IBV_WR_RDMA_READ, Some(remote), None)
            }
            Op::Send { local, .. } => {
                let max = (self.cfg.max_msg_size).min(p.remote.max_msg_size as usize);
                if local.len > max {
                    return fail(Error::MessageTooLarge { len: local.len, max });
                }
                (local, sys::ibv_wr_opcode::IBV_WR_SEND, None, None)
            }
            Op::Recv { .. } => unreachable!(),
        };
        let Ok(len) = u32::try_from(local.len) else {
            return fail(Error::MessageTooLarge { len: local.len, max: u32::MAX as usize });
        };
        let sge = sys::ibv_sge { addr: local.addr, length: len, lkey: local.desc as u32 };
        // SAFETY: all-zero is a valid ibv_send_wr.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        let index = match self.free_ops.pop() {
            Some(i) => i,
            None => {
                self.ops.push(None);
                (self.ops.len() - 1) as u32
            }
        };
        wr.wr_id = WR_OP | u64::from(index);
        if len > 0 {
            wr.num_sge = 1; // `sg_list` is pointed at the chained sge by `flush`
        }
        wr.opcode = opcode;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        if let Some(imm) = imm {
            wr.imm_data_invalidated_rkey_union.imm_data = imm_to_wire(imm);
        }
        if let Some(r) = remote {
            wr.wr.rdma = sys::rdma_t { remote_addr: r.addr, rkey: r.key as u32 };
        }
        // Accepted: it reaches the NIC at the next `flush` (or now, if the chain is full).
        self.ops[index as usize] = Some((token, peer as usize, lane));
        self.outstanding += 1;
        if !p.has_chain() {
            self.chained.push(peer as usize);
        }
        let q = p.lane(lane);
        q.outstanding += 1;
        q.chain.push(ChainedWr { wr, sge });
        if q.chain.len() >= MAX_CHAIN {
            self.chained.retain(|&i| i != peer as usize);
            // SAFETY: forwarded from the caller (memory registered and valid until completion).
            unsafe { self.flush_peer(peer as usize) };
        }
        Ok(())
    }

    /// Posts peer `idx`'s chained work requests: one `ibv_post_send` per QP with a
    /// non-empty chain. Those the NIC refuses complete as `Failed`.
    ///
    /// # Safety
    ///
    /// The memory every chained request names must be registered with this domain and stay
    /// valid until its completion is polled (the contract of [`Domain::post`]).
    unsafe fn flush_peer(&mut self, idx: usize) {
        for lane in [Lane::Data, Lane::Msg] {
            // SAFETY: forwarded from the caller.
            unsafe { self.flush_qp(idx, lane) };
        }
    }

    /// Posts the chained work requests of one QP of peer `idx` with one `ibv_post_send`.
    ///
    /// # Safety
    ///
    /// As for [`VerbsDomain::flush_peer`].
    unsafe fn flush_qp(&mut self, idx: usize, lane: Lane) {
        let p = self.peers[idx].lane(lane);
        let n = p.chain.len();
        if n == 0 {
            return;
        }
        let base = p.chain.as_mut_ptr();
        for i in 0..n {
            // SAFETY: `i` and `i + 1` are in bounds of the chain, which does not move or
            // change length until the post below has returned.
            unsafe {
                let w = &mut *base.add(i);
                if w.wr.num_sge > 0 {
                    w.wr.sg_list = &mut w.sge;
                }
                w.wr.next = if i + 1 < n { &mut (*base.add(i + 1)).wr } else { ptr::null_mut() };
            }
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is live; the linked list and its sges live in `p.chain` for the
        // call; the local memory is registered and valid until completion (the caller's
        // contract).
        let ret = unsafe { sys::ibv_post_send(p.qp.as_ptr(), &mut (*base).wr, &mut bad) };
        let refused_from =
            if ret == 0 { n } else { (0..n).find(|&i| ptr::eq(&p.chain[i].wr, bad)).unwrap_or(0) };
        let refused: Vec<u64> = p.chain[refused_from..].iter().map(|w| w.wr.wr_id).collect();
        p.chain.clear();
        if refused.is_empty() {
            return;
        }
        let (errno, message) = match check("ibv_post_send", ret) {
            Err(Error::Provider { errno, message, .. }) => (errno, message),
            // A partial post reports success for the posted part; the rest was still refused.
            _ => (libc::EIO, format!("ibv_post_send returned {ret} and refused part of a chain")),
        };
        for wr_id in refused {
            let index = (wr_id & !WR_OP) as usize;
            if let Some((token, peer, lane)) = self.ops.get_mut(index).and_then(Option::take) {
                self.free_ops.push(index as u32);
                self.peers[peer].lane(lane).outstanding -= 1;
                self.outstanding -= 1;
                self.ready.push_back(Completion::Failed { token, errno, message: message.clone() });
            }
        }
    }

    fn post_send_op_failed(&self, peer: PeerHandle) -> Result<(), PostError> {
        let message = match &self.peers[peer as usize].state {
            PeerState::Failed(m) => m.clone(),
            _ => "not connected".into(),
        };
        Err(PostError::Failed(Error::PeerUnreachable { peer: peer as u32, message }))
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

    fn keep_mr(&mut self, mr: Mr, remote_base: u64) -> Registration {
        // SAFETY: the MR is live.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        let handle = mr.as_ptr() as u64;
        self.mrs.insert(handle, mr);
        Registration { local: lkey.into(), remote_key: rkey.into(), handle, remote_base }
    }
}

/// A dma-buf fd for GPU memory. None exists yet: exporting one needs the CUDA driver's
/// `cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`, which this crate does
/// not link. When it does, [`VerbsDomain::reg_dmabuf`] is the registration path.
fn dmabuf_fd(ordinal: u32, _addr: u64, _len: usize) -> Result<RawFd, Error> {
    Err(Error::Unsupported(format!(
        "registering cuda:{ordinal} memory with verbs needs a dma-buf fd from the CUDA driver \
         (cuMemGetHandleForAddressRange), which fabric does not link yet"
    )))
}

fn create_srq(pd: &Arc<Pd>, depth: usize) -> Result<Arc<Srq>, Error> {
    let mut attr = sys::ibv_srq_init_attr {
        srq_context: ptr::null_mut(),
        attr: sys::ibv_srq_attr { max_wr: depth as u32, max_sge: 1, srq_limit: 0 },
    };
    // SAFETY: pd is live; attr is valid for the call.
    let p = check_ptr("ibv_create_srq", unsafe { sys::ibv_create_srq(pd.as_ptr(), &mut attr) })?;
    Ok(Arc::new(Srq { ptr: p, _pd: pd.clone() }))
}

fn create_qp(
    pd: &Arc<Pd>,
    cq: &Arc<Cq>,
    srq: Option<&Arc<Srq>>,
    qp_type: u32,
    depth: u32,
) -> Result<Qp, Error> {
    let mut init = sys::ibv_qp_init_attr {
        qp_context: ptr::null_mut(),
        send_cq: cq.as_ptr(),
        recv_cq: cq.as_ptr(),
        srq: srq.map_or(ptr::null_mut(), |s| s.as_ptr()),
        cap: sys::ibv_qp_cap {
            max_send_wr: depth,
            max_recv_wr: if srq.is_some() { 0 } else { depth },
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type,
        sq_sig_all: 0,
    };
    // SAFETY: pd, cq and srq are live; init is valid for the call.
    let p = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut init) };
    Ok(Qp { ptr: check_ptr("ibv_create_qp", p)?, _cq: cq.clone(), _srq: srq.cloned(), _pd: pd.clone() })
}

fn modify_qp(qp: &Qp, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<(), Error> {
    // SAFETY: the QP is live; attr is valid for the call and mask names its set fields.
    check("ibv_modify_qp", unsafe { sys::ibv_modify_qp(qp.as_ptr(), attr, mask as c_int) })
}

impl Domain for VerbsDomain {
    fn transport(&self) -> &str {
        TRANSPORT
    }

    fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    fn max_msg_size(&self) -> usize {
        self.cfg.max_msg_size
    }

    /// Writes go over RC queue pairs, whose send completion is generated only after the
    /// responder acknowledged the write, which it does once it has taken the data for
    /// placement in its memory.
    fn delivery_complete(&self) -> bool {
        true
    }

    unsafe fn register(
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
            return self.reg_dmabuf(fd, 0, len, addr).map_err(reg_err);
        }
        let base = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        let relaxed = sys::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
        let mr = if self.relaxed_ordering {
            match reg_mr(&self.pd, addr, len, base | relaxed) {
                Ok(mr) => Ok(mr),
                Err(e) => {
                    tracing::debug!(error = %e, "registration with relaxed ordering refused; retrying without");
                    let r = reg_mr(&self.pd, addr, len, base);
                    if r.is_ok() {
                        self.relaxed_ordering = false;
                    }
                    r
                }
            }
        } else {
            reg_mr(&self.pd, addr, len, base)
        };
        Ok(self.keep_mr(mr.map_err(reg_err)?, addr))
    }

    fn deregister(&mut self, reg: Registration) {
        if self.mrs.remove(&reg.handle).is_none() {
            tracing::warn!(
                handle = reg.handle,
                "deregister of a handle this domain did not register; ignored"
            );
        }
    }

    fn add_peer(&mut self, addr: &[u8]) -> Result<PeerHandle, Error> {
        let remote = PeerAddr::decode(addr)?;
        if let Some(&idx) = self.peer_by_addr.get(&remote) {
            return Ok(idx as PeerHandle);
        }
        let idx = self.new_peer(remote, PeerState::Connecting { since: Instant::now(), last: None })?;
        self.drive_handshakes(Instant::now());
        Ok(idx as PeerHandle)
    }

    unsafe fn post(&mut self, token: u64, op: &Op) -> Result<(), PostError> {
        if let Op::Recv { local } = *op {
            // Kept in software; see the module docs.
            self.engine_recvs.push_back((token, local));
            self.deliver_held();
            return Ok(());
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.post_send_op(token, op) }
    }

    fn flush(&mut self) {
        for idx in std::mem::take(&mut self.chained) {
            // SAFETY: every chained request came through `post`, whose caller guarantees its
            // memory (see `flush_peer`).
            unsafe { self.flush_peer(idx) };
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, Error> {
        while self.ready.len() < max {
            if let Some(wc) = self.lookahead.pop_front() {
                self.classify(wc);
                continue;
            }
            if self.read_cq(max - self.ready.len())? == 0 {
                break;
            }
        }
        self.drive_handshakes(Instant::now());
        self.deliver_held();
        self.replenish_srqs();
        let n = self.ready.len().min(max);
        out.extend(self.ready.drain(..n));
        Ok(n)
    }

    fn wait_fd(&self) -> Option<RawFd> {
        Some(self.wait_fd)
    }

    fn timer(&self) -> Option<Duration> {
        // A REQ or REP travels over UD and may be lost: while a peer is connecting, `poll`
        // must run every HANDSHAKE_RETRY to re-send it (and to enforce the connect timeout).
        self.peers.iter().any(|p| matches!(p.state, PeerState::Connecting { .. })).then_some(HANDSHAKE_RETRY)
    }

    fn arm(&mut self) -> bool {
        if !self.ready.is_empty() || !self.lookahead.is_empty() {
            return false;
        }
        // SAFETY: the CQ is live.
        if let Err(e) = check("ibv_req_notify_cq", unsafe { sys::ibv_req_notify_cq(self.cq.as_ptr(), 0) }) {
            tracing::warn!(error = %e, "arming the CQ failed; polling instead of sleeping");
            return false;
        }
        // A completion that arrived before the arm raises no event: look for one now, and
        // keep it for the next poll.
        // SAFETY: all-zero is a valid ibv_wc.
        let mut wc: sys::ibv_wc = unsafe { std::mem::zeroed() };
        // SAFETY: the CQ is live; wc holds one entry.
        let n = unsafe { sys::ibv_poll_cq(self.cq.as_ptr(), 1, &mut wc) };
        if n > 0 {
            self.lookahead.push_back(Wc::from_raw(&wc));
            return false;
        }
        n == 0
    }

    fn ack_wakeup(&mut self) {
        self.cq.ack_events();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(index: u32, gid_type: GidType, gid: [u8; 16]) -> GidEntry {
        GidEntry { index, gid_type, gid }
    }

    #[test]
    fn gid_selection_prefers_rocev2_ipv4() {
        let ll = {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = 1;
            g
        };
        let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 2, 15];
        let global6 = {
            let mut g = [0u8; 16];
            g[0] = 0x20;
            g[1] = 0x01;
            g[15] = 5;
            g
        };
        // rxe0: 0 = link-local v1, 1 = link-local v2, 2 = v4 v1, 3 = v4 v2.
        let rxe = [
            e(0, GidType::RoceV1, ll),
            e(1, GidType::RoceV2, ll),
            e(2, GidType::RoceV1, v4),
            e(3, GidType::RoceV2, v4),
        ];
        assert_eq!(select_gid(&rxe), Some(3));
        // The order seen in TESTBEDS (v2 IPv4 at index 1).
        let rxe2 = [e(0, GidType::RoceV1, v4), e(1, GidType::RoceV2, v4)];
        assert_eq!(select_gid(&rxe2), Some(1));
        assert_eq!(select_gid(&[e(0, GidType::RoceV2, ll), e(4, GidType::RoceV2, global6)]), Some(4));
        assert_eq!(select_gid(&[e(0, GidType::RoceV1, v4), e(2, GidType::RoceV2, ll)]), Some(2));
        assert_eq!(select_gid(&[e(0, GidType::Ib, ll), e(1, GidType::RoceV1, v4)]), Some(0));
        // Empty entries are never chosen.
        assert_eq!(select_gid(&[e(0, GidType::RoceV2, [0; 16])]), None);
        assert_eq!(select_gid(&[]), None);
        assert_eq!(parse_gid_type("RoCE v2\n"), Some(GidType::RoceV2));
        assert_eq!(parse_gid_type("IB/RoCE v1\n"), Some(GidType::RoceV1));
        assert_eq!(parse_gid_type("bogus"), None);
    }

    #[test]
    fn imm_is_big_endian_on_the_wire() {
        let wire = imm_to_wire(0x0102_0304);
        assert_eq!(wire.to_ne_bytes(), [1, 2, 3, 4]);
        assert_eq!(imm_from_wire(wire), 0x0102_0304);
        for v in [0, 1, 0xdead_beef, u32::MAX] {
            assert_eq!(imm_from_wire(imm_to_wire(v)), v);
        }
    }

    #[test]
    fn status_codes_map_to_errnos() {
        use sys::ibv_wc_status::*;
        assert_eq!(status_errno(IBV_WC_RETRY_EXC_ERR), libc::ETIMEDOUT);
        assert_eq!(status_errno(IBV_WC_REM_ACCESS_ERR), libc::EACCES);
        assert_eq!(status_errno(IBV_WC_WR_FLUSH_ERR), libc::ECANCELED);
        assert!(!status_str(IBV_WC_REM_ACCESS_ERR).is_empty());
        assert!(check("x", 0).is_ok());
        assert!(
            matches!(check("x", libc::ENOMEM), Err(Error::Provider { errno, .. }) if errno == libc::ENOMEM)
        );
        assert!(
            matches!(check("x", -libc::EINVAL), Err(Error::Provider { errno, .. }) if errno == libc::EINVAL)
        );
    }

    #[test]
    fn provider_names_parse() {
        assert_eq!(VerbsConfig::from_provider_name("verbs").unwrap().device, None);
        assert_eq!(VerbsConfig::from_provider_name("verbs:rxe0").unwrap().device.as_deref(), Some("rxe0"));
        assert!(VerbsConfig::from_provider_name("verbs:").is_none());
        assert!(VerbsConfig::from_provider_name("verbsx").is_none());
        assert!(VerbsConfig::from_provider_name("tcp").is_none());
    }

    /// On a machine without an RDMA device (CI, this container), opening fails cleanly.
    #[test]
    fn open_without_device_is_provider_not_found() {
        let has_device = std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some());
        match VerbsDomain::open(&VerbsConfig::default()) {
            Err(Error::ProviderNotFound { provider, reason }) => {
                assert_eq!(provider, "verbs");
                assert!(reason.starts_with("no RDMA device"), "{reason}");
            }
            Ok(d) => assert!(has_device, "opened {d:?} without a device"),
            Err(e) => assert!(has_device, "{e}"),
        }
        let named = VerbsConfig { device: Some("no-such-dev".into()), ..VerbsConfig::default() };
        assert!(matches!(VerbsDomain::open(&named), Err(Error::ProviderNotFound { .. })));
        if !has_device {
            let e = crate::Engine::builder().provider("verbs").build().expect_err("no device here");
            assert!(matches!(e, Error::ProviderNotFound { .. }), "{e}");
            eprintln!("verbs engine without a device: {e}");
        }
    }
}
