//! Streams, events, and asynchronous copies.
//!
//! A copy is enqueued on a [`Stream`] and returns at once; an [`Event`] recorded after it
//! says when it has finished ([`Event::query`] never blocks: the reactor polls it). The safe
//! copies take their buffers as `Arc`s and keep a clone until their completion has been seen
//! (by [`Stream::reap`], [`Stream::synchronize`], or the stream's drop), so dropping a buffer
//! while a copy engine still uses it frees nothing.

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys as cu;
use cudarc::driver::sys::CUresult;

use super::driver::{check, Context};
use super::loader;
use super::memory::{check_range, DeviceMemory, PinnedHostBuffer};
use crate::error::{Error, Result};

/// Something a copy or kernel uses, held until it has completed.
pub(crate) type Keep = Arc<dyn Any + Send + Sync>;

/// A CUDA stream (`cuStreamCreate(CU_STREAM_NON_BLOCKING)`): an ordered queue of copies and
/// kernels on one device. Non-blocking: it never waits for the legacy default stream, so the
/// blocking helpers of [`DeviceBuffer`](super::DeviceBuffer) do not queue behind a kernel
/// that spins on a host counter.
///
/// Dropping a stream waits for the work queued on it (`cuStreamSynchronize`), then releases
/// the buffers its copies held.
pub struct Stream {
    /// Work still in flight, oldest first, with what it uses. Events complete in stream order.
    in_flight: Mutex<VecDeque<InFlight>>,
    raw: cu::CUstream,
    /// Dropped after the stream is destroyed (field order).
    ctx: Arc<Context>,
}

struct InFlight {
    /// Recorded after the work; `None` when recording failed: then only a synchronize frees.
    done: Option<Event>,
    _keep: Vec<Keep>,
}

// SAFETY: a CUstream is a driver handle; the driver API is thread-safe and a stream may be
// used from any thread. The Rust-side state is behind a Mutex.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("ordinal", &self.ctx.ordinal())
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

impl Stream {
    /// A new non-blocking stream on `ctx`'s device.
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        let _cur = ctx.enter()?;
        let mut raw: cu::CUstream = ptr::null_mut();
        let flags = cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: a context is current; valid out-pointer. Destroyed in Drop.
        check("cuStreamCreate", unsafe { cu::cuStreamCreate(&mut raw, flags) })?;
        Ok(Stream { in_flight: Mutex::new(VecDeque::new()), raw, ctx: ctx.clone() })
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> cu::CUstream {
        self.raw
    }

    /// The raw `CUstream` as an integer, for launchers that take one
    /// ([`Function::launch_raw`](super::Function::launch_raw)) and for other libraries
    /// (PyTorch's `torch.cuda.ExternalStream`). Valid while this `Stream` lives.
    pub fn handle(&self) -> u64 {
        self.raw as usize as u64
    }

    /// A new event, recorded at the current end of this stream: it completes when everything
    /// queued so far has.
    pub fn record(&self) -> Result<Event> {
        let ev = Event::new(&self.ctx)?;
        ev.record(self)?;
        Ok(ev)
    }

