//! Peer up/down events (`Engine::peer_events`): the reactor publishes, any number of
//! subscribers read them as a `Stream`. A new subscriber first gets the current state of
//! every peer (an `Up` for each live one, then a `Down` for each one down), so it never has
//! to race the reactor to learn what it missed.
//!
//! Every change of a peer's state goes through [`PeerEventHub::publish`], so the hub is also
//! where `Engine::recv_from` learns that its peer is gone: it wakes the receives that watch
//! that peer when it goes down or is removed.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

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
    /// Receives waiting for one peer (`Engine::recv_from`): their id, the peer, their waker;
    /// woken when that peer goes down or is removed.
    watchers: Vec<(u64, PeerId, Waker)>,
}

/// Where the reactor publishes and subscribers subscribe.
#[derive(Default)]
pub(crate) struct PeerEventHub {
    inner: Mutex<Inner>,
    /// Peers down or removed so far: while 0, [`PeerEventHub::gone`] takes no lock (a
    /// spinning `recv_from` asks on every peek).
    gone: AtomicUsize,
}

/// Why a peer in `state` can no longer send us anything, if it cannot.
fn gone_reason(state: Option<&State>) -> Option<String> {
    match state? {
        State::Up => None,
        State::Down(reason) => Some(reason.clone()),
        State::Removed => Some("removed by Engine::remove_peer".to_owned()),
    }
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
        let was_gone = gone_reason(g.peers[i].as_ref()).is_some();
        let now_gone = state != State::Up;
        g.peers[i] = Some(state);
        g.subscribers.retain(|s| s.unbounded_send(event.clone()).is_ok());
        if !now_gone {
            return;
        }
        if !was_gone {
            self.gone.fetch_add(1, Ordering::Release);
        }
        let mut wake = Vec::new();
        g.watchers.retain(|(_, p, w)| {
            if *p == peer {
                wake.push(w.clone());
            }
            *p != peer
        });
        drop(g);
        for w in wake {
            w.wake();
        }
    }

    /// Why `peer` is gone (down: the reason it was found dead; removed), or `None` while it
    /// is up or unknown here.
    pub(crate) fn gone(&self, peer: PeerId) -> Option<String> {
        if self.gone.load(Ordering::Acquire) == 0 {
            return None;
        }
        let g = lock(&self.inner);
        gone_reason(g.peers.get(peer.0 as usize).and_then(Option::as_ref))
    }

    /// Wakes `waker` once `peer` goes down or is removed (watch `id` replaces an earlier
    /// watch of the same id). If the peer is gone already, registers nothing and says why.
    pub(crate) fn watch(&self, id: u64, peer: PeerId, waker: &Waker) -> Option<String> {
        let mut g = lock(&self.inner);
        if let Some(why) = gone_reason(g.peers.get(peer.0 as usize).and_then(Option::as_ref)) {
            return Some(why);
        }
        match g.watchers.iter_mut().find(|(i, _, _)| *i == id) {
            Some((_, _, w)) => {
                if !w.will_wake(waker) {
                    *w = waker.clone();
                }
            }
            None => g.watchers.push((id, peer, waker.clone())),
        }
        None
    }

    /// Forgets watch `id` (its receive completed or was dropped).
    pub(crate) fn unwatch(&self, id: u64) {
        lock(&self.inner).watchers.retain(|(i, _, _)| *i != id);
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

    #[test]
    fn watches_are_woken_when_their_peer_goes() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::task::Wake;

        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let (c0, c1) = (Arc::new(Count(AtomicUsize::new(0))), Arc::new(Count(AtomicUsize::new(0))));
        let hub = PeerEventHub::default();
        hub.publish(PeerEvent::Up { peer: PeerId(0) });
        hub.publish(PeerEvent::Up { peer: PeerId(1) });
        assert_eq!(hub.gone(PeerId(0)), None);
        assert_eq!(hub.watch(1, PeerId(0), &Waker::from(c0.clone())), None);
        assert_eq!(hub.watch(2, PeerId(1), &Waker::from(c1.clone())), None);
        hub.publish(PeerEvent::Down { peer: PeerId(0), reason: "exited".into() });
        assert_eq!((c0.0.load(Ordering::Relaxed), c1.0.load(Ordering::Relaxed)), (1, 0));
        assert_eq!(hub.gone(PeerId(0)).as_deref(), Some("exited"));
        assert_eq!(hub.watch(3, PeerId(0), &Waker::from(c0.clone())).as_deref(), Some("exited"));
        hub.unwatch(2);
        hub.publish(PeerEvent::Removed { peer: PeerId(1) });
        assert_eq!(c1.0.load(Ordering::Relaxed), 0, "an unwatched waiter is not woken");
        assert!(hub.gone(PeerId(1)).is_some_and(|r| r.contains("remove_peer")));
    }
}
