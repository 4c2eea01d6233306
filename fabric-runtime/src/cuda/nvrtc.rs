//! Compiling CUDA C at run time (NVRTC) and launching the kernels.
//!
//! The source is compiled to a CUBIN for the exact architecture of the device
//! (`--gpu-architecture=sm_XY`), not to PTX: a CUBIN does not need the driver's PTX JIT to be
//! as new as NVRTC, so an NVRTC from a newer toolkit still works with the installed driver.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nv;

use super::driver::{check, Context};
use super::loader;
use super::stream::Stream;
use crate::error::{Error, Result};

fn nvrtc_check(call: &'static str, r: nv::nvrtcResult) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: NVRTC is loaded (every caller ran `loader::nvrtc()` first); returns a static
    // NUL-terminated string for any code.
    let p = unsafe { nv::nvrtcGetErrorString(r) };
    let message = if p.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null static NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    Err(Error::Cuda { call, code: r as i32, message })
}

/// NVRTC's version, as (major, minor). `Unsupported` if libnvrtc cannot be loaded.
pub fn nvrtc_version() -> Result<(u32, u32)> {
    loader::nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: NVRTC loaded; valid out-pointers.
    nvrtc_check("nvrtcVersion", unsafe { nv::nvrtcVersion(&mut major, &mut minor) })?;
    Ok((major as u32, minor as u32))
}

/// An NVRTC program, destroyed on drop (also on the error paths of [`compile`]).
struct Program(nv::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        let _ = unsafe { nv::nvrtcDestroyProgram(&mut self.0) };
    }
}

/// Compiles CUDA C `src` to a CUBIN for `ctx`'s device. Kernels to be found by name must be
/// `extern "C"`. A compile error is [`Error::Cuda`] with NVRTC's log in the message.
pub fn compile(ctx: &Context, src: &str) -> Result<Vec<u8>> {
    loader::nvrtc()?;
    let nul = |what: &str| Error::Unsupported(format!("{what} contains a NUL byte"));
    let src = CString::new(src).map_err(|_| nul("kernel source"))?;
    let (major, minor) = ctx.compute_capability();
    let opts = [format!("--gpu-architecture=sm_{major}{minor}"), "--std=c++17".to_string()];
    let opts: Vec<CString> =
        opts.into_iter().map(CString::new).collect::<Result<_, _>>().map_err(|_| nul("option"))?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();

    let mut raw: nv::nvrtcProgram = ptr::null_mut();
    // SAFETY: NVRTC loaded; `src` and the name are NUL-terminated and outlive the program;
    // no headers.
    nvrtc_check("nvrtcCreateProgram", unsafe {
        nv::nvrtcCreateProgram(&mut raw, src.as_ptr(), c"fabric.cu".as_ptr(), 0, ptr::null(), ptr::null())
    })?;
    let prog = Program(raw);
    // SAFETY: live program; `opt_ptrs` holds that many NUL-terminated strings kept alive by `opts`.
    let r = unsafe { nv::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(&prog).unwrap_or_default();
        return nvrtc_check("nvrtcCompileProgram", r).map(|()| Vec::new()).map_err(|e| match e {
            Error::Cuda { call, code, message } => {
                Error::Cuda { call, code, message: format!("{message}:\n{log}") }
            }
            other => other,
        });
    }
    let mut size = 0usize;
    // SAFETY: compiled program; valid out-pointer.
    nvrtc_check("nvrtcGetCUBINSize", unsafe { nv::nvrtcGetCUBINSize(prog.0, &mut size) })?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the `size` bytes NVRTC asked for.
    nvrtc_check("nvrtcGetCUBIN", unsafe { nv::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) })?;
    Ok(cubin)
}

fn program_log(prog: &Program) -> Result<String> {
    let mut size = 0usize;
    // SAFETY: live program; valid out-pointer.
    nvrtc_check("nvrtcGetProgramLogSize", unsafe { nv::nvrtcGetProgramLogSize(prog.0, &mut size) })?;
    let mut log = vec![0u8; size.max(1)];
    // SAFETY: `log` has the `size` bytes NVRTC asked for.
    nvrtc_check("nvrtcGetProgramLog", unsafe { nv::nvrtcGetProgramLog(prog.0, log.as_mut_ptr().cast()) })?;
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Ok(String::from_utf8_lossy(&log[..end]).into_owned())
}

/// A loaded module (`cuModuleLoadData`), unloaded on drop.
pub struct Module {
    raw: cu::CUmodule,
    /// Dropped after the module is unloaded.
    ctx: Arc<Context>,
}

// SAFETY: a CUmodule is a thread-safe driver handle.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module").field("ordinal", &self.ctx.ordinal()).finish_non_exhaustive()
    }
}

impl Module {
    /// Loads a CUBIN (as [`compile`] makes) into `ctx`.
    pub fn load(ctx: &Arc<Context>, cubin: &[u8]) -> Result<Arc<Module>> {
        let _cur = ctx.enter()?;
        let mut raw: cu::CUmodule = ptr::null_mut();
        // SAFETY: a context is current; `cubin` is a complete image that outlives the call
        // (the driver copies it). Unloaded in Drop.
        check("cuModuleLoadData", unsafe { cu::cuModuleLoadData(&mut raw, cubin.as_ptr().cast()) })?;
        Ok(Arc::new(Module { raw, ctx: ctx.clone() }))
    }

