//! The receive side: the two SRQs (zero-length imm receives, message slots) kept topped up,
//! and received messages copied into the engine's receive buffers. See "Two RC QPs per peer,
//! two SRQs" in the module docs.

use std::ptr;

use rdma_sys as sys;

use super::datapath::Wc;
use super::error::{check, status_str};
use super::qp::Lane;
use super::{VerbsDomain, WR_IMM_RECV, WR_MSG_RECV};
use crate::provider::Completion;

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

impl VerbsDomain {
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

    /// Tops up both SRQs: the imm SRQ with zero-length receives, the message SRQ with every
    /// free message slot; one chain (one `ibv_post_srq_recv`) each.
    pub(super) fn replenish_srqs(&mut self) {
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

    /// Delivers held messages into engine receive buffers.
    pub(super) fn deliver_held(&mut self) {
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

    /// A receive of either SRQ failed: its QP (and so its peer) is gone.
    pub(super) fn recv_failed(&mut self, wc: &Wc) {
        let status = status_str(wc.status);
        tracing::warn!(%status, qpn = wc.qp_num, "a receive failed");
        // The receiving QP went to the error state (the requester's operation was refused
        // here, e.g. a write with immediate through a bad key): the connection is
        // re-established, as the requester does. A QP already replaced is left alone.
        let Some(&p) = self.peer_by_qpn.get(&wc.qp_num) else { return };
        let lane = match self.peers[p].qps.iter().position(|q| q.qpn == wc.qp_num) {
            Some(0) => Lane::Data,
            Some(_) => Lane::Msg,
            None => return,
        };
        self.reconnect(p, lane, &format!("a receive failed: {status} (vendor error {:#x})", wc.vendor_err));
    }
}
