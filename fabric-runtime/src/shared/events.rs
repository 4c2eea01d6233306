//! Peer up/down events (`Engine::peer_events`): the reactor publishes, any number of
//! subscribers read them as a `Stream`. A new subscriber first gets the current state of
//! every peer (an `Up` for each live one, then a `Down` for each one down), so it never has
//! to race the reactor to learn what it missed.

use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

use futures::channel::mpsc::{unbounded, UnboundedReceiver, UnboundedSender};
use futures::Stream;

use super::PeerId;
use crate::sync::lock;

/// A change of a peer's state, as the engine saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerEvent {
    /// The peer was added (`Engine::add_peer`, or a descriptor naming a new peer), or a
    /// peer that was `Down` answered again when its address was added again (same id, same
    /// incarnation: `docs/faults.md`, "A live peer can be recovered").
    Up { peer: PeerId },
    /// The peer was found gone: its process exited (shm, tcp's liveness connection), the
    /// transport gave up on it (verbs retries exceeded), or an operation to it outlived
    /// `op_timeout`. Every operation to it fails until it is brought back; `reason` says
    /// what the engine saw. A refused remote access or a connection the transport rebuilds
    /// does not make a peer `Down`.
    Down { peer: PeerId, reason: String },
    /// The peer was removed (`Engine::remove_peer`); its id is not used again.
    Removed { peer: PeerId },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Up,
    Down(String),
    Removed,
}

#[derive(Default)]
struct Inner {
    /// Every peer's latest state, by id.
    peers: Vec<Option<State>>,
    subscribers: Vec<UnboundedSender<PeerEvent>>,
}

/// Where the reactor publishes and subscribers subscribe.
#[derive(Default)]
pub(crate) struct PeerEventHub {
    inner: Mutex<Inner>,
}

impl PeerEventHub {
    /// Records `event` and hands it to every live subscriber (dropped ones are forgotten).
    /// A peer already down is not reported down twice.
    pub(crate) fn publish(&self, event: PeerEvent) {
        let mut g = lock(&self.inner);
        let (peer, state) = match &event {
            PeerEvent::Up { peer } => (*peer, State::Up),
            PeerEvent::Down { peer, reason } => (*peer, State::Down(reason.clone())),
            PeerEvent::Removed { peer } => (*peer, State::Removed),
        };
        let i = peer.0 as usize;
        if g.peers.len() <= i {
            g.peers.resize(i + 1, None);
        }
        match (&g.peers[i], &state) {
            (Some(State::Down(_)), State::Down(_)) | (Some(State::Removed), _) => return,
            _ => {}
        }
        g.peers[i] = Some(state);
        g.subscribers.retain(|s| s.unbounded_send(event.clone()).is_ok());
    }

    /// A new stream of events, starting with the current state of every peer.
    pub(crate) fn subscribe(&self) -> PeerEvents {
        let (tx, rx) = unbounded();
        let mut g = lock(&self.inner);
        for (i, s) in g.peers.iter().enumerate() {
            let peer = PeerId(i as u32);
            let e = match s {
                Some(State::Up) => PeerEvent::Up { peer },
                Some(State::Down(reason)) => PeerEvent::Down { peer, reason: reason.clone() },
                Some(State::Removed) | None => continue,
            };
            let _ = tx.unbounded_send(e);
        }
        g.subscribers.push(tx);
        PeerEvents { rx }
    }

    /// Ends every stream (engine shutdown).
    pub(crate) fn close(&self) {
        lock(&self.inner).subscribers.clear();
    }
}

/// A `Stream` of [`PeerEvent`]s from `Engine::peer_events`. It ends when the engine shuts
/// down. Unbounded: events are rare (one per peer change), and none is ever lost.
#[derive(Debug)]
pub struct PeerEvents {
    rx: UnboundedReceiver<PeerEvent>,
}

impl Stream for PeerEvents {
    type Item = PeerEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<PeerEvent>> {
        Pin::new(&mut self.rx).poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    #[test]
    fn replay_then_live_and_no_double_down() {
        let hub = PeerEventHub::default();
        hub.publish(PeerEvent::Up { peer: PeerId(0) });
        hub.publish(PeerEvent::Up { peer: PeerId(1) });
        hub.publish(PeerEvent::Down { peer: PeerId(1), reason: "gone".into() });
        hub.publish(PeerEvent::Up { peer: PeerId(2) });
        hub.publish(PeerEvent::Removed { peer: PeerId(2) });
        let mut s = hub.subscribe();
        hub.publish(PeerEvent::Down { peer: PeerId(1), reason: "again".into() });
        hub.publish(PeerEvent::Down { peer: PeerId(0), reason: "reset".into() });
        hub.publish(PeerEvent::Up { peer: PeerId(2) }); // removed stays removed
        hub.close();
        let got: Vec<_> = futures::executor::block_on(s.by_ref().collect());
        assert_eq!(
            got,
            vec![
                PeerEvent::Up { peer: PeerId(0) },
                PeerEvent::Down { peer: PeerId(1), reason: "gone".into() },
                PeerEvent::Down { peer: PeerId(0), reason: "reset".into() },
            ]
        );
    }
}
