//! The proxy thread: [`Proxy`] starts it (from the [`Links`] that [`connect`](super::connect)
//! made) and stops it; its [`Worker`] polls the doorbells of the proxy ranks, posts with the
//! engine the writes that each new doorbell announces ([`plan`]), opens the receive gates
//! ([`should_open`]), and keeps the stage times ([`ProxyTimes`]). A failed write goes to the
//! status word (`ERR_PROXY`) and to [`Proxy::error`]; the thread never blocks on anything but
//! its own short naps.

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fabric_async::cuda::PinnedHostBuffer;
use fabric_async::{Engine, GpuCounter, MemoryRegion, OpFuture, RemoteRegion};

use super::gate::{gate_word, open_all, should_open, GateState, OpenOnDrop, GATED};
use super::{imm, plan, Doorbell, Links, Stage, ERR_PROXY};
use crate::config::{Config, MAX_RANKS};
use crate::error::{MoeError, Result};
use crate::layout::Layout;

/// Stage times of the proxy (see [`ProxyTimes`]).
#[derive(Debug, Default)]
struct Times {
    /// `[stage][doorbell seen, writes posted, writes completed, gate opened]` of the last
    /// step.
    last: [[AtomicU64; 4]; 3],
}

/// The last step of one stage as the proxy saw it: when it saw the doorbell, had posted
/// the writes, saw the last of them complete, and opened the stage's receive gate, in ns of
/// the host's clock since the Unix epoch (0: not yet). Comparable with
/// [`AllToAll::clock_ns`](crate::AllToAll::clock_ns) only where the GPU's `%globaltimer`
/// follows the host's clock (it usually does, to a microsecond or so); differences between
/// them are exact.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyTimes {
    /// The doorbell seen.
    pub seen_ns: u64,
    /// Every write of the step posted.
    pub posted_ns: u64,
    /// Every write of the step completed locally.
    pub completed_ns: u64,
    /// The receive gate opened (the stream may start the receive kernel): the step's
    /// arrivals from every proxy source were counted, or the gate was opened on a timeout
    /// or a failure. 0 without gates (a driver without stream memory operations).
    pub gate_ns: u64,
}

/// The proxy thread of one all-to-all. Stopped (and joined) by [`stop`](Self::stop) or on
/// drop; it never blocks on anything but its own short sleeps, so the join is bounded.
pub(crate) struct Proxy {
    /// The path the engine takes to each rank's window (`None`: not a proxy rank).
    paths: Vec<Option<fabric_async::GpuPath>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    error: Arc<Mutex<Option<Failure>>>,
    times: Arc<Times>,
    /// The receive gates (also the thread's), opened when the thread stops.
    gates: Option<Arc<PinnedHostBuffer>>,
}

/// The first failed write: stage, destination rank, the engine's error.
type Failure = (&'static str, usize, String);

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy").field("running", &self.thread.is_some()).finish_non_exhaustive()
    }
}

/// One posted write.
struct InFlight {
    fut: OpFuture,
    stage: Stage,
    dest: usize,
    /// The last write of its step.
    last: bool,
}

/// How long the thread spins after its last work before it naps between polls (a nap
/// costs up to [`NAP`] of latency on the next doorbell).
const SPIN: Duration = Duration::from_millis(2);
const NAP: Duration = Duration::from_micros(20);

