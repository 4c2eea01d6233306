//! The synchronous fast path for dedicated busy-poll threads, and every reactor mode moving
//! real bytes.

use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, OpBatch, ReactorMode};
use integration_tests::{fill_pattern, get, get_str, hash, ping, primary, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

/// Whether some `fabric-reactor` thread of this process may run only on `cpus`
/// (`Cpus_allowed_list` in /proc). Waits briefly: the thread pins itself when it starts.
fn reactor_pinned_to(cpus: &str) -> bool {
    for _ in 0..100 {
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            let allowed = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(str::trim);
            if comm.trim() == "fabric-reactor" && allowed == Some(cpus) {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// Writer side: a plain thread posts without futures and spins on the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_post_and_spin_until_done() {
    for p in providers() {
        let n = 1000u64;
        let (_server, store, addr) = store().await;
        let size = 64 * 1024;
        let wait = format!("11={n},12=50");
        let mut peer = Peer::spawn(PEER, addr, &p, &["target", "--size", &size.to_string(), "--wait", &wait]);
        // A CPU this process may run on (not always cpu 0 under a restricted affinity).
        // SAFETY: sched_getcpu takes no arguments.
        let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).expect("sched_getcpu");
        let engine =
            Engine::builder().provider(p.as_str()).mode(ReactorMode::BusyPoll).pin_core(cpu).build().unwrap();
        assert!(reactor_pinned_to(&cpu.to_string()), "the busy-poll reactor runs on cpu {cpu} only");
        let mut data = vec![0u8; size];
        fill_pattern(&mut data, 77, 0);
        let src = engine.register_copy(data.clone()).await.unwrap();
        let dst = engine.remote_region(&get(&store, "target/desc").await).await.unwrap();
        let (e2, s2, d2) = (engine.clone(), src.clone(), dst.clone());
        tokio::task::spawn_blocking(move || {
            let batch = OpBatch::new();
            let chunk = (size as u64) / n.min(64);
            for i in 0..n {
                let off = (i % 64) * chunk;
                e2.post_write_imm(&batch, &s2, off, &d2, off, chunk, 11).expect("post");
            }
            for _ in 0..50 {
                e2.post_imm(&batch, &d2, 12).expect("post imm");
            }
            assert!(batch.spin_until(n + 50, Duration::from_secs(60)).expect("no failures"), "all complete");
            assert_eq!(batch.completed(), n + 50);
            assert_eq!(batch.failed(), 0);
        })
        .await
        .unwrap();
        assert_eq!(get_str(&store, "target/hash").await, hash(&data).to_string(), "{p}");
        assert_eq!(get_str(&store, "target/extra").await, "11=0,12=0", "{p}: exact counts");
        store.put("target/exit", vec![]).await.unwrap();
        assert!(peer.wait_success(Duration::from_secs(20)).await);
    }
}

/// Receiver side: a plain thread spin-waits on a counter (no waker, no syscall).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_spin_waits_on_a_counter() {
    let (_server, store, addr) = store().await;
    let p = primary();
    let engine = Engine::builder().provider(p.as_str()).mode(ReactorMode::BusyPoll).build().unwrap();
    let region = engine.alloc(4096).await.unwrap();
    store.put("writer/desc", region.descriptor().to_bytes()).await.unwrap();
    // 400 imm-only writes, all with imm 100 (one distinct value).
    let mut peer = Peer::spawn(PEER, addr, &p, &["writer", "--storm", "400,4,1,3"]);
    let counter = engine.imm_counter(100);
    let got = tokio::task::spawn_blocking(move || {
        let mut rounds = 0;
        while rounds < 4 && counter.spin_wait(100, Duration::from_secs(60)) {
            rounds += 1;
        }
        (rounds, counter.available())
    })
    .await
    .unwrap();
    assert_eq!(got, (4, 0), "four rounds of 100, nothing left over");
    assert_eq!(get_str(&store, "writer/done").await, "ok");
    store.put("writer/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}

/// Every reactor mode moves bytes and wakes futures, on every provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_moves_bytes() {
    let modes = [
        ReactorMode::Event,
        ReactorMode::Adaptive { spin: Duration::from_micros(200) },
        ReactorMode::BusyPoll,
        ReactorMode::Inline,
    ];
    for p in providers() {
        for mode in modes {
            let (_server, store, addr) = store().await;
            let size = 300_000;
            let mut peer =
                Peer::spawn(PEER, addr, &p, &["target", "--size", &size.to_string(), "--wait", "4=3"]);
            let engine = Engine::builder().provider(p.as_str()).mode(mode).build().unwrap();
            let mut data = vec![0u8; size];
            fill_pattern(&mut data, 5, 0);
            let src = engine.register_copy(data.clone()).await.unwrap();
            let dst = engine.remote_region(&get(&store, "target/desc").await).await.unwrap();
            for i in 0..3u64 {
                engine.write_imm(&src, i * 100_000, &dst, i * 100_000, 100_000, 4).await.unwrap();
            }
            assert_eq!(get_str(&store, "target/hash").await, hash(&data).to_string(), "{p} {mode:?}");
            store.put("target/exit", vec![]).await.unwrap();
            assert!(peer.wait_success(Duration::from_secs(20)).await);
        }
    }
}

/// A `BusyPoll` engine's spinning callers run its passes themselves (the reactor thread
/// stands by meanwhile): an 8 B ping-pong on the synchronous spin paths (`post_write_imm` +
/// `OpBatch::spin_until`, `ImmCounter::spin_wait`) between two engines lands every round
/// trip's bytes, and both engines count passes run on the callers' threads (none before
/// this change: every completion came from the reactor thread's core).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spinning_callers_drive_a_busy_poll_engine() {
    let n = 200u64;
    for p in providers() {
        let (a, b) = ping::pair(|| Engine::builder().provider(p.as_str()).mode(ReactorMode::BusyPoll)).await;
        let side = |s: ping::Side, lead: bool| {
            std::thread::spawn(move || {
                let (send, wait) = if lead { (1, 2) } else { (2, 1) };
                let c = s.engine.imm_counter(wait);
                let batch = OpBatch::new();
                let mut got = [0u8; 8];
                let limit = Duration::from_secs(20);
                for i in 0..n {
                    if lead {
                        s.region.write_at(0, &i.to_le_bytes()).unwrap();
                        s.engine.post_write_imm(&batch, &s.region, 0, &s.remote, 8, 8, send).unwrap();
                        assert!(c.spin_wait(1, limit), "echo {i} within {limit:?}");
                        s.region.read_at(8, &mut got).unwrap();
                        assert_eq!(u64::from_le_bytes(got), i, "the echo of round trip {i}");
                    } else {
                        assert!(c.spin_wait(1, limit), "ping {i} within {limit:?}");
                        s.region.read_at(8, &mut got).unwrap();
                        assert_eq!(u64::from_le_bytes(got), i, "round trip {i} landed before its immediate");
                        s.region.write_at(0, &got).unwrap();
                        s.engine.post_write_imm(&batch, &s.region, 0, &s.remote, 8, 8, send).unwrap();
                    }
                }
                assert!(batch.spin_until(n, limit).unwrap(), "every write completed");
                s
            })
        };
        let (tb, ta) = (side(b, false), side(a, true));
        let a = tokio::task::spawn_blocking(move || ta.join().expect("leader")).await.unwrap();
        let b = tokio::task::spawn_blocking(move || tb.join().expect("other side")).await.unwrap();
        let (ra, rb) = (a.engine.stats().reactor, b.engine.stats().reactor);
        assert!(
            ra.caller_passes > 0 && rb.caller_passes > 0,
            "{p}: no pass on a caller's thread: {ra:?} {rb:?}"
        );
        assert!(ra.caller_passes <= ra.passes, "{p}: {ra:?}");
    }
}

/// While a caller of a `BusyPoll` engine spins (and drives), a future that parked (no
/// lingering here) is completed by the caller's passes; once the caller stops, the reactor
/// thread takes over again (it stands by only while callers drive): a later parked wait is
/// answered too. Every wait is bounded, so a reactor that stood by for good fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_poll_reactor_resumes_when_its_spinning_callers_stop() {
    let p = primary();
    let a = Engine::builder().provider(p.as_str()).mode(ReactorMode::BusyPoll).await_linger(Duration::ZERO);
    let a = a.build().unwrap();
    let b = Engine::builder().provider(p.as_str()).build().unwrap();
    let ra = a.alloc(4096).await.unwrap();
    let to_a = b.remote_region(&ra.descriptor().to_bytes()).await.unwrap();
    let spinner = {
        let c = a.imm_counter(5);
        std::thread::spawn(move || c.spin_wait(1, Duration::from_secs(20)))
    };
    // The premise: the spinner drives (its passes make the reactor thread stand by). On a
    // starved CPU (CI's 2-vCPU TCG VM once) its first pass may take a while: wait for it,
    // bounded, before the parked wait below relies on it.
    let t0 = std::time::Instant::now();
    while a.stats().reactor.caller_passes == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the spinner ran no pass in 10 s");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let bounded = |f| tokio::time::timeout(Duration::from_secs(10), f);
    let c6 = a.imm_counter(6);
    let w6 = tokio::spawn(async move { c6.wait_for(1).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    b.imm(&to_a, 6).await.unwrap();
    bounded(w6).await.expect("answered while a caller drives").unwrap().unwrap();
    assert!(!spinner.is_finished(), "the spinner still waits (for imm 5)");
    b.imm(&to_a, 5).await.unwrap();
    let spun = tokio::task::spawn_blocking(move || spinner.join().expect("spinner")).await.unwrap();
    assert!(spun, "the spinner saw its immediate");
    let passes = a.stats().reactor.caller_passes;
    // Nobody spins now: this wait parks and only the reactor thread can answer it.
    let c7 = a.imm_counter(7);
    let w7 = tokio::spawn(async move { c7.wait_for(1).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    b.imm(&to_a, 7).await.unwrap();
    bounded(w7).await.expect("answered after the callers stopped").unwrap().unwrap();
    assert_eq!(a.stats().reactor.caller_passes, passes, "a pass on a caller's thread with none spinning");
}
