//! Backend-level tests of the libfabric backend against real providers on loopback:
//! two `LibfabricDomain`s in one process, talking over `tcp;ofi_rxm`, `shm` and `udp;ofi_rxd`.
//!
//! Every loop is bounded in iterations and time. Traffic stays on 127.0.0.1 (the backend binds
//! the socket providers there and sets `FI_TCP_IFACE=lo`).
#![cfg(feature = "libfabric")]

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fabric_runtime::provider::libfabric::{LibfabricConfig, LibfabricDomain};
use fabric_runtime::provider::{
    Completion, Domain, LocalSlice, MemoryLocation, Op, PeerHandle, PostError, Registration, RemoteSlice,
};
use fabric_runtime::Error;

/// libfabric initialisation and `FI_TCP_IFACE` are process-global: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const DEADLINE: Duration = Duration::from_secs(5);
const MAX_SPINS: usize = 5_000_000;
const BUF: usize = 4096;

/// Heap memory handed to the provider; only read and written through raw pointers, because
/// the provider writes into it while the test holds it.
struct Mem {
    ptr: *mut u8,
    len: usize,
}

impl Mem {
    fn new(len: usize) -> Mem {
        let b = vec![0u8; len].into_boxed_slice();
        Mem { ptr: Box::into_raw(b) as *mut u8, len }
    }
    fn addr(&self, off: usize) -> u64 {
        assert!(off <= self.len);
        self.ptr as u64 + off as u64
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds; the test is single-threaded and the providers only write into
        // this memory inside post/poll calls on this thread.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), v.as_mut_ptr(), len) };
        v
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: as in read().
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from Box::into_raw of a boxed slice of this length.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

struct Side {
    d: LibfabricDomain,
    mem: Mem,
    reg: Registration,
    got: Vec<Completion>,
}

impl Side {
    fn open(provider: &str) -> Side {
        let mut d = LibfabricDomain::open(&LibfabricConfig::new(provider))
            .unwrap_or_else(|e| panic!("opening {provider}: {e}"));
        let mem = Mem::new(BUF);
        // SAFETY: mem outlives the registration (deregistered in close()).
        let reg = unsafe { d.register(mem.addr(0), BUF, MemoryLocation::Host) }.expect("register");
        Side { d, mem, reg, got: Vec::new() }
    }

    fn local(&self, off: usize, len: usize) -> LocalSlice {
        LocalSlice { addr: self.mem.addr(off), len, desc: self.reg.local }
    }

    fn remote(&self, off: usize) -> RemoteSlice {
        RemoteSlice { addr: self.reg.remote_base + off as u64, key: self.reg.remote_key }
    }

    fn poll(&mut self) {
        let n = self.d.poll(&mut self.got, 64).expect("poll");
        assert!(n <= 64);
    }

    fn has(&self, c: &Completion) -> bool {
        self.got.contains(c)
    }

    fn close(mut self) -> Vec<Completion> {
        self.d.deregister(self.reg);
        std::mem::take(&mut self.got)
    }
}

/// Polls both sides until `done` holds; panics with `what` after the deadline.
fn pump(a: &mut Side, b: &mut Side, what: &str, done: impl Fn(&Side, &Side) -> bool) {
    let start = Instant::now();
    for _ in 0..MAX_SPINS {
        a.poll();
        b.poll();
        if done(a, b) {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out waiting for {what}; a got {:?}, b got {:?}",
            a.got,
            b.got
        );
    }
    panic!("gave up waiting for {what} after {MAX_SPINS} polls; a got {:?}, b got {:?}", a.got, b.got);
}

/// Posts on `a`, polling both sides while the queue is full.
fn post(a: &mut Side, b: &mut Side, token: u64, op: Op) {
    let start = Instant::now();
    loop {
        // SAFETY: every slice in the tests lies in a registered Mem that outlives the domain's
        // use of it (the test waits for every completion before closing).
        match unsafe { a.d.post(token, &op) } {
            Ok(()) => return,
            Err(PostError::Again) => {
                a.poll();
                b.poll();
                assert!(start.elapsed() < DEADLINE, "post of {op:?} stayed Again");
            }
            Err(PostError::Failed(e)) => panic!("post of {op:?} failed: {e}"),
        }
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn connect(a: &mut Side, b: &mut Side) -> (PeerHandle, PeerHandle) {
    let a_to_b = a.d.add_peer(&b.d.address()).expect("a.add_peer(b)");
    let b_to_a = b.d.add_peer(&a.d.address()).expect("b.add_peer(a)");
    (a_to_b, b_to_a)
}

/// The whole scenario on one provider; returns the two sides, connected and idle.
fn exercise(provider: &str) -> (Side, Side, PeerHandle, PeerHandle) {
    let mut a = Side::open(provider);
    let mut b = Side::open(provider);
    assert_eq!(a.d.transport(), b.d.transport());
    assert!(a.d.max_msg_size() >= 256);
    let (a_to_b, b_to_a) = connect(&mut a, &mut b);

    // Two-sided: b posts a receive first.
    let op = Op::Recv { local: b.local(2048, 256) };
    post(&mut b, &mut a, 100, op);

    // 1. Write with immediate.
    let p1 = pattern(1, 1024);
    a.mem.write(0, &p1);
    let op = Op::Write { peer: a_to_b, local: a.local(0, 1024), remote: b.remote(0), imm: Some(0xdead_beef) };
    post(&mut a, &mut b, 1, op);
    pump(&mut a, &mut b, "write+imm", |a, b| {
        a.has(&Completion::Done { token: 1 }) && b.has(&Completion::Imm { imm: 0xdead_beef })
    });
    assert_eq!(b.mem.read(0, 1024), p1, "write+imm bytes");

    // 2. Plain write: no completion at the target, so wait for the bytes.
    let p2 = pattern(2, 512);
    a.mem.write(1024, &p2);
    let op = Op::Write { peer: a_to_b, local: a.local(1024, 512), remote: b.remote(1024), imm: None };
    post(&mut a, &mut b, 2, op);
    pump(&mut a, &mut b, "plain write", |a, b| {
        a.has(&Completion::Done { token: 2 }) && b.mem.read(1024, 512) == p2
    });

    // 3. Imm-only (zero-byte) write.
    let op = Op::Write { peer: a_to_b, local: a.local(0, 0), remote: b.remote(0), imm: Some(42) };
    post(&mut a, &mut b, 3, op);
    pump(&mut a, &mut b, "imm-only write", |a, b| {
        a.has(&Completion::Done { token: 3 }) && b.has(&Completion::Imm { imm: 42 })
    });

    // 3b. Imm-only with a null local slice (no buffer at all).
    let op = Op::Write {
        peer: a_to_b,
        local: LocalSlice { addr: 0, len: 0, desc: 0 },
        remote: b.remote(0),
        imm: Some(43),
    };
    post(&mut a, &mut b, 6, op);
    pump(&mut a, &mut b, "imm-only write without buffer", |a, b| {
        a.has(&Completion::Done { token: 6 }) && b.has(&Completion::Imm { imm: 43 })
    });

    // 4. Read from b into a.
    let p4 = pattern(4, 100);
    b.mem.write(3000, &p4);
    let op = Op::Read { peer: a_to_b, local: a.local(3000, 100), remote: b.remote(3000) };
    post(&mut a, &mut b, 4, op);
    pump(&mut a, &mut b, "read", |a, _| a.has(&Completion::Done { token: 4 }));
    assert_eq!(a.mem.read(3000, 100), p4, "read bytes");

    // 5. Send a -> b into the receive posted at the start.
    let p5 = pattern(5, 100);
    a.mem.write(2048, &p5);
    let op = Op::Send { peer: a_to_b, local: a.local(2048, 100) };
    post(&mut a, &mut b, 5, op);
    pump(&mut a, &mut b, "send/recv", |a, b| {
        a.has(&Completion::Done { token: 5 })
            && b.got.iter().any(|c| matches!(c, Completion::Recv { token: 100, .. }))
    });
    let recv = b.got.iter().find(|c| matches!(c, Completion::Recv { .. })).unwrap();
    let Completion::Recv { len, src, .. } = recv else { unreachable!() };
    // tcp;ofi_rxm reports no source without the FI_SOURCE capability (not requested).
    assert_eq!(*len, 100);
    if let Some(src) = src {
        assert_eq!(*src, b_to_a, "recv src is the handle b gave a");
    }
    assert_eq!(b.mem.read(2048, 100), p5, "send bytes");

    // Exactly one completion per token, no failures, imms only where expected.
    for (side, tokens) in [(&a, vec![1, 2, 3, 4, 5, 6]), (&b, vec![100])] {
        let mut seen = HashSet::new();
        for c in &side.got {
            match c {
                Completion::Done { token } | Completion::Recv { token, .. } => {
                    assert!(seen.insert(*token), "token {token} completed twice");
                }
                Completion::Failed { token, errno, message, .. } => {
                    panic!("token {token} failed: {message} ({errno})")
                }
                Completion::Imm { .. } => {}
                Completion::PeerDown { peer, message } => panic!("peer {peer} reported down: {message}"),
            }
        }
        assert_eq!(seen, tokens.into_iter().collect::<HashSet<_>>());
    }
    let imms: Vec<_> = b.got.iter().filter(|c| matches!(c, Completion::Imm { .. })).collect();
    assert_eq!(imms.len(), 3, "b got {:?}", b.got);
    assert!(!a.got.iter().any(|c| matches!(c, Completion::Imm { .. })));
    a.got.clear();
    b.got.clear();
    (a, b, a_to_b, b_to_a)
}

#[test]
fn tcp_write_imm_read_send_and_wait_fd() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut a, mut b, a_to_b, _) = exercise("tcp");
    assert_eq!(a.d.transport(), "tcp;ofi_rxm");
    let fd = b.d.wait_fd().expect("tcp has a CQ wait fd");

    // Drain b until it may sleep.
    let start = Instant::now();
    while !b.d.arm() {
        b.poll();
        assert!(start.elapsed() < DEADLINE, "b never became armable");
    }
    // a writes; b's fd must become readable while b does not poll.
    a.mem.write(0, &pattern(9, 64));
    let op = Op::Write { peer: a_to_b, local: a.local(0, 64), remote: b.remote(0), imm: Some(77) };
    // SAFETY: registered memory that outlives the operation.
    unsafe { a.d.post(7, &op) }.expect("post");
    let start = Instant::now();
    let mut readable = false;
    while start.elapsed() < DEADLINE {
        a.poll();
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, 20 ms timeout.
        let r = unsafe { libc::poll(&mut pfd, 1, 20) };
        assert!(r >= 0, "poll(2) failed");
        if r == 1 && pfd.revents & libc::POLLIN != 0 {
            readable = true;
            break;
        }
    }
    assert!(readable, "tcp CQ wait fd never became readable after the peer's write");
    b.d.ack_wakeup();
    pump(&mut a, &mut b, "imm after wakeup", |a, b| {
        a.has(&Completion::Done { token: 7 }) && b.has(&Completion::Imm { imm: 77 })
    });
    assert_eq!(b.mem.read(0, 64), pattern(9, 64));
    a.close();
    b.close();
}

#[test]
fn shm_write_imm_read_send_no_wait_fd() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut a, b, _, _) = exercise("shm");
    assert_eq!(a.d.transport(), "shm");
    assert_eq!(a.d.wait_fd(), None, "shm has no CQ wait fd");
    assert!(!a.d.arm(), "without a wait fd arm() must say: poll");
    a.close();
    b.close();
}

