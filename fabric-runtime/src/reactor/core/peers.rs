//! The peers of a reactor: adding one (and telling it who we are: `Hello`), bringing back
//! one marked down that answers again (started here, settled in `revive.rs`), removing one, marking one down and failing what is
//! held for it, and the control messages that keep descriptors honest (sending `Revoke` for
//! the regions freed here, acting on a peer's `Revoke` and `Hello`: `pure/revoke.rs`). A
//! child module of `core`, so it works on `Core`'s fields directly.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use super::{Core, PeerState};
use crate::error::{Error, Result};
use crate::provider::Domain;
use crate::pure::descriptor::EngineAddress;
use crate::pure::revoke::{Hello, Revoke, MAX_REVOKED};
use crate::shared::events::PeerEvent;
use crate::shared::notify::{Notify, Reply};
use crate::shared::queue::Submission;
use crate::shared::PeerId;

/// What [`Core::add_peer_as`] did.
enum Added {
    /// The peer (new, known, or brought back at once).
    Peer(PeerId),
    /// A peer marked down whose revival waits for its answer (`revive.rs`).
    Reviving(PeerId),
}

impl<D: Domain> Core<D> {
    /// `Engine::add_peer`: answers `reply` now, or, for a peer marked down whose NICs need a
    /// round trip to tell whether it answers (verbs), once they can (`revive.rs`).
    pub(super) fn add_peer(&mut self, address: crate::pure::descriptor::EngineAddress, reply: Reply<PeerId>) {
        match self.add_peer_as(address, false) {
            Ok(Added::Peer(id)) => {
                let _ = reply.send(Ok(id));
            }
            Ok(Added::Reviving(id)) => self.await_revival(id, reply),
            Err(e) => {
                tracing::warn!(error = %e, "adding a peer failed");
                let _ = reply.send(Err(e));
            }
        }
    }

