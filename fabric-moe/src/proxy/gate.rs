//! The receive gates of the proxy transport (see the parent module's "Receive gates" and
//! `docs/moe.md`). A receive kernel that spins on the GPU while the proxy's writes are under
//! way slows them down, so the receive kernels of dispatch and combine are not started before
//! the step's arrivals are there: per gated stage ([`GATED`]) a u32 **gate** word of pinned,
//! device-mapped host memory, which the stream closes (a stream write of 0 before the send
//! kernel) and waits for (`>= 1`, before the receive kernel). The proxy thread opens it once
//! it has seen the step's doorbell and every proxy source's counter holds the step's
//! arrivals, after a timeout, after a failed write, and when it stops ([`should_open`], the
//! pure decision; [`arrived`], its count). Also the gate words ([`gate_word`], [`open_all`])
//! and what the thread keeps of them ([`GateState`], [`OpenOnDrop`]).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::cuda::PinnedHostBuffer;

use super::Stage;

/// The stages whose receive is gated, in the order of the gate words (the barrier carries no
/// data and is not).
pub(super) const GATED: [Stage; 2] = [Stage::Dispatch, Stage::Combine];

/// Bytes from one gate word to the next: a cache line each, so that the GPU's writes and
/// polls of one stage's gate and the host's of the other do not share a line.
pub(super) const GATE_STRIDE: usize = 64;

/// Whether a counter of `total` arrivals, counted from `base` with `writes` arrivals a step,
/// holds every arrival of step `seq`: the host's form of `px_wait` (`kernels/common.cu`),
/// wrap-safe in the step as the kernel's is (`(int)(steps - seq) >= 0`).
fn arrived(total: u64, base: u64, writes: u64, seq: u32) -> bool {
    let steps = (total.wrapping_sub(base) / writes.max(1)) as u32;
    steps.wrapping_sub(seq) as i32 >= 0
}

/// Why the proxy opens a gate ([`should_open`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Open {
    /// This step's doorbell seen and every source's arrivals there: the normal case.
    Arrived,
    /// Seen closed for longer than the timeout: the receive kernel runs and reports.
    TimedOut,
    /// A write of this proxy failed: the all-to-all is broken, no gate is kept closed.
    Failed,
}

/// The decision of one stage's gate, from what the proxy thread sees:
///
/// - `bell`: the step of this stage's doorbell seen and not yet opened for (`None`: none
///   pending). The doorbell is rung after the stream closed the gate, so an opening after it
///   is not undone by this step's close.
/// - `totals`: `(total, base)` of each proxy source's counter of the stage, `writes`
///   arrivals a step ([`Stage::writes`]);
/// - `closed_for`: how long the gate word has been seen at 0 (`None`: seen open);
/// - `timeout`: the kernels' wait bound ([`Config::timeout`](crate::Config::timeout));
/// - `failed`: a write of this proxy has failed.
///
/// Opens on the step's arrivals, or whenever it is closed once `failed`, or once closed for
/// longer than `timeout`; never keeps a gate closed for a reason that cannot end.
pub(super) fn should_open(
    bell: Option<u32>,
    totals: impl IntoIterator<Item = (u64, u64)>,
    writes: u64,
    closed_for: Option<Duration>,
    timeout: Duration,
    failed: bool,
) -> Option<Open> {
    if let Some(seq) = bell {
        if totals.into_iter().all(|(total, base)| arrived(total, base, writes, seq)) {
            return Some(Open::Arrived);
        }
    }
    match closed_for {
        Some(_) if failed => Some(Open::Failed),
        Some(d) if d > timeout => Some(Open::TimedOut),
        _ => None,
    }
}

/// `stage`'s gate word in `gates` (made by [`connect`](super::connect)).
pub(super) fn gate_word(gates: &PinnedHostBuffer, i: usize) -> &AtomicU32 {
    &gates.atomic_u32s()[i * GATE_STRIDE / 4]
}

/// Opens every gate of `gates`.
pub(super) fn open_all(gates: &PinnedHostBuffer) {
    for i in 0..GATED.len() {
        gate_word(gates, i).store(1, Ordering::Release);
    }
}

/// Opens the gates when dropped: at the end of the proxy thread, whether it returned or
/// panicked.
pub(super) struct OpenOnDrop(pub(super) Option<Arc<PinnedHostBuffer>>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        if let Some(g) = &self.0 {
            open_all(g);
        }
    }
}

