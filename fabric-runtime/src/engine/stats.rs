//! [`Engine::stats`]: a snapshot of what the engine has done, per NIC, per peer, for its
//! reactor and for each immediate counter.
//!
//! The counters are relaxed atomics that the reactor bumps as it posts and completes
//! (`shared/stats.rs`), so taking a snapshot costs a few loads per NIC and peer and never
//! stops the reactor. Each number is exact; the snapshot is not one atomic cut (an operation
//! completing while it is taken may show in `completed_ops` and still in `in_flight`).

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Engine;
use crate::shared::stats::OpCounters;
use crate::shared::PeerId;
use crate::sync::lock;

/// Operations of one NIC or one peer.
///
/// An operation is one posted work request: a write (with or without immediate, an imm-only
/// write counts 0 bytes), a read or a two-sided send. A transfer sharded over NICs counts one
/// operation per shard, on each shard's NIC. The engine's own control messages (the `Hello`
/// a new peer gets, the `Revoke` of a freed region: `docs/faults.md`) are not counted: these
/// figures describe the application's operations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpStats {
    /// Operations handed to the NIC.
    pub posted_ops: u64,
    /// Their bytes.
    pub posted_bytes: u64,
    /// Operations the NIC completed successfully.
    pub completed_ops: u64,
    /// Their bytes.
    pub completed_bytes: u64,
    /// Operations that failed: refused when posted, failed at completion, to a failed peer,
    /// timed out (`op_timeout`), or cancelled at shutdown.
    pub errors: u64,
    /// Operations posted that the NIC has not given back yet. One that timed out counts as an
    /// error at once but stays in flight until the provider completes it (its memory is held
    /// until then) or shutdown cancels it.
    pub in_flight: u64,
    /// Operations waiting to be posted (the NIC queue was full, or the connection not up).
    pub backlog: u64,
}

impl OpStats {
    fn read(c: &OpCounters) -> OpStats {
        let r = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        OpStats {
            posted_ops: r(&c.posted_ops),
            posted_bytes: r(&c.posted_bytes),
            completed_ops: r(&c.completed_ops),
            completed_bytes: r(&c.completed_bytes),
            errors: r(&c.errors),
            in_flight: r(&c.in_flight),
            backlog: r(&c.backlog),
        }
    }
}

/// The reactor's loop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReactorStats {
    /// Passes run (take the queue, post, poll every NIC), by the reactor thread or, in
    /// `ReactorMode::Inline`, by awaiting callers.
    pub passes: u64,
    /// Of `passes`, those run on callers' threads: by awaiting futures and the spin paths of
    /// an `Inline` engine or one with `await_spin`, and by the spinning callers of a
    /// `BusyPoll` engine (its spin paths, a lingering future), while its reactor thread
    /// stands by.
    pub caller_passes: u64,
    /// Times the reactor went to sleep in `ppoll` (`Event` mode, idle).
    pub sleeps: u64,
    /// Sleeps ended by a file descriptor (a submission's eventfd or a completion queue)
    /// rather than by the timeout.
    pub wakeups: u64,
    /// Time since the reactor started.
    pub uptime: Duration,
    /// Time spent asleep in `ppoll` (a sleep in progress included).
    pub slept: Duration,
    /// Time the reactor was awake: polling, posting, completing, spinning (`uptime - slept`).
    pub polling: Duration,
    /// Time inside the NIC backends' post calls (operations and receive buffers), where a
    /// provider may also do the transfer's work (libfabric `tcp` sends on the posting
    /// thread; `shm` waits there for the target's lock). Zero unless
    /// [`EngineBuilder::time_reactor`](crate::EngineBuilder::time_reactor).
    pub in_post: Duration,
    /// Time inside the NIC backends' poll calls (reading completion queues, which drives a
    /// libfabric provider's progress: socket reads and writes on `tcp`, the target's copy
    /// on `shm`). Zero unless `time_reactor`.
    pub in_poll: Duration,
    /// Time handling what the polls returned: completing futures (waking their tasks),
    /// counting arrivals, delivering messages. Zero unless `time_reactor`.
    ///
    /// `in_post + in_poll` is the NICs' share of the reactor's time, `completing` the
    /// engine's own per-completion work; the rest of `polling` is passes that found nothing
    /// to do (spinning or yielding) and the loop itself. `fabric-bench bw --time-calls` sets
    /// these per write beside the raw provider loop's (`docs/performance.md`). Each call's
    /// time is added when it returns, so a snapshot taken while a pass runs (by the task its
    /// completions just woke, say) lacks that pass's share.
    pub completing: Duration,
    /// Of the reactor's time, that inside completing the waiters of operations (waking their
    /// tasks: a futex wake-up for a parked one). Zero unless `time_reactor`.
    pub waking: Duration,
    /// Of the reactor's time, that inside taking and handling the submission queue (posting,
    /// and the enqueue of CUDA copies). Zero unless `time_reactor`.
    pub taking: Duration,
    /// Futures lingering now, 0 or 1 ([`EngineBuilder::await_linger`](crate::EngineBuilder::await_linger)):
    /// one pending future of the engine looks for its result rather than parking, and the
    /// reactor thread polls the NICs instead of sleeping.
    pub lingering: u64,
    /// Futures that began to linger, since the engine started.
    pub lingered: u64,
    /// Of those, the ones whose result did not come within the linger budget: they then
    /// registered their waker and parked, as without lingering. `lingered - linger_parked`
    /// (less those lingering now or dropped while lingering) saved an OS wake-up each.
    pub linger_parked: u64,
    /// Futures that did not linger because more than half of the last 64 lingers parked
    /// anyway (results that take longer than the budget: deep pipelines of GPU copies,
    /// large writes); one in 16 still lingers, so lingering comes back when results speed up.
    pub linger_skipped: u64,
}

