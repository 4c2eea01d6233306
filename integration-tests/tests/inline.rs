//! `ReactorMode::Inline`: the awaiting task drives the NICs itself, so the thread that
//! awaits never parks; a background reactor thread takes over when nobody awaits. Every test
//! moves real bytes through libfabric (tcp, shm) between two engines.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, OpBatch, ReactorMode};
use integration_tests::{get_str, ping, primary, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

/// Two engines of `mode` on provider `p` (`integration_tests::ping`). Direct posting is off:
/// a write started while the reactor sleeps then always goes through the reactor thread, so
/// an `Event` engine's awaiting thread parks once per hop (the control of
/// `inline_futures_never_park_the_awaiting_thread`; with direct posting the caller's own
/// pass sometimes finds its completion already and does not park). Lingering is off for the
/// same reason (on by default on machines with 8 or more CPUs).
async fn pair(p: &str, mode: ReactorMode) -> (ping::Side, ping::Side) {
    ping::pair(|| Engine::builder().provider(p).mode(mode).direct_post(false).await_linger(Duration::ZERO))
        .await
}

/// The ping-pong of `integration_tests::ping`: how often each side's awaiting thread parked.
async fn run_ping_pong(p: &str, mode: ReactorMode, n: u64) -> (usize, usize) {
    let (a, b) = pair(p, mode).await;
    assert_eq!(a.engine.is_inline(), mode == ReactorMode::Inline);
    let (lead, other, _, _) = ping::run(a, b, n).await;
    (lead, other)
}

/// Awaiting writes and counters of an inline engine never parks the awaiting thread, and
/// every byte and count is right. The same ping-pong in `Event` mode parks (often, about
/// once per wait): the measure can tell the two apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_futures_never_park_the_awaiting_thread() {
    for p in providers() {
        let n = 300;
        let (lead, other) = run_ping_pong(&p, ReactorMode::Inline, n).await;
        assert_eq!((lead, other), (0, 0), "{p}: parks of the awaiting threads in {n} inline round trips");
        let (lead, other) = run_ping_pong(&p, ReactorMode::Event, n).await;
        // Counted over both threads, as in linger.rs: one side's result is often there at
        // its first poll when its thread comes late (in the emulated rxe VM).
        assert!(
            (lead + other) as u64 >= n / 2,
            "{p}: Event mode parked only {lead} + {other} times in {n} round trips"
        );
    }
}

/// Nobody awaits: the background reactor thread of an inline engine counts a peer
/// process's writes by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_engine_progresses_without_callers() {
    let (_server, store, addr) = store().await;
    let p = primary();
    let engine = Engine::builder().provider(p.as_str()).mode(ReactorMode::Inline).build().unwrap();
    let region = engine.alloc(4096).await.unwrap();
    store.put("writer/desc", region.descriptor().to_bytes()).await.unwrap();
    let mut peer = Peer::spawn(PEER, addr, &p, &["writer", "--storm", "400,4,1,3"]);
    let counter = engine.imm_counter(100);
    // `available` only reads the count: it drives nothing.
    let deadline = Instant::now() + Duration::from_secs(60);
    while counter.available() < 400 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(get_str(&store, "writer/done").await, "ok");
    assert_eq!(counter.available(), 400, "{p}: every arrival, counted by the reactor thread");
    counter.wait_for(400).await.unwrap();
    assert_eq!(counter.available(), 0);
    store.put("writer/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}

/// The synchronous spin path on inline engines: `post_write_imm` + `OpBatch::spin_until` on
/// one side, `ImmCounter::spin_wait` on the other, each driving its own engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_spin_path_drives_its_engine() {
    for p in providers() {
        let (a, b) = pair(&p, ReactorMode::Inline).await;
        let n = 2000u64;
        a.region.write_at(0, &[0x5a; 64]).unwrap();
        let rx = std::thread::spawn(move || {
            let c = b.engine.imm_counter(9);
            assert!(c.spin_wait(n, Duration::from_secs(60)), "all {n} arrivals");
            assert_eq!(c.available(), 0);
            let mut got = [0u8; 64];
            b.region.read_at(64, &mut got).unwrap();
            got
        });
        let tx = std::thread::spawn(move || {
            let batch = OpBatch::new();
            for i in 0..n {
                a.engine.post_write_imm(&batch, &a.region, 0, &a.remote, 64, 64, 9).unwrap();
                // At most 64 in flight; the spin drives the engine.
                if i >= 64 {
                    assert!(batch.spin_until(i - 64, Duration::from_secs(60)).unwrap());
                }
            }
            assert!(batch.spin_until(n, Duration::from_secs(60)).unwrap());
            assert_eq!(batch.failed(), 0);
            a
        });
        let got = tokio::task::spawn_blocking(move || rx.join().expect("receiver")).await.unwrap();
        let _a = tokio::task::spawn_blocking(move || tx.join().expect("sender")).await.unwrap();
        assert_eq!(got, [0x5a; 64], "{p}: the bytes landed");
    }
}

