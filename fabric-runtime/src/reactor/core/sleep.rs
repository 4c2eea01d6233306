//! How an `Event`-mode reactor goes to sleep and wakes up, and what a caller that posted
//! directly while it slept must check (`reactor/mod.rs`, `Direct`).
//!
//! ```text
//!  reactor thread:  pass found nothing ─► prepare_sleep: arm every domain, timeout,
//!                   queue.sleeping = true ─► ppoll(eventfd, wait fds) ─► after_sleep
//!  a submitter meanwhile:  push ─► sleeping? ─► try_lock the core ─► one pass here
//!                          (posted at once; no wake-up of the reactor on the path)
//!                          ─► does the sleep still cover what is now in flight? if not,
//!                          or the core was busy: write the eventfd, as before
//! ```
//!
//! A child module of `core`, so it works on [`Core`]'s fields.

use std::time::{Duration, Instant};

use super::{Core, DEADLINE_TICK};
use crate::provider::Domain;
use crate::shared::queue::QueueState;
use crate::sync::lock;

/// The longest a sleeping reactor may leave an operation's deadline unchecked: a sleep with
/// nothing in flight still ends within this, so an operation posted directly during it is
/// failed at most this late (an eighth of `op_timeout`, between 100 ms and 1 s; 1 s at the
/// default 30 s). One wake-up a second costs nothing measurable on an idle engine.
fn deadline_slack(op_timeout: Duration) -> Duration {
    (op_timeout / 8).clamp(DEADLINE_TICK, Duration::from_secs(1))
}

/// How soon a reactor thread whose wait fds a watcher (`CompletionWakeups`) sleeps on runs
/// a pass anyway, the fallback for a watcher whose runtime is not running: 20 ms after
/// activity, doubling on every sleep that follows an idle pass up to 1 s, so an idle
/// engine wakes about once a second.
pub(super) const WATCH_FALLBACK: Duration = Duration::from_millis(20);
const WATCH_FALLBACK_MAX: Duration = Duration::from_secs(1);

/// How far past a backend timer's due instant the sleep may end and still cover it
/// (`sleep_covers_posts`). A timer is the time left until an instant (verbs' keep-alive), read
/// from the clock anew by each caller: the sleep was prepared with one reading and the check
/// takes another, so the very timer the sleep ends at seemed due microseconds before it
/// (tens to hundreds on verbs in the rxe VM, where 393 of 400 direct posts were then followed
/// by a needless wake-up of the reactor). A timer that a post starts (a handshake's 100 ms
/// retry) falls due long before a sleep of up to a second ends, which this does not hide.
const TIMER_SLACK: Duration = Duration::from_millis(1);

/// Whether a sleep that ends at `armed_until` (`None`: never) serves a backend timer that
/// read `t` at `now`: it ends no later than the timer falls due, give or take `TIMER_SLACK`.
fn ends_in_time(armed_until: Option<Instant>, now: Instant, t: Duration) -> bool {
    armed_until.is_some_and(|at| at <= now + t + TIMER_SLACK)
}

fn min_timeout(cur: Option<Duration>, t: Duration) -> Option<Duration> {
    Some(cur.map_or(t, |c| c.min(t)))
}

