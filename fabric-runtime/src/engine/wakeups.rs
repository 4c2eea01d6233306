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
/// Made by [`Engine::completion_wakeups`]. **While one exists, its holder is the engine's
/// sleeper**: the reactor thread stops sleeping on the wait fds (it would only wake beside
/// the holder and contend for the reactor's lock) and, besides submissions, runs a pass
/// only every 20 ms as a fallback. The holder must watch [`CompletionWakeups::fds`] for
/// readability and call [`CompletionWakeups::run_passes`] each time, from a thread that is
/// running, or completions wait for that fallback. Dropping it gives the fds back to the
/// reactor thread. `fabric_async::CompletionWatch` is this for tokio; the point is that the
/// thread the NIC wakes is the one whose task awaits (one OS wake-up per completion instead
/// of two: the reactor thread's, then the awaiting task's).
pub struct CompletionWakeups {
    fds: Vec<OwnedFd>,
    pass: Arc<dyn DirectPost>,
    shared: Arc<crate::shared::Shared>,
}

impl Drop for CompletionWakeups {
    fn drop(&mut self) {
        self.shared.watchers.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
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

    /// What to run when a wait fd is readable: acknowledges the wake-up, runs passes until
    /// one finds nothing to do (at most `max`), and arms the NICs for the next one, if no
    /// other thread is in a pass (that thread then completes what there is). Returns the
    /// number of passes run.
    pub fn run_passes(&self, max: usize) -> usize {
        self.pass.watch_pass(max).unwrap_or(0)
    }
}

impl Engine {
    /// How many times a submitter posted on its own thread
    /// ([`EngineBuilder::direct_post`](crate::EngineBuilder::direct_post)) since the engine
    /// started: it found the reactor thread asleep and did not wake it, or (`Inline`) it
    /// posted its operation at submit. A diagnostic: 0 on an engine that never sleeps
    /// (BusyPoll), on shm outside `Inline`, or with direct posting off.
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
        self.inner.shared.watchers.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(CompletionWakeups { fds, pass, shared: self.inner.shared.clone() })
    }
}
