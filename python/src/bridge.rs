//! Rust futures as asyncio awaitables that the engine completes, and as blocking calls.
//!
//! ```text
//!  engine.write_imm(..) ──► Pending (the Rust future; the write is already posted)
//!   await ──► first poll on the loop thread ── ready: the result at once, no asyncio.Future
//!               └─ pending: an asyncio.Future, the task kept in the loop's Bridge
//!  reactor thread ── Waker::wake ──► the task's id into the ready list, and one byte
//!                                    into a socketpair (no GIL taken, no Python called)
//!  loop thread: loop.add_reader(socket) ──► Bridge._drain ──► polls the woken tasks
//!                                           └─► future.set_result / set_exception
//!  .wait(timeout) ──► polls on the calling thread, parked between wake-ups, GIL released
//! ```
//!
//! No thread of ours runs Python and the reactor never waits for the GIL: its wake-up is a
//! mutex push and a socket write, which the event loop sees in its `select`.
//!
//! Cancel safety: cancelling the awaitable (`task.cancel()`, `asyncio.wait_for`'s timeout)
//! cancels its asyncio.Future, whose done callback drops the Rust future on the loop
//! thread, as dropping it in Rust does; so does a `wait()` that times out or is interrupted
//! (`KeyboardInterrupt`), and a `Pending` never awaited being garbage collected. What that
//! means per operation (a write is not recalled; a counter wait consumes nothing) is the Rust
//! method's `# Cancel safety` section, restated in `docs/python.md`.

use std::collections::HashMap;
use std::future::Future;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use fabric_async::Error;
use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::IntoPy;

/// What a finished future leaves: made into a Python value (or exception) on the thread
/// that holds the GIL.
pub(crate) type Outcome = Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>;
type Task = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// How often a blocking wait takes the GIL back to look for signals (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An operation of the engine as an awaitable: `await` it in a running asyncio loop, or
/// block on it with `wait(timeout=None)`.
pub(crate) fn pending<F, T, C>(fut: F, conv: C) -> Pending
where
    F: Future<Output = Result<T, Error>> + Send + 'static,
    T: Send + 'static,
    C: FnOnce(Python<'_>, T) -> PyResult<Py<PyAny>> + Send + 'static,
{
    let task = async move {
        let r = fut.await;
        Box::new(move |py: Python<'_>| r.py_err().and_then(|v| conv(py, v))) as Outcome
    };
    Pending { state: Mutex::new(State::Start(Box::pin(task))) }
}

/// `None` for operations that return nothing.
pub(crate) fn none(py: Python<'_>, (): ()) -> PyResult<Py<PyAny>> {
    Ok(py.None())
}

/// An engine operation in progress (what the Rust API returns as a future). Await it, or
/// call `wait()`; dropping it unawaited drops the Rust future (see the module docs).
#[pyclass(module = "fabric_rdma", name = "Pending")]
pub struct Pending {
    state: Mutex<State>,
}

enum State {
    /// Not awaited yet.
    Start(Task),
    /// Awaited: the iterator of the asyncio.Future that the bridge completes.
    Waiting(Py<PyAny>),
    /// Finished (its result handed out), or taken by `wait()`.
    Done,
}

#[pymethods]
impl Pending {
    fn __await__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mut st = lock(&self.state);
        match std::mem::replace(&mut *st, State::Done) {
            State::Start(mut task) => {
                let bridge = match Bridge::current(py) {
                    Ok(b) => b,
                    Err(e) => {
                        *st = State::Start(task);
                        return Err(e);
                    }
                };
                let b = bridge.get();
                let id = b.next.fetch_add(1, Ordering::Relaxed);
                let waker = Waker::from(Arc::new(TaskWaker { id, wake: b.wake.clone() }));
                match task.as_mut().poll(&mut Context::from_waker(&waker)) {
                    Poll::Ready(outcome) => {
                        drop(st);
                        Err(stop_iteration(py, outcome(py)?)?)
                    }
                    Poll::Pending => {
                        // The loop thread is this thread, so `_drain` cannot run before the
                        // task is in the table: a wake-up meanwhile waits in the ready list.
                        let fut = b.event_loop(py)?.call_method0("create_future")?;
                        lock(&b.tasks).insert(id, Entry { task, fut: fut.clone().unbind(), waker });
                        let hook = Py::new(py, DoneHook { bridge: bridge.clone_ref(py), id })?;
                        fut.call_method1("add_done_callback", (hook,))?;
                        let it = fut.call_method0("__await__")?;
                        let first = it.call_method0("__next__")?;
                        *st = State::Waiting(it.unbind());
                        Ok(first.unbind())
                    }
                }
            }
            State::Waiting(it) => {
                let r = it.bind(py).call_method0("__next__").map(Bound::unbind);
                // Yielded again (a spurious resume): still waiting. Raised (the result's
                // StopIteration, an error, CancelledError): done.
                if r.is_ok() {
                    *st = State::Waiting(it);
                }
                r
            }
            State::Done => Err(PyRuntimeError::new_err("this operation was already awaited or waited for")),
        }
    }

    /// Blocks until the operation completes and returns its result, the GIL released.
    /// `timeout` in seconds (None: no limit): past it raises `fabric_rdma.Timeout` and drops the
    /// operation as cancelling its awaitable does. Ctrl-C raises `KeyboardInterrupt` the
    /// same way.
    #[pyo3(signature = (timeout=None))]
    pub(crate) fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let task = {
            let mut st = lock(&self.state);
            match std::mem::replace(&mut *st, State::Done) {
                State::Start(task) => task,
                other => {
                    *st = other;
                    return Err(PyRuntimeError::new_err("this operation was already awaited or waited for"));
                }
            }
        };
        block_on(py, task, timeout)?(py)
    }

    fn __repr__(&self) -> &'static str {
        match *lock(&self.state) {
            State::Start(_) => "<fabric.Pending: not awaited>",
            State::Waiting(_) => "<fabric.Pending: awaited>",
            State::Done => "<fabric.Pending: done>",
        }
    }
}

