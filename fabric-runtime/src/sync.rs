//! The one place atomics and locks are imported from, so that `--cfg loom` swaps in loom's
//! model-checked versions (CONVENTIONS.md 10).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// Locks, ignoring poisoning: every critical section here leaves its data consistent before
/// anything that can panic, so a poisoned lock still holds valid data, and `Drop` paths must
/// never panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Moves an engine's NIC work forward from the calling thread (`ReactorMode::Inline`):
/// what the futures and the spin path of an inline engine call instead of parking. Defined
/// here, beside the atomics, because the loom-checked counter names it too.
pub(crate) trait Progress: Send + Sync {
    /// One pass of the reactor's loop on the caller's thread: post what is queued, poll
    /// every completion queue, complete futures and counters. Never blocks: returns false
    /// at once when another thread is driving the NICs (that thread makes the progress).
    fn progress(&self) -> bool;
}

/// A handle to an inline engine's progress, cloned into its futures and counters.
pub(crate) type Driver = std::sync::Arc<dyn Progress>;