impl Proxy {
    /// Starts the thread: it polls `links.doorbells` for `links.mask`'s ranks and writes
    /// what each new doorbell announces, and opens `links.gates` as [`should_open`] says; a
    /// failed write is reported in `status` (word 0: `ERR_PROXY << 32 | stage << 8 | rank`)
    /// and in [`error`](Self::error).
    pub(crate) fn start(
        engine: Engine,
        links: &Links,
        layout: Layout,
        config: &Config,
        status: Arc<PinnedHostBuffer>,
    ) -> Result<Proxy> {
        let stop = Arc::new(AtomicBool::new(false));
        let error = Arc::new(Mutex::new(None));
        let times = Arc::new(Times::default());
        let sources = |i: usize| -> Vec<(GpuCounter, u64)> {
            let pairs = links.counters.iter().zip(&links.bases);
            pairs.filter_map(|(c, b)| c[i].clone().map(|c| (c, b[i]))).collect()
        };
        let worker = Worker {
            engine,
            outbox: links.outbox_region.clone(),
            remotes: links.remotes.clone(),
            doorbells: links.doorbells.clone(),
            mask: links.mask,
            layout,
            tokens: config.max_tokens as u64,
            me: config.rank,
            imms: Stage::ALL.map(|s| imm(&config.tag, s, config.rank)),
            status,
            stop: stop.clone(),
            error: error.clone(),
            times: times.clone(),
            gates: links.gates.clone(),
            sources: [sources(0), sources(1)],
            timeout: config.timeout,
            failed: Cell::new(false),
        };
        let thread = std::thread::Builder::new()
            .name(format!("moe-proxy-{}", config.rank))
            .spawn(move || {
                // Opens the gates when the thread ends, by returning or by a panic.
                let _open = OpenOnDrop(worker.gates.clone());
                worker.run()
            })
            .map_err(|e| MoeError::Argument(format!("starting the proxy thread: {e}")))?;
        let paths = links.remotes.iter().map(|r| r.as_ref().and_then(|r| r.gpu_path())).collect();
        Ok(Proxy { paths, stop, thread: Some(thread), error, times, gates: links.gates.clone() })
    }

    /// The path the engine's writes to `rank`'s window take (`None`: not a proxy rank).
    pub(crate) fn path(&self, rank: usize) -> Option<fabric_async::GpuPath> {
        self.paths.get(rank).copied().flatten()
    }

    /// The first write that failed, if one did.
    pub(crate) fn error(&self) -> Option<MoeError> {
        let e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        e.as_ref().map(|(stage, rank, message)| MoeError::Transport {
            stage,
            rank: *rank,
            message: message.clone(),
        })
    }

    pub(crate) fn times(&self, stage: Stage) -> ProxyTimes {
        let t = &self.times.last[stage as usize];
        ProxyTimes {
            seen_ns: t[0].load(Ordering::Relaxed),
            posted_ns: t[1].load(Ordering::Relaxed),
            completed_ns: t[2].load(Ordering::Relaxed),
            gate_ns: t[3].load(Ordering::Relaxed),
        }
    }

    /// Whether the thread runs (so opens the gates): not after [`stop`](Self::stop) or a
    /// panic. A stream is not made to wait for a gate that nobody would open.
    pub(crate) fn running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Opens every receive gate now (teardown: a stream waiting on one must not outlive
    /// the thread that would open it; an early opening only lets a kernel spin).
    pub(crate) fn open_gates(&self) {
        if let Some(g) = &self.gates {
            open_all(g);
        }
    }

    /// Stops the thread and waits for it, then opens the gates (the thread opens them on its
    /// way out too; this covers a thread that panicked). Writes still in flight run to
    /// completion inside the engine (it holds the outbox until then).
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
                e.get_or_insert(("proxy", 0, "the proxy thread panicked".into()));
            }
        }
        self.open_gates();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    engine: Engine,
    outbox: MemoryRegion,
    remotes: Vec<Option<RemoteRegion>>,
    doorbells: Arc<PinnedHostBuffer>,
    mask: u64,
    layout: Layout,
    tokens: u64,
    me: usize,
    imms: [u32; 3],
    status: Arc<PinnedHostBuffer>,
    stop: Arc<AtomicBool>,
    error: Arc<Mutex<Option<Failure>>>,
    times: Arc<Times>,
    /// The receive gates of [`GATED`]'s stages (`None`: not gated).
    gates: Option<Arc<PinnedHostBuffer>>,
    /// Per gated stage, each proxy source's counter and base.
    sources: [Vec<(GpuCounter, u64)>; 2],
    /// How long a gate may be seen closed before it is opened anyway.
    timeout: Duration,
    /// A write failed: no gate is kept closed any more.
    failed: Cell<bool>,
}

