//! `EngineBuilder::await_linger`: a pending future of an `Event` (or `Adaptive`, `BusyPoll`)
//! engine looks for its result at each poll and asks to be polled again, for up to its
//! budget, before it registers its waker and parks; meanwhile the reactor thread polls
//! instead of sleeping. Every test moves real bytes through libfabric (tcp, shm) between two
//! engines, or waits on a real engine's counter.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::{Engine, EngineBuilder, ReactorMode};
use integration_tests::{ping, primary, providers, skipped};

fn builder(p: &str, linger: Duration) -> EngineBuilder {
    Engine::builder().provider(p).mode(ReactorMode::Event).await_linger(linger)
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("answered within 30 s")
}

/// With a budget far longer than a hop, every wait of a ping-pong ends while it lingers:
/// the awaiting threads never park, no wait spends its budget, and nothing lingers after.
/// Without lingering (the control) the same ping-pong parks often (about once per wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lingering_waits_see_their_results_without_parking() {
    for p in providers() {
        let n = 100;
        for (linger, lingers) in [(Duration::from_secs(2), true), (Duration::ZERO, false)] {
            let (a, b) = ping::pair(|| builder(&p, linger)).await;
            let (lead, other, a, b) = ping::run(a, b, n).await;
            let (sa, sb) = (a.engine.stats().reactor, b.engine.stats().reactor);
            if lingers {
                assert_eq!((lead, other), (0, 0), "{p}: parks of the awaiting threads in {n} round trips");
                // Each side awaits 2n futures; some are ready at their first poll.
                assert!(sa.lingered >= n / 2 && sb.lingered >= n / 2, "{p}: {sa:?} {sb:?}");
                assert_eq!((sa.linger_parked, sb.linger_parked), (0, 0), "{p}: a wait spent 2 s");
                assert_eq!((sa.lingering, sb.lingering), (0, 0), "{p}: lingering after the waits ended");
            } else {
                // Counted over both threads: one side's result is often there at its first
                // poll when its thread is late (31 of 100 parks once in the emulated rxe VM).
                assert!(
                    (lead + other) as u64 >= n / 2,
                    "{p}: without lingering the threads parked only {lead} + {other} times in {n} round trips"
                );
                assert_eq!((sa.lingered, sb.lingered), (0, 0), "{p}: await_linger(0) lingers");
            }
        }
    }
}

