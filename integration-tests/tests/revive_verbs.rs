//! On verbs: a peer marked down whose process still runs comes back when its
//! address is added again (`docs/faults.md`, "A live peer can be recovered"), and one whose
//! process is gone does not. On verbs whether a peer answers takes a handshake round trip:
//! `add_peer` answers once the peer's process has answered the handshake of the revival, or
//! fails with `Error::Stale` ("... does not answer ...") after `VerbsConfig::revive_timeout`
//! (2 s), without ever blocking the reactor.
//!
//! * A live peer made to look dead: the peer process is stopped (SIGSTOP) and sent more
//!   messages than its receive queue holds; its NIC (the kernel's rxe) answers RDMA writes
//!   for a stopped process, but a message beyond the posted receives waits ("receiver not
//!   ready") until `op_timeout` fails it and the peer goes `Down`. Still stopped, its
//!   process cannot answer the revival's handshake: `add_peer` fails `Stale` within the
//!   bound, no `Up`, no other event. Continued (SIGCONT), `add_peer` returns the same id,
//!   `Up` is published, and a write with immediate lands and is counted, every byte checked.
//! * A dead peer (SIGKILL), found `Down` by keep-alive: `add_peer` fails `Stale` within the
//!   bound.
//!
//! Runs for the verbs providers of `FABRIC_TEST_PROVIDERS` (the rxe VM); other providers
//! print a `SKIPPED` line (tcp and shm revive synchronously: `isolation.rs`). The times are
//! printed (`--nocapture`).

use std::time::{Duration, Instant};

use fabric_async::{Engine, Error, PeerEvent, PeerEvents, PeerId, Rendezvous};
use futures::{FutureExt, StreamExt};
use integration_tests::{fill_pattern, get, hash, providers, skipped, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
const N: usize = 64 * 1024;
/// The revival's bound (`DEFAULT_REVIVE_TIMEOUT`, 2 s) plus room for a loaded VM.
const REVIVE_BOUND: Duration = Duration::from_secs(4);
/// More messages than a verbs domain keeps receives posted for (`msg_slots`, 64).
const FLOOD: usize = 160;

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer in 30 s"))
}

/// Waits for `Down` of `peer` (the stream starts with the current state: `Up`).
async fn down(p: &str, events: &mut PeerEvents, peer: PeerId) {
    loop {
        match bounded("a Down event", events.next()).await {
            Some(PeerEvent::Down { peer: d, reason }) if d == peer => {
                eprintln!("{p}: Down: {reason}");
                return;
            }
            Some(_) => continue,
            None => panic!("{p}: the event stream ended"),
        }
    }
}

/// The events published so far, without waiting.
fn drain(events: &mut PeerEvents) -> Vec<PeerEvent> {
    let mut out = Vec::new();
    while let Some(Some(e)) = events.next().now_or_never() {
        out.push(e);
    }
    out
}

