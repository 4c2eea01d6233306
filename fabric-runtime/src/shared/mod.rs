//! The state the engine handle, its futures and its reactor thread share, and the queue
//! between them. Both sides depend on this module; neither depends on the other's
//! internals: the engine (`engine/`) submits and awaits, the reactor (`reactor/`) takes
//! submissions, posts them and completes them.
//!
//! ```text
//!   engine/ ──submit──► shared::queue (Submission) ──take──► reactor/
//!      ▲                                                        │
//!      └──── poll ◄── shared::notify (OpState, GroupState) ◄────┘ complete
//! ```
//!
//! * [`queue`]: what callers hand the reactor ([`Submission`](queue::Submission)) and the
//!   queue itself;
//! * [`notify`]: what the reactor completes (futures' states, batches, groups, replies);
//! * [`memory`]: the memory a region owns, and the region state that keeps it registered
//!   until no operation uses it;
//! * [`stats`]: the relaxed counters behind `Engine::stats`.

pub(crate) mod events;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
pub(crate) mod memory;
pub(crate) mod notify;
pub(crate) mod queue;
pub(crate) mod request;
pub(crate) mod revoked;
pub(crate) mod stats;

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::Waker;
use std::time::Instant;

use bytes::Bytes;

use crate::counter::CounterCell;
use crate::error::Result;
use crate::provider::Registration;
use crate::pure::counter_table::{Birth, CounterTable};
use crate::pure::descriptor::EngineAddress;
use crate::pure::route::TransferOpts;
use crate::sync::{lock, DirectPost};
use crate::sys::EventFd;

use memory::Backing;
use queue::{Queue, QueueState, Submission};

/// A peer of this engine: an index into its peer table. Only meaningful to the engine that
/// returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Received two-sided messages and the tasks waiting for them.
#[derive(Default)]
pub(crate) struct Inbox {
    /// Messages in arrival order, with their sender where the engine knows it.
    pub(crate) msgs: VecDeque<(Option<PeerId>, Bytes)>,
    /// Waiting receives: their id, the peer they wait for (`None`: any, `Engine::recv`;
    /// `Some`: `Engine::recv_from`) and their waker.
    pub(crate) waiters: Vec<(u64, Option<PeerId>, Waker)>,
    pub(crate) next_id: u64,
    pub(crate) closed: bool,
}

impl Inbox {
    /// Queues a message; returns the waker of the first receive that may take it.
    pub(crate) fn push(&mut self, m: (Option<PeerId>, Bytes)) -> Option<Waker> {
        let from = m.0;
        self.msgs.push_back(m);
        let i = self.waiters.iter().position(|(_, want, _)| want.is_none() || *want == from)?;
        Some(self.waiters.remove(i).2)
    }

    /// Takes the oldest message from `from` (`None`: from anyone).
    pub(crate) fn take(&mut self, from: Option<PeerId>) -> Option<(Option<PeerId>, Bytes)> {
        match from {
            None => self.msgs.pop_front(),
            Some(p) => {
                let i = self.msgs.iter().position(|(src, _)| *src == Some(p))?;
                self.msgs.remove(i)
            }
        }
    }

    /// A dropped receive was woken for a message it did not take: the waker of the first
    /// other receive that a queued message satisfies.
    pub(crate) fn pass_on(&mut self) -> Option<Waker> {
        let msgs = &self.msgs;
        let i = self.waiters.iter().position(|(_, want, _)| match want {
            None => !msgs.is_empty(),
            Some(p) => msgs.iter().any(|(src, _)| *src == Some(*p)),
        })?;
        Some(self.waiters.remove(i).2)
    }

    pub(crate) fn take_waiters(&mut self) -> Vec<Waker> {
        self.waiters.drain(..).map(|(_, _, w)| w).collect()
    }
}

