//! Operation contexts: one `fi_context2` slot per posted operation, at an address that stays
//! put until its completion is read, and the completion's context mapped back to the engine's
//! token (checked to be one of ours before anything is read).

use std::ffi::c_void;
use std::ptr::{self, NonNull};

use libfabric_sys as sys;

use crate::provider::{Op, PeerHandle};

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
    /// The operation as posted: its peer names whom it waits on (`shm/` fails a dead
    /// peer's operations itself).
    op: Op,
}

/// What an in-flight slot holds, for the shm bookkeeping (`shm/`).
#[derive(Debug, Clone, Copy)]
pub(super) struct InFlightOp {
    pub(super) slot: NonNull<OpCtx>,
    pub(super) token: u64,
    pub(super) op: Op,
}

impl InFlightOp {
    /// The peer the operation waits on (`None` for a posted receive).
    pub(super) fn peer(&self) -> Option<PeerHandle> {
        match self.op {
            Op::Write { peer, .. } | Op::Read { peer, .. } | Op::Send { peer, .. } => Some(peer),
            Op::Recv { .. } => None,
        }
    }
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
            .map(|_| OpCtx {
                fi: sys::fi_context2::default(),
                token: 0,
                in_flight: false,
                op: Op::Recv { local: crate::provider::LocalSlice { addr: 0, len: 0, desc: 0 } },
            })
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

    /// A slot for operation `op` with `token`, marked in flight.
    pub(super) fn take(&mut self, token: u64, op: &Op) -> NonNull<OpCtx> {
        if self.free.is_empty() {
            self.grow();
        }
        let slot = self.free.pop().expect("grow() added CTX_CHUNK free slots");
        // SAFETY: the slot is in a live chunk and not in flight, so the provider is not using
        // it; writes go through raw pointers.
        unsafe {
            ptr::addr_of_mut!((*slot.as_ptr()).token).write(token);
            ptr::addr_of_mut!((*slot.as_ptr()).in_flight).write(true);
            ptr::addr_of_mut!((*slot.as_ptr()).op).write(*op);
        }
        slot
    }

    /// Every slot in flight, with what it holds.
    pub(super) fn in_flight(&self) -> Vec<InFlightOp> {
        let mut out = Vec::new();
        for c in &self.chunks {
            for i in 0..CTX_CHUNK {
                // SAFETY: i < CTX_CHUNK, inside a live chunk; the fields read are ours (the
                // provider only uses the leading `fi_context2`), read through raw pointers.
                unsafe {
                    let p = c.as_ptr().add(i);
                    if ptr::addr_of!((*p).in_flight).read() {
                        out.push(InFlightOp {
                            slot: NonNull::new_unchecked(p),
                            token: ptr::addr_of!((*p).token).read(),
                            op: ptr::addr_of!((*p).op).read(),
                        });
                    }
                }
            }
        }
        out
    }

    /// Gives up on an in-flight slot whose completion may never come (its peer died, or was
    /// removed): it is no longer in flight, so a late completion for it is ignored by
    /// [`CtxPool::complete`], and it is never handed out again (a late completion must not
    /// name a newer operation). Bounded: only operations caught by a peer's departure.
    pub(super) fn abandon(&mut self, slot: NonNull<OpCtx>) {
        // SAFETY: slot is one of ours (from `in_flight`); only our own field is written.
        unsafe { ptr::addr_of_mut!((*slot.as_ptr()).in_flight).write(false) };
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
        self.complete_op(raw).map(|(token, _)| token)
    }

    /// Whether `slot` is in flight with `token` (not completed, abandoned or reused since).
    pub(super) fn holds(&self, slot: NonNull<OpCtx>, token: u64) -> bool {
        // SAFETY: slots handed out by `take` stay inside live chunks until the pool is
        // dropped; only our own fields are read, through raw pointers.
        unsafe {
            let p = slot.as_ptr();
            ptr::addr_of!((*p).in_flight).read() && ptr::addr_of!((*p).token).read() == token
        }
    }

    /// As [`CtxPool::complete`], with the operation as posted (its peer).
    pub(super) fn complete_op(&mut self, raw: *mut c_void) -> Option<(u64, Op)> {
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
        let (token, in_flight, op) = unsafe {
            let p = slot.as_ptr();
            let r = (
                ptr::addr_of!((*p).token).read(),
                ptr::addr_of!((*p).in_flight).read(),
                ptr::addr_of!((*p).op).read(),
            );
            ptr::addr_of_mut!((*p).in_flight).write(false);
            r
        };
        if !in_flight {
            return None;
        }
        self.free.push(slot);
        Some((token, op))
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
        let op = Op::Recv { local: crate::provider::LocalSlice { addr: 0, len: 0, desc: 0 } };
        let a = pool.take(7, &op);
        let b = pool.take(8, &op);
        assert_eq!(pool.in_flight().len(), 2);
        assert_ne!(a, b);
        assert_eq!(pool.complete(b.as_ptr().cast()), Some(8));
        // A second completion for the same slot is refused.
        assert_eq!(pool.complete(b.as_ptr().cast()), None);
        let mut x = 0u64;
        assert_eq!(pool.complete((&mut x as *mut u64).cast()), None);
        // Unaligned pointer into a chunk.
        assert_eq!(pool.complete(a.as_ptr().cast::<u8>().wrapping_add(1).cast()), None);
        assert_eq!(pool.complete(a.as_ptr().cast()), Some(7));
        assert!(pool.in_flight().is_empty());
        // An abandoned slot is never completed nor handed out again.
        let c = pool.take(9, &op);
        pool.abandon(c);
        assert_eq!(pool.complete(c.as_ptr().cast()), None);
        for t in 0..(3 * CTX_CHUNK as u64) {
            assert_ne!(pool.take(t, &op), c);
        }
        assert!(pool.chunks.len() >= 3);
    }
}
