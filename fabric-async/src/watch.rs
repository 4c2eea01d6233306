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
//! While the watch exists the reactor thread leaves the wait fds to it and wakes only for
//! submissions and every 20 ms (a fallback for a runtime that is not running), so exactly
//! one thread wakes per completion and nobody contends for the reactor's lock.

use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::task::JoinHandle;

use crate::{CompletionWakeups, Engine, Error};

/// Tasks on the current tokio runtime that wake on an engine's completions and run its
/// reactor's pass there (one task per NIC). Stopped when dropped.
///
/// For an `Event`-mode engine whose transfers are awaited by tasks of one runtime (an
/// orchestrator awaiting KV-cache transfers, a ping-pong), this removes one of the two OS
/// wake-ups between a completion and the awaiting task; `docs/latency.md` has the
/// figures. While idle it costs next to nothing (the tasks sleep in tokio's epoll; the
/// reactor thread's fallback pass runs 50 times a second). It needs a NIC with a completion
/// wait fd (tcp, verbs): [`CompletionWatch::spawn`] returns `Error::Unsupported` on shm or
/// EFA, and on a `BusyPoll` engine, which needs no help.
///
/// **The runtime must be running** while the watch exists: a multi-thread runtime, or a
/// current-thread runtime inside `block_on`. Completions are seen by its tasks; if no
/// thread of the runtime runs (a current-thread runtime between `block_on` calls, or every
/// worker blocked), they wait for the reactor thread's fallback pass, up to 20 ms. Drop the
/// watch before leaving the runtime idle.
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

/// One wait fd of shared wake-ups, as `AsyncFd` wants it: the `Arc` keeps open the
/// duplicate that `Engine::completion_wakeups` made, and runs the passes.
struct WaitFd(Arc<CompletionWakeups>, RawFd);

impl AsRawFd for WaitFd {
    fn as_raw_fd(&self) -> RawFd {
        self.1
    }
}

impl CompletionWatch {
    /// Starts the watch on the current tokio runtime. Errors: `Error::Unsupported` outside a
    /// runtime, on a NIC without a wait fd, or on a `BusyPoll` engine; `Error::Provider` if
    /// tokio cannot register an fd.
    pub fn spawn(engine: &Engine) -> Result<CompletionWatch, Error> {
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Unsupported("CompletionWatch::spawn needs a tokio runtime".into()))?;
        let wakeups = Arc::new(engine.completion_wakeups()?);
        let fds: Vec<RawFd> = wakeups.fds().map(|fd| fd.as_raw_fd()).collect();
        let passes = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::with_capacity(fds.len());
        for fd in fds {
            // Registered here (inside the runtime's context), not in the task, so a failure
            // is returned to the caller.
            let afd = {
                let _guard = rt.enter();
                // SAFETY: `fd` is a duplicate owned by the `CompletionWakeups` that `WaitFd`
                // holds an `Arc` of, closed only when that is dropped: it stays open, naming
                // the same file, for the `AsyncFd`'s whole life, and `as_raw_fd` returns it.
                unsafe {
                    AsyncFd::register_with_interest(
                        WaitFd(wakeups.clone(), fd),
                        tokio::io::Interest::READABLE,
                    )
                }
                .map_err(|e| io_error(e.into_parts().1))?
            };
            let passes = passes.clone();
            tasks.push(rt.spawn(async move {
                loop {
                    let Ok(mut ready) = afd.readable().await else { return };
                    // Cleared before the pass: an event during it raises readiness again.
                    ready.clear_ready();
                    let n = afd.get_ref().0.run_passes(64);
                    passes.fetch_add(n as u64, Ordering::Relaxed);
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