/// A timed-out inline wait consumes nothing (tokio's timer fires although the task never
/// lets its thread park), and shutdown releases an inline waiter.
#[tokio::test(flavor = "current_thread")]
async fn inline_wait_times_out_and_shuts_down() {
    let (a, b) = pair(&primary(), ReactorMode::Inline).await;
    let c = b.engine.imm_counter(3);
    a.engine.imm(&a.remote, 3).await.unwrap();
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_millis(50), c.wait_for(2)).await;
    assert!(r.is_err(), "one arrival of two: the wait times out");
    assert!(t.elapsed() < Duration::from_secs(5), "the timer fired while the task spun");
    assert_eq!(c.available(), 1, "a timed-out wait consumes nothing");
    let waiter = c.wait_for(2);
    b.engine.shutdown();
    assert!(matches!(waiter.await, Err(fabric_async::Error::Shutdown)));
}

/// An `Inline` engine posts each write on the caller's thread when it is submitted, in
/// order with what was queued; and a write that nobody polls, submitted while the reactor
/// thread sleeps, to a peer that stopped answering, still fails at its deadline: the
/// reactor thread finds it (its sleep is cut short where it would not cover the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_writes_post_at_submit_and_a_hung_peer_still_times_out() {
    if primary() != "tcp" {
        // shm: no hung peer (a stopped process's memory still takes the write); verbs (rxe):
        // the peer's kernel acknowledges writes while the process is stopped.
        let name = "inline_writes_post_at_submit_and_a_hung_peer_still_times_out";
        return integration_tests::skipped(name, "needs tcp");
    }
    let (_server, store, addr) = store().await;
    let peer = Peer::spawn(PEER, addr, "tcp", &["target", "--size", "4096", "--wait", "5=64"]);
    let a = Engine::builder()
        .provider("tcp")
        .mode(ReactorMode::Inline)
        .op_timeout(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    let src = a.alloc(4096).await.unwrap();
    src.write_at(0, &[0xa5; 4096]).unwrap();
    let dst = a.remote_region(&integration_tests::get(&store, "target/desc").await).await.unwrap();
    // 64 writes with immediates, awaited one by one: the caller drives, so each is posted
    // at submit (unless the reactor thread happens to be in a pass), and all arrive.
    let before = a.direct_posts();
    for i in 0..64u64 {
        tokio::time::timeout(Duration::from_secs(30), a.write_imm(&src, i * 64, &dst, i * 64, 64, 5))
            .await
            .expect("answered")
            .unwrap();
    }
    assert!(a.direct_posts() > before, "no write was posted at submit");
    assert_eq!(get_str(&store, "target/extra").await, "5=0", "exactly 64 arrivals");
    // Order: rounds of 64 writes of 0..64 into the same 8 bytes, submitted back to back
    // while another thread drives the engine (imm-only writes, awaited in a loop), so that
    // some are posted at submit and some are queued behind that thread's pass: the last
    // lands last.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let driver = std::thread::spawn({
        let (a, dst, stop) = (a.clone(), dst.clone(), stop.clone());
        move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                while !stop.load(Ordering::Relaxed) {
                    a.imm(&dst, 7).await.unwrap();
                }
            })
        }
    });
    let vals = a.alloc(64 * 8).await.unwrap();
    for i in 0..64u64 {
        vals.write_at(i * 8, &i.to_le_bytes()).unwrap();
    }
    let back = a.alloc(8).await.unwrap();
    for round in 0..600u64 {
        // Short rounds: only the order of the last writes shows in the bytes.
        let n = 2 + round % 3;
        let writes: Vec<_> = (0..n).map(|i| a.write(&vals, i * 8, &dst, 4000, 8)).collect();
        for w in writes {
            tokio::time::timeout(Duration::from_secs(30), w).await.expect("answered").unwrap();
        }
        let mut last = [0u8; 8];
        tokio::time::timeout(Duration::from_secs(30), a.read(&back, 0, &dst, 4000, 8))
            .await
            .expect("answered")
            .unwrap();
        back.read_at(0, &mut last).unwrap();
        assert_eq!(u64::from_le_bytes(last), n - 1, "round {round}: the writes were posted in order");
    }
    stop.store(true, Ordering::Relaxed);
    driver.join().unwrap();
    peer.signal("STOP");
    tokio::time::sleep(Duration::from_millis(300)).await; // the reactor thread goes to sleep
    let hung = a.write_imm(&src, 0, &dst, 0, 64, 6);
    // Nobody polls `hung`: the reactor thread alone must fail it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let s = a.stats();
    // (Still in flight for the NIC: its memory is kept until the provider gives it back.)
    assert_eq!(s.peers[0].errors, 1, "failed by the reactor thread: {s:?}");
    let e = tokio::time::timeout(Duration::from_secs(1), hung).await.expect("already failed").unwrap_err();
    assert!(matches!(e, fabric_async::Error::PeerUnreachable { .. }), "{e}");
    drop(peer); // killed (still stopped)
    let _ = store.put("target/exit", vec![]).await;
}
