//! What the verbs backend tests share (`verbs_backend.rs`, `verbs_reconnect.rs`,
//! `verbs_liveness.rs`): opening a domain on the test device (or skipping visibly without
//! one), leaked registered buffers, and polling helpers.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use fabric_runtime::provider::verbs::{VerbsConfig, VerbsDomain};
use fabric_runtime::provider::{Completion, Domain, LocalSlice, MemoryLocation, Op, PostError, RemoteSlice};
use fabric_runtime::Error;

pub const LIMIT: Duration = Duration::from_secs(30);

pub fn open() -> Option<VerbsDomain> {
    open_with(VerbsConfig::default())
}

pub fn open_with(cfg: VerbsConfig) -> Option<VerbsDomain> {
    let device = std::env::var("FABRIC_VERBS_DEVICE").or_else(|_| std::env::var("RXE_VM_DEVICE")).ok();
    match VerbsDomain::open(&VerbsConfig { device, ..cfg }) {
        Ok(d) => Some(d),
        Err(Error::ProviderNotFound { reason, .. }) => {
            // Inside the test VM (and so in CI) the device must be there: never skip.
            assert!(
                std::env::var_os("RXE_VM_GUEST").is_none(),
                "no RDMA device inside the test VM: {reason}"
            );
            // Straight to the process's stderr: the test harness captures `println!` (and
            // `eprintln!`), and a skip must be seen without `--nocapture`.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED: verbs backend test: no RDMA device ({reason})");
            None
        }
        Err(e) => panic!("opening a verbs domain failed: {e}"),
    }
}

/// A registered, page-aligned buffer (leaked Vec: lives as long as the test process).
pub struct Buf {
    pub ptr: *mut u8,
    pub len: usize,
    pub local: u64,
    pub key: u64,
    pub base: u64,
}

impl Buf {
    pub fn new(d: &mut VerbsDomain, len: usize) -> Buf {
        let v: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
        let ptr = v.as_mut_ptr();
        // SAFETY: the memory is leaked, so it stays valid for the whole process.
        let reg = unsafe { d.register(ptr as u64, len, MemoryLocation::Host) }.expect("register");
        Buf { ptr, len, local: reg.local, key: reg.remote_key, base: reg.remote_base }
    }
    pub fn slice(&self, off: usize, len: usize) -> LocalSlice {
        assert!(off + len <= self.len);
        LocalSlice { addr: self.ptr as u64 + off as u64, len, desc: self.local }
    }
    pub fn remote(&self, off: usize) -> RemoteSlice {
        RemoteSlice { addr: self.base + off as u64, key: self.key }
    }
    pub fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        // SAFETY: inside the leaked buffer; no operation on it is in flight when read.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }.to_vec()
    }
    pub fn fill(&self, off: usize, data: &[u8]) {
        // SAFETY: inside the leaked buffer; no operation on it is in flight.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) }
    }
}

/// The tests of this binary share one (emulated) device and run in parallel; the one that
/// measures how fast a bad access fails (<= 100 ms) runs alone, so that another test's burst
/// of 5000 writes on the same device is not what it measures.
static DEVICE: std::sync::RwLock<()> = std::sync::RwLock::new(());

pub fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    DEVICE.read().unwrap_or_else(|e| e.into_inner())
}

pub fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    DEVICE.write().unwrap_or_else(|e| e.into_inner())
}

pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Polls every domain until `done` says so (bounded by LIMIT); completions go to `got[i]`.
pub fn pump(
    ds: &mut [&mut VerbsDomain],
    got: &mut [Vec<Completion>],
    mut done: impl FnMut(&[Vec<Completion>]) -> bool,
) {
    let start = Instant::now();
    loop {
        for (d, g) in ds.iter_mut().zip(got.iter_mut()) {
            d.flush(); // as the engine's reactor does after each round of posts
            d.poll(g, 64).expect("poll");
        }
        if done(got) {
            return;
        }
        assert!(start.elapsed() < LIMIT, "timed out; completions so far: {got:?}");
        std::thread::yield_now();
    }
}

/// Posts on `ds[i]`, polling everyone while the domain says Again (connecting / queue full).
pub fn post(ds: &mut [&mut VerbsDomain], got: &mut [Vec<Completion>], i: usize, token: u64, op: Op) {
    let start = Instant::now();
    loop {
        // SAFETY: every buffer is leaked (valid for the process) and registered with ds[i].
        match unsafe { ds[i].post(token, &op) } {
            Ok(()) => return,
            Err(PostError::Again) => {
                for (d, g) in ds.iter_mut().zip(got.iter_mut()) {
                    d.flush();
                    d.poll(g, 64).expect("poll");
                }
                assert!(start.elapsed() < LIMIT, "post kept returning Again");
            }
            Err(PostError::Failed(e)) => panic!("post failed: {e}"),
        }
    }
}

pub fn has(got: &[Completion], c: &Completion) -> bool {
    got.contains(c)
}
