//! Engines: options, making and freeing one, its address, and its peers.

use std::ffi::{c_char, CStr, CString};
use std::time::Duration;

use fabric_async::{Engine, PeerId, ReactorMode};
use futures::executor::block_on;

use crate::status::{boundary, boundary_void, FabricStatus, Failure};
use crate::{copy_out, non_null, slice_in};

/// How the engine's reactor thread waits for its NICs.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricMode {
    /// Sleeps on the completion queues' wait fds while idle (no CPU when idle); the default.
    Event = 0,
    /// Spins `spin_us` microseconds after activity, then sleeps as `Event` does.
    Adaptive = 1,
    /// Spins on a core (`pin_core`) all the time: the lowest latency.
    BusyPoll = 2,
    /// Testing or waiting for an operation runs the engine's pass on the calling thread (no
    /// hand-over between threads); a reactor thread stands by and takes over, as in
    /// `Event`, while nobody tests. For callers that poll their operations in a loop, as
    /// NIXL's `checkXfer` does.
    Inline = 3,
}

/// Options of `fabric_engine_new`. Fill with `fabric_engine_options_init`, then set fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FabricEngineOptions {
    /// The provider: `"tcp"`, `"shm"`, `"udp"`, `"efa"`, `"verbs"` or `"verbs:DEV,DEV"`.
    /// NULL: the environment's `FABRIC_PROVIDER`, else `"tcp"`.
    pub provider: *const c_char,
    /// NIC names, comma-separated (verbs devices, libfabric domains). NULL: the provider's
    /// first NIC.
    pub nics: *const c_char,
    /// N domains of the provider's one NIC (a loopback stand-in for N NICs). 0: one per NIC.
    pub domains: u32,
    /// The reactor mode.
    pub mode: FabricMode,
    /// `FABRIC_MODE_ADAPTIVE`: microseconds of spinning after activity (0: 50).
    pub spin_us: u32,
    /// The core to pin the reactor thread to; -1: none.
    pub pin_core: i32,
    /// Milliseconds an operation may go without completing before it fails and its peer is
    /// marked down; 0: never. Default 30000.
    pub op_timeout_ms: u64,
    /// The largest message `fabric_send` takes; 0: the engine's default (8192).
    pub max_msg_size: u32,
    /// Writes into GPU memory of a process on this host through CUDA IPC: 1 on (the
    /// default), 0 off (the NIC path instead), -1 the default.
    pub cuda_ipc: i32,
    /// Transfers longer than this many bytes are cut into shards of it, dealt over the
    /// NICs (`domains`); 0: the engine's default (1 MiB). Peers must agree on it when they
    /// count arrivals (`fabric_write_arrivals`).
    pub chunk_bytes: u64,
}

/// An engine: one reactor thread driving the NICs of one process or GPU.
pub struct FabricEngine {
    pub(crate) engine: Engine,
    transport: CString,
}

/// Fills `opts` with the defaults.
///
/// # Safety
///
/// `opts` is NULL or points to writable memory for one `fabric_engine_options`.
#[no_mangle]
pub unsafe extern "C" fn fabric_engine_options_init(opts: *mut FabricEngineOptions) {
    if opts.is_null() {
        return;
    }
    let d = FabricEngineOptions {
        provider: std::ptr::null(),
        nics: std::ptr::null(),
        domains: 0,
        mode: FabricMode::Event,
        spin_us: 0,
        pin_core: -1,
        op_timeout_ms: 30_000,
        max_msg_size: 0,
        cuda_ipc: -1,
        chunk_bytes: 0,
    };
    // SAFETY: the caller's contract: `opts` is writable for one options struct.
    unsafe { opts.write(d) };
}

/// A C string argument, or `None` for NULL.
///
/// # Safety
///
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn opt_str(what: &str, s: *const c_char) -> Result<Option<String>, Failure> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    let c = unsafe { CStr::from_ptr(s) };
    c.to_str().map(|s| Some(s.to_string())).map_err(|_| Failure::invalid(format!("{what} is not UTF-8")))
}