/// Every immediate value's counter, created on first use (an arrival or a call); arrivals
/// create at most `EngineBuilder::max_counters` (`pure::counter_table`).
pub(crate) struct Counters {
    pub(crate) table: CounterTable<Arc<CounterCell>>,
    /// The engine has shut down: counters are born closed.
    closed: bool,
}

/// A new counter of `imm`: short if its value's arrivals were refused before, closed if the
/// engine has shut down.
fn new_cell(imm: u32, birth: Birth, limit: usize, closed: bool) -> Arc<CounterCell> {
    let c = match birth {
        Birth::Fresh => CounterCell::new(imm),
        Birth::Refused => CounterCell::short(imm, limit),
    };
    if closed {
        c.close();
    }
    Arc::new(c)
}

/// State shared by the engine handle, its futures and its reactor thread.
pub(crate) struct Shared {
    pub(crate) transport: String,
    pub(crate) address: EngineAddress,
    pub(crate) max_msg_size: usize,
    pub(crate) queue: Mutex<Queue>,
    /// Hint that `queue.items` is non-empty, so a spinning reactor need not take the lock.
    pub(crate) has_items: AtomicBool,
    pub(crate) wake: EventFd,
    pub(crate) counters: Mutex<Counters>,
    /// Number of peers added so far (peer ids are `0..npeers`).
    pub(crate) npeers: AtomicU32,
    pub(crate) inbox: Mutex<Inbox>,
    /// Number of NICs (domains).
    pub(crate) nics: usize,
    /// Routing and arrival defaults of the engine's own transfer methods.
    pub(crate) default_opts: TransferOpts,
    /// Where the next sharded transfer starts (round-robin over NICs).
    pub(crate) rotation: AtomicUsize,
    /// Every NIC's write completions are delivery-complete ([`Domain::delivery_complete`](crate::provider::Domain::delivery_complete)).
    pub(crate) delivery_complete: bool,
    /// Host regions from 2 MiB up ask for transparent huge pages (`EngineBuilder::huge_pages`).
    pub(crate) huge_pages: bool,
    /// Some NIC's target refuses a bad key without telling the writer
    /// ([`Domain::refuses_bad_keys_silently`](crate::provider::Domain::refuses_bad_keys_silently)):
    /// `Engine::remote_region` has the owner vouch for a descriptor first.
    pub(crate) vouch: bool,
    /// Moves while callers run passes (`Inline`, `await_spin`, `BusyPoll`'s spinning callers;
    /// the reactor thread stands by while it does). Not an exact count: racing callers may
    /// each store the same value.
    pub(crate) inline_polls: AtomicU64,
    /// The reactor thread stands by on its eventfd while callers run passes (`reactor::run`).
    pub(crate) standing_by: AtomicBool,
    /// Shutdown was requested.
    closing: AtomicBool,
    /// Posting on the submitter's thread while the reactor sleeps (`reactor::Direct`),
    /// when the engine allows it and every domain has a wait fd. Weak: the poster holds the
    /// core, which holds this.
    pub(crate) direct: OnceLock<Weak<dyn DirectPost>>,
    /// Submissions posted on the submitter's thread so far (`Engine::direct_posts`).
    pub(crate) direct_posts: AtomicU64,
    /// Live `CompletionWakeups` handles (a watcher runs passes when the wait fds wake).
    pub(crate) watchers: AtomicUsize,
    /// What `Engine::stats` reads: per NIC, per peer and reactor counters.
    pub(crate) stats: stats::Stats,
    /// Peer up/down events (`Engine::peer_events`).
    pub(crate) peer_events: events::PeerEventHub,
    /// Regions peers have freed (`Revoke` messages), and the flags of our `RemoteRegion`s.
    pub(crate) revoked: revoked::Revocations,
    /// GPU regions, CUDA IPC mappings and staging settings.
    #[cfg(feature = "cuda")]
    pub(crate) gpu: gpu::GpuShared,
}

