//! Bringing back a peer marked down that answers again (`docs/faults.md`, "A live peer can
//! be recovered"), without blocking the reactor thread.
//!
//! ```text
//!  add_peer of a peer down ─▶ start_revival: Domain::revive_peer on every NIC
//!      │ all NICs answered at once (tcp, shm) ──────────────▶ Up now, reply Ok(id)
//!      │ one refused (the peer does not answer) ────────────▶ reply Err(Stale)
//!      └ one still waits for the peer (verbs: a handshake) ─▶ `reviving`, reply deferred
//!  every pass, after the polls ─▶ check_revivals: Domain::revival on every NIC
//!      all Up ─▶ Up (`PeerEvent::Up`), every waiting add_peer answered Ok(id)
//!      one Failed ─▶ the peer stays down, every waiting add_peer answered Err(Stale)
//! ```
//!
//! The peer stays down until the outcome is known: operations submitted to it meanwhile
//! fail at once with `PeerUnreachable`, as for any peer down. Several `add_peer` calls (and
//! `remote_region` calls, which add the owner) of a peer being revived wait for the same
//! revival. A sleeping reactor wakes at least every [`REVIVAL_TICK`] while one is pending
//! (the backend's own timer, verbs' handshake re-sends, is usually sooner), and the engine
//! gives up on a backend that has given no outcome after [`REVIVAL_BACKSTOP`].
//!
//! A child module of `core`, so it works on `Core`'s fields directly.

use std::time::{Duration, Instant};

use super::Core;
use crate::error::{Error, Result};
use crate::provider::{Domain, Revival};
use crate::shared::events::PeerEvent;
use crate::shared::notify::Reply;
use crate::shared::PeerId;

/// The longest a sleeping reactor waits before asking the NICs about pending revivals again.
pub(super) const REVIVAL_TICK: Duration = Duration::from_millis(100);

/// How long the engine waits for a NIC to settle a revival before it fails it itself. The
/// backends bound their own wait far below it (verbs: `VerbsConfig::revive_timeout`, 2 s);
/// this only keeps a misbehaving backend from leaving `add_peer` waiting forever.
const REVIVAL_BACKSTOP: Duration = Duration::from_secs(60);

/// A revival started and not settled yet.
pub(super) struct Reviving {
    peer: PeerId,
    /// Why the peer went down: named in the error if it does not answer.
    why: String,
    since: Instant,
    /// The `add_peer` calls waiting for the outcome (none for one started by a `Hello`).
    waiters: Vec<Reply<PeerId>>,
}

/// The error of an `add_peer` of a peer down that does not answer.
fn gone(peer: PeerId, why: &str, e: &Error) -> Error {
    Error::Stale {
        what: "engine address",
        reason: format!("peer {peer} is gone: {why} (and does not answer: {e})"),
    }
}

impl<D: Domain> Core<D> {
    /// Starts bringing back `peer`, marked down because of `why`: every NIC re-opens what it
    /// keeps for the peer (`Domain::revive_peer`). `Ok(true)`: it is up again (`PeerEvent::Up`
    /// published); `Ok(false)`: the outcome comes later (a revival already under way counts);
    /// `Err(Stale)`: it does not answer and stays down.
    pub(super) fn start_revival(&mut self, peer: PeerId, why: &str) -> Result<bool> {
        if self.reviving.iter().any(|r| r.peer == peer) {
            return Ok(false);
        }
        let handles = self.peers[peer.0 as usize].handles.clone();
        for (d, h) in handles.iter().enumerate() {
            self.domains[d].revive_peer(*h).map_err(|e| gone(peer, why, &e))?;
        }
        let r = Reviving { peer, why: why.to_owned(), since: Instant::now(), waiters: Vec::new() };
        match self.revival_of(peer) {
            Revival::Up => {
                self.revived(peer);
                Ok(true)
            }
            Revival::Failed(e) => Err(gone(peer, why, &e)),
            Revival::Pending => {
                tracing::debug!(peer = peer.0, "reviving a peer; add_peer answers once it does (or not)");
                self.reviving.push(r);
                Ok(false)
            }
        }
    }

