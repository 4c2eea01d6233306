//! [`RecvFuture`]: waiting for the next two-sided message, from any peer
//! ([`Engine::recv`](super::Engine::recv)) or from one ([`Engine::recv_from`](super::Engine::recv_from)).
//!
//! Messages wait in the shared inbox (`shared::Inbox`) in arrival order; a receive takes the
//! oldest one it may take (any, or its peer's), so messages of other peers stay for the
//! receives that want them. A `recv_from` also watches its peer in the event hub
//! (`shared::events`), through which every peer that goes down or is removed passes, so the
//! reactor's `Down` wakes it and it fails instead of waiting for a message that will not come.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;

use super::PeerId;
use crate::error::{Error, Result};
use crate::shared::{Inbox, Shared};
use crate::sync::{lock, Driver, Linger};

/// Future returned by [`Engine::recv`](super::Engine::recv) and
/// [`Engine::recv_from`](super::Engine::recv_from).
#[must_use = "futures do nothing unless polled"]
pub struct RecvFuture {
    shared: Arc<Shared>,
    /// `recv_from`: the only peer whose messages this receive takes.
    from: Option<PeerId>,
    /// Fails at the first poll (`recv_from` of a peer this engine never gave).
    error: Option<Error>,
    /// Its waiter id in the inbox (and, for `recv_from`, in the event hub's watches), once
    /// it registered a waker.
    id: Option<u64>,
    /// `ReactorMode::Inline`: polling runs a reactor pass and never waits to be woken.
    driver: Option<Driver>,
    /// `EngineBuilder::await_linger`: where this wait stands in its lingering.
    linger: Linger,
}

impl RecvFuture {
    pub(crate) fn new(shared: Arc<Shared>, driver: Option<Driver>) -> Self {
        RecvFuture { shared, from: None, error: None, id: None, driver, linger: Linger::default() }
    }

    /// A receive of `peer`'s messages only.
    pub(crate) fn from_peer(shared: Arc<Shared>, driver: Option<Driver>, peer: PeerId) -> Self {
        let known = peer.0 < shared.npeers.load(std::sync::atomic::Ordering::Acquire);
        let error = (!known).then_some(Error::UnknownPeer { peer: peer.0 });
        RecvFuture { shared, from: Some(peer), error, id: None, driver, linger: Linger::default() }
    }
}

impl fmt::Debug for RecvFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvFuture").field("from", &self.from).finish_non_exhaustive()
    }
}

/// What a receive resolves with, if it can resolve now: a message it may take, else (for
/// `recv_from`) its peer's death, else the engine's shutdown. Messages first: those that
/// arrived before the peer died or the engine shut down are still delivered.
fn ready(
    shared: &Shared,
    inbox: &mut Inbox,
    from: Option<PeerId>,
) -> Option<Result<(Option<PeerId>, Bytes)>> {
    if let Some(m) = inbox.take(from) {
        return Some(Ok(m));
    }
    if let Some(peer) = from {
        if let Some(message) = shared.peer_events.gone(peer) {
            return Some(Err(Error::PeerUnreachable { peer: peer.0, message }));
        }
    }
    inbox.closed.then_some(Err(Error::Shutdown))
}

impl Future for RecvFuture {
    type Output = Result<(Option<PeerId>, Bytes)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(e) = self.error.take() {
            return Poll::Ready(Err(e));
        }
        let Some(driver) = self.driver.clone() else { return self.poll_inbox(cx) };
        let this = &mut *self;
        let from = this.from;
        if let Some(budget) = driver.linger() {
            let mut linger = std::mem::take(&mut this.linger);
            if this.id.is_some() {
                linger.skip();
            }
            let shared = this.shared.clone();
            // Never waits for the inbox's lock while spinning: the reactor thread delivering
            // into it must not queue behind a peek. A lingering receive ends at its peer's
            // death or the shutdown, not at the end of its budget.
            let peek = || {
                let mut inbox = match shared.inbox.try_lock() {
                    Ok(inbox) => inbox,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => return None,
                };
                ready(&shared, &mut inbox, from)
            };
            let r = crate::sync::linger_poll(&driver, budget, &mut linger, cx, peek, |cx| {
                Pin::new(&mut *this).poll_inbox(cx)
            });
            this.linger = linger;
            return r;
        }
        if this.id.is_some() {
            if !driver.repolls() {
                // `await_spin`: it spun once and parked; the reactor thread wakes it.
                return Pin::new(this).poll_inbox(cx);
            }
            return crate::sync::inline_poll(&driver, cx, || None, |cx| Pin::new(this).poll_inbox(cx));
        }
        let shared = this.shared.clone();
        let peek = || ready(&shared, &mut lock(&shared.inbox), from);
        crate::sync::inline_poll(&driver, cx, peek, |cx| Pin::new(&mut *this).poll_inbox(cx))
    }
}

impl RecvFuture {
    /// The ordinary poll: take what is ready, else register the waker (in the inbox, and
    /// for `recv_from` with the event hub, which wakes it when the peer goes down).
    fn poll_inbox(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(Option<PeerId>, Bytes)>> {
        let this = &mut *self;
        let mut inbox = lock(&this.shared.inbox);
        if let Some(r) = ready(&this.shared, &mut inbox, this.from) {
            drop(inbox);
            this.unregister();
            return Poll::Ready(r);
        }
        let id = match this.id {
            Some(id) => id,
            None => {
                let id = inbox.next_id;
                inbox.next_id += 1;
                this.id = Some(id);
                id
            }
        };
        match inbox.waiters.iter_mut().find(|(i, _, _)| *i == id) {
            Some((_, _, w)) => {
                if !w.will_wake(cx.waker()) {
                    *w = cx.waker().clone();
                }
            }
            None => inbox.waiters.push((id, this.from, cx.waker().clone())),
        }
        drop(inbox);
        if let Some(peer) = this.from {
            // Registered under the hub's lock: a `Down` published after `ready` looked is
            // either seen here or wakes us.
            if let Some(message) = this.shared.peer_events.watch(id, peer, cx.waker()) {
                this.unregister();
                return Poll::Ready(Err(Error::PeerUnreachable { peer: peer.0, message }));
            }
        }
        Poll::Pending
    }

    /// Removes this receive's waiter and watch (it completed).
    fn unregister(&mut self) {
        let Some(id) = self.id.take() else { return };
        lock(&self.shared.inbox).waiters.retain(|(i, _, _)| *i != id);
        if self.from.is_some() {
            self.shared.peer_events.unwatch(id);
        }
    }
}

impl Drop for RecvFuture {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        if self.from.is_some() {
            self.shared.peer_events.unwatch(id);
        }
        let mut inbox = lock(&self.shared.inbox);
        let before = inbox.waiters.len();
        inbox.waiters.retain(|(i, _, _)| *i != id);
        // We may have been woken for a message we will never take: pass the wake-up on.
        let next = if before == inbox.waiters.len() { inbox.pass_on() } else { None };
        drop(inbox);
        if let Some(w) = next {
            w.wake();
        }
    }
}