impl Worker {
    fn run(self) {
        let ns = || SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let mut seen = [[0u64; MAX_RANKS]; 3];
        let mut inflight: Vec<InFlight> = Vec::new();
        let mut idle_since = Instant::now();
        let mut cx = TaskContext::from_waker(Waker::noop());
        let bells = self.doorbells.atomic_u64s();
        let mut gates = [GateState::default(); 2];
        while !self.stop.load(Ordering::Acquire) {
            let mut busy = false;
            for stage in Stage::ALL {
                let mut bits = self.mask;
                while bits != 0 {
                    let dest = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let word = bells[stage as usize * MAX_RANKS + dest].load(Ordering::Acquire);
                    if word == seen[stage as usize][dest] {
                        continue;
                    }
                    seen[stage as usize][dest] = word;
                    busy = true;
                    let bell = Doorbell::decode(word);
                    if let Some(g) = GATED.iter().position(|&s| s == stage) {
                        gates[g].bell = bell.seq;
                    }
                    self.times.last[stage as usize][0].store(ns(), Ordering::Relaxed);
                    self.post(stage, dest, bell, &mut inflight);
                    self.times.last[stage as usize][1].store(ns(), Ordering::Relaxed);
                }
            }
            let waiting = self.gates(&mut gates, &mut busy, &ns);
            inflight.retain_mut(|op| match Pin::new(&mut op.fut).poll(&mut cx) {
                Poll::Pending => true,
                Poll::Ready(r) => {
                    busy = true;
                    match r {
                        Ok(()) if op.last => {
                            self.times.last[op.stage as usize][2].store(ns(), Ordering::Relaxed)
                        }
                        Ok(()) => {}
                        Err(e) => self.fail(op.stage, op.dest, e.to_string()),
                    }
                    false
                }
            });
            // A gate waiting for arrivals keeps the thread spinning: its opening is on the
            // step's critical path (the receive kernel starts only then).
            if busy || !inflight.is_empty() || waiting {
                if busy {
                    idle_since = Instant::now();
                }
                std::hint::spin_loop();
            } else if idle_since.elapsed() > SPIN {
                std::thread::sleep(NAP);
            } else {
                std::hint::spin_loop();
            }
        }
        // Dropping the futures does not cancel the writes; the engine keeps the outbox.
        // The thread's `OpenOnDrop` opens the gates: no stream may wait on a gate that
        // nobody opens any more.
    }

    /// One look at every gate: opens those [`should_open`] says. Returns whether a gate
    /// waits for arrivals (a doorbell seen, the gate not opened for it yet). Cheap when
    /// nothing is pending: one load per gate.
    fn gates(&self, state: &mut [GateState; 2], busy: &mut bool, ns: &dyn Fn() -> u64) -> bool {
        let Some(words) = &self.gates else { return false };
        let mut waiting = false;
        for (i, stage) in GATED.into_iter().enumerate() {
            let g = &mut state[i];
            let word = gate_word(words, i);
            if word.load(Ordering::Acquire) != 0 {
                g.closed_since = None;
            } else if g.closed_since.is_none() {
                g.closed_since = Some(Instant::now());
            }
            let bell = (g.bell != g.opened).then_some(g.bell);
            if bell.is_none() && g.closed_since.is_none() {
                continue;
            }
            let totals = self.sources[i].iter().map(|(c, base)| (c.total(), *base));
            let closed_for = g.closed_since.map(|t| t.elapsed());
            match should_open(bell, totals, stage.writes(), closed_for, self.timeout, self.failed.get()) {
                Some(_) => {
                    word.store(1, Ordering::Release);
                    g.closed_since = None;
                    g.opened = g.bell;
                    *busy = true;
                    self.times.last[stage as usize][3].store(ns(), Ordering::Relaxed);
                }
                None => waiting |= bell.is_some(),
            }
        }
        waiting
    }

    fn post(&self, stage: Stage, dest: usize, bell: Doorbell, inflight: &mut Vec<InFlight>) {
        let Some(remote) = &self.remotes[dest] else {
            return self.fail(stage, dest, "no remote window".into());
        };
        let imm = self.imms[stage as usize];
        let writes = plan(&self.layout, self.tokens, stage, self.me, dest, bell.count);
        let n = writes.len();
        for (i, w) in writes.into_iter().enumerate() {
            let fut = if w.len == 0 {
                self.engine.imm(remote, imm)
            } else {
                self.engine.write_imm(&self.outbox, w.src_off, remote, w.dst_off, w.len, imm)
            };
            inflight.push(InFlight { fut, stage, dest, last: i + 1 == n });
        }
    }

    fn fail(&self, stage: Stage, dest: usize, message: String) {
        let word = ERR_PROXY << 32 | (stage as u64) << 8 | dest as u64;
        self.status.atomic_u64s()[0].store(word, Ordering::Release);
        self.failed.set(true);
        if let Some(g) = &self.gates {
            open_all(g);
        }
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        e.get_or_insert((stage.name(), dest, message));
    }
}
