//! The reactor: owns every domain (NIC) of one engine, posts what callers submit, polls
//! completion queues, and wakes the futures and counters waiting on them.
//!
//! `core/` (`core/mod.rs`) holds the state and one pass of the loop ([`core::Core::turn`]): take the
//! submission queue (swapping buffers, so no allocation in steady state) → post (a full send
//! queue leaves the rest in a backlog, in order) → poll every domain → complete futures,
//! count immediates, deliver messages. This file runs passes on the reactor thread and
//! decides how to wait when a pass found nothing to do ([`Windows::idle`]): `BusyPoll` spins,
//! `Adaptive` spins until its window since the last activity has passed and then waits as
//! `Event` does, `Event` polls (yielding the core) for `EngineBuilder::poll_window` after
//! the last activity, then sleeps in `ppoll` on the eventfd and each domain's wait fd, after
//! `arm`ing every domain (so a completion racing the decision to sleep is never missed). A
//! domain with no wait fd is polled for at least 1 ms after activity, and its sleep is a
//! timed poll. In `Inline` mode the awaiting callers run passes themselves (through
//! [`Progress`]), and the thread stands by while they do.
//!
//! The core sits behind a mutex: the thread takes it for a pass (and to arm before a sleep,
//! never across the sleep), an inline caller only ever `try_lock`s it. So each domain is
//! still used by one thread at a time (`FI_THREAD_DOMAIN`).

pub(crate) mod core;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use self::core::{Core, EVENT_NO_FD_SPIN};
use crate::error::{Error, Result};
use crate::provider::Domain;
use crate::shared::queue::{Submission, SubmitHere};
use crate::shared::stats::bump;
use crate::shared::Shared;
use crate::sync::{lock, DirectPost, Driver, Progress};
use crate::sys;

/// How the reactor thread waits for work. Chosen when the engine is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReactorMode {
    /// Sleep on the completion queue's wait fd and the submission eventfd when idle: about
    /// zero CPU while nothing happens; a wake-up costs a few microseconds. After its last
    /// activity the reactor first keeps polling for `EngineBuilder::poll_window` (250 µs on
    /// machines with 8 or more CPUs, else 0), so a transfer in progress, whose provider
    /// progresses only when polled (tcp), never waits for the reactor to wake. On providers with
    /// no wait fd (libfabric `shm`, EFA) the reactor cannot sleep on the NIC: for 1 ms after
    /// the last activity it keeps polling (so a transfer in progress, whose target side must
    /// poll for it to progress, is not paced by timer sleeps), then polls at an interval that
    /// backs off from 50 µs to `EngineBuilder::idle_poll_interval` (1 ms by default), so an
    /// arrival on an idle engine is seen within that interval.
    ///
    /// An operation started while the reactor sleeps is posted on the starting thread
    /// (`EngineBuilder::direct_post`) rather than by waking the reactor, on providers with a
    /// wait fd. `fabric_async::CompletionWatch` lets the awaiting runtime's own thread wake on
    /// completions too (one OS wake-up fewer per completion; `docs/latency.md`). On machines
    /// with 8 or more CPUs a pending future first lingers for up to 200 µs
    /// (`EngineBuilder::await_linger`), during which the reactor polls rather than sleeps: a
    /// result that comes within it costs no wake-up at all.
    #[default]
    Event,
    /// Spin for `spin` after the last activity, then behave like `Event`: on a NIC with no
    /// wait fd (shm, EFA) that includes `Event`'s polling for 1 ms after the last activity,
    /// so a `spin` shorter than that never makes the reactor sleep sooner than `Event` would.
    Adaptive {
        /// How long to keep spinning after the last completion or submission.
        spin: Duration,
    },
    /// Spin continuously (one core at 100%; pin it with `EngineBuilder::pin_core`):
    /// completions are seen at once. A thread that spins anyway drives the NICs itself: the
    /// synchronous spin paths (`OpBatch::spin_until`, `ImmCounter::spin_wait`) and a
    /// lingering future (`EngineBuilder::await_linger`, 200 µs by default on 8 or more CPUs)
    /// run the reactor's pass on their own thread, so a completion is found where it is
    /// awaited instead of being handed over from the reactor's core. While they do, the
    /// reactor thread stands by, asleep on its eventfd for 20 µs at a time; it takes over
    /// within that once they stop, and at once when a future parks. A future that does not
    /// linger (another lingers, or the budget is 0) parks its executor thread and pays an OS
    /// wake-up; see `Inline`. What each path costs over the raw provider loop:
    /// `docs/latency.md`.
    BusyPoll,
    /// The task that awaits drives the NICs itself, for latency-critical paths (MoE
    /// dispatch/combine). Polling an `OpFuture`, a `wait_for` or a `recv`, and the
    /// synchronous spin path (`OpBatch::spin_until`, `ImmCounter::spin_wait`), run the
    /// reactor's pass on the caller's thread; a future still pending then wakes itself at
    /// once (`Waker::wake_by_ref`, as `tokio::task::yield_now` does) instead of waiting to be
    /// woken, so the executor thread never parks while something is awaited and no OS
    /// wake-up sits on the latency path (a pending future first spins, running passes, for up to
    /// `EngineBuilder::inline_spin`, 20 µs by default, inside one `poll`). It takes the awaiting thread's core: run that part
    /// of the program on a runtime of its own (a current-thread runtime on a dedicated,
    /// pinned thread; see `docs/latency.md`). A reactor thread stays in the background:
    /// while callers drive it stands by (a timed sleep of 200 µs, no NIC access); once they
    /// stop it takes over and behaves like `Event`, so work nobody awaits (a peer's writes
    /// to count, operation timeouts, shutdown) still moves.
    Inline,
}

