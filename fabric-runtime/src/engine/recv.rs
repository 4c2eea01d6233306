//! [`RecvFuture`]: waiting for the next two-sided message.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;

use super::PeerId;
use crate::error::{Error, Result};
use crate::shared::Shared;
use crate::sync::{lock, Driver, Linger};

/// Future returned by [`Engine::recv`](super::Engine::recv).
#[must_use = "futures do nothing unless polled"]
pub struct RecvFuture {
    shared: Arc<Shared>,
    id: Option<u64>,
    /// `ReactorMode::Inline`: polling runs a reactor pass and never waits to be woken.
    driver: Option<Driver>,
    /// `EngineBuilder::await_linger`: where this wait stands in its lingering.
    linger: Linger,
}

impl RecvFuture {
    pub(crate) fn new(shared: Arc<Shared>, driver: Option<Driver>) -> Self {
        RecvFuture { shared, id: None, driver, linger: Linger::default() }
    }
}

impl fmt::Debug for RecvFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RecvFuture")
    }
}

impl Future for RecvFuture {
    type Output = Result<(Option<PeerId>, Bytes)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(driver) = self.driver.clone() else { return self.poll_inbox(cx) };
        let this = &mut *self;
        if let Some(budget) = driver.linger() {
            let mut linger = std::mem::take(&mut this.linger);
            if this.id.is_some() {
                linger.skip();
            }
            let shared = this.shared.clone();
            // Never waits for the inbox's lock while spinning: the reactor thread delivering
            // into it must not queue behind a peek. A message first, then the engine's
            // shutdown, as `poll_inbox` decides (a lingering recv ends at the shutdown, not at
            // the end of its budget).
            let peek = || {
                let mut inbox = match shared.inbox.try_lock() {
                    Ok(inbox) => inbox,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => return None,
                };
                match inbox.msgs.pop_front() {
                    Some(m) => Some(Ok(m)),
                    None if inbox.closed => Some(Err(Error::Shutdown)),
                    None => None,
                }
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
        let peek = || lock(&shared.inbox).msgs.pop_front().map(Ok);
        crate::sync::inline_poll(&driver, cx, peek, |cx| Pin::new(&mut *this).poll_inbox(cx))
    }
}

impl RecvFuture {
    fn poll_inbox(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(Option<PeerId>, Bytes)>> {
        let this = &mut *self;
        let mut inbox = lock(&this.shared.inbox);
        if let Some(m) = inbox.msgs.pop_front() {
            if let Some(id) = this.id.take() {
                inbox.waiters.retain(|(i, _)| *i != id);
            }
            return Poll::Ready(Ok(m));
        }
        if inbox.closed {
            return Poll::Ready(Err(Error::Shutdown));
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
        match inbox.waiters.iter_mut().find(|(i, _)| *i == id) {
            Some((_, w)) => {
                if !w.will_wake(cx.waker()) {
                    *w = cx.waker().clone();
                }
            }
            None => inbox.waiters.push((id, cx.waker().clone())),
        }
        Poll::Pending
    }
}

impl Drop for RecvFuture {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut inbox = lock(&self.shared.inbox);
        let before = inbox.waiters.len();
        inbox.waiters.retain(|(i, _)| *i != id);
        // We may have been woken for a message we will never take: pass the wake-up on.
        let next =
            if before == inbox.waiters.len() && !inbox.msgs.is_empty() { inbox.pop_waiter() } else { None };
        drop(inbox);
        if let Some(w) = next {
            w.wake();
        }
    }
}
