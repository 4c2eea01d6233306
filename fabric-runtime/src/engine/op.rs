//! Completion plumbing between the reactor and the caller: the state one in-flight operation
//! shares with its future, the counter of the synchronous fast path, and control replies.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::{OpReq, Submission};
use crate::error::Error;
use crate::sync::lock;

/// What the reactor completes when an operation finishes.
pub(crate) enum Notify {
    /// An [`OpFuture`] (or nobody, if it was dropped) waits on this.
    Future(Arc<OpState>),
    /// A synchronous-path [`OpBatch`] counts completions.
    Batch(Arc<BatchState>),
    /// One shard of a transfer made of several operations.
    Group(Arc<GroupState>),
    /// Already told (the operation timed out); the entry only keeps memory alive.
    None,
}

impl Notify {
    /// Completes the waiter. Returns the operations to post next when this was the last
    /// shard of a group that ends with follow-ups (the imm-only writes of
    /// `Arrivals::One`); only a success can return some.
    #[must_use = "follow-up operations must be posted"]
    pub(crate) fn complete(self, result: Result<(), Error>) -> Vec<Submission> {
        match self {
            Notify::Future(s) => s.complete(result),
            Notify::Batch(b) => b.complete(result),
            Notify::Group(g) => return g.complete(result),
            Notify::None => {}
        }
        Vec::new()
    }

    /// Completes the waiter with an error (which never has a follow-up).
    pub(crate) fn fail(self, e: Error) {
        let next = self.complete(Err(e));
        debug_assert!(next.is_empty(), "a failure never posts a follow-up");
    }
}

/// A transfer posted as several operations: one waiter, completed once every shard has
/// completed, with the first error any shard reported.
pub(crate) struct GroupState {
    inner: Mutex<GroupInner>,
}

struct GroupInner {
    remaining: usize,
    error: Option<Error>,
    done: Option<Notify>,
    /// Posted (with `done` as their waiter) once every shard succeeded.
    then: Vec<OpReq>,
}

impl GroupState {
    pub(crate) fn new(shards: usize, done: Notify, then: Vec<OpReq>) -> Arc<Self> {
        Arc::new(GroupState {
            inner: Mutex::new(GroupInner { remaining: shards, error: None, done: Some(done), then }),
        })
    }

    fn complete(&self, result: Result<(), Error>) -> Vec<Submission> {
        let (done, error, mut then) = {
            let mut g = lock(&self.inner);
            if let Err(e) = result {
                g.error.get_or_insert(e);
            }
            g.remaining = g.remaining.saturating_sub(1);
            if g.remaining > 0 {
                return Vec::new();
            }
            let Some(done) = g.done.take() else { return Vec::new() };
            (done, g.error.take(), std::mem::take(&mut g.then))
        };
        if let Some(e) = error {
            done.fail(e);
            return Vec::new();
        }
        match then.len() {
            0 => done.complete(Ok(())),
            1 => vec![Submission::Op { req: then.remove(0), keep: None, notify: done }],
            n => {
                // The follow-ups form a group of their own, with the same waiter.
                let g = GroupState::new(n, done, Vec::new());
                then.into_iter()
                    .map(|req| Submission::Op { req, keep: None, notify: Notify::Group(g.clone()) })
                    .collect()
            }
        }
    }
}

#[derive(Default)]
struct OpSlot {
    result: Option<Result<(), Error>>,
    waker: Option<Waker>,
}

/// State shared by one in-flight operation's future and the reactor.
#[derive(Default)]
pub(crate) struct OpState {
    slot: Mutex<OpSlot>,
}