impl<D: Domain> Core<D> {
    /// Before an `Event`-mode sleep: arms every domain and fills `pollfds` (the eventfd,
    /// then each domain's wait fd) and returns the timeout (`None`: none), or returns
    /// `Err(())` when the reactor must not sleep (completions pending, submissions queued,
    /// shutdown). On `Ok`, the queue says the reactor sleeps: submitters post directly or
    /// write the eventfd.
    #[allow(clippy::result_unit_err)]
    pub(crate) fn prepare_sleep(
        &mut self,
        idle_interval: Duration,
    ) -> std::result::Result<Option<Duration>, ()> {
        // Read before any timer: a backend timer is the time left until its due instant
        // (verbs' keep-alive), so a sleep's end counted from a later clock read lies past
        // that instant (see `TIMER_SLACK`).
        let start = Instant::now();
        let mut fds = std::mem::take(&mut self.pollfds);
        fds.clear();
        fds.push(libc::pollfd { fd: self.shared.wake.raw(), events: libc::POLLIN, revents: 0 });
        let mut timeout: Option<Duration> = None;
        // A watcher sleeps on the wait fds instead (and runs the passes, `watch_pass`): this
        // thread would only wake beside it and contend for the lock.
        let watched = self.shared.watchers.load(std::sync::atomic::Ordering::Acquire) > 0;
        for d in self.domains.iter_mut() {
            if let Some(t) = d.timer() {
                timeout = min_timeout(timeout, t);
            }
            match d.wait_fd() {
                Some(fd) => {
                    if !d.arm() {
                        self.pollfds = fds;
                        return Err(()); // completions pending: poll again
                    }
                    if watched {
                        timeout = min_timeout(timeout, self.watch_fallback);
                    } else {
                        fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                    }
                }
                None => timeout = min_timeout(timeout, idle_interval),
            }
        }
        self.pollfds = fds;
        if !self.reviving.is_empty() {
            // `add_peer` waits for a revival's outcome, which only a pass asks for.
            timeout = min_timeout(timeout, super::revive::REVIVAL_TICK);
        }
        if !self.vouching.is_empty() {
            // `remote_region` waits for an owner's answer, whose bound only a pass checks.
            timeout = min_timeout(timeout, DEADLINE_TICK);
        }
        if self.has_pending() {
            // Posts are waiting for queue space; completions will wake us, but stay safe
            // against a provider that frees space without one.
            timeout = min_timeout(timeout, Duration::from_micros(100));
        }
        #[cfg(feature = "cuda")]
        if self.staging.has_gates() {
            // CUDA events wake nobody: poll them soon (a long copy: the reactor polled
            // through `GATE_POLL_WINDOW` already).
            timeout = min_timeout(timeout, super::gpu::GATE_SLEEP);
        } else if self.cfg.op_timeout.is_some() && self.staging.awaits_acks() {
            // A peer that never ACKs must still time out.
            timeout = min_timeout(timeout, DEADLINE_TICK);
        }
        if let Some(limit) = self.cfg.op_timeout {
            // Wake up to check deadlines even if the peer never answers; with nothing in
            // flight, late enough to cost nothing, early enough for an operation that a
            // caller posts directly while we sleep.
            let t = if self.slab.is_empty() { deadline_slack(limit) } else { DEADLINE_TICK };
            timeout = min_timeout(timeout, t);
        }
        let mut q = lock(&self.shared.queue);
        // A future that began to linger (`await_linger`) after the pass: it looks at
        // `sleeping` under this lock after taking the lingering slot, so one of us sees
        // the other.
        let lingering = self.shared.stats.reactor.lingering();
        if !q.items.is_empty() || q.state != QueueState::Open || lingering {
            return Err(());
        }
        q.sleeping = true;
        drop(q);
        if watched {
            self.watch_fallback = (self.watch_fallback * 2).min(WATCH_FALLBACK_MAX);
        }
        let now = Instant::now();
        self.shared.stats.reactor.sleep_begins(now);
        self.slept_since = Some(now);
        // No later than the sleep's real end (`ppoll` starts its timeout after this).
        self.armed_until = timeout.map(|t| start + t);
        Ok(timeout)
    }

