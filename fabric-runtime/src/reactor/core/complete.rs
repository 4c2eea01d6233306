//! The completion half of a reactor pass ([`Core::poll_domains`]): poll each domain, count
//! arrivals, finish operations (their futures, batches and shard groups), deliver messages;
//! and operation deadlines ([`Core::expire`]). A child module of `core`, so it works on
//! `Core`'s fields directly.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Core, InFlight, POLL_BATCH, RECV_TAG};
use crate::error::{Error, Result};
use crate::provider::{Completion, Domain, FailCause};
use crate::pure::control::{MsgKind, HEADER_LEN};
use crate::shared::events::PeerEvent;
use crate::shared::notify::Notify;
use crate::shared::stats::ReactorCounters;
use crate::sync::lock;

/// Whether `c` ends an operation held in the slab (not an arrival, a message or a posted
/// receive's failure).
fn ends_op(c: &Completion) -> bool {
    match c {
        Completion::Done { .. } => true,
        Completion::Failed { token, .. } => token & RECV_TAG == 0,
        _ => false,
    }
}

impl<D: Domain> Core<D> {
    pub(super) fn poll_domains(&mut self) -> bool {
        let mut any = false;
        for d in 0..self.domains.len() {
            let mut comps = std::mem::take(&mut self.completions);
            let t = self.clock();
            let polled = self.domains[d].poll(&mut comps, POLL_BATCH);
            ReactorCounters::charge(&self.shared.stats.reactor.poll_ns, t);
            match polled {
                Ok(0) => {}
                Ok(_) => {
                    any = true;
                    let t = self.clock();
                    let mut took = false;
                    // Completions of this batch for operations in the slab, not yet handled.
                    let mut ops_left = comps.iter().filter(|c| ends_op(c)).count();
                    for c in comps.drain(..) {
                        ops_left -= usize::from(ends_op(&c));
                        self.complete(d, c);
                        // When this batch completes everything that was in flight (shm
                        // completes a whole window of writes together), the NIC has nothing
                        // to do until something is posted: a caller woken (or lingering) on
                        // an earlier completion of the batch may have submitted its next
                        // operation already, so post it now, before the rest of the batch,
                        // not after. Once per batch. With operations still in flight (tcp's
                        // completions trickle in) the NIC is busy and the batch goes first:
                        // posting between its completions would only split the submitters'
                        // next batch of posts.
                        if !took
                            && self.slab.len() <= ops_left
                            && self.shared.has_items.load(Ordering::Acquire)
                        {
                            took = true;
                            self.take_submissions();
                            self.flush_posted();
                        }
                    }
                    ReactorCounters::charge(&self.shared.stats.reactor.complete_ns, t);
                }
                Err(e) => tracing::error!(domain = d, error = %e, "polling the completion queue failed"),
            }
            self.completions = comps;
        }
        any
    }

    /// One arrival of `imm`. The counter of the last immediate seen is kept at hand: the
    /// map's SipHash (kept, since a peer chooses the keys) is paid only when it changes. A
    /// value new to this reactor asks the engine's table, which refuses it when full
    /// (`Shared::arrival_cell`: counted, logged now and then); a refused value is asked
    /// about again at its next arrival, so one whose counter the application creates
    /// meanwhile is counted from then on.
    pub(super) fn arrive(&mut self, imm: u32) {
        if let Some((last, cell)) = &self.last_counter {
            if *last == imm {
                cell.arrive(1);
                return;
            }
        }
        let cell = match self.counters.get(&imm) {
            Some(cell) => cell.clone(),
            None => {
                let Some(cell) = self.shared.arrival_cell(imm) else { return };
                self.counters.insert(imm, cell.clone());
                cell
            }
        };
        cell.arrive(1);
        self.last_counter = Some((imm, cell));
    }

    /// `Engine::retire_counter(imm)`: the counter leaves this reactor's map and the engine's
    /// table together (no arrival is counted in between: both happen in this pass), so the
    /// next arrival of `imm` starts a new one. Returns the arrivals discarded.
    pub(super) fn retire_counter(&mut self, imm: u32) -> u64 {
        self.counters.remove(&imm);
        if self.last_counter.as_ref().is_some_and(|(last, _)| *last == imm) {
            self.last_counter = None;
        }
        self.shared.retire_counter(imm)
    }