#[test]
fn udp_small_run() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b, _, _) = exercise("udp");
    assert_eq!(a.d.transport(), "udp;ofi_rxd");
    a.close();
    b.close();
}

#[test]
fn unknown_provider_is_not_found() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    match LibfabricDomain::open(&LibfabricConfig::new("no_such_provider")) {
        Err(Error::ProviderNotFound { provider, .. }) => assert_eq!(provider, "no_such_provider"),
        other => panic!("expected ProviderNotFound, got {other:?}"),
    }
}

/// A provider that exists but cannot carry the remote CQ data asked for is told apart from
/// a missing one: real `fi_getinfo` calls, the full hints refused, the minimal ones not.
#[test]
fn provider_without_enough_cq_data_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for provider in ["tcp", "shm"] {
        let cfg = LibfabricConfig { cq_data_size: 64, ..LibfabricConfig::new(provider) };
        match LibfabricDomain::open(&cfg) {
            Err(Error::NoRemoteCqData { provider: p, reason }) => {
                assert!(p.starts_with(provider), "{p}");
                assert!(reason.contains("remote CQ data"), "{reason}");
            }
            other => panic!("{provider}: expected NoRemoteCqData, got {other:?}"),
        }
        // The same provider with the immediate's 4 bytes opens.
        LibfabricDomain::open(&LibfabricConfig::new(provider)).expect("4 bytes of CQ data");
    }
}