/// A wait longer than the budget lingers, then parks with its waker registered; the
/// reactor thread wakes it when the immediate arrives. The statistics say each step.
#[tokio::test]
async fn a_wait_past_its_budget_parks_and_the_reactor_thread_wakes_it() {
    let p = primary();
    let budget = Duration::from_millis(400);
    let (a, b) = (builder(&p, budget).build().unwrap(), builder(&p, Duration::ZERO).build().unwrap());
    let ra = a.alloc(4096).await.unwrap();
    let rb = b.alloc(4096).await.unwrap();
    let to_a = b.remote_region(&ra.descriptor().to_bytes()).await.unwrap();
    let c = a.imm_counter(9);
    let t0 = Instant::now();
    let wait = tokio::spawn(async move { c.wait_for(1).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = a.stats().reactor;
    if t0.elapsed() < budget {
        assert_eq!((r.lingering, r.lingered, r.linger_parked), (1, 1, 0), "lingering at 50 ms: {r:?}");
    }
    tokio::time::sleep(budget * 2).await;
    let r = a.stats().reactor;
    assert_eq!((r.lingering, r.lingered, r.linger_parked), (0, 1, 1), "parked after the budget: {r:?}");
    assert!(!wait.is_finished(), "nothing arrived, yet the wait ended");
    rb.write_at(0, &[7u8; 64]).unwrap();
    b.write_imm(&rb, 0, &to_a, 0, 64, 9).await.unwrap();
    bounded(wait).await.unwrap().expect("woken by the reactor thread with its arrival");
    let mut got = [0u8; 64];
    ra.read_at(0, &mut got).unwrap();
    assert_eq!(got, [7u8; 64]);
}

/// A lingering future never holds its runtime's thread for long: on a current-thread
/// runtime another task keeps running and a timer fires on time while a wait lingers (each
/// poll of the wait spins for at most 20 µs, then asks to be polled again, and tokio runs
/// its other tasks, timers and I/O in between). The runtime runs on a thread of its own,
/// so that a poll that never returned would fail this test instead of hanging it.
#[test]
fn a_lingering_wait_lets_the_other_tasks_of_its_runtime_run() {
    let p = primary();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let out = rt.block_on(async {
            let a = builder(&p, Duration::from_secs(3)).build().unwrap();
            let c = a.imm_counter(4);
            let wait = tokio::spawn(async move { c.wait_for(1).await });
            let ticks = Arc::new(AtomicU64::new(0));
            let t2 = ticks.clone();
            let ticker = tokio::spawn(async move {
                loop {
                    t2.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                }
            });
            let t0 = Instant::now();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let slept = t0.elapsed();
            let lingering = a.stats().reactor.lingering;
            ticker.abort();
            wait.abort();
            (slept, ticks.load(Ordering::Relaxed), lingering)
        });
        let _ = tx.send(out);
    });
    let (slept, ticks, lingering) =
        rx.recv_timeout(Duration::from_secs(20)).expect("the runtime's thread came back from its polls");
    assert_eq!(lingering, 1, "the wait lingered all along");
    assert!(slept < Duration::from_secs(2), "a 100 ms timer fired after {slept:?}");
    // A task that yields runs again once tokio polls its drivers (every 61 polls: about
    // every 1.2 ms beside a lingering wait's 20 µs slices: 73-79 times in 100 ms on the
    // 2-core host, as few as 13 once in the emulated rxe VM, where the rest of each poll is
    // slower). A poll that kept the thread, or a runtime that never came back to the
    // ticker, gives 0 or 1.
    assert!(ticks >= 5, "the other task ran only {ticks} times in {slept:?} beside the lingering wait");
}

/// A lingering future that is dropped (here by a timeout) stops lingering: nothing lingers
/// after, the reactor thread may sleep again, and the timeout fired on time.
#[tokio::test]
async fn dropping_a_lingering_wait_stops_its_lingering() {
    let p = primary();
    let a = builder(&p, Duration::from_secs(10)).build().unwrap();
    let c = a.imm_counter(5);
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_millis(50), c.wait_for(1)).await;
    assert!(r.is_err(), "nothing arrived, so the timeout fired");
    assert!(t0.elapsed() < Duration::from_secs(5), "the 50 ms timeout fired after {:?}", t0.elapsed());
    let s = a.stats().reactor;
    assert_eq!((s.lingering, s.lingered, s.linger_parked), (0, 1, 0), "{s:?}");
    assert_eq!(c.available(), 0, "and it consumed nothing");
}

