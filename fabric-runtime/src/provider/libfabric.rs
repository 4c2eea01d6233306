//! The libfabric backend: one `FI_EP_RDM` endpoint on one libfabric domain.
//!
//! ```text
//!   LibfabricDomain ──owns──▶ ep ──bound to──▶ cq (FI_CQ_FORMAT_DATA, TRANSMIT|RECV)
//!                     │        └──bound to──▶ av (FI_AV_TABLE: PeerHandle = fi_addr_t)
//!                     ├──▶ mrs (fid_mr, closed before ep)          all of them opened on
//!                     ├──▶ domain ──▶ fabric ──▶ fi_info            the domain / fabric
//!                     └──▶ CtxPool: stable `OpCtx { fi_context2, token }` slots, one per op
//! ```
//!
//! Every libfabric call goes through the C shim of `fabric-libfabric-sys` (most of libfabric's
//! API is `static inline`), and every negative return code goes through `check`, which turns
//! it into [`Error::Provider`] with libfabric's own `fi_strerror` text.
//!
//! Provider names: `"tcp"` → `"tcp;ofi_rxm"`, `"udp"` → `"udp;ofi_rxd"`, `"shm"`, `"efa"`; any
//! other string is passed to `fi_getinfo` unchanged. For `tcp`/`udp` the endpoint binds to
//! `127.0.0.1` (or [`LibfabricConfig::node`]) with `FI_SOURCE` and `FI_SOCKADDR_IN`, and
//! `FI_TCP_IFACE=lo` is set in the environment if it is unset (see [`LibfabricDomain::open`]),
//! so that test traffic never leaves the machine.
//!
//! Progress: `tcp;ofi_rxm` progresses data only when the CQ is read (manual progress), on
//! *both* sides, connection setup included. The engine's reactor polls every domain it owns,
//! which is what drives it.
//!
//! All `unsafe` of the libfabric backend lives in this module (and the `-sys` crate).

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};

use libfabric_sys as sys;

use super::{Completion, Domain, LocalSlice, MemoryLocation, Op, PeerHandle, PostError, Registration};
use crate::error::Error;

/// Default largest two-sided message, in bytes.
pub const DEFAULT_MAX_MSG_SIZE: usize = 8192;

/// The memory-registration modes offered to the provider (the EFA set); the provider answers
/// with the subset it needs, and [`LibfabricDomain`] honours that answer.
const MR_MODE_OFFERED: u32 = sys::FI_MR_LOCAL
    | sys::FI_MR_VIRT_ADDR
    | sys::FI_MR_ALLOCATED
    | sys::FI_MR_PROV_KEY
    | sys::FI_MR_ENDPOINT;

/// Capabilities asked for. `FI_REMOTE_CQ_DATA` is deliberately absent: it is an operation
/// flag, and putting it in caps makes `fi_getinfo` fail with -61 (TESTBEDS.md §1).
const CAPS: u64 =
    (sys::FI_MSG | sys::FI_RMA | sys::FI_WRITE | sys::FI_REMOTE_WRITE | sys::FI_READ | sys::FI_REMOTE_READ)
        as u64;

/// Access flags of every registration: local send/recv/read/write and remote read/write.
const MR_ACCESS: u64 =
    (sys::FI_SEND | sys::FI_RECV | sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE)
        as u64;

/// Bytes of immediate data the engine needs (a `u32`).
const IMM_BYTES: usize = 4;

/// Completions read from the CQ per `fi_cq_readfrom` call.
const CQ_BATCH: usize = 16;

/// `OpCtx` slots allocated at a time; a chunk is never moved or freed before the domain is
/// dropped, so a slot's address stays valid for the provider.
const CTX_CHUNK: usize = 64;

/// How to open a [`LibfabricDomain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibfabricConfig {
    /// `"tcp"`, `"shm"`, `"udp"`, `"efa"`, or any `fi_info` provider name (`"tcp;ofi_rxm"`).
    pub provider: String,
    /// Address to bind to, for the socket-based providers (`tcp`, `udp`). Defaults to
    /// `127.0.0.1`. Ignored by `shm` (which needs a NULL node so each endpoint gets its own
    /// region name).
    pub node: Option<String>,
    /// Largest [`Op::Send`] accepted, capped by the provider's `ep_attr.max_msg_size`.
    pub max_msg_size: usize,
    /// Transmit queue depth hint (`tx_attr.size`); provider default when `None`.
    pub tx_depth: Option<usize>,
    /// Receive queue depth hint (`rx_attr.size`); provider default when `None`.
    pub rx_depth: Option<usize>,
    /// The libfabric domain (NIC) to open, by its `fi_info` domain name (EFA:
    /// `"rdmap16s27-rdm"`; `fi_info -p efa` lists them). `None`: the provider's first.
    pub domain: Option<String>,
    /// Bytes of remote CQ data every write must be able to carry: 4 (the 32-bit immediate)
    /// by default. A provider offering less is refused with [`Error::NoRemoteCqData`] (every
    /// provider of libfabric 1.17 offers 8, so asking for more is how that path is tested).
    pub cq_data_size: usize,
}

impl LibfabricConfig {
    /// The defaults, for `provider`.
    pub fn new(provider: impl Into<String>) -> Self {
        LibfabricConfig {
            provider: provider.into(),
            node: None,
            max_msg_size: DEFAULT_MAX_MSG_SIZE,
            tx_depth: None,
            rx_depth: None,
            domain: None,
            cq_data_size: IMM_BYTES,
        }
    }
}

impl Default for LibfabricConfig {
    fn default() -> Self {
        LibfabricConfig::new("tcp")
    }
}

/// The `fi_getinfo` provider name for a user-facing one.
fn prov_name_for(provider: &str) -> &str {
    match provider {
        "tcp" => "tcp;ofi_rxm",
        "udp" => "udp;ofi_rxd",
        other => other,
    }
}

/// Whether a provider is socket based (binds to an IP address on `node`).
fn is_socket_provider(prov_name: &str) -> bool {
    let core = prov_name.split(';').next().unwrap_or(prov_name);
    matches!(core, "tcp" | "udp" | "sockets")
}

