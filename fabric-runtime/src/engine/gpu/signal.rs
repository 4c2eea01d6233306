//! Signals between the engine and CUDA work, with no thread blocked on either side:
//!
//! - [`GpuCounter`]: an immediate's count of arrivals mirrored into pinned, device-mapped
//!   host memory, so a CUDA kernel can spin on arrivals without a round trip through the CPU
//!   (the reference design's GDRCopy flags);
//! - [`Engine::after`]: transfers that start when the work recorded in a CUDA event is done,
//!   so nobody calls `cuStreamSynchronize` before a write. The reactor's CUDA stream waits on
//!   the event (`cuStreamWaitEvent`) and the reactor polls its own event after it, as it does
//!   for staging copies.
//!
//! ```text
//!  kernel ──record(ev)──►  engine.after(&ev).write_imm(..)  ──►  reactor stream waits on ev
//!                                                                   │ (polled, never blocks)
//!                                                                   ▼
//!  peer kernel spins on *GpuCounter::device_ptr() ◄── reactor stores the total ◄── imm arrives
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::counter::{ImmCounter, Mirror};
use crate::cuda::{self, Event, PinnedHostBuffer};
use crate::engine::transfer::Transfers;
use crate::engine::Engine;
use crate::error::Result;
use crate::sync::lock;

/// A word of pinned, device-mapped host memory that follows a counter's total of arrivals.
struct PinnedMirror(Arc<PinnedHostBuffer>);

impl Mirror for PinnedMirror {
    fn store(&self, total: u64) {
        // Monotonic: a racing first store of the current total never lowers a newer one.
        self.0.atomic_u64s()[0].fetch_max(total, std::sync::atomic::Ordering::Release);
    }
}

/// The pinned words of an engine's GPU counters, by immediate (one per immediate, shared by
/// every `gpu_counter` call for it), with the count of arrivals that stream waits asked for.
#[derive(Default)]
pub(crate) struct GpuCounters {
    words: Mutex<HashMap<u32, Word>>,
}

/// An immediate's pinned word, and how many of its arrivals stream waits asked for.
type Word = (Arc<PinnedHostBuffer>, Arc<AtomicU64>);

/// Words that a CUDA stream has been told to wait on ([`GpuCounter::wait_on_stream`]): kept
/// for the life of the process, since nothing tells the host when a stream has passed its
/// wait, and a wait on freed memory would read whatever is mapped there next. One pinned
/// page per immediate that streams waited on, per engine.
static STREAM_WORDS: Mutex<Vec<Arc<PinnedHostBuffer>>> = Mutex::new(Vec::new());

/// An [`ImmCounter`] whose total of arrivals a CUDA kernel can read: the reactor writes the
/// total (every arrival of the immediate ever seen, consumed or not: it only grows) into a
/// `u64` of pinned host memory mapped into the device's address space, right after it counts
/// an arrival. A kernel waits for `n` arrivals with a volatile load loop on
/// [`GpuCounter::device_ptr`] until the value is `>= n` (see `cuda::Kernels::spin_until`).
///
/// Host code keeps using [`GpuCounter::counter`] (`wait_for` consumes there; the GPU word
/// is not affected by consuming).
#[derive(Clone)]
pub struct GpuCounter {
    counter: ImmCounter,
    word: Arc<PinnedHostBuffer>,
    /// Arrivals that stream waits have asked for so far (shared by every `gpu_counter` of
    /// this immediate).
    streamed: Arc<AtomicU64>,
    /// Whether `word` is in `STREAM_WORDS` already.
    retained: Arc<std::sync::atomic::AtomicBool>,
    /// The device this counter was made for (`Engine::gpu_counter`): its streams wait.
    ordinal: u32,
}

impl fmt::Debug for GpuCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuCounter")
            .field("imm", &self.counter.imm())
            .field("total", &self.total())
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr()))
            .finish()
    }
}

impl GpuCounter {
    /// The device address of the `u64` total, valid in every CUDA context of the process
    /// (the memory is portable and mapped).
    pub fn device_ptr(&self) -> u64 {
        self.word.device_ptr()
    }

    /// The pinned buffer holding the total (word 0), for `cuda::Kernels::spin_until`.
    pub fn buffer(&self) -> &Arc<PinnedHostBuffer> {
        &self.word
    }

    /// The total as the GPU sees it.
    pub fn total(&self) -> u64 {
        self.word.atomic_u64s()[0].load(std::sync::atomic::Ordering::Acquire)
    }

    /// The host-side counter of the same immediate.
    pub fn counter(&self) -> &ImmCounter {
        &self.counter
    }

