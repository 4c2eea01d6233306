//! `Engine::recv_from(peer)`: the next message of one peer, which fails when that peer is
//! gone instead of waiting for a message that will not come.
//!
//! Three engines of this process (a receiver and two senders) check the filter in every
//! reactor mode and with spinning and lingering awaits: another peer's message is neither
//! taken nor lost, a pending `recv_from` is not the one woken for another peer's message,
//! `remove_peer` fails the waits on that peer, and an id never given is `UnknownPeer`. A
//! `fabric-peer` process left idle for seconds stays up (its pending `recv_from` waits on),
//! and killed with SIGKILL, with nothing posted to it, fails that `recv_from` with
//! `PeerUnreachable` within a bound (the time is printed, `--nocapture`). Provider-generic:
//! on the suite's providers (`FABRIC_TEST_PROVIDERS`; verbs in the rxe VM).

use std::time::{Duration, Instant};

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, EngineBuilder, Error, PeerId, ReactorMode};
use integration_tests::{get, get_str, primary, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
/// Any one wait of these tests.
const BOUND: Duration = Duration::from_secs(20);
/// How long a live peer stays idle, and up, before it is killed.
const IDLE: Duration = Duration::from_secs(3);
/// An idle peer killed with SIGKILL is found dead within this (a correctness bound: tcp and
/// shm take milliseconds, verbs about half a second, docs/faults.md).
const DETECT_BOUND: Duration = Duration::from_secs(5);

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f).await.unwrap_or_else(|_| panic!("{what}: nothing within {BOUND:?}"))
}

/// A receiver `t` and two senders `a` and `b`, each a peer of `t` and `t` of each.
struct Three {
    t: Engine,
    a: Engine,
    b: Engine,
    /// `a` and `b` as peers of `t`.
    a_id: PeerId,
    b_id: PeerId,
    /// `t` as a peer of `a` and of `b`.
    t_at_a: PeerId,
    t_at_b: PeerId,
}

async fn three(builder: impl Fn() -> EngineBuilder) -> Three {
    let (t, a, b) = (builder().build().unwrap(), builder().build().unwrap(), builder().build().unwrap());
    let a_id = t.add_peer(&a.address()).await.unwrap();
    let b_id = t.add_peer(&b.address()).await.unwrap();
    let t_at_a = a.add_peer(&t.address()).await.unwrap();
    let t_at_b = b.add_peer(&t.address()).await.unwrap();
    Three { t, a, b, a_id, b_id, t_at_a, t_at_b }
}