impl OpState {
    pub(crate) fn complete(&self, result: Result<(), Error>) {
        let waker = {
            let mut s = lock(&self.slot);
            s.result = Some(result);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// A future that resolves when one posted operation has completed locally.
///
/// Returned by `Engine::write`, `write_imm`, `imm`, `read` and `send`.
///
/// # Cancel safety
///
/// Dropping it does **not** cancel the operation, which is already queued to (or posted
/// on) the NIC and runs to completion: the remote side may or may not see the bytes and
/// the immediate. The memory involved stays valid regardless: the operation holds its own
/// reference to the local region until the NIC reports completion, so a dropped future never
/// lets the buffer be freed or deregistered while the NIC may still touch it.
#[must_use = "the operation is posted either way; await the future to learn whether it succeeded"]
pub struct OpFuture {
    inner: Inner,
}

enum Inner {
    Pending(Arc<OpState>),
    Failed(Option<Error>),
}

impl OpFuture {
    pub(crate) fn pending(state: Arc<OpState>) -> Self {
        OpFuture { inner: Inner::Pending(state) }
    }

    pub(crate) fn failed(e: Error) -> Self {
        OpFuture { inner: Inner::Failed(Some(e)) }
    }

    /// A future that is already complete (a transfer with nothing to post).
    pub(crate) fn done() -> Self {
        let state = Arc::new(OpState::default());
        state.complete(Ok(()));
        OpFuture::pending(state)
    }

    /// A pending future attached to no engine, and the reactor's side of it (completes it
    /// successfully, waking the task), for benchmarks of the completion and wake path
    /// (`fabric-bench`). Not part of the API.
    #[doc(hidden)]
    pub fn detached_for_bench() -> (OpFuture, impl FnOnce() + Send) {
        let state = Arc::new(OpState::default());
        let done = state.clone();
        (OpFuture::pending(state), move || done.complete(Ok(())))
    }
}

impl fmt::Debug for OpFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OpFuture")
    }
}

impl Future for OpFuture {
    type Output = Result<(), Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().inner {
            Inner::Failed(e) => Poll::Ready(Err(e.take().unwrap_or(Error::Shutdown))),
            Inner::Pending(state) => {
                let mut s = lock(&state.slot);
                if let Some(r) = s.result.take() {
                    // A second poll after Ready would find nothing: report it as shut down
                    // rather than hang.
                    s.result = Some(Err(Error::Shutdown));
                    return Poll::Ready(r);
                }
                match &s.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => s.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

/// Shared counters of an [`OpBatch`].
#[derive(Default)]
pub(crate) struct BatchState {
    completed: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<Error>>,
}

impl BatchState {
    fn complete(&self, result: Result<(), Error>) {
        if let Err(e) = result {
            let mut first = lock(&self.first_error);
            if first.is_none() {
                *first = Some(e);
            }
            drop(first);
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.completed.fetch_add(1, Ordering::Release);
    }
}

/// Completion counter of the synchronous fast path (`Engine::post_*`): a busy-poll thread
/// posts operations that name this batch, then spins until the batch has seen as many
/// completions as it posted. No waker, no allocation and no syscall per operation.
#[derive(Clone, Default)]
pub struct OpBatch {
    pub(crate) state: Arc<BatchState>,
}

impl OpBatch {
    /// A new batch with nothing posted.
    pub fn new() -> Self {
        Self::default()
    }

    /// Operations of this batch that completed so far (successfully or not).
    pub fn completed(&self) -> u64 {
        self.state.completed.load(Ordering::Acquire)
    }

    /// Operations of this batch that failed so far.
    pub fn failed(&self) -> u64 {
        self.state.failed.load(Ordering::Relaxed)
    }

    /// Spins until `completed() >= n` or `timeout` passes. Returns the first error any
    /// operation of the batch reported, if one did; `Ok(false)` on timeout.
    pub fn spin_until(&self, n: u64, timeout: Duration) -> Result<bool, Error> {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.completed() < n {
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 && start.elapsed() >= timeout {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
        match lock(&self.state.first_error).clone() {
            Some(e) => Err(e),
            None => Ok(true),
        }
    }
}

impl fmt::Debug for OpBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpBatch")
            .field("completed", &self.completed())
            .field("failed", &self.failed())
            .finish()
    }
}

/// A reply from the reactor to a control request (registration, peer insertion).
pub(crate) type Reply<T> = futures::channel::oneshot::Sender<Result<T, Error>>;

/// Future of a control request handled by the reactor thread.
///
/// # Cancel safety
///
/// Dropping it does not undo the request: a registration that completes anyway is
/// deregistered again, and an added peer stays added.
#[must_use = "futures do nothing unless polled"]
pub struct ControlFuture<T> {
    rx: futures::channel::oneshot::Receiver<Result<T, Error>>,
}

impl<T> ControlFuture<T> {
    pub(crate) fn new(rx: futures::channel::oneshot::Receiver<Result<T, Error>>) -> Self {
        ControlFuture { rx }
    }
}

impl<T> fmt::Debug for ControlFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ControlFuture")
    }
}

impl<T> Future for ControlFuture<T> {
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.get_mut().rx).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(r)) => Poll::Ready(r),
            // The reactor dropped the request: it is gone.
            Poll::Ready(Err(_canceled)) => Poll::Ready(Err(Error::Shutdown)),
        }
    }
}
