//! The kernels (`kernels/*.cu`, CUDA C compiled by NVRTC when an [`AllToAll`](crate::AllToAll)
//! is made) and the one function that launches them.

use std::fmt;
use std::sync::{Arc, Mutex};

use fabric_async::cuda::{self, Context, Function, KernelArgs, LaunchConfig, Module, Stream};

use crate::error::Result;

/// The CUDA C source of every kernel of this crate: `kernels/` in the order the parts build
/// on each other (`emu/run.sh` concatenates them in the same order).
pub const SOURCE: &str = concat!(
    include_str!("kernels/common.cu"),
    include_str!("kernels/dispatch.cu"),
    include_str!("kernels/combine.cu"),
    include_str!("kernels/misc.cu"),
);

/// Threads per block of the row kernels (8 warps; each warp moves one row at a time).
pub(crate) const THREADS: u32 = 256;

/// The loaded kernels of one device.
pub(crate) struct Kernels {
    pub dispatch_send: Function,
    pub dispatch_recv: Function,
    /// Both dispatch stages in one launch.
    pub dispatch: Function,
    pub combine_send: Function,
    pub combine_recv: Function,
    /// Both combine stages in one launch.
    pub combine: Function,
    pub barrier: Function,
    pub clock: Function,
    pub toy_experts: Function,
    pub toy_experts_rank: Function,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels").field("module", self.dispatch_send.module()).finish_non_exhaustive()
    }
}

impl Kernels {
    /// Compiles [`SOURCE`] for `ctx`'s device (once per device and process: the CUBIN is
    /// kept) and looks every kernel up.
    pub(crate) fn load(ctx: &Arc<Context>) -> Result<Kernels> {
        static CUBINS: Mutex<Vec<(usize, Arc<Vec<u8>>)>> = Mutex::new(Vec::new());
        let cached = {
            let cubins = CUBINS.lock().unwrap_or_else(|e| e.into_inner());
            cubins.iter().find(|(o, _)| *o == ctx.ordinal()).map(|(_, c)| c.clone())
        };
        let cubin = match cached {
            Some(c) => c,
            None => {
                // FABRIC_MOE_PROBE compiles the probes in (AllToAll::probe_ns).
                let c = match std::env::var_os("FABRIC_MOE_PROBE") {
                    Some(_) => cuda::compile(ctx, &format!("#define MOE_PROBE 1\n{SOURCE}"))?,
                    None => cuda::compile(ctx, SOURCE)?,
                };
                let c = Arc::new(c);
                CUBINS.lock().unwrap_or_else(|e| e.into_inner()).push((ctx.ordinal(), c.clone()));
                c
            }
        };
        let m = Module::load(ctx, &cubin)?;
        Ok(Kernels {
            dispatch_send: m.function("moe_dispatch_send")?,
            dispatch_recv: m.function("moe_dispatch_recv")?,
            dispatch: m.function("moe_dispatch")?,
            combine_send: m.function("moe_combine_send")?,
            combine_recv: m.function("moe_combine_recv")?,
            combine: m.function("moe_combine")?,
            barrier: m.function("moe_barrier")?,
            clock: m.function("moe_clock")?,
            toy_experts: m.function("moe_toy_experts")?,
            toy_experts_rank: m.function("moe_toy_experts_rank")?,
        })
    }
}

/// The stream a stage is launched on: one of the runtime's [`Stream`]s, or a raw `CUstream`
/// of another library (PyTorch's `torch.cuda.current_stream().cuda_stream`; 0 is the legacy
/// default stream). It must belong to the all-to-all's device.
#[derive(Debug, Clone, Copy)]
pub enum CudaStream<'a> {
    /// A stream of the runtime.
    Fabric(&'a Stream),
    /// A raw `CUstream` handle, as an integer.
    Raw(u64),
}

impl<'a> From<&'a Stream> for CudaStream<'a> {
    fn from(s: &'a Stream) -> Self {
        CudaStream::Fabric(s)
    }
}

impl CudaStream<'_> {
    pub(crate) fn handle(self) -> u64 {
        match self {
            CudaStream::Fabric(s) => s.handle(),
            CudaStream::Raw(h) => h,
        }
    }

    /// The device of a runtime stream (a raw handle cannot be asked cheaply).
    pub(crate) fn ordinal(self) -> Option<usize> {
        match self {
            CudaStream::Fabric(s) => Some(s.context().ordinal()),
            CudaStream::Raw(_) => None,
        }
    }
}

/// A launch of `f` with `grid` blocks of `threads` on `stream`: one `cuLaunchKernel`, no
/// other stream operation, so it may be captured in a CUDA graph.
///
/// # Safety
///
/// `args` must match `f`'s parameter list, and every address in them must stay valid (no
/// conflicting access) until the kernel completes; `stream` must be a live stream of `f`'s
/// device.
pub(crate) unsafe fn launch(
    f: &Function,
    stream: CudaStream<'_>,
    grid: u32,
    threads: u32,
    args: KernelArgs,
) -> Result<()> {
    let cfg = LaunchConfig { grid: (grid.max(1), 1, 1), block: (threads, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the caller's contract.
    unsafe { f.launch_raw(stream.handle(), cfg, &args)? };
    Ok(())
}
