//! The counters behind `Engine::stats`: plain relaxed atomics that the reactor bumps and
//! anyone may read.
//!
//! Every counter here has **one writer at a time**: the reactor's pass, which runs under the
//! core's mutex (on the reactor thread, or on an `Inline` caller's thread through
//! `try_lock`). So an increment is a relaxed load and a relaxed store ([`bump`]), not a locked
//! read-modify-write, and the hot path takes no lock and no contended cache line. Readers
//! (a snapshot) see each counter's latest value, but not one consistent cut across counters:
//! `posted - completed - errors` may differ from `in_flight` by an operation in passing.
//!
//! Per-peer counters are created when the reactor adds the peer; the list of them sits behind
//! a mutex that only `add_peer` (cold) and snapshots take.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::sync::lock;

/// Adds `n` to a counter that only the holder of the reactor core writes.
#[inline]
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Subtracts `n` from such a counter, stopping at zero.
#[inline]
pub(crate) fn drop_by(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).saturating_sub(n), Ordering::Relaxed);
}

/// Operation counters of one NIC or one peer.
#[derive(Default, Debug)]
pub(crate) struct OpCounters {
    pub(crate) posted_ops: AtomicU64,
    pub(crate) posted_bytes: AtomicU64,
    pub(crate) completed_ops: AtomicU64,
    pub(crate) completed_bytes: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) backlog: AtomicU64,
}

impl OpCounters {
    fn posted(&self, bytes: u64) {
        bump(&self.posted_ops, 1);
        bump(&self.posted_bytes, bytes);
        bump(&self.in_flight, 1);
    }

    fn completed(&self, bytes: u64) {
        bump(&self.completed_ops, 1);
        bump(&self.completed_bytes, bytes);
        drop_by(&self.in_flight, 1);
    }

    fn failed(&self, was_in_flight: bool) {
        bump(&self.errors, 1);
        if was_in_flight {
            drop_by(&self.in_flight, 1);
        }
    }
}

/// Counters of the engine's reactor.
#[derive(Debug)]
pub(crate) struct ReactorCounters {
    pub(crate) started: Instant,
    pub(crate) passes: AtomicU64,
    /// Of `passes`, those run on a caller's thread (bumped under the core's lock).
    pub(crate) caller_passes: AtomicU64,
    pub(crate) sleeps: AtomicU64,
    /// Sleeps ended by a file descriptor (the eventfd or a CQ), not the timeout.
    pub(crate) wakeups: AtomicU64,
    pub(crate) slept_ns: AtomicU64,
    /// While asleep: when the sleep began, in ns since `started`, plus one; 0 while awake
    /// (so a snapshot counts a sleep in progress as sleep).
    pub(crate) asleep_since: AtomicU64,
    /// `EngineBuilder::time_reactor`: ns inside the backends' post calls, their poll calls,
    /// and handling what the polls returned.
    pub(crate) post_ns: AtomicU64,
    pub(crate) poll_ns: AtomicU64,
    pub(crate) complete_ns: AtomicU64,
    /// `time_reactor`: ns inside completing futures (waking their tasks), and inside taking
    /// and handling the submission queue.
    pub(crate) wake_ns: AtomicU64,
    pub(crate) take_ns: AtomicU64,
    pub(crate) linger: LingerCounters,
}

/// `EngineBuilder::await_linger`, written by the awaiting callers (read-modify-writes; on a
/// cache line of their own, away from the reactor's counters that every pass writes).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct LingerCounters {
    /// While a future lingers: the end of its budget, in ns since the reactor started
    /// (`ReactorCounters::started`); 0 when none does. One future lingers at a time (it
    /// takes this with a compare-and-swap); the reactor thread polls instead of sleeping
    /// until this passes, so a lingering future that is never polled again cannot keep it
    /// awake for longer than its budget.
    pub(crate) until: AtomicU64,
    /// Futures that began to linger, and those of them that spent their budget and parked.
    pub(crate) began: AtomicU64,
    pub(crate) parked: AtomicU64,
    /// The outcomes of the last 64 lingers, newest in bit 0 (1: it spent its budget and
    /// parked), and the futures that did not linger because most of those parked.
    pub(crate) recent: AtomicU64,
    pub(crate) skipped: AtomicU64,
    /// Futures that found lingering off for misses (the skipped ones and the probes).
    pub(crate) off: AtomicU64,
}

