//! The [`Domain`] impl: posting (`fi_writedata`, `fi_write`, `fi_read`, `fi_send`, `fi_recv`
//! with a context slot each), polling (`fi_cq_readfrom`, error entries with `fi_cq_readerr`,
//! entries classified into [`Completion`]s), `fi_trywait` before the reactor sleeps, and the
//! cold calls of the contract.

use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr};
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::ptr;

use libfabric_sys as sys;

use super::address::validate_peer_address;
use super::error::{check, strerror, EAGAIN, EAVAIL};
use super::liveness::{sockaddr_in, Suspect, TRAILER};
use super::LibfabricDomain;
use crate::error::Error;
use crate::provider::{
    is_peer_errno, Completion, Domain, FailCause, LocalSlice, MemoryLocation, Op, PeerHandle, PostError,
    Registration,
};

/// How long `revive_peer` waits for a tcp peer's liveness port to accept (a live peer on
/// the same network answers within a round trip; a dead one refuses at once).
const REVIVE_CONNECT_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// How long posts to a live tcp peer wait after rxm tore its connection down (see
/// `TcpLiveness::hold`).
const RECONNECT_HOLD: std::time::Duration = std::time::Duration::from_millis(20);

/// Completions read from the CQ per `fi_cq_readfrom` call.
const CQ_BATCH: usize = 16;

/// `fi_addr_t` of a completion's source as a [`PeerHandle`].
fn peer_of(src: sys::fi_addr_t) -> Option<PeerHandle> {
    (src != sys::FI_ADDR_NOTAVAIL).then_some(src)
}

impl LibfabricDomain {
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