/// What the reactor thread needs to know of the engine's settings (made by
/// `EngineBuilder::reactor_config`).
#[derive(Debug, Clone)]
pub(crate) struct ReactorConfig {
    pub(crate) mode: ReactorMode,
    pub(crate) pin_core: Option<usize>,
    pub(crate) idle_poll_interval: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) recv_depth: usize,
    pub(crate) send_depth: usize,
    pub(crate) op_timeout: Option<Duration>,
    /// Bytes of one message slot: the kind byte, then a user message or a control message.
    pub(crate) msg_slot: usize,
    /// `Inline`: how long a pending future spins inside one `poll`.
    pub(crate) inline_spin: Duration,
    /// Other modes: how long a pending future runs passes before parking (0: never).
    pub(crate) await_spin: Duration,
    /// Other modes, without `await_spin`: how long a pending future lingers (0: never).
    pub(crate) await_linger: Duration,
    /// Post on the submitter's thread while the reactor thread sleeps.
    pub(crate) direct_post: bool,
    /// `EngineBuilder::poll_window`: polling (yielding) after the last activity.
    pub(crate) poll_window: Duration,
    /// `EngineBuilder::time_reactor`: time the backends' post and poll calls.
    pub(crate) time_calls: bool,
}

/// How long the reactor thread of an `Inline` engine sleeps while callers drive the NICs,
/// before it looks again whether they still do.
const INLINE_STANDBY: Duration = Duration::from_micros(200);

/// How long the reactor thread of a `BusyPoll` engine stands by, asleep on its eventfd,
/// each time it sees that its spinning callers ran passes since it last looked: the first
/// pass after the last of them stops comes within about this long. A future that parks
/// meanwhile ends the standby at once (`Lingering::parking`), unless it looked just before
/// the standby began; this bound then holds for it too.
/// It sleeps rather than spins meanwhile: a reactor thread spinning beside them, even on a
/// core of its own and touching nothing they write but the pass counter, slowed the round
/// trips of callers that drive (`docs/latency.md`).
const BUSY_STANDBY: Duration = Duration::from_micros(20);

/// The timer slack of a `BusyPoll` reactor thread, in ns (`sys::set_timer_slack`).
const BUSY_TIMER_SLACK_NS: u64 = 1000;

/// A pass on a caller's thread (`Inline`, `AwaitSpin`, a spinning caller of a `BusyPoll`
/// engine), after telling the reactor thread that a caller drives (it stands by). The
/// counter is bumped with a load and a store, not a read-modify-write: callers racing here
/// may lose an increment, but the value still changes, which is all the reactor thread
/// looks at.
fn caller_pass<D: Domain>(core: &Mutex<Core<D>>, shared: &Shared) -> bool {
    let polls = &shared.inline_polls;
    polls.store(polls.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    try_core(core).is_some_and(|mut c| {
        bump(&shared.stats.reactor.caller_passes, 1);
        c.turn()
    })
}

/// The core for a pass on another thread than the reactor's: never waits (`None` while some
/// thread is in a pass); a poisoned lock still holds a consistent core (see `sync::lock`).
fn try_core<D: Domain>(core: &Mutex<Core<D>>) -> Option<MutexGuard<'_, Core<D>>> {
    match core.try_lock() {
        Ok(c) => Some(c),
        Err(TryLockError::WouldBlock) => None,
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
    }
}

