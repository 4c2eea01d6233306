//! The one place atomics and locks are imported from, so that `--cfg loom` swaps in loom's
//! model-checked versions (`counter/loom_tests.rs`).

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

/// Moves an engine's NIC work forward from the calling thread (`ReactorMode::Inline`,
/// `await_spin`, and the spinning callers of a `BusyPoll` engine): what the futures and the
/// spin paths of such an engine call instead of waiting for the reactor thread. Defined
/// here, beside the atomics, because the loom-checked counter names it too.
pub(crate) trait Progress: Send + Sync {
    /// One pass of the reactor's loop on the caller's thread: post what is queued, poll
    /// every completion queue, complete futures and counters. Never blocks: returns false
    /// at once when another thread is driving the NICs (that thread makes the progress).
    fn progress(&self) -> bool;

    /// How long a pending future spins (running passes) inside one `poll` before it hands
    /// its thread back to the executor (`EngineBuilder::inline_spin`).
    fn spin_budget(&self) -> std::time::Duration;

    /// Whether a future still pending after its spin asks to be polled again at once
    /// (`Inline`: the caller keeps driving) rather than waiting for the reactor thread to
    /// wake it (`EngineBuilder::await_spin`).
    fn repolls(&self) -> bool {
        true
    }

    /// A future that does not repoll gave up its spin and parks: whoever must now run the
    /// passes that complete it (the reactor thread, standing by) is told at once.
    fn parking(&self) {}

    /// `EngineBuilder::await_linger`: how long a pending future of this engine keeps
    /// looking for its result before it registers its waker and parks. `None` for drivers
    /// that run passes (`Inline`, `await_spin`): their futures spin as [`inline_poll`] says.
    fn linger(&self) -> Option<std::time::Duration> {
        None
    }

    /// A future asks to linger for `budget`. One future of an engine lingers at a time:
    /// `None` when another does (this one then waits as without lingering), else the token
    /// to end it with. While one lingers, the reactor thread polls instead of sleeping, so
    /// that the result is seen as soon as it lands; it stops when the budget ends whether or
    /// not the future is polled again.
    fn linger_begin(&self, _budget: std::time::Duration) -> Option<u64> {
        None
    }

    /// Whether [`Self::progress`] runs passes while futures linger (`BusyPoll`).
    fn drives(&self) -> bool {
        false
    }

    /// Whether no future lingers now (a load; the answer may change at once).
    fn linger_free(&self) -> bool {
        true
    }

    /// The lingering future that holds `token` stops: its result came, it spent its budget
    /// and parks (`parked`), or it was dropped.
    fn linger_end(&self, _token: u64, _parked: bool) {}
}

/// Posts a submission on the caller's thread while an `Event`-mode reactor thread sleeps
/// (`EngineBuilder::direct_post`), instead of waking that thread to post it.
pub(crate) trait DirectPost: Send + Sync {
    /// Runs one pass of the reactor here if no other thread is in one and nothing is in
    /// flight. `Some(true)`: the queued work was handled and the sleeping reactor thread
    /// need not be woken; `Some(false)`: the caller must wake it (the core was busy, or what
    /// was posted needs a timed pass sooner than the sleep ends); `None`: operations are in
    /// flight, so the reactor thread, which their completions wake anyway, posts this one
    /// too (a stream of writes then has one thread in the NIC, not two taking turns on the
    /// core's lock: on tcp that cost 5-20% of a window's bandwidth at 64 KiB-1 MiB).
    fn post_now(&self) -> Option<bool>;

    /// A watcher's turn after a wait fd woke it (`Core::watch_pass`): `None` if another
    /// thread is in a pass, else the number of passes run (at most `max`).
    fn watch_pass(&self, max: usize) -> Option<usize>;

    /// Every domain's completion wait fd (each domain has one, or there is no poster).
    fn wait_fds(&self) -> Vec<std::os::fd::RawFd>;
}

