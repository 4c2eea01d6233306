//! Device memory, pinned device-mapped host memory, and what an address is.

use std::ffi::c_void;
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::driver::sys::CUpointer_attribute as Attr;

use super::driver::{check, driver, Context};
use super::loader;
use crate::error::{Error, Result, Side};

/// Device memory that the safe copies of [`Stream`](super::Stream) may read and write by
/// address.
///
/// # Safety
///
/// `device_ptr()..device_ptr() + len()` must be device memory (or device-accessible memory)
/// of `context()`'s device, valid for reads and writes by the GPU for as long as the value
/// lives, and the values must not change over its life. The safe copies trust this to stay in
/// bounds.
pub unsafe trait DeviceMemory: Send + Sync + 'static {
    /// Start address in the unified address space.
    fn device_ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the length is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The context of the device this memory is on.
    fn context(&self) -> &Arc<Context>;
}

/// `offset..offset+len` inside a `region_len`-byte region, or `OutOfBounds`.
pub(crate) fn check_range(offset: usize, len: usize, region_len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            side: Side::Local,
            offset: offset as u64,
            len: len as u64,
            region_len: region_len as u64,
        }),
    }
}

/// A device allocation (`cuMemAlloc`), zero-filled, freed on drop.
///
/// Memory from `cuMemAlloc` can be shared with another process through CUDA IPC
/// ([`DeviceBuffer::ipc_export`](super::DeviceBuffer::ipc_export)).
pub struct DeviceBuffer {
    /// Keeps the context (and so the allocation's address space) alive until after `cuMemFree`.
    ctx: Arc<Context>,
    ptr: u64,
    len: usize,
}

// SAFETY: a device address is plain data; the driver calls made with it are thread-safe.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&self` methods only issue driver calls; the device memory is not Rust memory.
unsafe impl Sync for DeviceBuffer {}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ordinal", &self.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 1) on `ctx`'s device and zero-fills them.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(Error::Unsupported("a zero-length CUDA allocation".into()));
        }
        let _cur = ctx.enter()?;
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: a context is current; valid out-pointer. Freed in Drop.
        check("cuMemAlloc", unsafe { cu::cuMemAlloc_v2(&mut ptr, len) })?;
        let buf = DeviceBuffer { ctx: ctx.clone(), ptr, len };
        // SAFETY: `ptr..ptr+len` is the allocation just made; synchronous memset.
        check("cuMemsetD8", unsafe { cu::cuMemsetD8_v2(ptr, 0, len) })?;
        Ok(buf)
    }

    /// Device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (allocations have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Copies `src` to `offset`, blocking until done. Cold path (setup, tests): uses the
    /// legacy default stream, which does not wait for this module's (non-blocking) streams.
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(offset, src.len(), self.len)?;
        let _cur = self.ctx.enter()?;
        // SAFETY: destination range checked above; `src` is valid for reads of its length.
        check("cuMemcpyHtoD", unsafe {
            cu::cuMemcpyHtoD_v2(self.ptr + offset as u64, src.as_ptr().cast(), src.len())
        })
    }

    /// Copies from `offset` into `dst`, blocking until done. Cold path, as
    /// [`copy_from_host`](Self::copy_from_host).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), self.len)?;
        let _cur = self.ctx.enter()?;
        // SAFETY: source range checked above; `dst` is valid for writes of its length and
        // exclusively borrowed until the synchronous copy returns.
        check("cuMemcpyDtoH", unsafe {
            cu::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len())
        })
    }

    /// Sets every byte to `value`, blocking until done.
    pub fn fill(&self, value: u8) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the whole allocation.
        check("cuMemsetD8", unsafe { cu::cuMemsetD8_v2(self.ptr, value, self.len) })
    }

    /// A dma-buf fd for `offset..offset+len` of this allocation, for registering it with an
    /// RDMA NIC (`ibv_reg_dmabuf_mr`). Both must be multiples of the host page size. Needs a
    /// driver with `cuMemGetHandleForAddressRange` (CUDA 11.7) and
    /// [`Context::dmabuf_supported`].
    pub fn dmabuf_fd(&self, offset: usize, len: usize) -> Result<OwnedFd> {
        check_range(offset, len, self.len)?;
        dmabuf_fd_of(&self.ctx, self.ptr + offset as u64, len)
    }
}

