//! Hooks for `fabric-bench`'s criterion benches of the reactor's hot paths that need no
//! NIC, compiled only with the `bench-hooks` feature: the counter table (an immediate's counter found or created, as the reactor
//! dispatches `Completion::Imm`) and the wake path (a caller's submission, the
//! `has_items` / eventfd decision, the reactor taking the queue, and the completion that
//! wakes the parked future). Also [`HostMemory`], the raw loop's buffer, made as the engine
//! makes a region's. Not part of the API: hidden from the docs.
//!
//! [`BenchReactor`] holds a real `Shared` (queue, counter table, eventfd) and no reactor
//! thread: the bench plays the reactor. Caller-side steps are the engine's own functions
//! (`Shared::submit_all`, `Shared::counter_cell`); the reactor-side steps repeat, line for
//! line, what `reactor::Reactor` does (`complete`, `take_submissions`, `sleep`), minus the
//! domains.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::counter::{CounterCell, ImmCounter};
use crate::engine::OpFuture;
use crate::error::Result;
use crate::provider::RemoteSlice;
use crate::pure::descriptor::EngineAddress;
use crate::pure::route::TransferOpts;
use crate::pure::slab::Slab;
use crate::shared::notify::{Notify, OpState};
use crate::shared::queue::{OpKind, OpReq, QueueState, Submission};
use crate::shared::{PeerId, Shared};
use crate::sync::lock;
use crate::sys;

/// An engine's shared state with no NIC and no reactor thread; see the module docs.
pub struct BenchReactor {
    shared: Arc<Shared>,
    /// The reactor's own map of counters (`Reactor::counters`).
    counters: HashMap<u32, Arc<CounterCell>>,
    /// The reactor's spare submission buffer (`Reactor::items`).
    items: Vec<Submission>,
    slab: Slab<Notify>,
    tokens: Vec<u64>,
}

impl fmt::Debug for BenchReactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BenchReactor").field("in_flight", &self.slab.len()).finish()
    }
}

impl BenchReactor {
    /// The state `Engine::start` builds for one domain, without starting a reactor.
    pub fn new() -> Result<BenchReactor> {
        let address = EngineAddress { transport: "bench".into(), domains: vec![Vec::new()], incarnation: 1 };
        let shared = Arc::new(Shared::new("bench".into(), address, 0, 1, TransferOpts::default(), true)?);
        Ok(BenchReactor {
            shared,
            counters: HashMap::new(),
            items: Vec::with_capacity(1024),
            slab: Slab::default(),
            tokens: Vec::new(),
        })
    }

    // --- counter table ----------------------------------------------------------------

    /// The reactor's dispatch of `Completion::Imm { imm }` (`Reactor::complete`): its own
    /// map first; on the first arrival of `imm`, the engine's shared table (lock, find or
    /// create the cell, or refuse it when the table is full).
    pub fn dispatch_imm(&mut self, imm: u32) {
        if let Some(cell) = self.counters.get(&imm) {
            cell.arrive(1);
        } else if let Some(cell) = self.shared.arrival_cell(imm) {
            cell.arrive(1);
            self.counters.insert(imm, cell);
        }
    }

    /// `Engine::imm_counter(imm)`: the shared table's lookup (or creation) of the cell.
    pub fn imm_counter(&self, imm: u32) -> ImmCounter {
        ImmCounter::from_cell(self.shared.counter_cell(imm))
    }

    /// Empties both counter tables (so that the next dispatch creates the cells again).
    pub fn clear_counters(&mut self) {
        self.counters.clear();
        lock(&self.shared.counters).table.clear();
    }

    // --- wake path ----------------------------------------------------------------------

    /// The caller's side of `Engine::imm`: an imm-only write submitted with
    /// `Shared::submit_all` (queue lock, `has_items`, and an eventfd write if the reactor
    /// said it sleeps). The future completes at [`BenchReactor::complete_all`].
    pub fn submit_imm(&self, imm: u32) -> OpFuture {
        let state = Arc::new(OpState::default());
        let req = OpReq {
            domain: 0,
            peer: PeerId(0),
            kind: OpKind::Write,
            local_addr: 0,
            len: 0,
            remote: RemoteSlice { addr: 0, key: 0 },
            imm: Some(imm),
        };
        let s = Submission::Op { req, keep: None, notify: Notify::Future(state.clone()) };
        match self.shared.submit_all(vec![s]) {
            Ok(()) => OpFuture::pending(state),
            Err(_) => unreachable!("the bench queue is never closed"),
        }
    }

