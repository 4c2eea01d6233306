//! The futures of the engine's operations: [`OpFuture`] (one transfer), [`OpBatch`] (the
//! synchronous fast path's completion counter) and [`ControlFuture`] (registration, peers).
//! Their shared state with the reactor lives in `shared::notify`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::shared::notify::{BatchState, OpState};
use crate::sync::{lock, Driver, Linger};

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
    /// `ReactorMode::Inline`: polling runs a reactor pass and never waits to be woken;
    /// `await_spin`: the first poll runs passes; `await_linger`: pending polls linger.
    driver: Option<Driver>,
    linger: Linger,
}

enum Inner {
    Pending(Arc<OpState>),
    Failed(Option<Error>),
}

impl OpFuture {
    pub(crate) fn pending(state: Arc<OpState>) -> Self {
        OpFuture { inner: Inner::Pending(state), driver: None, linger: Linger::default() }
    }

    pub(crate) fn failed(e: Error) -> Self {
        OpFuture { inner: Inner::Failed(Some(e)), driver: None, linger: Linger::default() }
    }

    /// The error of an operation refused before anything was posted (a bad offset, an
    /// unknown peer, a shut-down engine), taken out of the future, which then resolves with
    /// [`Error::Shutdown`]; `None` for an operation that was handed to the reactor. Never
    /// polls: for callers that report refusals at the call (the C API).
    pub fn refused(&mut self) -> Option<Error> {
        match &mut self.inner {
            Inner::Failed(e) => e.take(),
            Inner::Pending(_) => None,
        }
    }

    /// Makes polling drive `driver` (an `Inline` engine's NICs).
    pub(crate) fn driven_by(mut self, driver: Option<&Driver>) -> Self {
        self.driver = driver.cloned();
        self
    }

    /// A future that parks at once instead of lingering (`EngineBuilder::await_linger`): its
    /// result comes after CUDA copies, which take longer than a linger pays for; a spin that
    /// runs out ends in the wake-up it was meant to save, late (on the two H200 a stream of
    /// CUDA IPC writes lost 2-5x to it). `Inline` and `BusyPoll` engines still drive from
    /// the awaiting task (their callers chose to spin).
    pub(crate) fn without_linger(mut self) -> Self {
        self.linger.never = true;
        self
    }

    /// A future that is already complete (a transfer with nothing to post).
    pub(crate) fn done() -> Self {
        let state = Arc::new(OpState::default());
        state.complete(Ok(()));
        OpFuture::pending(state)
    }

