//! The proxy transport: for ranks the kernels cannot store into (another host, or any rank
//! with `Transport::Proxy`), the send kernels pack rows into a local **outbox** (GPU memory,
//! the window's layout, section `d` for rank `d`) and ring a **doorbell** in pinned,
//! device-mapped host memory; a host thread sees it and writes those bytes with the engine
//! (`write_imm`: the engine picks CUDA IPC, GPUDirect or staging by itself); each write
//! raises an immediate that the destination's engine counts into a [`GpuCounter`], on which
//! the receive kernel waits. The GPU's SMs do not copy network bytes.
//!
//! ```text
//!  rank a                                                   rank b
//!  dispatch_send: rows, meta ─► outbox.rx[b], .meta[b]
//!    last block: outbox.dflag[b] = seq<<32|n,
//!    __threadfence_system, doorbell[dispatch][b] = same
//!  proxy thread (a): sees the doorbell change ─► write_imm outbox.meta[b] ─► window_b.meta[a]
//!                                                write_imm outbox.rx[b]   ─► window_b.rx[a]
//!                                                write_imm outbox.dflag[b] ─► window_b.dflag[a]
//!                                                (imm = imm(tag, dispatch, a), 3 per step)
//!                                                         engine b: GpuCounter(imm) += 1 each
//!                                                         dispatch_recv: counter - base >= 3 * seq,
//!                                                           then the flag, then the rows as NVLink
//! ```
//!
//! Combine is the same with its rows and flag (2 writes a step), the GPU barrier with its
//! flag only (1 write; its receiver spins on the flag word, which carries no data).
//!
//! **Receive gates.** A receive kernel that spins on the GPU while the proxy's writes are
//! under way slows them down (on one host the engine's CUDA IPC copies waited about a
//! scheduler time slice, ~1 ms, each). So the receive kernels of dispatch and combine are
//! not started before the arrivals are there: per stage a 32-bit **gate** word of pinned,
//! device-mapped host memory, which `dispatch_send` / `combine_send` close (a stream write of
//! 0 before the send kernel) and `dispatch_recv` / `combine_recv` wait for (a stream wait for
//! `>= 1` before the receive kernel), both stream memory operations (capturable in a CUDA
//! graph: the values are constants). The thread opens a gate (stores 1) once it has seen this
//! step's doorbell of the stage (rung after the stream closed the gate, so the opening cannot
//! be overwritten by this step's close) and every proxy source's counter holds the step's
//! arrivals ([`should_open`]); after the config's timeout of seeing it closed, after a
//! failed write, and when it stops, it opens it anyway: an early opening only lets the
//! kernel spin as before, and the kernel's own bounded waits stay the check and the timeout.
//!
//! ```text
//!  stream: gate = 0 ─► dispatch_send ─► doorbell ─► proxy thread: posts the writes; has
//!          wait gate >= 1 ◄──────────────────────── seen the doorbell and every source's
//!          dispatch_recv (its waits pass at once)   counter at the step's arrivals: gate = 1
//! ```
//!
//! Layout of the pure part: [`imm`], [`Doorbell`], [`plan`] (what to write for a doorbell),
//! [`arrived`] and [`should_open`] (the gates) are plain functions; [`connect`] registers
//! and exchanges the regions; [`Proxy`] is the thread. Errors of a write go to the status
//! word (`ERR_PROXY`) and the message to [`Proxy::error`]; the peer's receive kernel times
//! out, nothing hangs.

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fabric_async::bootstrap::{all_gather, Rendezvous};
use fabric_async::cuda::{Context, DeviceBuffer, PinnedHostBuffer};
use fabric_async::{Engine, GpuCounter, MemoryRegion, OpFuture, RemoteRegion};

use crate::config::{Config, MAX_RANKS};
use crate::error::{MoeError, Result};
use crate::layout::{Layout, PX_BASE, PX_COUNTER, PX_DOORBELL, PX_MASK, PX_OUTBOX};

/// The stages that go through the proxy (the doorbell rows, in `kernels/common.cu`'s order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    Dispatch = 0,
    Combine = 1,
    Barrier = 2,
}

