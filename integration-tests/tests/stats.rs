//! `Engine::stats` adds up after real transfers: two engines of this process over libfabric
//! (tcp and shm on loopback, or `FABRIC_TEST_PROVIDERS`), N writes of S bytes, then the
//! writer's NIC and peer entries, the receiver's counter and both reactors are checked.

use std::time::Duration;

use fabric_async::{Engine, EngineStats, OpStats};
use integration_tests::{fill_pattern, pattern_byte, primary, providers};

const WAIT: Duration = Duration::from_secs(30);
const IMM: u32 = 9;

fn all_done(s: &OpStats, ops: u64, bytes: u64) {
    assert_eq!(s.posted_ops, ops, "posted ops: {s}");
    assert_eq!(s.completed_ops, ops, "completed ops: {s}");
    assert_eq!(s.posted_bytes, bytes, "posted bytes: {s}");
    assert_eq!(s.completed_bytes, bytes, "completed bytes: {s}");
    assert_eq!(s.errors, 0, "errors: {s}");
    assert_eq!(s.in_flight, 0, "in flight: {s}");
    assert_eq!(s.backlog, 0, "backlog: {s}");
}

/// A writer and a receiver on provider `p`, their reactors timed or not
/// (`EngineBuilder::time_reactor`).
fn pair(p: &str, timed: bool) -> (Engine, Engine) {
    let b = || Engine::builder().provider(p).time_reactor(timed);
    (b().build().expect("writer"), b().build().expect("receiver"))
}

