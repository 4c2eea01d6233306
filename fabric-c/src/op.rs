//! Operation handles: a transfer, send or counter wait in flight, tested without blocking,
//! waited for with a timeout, or announced through a callback.
//!
//! ```text
//!  fabric_write(..) ──► FabricOp { the Rust future (already posted), a Signal }
//!  fabric_op_test ──► one poll, the Signal as waker ── pending: FABRIC_STATUS_IN_PROGRESS
//!  reactor thread completes the op ── Waker::wake ──► Signal: flag, unpark the waiter,
//!                                                     call the C callback if set
//!  fabric_op_wait ──► test, park until woken or the deadline, test again
//! ```
//!
//! A test costs one poll of the engine's future: an atomic load when it is still running,
//! at most one linger slice (20 µs, on machines of 8 or more CPUs) while the engine lingers
//! for a result that is about to land. Nothing here blocks except `fabric_op_wait`.

use std::cell::Cell;
use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use fabric_async::Error;

use crate::status::{boundary, boundary_void, code_of, FabricStatus, Failure, Outcome};

/// Called, from any thread (usually the engine's reactor thread), when an operation may
/// have finished: call `fabric_op_test` to see. It must return quickly, may test the
/// operation, must not set its callback or free it, and may be called more than once.
pub type FabricWakeFn = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

type Task = Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;

/// An operation in flight (a write, read, batch, send or counter wait).
pub struct FabricOp {
    state: Mutex<State>,
    signal: Arc<Signal>,
}

enum State {
    Running(Task),
    /// Finished: its status and, for an error, the message.
    Done(FabricStatus, String),
}

#[derive(Default)]
struct Signal {
    woken: AtomicBool,
    /// Woken from inside our own poll (an engine future that lingers asks to be polled
    /// again): the callback is called once the poll is over, outside every lock.
    self_woken: AtomicBool,
    /// The callback was asked for while it ran on this thread: it runs once more after.
    again: AtomicBool,
    waiter: Mutex<Option<Thread>>,
    /// The C callback and its context (an address, so that the signal is `Send`).
    callback: Mutex<Option<(unsafe extern "C" fn(*mut c_void), usize)>>,
}

thread_local! {
    /// The signal whose operation this thread is polling, if any.
    static POLLING: Cell<usize> = const { Cell::new(0) };
    /// The signal whose callback this thread is running, if any.
    static CALLING: Cell<usize> = const { Cell::new(0) };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Signal {
    fn id(&self) -> usize {
        self as *const Signal as usize
    }

    /// Calls the C callback, if any. A callback that tests its operation may be asked for
    /// again from inside itself: that is one more call after it returns, not a nested one.
    fn fire(&self) {
        if CALLING.with(Cell::get) == self.id() {
            self.again.store(true, Ordering::Release);
            return;
        }
        let outer = CALLING.with(|c| c.replace(self.id()));
        loop {
            self.again.store(false, Ordering::Release);
            // Held while the callback runs, so that fabric_op_free (which takes it) returns
            // only after a concurrent call is over; the callback may not set or free.
            let cb = lock(&self.callback);
            if let Some((f, ctx)) = *cb {
                // SAFETY: the caller of fabric_op_set_wake gave a callback that may be
                // called from any thread with its context until the operation is freed.
                unsafe { f(ctx as *mut c_void) };
            }
            drop(cb);
            if !self.again.swap(false, Ordering::AcqRel) {
                break;
            }
        }
        CALLING.with(|c| c.set(outer));
    }
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        if let Some(t) = lock(&self.waiter).as_ref() {
            t.unpark();
        }
        if POLLING.with(Cell::get) == self.id() {
            // Inside our own poll, which holds the operation's lock: later.
            self.self_woken.store(true, Ordering::Release);
            return;
        }
        self.fire();
    }
}

impl FabricOp {
    pub(crate) fn new(fut: impl Future<Output = Result<(), Error>> + Send + 'static) -> Box<FabricOp> {
        Box::new(FabricOp { state: Mutex::new(State::Running(Box::pin(fut))), signal: Arc::default() })
    }

    /// One poll; the status (and for errors the message).
    fn test(&self) -> Outcome {
        let mut st = lock(&self.state);
        if let State::Running(task) = &mut *st {
            let waker = Waker::from(self.signal.clone());
            let outer = POLLING.with(|p| p.replace(self.signal.id()));
            let polled = task.as_mut().poll(&mut Context::from_waker(&waker));
            POLLING.with(|p| p.set(outer));
            match polled {
                Poll::Pending => {
                    drop(st);
                    if self.signal.self_woken.swap(false, Ordering::AcqRel) {
                        self.signal.fire();
                    }
                    return Ok(FabricStatus::InProgress);
                }
                Poll::Ready(Ok(())) => *st = State::Done(FabricStatus::Ok, String::new()),
                Poll::Ready(Err(e)) => *st = State::Done(code_of(&e), e.to_string()),
            }
        }
        match &*st {
            State::Done(FabricStatus::Ok, _) => Ok(FabricStatus::Ok),
            State::Done(s, m) => Err(Failure::new(*s, m.clone())),
            State::Running(_) => unreachable!("finished above"),
        }
    }
}

/// Hands a new engine operation to C through `out`, or its error if the engine refused it
/// before posting anything (then no handle is made).
///
/// # Safety
///
/// `out` is writable or NULL (an error).
pub(crate) unsafe fn engine_op_out(mut fut: fabric_async::OpFuture, out: *mut *mut FabricOp) -> Outcome {
    crate::non_null("out", out)?;
    if let Some(e) = fut.refused() {
        return Err(e.into());
    }
    // SAFETY: the caller's contract.
    unsafe { op_out(fut, out) }
}

