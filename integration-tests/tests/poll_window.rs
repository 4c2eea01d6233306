//! `EngineBuilder::poll_window`: after its last activity an `Event` reactor keeps polling
//! (yielding the core) for the window before it sleeps, so a stream in progress never waits
//! for the reactor to wake; an idle engine still sleeps. Every test moves real bytes
//! through libfabric (tcp, shm) or verbs between two engines of this process.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use fabric_async::{Engine, EngineBuilder, ReactorMode, ReactorStats};
use integration_tests::{fill_pattern, hash, providers, skipped};

fn builder(p: &str, window: Duration) -> EngineBuilder {
    // Lingering also keeps a reactor from sleeping: off, so only the window does.
    Engine::builder().provider(p).mode(ReactorMode::Event).poll_window(window).await_linger(Duration::ZERO)
}

fn stats(e: &Engine) -> ReactorStats {
    e.stats().reactor
}

/// The sender's reactor, with a 400 ms window, polls without sleeping for the first part of
/// the window after a write completes and sleeps once it has passed; the receiver's, with
/// none, sleeps at once after the arrival (shm's polls for 1 ms anyway, so not checked
/// there). The write's bytes are checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reactor_polls_through_its_window_then_sleeps() {
    let window = Duration::from_millis(400);
    for p in providers() {
        let a = builder(&p, window).build().unwrap();
        let b = builder(&p, Duration::ZERO).build().unwrap();
        let (ra, rb) = (a.alloc(4096).await.unwrap(), b.alloc(4096).await.unwrap());
        let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
        let c = b.imm_counter(5);
        ra.write_at(0, &[0x5a; 256]).unwrap();
        // Twice: the first write also connects, and b's reactor may still be busy with that.
        for _ in 0..2 {
            a.write_imm(&ra, 0, &to_b, 0, 256, 5).await.unwrap();
            c.wait_for(1).await.unwrap();
        }
        let done = Instant::now();
        let (a0, b0) = (stats(&a), stats(&b));
        tokio::time::sleep(Duration::from_millis(150)).await;
        let (a1, b1) = (stats(&a), stats(&b));
        let mut got = [0u8; 256];
        rb.read_at(0, &mut got).unwrap();
        assert_eq!(got, [0x5a; 256], "{p}: the bytes landed");
        // (A host so loaded that 150 ms took most of the window proves nothing either way.)
        if done.elapsed() < window / 2 {
            let no_sleep = (a1.sleeps, a1.slept) == (a0.sleeps, a0.slept);
            assert!(no_sleep, "{p}: slept inside its window: {a0:?} -> {a1:?}");
            assert!(a1.passes - a0.passes >= 100, "{p}: not polling in its window: {a0:?} -> {a1:?}");
        }
        // (It may have gone to sleep before `b0`: then it slept all along, and passed little.)
        let asleep = b1.slept > b0.slept && b1.passes - b0.passes < 50;
        if p != "shm" {
            assert!(asleep, "{p}: without a window the reactor did not sleep: {b0:?} -> {b1:?}");
        }
        // Past the window: asleep, and staying so (an idle engine costs nothing).
        tokio::time::sleep((window + Duration::from_millis(300)).saturating_sub(done.elapsed())).await;
        let a2 = stats(&a);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let a3 = stats(&a);
        assert!(a2.sleeps > a1.sleeps, "{p}: still polling past its window: {a1:?} -> {a2:?}");
        // Asleep for most of those 300 ms (shm's sleeps are timed polls every millisecond).
        let idle = a3.slept.saturating_sub(a2.slept);
        assert!(idle >= Duration::from_millis(200), "{p}: an idle engine kept polling: {a2:?} -> {a3:?}");
    }
}

/// A stream of 96 writes of 256 KiB, 16 in flight: with a window far longer than any gap
/// between arrivals, the receiving reactor never sleeps until the stream has landed; without
/// one (the control) it sleeps between arrivals. Every byte and the count are checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_keeps_the_receiving_reactor_awake() {
    for p in providers() {
        if p == "shm" {
            // With no wait fd its reactor polls for 1 ms after activity anyway.
            skipped(
                "a_stream_keeps_the_receiving_reactor_awake",
                "shm: its reactor polls 1 ms after activity anyway",
            );
            continue;
        }
        let with = stream(&p, Duration::from_millis(500)).await;
        let without = stream(&p, Duration::ZERO).await;
        println!("{p}: the receiver slept {with} times with the window, {without} without");
        assert_eq!(with, 0, "{p}: the receiving reactor slept mid-stream with a 500 ms window");
        assert!(without > 0, "{p}: the control never slept: the test shows nothing");
    }
}

/// One stream between two engines with this window; returns how often the receiving
/// reactor went to sleep while it flowed.
async fn stream(p: &str, window: Duration) -> u64 {
    const SIZE: usize = 256 << 10;
    const OPS: usize = 96;
    const SLOTS: usize = 8;
    let (a, b) = (builder(p, window).build().unwrap(), builder(p, window).build().unwrap());
    let (ra, rb) = (a.alloc(SIZE * SLOTS).await.unwrap(), b.alloc(SIZE * SLOTS).await.unwrap());
    let mut data = vec![0u8; SIZE * SLOTS];
    fill_pattern(&mut data, 7, 0);
    ra.write_at(0, &data).unwrap();
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let (warm, c) = (b.imm_counter(8), b.imm_counter(9));
    a.write_imm(&ra, 0, &to_b, 0, 64, 8).await.unwrap();
    warm.wait_for(1).await.unwrap();
    let before = stats(&b).sleeps;
    let mut inflight = VecDeque::new();
    for i in 0..OPS {
        let off = ((i % SLOTS) * SIZE) as u64;
        inflight.push_back(a.write_imm(&ra, off, &to_b, off, SIZE as u64, 9));
        if inflight.len() >= 16 {
            inflight.pop_front().unwrap().await.unwrap();
        }
    }
    for f in inflight {
        f.await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(30), c.wait_for(OPS as u64))
        .await
        .expect("every arrival within 30 s")
        .unwrap();
    let slept = stats(&b).sleeps - before;
    assert_eq!(c.available(), 0, "{p}: exactly {OPS} arrivals");
    let mut got = vec![0u8; SIZE * SLOTS];
    rb.read_at(0, &mut got).unwrap();
    assert_eq!(hash(&got), hash(&data), "{p}: the bytes that landed");
    slept
}
