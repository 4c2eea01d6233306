//! Transfers (write, write_imm, read, imm-only writes, paged writes, batches), two-sided
//! messages and immediate counters. Every transfer call checks its arguments, posts, and
//! returns an operation handle at once (`op.rs`); none of them blocks.

use std::collections::HashMap;

use fabric_async::{BatchEntry, BatchOp, Engine, PageLayout, PeerId, ScatterEntry};
use futures::future::{try_join_all, BoxFuture};
use futures::FutureExt;

use crate::engine::{engine_ref, FabricEngine};
use crate::memory::{region_ref, remote_ref, FabricRegion, FabricRemote};
use crate::op::{engine_op_out, op_out, FabricOp};
use crate::status::{boundary, FabricStatus, Failure};
use crate::{non_null, slice_in};

/// Writes `len` bytes of `src` at `src_off` into `dst` at `dst_off`.
///
/// # Safety
///
/// `engine`, `src` and `dst` are live handles of one engine; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_write(
    engine: *const FabricEngine,
    src: *const FabricRegion,
    src_off: u64,
    dst: *const FabricRemote,
    dst_off: u64,
    len: u64,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract (all three).
        let (e, s, d) = unsafe { (engine_ref(engine)?, region_ref("src", src)?, remote_ref("dst", dst)?) };
        // SAFETY: the caller's contract.
        unsafe { engine_op_out(e.write(s, src_off, d, dst_off, len), out) }
    })
}

/// As `fabric_write`, and the owner of `dst` counts arrivals of `imm` once the bytes have
/// landed: `fabric_write_arrivals` of them (one per NIC shard; 1 with one NIC).
///
/// # Safety
///
/// As for `fabric_write`.
#[no_mangle]
pub unsafe extern "C" fn fabric_write_imm(
    engine: *const FabricEngine,
    src: *const FabricRegion,
    src_off: u64,
    dst: *const FabricRemote,
    dst_off: u64,
    len: u64,
    imm: u32,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract (all three).
        let (e, s, d) = unsafe { (engine_ref(engine)?, region_ref("src", src)?, remote_ref("dst", dst)?) };
        // SAFETY: the caller's contract.
        unsafe { engine_op_out(e.write_imm(s, src_off, d, dst_off, len, imm), out) }
    })
}

/// An imm-only write: no bytes, exactly one arrival of `imm` at the owner of `dst`.
///
/// # Safety
///
/// `engine` and `dst` are live handles of one engine; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_imm(
    engine: *const FabricEngine,
    dst: *const FabricRemote,
    imm: u32,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract (both).
        let (e, d) = unsafe { (engine_ref(engine)?, remote_ref("dst", dst)?) };
        // SAFETY: the caller's contract.
        unsafe { engine_op_out(e.imm(d, imm), out) }
    })
}

/// Reads `len` bytes of the peer's `src` at `src_off` into the local `dst` at `dst_off`.
///
/// # Safety
///
/// `engine`, `dst` and `src` are live handles of one engine; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_read(
    engine: *const FabricEngine,
    dst: *const FabricRegion,
    dst_off: u64,
    src: *const FabricRemote,
    src_off: u64,
    len: u64,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract (all three).
        let (e, d, s) = unsafe { (engine_ref(engine)?, region_ref("dst", dst)?, remote_ref("src", src)?) };
        // SAFETY: the caller's contract.
        unsafe { engine_op_out(e.read(d, dst_off, s, src_off, len), out) }
    })
}

/// How many arrivals of the immediate `fabric_write_imm` of `len` bytes into `dst` makes at
/// its owner (what its counter wait should ask for).
///
/// # Safety
///
/// `engine` and `dst` are live handles of one engine; `n` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_write_arrivals(
    engine: *const FabricEngine,
    dst: *const FabricRemote,
    len: u64,
    n: *mut u64,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract (both).
        let (e, d) = unsafe { (engine_ref(engine)?, remote_ref("dst", dst)?) };
        non_null("n", n)?;
        let v = e.write_arrivals(d, len)?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { n.write(v) };
        Ok(FabricStatus::Ok)
    })
}

