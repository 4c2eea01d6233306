//! CUDA IPC: sharing device memory with another process on the same host.
//!
//! ```text
//!   process A                                   process B
//!   DeviceBuffer (or any cuMemAlloc block)
//!     ipc_export(ptr, len) ──► IpcExport { handle: 64 bytes, offset, len } ──► IpcMapping::open
//!                                (sent in a descriptor)                         (cuIpcOpenMemHandle)
//!                                                                               copies, kernels on
//!                                                                               A's memory (NVLink/PCIe)
//! ```
//!
//! A handle names a whole allocation; a sub-range (a caching allocator's block inside a slab)
//! is shared as the allocation's handle plus an offset, found with `cuMemGetAddressRange`.
//! The exporter must keep the allocation alive while importers use it: that is the
//! protocol's job. A process cannot open its own handles (`cuIpcOpenMemHandle` refuses).

use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::driver::{check, Context};
use super::memory::{check_range, pointer_info, DeviceBuffer, DeviceMemory, MemoryKind};
use crate::error::{Error, Result};

/// A CUDA IPC memory handle (`CUipcMemHandle`): 64 opaque bytes naming one device allocation
/// of the exporting process.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle([u8; IpcMemHandle::LEN]);

impl IpcMemHandle {
    /// Size of a handle in bytes.
    pub const LEN: usize = 64;

    /// The handle as plain bytes (for a descriptor).
    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }

    /// A handle from its bytes, as received from the exporter.
    pub fn from_bytes(bytes: [u8; Self::LEN]) -> IpcMemHandle {
        IpcMemHandle(bytes)
    }

    fn to_raw(self) -> cu::CUipcMemHandle {
        cu::CUipcMemHandle { reserved: self.0.map(|b| b as std::ffi::c_char) }
    }
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcMemHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// A range of device memory as another process can open it: the handle of the allocation
/// that contains it, and where in that allocation the range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// Handle of the whole allocation.
    pub handle: IpcMemHandle,
    /// Offset of the shared range from the allocation's base.
    pub offset: u64,
    /// Length of the shared range.
    pub len: u64,
}

impl IpcExport {
    /// Size of [`to_bytes`](Self::to_bytes).
    pub const WIRE_LEN: usize = IpcMemHandle::LEN + 16;

    /// Handle, offset and length, little-endian: 80 bytes.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut out = [0u8; Self::WIRE_LEN];
        out[..64].copy_from_slice(&self.handle.0);
        out[64..72].copy_from_slice(&self.offset.to_le_bytes());
        out[72..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// The inverse of [`to_bytes`](Self::to_bytes); `Malformed` if `bytes` has another length.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcExport> {
        if bytes.len() != Self::WIRE_LEN {
            return Err(Error::Malformed {
                what: "CUDA IPC export",
                reason: format!("{} bytes, expected {}", bytes.len(), Self::WIRE_LEN),
            });
        }
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(bytes[r].try_into().unwrap_or([0; 8]));
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&bytes[..64]);
        Ok(IpcExport { handle: IpcMemHandle(handle), offset: word(64..72), len: word(72..80) })
    }
}

/// Exports `ptr..ptr+len`, which must lie inside one device allocation made by `cuMemAlloc`
/// (or `cudaMalloc`, or a caching allocator built on them) in this process.
pub fn ipc_export(ptr: u64, len: usize) -> Result<IpcExport> {
    let info = pointer_info(ptr)?;
    let (MemoryKind::Device, Some(ordinal)) = (info.kind, info.ordinal) else {
        return Err(Error::Unsupported(format!(
            "CUDA IPC export of {ptr:#x}: not device memory ({:?})",
            info.kind
        )));
    };
    let ctx = super::context(ordinal)?;
    let range = ctx.address_range(ptr)?;
    if !range.contains(ptr, len) {
        return Err(Error::OutOfBounds {
            side: crate::error::Side::Local,
            offset: ptr - range.base,
            len: len as u64,
            region_len: range.len as u64,
        });
    }
    let handle = get_handle(&ctx, range.base)?;
    Ok(IpcExport { handle, offset: ptr - range.base, len: len as u64 })
}

