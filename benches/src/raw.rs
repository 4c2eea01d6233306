//! The ceiling: the provider's domain (a `LibfabricDomain`, or a `VerbsDomain` for
//! `verbs[:DEV]`), opened exactly as the engine opens it and driven directly through the
//! `Domain` trait by one plain thread per side. Post, flush, poll in a loop: no engine, no
//! futures, no reactor, no queue.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use fabric_runtime::bench_hooks::HostMemory;
use fabric_runtime::provider::libfabric::{LibfabricConfig, LibfabricDomain};
use fabric_runtime::provider::verbs::{VerbsConfig, VerbsDomain};
use fabric_runtime::provider::{
    Completion, Domain, LocalSlice, MemoryLocation, Op, PeerHandle, PostError, Registration, RemoteSlice,
};
use fabric_runtime::Error;

use crate::pattern::Pattern;

/// Tokens of posted receives carry this bit; writes use a plain counter.
const RECV_TAG: u64 = 1 << 63;
const RECVS: usize = 16;
const RECV_SLOT: usize = 256;
/// Give up on a stalled loop instead of hanging the benchmark.
const STALL: Duration = Duration::from_secs(60);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whether `provider` names the ibverbs backend (`verbs`, `verbs:DEV`), as the engine reads it.
pub fn is_verbs(provider: &str) -> bool {
    VerbsConfig::from_provider_name(provider).is_some()
}

/// The domain of any backend the bench runs on. One branch per call; the raw loop's
/// operations take microseconds, so this costs nothing measurable.
// One value per side, moved only between bursts: the size of the larger variant is harmless,
// and boxing it would put an indirection on the loop being measured.
#[allow(clippy::large_enum_variant)]
pub enum AnyDomain {
    Libfabric(LibfabricDomain),
    Verbs(VerbsDomain),
}

impl AnyDomain {
    /// Opens the domain the engine would open for this provider name (same config).
    pub fn open(provider: &str) -> Result<AnyDomain, Error> {
        match VerbsConfig::from_provider_name(provider) {
            Some(cfg) => Ok(AnyDomain::Verbs(VerbsDomain::open(&cfg)?)),
            None => Ok(AnyDomain::Libfabric(LibfabricDomain::open(&LibfabricConfig::new(provider))?)),
        }
    }
}

/// `$d.$call` on whichever domain this is.
macro_rules! each {
    ($self:expr, $d:ident => $e:expr) => {
        match $self {
            AnyDomain::Libfabric($d) => $e,
            AnyDomain::Verbs($d) => $e,
        }
    };
}

impl Domain for AnyDomain {
    fn transport(&self) -> &str {
        each!(self, d => d.transport())
    }
    fn address(&self) -> Vec<u8> {
        each!(self, d => d.address())
    }
    fn max_msg_size(&self) -> usize {
        each!(self, d => d.max_msg_size())
    }
    fn delivery_complete(&self) -> bool {
        each!(self, d => d.delivery_complete())
    }
    unsafe fn register(
        &mut self,
        addr: u64,
        len: usize,
        location: MemoryLocation,
    ) -> Result<Registration, Error> {
        // SAFETY: forwarded from the caller.
        each!(self, d => unsafe { d.register(addr, len, location) })
    }
    fn deregister(&mut self, reg: Registration) {
        each!(self, d => d.deregister(reg))
    }
    fn add_peer(&mut self, addr: &[u8]) -> Result<PeerHandle, Error> {
        each!(self, d => d.add_peer(addr))
    }
    unsafe fn post(&mut self, token: u64, op: &Op) -> Result<(), PostError> {
        // SAFETY: forwarded from the caller.
        each!(self, d => unsafe { d.post(token, op) })
    }
    fn flush(&mut self) {
        each!(self, d => d.flush())
    }
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize, Error> {
        each!(self, d => d.poll(out, max))
    }
    fn wait_fd(&self) -> Option<RawFd> {
        each!(self, d => d.wait_fd())
    }
    fn arm(&mut self) -> bool {
        each!(self, d => d.arm())
    }
    fn ack_wakeup(&mut self) {
        each!(self, d => d.ack_wakeup())
    }
}

