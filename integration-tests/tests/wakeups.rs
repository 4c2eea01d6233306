//! The wake-up paths of an `Event`-mode engine: direct posting (an operation submitted
//! while the reactor thread sleeps is posted on the submitter's thread) and
//! `CompletionWatch` (tokio's I/O driver wakes on the completion fds and runs the pass).
//! Real bytes through libfabric tcp and shm on loopback.

use std::time::{Duration, Instant};

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{CompletionWatch, Engine, Error, ReactorMode};
use integration_tests::{get, primary, skipped, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("answered within 30 s")
}

/// `n` verified 8-byte round trips between two engines of this builder, on this runtime.
/// Returns both engines (for their diagnostics).
async fn ping_pong(builder: impl Fn() -> fabric_async::EngineBuilder, n: u64) -> (Engine, Engine) {
    ping_pong_gap(builder, n, Duration::ZERO).await
}

/// As [`ping_pong`], each side pausing `gap` between an arrival and its next write.
async fn ping_pong_gap(
    builder: impl Fn() -> fabric_async::EngineBuilder,
    n: u64,
    gap: Duration,
) -> (Engine, Engine) {
    let (a, b) = (builder().build().unwrap(), builder().build().unwrap());
    ping_pong_on(&a, &b, n, gap).await;
    (a, b)
}