/// A dma-buf fd for `ptr..ptr+len` of device `ordinal`'s memory (any allocation the driver
/// can export, for example a user's `cudaMalloc` range registered with `register_cuda`), for
/// `ibv_reg_dmabuf_mr`. `ptr` and `len` must be multiples of the host page size and the
/// range inside one allocation, else the driver refuses ([`Error::Cuda`]).
pub fn dmabuf_fd(ordinal: usize, ptr: u64, len: usize) -> Result<OwnedFd> {
    dmabuf_fd_of(&*super::context(ordinal)?, ptr, len)
}

fn dmabuf_fd_of(ctx: &Context, ptr: u64, len: usize) -> Result<OwnedFd> {
    if !loader::has_driver_symbol(loader::DMABUF_SYMBOL) {
        return Err(Error::Unsupported("this CUDA driver cannot export dma-bufs".into()));
    }
    let _cur = ctx.enter()?;
    let mut fd: i32 = -1;
    // SAFETY: the symbol exists (checked above); the driver checks the range itself and
    // fails for one that is not its memory; `fd` is a valid out-pointer for the int the
    // DMA_BUF_FD handle type writes.
    check("cuMemGetHandleForAddressRange", unsafe {
        cu::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            ptr,
            len,
            cu::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    // SAFETY: on success the driver returned a new fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

// SAFETY: ptr..ptr+len is our own live allocation on ctx's device, fixed for its life.
unsafe impl DeviceMemory for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // A failure to make the context current only means cuMemFree may fail too; nothing
        // else can be done in Drop.
        let _cur = self.ctx.enter();
        // SAFETY: our allocation, freed once. Async work on it must be complete: the safe
        // copies keep an `Arc` of this buffer until their event has completed.
        let _ = unsafe { cu::cuMemFree_v2(self.ptr) };
    }
}

/// Page-locked host memory (`cuMemHostAlloc(PORTABLE | DEVICEMAP)`), zero-filled, freed on
/// drop.
///
/// It has two addresses: [`as_ptr`](Self::as_ptr) for the CPU and
/// [`device_ptr`](Self::device_ptr) for kernels, which read and write it over PCIe. Portable:
/// pinned for every context, so any device's copy engine moves it at full speed. Uses: bounce
/// buffers of a staged transfer, and counters or flags a kernel spins on
/// ([`atomic_u64s`](Self::atomic_u64s)).
///
/// Byte access needs `&mut self` ([`as_mut_slice`](Self::as_mut_slice)): a shared buffer may
/// be under a GPU copy. The safe copies keep an `Arc` clone until they complete, so
/// `Arc::get_mut` succeeds exactly when no copy of this module is using the buffer.
pub struct PinnedHostBuffer {
    /// Keeps the context that pinned the pages alive until after `cuMemFreeHost`.
    ctx: Arc<Context>,
    host: NonNull<u8>,
    device: u64,
    len: usize,
}

// SAFETY: the pages are ordinary (pinned) process memory owned by this value; nothing ties
// them to a thread.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: `&self` gives out only atomics and raw pointers; byte slices need `&mut self`.
unsafe impl Sync for PinnedHostBuffer {}

impl fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedHostBuffer")
            .field("host", &self.host)
            .field("device", &format_args!("{:#x}", self.device))
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedHostBuffer {
    /// Allocates `len` bytes (at least 1) of pinned, device-mapped host memory, zero-filled.
    /// `ctx` is the context that pins it; the memory is usable by every device (portable).
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<PinnedHostBuffer> {
        if len == 0 {
            return Err(Error::Unsupported("a zero-length pinned allocation".into()));
        }
        let _cur = ctx.enter()?;
        let mut p: *mut c_void = ptr::null_mut();
        let flags = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a context is current; valid out-pointer. Freed in Drop.
        check("cuMemHostAlloc", unsafe { cu::cuMemHostAlloc(&mut p, len, flags) })?;
        let host = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::Unsupported("cuMemHostAlloc returned a null pointer".into()))?;
        let mut buf = PinnedHostBuffer { ctx: ctx.clone(), host, device: 0, len };
        // SAFETY: `host..host+len` was just allocated for us and nothing else uses it yet.
        unsafe { ptr::write_bytes(host.as_ptr(), 0, len) };
        let mut device: cu::CUdeviceptr = 0;
        // SAFETY: `p` is a DEVICEMAP allocation of the current context; flags must be 0.
        check("cuMemHostGetDevicePointer", unsafe { cu::cuMemHostGetDevicePointer_v2(&mut device, p, 0) })?;
        buf.device = device;
        Ok(buf)
    }

    /// Host address of the first byte (page-aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.host.as_ptr()
    }

    /// Address of the mapped view for kernels and copies on any device (equal to the host
    /// address on 64-bit Linux, where addressing is unified).
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context that pinned the memory.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The bytes. `&mut self` proves no copy of this module uses them (see the type docs);
    /// kernels launched with the raw [`device_ptr`](Self::device_ptr) are the launcher's
    /// business.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: our allocation of `len` initialised bytes, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.host.as_ptr(), self.len) }
    }

    /// The bytes, read-only; `&mut self` for the same reason as
    /// [`as_mut_slice`](Self::as_mut_slice).
    pub fn as_slice(&mut self) -> &[u8] {
        self.as_mut_slice()
    }

    /// The buffer as 64-bit atomics (`len / 8` of them): counters a kernel spins on, written
    /// by the host with release stores, or words a kernel writes that the host polls.
    pub fn atomic_u64s(&self) -> &[AtomicU64] {
        // SAFETY: the allocation is page-aligned (so 8-aligned), initialised, lives as long as
        // `&self`, and is only ever accessed through atomics while shared (byte access needs
        // `&mut self`). The GPU side uses volatile or atomic accesses of whole words.
        unsafe { std::slice::from_raw_parts(self.host.as_ptr().cast::<AtomicU64>(), self.len / 8) }
    }

    /// The buffer as 32-bit atomics (`len / 4` of them): flags.
    pub fn atomic_u32s(&self) -> &[AtomicU32] {
        // SAFETY: as for `atomic_u64s`, with 4-byte alignment.
        unsafe { std::slice::from_raw_parts(self.host.as_ptr().cast::<AtomicU32>(), self.len / 4) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let _cur = self.ctx.enter();
        // SAFETY: our allocation, freed once; the safe copies keep an `Arc` of this buffer
        // until they complete, so no copy engine uses it any more.
        let _ = unsafe { cu::cuMemFreeHost(self.host.as_ptr().cast()) };
    }
}