/// One side of the raw loop over domain `D` (the bench uses [`AnyDomain`]).
pub struct Raw<D: Domain = AnyDomain> {
    dom: D,
    /// The registered bytes, made as the engine makes a region (`--huge-pages`).
    buf: HostMemory,
    len: usize,
    reg: Registration,
    peer: PeerHandle,
    remote_base: u64,
    remote_key: u64,
    comps: Vec<Completion>,
    imms: HashMap<u32, u64>,
    next_token: u64,
    /// Posted, not yet completed writes.
    outstanding: u64,
    /// `sched_yield` after a poll that found nothing (experiment: `FABRIC_BENCH_RAW_YIELD=1`).
    yield_idle: bool,
    /// `bw --time-calls`: the time inside the domain's post and poll calls, as a timed
    /// engine's reactor keeps it (`EngineBuilder::time_reactor`).
    timed: bool,
    calls: crate::account::Calls,
}

/// Adds the time since `t` (read where calls are timed; `None`: untimed) to `total`.
fn charge(total: &mut Duration, t: Option<Instant>) {
    if let Some(t) = t {
        *total += t.elapsed();
    }
}

impl Raw {
    /// Opens the provider's domain (as the engine does) and registers `len` bytes (plus a few
    /// receive buffers). Returns the side and the bytes to give to the other side.
    pub fn open(provider: &str, len: usize, huge: bool) -> Result<(Raw, Vec<u8>), BoxError> {
        Raw::with_domain(AnyDomain::open(provider)?, len, huge)
    }
}

impl<D: Domain> Raw<D> {
    /// Registers `len` bytes (plus a few receive buffers) with `dom`, in memory made as an
    /// engine with `huge_pages(huge)` makes a region's. Returns the side and the bytes to
    /// give to the other side.
    pub fn with_domain(mut dom: D, len: usize, huge: bool) -> Result<(Raw<D>, Vec<u8>), BoxError> {
        let total = len + RECVS * RECV_SLOT;
        let buf = HostMemory::new(total, huge, 0x5a)?;
        // SAFETY: `buf` is owned by the returned `Raw`, never moved out of it, and is dropped
        // only after `Drop for Raw` deregistered it.
        let reg = unsafe { dom.register(buf.addr(), total, MemoryLocation::Host)? };
        let mut mine = Vec::new();
        let addr = dom.address();
        mine.extend_from_slice(&(addr.len() as u32).to_le_bytes());
        mine.extend_from_slice(&addr);
        mine.extend_from_slice(&reg.remote_base.to_le_bytes());
        mine.extend_from_slice(&reg.remote_key.to_le_bytes());
        let raw = Raw {
            dom,
            buf,
            len,
            reg,
            peer: 0,
            remote_base: 0,
            remote_key: 0,
            comps: Vec::with_capacity(64),
            imms: HashMap::new(),
            next_token: 0,
            outstanding: 0,
            yield_idle: std::env::var_os("FABRIC_BENCH_RAW_YIELD").is_some_and(|v| v == "1"),
            timed: false,
            calls: Default::default(),
        };
        Ok((raw, mine))
    }

    /// Times the domain's post and poll calls from now on (`bw --time-calls`).
    pub fn time_calls(&mut self, on: bool) {
        self.timed = on;
    }

    /// The time inside the domain's calls so far (zero unless [`Raw::time_calls`]).
    pub fn calls(&self) -> crate::account::Calls {
        self.calls
    }

    fn clock(&self) -> Option<Instant> {
        self.timed.then(Instant::now)
    }

