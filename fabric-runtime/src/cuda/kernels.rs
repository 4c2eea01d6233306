//! Small built-in kernels, compiled with NVRTC on first use: a pattern fill (tests, benches),
//! a kernel that spins on a host counter (what a consumer kernel waiting for arrivals does),
//! and a timed sleep (a long kernel, for tests of event polling).
//!
//! Their launchers are safe: they check ranges, and hold the buffers and the module until the
//! kernel has completed, as the copies of [`Stream`] do.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::driver::Context;
use super::memory::{check_range, DeviceMemory, PinnedHostBuffer};
use super::nvrtc::{Function, KernelArgs, LaunchConfig, Module};
use super::stream::{Keep, Stream};
use crate::error::{Error, Result};

/// [`Kernels::spin_until`] wrote this status: the counter reached the target.
pub const SPIN_RELEASED: u64 = 1;
/// [`Kernels::spin_until`] wrote this status: the timeout passed first.
pub const SPIN_TIMED_OUT: u64 = 2;

const SOURCE: &str = r#"
__device__ __forceinline__ unsigned long long fabric_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// dst[i] = pattern(index0 + i, seed); see `pattern_byte` on the host.
extern "C" __global__ void fabric_fill(unsigned char* dst, unsigned long long len,
                                       unsigned long long index0, unsigned int seed) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < len;
         i += stride) {
        unsigned long long k = index0 + i;
        unsigned long long x = k ^ (k >> 8) ^ (k >> 16) ^ (k >> 24) ^ (k >> 32);
        dst[i] = (unsigned char)(x * 131ull + seed);
    }
}

// Spins until *counter >= target or timeout_ns passes. Writes out[1] = last value seen,
// out[2] = ns spent, then out[0] = 1 (released) or 2 (timed out), each made visible to the host.
extern "C" __global__ void fabric_spin_until(const volatile unsigned long long* counter,
                                             unsigned long long target,
                                             volatile unsigned long long* out,
                                             unsigned long long timeout_ns) {
    unsigned long long start = fabric_now_ns();
    unsigned long long seen = *counter;
    unsigned long long status = 1;
    while (seen < target) {
        if (fabric_now_ns() - start > timeout_ns) { status = 2; break; }
        seen = *counter;
    }
    out[1] = seen;
    out[2] = fabric_now_ns() - start;
    __threadfence_system();
    out[0] = status;
    __threadfence_system();
}

extern "C" __global__ void fabric_sleep(unsigned long long ns) {
    unsigned long long start = fabric_now_ns();
    while (fabric_now_ns() - start < ns) { }
}
"#;

/// Byte `index` of the pattern [`Kernels::fill`] writes with `seed` (the index counts from the
/// start of the buffer, so a sub-range fill continues the same pattern).
pub fn pattern_byte(index: u64, seed: u32) -> u8 {
    let k = index;
    let x = k ^ (k >> 8) ^ (k >> 16) ^ (k >> 24) ^ (k >> 32);
    x.wrapping_mul(131).wrapping_add(u64::from(seed)) as u8
}

/// The built-in kernels, loaded in one context.
pub struct Kernels {
    fill: Function,
    spin_until: Function,
    sleep: Function,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels").field("ordinal", &self.fill_ctx().ordinal()).finish_non_exhaustive()
    }
}

impl Kernels {
    /// Compiles (NVRTC, for this device's architecture) and loads them into `ctx`.
    /// `Unsupported` without libnvrtc.
    pub fn load(ctx: &Arc<Context>) -> Result<Kernels> {
        let module = Module::compile(ctx, SOURCE)?;
        Ok(Kernels {
            fill: module.function("fabric_fill")?,
            spin_until: module.function("fabric_spin_until")?,
            sleep: module.function("fabric_sleep")?,
        })
    }

    fn fill_ctx(&self) -> &Arc<Context> {
        self.fill_module().context()
    }

    fn fill_module(&self) -> &Arc<Module> {
        // All three functions come from one module.
        self.fill.module()
    }

    fn same_device(&self, stream: &Stream) -> Result<()> {
        let (k, s) = (self.fill_ctx().ordinal(), stream.context().ordinal());
        if k != s {
            return Err(Error::Unsupported(format!("kernels of cuda:{k} launched on a stream of cuda:{s}")));
        }
        Ok(())
    }