async fn filter_in(what: &str, builder: impl Fn() -> EngineBuilder) {
    let x = three(builder).await;
    let (t, a_id, b_id) = (&x.t, x.a_id, x.b_id);

    // A message of a is not taken by recv_from(b), and stays for recv_from(a).
    bounded("send", x.a.send(x.t_at_a, b"a1")).await.unwrap();
    let waited = tokio::time::timeout(Duration::from_millis(300), t.recv_from(b_id)).await;
    assert!(waited.is_err(), "{what}: recv_from(b) took {waited:?}");
    let (from, m) = bounded("recv_from(a)", t.recv_from(a_id)).await.unwrap();
    assert_eq!((from, &m[..]), (Some(a_id), &b"a1"[..]), "{what}");

    // Both arrived: recv_from(a) takes a's, recv() what is left (b's).
    bounded("send", x.b.send(x.t_at_b, b"b1")).await.unwrap();
    bounded("send", x.a.send(x.t_at_a, b"a2")).await.unwrap();
    let (from, m) = bounded("recv_from(a)", t.recv_from(a_id)).await.unwrap();
    assert_eq!((from, &m[..]), (Some(a_id), &b"a2"[..]), "{what}");
    let (from, m) = bounded("recv", t.recv()).await.unwrap();
    assert_eq!((from, &m[..]), (Some(b_id), &b"b1"[..]), "{what}");

    // A pending recv_from(b), registered first, is not the waiter a's message wakes: the
    // recv() after it gets it. Then b's message ends the recv_from(b).
    let waiting_b = tokio::spawn(bounded("pending recv_from(b)", t.recv_from(b_id)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    bounded("send", x.a.send(x.t_at_a, b"a3")).await.unwrap();
    let (from, m) = bounded("recv behind a pending recv_from(b)", t.recv()).await.unwrap();
    assert_eq!((from, &m[..]), (Some(a_id), &b"a3"[..]), "{what}");
    assert!(!waiting_b.is_finished(), "{what}: recv_from(b) ended without a message of b");
    bounded("send", x.b.send(x.t_at_b, b"b2")).await.unwrap();
    let (from, m) = bounded("join", waiting_b).await.unwrap().unwrap();
    assert_eq!((from, &m[..]), (Some(b_id), &b"b2"[..]), "{what}");

    // A dropped recv_from consumes nothing.
    bounded("send", x.b.send(x.t_at_b, b"b3")).await.unwrap();
    drop(t.recv_from(b_id));
    let (_, m) = bounded("recv_from(b) after a dropped one", t.recv_from(b_id)).await.unwrap();
    assert_eq!(&m[..], b"b3", "{what}");

    // An id never given.
    let e = bounded("unknown", t.recv_from(PeerId(99))).await.unwrap_err();
    assert!(matches!(e, Error::UnknownPeer { peer: 99 }), "{what}: {e}");

    // remove_peer fails a pending recv_from of that peer (the reactor wakes it), and later
    // ones at once; the other peer is untouched.
    let waiting_b = tokio::spawn(bounded("pending recv_from(b)", t.recv_from(b_id)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    bounded("remove", t.remove_peer(b_id)).await.unwrap();
    let e = bounded("join", waiting_b).await.unwrap().unwrap_err();
    assert!(
        matches!(&e, Error::PeerUnreachable { peer, message } if *peer == b_id.0 && message.contains("remove_peer")),
        "{what}: {e}"
    );
    let e = bounded("recv_from a removed peer", t.recv_from(b_id)).await.unwrap_err();
    assert!(matches!(e, Error::PeerUnreachable { .. }), "{what}: {e}");
    bounded("send", x.a.send(x.t_at_a, b"a4")).await.unwrap();
    let (_, m) = bounded("recv_from(a) after b's removal", t.recv_from(a_id)).await.unwrap();
    assert_eq!(&m[..], b"a4", "{what}");

    // Shutdown: a pending recv_from ends with Shutdown.
    let waiting_a = tokio::spawn(bounded("pending recv_from(a)", t.recv_from(a_id)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    t.shutdown();
    let e = bounded("join", waiting_a).await.unwrap().unwrap_err();
    assert!(matches!(e, Error::Shutdown), "{what}: {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_from_takes_only_its_peers_messages_in_every_mode() {
    let p = primary();
    let ms = Duration::from_millis;
    let base = || Engine::builder().provider(&p).await_linger(Duration::ZERO);
    filter_in(&format!("{p} Event"), || base().mode(ReactorMode::Event)).await;
    filter_in(&format!("{p} Adaptive"), || base().mode(ReactorMode::Adaptive { spin: ms(1) })).await;
    filter_in(&format!("{p} BusyPoll"), || base().mode(ReactorMode::BusyPoll)).await;
    filter_in(&format!("{p} Inline"), || base().mode(ReactorMode::Inline)).await;
    filter_in(&format!("{p} Event, await_spin"), || base().await_spin(ms(1))).await;
    filter_in(&format!("{p} Event, await_linger"), || {
        Engine::builder().provider(&p).mode(ReactorMode::Event).await_linger(ms(1))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_from_a_killed_peer_fails() {
    for p in providers() {
        let (_server, store, addr) = store().await;
        let engine = Engine::builder().provider(p.as_str()).build().expect("engine");
        store.put("test/addr", engine.address()).await.unwrap();
        let mut peer = Peer::spawn(PEER, addr, &p, &["echo", "--count", "1000"]);
        let id = engine.add_peer(&get(&store, "echo/addr").await).await.expect("add peer");
        assert_eq!(get_str(&store, "echo/ready").await, "ok");
        bounded("send", engine.send(id, b"ping")).await.unwrap();
        let (_, m) = bounded("echo", engine.recv_from(id)).await.unwrap();
        assert_eq!(&m[..], b"ping", "{p}");

        let waiting = tokio::spawn(bounded("recv_from the killed peer", engine.recv_from(id)));
        // Nothing goes either way now: a healthy idle peer stays up (on verbs its keep-alive
        // probes are answered), so the wait stays pending.
        tokio::time::sleep(IDLE).await;
        assert!(!waiting.is_finished(), "{p}: recv_from of a live idle peer ended: {:?}", waiting.await);
        let killed = Instant::now();
        peer.kill();
        // Nothing is posted to the dead peer: its transport's liveness watch finds it (verbs:
        // a keep-alive probe, docs/faults.md).
        let e = bounded("join", waiting).await.unwrap().unwrap_err();
        let took = killed.elapsed();
        println!("{p}: recv_from of a peer killed with SIGKILL failed {took:?} after the kill: {e}");
        assert!(matches!(&e, Error::PeerUnreachable { peer, .. } if *peer == id.0), "{p}: {e}");
        assert!(took < DETECT_BOUND, "{p}: the idle dead peer was found after {took:?}");
        let e = bounded("recv_from after", engine.recv_from(id)).await.unwrap_err();
        assert!(matches!(e, Error::PeerUnreachable { .. }), "{p}: {e}");
    }
}