fn get_handle(ctx: &Context, base: u64) -> Result<IpcMemHandle> {
    let _cur = ctx.enter()?;
    let mut raw = cu::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: valid out-pointer; `base` is the base of a live allocation (the driver checks).
    check("cuIpcGetMemHandle", unsafe { cu::cuIpcGetMemHandle(&mut raw, base) })?;
    Ok(IpcMemHandle(raw.reserved.map(|c| c as u8)))
}

impl DeviceBuffer {
    /// Exports `offset..offset+len` of this buffer for another process
    /// ([`IpcMapping::open`]). The buffer must outlive the importer's use.
    pub fn ipc_export(&self, offset: usize, len: usize) -> Result<IpcExport> {
        check_range(offset, len, self.len())?;
        let handle = get_handle(self.context(), self.device_ptr())?;
        Ok(IpcExport { handle, offset: offset as u64, len: len as u64 })
    }
}

/// Another process's device memory, opened here (`cuIpcOpenMemHandle`) and closed on drop.
///
/// As [`DeviceMemory`] it is the exported range (`device_ptr()` is the mapping's base plus the
/// export's offset), so the safe copies of [`Stream`](super::Stream) stay inside it.
pub struct IpcMapping {
    /// The context the mapping lives in; dropped after `cuIpcCloseMemHandle`.
    ctx: Arc<Context>,
    base: u64,
    allocation_len: usize,
    offset: u64,
    len: usize,
}

// SAFETY: a device address is plain data; the driver calls made with it are thread-safe.
unsafe impl Send for IpcMapping {}
// SAFETY: as above.
unsafe impl Sync for IpcMapping {}

impl fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMapping")
            .field("ordinal", &self.ctx.ordinal())
            .field("base", &format_args!("{:#x}", self.base))
            .field("allocation_len", &self.allocation_len)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl IpcMapping {
    /// Opens `export` (made by another process on this host) in `ctx`, the device this
    /// process will access it from (the exporter's device, or a peer of it). Checks that the
    /// exported range lies inside the allocation the handle names.
    pub fn open(ctx: &Arc<Context>, export: &IpcExport) -> Result<IpcMapping> {
        let _cur = ctx.enter()?;
        let mut base: cu::CUdeviceptr = 0;
        let flags = cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: valid out-pointer; the driver validates the handle. Closed in Drop.
        check("cuIpcOpenMemHandle", unsafe {
            cu::cuIpcOpenMemHandle_v2(&mut base, export.handle.to_raw(), flags)
        })?;
        // From here on, Drop closes the mapping on every path.
        let mut mapping = IpcMapping { ctx: ctx.clone(), base, allocation_len: 0, offset: 0, len: 0 };
        let range = ctx.address_range(base)?;
        mapping.allocation_len = range.len;
        let (offset, len) = (usize::try_from(export.offset), usize::try_from(export.len));
        let (Ok(offset), Ok(len)) = (offset, len) else {
            return Err(Error::Malformed {
                what: "CUDA IPC export",
                reason: "range does not fit usize".into(),
            });
        };
        check_range(offset, len, range.len)?;
        mapping.offset = export.offset;
        mapping.len = len;
        Ok(mapping)
    }

    /// Base address of the whole mapped allocation.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Length of the whole mapped allocation.
    pub fn allocation_len(&self) -> usize {
        self.allocation_len
    }
}

// SAFETY: base+offset..+len was checked inside the mapped allocation, which stays mapped in
// `ctx` until Drop; the values never change.
unsafe impl DeviceMemory for IpcMapping {
    fn device_ptr(&self) -> u64 {
        self.base + self.offset
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let _cur = self.ctx.enter();
        // SAFETY: opened by us in `open`, closed once. The safe copies hold an `Arc` of the
        // mapping until they complete, so no copy engine uses it any more.
        let _ = unsafe { cu::cuIpcCloseMemHandle(self.base) };
    }
}