/// The progress handle of an `Inline` engine: a pass of the reactor on the caller's thread.
struct Inline<D: Domain> {
    core: Arc<Mutex<Core<D>>>,
    shared: Arc<Shared>,
    spin: Duration,
    /// `EngineBuilder::direct_post`: operations are posted at submit (`submit_here`).
    direct: bool,
}

impl<D: Domain> Progress for Inline<D> {
    fn progress(&self) -> bool {
        caller_pass(&self.core, &self.shared)
    }

    fn spin_budget(&self) -> Duration {
        self.spin
    }
}

impl<D: Domain> SubmitHere for Inline<D> {
    fn submit_here(&self, s: Submission) -> std::result::Result<(), Submission> {
        if !self.direct || self.shared.closing() || !matches!(s, Submission::Op { .. }) {
            return Err(s);
        }
        let Some(mut c) = try_core(&self.core) else { return Err(s) };
        let wake = c.submit_here(s)?;
        drop(c);
        self.shared.direct_posts.fetch_add(1, Ordering::Relaxed);
        if wake {
            self.shared.wake.notify();
        }
        Ok(())
    }
}

/// `EngineBuilder::await_spin` on an engine with a reactor thread of its own: a pending
/// future runs passes on its thread (when no other thread is in one) for up to `spin`, then
/// registers its waker and parks; the reactor thread wakes it when a pass of its own
/// completes it.
///
/// While callers spin, the reactor thread stands by, as an `Inline` engine's does: woken on
/// a wait fd it would take the core's lock for a pass of its own, and if it is then
/// preempted (it often wakes on the very CPU the spinner keeps busy) every caller's
/// `try_lock` fails until it runs again, so the spin would find nothing. A caller that gives
/// up its spin and parks writes the eventfd, which ends the standby at once.
struct AwaitSpin<D: Domain> {
    core: Arc<Mutex<Core<D>>>,
    shared: Arc<Shared>,
    spin: Duration,
}

impl<D: Domain> Progress for AwaitSpin<D> {
    fn progress(&self) -> bool {
        caller_pass(&self.core, &self.shared)
    }

    fn parking(&self) {
        self.shared.wake.notify();
    }

    fn spin_budget(&self) -> Duration {
        self.spin
    }

    fn repolls(&self) -> bool {
        false
    }
}

/// `EngineBuilder::await_linger`: the first pending future of the engine spins in short
/// slices, peeking at its result, for up to `budget` before it parks
/// ([`crate::sync::linger_poll`]). While it lingers the reactor thread does not sleep: it
/// polls, yielding its core between passes that find nothing, so that the result is seen as
/// soon as it lands, and no OS wake-up of either thread is on its path.
///
/// On a `BusyPoll` engine (`drive`), every thread that spins anyway runs passes itself: a
/// lingering future between its peeks, the synchronous spin paths (`OpBatch::spin_until`,
/// `ImmCounter::spin_wait`) while they wait; the budget may then be zero (futures park at
/// once, the spin paths still drive). The reactor thread stands by while they do (`run`),
/// so that a completion is found on the thread that waits for it instead of being handed
/// over from the reactor's core: two such hand-offs per hop were most of the distance
/// between `BusyPoll` and the raw provider loop (`docs/latency.md`).
struct Lingering<D: Domain> {
    shared: Arc<Shared>,
    budget: Duration,
    drive: Option<Arc<Mutex<Core<D>>>>,
}

impl<D: Domain> Progress for Lingering<D> {
    fn progress(&self) -> bool {
        // Without `drive` the reactor thread drives the NICs; callers just look.
        self.drive.as_ref().is_some_and(|core| caller_pass(core, &self.shared))
    }

    fn spin_budget(&self) -> Duration {
        Duration::ZERO
    }

    fn linger(&self) -> Option<Duration> {
        Some(self.budget)
    }

    fn drives(&self) -> bool {
        self.drive.is_some()
    }

    fn linger_free(&self) -> bool {
        !self.shared.stats.reactor.lingering()
    }