/// What kind of memory an address is, as the driver sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Device memory (`cuMemAlloc`, `cudaMalloc`, a caching allocator's slab, an IPC mapping).
    Device,
    /// Host memory the driver knows: pinned (`cuMemHostAlloc`) or registered.
    Host,
    /// Managed (unified) memory (`cuMemAllocManaged`).
    Managed,
    /// Not memory the driver knows (ordinary pageable host memory, or no memory at all).
    Unknown,
}

/// The answer of [`pointer_info`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    /// What the address is.
    pub kind: MemoryKind,
    /// The device it belongs to (for host memory: the device of the context that pinned it).
    pub ordinal: Option<usize>,
    /// The whole allocation containing the address, `(base, len)`, where the driver says.
    pub allocation: Option<AddressRange>,
}

/// A `(base, len)` pair: an allocation as `cuMemGetAddressRange` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressRange {
    /// First byte of the allocation.
    pub base: u64,
    /// Its length in bytes.
    pub len: usize,
}

impl AddressRange {
    /// Whether `ptr..ptr+len` lies inside this allocation.
    pub fn contains(&self, ptr: u64, len: usize) -> bool {
        ptr >= self.base && ptr.checked_add(len as u64).is_some_and(|end| end <= self.base + self.len as u64)
    }
}