#[test]
fn bad_peer_addresses_are_malformed() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for provider in ["tcp", "shm"] {
        let mut d = LibfabricDomain::open(&LibfabricConfig::new(provider)).expect("open");
        let good = d.address();
        for bad in [vec![], vec![1, 2, 3], vec![0xff; good.len() + 1]] {
            match d.add_peer(&bad) {
                Err(Error::Malformed { what: "peer address", .. }) => {}
                other => panic!("{provider}: {bad:?} gave {other:?}"),
            }
        }
        if provider == "tcp" {
            // Right length, wrong address family.
            let mut wrong = good.clone();
            wrong[0] = 0xff;
            wrong[1] = 0xff;
            assert!(matches!(d.add_peer(&wrong), Err(Error::Malformed { .. })));
        }
    }
}

#[test]
fn send_larger_than_max_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut a = Side::open("shm");
    let mut b = Side::open("shm");
    let (a_to_b, _) = connect(&mut a, &mut b);
    let max = a.d.max_msg_size();
    assert!(max <= 8192);
    let big = Mem::new(max + 1);
    let op = Op::Send { peer: a_to_b, local: LocalSlice { addr: big.addr(0), len: max + 1, desc: 0 } };
    // SAFETY: refused before the provider sees it.
    match unsafe { a.d.post(1, &op) } {
        Err(PostError::Failed(Error::MessageTooLarge { len, max: m })) => {
            assert_eq!((len, m), (max + 1, max));
        }
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    a.close();
    b.close();
}

