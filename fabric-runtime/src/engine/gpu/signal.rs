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
/// every `gpu_counter` call for it).
#[derive(Default)]
pub(crate) struct GpuCounters {
    words: Mutex<HashMap<u32, Arc<PinnedHostBuffer>>>,
}

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
                    words.insert(imm, w.clone());
                    w
                }
            }
        };
        Ok(GpuCounter { counter: self.imm_counter(imm), word })
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