/// How many arrivals of the immediate `fabric_write_paged` of `pages` pages into `dst` makes
/// at its owner.
///
/// # Safety
///
/// `engine` and `dst` are live handles of one engine; `n` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_paged_arrivals(
    engine: *const FabricEngine,
    dst: *const FabricRemote,
    pages: usize,
    n: *mut u64,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract (both).
        let (e, d) = unsafe { (engine_ref(engine)?, remote_ref("dst", dst)?) };
        non_null("n", n)?;
        let v = e.paged_arrivals(d, pages)?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { n.write(v) };
        Ok(FabricStatus::Ok)
    })
}

/// The geometry of a paged write: page `i` of a list is `page_len` bytes at
/// `offset + i * stride` of its region.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FabricPageLayout {
    /// Bytes per page (non-zero).
    pub page_len: u64,
    /// Distance between source pages (at least `page_len`).
    pub src_stride: u64,
    /// Distance between destination pages (at least `page_len`).
    pub dst_stride: u64,
    /// Offset of source page 0.
    pub src_offset: u64,
    /// Offset of destination page 0.
    pub dst_offset: u64,
}

/// Writes page `src_pages[i]` of `src` into page `dst_pages[i]` of `dst` for each of the `n`
/// pairs (KV-cache blocks), in one call. With `imm` >= 0 the owner counts arrivals of
/// `(uint32_t)imm` (one per page with one NIC); -1: none. Everything is checked before
/// anything is posted (every page inside its region, no destination page twice).
///
/// # Safety
///
/// `engine`, `src` and `dst` are live handles of one engine; `layout` is readable;
/// `src_pages` and `dst_pages` are readable for `n` entries each; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_write_paged(
    engine: *const FabricEngine,
    src: *const FabricRegion,
    dst: *const FabricRemote,
    layout: *const FabricPageLayout,
    src_pages: *const u32,
    dst_pages: *const u32,
    n: usize,
    imm: i64,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract (all three).
        let (e, s, d) = unsafe { (engine_ref(engine)?, region_ref("src", src)?, remote_ref("dst", dst)?) };
        // SAFETY: the caller's contract.
        let l = unsafe { layout.as_ref() }.ok_or_else(|| Failure::invalid("layout is NULL"))?;
        // SAFETY: the caller's contract (both lists).
        let (sp, dp) =
            unsafe { (slice_in("src_pages", src_pages, n)?, slice_in("dst_pages", dst_pages, n)?) };
        let imm = match imm {
            -1 => None,
            v => Some(u32::try_from(v).map_err(|_| Failure::invalid(format!("imm {v}: -1 or 0..2^32")))?),
        };
        let layout = PageLayout {
            page_len: l.page_len,
            src_stride: l.src_stride,
            dst_stride: l.dst_stride,
            src_offset: l.src_offset,
            dst_offset: l.dst_offset,
        };
        // SAFETY: the caller's contract.
        unsafe { engine_op_out(e.write_paged(s, d, &layout, sp, dp, imm), out) }
    })
}

/// The direction of `fabric_batch`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricBatchOp {
    /// Local bytes into the peers' regions.
    Write = 0,
    /// Peers' bytes into the local regions.
    Read = 1,
}

/// One piece of a batch: `len` bytes between `local` at `local_off` and `remote` at
/// `remote_off`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FabricBatchEntry {
    /// The local region (source of a write, destination of a read).
    pub local: *const FabricRegion,
    /// Offset in `local`.
    pub local_off: u64,
    /// The peer's region (destination of a write, source of a read).
    pub remote: *const FabricRemote,
    /// Offset in `remote`.
    pub remote_off: u64,
    /// Bytes to move.
    pub len: u64,
}

