//! What the reactor completes when an operation finishes: the state one in-flight
//! operation shares with its future, the counters of a synchronous batch, the group of a
//! sharded transfer, and the replies to control requests.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Poll, Waker};

use super::request::OpReq;
use crate::error::Error;
use crate::sync::{lock, Driver};

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
    /// An operation the reactor posted for itself (a chunk read of a pull, a control
    /// message): the reactor routes its completion by this tag before `complete`; a failure
    /// reported through `complete`/`fail` (refused at post, timed out) is queued in the list
    /// for the reactor's next pass.
    #[cfg(feature = "cuda")]
    Internal(u64, Arc<InternalFailures>),
}

/// An operation to post once a sharded transfer's shards are done (the imm-only writes of
/// `Arrivals::One`), with its waiter: a `Submission::Op` without memory to keep.
pub(crate) struct FollowUp {
    pub(crate) req: OpReq,
    pub(crate) notify: Notify,
}

/// Failures of [`Notify::Internal`] operations that did not pass through the reactor's
/// completion path.
#[cfg(feature = "cuda")]
pub(crate) type InternalFailures = Mutex<Vec<(u64, Error)>>;

impl Notify {
    /// Completes the waiter. Returns the operations to post next when this was the last
    /// shard of a group that ends with follow-ups (the imm-only writes of
    /// `Arrivals::One`); only a success can return some.
    #[must_use = "follow-up operations must be posted"]
    pub(crate) fn complete(self, result: Result<(), Error>) -> Vec<FollowUp> {
        match self {
            Notify::Future(s) => s.complete(result),
            Notify::Batch(b) => b.complete(result),
            Notify::Group(g) => return g.complete(result),
            Notify::None => {}
            #[cfg(feature = "cuda")]
            Notify::Internal(tag, failures) => {
                if let Err(e) = result {
                    lock(&failures).push((tag, e));
                }
            }
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

    fn complete(&self, result: Result<(), Error>) -> Vec<FollowUp> {
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
            1 => vec![FollowUp { req: then.remove(0), notify: done }],
            n => {
                // The follow-ups form a group of their own, with the same waiter.
                let g = GroupState::new(n, done, Vec::new());
                then.into_iter().map(|req| FollowUp { req, notify: Notify::Group(g.clone()) }).collect()
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
    /// Set once the result is in `slot`: a caller that peeks while spinning or lingering
    /// reads this (the reactor's cache line stays shared) instead of taking the lock.
    done: AtomicBool,
}

impl OpState {
    pub(crate) fn complete(&self, result: Result<(), Error>) {
        let waker = {
            let mut s = lock(&self.slot);
            s.result = Some(result);
            self.done.store(true, Ordering::Release);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Takes the result if there is one, without registering a waker (a later call then
    /// reports [`Error::Shutdown`]).
    pub(crate) fn try_take(&self) -> Option<Result<(), Error>> {
        if !self.done.load(Ordering::Acquire) {
            return None;
        }
        let mut s = lock(&self.slot);
        let r = s.result.take()?;
        s.result = Some(Err(Error::Shutdown));
        Some(r)
    }

    /// The future's side: takes the result if there is one (a later call then reports
    /// [`Error::Shutdown`] rather than hang), else stores `waker` to be woken with it.
    pub(crate) fn poll_result(&self, waker: &Waker) -> Poll<Result<(), Error>> {
        let mut s = lock(&self.slot);
        if let Some(r) = s.result.take() {
            s.result = Some(Err(Error::Shutdown));
            return Poll::Ready(r);
        }
        match &s.waker {
            Some(w) if w.will_wake(waker) => {}
            _ => s.waker = Some(waker.clone()),
        }
        Poll::Pending
    }
}

/// Shared counters of an `OpBatch` (the synchronous fast path).
#[derive(Default)]
pub(crate) struct BatchState {
    pub(crate) completed: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) first_error: Mutex<Option<Error>>,
    /// `ReactorMode::Inline`: the pass a spinning caller runs (set by the first post).
    pub(crate) driver: OnceLock<Driver>,
}

impl BatchState {
    pub(crate) fn complete(&self, result: Result<(), Error>) {
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

/// A reply from the reactor to a control request (registration, peer insertion).
pub(crate) type Reply<T> = futures::channel::oneshot::Sender<Result<T, Error>>;