// ---------------------------------------------------------------------------------------------
// Return codes: the one place negative libfabric returns become errors.
// ---------------------------------------------------------------------------------------------

/// libfabric's text for `errno` (a positive `FI_E*` / errno value).
fn strerror(errno: i32) -> String {
    // SAFETY: fi_strerror accepts any int and returns a pointer to a static NUL-terminated
    // string (or to a thread-local buffer for unknown values), valid until the next call on
    // this thread; it is copied out immediately.
    let p = unsafe { sys::fi_strerror(errno) };
    if p.is_null() {
        return format!("libfabric error {errno}");
    }
    // SAFETY: non-null, NUL-terminated, see above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// [`Error::Provider`] for a failed `call` with positive `errno`.
fn provider_error(call: &'static str, errno: i32) -> Error {
    Error::Provider { call, errno, message: strerror(errno) }
}

/// Maps a libfabric return code: negative is an error (`-FI_E*`), anything else is returned.
fn check(call: &'static str, ret: isize) -> Result<isize, Error> {
    if ret < 0 {
        Err(provider_error(call, i32::try_from(-ret).unwrap_or(i32::MAX)))
    } else {
        Ok(ret)
    }
}

const EAGAIN: isize = -(sys::FI_EAGAIN as isize);
const EAVAIL: isize = -(sys::FI_EAVAIL as isize);

// ---------------------------------------------------------------------------------------------
// Owned libfabric objects.
// ---------------------------------------------------------------------------------------------

/// An owned `fi_info` list, freed with `fi_freeinfo` (which also frees the strings in it:
/// those must come from `malloc`, hence `libc::strdup`).
struct Info(NonNull<sys::fi_info>);

impl Info {
    /// A zeroed `fi_info` with all attribute structs allocated (`fi_allocinfo`).
    fn alloc() -> Result<Info, Error> {
        // SAFETY: fi_allocinfo has no preconditions; it returns NULL on allocation failure.
        let p = unsafe { sys::fabric_shim_fi_allocinfo() };
        NonNull::new(p).map(Info).ok_or_else(|| provider_error("fi_allocinfo", libc::ENOMEM))
    }

    fn as_ptr(&self) -> *mut sys::fi_info {
        self.0.as_ptr()
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: self.0 came from fi_allocinfo or fi_getinfo and is freed exactly once here.
        unsafe { sys::fi_freeinfo(self.0.as_ptr()) }
    }
}

/// A libfabric object type whose first member is its `struct fid`.
trait FidObject {
    /// # Safety
    ///
    /// `this` must point to a live object of this type.
    unsafe fn fid(this: *mut Self) -> *mut sys::fid;
}

macro_rules! fid_object {
    ($($t:ty),*) => {$(
        impl FidObject for $t {
            unsafe fn fid(this: *mut Self) -> *mut sys::fid {
                // SAFETY: the caller guarantees `this` is live; addr_of_mut! creates no
                // reference.
                unsafe { ptr::addr_of_mut!((*this).fid) }
            }
        }
    )*};
}
fid_object!(sys::fid_fabric, sys::fid_domain, sys::fid_ep, sys::fid_cq, sys::fid_av, sys::fid_mr);

/// An open libfabric object, closed with `fi_close` on drop (errors are logged: drop never
/// panics).
struct Fid<T: FidObject> {
    ptr: NonNull<T>,
    what: &'static str,
}

impl<T: FidObject> Fid<T> {
    /// Wraps the object an `fi_*_open`-style call just returned.
    fn new(ptr: *mut T, what: &'static str) -> Result<Fid<T>, Error> {
        NonNull::new(ptr).map(|ptr| Fid { ptr, what }).ok_or_else(|| Error::Provider {
            call: what,
            errno: 0,
            message: "provider returned a NULL object".into(),
        })
    }

    fn as_ptr(&self) -> *mut T {
        self.ptr.as_ptr()
    }

    fn fid(&self) -> *mut sys::fid {
        // SAFETY: the object stays open as long as self exists.
        unsafe { T::fid(self.ptr.as_ptr()) }
    }
}

impl<T: FidObject> Drop for Fid<T> {
    fn drop(&mut self) {
        // SAFETY: the object is open and closed exactly once, here; everything bound to it
        // has been closed before (field order of LibfabricDomain).
        let ret = unsafe { sys::fabric_shim_fi_close(self.fid()) };
        if let Err(e) = check("fi_close", ret as isize) {
            tracing::warn!(object = self.what, error = %e, "closing a libfabric object failed");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operation contexts.
// ---------------------------------------------------------------------------------------------

/// The context of one posted operation. `FI_CONTEXT`/`FI_CONTEXT2` mode lets the provider use
/// the first bytes as scratch space until the operation completes, so a slot must not move
/// or be reused until its completion has been read.
#[repr(C)]
struct OpCtx {
    fi: sys::fi_context2,
    token: u64,
    in_flight: bool,
}

/// A pool of [`OpCtx`] slots in chunks that never move. Slots are only touched through raw
/// pointers, never references, because the provider writes into them behind our back.
struct CtxPool {
    chunks: Vec<NonNull<OpCtx>>,
    free: Vec<NonNull<OpCtx>>,
}

impl CtxPool {
    fn new() -> CtxPool {
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
    fn take(&mut self, token: u64) -> NonNull<OpCtx> {
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
    fn untake(&mut self, slot: NonNull<OpCtx>) {
        // SAFETY: slot came from take() and the post that used it returned an error.
        unsafe { ptr::addr_of_mut!((*slot.as_ptr()).in_flight).write(false) };
        self.free.push(slot);
    }

    /// The token of the operation whose context is `raw`, releasing its slot. `None` if `raw`
    /// is not one of our in-flight slots (checked by address before anything is read).
    fn complete(&mut self, raw: *mut c_void) -> Option<u64> {
        let addr = raw as usize;
        let size = std::mem::size_of::<OpCtx>();
        let owned = self.chunks.iter().any(|c| {
            let base = c.as_ptr() as usize;
            addr >= base && addr < base + CTX_CHUNK * size && (addr - base) % size == 0
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

// ---------------------------------------------------------------------------------------------
// The domain.
// ---------------------------------------------------------------------------------------------

/// One libfabric `FI_EP_RDM` endpoint with its domain, CQ and AV. See the module docs.
///
/// Teardown order is field order (Rust drops fields top to bottom), after `Drop::drop` has
/// closed any memory region the engine left registered: endpoint, CQ, AV, domain, fabric,
/// `fi_info`, and last the context pool (the provider may touch contexts until the endpoint
/// and CQ are closed).
pub struct LibfabricDomain {
    ep: Fid<sys::fid_ep>,
    cq: Fid<sys::fid_cq>,
    av: Fid<sys::fid_av>,
    domain: Fid<sys::fid_domain>,
    fabric: Fid<sys::fid_fabric>,
    /// The `fi_info` the objects were opened from, kept until they are all closed.
    _info: Info,
    ctxs: CtxPool,
    /// Live registrations by `Registration::handle`; closed in `Drop` if the engine left any.
    mrs: HashMap<u64, NonNull<sys::fid_mr>>,
    transport: String,
    address: Vec<u8>,
    addr_format: u32,
    max_msg_size: usize,
    /// Whether the provider granted `FI_DELIVERY_COMPLETE` as a default transmit op flag:
    /// then a write completes only once its data is placed at the target.
    delivery_complete: bool,
    mr_mode: u32,
    next_key: u64,
    wait_fd: Option<RawFd>,
    /// Completions read from the CQ that did not fit in the caller's `max`.
    overflow: VecDeque<Completion>,
}

// SAFETY: the libfabric objects are opened with FI_THREAD_DOMAIN, which lets them be used from
// any thread as long as one thread at a time does; a LibfabricDomain is owned by one reactor
// thread (every method takes `&mut self`, and it is not Sync), so moving it there once is sound.
// The raw pointers it holds are owned handles, not shared borrows.
unsafe impl Send for LibfabricDomain {}

impl fmt::Debug for LibfabricDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LibfabricDomain")
            .field("transport", &self.transport)
            .field("address_len", &self.address.len())
            .field("max_msg_size", &self.max_msg_size)
            .field("delivery_complete", &self.delivery_complete)
            .field("mr_mode", &format_args!("{:#x}", self.mr_mode))
            .field("wait_fd", &self.wait_fd)
            .field("registrations", &self.mrs.len())
            .finish_non_exhaustive()
    }
}

/// Copies a Rust string into a `malloc`ed C string that `fi_freeinfo` may free.
fn strdup(s: &str) -> Result<*mut c_char, Error> {
    let c = CString::new(s).map_err(|_| Error::Config(format!("{s:?} contains a NUL byte")))?;
    // SAFETY: c is a valid NUL-terminated string; strdup copies it into malloc'ed memory.
    let p = unsafe { libc::strdup(c.as_ptr()) };
    if p.is_null() {
        return Err(provider_error("strdup", libc::ENOMEM));
    }
    Ok(p)
}

/// Optional asks of the hints, dropped when a provider refuses them.
///
/// * `delivery_complete`: writes complete locally only once the data has been placed at
///   the target (`FI_DELIVERY_COMPLETE` as the default op flag), as on verbs RC. Without it
///   `tcp;ofi_rxm` completes a write once it is sent, so a write the target rejects (a bad
///   key) would look successful. Measured on loopback tcp at 4 MiB writes: no visible
///   throughput cost. Asked of `tcp` only; whether it was granted is read back from the
///   `fi_info` the endpoint is opened with ([`Domain::delivery_complete`]), never assumed.
/// * `source`: the `FI_SOURCE` capability, so received messages name their sender.
#[derive(Debug, Clone, Copy)]
struct Extras {
    delivery_complete: bool,
    source: bool,
}

impl Extras {
    const NONE: Extras = Extras { delivery_complete: false, source: false };
    const PREFERENCE: [Extras; 4] = [
        Extras { delivery_complete: true, source: true },
        Extras { delivery_complete: true, source: false },
        Extras { delivery_complete: false, source: true },
        Extras::NONE,
    ];
}

/// The inputs of one `fi_getinfo` call.
struct Query {
    prov_name: String,
    node: Option<CString>,
    flags: u64,
    socket: bool,
}

impl Query {
    /// `fi_getinfo` with the full hints (`full`) or the minimal ones (RDM + provider name).
    /// `extras` adds the optional asks of [`Extras`] to the full hints.
    fn getinfo(&self, cfg: &LibfabricConfig, full: bool, extras: Extras) -> Result<Info, Error> {
        let hints = Info::alloc()?;
        let h = hints.as_ptr();
        let prov = strdup(&self.prov_name)?;
        let domain_name = cfg.domain.as_deref().map(strdup).transpose()?;
        // SAFETY: fi_allocinfo allocated hints and all its attribute structs (non-null, zeroed);
        // the strings are malloc'ed and become owned by hints (freed by fi_freeinfo).
        unsafe {
            (*(*h).fabric_attr).prov_name = prov;
            if let Some(name) = domain_name {
                (*(*h).domain_attr).name = name;
            }
            (*(*h).ep_attr).type_ = sys::FI_EP_RDM;
            if self.socket {
                (*h).addr_format = sys::FI_SOCKADDR_IN;
            }
            if full {
                (*h).caps = CAPS;
                if extras.source {
                    (*h).caps |= sys::FI_SOURCE;
                }
                if extras.delivery_complete && self.prov_name.starts_with("tcp") {
                    (*(*h).tx_attr).op_flags = sys::FI_DELIVERY_COMPLETE as u64;
                }
                (*h).mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
                let d = (*h).domain_attr;
                (*d).mr_mode = MR_MODE_OFFERED as c_int;
                (*d).threading = sys::FI_THREAD_DOMAIN;
                (*d).cq_data_size = cfg.cq_data_size.max(IMM_BYTES);
                if let Some(n) = cfg.tx_depth {
                    (*(*h).tx_attr).size = n;
                }
                if let Some(n) = cfg.rx_depth {
                    (*(*h).rx_attr).size = n;
                }
            }
        }
        let mut out: *mut sys::fi_info = ptr::null_mut();
        let node = self.node.as_ref().map_or(ptr::null(), |n| n.as_ptr());
        // SAFETY: node is NULL or a live C string, service is NULL, hints is a valid fi_info,
        // out receives a list we own (wrapped in Info below).
        let ret = unsafe {
            sys::fi_getinfo(sys::fabric_shim_version(), node, ptr::null(), self.flags, h, &mut out)
        };
        check("fi_getinfo", ret as isize)?;
        NonNull::new(out).map(Info).ok_or_else(|| provider_error("fi_getinfo", sys::FI_ENODATA as i32))
    }
}

impl LibfabricDomain {
    /// Opens a fabric, domain, AV, CQ and `FI_EP_RDM` endpoint on the provider `cfg.provider`.
    ///
    /// For the socket providers (`tcp`, `udp`), binds to `cfg.node` (default `127.0.0.1`) and,
    /// if `FI_TCP_IFACE` is not set in the environment, sets it to `lo` first, so that the tcp
    /// provider never picks another interface. Setting an environment variable is not
    /// thread-safe with respect to concurrent `getenv` in C code: open domains before starting
    /// threads that read the environment, or set `FI_TCP_IFACE` yourself.
    ///
    /// Errors: [`Error::ProviderNotFound`] if no such provider offers an RDM endpoint,
    /// [`Error::NoRemoteCqData`] if it exists but cannot do RMA with remote CQ data (the
    /// immediates), [`Error::Provider`] if opening an object fails.
    pub fn open(cfg: &LibfabricConfig) -> Result<LibfabricDomain, Error> {
        let prov_name = prov_name_for(&cfg.provider).to_owned();
        let socket = is_socket_provider(&prov_name);
        if socket && std::env::var_os("FI_TCP_IFACE").is_none() {
            std::env::set_var("FI_TCP_IFACE", "lo");
        }
        let node = if socket {
            let n = cfg.node.clone().unwrap_or_else(|| "127.0.0.1".to_owned());
            Some(CString::new(n).map_err(|_| Error::Config("node contains a NUL byte".into()))?)
        } else {
            None
        };
        let query = Query {
            prov_name: prov_name.clone(),
            node,
            flags: if socket { sys::FI_SOURCE } else { 0 },
            socket,
        };

        // Ask for the optional extras first and drop them one by one if refused.
        let mut found = None;
        let mut first_err = None;
        for extras in Extras::PREFERENCE {
            match query.getinfo(cfg, true, extras) {
                Ok(info) => {
                    found = Some((info, extras));
                    break;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let (info, extras) = match found {
            Some(f) => f,
            None => {
                let minimal = query.getinfo(cfg, false, Extras::NONE).map(drop);
                let full_err = first_err.expect("at least one attempt was made");
                return Err(getinfo_failure(prov_name, full_err, minimal));
            }
        };
        tracing::debug!(provider = %prov_name, ?extras, "libfabric provider opened");
        let i = info.as_ptr();
        // SAFETY: fi_getinfo returned a valid fi_info whose attribute pointers are non-null.
        let (cq_data_size, mr_mode, addr_format, ep_max_msg, resolved, tx_op_flags) = unsafe {
            let d = (*i).domain_attr;
            let prov = (*(*i).fabric_attr).prov_name;
            let resolved = if prov.is_null() {
                prov_name.clone()
            } else {
                CStr::from_ptr(prov).to_string_lossy().into_owned()
            };
            (
                (*d).cq_data_size,
                (*d).mr_mode as u32,
                (*i).addr_format,
                (*(*i).ep_attr).max_msg_size,
                resolved,
                (*(*i).tx_attr).op_flags,
            )
        };
        // The endpoint's default transmit flags (what fi_write and fi_writedata use) are the
        // tx_attr op_flags of this fi_info: delivery complete only if they say so, whatever
        // was asked.
        let delivery_complete = tx_op_flags & sys::FI_DELIVERY_COMPLETE as u64 != 0;
        if !delivery_complete && prov_name.starts_with("tcp") {
            tracing::warn!(
                provider = %resolved,
                asked = extras.delivery_complete,
                "FI_DELIVERY_COMPLETE was not granted: Arrivals::One over several NICs is refused"
            );
        }
        if cq_data_size < cfg.cq_data_size.max(IMM_BYTES) {
            return Err(Error::NoRemoteCqData {
                provider: resolved,
                reason: format!("cq_data_size is {cq_data_size}, need {}", cfg.cq_data_size.max(IMM_BYTES)),
            });
        }
        tracing::debug!(provider = %resolved, mr_mode = format_args!("{mr_mode:#x}"), "libfabric provider chosen");

        let mut fabric = ptr::null_mut();
        // SAFETY: fabric_attr comes from fi_getinfo; fabric receives a new object.
        let ret = unsafe { sys::fi_fabric((*i).fabric_attr, &mut fabric, ptr::null_mut()) };
        check("fi_fabric", ret as isize)?;
        let fabric = Fid::new(fabric, "fi_fabric")?;

        let mut domain = ptr::null_mut();
        // SAFETY: fabric is open, info is the fi_info it was opened from.
        let ret = unsafe { sys::fabric_shim_fi_domain(fabric.as_ptr(), i, &mut domain, ptr::null_mut()) };
        check("fi_domain", ret as isize)?;
        let domain = Fid::new(domain, "fi_domain")?;

        let mut av_attr = sys::fi_av_attr { type_: sys::FI_AV_TABLE, ..Default::default() };
        let mut av = ptr::null_mut();
        // SAFETY: domain is open, av_attr is a valid attribute struct for the call's duration.
        let ret =
            unsafe { sys::fabric_shim_fi_av_open(domain.as_ptr(), &mut av_attr, &mut av, ptr::null_mut()) };
        check("fi_av_open", ret as isize)?;
        let av = Fid::new(av, "fi_av_open")?;

        let (cq, wait_fd) = open_cq(&domain)?;

        let mut ep = ptr::null_mut();
        // SAFETY: domain is open, info is the fi_info it was opened from.
        let ret = unsafe { sys::fabric_shim_fi_endpoint(domain.as_ptr(), i, &mut ep, ptr::null_mut()) };
        check("fi_endpoint", ret as isize)?;
        let ep = Fid::new(ep, "fi_endpoint")?;

        // SAFETY: ep, av and cq are open objects of the same domain.
        unsafe {
            check("fi_ep_bind(av)", sys::fabric_shim_fi_ep_bind(ep.as_ptr(), av.fid(), 0) as isize)?;
            let flags = (sys::FI_TRANSMIT | sys::FI_RECV) as u64;
            check("fi_ep_bind(cq)", sys::fabric_shim_fi_ep_bind(ep.as_ptr(), cq.fid(), flags) as isize)?;
            check("fi_enable", sys::fabric_shim_fi_enable(ep.as_ptr()) as isize)?;
        }

        let address = getname(&ep)?;

        Ok(LibfabricDomain {
            ep,
            cq,
            av,
            domain,
            fabric,
            _info: info,
            ctxs: CtxPool::new(),
            mrs: HashMap::new(),
            transport: resolved,
            address,
            addr_format,
            max_msg_size: cfg.max_msg_size.min(ep_max_msg),
            delivery_complete,
            mr_mode,
            next_key: 1,
            wait_fd,
            overflow: VecDeque::new(),
        })
    }

    /// The `mr_mode` bits the provider asked for (a subset of the offered EFA set).
    pub fn mr_mode(&self) -> u32 {
        self.mr_mode
    }

    fn mr_needs(&self, bit: u32) -> bool {
        self.mr_mode & bit != 0
    }

    /// Converts one CQ entry into completions (appended to `out`).
    fn classify(&mut self, e: &sys::fi_cq_data_entry, src: sys::fi_addr_t, out: &mut VecDeque<Completion>) {
        let flags = e.flags;
        let ctx_token = if e.op_context.is_null() { None } else { self.ctxs.complete(e.op_context) };
        if flags & sys::FI_REMOTE_CQ_DATA as u64 != 0 {
            // Target side of a write with immediate. rxm reports len 0, shm/udp len N: ignore
            // len; cq_data_size may be 8, the engine's immediate is the low 32 bits.
            out.push_back(Completion::Imm { imm: (e.data & 0xffff_ffff) as u32 });
            // A provider may have consumed a posted receive for it: that receive completes here.
            if let Some(token) = ctx_token {
                out.push_back(if flags & sys::FI_RECV as u64 != 0 {
                    Completion::Recv { token, len: 0, src: peer_of(src) }
                } else {
                    Completion::Done { token }
                });
            }
            return;
        }
        let Some(token) = ctx_token else {
            tracing::warn!(flags = format_args!("{flags:#x}"), ctx = ?e.op_context, "libfabric completion without one of our contexts; skipped");
            return;
        };
        if flags & sys::FI_RECV as u64 != 0 {
            out.push_back(Completion::Recv { token, len: e.len, src: peer_of(src) });
        } else {
            out.push_back(Completion::Done { token });
        }
    }

    /// Reads one error entry (after `-FI_EAVAIL`).
    fn read_error(&mut self, out: &mut VecDeque<Completion>) -> Result<bool, Error> {
        let mut err = sys::fi_cq_err_entry::default();
        // SAFETY: cq is open; err is a valid, zeroed entry (err_data NULL, err_data_size 0, so
        // the provider uses its own buffer for err_data).
        let ret = unsafe { sys::fabric_shim_fi_cq_readerr(self.cq.as_ptr(), &mut err, 0) };
        if ret == EAGAIN {
            return Ok(false);
        }
        check("fi_cq_readerr", ret as isize)?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: cq is open; err_data is valid until the next CQ read; buf is writable for its
        // length; the result is NULL or a NUL-terminated string (buf or a provider string).
        let message = unsafe {
            let p = sys::fabric_shim_fi_cq_strerror(
                self.cq.as_ptr(),
                err.prov_errno,
                err.err_data,
                buf.as_mut_ptr(),
                buf.len(),
            );
            if p.is_null() {
                strerror(err.err)
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        let token = if err.op_context.is_null() { None } else { self.ctxs.complete(err.op_context) };
        match token {
            Some(token) => out.push_back(Completion::Failed { token, errno: err.err, message }),
            None => tracing::warn!(
                errno = err.err,
                prov_errno = err.prov_errno,
                %message,
                "libfabric error completion without one of our contexts (e.g. a failed remote write); skipped"
            ),
        }
        Ok(true)
    }
}

/// What a failed `fi_getinfo` with the full hints means, given the retry with minimal hints
/// (`FI_EP_RDM` and the provider name only): the provider exists but cannot do what the engine
/// needs (RMA with remote CQ data), or it does not exist here at all.
fn getinfo_failure(provider: String, full_err: Error, minimal: Result<(), Error>) -> Error {
    match minimal {
        Ok(()) => Error::NoRemoteCqData {
            provider,
            reason: format!(
                "it offers FI_EP_RDM but not RMA with {IMM_BYTES}-byte remote CQ data under the \
                 required hints ({full_err})"
            ),
        },
        Err(min_err) => Error::ProviderNotFound { provider, reason: min_err.to_string() },
    }
}

/// Checks that `peer` can safely be handed to `fi_av_insert` as one address in `format`,
/// judged against our own address `ours`:
///
/// * `FI_ADDR_STR` (shm: `"fi_shm://PID:N:0\0"`, variable length): NUL-terminated (the provider
///   reads up to the NUL), no interior NUL, ASCII, same `scheme://` prefix, at most
///   `FI_NAME_MAX` bytes.
/// * every other (binary, fixed-size) format: exactly our length; for `FI_SOCKADDR_IN` also
///   the `AF_INET` family.
fn validate_peer_address(format: u32, ours: &[u8], peer: &[u8], transport: &str) -> Result<(), Error> {
    let malformed = |reason: String| Err(Error::Malformed { what: "peer address", reason });
    if format == sys::FI_ADDR_STR {
        let max = sys::FI_NAME_MAX as usize;
        if peer.is_empty() || peer.len() > max {
            return malformed(format!("{} bytes, {transport} addresses are 1..={max}", peer.len()));
        }
        let Some((&0, text)) = peer.split_last() else {
            return malformed("string address is not NUL-terminated".into());
        };
        if text.contains(&0) || !text.is_ascii() {
            return malformed("string address has a NUL or non-ASCII byte inside".into());
        }
        let scheme = |a: &[u8]| a.windows(3).position(|w| w == b"://").map(|i| a[..i + 3].to_vec());
        let ours_text = ours.strip_suffix(&[0]).unwrap_or(ours);
        if scheme(text).is_none() || scheme(text) != scheme(ours_text) {
            return malformed(format!("{:?} is not a {transport} address", String::from_utf8_lossy(text)));
        }
        return Ok(());
    }
    if peer.len() != ours.len() {
        return malformed(format!(
            "{} bytes, but {transport} addresses are {} bytes",
            peer.len(),
            ours.len()
        ));
    }
    if format == sys::FI_SOCKADDR_IN {
        let family = u16::from_ne_bytes([peer[0], peer[1]]);
        if family != libc::AF_INET as u16 {
            return malformed(format!("address family {family} is not AF_INET"));
        }
    }
    Ok(())
}

/// `fi_addr_t` of a completion's source as a [`PeerHandle`].
fn peer_of(src: sys::fi_addr_t) -> Option<PeerHandle> {
    (src != sys::FI_ADDR_NOTAVAIL).then_some(src)
}

/// Opens the CQ, with a wait fd if the provider has one (`FI_WAIT_FD` + `FI_GETWAIT`), else
/// busy-poll only (`FI_WAIT_NONE`: shm fails `fi_cq_open` with -38, udp fails `FI_GETWAIT`).
fn open_cq(domain: &Fid<sys::fid_domain>) -> Result<(Fid<sys::fid_cq>, Option<RawFd>), Error> {
    let open = |wait_obj| -> Result<Fid<sys::fid_cq>, Error> {
        let mut attr = sys::fi_cq_attr { format: sys::FI_CQ_FORMAT_DATA, wait_obj, ..Default::default() };
        let mut cq = ptr::null_mut();
        // SAFETY: domain is open; attr is valid for the duration of the call.
        let ret =
            unsafe { sys::fabric_shim_fi_cq_open(domain.as_ptr(), &mut attr, &mut cq, ptr::null_mut()) };
        check("fi_cq_open", ret as isize)?;
        Fid::new(cq, "fi_cq_open")
    };
    match open(sys::FI_WAIT_FD) {
        Ok(cq) => {
            let mut fd: c_int = -1;
            // SAFETY: FI_GETWAIT on a FI_WAIT_FD CQ writes one int (the fd) to arg.
            let ret = unsafe {
                sys::fabric_shim_fi_control(
                    cq.fid(),
                    sys::FI_GETWAIT as c_int,
                    (&mut fd as *mut c_int).cast(),
                )
            };
            match check("fi_control(FI_GETWAIT)", ret as isize) {
                Ok(_) if fd >= 0 => return Ok((cq, Some(fd))),
                Ok(_) => tracing::debug!("FI_GETWAIT gave no fd; busy-polling"),
                Err(e) => tracing::debug!(error = %e, "CQ wait fd unavailable; busy-polling"),
            }
            drop(cq);
        }
        Err(e) => tracing::debug!(error = %e, "CQ with FI_WAIT_FD refused; busy-polling"),
    }
    Ok((open(sys::FI_WAIT_NONE)?, None))
}

/// `fi_getname` of the endpoint.
fn getname(ep: &Fid<sys::fid_ep>) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; 128];
    for _ in 0..2 {
        let mut len = buf.len();
        // SAFETY: ep is open and enabled; buf is writable for len bytes; len is updated.
        let ret = unsafe { sys::fabric_shim_fi_getname(ep.fid(), buf.as_mut_ptr().cast(), &mut len) };
        if ret == -(sys::FI_ETOOSMALL as c_int) && len > buf.len() {
            buf.resize(len, 0);
            continue;
        }
        check("fi_getname", ret as isize)?;
        buf.truncate(len);
        return Ok(buf);
    }
    Err(provider_error("fi_getname", sys::FI_ETOOSMALL as i32))
}

impl Domain for LibfabricDomain {
    fn transport(&self) -> &str {
        &self.transport
    }

    fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    fn max_msg_size(&self) -> usize {
        self.max_msg_size
    }

    fn delivery_complete(&self) -> bool {
        self.delivery_complete
    }

    unsafe fn register(
        &mut self,
        addr: u64,
        len: usize,
        location: MemoryLocation,
    ) -> Result<Registration, Error> {
        if location != MemoryLocation::Host {
            // Debian's libfabric has no CUDA support (FI_HMEM_CUDA registration gives -38).
            return Err(Error::Unsupported(format!("registering {location} memory with libfabric")));
        }
        let reg_err =
            |e: Error| Error::RegisterMemory { len, location: location.to_string(), message: e.to_string() };
        // Without FI_MR_PROV_KEY the application picks the keys; unique per domain.
        let requested_key = if self.mr_needs(sys::FI_MR_PROV_KEY) { 0 } else { self.next_key };
        let mut mr = ptr::null_mut();
        // SAFETY: the caller guarantees addr..addr+len is valid until deregister; domain is open.
        let ret = unsafe {
            sys::fabric_shim_fi_mr_reg(
                self.domain.as_ptr(),
                addr as *const c_void,
                len,
                MR_ACCESS,
                0,
                requested_key,
                0,
                &mut mr,
                ptr::null_mut(),
            )
        };
        check("fi_mr_reg", ret as isize).map_err(reg_err)?;
        let mr = NonNull::new(mr).ok_or_else(|| reg_err(provider_error("fi_mr_reg", libc::EINVAL)))?;
        let close = |mr: NonNull<sys::fid_mr>| {
            // SAFETY: mr was just opened and is not known to anyone else.
            unsafe { sys::fabric_shim_fi_close(sys::fid_mr::fid(mr.as_ptr())) };
        };
        if self.mr_needs(sys::FI_MR_ENDPOINT) {
            // SAFETY: mr and ep are open objects of this domain.
            let r = unsafe {
                check("fi_mr_bind", sys::fabric_shim_fi_mr_bind(mr.as_ptr(), self.ep.fid(), 0) as isize)
                    .and_then(|_| check("fi_mr_enable", sys::fabric_shim_fi_mr_enable(mr.as_ptr()) as isize))
            };
            if let Err(e) = r {
                close(mr);
                return Err(reg_err(e));
            }
        }
        if !self.mr_needs(sys::FI_MR_PROV_KEY) {
            self.next_key += 1;
        }
        // SAFETY: mr is open and registered (and enabled where needed).
        let (desc, key) =
            unsafe { (sys::fabric_shim_fi_mr_desc(mr.as_ptr()), sys::fabric_shim_fi_mr_key(mr.as_ptr())) };
        if key == sys::FI_KEY_NOTAVAIL {
            close(mr);
            return Err(reg_err(provider_error("fi_mr_key", sys::FI_ENOKEY as i32)));
        }
        let handle = mr.as_ptr() as u64;
        self.mrs.insert(handle, mr);
        Ok(Registration {
            // The contract: `local` is 0 when the provider needs no descriptor.
            local: if self.mr_needs(sys::FI_MR_LOCAL) { desc as u64 } else { 0 },
            remote_key: key,
            handle,
            remote_base: if self.mr_needs(sys::FI_MR_VIRT_ADDR) { addr } else { 0 },
        })
    }

    fn deregister(&mut self, reg: Registration) {
        let Some(mr) = self.mrs.remove(&reg.handle) else {
            tracing::warn!(
                handle = reg.handle,
                "deregister of a handle this domain did not register; ignored"
            );
            return;
        };
        // SAFETY: mr is one of our open registrations, removed from the table so it is closed
        // exactly once.
        let ret = unsafe { sys::fabric_shim_fi_close(sys::fid_mr::fid(mr.as_ptr())) };
        if let Err(e) = check("fi_close(mr)", ret as isize) {
            tracing::warn!(error = %e, "deregistering memory failed");
        }
    }

    fn add_peer(&mut self, addr: &[u8]) -> Result<PeerHandle, Error> {
        let malformed = |reason: String| Error::Malformed { what: "peer address", reason };
        validate_peer_address(self.addr_format, &self.address, addr, &self.transport)?;
        let mut fi_addr: sys::fi_addr_t = sys::FI_ADDR_NOTAVAIL;
        // SAFETY: av is open; addr holds exactly one address of this provider's format,
        // checked above (fixed-size formats have our length, string formats end in a NUL, so
        // the provider never reads past the slice); fi_addr receives one entry. With FI_AV_TABLE the insert is synchronous.
        let ret = unsafe {
            sys::fabric_shim_fi_av_insert(
                self.av.as_ptr(),
                addr.as_ptr().cast(),
                1,
                &mut fi_addr,
                0,
                ptr::null_mut(),
            )
        };
        match check("fi_av_insert", ret as isize) {
            Ok(1) if fi_addr != sys::FI_ADDR_NOTAVAIL => Ok(fi_addr),
            Ok(_) => Err(malformed("the provider rejected the address".into())),
            Err(Error::Provider { errno, message, .. }) if errno == sys::FI_EINVAL as i32 => {
                Err(malformed(message))
            }
            Err(e) => Err(e),
        }
    }

    unsafe fn post(&mut self, token: u64, op: &Op) -> Result<(), PostError> {
        if let Op::Send { local, .. } = op {
            if local.len > self.max_msg_size {
                return Err(PostError::Failed(Error::MessageTooLarge {
                    len: local.len,
                    max: self.max_msg_size,
                }));
            }
        }
        let ep = self.ep.as_ptr();
        let slot = self.ctxs.take(token);
        let ctx = slot.as_ptr().cast::<c_void>();
        let buf = |l: &LocalSlice| l.addr as *mut c_void;
        let desc = |l: &LocalSlice| l.desc as *mut c_void;
        // SAFETY: the caller guarantees the memory in `op` is registered with this domain
        // (desc from that registration) and stays valid until the completion is polled; ctx
        // is a pool slot that stays put and unused until its completion is read; ep is open.
        let (call, ret) = unsafe {
            match *op {
                Op::Write { peer, ref local, remote, imm: Some(imm) } => (
                    "fi_writedata",
                    sys::fabric_shim_fi_writedata(
                        ep,
                        buf(local),
                        local.len,
                        desc(local),
                        u64::from(imm),
                        peer,
                        remote.addr,
                        remote.key,
                        ctx,
                    ),
                ),
                Op::Write { peer, ref local, remote, imm: None } => (
                    "fi_write",
                    sys::fabric_shim_fi_write(
                        ep,
                        buf(local),
                        local.len,
                        desc(local),
                        peer,
                        remote.addr,
                        remote.key,
                        ctx,
                    ),
                ),
                Op::Read { peer, ref local, remote } => (
                    "fi_read",
                    sys::fabric_shim_fi_read(
                        ep,
                        buf(local),
                        local.len,
                        desc(local),
                        peer,
                        remote.addr,
                        remote.key,
                        ctx,
                    ),
                ),
                Op::Send { peer, ref local } => {
                    ("fi_send", sys::fabric_shim_fi_send(ep, buf(local), local.len, desc(local), peer, ctx))
                }
                Op::Recv { ref local } => (
                    "fi_recv",
                    sys::fabric_shim_fi_recv(
                        ep,
                        buf(local),
                        local.len,
                        desc(local),
                        sys::FI_ADDR_UNSPEC,
                        ctx,
                    ),
                ),
            }
        };
        match ret {
            0.. => Ok(()),
            EAGAIN => {
                self.ctxs.untake(slot);
                Err(PostError::Again)
            }
            _ => {
                self.ctxs.untake(slot);
                Err(PostError::Failed(check(call, ret).expect_err("ret is negative")))
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, Error> {
        let mut got = 0;
        let mut pending = std::mem::take(&mut self.overflow);
        let result = (|| {
            while got < max {
                if let Some(c) = pending.pop_front() {
                    out.push(c);
                    got += 1;
                    continue;
                }
                let mut entries = [sys::fi_cq_data_entry::default(); CQ_BATCH];
                let mut srcs = [sys::FI_ADDR_NOTAVAIL; CQ_BATCH];
                let want = (max - got).min(CQ_BATCH);
                // SAFETY: cq is open with FI_CQ_FORMAT_DATA, so each entry is an
                // fi_cq_data_entry; both arrays hold at least `want` entries.
                let ret = unsafe {
                    sys::fabric_shim_fi_cq_readfrom(
                        self.cq.as_ptr(),
                        entries.as_mut_ptr().cast(),
                        want,
                        srcs.as_mut_ptr(),
                    )
                };
                match ret {
                    EAGAIN => break,
                    EAVAIL => {
                        if !self.read_error(&mut pending)? {
                            break;
                        }
                    }
                    _ => {
                        let n = check("fi_cq_readfrom", ret)? as usize;
                        for (e, &src) in entries.iter().zip(srcs.iter()).take(n) {
                            self.classify(e, src, &mut pending);
                        }
                        if n < want && pending.is_empty() {
                            break;
                        }
                    }
                }
            }
            Ok(())
        })();
        // Whatever did not fit in `max` (or was read before an error) is kept for next time.
        self.overflow = pending;
        result.map(|()| got)
    }

    fn wait_fd(&self) -> Option<RawFd> {
        self.wait_fd
    }

    fn arm(&mut self) -> bool {
        if self.wait_fd.is_none() || !self.overflow.is_empty() {
            return false;
        }
        let mut fids = [self.cq.fid()];
        // SAFETY: fabric and cq are open; fids holds one valid fid for the call's duration.
        let ret = unsafe { sys::fabric_shim_fi_trywait(self.fabric.as_ptr(), fids.as_mut_ptr(), 1) };
        match ret as isize {
            0 => true,
            EAGAIN => false,
            r => {
                if let Err(e) = check("fi_trywait", r) {
                    tracing::warn!(error = %e, "fi_trywait failed; polling instead of sleeping");
                }
                false
            }
        }
    }

    /// Nothing to acknowledge: libfabric's wait fd is level-triggered on the provider's own
    /// sockets/signals and is reset by reading the CQ, which the reactor does next.
    fn ack_wakeup(&mut self) {}
}

impl Drop for LibfabricDomain {
    fn drop(&mut self) {
        // Registrations must be closed before the endpoint (FI_MR_ENDPOINT binds them to it)
        // and the domain; the engine normally deregisters everything first.
        for (_, mr) in self.mrs.drain() {
            tracing::debug!("closing a registration left open at domain drop");
            // SAFETY: mr is an open registration of this domain, closed exactly once here.
            let ret = unsafe { sys::fabric_shim_fi_close(sys::fid_mr::fid(mr.as_ptr())) };
            if let Err(e) = check("fi_close(mr)", ret as isize) {
                tracing::warn!(error = %e, "closing a registration failed");
            }
        }
        // The remaining fields now drop in declaration order: ep, cq, av, domain, fabric,
        // info, ctxs.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_names_map() {
        assert_eq!(prov_name_for("tcp"), "tcp;ofi_rxm");
        assert_eq!(prov_name_for("udp"), "udp;ofi_rxd");
        assert_eq!(prov_name_for("shm"), "shm");
        assert_eq!(prov_name_for("efa"), "efa");
        assert_eq!(prov_name_for("verbs;ofi_rxm"), "verbs;ofi_rxm");
        assert!(is_socket_provider("tcp;ofi_rxm"));
        assert!(!is_socket_provider("shm"));
    }

    #[test]
    fn check_maps_negative_codes() {
        assert_eq!(check("x", 3).unwrap(), 3);
        match check("fi_x", -(sys::FI_EAGAIN as isize)) {
            Err(Error::Provider { call, errno, message }) => {
                assert_eq!(call, "fi_x");
                assert_eq!(errno, sys::FI_EAGAIN as i32);
                assert!(!message.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn peer_addresses_are_validated() {
        let shm = b"fi_shm://123:4:0\0";
        let ok = |a: &[u8]| validate_peer_address(sys::FI_ADDR_STR, shm, a, "shm");
        assert!(ok(b"fi_shm://123:10:0\0").is_ok(), "longer string addresses are fine");
        assert!(ok(b"fi_shm://123:4:0").is_err(), "no NUL");
        assert!(ok(b"fi_shm://1\x0023:4:0\0").is_err(), "interior NUL");
        assert!(ok(b"fi_sock://1.2.3.4\0").is_err(), "other scheme");
        assert!(ok(b"\0").is_err());
        assert!(ok(b"").is_err());
        assert!(ok(&[b'a'; 300]).is_err());
        let sin = [2u8, 0, 1, 2, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
        let ok = |a: &[u8]| validate_peer_address(sys::FI_SOCKADDR_IN, &sin, a, "tcp;ofi_rxm");
        assert!(ok(&sin).is_ok());
        assert!(ok(&sin[..15]).is_err());
        let mut wrong = sin;
        wrong[0] = 10;
        assert!(ok(&wrong).is_err());
    }

    #[test]
    fn getinfo_failures_are_classified() {
        let nodata = || provider_error("fi_getinfo", sys::FI_ENODATA as i32);
        assert!(matches!(
            getinfo_failure("x".into(), nodata(), Ok(())),
            Error::NoRemoteCqData { provider, .. } if provider == "x"
        ));
        assert!(matches!(
            getinfo_failure("x".into(), nodata(), Err(nodata())),
            Error::ProviderNotFound { provider, .. } if provider == "x"
        ));
    }

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