/// The engine's CUDA copies (CUDA IPC writes, staging copies), each stage's time summed
/// over the gates (a gate: the copies of one operation or chunk, and the event after them).
/// Divide by `gates` for the mean per operation; `docs/gpu.md` has the breakdown of one
/// IPC `write_imm`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuStats {
    /// Gates started.
    pub gates: u64,
    /// Copies enqueued in them.
    pub copies: u64,
    /// On the calling thread, from a CUDA IPC write's call to its hand-over to the reactor:
    /// bounds, the IPC mapping's lookup, the list of copies.
    pub plan: Duration,
    /// From the engine handing an operation over to the reactor starting its copies
    /// (operations with copies of their own: CUDA IPC writes, `Engine::after`).
    pub handoff: Duration,
    /// Inside the driver's copy and event-record calls.
    pub enqueue: Duration,
    /// From the end of the enqueue to the reactor's pass that saw the copies done: the
    /// copies' own time plus how late the reactor looked.
    pub copy: Duration,
    /// Posting what a CUDA IPC write's copies released (its imm-only write), once the
    /// reactor saw them done: the sender's share of the arrival signal.
    pub signal: Duration,
    /// Inside the passes' event queries (`cuEventQuery`), and how many were made: the
    /// reactor's own cost of watching copies.
    pub polling: Duration,
    pub queries: u64,
}

/// One immediate value's counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CounterStats {
    /// The immediate value.
    pub imm: u32,
    /// Arrivals ever counted.
    pub arrivals: u64,
    /// Arrivals not consumed by a wait yet.
    pub available: u64,
    /// Async waits queued now.
    pub waiters: u64,
}

/// A snapshot of an engine's statistics ([`Engine::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineStats {
    /// The transport (`tcp;ofi_rxm`, `shm`, `verbs`).
    pub transport: String,
    /// Per NIC, by NIC index.
    pub nics: Vec<OpStats>,
    /// Per peer, by [`PeerId`] (index `i` is `PeerId(i)`).
    pub peers: Vec<OpStats>,
    /// The reactor.
    pub reactor: ReactorStats,
    /// Every immediate counter this engine has seen or been asked for, by immediate value:
    /// at most [`max_counters`](Self::max_counters) created by arrivals, plus those the
    /// application asked for beyond that.
    pub counters: Vec<CounterStats>,
    /// The most counters arrivals may create ([`EngineBuilder::max_counters`](crate::EngineBuilder::max_counters)).
    pub max_counters: usize,
    /// Arrivals refused since the engine started: each landed while the counter table held
    /// `max_counters` counters and its immediate had none. Not 0 means a peer sends more
    /// distinct immediates than the table holds (or the application never retires its
    /// per-request ones); a wait on such a value fails with
    /// [`Error::CounterLimit`](crate::Error::CounterLimit).
    pub imm_refused: u64,
    /// The engine's CUDA copies (all zero without GPU transfers).
    pub gpu: GpuStats,
    /// The latency settings the engine runs with, as its builder resolved them.
    pub settings: EngineSettings,
}

