//! Keep-alive: finding a dead peer that nothing is posted to.
//!
//! An RC QP learns that its peer is gone only by sending to it: the transport retries an
//! unanswered request and then fails it (`IBV_WC_RETRY_EXC_ERR`). A peer this domain posts
//! nothing to (a receiver that only waits for messages) would never be found dead. So a
//! Connected peer with nothing in flight on either QP whose last completion is older than
//! [`VerbsConfig::keepalive`](super::VerbsConfig::keepalive) (100 ms by default) gets a
//! **probe**: a signaled zero-length `RDMA_WRITE` on its data QP (`wr_id` kind `WR_PROBE`,
//! the low bits the peer's index).
//!
//! * Cheap for the peer: a zero-length RDMA write names no memory (IBTA C9-88: it need carry
//!   no valid address or rkey; rxe's responder returns before its rkey check for a zero
//!   length, "A zero-byte op is not required to set an addr or rkey" in `check_rkey`,
//!   `drivers/infiniband/sw/rxe/rxe_resp.c`), consumes no receive and makes no completion
//!   there. The peer's NIC (for rxe: its kernel) acknowledges it without the peer's process,
//!   so a live process that is busy, or stopped, is never taken for a dead one; a process
//!   that exited has had its QPs destroyed, nothing answers, and the probe fails after the
//!   transport's retries (timeout 14, 6 retries: ~0.5 s).
//! * Bounded: at most one probe in flight per peer, none while operations are in flight to
//!   it (their own completions or failures tell), and only within the CQ's budget of sends
//!   (`max_outstanding`; a probe counts in `outstanding` like an operation).
//! * Internal: the engine never sees a probe, only [`Completion::PeerDown`] when one finds
//!   the peer lost; probes are in no operation statistics.
//! * No busy wake-ups: the pass runs from `poll` when due (`keepalive_next`; one comparison
//!   per poll otherwise), and [`VerbsDomain::keepalive_timer`] ends a sleep when the next
//!   probe is due. An idle engine wakes about twice per period per idle peer (the probe, its
//!   completion), like tcp's 100 ms liveness timer.
//!
//! A probe's completion: success marks the peer heard; a status that means a lost peer
//! fails the peer (`fail_peer`) and reports [`Completion::PeerDown`]; a flush on a live
//! peer's current QP (torn down by the peer's side) re-establishes that QP as an
//! operation's would; a probe on a QP replaced since says nothing.

use std::ptr;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use super::error::{check, status_class, status_str, StatusClass};
use super::qp::{Lane, PeerState};
use super::{VerbsDomain, WR_PROBE};
use crate::provider::{Completion, PeerHandle};

/// The shortest sleep [`VerbsDomain::keepalive_timer`] asks for, so that a pass that is due
/// but finds nothing to do can never make the reactor spin.
const MIN_TIMER: Duration = Duration::from_millis(1);

impl VerbsDomain {
    /// The keep-alive pass, when due (see the module docs): takes each peer's `heard` into
    /// `last_heard`, posts a probe to each Connected, idle peer not heard for a period, and
    /// sets when the next pass is due.
    pub(super) fn drive_keepalive(&mut self, now: Instant) {
        let Some(period) = self.cfg.keepalive else { return };
        if now < self.keepalive_next {
            return;
        }
        // Peers with something in flight, or a probe, are looked at again a period from now.
        let mut next = now + period;
        for idx in 0..self.peers.len() {
            let p = &mut self.peers[idx];
            if p.heard {
                p.heard = false;
                p.last_heard = now;
            }
            if !matches!(p.state, PeerState::Connected) || p.probing {
                continue;
            }
            if p.qps.iter().any(|q| q.outstanding > 0) {
                continue;
            }
            let due = p.last_heard + period;
            if now < due {
                next = next.min(due);
            } else if !self.post_probe(idx) {
                tracing::debug!(peer = idx, "no room for a keep-alive probe now; trying again later");
            }
        }
        self.keepalive_next = next;
    }

    /// Posts a probe to peer `idx`'s data QP (directly: the peer is idle, so nothing is
    /// chained). Returns whether it was posted.
    fn post_probe(&mut self, idx: usize) -> bool {
        if self.outstanding >= self.max_outstanding {
            return false;
        }
        let q = &self.peers[idx].qps[Lane::Data as usize];
        if q.remote_qpn.is_none() || q.outstanding >= self.sq_depth {
            return false;
        }
        // SAFETY: all-zero is a valid ibv_send_wr: no scatter/gather entries (a zero-length
        // write), remote address and rkey 0 (not looked at for a zero length), no next.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = WR_PROBE | idx as u64;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is live; wr is valid for the call and names no memory.
        let ret = unsafe { sys::ibv_post_send(q.qp.as_ptr(), &mut wr, &mut bad) };
        if let Err(e) = check("ibv_post_send(keep-alive probe)", ret) {
            tracing::debug!(peer = idx, error = %e, "posting a keep-alive probe failed");
            return false;
        }
        self.outstanding += 1;
        let p = &mut self.peers[idx];
        p.qps[Lane::Data as usize].outstanding += 1;
        p.probing = true;
        true
    }

    /// A probe to peer `idx` completed on QP `qpn` with `status` (see the module docs).
    pub(super) fn probe_done(&mut self, idx: usize, qpn: u32, status: u32, vendor_err: u32) {
        if idx >= self.peers.len() {
            tracing::warn!(peer = idx, "keep-alive completion for an unknown peer; skipped");
            return;
        }
        self.outstanding -= 1;
        let retired = self.op_completed(idx, qpn);
        let p = &mut self.peers[idx];
        p.probing = false;
        if status == sys::ibv_wc_status::IBV_WC_SUCCESS {
            p.heard = true;
            p.probes_acked += 1;
            return;
        }
        if retired.is_some() || matches!(p.state, PeerState::Failed(_)) {
            // Lost with a QP replaced since, or flushed behind what failed the peer.
            return;
        }
        let message = format!("{} (vendor error {vendor_err:#x})", status_str(status));
        match status_class(status) {
            StatusClass::Flushed => self.reconnect(
                idx,
                Lane::Data,
                "the queue pair left the ready state (torn down by the peer's side)",
            ),
            StatusClass::PeerLost => {
                let message = format!("queue pair failed (keep-alive probe): {message}");
                self.fail_peer(idx, message.clone());
                self.ready.push_back(Completion::PeerDown { peer: idx as PeerHandle, message });
            }
            _ => {
                tracing::warn!(peer = idx, %message, "a keep-alive probe failed; re-establishing its queue pair");
                self.reconnect(idx, Lane::Data, &format!("a keep-alive probe failed: {message}"));
            }
        }
    }

    /// How soon the next keep-alive pass is due, while keep-alive is on and a peer is
    /// Connected ([`Domain::timer`](crate::provider::Domain::timer)); at least [`MIN_TIMER`].
    pub(super) fn keepalive_timer(&self) -> Option<Duration> {
        self.cfg.keepalive?;
        if !self.peers.iter().any(|p| matches!(p.state, PeerState::Connected)) {
            return None;
        }
        Some(self.keepalive_next.saturating_duration_since(Instant::now()).max(MIN_TIMER))
    }
}