/// What the thread keeps of one stage's gate.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct GateState {
    /// The step of the stage's last doorbell seen (0: none yet; steps count from 1).
    pub(super) bell: u32,
    /// The step the gate was last opened for (0: none).
    pub(super) opened: u32,
    /// When the gate word was first seen at 0 since it was last open.
    pub(super) closed_since: Option<Instant>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_count_whole_steps_from_the_base_and_wrap() {
        // Dispatch: 4 writes a step, counted from 10.
        assert!(arrived(10, 10, 4, 0));
        assert!(!arrived(13, 10, 4, 1), "3 of step 1's 4 writes");
        assert!(arrived(14, 10, 4, 1));
        assert!(arrived(22, 10, 4, 3));
        assert!(!arrived(22, 10, 4, 4));
        assert!(arrived(26, 10, 4, 3), "a later step covers the earlier ones");
        // The total wraps past u64::MAX (its base was near the end).
        assert!(arrived(2, u64::MAX - 1, 2, 2), "4 arrivals across the wrap");
        assert!(!arrived(1, u64::MAX - 1, 2, 2));
        // The step wraps past u32::MAX: step 0 after u32::MAX, as the kernel's (int)(steps - want).
        let per = |steps: u64| 7 + 2 * steps;
        assert!(arrived(per(1 << 32), 7, 2, 0));
        assert!(arrived(per(1 << 32), 7, 2, u32::MAX));
        assert!(!arrived(per((1 << 32) - 1), 7, 2, 0));
        // More than 2^31 steps behind reads as ahead, as on the GPU (never reached: the
        // ranks are at most a step apart).
        assert!(!arrived(7, 7, 2, 1 << 31));
        assert!(arrived(7, 7, 2, (1 << 31) + 1));
    }

    #[test]
    fn gates_open_on_the_steps_arrivals_from_every_source() {
        let t = Duration::from_secs(10);
        let short = Some(Duration::from_millis(1));
        // Step 3's doorbell seen; source A has 3 steps of combine (2 writes), source B 2.
        let a = (100 + 6, 100);
        let b = (50 + 4, 50);
        assert_eq!(should_open(Some(3), [a, b], 2, short, t, false), None, "B is a step behind");
        assert_eq!(should_open(Some(2), [a, b], 2, short, t, false), Some(Open::Arrived));
        let b = (50 + 6, 50);
        assert_eq!(should_open(Some(3), [a, b], 2, short, t, false), Some(Open::Arrived));
        // Arrivals alone, without this step's doorbell, never open: the stream's close of
        // this step may still be on its way and would undo the opening.
        assert_eq!(should_open(None, [a, b], 2, short, t, false), None);
        assert_eq!(should_open(None, [a, b], 2, None, t, false), None);
        // Open on arrivals even where the gate was seen open (harmless), and with no source
        // (nothing to wait for).
        assert_eq!(should_open(Some(3), [a, b], 2, None, t, false), Some(Open::Arrived));
        assert_eq!(should_open(Some(3), [], 2, short, t, false), Some(Open::Arrived));
        // Across the step's wrap.
        let w = (9 + 2 * (1u64 << 32), 9);
        assert_eq!(should_open(Some(0), [w], 2, short, t, false), Some(Open::Arrived));
        assert_eq!(should_open(Some(1), [w], 2, short, t, false), None);
    }

    #[test]
    fn gates_never_stay_closed_past_the_timeout_or_a_failure() {
        let t = Duration::from_secs(10);
        let behind = [(0, 0)];
        assert_eq!(should_open(Some(1), behind, 4, Some(t), t, false), None, "at the bound");
        let long = Some(t + Duration::from_nanos(1));
        assert_eq!(should_open(Some(1), behind, 4, long, t, false), Some(Open::TimedOut));
        // Closed with no doorbell (a send that was never launched): the timeout still opens.
        assert_eq!(should_open(None, behind, 4, long, t, false), Some(Open::TimedOut));
        // Once a write failed, any closed gate opens at once; an open one is left alone.
        let short = Some(Duration::from_micros(1));
        assert_eq!(should_open(Some(1), behind, 4, short, t, true), Some(Open::Failed));
        assert_eq!(should_open(None, behind, 4, short, t, true), Some(Open::Failed));
        assert_eq!(should_open(None, behind, 4, None, t, true), None);
        assert_eq!(should_open(None, behind, 4, None, t, false), None);
    }
}