/// Moves `n` entries, each between any local and any remote region, as one operation: all
/// checked before anything is posted, handed to the reactor at once, and finished when the
/// last one is (with the first error if any failed). Host memory and GPUDirect regions take
/// one batched path, and so do GPU regions of processes on this host reached through CUDA
/// IPC (one gate of copies, reads included); staged GPU memory, or CUDA IPC mixed with NIC
/// paths in one batch, is moved entry by entry (a write batch as one scatter per local
/// region). No immediates: announce a finished batch with `fabric_send` or `fabric_imm`.
///
/// # Safety
///
/// `engine` is a live engine; `entries` is readable for `n` entries whose handles are live
/// handles of that engine; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_batch(
    engine: *const FabricEngine,
    op: FabricBatchOp,
    entries: *const FabricBatchEntry,
    n: usize,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        // SAFETY: the caller's contract.
        let raw = unsafe { slice_in("entries", entries, n) }?;
        let mut list = Vec::with_capacity(raw.len());
        for (i, r) in raw.iter().enumerate() {
            // SAFETY: the caller's contract: every entry's handles are live.
            let (local, remote) = unsafe {
                (
                    region_ref(&format!("entries[{i}].local"), r.local)?,
                    remote_ref(&format!("entries[{i}].remote"), r.remote)?,
                )
            };
            list.push(BatchEntry {
                local,
                local_off: r.local_off,
                remote,
                remote_off: r.remote_off,
                len: r.len,
            });
        }
        let op = match op {
            FabricBatchOp::Write => BatchOp::Write,
            FabricBatchOp::Read => BatchOp::Read,
        };
        let mut batch = e.batch(op, &list);
        match batch.refused() {
            // Staged GPU ends, or IPC mixed with NIC paths: entry by entry.
            // SAFETY: the caller's contract.
            Some(fabric_async::Error::Unsupported(_)) => unsafe { op_out(entry_by_entry(e, op, &list), out) },
            Some(err) => Err(err.into()),
            // SAFETY: the caller's contract.
            None => unsafe { op_out(batch, out) },
        }
    })
}

/// A batch the engine does not take whole (staged GPU ends, or CUDA IPC mixed with NIC
/// paths): writes as one scatter per local region, reads one by one; all posted now.
fn entry_by_entry(
    e: &Engine,
    op: BatchOp,
    list: &[BatchEntry<'_>],
) -> BoxFuture<'static, fabric_async::Result<()>> {
    let mut futs = Vec::new();
    match op {
        BatchOp::Read => {
            for b in list {
                futs.push(e.read(b.local, b.local_off, b.remote, b.remote_off, b.len));
            }
        }
        BatchOp::Write => {
            // Per local region (in order of first use): its remote regions as a group.
            let mut slot: HashMap<*const fabric_async::MemoryRegion, usize> = HashMap::new();
            let mut groups: Vec<Vec<&BatchEntry<'_>>> = Vec::new();
            for b in list {
                let i = *slot.entry(b.local as *const _).or_insert_with(|| {
                    groups.push(Vec::new());
                    groups.len() - 1
                });
                groups[i].push(b);
            }
            for entries in groups {
                let mut members = Vec::new();
                let mut index: HashMap<*const fabric_async::RemoteRegion, usize> = HashMap::new();
                let mut scatter = Vec::with_capacity(entries.len());
                for b in &entries {
                    let m = *index.entry(b.remote as *const _).or_insert_with(|| {
                        members.push(b.remote.clone());
                        members.len() - 1
                    });
                    scatter.push(ScatterEntry {
                        member: m,
                        src_off: b.local_off,
                        dst_off: b.remote_off,
                        len: b.len,
                    });
                }
                match e.peer_group(members) {
                    Ok(g) => futs.push(e.scatter(entries[0].local, &g, &scatter, None)),
                    Err(err) => return futures::future::ready(Err(err)).boxed(),
                }
            }
        }
    }
    try_join_all(futs).map(|r| r.map(|_| ())).boxed()
}

