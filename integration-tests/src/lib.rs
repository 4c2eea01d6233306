//! Shared helpers of the integration tests: the peer process, byte patterns, hashing.
//!
//! Every test here moves real bytes through libfabric between two OS processes: the test
//! itself and a `fabric-peer` child (see `src/bin/fabric-peer.rs`), which meet through a
//! `TcpStore` on 127.0.0.1.

pub mod etcd_server;
pub mod ping;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};

/// Providers the suite runs on: `FABRIC_TEST_PROVIDERS` (comma-separated) or tcp and shm.
pub fn providers() -> Vec<String> {
    std::env::var("FABRIC_TEST_PROVIDERS")
        .unwrap_or_else(|_| "tcp,shm".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The provider the single-provider tests use: the first of [`providers`] (so inside the
/// rxe VM, with `FABRIC_TEST_PROVIDERS=verbs`, the whole suite runs on verbs).
pub fn primary() -> String {
    providers().into_iter().next().unwrap_or_else(|| "tcp".into())
}

/// An `Event`-mode engine of `nics` NICs on the [`primary`] provider, or `None` where that
/// many cannot be had. On libfabric the N NICs are N domains on loopback
/// (`EngineBuilder::domains`, each its own endpoint and connections); on verbs (the rxe VM)
/// the devices in `RXE_VM_DEVICES` (else `RXE_VM_DEVICE`, else `rxe0`), of which the VM may
/// have fewer.
pub fn nic_engine(nics: usize) -> Option<fabric_async::Engine> {
    let p = primary();
    let b = fabric_async::Engine::builder().mode(fabric_async::ReactorMode::Event);
    let b = if p.starts_with("verbs") {
        let devices: Vec<String> = std::env::var("RXE_VM_DEVICES")
            .unwrap_or_else(|_| std::env::var("RXE_VM_DEVICE").unwrap_or_else(|_| "rxe0".into()))
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        if devices.len() < nics {
            eprintln!("verbs: {nics} NICs wanted, the VM has {devices:?}: skipped");
            return None;
        }
        b.provider("verbs").nics(devices.into_iter().take(nics))
    } else {
        b.provider(p).domains(nics)
    };
    Some(b.build().expect("engine"))
}

/// Says that a test did not run, and why, on the process's stderr: the test harness
/// captures `println!` and `eprintln!`, and a skip must be visible without `--nocapture`.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: {why}");
}

/// A transport other than `p`, for tests of foreign descriptors.
pub fn other_than(p: &str) -> &'static str {
    if p == "shm" {
        "tcp"
    } else {
        "shm"
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine, so that
/// two processes can order their events.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The byte at `offset` of pattern `seed`.
pub fn pattern_byte(seed: u64, offset: u64) -> u8 {
    let x = (offset ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (offset as u8)
}

/// Fills `buf` (standing at `offset` of a region) with pattern `seed`.
pub fn fill_pattern(buf: &mut [u8], seed: u64, offset: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(seed, offset + i as u64);
    }
}

/// FNV-1a over 8-byte words (and the tail), fast enough for 64 MiB in a debug build.
pub fn hash(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        h ^= u64::from_le_bytes(c.try_into().unwrap());
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    for &b in chunks.remainder() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ data.len() as u64
}

/// The immediates each of `tasks` writer tasks sends in the counter storm: `total` imm-only
/// writes spread over `distinct` values, shuffled deterministically by `seed`.
pub fn storm_plan(total: usize, tasks: usize, distinct: u32, seed: u64) -> Vec<Vec<u32>> {
    let mut all: Vec<u32> = (0..total).map(|i| 100 + (i as u32 % distinct)).collect();
    // Fisher-Yates with xorshift64.
    let mut s = seed | 1;
    for i in (1..all.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        all.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let per = total.div_ceil(tasks);
    all.chunks(per).map(|c| c.to_vec()).collect()
}

/// How many times each immediate appears in a plan.
pub fn plan_counts(plan: &[Vec<u32>]) -> std::collections::BTreeMap<u32, u64> {
    let mut m = std::collections::BTreeMap::new();
    for imm in plan.iter().flatten() {
        *m.entry(*imm).or_insert(0) += 1;
    }
    m
}

/// A rendezvous store on 127.0.0.1 and a connected client.
pub async fn store() -> (TcpStoreServer, TcpStore, SocketAddr) {
    let server = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).await.expect("bind store");
    let addr = server.local_addr();
    let client = TcpStore::connect(addr).await.expect("connect store");
    (server, client, addr)
}

/// A `fabric-peer` child process, killed when dropped.
#[derive(Debug)]
pub struct Peer {
    child: Option<Child>,
}

impl Peer {
    /// Starts `bin` (the path of the `fabric-peer` binary) with these arguments.
    pub fn spawn(bin: &str, store: SocketAddr, provider: &str, args: &[&str]) -> Peer {
        let child = Command::new(bin)
            .arg("--store")
            .arg(store.to_string())
            .arg("--provider")
            .arg(provider)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn fabric-peer");
        Peer { child: Some(child) }
    }

    /// Any child process, killed when dropped, waited for with [`Peer::wait_success`].
    pub fn from_child(child: Child) -> Peer {
        Peer { child: Some(child) }
    }

    /// Kills the process now (to test a dead peer). A stopped peer dies stopped: SIGKILL
    /// needs no SIGCONT, and continuing it first would let it resume for a moment and start
    /// on the work queued for it meanwhile, so that it could die holding libfabric shm's
    /// region lock (docs/faults.md), which hangs the next post to it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends `signal` (a name such as `STOP` or `CONT`) with kill(1): a stopped peer keeps
    /// its connections open and answers nothing, like a hung process.
    /// `STOP` returns once every thread of the process has stopped (up to 5 s): `kill`
    /// only queues the signal, and a thread still running on another CPU could answer one
    /// more operation (seen on the 2-core CI machine under load: a write to a "stopped" tcp
    /// peer completed).
    pub fn signal(&self, signal: &str) {
        if let Some(c) = self.child.as_ref() {
            let ok = Command::new("kill").arg(format!("-{signal}")).arg(c.id().to_string()).status();
            assert!(ok.is_ok_and(|s| s.success()), "kill -{signal} {}", c.id());
            if signal == "STOP" {
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while !all_threads_stopped(c.id()) && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// Waits up to `timeout` for the process to exit by itself; returns whether it did and
    /// succeeded. Async, so that a store served by the same (possibly current-thread)
    /// runtime keeps answering the peer meanwhile.
    pub async fn wait_success(&mut self, timeout: Duration) -> bool {
        let Some(c) = self.child.as_mut() else { return false };
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match c.try_wait() {
                Ok(Some(status)) => {
                    self.child = None;
                    return status.success();
                }
                Ok(None) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                _ => return false,
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs one `#[ignore]`d test of this test binary (`test`) in a child process with `env` set,
/// waits up to `bound` for it (killed past that, so a child stuck for good fails the caller
/// instead of hanging the suite), and returns whether it exited successfully, with its
/// stdout and stderr. Its output goes to files, not pipes: the peers it starts inherit them,
/// and would hold a pipe open past the child's end.
pub async fn run_child_test(
    test: &str,
    tag: &str,
    env: &[(&str, String)],
    bound: Duration,
) -> (bool, String, String) {
    let path = |what: &str| std::env::temp_dir().join(format!("fabric-{tag}-{}.{what}", std::process::id()));
    let (out_path, err_path) = (path("out"), path("err"));
    let file = |p: &std::path::Path| std::fs::File::create(p).expect("create the child's output file");
    let child = Command::new(std::env::current_exe().expect("the test binary's path"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args(["--ignored", "--exact", test, "--nocapture", "--test-threads", "1"])
        .stdin(Stdio::null())
        .stdout(file(&out_path))
        .stderr(file(&err_path))
        .spawn()
        .expect("run the child test");
    let mut child = Peer::from_child(child);
    let ok = child.wait_success(bound).await;
    drop(child);
    let read = |p: &std::path::Path| {
        let s = std::fs::read_to_string(p).unwrap_or_default();
        let _ = std::fs::remove_file(p);
        s
    };
    (ok, read(&out_path), read(&err_path))
}

/// Reads a key that the peer writes, with a deadline so a broken peer fails the test
/// instead of hanging it.
pub async fn get(store: &TcpStore, key: &str) -> Vec<u8> {
    match tokio::time::timeout(Duration::from_secs(120), store.get(key)).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("store get {key}: {e}"),
        Err(_) => panic!("timed out waiting for {key} from the peer"),
    }
}

/// Reads a key as UTF-8.
pub async fn get_str(store: &TcpStore, key: &str) -> String {
    String::from_utf8(get(store, key).await).expect("utf-8 value")
}

/// Per thread of this process named `fabric-reactor`: its id and the time it has spent
/// runnable (running on a CPU plus waiting in the run queue for one; `schedstat` in /proc).
/// A spinning thread is runnable all the time however loaded the machine is; a sleeping
/// one is not, so this tells the two apart where CPU time alone would depend on the load.
pub fn reactor_runnable_times() -> Vec<(u32, Duration)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task").flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != "fabric-reactor" {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else { continue };
        let ns: Vec<u64> = stat.split_whitespace().take(2).filter_map(|x| x.parse().ok()).collect();
        let tid = task.file_name().to_string_lossy().parse().unwrap_or(0);
        if let [run, wait] = ns[..] {
            out.push((tid, Duration::from_nanos(run + wait)));
        }
    }
    out
}

/// CPU time (user + system) of this whole process so far.
pub fn process_cpu_time() -> Duration {
    // SAFETY: getrusage only writes the struct we pass, which is plain data.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to a rusage.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage failed");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc/<pid>/task/*/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            // The state follows the command name, which is in parentheses and may hold spaces.
            .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
            .unwrap_or(false)
    })
}