/// The reactor mode and latency options an engine runs with ([`EngineStats::settings`]):
/// what [`EngineBuilder::latency_profile`](crate::EngineBuilder::latency_profile), the
/// builder's setters, the environment and the machine's CPU count made of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineSettings {
    /// The reactor mode.
    pub mode: crate::ReactorMode,
    /// `EngineBuilder::await_linger`.
    pub await_linger: Duration,
    /// `EngineBuilder::poll_window`.
    pub poll_window: Duration,
    /// `EngineBuilder::await_spin`.
    pub await_spin: Duration,
    /// `EngineBuilder::direct_post`.
    pub direct_post: bool,
    /// The CPUs this process may use (a cgroup's quota counted), which the defaults of
    /// `await_linger` and `poll_window` depend on.
    pub cpus: usize,
}

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings {
            mode: crate::ReactorMode::Event,
            await_linger: Duration::ZERO,
            poll_window: Duration::ZERO,
            await_spin: Duration::ZERO,
            direct_post: true,
            cpus: 0,
        }
    }
}

impl fmt::Display for EngineSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} mode, await_linger {} us, poll_window {} us, await_spin {} us, direct posting {} ({} CPUs)",
            self.mode,
            self.await_linger.as_micros(),
            self.poll_window.as_micros(),
            self.await_spin.as_micros(),
            if self.direct_post { "on" } else { "off" },
            self.cpus
        )
    }
}

impl EngineStats {
    /// The entry of `peer`, if it is a peer of this engine.
    pub fn peer(&self, peer: PeerId) -> Option<&OpStats> {
        self.peers.get(peer.0 as usize)
    }

    /// The entry of immediate `imm`'s counter, if it exists.
    pub fn counter(&self, imm: u32) -> Option<&CounterStats> {
        self.counters.iter().find(|c| c.imm == imm)
    }

    /// All NICs together.
    pub fn total(&self) -> OpStats {
        self.nics.iter().fold(OpStats::default(), |a, n| OpStats {
            posted_ops: a.posted_ops + n.posted_ops,
            posted_bytes: a.posted_bytes + n.posted_bytes,
            completed_ops: a.completed_ops + n.completed_ops,
            completed_bytes: a.completed_bytes + n.completed_bytes,
            errors: a.errors + n.errors,
            in_flight: a.in_flight + n.in_flight,
            backlog: a.backlog + n.backlog,
        })
    }
}

impl fmt::Display for OpStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "posted {} ops / {} B, completed {} ops / {} B, errors {}, in flight {}, backlog {}",
            self.posted_ops,
            self.posted_bytes,
            self.completed_ops,
            self.completed_bytes,
            self.errors,
            self.in_flight,
            self.backlog
        )
    }
}

impl fmt::Display for EngineStats {
    /// Several lines: NICs, peers, the reactor, counters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "settings: {}", self.settings)?;
        for (i, n) in self.nics.iter().enumerate() {
            writeln!(f, "nic {i} ({}): {n}", self.transport)?;
        }
        for (i, p) in self.peers.iter().enumerate() {
            writeln!(f, "peer {i}: {p}")?;
        }
        let r = &self.reactor;
        write!(
            f,
            "reactor: {} passes ({} on callers' threads), {} sleeps ({} woken by an fd), up {:.3} s, asleep {:.3} s, polling {:.3} s",
            r.passes,
            r.caller_passes,
            r.sleeps,
            r.wakeups,
            r.uptime.as_secs_f64(),
            r.slept.as_secs_f64(),
            r.polling.as_secs_f64()
        )?;
        if r.lingered > 0 {
            write!(
                f,
                ", {} awaits lingered ({} parked after the budget, {} lingering now)",
                r.lingered, r.linger_parked, r.lingering
            )?;
        }
        if !(r.in_post + r.in_poll + r.completing).is_zero() {
            write!(
                f,
                " (in NIC posts {:.3} s, in NIC polls {:.3} s, completing {:.3} s)",
                r.in_post.as_secs_f64(),
                r.in_poll.as_secs_f64(),
                r.completing.as_secs_f64()
            )?;
        }
        if self.imm_refused > 0 {
            write!(
                f,
                "\ncounters: {} (arrivals create at most {}), {} arrivals refused",
                self.counters.len(),
                self.max_counters,
                self.imm_refused
            )?;
        }
        for c in &self.counters {
            write!(
                f,
                "\ncounter imm {}: {} arrivals, {} available, {} waiters",
                c.imm, c.arrivals, c.available, c.waiters
            )?;
        }
        Ok(())
    }
}

