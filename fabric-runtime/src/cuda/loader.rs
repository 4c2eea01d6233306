//! Finding `libcuda` and `libnvrtc` at run time, without panicking.
//!
//! cudarc's dynamic loading opens the library on the first call of any binding and **panics**
//! when no candidate name loads (`panic_no_lib_found`), or when a symbol is missing
//! (`Missing symbol ...`). So nothing in this module tree calls a binding before the probe here
//! has said yes:
//!
//! 1. `is_culib_present()` (cudarc's own check) tries cudarc's candidate names (`libcuda.so`,
//!    ..., `libcuda.so.1`; `libnvrtc.so`, ..., `libnvrtc.so.13`) through the dynamic loader's
//!    search path;
//! 2. if none loads, a few well-known directories are tried by absolute path (`$CUDA_HOME`,
//!    `/usr/local/cuda`, ...; `FABRIC_NVRTC` may name the NVRTC library itself). A library
//!    loaded that way is found again by cudarc's `dlopen("libnvrtc.so.13")`, because the dynamic
//!    loader matches an already loaded object by its `DT_SONAME`;
//! 3. every symbol this module calls is looked up once, so a driver too old for one of them is
//!    reported as such instead of panicking in the middle of an operation.
//!
//! The verdict is cached for the life of the process.

use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nv;

use crate::error::{Error, Result};

/// Driver entry points called by this module, checked before the first call. All of them are
/// in every driver since CUDA 11.0; the names are the exact exported symbols that cudarc's
/// `cuda-13000` bindings look up.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuCtxEnablePeerAccess",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute",
    "cuPointerGetAttributes",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuEventRecordWithFlags",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
];

/// Driver entry points that only some drivers have; checked right before their call with
/// [`has_driver_symbol`].
pub(crate) const DMABUF_SYMBOL: &str = "cuMemGetHandleForAddressRange";
/// `Event::elapsed_ms`: the entry point `cuda-13000` bindings call, CUDA 12.8 and later.
pub(crate) const ELAPSED_SYMBOL: &str = "cuEventElapsedTime_v2";
/// CUDA graphs (`graph.rs`): stream capture and replay, CUDA 11.4 and later.
pub(crate) const GRAPH_SYMBOLS: &[&str] = &[
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
];

/// Stream memory operations (`stream.rs`): a wait on and a write of a 32-bit word in stream
/// order. The `_v2` entry points: CUDA 11.7 and later, available on every platform without
/// the `NVreg_EnableStreamMemOPs` module parameter the first versions needed, and what
/// `cuda.h` maps `cuStreamWaitValue32` / `cuStreamWriteValue32` to since CUDA 12 (the plain
/// names are the old versions, which cudarc's `cuda-13000` bindings no longer have).
pub(crate) const STREAM_MEMOP_SYMBOLS: &[&str] = &["cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"];

/// NVRTC entry points called by this module.
const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcVersion",
    "nvrtcGetErrorString",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcDestroyProgram",
];

/// Directories tried by absolute path when the dynamic loader's search path has no driver
/// (containers often mount it under `/usr/local/nvidia`).
const DRIVER_DIRS: &[&str] =
    &["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64", "/usr/lib/wsl/lib"];
const DRIVER_NAMES: &[&str] = &["libcuda.so.1"];
const NVRTC_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// `Ok` once `libcuda` is loaded and has every symbol of [`DRIVER_SYMBOLS`]; the error says why
/// not. No driver binding may be called before this returned `Ok`.
pub(crate) fn driver() -> Result<()> {
    static VERDICT: OnceLock<Result<(), String>> = OnceLock::new();
    VERDICT
        .get_or_init(probe_driver)
        .clone()
        .map_err(|reason| Error::Unsupported(format!("no CUDA driver: {reason}")))
}

/// `Ok` once `libnvrtc` is loaded and has every symbol of [`NVRTC_SYMBOLS`].
pub(crate) fn nvrtc() -> Result<()> {
    static VERDICT: OnceLock<Result<(), String>> = OnceLock::new();
    VERDICT
        .get_or_init(probe_nvrtc)
        .clone()
        .map_err(|reason| Error::Unsupported(format!("no NVRTC: {reason}")))
}