#[test]
fn drop_with_open_registration_and_pending_recv() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for provider in ["tcp", "shm"] {
        let mut a = Side::open(provider);
        let mut b = Side::open(provider);
        connect(&mut a, &mut b);
        let op = Op::Recv { local: a.local(0, 64) };
        // SAFETY: a.mem outlives a.d (fields drop in order: d first, then mem).
        unsafe { a.d.post(1, &op) }.expect("post recv");
        a.poll();
        // Dropping closes the leftover registration, then ep, cq, av, domain, fabric; the
        // pending receive's context is freed after the endpoint is gone.
        drop(a);
        b.close();
    }
}

#[test]
fn poll_respects_max() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut a = Side::open("shm");
    let mut b = Side::open("shm");
    let (a_to_b, _) = connect(&mut a, &mut b);
    for t in 0..5u64 {
        let op = Op::Write {
            peer: a_to_b,
            local: a.local(0, 8),
            remote: b.remote(8 * t as usize),
            imm: Some(1000 + t as u32),
        };
        post(&mut a, &mut b, t, op);
    }
    assert_eq!(b.d.poll(&mut b.got, 0).expect("poll 0"), 0);
    let start = Instant::now();
    let mut imms = Vec::new();
    while imms.len() < 5 {
        a.poll();
        let mut out = Vec::new();
        let n = b.d.poll(&mut out, 1).expect("poll");
        assert!(n <= 1 && out.len() == n, "poll(max=1) gave {out:?}");
        imms.extend(out);
        assert!(start.elapsed() < DEADLINE, "imms: {imms:?}");
    }
    let want: Vec<_> = (0..5).map(|t| Completion::Imm { imm: 1000 + t }).collect();
    let mut got = imms.clone();
    got.sort_by_key(|c| match c {
        Completion::Imm { imm } => *imm,
        _ => u32::MAX,
    });
    assert_eq!(got, want);
    pump(&mut a, &mut b, "all writes done", |a, _| (0..5).all(|t| a.has(&Completion::Done { token: t })));
    a.close();
    b.close();
}