/// Whether a submission may be posted on the submitter's thread (`EngineBuilder::direct_post`):
/// operations and sends awaited as futures. Not registrations or peer changes (their page
/// pinning and handshakes stay off the caller's thread; a small host registration is made
/// on the caller's thread before it is ever queued, `Engine::register_raw`), and not the synchronous `post_*`
/// path (`OpBatch`), which promises its caller no allocation and no reactor work on its
/// thread outside `ReactorMode::Inline`.
fn posts_directly(s: &Submission) -> bool {
    match s {
        Submission::Op { notify, .. } => !matches!(notify, notify::Notify::Batch(_)),
        Submission::Send { .. } => true,
        _ => false,
    }
}

impl Shared {
    /// The state of a new engine: an open, empty queue and no peers or counters.
    pub(crate) fn new(
        transport: String,
        address: EngineAddress,
        max_msg_size: usize,
        nics: usize,
        default_opts: TransferOpts,
        delivery_complete: bool,
    ) -> Result<Shared> {
        Ok(Shared {
            transport,
            address,
            max_msg_size,
            queue: Mutex::new(Queue {
                state: QueueState::Open,
                items: Vec::with_capacity(1024),
                sleeping: false,
                graveyard: Vec::new(),
            }),
            has_items: AtomicBool::new(false),
            wake: EventFd::new()?,
            counters: Mutex::new(Counters {
                table: CounterTable::new(crate::pure::counter_table::DEFAULT_LIMIT),
                closed: false,
            }),
            npeers: AtomicU32::new(0),
            inbox: Mutex::new(Inbox::default()),
            nics,
            default_opts,
            rotation: AtomicUsize::new(0),
            delivery_complete,
            huge_pages: true,
            vouch: false,
            inline_polls: AtomicU64::new(0),
            standing_by: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            direct: OnceLock::new(),
            direct_posts: AtomicU64::new(0),
            watchers: AtomicUsize::new(0),
            stats: stats::Stats::new(nics),
            peer_events: events::PeerEventHub::default(),
            revoked: revoked::Revocations::default(),
            #[cfg(feature = "cuda")]
            gpu: gpu::GpuShared::default(),
        })
    }

    /// Hands every submission to the reactor under one lock. Gives them back if the engine
    /// is shutting down (then none was queued).
    pub(crate) fn submit_all(&self, mut s: Vec<Submission>) -> std::result::Result<(), Vec<Submission>> {
        let mut q = lock(&self.queue);
        if q.state != QueueState::Open {
            return Err(s);
        }
        let direct = s.iter().all(posts_directly);
        q.items.append(&mut s);
        self.queued(q, direct);
        Ok(())
    }

    /// The NIC the next transfer starts on.
    pub(crate) fn next_start(&self) -> usize {
        if self.nics <= 1 {
            0
        } else {
            self.rotation.fetch_add(1, Ordering::Relaxed) % self.nics
        }
    }

    /// Hands `s` to the reactor. Gives it back if the engine is shutting down.
    pub(crate) fn submit(&self, s: Submission) -> std::result::Result<(), Submission> {
        let direct = posts_directly(&s);
        let mut q = lock(&self.queue);
        if q.state != QueueState::Open {
            return Err(s);
        }
        q.items.push(s);
        self.queued(q, direct);
        Ok(())
    }

    /// After submissions were pushed (the queue lock `q` still held): if the reactor thread
    /// sleeps, post them from this thread when allowed and possible (`direct`, operations
    /// only: a registration's page pinning stays off the caller's thread), else wake it.
    fn queued<'a>(&'a self, mut q: MutexGuard<'a, Queue>, direct: bool) {
        self.has_items.store(true, Ordering::Release);
        if !q.sleeping {
            return;
        }
        if direct {
            if let Some(poster) = self.direct.get().and_then(Weak::upgrade) {
                // The reactor stays marked asleep: the next submitter may post directly too.
                drop(q);
                match poster.post_now() {
                    Some(true) => {
                        self.direct_posts.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Some(false) => {
                        self.wake.notify();
                        return;
                    }
                    // In flight already: wake the reactor thread, once, as without direct posting.
                    None => {
                        q = lock(&self.queue);
                        if !q.sleeping {
                            return; // it woke meanwhile and will take the queue
                        }
                    }
                }
            }
        }
        q.sleeping = false;
        drop(q);
        self.wake.notify();
    }

