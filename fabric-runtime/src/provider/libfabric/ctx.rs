//! Operation contexts: one `fi_context2` slot per posted operation, at an address that stays
//! put until its completion is read, and the completion's context mapped back to the engine's
//! token (checked to be one of ours before anything is read).

use std::ffi::c_void;
use std::ptr::{self, NonNull};

use libfabric_sys as sys;

/// `OpCtx` slots allocated at a time; a chunk is never moved or freed before the domain is
/// dropped, so a slot's address stays valid for the provider.
const CTX_CHUNK: usize = 64;

/// The context of one posted operation. `FI_CONTEXT`/`FI_CONTEXT2` mode lets the provider use
/// the first bytes as scratch space until the operation completes, so a slot must not move
/// or be reused until its completion has been read.
#[repr(C)]
pub(super) struct OpCtx {
    fi: sys::fi_context2,
    token: u64,
    in_flight: bool,
}

/// A pool of [`OpCtx`] slots in chunks that never move. Slots are only touched through raw
/// pointers, never references, because the provider writes into them behind our back.
pub(super) struct CtxPool {
    chunks: Vec<NonNull<OpCtx>>,
    free: Vec<NonNull<OpCtx>>,
}

impl CtxPool {
    pub(super) fn new() -> CtxPool {
        CtxPool { chunks: Vec::new(), free: Vec::new() }
    }

    fn grow(&mut self) {
        let chunk: Box<[OpCtx]> = (0..CTX_CHUNK)
            .map(|_| OpCtx { fi: sys::fi_context2::default(), token: 0, in_flight: false })
            .collect();
        let base = Box::into_raw(chunk) as *mut OpCtx;
        // SAFETY: Box::into_raw never returns NULL.
        let base = unsafe { NonNull::new_unchecked(base) };
        self.chunks.push(base);
        for i in (0..CTX_CHUNK).rev() {
            // SAFETY: i < CTX_CHUNK, inside the allocation just made.
            self.free.push(unsafe { base.add(i) });
        }
    }

    /// A slot for an operation with `token`, marked in flight.
    pub(super) fn take(&mut self, token: u64) -> NonNull<OpCtx> {
        if self.free.is_empty() {
            self.grow();
        }
        let slot = self.free.pop().expect("grow() added CTX_CHUNK free slots");
        // SAFETY: the slot is in a live chunk and not in flight, so the provider is not using
        // it; writes go through raw pointers.
        unsafe {
            ptr::addr_of_mut!((*slot.as_ptr()).token).write(token);
            ptr::addr_of_mut!((*slot.as_ptr()).in_flight).write(true);
        }
        slot
    }

    /// Returns a slot whose post failed (the provider never saw it).
    pub(super) fn untake(&mut self, slot: NonNull<OpCtx>) {
        // SAFETY: slot came from take() and the post that used it returned an error.
        unsafe { ptr::addr_of_mut!((*slot.as_ptr()).in_flight).write(false) };
        self.free.push(slot);
    }

    /// The token of the operation whose context is `raw`, releasing its slot. `None` if `raw`
    /// is not one of our in-flight slots (checked by address before anything is read).
    pub(super) fn complete(&mut self, raw: *mut c_void) -> Option<u64> {
        let addr = raw as usize;
        let size = std::mem::size_of::<OpCtx>();
        let owned = self.chunks.iter().any(|c| {
            let base = c.as_ptr() as usize;
            addr >= base && addr < base + CTX_CHUNK * size && (addr - base).is_multiple_of(size)
        });
        if !owned {
            return None;
        }
        let slot = NonNull::new(raw as *mut OpCtx)?;
        // SAFETY: slot is the start of an OpCtx inside one of our live chunks (checked above);
        // the provider is done with it since it reported its completion.
        let (token, in_flight) = unsafe {
            let p = slot.as_ptr();
            let r = (ptr::addr_of!((*p).token).read(), ptr::addr_of!((*p).in_flight).read());
            ptr::addr_of_mut!((*p).in_flight).write(false);
            r
        };
        if !in_flight {
            return None;
        }
        self.free.push(slot);
        Some(token)
    }
}

impl Drop for CtxPool {
    fn drop(&mut self) {
        for c in self.chunks.drain(..) {
            let slice = ptr::slice_from_raw_parts_mut(c.as_ptr(), CTX_CHUNK);
            // SAFETY: each chunk came from Box::into_raw of a CTX_CHUNK-long boxed slice and is
            // freed once; the endpoint and CQ are closed before the pool is dropped, so the
            // provider no longer touches any slot.
            drop(unsafe { Box::from_raw(slice) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctx_pool_round_trips_and_rejects_foreign_pointers() {
        let mut pool = CtxPool::new();
        let a = pool.take(7);
        let b = pool.take(8);
        assert_ne!(a, b);
        assert_eq!(pool.complete(b.as_ptr().cast()), Some(8));
        // A second completion for the same slot is refused.
        assert_eq!(pool.complete(b.as_ptr().cast()), None);
        let mut x = 0u64;
        assert_eq!(pool.complete((&mut x as *mut u64).cast()), None);
        // Unaligned pointer into a chunk.
        assert_eq!(pool.complete(a.as_ptr().cast::<u8>().wrapping_add(1).cast()), None);
        assert_eq!(pool.complete(a.as_ptr().cast()), Some(7));
        for t in 0..(3 * CTX_CHUNK as u64) {
            let _ = pool.take(t);
        }
        assert!(pool.chunks.len() >= 3);
    }
}
