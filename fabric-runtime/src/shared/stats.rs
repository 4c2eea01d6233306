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

/// Every counter of one engine.
#[derive(Debug)]
pub(crate) struct Stats {
    pub(crate) nics: Box<[OpCounters]>,
    pub(crate) peers: Mutex<Vec<Arc<OpCounters>>>,
    pub(crate) reactor: ReactorCounters,
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
            },
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