    /// Adds the other side from its `open` bytes and posts the receive buffers. Both sides
    /// call it (verbs resolves the simultaneous open; its posts return `Again` until the
    /// connection is up, and `post` keeps polling, which drives the handshake).
    pub fn connect(&mut self, theirs: &[u8]) -> Result<(), BoxError> {
        let n = u32::from_le_bytes(theirs[0..4].try_into()?) as usize;
        let addr = &theirs[4..4 + n];
        self.remote_base = u64::from_le_bytes(theirs[4 + n..12 + n].try_into()?);
        self.remote_key = u64::from_le_bytes(theirs[12 + n..20 + n].try_into()?);
        self.peer = self.dom.add_peer(addr)?;
        for i in 0..RECVS {
            self.post_recv(i)?;
        }
        Ok(())
    }

    fn post_recv(&mut self, i: usize) -> Result<(), BoxError> {
        let local = LocalSlice {
            addr: self.buf.addr() + (self.len + i * RECV_SLOT) as u64,
            len: RECV_SLOT,
            desc: self.reg.local,
        };
        loop {
            let t = self.clock();
            // SAFETY: the slot lies in our registered buffer, alive until Drop.
            let posted = unsafe { self.dom.post(RECV_TAG | i as u64, &Op::Recv { local }) };
            charge(&mut self.calls.post, t);
            match posted {
                Ok(()) => return Ok(()),
                Err(PostError::Again) => self.poll()?,
                Err(PostError::Failed(e)) => return Err(e.into()),
            }
        }
    }

    /// One poll of the CQ: counts immediates and local completions. Flushes first: a backend
    /// may hold posted work until `flush` (verbs chains work requests and rings the doorbell
    /// only there), so every post is followed by a poll before anything waits on it.
    fn poll(&mut self) -> Result<(), BoxError> {
        self.dom.flush();
        let mut comps = std::mem::take(&mut self.comps);
        let t = self.clock();
        let polled = self.dom.poll(&mut comps, 64);
        charge(&mut self.calls.poll, t);
        if polled? == 0 && self.yield_idle {
            std::thread::yield_now();
        }
        for c in comps.drain(..) {
            match c {
                Completion::Done { .. } => self.outstanding -= 1,
                Completion::Imm { imm } => *self.imms.entry(imm).or_insert(0) += 1,
                Completion::Recv { token, .. } => self.post_recv((token & !RECV_TAG) as usize)?,
                Completion::Failed { message, .. } => return Err(format!("raw op failed: {message}").into()),
                Completion::PeerDown { message, .. } => {
                    return Err(format!("raw loop's peer down: {message}").into())
                }
            }
        }
        self.comps = comps;
        Ok(())
    }

    /// Tries once to post a write of `len` bytes at `off` (both sides) carrying `imm`
    /// (`len == 0`: imm-only). `Ok(false)`: the queue is full, poll and retry.
    fn try_post(&mut self, off: usize, len: usize, imm: u32) -> Result<bool, BoxError> {
        let local = LocalSlice {
            addr: if len == 0 { 0 } else { self.buf.addr() + off as u64 },
            len,
            desc: if len == 0 { 0 } else { self.reg.local },
        };
        let remote = RemoteSlice { addr: self.remote_base + off as u64, key: self.remote_key };
        let op = Op::Write { peer: self.peer, local, remote, imm: Some(imm) };
        self.next_token += 1;
        let t = self.clock();
        // SAFETY: the local range lies in our registered buffer, alive until Drop.
        let posted = unsafe { self.dom.post(self.next_token, &op) };
        charge(&mut self.calls.post, t);
        match posted {
            Ok(()) => {
                self.outstanding += 1;
                Ok(true)
            }
            Err(PostError::Again) => Ok(false),
            Err(PostError::Failed(e)) => Err(e.into()),
        }
    }

    fn post(&mut self, off: usize, len: usize, imm: u32) -> Result<(), BoxError> {
        let t = Instant::now();
        while !self.try_post(off, len, imm)? {
            self.poll()?;
            if t.elapsed() > STALL {
                return Err("raw loop: the send queue stayed full".into());
            }
        }
        // To the NIC now, not at the next poll (a ping-pong waits on the answer to this one).
        self.dom.flush();
        Ok(())
    }