fn builder(o: &FabricEngineOptions) -> Result<fabric_async::EngineBuilder, Failure> {
    let mut b = Engine::builder();
    // SAFETY: the caller of fabric_engine_new vouches for the strings in the options.
    if let Some(p) = unsafe { opt_str("provider", o.provider) }? {
        b = b.provider(p);
    }
    // SAFETY: as above.
    if let Some(n) = unsafe { opt_str("nics", o.nics) }? {
        let names: Vec<String> =
            n.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
        if !names.is_empty() {
            b = b.nics(names);
        }
    }
    if o.domains > 0 {
        b = b.domains(o.domains as usize);
    }
    b = b.mode(match o.mode {
        FabricMode::Event => ReactorMode::Event,
        FabricMode::Adaptive => {
            let us = if o.spin_us == 0 { 50 } else { o.spin_us };
            ReactorMode::Adaptive { spin: Duration::from_micros(u64::from(us)) }
        }
        FabricMode::BusyPoll => ReactorMode::BusyPoll,
        FabricMode::Inline => ReactorMode::Inline,
    });
    if o.pin_core >= 0 {
        b = b.pin_core(o.pin_core as usize);
    }
    b = b.op_timeout((o.op_timeout_ms > 0).then(|| Duration::from_millis(o.op_timeout_ms)));
    if o.max_msg_size > 0 {
        b = b.messages(o.max_msg_size as usize, 64);
    }
    if o.chunk_bytes > 0 {
        b = b.transfer(fabric_async::TransferOpts::sharded(o.chunk_bytes));
    }
    match o.cuda_ipc {
        -1 => {}
        0 => b = b.cuda_ipc(false),
        1 => b = b.cuda_ipc(true),
        v => return Err(Failure::invalid(format!("cuda_ipc must be -1, 0 or 1, not {v}"))),
    }
    Ok(b)
}

/// Makes an engine and starts its reactor thread. `opts` NULL: the defaults.
///
/// # Safety
///
/// `opts` is NULL or a valid options struct (its strings NULL or NUL-terminated); `out` is
/// writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_engine_new(
    opts: *const FabricEngineOptions,
    out: *mut *mut FabricEngine,
) -> FabricStatus {
    boundary(|| {
        non_null("out", out)?;
        let o = if opts.is_null() {
            let mut d = std::mem::MaybeUninit::uninit();
            // SAFETY: `d` is writable; init fills all of it.
            unsafe { fabric_engine_options_init(d.as_mut_ptr()) };
            // SAFETY: initialised just above.
            unsafe { d.assume_init() }
        } else {
            // SAFETY: the caller's contract.
            unsafe { *opts }
        };
        let engine = builder(&o)?.build()?;
        let transport = CString::new(engine.transport()).unwrap_or_default();
        let e = Box::new(FabricEngine { engine, transport });
        // SAFETY: `out` is writable (checked non-null; the caller's contract).
        unsafe { out.write(Box::into_raw(e)) };
        Ok(FabricStatus::Ok)
    })
}

/// Shuts the engine down and frees it: operations still running fail with
/// `FABRIC_STATUS_ERR_SHUTDOWN` (after a grace of up to 2 s to complete), and the reactor thread is
/// joined. Regions, remote regions and operations of the engine stay valid to free
/// afterwards (their calls fail with `FABRIC_STATUS_ERR_SHUTDOWN`). NULL is a no-op.
///
/// # Safety
///
/// `engine` is NULL or an engine from `fabric_engine_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn fabric_engine_free(engine: *mut FabricEngine) {
    if engine.is_null() {
        return;
    }
    boundary_void(|| {
        // SAFETY: the caller's contract: made by Box::into_raw in fabric_engine_new.
        let e = unsafe { Box::from_raw(engine) };
        e.engine.shutdown();
        drop(e);
    });
}

/// The engine behind a handle.
///
/// # Safety
///
/// `e` is NULL or a live engine handle.
pub(crate) unsafe fn engine_ref<'a>(e: *const FabricEngine) -> Result<&'a Engine, Failure> {
    // SAFETY: the caller's contract.
    unsafe { e.as_ref() }.map(|e| &e.engine).ok_or_else(|| Failure::invalid("engine is NULL"))
}