impl Stage {
    pub(crate) const ALL: [Stage; 3] = [Stage::Dispatch, Stage::Combine, Stage::Barrier];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Stage::Dispatch => "dispatch",
            Stage::Combine => "combine",
            Stage::Barrier => "barrier",
        }
    }

    /// Writes (so arrivals of its immediate) per step: `kernels/common.cu`'s `PX_WRITES`.
    pub(crate) fn writes(self) -> u64 {
        match self {
            Stage::Dispatch => 4,
            Stage::Combine => 2,
            Stage::Barrier => 1,
        }
    }

    fn from_index(i: u64) -> Option<Stage> {
        Stage::ALL.get(i as usize).copied()
    }
}

/// Error kind of the proxy in the status word (`kernels/common.cu` has 1..=5).
pub(crate) const ERR_PROXY: u64 = 6;

/// Doorbell words: `[stage][MAX_RANKS]`.
pub(crate) const DOORBELL_WORDS: usize = 3 * MAX_RANKS;

/// The stages whose receive is gated, in the order of the gate words (the barrier carries no
/// data and is not).
pub(crate) const GATED: [Stage; 2] = [Stage::Dispatch, Stage::Combine];

/// Bytes from one gate word to the next: a cache line each, so that the GPU's writes and
/// polls of one stage's gate and the host's of the other do not share a line.
pub(crate) const GATE_STRIDE: usize = 64;

/// The immediate of `stage`'s writes from rank `src` in the all-to-all tagged `tag`:
/// `0xE` in the top 4 bits (other users of the engine should keep their immediates clear of
/// `0xE000_0000..=0xEFFF_FFFF`), 20 bits of a hash of the tag, the stage, the source rank.
pub(crate) fn imm(tag: &str, stage: Stage, src: usize) -> u32 {
    // FNV-1a, folded to 20 bits.
    let mut h: u32 = 0x811c_9dc5;
    for b in tag.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    let h = (h ^ (h >> 20)) & 0xf_ffff;
    0xE000_0000 | h << 8 | (stage as u32) << 6 | (src as u32 & 0x3f)
}

/// A doorbell word as the send kernel rings it: `seq << 32 | count` (rows for that rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Doorbell {
    pub seq: u32,
    pub count: u32,
}

impl Doorbell {
    pub(crate) fn decode(word: u64) -> Doorbell {
        Doorbell { seq: (word >> 32) as u32, count: word as u32 }
    }
}

/// One write of a step: `len` bytes from the outbox at `src_off` to the peer's window at
/// `dst_off` (0 bytes: an imm-only write, one arrival all the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Write {
    pub src_off: u64,
    pub dst_off: u64,
    pub len: u64,
}

/// What rank `me` writes to rank `dest` for a doorbell of `stage` announcing `count` rows:
/// always [`Stage::writes`] writes (so that the receiver's count of arrivals is a multiple
/// of the steps), the flag word last.
pub(crate) fn plan(l: &Layout, tokens: u64, stage: Stage, me: usize, dest: usize, count: u32) -> Vec<Write> {
    let (me, dest, n) = (me as u64, dest as u64, u64::from(count).min(tokens));
    let section = |f: &dyn Fn(u64) -> u64, bytes: u64| Write { src_off: f(dest), dst_off: f(me), len: bytes };
    let flag = |off: u64| Write { src_off: off + 8 * dest, dst_off: off + 8 * me, len: 8 };
    let writes = match stage {
        Stage::Dispatch => vec![
            section(&|s| l.ecount_section(s), l.ecount_bytes),
            section(&|s| l.meta_section(tokens, s), n * l.meta_words * 4),
            section(&|s| l.rx_section(tokens, s), n * l.row_bytes),
            flag(l.off_dflag),
        ],
        Stage::Combine => vec![section(&|s| l.cx_section(tokens, s), n * l.row_bytes), flag(l.off_cflag)],
        Stage::Barrier => vec![flag(l.off_bflag)],
    };
    debug_assert_eq!(writes.len() as u64, stage.writes());
    writes
}

/// Whether a counter of `total` arrivals, counted from `base` with `writes` arrivals a step,
/// holds every arrival of step `seq`: the host's form of `px_wait` (`kernels/common.cu`),
/// wrap-safe in the step as the kernel's is (`(int)(steps - seq) >= 0`).
pub(crate) fn arrived(total: u64, base: u64, writes: u64, seq: u32) -> bool {
    let steps = (total.wrapping_sub(base) / writes.max(1)) as u32;
    steps.wrapping_sub(seq) as i32 >= 0
}

