//! The driver handle, per-device primary contexts, and the one return-code helper.

use std::ffi::{c_char, c_int, CStr};
use std::fmt;
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys as cu;
use cudarc::driver::sys::{CUdevice_attribute, CUresult};

use super::loader;
use crate::error::{Error, Result};

/// Turns a driver return code into a `Result`, naming the call. The one place `CUresult`s are
/// mapped to [`Error::Cuda`].
pub(crate) fn check(call: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { call, code: r as i32, message: describe(r) })
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY: out of memory`, from the driver's own tables.
fn describe(r: CUresult) -> String {
    let text = |f: unsafe fn(CUresult, *mut *const c_char) -> CUresult| {
        let mut p: *const c_char = ptr::null();
        // SAFETY: `check` runs only after a driver call, so the loader has said yes; `p` is a
        // valid out-pointer. The driver returns a static NUL-terminated string or an error.
        let ok = unsafe { f(r, &mut p) } == CUresult::CUDA_SUCCESS && !p.is_null();
        // SAFETY: on success `p` points to a static NUL-terminated string owned by the driver.
        ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (text(cu::cuGetErrorName), text(cu::cuGetErrorString)) {
        (Some(name), Some(s)) => format!("{name}: {s}"),
        (Some(name), None) => name,
        _ => format!("{r:?}"),
    }
}

/// The loaded CUDA driver: initialised once per process, then shared.
///
/// Get it with [`driver()`]; [`available()`] is the short question "how many GPUs can I use".
pub struct Driver {
    version: i32,
    devices: usize,
    /// Primary contexts, retained on first use and kept for the life of the process (as the
    /// CUDA runtime does): a context's allocations outlive any one user.
    contexts: Mutex<Vec<Option<Arc<Context>>>>,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.version();
        f.debug_struct("Driver")
            .field("version", &format_args!("{major}.{minor}"))
            .field("devices", &self.devices)
            .finish()
    }
}

/// The process-wide driver handle: loads `libcuda` (see the module docs), runs `cuInit` and
/// counts the devices, once. A machine without a driver gets [`Error::Unsupported`]
/// (`"no CUDA driver: ..."`), every time, without panicking.
pub fn driver() -> Result<&'static Driver> {
    static DRIVER: OnceLock<Result<Driver>> = OnceLock::new();
    DRIVER.get_or_init(Driver::init).as_ref().map_err(Clone::clone)
}

/// How many CUDA devices this process can use. `Err` when there is no driver at all; `Ok(0)`
/// when the driver loads but finds no device (`CUDA_ERROR_NO_DEVICE`, e.g. an empty
/// `CUDA_VISIBLE_DEVICES`).
pub fn available() -> Result<usize> {
    driver().map(|d| d.devices)
}

/// The primary context of device `ordinal`, shared by every caller (see [`Driver::context`]).
pub fn context(ordinal: usize) -> Result<Arc<Context>> {
    driver()?.context(ordinal)
}

impl Driver {
    fn init() -> Result<Driver> {
        loader::driver()?;
        // SAFETY: the loader found libcuda with this symbol; cuInit takes flags 0.
        let r = unsafe { cu::cuInit(0) };
        if r == CUresult::CUDA_ERROR_NO_DEVICE {
            return Ok(Driver { version: driver_version()?, devices: 0, contexts: Mutex::new(Vec::new()) });
        }
        check("cuInit", r)?;
        let mut count: c_int = 0;
        // SAFETY: the driver is initialised; `count` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut count) })?;
        let devices = usize::try_from(count).unwrap_or(0);
        Ok(Driver { version: driver_version()?, devices, contexts: Mutex::new(vec![None; devices]) })
    }

    /// The CUDA version the driver supports, as (major, minor): (13, 0) for driver 580.
    pub fn version(&self) -> (u32, u32) {
        let v = self.version.max(0) as u32;
        (v / 1000, (v % 1000) / 10)
    }

    /// How many devices the driver sees.
    pub fn device_count(&self) -> usize {
        self.devices
    }

    /// The primary context of device `ordinal`: retained on first use, then shared (the same
    /// `Arc` for every caller). Everything this module allocates on that device holds it.
    pub fn context(&self, ordinal: usize) -> Result<Arc<Context>> {
        let mut contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = contexts.get_mut(ordinal) else {
            return Err(Error::Unsupported(format!(
                "no CUDA device {ordinal}: the driver sees {} device(s)",
                self.devices
            )));
        };
        if let Some(ctx) = slot {
            return Ok(ctx.clone());
        }
        let ctx = Arc::new(Context::retain(ordinal)?);
        *slot = Some(ctx.clone());
        Ok(ctx)
    }
}

fn driver_version() -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: the loader found the symbol; `v` is a valid out-pointer. Works before cuInit.
    check("cuDriverGetVersion", unsafe { cu::cuDriverGetVersion(&mut v) })?;
    Ok(v)
}

/// One device's primary context (the one the CUDA runtime and PyTorch use too, so memory is
/// shared with them without copies).
///
/// Every call of this module that needs a current context makes this one current for its
/// duration and restores the caller's afterwards, so the types here work from any thread
/// (a reactor thread, a tokio worker) without the caller calling `cuCtxSetCurrent`.
pub struct Context {
    ordinal: usize,
    device: cu::CUdevice,
    raw: cu::CUcontext,
    name: String,
    compute_capability: (u32, u32),
}

// SAFETY: a CUcontext is a driver handle, not thread-bound: the driver API is thread-safe and
// any thread may make a context current. `Context` has no interior mutability of its own.
unsafe impl Send for Context {}
// SAFETY: as above; all methods take `&self` and only call thread-safe driver functions.
unsafe impl Sync for Context {}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .finish_non_exhaustive()
    }
}

impl Context {
    fn retain(ordinal: usize) -> Result<Context> {
        let mut device: cu::CUdevice = 0;
        let ord =
            c_int::try_from(ordinal).map_err(|_| Error::Unsupported(format!("no CUDA device {ordinal}")))?;
        // SAFETY: driver initialised (we are called through `driver()`); valid out-pointer.
        check("cuDeviceGet", unsafe { cu::cuDeviceGet(&mut device, ord) })?;
        let mut name = [0 as c_char; 256];
        // SAFETY: `name` has room for 256 bytes, as passed; the driver NUL-terminates.
        check("cuDeviceGetName", unsafe { cu::cuDeviceGetName(name.as_mut_ptr(), 256, device) })?;
        // SAFETY: NUL-terminated by the driver within the buffer.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let major = attribute(device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let mut raw: cu::CUcontext = ptr::null_mut();
        // SAFETY: valid device and out-pointer; balanced by cuDevicePrimaryCtxRelease in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe { cu::cuDevicePrimaryCtxRetain(&mut raw, device) })?;
        Ok(Context { ordinal, device, raw, name, compute_capability: (major as u32, minor as u32) })
    }

    /// The device ordinal (as in `CUDA_VISIBLE_DEVICES` order).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's marketing name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor): (9, 0) for H100 and H200.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// How many streaming multiprocessors the device has (132 on H100 SXM and H200): how
    /// many blocks a kernel that should occupy the whole GPU launches.
    pub fn multiprocessor_count(&self) -> Result<u32> {
        Ok(attribute(self.device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1)
            as u32)
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: valid device and out-pointer.
        check("cuDeviceTotalMem", unsafe { cu::cuDeviceTotalMem_v2(&mut bytes, self.device) })?;
        Ok(bytes)
    }

    /// The device's PCI address as the driver spells it (`0000:1B:00.0`), for
    /// [`Topology::gpu_by_pci`](crate::topology::Topology::gpu_by_pci).
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as c_char; 32];
        // SAFETY: `buf` has room for 32 bytes, as passed; the driver NUL-terminates.
        check("cuDeviceGetPCIBusId", unsafe { cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), 32, self.device) })?;
        // SAFETY: NUL-terminated by the driver within the buffer.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// Whether the device can export dma-bufs of its memory (for `ibv_reg_dmabuf_mr`).
    pub fn dmabuf_supported(&self) -> Result<bool> {
        Ok(attribute(self.device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0)
    }

    /// Whether kernels of this device can read `other`'s memory directly (NVLink or PCIe P2P).
    pub fn can_access_peer(&self, other: &Context) -> Result<bool> {
        if other.device == self.device {
            return Ok(true);
        }
        let mut can: c_int = 0;
        // SAFETY: valid devices and out-pointer.
        check("cuDeviceCanAccessPeer", unsafe {
            cu::cuDeviceCanAccessPeer(&mut can, self.device, other.device)
        })?;
        Ok(can != 0)
    }

    /// Lets this context map `other`'s memory (one direction). Already enabled is not an error.
    pub fn enable_peer_access(&self, other: &Context) -> Result<()> {
        if other.device == self.device {
            return Ok(());
        }
        let _cur = self.enter()?;
        // SAFETY: `other.raw` is a live retained primary context; flags must be 0.
        let r = unsafe { cu::cuCtxEnablePeerAccess(other.raw, 0) };
        if r == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", r)
    }

    /// Blocks until all work on this device is done. Cold path (tests, teardown).
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.enter()?;
        // SAFETY: this context is current.
        check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
    }

    pub(crate) fn raw(&self) -> cu::CUcontext {
        self.raw
    }

    /// Makes this context current on the calling thread until the guard drops, then restores
    /// whatever was current before (nothing, or a context of the caller's own).
    pub(crate) fn enter(&self) -> Result<Current<'_>> {
        let mut prev: cu::CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer; the driver is initialised (a Context exists).
        check("cuCtxGetCurrent", unsafe { cu::cuCtxGetCurrent(&mut prev) })?;
        if prev != self.raw {
            // SAFETY: `self.raw` is a live retained primary context.
            check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(self.raw) })?;
        }
        Ok(Current { prev, ctx: self })
    }
}

impl Context {
    /// Like [`enter`](Self::enter), but leaves a caller's current context (any device) in
    /// place: for calls that only need *a* context.
    pub(crate) fn enter_if_none(&self) -> Result<Option<Current<'_>>> {
        let mut cur: cu::CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuCtxGetCurrent", unsafe { cu::cuCtxGetCurrent(&mut cur) })?;
        if cur.is_null() {
            self.enter().map(Some)
        } else {
            Ok(None)
        }
    }
}

/// The guard of [`Context::enter`]. Not `Send`: it restores the thread it was made on.
pub(crate) struct Current<'a> {
    prev: cu::CUcontext,
    ctx: &'a Context,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        if self.prev != self.ctx.raw {
            // SAFETY: `prev` was current on this thread when the guard was made (or null,
            // which unbinds); the caller's context outlives its own use of it on this thread.
            let _ = unsafe { cu::cuCtxSetCurrent(self.prev) };
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Only reached if the driver's context table is dropped (it lives for the process);
        // every allocation holds an `Arc<Context>`, so none outlives this.
        // SAFETY: balances the retain in `Context::retain`; errors cannot be acted on here.
        let _ = unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

fn attribute(device: cu::CUdevice, attr: CUdevice_attribute) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: valid device and out-pointer.
    check("cuDeviceGetAttribute", unsafe { cu::cuDeviceGetAttribute(&mut v, attr, device) })?;
    Ok(v)
}
