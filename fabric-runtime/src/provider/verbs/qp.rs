//! Queue pairs and peers: a peer's two RC QPs (data, message) with their send-side
//! bookkeeping, the peer's connection state, creating QPs and moving them INIT → RTR → RTS
//! (or to ERR when the peer fails), and replacing a QP that the transport tore down (the
//! old one is retired: kept until its work requests have completed, then destroyed).

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
    Connecting { since: Instant, last: Option<Instant> },
    /// Both QPs are in RTS (each towards the remote QP in its `remote_qpn`).
    Connected,
    /// The peer is lost (an error completion that means so, or no answer to the handshake
    /// within the connect timeout): every QP of it is in the error state.
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
    /// The remote RC QP this one is connected to (RTR → RTS done); `None` while the QP is
    /// fresh (INIT, waiting for the handshake): nothing is posted on it then.
    pub(super) remote_qpn: Option<u32>,
}

/// A QP replaced by a reconnection, in the error state, kept until every work request
/// posted on it has completed (flushed), so that no completion is lost; then destroyed.
pub(super) struct RetiredQp {
    pub(super) q: PeerQp,
    /// Why it was replaced: named in the `ConnectionLost` message of each flushed request.
    pub(super) cause: String,
}

/// One peer: its two RC QPs, its address and its connection state.
pub(super) struct Peer {
    /// Indexed by [`Lane`]: the data QP, then the message QP.
    pub(super) qps: [PeerQp; 2],
    pub(super) remote: PeerAddr,
    pub(super) state: PeerState,
    /// To the peer's UD QP, made on first use.
    pub(super) ah: Option<Ah>,
    /// The connection's epoch (see "Faults" in the module docs): 0 at first, one more each
    /// time either side replaces QPs; both sides agree once the handshake completes.
    pub(super) epoch: u32,
    /// QPs replaced by reconnections whose work requests have not all completed yet.
    pub(super) retired: Vec<RetiredQp>,
    /// Keep-alive (`keepalive.rs`): an operation to the peer (or a probe) completed since the
    /// last keep-alive pass. Set per completion (a store, no clock read); the pass moves it
    /// into `last_heard`.
    pub(super) heard: bool,
    /// When a keep-alive pass last found `heard` set, or the peer last became Connected.
    pub(super) last_heard: Instant,
    /// A keep-alive probe is in flight on the data QP (at most one per peer).
    pub(super) probing: bool,
    /// Keep-alive probes the peer's NIC acknowledged (for tests and diagnostics).
    pub(super) probes_acked: u64,
}

impl Peer {
    pub(super) fn lane(&mut self, lane: Lane) -> &mut PeerQp {
        &mut self.qps[lane as usize]
    }

    /// Whether a connected QP of the peer has work requests chained for the next `flush`
    /// (the peer is then in `VerbsDomain::chained`). A fresh QP's chain (moved there from the
    /// QP it replaced) waits until the QP is connected, and does not count until then.
    pub(super) fn has_chain(&self) -> bool {
        self.qps.iter().any(|q| q.remote_qpn.is_some() && !q.chain.is_empty())
    }

    /// Whether `lane`'s QP is connected (in RTS): posts on it go to the NIC.
    pub(super) fn ready(&self, lane: Lane) -> bool {
        self.qps[lane as usize].remote_qpn.is_some()
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
        Ok(PeerQp { qp, qpn, psn: random_psn(), outstanding: 0, chain: Vec::new(), remote_qpn: None })
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
        self.peers.push(Peer {
            qps: [data, msg],
            remote,
            state,
            ah: None,
            epoch: 0,
            retired: Vec::new(),
            heard: false,
            last_heard: Instant::now(),
            probing: false,
            probes_acked: 0,
        });
        Ok(idx)
    }

    /// Replaces `lane`'s QP of `peer` with a fresh one (INIT): the old one goes to the error
    /// state and is retired with `cause` (its posted work requests complete as flushed and
    /// fail `ConnectionLost` naming `cause`); work requests chained and not yet handed to the
    /// NIC move to the fresh QP, in order, and are posted once it is connected. Does not
    /// change the peer's state or epoch.
    pub(super) fn replace_lane(&mut self, peer: usize, lane: Lane, cause: &str) -> Result<(), Error> {
        let srq = match lane {
            Lane::Data => self.imm_srq.clone(),
            Lane::Msg => self.msg_srq.clone(),
        };
        let mut fresh = self.new_rc_qp(&srq)?;
        self.peer_by_qpn.insert(fresh.qpn, peer);
        let p = &mut self.peers[peer];
        let old = &mut p.qps[lane as usize];
        fresh.chain = std::mem::take(&mut old.chain);
        fresh.outstanding = fresh.chain.len() as u32;
        old.outstanding -= fresh.outstanding;
        let old = std::mem::replace(old, fresh);
        tracing::info!(peer, old_qpn = old.qpn, qpn = p.qps[lane as usize].qpn, %cause, "verbs QP replaced");
        move_to_err(&old);
        if old.outstanding == 0 {
            self.peer_by_qpn.remove(&old.qpn);
        } else {
            p.retired.push(RetiredQp { q: old, cause: cause.to_owned() });
        }
        Ok(())
    }

