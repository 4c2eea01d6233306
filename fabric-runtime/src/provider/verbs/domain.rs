//! The [`VerbsDomain`] itself: its fields (in teardown order) and `open`, which builds the PD,
//! the CQ with its completion channel, both SRQs and the handshake UD QP on the chosen port.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::fmt;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::Arc;
use std::time::Instant;

use rdma_sys as sys;

use super::config::VerbsConfig;
use super::datapath::Wc;
use super::device::{choose_device, gid_table, not_found, select_gid, Chosen};
use super::error::{check, check_ptr};
use super::handshake::{HANDSHAKE_QKEY, UD_SLOTS, UD_SLOT_SIZE};
use super::owned::{create_srq, Channel, Context, Cq, Mr, Pd, Qp, SlotPool, Srq};
use super::qp::{create_qp, modify_qp, random_psn, Lane, Peer, PeerState};
use crate::error::Error;
use crate::provider::{Completion, LocalSlice, PeerHandle};
use crate::pure::verbs_wire::PeerAddr;

/// One ibverbs device port: a PD, one CQ with a completion channel, two SRQs (zero-length
/// imm receives, message slots), a UD QP for the handshake, and two RC QPs per peer. See the
/// module docs.
///
/// No `Drop` impl is needed: fields drop in declaration order — QPs (peers, UD), SRQs, CQ
/// (acking its pending events first), channel, MRs, PD, device context — and the `Arc`s
/// inside enforce that order in any case. Engine receive buffers were never given to the NIC,
/// so there is nothing to cancel.
pub struct VerbsDomain {
    pub(super) peers: Vec<Peer>,
    pub(super) ud_qp: Qp,
    pub(super) imm_srq: Arc<Srq>,
    pub(super) msg_srq: Arc<Srq>,
    pub(super) cq: Arc<Cq>,
    _channel: Arc<Channel>,
    pub(super) mrs: HashMap<u64, Mr>,
    pub(super) msg_pool: SlotPool,
    pub(super) ud_pool: SlotPool,
    pub(super) pd: Arc<Pd>,
    _ctx: Arc<Context>,

    device: String,
    pub(super) port: u8,
    pub(super) gid_index: u32,
    pub(super) me: PeerAddr,
    pub(super) address: Vec<u8>,
    pub(super) cfg: VerbsConfig,
    pub(super) sq_depth: u32,
    pub(super) max_rd_atomic: u8,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) relaxed_ordering: bool,
    pub(super) wait_fd: RawFd,
    pub(super) peer_by_addr: HashMap<PeerAddr, usize>,
    pub(super) peer_by_qpn: HashMap<u32, usize>,
    /// In-flight send-side operations by wr_id index: (engine token, peer index, QP).
    pub(super) ops: Vec<Option<(u64, usize, Lane)>>,
    pub(super) free_ops: Vec<u32>,
    /// Send WRs in flight over all QPs, and the most allowed (so the CQ cannot overflow).
    pub(super) outstanding: usize,
    pub(super) max_outstanding: usize,
    /// Zero-length receives the imm SRQ is short of (re-posted in one chain by `poll`), and
    /// its depth.
    pub(super) imm_missing: usize,
    pub(super) imm_depth: usize,
    /// Scratch for re-posting imm receives (kept to avoid an allocation per poll).
    pub(super) imm_wrs: Vec<sys::ibv_recv_wr>,
    /// Message slots not on the message SRQ (to re-post), and slots holding a message that
    /// waits for an engine buffer: (slot, len, peer).
    pub(super) free_slots: Vec<u32>,
    pub(super) held: VecDeque<(u32, usize, Option<PeerHandle>)>,
    /// Engine receive buffers ([`Op::Recv`](crate::provider::Op::Recv)), oldest first.
    pub(super) engine_recvs: VecDeque<(u64, LocalSlice)>,
    /// UD send slots not in use.
    pub(super) ud_send_free: Vec<u32>,
    /// Work completions read by `arm` and not yet classified.
    pub(super) lookahead: VecDeque<Wc>,
    /// Completions classified and not yet returned (over the caller's `max`).
    pub(super) ready: VecDeque<Completion>,
    /// Peers whose `chain` is not empty.
    pub(super) chained: Vec<usize>,
    /// When the next keep-alive pass is due (`keepalive.rs`).
    pub(super) keepalive_next: Instant,
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
            // A zero period would probe without pause: it means off, as `None` does.
            cfg: VerbsConfig { keepalive: cfg.keepalive.filter(|k| !k.is_zero()), ..cfg.clone() },
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
            keepalive_next: Instant::now(),
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

    /// Whether the connection to `peer` is up (for tests and diagnostics).
    pub fn is_connected(&self, peer: PeerHandle) -> bool {
        self.peers.get(peer as usize).is_some_and(|p| matches!(p.state, PeerState::Connected))
    }

    /// Reconnects a failed peer: both QPs are replaced, the epoch goes up and the handshake
    /// runs again; `Ok` at once, and posts to the peer answer `PostError::Again` until it
    /// completes, or fail [`Error::PeerUnreachable`] if it has not within `connect_timeout`
    /// (the peer is failed again). A peer that has not failed is left alone. `Err` if the
    /// handle is unknown or the QPs cannot be made. (The engine's revival of a peer it marked
    /// down, `Domain::revive_peer`, restarts the connection whatever its state and bounds the
    /// wait by `revive_timeout`: `revive.rs`.)
    pub fn reconnect_failed(&mut self, peer: PeerHandle) -> Result<(), Error> {
        if (peer as usize) >= self.peers.len() {
            return Err(Error::UnknownPeer { peer: peer as u32 });
        }
        self.revive(peer as usize)
    }

    /// The epoch of the connection to `peer`: how many times it has been re-established
    /// (for tests and diagnostics; see "Faults" in the module docs).
    pub fn connection_epoch(&self, peer: PeerHandle) -> Option<u32> {
        self.peers.get(peer as usize).map(|p| p.epoch)
    }

    /// How many keep-alive probes to `peer` its NIC has acknowledged (for tests and
    /// diagnostics; see `VerbsConfig::keepalive`).
    pub fn keepalive_probes(&self, peer: PeerHandle) -> Option<u64> {
        self.peers.get(peer as usize).map(|p| p.probes_acked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