    /// Makes work queued on this stream from now on wait until `event` completes (on the GPU;
    /// the calling thread does not wait). Works across streams and devices.
    pub fn wait(&self, event: &Event) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: live stream and event; flags must be 0.
        check("cuStreamWaitEvent", unsafe { cu::cuStreamWaitEvent(self.raw, event.raw, 0) })
    }

    /// Whether everything queued on the stream so far has completed. Never blocks. An error
    /// is a failed copy or kernel (the context is then unusable).
    pub fn query(&self) -> Result<EventStatus> {
        let _cur = self.ctx.enter()?;
        // SAFETY: live stream.
        match unsafe { cu::cuStreamQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(EventStatus::Ready),
            CUresult::CUDA_ERROR_NOT_READY => Ok(EventStatus::NotReady),
            r => check("cuStreamQuery", r).map(|()| EventStatus::Ready),
        }
    }

    /// Blocks the calling thread until everything queued has completed, then releases every
    /// buffer held by the safe copies. Cold path: tests, teardown.
    pub fn synchronize(&self) -> Result<()> {
        {
            let _cur = self.ctx.enter()?;
            // SAFETY: live stream.
            check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.raw) })?;
        }
        self.lock().clear();
        Ok(())
    }

    /// Releases the buffers of the copies that have completed, without blocking. Returns how
    /// many pieces of work are still in flight. Every safe copy reaps first, so a stream that
    /// is used keeps few buffers.
    pub fn reap(&self) -> Result<usize> {
        let mut q = self.lock();
        while let Some(front) = q.front() {
            match &front.done {
                Some(ev) if ev.query()? == EventStatus::Ready => {
                    q.pop_front();
                }
                _ => break,
            }
        }
        Ok(q.len())
    }

    /// How many pieces of work with held buffers have not been reaped yet.
    pub fn in_flight(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<InFlight>> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `keep` until the work queued so far has completed. Called right after the work was
    /// enqueued; if the completion event cannot be recorded, `keep` is held until the stream is
    /// synchronized or dropped (never released early).
    pub(crate) fn hold_until_done(&self, keep: Vec<Keep>) {
        let done = match self.record() {
            Ok(ev) => Some(ev),
            Err(e) => {
                tracing::warn!(error = %e, "cuda: no completion event; buffers held until the stream is synchronized");
                None
            }
        };
        self.lock().push_back(InFlight { done, _keep: keep });
    }

    /// Copies `len` bytes from pinned host memory to device memory, asynchronously. Both
    /// buffers are held until the copy has completed.
    pub fn copy_h2d<D: DeviceMemory>(
        &self,
        dst: &Arc<D>,
        dst_offset: usize,
        src: &Arc<PinnedHostBuffer>,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range(dst_offset, len, dst.len())?;
        check_range(src_offset, len, src.len())?;
        self.reap()?;
        // SAFETY: both ranges checked in bounds of live buffers; the Arcs are held until the
        // copy's completion event has been seen.
        unsafe {
            self.copy_h2d_raw(dst.device_ptr() + dst_offset as u64, src.as_ptr().add(src_offset), len)?;
        }
        self.hold_until_done(vec![dst.clone(), src.clone()]);
        Ok(())
    }

    /// Copies `len` bytes from device memory to pinned host memory, asynchronously. Both
    /// buffers are held until the copy has completed.
    pub fn copy_d2h<S: DeviceMemory>(
        &self,
        dst: &Arc<PinnedHostBuffer>,
        dst_offset: usize,
        src: &Arc<S>,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range(dst_offset, len, dst.len())?;
        check_range(src_offset, len, src.len())?;
        self.reap()?;
        // SAFETY: as in `copy_h2d`.
        unsafe {
            self.copy_d2h_raw(dst.as_ptr().add(dst_offset), src.device_ptr() + src_offset as u64, len)?;
        }
        self.hold_until_done(vec![dst.clone(), src.clone()]);
        Ok(())
    }

    /// Copies `len` bytes between device memories, asynchronously: `cuMemcpyDtoDAsync` on one
    /// device, `cuMemcpyPeerAsync` across two (over NVLink or PCIe; staged through the host by
    /// the driver if the devices cannot reach each other). Both are held until it completes.
    pub fn copy_d2d<D: DeviceMemory, S: DeviceMemory>(
        &self,
        dst: &Arc<D>,
        dst_offset: usize,
        src: &Arc<S>,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range(dst_offset, len, dst.len())?;
        check_range(src_offset, len, src.len())?;
        self.reap()?;
        let (d, s) = (dst.device_ptr() + dst_offset as u64, src.device_ptr() + src_offset as u64);
        // SAFETY: as in `copy_h2d`.
        unsafe {
            if dst.context().ordinal() == src.context().ordinal() {
                self.copy_d2d_raw(d, s, len)?;
            } else {
                self.copy_peer_raw(d, dst.context(), s, src.context(), len)?;
            }
        }
        self.hold_until_done(vec![dst.clone(), src.clone()]);
        Ok(())
    }

    /// Enqueues a host-to-device copy of raw addresses.
    ///
    /// # Safety
    ///
    /// `dst..dst+len` must be device memory and `src..src+len` host memory (pinned, for the
    /// copy to be asynchronous), both valid until the copy has completed (an event recorded
    /// after it is ready, or the stream synchronized); nothing else may write `dst` or `src`
    /// meanwhile.
    pub unsafe fn copy_h2d_raw(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; live stream.
        check("cuMemcpyHtoDAsync", unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw) })
    }

    /// Enqueues a device-to-host copy of raw addresses.
    ///
    /// # Safety
    ///
    /// As [`copy_h2d_raw`](Self::copy_h2d_raw), with the roles swapped: nothing may read or
    /// write `dst` until the copy has completed.
    pub unsafe fn copy_d2h_raw(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; live stream.
        check("cuMemcpyDtoHAsync", unsafe { cu::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.raw) })
    }

    /// Enqueues a device-to-device copy of raw addresses (same device, or any two devices
    /// with unified addressing).
    ///
    /// # Safety
    ///
    /// Both ranges must be device memory valid until the copy has completed; nothing may
    /// write either meanwhile.
    pub unsafe fn copy_d2d_raw(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; live stream.
        check("cuMemcpyDtoDAsync", unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw) })
    }

    /// Enqueues a copy between the memories of two devices.
    ///
    /// # Safety
    ///
    /// As [`copy_d2d_raw`](Self::copy_d2d_raw); `dst` must belong to `dst_ctx`'s device and
    /// `src` to `src_ctx`'s.
    pub unsafe fn copy_peer_raw(
        &self,
        dst: u64,
        dst_ctx: &Context,
        src: u64,
        src_ctx: &Context,
        len: usize,
    ) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges and their contexts; live stream.
        check("cuMemcpyPeerAsync", unsafe {
            cu::cuMemcpyPeerAsync(dst, dst_ctx.raw(), src, src_ctx.raw(), len, self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _cur = self.ctx.enter();
        // SAFETY: live stream. Waiting here is what lets the held buffers go: a copy engine may
        // still be using them. Errors (a faulted context) cannot be acted on in Drop.
        let _ = unsafe { cu::cuStreamSynchronize(self.raw) };
        // SAFETY: destroyed once; no work of ours remains on it.
        let _ = unsafe { cu::cuStreamDestroy_v2(self.raw) };
        // `in_flight` (events, held buffers) and then `ctx` drop after this, in field order.
    }
}

/// What [`Event::query`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventStatus {
    /// Everything before the event's record point has completed (or it was never recorded).
    Ready,
    /// Not yet.
    NotReady,
}

