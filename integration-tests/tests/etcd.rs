//! `EtcdStore` against a real etcd server (Debian's `etcd-server`): three member processes
//! find the test through etcd alone, receive real bytes over libfabric (tcp on loopback,
//! every byte checked), and the membership watch reports one of them leaving when the test
//! kills it (lease expiry, TTL 2 s) and the others leaving cleanly.
//!
//! Without an etcd binary the test fails when `CI=true` and is skipped (with a line on
//! stderr) elsewhere.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, EtcdOptions, EtcdStore, MemberEvent, MemberEvents};
use futures::StreamExt;
use integration_tests::etcd_server::{etcd_binary, EtcdServer};
use integration_tests::{fill_pattern, skipped};

const MEMBER: &str = env!("CARGO_BIN_EXE_fabric-etcd-member");
const MEMBERS: usize = 3;
const SIZE: usize = 1 << 20;
const CHUNK: usize = 64 << 10;
const IMM: u32 = 7;

/// Member processes, killed on drop (a failing test leaks none).
struct Members(Vec<Option<Child>>);

impl Drop for Members {
    fn drop(&mut self) {
        for c in self.0.iter_mut().filter_map(Option::take) {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn next_event(events: &mut MemberEvents, within: Duration) -> MemberEvent {
    match tokio::time::timeout(within, events.next()).await {
        Ok(Some(Ok(e))) => e,
        Ok(Some(Err(e))) => panic!("membership watch failed: {e}"),
        Ok(None) => panic!("membership watch ended"),
        Err(_) => panic!("no membership event within {within:?}"),
    }
}

/// Why the etcd tests do not run in the rxe VM stage of the suite.
const VM_SKIP: &str = "runs in the host stage: etcd is transport-independent, and the rxe VM's \
                       emulated CPUs (qemu TCG) outlast the tests' 2 s leases";

/// The host stage of the suite (its providers include tcp); the rxe VM stage runs with
/// `FABRIC_TEST_PROVIDERS=verbs`.
fn on_host_stage() -> bool {
    integration_tests::providers().iter().any(|p| p == "tcp")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_meet_transfer_and_leave_through_etcd() {
    if !on_host_stage() {
        return skipped("members_meet_transfer_and_leave_through_etcd", VM_SKIP);
    }
    let Some(bin) = etcd_binary() else {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true but no etcd binary (apt-get install etcd-server; scripts/install-deps.sh does)");
        }
        skipped("members_meet_transfer_and_leave_through_etcd", "no etcd binary (install etcd-server)");
        return;
    };
    let etcd = EtcdServer::start(&bin);
    let prefix = format!("fabric-test/{}", std::process::id());
    let opts = EtcdOptions::default().lease_ttl(Duration::from_secs(2)).get_timeout(Duration::from_secs(60));
    let store = EtcdStore::connect(&[etcd.endpoint.as_str()], &prefix, opts).await.expect("connect to etcd");
    let mut events = store.watch_members().await.expect("watch members");

    let writes = SIZE.div_ceil(CHUNK);
    let mut members = Members(Vec::new());
    for i in 0..MEMBERS {
        let child = Command::new(MEMBER)
            .args([&etcd.endpoint, &prefix, &format!("m{i}"), "tcp"])
            .args([SIZE.to_string(), writes.to_string(), (100 + i).to_string()])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn fabric-etcd-member");
        members.0.push(Some(child));
    }

    // Everyone found through the watch alone: each Joined event carries a region descriptor.
    let engine = Engine::builder().provider("tcp").build().expect("engine");
    let mut joined = Vec::new();
    while joined.len() < MEMBERS {
        match next_event(&mut events, Duration::from_secs(30)).await {
            MemberEvent::Joined { name, value } => joined.push((name, value)),
            other => panic!("unexpected event before all joined: {other:?}"),
        }
    }
    joined.sort();
    for (name, desc) in &joined {
        let i: usize = name.strip_prefix('m').and_then(|n| n.parse().ok()).expect("member name m<i>");
        let dst = engine.remote_region(desc).await.expect("remote region from etcd");
        let src = engine.alloc(SIZE).await.expect("alloc");
        let mut buf = vec![0u8; SIZE];
        fill_pattern(&mut buf, 100 + i as u64, 0);
        src.write_at(0, &buf).expect("fill");
        let ops = (0..writes).map(|w| {
            let off = (w * CHUNK) as u64;
            engine.write_imm(&src, off, &dst, off, CHUNK.min(SIZE - w * CHUNK) as u64, IMM)
        });
        let all = futures::future::try_join_all(ops);
        tokio::time::timeout(Duration::from_secs(30), all).await.expect("writes in time").expect("writes");
    }
    for (name, _) in &joined {
        let verdict = store.get(&format!("done/{name}")).await.expect("member verdict");
        assert_eq!(String::from_utf8_lossy(&verdict), "ok", "member {name}");
    }

    // m0 dies: no clean leave, its lease (2 s) expires and the watch says so.
    let killed = Instant::now();
    if let Some(mut c) = members.0[0].take() {
        c.kill().expect("kill m0");
        let _ = c.wait();
    }
    match next_event(&mut events, Duration::from_secs(15)).await {
        MemberEvent::Left { name } => assert_eq!(name, "m0"),
        other => panic!("expected m0 to leave, got {other:?}"),
    }
    let after = killed.elapsed();
    eprintln!("m0 reported Left {after:?} after SIGKILL (lease TTL {:?})", store.lease_ttl());
    assert!(after >= Duration::from_millis(500), "m0 left before its lease could expire: {after:?}");

    // The others leave cleanly (lease revoked): reported at once.
    store.put("exit", b"now".to_vec()).await.expect("put exit");
    let mut left = Vec::new();
    while left.len() < MEMBERS - 1 {
        match next_event(&mut events, Duration::from_secs(15)).await {
            MemberEvent::Left { name } => left.push(name),
            other => panic!("expected a departure, got {other:?}"),
        }
    }
    left.sort();
    assert_eq!(left, ["m1", "m2"]);
    let deadline = Instant::now() + Duration::from_secs(15);
    for c in members.0.iter_mut().skip(1) {
        let Some(child) = c.as_mut() else { continue };
        loop {
            match child.try_wait().expect("try_wait") {
                Some(status) => {
                    assert!(status.success(), "member exited with {status}");
                    *c = None;
                    break;
                }
                None if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
                None => panic!("a member did not exit after `exit`"),
            }
        }
    }
    store.leave().await.expect("leave");
    engine.shutdown();
    drop(etcd);
}

/// The watch and a waiting `get` outlive the per-request timeout (1 s here): a member that
/// joins, and a key put, 2.5 s later are still seen; a key of a store that is dropped (its
/// keep-alive stops) expires with its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_and_get_outlive_the_request_timeout() {
    if !on_host_stage() {
        return skipped("watch_and_get_outlive_the_request_timeout", VM_SKIP);
    }
    let Some(bin) = etcd_binary() else {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true but no etcd binary (apt-get install etcd-server; scripts/install-deps.sh does)");
        }
        skipped("watch_and_get_outlive_the_request_timeout", "no etcd binary (install etcd-server)");
        return;
    };
    let etcd = EtcdServer::start(&bin);
    let ep = [etcd.endpoint.as_str()];
    let opts = EtcdOptions::default()
        .lease_ttl(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(1))
        .get_timeout(Duration::from_secs(20));
    let a = EtcdStore::connect(&ep, "outlive", opts.clone()).await.expect("connect a");
    let b = EtcdStore::connect(&ep, "outlive", opts.clone()).await.expect("connect b");
    let mut events = a.watch_members().await.expect("watch");
    let waiting = tokio::spawn(async move {
        let v = a.get("late").await;
        (a, v)
    });
    tokio::time::sleep(Duration::from_millis(2500)).await;
    b.join("b", b"hello".to_vec()).await.expect("join");
    b.put("late", b"value".to_vec()).await.expect("put");
    assert_eq!(
        next_event(&mut events, Duration::from_secs(10)).await,
        MemberEvent::Joined { name: "b".into(), value: b"hello".to_vec() }
    );
    let (a, got) =
        tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("get in time").expect("task");
    assert_eq!(got.expect("get"), b"value");
    // b goes away without leave(): its keep-alive stops, its lease (2 s) expires.
    drop(b);
    match next_event(&mut events, Duration::from_secs(15)).await {
        MemberEvent::Left { name } => assert_eq!(name, "b"),
        other => panic!("expected b to leave, got {other:?}"),
    }
    let c =
        EtcdStore::connect(&ep, "outlive", opts.get_timeout(Duration::from_millis(300))).await.expect("c");
    match c.get("late").await {
        Err(fabric_async::BootstrapError::Timeout { .. }) => {}
        other => panic!("b's key should have expired with its lease: {other:?}"),
    }
    a.leave().await.expect("leave");
}