/// `StopIteration(value)`: what an awaitable's iterator raises to return `value` (made as an
/// instance so that a tuple is the value, not the arguments).
fn stop_iteration(py: Python<'_>, value: Py<PyAny>) -> PyResult<PyErr> {
    let e = py.get_type::<PyStopIteration>().call1((value,))?;
    Ok(PyErr::from_value(e))
}

/// Polls `task` on this thread until it completes, parked between wake-ups, the GIL
/// released; takes the GIL back every `SIGNAL_CHECK` for signals.
pub(crate) fn block_on(py: Python<'_>, mut task: Task, timeout: Option<f64>) -> PyResult<Outcome> {
    let deadline = match timeout {
        None => None,
        Some(t) if t.is_finite() && t >= 0.0 => Some(Instant::now() + Duration::from_secs_f64(t.min(1e9))),
        Some(t) => {
            return Err(PyValueError::new_err(format!("timeout must be a finite number >= 0, not {t}")))
        }
    };
    loop {
        let done = py.detach(|| {
            let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
            let mut cx = Context::from_waker(&waker);
            let start = Instant::now();
            let slice_end = deadline.map_or(start + SIGNAL_CHECK, |d| d.min(start + SIGNAL_CHECK));
            loop {
                if let Poll::Ready(o) = task.as_mut().poll(&mut cx) {
                    return Some(o);
                }
                let now = Instant::now();
                if now >= slice_end {
                    return None;
                }
                std::thread::park_timeout(slice_end - now);
            }
        });
        if let Some(o) = done {
            return Ok(o);
        }
        py.check_signals()?;
        if let Some(d) = deadline.filter(|&d| Instant::now() >= d) {
            let _ = d;
            return Err(crate::errors::timeout(
                py,
                format!("no result within {:.3} s; the operation was dropped", timeout.unwrap_or(0.0)),
            ));
        }
    }
}

struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// What wakers share with their bridge: the ids woken, and the socket the loop watches.
struct Wakeups {
    ready: Mutex<Vec<u64>>,
    /// A byte is in the socket (or about to be) and `_drain` has not run since.
    signaled: AtomicBool,
    writer: UnixStream,
}

struct TaskWaker {
    id: u64,
    wake: Arc<Wakeups>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        lock(&self.wake.ready).push(self.id);
        if !self.wake.signaled.swap(true, Ordering::SeqCst) {
            // A full socket already holds a byte the loop will read: nothing is lost.
            let _ = (&self.wake.writer).write(&[1]);
        }
    }
}

struct Entry {
    task: Task,
    fut: Py<PyAny>,
    waker: Waker,
}

/// One per asyncio event loop: the socket it watches and the tasks waiting on it.
#[pyclass(module = "fabric_rdma", frozen)]
pub struct Bridge {
    wake: Arc<Wakeups>,
    reader: UnixStream,
    tasks: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
    /// The loop, weakly (the loop holds the bridge through its reader callback).
    event_loop: Py<PyAny>,
}

/// Bridges by event loop (`weakref.WeakKeyDictionary`).
static BRIDGES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