/// `e`'s stats once its reactor has charged completion work (at most [`WAIT`]).
async fn settled(e: &Engine) -> EngineStats {
    let t0 = std::time::Instant::now();
    loop {
        let s = e.stats();
        if !s.reactor.completing.is_zero() || t0.elapsed() > WAIT {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// N write_imm of S bytes from `w` to `r`; returns both engines' stats afterwards.
async fn run(w: &Engine, r: &Engine, n: usize, s: usize) -> (EngineStats, EngineStats, fabric_async::PeerId) {
    let dst_region = r.alloc(n * s).await.expect("alloc dst");
    let dst = w.remote_region(&dst_region.descriptor().to_bytes()).await.expect("remote");
    let mut data = vec![0u8; n * s];
    fill_pattern(&mut data, 5, 0);
    let src = w.register_copy(data).await.expect("register src");
    let before = w.stats();
    assert_eq!(before.peer(dst.peer()).copied().unwrap_or_default().posted_ops, 0, "fresh peer: {before}");
    let arrivals: u64 = (0..n).map(|_| w.write_arrivals(&dst, s as u64).expect("arrivals")).sum();
    let writes = (0..n).map(|i| {
        let off = (i * s) as u64;
        w.write_imm(&src, off, &dst, off, s as u64, IMM)
    });
    tokio::time::timeout(WAIT, futures::future::try_join_all(writes))
        .await
        .expect("writes in time")
        .expect("writes");
    let counter = r.imm_counter(IMM);
    tokio::time::timeout(WAIT, counter.wait_for(arrivals)).await.expect("arrivals in time").expect("wait");
    let mut got = vec![0u8; n * s];
    dst_region.read_at(0, &mut got).expect("read");
    assert!(got.iter().enumerate().all(|(i, b)| *b == pattern_byte(5, i as u64)), "bytes differ");
    let rs = r.stats();
    let c = rs.counter(IMM).expect("receiver counter entry");
    assert_eq!(c.arrivals, arrivals, "receiver arrivals: {rs}");
    assert_eq!(c.available, 0, "wait_for consumed them: {rs}");
    assert_eq!(c.waiters, 0, "{rs}");
    assert_eq!(rs.total().posted_ops, 0, "the receiver posted nothing: {rs}");
    (w.stats(), rs, dst.peer())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_add_up_on_nic_peer_and_counter() {
    const N: usize = 32;
    const S: usize = 64 << 10;
    for p in providers() {
        let (w, r) = pair(&p, false);
        let (ws, rs, peer) = run(&w, &r, N, S).await;
        eprintln!("{p}: writer after {N} x {S} B:\n{ws}\n{p}: receiver:\n{rs}");
        assert_eq!(ws.nics.len(), 1);
        all_done(&ws.nics[0], N as u64, (N * S) as u64);
        all_done(ws.peer(peer).expect("peer entry"), N as u64, (N * S) as u64);
        assert!(ws.reactor.passes > 0 && rs.reactor.passes > 0, "{ws}\n{rs}");
        assert!(ws.reactor.polling <= ws.reactor.uptime);
        // Untimed (`time_reactor` off): no clock was read for these.
        for s in [&ws, &rs] {
            let r = &s.reactor;
            assert!(r.in_post.is_zero() && r.in_poll.is_zero() && r.completing.is_zero(), "{s}");
        }
        w.shutdown();
        r.shutdown();
    }
}

/// `EngineBuilder::time_reactor`: the writer's reactor reports time in NIC posts, in NIC
/// polls and completing the writes; the receiver's in NIC polls (where the arrivals are read);
/// no engine reports more of it than it has been up (passes never overlap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_reactor_splits_its_time_between_nic_calls_and_completions() {
    const N: usize = 32;
    const S: usize = 64 << 10;
    for p in providers() {
        let (w, r) = pair(&p, true);
        let (_, _, peer) = run(&w, &r, N, S).await;
        // A call's time is added when it returns: the pass that completed the last writes
        // (and woke this task) may still be finishing.
        let (ws, rs) = (settled(&w).await, settled(&r).await);
        eprintln!("{p}: timed writer:\n{ws}\n{p}: timed receiver:\n{rs}");
        all_done(ws.peer(peer).expect("peer entry"), N as u64, (N * S) as u64);
        let (a, b) = (&ws.reactor, &rs.reactor);
        assert!(!a.in_post.is_zero() && !a.in_poll.is_zero() && !a.completing.is_zero(), "{p} writer: {ws}");
        assert!(!b.in_poll.is_zero() && !b.completing.is_zero(), "{p} receiver: {rs}");
        for s in [&ws, &rs] {
            let r = &s.reactor;
            assert!(r.in_post + r.in_poll + r.completing <= r.uptime, "{p}: {s}");
        }
        let shown = ws.to_string();
        assert!(shown.contains("in NIC posts") && shown.contains("completing"), "{shown}");
        w.shutdown();
        r.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_writes_add_up_over_two_nics() {
    const N: usize = 8;
    const S: usize = 1 << 20;
    let p = primary();
    if p.starts_with("verbs") {
        integration_tests::skipped("sharded_writes_add_up_over_two_nics", "needs two libfabric domains");
        return;
    }
    let w = Engine::builder().provider(p.as_str()).domains(2).build().expect("writer");
    let r = Engine::builder().provider(p.as_str()).domains(2).build().expect("receiver");
    let (ws, _rs, peer) = run(&w, &r, N, S).await;
    eprintln!("{p}, 2 NICs: writer after {N} x {S} B:\n{ws}");
    let total = ws.total();
    assert_eq!(total.posted_bytes, (N * S) as u64, "{ws}");
    assert_eq!(total.completed_ops, total.posted_ops, "{ws}");
    assert!(ws.nics.iter().all(|n| n.posted_ops > 0), "both NICs carried shards: {ws}");
    all_done(ws.peer(peer).expect("peer entry"), total.posted_ops, (N * S) as u64);
    w.shutdown();
    r.shutdown();
}

/// A `metrics` recorder that keeps the last value of every series, keyed `name{l=v,...}`.
#[derive(Default)]
struct Last(std::sync::Mutex<std::collections::BTreeMap<String, f64>>);

struct Series(std::sync::Arc<Last>, String);

impl metrics::CounterFn for Series {
    fn increment(&self, v: u64) {
        *self.0 .0.lock().unwrap().entry(self.1.clone()).or_default() += v as f64;
    }
    fn absolute(&self, v: u64) {
        self.0 .0.lock().unwrap().insert(self.1.clone(), v as f64);
    }
}

impl metrics::GaugeFn for Series {
    fn increment(&self, v: f64) {
        *self.0 .0.lock().unwrap().entry(self.1.clone()).or_default() += v;
    }
    fn decrement(&self, v: f64) {
        *self.0 .0.lock().unwrap().entry(self.1.clone()).or_default() -= v;
    }
    fn set(&self, v: f64) {
        self.0 .0.lock().unwrap().insert(self.1.clone(), v);
    }
}

struct Recorder(std::sync::Arc<Last>);

impl Recorder {
    fn series(&self, key: &metrics::Key) -> std::sync::Arc<Series> {
        let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        std::sync::Arc::new(Series(self.0.clone(), format!("{}{{{}}}", key.name(), labels.join(","))))
    }
}

impl metrics::Recorder for Recorder {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(self.series(key))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(self.series(key))
    }
    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_reach_the_metrics_facade() {
    const N: usize = 4;
    const S: usize = 4096;
    let p = primary();
    let w = Engine::builder().provider(p.as_str()).build().expect("writer");
    let r = Engine::builder().provider(p.as_str()).build().expect("receiver");
    let (ws, rs, peer) = run(&w, &r, N, S).await;
    let last = std::sync::Arc::new(Last::default());
    metrics::with_local_recorder(&Recorder(last.clone()), || {
        ws.record_metrics("w");
        rs.record_metrics("r");
    });
    let m = last.0.lock().unwrap().clone();
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("no series {k} in {m:#?}"));
    assert_eq!(get("fabric_nic_posted_ops_total{engine=w,nic=0}"), N as f64);
    assert_eq!(get("fabric_nic_completed_bytes_total{engine=w,nic=0}"), (N * S) as f64);
    assert_eq!(get(&format!("fabric_peer_completed_ops_total{{engine=w,peer={}}}", peer.0)), N as f64);
    assert_eq!(get("fabric_nic_in_flight{engine=w,nic=0}"), 0.0);
    assert_eq!(get(&format!("fabric_counter_arrivals_total{{engine=r,imm={IMM}}}")), N as f64);
    assert_eq!(get("fabric_counters{engine=r}"), rs.counters.len() as f64);
    assert_eq!(get("fabric_counters_max{engine=r}"), rs.max_counters as f64);
    assert_eq!(get("fabric_counter_refused_total{engine=r}"), 0.0);
    assert!(get("fabric_reactor_passes_total{engine=w}") > 0.0);
    w.shutdown();
    r.shutdown();
}

/// Latency profiles set the mode and every latency option together; a setter after the
/// profile wins; `stats()` (and its `Display`) says what the engine runs with.
#[test]
fn latency_profiles_and_the_settings_stats_report() {
    use fabric_async::{LatencyProfile, ReactorMode};
    let p = primary();
    let build = |b: fabric_async::EngineBuilder| b.provider(&p).build().expect("engine");
    let low = build(Engine::builder().latency_profile(LatencyProfile::LowCpu));
    let s = low.stats().settings;
    assert_eq!(
        (s.mode, s.await_linger, s.poll_window, s.await_spin),
        (ReactorMode::Event, Duration::ZERO, Duration::ZERO, Duration::ZERO)
    );
    assert!(s.cpus >= 1);
    assert!(low.stats().to_string().contains("settings: Event mode, await_linger 0 us, poll_window 0 us"));
    let balanced = build(Engine::builder().latency_profile(LatencyProfile::Balanced));
    let s = balanced.stats().settings;
    assert_eq!(
        (s.mode, s.await_linger, s.poll_window),
        (ReactorMode::Event, Duration::from_micros(200), Duration::from_micros(250))
    );
    let fast = build(
        Engine::builder().latency_profile(LatencyProfile::LowLatency).await_linger(Duration::from_micros(50)),
    );
    let s = fast.stats().settings;
    assert_eq!(
        (s.mode, s.await_linger),
        (ReactorMode::BusyPoll, Duration::from_micros(50)),
        "the later setter wins"
    );
    for e in [low, balanced, fast] {
        e.shutdown();
    }
}