/// A CUDA event: a point in a stream that the host can poll without blocking, and that other
/// streams can wait for. [`Event::new`] makes one without timing (`CU_EVENT_DISABLE_TIMING`,
/// the cheap kind a reactor polls); [`Event::timed`] one that [`Event::elapsed_ms`] can read.
pub struct Event {
    raw: cu::CUevent,
    /// Dropped after the event is destroyed.
    ctx: Arc<Context>,
}

// SAFETY: a CUevent is a thread-safe driver handle.
unsafe impl Send for Event {}
// SAFETY: as above; `&self` methods only make driver calls.
unsafe impl Sync for Event {}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event").field("ordinal", &self.ctx.ordinal()).finish_non_exhaustive()
    }
}

impl Event {
    /// A new event on `ctx`'s device, not recorded yet (a query says [`EventStatus::Ready`]).
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        let _cur = ctx.enter()?;
        let mut raw: cu::CUevent = ptr::null_mut();
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: a context is current; valid out-pointer. Destroyed in Drop.
        check("cuEventCreate", unsafe { cu::cuEventCreate(&mut raw, flags) })?;
        Ok(Event { raw, ctx: ctx.clone() })
    }

    /// A new event on `ctx`'s device that records a timestamp (for [`Event::elapsed_ms`]),
    /// as benchmarks time stream work (NCCL's and PyTorch's figures are taken this way).
    pub fn timed(ctx: &Arc<Context>) -> Result<Event> {
        let _cur = ctx.enter()?;
        let mut raw: cu::CUevent = ptr::null_mut();
        // SAFETY: a context is current; valid out-pointer. Destroyed in Drop.
        check("cuEventCreate", unsafe { cu::cuEventCreate(&mut raw, 0) })?;
        Ok(Event { raw, ctx: ctx.clone() })
    }

    /// Records the event at the current end of the raw stream `stream` (a `CUstream` as an
    /// integer, of this event's device). With `captured`, the stream is being captured into
    /// a CUDA graph and the record becomes a node of the graph (`CU_EVENT_RECORD_EXTERNAL`):
    /// each replay records the event again.
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of this event's device (or 0) for the call.
    pub unsafe fn record_raw(&self, stream: u64, captured: bool) -> Result<()> {
        let _cur = self.ctx.enter()?;
        let s = stream as usize as cu::CUstream;
        if captured {
            let flags = cu::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32;
            // SAFETY: live event; the caller vouches for the stream.
            check("cuEventRecordWithFlags", unsafe { cu::cuEventRecordWithFlags(self.raw, s, flags) })
        } else {
            // SAFETY: as above.
            check("cuEventRecord", unsafe { cu::cuEventRecord(self.raw, s) })
        }
    }

    /// Milliseconds from `self`'s last recorded point to `end`'s (resolution about 0.5 µs).
    /// Both must be [`timed`](Event::timed) and completed.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        let _cur = self.ctx.enter()?;
        if !loader::has_driver_symbol(loader::ELAPSED_SYMBOL) {
            return Err(Error::Unsupported(format!(
                "event timing needs {} (a CUDA 12.8 or later driver)",
                loader::ELAPSED_SYMBOL
            )));
        }
        let mut ms = 0f32;
        // SAFETY: live events, valid out-pointer; the symbol is present (checked above).
        check("cuEventElapsedTime", unsafe { cu::cuEventElapsedTime_v2(&mut ms, self.raw, end.raw) })?;
        Ok(ms)
    }

    /// The device the event belongs to.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Records the event at the current end of `stream` (same device). Re-recording moves it.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: live event and stream.
        check("cuEventRecord", unsafe { cu::cuEventRecord(self.raw, stream.raw()) })
    }

    /// Whether the work before the record point has completed. Never blocks: this is what a
    /// reactor polls. An error is a failed copy or kernel (the context is then unusable).
    pub fn query(&self) -> Result<EventStatus> {
        let _cur = self.ctx.enter()?;
        // SAFETY: live event.
        match unsafe { cu::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(EventStatus::Ready),
            CUresult::CUDA_ERROR_NOT_READY => Ok(EventStatus::NotReady),
            r => check("cuEventQuery", r).map(|()| EventStatus::Ready),
        }
    }

    /// Blocks the calling thread until the event has completed. Cold path only.
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: live event.
        check("cuEventSynchronize", unsafe { cu::cuEventSynchronize(self.raw) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _cur = self.ctx.enter();
        // SAFETY: destroyed once. Destroying an event whose work is pending is allowed: the
        // driver releases it when the work completes.
        let _ = unsafe { cu::cuEventDestroy_v2(self.raw) };
    }
}