    pub(super) fn complete(&mut self, d: usize, c: Completion) {
        match c {
            Completion::Imm { imm } => self.arrive(imm),
            Completion::Done { token } => {
                if let Some(op) = self.slab.remove(token) {
                    self.finish(op, Ok(()));
                } else {
                    tracing::warn!(token, "completion for an unknown operation");
                }
            }
            Completion::Failed { token, errno, message, cause } => {
                if token & RECV_TAG != 0 {
                    tracing::debug!(errno, %message, "a posted receive failed (cancelled at shutdown?)");
                    return;
                }
                let Some(op) = self.slab.remove(token) else {
                    tracing::warn!(token, errno, %message, "failure for an unknown operation");
                    return;
                };
                let peer = op.peer;
                // Only a lost peer goes down: a refused access or a connection the transport
                // rebuilds fails this operation alone (docs/faults.md).
                let e = match cause {
                    FailCause::PeerLost => {
                        if let Some(p) = self.peers.get(peer.0 as usize).filter(|p| p.failed.is_none()) {
                            // A peer known only through its Hello (a writer that already
                            // left, found by a Revoke or a keep-alive): not the application's
                            // concern, so not a warning, as for its `PeerDown` below.
                            if p.passive {
                                tracing::debug!(peer = peer.0, errno, %message, "peer unreachable; marked failed");
                            } else {
                                tracing::warn!(peer = peer.0, errno, %message, "peer unreachable; marked failed");
                            }
                        }
                        self.mark_down(peer, &message);
                        Error::PeerUnreachable { peer: peer.0, message }
                    }
                    FailCause::RemoteAccess => Error::RemoteAccess { peer: peer.0, op: op.name, message },
                    FailCause::ConnectionLost => Error::ConnectionLost { peer: peer.0, op: op.name, message },
                    FailCause::Op => Error::Completion { op: op.name, errno, message },
                };
                self.finish(op, Err(e));
            }
            Completion::PeerDown { peer: handle, message } => {
                let Some(&peer) = self.handle_to_peer[d].get(&handle) else { return };
                if self.peers.get(peer.0 as usize).is_some_and(|p| p.passive) {
                    tracing::debug!(peer = peer.0, nic = d, %message, "peer down (known through its Hello)");
                } else {
                    tracing::warn!(peer = peer.0, nic = d, %message, "peer down");
                }
                self.mark_down(peer, &message);
                self.fail_peer(peer, &message);
            }
            Completion::Recv { token, len, src } => {
                let slot = (token & 0xffff_ffff) as u32;
                let pool = &self.recv_pools[d];
                let local = pool.slot(slot);
                let len = len.min(pool.slot_size);
                // SAFETY: the NIC has completed this receive, so the slot holds `len` bytes
                // and nothing writes to it until it is posted again below.
                let data = Bytes::copy_from_slice(unsafe {
                    std::slice::from_raw_parts(local.addr as *const u8, len)
                });
                let from = src.and_then(|h| self.handle_to_peer[d].get(&h).copied());
                if let Err(e) = self.post_recv(d, slot) {
                    tracing::error!(error = %e, "re-posting a receive buffer failed");
                }
                self.unflushed = true;
                match MsgKind::of(&data) {
                    Some(MsgKind::User) => {
                        let waker = lock(&self.shared.inbox).push((from, data.slice(HEADER_LEN..)));
                        if let Some(w) = waker {
                            w.wake();
                        }
                    }
                    Some(MsgKind::Revoke) => self.on_revoke(&data, from),
                    Some(MsgKind::RevokeAck) => self.on_revoke_ack(&data, from),
                    Some(MsgKind::Hello) => self.on_hello(&data),
                    Some(MsgKind::Vouch) => self.on_vouch(&data),
                    Some(MsgKind::Vouched) => self.on_vouched(&data, from),
                    #[cfg(feature = "cuda")]
                    Some(MsgKind::Pull) => self.on_pull(&data),
                    #[cfg(feature = "cuda")]
                    Some(MsgKind::Ack) => self.on_ack(&data),
                    #[cfg(feature = "cuda")]
                    Some(MsgKind::Push) => self.on_push(&data),
                    kind => {
                        tracing::warn!(?kind, len, "dropped a message of a kind this engine does not serve")
                    }
                }
            }
        }
    }

