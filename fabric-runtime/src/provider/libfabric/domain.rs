//! The [`LibfabricDomain`] itself: its fields (in teardown order), `open` (fabric, domain,
//! AV, CQ and endpoint from the `fi_info` that `fi_getinfo` chose) and `Drop`.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, CStr, CString};
use std::fmt;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};

use libfabric_sys as sys;

use super::address::getname;
use super::config::{is_socket_provider, prov_name_for, LibfabricConfig};
use super::ctx::CtxPool;
use super::error::check;
use super::fid::{Fid, FidObject, Info};
use super::info::{getinfo_failure, Extras, Query};
use super::liveness::{sockaddr_in, TcpLiveness};
use super::shm::{ShmState, Tick};
use super::IMM_BYTES;
use crate::error::Error;
use crate::provider::Completion;

/// One libfabric `FI_EP_RDM` endpoint with its domain, CQ and AV. See the module docs.
///
/// Teardown order is field order (Rust drops fields top to bottom), after `Drop::drop` has
/// closed any memory region the engine left registered: endpoint, CQ, AV, domain, fabric,
/// `fi_info`, and last the context pool (the provider may touch contexts until the endpoint
/// and CQ are closed).
pub struct LibfabricDomain {
    pub(super) ep: Fid<sys::fid_ep>,
    /// shm only: peer liveness and the endpoint for one-sided operations (`shm/`).
    pub(super) shm: Option<ShmState>,
    /// tcp only: the liveness listener and connections (`liveness.rs`).
    pub(super) tcp_live: Option<TcpLiveness>,
    /// tcp only: failed operations whose peer's liveness connection was still open when
    /// rxm failed them, until that tells whether the peer died (`liveness.rs`, `Suspect`).
    pub(super) tcp_suspects: Vec<super::liveness::Suspect>,
    /// Paces the liveness work of `poll`.
    pub(super) tick: Tick,
    pub(super) cq: Fid<sys::fid_cq>,
    pub(super) av: Fid<sys::fid_av>,
    pub(super) domain: Fid<sys::fid_domain>,
    pub(super) fabric: Fid<sys::fid_fabric>,
    /// The `fi_info` the objects were opened from, kept until they are all closed.
    _info: Info,
    pub(super) ctxs: CtxPool,
    /// Live registrations by `Registration::handle`; closed in `Drop` if the engine left any.
    pub(super) mrs: HashMap<u64, NonNull<sys::fid_mr>>,
    pub(super) transport: String,
    pub(super) address: Vec<u8>,
    pub(super) addr_format: u32,
    pub(super) max_msg_size: usize,
    /// Whether the provider granted `FI_DELIVERY_COMPLETE` as a default transmit op flag:
    /// then a write completes only once its data is placed at the target.
    pub(super) delivery_complete: bool,
    pub(super) mr_mode: u32,
    /// Whether the provider granted `FI_HMEM`: GPU memory is registered with it
    /// (`fi_mr_regattr`, `FI_HMEM_CUDA`) instead of being refused (then staged).
    pub(super) hmem: bool,
    /// The key the next registration asks for (without `FI_MR_PROV_KEY`): a random start,
    /// then +1 per registration, so no two registrations of this domain, nor of an earlier
    /// domain that had the same address, share a key (see `docs/security.md`).
    pub(super) next_key: u64,
    pub(super) wait_fd: Option<RawFd>,
    /// Completions read from the CQ that did not fit in the caller's `max`.
    pub(super) overflow: VecDeque<Completion>,
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
        for extras in Extras::preference(cfg.hmem) {
            if extras.delivery_complete && !cfg.delivery_complete {
                continue;
            }
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
        let (cq_data_size, mr_mode, mr_key_size, addr_format, ep_max_msg, resolved, tx_op_flags, caps) = unsafe {
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
                (*d).mr_key_size,
                (*i).addr_format,
                (*(*i).ep_attr).max_msg_size,
                resolved,
                (*(*i).tx_attr).op_flags,
                (*i).caps,
            )
        };
        let hmem = extras.hmem && caps & sys::FI_HMEM != 0;
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
        tracing::debug!(provider = %resolved, mr_mode = format_args!("{mr_mode:#x}"), hmem, "libfabric provider chosen");

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

        let ep = open_endpoint(&domain, &info, &av, &cq, (sys::FI_TRANSMIT | sys::FI_RECV) as u64)?;
        let mut shm = (resolved == "shm").then(ShmState::new);

        let mut address = getname(&ep)?;
        if let Some(shm) = shm.as_mut() {
            shm.register_local(&address);
        }
        // tcp: a liveness port beside the endpoint, on the same IP (`liveness.rs`).
        let tcp_live = match sockaddr_in(&address) {
            Some(sa) if resolved.starts_with("tcp") => {
                let live = TcpLiveness::listen(sa.ip())?;
                address.extend_from_slice(&live.trailer());
                Some(live)
            }
            _ => None,
        };