    fn linger_begin(&self, budget: Duration) -> Option<u64> {
        let r = &self.shared.stats.reactor;
        let now = r.clock_ns();
        let until = now.saturating_add(budget.as_nanos() as u64).max(1);
        let cur = r.linger.until.load(Ordering::SeqCst);
        // Free, or its holder's budget is over (a future polled once and then left alone).
        if cur != 0 && now < cur {
            return None;
        }
        // Most recent lingers parked anyway: park at once (the wake-up is paid either way,
        // and a lingering spin beside the reactor only delays it).
        if !r.linger.worth_it() {
            return None;
        }
        r.linger.until.compare_exchange(cur, until, Ordering::SeqCst, Ordering::Relaxed).ok()?;
        r.linger.began.fetch_add(1, Ordering::Relaxed);
        if self.drive.is_some() {
            // `BusyPoll`: the reactor thread never sleeps in `ppoll`, and this future drives.
            return Some(until);
        }
        // A reactor thread asleep in `ppoll` must poll instead. It looks at `until` under
        // the queue's lock before it sleeps (`Core::prepare_sleep`), and this looks at its
        // flag under the same lock after `until` was set: one of the two sees the other.
        let mut q = lock(&self.shared.queue);
        if q.sleeping {
            q.sleeping = false;
            drop(q);
            self.shared.wake.notify();
        }
        Some(until)
    }

    fn linger_end(&self, token: u64, parked: bool) {
        let l = &self.shared.stats.reactor.linger;
        if parked {
            l.parked.fetch_add(1, Ordering::Relaxed);
        }
        l.outcome(parked);
        // Only if still ours: after our budget another future may have taken it.
        let _ = l.until.compare_exchange(token, 0, Ordering::SeqCst, Ordering::Relaxed);
    }

    fn parking(&self) {
        // `BusyPoll`: a future that registers its waker needs the reactor thread's passes;
        // one standing by for callers that drive is told at once (a load when it is not).
        if self.drive.is_some() && self.shared.standing_by.load(Ordering::SeqCst) {
            self.shared.wake.notify();
        }
    }
}

/// Direct posting (`EngineBuilder::direct_post`): a submitter that finds the reactor
/// thread asleep runs a pass itself (`reactor/core/sleep.rs` shows the handshake).
struct Direct<D: Domain> {
    core: Arc<Mutex<Core<D>>>,
}

impl<D: Domain> DirectPost for Direct<D> {
    fn post_now(&self) -> Option<bool> {
        let Some(mut c) = try_core(&self.core) else { return Some(false) };
        if c.in_flight() > 0 {
            return None;
        }
        c.turn();
        // Shutdown seen in this pass: only the reactor thread may close the domains.
        Some(!c.closing && c.sleep_covers_posts())
    }

    fn watch_pass(&self, max: usize) -> Option<usize> {
        try_core(&self.core).map(|mut c| c.watch_pass(max))
    }

    fn wait_fds(&self) -> Vec<std::os::fd::RawFd> {
        lock(&self.core).wait_fds()
    }
}

/// Registrations on a caller's thread (`RegisterHere`).
struct Registrar<D: Domain> {
    core: Arc<Mutex<Core<D>>>,
}

impl<D: Domain> crate::sync::RegisterHere for Registrar<D> {
    fn register_now(
        &self,
        addr: u64,
        len: usize,
        location: crate::provider::MemoryLocation,
    ) -> Option<Result<Vec<crate::provider::Registration>>> {
        let mut c = try_core(&self.core)?;
        // Shut down, or asked to: refused as a queued registration is (the reactor thread
        // alone closes the domains).
        if c.shutting_down() {
            return Some(Err(Error::Shutdown));
        }
        Some(c.register(addr, len, location))
    }
}

/// A started reactor: its thread, for an `Inline` engine the callers' progress handle, and
/// the direct poster where every domain has a wait fd (kept alive here: `Shared` holds it
/// weakly; [`Engine::completion_wakeups`](crate::Engine::completion_wakeups) uses it too).
pub(crate) struct Started {
    pub(crate) thread: JoinHandle<()>,
    pub(crate) driver: Option<Driver>,
    /// `Inline`: operations posted on the submitting thread (`EngineBuilder::direct_post`).
    pub(crate) submitter: Option<Arc<dyn SubmitHere>>,
    pub(crate) direct: Option<Arc<dyn DirectPost>>,
    /// Registrations on callers' threads.
    pub(crate) registrar: Arc<dyn crate::sync::RegisterHere>,
}

