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
//! An error completion does not always mean a lost peer; see "Faults" below.
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
//! fail with [`Error::PeerUnreachable`]. The address and handshake carry a version (3: two QPs
//! per peer, and the connection's epoch in the handshake); an address of another version is
//! refused by [`Domain::add_peer`] at once ([`Error::Malformed`] naming both versions), and a
//! handshake of another version is ignored with a warning.
//!
//! A REQ from a peer never added here creates that peer (with a new handle) and is answered
//! at once: a peer may be added on one side only. Simultaneous open (both sides add each
//! other) is resolved without a second pair of QPs: a side that is connecting and receives
//! the other's REQ accepts it (connecting its *existing* QPs to the requester's) only if its
//! own address is the larger; the smaller side ignores the REQ and the larger side answers the
//! smaller side's REQ with a REP carrying the same QPs. Duplicated or late REQs for QPs we are
//! already connected to are answered again with the same REP.
//!
//! # Faults: a bad remote access fails that operation only
//!
//! Any error completion moves an RC QP to the error state, and the requester's side is not
//! the only one: on a remote access violation the responder's QP goes there too (the IB
//! spec's class C error; checked on rxe with `ibv_query_qp`: after a write, a write with
//! immediate or a read through a bad rkey, the data QPs of *both* sides are in ERR, both
//! message QPs still in RTS; for a write with immediate the responder's imm SRQ also
//! completes one receive with `IBV_WC_REM_ACCESS_ERR`). What a failed work completion of an
//! operation does depends on its status (`error.rs`, `status_class`):
//!
//! | status | the operation | the connection |
//! |---|---|---|
//! | `REM_ACCESS_ERR` (bad rkey, range outside the region, dropped region) | [`FailCause::RemoteAccess`] (errno `EACCES`) | that QP is replaced (below) |
//! | `LOC_LEN_ERR`, `LOC_QP_OP_ERR`, `LOC_PROT_ERR`, `LOC_ACCESS_ERR`, `MW_BIND_ERR`, `REM_INV_REQ_ERR`, `REM_OP_ERR`, `BAD_RESP_ERR` | [`FailCause::Op`] (this request was bad) | that QP is replaced |
//! | `WR_FLUSH_ERR`, on a QP replaced since | [`FailCause::ConnectionLost`] (`ECONNRESET`), the message names the first cause | (already being re-established) |
//! | `WR_FLUSH_ERR`, on the current QP of a live peer (its QP went to ERR with no error completion here: the responder's side of a refused access) | [`FailCause::ConnectionLost`] | that QP is replaced |
//! | `WR_FLUSH_ERR` of a failed peer | [`FailCause::PeerLost`], naming the cause | — |
//! | `RETRY_EXC_ERR`, `RNR_RETRY_EXC_ERR`, `RESP_TIMEOUT_ERR`, `REM_ABORT_ERR`, anything else | [`FailCause::PeerLost`]: the peer is failed, both QPs go to ERR | — |
//!
//! A failed receive on either SRQ (the responder's side of a refused write with immediate)
//! replaces the QP it arrived on the same way; it fails nothing.
//!
//! **An idle dead peer: keep-alive** (`keepalive.rs`). The statuses above come only from
//! work requests, so a peer nothing is posted to would never be found dead. A Connected peer
//! with nothing in flight whose last completion is 100-200 ms old
//! ([`VerbsConfig::keepalive`], default 100 ms) gets a probe: a zero-length RDMA write on its
//! data QP, which names no memory (no rkey is checked for a zero length: IBTA C9-88, and
//! rxe's `check_rkey`) and which the peer's NIC answers without its process. One in flight
//! per peer, never an engine operation. If it fails as a lost peer would
//! (`RETRY_EXC_ERR` after ~0.5 s of retries once the peer's QPs are gone), the peer is
//! failed and [`Completion::PeerDown`] reported: the engine marks it down and fails its
//! operations with `PeerUnreachable`. Measured on rxe in the emulated VM: an idle peer whose
//! domain was dropped is reported down 0.67 s later; a live idle peer, polled or not,
//! answers ~7 probes in 1.5 s and stays up (`tests/verbs_liveness.rs`).
//!
//! **Re-establishing a connection.** Each peer's connection has an *epoch*, 0 at first, which
//! travels in every REQ and REP. Replacing the QP of one lane (`qp.rs`, `reconnect`): a fresh
//! QP is created (INIT), the old one is moved to ERR and *retired* (kept, with the cause,
//! until every work request posted on it has completed as flushed, then destroyed, so no
//! completion is lost), work requests chained and not yet handed to the NIC move to the fresh
//! QP in order, the epoch goes up by one and the peer is Connecting again: a REQ carrying the
//! new epoch and both QPNs (the fresh one, and the other lane's unchanged one) goes out at once
//! and every `HANDSHAKE_RETRY`. The other lane keeps working meanwhile (a bad write does not
//! touch sends in flight on the message QP); posts on the lane being re-established answer
//! [`PostError::Again`] (the reactor defers them in order), and if no REP arrives within
//! `connect_timeout` the peer fails ([`FailCause::PeerLost`]).
//!
//! The peer, on a REQ:
//!
//! * of a lower epoch than its own: stale, ignored;
//! * of the same epoch: a duplicate for the QPs it is connected to is answered again; while it
//!   is Connecting itself (both sides replaced a QP at once, e.g. the responder after its
//!   failed imm receive), simultaneous open as above (the larger address accepts);
//! * of a higher epoch: accepted, lane by lane: a lane connected to the QPN the REQ names is
//!   kept; a lane connected to another QPN (the requester replaced its QP) has its own QP
//!   replaced by a fresh one connected to the REQ's (the responder's side of a refused access,
//!   whose QP is in ERR, is replaced this way, and what it had posted on it fails
//!   `ConnectionLost`); a fresh lane is connected. It adopts the epoch and answers with a REP.
//!   A failed peer that sends such a REQ (it was revived on its side) has both QPs replaced
//!   first: it is Connected again.
//!
//! A REP of the current epoch connects the fresh lanes. Should it name a new QP for a lane we
//! hold connected (both sides replaced *different* lanes at once), that lane is replaced too
//! and one more REQ (next epoch) settles it. Immediates are counted from the shared imm SRQ,
//! so a write with immediate that lands on a re-established QP is counted once like any other.
//!
//! **Reconnecting a failed peer** ([`VerbsDomain::reconnect_failed`]): a failed peer gets both QPs
//! replaced, the next epoch and a fresh handshake, and `reconnect_failed` returns `Ok` at once; posts
//! answer [`PostError::Again`] until the REP arrives, and fail [`Error::PeerUnreachable`] after
//! `connect_timeout` without one (the peer is failed again). A peer that has not failed is
//! left alone.
//!
//! **Reviving a peer the engine marked down** (`revive.rs`; the engine's `add_peer` of it):
//! [`Domain::revive_peer`] restarts the connection the same way whatever its state (failed,
//! connecting, or connected when only the engine's `op_timeout` marked the peer down) and
//! returns at once; [`Domain::revival`], asked after each reactor pass, says `Pending` until
//! the REP of the new epoch arrives (`Up`), or `Failed` once
//! [`VerbsConfig::revive_timeout`] (2 s) has passed without one, failing the peer (no
//! [`Completion::PeerDown`]: the engine has it down already). The REQ is answered by the
//! peer's process (its reactor reads the UD QP), so a process that is gone or stopped does
//! not come back, though its NIC would still acknowledge RDMA writes. Measured in the VM:
//! a live peer revived in 10-39 ms through the engine, 14-21 ms between two domains; a
//! stopped or dead one's revival failed after 2.05-2.08 s
//! (`integration-tests/tests/revive_verbs.rs`),
//! 504-510 ms with a 500 ms bound (`tests/verbs_liveness.rs`).
//!
//! Measured on rxe in the emulated VM (`tests/verbs_reconnect.rs`,
//! `integration-tests/tests/bad_access_verbs.rs`): a bad write, write with immediate or read
//! fails in 3-45 ms (mean 4-22 ms over runs); a write with immediate to a live region right
//! after it completes, its immediate counted, 6-73 ms (mean 6-32 ms) after the bad one failed.
//!
//! # Memory
//!
//! Registration is `ibv_reg_mr_iova2` with `LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ`, plus
//! `RELAXED_ORDERING` (an optional access flag the kernel drops if unsupported; if the
//! registration is still refused, it is retried without, once for the domain's lifetime).
//! `remote_base` is the virtual address. [`MemoryLocation::Cuda`] goes through
//! `ibv_reg_dmabuf_mr`, which needs a dma-buf file descriptor of the GPU range
//! (`cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ...)` of the
//! CUDA driver API, `cuda::dmabuf_fd`, with the cargo feature `cuda`). Where that or the
//! registration fails (no driver support, a range that is not page-aligned, a NIC without
//! dma-buf), the engine stages the region through pinned host memory instead.
//!
//! # Immediates
//!
//! `imm_data` is big-endian on the wire (`__be32` in both `ibv_send_wr` and `ibv_wc`);
//! [`imm_to_wire`] / [`imm_from_wire`] convert, so the target's [`Completion::Imm`] equals what
//! was posted.
//!
//! # Files
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | these docs, the `wr_id` kinds, the re-exports |
//! | `config.rs` | [`VerbsConfig`] and its defaults |
//! | `device.rs` | device and port choice, the GID table and [`select_gid`] |
//! | `owned.rs` | the owning wrappers (context, PD, channel, CQ, SRQ, QP, AH, MR), `SlotPool` |
//! | `qp.rs` | peers and their two RC QPs: creation, INIT → RTR → RTS, replacement, failure |
//! | `handshake.rs` | the UD handshake: sending, re-sending and answering REQ/REP, epochs |
//! | `keepalive.rs` | keep-alive probes to idle peers, so that a dead one is found |
//! | `revive.rs` | reviving a peer the engine marked down: started at once, its outcome asked for |
//! | `recv.rs` | the receive side: topping up both SRQs, delivering messages |
//! | `memory.rs` | memory registration (host, dma-buf) |
//! | `domain.rs` | the [`VerbsDomain`] struct and `open` |
//! | `datapath.rs` | the [`Domain`] impl: post, flush, poll, arm; completion classification |
//! | `error.rs` | return codes and work completion statuses as [`Error`]s |
//!
//! The bytes of the address ([`PeerAddr`]) and of the handshake messages are pure code, in
//! [`crate::pure::verbs_wire`].
//!
//! All `unsafe` of the verbs backend lives in this folder; every verbs return code goes
//! through `check` / `check_ptr` (`error.rs`).