/// While a future lingers the reactor thread of an engine with a wait fd polls instead of
/// sleeping (so the result is seen at once); once nothing lingers it sleeps again.
#[tokio::test]
async fn the_reactor_thread_polls_while_a_future_lingers_and_sleeps_after() {
    let p = primary();
    if p == "shm" {
        // shm has no wait fd: its reactor polls for 1 ms after activity and then sleeps
        // on timers whether or not anything lingers.
        return skipped(
            "the_reactor_thread_polls_while_a_future_lingers_and_sleeps_after",
            "needs a wait fd",
        );
    }
    let budget = Duration::from_millis(600);
    let a = builder(&p, budget).build().unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await; // asleep
    let c = a.imm_counter(6);
    let wait = tokio::spawn(async move { c.wait_for(1).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let s0 = a.stats().reactor;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s1 = a.stats().reactor;
    assert_eq!(s1.lingering, 1, "{s1:?}");
    assert_eq!(s1.sleeps, s0.sleeps, "the reactor thread slept while a future lingered");
    // A sleeping reactor thread, with nothing in flight, passes a few times at most in 200 ms;
    // a polling one thousands of times, or, yielding its core to the spinning threads of the
    // other tests on a 2-core machine, still dozens.
    assert!(s1.passes > s0.passes + 20, "the reactor thread did not poll: {s0:?} then {s1:?}");
    tokio::time::sleep(budget).await;
    let s2 = a.stats().reactor;
    assert_eq!((s2.lingering, s2.linger_parked), (0, 1), "{s2:?}");
    assert!(s2.sleeps > s1.sleeps, "nothing lingers, yet the reactor thread never slept: {s2:?}");
    wait.abort();
}

/// One future of an engine lingers at a time, and its turn ends with its budget even if
/// nobody polls it again: a wait polled once and then left alone keeps the reactor thread
/// polling for its budget only, and another future may linger after it.
#[tokio::test]
async fn a_lingering_future_left_unpolled_holds_nothing_past_its_budget() {
    let p = primary();
    let budget = Duration::from_millis(200);
    let a = builder(&p, budget).build().unwrap();
    let (c1, c2) = (a.imm_counter(7), a.imm_counter(8));
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let mut first = Box::pin(c1.wait_for(1));
    assert!(first.as_mut().poll(&mut cx).is_pending());
    let mut second = Box::pin(c2.wait_for(1));
    assert!(second.as_mut().poll(&mut cx).is_pending());
    let r = a.stats().reactor;
    assert_eq!((r.lingering, r.lingered), (1, 1), "the first lingers, the second waits as usual: {r:?}");
    tokio::time::sleep(budget + Duration::from_millis(300)).await;
    let r1 = a.stats().reactor;
    assert_eq!(r1.lingering, 0, "the unpolled future's turn ended with its budget: {r1:?}");
    if p != "shm" {
        // With a wait fd the reactor thread sleeps again: a handful of passes in 100 ms, not
        // the thousands of a polling thread (shm polls on timers of up to 1 ms anyway).
        tokio::time::sleep(Duration::from_millis(100)).await;
        let passes = a.stats().reactor.passes - r1.passes;
        assert!(passes < 50, "{passes} passes in 100 ms: the reactor thread still polls");
    }
    let mut third = Box::pin(a.imm_counter(9).wait_for(1));
    assert!(third.as_mut().poll(&mut cx).is_pending());
    assert_eq!(a.stats().reactor.lingered, 2, "another future lingers after the budget");
    // The first, polled again, parks (its budget is spent) and gives nothing back.
    assert!(first.as_mut().poll(&mut cx).is_pending());
    let r = a.stats().reactor;
    assert_eq!((r.lingering, r.linger_parked), (1, 1), "the third still lingers: {r:?}");
    drop((first, second, third));
    assert_eq!(a.stats().reactor.lingering, 0);
}

/// A stream of 64 KiB writes, 16 in flight, between two lingering engines: the reactor posts
/// the next writes while it is still completing the window's earlier ones. Every write's
/// bytes land and every immediate is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lingering_stream_lands_every_byte() {
    const SLOT: u64 = 64 << 10;
    const WINDOW: u64 = 16;
    for p in providers() {
        let (a, b) = pair_big(&p, SLOT * WINDOW).await;
        let n = 1000u64;
        let mut inflight = std::collections::VecDeque::new();
        for i in 0..n {
            let slot = i % WINDOW;
            if inflight.len() as u64 == WINDOW {
                let f: fabric_async::OpFuture = inflight.pop_front().unwrap();
                bounded(f).await.unwrap();
            }
            // The slot's previous write has completed: its source may be reused.
            a.region.write_at(slot * SLOT, &vec![(i % 251) as u8; SLOT as usize]).unwrap();
            inflight.push_back(a.engine.write_imm(&a.region, slot * SLOT, &a.remote, slot * SLOT, SLOT, 3));
        }
        for f in inflight {
            bounded(f).await.unwrap();
        }
        bounded(b.engine.imm_counter(3).wait_for(n)).await.unwrap();
        assert_eq!(b.engine.imm_counter(3).available(), 0, "{p}: one arrival per write");
        for slot in 0..WINDOW {
            let last = (n - WINDOW..n).find(|i| i % WINDOW == slot).unwrap();
            let mut got = vec![0u8; SLOT as usize];
            b.region.read_at(slot * SLOT, &mut got).unwrap();
            assert!(got.iter().all(|&x| x == (last % 251) as u8), "{p}: slot {slot} holds write {last}");
        }
        assert!(a.engine.stats().reactor.lingered > 0, "{p}: the stream's waits lingered");
    }
}

async fn pair_big(p: &str, len: u64) -> (ping::Side, ping::Side) {
    let linger = Duration::from_secs(1);
    let (a, b) = (builder(p, linger).build().unwrap(), builder(p, linger).build().unwrap());
    let (ra, rb) = (a.alloc(len as usize).await.unwrap(), b.alloc(len as usize).await.unwrap());
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let to_a = b.remote_region(&ra.descriptor().to_bytes()).await.unwrap();
    (ping::Side { engine: a, region: ra, remote: to_b }, ping::Side { engine: b, region: rb, remote: to_a })
}

/// Where lingering applies: not beside `await_spin` (which runs passes itself) nor in
/// `Inline` mode (which never parks); the budget set is the budget used.
#[test]
fn the_linger_budget_is_what_the_builder_says() {
    let ms = Duration::from_millis;
    assert_eq!(builder("tcp", ms(3)).linger_budget(), ms(3));
    assert_eq!(builder("tcp", ms(3)).await_spin(ms(1)).linger_budget(), Duration::ZERO);
    assert_eq!(builder("tcp", ms(3)).mode(ReactorMode::Inline).linger_budget(), Duration::ZERO);
    assert_eq!(builder("tcp", ms(3)).mode(ReactorMode::BusyPoll).linger_budget(), ms(3));
    assert_eq!(builder("tcp", Duration::ZERO).linger_budget(), Duration::ZERO);
}

/// A wait that lingers when its engine shuts down ends with `Error::Shutdown` at once, not
/// at the end of its budget: a counter's wait and a `recv` alike.
#[tokio::test]
async fn a_lingering_wait_ends_at_shutdown_not_at_its_budget() {
    let p = primary();
    let budget = Duration::from_secs(20);
    for what in ["wait_for", "recv"] {
        let (a, b) = (builder(&p, budget).build().unwrap(), builder(&p, Duration::ZERO).build().unwrap());
        // One arrival first: the engine and its counter work before the shutdown.
        let c = a.imm_counter(11);
        let ra = a.alloc(4096).await.unwrap();
        let to_a = b.remote_region(&ra.descriptor().to_bytes()).await.unwrap();
        b.imm(&to_a, 11).await.unwrap();
        bounded(c.wait_for(1)).await.unwrap();
        let t0 = Instant::now();
        let wait = if what == "wait_for" {
            let c = c.clone();
            tokio::spawn(async move { c.wait_for(1).await.map(|_| ()) })
        } else {
            let r = a.recv();
            tokio::spawn(async move { r.await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(a.stats().reactor.lingering, 1, "{what}: lingering before the shutdown");
        a.shutdown();
        let r = tokio::time::timeout(Duration::from_secs(5), wait).await;
        let r = r.unwrap_or_else(|_| panic!("{what}: still waiting 5 s after the shutdown")).unwrap();
        assert!(matches!(r, Err(fabric_async::Error::Shutdown)), "{what}: {r:?}");
        assert!(t0.elapsed() < budget / 2, "{what}: ended after {:?}", t0.elapsed());
    }
}

/// On a `BusyPoll` engine a lingering future runs the engine's passes between its peeks (the
/// reactor thread stands by while it does): a ping-pong of futures never parks, every wait
/// ends inside its budget, and the passes ran on the awaiting threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lingering_future_of_a_busy_poll_engine_drives_it() {
    for p in providers() {
        let n = 100;
        let (a, b) = ping::pair(|| builder(&p, Duration::from_secs(2)).mode(ReactorMode::BusyPoll)).await;
        let (lead, other, a, b) = ping::run(a, b, n).await;
        let (sa, sb) = (a.engine.stats().reactor, b.engine.stats().reactor);
        assert_eq!((lead, other), (0, 0), "{p}: parks of the awaiting threads in {n} round trips");
        assert_eq!((sa.linger_parked, sb.linger_parked), (0, 0), "{p}: a wait spent 2 s");
        assert!(
            sa.caller_passes > 0 && sb.caller_passes > 0,
            "{p}: no pass on an awaiting thread: {sa:?} {sb:?}"
        );
    }
}