/// Copies the engine's address (bytes for a peer's `fabric_add_peer`) into `buf`. `*len` is
/// set to its length; `FABRIC_STATUS_ERR_BUFFER_TOO_SMALL` if `cap` is less (nothing copied).
///
/// # Safety
///
/// `engine` is a live engine; `buf` is writable for `cap` bytes (NULL with `cap` 0);
/// `len` is writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_engine_address(
    engine: *const FabricEngine,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        // SAFETY: the caller's contract.
        unsafe { copy_out(&e.address(), buf, cap, len) }
    })
}

/// The transport the engine's NICs speak (`"tcp;ofi_rxm"`, `"shm"`, `"verbs"`): a string
/// that lives as long as the engine. NULL for a NULL engine.
///
/// # Safety
///
/// `engine` is NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn fabric_engine_transport(engine: *const FabricEngine) -> *const c_char {
    // SAFETY: the caller's contract.
    match unsafe { engine.as_ref() } {
        Some(e) => e.transport.as_ptr(),
        None => std::ptr::null(),
    }
}

/// How many NICs the engine drives (0 for a NULL engine).
///
/// # Safety
///
/// `engine` is NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn fabric_engine_nics(engine: *const FabricEngine) -> usize {
    // SAFETY: the caller's contract.
    unsafe { engine.as_ref() }.map_or(0, |e| e.engine.nics())
}

/// The largest message `fabric_send` takes, and the buffer `fabric_try_recv` needs (0 for a
/// NULL engine).
///
/// # Safety
///
/// `engine` is NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn fabric_engine_max_msg_size(engine: *const FabricEngine) -> usize {
    // SAFETY: the caller's contract.
    unsafe { engine.as_ref() }.map_or(0, |e| e.engine.max_msg_size())
}

/// Makes the engine at `addr` (its `fabric_engine_address`) a peer and writes its id to
/// `peer`. Adding the same address again gives the same id. Blocks until the peer is
/// added (a connection on some transports).
///
/// # Safety
///
/// `engine` is a live engine; `addr` readable for `len` bytes; `peer` writable.
#[no_mangle]
pub unsafe extern "C" fn fabric_add_peer(
    engine: *const FabricEngine,
    addr: *const u8,
    len: usize,
    peer: *mut u32,
) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        non_null("peer", peer)?;
        // SAFETY: the caller's contract.
        let a = unsafe { slice_in("addr", addr, len) }?;
        let id = block_on(e.add_peer(a))?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { peer.write(id.0) };
        Ok(FabricStatus::Ok)
    })
}

/// Removes a peer: its operations in flight fail with `FABRIC_STATUS_ERR_PEER_UNREACHABLE`, and so
/// does everything later through its id or its regions. Removing it twice is a no-op.
///
/// # Safety
///
/// `engine` is a live engine.
#[no_mangle]
pub unsafe extern "C" fn fabric_remove_peer(engine: *const FabricEngine, peer: u32) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        block_on(e.remove_peer(PeerId(peer)))?;
        Ok(FabricStatus::Ok)
    })
}

/// Whether `peer` is up: `FABRIC_STATUS_OK` if it is, `FABRIC_STATUS_ERR_PEER_UNREACHABLE` once it is
/// found down or removed (a dead process is found within about 20 ms on tcp and shm),
/// `FABRIC_STATUS_ERR_UNKNOWN_PEER` for an id this engine never gave. Never blocks.
///
/// # Safety
///
/// `engine` is a live engine.
#[no_mangle]
pub unsafe extern "C" fn fabric_peer_status(engine: *const FabricEngine, peer: u32) -> FabricStatus {
    boundary(|| {
        // SAFETY: the caller's contract.
        let e = unsafe { engine_ref(engine) }?;
        e.peer_status(PeerId(peer))?;
        Ok(FabricStatus::Ok)
    })
}