impl Bridge {
    /// The bridge of the running event loop, made on first use.
    fn current(py: Python<'_>) -> PyResult<Py<Bridge>> {
        let get = GET_RUNNING_LOOP.import(py, "asyncio", "get_running_loop")?;
        let lp = get.call0().map_err(|_| {
            PyRuntimeError::new_err(
                "no running asyncio event loop: await this inside one (asyncio.run), or call .wait()",
            )
        })?;
        let bridges = BRIDGES.get_or_try_init(py, || {
            py.import("weakref")?.getattr("WeakKeyDictionary")?.call0().map(Bound::unbind)
        })?;
        let bridges = bridges.bind(py);
        if let Ok(b) = bridges.call_method1("get", (&lp,))?.cast_into::<Bridge>() {
            return Ok(b.unbind());
        }
        let (reader, writer) = UnixStream::pair()?;
        reader.set_nonblocking(true)?;
        writer.set_nonblocking(true)?;
        let fd = reader.as_raw_fd();
        let weak = py.import("weakref")?.getattr("ref")?.call1((&lp,))?;
        let b = Py::new(
            py,
            Bridge {
                wake: Arc::new(Wakeups {
                    ready: Mutex::new(Vec::new()),
                    signaled: AtomicBool::new(false),
                    writer,
                }),
                reader,
                tasks: Mutex::new(HashMap::new()),
                next: AtomicU64::new(0),
                event_loop: weak.unbind(),
            },
        )?;
        lp.call_method1("add_reader", (fd, b.bind(py).getattr("_drain")?))?;
        bridges.set_item(&lp, &b)?;
        Ok(b)
    }

    fn event_loop<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let lp = self.event_loop.bind(py).call0()?;
        if lp.is_none() {
            return Err(PyRuntimeError::new_err("the event loop is gone"));
        }
        Ok(lp)
    }
}

#[pymethods]
impl Bridge {
    /// The loop's reader callback: polls every task woken since the last call.
    fn _drain(&self, py: Python<'_>) -> PyResult<()> {
        // Empty the socket first, then clear the flag, then take the ids: a waker that
        // pushes after the take saw the flag clear and writes a byte that is still in the
        // socket (the next call). Clearing the flag before reading could swallow the byte of
        // a waker whose id comes after the take, and that task would never be polled again.
        let mut buf = [0u8; 256];
        while let Ok(n) = (&self.reader).read(&mut buf) {
            if n < buf.len() {
                break;
            }
        }
        self.wake.signaled.store(false, Ordering::SeqCst);
        let ids = std::mem::take(&mut *lock(&self.wake.ready));
        for id in ids {
            let Some(mut e) = lock(&self.tasks).remove(&id) else { continue };
            match e.task.as_mut().poll(&mut Context::from_waker(&e.waker)) {
                Poll::Pending => {
                    lock(&self.tasks).insert(id, e);
                }
                Poll::Ready(outcome) => {
                    let fut = e.fut.bind(py);
                    if fut.call_method0("done")?.is_truthy()? {
                        continue;
                    }
                    let r = match outcome(py) {
                        Ok(v) => fut.call_method1("set_result", (v,)),
                        Err(err) => fut.call_method1("set_exception", (err.into_value(py),)),
                    };
                    if let Err(err) = r {
                        err.write_unraisable(py, Some(fut));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The done callback of a task's asyncio.Future: a cancelled future drops its Rust future.
#[pyclass(module = "fabric_rdma", frozen)]
struct DoneHook {
    bridge: Py<Bridge>,
    id: u64,
}

#[pymethods]
impl DoneHook {
    fn __call__(&self, fut: &Bound<'_, PyAny>) -> PyResult<()> {
        if fut.call_method0("cancelled")?.is_truthy()? {
            let entry = lock(&self.bridge.get().tasks).remove(&self.id);
            drop(entry);
        }
        Ok(())
    }
}

/// A tokio runtime for the few waits that need tokio's timers (`ImmCounter.wait_for` with
/// `peers`: a grace period after a peer went down). Engine futures need no runtime; this one
/// thread is started on first use.
fn timers() -> Result<&'static tokio::runtime::Runtime, Error> {
    static RT: std::sync::OnceLock<Option<tokio::runtime::Runtime>> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fabric-py-timers")
            .enable_time()
            .build()
            .ok()
    })
    .as_ref()
    .ok_or_else(|| Error::Unsupported("could not start the timer thread".into()))
}

/// Runs `fut` on the timer runtime; the returned future resolves with its output, and
/// dropping it (a cancelled await, a timed-out `wait()`) cancels `fut` there, so a counter
/// wait inside it consumes nothing.
pub(crate) fn on_timers<T: Send + 'static>(
    fut: impl Future<Output = Result<T, Error>> + Send + 'static,
) -> impl Future<Output = Result<T, Error>> + Send + 'static {
    struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);
    impl<T> Drop for AbortOnDrop<T> {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let handle = timers().map(|rt| AbortOnDrop(rt.spawn(fut)));
    async move {
        let mut h = handle?;
        match (&mut h.0).await {
            Ok(r) => r,
            Err(e) => Err(Error::Unsupported(format!("the wait's task ended abnormally: {e}"))),
        }
    }
}