/// Why the proxy opens a gate ([`should_open`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Open {
    /// This step's doorbell seen and every source's arrivals there: the normal case.
    Arrived,
    /// Seen closed for longer than the timeout: the receive kernel runs and reports.
    TimedOut,
    /// A write of this proxy failed: the all-to-all is broken, no gate is kept closed.
    Failed,
}

/// The decision of one stage's gate, from what the proxy thread sees:
///
/// - `bell`: the step of this stage's doorbell seen and not yet opened for (`None`: none
///   pending). The doorbell is rung after the stream closed the gate, so an opening after it
///   is not undone by this step's close.
/// - `totals`: `(total, base)` of each proxy source's counter of the stage, `writes`
///   arrivals a step ([`Stage::writes`]);
/// - `closed_for`: how long the gate word has been seen at 0 (`None`: seen open);
/// - `timeout`: the kernels' wait bound ([`Config::timeout`]);
/// - `failed`: a write of this proxy has failed.
///
/// Opens on the step's arrivals, or whenever it is closed once `failed`, or once closed for
/// longer than `timeout`; never keeps a gate closed for a reason that cannot end.
pub(crate) fn should_open(
    bell: Option<u32>,
    totals: impl IntoIterator<Item = (u64, u64)>,
    writes: u64,
    closed_for: Option<Duration>,
    timeout: Duration,
    failed: bool,
) -> Option<Open> {
    if let Some(seq) = bell {
        if totals.into_iter().all(|(total, base)| arrived(total, base, writes, seq)) {
            return Some(Open::Arrived);
        }
    }
    match closed_for {
        Some(_) if failed => Some(Open::Failed),
        Some(d) if d > timeout => Some(Open::TimedOut),
        _ => None,
    }
}

/// The proxy words of the private buffer (`layout.rs`), as kernels read them.
pub(crate) fn words(
    mask: u64,
    outbox: u64,
    doorbells: u64,
    counters: &[[Option<(u64, u64)>; 2]],
) -> Vec<u64> {
    let mut w = vec![0u64; crate::layout::PROXY_WORDS as usize];
    w[PX_MASK] = mask;
    w[PX_OUTBOX] = outbox;
    w[PX_DOORBELL] = doorbells;
    for (s, pair) in counters.iter().enumerate() {
        for (stage, c) in pair.iter().enumerate() {
            if let Some((ptr, base)) = c {
                w[PX_COUNTER + stage * MAX_RANKS + s] = *ptr;
                w[PX_BASE + stage * MAX_RANKS + s] = *base;
            }
        }
    }
    w
}

/// What [`connect`] sets up: this rank's registered window and outbox, the peers' windows,
/// the counters of arrivals from each proxy source.
pub(crate) struct Links {
    pub outbox: Arc<DeviceBuffer>,
    outbox_region: MemoryRegion,
    /// Kept registered: proxy peers write into it.
    _window_region: MemoryRegion,
    remotes: Vec<Option<RemoteRegion>>,
    /// `[source][dispatch, combine]`, for proxy sources.
    pub counters: Vec<[Option<GpuCounter>; 2]>,
    /// The counters' totals when they were made, before any peer could write: the kernels'
    /// and the gates' zero (an engine reused by an earlier all-to-all has counted before).
    bases: Vec<[u64; 2]>,
    pub doorbells: Arc<PinnedHostBuffer>,
    /// The receive gates of [`GATED`]'s stages, u32 words [`GATE_STRIDE`] bytes apart, made
    /// open (1); `None` where the driver has no stream memory operations (then the receive
    /// kernels spin from their launch, as without gates).
    pub gates: Option<Arc<PinnedHostBuffer>>,
    pub mask: u64,
}

impl Links {
    /// `(device address, base)` of each source's counters, for [`words`].
    pub(crate) fn counter_words(&self) -> Vec<[Option<(u64, u64)>; 2]> {
        self.counters
            .iter()
            .zip(&self.bases)
            .map(|(pair, base)| [0, 1].map(|i| pair[i].as_ref().map(|c| (c.device_ptr(), base[i]))))
            .collect()
    }

    /// The device address of `stage`'s gate word (`None`: the stage is not gated, or there
    /// are no gates).
    pub(crate) fn gate_ptr(&self, stage: Stage) -> Option<u64> {
        let i = GATED.iter().position(|&s| s == stage)?;
        Some(self.gates.as_ref()?.device_ptr() + (i * GATE_STRIDE) as u64)
    }
}