        Ok(LibfabricDomain {
            ep,
            shm,
            tcp_live,
            tcp_suspects: Vec::new(),
            tick: Tick::new(),
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
            hmem,
            next_key: first_key(mr_key_size),
            wait_fd,
            overflow: VecDeque::new(),
        })
    }

    /// Opens another endpoint on this domain's AV and CQ (`flags`: what the CQ serves it).
    pub(super) fn open_endpoint(&self, flags: u64) -> Result<Fid<sys::fid_ep>, Error> {
        open_endpoint(&self.domain, &self._info, &self.av, &self.cq, flags)
    }

    /// The `mr_mode` bits the provider asked for (a subset of the offered EFA set).
    pub fn mr_mode(&self) -> u32 {
        self.mr_mode
    }

    /// Whether the provider asked for the `mr_mode` bit `bit`.
    pub(super) fn mr_needs(&self, bit: u32) -> bool {
        self.mr_mode & bit != 0
    }
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

/// Opens an `FI_EP_RDM` endpoint bound to `av` and to `cq` (for `flags`: `FI_TRANSMIT`,
/// `FI_RECV`) and enables it.
fn open_endpoint(
    domain: &Fid<sys::fid_domain>,
    info: &Info,
    av: &Fid<sys::fid_av>,
    cq: &Fid<sys::fid_cq>,
    flags: u64,
) -> Result<Fid<sys::fid_ep>, Error> {
    // shm names its region after the process id (`PID:UID:N`, N counting the process's
    // endpoints). A process killed before it could unlink its regions leaves them in
    // /dev/shm; a later process that gets the same pid finds one, and `fi_enable` fails
    // with EBUSY (libfabric takes over a dead owner's region, but the recorded owner is
    // that pid, alive again as us) after unlinking it. The next endpoint takes the next N,
    // so a few tries get past every region the dead process left.
    let mut tries = 0;
    loop {
        match open_endpoint_once(domain, info, av, cq, flags) {
            Err(Error::Provider { call: "fi_enable", errno, .. })
                if errno == libc::EBUSY && tries < STALE_SHM_TRIES =>
            {
                tries += 1;
                tracing::info!(
                    tries,
                    "fi_enable: EBUSY (a region a dead process of our pid left in /dev/shm?); retrying"
                );
            }
            r => return r,
        }
    }
}

/// How many EBUSY endpoints `open_endpoint` gets past (regions a dead process of the same
/// pid left behind: one per endpoint it had).
const STALE_SHM_TRIES: u32 = 64;

fn open_endpoint_once(
    domain: &Fid<sys::fid_domain>,
    info: &Info,
    av: &Fid<sys::fid_av>,
    cq: &Fid<sys::fid_cq>,
    flags: u64,
) -> Result<Fid<sys::fid_ep>, Error> {
    let mut ep = ptr::null_mut();
    // SAFETY: domain is open, info is the fi_info it was opened from.
    let ret =
        unsafe { sys::fabric_shim_fi_endpoint(domain.as_ptr(), info.as_ptr(), &mut ep, ptr::null_mut()) };
    check("fi_endpoint", ret as isize)?;
    let ep = Fid::new(ep, "fi_endpoint")?;
    // SAFETY: ep, av and cq are open objects of the same domain.
    unsafe {
        check("fi_ep_bind(av)", sys::fabric_shim_fi_ep_bind(ep.as_ptr(), av.fid(), 0) as isize)?;
        check("fi_ep_bind(cq)", sys::fabric_shim_fi_ep_bind(ep.as_ptr(), cq.fid(), flags) as isize)?;
        check("fi_enable", sys::fabric_shim_fi_enable(ep.as_ptr()) as isize)?;
    }
    Ok(ep)
}

impl Drop for LibfabricDomain {
    fn drop(&mut self) {
        // The other shm domains of this process take us out of their AV while our regions
        // are mapped, and stop posting to us, before anything closes (`shm/mod.rs`, LOCAL,
        // Removal); then we serve what the others that closed meanwhile asked of us.
        self.shm_before_close();
        if let Some(shm) = self.shm.as_mut() {
            shm.unregister_local();
        }
        self.shm_serve_removals();
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

/// A random first requested key, within the provider's `mr_key_size` bytes and leaving 2^32
/// registrations of room before it wraps; never 0.
fn first_key(mr_key_size: usize) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // std's RandomState is seeded from the OS once per process and advanced per instance.
    let r = std::collections::hash_map::RandomState::new().build_hasher().finish();
    let bits = (mr_key_size.min(8) * 8) as u32;
    if bits <= 32 {
        return 1;
    }
    let top = if bits >= 64 { u64::MAX } else { (1u64 << bits) - 1 };
    ((r & top) & !0xffff_ffff).max(1 << 32)
}