    /// Re-establishes the connection to `peer` after `lane`'s QP was torn down: the QP is
    /// replaced, the epoch goes up by one and a REQ goes out at the next `poll` (posts on
    /// the lane answer `Again` until the REP arrives, and the peer fails if none does within
    /// the connect timeout). Nothing if the lane is already being re-established or the
    /// peer has failed; if no QP can be made, the peer fails.
    pub(super) fn reconnect(&mut self, peer: usize, lane: Lane, cause: &str) {
        let p = &self.peers[peer];
        if matches!(p.state, PeerState::Failed(_)) || !p.ready(lane) {
            return;
        }
        if let Err(e) = self.replace_lane(peer, lane, cause) {
            self.fail_peer(peer, format!("{cause}; re-creating its queue pair failed: {e}"));
            return;
        }
        let p = &mut self.peers[peer];
        p.epoch = p.epoch.wrapping_add(1);
        let since = match p.state {
            PeerState::Connecting { since, .. } => since,
            _ => Instant::now(),
        };
        p.state = PeerState::Connecting { since, last: None };
        tracing::info!(peer, epoch = p.epoch, %cause, "verbs connection being re-established");
    }

    /// Decrements the outstanding count of the QP `qpn` of `peer` (current or retired) for
    /// one completed work request. Returns the retirement cause if the QP is retired (and
    /// destroys it when that was its last request), `None` for a current QP.
    pub(super) fn op_completed(&mut self, peer: usize, qpn: u32) -> Option<String> {
        let p = &mut self.peers[peer];
        if let Some(q) = p.qps.iter_mut().find(|q| q.qpn == qpn) {
            q.outstanding = q.outstanding.saturating_sub(1);
            return None;
        }
        let i = p.retired.iter().position(|r| r.q.qpn == qpn)?;
        let r = &mut p.retired[i];
        r.q.outstanding = r.q.outstanding.saturating_sub(1);
        let cause = r.cause.clone();
        if r.q.outstanding == 0 {
            let r = p.retired.swap_remove(i);
            self.peer_by_qpn.remove(&r.q.qpn);
            tracing::debug!(peer, qpn = r.q.qpn, "retired verbs QP drained; destroyed");
        }
        Some(cause)
    }

    /// Connects `peer`'s QPs to the two that `msg` (a REQ, or the REP to ours) names, lane
    /// by lane, and adopts its epoch:
    ///
    /// * a fresh lane (INIT) goes RTR → RTS towards the named QP;
    /// * a connected lane already towards the named QP is kept as it is (the other lane was
    ///   re-established, not this one);
    /// * a connected lane towards another QP: the peer replaced its side, so ours is replaced
    ///   too. Answering a REQ, the fresh QP is connected at once (the REP tells the peer its
    ///   number); reading a REP, it cannot be (the peer has already connected its QP to our
    ///   old one), so the epoch goes up and the peer stays Connecting: the next REQ carries it.
    ///
    /// A failed peer (the other side re-established the connection after a transient outage)
    /// has all of its QPs replaced first. The peer is Connected when both lanes are.
    pub(super) fn accept(&mut self, peer: usize, msg: &Handshake, rep: bool) -> Result<(), Error> {
        if msg.msg_qpn == 0 || msg.msg_qpn > 0x00ff_ffff || msg.qpn == 0 || msg.qpn > 0x00ff_ffff {
            return Err(Error::Malformed {
                what: "verbs handshake",
                reason: format!("QPNs {:#x} / {:#x} are not 24-bit QP numbers", msg.qpn, msg.msg_qpn),
            });
        }
        if let PeerState::Failed(m) = &self.peers[peer].state {
            let cause = format!("the peer re-established the connection after: {m}");
            for lane in [Lane::Data, Lane::Msg] {
                self.replace_lane(peer, lane, &cause)?;
            }
            self.peers[peer].state =
                PeerState::Connecting { since: Instant::now(), last: Some(Instant::now()) };
        }
        self.peers[peer].epoch = msg.epoch;
        let mut again = false;
        for (lane, qpn, psn) in [(Lane::Data, msg.qpn, msg.psn), (Lane::Msg, msg.msg_qpn, msg.msg_psn)] {
            match self.peers[peer].qps[lane as usize].remote_qpn {
                None => self.connect_qp(peer, lane, qpn, psn)?,
                Some(r) if r == qpn => {}
                Some(_) => {
                    let e = msg.epoch;
                    self.replace_lane(
                        peer,
                        lane,
                        &format!("the peer re-established the connection (epoch {e})"),
                    )?;
                    if rep {
                        again = true;
                    } else {
                        self.connect_qp(peer, lane, qpn, psn)?;
                    }
                }
            }
        }
        // Work requests chained while a lane was being re-established go out at the next flush.
        if self.peers[peer].has_chain() && !self.chained.contains(&peer) {
            self.chained.push(peer);
        }
        let p = &mut self.peers[peer];
        if again {
            p.epoch = p.epoch.wrapping_add(1);
            let since = match p.state {
                PeerState::Connecting { since, .. } => since,
                _ => Instant::now(),
            };
            p.state = PeerState::Connecting { since, last: None };
            return Ok(());
        }
        p.state = PeerState::Connected;
        p.last_heard = Instant::now();
        tracing::debug!(
            peer,
            epoch = p.epoch,
            qpn = p.qps[0].qpn,
            msg_qpn = p.qps[1].qpn,
            remote_qpn = msg.qpn,
            remote_msg_qpn = msg.msg_qpn,
            "verbs peer connected"
        );
        Ok(())
    }

