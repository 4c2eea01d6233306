//! Revocations that a racing write cannot outrun, on transports whose target refuses a bad
//! key without telling the writer (libfabric 1.17's shm: a write with immediate through a
//! key the owner has closed completes at the writer as if delivered, up to 4 KiB, or never;
//! `docs/faults.md`). A child module of `core`, so it works on `Core`'s fields directly.
//!
//! ```text
//!  writer's reactor                                  owner's reactor
//!   │ write_imm posted (key still registered)          │ region dropped: Deregister
//!   │   ─ ─ command queued in the owner's region ─ ─ ─►│ `draining`: registration and
//!   │◄────────────── Revoke { [(base, key)] } ─────────│ memory kept; Revoke to each peer
//!   on_revoke: flag set (new posts: Stale); the key   │
//!   in `recent` (a post already queued: Stale);       │
//!   `acking`: once every operation posted to the      │
//!   owner before now is done                          │
//!   │──────────── RevokeAck { [(base, key)] } ────────►│ processed after those writes
//!   │                                                  │ (one command queue, FIFO):
//!   │                                                  │ they landed and were counted;
//!   │                                                  │ every peer acked (or is down, or
//!   │                                                  │ DRAIN_BOUND passed): deregister
//! ```
//!
//! Why that is enough: libfabric 1.17's shm owner processes the commands of its region's one
//! queue in order (`smr_progress_cmd` in `prov/shm/src/smr_progress.c`), and every sender's
//! endpoints push into that queue when they post. An operation posted before the `Revoke`
//! arrived is done at the writer before the acknowledgement is posted, so the owner meets
//! it (and, for the protocols that copy later, finishes it: the writer's completion of a
//! write over 4 KiB waits for the owner's copy) before it meets the acknowledgement, while
//! the key is still registered. An operation not yet posted when the `Revoke` arrived fails
//! with `Error::Stale`, at submission (the region's flag) or at the post (`recent`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::Core;
use crate::provider::{Domain, Registration};
use crate::pure::int_map::IntMap;
use crate::pure::revoke::{Revoke, RevokeAck};
use crate::shared::memory::Backing;
use crate::shared::notify::Notify;
use crate::shared::queue::Submission;
use crate::shared::PeerId;

/// How long an owner keeps a freed region registered for peers that do not acknowledge its
/// revocation (an older build, a peer stopped but not dead).
pub(super) const DRAIN_BOUND: Duration = Duration::from_secs(1);
/// How long a writer remembers a revoked key for the check at post time when the engine
/// has no `op_timeout` (an operation waiting to be posted longer than `op_timeout` fails).
const RECENT_BACKSTOP: Duration = Duration::from_secs(30);
/// The most revoked keys a writer remembers for the check at post time (the oldest go).
const RECENT_CAP: usize = 65_536;

/// Owner: a freed region, still registered (and its memory still held) until every peer it
/// was revoked to has acknowledged.
pub(super) struct Draining {
    regs: Vec<Registration>,
    backing: Backing,
    /// (base, key) on NIC 0, as the `Revoke` names it.
    region: (u64, u64),
    waiting: Vec<PeerId>,
    since: Instant,
}

/// Writer: an acknowledgement to send to `peer` once every operation posted to it before
/// `since` is done.
pub(super) struct Acking {
    peer: PeerId,
    since: Instant,
    data: Bytes,
}

/// Writer: the keys revoked lately, by key: (owner, base, when). An operation submitted
/// before its region's flag was set may be posted after the `Revoke` arrived (it waited in
/// the submission queue or behind a full NIC queue); this catches it.
#[derive(Default)]
pub(super) struct Recent {
    by_key: IntMap<u64, (PeerId, u64, Instant)>,
    order: VecDeque<(Instant, u64)>,
}

impl<D: Domain> Core<D> {
    /// A region was freed: on a transport whose target refuses a bad key silently, keep it
    /// registered until the peers it is revoked to acknowledge (`draining`); otherwise (or
    /// with no live peer) deregister it now. It leaves `live` at once: nobody is vouched
    /// for it any more.
    pub(super) fn drain_or_deregister(&mut self, regs: Vec<Registration>, backing: Backing) {
        let waiting: Vec<PeerId> = if self.shared.vouch && !self.closing {
            (0..self.peers.len())
                .filter(|&i| self.peers[i].failed.is_none() && !self.peers[i].removed)
                .map(|i| PeerId(i as u32))
                .collect()
        } else {
            Vec::new()
        };
        let Some(first) = regs.first().filter(|_| !waiting.is_empty()) else {
            return self.deregister(regs, backing);
        };
        let region = (first.remote_base, first.remote_key);
        for (d, r) in regs.iter().enumerate() {
            self.live[d].remove(&r.handle);
        }
        self.draining.push(Draining { regs, backing, region, waiting, since: Instant::now() });
    }

