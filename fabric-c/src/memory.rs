//! Memory: local regions (registered host or CUDA memory) and peers' regions (from their
//! descriptors).

use std::ffi::c_void;

use fabric_async::{MemoryLocation, MemoryRegion, RemoteRegion};
use futures::executor::block_on;

use crate::engine::{engine_ref, FabricEngine};
use crate::status::{boundary, boundary_void, FabricStatus, Failure};
use crate::{copy_out, non_null, slice_in};

/// Registered local memory: the source of writes, the destination of reads and of peers'
/// writes.
pub struct FabricRegion {
    pub(crate) region: MemoryRegion,
}

/// A peer's region, from its descriptor: the destination of writes, the source of reads.
pub struct FabricRemote {
    pub(crate) remote: RemoteRegion,
}

/// Registers `len` bytes at `ptr` in place, without copying: host memory for `cuda_device`
/// -1, else device memory of that CUDA ordinal (its range is checked against the driver's
/// allocation). Blocks for the registration.
///
/// # Safety
///
/// `engine` is a live engine; `out` is writable. `ptr..ptr + len` stays allocated and is
/// not freed or moved by other means until the region is freed with `fabric_region_free`
/// **and** every operation that used it has completed (`fabric_op_test` returned something
/// other than `FABRIC_STATUS_IN_PROGRESS`, or its engine was freed): peers may write into it at any
/// time until then.
#[no_mangle]
pub unsafe extern "C" fn fabric_register(
    engine: *const FabricEngine,
    ptr: *mut c_void,
    len: usize,
    cuda_device: i32,
    out: *mut *mut FabricRegion,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        non_null("out", out)?;
        non_null("ptr", ptr)?;
        let region = if cuda_device < 0 {
            // SAFETY: the caller keeps the range valid for as long as the region and its
            // operations need it (this function's contract); nothing else owns it.
            block_on(unsafe { e.register_host(ptr as u64, len, ()) })?
        } else {
            // SAFETY: as above, for device memory of `cuda_device` (checked by the engine).
            block_on(unsafe { e.register_cuda(ptr as u64, len, cuda_device as u32) })?
        };
        let r = Box::new(FabricRegion { region });
        // SAFETY: checked non-null; the caller's contract.
        unsafe { out.write(Box::into_raw(r)) };
        Ok(FabricStatus::Ok)
    })
}

/// Allocates `len` zeroed bytes and registers them: host memory for `cuda_device` -1, else
/// device memory of that CUDA ordinal. The memory is the region's: `fabric_region_ptr`
/// gives its address, and it is freed with the region once no operation uses it.
///
/// # Safety
///
/// `engine` is a live engine; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_alloc(
    engine: *const FabricEngine,
    len: usize,
    cuda_device: i32,
    out: *mut *mut FabricRegion,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        non_null("out", out)?;
        let location = if cuda_device < 0 {
            MemoryLocation::Host
        } else {
            MemoryLocation::Cuda { ordinal: cuda_device as u32 }
        };
        let region = block_on(e.alloc_in(len, location))?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { out.write(Box::into_raw(Box::new(FabricRegion { region }))) };
        Ok(FabricStatus::Ok)
    })
}

/// The address of the region's byte 0 (a device address for CUDA memory); NULL for NULL.
///
/// # Safety
///
/// `region` is NULL or a live region.
#[no_mangle]
pub unsafe extern "C" fn fabric_region_ptr(region: *const FabricRegion) -> *mut c_void {
    // SAFETY: the caller's contract.
    match unsafe { region.as_ref() } {
        Some(r) => r.region.device_ptr().map_or(r.region.as_ptr() as *mut c_void, |p| p as *mut c_void),
        None => std::ptr::null_mut(),
    }
}

/// The region's length in bytes (0 for NULL).
///
/// # Safety
///
/// `region` is NULL or a live region.
#[no_mangle]
pub unsafe extern "C" fn fabric_region_len(region: *const FabricRegion) -> usize {
    // SAFETY: the caller's contract.
    unsafe { region.as_ref() }.map_or(0, |r| r.region.len())
}