    /// Makes the work queued on `stream` after this call wait, on the GPU, for the next `n`
    /// arrivals of the immediate: the calling thread does not wait, and kernels launched on
    /// `stream` afterwards see the bytes those arrivals announced. Arrivals are taken in
    /// order across calls: the first call waits for arrivals 1..=n of everything this
    /// engine ever counted for the immediate, the next for the `n` after those, and so on
    /// (across every `GpuCounter` of the immediate, and whatever `wait_for` consumed on the
    /// host: the two are counted apart). `stream` is a raw `CUstream` of the device this
    /// counter was made for (`gpu_counter`'s `ordinal`) as an integer (`torch.cuda.Stream.cuda_stream`, a [`cuda::Stream::handle`]);
    /// it may be captured into a CUDA graph, where each replay waits for the same arrival
    /// number (use a fresh counter cursor per replay: call again).
    ///
    /// A `cuStreamWaitValue32` (cyclic greater-or-equal on the low 32 bits of the total) on
    /// the word the reactor stores each arrival's total into, right after it counted the
    /// arrival, which is after the arrival's bytes landed. The word is kept for the life of
    /// the process from the first wait on.
    ///
    /// If the arrivals never come (a dead peer), the stream waits forever, and with it
    /// anything that synchronizes with it: bound such waits on the host (`wait_for` with a
    /// timeout on [`GpuCounter::counter`], peer events) and do not synchronize with the stream
    /// before you know the arrivals are there or coming.
    ///
    /// Errors: [`Error::Unsupported`](crate::Error::Unsupported) for a driver without stream
    /// memory operations, [`Error::Config`](crate::Error::Config) for `n == 0` or more than
    /// 2^31 - 1 at once, the driver's refusal as [`Error::Cuda`](crate::Error::Cuda).
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of the counter's device for the call.
    pub unsafe fn wait_on_stream(&self, stream: u64, n: u64) -> Result<()> {
        if n == 0 || n >= 1 << 31 {
            return Err(crate::Error::Config(format!("a stream wait for {n} arrivals (1 to 2^31 - 1)")));
        }
        if !self.retained.swap(true, Ordering::AcqRel) {
            lock(&STREAM_WORDS).push(self.word.clone());
        }
        let target = self.streamed.fetch_add(n, Ordering::AcqRel) + n;
        // The low word of the little-endian u64 total; the cyclic compare stays right while
        // no stream lags more than 2^31 arrivals behind.
        let ctx = cuda::context(self.ordinal as usize)?;
        // SAFETY: the word is pinned, device-mapped host memory, 8-byte aligned, kept for the
        // life of the process (`STREAM_WORDS`) and only ever raised by the reactor, which
        // makes the condition true once the arrivals are counted; the caller vouches for
        // the stream.
        unsafe { ctx.wait_value32_raw(stream, self.word.device_ptr(), target as u32, cuda::WaitValue::Geq) }
    }
}

impl Engine {
    /// The counter of immediate `imm`, mirrored for CUDA kernels on device `ordinal` (see
    /// [`GpuCounter`]). Arrivals that landed before the call are in the total too. Every call
    /// for the same `imm` shares one word.
    ///
    /// Errors: no CUDA driver or device (`Error::Unsupported`, `Error::Cuda`).
    pub fn gpu_counter(&self, imm: u32, ordinal: u32) -> Result<GpuCounter> {
        let cell = self.shared().counter_cell(imm);
        let word = {
            let mut words = lock(&self.inner.gpu_counters.words);
            match words.get(&imm) {
                Some(w) => w.clone(),
                None => {
                    let w = Arc::new(PinnedHostBuffer::new(&cuda::context(ordinal as usize)?, 8)?);
                    w.atomic_u64s()[0].store(0, std::sync::atomic::Ordering::Release);
                    cell.set_mirror(Arc::new(PinnedMirror(w.clone())));
                    let entry = (w, Arc::new(AtomicU64::new(0)));
                    words.insert(imm, entry.clone());
                    entry
                }
            }
        };
        let (word, streamed) = word;
        let retained = Arc::new(std::sync::atomic::AtomicBool::new(false));
        Ok(GpuCounter { counter: self.imm_counter(imm), word, streamed, retained, ordinal })
    }

    /// The transfer methods, starting only once the work recorded in `event` is done: e.g.
    /// `engine.after(&ev).write_imm(&src, 0, &dst, 0, len, imm)` right after a kernel that
    /// fills `src` recorded `ev`, with no `cuStreamSynchronize` anywhere. Nothing of the
    /// transfer (no copy, no post) starts before; the reactor's CUDA stream waits on the
    /// event and the reactor polls it without blocking. An error of the event's work fails
    /// the transfer.
    ///
    /// The event is read when the reactor takes the transfer (normally at once): record it
    /// before calling, and do not record it again until the returned future has resolved.
    /// Operations of the synchronous path (`post_write_imm`) are not gated.
    pub fn after<'a>(&'a self, event: &'a Arc<Event>) -> Transfers<'a> {
        let mut t = self.transfers();
        t.after = Some(event);
        t
    }
}
