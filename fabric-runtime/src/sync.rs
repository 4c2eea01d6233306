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