/// Lingering pays only when results come within the budget: when more than this many of
/// the last 64 lingers parked anyway (a deep pipeline of GPU copies, large writes), futures
/// park at once, but for one in [`LINGER_PROBE`], whose outcome keeps the history current.
pub(crate) const LINGER_MISSES_MAX: u32 = 32;
/// While lingering is off for misses, one future in this many lingers still (a probe).
pub(crate) const LINGER_PROBE: u64 = 16;

impl LingerCounters {
    /// Whether the next future may linger: yes, unless most recent lingers parked anyway
    /// (then one in [`LINGER_PROBE`] does, to see whether that changed).
    pub(crate) fn worth_it(&self) -> bool {
        if self.recent.load(Ordering::Relaxed).count_ones() <= LINGER_MISSES_MAX {
            return true;
        }
        if self.off.fetch_add(1, Ordering::Relaxed) % LINGER_PROBE == LINGER_PROBE - 1 {
            return true;
        }
        self.skipped.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// A linger ended: `parked` if its budget ran out.
    pub(crate) fn outcome(&self, parked: bool) {
        let _ = self
            .recent
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| Some(r << 1 | u64::from(parked)));
    }
}

impl ReactorCounters {
    /// Now, in ns since the reactor started (the time base of [`LingerCounters::until`]).
    pub(crate) fn clock_ns(&self) -> u64 {
        self.started.elapsed().as_nanos() as u64
    }

    /// Whether a future lingers now (`EngineBuilder::await_linger`): the reactor thread
    /// polls rather than sleeps.
    pub(crate) fn lingering(&self) -> bool {
        let until = self.linger.until.load(Ordering::SeqCst);
        until != 0 && self.clock_ns() < until
    }

    /// A sleep begins now.
    pub(crate) fn sleep_begins(&self, now: Instant) {
        bump(&self.sleeps, 1);
        let ns = now.saturating_duration_since(self.started).as_nanos() as u64;
        self.asleep_since.store(ns + 1, Ordering::Relaxed);
    }

    /// Adds the time since `t` (a clock read by a timed reactor; `None`: untimed) to `c`.
    pub(crate) fn charge(c: &AtomicU64, t: Option<Instant>) {
        if let Some(t) = t {
            bump(c, t.elapsed().as_nanos() as u64);
        }
    }

    /// The sleep that began at `began` is over; a file descriptor ended it if `woken`.
    pub(crate) fn sleep_ends(&self, began: Instant, woken: bool) {
        self.asleep_since.store(0, Ordering::Relaxed);
        bump(&self.slept_ns, began.elapsed().as_nanos() as u64);
        if woken {
            bump(&self.wakeups, 1);
        }
    }
}

/// The reactor's CUDA copies (`EngineStats::gpu`): gates started, copies in them, and ns
/// summed over the gates of each stage.
#[derive(Debug, Default)]
pub(crate) struct GpuCounters {
    pub(crate) gates: AtomicU64,
    pub(crate) copies: AtomicU64,
    /// The calling thread's planning of an IPC write (bounds, mapping, copies) until it hands
    /// it over.
    pub(crate) plan_ns: AtomicU64,
    /// From the engine handing an IPC write over to the reactor starting its copies.
    pub(crate) handoff_ns: AtomicU64,
    /// Inside the copy and event-record calls.
    pub(crate) enqueue_ns: AtomicU64,
    /// From the end of the enqueue to the pass that saw the copies done.
    pub(crate) copy_ns: AtomicU64,
    /// Handling what an IPC write's gate released (posting its imm-only write), from the
    /// pass that saw the copies done.
    pub(crate) signal_ns: AtomicU64,
    /// Inside the passes' event queries, and how many were made.
    pub(crate) poll_ns: AtomicU64,
    pub(crate) queries: AtomicU64,
}

/// Every counter of one engine.
#[derive(Debug)]
pub(crate) struct Stats {
    pub(crate) nics: Box<[OpCounters]>,
    pub(crate) peers: Mutex<Vec<Arc<OpCounters>>>,
    pub(crate) reactor: ReactorCounters,
    pub(crate) gpu: GpuCounters,
}

