//! Waits tied to the peers they depend on.
//!
//! A counter wait (and a `recv()` from any peer, a message through a channel) is not tied to
//! a peer: if the sender dies, nothing fails it, and it stays pending until the caller's own
//! timeout. These race such a wait against [`Engine::peer_events`], so that it fails with
//! [`Error::PeerUnreachable`] once a peer it depends on is marked down (or removed):
//!
//! ```no_run
//! # use fabric_async::{Engine, ImmCounterExt, PeerId};
//! # async fn demo(engine: Engine, sender: PeerId) -> Result<(), fabric_async::Error> {
//! // 16 arrivals of imm 7 from `sender`, or PeerUnreachable soon after it dies.
//! engine.imm_counter(7).wait_for_from(&engine, &[sender], 16).await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;

use crate::{Engine, Error, PeerEvent, PeerId};

/// How long a wait whose peer went down still gets to end by itself before it fails: the
/// peer's last writes or messages may still be on their way to the wait (a peer that
/// finished cleanly and shut down is reported down on tcp as a dead one is, as soon as its
/// liveness connection closes).
pub const DOWN_GRACE: Duration = Duration::from_millis(250);

/// Resolves when one of `peers` goes down (or is removed), with [`Error::PeerUnreachable`]
/// for that peer and the reason the engine saw; at once for a peer already down
/// ([`Engine::peer_events`] starts with every peer's state). Never, while they live;
/// [`Error::Shutdown`] if the engine shuts down first.
///
/// # Cancel safety
///
/// Cancel safe: it only reads peer events.
pub async fn peer_down(engine: &Engine, peers: &[PeerId]) -> Error {
    let mut events = engine.peer_events();
    while let Some(e) = events.next().await {
        match e {
            PeerEvent::Down { peer, reason } if peers.contains(&peer) => {
                return Error::PeerUnreachable { peer: peer.0, message: reason };
            }
            PeerEvent::Removed { peer } if peers.contains(&peer) => {
                return Error::PeerUnreachable {
                    peer: peer.0,
                    message: "removed by Engine::remove_peer".into(),
                };
            }
            _ => {}
        }
    }
    Error::Shutdown
}

/// Runs `wait` to its end unless one of `peers` goes down (or is removed) first and `wait`
/// does not end within [`DOWN_GRACE`] after that; then `wait` is dropped and the result is
/// [`peer_down`]'s [`Error::PeerUnreachable`].
///
/// # Cancel safety
///
/// As cancel safe as `wait`: dropping this (or losing the race) drops `wait`.
pub async fn race_down<F: Future>(engine: &Engine, peers: &[PeerId], wait: F) -> Result<F::Output, Error> {
    let mut wait = std::pin::pin!(wait);
    let down = tokio::select! {
        biased;
        r = &mut wait => return Ok(r),
        e = peer_down(engine, peers) => e,
    };
    tokio::time::timeout(DOWN_GRACE, wait).await.map_err(|_| down)
}

/// [`race_down`] for a wait that returns this crate's errors: its own error, or the peer's
/// death as [`Error::PeerUnreachable`].
///
/// # Cancel safety
///
/// As cancel safe as `wait`. A counter's `wait_for` and `recv` consume nothing when dropped.
pub async fn unless_down<T>(
    engine: &Engine,
    peers: &[PeerId],
    wait: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    race_down(engine, peers, wait).await?
}