    /// One QP of `peer`: INIT → RTR → RTS towards the remote RC QP `remote_qpn`.
    fn connect_qp(&mut self, peer: usize, lane: Lane, remote_qpn: u32, remote_psn: u32) -> Result<(), Error> {
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
        )?;
        self.peers[peer].qps[lane as usize].remote_qpn = Some(remote_qpn);
        Ok(())
    }

    /// Marks `peer` failed with its first cause and moves both of its QPs to the error
    /// state: the peer is lost, so the work still queued on either QP is flushed (each
    /// completes as `ECONNRESET`, `PeerLost`, naming the cause, see `classify`).
    pub(super) fn fail_peer(&mut self, peer: usize, message: String) {
        let p = &mut self.peers[peer];
        if matches!(p.state, PeerState::Failed(_)) {
            return;
        }
        // The engine says it at warn for the peers the application added (it knows which).
        tracing::debug!(peer, %message, "verbs peer failed");
        for q in &p.qps {
            move_to_err(q);
        }
        // Work requests chained on a fresh QP (moved from the QP it replaced) never reached
        // the NIC and never will: they fail now, as the flushed ones do.
        let unposted: Vec<u64> = p
            .qps
            .iter_mut()
            .filter(|q| q.remote_qpn.is_none())
            .flat_map(|q| {
                q.outstanding -= q.chain.len() as u32;
                q.chain.drain(..).map(|w| w.wr.wr_id)
            })
            .collect();
        for wr_id in unposted {
            let index = (wr_id & !super::WR_KIND_MASK) as usize;
            if let Some((token, _, _)) = self.ops.get_mut(index).and_then(Option::take) {
                self.free_ops.push(index as u32);
                self.outstanding -= 1;
                let message = format!("not posted: {message}");
                let cause = crate::provider::FailCause::PeerLost;
                self.ready.push_back(crate::provider::Completion::Failed {
                    token,
                    errno: libc::ECONNRESET,
                    message,
                    cause,
                });
            }
        }
        self.peers[peer].state = PeerState::Failed(message);
    }

    /// Brings back a failed peer ([`VerbsDomain::reconnect_failed`]): both QPs are replaced,
    /// the epoch goes up and the handshake starts again (`restart`); posts answer `Again`
    /// until it completes, and the peer fails again if it does not within the connect
    /// timeout. A peer that has not failed is left as it is.
    pub(super) fn revive(&mut self, peer: usize) -> Result<(), Error> {
        let PeerState::Failed(m) = &self.peers[peer].state else { return Ok(()) };
        let cause = format!("the peer was revived after: {m}");
        self.restart(peer, &cause)?;
        tracing::info!(peer, epoch = self.peers[peer].epoch, "verbs peer revived; handshaking again");
        Ok(())
    }

    /// Starts `peer`'s connection afresh, whatever its state: both QPs are replaced (what
    /// was posted on the old ones fails naming `cause`), the epoch goes up by one and the
    /// peer is Connecting from now, its REQ sent at once. If a QP cannot be made, the peer
    /// fails and the error is returned.
    pub(super) fn restart(&mut self, peer: usize, cause: &str) -> Result<(), Error> {
        for lane in [Lane::Data, Lane::Msg] {
            if let Err(e) = self.replace_lane(peer, lane, cause) {
                self.fail_peer(peer, format!("{cause}; re-creating its queue pair failed: {e}"));
                return Err(e);
            }
        }
        let p = &mut self.peers[peer];
        p.epoch = p.epoch.wrapping_add(1);
        p.state = PeerState::Connecting { since: Instant::now(), last: None };
        self.drive_handshakes(Instant::now());
        Ok(())
    }
}

/// Moves a QP to the error state (its posted work requests are flushed); failures are logged.
fn move_to_err(q: &PeerQp) {
    // SAFETY: all-zero is a valid ibv_qp_attr.
    let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
    if let Err(e) = modify_qp(&q.qp, &mut a, sys::ibv_qp_attr_mask::IBV_QP_STATE.0) {
        tracing::debug!(qpn = q.qpn, error = %e, "moving a QP to ERR failed");
    }
}