    /// The peer at `address`, added if new, for the engine's own protocols (a GPU pull or
    /// push request names its sender): as [`Core::add_peer`], but a peer down whose revival
    /// waits for its answer is returned at once, still down.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn peer_of(&mut self, address: crate::pure::descriptor::EngineAddress) -> Result<PeerId> {
        match self.add_peer_as(address, false)? {
            Added::Peer(id) | Added::Reviving(id) => Ok(id),
        }
    }

    /// The peer that sent an engine control message naming its own address (a `Vouch`
    /// question), added if new as a peer known through its `Hello` is.
    pub(super) fn peer_of_sender(&mut self, address: EngineAddress) -> Result<PeerId> {
        match self.add_peer_as(address, true)? {
            Added::Peer(id) | Added::Reviving(id) => Ok(id),
        }
    }

    /// [`Core::add_peer`]; `passive`: only because it said `Hello` ([`PeerState::passive`]).
    fn add_peer_as(
        &mut self,
        address: crate::pure::descriptor::EngineAddress,
        passive: bool,
    ) -> Result<Added> {
        let incarnation = address.incarnation;
        // Peers are found by their transport addresses; the incarnation tells runs apart.
        let key = crate::pure::descriptor::EngineAddress { incarnation: 0, ..address.clone() }.to_bytes();
        if let Some(&id) = self.peer_by_addr.get(&key) {
            let p = &self.peers[id.0 as usize];
            let stale = |reason: String| Err(Error::Stale { what: "engine address", reason });
            let known = (incarnation != 0 && p.incarnation != 0).then_some(p.incarnation);
            match known {
                Some(k) if incarnation < k => {
                    return stale(format!(
                        "an earlier incarnation of peer {id}, which restarted at the same address"
                    ));
                }
                Some(k) if incarnation > k => {
                    // The process we knew at this address is gone: a new one runs there.
                    let reason = "a later incarnation of it was added (it restarted at the same address)";
                    self.cancel_revival(
                        id,
                        &Error::Stale { what: "engine address", reason: format!("peer {id}: {reason}") },
                    );
                    self.mark_down(id, reason);
                    self.fail_peer(id, reason);
                }
                _ if p.removed && known.is_some() => {
                    return stale(format!("peer {id} was removed (Engine::remove_peer)"));
                }
                _ if p.removed => {} // an older build's address: a new peer
                _ => {
                    // A peer down comes back if it answers (a transient failure, a torn
                    // connection); one that does not stays down, and descriptors of this
                    // incarnation are stale (`revive.rs`).
                    let failed = p.failed.clone();
                    if !passive {
                        self.peers[id.0 as usize].passive = false;
                    }
                    if let (Some(why), Some(_)) = (failed, known) {
                        if !self.start_revival(id, &why)? {
                            return Ok(Added::Reviving(id));
                        }
                    }
                    return Ok(Added::Peer(id));
                }
            }
        }
        let mut handles = Vec::with_capacity(self.domains.len());
        for (d, a) in self.domains.iter_mut().zip(&address.domains) {
            handles.push(d.add_peer(a)?);
        }
        let id = PeerId(self.peers.len() as u32);
        for (d, h) in handles.iter().enumerate() {
            self.handle_to_peer[d].insert(*h, id);
        }
        let stats = self.shared.stats.add_peer();
        self.peers.push(PeerState {
            handles,
            passive,
            failed: None,
            removed: false,
            incarnation,
            pending: VecDeque::new(),
            stats,
        });
        tracing::debug!(peer = id.0, "peer added");
        self.peer_by_addr.insert(key, id);
        self.shared.npeers.store(self.peers.len() as u32, Ordering::Release);
        self.shared.peer_events.publish(PeerEvent::Up { peer: id });
        // Tell it who we are, so that it knows us as a peer too and revokes to us what it
        // frees (`pure/revoke.rs`). A peer that knows us already ignores it.
        let hello = Hello { address: self.shared.address.to_bytes() }.to_bytes();
        self.handle(Submission::Send { peer: id, data: hello.into(), notify: Notify::None });
        Ok(Added::Peer(id))
    }

    /// Tells every live peer which regions were freed since the last call (`revoking`).
    pub(super) fn send_revocations(&mut self) {
        let regions = std::mem::take(&mut self.revoking);
        let incarnation = self.shared.address.incarnation;
        let msgs: Vec<bytes::Bytes> = regions
            .chunks(MAX_REVOKED)
            .map(|c| Revoke { incarnation, regions: c.to_vec() }.to_bytes().into())
            .collect();
        for id in 0..self.peers.len() {
            let p = &self.peers[id];
            if p.failed.is_some() || p.removed {
                continue;
            }
            for data in &msgs {
                self.handle(Submission::Send {
                    peer: PeerId(id as u32),
                    data: data.clone(),
                    notify: Notify::None,
                });
            }
        }
        self.revoking = regions;
        self.revoking.clear();
    }

    /// A peer freed regions: our descriptors of them are stale from now on. On shm the
    /// owner waits for our acknowledgement before it deregisters them (`drain.rs`).
    pub(super) fn on_revoke(&mut self, msg: &[u8], from: Option<PeerId>) {
        match Revoke::from_bytes(msg) {
            Ok(r) => {
                for key in r.keys() {
                    self.shared.revoked.revoke(key);
                }
                self.ack_revocation(&r, from);
            }
            Err(e) => tracing::warn!(error = %e, "dropped a malformed revoke message"),
        }
    }

    /// A peer introduced itself: it is our peer too (if it is not already). Not once this
    /// engine is closing: a peer added then would only be torn down again, and opening its
    /// NIC objects (an shm endpoint per peer) while this process's other engines close theirs
    /// crashed inside libfabric 1.17 (`tests/shm_reuse.rs`).
    pub(super) fn on_hello(&mut self, msg: &[u8]) {
        if self.closing {
            tracing::debug!("a peer's hello while closing: ignored");
            return;
        }
        let address = Hello::from_bytes(msg).and_then(|h| EngineAddress::from_bytes(&h.address));
        match address {
            Ok(a) if a.transport == self.shared.transport => {
                if let Err(e) = self.add_peer_as(a, true) {
                    tracing::debug!(error = %e, "a peer that said hello could not be added");
                }
            }
            Ok(a) => tracing::warn!(transport = %a.transport, "dropped a hello of another transport"),
            Err(e) => tracing::warn!(error = %e, "dropped a malformed hello message"),
        }
    }

    /// `Engine::remove_peer`: fails what the engine still holds for the peer, gives its
    /// handles back to the NICs and forgets its address (adding it again makes a new peer).
    pub(super) fn remove_peer(&mut self, peer: PeerId) -> Result<()> {
        match self.peers.get(peer.0 as usize) {
            None => return Err(Error::UnknownPeer { peer: peer.0 }),
            Some(p) if p.removed => return Ok(()),
            Some(_) => {}
        }
        let message = "removed by Engine::remove_peer".to_owned();
        let removed = format!("peer {peer} was removed (Engine::remove_peer)");
        self.cancel_revival(peer, &Error::Stale { what: "engine address", reason: removed });
        self.fail_peer(peer, &message);
        let p = &mut self.peers[peer.0 as usize];
        p.failed = Some(message);
        p.removed = true;
        // Its address stays known (a tombstone): a descriptor of this incarnation is stale.
        let handles = p.handles.clone();
        for (d, h) in handles.into_iter().enumerate() {
            // A later incarnation at the same address may have the same handle by now.
            if self.handle_to_peer[d].get(&h) == Some(&peer) {
                self.handle_to_peer[d].remove(&h);
                self.domains[d].remove_peer(h);
            }
        }
        tracing::info!(peer = peer.0, "peer removed");
        self.shared.peer_events.publish(PeerEvent::Removed { peer });
        Ok(())
    }

    /// Marks a peer down (once): every later operation to it fails at once, and
    /// `peer_events` says so.
    pub(super) fn mark_down(&mut self, peer: PeerId, reason: &str) {
        let Some(p) = self.peers.get_mut(peer.0 as usize) else { return };
        if p.removed {
            return;
        }
        if p.failed.is_none() {
            p.failed = Some(reason.to_owned());
        }
        self.shared.peer_events.publish(PeerEvent::Down { peer, reason: reason.to_owned() });
    }

    /// Fails everything the engine holds for `peer`: operations waiting to be posted, and
    /// the futures of those in flight (whose memory stays held until the NIC completes
    /// them, as for `op_timeout`).
    pub(super) fn fail_peer(&mut self, peer: PeerId, message: &str) {
        let Some(p) = self.peers.get_mut(peer.0 as usize) else { return };
        let err = || Error::PeerUnreachable { peer: peer.0, message: message.to_owned() };
        let mut i = 0;
        while i < self.vouching.len() {
            if self.vouching[i].peer == peer {
                self.vouching.swap_remove(i).fail(err());
            } else {
                i += 1;
            }
        }
        for (_, s) in p.pending.drain(..) {
            self.shared.stats.backlog(s.nic(), &p.stats, false, 1);
            if !s.is_internal() {
                self.shared.stats.failed(s.nic(), Some(&p.stats), false);
            }
            s.fail(err());
        }
        let peers = &self.peers;
        self.pending_peers.retain(|p| !peers[p.0 as usize].pending.is_empty());
        for op in self.slab.iter_mut() {
            if op.peer != peer || matches!(op.notify, Notify::None) {
                continue;
            }
            let notify = std::mem::replace(&mut op.notify, Notify::None);
            notify.fail(err());
            op.expired = true;
            let stats = self.peers.get(op.peer.0 as usize).map(|p| &*p.stats);
            self.shared.stats.failed(op.nic, stats, false);
        }
    }
}