    /// [`compile`] then [`load`](Self::load).
    pub fn compile(ctx: &Arc<Context>, src: &str) -> Result<Arc<Module>> {
        Module::load(ctx, &compile(ctx, src)?)
    }

    /// The `extern "C"` kernel `name`.
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        let cname =
            CString::new(name).map_err(|_| Error::Unsupported("kernel name contains a NUL byte".into()))?;
        let _cur = self.ctx.enter()?;
        let mut raw: cu::CUfunction = ptr::null_mut();
        // SAFETY: live module; NUL-terminated name; valid out-pointer.
        check("cuModuleGetFunction", unsafe { cu::cuModuleGetFunction(&mut raw, self.raw, cname.as_ptr()) })?;
        Ok(Function { raw, module: self.clone(), name: name.to_string() })
    }

    /// The context the module is loaded in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let _cur = self.ctx.enter();
        // SAFETY: loaded by us, unloaded once. A `Function` holds an `Arc` of its module, and
        // the safe launchers hold the function until the kernel completes.
        let _ = unsafe { cu::cuModuleUnload(self.raw) };
    }
}

/// A kernel of a [`Module`]; keeps the module loaded.
pub struct Function {
    raw: cu::CUfunction,
    module: Arc<Module>,
    name: String,
}

// SAFETY: a CUfunction is a thread-safe driver handle.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Function").field("name", &self.name).field("module", &self.module).finish()
    }
}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The module the kernel belongs to.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// How many blocks of `threads` threads (and `shared_mem_bytes` of dynamic shared memory)
    /// of this kernel one multiprocessor holds at once: a kernel whose blocks wait for each
    /// other needs its whole grid resident, at most this times the multiprocessor count.
    pub fn max_active_blocks_per_sm(&self, threads: u32, shared_mem_bytes: usize) -> Result<u32> {
        let _cur = self.module.ctx.enter()?;
        let mut n: std::ffi::c_int = 0;
        // SAFETY: live function of the current context; valid out-pointer.
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                self.raw,
                threads as std::ffi::c_int,
                shared_mem_bytes,
            )
        })?;
        Ok(n.max(0) as u32)
    }
}

/// Grid and block dimensions of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// One block of one thread.
    pub const SINGLE: LaunchConfig = LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 };

    /// A 1-D grid-stride launch for `n` elements: 256 threads per block, at most 1024 blocks.
    pub fn for_elements(n: u64) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
        LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

/// Kernel parameters, in order. Each takes one 8-byte slot; a 32-bit parameter is read from the
/// low half (x86_64 and aarch64 are little-endian).
#[derive(Debug, Clone, Default)]
pub struct KernelArgs {
    slots: Vec<u64>,
}

impl KernelArgs {
    /// No parameters yet.
    pub fn new() -> KernelArgs {
        KernelArgs::default()
    }

    /// A 64-bit parameter (`unsigned long long`, or a pointer given as its device address).
    pub fn u64(mut self, v: u64) -> Self {
        self.slots.push(v);
        self
    }

    /// A 32-bit parameter (`unsigned int`, `int`).
    pub fn u32(mut self, v: u32) -> Self {
        self.slots.push(u64::from(v));
        self
    }
}

impl Function {
    /// Launches this kernel on the raw stream `stream` (a `CUstream` as an integer, e.g.
    /// `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default stream), with this
    /// function's context made current for the call. Only `cuLaunchKernel` is called, so the
    /// launch may be captured in a CUDA graph.
    ///
    /// # Safety
    ///
    /// As [`Stream::launch`]; besides, `stream` must be a live stream of this function's
    /// device (or 0) for the duration of the call.
    pub unsafe fn launch_raw(&self, stream: u64, cfg: LaunchConfig, args: &KernelArgs) -> Result<()> {
        let _cur = self.module.ctx.enter()?;
        let mut slots = args.slots.clone();
        let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        let (g, b) = (cfg.grid, cfg.block);
        // SAFETY: `params` points at one live 8-byte slot per parameter for the duration of
        // the call (the driver copies them); the caller guarantees the kernel's view of them
        // and that `stream` is a stream of this device.
        check("cuLaunchKernel", unsafe {
            cu::cuLaunchKernel(
                self.raw,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                cfg.shared_mem_bytes,
                stream as usize as cu::CUstream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }
}

impl Stream {
    /// Launches `f` on this stream.
    ///
    /// # Safety
    ///
    /// `args` must match the kernel's parameter list in number and size, and every address in
    /// it must stay valid, with no conflicting host access, for everything the kernel does with
    /// it until the kernel has completed. `f`'s module must stay loaded until then (hold the
    /// [`Function`]).
    pub unsafe fn launch(&self, f: &Function, cfg: LaunchConfig, args: &KernelArgs) -> Result<()> {
        let _cur = self.context().enter()?;
        // SAFETY: the caller's contract; this stream is live and of the context made current.
        unsafe { f.launch_raw(self.handle(), cfg, args) }
    }
}