    /// The reactor's pass over the queue (`Reactor::run` + `take_submissions`): if
    /// `has_items`, swap the queue out under its lock and put each operation in the slab
    /// as if posted. Returns how many were taken.
    pub fn take_submissions(&mut self) -> usize {
        if !self.shared.has_items.load(Ordering::Acquire) {
            return 0;
        }
        {
            let mut q = lock(&self.shared.queue);
            self.shared.has_items.store(false, Ordering::Release);
            std::mem::swap(&mut q.items, &mut self.items);
        }
        let mut items = std::mem::take(&mut self.items);
        let n = items.len();
        for s in items.drain(..) {
            if let Submission::Op { notify, .. } = s {
                let token = self.slab.next_token();
                self.slab.insert(notify);
                self.tokens.push(token);
            }
        }
        self.items = items;
        n
    }

    /// Completes every operation taken, as their `Completion::Done` would: slab removal by
    /// token, then `Notify::complete` (which wakes a parked future). Returns how many.
    pub fn complete_all(&mut self) -> usize {
        let mut n = 0;
        for t in self.tokens.drain(..) {
            if let Some(notify) = self.slab.remove(t) {
                let next = notify.complete(Ok(()));
                debug_assert!(next.is_empty());
                n += 1;
            }
        }
        n
    }

    /// The reactor deciding to sleep (`Reactor::sleep` before `ppoll`): under the queue
    /// lock, if nothing is queued, mark itself sleeping, so that the next submission writes
    /// the eventfd. Returns false if it must not sleep.
    pub fn prepare_sleep(&self) -> bool {
        let mut q = lock(&self.shared.queue);
        if !q.items.is_empty() || q.state != QueueState::Open {
            return false;
        }
        q.sleeping = true;
        true
    }

    /// The reactor's `ppoll` on the eventfd, with a zero timeout, and what follows it
    /// (clear `sleeping`, drain the eventfd if it fired). Returns whether it fired.
    pub fn poll_wake(&self) -> bool {
        let mut fds = [libc::pollfd { fd: self.shared.wake.raw(), events: libc::POLLIN, revents: 0 }];
        let _ = sys::wait(&mut fds, Some(Duration::ZERO));
        lock(&self.shared.queue).sleeping = false;
        let fired = fds[0].revents != 0;
        if fired {
            self.shared.wake.drain();
        }
        fired
    }
}

/// Host memory made as the engine makes a region's ([`Engine::alloc`](crate::Engine::alloc)):
/// `fabric-bench`'s raw loop copies from and into the same kind of pages as the engine it
/// is compared with (`huge`: [`EngineBuilder::huge_pages`](crate::EngineBuilder::huge_pages)).
/// Filled with `fill`; freed (and its range reserved, as a region's) when dropped.
pub struct HostMemory(crate::shared::memory::Backing);

impl HostMemory {
    /// `len` bytes of `fill`.
    pub fn new(len: usize, huge: bool, fill: u8) -> Result<HostMemory> {
        let b = crate::shared::memory::Backing::host(len, huge)?;
        // SAFETY: a fresh mapping of `len` writable bytes that nothing else uses yet.
        unsafe { std::ptr::write_bytes(b.as_ptr(), fill, len) };
        Ok(HostMemory(b))
    }

    /// The first byte's address.
    pub fn addr(&self) -> u64 {
        self.0.addr()
    }
}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMemory").field("addr", &self.addr()).field("len", &self.0.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll};

    #[test]
    fn counter_table_dispatch_reaches_the_callers_counter() {
        let mut r = BenchReactor::new().unwrap();
        let c = r.imm_counter(5);
        r.dispatch_imm(5);
        r.dispatch_imm(5);
        assert_eq!(c.available(), 2);
        r.clear_counters();
        r.dispatch_imm(5);
        assert_eq!(c.available(), 2, "a cleared table makes a new cell");
        assert_eq!(r.imm_counter(5).available(), 1);
    }

    #[test]
    fn wake_path_round_trip() {
        let mut r = BenchReactor::new().unwrap();
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        // Reactor awake: no eventfd write.
        let mut f = pin!(r.submit_imm(1));
        assert!(f.as_mut().poll(&mut cx).is_pending());
        assert!(!r.poll_wake());
        assert_eq!(r.take_submissions(), 1);
        assert_eq!(r.take_submissions(), 0);
        assert_eq!(r.complete_all(), 1);
        assert!(matches!(f.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        // Reactor asleep: the submission writes the eventfd.
        assert!(r.prepare_sleep());
        let g = r.submit_imm(2);
        assert!(!r.prepare_sleep(), "items queued: no sleep");
        assert!(r.poll_wake());
        assert_eq!(r.take_submissions(), 1);
        assert_eq!(r.complete_all(), 1);
        drop(g);
    }
}