/// `add_peer` of a peer down that does not answer: `Stale` naming it, within the bound, and
/// nothing published. Returns how long it took.
async fn not_revived(p: &str, engine: &Engine, events: &mut PeerEvents, addr: &[u8]) -> Duration {
    let t = Instant::now();
    let r = bounded("add_peer of a peer that does not answer", engine.add_peer(addr)).await;
    let took = t.elapsed();
    match &r {
        Err(Error::Stale { reason, .. }) if reason.contains("does not answer") => {
            eprintln!("{p}: add_peer failed in {took:?}: {}", r.as_ref().unwrap_err())
        }
        other => panic!("{p}: add_peer of a peer that does not answer: {other:?}"),
    }
    assert!(took < REVIVE_BOUND, "{p}: add_peer took {took:?} to fail");
    // The revival's handshake is over: nothing more may come of it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = drain(events);
    assert!(after.is_empty(), "{p}: events after a failed revival: {after:?}");
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_peer_marked_down_comes_back_when_it_answers() {
    for p in providers() {
        if !p.starts_with("verbs") {
            skipped("a_verbs_peer_marked_down_comes_back_when_it_answers", &format!("{p}: verbs only"));
            continue;
        }
        let (_server, store, addr) = store().await;
        let mut target = Peer::spawn(PEER, addr, &p, &["target", "--size", &N.to_string(), "--wait", "5=1"]);
        let engine =
            Engine::builder().provider(p.as_str()).op_timeout(Some(Duration::from_secs(1))).build().unwrap();
        let dst = engine.remote_region(&get(&store, "target/desc").await).await.unwrap();
        let peer_addr = get(&store, "target/addr").await;
        let mut events = engine.peer_events();
        let mut bytes = vec![0u8; N];
        fill_pattern(&mut bytes, 77, 0);
        let src = engine.alloc(N).await.unwrap();
        src.write_at(0, &bytes).unwrap();
        bounded("a first write", engine.write(&src, 0, &dst, 0, N as u64)).await.expect("a first write");

        // Stopped, and sent more messages than it has receives for: those past its receive
        // queue wait for it until op_timeout, and it goes down.
        target.signal("STOP");
        let t = Instant::now();
        let flood: Vec<_> = (0..FLOOD).map(|i| engine.send(dst.peer(), &[i as u8; 64])).collect();
        let results = bounded("the flood of messages", futures::future::join_all(flood)).await;
        let failed = results.iter().filter(|r| matches!(r, Err(Error::PeerUnreachable { .. }))).count();
        assert!(failed > 0, "{p}: every message to a stopped peer completed: {results:?}");
        down(&p, &mut events, dst.peer()).await;
        eprintln!("{p}: {failed} of {FLOOD} messages failed; down {:?} after the stop", t.elapsed());
        let r = bounded("a write to a peer down", engine.write(&src, 0, &dst, 0, 8)).await;
        assert!(matches!(r, Err(Error::PeerUnreachable { .. })), "{p}: a peer down stays down: {r:?}");
        drain(&mut events);

        // Still stopped: its process cannot answer the revival's handshake.
        let stopped = not_revived(&p, &engine, &mut events, &peer_addr).await;
        let r = bounded("a write after a failed revival", engine.write(&src, 0, &dst, 0, 8)).await;
        assert!(matches!(r, Err(Error::PeerUnreachable { .. })), "{p}: still down: {r:?}");

        // Continued: it answers, and comes back with the same id.
        target.signal("CONT");
        let t = Instant::now();
        let back = bounded("add_peer of a live peer", engine.add_peer(&peer_addr))
            .await
            .expect("a live peer comes back");
        let took = t.elapsed();
        assert_eq!(back, dst.peer(), "{p}: same peer id");
        match bounded("the Up event", events.next()).await {
            Some(PeerEvent::Up { peer }) => assert_eq!(peer, back),
            other => panic!("{p}: expected Up after add_peer, got {other:?}"),
        }
        // Adding it again now: the same id at once.
        assert_eq!(bounded("add_peer again", engine.add_peer(&peer_addr)).await.unwrap(), back);
        let t2 = Instant::now();
        bounded("a write with immediate after the revival", engine.write_imm(&src, 0, &dst, 0, N as u64, 5))
            .await
            .expect("traffic resumes");
        let wrote = t2.elapsed();
        let got = get(&store, "target/hash").await;
        assert_eq!(String::from_utf8(got).unwrap(), hash(&bytes).to_string(), "{p}: the target's bytes");
        assert_eq!(get(&store, "target/extra").await, b"5=0", "{p}: the immediate counted once");
        eprintln!(
            "{p}: a stopped peer's add_peer failed in {stopped:?}; once continued it came back in {took:?}, \
             a 64 KiB write with immediate then completed in {wrote:?}"
        );
        let after = drain(&mut events);
        assert!(after.is_empty(), "{p}: events after the revival: {after:?}");
        store.put("target/exit", b"bye".to_vec()).await.unwrap();
        assert!(target.wait_success(Duration::from_secs(30)).await, "{p}: the target exited cleanly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_verbs_peer_does_not_come_back() {
    for p in providers() {
        if !p.starts_with("verbs") {
            skipped("a_dead_verbs_peer_does_not_come_back", &format!("{p}: verbs only"));
            continue;
        }
        let (_server, store, addr) = store().await;
        let mut target = Peer::spawn(PEER, addr, &p, &["target", "--size", &N.to_string()]);
        let engine =
            Engine::builder().provider(p.as_str()).op_timeout(Some(Duration::from_secs(10))).build().unwrap();
        let dst = engine.remote_region(&get(&store, "target/desc").await).await.unwrap();
        let peer_addr = get(&store, "target/addr").await;
        let mut events = engine.peer_events();
        let src = engine.alloc(N).await.unwrap();
        bounded("a first write", engine.write(&src, 0, &dst, 0, N as u64)).await.expect("a first write");

        target.kill();
        let t = Instant::now();
        // Keep-alive finds it (nothing is posted to it).
        down(&p, &mut events, dst.peer()).await;
        eprintln!("{p}: a killed peer went down {:?} after the kill", t.elapsed());
        drain(&mut events);
        let took = not_revived(&p, &engine, &mut events, &peer_addr).await;
        // Again (a second revival, not a cached answer); while it waits for the peer, the
        // reactor serves everything else, and an operation to the peer fails at once (it is
        // down until it answers).
        let pending = {
            let (engine, addr) = (engine.clone(), peer_addr.clone());
            tokio::spawn(async move { engine.add_peer(&addr).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        let r = bounded("a write during a revival", engine.write(&src, 0, &dst, 0, 8)).await;
        let failed_in = t.elapsed();
        assert!(matches!(r, Err(Error::PeerUnreachable { .. })), "{p}: a write during a revival: {r:?}");
        assert!(failed_in < Duration::from_millis(500), "{p}: a write during a revival took {failed_in:?}");
        let other = bounded("alloc during a revival", engine.alloc(4096)).await;
        assert!(other.is_ok(), "{p}: the reactor serves other work during a revival");
        assert!(!pending.is_finished(), "{p}: add_peer answered before the revival's bound");
        let r = bounded("the second revival", pending).await.expect("the add_peer task");
        assert!(
            matches!(&r, Err(Error::Stale { reason, .. }) if reason.contains("does not answer")),
            "{p}: {r:?}"
        );
        eprintln!("{p}: a write during a revival failed in {failed_in:?}");
        // Its descriptors go through the same path.
        let t = Instant::now();
        let r =
            bounded("remote_region of a dead peer", engine.remote_region(&get(&store, "target/desc").await))
                .await;
        assert!(
            matches!(&r, Err(Error::Stale { reason, .. }) if reason.contains("does not answer")),
            "{p}: {r:?}"
        );
        eprintln!("{p}: a dead peer's add_peer failed in {took:?}, its remote_region in {:?}", t.elapsed());
        let r = bounded("a write to a dead peer", engine.write(&src, 0, &dst, 0, 8)).await;
        assert!(matches!(r, Err(Error::PeerUnreachable { .. })), "{p}: {r:?}");
    }
}