/// An operation on a wrong remote key gives exactly one completion at the initiator.
fn bad_remote_key(provider: &str, read: bool) -> Completion {
    let mut a = Side::open(provider);
    let mut b = Side::open(provider);
    let (a_to_b, _) = connect(&mut a, &mut b);
    let remote = RemoteSlice { addr: b.reg.remote_base, key: b.reg.remote_key ^ 0x5a5a };
    let op = if read {
        Op::Read { peer: a_to_b, local: a.local(0, 8), remote }
    } else {
        Op::Write { peer: a_to_b, local: a.local(0, 8), remote, imm: Some(5) }
    };
    post(&mut a, &mut b, 9, op);
    pump(&mut a, &mut b, "completion of the bad op", |a, _| !a.got.is_empty());
    // Keep polling a little: no second completion may follow.
    for _ in 0..1000 {
        a.poll();
        b.poll();
    }
    assert_eq!(a.got.len(), 1, "exactly one completion: {:?}", a.got);
    assert!(!b.got.iter().any(|c| matches!(c, Completion::Imm { .. })));
    let c = a.got[0].clone();
    a.close();
    b.close();
    c
}

/// Measured on libfabric 1.17: tcp;ofi_rxm reports a bad key to the initiator for a read and,
/// because the backend asks for delivery-complete writes, for a write too (`Failed`, errno
/// 125 ECANCELED, provider text "No such file or directory"). shm does not check keys at all
/// (its writes and reads complete `Done`). In every case: exactly one completion.
#[test]
fn bad_remote_key_gives_one_completion() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    match bad_remote_key("tcp", true) {
        Completion::Failed { token: 9, errno, message, .. } => {
            assert!(errno > 0, "errno {errno}");
            assert!(!message.is_empty());
        }
        other => panic!("tcp read with a bad key gave {other:?}"),
    }
    match bad_remote_key("tcp", false) {
        Completion::Failed { token: 9, errno, message, .. } => {
            assert!(errno > 0, "errno {errno}");
            assert!(!message.is_empty());
        }
        other => panic!("tcp write with a bad key gave {other:?} (delivery-complete lost?)"),
    }
    for (p, read) in [("shm", false), ("shm", true)] {
        let c = bad_remote_key(p, read);
        assert!(
            matches!(c, Completion::Done { token: 9 } | Completion::Failed { token: 9, .. }),
            "{p} read={read}: {c:?}"
        );
    }
}

/// `Arrivals::One` over several NICs relies on writes completing only once their data is
/// placed at the target. The backend asks `tcp` for `FI_DELIVERY_COMPLETE` and reports what
/// the provider granted: tcp;ofi_rxm grants it. `shm` is not asked, and completes a small
/// write as soon as it is queued (libfabric 1.17 `smr` only waits for the peer with the
/// flag), so it must not claim it.
#[test]
fn delivery_complete_is_what_the_provider_granted() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tcp = LibfabricDomain::open(&LibfabricConfig::new("tcp")).expect("tcp");
    assert!(tcp.delivery_complete(), "tcp;ofi_rxm was asked for FI_DELIVERY_COMPLETE and grants it");
    let shm = LibfabricDomain::open(&LibfabricConfig::new("shm")).expect("shm");
    assert!(!shm.delivery_complete(), "shm was not asked for FI_DELIVERY_COMPLETE");
}
