//! The [`Domain`] impl: posting (work requests chained per QP, one `ibv_post_send` per QP in
//! `flush`), polling (work completions classified into [`Completion`]s by the kind in their
//! `wr_id`), arming the CQ before the reactor sleeps, and the cold calls of the contract.

use std::ffi::c_int;
use std::os::fd::RawFd;
use std::ptr;
use std::time::{Duration, Instant};

use rdma_sys as sys;

use super::error::{check, os_error, status_class, status_errno, status_str, StatusClass};
use super::handshake::HANDSHAKE_RETRY;
use super::qp::{ChainedWr, Lane, PeerState};
use super::{
    VerbsDomain, TRANSPORT, WR_IMM_RECV, WR_KIND_MASK, WR_MSG_RECV, WR_OP, WR_PROBE, WR_UD_RECV, WR_UD_SEND,
};
use crate::error::Error;
use crate::provider::{
    Completion, Domain, FailCause, MemoryLocation, Op, PeerHandle, PostError, Registration, Revival,
};
use crate::pure::verbs_wire::PeerAddr;

/// Work completions read per `ibv_poll_cq` call.
const CQ_BATCH: usize = 32;

/// The most work requests chained on one QP before `post` rings the doorbell by itself.
const MAX_CHAIN: usize = 64;

/// The immediate as it goes into `ibv_send_wr.imm_data` (network byte order).
pub fn imm_to_wire(imm: u32) -> u32 {
    imm.to_be()
}

/// The immediate from `ibv_wc.imm_data` (network byte order) as the sender posted it.
pub fn imm_from_wire(wire: u32) -> u32 {
    u32::from_be(wire)
}

/// The plain fields of an `ibv_wc` we use.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wc {
    pub(super) wr_id: u64,
    pub(super) status: u32,
    pub(super) opcode: u32,
    pub(super) vendor_err: u32,
    pub(super) byte_len: u32,
    pub(super) imm: u32,
    pub(super) qp_num: u32,
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

