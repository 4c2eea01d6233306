//! The bounded counter table (`EngineBuilder::max_counters`) against a peer that sends a
//! million distinct immediates over a real transport. Its own test binary, so that the
//! process's resident memory is this test's alone.

use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, ImmCounterExt};
use integration_tests::{get_str, primary, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

/// This process's resident memory (`VmRSS` of /proc/self/status), in bytes.
fn vm_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    let kib: u64 = line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("VmRSS in kB");
    kib * 1024
}

/// A peer sends 1,000,000 imm-only writes, each with an immediate of its own (a hostile or
/// leaking peer), to an engine whose arrivals may create at most `LIMIT` counters
/// (`EngineBuilder::max_counters`): the counter table stays within it, every arrival beyond
/// it is refused and counted, a counter the application holds still counts exactly, a wait on
/// a refused value fails with `CounterLimit`, and the receiver's memory grows by a bounded
/// amount (1,000,000 counters would take about 170 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_distinct_immediates_leave_the_receivers_memory_bounded() {
    const LIMIT: usize = 65_536;
    const DISTINCT: usize = 1_000_000;
    /// The application's own channel, asked for before the flood (the storm's values start
    /// at 100).
    const CHANNEL: u32 = 7;
    const CHANNEL_WRITES: u64 = 1000;
    /// A value first sent once the table is full.
    const LATE: u32 = 5;
    let p = primary();
    let (_server, store, addr) = store().await;
    let engine = Engine::builder().provider(p.as_str()).max_counters(LIMIT).build().expect("engine");
    let region = engine.alloc(4096).await.expect("alloc");
    let channel = engine.imm_counter(CHANNEL);
    store.put("writer/desc", region.descriptor().to_bytes()).await.unwrap();
    let rss_before = vm_rss();
    let started = std::time::Instant::now();
    // 4 tasks of 64 writes in flight each; then the channel's writes, then the late value's.
    let storm = format!("{DISTINCT},4,{DISTINCT},29");
    let then = format!("{CHANNEL}={CHANNEL_WRITES},{LATE}=3");
    let mut peer = Peer::spawn(PEER, addr, &p, &["writer", "--storm", &storm, "--then", &then]);
    // Memory once the table is full and refusals have begun, to compare with the end: the
    // ~830,000 refusals after it must not grow it.
    let full = async {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if engine.stats().imm_refused >= 100_000 {
                return Some(vm_rss());
            }
        }
        None
    };
    let (rss_full, done) = tokio::join!(full, get_str(&store, "writer/done"));
    assert_eq!(done, "ok");
    let rss_full = rss_full.expect("refusals began within 120 s");
    // Every write has completed at the writer; wait until the receiver has seen them all.
    let sent = DISTINCT as u64 + CHANNEL_WRITES + 3;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let stats = loop {
        let s = engine.stats();
        let counted: u64 = s.counters.iter().map(|c| c.arrivals).sum();
        if counted + s.imm_refused >= sent || std::time::Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let elapsed = started.elapsed();
    let rss_after = vm_rss();
    let grown = rss_after.saturating_sub(rss_before);
    let grown_refusing = rss_after.saturating_sub(rss_full);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "{p}: {DISTINCT} distinct immediates in {:.1} s; {} counters, {} arrivals refused; \
         VmRSS {:.1} MiB before, {:.1} MiB once 100,000 were refused, {:.1} MiB at the end \
         (+{:.1} MiB in all, +{:.1} MiB while refusing)",
        elapsed.as_secs_f64(),
        stats.counters.len(),
        stats.imm_refused,
        mib(rss_before),
        mib(rss_full),
        mib(rss_after),
        mib(grown),
        mib(grown_refusing),
    );
    assert_eq!(stats.max_counters, LIMIT);
    assert_eq!(stats.counters.len(), LIMIT, "the table fills up to its limit and no further");
    // The channel took one place; arrivals created the other LIMIT - 1 and were refused
    // for every other value of the storm, and for the late value's three writes.
    let refused = (DISTINCT - (LIMIT - 1)) as u64 + 3;
    assert_eq!(stats.imm_refused, refused, "every arrival beyond the limit is refused and counted");
    let counted: u64 = stats.counters.iter().map(|c| c.arrivals).sum();
    assert_eq!(counted + stats.imm_refused, sent, "every arrival is counted or refused, none lost");
    // Under the limit nothing changed: the application's channel counts exactly ...
    assert_eq!(channel.total_arrived(), CHANNEL_WRITES);
    assert!(channel.wait_for_timeout(CHANNEL_WRITES, Duration::from_secs(10)).await.unwrap());
    assert_eq!(channel.available(), 0);
    // ... and arrivals that created a counter before anybody asked for it are kept.
    let early = stats.counters.iter().find(|c| c.imm >= 100).expect("a counter the storm created").imm;
    let c = engine.imm_counter(early);
    assert_eq!((c.available(), c.total_arrived()), (1, 1), "imm {early}");
    assert!(c.wait_for_timeout(1, Duration::from_secs(10)).await.unwrap());
    // A wait on the value whose arrivals were refused fails at once, typed.
    let late = engine.imm_counter(LATE);
    match late.wait_for(3).await {
        Err(fabric_async::Error::CounterLimit { imm: LATE, limit: LIMIT }) => {}
        other => panic!("a wait on a refused value: {other:?}"),
    }
    // Bounded memory: the table's 65,536 counters and the last 4,096 refused values, not a
    // million counters.
    assert!(grown < 64 << 20, "VmRSS grew by {grown} bytes");
    assert!(grown_refusing < 16 << 20, "VmRSS grew by {grown_refusing} bytes while refusing");
    // Retiring gives places back: what a counter held is discarded, and the refused value
    // starts afresh.
    assert_eq!(engine.retire_counter(early).await.unwrap(), 0, "its arrival was consumed");
    assert_eq!(engine.retire_counter(LATE).await.unwrap(), 0);
    assert_eq!(engine.stats().counters.len(), LIMIT - 1);
    assert!(matches!(late.wait_for(1).await, Err(fabric_async::Error::CounterRetired { imm: LATE })));
    let fresh = engine.imm_counter(LATE);
    assert!(!fresh.wait_for_timeout(1, Duration::from_millis(50)).await.unwrap(), "a fresh counter waits");
    store.put("writer/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}
