//! Queue pairs and peers: a peer's two RC QPs (data, message) with their send-side
//! bookkeeping, the peer's connection state, creating QPs and moving them INIT → RTR → RTS
//! (or to ERR when the peer fails).

use std::ffi::c_int;
use std::ptr;
use std::sync::Arc;
use std::time::Instant;

use rdma_sys as sys;

use super::error::{check, check_ptr};
use super::owned::{Ah, Cq, Pd, Qp, Srq};
use super::VerbsDomain;
use crate::error::Error;
use crate::pure::verbs_wire::{Handshake, PeerAddr};

/// Where a peer's connection stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PeerState {
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
pub(super) enum Lane {
    /// Writes (with or without immediate), imm-only writes, reads. Receives from the imm SRQ.
    Data = 0,
    /// Two-sided sends. Receives from the message SRQ.
    Msg = 1,
}

/// One RC QP of a peer, with its send-side bookkeeping.
pub(super) struct PeerQp {
    pub(super) qp: Qp,
    pub(super) qpn: u32,
    pub(super) psn: u32,
    /// Send WRs posted on the QP and not completed (chained ones included).
    pub(super) outstanding: u32,
    /// Work requests accepted by `post` and not yet handed to the NIC: `flush` links them
    /// and posts them with one `ibv_post_send` (one doorbell per QP for the batch).
    pub(super) chain: Vec<ChainedWr>,
}

/// One peer: its two RC QPs, its address and its connection state.
pub(super) struct Peer {
    /// Indexed by [`Lane`]: the data QP, then the message QP.
    pub(super) qps: [PeerQp; 2],
    pub(super) remote: PeerAddr,
    pub(super) state: PeerState,
    /// To the peer's UD QP, made on first use.
    pub(super) ah: Option<Ah>,
}

impl Peer {
    pub(super) fn lane(&mut self, lane: Lane) -> &mut PeerQp {
        &mut self.qps[lane as usize]
    }

    pub(super) fn has_chain(&self) -> bool {
        self.qps.iter().any(|q| !q.chain.is_empty())
    }
}

/// One deferred send work request. The `next` and `sg_list` pointers are set by `flush`,
/// once the vector no longer moves.
pub(super) struct ChainedWr {
    pub(super) wr: sys::ibv_send_wr,
    pub(super) sge: sys::ibv_sge,
}

/// A 24-bit random PSN.
pub(super) fn random_psn() -> u32 {
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

/// A QP of `qp_type` whose sends and receives complete on `cq`, receiving from `srq` if one is
/// given (the RC QPs), else from its own receive queue of `depth` entries (the UD QP).
pub(super) fn create_qp(
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

/// `ibv_modify_qp` with the attributes `mask` names.
pub(super) fn modify_qp(qp: &Qp, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<(), Error> {
    // SAFETY: the QP is live; attr is valid for the call and mask names its set fields.
    check("ibv_modify_qp", unsafe { sys::ibv_modify_qp(qp.as_ptr(), attr, mask as c_int) })
}

impl VerbsDomain {
    /// An address handle for `remote`'s UD QP (the handshake's destination).
    pub(super) fn create_ah(&self, remote: &PeerAddr) -> Result<Ah, Error> {
        let mut attr = self.ah_attr(remote);
        // SAFETY: pd is live; attr is valid for the call.
        let p = unsafe { sys::ibv_create_ah(self.pd.as_ptr(), &mut attr) };
        Ok(Ah { ptr: check_ptr("ibv_create_ah", p)?, _pd: self.pd.clone() })
    }

    /// The route to `remote`: global (GRH) routing from our GID index and port.
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
    pub(super) fn new_peer(&mut self, remote: PeerAddr, state: PeerState) -> Result<usize, Error> {
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
    pub(super) fn connect(&mut self, peer: usize, msg: &Handshake) -> Result<(), Error> {
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
                        // 6, not 7: Soft-RoCE (rxe) takes a retry count of 7 as "retry forever" (as the
                        // spec does for rnr_retry only), and a dead peer would then never fail.
        a.retry_cnt = 6;
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

    /// Marks `peer` failed with its first cause and moves both of its QPs to the error
    /// state: an error completion on one QP fails the peer, so the work still queued on the
    /// other is flushed too (each completes as `ECONNRESET` naming the cause, see `classify`).
    pub(super) fn fail_peer(&mut self, peer: usize, message: String) {
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
}
