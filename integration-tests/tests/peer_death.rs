//! A peer process that dies is detected by what its transport reports, not waited out:
//! every operation to it fails promptly with `PeerUnreachable`, `peer_events` says `Down`,
//! and the engine keeps serving the other peers with every byte verified. A restarted peer
//! is added again without restarting anyone, and `remove_peer` forgets the dead one.
//!
//! `op_timeout` is 60 s here, so a failure that arrives within the test's bound (10 s) was
//! found by the transport. The detection times are printed (`--nocapture`).

use std::time::{Duration, Instant};

use fabric_async::{Engine, Error, ImmCounterExt, PeerEvent, PeerId, Rendezvous};
use futures::StreamExt;
use integration_tests::{fill_pattern, get, get_str, hash, providers, run_child_test, skipped, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
const CHUNK: usize = 32 << 10;
const CHUNKS: usize = 128;
const REGION: usize = CHUNK * CHUNKS;
/// A dead peer must be detected well before this (and `op_timeout` is far above it).
const DETECT_BOUND: Duration = Duration::from_secs(10);

fn engine(p: &str) -> Engine {
    Engine::builder().provider(p).op_timeout(Some(Duration::from_secs(60))).build().expect("engine")
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer in 60 s"))
}

/// A peer event stream that keeps the events it read past, so that waiting for one peer's
/// event loses none about another.
struct Events {
    stream: fabric_async::PeerEvents,
    skipped: Vec<PeerEvent>,
}

fn about(e: &PeerEvent) -> PeerId {
    match e {
        PeerEvent::Up { peer } | PeerEvent::Down { peer, .. } | PeerEvent::Removed { peer } => *peer,
        other => panic!("unknown event {other:?}"),
    }
}

impl Events {
    fn of(engine: &Engine) -> Events {
        Events { stream: engine.peer_events(), skipped: Vec::new() }
    }

    /// The next event about `peer`, within `DETECT_BOUND`.
    async fn next_about(&mut self, peer: PeerId) -> PeerEvent {
        if let Some(i) = self.skipped.iter().position(|e| about(e) == peer) {
            return self.skipped.remove(i);
        }
        tokio::time::timeout(DETECT_BOUND, async {
            loop {
                let e = self.stream.next().await.expect("the stream lives as long as the engine");
                if about(&e) == peer {
                    return e;
                }
                self.skipped.push(e);
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no event about peer {peer} within {DETECT_BOUND:?}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_fails_fast_and_the_others_keep_working() {
    for p in providers() {
        killed_peer(&p).await;
    }
}

/// shm with CMA off (`FI_SHM_DISABLE_CMA=1`, read once per process, so in a child test
/// process): then plain writes wait for answers too (the SAR protocol), so they would be
/// held behind the dead peer's unanswered ones on a shared endpoint.
#[tokio::test]
async fn shm_without_cma_too() {
    if !providers().iter().any(|p| p == "shm") {
        skipped("shm_without_cma_too", "shm is not among FABRIC_TEST_PROVIDERS");
        return;
    }
    // Bounded: a child stuck for good (a reactor thread spinning on a lock its dead peer
    // left held, docs/faults.md) is killed and fails this test instead of hanging the suite.
    let env = [("FI_SHM_DISABLE_CMA", "1".to_string())];
    let (ok, stdout, stderr) = run_child_test("shm_without_cma_child", "shm-no-cma", &env, CHILD_BOUND).await;
    println!("{stdout}");
    assert!(ok, "the child test failed or did not end within {CHILD_BOUND:?} (killed): {stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "the child ran: {stdout}");
}

/// How long `shm_without_cma_too` waits for its child (which takes a few seconds).
const CHILD_BOUND: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by shm_without_cma_too, with FI_SHM_DISABLE_CMA=1"]
async fn shm_without_cma_child() {
    killed_peer("shm").await;
}

async fn killed_peer(p: &str) {
    let (_vs, vstore, vaddr) = store().await;
    let (_ss, sstore, saddr) = store().await;
    let size = REGION.to_string();
    let mut victim = Peer::spawn(PEER, vaddr, p, &["target", "--size", &size]);
    let post_death_imms = 16u64;
    let wait = format!("8=0,9={post_death_imms}");
    let mut survivor = Peer::spawn(PEER, saddr, p, &["target", "--size", &size, "--wait", &wait]);
    let engine = engine(p);
    let mut events = Events::of(&engine);
    let dv = engine.remote_region(&get(&vstore, "target/desc").await).await.unwrap();
    let ds = engine.remote_region(&get(&sstore, "target/desc").await).await.unwrap();
    assert!(matches!(events.next_about(dv.peer()).await, PeerEvent::Up { .. }));
    let mut data = vec![0u8; REGION];
    fill_pattern(&mut data, 42, 0);
    let src = engine.register_copy(data.clone()).await.unwrap();

    // Both connected first (a connection needs the peer's answer).
    bounded("warm-up", engine.write(&src, 0, &dv, 0, CHUNK as u64)).await.unwrap();
    bounded("warm-up", engine.write(&src, 0, &ds, 0, CHUNK as u64)).await.unwrap();
    // The victim stops answering (its memory and connections stay), everything is posted,
    // then it is killed: on shm its unanswered writes sit ahead of the survivor's.
    victim.signal("STOP");
    let mut to_victim = Vec::new();
    let mut to_survivor = Vec::new();
    let mut imms_to_survivor = Vec::new();
    for i in 0..CHUNKS {
        let off = (i * CHUNK) as u64;
        to_victim.push(engine.write_imm(&src, off, &dv, off, CHUNK as u64, 7));
        to_survivor.push(engine.write(&src, off, &ds, off, CHUNK as u64));
        // The same bytes again, with an immediate: on shm these wait for an answer (on an
        // endpoint shared with the victim's writes they would wait forever).
        imms_to_survivor.push(engine.write_imm(&src, off, &ds, off, CHUNK as u64, 8));
    }
    let victim_ops = tokio::spawn(futures::future::join_all(to_victim));
    let survivor_ops = tokio::spawn(futures::future::join_all(to_survivor));
    let survivor_imms = tokio::spawn(futures::future::join_all(imms_to_survivor));
    // Counter waits tied to a peer (`wait_for_from`): nothing will arrive for either.
    let tied = |peer: PeerId, imm: u32| {
        let e = engine.clone();
        tokio::spawn(async move { e.imm_counter(imm).wait_for_from(&e, &[peer], 1).await })
    };
    let tied_to_victim = tied(dv.peer(), 77);
    let tied_to_survivor = tied(ds.peer(), 78);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let killed = Instant::now();
    victim.kill();

    // Every operation to the victim resolves, and those that fail say the peer is gone.
    let results = bounded("victim ops", victim_ops).await.unwrap();
    let resolved = killed.elapsed();
    let failed = results.iter().filter(|r| r.is_err()).count();
    for r in &results {
        assert!(matches!(r, Ok(()) | Err(Error::PeerUnreachable { .. })), "{p}: {r:?}");
    }
    // And a later one fails at once.
    let t = Instant::now();
    let e = bounded("write to the dead peer", engine.write(&src, 0, &dv, 0, 64)).await.unwrap_err();
    assert!(matches!(e, Error::PeerUnreachable { .. }), "{p}: {e}");
    let later = t.elapsed();
    let down = events.next_about(dv.peer()).await;
    let detected = killed.elapsed();
    let PeerEvent::Down { reason, .. } = down else { panic!("{p}: expected Down, got {down:?}") };
    // The wait tied to the victim fails with it; the one tied to the survivor still waits.
    let r = bounded("a wait tied to the victim", tied_to_victim).await.unwrap();
    assert!(matches!(r, Err(Error::PeerUnreachable { peer, .. }) if peer == dv.peer().0), "{p}: {r:?}");
    assert!(!tied_to_survivor.is_finished(), "{p}: a wait tied to the live peer ended");
    tied_to_survivor.abort();
    // The same, asked without waiting; the survivor is up; an id never given is unknown.
    let status = engine.peer_status(dv.peer());
    assert!(
        matches!(status, Err(Error::PeerUnreachable { ref message, .. }) if *message == reason),
        "{p}: {status:?}"
    );
    assert!(engine.peer_status(ds.peer()).is_ok(), "{p}: the survivor is up");
    assert!(matches!(engine.peer_status(fabric_async::PeerId(1 << 30)), Err(Error::UnknownPeer { .. })));
    println!(
        "{p}: killed peer: {failed}/{CHUNKS} writes in flight failed, all resolved {resolved:?} after \
         the kill, Down event by {detected:?} ({reason}); a later write failed in {later:?}"
    );
    assert!(resolved < DETECT_BOUND, "{p}: found by the transport, not op_timeout: {resolved:?}");

    // The survivor's writes all landed, and new ones do too.
    for r in bounded("survivor ops", survivor_ops).await.unwrap() {
        r.unwrap_or_else(|e| panic!("{p}: a write to the live peer failed: {e}"));
    }
    for r in bounded("survivor write_imms", survivor_imms).await.unwrap() {
        r.unwrap_or_else(|e| panic!("{p}: a write_imm to the live peer failed: {e}"));
    }
    for i in 0..post_death_imms as usize {
        let off = (i * CHUNK) as u64;
        bounded("write_imm after", engine.write_imm(&src, off, &ds, off, CHUNK as u64, 9))
            .await
            .unwrap_or_else(|e| panic!("{p}: a write to the live peer after the death failed: {e}"));
    }
    let their_hash: u64 = get_str(&sstore, "target/hash").await.parse().unwrap();
    assert_eq!(their_hash, hash(&data), "{p}: the live peer's region holds exactly what was written");
    let extra = get_str(&sstore, "target/extra").await;
    assert_eq!(extra, format!("8={CHUNKS},9=0"), "{p}: every arrival counted once");
    sstore.put("target/exit", vec![]).await.unwrap();
    assert!(survivor.wait_success(Duration::from_secs(20)).await, "{p}: survivor exits cleanly");
    let s = engine.stats();
    let sp = s.peer(ds.peer()).expect("survivor stats");
    assert_eq!(sp.errors, 0, "{p}: nothing failed at the live peer: {s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_is_added_again_and_the_dead_one_removed() {
    for p in providers() {
        restarted_peer(&p).await;
    }
}

async fn restarted_peer(p: &str) {
    let engine = engine(p);
    let mut events = Events::of(&engine);
    let src = engine.register_copy(vec![5u8; 4096]).await.unwrap();

    let (_s1, store1, addr1) = store().await;
    let mut first = Peer::spawn(PEER, addr1, p, &["target", "--size", "4096"]);
    let old_desc = get(&store1, "target/desc").await;
    let old = engine.remote_region(&old_desc).await.unwrap();
    bounded("first write", engine.write(&src, 0, &old, 0, 4096)).await.unwrap();
    assert_eq!(events.next_about(old.peer()).await, PeerEvent::Up { peer: old.peer() });
    first.kill();

    // The restarted peer: a new process, a new address, new descriptors.
    let (_s2, store2, addr2) = store().await;
    let mut second = Peer::spawn(PEER, addr2, p, &["target", "--size", "4096", "--wait", "3=1"]);
    let new = engine.remote_region(&get(&store2, "target/desc").await).await.unwrap();
    assert_ne!(new.peer(), old.peer(), "{p}: a restarted peer is a new peer");
    assert_eq!(events.next_about(new.peer()).await, PeerEvent::Up { peer: new.peer() });
    bounded("write to the restarted peer", engine.write_imm(&src, 0, &new, 0, 4096, 3)).await.unwrap();
    let their_hash: u64 = get_str(&store2, "target/hash").await.parse().unwrap();
    assert_eq!(their_hash, hash(&[5u8; 4096]), "{p}");

    // The old incarnation's descriptor never writes anywhere: an error, typed.
    let e = bounded("write to the dead peer", engine.write(&src, 0, &old, 0, 64)).await.unwrap_err();
    assert!(matches!(e, Error::PeerUnreachable { .. } | Error::Completion { .. }), "{p}: {e}");
    // Once the transport said the peer died, its descriptors are refused as stale.
    assert!(matches!(events.next_about(old.peer()).await, PeerEvent::Down { .. }), "{p}");
    let e = engine.remote_region(&old_desc).await.unwrap_err();
    assert!(matches!(&e, Error::Stale { reason, .. } if reason.contains("gone")), "{p}: {e}");
    engine.remove_peer(old.peer()).await.unwrap();
    assert_eq!(events.next_about(old.peer()).await, PeerEvent::Removed { peer: old.peer() }, "{p}");
    let e = bounded("write to a removed peer", engine.write(&src, 0, &old, 0, 64)).await.unwrap_err();
    assert!(
        matches!(&e, Error::PeerUnreachable { message, .. } if message.contains("remove_peer")),
        "{p}: {e}"
    );
    engine.remove_peer(old.peer()).await.expect("removing twice is a no-op");
    let e = engine.remote_region(&old_desc).await.unwrap_err();
    assert!(matches!(&e, Error::Stale { reason, .. } if reason.contains("removed")), "{p}: {e}");
    let e = engine.remove_peer(PeerId(10_000)).await.unwrap_err();
    assert!(matches!(e, Error::UnknownPeer { peer: 10_000 }), "{p}: {e}");
    // The live one is untouched.
    bounded("write after", engine.write(&src, 0, &new, 0, 4096)).await.unwrap();
    // A late subscriber sees the current state: the restarted peer up, the removed one gone.
    let late: Vec<PeerEvent> = {
        let mut s = engine.peer_events();
        let mut v = Vec::new();
        while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(200), s.next()).await {
            v.push(e);
        }
        v
    };
    assert_eq!(late, vec![PeerEvent::Up { peer: new.peer() }], "{p}");
    store2.put("target/exit", vec![]).await.unwrap();
    assert!(second.wait_success(Duration::from_secs(20)).await, "{p}");
}

/// Two runs of a peer at one transport address (a restart that reused the port or the pid)
/// are told apart by their incarnations: an earlier one is refused as stale, a later one
/// replaces the peer we knew, which goes down. Addresses and descriptors are rewritten here
/// to stand for those runs; the bytes go to the one real peer process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incarnations_tell_runs_at_one_address_apart() {
    let p = integration_tests::primary();
    if p.starts_with("verbs") {
        // A second set of queue pairs to the same peer engine would need its side of the
        // handshake; the rule is the engine's, the same on every transport.
        skipped("incarnations_tell_runs_at_one_address_apart", "runs on the libfabric providers");
        return;
    }
    let (_s, store, addr) = store().await;
    let mut peer = Peer::spawn(PEER, addr, &p, &["target", "--size", "4096", "--wait", "4=1"]);
    let engine = engine(&p);
    let mut events = Events::of(&engine);
    let src = engine.register_copy(vec![6u8; 4096]).await.unwrap();
    let desc_bytes = get(&store, "target/desc").await;
    let first = engine.remote_region(&desc_bytes).await.unwrap();
    assert_eq!(events.next_about(first.peer()).await, PeerEvent::Up { peer: first.peer() });

    let addr = fabric_runtime::EngineAddress::from_bytes(&get(&store, "target/addr").await).unwrap();
    assert_ne!(addr.incarnation, 0, "an engine has an incarnation");
    let with = |incarnation: u64| fabric_runtime::EngineAddress { incarnation, ..addr.clone() }.to_bytes();
    assert_eq!(engine.add_peer(&with(addr.incarnation)).await.unwrap(), first.peer(), "same run, same peer");
    let e = engine.add_peer(&with(addr.incarnation - 1)).await.unwrap_err();
    assert!(matches!(&e, Error::Stale { reason, .. } if reason.contains("earlier incarnation")), "{p}: {e}");

    // A later run at the same address: the peer we knew is gone.
    let mut later = fabric_runtime::RegionDescriptor::from_bytes(&desc_bytes).unwrap();
    later.incarnation += 1;
    let second = engine.remote_region(&later.to_bytes()).await.unwrap();
    assert_ne!(second.peer(), first.peer(), "{p}: a later run is a new peer");
    match events.next_about(first.peer()).await {
        PeerEvent::Down { reason, .. } => assert!(reason.contains("later incarnation"), "{reason}"),
        other => panic!("{p}: expected Down, got {other:?}"),
    }
    let e = bounded("write to the replaced peer", engine.write(&src, 0, &first, 0, 64)).await.unwrap_err();
    assert!(matches!(e, Error::PeerUnreachable { .. }), "{p}: {e}");
    let e = engine.remote_region(&desc_bytes).await.unwrap_err();
    assert!(matches!(&e, Error::Stale { reason, .. } if reason.contains("earlier incarnation")), "{p}: {e}");
    // Through the later run's descriptor, bytes land.
    bounded("write to the later run", engine.write_imm(&src, 0, &second, 0, 4096, 4)).await.unwrap();
    let their_hash: u64 = get_str(&store, "target/hash").await.parse().unwrap();
    assert_eq!(their_hash, hash(&[6u8; 4096]), "{p}");
    store.put("target/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await, "{p}");
}