impl VerbsDomain {
    /// Acts on one work completion by the kind in its `wr_id`: an operation done or failed,
    /// an immediate or a message received, a handshake datagram.
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
                let retired = self.op_completed(peer, wc.qp_num);
                if ok {
                    self.peers[peer].heard = true;
                    self.ready.push_back(Completion::Done { token });
                    return;
                }
                let (errno, message, cause) = self.op_failed(peer, lane, &wc, retired);
                self.ready.push_back(Completion::Failed { token, errno, message, cause });
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
            WR_UD_RECV => self.ud_recv_done(index, wc.byte_len, ok),
            WR_UD_SEND => self.ud_send_done(index, wc.status),
            WR_PROBE => self.probe_done(index, wc.qp_num, wc.status, wc.vendor_err),
            _ => tracing::warn!(wr_id = wc.wr_id, "completion with a foreign wr_id; skipped"),
        }
    }

    /// What a failed work completion of an operation on `peer`'s `lane` means (see "Faults"
    /// in the module docs), and what follows from it: the QP is replaced (a bad access or a
    /// bad request: the operation fails alone) or the peer fails (it is unreachable).
    /// `retired` is the retirement cause of the QP it completed on, if that QP was replaced.
    fn op_failed(
        &mut self,
        peer: usize,
        lane: Lane,
        wc: &Wc,
        retired: Option<String>,
    ) -> (i32, String, FailCause) {
        let message = format!("{} (vendor error {:#x})", status_str(wc.status), wc.vendor_err);
        if let Some(first) = retired {
            // Posted on a QP that was torn down and replaced since: lost with it.
            return (
                libc::ECONNRESET,
                format!("{message}: lost with the connection: {first}"),
                FailCause::ConnectionLost,
            );
        }
        match status_class(wc.status) {
            StatusClass::Flushed => match &self.peers[peer].state {
                // Flushed behind the failure that lost the peer.
                PeerState::Failed(m) => (libc::ECONNRESET, format!("{message}: {m}"), FailCause::PeerLost),
                _ => {
                    // The QP went to the error state with no error completion here: the
                    // peer's side of a refused access tore the connection down.
                    let first = "the queue pair left the ready state (torn down by the peer's side)";
                    self.reconnect(peer, lane, first);
                    (
                        libc::ECONNRESET,
                        format!("{message}: lost with the connection: {first}"),
                        FailCause::ConnectionLost,
                    )
                }
            },
            StatusClass::PeerLost => {
                self.fail_peer(peer, format!("queue pair failed: {message}"));
                (status_errno(wc.status), message, FailCause::PeerLost)
            }
            class => {
                // This operation's own failure. The QP is in the error state now (both sides'
                // QPs, for a refused access): the connection is re-established, and what was
                // posted behind this operation is flushed and fails `ConnectionLost`.
                self.reconnect(peer, lane, &format!("an earlier operation failed: {message}"));
                let cause =
                    if class == StatusClass::RemoteAccess { FailCause::RemoteAccess } else { FailCause::Op };
                (status_errno(wc.status), message, cause)
            }
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
        let lane = if matches!(op, Op::Send { .. }) { Lane::Msg } else { Lane::Data };
        match &p.state {
            PeerState::Connected => {}
            // While one lane is re-established, the other carries on.
            PeerState::Connecting { .. } if p.ready(lane) => {}
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
        if n == 0 || p.remote_qpn.is_none() {
            // A fresh QP (being connected) keeps its chain until it is in RTS.
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
            if let Some((token, peer, _)) = self.ops.get_mut(index).and_then(Option::take) {
                self.free_ops.push(index as u32);
                self.peers[peer].lane(lane).outstanding -= 1;
                self.outstanding -= 1;
                let cause = FailCause::of_errno(errno);
                self.ready.push_back(Completion::Failed { token, errno, message: message.clone(), cause });
            }
        }
    }

    /// The error of a post to `peer`, which has failed or is not connected.
    fn post_send_op_failed(&self, peer: PeerHandle) -> Result<(), PostError> {
        let message = match &self.peers[peer as usize].state {
            PeerState::Failed(m) => m.clone(),
            _ => "not connected".into(),
        };
        Err(PostError::Failed(Error::PeerUnreachable { peer: peer as u32, message }))
    }
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
        // SAFETY: forwarded from the caller (the range stays allocated until deregister).
        unsafe { self.register_memory(addr, len, location) }
    }

    fn deregister(&mut self, reg: Registration) {
        self.deregister_memory(reg);
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

    /// Starts reviving a peer the engine marked down: fresh QPs, the next epoch, a handshake
    /// (`revive.rs`); returns at once. [`Domain::revival`] tells when the peer's process has
    /// answered, or that it has not within `VerbsConfig::revive_timeout`.
    fn revive_peer(&mut self, peer: PeerHandle) -> Result<(), Error> {
        self.start_revival(peer)
    }

    fn revival(&mut self, peer: PeerHandle) -> Revival {
        self.revival_state(peer)
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
        // Taken and given back cleared, so that the list keeps its capacity: a pass allocates
        // nothing in steady state (it may run on the synchronous fast path's thread).
        let mut chained = std::mem::take(&mut self.chained);
        for &idx in &chained {
            // SAFETY: every chained request came through `post`, whose caller guarantees its
            // memory (see `flush_peer`).
            unsafe { self.flush_peer(idx) };
        }
        chained.clear();
        self.chained = chained;
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
        let now = Instant::now();
        self.drive_handshakes(now);
        self.drive_keepalive(now);
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
        let handshake = self
            .peers
            .iter()
            .any(|p| matches!(p.state, PeerState::Connecting { .. }))
            .then_some(HANDSHAKE_RETRY);
        // And when the next keep-alive probe is due (`keepalive.rs`).
        match (handshake, self.keepalive_timer()) {
            (Some(h), Some(k)) => Some(h.min(k)),
            (h, k) => h.or(k),
        }
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

    #[test]
    fn imm_is_big_endian_on_the_wire() {
        let wire = imm_to_wire(0x0102_0304);
        assert_eq!(wire.to_ne_bytes(), [1, 2, 3, 4]);
        assert_eq!(imm_from_wire(wire), 0x0102_0304);
        for v in [0, 1, 0xdead_beef, u32::MAX] {
            assert_eq!(imm_from_wire(imm_to_wire(v)), v);
        }
    }
}