/// Registers memory on the caller's thread when no other thread is in a pass of the reactor
/// (`Engine::register_raw`), instead of handing the registration to the reactor thread and
/// waiting for its answer.
#[cfg(not(loom))]
pub(crate) trait RegisterHere: Send + Sync {
    /// `None` if another thread is in a pass (then the reactor thread takes it); else the
    /// registrations of `len` bytes at `addr` with every domain, or why not.
    fn register_now(
        &self,
        addr: u64,
        len: usize,
        location: crate::provider::MemoryLocation,
    ) -> Option<crate::error::Result<Vec<crate::provider::Registration>>>;
}

/// The `poll` of an inline future. `peek` looks for the result without registering the
/// waker; `register` is the future's ordinary poll (which does). Passes of the reactor run on
/// this thread, with a `peek` after each, for up to the driver's spin budget; only then is
/// the waker registered (so an arrival inside the budget wakes nobody: no executor wake-up,
/// which for a `block_on` future is a syscall), and a future still pending asks to be polled
/// again at once (`wake_by_ref`, as `tokio::task::yield_now` does) instead of waiting.
pub(crate) fn inline_poll<T>(
    driver: &Driver,
    cx: &mut std::task::Context<'_>,
    mut peek: impl FnMut() -> Option<T>,
    register: impl FnOnce(&mut std::task::Context<'_>) -> std::task::Poll<T>,
) -> std::task::Poll<T> {
    use std::task::Poll;
    if let Some(r) = peek() {
        return Poll::Ready(r);
    }
    // The clock is first read after 16 passes (then every 16): most waits of a latency-
    // critical loop end sooner, and each read costs ~20 ns on their path.
    let mut start = None;
    let mut passes = 0u32;
    loop {
        driver.progress();
        if let Some(r) = peek() {
            return Poll::Ready(r);
        }
        passes = passes.wrapping_add(1);
        if passes.is_multiple_of(16) {
            let now = std::time::Instant::now();
            let since = *start.get_or_insert(now);
            if now.duration_since(since) >= driver.spin_budget() {
                break;
            }
        }
        std::hint::spin_loop();
    }
    match register(cx) {
        Poll::Ready(r) => Poll::Ready(r),
        Poll::Pending => {
            if driver.repolls() {
                cx.waker().wake_by_ref();
            } else {
                driver.parking();
            }
            Poll::Pending
        }
    }
}

/// A handle to an inline engine's progress, cloned into its futures and counters.
pub(crate) type Driver = std::sync::Arc<dyn Progress>;

/// Where one pending future stands in its lingering (`EngineBuilder::await_linger`; see
/// [`linger_poll`]). Dropping it mid-linger tells the driver that it stopped.
#[derive(Default)]
pub(crate) struct Linger {
    /// When the future began to linger.
    since: Option<std::time::Instant>,
    /// The driver it lingers on and its token, until it stops.
    counted: Option<(Driver, u64)>,
    /// It does not linger (any more): an ordinary future from now on.
    parked: bool,
    /// It never lingers (its result comes after device work: CUDA copies), as with a
    /// budget of 0.
    pub(crate) never: bool,
}

impl Linger {
    fn stop(&mut self, parked: bool) {
        if let Some((d, token)) = self.counted.take() {
            d.linger_end(token, parked);
        }
    }

    /// Lingering does not apply to this wait (it cannot be satisfied by a peek): the future
    /// registers its waker at once, as without lingering.
    pub(crate) fn skip(&mut self) {
        self.stop(false);
        self.parked = true;
    }
}

impl Drop for Linger {
    fn drop(&mut self) {
        self.stop(false);
    }
}

/// A lingering future stops looking and registers its waker; still pending, it tells the
/// driver (a `BusyPoll` reactor thread standing by must take over its passes).
fn park<T>(
    driver: &Driver,
    cx: &mut std::task::Context<'_>,
    register: impl FnOnce(&mut std::task::Context<'_>) -> std::task::Poll<T>,
) -> std::task::Poll<T> {
    let r = register(cx);
    if r.is_pending() {
        driver.parking();
    }
    r
}

/// Passes a pending future of a `BusyPoll` engine runs before it takes the engine's lingering
/// slot. Chosen, not tuned: the slot's bookkeeping is what the pre-spin saves, and a wait
/// that outlasts the pre-spin pays it as before.
const PRESPIN_PASSES: u32 = 32;

/// How long one `poll` of a lingering future may spin before it hands its thread back to
/// the executor (as `Inline`'s default `inline_spin`).
pub(crate) const LINGER_SLICE: std::time::Duration = std::time::Duration::from_micros(20);

/// The `poll` of a future whose engine lingers (`EngineBuilder::await_linger`): `peek` looks
/// for the result without registering the waker; `register` is the future's ordinary poll.
///
/// The first future of an engine to find itself pending becomes its lingerer (one at a
/// time; the others wait as usual, so that a `join_all` of many futures never spins for
/// each). Each `poll` of the lingerer spins, peeking, for up to [`LINGER_SLICE`], then asks
/// to be polled again (`wake_by_ref`) so that the executor runs its other tasks in between;
/// the reactor thread keeps driving the NICs and does not sleep meanwhile. The result is
/// seen within a peek of its landing, with no OS wake-up of either thread on its path. Once
/// the budget (from its first pending poll) is spent, the future registers its waker and
/// parks like any other.
///
/// On a `BusyPoll` engine the lingerer also runs the engine's passes between its peeks
/// ([`Progress::progress`]), as the synchronous spin paths do there: the result is then
/// found on this thread, not handed over from the reactor thread's core (which stands by
/// while callers drive).
pub(crate) fn linger_poll<T>(
    driver: &Driver,
    budget: std::time::Duration,
    st: &mut Linger,
    cx: &mut std::task::Context<'_>,
    mut peek: impl FnMut() -> Option<T>,
    register: impl FnOnce(&mut std::task::Context<'_>) -> std::task::Poll<T>,
) -> std::task::Poll<T> {
    use std::task::Poll;
    use std::time::Instant;
    if st.parked {
        return register(cx);
    }
    // A budget of zero (a `BusyPoll` engine's driver without lingering), or a wait for device
    // work on an engine whose lingering futures only look (a `BusyPoll` one's drive the
    // NICs and the copies' events: they keep lingering): park at once.
    if budget.is_zero() || (st.never && !driver.drives()) {
        st.parked = true;
        return park(driver, cx, register);
    }
    if let Some(r) = peek() {
        st.stop(false);
        return Poll::Ready(r);
    }
    if st.counted.is_none() && driver.drives() && driver.linger_free() {
        // `BusyPoll`: a few passes first, without the slot's bookkeeping (two clock reads and
        // a handful of atomics; about 0.2 µs per wait in `rtt`'s futures row on shm): the
        // waits of a short hop end here. Only while no other future lingers, so that a
        // `join_all` of many does not spin for each.
        for _ in 0..PRESPIN_PASSES {
            driver.progress();
            if let Some(r) = peek() {
                return Poll::Ready(r);
            }
            std::hint::spin_loop();
        }
    }
    let mut now = Instant::now();
    if st.counted.is_none() {
        let Some(token) = driver.linger_begin(budget) else {
            st.skip();
            return park(driver, cx, register);
        };
        st.counted = Some((driver.clone(), token));
        st.since = Some(now);
    }
    let end = st.since.unwrap_or(now) + budget;
    let slice_end = (now + LINGER_SLICE).min(end);
    // The clock is read every 16 peeks (~20 ns each read).
    let mut spins = 0u32;
    while now < slice_end {
        // `BusyPoll`: a pass here, if no other thread is in one (else, and in the other
        // modes, nothing: the reactor thread's pass lands the result).
        if !driver.progress() {
            std::hint::spin_loop();
        }
        if let Some(r) = peek() {
            st.stop(false);
            return Poll::Ready(r);
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(16) {
            now = Instant::now();
        }
    }
    if now >= end {
        st.stop(true);
        st.parked = true;
        return park(driver, cx, register);
    }
    cx.waker().wake_by_ref();
    Poll::Pending
}