/// Opens the message pools, then moves the domains to a new reactor thread.
pub(crate) fn spawn<D: Domain>(domains: Vec<D>, shared: Arc<Shared>, cfg: ReactorConfig) -> Result<Started> {
    let core = Arc::new(Mutex::new(Core::open(domains, shared.clone(), cfg.clone())?));
    let mut submitter: Option<Arc<dyn SubmitHere>> = None;
    let driver = if cfg.mode == ReactorMode::Inline {
        let direct = cfg.direct_post;
        let inline =
            Arc::new(Inline { core: core.clone(), shared: shared.clone(), spin: cfg.inline_spin, direct });
        submitter = Some(inline.clone());
        Some(inline as Driver)
    } else if !cfg.await_spin.is_zero() {
        Some(Arc::new(AwaitSpin { core: core.clone(), shared: shared.clone(), spin: cfg.await_spin })
            as Driver)
    } else if cfg.mode == ReactorMode::BusyPoll || !cfg.await_linger.is_zero() {
        let drive = (cfg.mode == ReactorMode::BusyPoll).then(|| core.clone());
        Some(Arc::new(Lingering { shared: shared.clone(), budget: cfg.await_linger, drive }) as Driver)
    } else {
        None
    };
    // A pass on a caller's thread needs every domain to wake a sleeping reactor by itself.
    let direct = (!lock(&core).has_fdless_domain()).then(|| {
        let d = Arc::new(Direct { core: core.clone() }) as Arc<dyn DirectPost>;
        if cfg.direct_post {
            let _ = shared.direct.set(Arc::downgrade(&d));
        }
        d
    });
    let registrar = Arc::new(Registrar { core: core.clone() }) as Arc<dyn crate::sync::RegisterHere>;
    let thread = std::thread::Builder::new()
        .name("fabric-reactor".into())
        .spawn(move || run(core, shared, cfg))
        .map_err(|e| Error::Provider {
            call: "spawn reactor thread",
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        })?;
    Ok(Started { thread, driver, submitter, direct, registrar })
}

/// What the reactor thread does after a pass that found nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idle {
    /// Pass again at once (`BusyPoll`; `Adaptive`'s window).
    Spin,
    /// Pass again after yielding the core: the window after activity
    /// (`EngineBuilder::poll_window`, at least 1 ms where a domain has no wait fd, shm or
    /// EFA, which would otherwise be put on a timer), so a transfer in progress is not paced
    /// by sleeps, and any time a future lingers (`await_linger`). Yielding lets
    /// a caller waiting to run (the task that submits the next operation) go first,
    /// instead of waiting for the end of a timeslice.
    Yield,
    /// Sleep as `ReactorMode::Event` does (`Core::prepare_sleep`).
    Sleep,
}

/// The windows after the last activity in which an idle reactor thread does not sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Windows {
    /// `BusyPoll`: never sleeps nor yields.
    always_spin: bool,
    /// `Adaptive`'s spin.
    spin: Duration,
    /// Polling with yields: `EngineBuilder::poll_window`, and at least [`EVENT_NO_FD_SPIN`]
    /// where a domain has no wait fd.
    poll: Duration,
}

impl Windows {
    fn of(mode: ReactorMode, fdless: bool, poll_window: Duration) -> Windows {
        let spin = match mode {
            ReactorMode::Adaptive { spin } => spin,
            _ => Duration::ZERO,
        };
        let always_spin = mode == ReactorMode::BusyPoll;
        let poll = match (always_spin, fdless) {
            (true, _) => Duration::ZERO,
            (false, true) => poll_window.max(EVENT_NO_FD_SPIN),
            (false, false) => poll_window,
        };
        Windows { always_spin, spin, poll }
    }

    /// Whether the time of the last activity matters (it is read on every busy pass).
    fn track_activity(&self) -> bool {
        !self.spin.is_zero() || !self.poll.is_zero()
    }

    /// What to do `since` the last activity (`Duration::MAX` when not tracked); `lingering`
    /// says whether a future waits for a result (`await_linger`), asked only where the
    /// answer matters (never on a spinning pass).
    fn idle(&self, since: Duration, lingering: impl FnOnce() -> bool) -> Idle {
        if self.always_spin || since < self.spin {
            Idle::Spin
        } else if since < self.poll || lingering() {
            Idle::Yield
        } else {
            Idle::Sleep
        }
    }
}

