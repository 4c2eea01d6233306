//! The C API of fabric: `include/fabric.h` (made from this crate by cbindgen; the test
//! `tests/header.rs` fails when the two differ), in `libfabric_c.so` and `libfabric_c.a`.
//!
//! ```c
//! fabric_engine *e;
//! fabric_engine_options o;
//! fabric_engine_options_init(&o);
//! o.provider = "shm";
//! if (fabric_engine_new(&o, &e) != FABRIC_STATUS_OK) fprintf(stderr, "%s\n", fabric_last_error());
//! // register memory, hand its descriptor to a peer (any channel), post, then test or wait:
//! fabric_op *op;
//! fabric_write_imm(e, src, 0, dst, 0, len, 7, &op);
//! while (fabric_op_test(op) == FABRIC_STATUS_IN_PROGRESS) { /* other work */ }
//! fabric_op_free(op);
//! ```
//!
//! Files: `status.rs` (status codes, the last error, the boundary no panic crosses),
//! `engine.rs` (options, engines, peers), `memory.rs` (regions and remote regions), `op.rs`
//! (operation handles: test, wait, callback, free), `transfer.rs` (transfers, batches,
//! messages, counters). `docs/c-api.md` is the guide; `nixl/` holds the NIXL backend
//! plugin built on this API (`docs/nixl.md`).
//!
//! Conventions, for every function: handles are opaque pointers made by a `*_new`,
//! `fabric_register`/`fabric_alloc` or a transfer call and given back with their `*_free`;
//! a NULL handle or pointer argument is `FABRIC_STATUS_ERR_INVALID`, never a crash; every error
//! status is negative and `fabric_last_error()` holds its message on the calling thread;
//! calls that set up (engines, peers, registration, remote regions) block until done, and
//! calls that move data never block: they return an operation handle, or the error at once
//! when the engine refuses the operation before posting anything (an offset out of bounds,
//! an unknown peer); what fails after posting (a dead peer, a refused access) is the
//! handle's status. Every handle may be used from any thread.

mod engine;
mod memory;
mod op;
mod status;
mod transfer;

pub use engine::*;
pub use memory::*;
pub use op::*;
pub use status::{fabric_last_error, fabric_status_name, FabricStatus};
pub use transfer::*;

use status::{FabricStatus as S, Failure, Outcome};

/// `Err(FABRIC_STATUS_ERR_INVALID)` for a NULL pointer argument.
pub(crate) fn non_null<T>(what: &str, p: *const T) -> Result<(), Failure> {
    if p.is_null() {
        Err(Failure::invalid(format!("{what} is NULL")))
    } else {
        Ok(())
    }
}

/// `len` elements at `p` as a slice (empty for `len` 0, whatever `p` is).
///
/// # Safety
///
/// With `len` > 0, `p` is NULL (an error) or readable for `len` elements that nothing
/// writes during the call.
pub(crate) unsafe fn slice_in<'a, T>(what: &str, p: *const T, len: usize) -> Result<&'a [T], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    non_null(what, p)?;
    // SAFETY: the caller's contract; `p` is non-null.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// Copies `bytes` into the caller's `buf` of `cap` bytes and its length into `*len`;
/// `FABRIC_STATUS_ERR_BUFFER_TOO_SMALL` (with `*len` set, nothing copied) if it does not fit.
///
/// # Safety
///
/// `buf` is writable for `cap` bytes (may be NULL with `cap` 0); `len` is writable.
pub(crate) unsafe fn copy_out(bytes: &[u8], buf: *mut u8, cap: usize, len: *mut usize) -> Outcome {
    non_null("len", len)?;
    // SAFETY: the caller's contract.
    unsafe { len.write(bytes.len()) };
    if cap < bytes.len() {
        return Err(Failure::new(
            S::ErrBufferTooSmall,
            format!("{} bytes do not fit in a buffer of {cap}", bytes.len()),
        ));
    }
    non_null("buf", buf)?;
    // SAFETY: `buf` is writable for `cap` >= bytes.len() bytes (the caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    Ok(S::Ok)
}