/// What `ptr` is: device memory of which ordinal, pinned host memory, or nothing the driver
/// knows. Validates a user's `register_cuda(ptr, len, ordinal)`: the range must be
/// [`MemoryKind::Device`] of that ordinal and inside [`PointerInfo::allocation`].
///
/// Never fails for a garbage address (that is [`MemoryKind::Unknown`]); fails only without a
/// driver or device.
pub fn pointer_info(ptr: u64) -> Result<PointerInfo> {
    let drv = driver()?;
    // Some drivers want a current context for pointer queries: use the caller's if it has
    // one, else device 0's primary context.
    let ctx0 = drv.context(0)?;
    let _cur = ctx0.enter_if_none()?;
    let mut attrs = [
        Attr::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        Attr::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        Attr::CU_POINTER_ATTRIBUTE_IS_MANAGED,
    ];
    // Each attribute writes at most 8 bytes (an enum, an int, a bool); zeroed words make the
    // width irrelevant on little-endian.
    let mut vals = [0u64; 3];
    let mut data: [*mut c_void; 3] = [ptr::null_mut(); 3];
    for (d, v) in data.iter_mut().zip(vals.iter_mut()) {
        *d = (v as *mut u64).cast();
    }
    // SAFETY: three attributes, three valid 8-byte out-buffers. cuPointerGetAttributes does not
    // fail for an address the driver does not know: it leaves the defaults (zero) in place.
    let r = unsafe { cu::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    if r == cu::CUresult::CUDA_ERROR_INVALID_VALUE {
        // Documented not to happen for unknown addresses; if a driver does it anyway, the
        // address is still not one it knows.
        return Ok(PointerInfo { kind: MemoryKind::Unknown, ordinal: None, allocation: None });
    }
    check("cuPointerGetAttributes", r)?;
    let (mem_type, ordinal, managed) = (vals[0] as u32, vals[1] as u32 as i32, vals[2] != 0);
    let kind = match mem_type {
        _ if managed => MemoryKind::Managed,
        t if t == cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryKind::Device,
        t if t == cu::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemoryKind::Host,
        t if t == cu::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 => MemoryKind::Managed,
        _ => MemoryKind::Unknown,
    };
    if kind == MemoryKind::Unknown {
        return Ok(PointerInfo { kind, ordinal: None, allocation: None });
    }
    let ordinal = usize::try_from(ordinal).ok().filter(|&o| o < drv.device_count());
    let allocation = match (kind, ordinal) {
        (MemoryKind::Device, Some(o)) => Some(drv.context(o)?.address_range(ptr)?),
        _ => host_range(ptr),
    };
    Ok(PointerInfo { kind, ordinal, allocation })
}

/// Range attributes of a host or managed address, where the driver reports them.
fn host_range(ptr: u64) -> Option<AddressRange> {
    let mut base: u64 = 0;
    let mut len: u64 = 0;
    // SAFETY: valid 8-byte out-buffers (a CUdeviceptr and a size_t).
    let a = unsafe {
        cu::cuPointerGetAttribute(
            (&mut base as *mut u64).cast(),
            Attr::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ptr,
        )
    };
    // SAFETY: as above.
    let b = unsafe {
        cu::cuPointerGetAttribute((&mut len as *mut u64).cast(), Attr::CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr)
    };
    (a == cu::CUresult::CUDA_SUCCESS && b == cu::CUresult::CUDA_SUCCESS && len > 0)
        .then_some(AddressRange { base, len: len as usize })
}

impl Context {
    /// The allocation of this device that contains `ptr` (`cuMemGetAddressRange`): how a
    /// sub-range of a larger allocation (a caching allocator's block) is shared over CUDA IPC,
    /// as the allocation's handle plus an offset.
    pub fn address_range(&self, ptr: u64) -> Result<AddressRange> {
        let _cur = self.enter()?;
        let mut base: cu::CUdeviceptr = 0;
        let mut len: usize = 0;
        // SAFETY: valid out-pointers; the driver validates `ptr`.
        check("cuMemGetAddressRange", unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut len, ptr) })?;
        Ok(AddressRange { base, len })
    }
}