/// Sends a small message (at most `fabric_engine_max_msg_size` bytes, copied: `msg` is free
/// at once) to `peer`, which takes it with `fabric_try_recv`. Messages are not ordered with
/// writes: send one that announces a write after the write's operation finished.
///
/// # Safety
///
/// `engine` is a live engine; `msg` is readable for `len` bytes; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_send(
    engine: *const FabricEngine,
    peer: u32,
    msg: *const u8,
    len: usize,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        // SAFETY: the caller's contract.
        let m = unsafe { slice_in("msg", msg, len) }?;
        // SAFETY: the caller's contract.
        unsafe { engine_op_out(e.send(PeerId(peer), m), out) }
    })
}

/// Takes the next message from any peer if one is there: copies it into `buf`, its length
/// into `*len` and its sender's id into `*peer` (`UINT32_MAX` when the transport does not
/// say). `FABRIC_STATUS_ERR_AGAIN` when there is none (nothing is taken). `cap` must be at least
/// `fabric_engine_max_msg_size`, so that no message is ever cut or lost. Never blocks.
///
/// # Safety
///
/// `engine` is a live engine; `buf` is writable for `cap` bytes; `len` and `peer` are
/// writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_try_recv(
    engine: *const FabricEngine,
    peer: *mut u32,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        non_null("peer", peer)?;
        non_null("len", len)?;
        non_null("buf", buf)?;
        if cap < e.max_msg_size() {
            return Err(Failure::invalid(format!(
                "cap {cap} is less than the engine's max_msg_size {}",
                e.max_msg_size()
            )));
        }
        // A receive taken only by the poll that returns it: dropping it pending loses nothing.
        match e.recv().now_or_never() {
            None => Err(Failure::new(FabricStatus::ErrAgain, "no message")),
            Some(Err(err)) => Err(err.into()),
            Some(Ok((from, bytes))) => {
                // SAFETY: `buf` is writable for `cap` >= max_msg_size >= bytes.len() bytes,
                // and `peer`/`len` are writable (the caller's contract, checked non-null).
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len());
                    len.write(bytes.len());
                    peer.write(from.map_or(u32::MAX, |p| p.0));
                }
                Ok(FabricStatus::Ok)
            }
        }
    })
}

/// Arrivals of immediate `imm` that landed and were not consumed yet, into `*n`.
///
/// # Safety
///
/// `engine` is a live engine; `n` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_counter_available(
    engine: *const FabricEngine,
    imm: u32,
    n: *mut u64,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        non_null("n", n)?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { n.write(e.imm_counter(imm).available()) };
        Ok(FabricStatus::Ok)
    })
}

/// Consumes `n` arrivals of `imm` if they are there now (`FABRIC_STATUS_OK`), else consumes nothing
/// (`FABRIC_STATUS_ERR_AGAIN`). Never blocks.
///
/// # Safety
///
/// `engine` is a live engine.
#[no_mangle]
pub unsafe extern "C" fn fabric_counter_try_consume(
    engine: *const FabricEngine,
    imm: u32,
    n: u64,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        if e.imm_counter(imm).try_consume(n) {
            Ok(FabricStatus::Ok)
        } else {
            Err(Failure::new(
                FabricStatus::ErrAgain,
                format!("fewer than {n} arrivals of {imm:#x} available"),
            ))
        }
    })
}

/// An operation that finishes once `n` arrivals of `imm` have landed, and consumes them.
/// Freeing it unfinished consumes nothing. A counter is not tied to a peer: to stop waiting
/// for a sender that died, watch `fabric_peer_status` beside it.
///
/// # Safety
///
/// `engine` is a live engine; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_counter_wait(
    engine: *const FabricEngine,
    imm: u32,
    n: u64,
    out: *mut *mut FabricOp,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        // SAFETY: the caller's contract.
        unsafe { op_out(e.imm_counter(imm).wait_for(n), out) }
    })
}