/// Hands a new operation to C through `out`.
///
/// # Safety
///
/// `out` is writable or NULL (an error).
pub(crate) unsafe fn op_out(
    fut: impl Future<Output = Result<(), Error>> + Send + 'static,
    out: *mut *mut FabricOp,
) -> Outcome {
    crate::non_null("out", out)?;
    // SAFETY: the caller's contract.
    unsafe { out.write(Box::into_raw(FabricOp::new(fut))) };
    Ok(FabricStatus::Ok)
}

/// The operation behind a handle.
///
/// # Safety
///
/// `op` is NULL or a live operation.
unsafe fn op_ref<'a>(op: *const FabricOp) -> Result<&'a FabricOp, Failure> {
    // SAFETY: the caller's contract.
    unsafe { op.as_ref() }.ok_or_else(|| Failure::invalid("op is NULL"))
}

/// Whether the operation has finished: `FABRIC_STATUS_IN_PROGRESS` while it runs, then
/// `FABRIC_STATUS_OK` or its error (the same answer every time after). Never blocks.
///
/// # Safety
///
/// `op` is a live operation.
#[no_mangle]
pub unsafe extern "C" fn fabric_op_test(op: *const FabricOp) -> FabricStatus {
    // SAFETY: the caller's contract.
    boundary(|| unsafe { op_ref(op) }?.test())
}

/// Waits for the operation to finish, at most `timeout_ms` milliseconds (-1: no limit).
/// Its result, or `FABRIC_STATUS_ERR_TIMEOUT` if it is still running (it goes on).
///
/// # Safety
///
/// `op` is a live operation, not waited for by another thread at the same time.
#[no_mangle]
pub unsafe extern "C" fn fabric_op_wait(op: *const FabricOp, timeout_ms: i64) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let op = unsafe { op_ref(op) }?;
        let deadline = (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
        *lock(&op.signal.waiter) = Some(std::thread::current());
        let r = loop {
            op.signal.woken.store(false, Ordering::Release);
            match op.test() {
                Ok(FabricStatus::InProgress) => {}
                done => break done,
            }
            if op.signal.woken.load(Ordering::Acquire) {
                continue;
            }
            match deadline {
                None => std::thread::park(),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break Err(Failure::new(
                            FabricStatus::ErrTimeout,
                            format!("the operation is still running after {timeout_ms} ms"),
                        ));
                    }
                    std::thread::park_timeout(d - now);
                }
            }
        };
        *lock(&op.signal.waiter) = None;
        r
    })
}

/// Sets the callback that says the operation may have finished (NULL `wake`: none). If it
/// has finished already, `wake(ctx)` is called before this returns.
///
/// # Safety
///
/// `op` is a live operation; `wake`, if set, may be called with `ctx` from any thread until
/// the operation is freed.
#[no_mangle]
pub unsafe extern "C" fn fabric_op_set_wake(
    op: *const FabricOp,
    wake: FabricWakeFn,
    ctx: *mut c_void,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let op = unsafe { op_ref(op) }?;
        if CALLING.with(Cell::get) == op.signal.id() {
            return Err(Failure::invalid("fabric_op_set_wake called from the operation's own callback"));
        }
        *lock(&op.signal.callback) = wake.map(|f| (f, ctx as usize));
        // A poll registers the waker, and tells whether it is done already.
        let done = !matches!(op.test(), Ok(FabricStatus::InProgress));
        if let (true, Some(f)) = (done, wake) {
            // SAFETY: the caller's contract.
            unsafe { f(ctx) };
        }
        Ok(FabricStatus::Ok)
    })
}

/// Frees an operation handle, finished or not. An unfinished operation is not recalled: a
/// write still lands, a read still fills its destination (the regions stay registered until
/// the NIC is done), and a send is still delivered; a counter wait consumes nothing. The
/// callback is not called after this returns. NULL is a no-op.
///
/// # Safety
///
/// `op` is NULL or an operation not freed before, with no `fabric_op_wait` running on it.
#[no_mangle]
pub unsafe extern "C" fn fabric_op_free(op: *mut FabricOp) {
    if op.is_null() {
        return;
    }
    boundary_void(|| {
        // SAFETY: the caller's contract: made by Box::into_raw in op_out.
        let op = unsafe { Box::from_raw(op) };
        *lock(&op.signal.callback) = None;
        drop(op);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn count(_ctx: *mut c_void) {
        CALLS.fetch_add(1, Ordering::SeqCst);
    }

    #[test]
    fn an_op_reports_progress_then_its_result_and_calls_back() {
        let (tx, rx) = futures::channel::oneshot::channel::<Result<(), Error>>();
        let op = Box::into_raw(FabricOp::new(async move { rx.await.unwrap_or(Err(Error::Shutdown)) }));
        // SAFETY: `op` is live until freed at the end.
        unsafe {
            assert_eq!(fabric_op_test(op), FabricStatus::InProgress);
            assert_eq!(fabric_op_set_wake(op, Some(count), std::ptr::null_mut()), FabricStatus::Ok);
            assert_eq!(fabric_op_wait(op, 10), FabricStatus::ErrTimeout);
            tx.send(Err(Error::Unsupported("nope".into()))).unwrap();
            assert!(CALLS.load(Ordering::SeqCst) >= 1);
            assert_eq!(fabric_op_wait(op, 1000), FabricStatus::ErrUnsupported);
            assert_eq!(fabric_op_test(op), FabricStatus::ErrUnsupported);
            fabric_op_free(op);
        }
    }
}