    /// Answers `reply` when the revival of `peer` under way settles.
    pub(super) fn await_revival(&mut self, peer: PeerId, reply: Reply<PeerId>) {
        match self.reviving.iter_mut().find(|r| r.peer == peer) {
            Some(r) => r.waiters.push(reply),
            // Settled already (a start that answered at once does not come here).
            None => {
                let p = &self.peers[peer.0 as usize];
                let r = match &p.failed {
                    None => Ok(peer),
                    Some(why) => Err(Error::Stale {
                        what: "engine address",
                        reason: format!("peer {peer} is gone: {why}"),
                    }),
                };
                let _ = reply.send(r);
            }
        }
    }

    /// After a pass: asks the NICs about every pending revival and settles those they have
    /// an outcome for. Returns whether any settled.
    pub(super) fn check_revivals(&mut self) -> bool {
        let mut settled = false;
        let mut i = 0;
        while i < self.reviving.len() {
            let peer = self.reviving[i].peer;
            let outcome = match self.revival_of(peer) {
                Revival::Pending if self.reviving[i].since.elapsed() < REVIVAL_BACKSTOP => {
                    i += 1;
                    continue;
                }
                Revival::Pending => Err(Error::PeerUnreachable {
                    peer: peer.0,
                    message: format!("its NIC gave no outcome of the revival within {REVIVAL_BACKSTOP:?}"),
                }),
                Revival::Up => Ok(()),
                Revival::Failed(e) => Err(e),
            };
            let r = self.reviving.swap_remove(i);
            settled = true;
            match outcome {
                Ok(()) => {
                    self.revived(peer);
                    for w in r.waiters {
                        let _ = w.send(Ok(peer));
                    }
                }
                Err(e) => {
                    let e = gone(peer, &r.why, &e);
                    let took = r.since.elapsed();
                    // As for a failed `add_peer` answered at once; one started by a peer's
                    // `Hello` (no caller) is not the application's concern.
                    if r.waiters.is_empty() {
                        tracing::debug!(peer = peer.0, ?took, error = %e, "a peer marked down did not answer; it stays down");
                    } else {
                        tracing::warn!(peer = peer.0, ?took, error = %e, "adding a peer failed: it did not answer");
                    }
                    for w in r.waiters {
                        let _ = w.send(Err(e.clone()));
                    }
                }
            }
        }
        settled
    }

    /// Ends the revival of `peer` under way, if any, answering its waiters with `e` (the peer
    /// was removed, or a later incarnation of it added).
    pub(super) fn cancel_revival(&mut self, peer: PeerId, e: &Error) {
        if let Some(i) = self.reviving.iter().position(|r| r.peer == peer) {
            for w in self.reviving.swap_remove(i).waiters {
                let _ = w.send(Err(e.clone()));
            }
        }
    }

    /// Shutdown: every `add_peer` waiting for a revival gets `Error::Shutdown`.
    pub(super) fn drop_revivals(&mut self) {
        for r in self.reviving.drain(..) {
            for w in r.waiters {
                let _ = w.send(Err(Error::Shutdown));
            }
        }
    }

    /// Where the revival of `peer` stands over all NICs: `Up` when every NIC says so, the
    /// first `Failed`, else `Pending`.
    fn revival_of(&mut self, peer: PeerId) -> Revival {
        let mut all = Revival::Up;
        for (d, &h) in self.peers[peer.0 as usize].handles.iter().enumerate() {
            match self.domains[d].revival(h) {
                Revival::Up => {}
                Revival::Pending => all = Revival::Pending,
                failed @ Revival::Failed(_) => return failed,
            }
        }
        all
    }

    /// The peer answered on every NIC: it is up again, same id, same incarnation.
    /// Operations failed while it was down stay failed.
    fn revived(&mut self, peer: PeerId) {
        let was = self.peers[peer.0 as usize].failed.take();
        tracing::info!(peer = peer.0, was = ?was, "peer answers again; up");
        self.shared.peer_events.publish(PeerEvent::Up { peer });
    }
}