    /// Fails every operation that has waited longer than `limit` for its completion and
    /// marks its peer failed. The slab entry stays (keeping its memory alive) until the
    /// provider completes or shutdown cancels it.
    pub(super) fn expire(&mut self, now: Instant, limit: Duration) {
        #[cfg(feature = "cuda")]
        self.expire_acks(now, limit);
        self.prune_recent(now);
        // Operations that never even reached the NIC (a peer whose connection never comes
        // up keeps refusing them).
        for i in 0..self.pending_peers.len() {
            let peer = self.pending_peers[i];
            let p = &mut self.peers[peer.0 as usize];
            if p.pending.front().is_some_and(|(since, _)| now.duration_since(*since) >= limit) {
                let message = format!("operations could not be posted within {limit:?}; peer marked failed");
                tracing::warn!(peer = peer.0, %message, "operations timed out");
                p.failed.get_or_insert_with(|| message.clone());
                self.shared.peer_events.publish(PeerEvent::Down { peer, reason: message.clone() });
                for (_, s) in p.pending.drain(..) {
                    self.shared.stats.backlog(s.nic(), &p.stats, false, 1);
                    if !s.is_internal() {
                        self.shared.stats.failed(s.nic(), Some(&p.stats), false);
                    }
                    s.fail(Error::PeerUnreachable { peer: peer.0, message: message.clone() });
                }
            }
        }
        let peers = &self.peers;
        self.pending_peers.retain(|p| !peers[p.0 as usize].pending.is_empty());
        for op in self.slab.iter_mut() {
            if matches!(op.notify, Notify::None) || now.duration_since(op.posted) < limit {
                continue;
            }
            let message = format!("no completion for a {} within {limit:?}; peer marked failed", op.name);
            tracing::warn!(peer = op.peer.0, %message, "operation timed out");
            if let Some(p) = self.peers.get_mut(op.peer.0 as usize) {
                p.failed.get_or_insert_with(|| message.clone());
                if !p.removed {
                    self.shared
                        .peer_events
                        .publish(PeerEvent::Down { peer: op.peer, reason: message.clone() });
                }
            }
            let notify = std::mem::replace(&mut op.notify, Notify::None);
            notify.fail(Error::PeerUnreachable { peer: op.peer.0, message });
            op.expired = true;
            let peer = self.peers.get(op.peer.0 as usize).map(|p| &*p.stats);
            self.shared.stats.failed(op.nic, peer, false);
        }
    }

    pub(super) fn finish(&mut self, op: InFlight, result: Result<()>) {
        let peer = self.peers.get(op.peer.0 as usize).map(|p| &*p.stats);
        match &result {
            _ if op.internal => {
                if let Err(e) = &result {
                    tracing::debug!(peer = op.peer.0, error = %e, "an engine control message was not delivered");
                }
            }
            // Counted as an error when it timed out; the NIC is done with it only now.
            _ if op.expired => self.shared.stats.landed(op.nic, peer),
            Ok(()) => self.shared.stats.completed(op.nic, peer, op.bytes),
            Err(e) => {
                self.shared.stats.failed(op.nic, peer, true);
                tracing::warn!(peer = op.peer.0, nic = op.nic, op = op.name, error = %e, "operation failed");
            }
        }
        if let Some((d, slot)) = op.send_slot {
            self.send_pools[d].free.push(slot);
        }
        #[cfg(feature = "cuda")]
        if let Notify::Internal(tag, _) = op.notify {
            drop(op.keep);
            self.internal_done(tag, result);
            return;
        }
        let t = self.clock();
        let next = op.notify.complete(result);
        ReactorCounters::charge(&self.shared.stats.reactor.wake_ns, t);
        drop(op.keep);
        for s in next {
            // The imm-only writes of an `Arrivals::One` transfer: its shards are all done.
            self.handle(s.into());
        }
    }
}
