//! Connection setup: the UD handshake. Every domain has one UD QP; `add_peer` sends a REQ
//! to the peer's UD QP (re-sent every [`HANDSHAKE_RETRY`] until a REP arrives or
//! `connect_timeout` passes), and a REQ from an unknown peer creates it. The message bytes
//! are encoded in [`crate::pure::verbs_wire`]; the protocol (simultaneous open included) is
//! described in the module docs.

use std::ptr;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use super::error::{check, status_str};
use super::qp::PeerState;
use super::{VerbsDomain, WR_UD_RECV, WR_UD_SEND};
use crate::error::Error;
use crate::pure::verbs_wire::{Handshake, HsKind, HANDSHAKE_LEN};

/// How often a connecting peer's REQ is re-sent.
pub const HANDSHAKE_RETRY: Duration = Duration::from_millis(100);
/// Q_Key of the handshake UD QPs (high bit clear: not a privileged Q_Key).
pub(super) const HANDSHAKE_QKEY: u32 = 0x1f4b_5642;
/// UD receive slots for handshake messages, and UD send slots.
pub(super) const UD_SLOTS: usize = 64;
/// Bytes per UD slot: the 40-byte GRH the HCA puts in front of every UD receive + a message.
pub(super) const UD_SLOT_SIZE: usize = 128;
/// Bytes of the global routing header in front of every UD receive.
const GRH_LEN: usize = 40;
// A handshake (behind the GRH the HCA prepends) fits one UD receive slot.
const _: () = assert!(GRH_LEN + HANDSHAKE_LEN <= UD_SLOT_SIZE);

impl VerbsDomain {
    /// Posts UD receive slot `slot` (a handshake message lands there behind the GRH).
    pub(super) fn post_ud_recv(&mut self, slot: usize) -> Result<(), Error> {
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

    /// A handshake message (REQ or REP) carrying both of our QPs.
    fn handshake(&self, peer: usize, kind: HsKind, echo_qpn: u32) -> Handshake {
        let [d, m] = &self.peers[peer].qps;
        let epoch = self.peers[peer].epoch;
        Handshake {
            kind,
            from: self.me,
            qpn: d.qpn,
            psn: d.psn,
            echo_qpn,
            msg_qpn: m.qpn,
            msg_psn: m.psn,
            epoch,
        }
    }

    /// Answers a REQ from `peer` with a REP echoing its data QPN.
    fn reply(&mut self, peer: usize, echo_qpn: u32) {
        let msg = self.handshake(peer, HsKind::Rep, echo_qpn);
        self.send_handshake(peer, msg);
    }

    /// Acts on a REQ or REP (see "Connection setup" and "Faults" in the module docs).
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
                    .and_then(|idx| self.accept(idx, &msg, false).map(|()| idx));
                match r {
                    Ok(idx) => self.reply(idx, msg.qpn),
                    Err(e) => tracing::warn!(error = %e, "accepting a verbs connection failed"),
                }
            }
            (HsKind::Req, Some(idx)) => {
                let p = &self.peers[idx];
                let accept = if msg.epoch < p.epoch {
                    // Stale: from before the connection was last re-established.
                    tracing::debug!(epoch = msg.epoch, ours = p.epoch, "stale verbs REQ; ignored");
                    false
                } else if msg.epoch > p.epoch {
                    // The peer re-established the connection (or revived us): follow it.
                    true
                } else {
                    match p.state {
                        PeerState::Connected => {
                            if p.qps[0].remote_qpn == Some(msg.qpn)
                                && p.qps[1].remote_qpn == Some(msg.msg_qpn)
                            {
                                // A duplicated or late REQ for the QPs we are connected to.
                                self.reply(idx, msg.qpn);
                            } else {
                                tracing::warn!(
                                    epoch = msg.epoch,
                                    req_qpn = msg.qpn,
                                    "REQ from a connected peer for other QPs in the same epoch; ignored"
                                );
                            }
                            false
                        }
                        // Simultaneous open (or both sides re-establishing at once): the
                        // larger address accepts, the smaller one waits for the REP to its own
                        // REQ.
                        PeerState::Connecting { .. } => self.address.as_slice() >= from.encode().as_slice(),
                        PeerState::Failed(_) => false,
                    }
                };
                if accept {
                    match self.accept(idx, &msg, false) {
                        Ok(()) => self.reply(idx, msg.qpn),
                        Err(e) => self.fail_peer(idx, format!("connecting the QP failed: {e}")),
                    }
                }
            }
            (HsKind::Rep, Some(idx)) => {
                let p = &self.peers[idx];
                if matches!(p.state, PeerState::Connecting { .. })
                    && msg.epoch == p.epoch
                    && msg.echo_qpn == p.qps[0].qpn
                {
                    if let Err(e) = self.accept(idx, &msg, true) {
                        self.fail_peer(idx, format!("connecting the QP failed: {e}"));
                    }
                }
            }
            (HsKind::Rep, None) => tracing::debug!("REP from an unknown peer; ignored"),
        }
    }

    /// Re-sends due REQs; fails peers past the connect timeout.
    pub(super) fn drive_handshakes(&mut self, now: Instant) {
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
            if last.is_none_or(|l| now.duration_since(l) >= HANDSHAKE_RETRY) {
                self.peers[idx].state = PeerState::Connecting { since, last: Some(now) };
                let msg = self.handshake(idx, HsKind::Req, 0);
                self.send_handshake(idx, msg);
            }
        }
    }

    /// A UD receive of `byte_len` bytes completed (`index`: its slot; `ok`: successfully):
    /// hands a handshake to `on_handshake`, then re-posts the slot.
    pub(super) fn ud_recv_done(&mut self, index: usize, byte_len: u32, ok: bool) {
        if ok {
            let len = (byte_len as usize).min(UD_SLOT_SIZE);
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

    /// A UD send completed with `status` (`index`: its slot): the slot is free again.
    pub(super) fn ud_send_done(&mut self, index: usize, status: u32) {
        if status != sys::ibv_wc_status::IBV_WC_SUCCESS {
            tracing::debug!(status = %status_str(status), "a handshake send failed");
        }
        self.ud_send_free.push(index as u32);
    }
}