/// `stage`'s gate word in `gates` (made by [`connect`]).
fn gate_word(gates: &PinnedHostBuffer, i: usize) -> &AtomicU32 {
    &gates.atomic_u32s()[i * GATE_STRIDE / 4]
}

/// Opens every gate of `gates`.
fn open_all(gates: &PinnedHostBuffer) {
    for i in 0..GATED.len() {
        gate_word(gates, i).store(1, Ordering::Release);
    }
}

impl fmt::Debug for Links {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Links").field("mask", &format_args!("{:#x}", self.mask)).finish_non_exhaustive()
    }
}

/// Registers `window` and a new outbox with `engine`, publishes the window's descriptor
/// (every rank takes part, those with no proxy peer with an empty record), and turns the
/// proxy peers' descriptors into remote regions (which adds their engines as peers).
/// Returns `None` where this rank has no proxy peer.
pub(crate) async fn connect(
    engine: &Engine,
    world: &dyn Rendezvous,
    config: &Config,
    ctx: &Arc<Context>,
    window: &Arc<DeviceBuffer>,
    mask: u64,
) -> Result<Option<Links>> {
    let ordinal = ctx.ordinal() as u32;
    let mine = if mask == 0 {
        None
    } else {
        // SAFETY: `window` is device memory of `ordinal` (one allocation of its full length)
        // and the engine keeps the Arc (so the allocation) until the region and every
        // transfer into it are done.
        let region = unsafe {
            engine.register_cuda_owned(window.device_ptr(), window.len(), ordinal, window.clone()).await?
        };
        Some(region)
    };
    let record = mine.as_ref().map(|r| r.descriptor().to_bytes()).unwrap_or_default();
    let key = format!("{}/moe-proxy", config.tag);
    let all = all_gather(world, &key, config.rank, config.ranks, record).await?;
    let Some(window_region) = mine else { return Ok(None) };
    let outbox = Arc::new(DeviceBuffer::new(ctx, window.len())?);
    // SAFETY: as for the window: our allocation, kept alive by the engine through the Arc.
    let outbox_region = unsafe {
        engine.register_cuda_owned(outbox.device_ptr(), outbox.len(), ordinal, outbox.clone()).await?
    };
    let mut remotes = Vec::with_capacity(config.ranks);
    let mut counters = Vec::with_capacity(config.ranks);
    for (r, desc) in all.iter().enumerate() {
        if mask >> r & 1 == 0 {
            remotes.push(None);
            counters.push([None, None]);
            continue;
        }
        if desc.is_empty() {
            return Err(MoeError::Config(format!(
                "rank {r} published no proxy window (transports disagree)"
            )));
        }
        let remote = engine.remote_region(desc).await?;
        if remote.len() != window.len() as u64 {
            return Err(MoeError::Config(format!("rank {r}'s proxy window has {} bytes", remote.len())));
        }
        remotes.push(Some(remote));
        let counter = |stage| engine.gpu_counter(imm(&config.tag, stage, r), ordinal);
        counters.push([Some(counter(Stage::Dispatch)?), Some(counter(Stage::Combine)?)]);
    }
    // The totals now are the zero: no peer writes before `new`'s last exchange (`moe-ready`).
    let bases =
        counters.iter().map(|pair| pair.each_ref().map(|c| c.as_ref().map_or(0, |c| c.total()))).collect();
    let doorbells = Arc::new(PinnedHostBuffer::new(ctx, 8 * DOORBELL_WORDS)?);
    let gates = match fabric_async::cuda::stream_memops_supported() {
        true => {
            let g = PinnedHostBuffer::new(ctx, GATED.len() * GATE_STRIDE)?;
            open_all(&g);
            Some(Arc::new(g))
        }
        false => None,
    };
    Ok(Some(Links {
        outbox,
        outbox_region,
        _window_region: window_region,
        remotes,
        counters,
        bases,
        doorbells,
        gates,
        mask,
    }))
}

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

/// Opens the gates when dropped: at the end of the proxy thread, whether it returned or
/// panicked.
struct OpenOnDrop(Option<Arc<PinnedHostBuffer>>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        if let Some(g) = &self.0 {
            open_all(g);
        }
    }
}