/// The condition of a stream's wait on a 32-bit word ([`Stream::wait_value32_raw`],
/// [`Context::wait_value32_raw`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitValue {
    /// `(int32_t)(*addr - value) >= 0`: a cyclic greater-or-equal, so a sequence number that
    /// wraps past `u32::MAX` still compares right (`CU_STREAM_WAIT_VALUE_GEQ`).
    Geq,
    /// `*addr == value` (`CU_STREAM_WAIT_VALUE_EQ`).
    Eq,
    /// `(*addr & value) != 0` (`CU_STREAM_WAIT_VALUE_AND`).
    And,
}

impl WaitValue {
    fn flags(self) -> u32 {
        use cu::CUstreamWaitValue_flags as F;
        match self {
            WaitValue::Geq => F::CU_STREAM_WAIT_VALUE_GEQ as u32,
            WaitValue::Eq => F::CU_STREAM_WAIT_VALUE_EQ as u32,
            WaitValue::And => F::CU_STREAM_WAIT_VALUE_AND as u32,
        }
    }
}

/// Whether the loaded driver has the stream memory operations ([`Stream::wait_value32_raw`],
/// [`Stream::write_value32_raw`] and their [`Context`] forms): CUDA 11.7 or later. `false`
/// without a driver (and so on the CPU emulation, which has no streams). Checked once per
/// process.
pub fn stream_memops_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| loader::STREAM_MEMOP_SYMBOLS.iter().all(|s| loader::has_driver_symbol(s)))
}

fn memops() -> Result<()> {
    if stream_memops_supported() {
        Ok(())
    } else {
        Err(Error::Unsupported(
            "this CUDA driver has no stream memory operations (CUDA 11.7 or later)".into(),
        ))
    }
}

