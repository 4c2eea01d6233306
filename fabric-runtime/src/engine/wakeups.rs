//! Completion wake-ups for another event loop: the engine's completion wait fds, and a
//! reactor pass to run when one is readable. `fabric_async::CompletionWatch` plugs them
//! into tokio's I/O driver, so the thread that awaits a transfer is the one the NIC wakes.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use super::Engine;
use crate::error::{Error, Result};
use crate::sync::DirectPost;
use crate::sys;

/// An engine's completion wait fds (duplicates, owned by this value: they stay valid after
/// the engine shuts down) and a handle to run its reactor's pass.
///
/// Made by [`Engine::completion_wakeups`]. Whoever watches the fds calls
/// [`CompletionWakeups::run_pass`] when one becomes readable; the pass completes the
/// futures and counters it finds done, and wakes their tasks from the watching thread.
/// The reactor thread keeps sleeping on the same fds, so work nobody watches still moves:
/// the watcher only shortens the path (one OS wake-up instead of two: the reactor thread's,
/// then the awaiting task's).
pub struct CompletionWakeups {
    fds: Vec<OwnedFd>,
    pass: Arc<dyn DirectPost>,
}

impl fmt::Debug for CompletionWakeups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionWakeups").field("fds", &self.fds).finish_non_exhaustive()
    }
}

impl CompletionWakeups {
    /// The fds to watch for readability (one per NIC). Level-triggered readiness may stay
    /// up until the reactor thread acknowledges a wake-up; an edge-triggered watcher (tokio)
    /// sees each new event.
    pub fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.fds.iter().map(|f| f.as_fd())
    }

    /// Runs one reactor pass on this thread if no other thread is running one (never
    /// waits for it). Returns false when it did not run (the reactor thread or another
    /// caller is in a pass, and completes what there is) or once the engine has shut down.
    pub fn run_pass(&self) -> bool {
        self.pass.post_now()
    }
}

impl Engine {
    /// How many times a submitter found the reactor thread asleep and posted on its own
    /// thread instead of waking it ([`EngineBuilder::direct_post`](crate::EngineBuilder::direct_post)),
    /// since the engine started. A diagnostic: 0 on an engine that never sleeps (BusyPoll),
    /// on shm, or with direct posting off.
    pub fn direct_posts(&self) -> u64 {
        self.inner.shared.direct_posts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The engine's completion wait fds and a handle to run its reactor's pass, for an
    /// event loop that wants to wake on completions itself (`fabric_async::CompletionWatch`
    /// does this for tokio). Errors with [`Error::Unsupported`] when a NIC has no wait fd
    /// (libfabric `shm`, EFA), or the engine's reactor never sleeps on them
    /// (`ReactorMode::BusyPoll`: it sees every completion at once already).
    pub fn completion_wakeups(&self) -> Result<CompletionWakeups> {
        if self.inner.mode == crate::ReactorMode::BusyPoll {
            return Err(Error::Unsupported(
                "completion wake-ups: a BusyPoll reactor never sleeps on the wait fds".into(),
            ));
        }
        let Some(pass) = self.inner.direct.clone() else {
            return Err(Error::Unsupported(format!(
                "completion wake-ups: a NIC of this engine ({}) has no completion wait fd",
                self.inner.shared.transport
            )));
        };
        let fds = pass.wait_fds().into_iter().map(sys::dup_fd).collect::<std::io::Result<Vec<_>>>().map_err(
            |e| Error::Provider {
                call: "dup(wait fd)",
                errno: e.raw_os_error().unwrap_or(0),
                message: e.to_string(),
            },
        )?;
        Ok(CompletionWakeups { fds, pass })
    }
}