impl Stats {
    pub(crate) fn new(nics: usize) -> Stats {
        Stats {
            nics: (0..nics).map(|_| OpCounters::default()).collect(),
            peers: Mutex::new(Vec::new()),
            reactor: ReactorCounters {
                started: Instant::now(),
                passes: AtomicU64::new(0),
                caller_passes: AtomicU64::new(0),
                sleeps: AtomicU64::new(0),
                wakeups: AtomicU64::new(0),
                slept_ns: AtomicU64::new(0),
                asleep_since: AtomicU64::new(0),
                linger: LingerCounters::default(),
                post_ns: AtomicU64::new(0),
                poll_ns: AtomicU64::new(0),
                complete_ns: AtomicU64::new(0),
                wake_ns: AtomicU64::new(0),
                take_ns: AtomicU64::new(0),
            },
            gpu: GpuCounters::default(),
        }
    }

    /// The counters of a new peer (the reactor keeps the `Arc` in its peer table).
    pub(crate) fn add_peer(&self) -> Arc<OpCounters> {
        let c = Arc::new(OpCounters::default());
        lock(&self.peers).push(c.clone());
        c
    }

    fn nic(&self, nic: usize) -> Option<&OpCounters> {
        self.nics.get(nic)
    }

    /// An operation of `bytes` was posted on `nic` to a peer with counters `peer`.
    #[inline]
    pub(crate) fn posted(&self, nic: usize, peer: &OpCounters, bytes: u64) {
        if let Some(n) = self.nic(nic) {
            n.posted(bytes);
        }
        peer.posted(bytes);
    }

    /// A posted operation completed successfully.
    #[inline]
    pub(crate) fn completed(&self, nic: usize, peer: Option<&OpCounters>, bytes: u64) {
        if let Some(n) = self.nic(nic) {
            n.completed(bytes);
        }
        if let Some(p) = peer {
            p.completed(bytes);
        }
    }

    /// An operation failed: at its completion (`was_in_flight`) or before it was posted.
    pub(crate) fn failed(&self, nic: usize, peer: Option<&OpCounters>, was_in_flight: bool) {
        if let Some(n) = self.nic(nic) {
            n.failed(was_in_flight);
        }
        if let Some(p) = peer {
            p.failed(was_in_flight);
        }
    }

    /// An operation already counted as failed (it timed out) is no longer in flight.
    pub(crate) fn landed(&self, nic: usize, peer: Option<&OpCounters>) {
        if let Some(n) = self.nic(nic) {
            drop_by(&n.in_flight, 1);
        }
        if let Some(p) = peer {
            drop_by(&p.in_flight, 1);
        }
    }

    /// `n` operations joined (`grew`) or left a peer's backlog of operations refused for now.
    pub(crate) fn backlog(&self, nic: usize, peer: &OpCounters, grew: bool, n: u64) {
        let f = if grew { bump } else { drop_by };
        if let Some(c) = self.nic(nic) {
            f(&c.backlog, n);
        }
        f(&peer.backlog, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lingering turns itself off when most lingers park, probes one future in 16 while off,
    /// and comes back once lingers succeed again.
    #[test]
    fn lingering_turns_itself_off_and_back_on() {
        let l = LingerCounters::default();
        for _ in 0..64 {
            assert!(l.worth_it(), "fresh history: linger");
            l.outcome(false);
        }
        for _ in 0..LINGER_MISSES_MAX {
            assert!(l.worth_it());
            l.outcome(true);
        }
        assert!(l.worth_it(), "exactly half parked: still on");
        l.outcome(true);
        let tried: Vec<bool> = (0..32).map(|_| l.worth_it()).collect();
        assert_eq!(tried.iter().filter(|t| **t).count(), 2, "one probe in 16: {tried:?}");
        assert_eq!(l.skipped.load(Ordering::Relaxed), 30);
        // Probes that succeed bring it back: once at most half of the last 64 parked.
        let mut probes = 0;
        while !(0..LINGER_PROBE).all(|_| l.worth_it()) {
            l.outcome(false);
            probes += 1;
            assert!(probes <= 64, "lingering never came back");
        }
    }
}