    /// A peer acknowledged our revocation of regions: it posts nothing more to them, and
    /// what it posted before has been processed here.
    pub(super) fn on_revoke_ack(&mut self, msg: &[u8], from: Option<PeerId>) {
        let ack = match RevokeAck::from_bytes(msg) {
            Ok(a) => a.0,
            Err(e) => {
                tracing::warn!(error = %e, "dropped a malformed revoke acknowledgement");
                return;
            }
        };
        let Some(peer) = from else {
            tracing::debug!("a revoke acknowledgement without its sender: ignored");
            return;
        };
        if ack.incarnation != self.shared.address.incarnation {
            return;
        }
        for d in self.draining.iter_mut().filter(|d| ack.regions.contains(&d.region)) {
            d.waiting.retain(|&p| p != peer);
        }
        self.check_drains();
    }

    /// Deregisters the draining regions that no live peer waits for any more, or that
    /// waited [`DRAIN_BOUND`]. Run every pass while one drains.
    pub(super) fn check_drains(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.draining.len() {
            let peers = &self.peers;
            let d = &mut self.draining[i];
            d.waiting.retain(|p| peers.get(p.0 as usize).is_some_and(|p| p.failed.is_none() && !p.removed));
            let late = now.duration_since(d.since) >= DRAIN_BOUND;
            if !d.waiting.is_empty() && !late {
                i += 1;
                continue;
            }
            let d = self.draining.swap_remove(i);
            if late && !d.waiting.is_empty() {
                tracing::debug!(
                    peers = ?d.waiting,
                    bound = ?DRAIN_BOUND,
                    "peers did not acknowledge a revocation in time; the region is deregistered"
                );
            }
            self.finish_drain(d);
        }
    }

    /// Closes a draining region's registrations, then lets its memory go.
    pub(super) fn finish_drain(&mut self, d: Draining) {
        for (n, r) in d.regs.into_iter().enumerate() {
            self.domains[n].deregister(r);
        }
        drop(d.backing);
    }

    /// Writer: a peer revoked regions. Where the owner keeps them registered for our
    /// acknowledgement (shm), remember the keys for the check at post time and acknowledge
    /// once what was posted to it before now is done.
    pub(super) fn ack_revocation(&mut self, r: &Revoke, from: Option<PeerId>) {
        if !self.shared.vouch || self.closing {
            return;
        }
        let peer = from.or_else(|| {
            let i = self
                .peers
                .iter()
                .position(|p| !p.removed && r.incarnation != 0 && p.incarnation == r.incarnation)?;
            Some(PeerId(i as u32))
        });
        let Some(peer) = peer else {
            tracing::debug!("a revocation from a peer this engine does not know: not acknowledged");
            return;
        };
        let now = Instant::now();
        self.prune_recent(now);
        for &(base, key) in &r.regions {
            self.recent.by_key.insert(key, (peer, base, now));
            self.recent.order.push_back((now, key));
        }
        let data = RevokeAck(r.clone()).to_bytes().into();
        self.acking.push(Acking { peer, since: now, data });
        self.send_acks();
    }

    /// Sends the acknowledgements whose operations are done (or drops those whose peer is
    /// down). Run every pass while one waits. Returns whether one was sent.
    pub(super) fn send_acks(&mut self) -> bool {
        let mut ready = Vec::new();
        let mut i = 0;
        while i < self.acking.len() {
            let a = &self.acking[i];
            let gone = self.peers.get(a.peer.0 as usize).is_none_or(|p| p.failed.is_some() || p.removed);
            let busy =
                !gone && self.slab.iter().any(|op| op.peer == a.peer && op.posted <= a.since && !op.expired);
            if busy {
                i += 1;
                continue;
            }
            let a = self.acking.swap_remove(i);
            if !gone {
                ready.push(a);
            }
        }
        let sent = !ready.is_empty();
        for a in ready {
            // Behind the peer's operations still waiting to be posted, if any (in order).
            self.handle(Submission::Send { peer: a.peer, data: a.data, notify: Notify::None });
        }
        if sent {
            self.flush_posted();
        }
        sent
    }

    /// Whether an operation to `peer` through `key` on NIC 0 at `addr` names a region whose
    /// revocation has arrived (the check at post time; nothing to do on tcp and verbs,
    /// where `recent` stays empty).
    pub(super) fn revoked_at_post(&self, peer: PeerId, domain: usize, addr: u64, key: u64) -> bool {
        domain == 0
            && !self.recent.by_key.is_empty()
            && self.recent.by_key.get(&key).is_some_and(|&(p, base, _)| p == peer && addr >= base)
    }

    /// Forgets revoked keys older than `op_timeout` (no operation waits that long to be
    /// posted) or past [`RECENT_CAP`].
    pub(super) fn prune_recent(&mut self, now: Instant) {
        let keep = self.cfg.op_timeout.unwrap_or(RECENT_BACKSTOP);
        while let Some(&(t, key)) = self.recent.order.front() {
            if now.duration_since(t) < keep && self.recent.order.len() < RECENT_CAP {
                break;
            }
            self.recent.order.pop_front();
            if self.recent.by_key.get(&key).is_some_and(|&(_, _, at)| at == t) {
                self.recent.by_key.remove(&key);
            }
        }
    }
}