    /// Posts `op` with `token`: one-sided operations on shm's one-sided endpoint (`shm/`),
    /// everything else on the main endpoint.
    ///
    /// # Safety
    ///
    /// As [`Domain::post`].
    pub(super) unsafe fn post_on(&mut self, token: u64, op: &Op) -> Result<(), PostError> {
        if let Op::Send { local, .. } = op {
            if local.len > self.max_msg_size {
                return Err(PostError::Failed(Error::MessageTooLarge {
                    len: local.len,
                    max: self.max_msg_size,
                }));
            }
        }
        if let (Some(live), Op::Write { peer, .. } | Op::Read { peer, .. } | Op::Send { peer, .. }) =
            (self.tcp_live.as_mut(), op)
        {
            if live.held(*peer) {
                return Err(PostError::Again);
            }
        }
        // An shm peer in this process: hold its registration until the post returns.
        let _local = match (&self.shm, op) {
            (Some(shm), Op::Write { peer, .. } | Op::Read { peer, .. } | Op::Send { peer, .. }) => {
                shm.local_guard(*peer).map_err(PostError::Failed)?
            }
            _ => None,
        };
        let ep = match (&self.shm, op) {
            (Some(shm), Op::Write { peer, .. } | Op::Read { peer, .. }) => {
                shm.rma_ep(*peer).unwrap_or(self.ep.as_ptr())
            }
            _ => self.ep.as_ptr(),
        };
        let slot = self.ctxs.take(token, op);
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
            0.. => {
                if let (Some(shm), Op::Write { imm: None, .. } | Op::Read { .. }) = (self.shm.as_mut(), op) {
                    shm.posted_fast(&self.ctxs, slot, token);
                }
                Ok(())
            }
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

    /// Takes `peer`'s address out of the AV (`fi_av_remove`); a failure is only logged.
    pub(super) fn av_remove(&mut self, peer: PeerHandle) {
        let mut addr = peer;
        // SAFETY: av is open; one fi_addr_t is read from `addr`.
        let ret = unsafe { sys::fabric_shim_fi_av_remove(self.av.as_ptr(), &mut addr, 1, 0) };
        if let Err(e) = check("fi_av_remove", ret as isize) {
            tracing::debug!(peer, error = %e, "removing a peer's address failed; it stays in the AV");
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
        let op = if err.op_context.is_null() { None } else { self.ctxs.complete_op(err.op_context) };
        match op {
            Some((token, op)) => {
                // rxm fails what was in flight on a connection that closed with ECANCELED,
                // the cause (ENOTCONN, ECONNRESET) being the provider's own code: pass on
                // the cause, so that the engine knows the peer is gone.
                let errno = if is_peer_errno(err.prov_errno) { err.prov_errno } else { err.err };
                let cause = FailCause::of_errno(errno);
                // The tcp provider closes a connection over which a peer sent an unknown
                // key (a stale or forged descriptor), and rxm then fails everything in
                // flight on it (ECANCELED, or the cause ENOTCONN/ECONNRESET): if the peer's
                // liveness connection is still open, its process lives, and the connection
                // is made again by the next post to it. Which of the failed operations had
                // the bad key, the provider does not say.
                let peer = match op {
                    Op::Write { peer, .. } | Op::Read { peer, .. } | Op::Send { peer, .. } => Some(peer),
                    Op::Recv { .. } => None,
                };
                // A killed peer's liveness connection may close a moment after rxm failed
                // this: the operation waits (`liveness.rs`, `SUSPECT_WAIT`) to be told apart.
                let lost = cause == FailCause::PeerLost || errno == libc::ECANCELED;
                if let (true, Some(live), Some(peer)) = (lost, self.tcp_live.as_mut(), peer) {
                    if live.alive(peer) == Some(true) {
                        live.hold(peer, RECONNECT_HOLD);
                        let since = std::time::Instant::now();
                        self.tcp_suspects.push(Suspect { since, peer, token, errno, message });
                        return Ok(true);
                    }
                }
                out.push_back(Completion::Failed { token, errno, message, cause })
            }
            // shm's fast RMA path (a plain write or read copied with CMA in the post call)
            // reports a failed copy without the operation's context: it is the oldest such
            // operation still in flight (`shm/mod.rs`, `ShmState::fast`). Target-side errors
            // (an incoming operation that failed here) carry FI_REMOTE_* or FI_RECV.
            None if self.shm.is_some()
                && err.op_context.is_null()
                && err.flags & (sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE | sys::FI_RECV) as u64 == 0 =>
            {
                let failed = self.shm.as_mut().and_then(|shm| shm.take_failed_fast(&self.ctxs));
                match failed.and_then(|(slot, _)| self.ctxs.complete(slot.as_ptr().cast())) {
                    Some(token) => out.push_back(Completion::Failed {
                        token,
                        errno: err.err.abs(),
                        message: format!(
                            "{message}: the peer's memory at that address is not accessible (a freed region, or a forged descriptor)"
                        ),
                        cause: FailCause::RemoteAccess,
                    }),
                    None => tracing::warn!(
                        errno = err.err,
                        %message,
                        "shm error completion without a context and no plain write or read in flight; skipped"
                    ),
                }
            }
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

    /// shm: a write with immediate goes through the owner's provider, whose
    /// `smr_progress_cmd_rma` fails `ofi_mr_verify` and sends no response (libfabric 1.17).
    /// tcp's provider closes the connection and rxm fails the operation (`ConnectionLost`),
    /// so it needs no vouching.
    fn refuses_bad_keys_silently(&self) -> bool {
        self.shm.is_some()
    }

    unsafe fn register(
        &mut self,
        addr: u64,
        len: usize,
        location: MemoryLocation,
    ) -> Result<Registration, Error> {
        // SAFETY: forwarded from the caller (the range stays allocated until deregister).
        unsafe { self.register_memory(addr, len, location) }
    }

    fn deregister(&mut self, reg: Registration) {
        self.deregister_memory(reg);
    }

    fn add_peer(&mut self, addr: &[u8]) -> Result<PeerHandle, Error> {
        let malformed = |reason: String| Error::Malformed { what: "peer address", reason };
        validate_peer_address(self.addr_format, &self.address, addr, &self.transport)?;
        // A tcp address ends in the liveness port (`liveness.rs`); libfabric gets the rest.
        let (addr, trailer) = match self.tcp_live {
            Some(_) => {
                let (a, t) = addr.split_at(addr.len() - TRAILER);
                (a, Some([t[0], t[1]]))
            }
            None => (addr, None),
        };
        // shm: no endpoint of this process closes until the peer's endpoint is enabled, and
        // none that closed stays in the AV (`shm_prepare_add`).
        let _local = if self.shm.is_some() { Some(self.shm_prepare_add(addr)?) } else { None };
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
            Ok(1) if fi_addr != sys::FI_ADDR_NOTAVAIL => {
                if self.shm.is_some() {
                    if let Err(e) = self.shm_add_peer(fi_addr, addr) {
                        self.av_remove(fi_addr);
                        return Err(e);
                    }
                }
                if let (Some(live), Some(t), Some(sa)) = (self.tcp_live.as_mut(), trailer, sockaddr_in(addr))
                {
                    live.watch(fi_addr, sa.ip(), t);
                }
                Ok(fi_addr)
            }
            Ok(_) => Err(malformed("the provider rejected the address".into())),
            Err(Error::Provider { errno, message, .. }) if errno == sys::FI_EINVAL as i32 => {
                Err(malformed(message))
            }
            Err(e) => Err(e),
        }
    }

    unsafe fn post(&mut self, token: u64, op: &Op) -> Result<(), PostError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.post_on(token, op) }
    }

    fn revive_peer(&mut self, peer: PeerHandle) -> Result<(), Error> {
        if self.shm.is_some() {
            self.shm_revive_peer(peer)?;
        }
        if let Some(live) = self.tcp_live.as_mut() {
            if let Some(addr) = live.address_of(peer) {
                live.revive(peer, addr, REVIVE_CONNECT_LIMIT)?;
            }
        }
        Ok(())
    }

    fn remove_peer(&mut self, peer: PeerHandle) {
        if self.shm.is_some() {
            let mut out = std::mem::take(&mut self.overflow);
            self.shm_drop_peer(peer, libc::ECANCELED, "the peer was removed", &mut out);
            self.overflow = out;
        }
        if let Some(live) = self.tcp_live.as_mut() {
            live.unwatch(peer);
        }
        self.av_remove(peer);
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
                // Entries left uninitialised: this runs on every poll of a spinning caller,
                // and zeroing 640 bytes each time showed in its profile (memset, ~7%). The
                // sources stay set: util CQs opened without FI_SOURCE do not write them.
                let mut entries = [const { MaybeUninit::<sys::fi_cq_data_entry>::uninit() }; CQ_BATCH];
                let mut srcs = [sys::FI_ADDR_NOTAVAIL; CQ_BATCH];
                let want = (max - got).min(CQ_BATCH);
                // SAFETY: cq is open with FI_CQ_FORMAT_DATA, so each entry is an
                // fi_cq_data_entry; both arrays hold at least `want` entries, which libfabric
                // only writes.
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
                        let n = (check("fi_cq_readfrom", ret)? as usize).min(want);
                        for (e, &src) in entries.iter().zip(srcs.iter()).take(n) {
                            // SAFETY: fi_cq_readfrom returned `n`: it wrote the first `n`
                            // entries.
                            let e = unsafe { e.assume_init_ref() };
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
        if !self.tcp_suspects.is_empty() {
            self.tcp_settle(&mut pending);
        }
        // A peer's death, retired endpoints, re-posts: after the CQ was read, so that a
        // completion already there is not reported as a failure.
        // Closing shm domains of this process wait for us to take them out of the AV.
        self.shm_serve_removals();
        if (self.shm.is_some() || self.tcp_live.is_some()) && self.tick.due() {
            self.shm_maintenance(&mut pending);
            self.tcp_maintenance(&mut pending);
        }
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
        // The liveness checks of the first poll after the sleep are not put off.
        self.tick.slept();
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

    /// tcp with watched peers: their liveness connections are not wait fds, so a sleep
    /// ends within `liveness::SLEEP_CHECK` to look at them.
    fn timer(&self) -> Option<std::time::Duration> {
        if !self.tcp_suspects.is_empty() {
            // A failed operation waits to be told apart (`SUSPECT_WAIT`): look again soon.
            return Some(super::liveness::SUSPECT_WAIT / 4);
        }
        self.tcp_live.as_ref().filter(|l| l.watching()).map(|_| super::liveness::SLEEP_CHECK)
    }

    /// Nothing to acknowledge: libfabric's wait fd is level-triggered on the provider's own
    /// sockets/signals and is reset by reading the CQ, which the reactor does next.
    fn ack_wakeup(&mut self) {}
}
