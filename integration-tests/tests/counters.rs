//! ImmCounter semantics over real transports: exact counts under concurrency and shuffling,
//! early arrivals, and timeouts that consume nothing.

use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, ImmCounterExt};
use integration_tests::{get_str, plan_counts, primary, providers, skipped, store, storm_plan, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

async fn storm(provider: &str, total: usize, tasks: usize, distinct: u32) {
    let seed = 0x5eed + total as u64;
    let (_server, store, addr) = store().await;
    let engine = Engine::builder().provider(provider).build().expect("engine");
    let region = engine.alloc(4096).await.expect("alloc");
    store.put("writer/desc", region.descriptor().to_bytes()).await.unwrap();
    let storm = format!("{total},{tasks},{distinct},{seed}");
    let mut peer = Peer::spawn(PEER, addr, provider, &["writer", "--storm", &storm]);
    let done = get_str(&store, "writer/done").await;
    assert_eq!(done, "ok");

    // Every counter below is created only now, after the writer saw all its writes
    // complete: arrivals that landed before anybody asked must have been kept.
    let counts = plan_counts(&storm_plan(total, tasks, distinct, seed));
    assert_eq!(counts.values().sum::<u64>(), total as u64);
    let (&first_imm, &first_n) = counts.iter().next().unwrap();
    let first = engine.imm_counter(first_imm);
    // Wait until all of the first value's arrivals are there ...
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while first.available() < first_n && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ... then a wait for one more than was sent times out and consumes nothing.
    assert!(!first.wait_for_timeout(first_n + 1, Duration::from_millis(200)).await.unwrap());
    assert_eq!(first.available(), first_n, "{provider}: a timed-out wait consumed arrivals");
    for (&imm, &n) in &counts {
        let c = engine.imm_counter(imm);
        assert!(
            c.wait_for_timeout(n, Duration::from_secs(30)).await.unwrap(),
            "{provider}: imm {imm}: wanted {n}, have {}",
            c.available()
        );
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for &imm in counts.keys() {
        assert_eq!(engine.imm_counter(imm).available(), 0, "{provider}: imm {imm} got more than was sent");
        assert_eq!(engine.imm_counter(imm).total_arrived(), counts[&imm], "{provider}: imm {imm} total");
    }
    store.put("writer/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_tasks_ten_thousand_shuffled_imms_exact_counts() {
    for p in providers() {
        storm(&p, 10_000, 8, 16).await;
        eprintln!("{p}: 10000 imm-only writes counted exactly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_run_on_udp() {
    if !providers().iter().any(|p| p == "tcp") {
        skipped("small_run_on_udp", "udp runs with the libfabric suite (FABRIC_TEST_PROVIDERS has no tcp)");
        return;
    }
    storm("udp", 200, 2, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_wait_consumes_nothing_and_early_arrivals_count() {
    let (_server, store, addr) = store().await;
    let p = primary();
    let engine = Engine::builder().provider(p.as_str()).build().expect("engine");
    let region = engine.alloc(4096).await.expect("alloc");
    store.put("writer/desc", region.descriptor().to_bytes()).await.unwrap();
    // 300 imm-only writes of values 100..103, 100 of each ... (3 distinct, 1 task)
    let mut peer = Peer::spawn(PEER, addr, &p, &["writer", "--storm", "300,1,3,7"]);
    assert_eq!(get_str(&store, "writer/done").await, "ok");
    // Give the last arrivals time to land, then ask for the counter for the first time.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let c = loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let c = engine.imm_counter(100);
        if c.available() == 100 || std::time::Instant::now() > deadline {
            break c;
        }
    };
    assert_eq!(c.available(), 100, "arrivals before the counter was first asked for are counted");
    // Ask for more than will ever come: the timeout fires and nothing is consumed.
    let r = tokio::time::timeout(Duration::from_millis(300), c.wait_for(101)).await;
    assert!(r.is_err(), "101 of 100 cannot be satisfied");
    assert_eq!(c.available(), 100, "a timed-out wait consumes nothing");
    // Several waiters with different n on one counter: 30 + 70 = 100.
    let (a, b) = tokio::join!(c.wait_for(30), c.wait_for(70));
    a.unwrap();
    b.unwrap();
    assert_eq!(c.available(), 0);
    // select!: a wait that was polled (and registered its waker) loses to a timer and is
    // dropped while pending; it consumes nothing, and a later wait gets every arrival.
    let c2 = engine.imm_counter(101);
    let mut polled = false;
    {
        let wait = c2.wait_for(150);
        tokio::pin!(wait);
        tokio::select! {
            biased;
            _ = &mut wait => panic!("150 of 100 cannot be satisfied"),
            _ = async { polled = true; tokio::time::sleep(Duration::from_millis(100)).await } => {}
        }
    } // the pending wait is dropped here
    assert!(polled, "the wait was polled first (biased), then the timer won");
    assert!(c2.wait_for_timeout(100, Duration::from_secs(10)).await.unwrap());
    assert_eq!(c2.available(), 0, "exactly 100 arrivals of 101");
    store.put("writer/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}
