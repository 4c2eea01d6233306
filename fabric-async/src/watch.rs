//! Completions that wake the awaiting task's own runtime thread: the engine's completion
//! wait fds registered with tokio's I/O driver (`AsyncFd`).
//!
//! ```text
//!  without:  NIC ─► wait fd ─► reactor thread wakes (1) ─► pass ─► waker ─► tokio worker
//!            unparks (2) ─► task polled
//!  with:     NIC ─► wait fd ─► tokio worker wakes in epoll (1) ─► watch task runs the pass
//!            ─► waker ─► task queued on this same worker ─► polled right after
//! ```
//!
//! The reactor thread still sleeps on the same fds and wakes too (whichever thread gets the
//! reactor's lock first runs the pass; the other finds nothing to do), so work nobody awaits
//! moves as before: the watch only takes an OS wake-up off the awaiting task's path.

use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::task::JoinHandle;

use crate::{Engine, Error};

/// Tasks on the current tokio runtime that wake on an engine's completions and run its
/// reactor's pass there (one task per NIC). Stopped when dropped.
///
/// For an `Event`-mode engine whose transfers are awaited by tasks of one runtime (an
/// orchestrator awaiting KV-cache transfers, a ping-pong), this removes one of the two OS
/// wake-ups between a completion and the awaiting task; `docs/performance.md` has the
/// figures. It costs nothing while idle (the tasks sleep in tokio's epoll), a little CPU per
/// completion (the reactor thread wakes as well), and needs a NIC with a completion wait fd
/// (tcp, verbs): [`CompletionWatch::spawn`] returns `Error::Unsupported` on shm or EFA, and
/// on a `BusyPoll` engine, which needs no help.
///
/// ```no_run
/// # async fn demo() -> Result<(), fabric_async::Error> {
/// let engine = fabric_async::Engine::builder().provider("tcp").build()?;
/// let _watch = fabric_async::CompletionWatch::spawn(&engine)?; // keep it while you await
/// # Ok(()) }
/// ```
pub struct CompletionWatch {
    tasks: Vec<JoinHandle<()>>,
    passes: Arc<AtomicU64>,
}

impl fmt::Debug for CompletionWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionWatch").field("tasks", &self.tasks.len()).finish()
    }
}

/// An owned wait fd as `AsyncFd` wants it.
struct WaitFd(OwnedFd);

impl AsRawFd for WaitFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl CompletionWatch {
    /// Starts the watch on the current tokio runtime. Errors: `Error::Unsupported` outside a
    /// runtime, on a NIC without a wait fd, or on a `BusyPoll` engine; `Error::Provider` if
    /// tokio cannot register an fd.
    pub fn spawn(engine: &Engine) -> Result<CompletionWatch, Error> {
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Unsupported("CompletionWatch::spawn needs a tokio runtime".into()))?;
        let wakeups = engine.completion_wakeups()?;
        let fds: Vec<OwnedFd> = wakeups
            .fds()
            .map(|fd| fd.try_clone_to_owned())
            .collect::<std::io::Result<_>>()
            .map_err(io_error)?;
        let wakeups = Arc::new(wakeups);
        let passes = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::with_capacity(fds.len());
        for fd in fds {
            // Registered here (inside the runtime's context), not in the task, so a failure
            // is returned to the caller.
            let afd = {
                let _guard = rt.enter();
                // SAFETY: `WaitFd` owns the descriptor (a duplicate made for this watch): it
                // stays open, naming the same file, until the `AsyncFd` drops it, and
                // `as_raw_fd` always returns it.
                unsafe { AsyncFd::register_with_interest(WaitFd(fd), tokio::io::Interest::READABLE) }
                    .map_err(|e| io_error(e.into_parts().1))?
            };
            let (w, passes) = (wakeups.clone(), passes.clone());
            tasks.push(rt.spawn(async move {
                loop {
                    let Ok(mut ready) = afd.readable().await else { return };
                    // Cleared before the pass: an event during it raises readiness again.
                    ready.clear_ready();
                    if w.run_pass() {
                        passes.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        Ok(CompletionWatch { tasks, passes })
    }

    /// Reactor passes the watch has run so far (woken by a wait fd, and the reactor's lock
    /// was free). A diagnostic: it grows with completions while the watch is doing its job.
    pub fn passes(&self) -> u64 {
        self.passes.load(Ordering::Relaxed)
    }
}

impl Drop for CompletionWatch {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn io_error(e: std::io::Error) -> Error {
    Error::Provider { call: "CompletionWatch", errno: e.raw_os_error().unwrap_or(0), message: e.to_string() }
}