/// Copies the region's descriptor (bytes for a peer's `fabric_remote_new`) into `buf`;
/// `*len` is set to its length, `FABRIC_STATUS_ERR_BUFFER_TOO_SMALL` if `cap` is less.
///
/// # Safety
///
/// `region` is a live region; `buf` is writable for `cap` bytes; `len` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_region_descriptor(
    region: *const FabricRegion,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { region.as_ref() }.ok_or_else(|| Failure::invalid("region is NULL"))?;
        let bytes = r.region.descriptor().to_bytes();
        // SAFETY: the caller's contract.
        unsafe { copy_out(&bytes, buf, cap, len) }
    })
}

/// Frees a region handle. The registration is closed, and the memory released (for
/// `fabric_alloc`'s), once no operation uses it any more; peers holding its descriptor get
/// `FABRIC_STATUS_ERR_STALE` from then on. NULL is a no-op.
///
/// # Safety
///
/// `region` is NULL or a region not freed before.
#[no_mangle]
pub unsafe extern "C" fn fabric_region_free(region: *mut FabricRegion) {
    if region.is_null() {
        return;
    }
    // SAFETY: the caller's contract: made by Box::into_raw here.
    boundary_void(|| drop(unsafe { Box::from_raw(region) }));
}

/// A peer's region from its descriptor bytes, adding the owner as a peer if it is not one.
/// Blocks (on shm the owner is asked once whether the descriptor is live).
///
/// # Safety
///
/// `engine` is a live engine; `desc` is readable for `len` bytes; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_remote_new(
    engine: *const FabricEngine,
    desc: *const u8,
    len: usize,
    out: *mut *mut FabricRemote,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        non_null("out", out)?;
        // SAFETY: the caller's contract.
        let d = unsafe { slice_in("desc", desc, len) }?;
        let remote = block_on(e.remote_region(d))?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { out.write(Box::into_raw(Box::new(FabricRemote { remote }))) };
        Ok(FabricStatus::Ok)
    })
}

/// The id of the peer that owns the region (`u32::MAX` for NULL).
///
/// # Safety
///
/// `remote` is NULL or a live remote region.
#[no_mangle]
pub unsafe extern "C" fn fabric_remote_peer(remote: *const FabricRemote) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { remote.as_ref() }.map_or(u32::MAX, |r| r.remote.peer().0)
}

/// The remote region's length in bytes (0 for NULL).
///
/// # Safety
///
/// `remote` is NULL or a live remote region.
#[no_mangle]
pub unsafe extern "C" fn fabric_remote_len(remote: *const FabricRemote) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { remote.as_ref() }.map_or(0, |r| r.remote.len())
}

/// Frees a remote region handle (operations through it keep what they need). NULL is a
/// no-op.
///
/// # Safety
///
/// `remote` is NULL or a remote region not freed before.
#[no_mangle]
pub unsafe extern "C" fn fabric_remote_free(remote: *mut FabricRemote) {
    if remote.is_null() {
        return;
    }
    // SAFETY: the caller's contract: made by Box::into_raw here.
    boundary_void(|| drop(unsafe { Box::from_raw(remote) }));
}

/// The region behind a handle that C code may pass as NULL.
///
/// # Safety
///
/// `r` is NULL or a live region handle (from `fabric_register`/`fabric_alloc`, not freed).
pub(crate) unsafe fn region_ref<'a>(what: &str, r: *const FabricRegion) -> Result<&'a MemoryRegion, Failure> {
    // SAFETY: the caller's contract.
    unsafe { r.as_ref() }.map(|r| &r.region).ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}

/// As [`region_ref`], for remote regions.
///
/// # Safety
///
/// `r` is NULL or a live remote region handle (from `fabric_remote_new`, not freed).
pub(crate) unsafe fn remote_ref<'a>(what: &str, r: *const FabricRemote) -> Result<&'a RemoteRegion, Failure> {
    // SAFETY: the caller's contract.
    unsafe { r.as_ref() }.map(|r| &r.remote).ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}
