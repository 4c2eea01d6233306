//! Emulated device memory for tests without a GPU (see `Engine::alloc_emulated_staged`,
//! feature `gpu-emulation`): an ordinal no device has, whose "copies" are `memcpy` on the
//! calling thread. Without the feature nothing creates memory of that ordinal.

/// The ordinal of emulated device memory (no driver reports this many devices).
pub const EMULATED_ORDINAL: u32 = u32::MAX;

/// Whether `ordinal` names emulated device memory.
pub fn is_emulated(ordinal: usize) -> bool {
    ordinal == EMULATED_ORDINAL as usize
}

/// The copy of an emulated device: `len` bytes from `src` to `dst`, now.
///
/// # Safety
///
/// `src..src+len` must be readable and `dst..dst+len` writable host memory (emulated device
/// memory is host memory), not overlapping, and nothing else may write either range during
/// the copy.
pub unsafe fn emulated_copy(dst: u64, src: u64, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: the caller's contract above.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
}