/// Stream memory operations: a stream that waits for a 32-bit word to meet a condition
/// before running what was queued after the wait, and a write of a word in stream order.
/// Both are stream operations like a kernel launch (no host synchronization), so they can be
/// captured in a CUDA graph (as batch memory-operation nodes, CUDA 11.7 and later).
///
/// NVIDIA's warning applies: the ordering such a wait creates is invisible to CUDA, and the
/// driver may serialize other work (of this process, on any stream) behind a waiting
/// stream. Whatever makes the condition true (a host thread, another device's copy) must not
/// depend on work that may queue behind the wait, and should give up and satisfy the
/// condition after a bound of its own rather than leave the stream waiting forever.
impl Context {
    /// Makes work queued on `stream` after this call wait (on the GPU; the calling thread
    /// does not) until the 32-bit word at device address `addr` meets `cond` against
    /// `value`. `stream` is a raw `CUstream` of this context's device, as an integer (a
    /// [`Stream::handle`], another library's stream; 0 is the legacy default stream).
    ///
    /// Errors: [`Error::Unsupported`] where [`stream_memops_supported`] is false; the
    /// driver's refusal (a misaligned or unmapped address) as [`Error::Cuda`].
    ///
    /// # Safety
    ///
    /// `addr` must be the device address of a 4-byte aligned word of device memory or of
    /// pinned, device-mapped host memory (a [`PinnedHostBuffer::device_ptr`]; not managed
    /// memory) that stays allocated until the stream has passed the wait (and as long as a
    /// graph captured with it may be replayed). `stream` must be a live stream of this
    /// device. Something must make the condition true eventually: until then the stream,
    /// and anything that synchronizes with it, waits.
    pub unsafe fn wait_value32_raw(&self, stream: u64, addr: u64, value: u32, cond: WaitValue) -> Result<()> {
        memops()?;
        let _cur = self.enter()?;
        // SAFETY: the symbol is present (checked above); the caller guarantees the address,
        // its lifetime and the stream, and that the wait ends.
        check("cuStreamWaitValue32", unsafe {
            cu::cuStreamWaitValue32_v2(stream as usize as cu::CUstream, addr, value, cond.flags())
        })
    }

    /// Writes `value` into the 32-bit word at device address `addr` when `stream` gets
    /// there, after the work queued before it, with a memory fence before the write (the
    /// default of `cuStreamWriteValue32`: earlier writes of the stream are visible first).
    /// `stream` as for [`wait_value32_raw`](Self::wait_value32_raw).
    ///
    /// Errors: as [`wait_value32_raw`](Self::wait_value32_raw).
    ///
    /// # Safety
    ///
    /// `addr` as for [`wait_value32_raw`](Self::wait_value32_raw), valid until the stream
    /// has passed the write; nothing may rely on the word keeping another value meanwhile.
    /// `stream` must be a live stream of this device.
    pub unsafe fn write_value32_raw(&self, stream: u64, addr: u64, value: u32) -> Result<()> {
        memops()?;
        let _cur = self.enter()?;
        let flags = cu::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // SAFETY: the symbol is present (checked above); the caller guarantees the address,
        // its lifetime and the stream.
        check("cuStreamWriteValue32", unsafe {
            cu::cuStreamWriteValue32_v2(stream as usize as cu::CUstream, addr, value, flags)
        })
    }
}

impl Stream {
    /// [`Context::wait_value32_raw`] on this stream.
    ///
    /// # Safety
    ///
    /// As [`Context::wait_value32_raw`].
    pub unsafe fn wait_value32_raw(&self, addr: u64, value: u32, cond: WaitValue) -> Result<()> {
        // SAFETY: the caller's contract; this stream is live and of this context.
        unsafe { self.context().wait_value32_raw(self.handle(), addr, value, cond) }
    }

    /// [`Context::write_value32_raw`] on this stream.
    ///
    /// # Safety
    ///
    /// As [`Context::write_value32_raw`].
    pub unsafe fn write_value32_raw(&self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: the caller's contract; this stream is live and of this context.
        unsafe { self.context().write_value32_raw(self.handle(), addr, value) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_conditions_are_the_drivers_flags() {
        assert_eq!(WaitValue::Geq.flags(), 0);
        assert_eq!(WaitValue::Eq.flags(), 1);
        assert_eq!(WaitValue::And.flags(), 2);
    }

    #[test]
    fn memops_need_a_driver_that_has_them() {
        // Without a driver: unsupported, no panic. With one: whatever its symbols say.
        if crate::cuda::driver().is_err() {
            assert!(!stream_memops_supported());
            assert!(matches!(memops(), Err(Error::Unsupported(_))));
        }
        assert_eq!(memops().is_ok(), stream_memops_supported());
    }
}