    /// A pending future attached to no engine, and the reactor's side of it (completes it
    /// successfully, waking the task), for benchmarks of the completion and wake path
    /// (`fabric-bench`). Not part of the API: only with the `bench-hooks` feature.
    #[cfg(feature = "bench-hooks")]
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
        let OpFuture { inner, driver, linger } = self.get_mut();
        match inner {
            Inner::Failed(e) => Poll::Ready(Err(e.take().unwrap_or(Error::Shutdown))),
            Inner::Pending(state) => match driver {
                None => state.poll_result(cx.waker()),
                Some(d) => match d.linger() {
                    Some(budget) => crate::sync::linger_poll(
                        d,
                        budget,
                        linger,
                        cx,
                        || state.try_take(),
                        |cx| state.poll_result(cx.waker()),
                    ),
                    None => crate::sync::inline_poll(
                        d,
                        cx,
                        || state.try_take(),
                        |cx| state.poll_result(cx.waker()),
                    ),
                },
            },
        }
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
        let driver = self.state.driver.get();
        while self.completed() < n {
            if let Some(d) = driver {
                d.progress();
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && start.elapsed() >= timeout {
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

/// The group logic of sharded transfers, driven by a fake completion source: shards of one
/// transfer complete in every order (as they do when they travel different NICs), some
/// fail, and the `Arrivals::One` follow-up must be released exactly when it is safe.
#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use std::task::Waker;

    use super::*;
    use crate::provider::RemoteSlice;
    use crate::shared::notify::{GroupState, Notify};
    use crate::shared::queue::{OpKind, OpReq, Submission};
    use crate::shared::PeerId;

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// One transfer as the engine submits it: a group of `shards` operations (plus
    /// `follow_ups` imm-only writes) and the caller's future, already polled once so that it
    /// waits with a waker, as a task would.
    struct Transfer {
        shards: Vec<Option<Notify>>,
        fut: OpFuture,
        wakes: Arc<Wakes>,
        waker: Waker,
    }

    impl Transfer {
        fn new(shards: usize, follow_ups: usize) -> Transfer {
            let state = Arc::new(OpState::default());
            let then = (0..follow_ups).map(|m| imm_only(m as u32)).collect();
            let group = GroupState::new(shards, Notify::Future(state.clone()), then);
            let wakes = Arc::new(Wakes::default());
            let mut t = Transfer {
                shards: (0..shards).map(|_| Some(Notify::Group(group.clone()))).collect(),
                fut: OpFuture::pending(state),
                waker: Waker::from(wakes.clone()),
                wakes,
            };
            assert!(t.poll().is_pending(), "nothing has completed yet");
            t
        }

        fn poll(&mut self) -> Poll<Result<(), Error>> {
            Pin::new(&mut self.fut).poll(&mut Context::from_waker(&self.waker))
        }

        fn woken(&self) -> usize {
            self.wakes.0.load(Ordering::SeqCst)
        }

        /// The reactor's side: shard `i`'s completion arrives with `result`.
        fn complete(&mut self, i: usize, result: Result<(), Error>) -> Vec<Submission> {
            let next = self.shards[i].take().expect("each shard completes once").complete(result);
            next.into_iter().map(Submission::from).collect()
        }
    }

    fn imm_only(member: u32) -> OpReq {
        OpReq {
            domain: 0,
            peer: PeerId(member),
            kind: OpKind::Write,
            local_addr: 0,
            len: 0,
            remote: RemoteSlice { addr: 0, key: 0 },
            imm: Some(7),
        }
    }

    fn shard_error(i: usize) -> Error {
        Error::Completion { op: "write", errno: i as i32 + 1, message: format!("shard {i} failed") }
    }

    /// Every order of `n` items (Heap's algorithm).
    fn permutations(n: usize) -> Vec<Vec<usize>> {
        fn heap(k: usize, a: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if k <= 1 {
                out.push(a.clone());
                return;
            }
            for i in 0..k - 1 {
                heap(k - 1, a, out);
                let j = if k.is_multiple_of(2) { i } else { 0 };
                a.swap(j, k - 1);
            }
            heap(k - 1, a, out);
        }
        let mut out = Vec::new();
        heap(n, &mut (0..n).collect(), &mut out);
        out
    }

    /// Every order of 5 shards, the reverse order of 64, and seeded shuffles of 64.
    fn orders() -> Vec<Vec<usize>> {
        let mut all = permutations(5);
        assert_eq!(all.len(), 120);
        all.push((0..64).rev().collect());
        let mut s: u64 = 0x5eed_f00d;
        for _ in 0..32 {
            let mut v: Vec<usize> = (0..64).collect();
            for i in (1..v.len()).rev() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                v.swap(i, (s % (i as u64 + 1)) as usize);
            }
            all.push(v);
        }
        all
    }

    #[test]
    fn group_resolves_only_after_its_last_shard_in_any_order() {
        for order in orders() {
            let mut t = Transfer::new(order.len(), 0);
            let (last, rest) = order.split_last().unwrap();
            for &i in rest {
                assert!(t.complete(i, Ok(())).is_empty(), "{order:?}: no follow-up to release");
                assert_eq!(t.woken(), 0, "{order:?}: woken before shard {last} completed");
                assert!(t.poll().is_pending(), "{order:?}: resolved before shard {last} completed");
            }
            assert!(t.complete(*last, Ok(())).is_empty());
            assert_eq!(t.woken(), 1, "{order:?}: the last shard wakes the task once");
            assert!(matches!(t.poll(), Poll::Ready(Ok(()))), "{order:?}");
        }
    }

    #[test]
    fn group_reports_the_first_error_after_its_last_shard() {
        for order in orders() {
            let n = order.len();
            // One failed shard at every position of the order (first, middle, last), and
            // two failed shards: the one reported first wins.
            for (a, b) in (0..n).map(|p| (p, None)).chain([(0, Some(n - 1)), (n / 2, Some(1))]) {
                let failing: Vec<usize> =
                    [Some(order[a]), b.map(|b| order[b])].into_iter().flatten().collect();
                let first = *failing.iter().min_by_key(|i| order.iter().position(|o| o == *i)).unwrap();
                let mut t = Transfer::new(n, 0);
                for (k, &i) in order.iter().enumerate() {
                    let r = if failing.contains(&i) { Err(shard_error(i)) } else { Ok(()) };
                    assert!(t.complete(i, r).is_empty());
                    if k + 1 < n {
                        assert_eq!(t.woken(), 0, "{order:?} failing {failing:?}: woken early");
                        assert!(t.poll().is_pending(), "{order:?} failing {failing:?}: resolved early");
                    }
                }
                assert_eq!(t.woken(), 1);
                match t.poll() {
                    Poll::Ready(Err(Error::Completion { errno, .. })) => {
                        assert_eq!(
                            errno,
                            first as i32 + 1,
                            "{order:?} failing {failing:?}: not the first error"
                        )
                    }
                    other => panic!("{order:?} failing {failing:?}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn one_arrival_follow_up_is_released_only_after_every_shard_succeeded() {
        for order in orders() {
            let mut t = Transfer::new(order.len(), 1);
            let (last, rest) = order.split_last().unwrap();
            for &i in rest {
                assert!(
                    t.complete(i, Ok(())).is_empty(),
                    "{order:?}: follow-up released before shard {last}"
                );
            }
            let mut next = t.complete(*last, Ok(()));
            assert_eq!(next.len(), 1, "{order:?}: exactly one imm-only write after the last shard");
            let Some(Submission::Op { req, keep, notify }) = next.pop() else { panic!("not an operation") };
            assert_eq!((req.kind, req.len, req.imm), (OpKind::Write, 0, Some(7)), "an imm-only write");
            assert!(
                keep.is_none() && matches!(notify, Notify::Future(_)),
                "it completes the caller's future"
            );
            // The data has landed, but the transfer is done only when its arrival is sent.
            assert_eq!(t.woken(), 0, "{order:?}: woken before the imm-only write completed");
            assert!(t.poll().is_pending());
            assert!(notify.complete(Ok(())).is_empty());
            assert_eq!(t.woken(), 1);
            assert!(matches!(t.poll(), Poll::Ready(Ok(()))), "{order:?}");
        }
    }

    #[test]
    fn one_arrival_follow_up_is_never_released_after_a_failure() {
        for order in orders() {
            for p in 0..order.len() {
                let failed = order[p];
                let mut t = Transfer::new(order.len(), 1);
                for &i in &order {
                    let r = if i == failed { Err(shard_error(i)) } else { Ok(()) };
                    assert!(
                        t.complete(i, r).is_empty(),
                        "{order:?}: an imm-only write was released although shard {failed} failed"
                    );
                }
                assert_eq!(t.woken(), 1);
                assert!(
                    matches!(t.poll(), Poll::Ready(Err(Error::Completion { errno, .. })) if errno == failed as i32 + 1),
                    "{order:?}: shard {failed}'s error"
                );
            }
        }
    }

    /// A timed-out shard is failed by the reactor (`Notify::fail`) and its entry keeps
    /// `Notify::None`: its late completion must not count a second time.
    #[test]
    fn a_timed_out_shard_fails_the_group_once() {
        let mut t = Transfer::new(3, 1);
        t.shards[1].take().unwrap().fail(Error::PeerUnreachable { peer: 0, message: "timed out".into() });
        assert!(Notify::None.complete(Ok(())).is_empty(), "the late completion of the timed-out shard");
        assert!(t.complete(2, Ok(())).is_empty());
        assert!(t.poll().is_pending(), "shard 0 is still in flight");
        assert!(t.complete(0, Ok(())).is_empty(), "no follow-up after a failure");
        assert!(matches!(t.poll(), Poll::Ready(Err(Error::PeerUnreachable { .. }))));
    }

    /// `Arrivals::One` in a scatter: one imm-only write per member, released together once
    /// every shard succeeded; the caller's future resolves when all of them completed, with
    /// the first error among them.
    #[test]
    fn several_follow_ups_form_their_own_group() {
        for fail_second in [false, true] {
            for order in permutations(4) {
                let mut t = Transfer::new(order.len(), 3);
                let (last, rest) = order.split_last().unwrap();
                for &i in rest {
                    assert!(t.complete(i, Ok(())).is_empty());
                }
                let next = t.complete(*last, Ok(()));
                let members: Vec<u32> = next
                    .iter()
                    .map(|s| match s {
                        Submission::Op { req, notify: Notify::Group(_), .. } => req.peer.0,
                        _ => panic!("follow-ups of a group share one"),
                    })
                    .collect();
                assert_eq!(members, [0, 1, 2], "one imm-only write per member, in order");
                let mut notifies: Vec<Notify> = next
                    .into_iter()
                    .map(|s| match s {
                        Submission::Op { notify, .. } => notify,
                        _ => unreachable!(),
                    })
                    .collect();
                let n2 = notifies.pop().unwrap();
                let n1 = notifies.pop().unwrap();
                assert!(notifies.pop().unwrap().complete(Ok(())).is_empty());
                let r1 = if fail_second { Err(shard_error(41)) } else { Ok(()) };
                assert!(n1.complete(r1).is_empty());
                assert!(t.poll().is_pending(), "one follow-up is still in flight");
                assert_eq!(t.woken(), 0);
                assert!(n2.complete(Ok(())).is_empty());
                assert_eq!(t.woken(), 1);
                match (fail_second, t.poll()) {
                    (false, Poll::Ready(Ok(()))) => {}
                    (true, Poll::Ready(Err(Error::Completion { errno: 42, .. }))) => {}
                    (_, other) => panic!("fail_second {fail_second}: {other:?}"),
                }
            }
        }
    }
}
