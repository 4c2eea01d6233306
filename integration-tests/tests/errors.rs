//! Bad input gets a clear, typed error, and never a panic or a hang.

use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, Error, MemoryLocation, PeerId, RegionDescriptor, Side};
use integration_tests::{get, other_than, primary, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

/// Every call below must answer quickly; a hang fails the test instead of stalling CI.
async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("answered within 30 s")
}

async fn pair(provider: &str) -> (Engine, Engine) {
    let a = Engine::builder().provider(provider).build().expect("engine a");
    let b = Engine::builder().provider(provider).build().expect("engine b");
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_on_either_side() {
    let (a, b) = pair(&primary()).await;
    let src = a.alloc(4096).await.unwrap();
    let theirs = b.alloc(1000).await.unwrap();
    let dst = a.remote_region(&theirs.descriptor().to_bytes()).await.unwrap();
    let e = bounded(a.write(&src, 4000, &dst, 0, 200)).await.unwrap_err();
    assert!(
        matches!(e, Error::OutOfBounds { side: Side::Local, offset: 4000, len: 200, region_len: 4096 }),
        "{e}"
    );
    let e = bounded(a.write_imm(&src, 0, &dst, 900, 101, 1)).await.unwrap_err();
    assert!(
        matches!(e, Error::OutOfBounds { side: Side::Remote, offset: 900, len: 101, region_len: 1000 }),
        "{e}"
    );
    let e = bounded(a.read(&src, 0, &dst, u64::MAX, 2)).await.unwrap_err();
    assert!(
        matches!(e, Error::OutOfBounds { side: Side::Remote, .. }),
        "overflowing offsets are caught: {e}"
    );
    let e = src.write_at(4095, &[1, 2]).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { side: Side::Local, .. }));
    // Exactly at the edge is fine.
    bounded(a.write(&src, 3096, &dst, 0, 1000)).await.expect("in-bounds write");
    // A remote region resolved by another engine is refused (its peer id means nothing here).
    let b_view = b.remote_region(&src.descriptor().to_bytes()).await.unwrap();
    let e = bounded(a.write(&src, 0, &b_view, 0, 8)).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_peer_and_oversized_message() {
    let (a, b) = pair(&primary()).await;
    let e = bounded(a.send(PeerId(42), b"hello")).await.unwrap_err();
    assert!(matches!(e, Error::UnknownPeer { peer: 42 }), "{e}");
    let p = a.add_peer(&b.address()).await.unwrap();
    assert_eq!(a.add_peer(&b.address()).await.unwrap(), p, "same address, same id");
    let big = vec![0u8; a.max_msg_size() + 1];
    let e = bounded(a.send(p, &big)).await.unwrap_err();
    assert!(matches!(e, Error::MessageTooLarge { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_foreign_descriptors_and_addresses() {
    let p = primary();
    let tcp = Engine::builder().provider(p.as_str()).build().unwrap();
    let shm = Engine::builder().provider(other_than(&p)).build().unwrap();
    let region = shm.alloc(4096).await.unwrap();
    let good = region.descriptor().to_bytes();

    let e = tcp.remote_region(b"definitely not a descriptor").await.unwrap_err();
    assert!(matches!(e, Error::Malformed { .. }), "{e}");
    let e = tcp.remote_region(&good[..good.len() - 3]).await.unwrap_err();
    assert!(matches!(e, Error::Malformed { .. }), "truncated: {e}");
    let e = tcp.remote_region(&good).await.unwrap_err();
    assert!(matches!(e, Error::Foreign { .. }), "another transport's descriptor: {e}");
    let e = tcp.add_peer(&shm.address()).await.unwrap_err();
    assert!(matches!(e, Error::Foreign { .. }), "another transport's address: {e}");
    let e = tcp.add_peer(&[0xff; 7]).await.unwrap_err();
    assert!(matches!(e, Error::Malformed { .. }), "{e}");
    // An address is not a descriptor.
    let e = tcp.remote_region(&tcp.address()).await.unwrap_err();
    assert!(matches!(e, Error::Malformed { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_provider_and_bad_config() {
    let e = Engine::builder().provider("no-such-provider").build().unwrap_err();
    assert!(matches!(e, Error::ProviderNotFound { .. }), "{e}");
    let e = Engine::builder().messages(0, 8).build().unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    let a = Engine::builder().provider(primary()).build().unwrap();
    let e = a.register_copy(Vec::new()).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    let e = a.alloc_in(4096, MemoryLocation::Cuda { ordinal: 0 }).await.unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
}

/// A bad key fails that operation with a typed error and leaves the peer up
/// (`docs/faults.md`): tcp's provider closes the connection that carried it
/// (`ConnectionLost`), verbs' NIC refuses it (`RemoteAccess`) and the queue pair is set up
/// again, shm's owner does not vouch for it (`remote_region` fails with `RemoteAccess`);
/// later operations of the same engine to the same peer succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_remote_key_fails_that_operation_and_the_peer_stays_up() {
    let (_server, store, addr) = store().await;
    let mut peer = Peer::spawn(PEER, addr, &primary(), &["target", "--size", "4096", "--wait", "9=1"]);
    let a = Engine::builder().provider(primary()).build().unwrap();
    let src = a.alloc(4096).await.unwrap();
    let good = get(&store, "target/desc").await;
    let mut desc = RegionDescriptor::from_bytes(&good).unwrap();
    desc.domains[0].key ^= 0x5a5a_0000;
    match bounded(a.remote_region(&desc.to_bytes())).await {
        Err(Error::RemoteAccess { op: "descriptor", message, .. }) if primary() == "shm" => {
            assert!(message.contains("does not know this key"), "{message}")
        }
        Err(e) => panic!("remote_region of a forged descriptor: {e}"),
        Ok(_) if primary() == "shm" => panic!("shm: the owner vouched for a forged key"),
        Ok(forged) => {
            let e = bounded(a.write(&src, 0, &forged, 0, 64)).await.unwrap_err();
            match &e {
                Error::ConnectionLost { op: "write", message, .. }
                | Error::RemoteAccess { op: "write", message, .. } => {
                    assert!(!message.is_empty())
                }
                other => panic!("expected ConnectionLost or RemoteAccess, got {other}"),
            }
            if primary().starts_with("verbs") {
                assert!(matches!(e, Error::RemoteAccess { .. }), "verbs: a remote access error: {e}");
            }
            if let Err(e) = bounded(a.imm(&forged, 9)).await {
                assert!(matches!(e, Error::ConnectionLost { .. } | Error::RemoteAccess { .. }), "{e}");
            }
        }
    }
    // The same engine still reaches the target, through its real descriptor.
    let real = a.remote_region(&good).await.unwrap();
    bounded(a.write_imm(&src, 0, &real, 0, 64, 9)).await.expect("a good write after the bad ones");
    get(&store, "target/hash").await;
    // And it still serves its other peers.
    let b = Engine::builder().provider(primary()).build().unwrap();
    let theirs = b.alloc(4096).await.unwrap();
    let other = a.remote_region(&theirs.descriptor().to_bytes()).await.unwrap();
    bounded(a.write(&src, 0, &other, 0, 4096)).await.expect("another peer still works");
    store.put("target/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}

/// A bad key among many writes in flight to one peer: every operation resolves, each with
/// success or a typed error (never a hang, never an untyped one): the bad one is refused
/// (`RemoteAccess`) or lost with the connection it broke (`ConnectionLost`), and so may the
/// writes that shared that connection (tcp) or queue pair (verbs); none makes the peer
/// down, and a later operation to it succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_in_flight_behind_a_bad_key_get_typed_errors() {
    let (_server, store, addr) = store().await;
    let mut peer = Peer::spawn(PEER, addr, &primary(), &["target", "--size", "1048576"]);
    let a = Engine::builder().provider(primary()).build().unwrap();
    let src = a.alloc(1 << 20).await.unwrap();
    let good_desc = get(&store, "target/desc").await;
    let good = a.remote_region(&good_desc).await.unwrap();
    bounded(a.write(&src, 0, &good, 0, 4096)).await.expect("a first good write connects");
    let mut desc = RegionDescriptor::from_bytes(&good_desc).unwrap();
    desc.domains[0].key ^= 0x5a5a_0000;
    let forged = match bounded(a.remote_region(&desc.to_bytes())).await {
        Ok(forged) => forged,
        Err(Error::RemoteAccess { op: "descriptor", .. }) if primary() == "shm" => {
            // shm: the owner does not vouch for the forged key, so nothing can be posted
            // through it; the good writes still go through.
            let writes = (0..32u64).map(|i| a.write(&src, i * 16384, &good, i * 16384, 16384));
            for r in bounded(futures::future::join_all(writes)).await {
                r.expect("a good write");
            }
            store.put("target/exit", vec![]).await.unwrap();
            assert!(peer.wait_success(Duration::from_secs(20)).await);
            return;
        }
        Err(e) => panic!("remote_region of a forged descriptor: {e}"),
    };
    let mut writes = vec![a.write(&src, 0, &good, 0, 4096), a.write(&src, 0, &forged, 0, 4096)];
    writes.extend((1..=32u64).map(|i| a.write(&src, i * 16384, &good, i * 16384, 16384)));
    let results = bounded(futures::future::join_all(writes)).await;
    let typed = |r: &Result<(), Error>| {
        matches!(r, Ok(()) | Err(Error::ConnectionLost { .. } | Error::RemoteAccess { .. }))
    };
    assert!(results.iter().all(typed), "{results:?}");
    assert!(results[1].is_err(), "the bad key is reported: {:?}", results[1]);
    if primary().starts_with("verbs") {
        // The bad write kills the RC queue pair: the writes queued behind it on that queue
        // pair fail as `ConnectionLost` naming the first cause, or succeed if they were
        // posted on the re-established one.
        assert!(matches!(results[1], Err(Error::RemoteAccess { .. })), "{:?}", results[1]);
        for (i, r) in results.iter().enumerate().skip(2) {
            match r {
                Ok(()) => {}
                Err(Error::ConnectionLost { message, .. }) => {
                    assert!(message.contains("remote access"), "names the first cause: {message}")
                }
                other => panic!("write {i} behind the bad key: {other:?}"),
            }
        }
    }
    bounded(a.imm(&good, 1)).await.expect("the peer is not marked down");
    store.put("target/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_peer_is_an_error_not_a_hang() {
    let (_server, store, addr) = store().await;
    let mut peer = Peer::spawn(PEER, addr, &primary(), &["target", "--size", "4096"]);
    let a = Engine::builder().provider(primary()).op_timeout(Some(Duration::from_secs(2))).build().unwrap();
    let src = a.alloc(4096).await.unwrap();
    let dst = a.remote_region(&get(&store, "target/desc").await).await.unwrap();
    peer.kill();
    let e = bounded(a.write_imm(&src, 0, &dst, 0, 64, 1)).await.unwrap_err();
    assert!(matches!(e, Error::PeerUnreachable { .. } | Error::Completion { .. }), "{e}");
    // Later operations to the dead peer fail fast too.
    let t = std::time::Instant::now();
    let e = bounded(a.imm(&dst, 1)).await.unwrap_err();
    assert!(matches!(e, Error::PeerUnreachable { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1), "a failed peer fails fast");
    // Both failures are in the statistics (the first may still be held by the provider).
    let s = a.stats();
    let p = s.peer(dst.peer()).expect("the dead peer's entry");
    assert!(p.errors >= 2 && p.completed_ops == 0 && p.posted_ops <= 2, "{s}");
    assert_eq!(s.nics[0].errors, p.errors, "{s}");
    // The engine still serves others.
    let b = Engine::builder().provider(primary()).build().unwrap();
    let theirs = b.alloc(4096).await.unwrap();
    let other = a.remote_region(&theirs.descriptor().to_bytes()).await.unwrap();
    bounded(a.write(&src, 0, &other, 0, 4096)).await.expect("another peer still works");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_after_shutdown_fail_cleanly() {
    let (a, b) = pair(&primary()).await;
    let src = a.alloc(4096).await.unwrap();
    let theirs = b.alloc(4096).await.unwrap();
    let dst = a.remote_region(&theirs.descriptor().to_bytes()).await.unwrap();
    let recv = tokio::spawn({
        let a = a.clone();
        async move { a.recv().await }
    });
    let counter = a.imm_counter(5);
    let wait = tokio::spawn(async move { counter.wait_for(1).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    a.shutdown();
    // At once, before the reactor thread has closed anything: a small registration, which
    // would run on this thread, is refused too.
    let e = a.register_copy(vec![1; 4096]).await.unwrap_err();
    assert!(matches!(e, Error::Shutdown), "{e}");
    let r = bounded(wait).await.unwrap();
    assert!(matches!(r, Err(Error::Shutdown)), "a pending counter wait is released: {r:?}");
    let r = bounded(a.imm_counter(6).wait_for(1)).await;
    assert!(matches!(r, Err(Error::Shutdown)), "and so is a new one");
    let e = bounded(a.write(&src, 0, &dst, 0, 64)).await.unwrap_err();
    assert!(matches!(e, Error::Shutdown), "{e}");
    let e = a.alloc(4096).await.unwrap_err();
    assert!(matches!(e, Error::Shutdown), "{e}");
    let r = bounded(recv).await.unwrap();
    assert!(matches!(r, Err(Error::Shutdown)), "a pending recv is told");
    // Regions outliving their engine are freed safely.
    drop(a);
    drop(src);
}
