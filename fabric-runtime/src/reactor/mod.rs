//! The reactor: owns every domain (NIC) of one engine, posts what callers submit, polls
//! completion queues, and wakes the futures and counters waiting on them.
//!
//! `core.rs` holds the state and one pass of the loop ([`core::Core::turn`]): take the
//! submission queue (swapping buffers, so no allocation in steady state) → post (a full send
//! queue leaves the rest in a backlog, in order) → poll every domain → complete futures,
//! count immediates, deliver messages. This file runs passes on the reactor thread and
//! decides how to wait when a pass found nothing to do: `BusyPoll` spins, `Adaptive` spins
//! until its window since the last activity has passed, `Event` sleeps in `ppoll` on the
//! eventfd and each domain's wait fd, after `arm`ing every domain (so a completion racing the
//! decision to sleep is never missed). A domain with no wait fd turns that sleep into a
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
use crate::shared::queue::Submission;
use crate::shared::Shared;
use crate::sync::{lock, DirectPost, Driver, Progress};
use crate::sys;

/// How the reactor thread waits for work. Chosen when the engine is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReactorMode {
    /// Sleep on the completion queue's wait fd and the submission eventfd when idle: about
    /// zero CPU while nothing happens; a wake-up costs a few microseconds. On providers with
    /// no wait fd (libfabric `shm`, EFA) the reactor cannot sleep on the NIC: for 1 ms after
    /// the last activity it keeps polling (so a transfer in progress, whose target side must
    /// poll for it to progress, is not paced by timer sleeps), then polls at an interval that
    /// backs off from 50 µs to `EngineBuilder::idle_poll_interval` (1 ms by default), so an
    /// arrival on an idle engine is seen within that interval.
    ///
    /// An operation started while the reactor sleeps is posted on the starting thread
    /// (`EngineBuilder::direct_post`) rather than by waking the reactor, on providers with a
    /// wait fd. `fabric_async::CompletionWatch` lets the awaiting runtime's own thread wake on
    /// completions too (one OS wake-up fewer per completion; `docs/latency.md`).
    #[default]
    Event,
    /// Spin for `spin` after the last activity, then behave like `Event`.
    Adaptive {
        /// How long to keep spinning after the last completion or submission.
        spin: Duration,
    },
    /// Spin continuously (one core at 100%): completions are seen at once, but an awaiting
    /// task whose executor thread parked still pays an OS wake-up (~10 µs); see `Inline`.
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
    /// Post on the submitter's thread while the reactor thread sleeps.
    pub(crate) direct_post: bool,
    /// `EngineBuilder::time_reactor`: time the backends' post and poll calls.
    pub(crate) time_calls: bool,
}

/// How long the reactor thread of an `Inline` engine sleeps while callers drive the NICs,
/// before it looks again whether they still do.
const INLINE_STANDBY: Duration = Duration::from_micros(200);

/// A pass on a caller's thread (`Inline`, `AwaitSpin`), after telling the reactor thread
/// that a caller drives (it stands by). The counter is bumped with a load and a store, not
/// a read-modify-write: callers racing here may lose an increment, but the value still
/// changes, which is all the reactor thread looks at.
fn caller_pass<D: Domain>(core: &Mutex<Core<D>>, shared: &Shared) -> bool {
    let polls = &shared.inline_polls;
    polls.store(polls.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    try_core(core).is_some_and(|mut c| c.turn())
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

/// Direct posting (`EngineBuilder::direct_post`): a submitter that finds the reactor
/// thread asleep runs a pass itself (`reactor/sleep.rs` shows the handshake).
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

/// A started reactor: its thread, for an `Inline` engine the callers' progress handle, and
/// the direct poster where every domain has a wait fd (kept alive here: `Shared` holds it
/// weakly; [`Engine::completion_wakeups`](crate::Engine::completion_wakeups) uses it too).
pub(crate) struct Started {
    pub(crate) thread: JoinHandle<()>,
    pub(crate) driver: Option<Driver>,
    pub(crate) direct: Option<Arc<dyn DirectPost>>,
}

/// Opens the message pools, then moves the domains to a new reactor thread.
pub(crate) fn spawn<D: Domain>(domains: Vec<D>, shared: Arc<Shared>, cfg: ReactorConfig) -> Result<Started> {
    let core = Arc::new(Mutex::new(Core::open(domains, shared.clone(), cfg.clone())?));
    let driver = if cfg.mode == ReactorMode::Inline {
        let direct = cfg.direct_post;
        Some(Arc::new(Inline { core: core.clone(), shared: shared.clone(), spin: cfg.inline_spin, direct })
            as Driver)
    } else if !cfg.await_spin.is_zero() {
        Some(Arc::new(AwaitSpin { core: core.clone(), shared: shared.clone(), spin: cfg.await_spin })
            as Driver)
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
    let thread = std::thread::Builder::new()
        .name("fabric-reactor".into())
        .spawn(move || run(core, shared, cfg))
        .map_err(|e| Error::Provider {
            call: "spawn reactor thread",
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        })?;
    Ok(Started { thread, driver, direct })
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
    // How long to keep polling after the last activity before sleeping: Adaptive's window;
    // in Event (and Inline) mode, only when a domain has no wait fd (shm, EFA), which is
    // otherwise polled on a timer, so a transfer in progress is not paced by timer sleeps.
    let spin_after_activity = match cfg.mode {
        ReactorMode::Adaptive { spin } => spin,
        ReactorMode::Event | ReactorMode::Inline if lock(&core).has_fdless_domain() => EVENT_NO_FD_SPIN,
        _ => Duration::ZERO,
    };
    let spins = !spin_after_activity.is_zero();
    // Callers may run passes (`Inline`, `await_spin`): stand by while they do.
    let inline = cfg.mode == ReactorMode::Inline || !cfg.await_spin.is_zero();
    let mut seen_polls = shared.inline_polls.load(Ordering::Relaxed);
    loop {
        if inline {
            // Callers drove the NICs since we last looked: stand by, untouched.
            let polls = shared.inline_polls.load(Ordering::Relaxed);
            if polls != seen_polls && !shared.closing() {
                seen_polls = polls;
                // On the eventfd: a caller that parks (`AwaitSpin::parking`) ends it.
                let mut fd = [libc::pollfd { fd: shared.wake.raw(), events: libc::POLLIN, revents: 0 }];
                if let Ok(n) = sys::wait(&mut fd, Some(INLINE_STANDBY)) {
                    if n > 0 {
                        shared.wake.drain();
                    }
                }
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
        let in_window = spins && last_activity.elapsed() < spin_after_activity;
        match cfg.mode {
            ReactorMode::BusyPoll => {
                drop(c);
                std::hint::spin_loop();
            }
            // Event mode's window on a domain without a wait fd polls, but yields the core
            // on every empty pass: a caller waiting to run (the task that will submit the
            // next operation) goes first, instead of waiting for the end of a timeslice.
            ReactorMode::Event | ReactorMode::Inline if in_window => {
                drop(c);
                std::thread::yield_now();
            }
            _ if in_window => {
                drop(c);
                std::hint::spin_loop();
            }
            _ => {
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