/// The reactor thread's loop: passes, and waiting between them as the mode says.
fn run<D: Domain>(core: Arc<Mutex<Core<D>>>, shared: Arc<Shared>, cfg: ReactorConfig) {
    if let Some(c) = cfg.pin_core {
        if let Err(e) = sys::pin_to_core(c) {
            tracing::warn!(core = c, error = %e, "could not pin the fabric reactor thread");
        }
    }
    let mut last_activity = Instant::now();
    let mut idle_interval = Duration::from_micros(50);
    let windows = Windows::of(cfg.mode, lock(&core).has_fdless_domain(), cfg.poll_window);
    let spins = windows.track_activity();
    // Callers may run passes (`Inline`, `await_spin`, `BusyPoll`'s spinning callers): stand
    // by while they do, for this long at a time.
    let standby = if cfg.mode == ReactorMode::Inline || !cfg.await_spin.is_zero() {
        Some(INLINE_STANDBY)
    } else if cfg.mode == ReactorMode::BusyPoll {
        Some(BUSY_STANDBY)
    } else {
        None
    };
    if standby == Some(BUSY_STANDBY) {
        // Its standby is a 20 µs timed sleep: with Linux's default 50 µs timer slack it could
        // last 70 µs. The thread spins when it is not standing by, so precise wake-ups cost
        // nothing it did not spend already.
        if let Err(e) = sys::set_timer_slack(BUSY_TIMER_SLACK_NS) {
            tracing::debug!(error = %e, "could not set the BusyPoll reactor thread's timer slack");
        }
    }
    let mut seen_polls = shared.inline_polls.load(Ordering::Relaxed);
    loop {
        if let Some(standby) = standby {
            // Callers drove the NICs since we last looked: stand by, untouched.
            let polls = shared.inline_polls.load(Ordering::Relaxed);
            if polls != seen_polls && !shared.closing() {
                seen_polls = polls;
                // On the eventfd: a caller that parks (`Progress::parking`) ends it.
                let mut fd = [libc::pollfd { fd: shared.wake.raw(), events: libc::POLLIN, revents: 0 }];
                shared.standing_by.store(true, Ordering::SeqCst);
                if let Ok(n) = sys::wait(&mut fd, Some(standby)) {
                    if n > 0 {
                        shared.wake.drain();
                    }
                }
                shared.standing_by.store(false, Ordering::SeqCst);
                continue;
            }
        }
        let mut c = lock(&core);
        let busy = c.turn();
        if c.closing {
            c.close();
            return;
        }
        if busy {
            idle_interval = Duration::from_micros(50);
            if spins {
                last_activity = Instant::now();
            }
            continue;
        }
        let since = if spins { last_activity.elapsed() } else { Duration::MAX };
        // CUDA copies wake nobody: while they are in flight (and one started or ended
        // lately) the reactor polls, as it does for a lingering future.
        match windows.idle(since, || c.copies_fresh() || shared.stats.reactor.lingering()) {
            Idle::Spin => {
                drop(c);
                std::hint::spin_loop();
            }
            Idle::Yield => {
                drop(c);
                std::thread::yield_now();
            }
            Idle::Sleep => {
                let Ok(timeout) = c.prepare_sleep(idle_interval) else { continue };
                let mut fds = std::mem::take(&mut c.pollfds);
                // Never across the sleep: an inline caller may drive meanwhile (it finds the
                // domains armed; at worst we wake once for nothing).
                drop(c);
                if let Err(e) = sys::wait(&mut fds, timeout) {
                    tracing::error!(error = %e, "ppoll failed");
                }
                lock(&core).after_sleep(fds);
                idle_interval = (idle_interval * 2).min(cfg.idle_poll_interval);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn adaptive_never_sleeps_sooner_than_event() {
        let us = Duration::from_micros;
        let adaptive = ReactorMode::Adaptive { spin: us(50) };
        // No wait fd (shm): Adaptive spins, then polls like Event until Event would sleep.
        let w = Windows::of(adaptive, true, Duration::ZERO);
        assert!(w.track_activity());
        assert_eq!(w.idle(us(10), || false), Idle::Spin);
        assert_eq!(w.idle(us(100), || false), Idle::Yield);
        assert_eq!(w.idle(2 * MS, || false), Idle::Sleep);
        let e = Windows::of(ReactorMode::Event, true, Duration::ZERO);
        for t in [us(0), us(10), us(100), us(999)] {
            assert_eq!(e.idle(t, || false), Idle::Yield, "{t:?}");
            assert_ne!(w.idle(t, || false), Idle::Sleep, "{t:?}");
        }
        assert_eq!(e.idle(2 * MS, || false), Idle::Sleep);
        // A spin longer than Event's window: spinning all along.
        let long = ReactorMode::Adaptive { spin: 5 * MS };
        assert_eq!(Windows::of(long, true, Duration::ZERO).idle(2 * MS, || false), Idle::Spin);
        assert_eq!(Windows::of(long, true, Duration::ZERO).idle(6 * MS, || false), Idle::Sleep);
    }

    #[test]
    fn with_a_wait_fd_only_adaptive_waits_before_sleeping() {
        let us = Duration::from_micros;
        for mode in [ReactorMode::Event, ReactorMode::Inline] {
            let w = Windows::of(mode, false, Duration::ZERO);
            assert!(!w.track_activity());
            assert_eq!(w.idle(Duration::MAX, || false), Idle::Sleep);
        }
        let adaptive = ReactorMode::Adaptive { spin: us(50) };
        let w = Windows::of(adaptive, false, Duration::ZERO);
        assert_eq!(w.idle(us(10), || false), Idle::Spin);
        assert_eq!(w.idle(us(100), || false), Idle::Sleep);
        for fdless in [false, true] {
            let b = Windows::of(ReactorMode::BusyPoll, fdless, Duration::ZERO);
            assert_eq!(b.idle(Duration::MAX, || false), Idle::Spin);
            assert_eq!(b.idle(Duration::MAX, || true), Idle::Spin);
        }
    }

    #[test]
    fn the_poll_window_keeps_polling_after_activity_then_sleeps() {
        let us = Duration::from_micros;
        let window = us(50);
        for mode in [ReactorMode::Event, ReactorMode::Inline] {
            let w = Windows::of(mode, false, window);
            assert!(w.track_activity());
            assert_eq!(w.idle(us(0), || false), Idle::Yield);
            assert_eq!(w.idle(us(49), || false), Idle::Yield);
            assert_eq!(w.idle(us(51), || false), Idle::Sleep);
            assert_eq!(w.idle(us(51), || true), Idle::Yield, "a lingering future still counts");
        }
        // Without a wait fd the 1 ms window stays the floor; a longer window wins.
        let e = Windows::of(ReactorMode::Event, true, window);
        assert_eq!(e.idle(us(999), || false), Idle::Yield);
        assert_eq!(e.idle(2 * MS, || false), Idle::Sleep);
        let e = Windows::of(ReactorMode::Event, true, 5 * MS);
        assert_eq!(e.idle(2 * MS, || false), Idle::Yield);
        assert_eq!(e.idle(6 * MS, || false), Idle::Sleep);
        // Adaptive spins first, then polls for the window, then sleeps.
        let a = Windows::of(ReactorMode::Adaptive { spin: us(50) }, false, us(200));
        assert_eq!(a.idle(us(10), || false), Idle::Spin);
        assert_eq!(a.idle(us(100), || false), Idle::Yield);
        assert_eq!(a.idle(us(300), || false), Idle::Sleep);
        // BusyPoll never stops spinning.
        let b = Windows::of(ReactorMode::BusyPoll, false, window);
        assert_eq!(b.idle(Duration::MAX, || false), Idle::Spin);
    }

    #[test]
    fn a_lingering_future_keeps_the_reactor_from_sleeping() {
        let us = Duration::from_micros;
        for fdless in [false, true] {
            let e = Windows::of(ReactorMode::Event, fdless, Duration::ZERO);
            assert_eq!(e.idle(Duration::MAX, || true), Idle::Yield, "fdless {fdless}");
            assert_eq!(e.idle(Duration::MAX, || false), Idle::Sleep, "fdless {fdless}");
            let a = Windows::of(ReactorMode::Adaptive { spin: us(50) }, fdless, Duration::ZERO);
            // Adaptive's own spin still comes first; after it, polling, not sleeping.
            assert_eq!(a.idle(us(10), || true), Idle::Spin);
            assert_eq!(a.idle(Duration::MAX, || true), Idle::Yield);
        }
    }
}