impl Engine {
    /// A snapshot of this engine's statistics: per NIC and per peer operations and bytes
    /// (posted, completed, failed, in flight, waiting), the reactor's passes and sleeps, and
    /// each immediate counter's arrivals and waiters.
    ///
    /// Cheap: relaxed loads, plus two short locks that the data path never takes (the peer
    /// list, the counter table) and one per counter with waiters queued. The reactor bumps
    /// the counters without locks or atomic read-modify-writes. `docs/operations.md` has an
    /// example; `Display` prints it on a few lines.
    pub fn stats(&self) -> EngineStats {
        let s = &self.shared().stats;
        let nics = s.nics.iter().map(OpStats::read).collect();
        let peers = lock(&s.peers).iter().map(|p| OpStats::read(p)).collect();
        let r = &s.reactor;
        let uptime = r.started.elapsed();
        let mut slept = Duration::from_nanos(r.slept_ns.load(Ordering::Relaxed));
        // A sleep in progress counts as sleep so far.
        let since = r.asleep_since.load(Ordering::Relaxed);
        if since > 0 {
            slept += uptime.saturating_sub(Duration::from_nanos(since - 1));
        }
        let reactor = ReactorStats {
            passes: r.passes.load(Ordering::Relaxed),
            caller_passes: r.caller_passes.load(Ordering::Relaxed),
            sleeps: r.sleeps.load(Ordering::Relaxed),
            wakeups: r.wakeups.load(Ordering::Relaxed),
            uptime,
            slept,
            polling: uptime.saturating_sub(slept),
            in_post: Duration::from_nanos(r.post_ns.load(Ordering::Relaxed)),
            in_poll: Duration::from_nanos(r.poll_ns.load(Ordering::Relaxed)),
            completing: Duration::from_nanos(r.complete_ns.load(Ordering::Relaxed)),
            waking: Duration::from_nanos(r.wake_ns.load(Ordering::Relaxed)),
            taking: Duration::from_nanos(r.take_ns.load(Ordering::Relaxed)),
            lingering: u64::from(r.lingering()),
            lingered: r.linger.began.load(Ordering::Relaxed),
            linger_parked: r.linger.parked.load(Ordering::Relaxed),
            linger_skipped: r.linger.skipped.load(Ordering::Relaxed),
        };
        let (cells, max_counters, imm_refused) = {
            let c = lock(&self.shared().counters);
            (c.table.values().cloned().collect::<Vec<_>>(), c.table.limit(), c.table.refused())
        };
        let mut counters: Vec<CounterStats> = cells
            .iter()
            .map(|c| CounterStats {
                imm: c.imm(),
                arrivals: c.arrived(),
                available: c.unconsumed(),
                waiters: c.waiters() as u64,
            })
            .collect();
        counters.sort_by_key(|c| c.imm);
        let g = &s.gpu;
        let ns = |a: &std::sync::atomic::AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        let gpu = GpuStats {
            gates: g.gates.load(Ordering::Relaxed),
            copies: g.copies.load(Ordering::Relaxed),
            plan: ns(&g.plan_ns),
            handoff: ns(&g.handoff_ns),
            enqueue: ns(&g.enqueue_ns),
            copy: ns(&g.copy_ns),
            signal: ns(&g.signal_ns),
            polling: ns(&g.poll_ns),
            queries: g.queries.load(Ordering::Relaxed),
        };
        EngineStats {
            gpu,
            transport: self.shared().transport.clone(),
            nics,
            peers,
            reactor,
            counters,
            max_counters,
            imm_refused,
            settings: self.inner.settings,
        }
    }
}