/// `n` verified 8-byte round trips between `a` and `b`, one awaited write each way, each
/// side pausing `gap` (if not zero) after an arrival before it writes.
async fn ping_pong_on(a: &Engine, b: &Engine, n: u64, gap: Duration) {
    let (ra, rb) = (a.alloc(4096).await.unwrap(), b.alloc(4096).await.unwrap());
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let to_a = b.remote_region(&ra.descriptor().to_bytes()).await.unwrap();
    let pong = tokio::spawn({
        let b = b.clone();
        async move {
            let c = b.imm_counter(11);
            let mut got = [0u8; 8];
            for i in 0..n {
                c.wait_for(1).await.unwrap();
                rb.read_at(8, &mut got).unwrap();
                assert_eq!(u64::from_le_bytes(got), i, "round trip {i} landed before its immediate");
                rb.write_at(0, &got).unwrap();
                if !gap.is_zero() {
                    tokio::time::sleep(gap).await;
                }
                b.write_imm(&rb, 0, &to_a, 8, 8, 12).await.unwrap();
            }
        }
    });
    let c = a.imm_counter(12);
    let mut got = [0u8; 8];
    for i in 0..n {
        ra.write_at(0, &i.to_le_bytes()).unwrap();
        if !gap.is_zero() && i > 0 {
            tokio::time::sleep(gap).await;
        }
        bounded(a.write_imm(&ra, 0, &to_b, 8, 8, 11)).await.unwrap();
        bounded(c.wait_for(1)).await.unwrap();
        ra.read_at(8, &mut got).unwrap();
        assert_eq!(u64::from_le_bytes(got), i, "the echo of round trip {i}");
    }
    bounded(pong).await.unwrap();
    assert_eq!(c.available(), 0, "one arrival per round trip");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_post_posts_from_the_caller() {
    let p = primary();
    // Neither lingering nor a poll window (both on by default with 8 or more CPUs): each keeps
    // its reactor awake across a round trip shorter than itself, and only a sleeping
    // reactor's engine posts directly.
    let event = || {
        Engine::builder()
            .provider(&p)
            .mode(ReactorMode::Event)
            .await_linger(Duration::ZERO)
            .poll_window(Duration::ZERO)
    };
    // Each side pauses 2 ms after an arrival before it writes back, so that its reactor,
    // which had just woken the waiter, has gone back to sleep: a write started then is
    // posted by its task, and the reactor is not woken for it. Without the pause the write
    // races the reactor's last pass.
    let (a, b) = ping_pong_gap(event, 200, Duration::from_millis(2)).await;
    // Nearly all are (394-399 of 400 on tcp, and on verbs in the rxe VM). Half leaves room
    // for a crowded machine and still fails where the reactor is woken after most direct
    // posts: a verbs sleep that seemed to end past its own keep-alive timer (`TIMER_SLACK`)
    // gave 7-12 of 400 in the rxe VM.
    let direct = a.direct_posts() + b.direct_posts();
    assert!(direct >= 200, "{direct} of 400 writes were posted directly");
    let (a, b) =
        ping_pong(|| Engine::builder().provider("tcp").mode(ReactorMode::Event).direct_post(false), 100)
            .await;
    assert_eq!(a.direct_posts() + b.direct_posts(), 0, "direct_post(false) is off");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_never_posts_directly() {
    // shm has no completion wait fd: only the reactor thread's poll window moves a
    // transfer, so it is woken instead.
    let (a, b) = ping_pong(|| Engine::builder().provider("shm").mode(ReactorMode::Event), 100).await;
    assert_eq!(a.direct_posts() + b.direct_posts(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_post_to_a_hung_peer_still_times_out() {
    // The reactor sleeps with nothing in flight; the write posted directly during that sleep
    // must still fail at its deadline (the sleep ends within an eighth of op_timeout).
    if primary() != "tcp" {
        // verbs (rxe): the peer's kernel acknowledges writes while the process is stopped.
        return skipped("a_direct_post_to_a_hung_peer_still_times_out", "needs tcp");
    }
    let (_server, store, addr) = store().await;
    let peer = Peer::spawn(PEER, addr, "tcp", &["target", "--size", "4096"]);
    let a = Engine::builder().provider("tcp").op_timeout(Some(Duration::from_secs(1))).build().unwrap();
    let src = a.alloc(4096).await.unwrap();
    let dst = a.remote_region(&get(&store, "target/desc").await).await.unwrap();
    bounded(a.write(&src, 0, &dst, 0, 64)).await.expect("the peer answers while it runs");
    peer.signal("STOP");
    tokio::time::sleep(Duration::from_millis(300)).await; // the reactor goes to sleep
    let before = a.direct_posts();
    let t = Instant::now();
    let e = bounded(a.write_imm(&src, 0, &dst, 0, 64, 1)).await.unwrap_err();
    let took = t.elapsed();
    assert!(matches!(e, Error::PeerUnreachable { .. }), "{e}");
    assert!(a.direct_posts() > before, "the write was posted directly");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(6), "failed after {took:?}");
    drop(peer); // killed (still stopped)
    let _ = store.put("target/exit", vec![]).await;
}

/// 50 writes of varied lengths from `a` into `b`, each awaited and its bytes checked.
async fn verified_writes(a: &Engine, b: &Engine) {
    let (ra, rb) = (a.alloc(1 << 20).await.unwrap(), b.alloc(1 << 20).await.unwrap());
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let pattern: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
    ra.write_at(0, &pattern).unwrap();
    let c = b.imm_counter(9);
    for round in 0..50u64 {
        let len = 1 + (round as usize * 20_011) % (1 << 20);
        bounded(a.write_imm(&ra, 0, &to_b, 0, len as u64, 9)).await.unwrap();
        bounded(c.wait_for(1)).await.unwrap();
        let mut got = vec![0u8; len];
        rb.read_at(0, &mut got).unwrap();
        assert!(got == pattern[..len], "round {round}: {len} bytes");
    }
    assert_eq!(c.available(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_watch_runs_the_passes() {
    let p = primary();
    // Not lingering: a lingering wait keeps the reactor thread polling, and the watch runs
    // passes only when the reactor thread sleeps.
    let a = Engine::builder().provider(&p).await_linger(Duration::ZERO).build().unwrap();
    let b = Engine::builder().provider(&p).await_linger(Duration::ZERO).build().unwrap();
    let (wa, wb) = (CompletionWatch::spawn(&a).unwrap(), CompletionWatch::spawn(&b).unwrap());
    verified_writes(&a, &b).await;
    ping_pong_on(&a, &b, 100, Duration::ZERO).await;
    // The reactor threads leave the wait fds to the watches: they run the passes.
    assert!(wa.passes() > 0 && wb.passes() > 0, "passes: {} and {}", wa.passes(), wb.passes());
    // Dropped: the reactor threads sleep on the fds again.
    drop((wa, wb));
    verified_writes(&a, &b).await;
}

#[test]
fn a_watch_whose_runtime_stopped_falls_back_to_the_reactor() {
    // The watch lives on a current-thread runtime that nobody drives after block_on
    // returns: the reactor thread's fallback pass must still complete everything.
    let p = primary();
    let a = Engine::builder().provider(&p).build().unwrap();
    let b = Engine::builder().provider(&p).build().unwrap();
    let idle = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let watches =
        idle.block_on(async { (CompletionWatch::spawn(&a).unwrap(), CompletionWatch::spawn(&b).unwrap()) });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        verified_writes(&a, &b).await;
        ping_pong_on(&a, &b, 20, Duration::ZERO).await;
    });
    drop(watches);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_watch_refuses_what_it_cannot_watch() {
    let shm = Engine::builder().provider("shm").build().unwrap();
    let e = CompletionWatch::spawn(&shm).unwrap_err();
    assert!(matches!(&e, Error::Unsupported(m) if m.contains("wait fd")), "{e}");
    let busy = Engine::builder().provider("tcp").mode(ReactorMode::BusyPoll).build().unwrap();
    let e = CompletionWatch::spawn(&busy).unwrap_err();
    assert!(matches!(&e, Error::Unsupported(m) if m.contains("BusyPoll")), "{e}");
    // Outside a runtime.
    let tcp = Engine::builder().provider("tcp").build().unwrap();
    let e = std::thread::spawn(move || CompletionWatch::spawn(&tcp).map(|_| ())).join().unwrap().unwrap_err();
    assert!(matches!(&e, Error::Unsupported(m) if m.contains("tokio runtime")), "{e}");
}

/// A window of writes submitted at once into a sleeping reactor (tcp: a delivery-complete
/// write stays in flight until the peer's reactor answers): the first is posted on the
/// submitter's thread, the others (operations in flight) are left to the reactor thread
/// (none is posted there while another is in flight),
/// woken once, so that a stream has one thread in the NIC rather than two taking turns on
/// its lock. Every write lands.
#[tokio::test]
async fn only_a_write_into_an_idle_engine_is_posted_directly() {
    let p = primary();
    if p != "tcp" {
        // shm has no wait fd: no direct posting at all. On rxe a write to this host may
        // complete inside the very pass that posted it, so the engine is idle again at the
        // next submit and posting it directly is right: the test could not tell.
        return skipped(
            "only_a_write_into_an_idle_engine_is_posted_directly",
            "needs tcp (writes that stay in flight across a submit)",
        );
    }
    let (a, b) =
        (Engine::builder().provider(&p).build().unwrap(), Engine::builder().provider(&p).build().unwrap());
    let (ra, rb) = (a.alloc(1 << 20).await.unwrap(), b.alloc(1 << 20).await.unwrap());
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let pattern: Vec<u8> = (0..1 << 20).map(|i| (i * 13 % 251) as u8).collect();
    ra.write_at(0, &pattern).unwrap();
    bounded(a.write_imm(&ra, 0, &to_b, 0, 64, 5)).await.unwrap();
    let c = b.imm_counter(5);
    bounded(c.wait_for(1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await; // the reactor goes to sleep
                                                          // A write posted here although others were in flight breaks the rule. On a loaded host
                                                          // the submitting loop may be held up long enough for every earlier write to complete
                                                          // and the reactor to sleep again: posting the next one here is then right.
    let (mut writes, mut posted_here, mut found_idle, mut broken) = (Vec::new(), 0, 0, Vec::new());
    for i in 0..16u64 {
        let idle = a.stats().nics.iter().all(|n| n.in_flight == 0);
        let before = a.direct_posts();
        writes.push(a.write_imm(&ra, i << 16, &to_b, i << 16, 1 << 16, 5));
        if a.direct_posts() > before {
            posted_here += 1;
            if !idle {
                broken.push(i);
            }
        }
        found_idle += idle as u32;
    }
    for w in writes {
        bounded(w).await.unwrap();
    }
    bounded(c.wait_for(16)).await.unwrap();
    let mut got = vec![0u8; 1 << 20];
    rb.read_at(0, &mut got).unwrap();
    assert!(got == pattern, "every write landed");
    assert!(
        broken.is_empty(),
        "writes {broken:?} were posted on the submitter's thread with others in flight ({posted_here} of 16 \
         posted there, {found_idle} found nothing in flight)"
    );
}