/// What the thread keeps of one stage's gate.
#[derive(Debug, Clone, Copy, Default)]
struct GateState {
    /// The step of the stage's last doorbell seen (0: none yet; steps count from 1).
    bell: u32,
    /// The step the gate was last opened for (0: none).
    opened: u32,
    /// When the gate word was first seen at 0 since it was last open.
    closed_since: Option<Instant>,
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

/// The stage and rank of a status word's detail from the proxy.
pub(crate) fn decode_status(detail: u64) -> (&'static str, usize) {
    let stage = Stage::from_index(detail >> 8 & 0xff).map_or("unknown stage", Stage::name);
    (stage, (detail & 0xff) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_are_distinct_per_stage_and_source() {
        let mut seen = std::collections::HashSet::new();
        for stage in Stage::ALL {
            for src in 0..MAX_RANKS {
                let i = imm("moe", stage, src);
                assert_eq!(i >> 28, 0xE);
                assert!(seen.insert(i), "{stage:?} {src}");
            }
        }
        assert_ne!(imm("moe", Stage::Dispatch, 1), imm("moe2", Stage::Dispatch, 1));
        assert_eq!(imm("a/1", Stage::Combine, 3), imm("a/1", Stage::Combine, 3));
    }

    #[test]
    fn doorbells_decode() {
        assert_eq!(Doorbell::decode(7 << 32 | 128), Doorbell { seq: 7, count: 128 });
        assert_eq!(Doorbell::decode(u64::MAX), Doorbell { seq: u32::MAX, count: u32::MAX });
        assert_eq!(decode_status((Stage::Combine as u64) << 8 | 5), ("combine", 5));
    }

    #[test]
    fn plans_move_the_outbox_section_of_the_destination_to_the_section_of_the_source() {
        let c = Config::new(3, 1, 4, 16, 64, 2);
        let l = Layout::new(&c);
        let t = 16;
        let p = plan(&l, t, Stage::Dispatch, 1, 2, 5);
        assert_eq!(p.len() as u64, Stage::Dispatch.writes());
        assert_eq!(p[0], Write { src_off: l.ecount_section(2), dst_off: l.ecount_section(1), len: 4 * 4 });
        assert_eq!(
            p[1],
            Write { src_off: l.meta_section(t, 2), dst_off: l.meta_section(t, 1), len: 5 * 7 * 4 }
        );
        assert_eq!(p[2], Write { src_off: l.rx_section(t, 2), dst_off: l.rx_section(t, 1), len: 5 * 128 });
        assert_eq!(p[3], Write { src_off: l.off_dflag + 16, dst_off: l.off_dflag + 8, len: 8 });
        let p = plan(&l, t, Stage::Combine, 0, 2, 0);
        assert_eq!(p.len() as u64, Stage::Combine.writes());
        assert_eq!(p[0], Write { src_off: l.cx_section(t, 2), dst_off: l.cx_section(t, 0), len: 0 });
        assert_eq!(p[1], Write { src_off: l.off_cflag + 16, dst_off: l.off_cflag, len: 8 });
        let p = plan(&l, t, Stage::Barrier, 2, 0, 0);
        assert_eq!(p, vec![Write { src_off: l.off_bflag, dst_off: l.off_bflag + 16, len: 8 }]);
        // A count past the section (a corrupt doorbell) never writes past it.
        assert_eq!(plan(&l, t, Stage::Combine, 0, 1, u32::MAX)[0].len, t * l.row_bytes);
        // Every write stays inside the window.
        for stage in Stage::ALL {
            for w in plan(&l, t, stage, 2, 1, t as u32) {
                assert!(w.src_off + w.len <= l.window_len && w.dst_off + w.len <= l.window_len);
            }
        }
    }

    #[test]
    fn arrivals_count_whole_steps_from_the_base_and_wrap() {
        // Dispatch: 4 writes a step, counted from 10.
        assert!(arrived(10, 10, 4, 0));
        assert!(!arrived(13, 10, 4, 1), "3 of step 1's 4 writes");
        assert!(arrived(14, 10, 4, 1));
        assert!(arrived(22, 10, 4, 3));
        assert!(!arrived(22, 10, 4, 4));
        assert!(arrived(26, 10, 4, 3), "a later step covers the earlier ones");
        // The total wraps past u64::MAX (its base was near the end).
        assert!(arrived(2, u64::MAX - 1, 2, 2), "4 arrivals across the wrap");
        assert!(!arrived(1, u64::MAX - 1, 2, 2));
        // The step wraps past u32::MAX: step 0 after u32::MAX, as the kernel's (int)(steps - want).
        let per = |steps: u64| 7 + 2 * steps;
        assert!(arrived(per(1 << 32), 7, 2, 0));
        assert!(arrived(per(1 << 32), 7, 2, u32::MAX));
        assert!(!arrived(per((1 << 32) - 1), 7, 2, 0));
        // More than 2^31 steps behind reads as ahead, as on the GPU (never reached: the
        // ranks are at most a step apart).
        assert!(!arrived(7, 7, 2, 1 << 31));
        assert!(arrived(7, 7, 2, (1 << 31) + 1));
    }

    #[test]
    fn gates_open_on_the_steps_arrivals_from_every_source() {
        let t = Duration::from_secs(10);
        let short = Some(Duration::from_millis(1));
        // Step 3's doorbell seen; source A has 3 steps of combine (2 writes), source B 2.
        let a = (100 + 6, 100);
        let b = (50 + 4, 50);
        assert_eq!(should_open(Some(3), [a, b], 2, short, t, false), None, "B is a step behind");
        assert_eq!(should_open(Some(2), [a, b], 2, short, t, false), Some(Open::Arrived));
        let b = (50 + 6, 50);
        assert_eq!(should_open(Some(3), [a, b], 2, short, t, false), Some(Open::Arrived));
        // Arrivals alone, without this step's doorbell, never open: the stream's close of
        // this step may still be on its way and would undo the opening.
        assert_eq!(should_open(None, [a, b], 2, short, t, false), None);
        assert_eq!(should_open(None, [a, b], 2, None, t, false), None);
        // Open on arrivals even where the gate was seen open (harmless), and with no source
        // (nothing to wait for).
        assert_eq!(should_open(Some(3), [a, b], 2, None, t, false), Some(Open::Arrived));
        assert_eq!(should_open(Some(3), [], 2, short, t, false), Some(Open::Arrived));
        // Across the step's wrap.
        let w = (9 + 2 * (1u64 << 32), 9);
        assert_eq!(should_open(Some(0), [w], 2, short, t, false), Some(Open::Arrived));
        assert_eq!(should_open(Some(1), [w], 2, short, t, false), None);
    }

    #[test]
    fn gates_never_stay_closed_past_the_timeout_or_a_failure() {
        let t = Duration::from_secs(10);
        let behind = [(0, 0)];
        assert_eq!(should_open(Some(1), behind, 4, Some(t), t, false), None, "at the bound");
        let long = Some(t + Duration::from_nanos(1));
        assert_eq!(should_open(Some(1), behind, 4, long, t, false), Some(Open::TimedOut));
        // Closed with no doorbell (a send that was never launched): the timeout still opens.
        assert_eq!(should_open(None, behind, 4, long, t, false), Some(Open::TimedOut));
        // Once a write failed, any closed gate opens at once; an open one is left alone.
        let short = Some(Duration::from_micros(1));
        assert_eq!(should_open(Some(1), behind, 4, short, t, true), Some(Open::Failed));
        assert_eq!(should_open(None, behind, 4, short, t, true), Some(Open::Failed));
        assert_eq!(should_open(None, behind, 4, None, t, true), None);
        assert_eq!(should_open(None, behind, 4, None, t, false), None);
    }

    #[test]
    fn proxy_words_put_counters_by_stage_and_source() {
        let mut counters = vec![[None, None]; 3];
        counters[2] = [Some((0x1000, 7)), Some((0x2000, 9))];
        let w = words(0b100, 0xa, 0xb, &counters);
        assert_eq!(w.len() as u64, crate::layout::PROXY_WORDS);
        assert_eq!((w[PX_MASK], w[PX_OUTBOX], w[PX_DOORBELL]), (4, 0xa, 0xb));
        assert_eq!(w[PX_COUNTER + 2], 0x1000);
        assert_eq!(w[PX_COUNTER + MAX_RANKS + 2], 0x2000);
        assert_eq!(w[PX_BASE + 2], 7);
        assert_eq!(w[PX_BASE + MAX_RANKS + 2], 9);
        assert_eq!(w[PX_COUNTER], 0);
    }
}