/// Whether the loaded driver exports `name`. Call only after [`driver`] returned `Ok`.
pub(crate) fn has_driver_symbol(name: &str) -> bool {
    if driver().is_err() {
        return false;
    }
    // SAFETY: `driver()` returned Ok, so `is_culib_present()` found a library and `culib()`
    // (which opens the first candidate that loads) does not panic.
    let lib = unsafe { cu::culib() };
    // SAFETY: looking a symbol up does not call it; the pointer type is never used.
    unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_ok()
}

fn probe_driver() -> Result<(), String> {
    // SAFETY: `is_culib_present` dlopens cudarc's candidate names and closes them again;
    // loading libcuda runs its initialisers, as in every CUDA program.
    let mut present = unsafe { cu::is_culib_present() };
    if !present && preload(&candidates(DRIVER_DIRS.iter().map(PathBuf::from), DRIVER_NAMES)) {
        // SAFETY: as above.
        present = unsafe { cu::is_culib_present() };
    }
    if !present {
        return Err("libcuda.so.1 not found (no NVIDIA driver on this machine)".into());
    }
    // SAFETY: `is_culib_present()` returned true, so `culib()` finds a candidate that loads
    // (the same search, in the same order) and does not panic.
    let lib = unsafe { cu::culib() };
    for name in DRIVER_SYMBOLS {
        // SAFETY: looking a symbol up does not call it; the pointer type is never used.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(format!("the loaded libcuda has no {name} (driver older than CUDA 11?)"));
        }
    }
    Ok(())
}

fn probe_nvrtc() -> Result<(), String> {
    // SAFETY: as in `probe_driver`: cudarc dlopens its candidate names for libnvrtc.
    let mut present = unsafe { nv::is_culib_present() };
    if !present && preload(&nvrtc_paths()) {
        // SAFETY: as above.
        present = unsafe { nv::is_culib_present() };
    }
    if !present {
        return Err("libnvrtc (libnvrtc.so.13, .12, ...) is neither on the dynamic loader's path nor in \
             $CUDA_HOME or /usr/local/cuda; set FABRIC_NVRTC to its path"
            .into());
    }
    // SAFETY: `is_culib_present()` returned true, so `culib()` does not panic.
    let lib = unsafe { nv::culib() };
    for name in NVRTC_SYMBOLS {
        // SAFETY: looking a symbol up does not call it.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(format!("the loaded libnvrtc has no {name}"));
        }
    }
    Ok(())
}

/// Absolute paths to try for NVRTC, most specific first.
fn nvrtc_paths() -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::env::var_os("FABRIC_NVRTC").map(PathBuf::from).into_iter().collect();
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    roots.push("/usr/local/cuda".into());
    let dirs = roots
        .iter()
        .flat_map(|r| ["lib64", "lib", "targets/x86_64-linux/lib"].into_iter().map(move |sub| r.join(sub)));
    paths.extend(candidates(dirs, NVRTC_NAMES));
    paths
}

fn candidates(dirs: impl Iterator<Item = PathBuf>, names: &[&str]) -> Vec<PathBuf> {
    dirs.flat_map(|d| names.iter().map(move |n| d.join(n))).collect()
}

/// Loads the first existing path of `paths` with `RTLD_GLOBAL` and keeps it loaded for the life
/// of the process (cudarc then finds it by soname). Returns whether one loaded.
fn preload(paths: &[PathBuf]) -> bool {
    use std::os::unix::ffi::OsStrExt;
    for path in paths.iter().filter(|p| p.is_file()) {
        let Ok(c) = CString::new(path.as_os_str().as_bytes()) else { continue };
        // SAFETY: `c` is a NUL-terminated path; loading a CUDA library runs its initialisers,
        // as in every CUDA program. The handle is deliberately never closed.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !handle.is_null() {
            tracing::debug!(path = %path.display(), "loaded a CUDA library by absolute path");
            return true;
        }
    }
    false
}