    /// Whether shutdown was requested.
    pub(crate) fn closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Asks the reactor to stop.
    pub(crate) fn request_shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        let mut q = lock(&self.queue);
        if q.state == QueueState::Open {
            q.state = QueueState::Closing;
        }
        drop(q);
        self.has_items.store(true, Ordering::Release);
        self.wake.notify();
    }

    /// Called when a region is dropped: its registrations must be closed before its memory
    /// is freed, and only the reactor may close them while it runs.
    pub(crate) fn retire(&self, regs: Vec<Registration>, backing: Backing) {
        let mut q = lock(&self.queue);
        match q.state {
            QueueState::Open => {
                q.items.push(Submission::Deregister { regs, backing });
                let wake = std::mem::take(&mut q.sleeping);
                self.has_items.store(true, Ordering::Release);
                drop(q);
                if wake {
                    self.wake.notify();
                }
            }
            QueueState::Closing => q.graveyard.push(backing),
            // Every NIC object is closed: nothing can touch the memory any more.
            QueueState::Closed => {
                drop(q);
                drop(backing);
            }
        }
    }

    /// Arrivals create at most `n` counters (`EngineBuilder::max_counters`).
    pub(crate) fn set_max_counters(&mut self, n: usize) {
        let c = self.counters.get_mut().unwrap_or_else(|p| p.into_inner());
        c.table = CounterTable::new(n);
    }

    /// The counter of `imm` the application asks for (`Engine::imm_counter`): never refused.
    pub(crate) fn counter_cell(&self, imm: u32) -> Arc<CounterCell> {
        let mut c = lock(&self.counters);
        let (closed, limit) = (c.closed, c.table.limit());
        c.table.get_or_create(imm, |birth| new_cell(imm, birth, limit, closed))
    }

    /// The counter an arrival of `imm` lands in (the reactor asks on the first arrival of
    /// each value it sees): `None` when the table is full, which counts the refusal and logs
    /// the first one, then at most one line per 10 s.
    pub(crate) fn arrival_cell(&self, imm: u32) -> Option<Arc<CounterCell>> {
        let mut c = lock(&self.counters);
        let (closed, limit) = (c.closed, c.table.limit());
        match c.table.for_arrival(imm, Instant::now(), |birth| new_cell(imm, birth, limit, closed)) {
            Ok(cell) => Some(cell),
            Err(refused) => {
                drop(c);
                if let Some(r) = refused.report {
                    tracing::warn!(
                        imm,
                        limit,
                        refused = r.since_last,
                        refused_total = r.total,
                        "immediate counter table full (EngineBuilder::max_counters): arrivals of values \
                         without a counter are refused; waits on them fail with CounterLimit"
                    );
                }
                None
            }
        }
    }

    /// Removes the counter of `imm` and retires it (`Engine::retire_counter`; the reactor,
    /// having dropped its own references, calls this). Returns the arrivals it discarded.
    pub(crate) fn retire_counter(&self, imm: u32) -> u64 {
        let cell = lock(&self.counters).table.remove(imm);
        cell.map_or(0, |c| c.retire())
    }

    /// Shutdown: every counter, present and future, stops waiting for arrivals.
    pub(crate) fn close_counters(&self) {
        let cells: Vec<Arc<CounterCell>> = {
            let mut t = lock(&self.counters);
            t.closed = true;
            t.table.values().cloned().collect()
        };
        for c in cells {
            c.close();
        }
    }
}