    /// Launches `f` with `args` and holds `keep` (plus the module) until it completes.
    ///
    /// # Safety
    ///
    /// As [`Stream::launch`]: `args` match `f`, and every address in them lies inside a buffer
    /// of `keep`.
    unsafe fn launch(
        &self,
        stream: &Stream,
        f: &Function,
        cfg: LaunchConfig,
        args: KernelArgs,
        mut keep: Vec<Keep>,
    ) -> Result<()> {
        self.same_device(stream)?;
        stream.reap()?;
        // SAFETY: the caller's contract; `keep` is held until completion just below.
        unsafe { stream.launch(f, cfg, &args)? };
        keep.push(self.fill_module().clone());
        stream.hold_until_done(keep);
        Ok(())
    }

    /// Writes [`pattern_byte`]`(offset + i, seed)` to byte `offset + i` of `dst`, for
    /// `i < len`, on `stream`.
    pub fn fill<D: DeviceMemory>(
        &self,
        stream: &Stream,
        dst: &Arc<D>,
        offset: usize,
        len: usize,
        seed: u32,
    ) -> Result<()> {
        check_range(offset, len, dst.len())?;
        let (d, s) = (dst.context().ordinal(), stream.context().ordinal());
        if d != s {
            return Err(Error::Unsupported(format!("fill of cuda:{d} memory from a kernel on cuda:{s}")));
        }
        let args = KernelArgs::new()
            .u64(dst.device_ptr() + offset as u64)
            .u64(len as u64)
            .u64(offset as u64)
            .u32(seed);
        // SAFETY: fabric_fill(uchar*, u64, u64, u32) writes exactly dst[offset..offset+len],
        // checked above; `dst` is held until the kernel completes.
        unsafe {
            self.launch(stream, &self.fill, LaunchConfig::for_elements(len as u64), args, vec![dst.clone()])
        }
    }

    /// As [`fill`](Self::fill), into pinned host memory through its device-mapped view (the
    /// kernel writes over PCIe): how a kernel hands results to the host without a copy.
    pub fn fill_mapped(
        &self,
        stream: &Stream,
        dst: &Arc<PinnedHostBuffer>,
        offset: usize,
        len: usize,
        seed: u32,
    ) -> Result<()> {
        check_range(offset, len, dst.len())?;
        let args = KernelArgs::new()
            .u64(dst.device_ptr() + offset as u64)
            .u64(len as u64)
            .u64(offset as u64)
            .u32(seed);
        // SAFETY: as in `fill`; the mapped view covers the whole buffer.
        unsafe {
            self.launch(stream, &self.fill, LaunchConfig::for_elements(len as u64), args, vec![dst.clone()])
        }
    }

    /// One thread spins until the 64-bit word `counter.0.atomic_u64s()[counter.1]` is at least
    /// `target`, or `timeout` passes. Then it writes, in `out.0.atomic_u64s()[out.1..out.1 + 3]`:
    /// the last value seen and the nanoseconds spent (words 1 and 2), then the status,
    /// [`SPIN_RELEASED`] or [`SPIN_TIMED_OUT`] (word 0, written last). The host releases it by
    /// storing into the counter.
    pub fn spin_until(
        &self,
        stream: &Stream,
        counter: (&Arc<PinnedHostBuffer>, usize),
        target: u64,
        out: (&Arc<PinnedHostBuffer>, usize),
        timeout: Duration,
    ) -> Result<()> {
        let ((counter, counter_index), (out, out_index)) = (counter, out);
        check_range(counter_index * 8, 8, counter.len())?;
        check_range(out_index * 8, 24, out.len())?;
        let args = KernelArgs::new()
            .u64(counter.device_ptr() + counter_index as u64 * 8)
            .u64(target)
            .u64(out.device_ptr() + out_index as u64 * 8)
            .u64(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX));
        // SAFETY: fabric_spin_until(const u64*, u64, u64*, u64) reads one word of `counter`
        // and writes three of `out`, all checked in bounds; both are held until completion.
        unsafe {
            self.launch(
                stream,
                &self.spin_until,
                LaunchConfig::SINGLE,
                args,
                vec![counter.clone(), out.clone()],
            )
        }
    }

    /// A kernel that does nothing for `duration` (one thread, spinning on the GPU's clock).
    pub fn sleep(&self, stream: &Stream, duration: Duration) -> Result<()> {
        let args = KernelArgs::new().u64(u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX));
        // SAFETY: fabric_sleep(u64) touches no memory.
        unsafe { self.launch(stream, &self.sleep, LaunchConfig::SINGLE, args, Vec::new()) }
    }
}