    /// One imm-only write each way, so that connection setup is not timed.
    pub fn warm_up(&mut self, imm: u32) -> Result<(), BoxError> {
        self.post(0, 0, imm)?;
        self.wait_imm(imm, 1)?;
        self.drain()
    }

    /// Polls until `n` arrivals of `imm` are there, then consumes them.
    pub fn wait_imm(&mut self, imm: u32, n: u64) -> Result<(), BoxError> {
        let t = Instant::now();
        let mut spins = 0u32;
        loop {
            let have = self.imms.get(&imm).copied().unwrap_or(0);
            if have >= n {
                self.imms.insert(imm, have - n);
                return Ok(());
            }
            self.poll()?;
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && t.elapsed() > STALL {
                return Err(format!("raw loop: only {have} of {n} arrivals of imm {imm}").into());
            }
        }
    }

    /// Polls until every posted write has completed locally.
    pub fn drain(&mut self) -> Result<(), BoxError> {
        let t = Instant::now();
        while self.outstanding > 0 {
            self.poll()?;
            if t.elapsed() > STALL {
                return Err("raw loop: writes never completed".into());
            }
        }
        Ok(())
    }

    /// Streams `ops` writes of `size` bytes with `window` in flight (imm `imm`; `size == 0`:
    /// imm-only), at the offsets of `pattern` in the registered `len` bytes (the engine's
    /// `engine_stream` uses the same), then waits for the receiver's `ack`. Returns the
    /// elapsed time.
    pub fn stream(
        &mut self,
        size: usize,
        ops: u64,
        window: u64,
        (imm, ack): (u32, u32),
        pattern: Pattern,
    ) -> Result<Duration, BoxError> {
        let t0 = Instant::now();
        let mut posted = 0u64;
        while posted < ops {
            while posted < ops && self.outstanding < window {
                let off = pattern.offset(posted, size, self.len);
                if !self.try_post(off, size, imm)? {
                    break;
                }
                posted += 1;
            }
            // `poll` flushes the batch just posted (one doorbell on verbs), then reaps.
            self.poll()?;
            if t0.elapsed() > STALL {
                return Err("raw stream stalled".into());
            }
        }
        self.drain()?;
        self.wait_imm(ack, 1)?;
        Ok(t0.elapsed())
    }

    /// Receiving side of [`Raw::stream`]: counts `ops` arrivals of `imm`, then acks.
    pub fn absorb(&mut self, ops: u64, imm: u32, ack: u32) -> Result<(), BoxError> {
        self.wait_imm(imm, ops)?;
        self.post(0, 0, ack)?;
        self.drain()
    }

    /// `iters` round trips of `size` bytes (ping `a`, pong `b`); the round-trip times.
    pub fn ping(&mut self, size: usize, iters: usize, a: u32, b: u32) -> Result<Vec<Duration>, BoxError> {
        let mut rtts = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            self.post(0, size, a)?;
            self.wait_imm(b, 1)?;
            rtts.push(t.elapsed());
        }
        self.drain()?;
        Ok(rtts)
    }

    /// The other side of [`Raw::ping`].
    pub fn pong(&mut self, size: usize, iters: usize, a: u32, b: u32) -> Result<(), BoxError> {
        for _ in 0..iters {
            self.wait_imm(a, 1)?;
            self.post(0, size, b)?;
        }
        self.drain()
    }
}

impl<D: Domain> Drop for Raw<D> {
    fn drop(&mut self) {
        // Completions still owed by the provider are flushed by closing the endpoint (in
        // the domain's own Drop), which happens after this deregistration: the buffer itself
        // is dropped after both, as a field declared after `dom`.
        let _ = self.drain_briefly();
        self.dom.deregister(self.reg);
    }
}

impl<D: Domain> Raw<D> {
    fn drain_briefly(&mut self) -> Result<(), BoxError> {
        let t = Instant::now();
        while self.outstanding > 0 && t.elapsed() < Duration::from_secs(1) {
            self.poll()?;
        }
        Ok(())
    }
}
