//! Reviving a peer the engine marked down ([`Domain::revive_peer`] and [`Domain::revival`]):
//! whether it answers takes a handshake round trip, which the reactor thread cannot wait
//! for, so the revival is started here and its outcome asked for after each poll.
//!
//! ```text
//!  engine add_peer ─▶ revive_peer: both QPs replaced, epoch + 1, REQ ──▶ peer's process
//!  (reply deferred)   Connecting { since: now }                           │ accepts (higher
//!                                                                         │ epoch), REP
//!  each pass ─▶ revival: Connected ─▶ Up          ◀───────────────────────┘
//!                        Connecting, since < revive_timeout ─▶ Pending
//!                        Connecting past revive_timeout ─▶ peer failed, Failed(PeerUnreachable)
//!                        Failed (a QP could not be connected) ─▶ Failed(PeerUnreachable)
//! ```
//!
//! The REQ is answered by the peer's *process* (its reactor reads the UD QP), not by its NIC
//! alone: a peer whose process is gone, stopped, or out of reach does not answer, and the
//! revival fails after [`VerbsConfig::revive_timeout`](super::VerbsConfig::revive_timeout)
//! (2 s by default). The peer is then failed here too (its fresh QPs go to the error state)
//! with no [`Completion::PeerDown`]: the engine has it down already, and says so itself.

use super::qp::PeerState;
use super::VerbsDomain;
use crate::error::Error;
#[cfg(doc)]
use crate::provider::{Completion, Domain};
use crate::provider::{PeerHandle, Revival};

impl VerbsDomain {
    /// [`Domain::revive_peer`]: restarts the peer's connection whatever its state (failed;
    /// connecting, as after a link outage; or connected, when the engine marked it down
    /// because an operation outlived `op_timeout`), so that only an answer from its process
    /// brings it back. Returns at once; [`VerbsDomain::revival_state`] tells the outcome.
    pub(super) fn start_revival(&mut self, peer: PeerHandle) -> Result<(), Error> {
        let idx = peer as usize;
        let Some(p) = self.peers.get(idx) else { return Err(Error::UnknownPeer { peer: peer as u32 }) };
        let cause = match &p.state {
            PeerState::Failed(m) => format!("the peer was revived after: {m}"),
            _ => "the peer was revived after the engine marked it down".to_owned(),
        };
        self.restart(idx, &cause)?;
        tracing::info!(peer = idx, epoch = self.peers[idx].epoch, "verbs peer being revived; handshaking");
        Ok(())
    }

    /// [`Domain::revival`]: `Up` once the handshake completed, `Failed` if the peer failed
    /// or has not answered within `revive_timeout` of the revival's start (the peer is then
    /// failed), `Pending` before.
    pub(super) fn revival_state(&mut self, peer: PeerHandle) -> Revival {
        let idx = peer as usize;
        let limit = self.cfg.revive_timeout;
        let unreachable =
            |message: String| Revival::Failed(Error::PeerUnreachable { peer: peer as u32, message });
        let Some(p) = self.peers.get(idx) else {
            return Revival::Failed(Error::UnknownPeer { peer: peer as u32 });
        };
        match &p.state {
            PeerState::Connected => Revival::Up,
            PeerState::Failed(m) => unreachable(m.clone()),
            // `since` is the revival's start: a lane replaced meanwhile keeps it.
            PeerState::Connecting { since, .. } if since.elapsed() < limit => Revival::Pending,
            PeerState::Connecting { .. } => {
                let message = format!("no answer to the verbs handshake within {limit:?}");
                self.fail_peer(idx, message.clone());
                tracing::debug!(peer = idx, %message, "verbs peer revival failed");
                unreachable(message)
            }
        }
    }
}