    /// After the sleep that [`Core::prepare_sleep`] prepared (`fds` is its `pollfds`, with
    /// `revents` set): the queue no longer says the reactor sleeps; the eventfd is drained and
    /// each domain that woke us acknowledged.
    pub(crate) fn after_sleep(&mut self, fds: Vec<libc::pollfd>) {
        lock(&self.shared.queue).sleeping = false;
        self.armed_until = None;
        if let Some(t) = self.slept_since.take() {
            self.shared.stats.reactor.sleep_ends(t, fds.iter().any(|f| f.revents != 0));
        }
        if fds[0].revents != 0 {
            self.shared.wake.drain();
        }
        let mut i = 1;
        for d in self.domains.iter_mut() {
            // Watched: the set held the eventfd only.
            if d.wait_fd().is_some() && i < fds.len() {
                if fds[i].revents != 0 {
                    d.ack_wakeup();
                }
                i += 1;
            }
        }
        self.pollfds = fds;
    }

    /// What a watcher (`CompletionWakeups`) runs when a wait fd woke it, in place of the
    /// reactor thread's wake-pass-sleep cycle, which leaves the wait fds to it
    /// (`prepare_sleep`): acknowledge each domain's wake-up (a verbs completion event), run
    /// passes until one finds nothing, then arm every domain so that the next completion
    /// wakes the watcher again (a domain with completions already waiting refuses to arm:
    /// another pass). At most `max` passes; returns how many ran.
    pub(crate) fn watch_pass(&mut self, max: usize) -> usize {
        // Non-blocking where nothing is pending (a verbs channel read that finds no event).
        for d in self.domains.iter_mut().filter(|d| d.wait_fd().is_some()) {
            d.ack_wakeup();
        }
        let mut n = 0;
        while n < max {
            n += 1;
            if self.turn() {
                continue;
            }
            if self.closing || self.domains.iter_mut().filter(|d| d.wait_fd().is_some()).all(|d| d.arm()) {
                break;
            }
        }
        n
    }

    /// After a caller's pass while the reactor thread sleeps (a direct post): whether that
    /// sleep, prepared before the caller's operations existed, still covers them. It does
    /// when their completions will wake it through the wait fds (every domain has one,
    /// which is when direct posting is on) and it ends in time to check their deadlines.
    /// It does not when a post is waiting for queue space, a CUDA copy is waiting for its
    /// event, or a backend timer runs that the sleep ends too late for (verbs: a handshake
    /// the post started; a timer the sleep was prepared with, tcp's liveness checks, is
    /// covered): those need a timed pass soon, so the caller wakes the reactor.
    pub(crate) fn sleep_covers_posts(&self) -> bool {
        if self.has_pending() {
            return false;
        }
        let now = Instant::now();
        if self.domains.iter().any(|d| d.timer().is_some_and(|t| !ends_in_time(self.armed_until, now, t))) {
            return false;
        }
        #[cfg(feature = "cuda")]
        if self.staging.active() {
            return false;
        }
        match self.cfg.op_timeout {
            Some(limit) if !self.slab.is_empty() || self.staging_waits() => {
                self.armed_until.is_some_and(|at| at <= now + deadline_slack(limit))
            }
            _ => true,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_sleep_serves_the_timer_it_was_armed_with() {
        let ms = Duration::from_millis;
        let start = Instant::now();
        // A timer of "time left until an instant" (verbs' keep-alive), due at `due`: the
        // sleep armed with it ends then. The check reads the clock (`now`), and the domain
        // reads it again a little later for its timer, so its reading is short of `due -
        // now`: without the slack the sleep seemed to end too late for its own timer.
        let due = start + ms(100);
        let now = start + Duration::from_micros(50);
        let t = due.duration_since(now + Duration::from_micros(20));
        assert!(ends_in_time(Some(due), now, t));
        // A timer due well before the sleep ends (a handshake's retry started by a post
        // into a sleep of a second) is not served: the reactor must be woken for it.
        assert!(!ends_in_time(Some(start + ms(1000)), now, ms(100)));
        // Past the slack, not served; within it, served.
        assert!(!ends_in_time(Some(start + ms(102)), start, ms(100)));
        assert!(ends_in_time(Some(start + ms(100) + TIMER_SLACK), start, ms(100)));
        // A sleep with no timeout serves no timer.
        assert!(!ends_in_time(None, start, ms(100)));
    }
}