#[cfg(doc)]
use super::{Completion, Domain, FailCause, MemoryLocation, Op, PostError};
#[cfg(doc)]
use crate::error::Error;

mod config;
mod datapath;
mod device;
mod domain;
mod error;
mod handshake;
mod keepalive;
mod memory;
mod owned;
mod qp;
mod recv;
mod revive;

pub use config::{VerbsConfig, DEFAULT_KEEPALIVE, DEFAULT_MAX_MSG_SIZE, DEFAULT_REVIVE_TIMEOUT};
pub use datapath::{imm_from_wire, imm_to_wire};
pub use device::{select_gid, GidEntry, GidType};
pub use domain::VerbsDomain;
pub use handshake::HANDSHAKE_RETRY;
pub use recv::ReceiveQueues;
// The address and handshake bytes are pure code, beside the other wire formats.
pub use crate::pure::verbs_wire::{PeerAddr, ADDR_LEN};

/// The transport name stored in descriptors.
const TRANSPORT: &str = "verbs";

/// wr_id kinds (top byte); the low 32 bits are an index in the kind's own table.
const WR_OP: u64 = 1 << 56;
/// A zero-length receive of the imm SRQ (no index: the entries are interchangeable).
const WR_IMM_RECV: u64 = 2 << 56;
const WR_UD_RECV: u64 = 3 << 56;
const WR_UD_SEND: u64 = 4 << 56;
/// A message slot of the message SRQ.
const WR_MSG_RECV: u64 = 5 << 56;
/// A keep-alive probe (`keepalive.rs`); the low 32 bits are the peer's index.
const WR_PROBE: u64 = 6 << 56;
const WR_KIND_MASK: u64 = 0xff << 56;
