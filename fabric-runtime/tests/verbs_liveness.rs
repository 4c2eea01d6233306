//! Liveness of the verbs backend against a real RDMA device (two `VerbsDomain`s in one
//! process, loopback RC QPs, as in `verbs_backend.rs`): keep-alive probes find an idle dead
//! peer and leave an idle live one alone; a peer revived through `Domain::revive_peer` comes
//! back once it answers the handshake, and one that does not answer fails within
//! `VerbsConfig::revive_timeout`. Needs an RDMA device (the VM of `scripts/rxe-vm.sh`);
//! without one every test prints a `SKIPPED` line and passes.
#![cfg(feature = "verbs")]

use std::time::{Duration, Instant};

use fabric_runtime::provider::verbs::{VerbsConfig, VerbsDomain};
use fabric_runtime::provider::{Completion, Domain, Op, PostError, Revival};
use fabric_runtime::Error;

mod verbs_util;
use verbs_util::*;

/// Polls `d` alone for `how_long` (nothing posted), its completions into `got`.
fn idle(d: &mut VerbsDomain, got: &mut Vec<Completion>, how_long: Duration) {
    let start = Instant::now();
    while start.elapsed() < how_long {
        d.flush();
        d.poll(got, 64).expect("poll");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Keep-alive: a healthy peer that nothing is posted to stays up for seconds (whether or not
/// its own domain is polled: its NIC answers the probes), and the probes do flow: zero-length
/// writes with no rkey are acknowledged by the peer's NIC, never refused (a refusal would
/// re-establish the connection: the epoch would go up).
#[test]
fn an_idle_healthy_peer_is_probed_and_stays_up() {
    let _device = shared();
    let Some(mut a) = open() else { return };
    let Some(mut c) = open() else { return };
    let abuf = Buf::new(&mut a, 4096);
    let cbuf = Buf::new(&mut c, 4096);
    let hc = a.add_peer(&c.address()).expect("add c");
    let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
    let mut got = vec![Vec::new(), Vec::new()];
    let op = Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None };
    post(ds, &mut got, 0, 1, op);
    pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 1 }));
    // Both polled, then `c` busy elsewhere (not polled): 1.5 s each, nothing posted.
    let t = Instant::now();
    pump(ds, &mut got, |_| t.elapsed() > Duration::from_millis(1500));
    let both = ds[0].keepalive_probes(hc).expect("peer");
    let [a, c] = ds else { unreachable!() };
    idle(a, &mut got[0], Duration::from_millis(1500));
    let alone = a.keepalive_probes(hc).expect("peer") - both;
    eprintln!(
        "keep-alive probes acknowledged: {both} in 1.5 s, then {alone} in 1.5 s with the peer not polled"
    );
    let bad = |g: &Vec<Completion>| {
        g.iter().filter(|c| matches!(c, Completion::Failed { .. } | Completion::PeerDown { .. })).count()
    };
    assert_eq!(bad(&got[0]) + bad(&got[1]), 0, "{got:?}");
    assert!(a.is_connected(hc) && c.is_connected(0), "the idle peer went down");
    assert_eq!(a.connection_epoch(hc), Some(0), "a probe was refused: the connection was re-established");
    // 100 ms idle before each probe: ~7-15 in 1.5 s; at least a few even on a slow VM.
    assert!(both >= 3 && alone >= 3, "probes: {both}, {alone}");
    // And the connection still carries writes.
    let data = pattern(9, 64);
    abuf.fill(0, &data);
    let ds: &mut [&mut VerbsDomain] = &mut [a, c];
    post(
        ds,
        &mut got,
        0,
        2,
        Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None },
    );
    pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 2 }));
    assert_eq!(cbuf.bytes(0, 64), data);
}

/// Keep-alive: a peer whose QPs are gone (its domain dropped, as when its process is
/// killed) while nothing is posted to it is reported `PeerDown` within a bound, and a post
/// to it then fails `PeerUnreachable`. Without keep-alive nothing finds it.
#[test]
fn an_idle_dead_peer_is_reported_down() {
    let _device = shared();
    for keepalive in [Some(Duration::from_millis(100)), None] {
        let Some(mut a) = open_with(VerbsConfig { keepalive, ..VerbsConfig::default() }) else { return };
        let Some(mut c) = open() else { return };
        let abuf = Buf::new(&mut a, 4096);
        let cbuf = Buf::new(&mut c, 4096);
        let hc = a.add_peer(&c.address()).expect("add c");
        let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
        let mut got = vec![Vec::new(), Vec::new()];
        let op = Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None };
        post(ds, &mut got, 0, 1, op);
        pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 1 }));
        drop(c);
        let killed = Instant::now();
        let down = |g: &Vec<Completion>| {
            g.iter().any(|c| matches!(c, Completion::PeerDown { peer, .. } if *peer == hc))
        };
        let mut got = Vec::new();
        let bound = Duration::from_secs(5);
        match keepalive {
            Some(_) => {
                while !down(&got) {
                    a.flush();
                    a.poll(&mut got, 64).expect("poll");
                    assert!(killed.elapsed() < bound, "not down within {bound:?}: {got:?}");
                    std::thread::sleep(Duration::from_millis(2));
                }
                eprintln!("idle dead peer down after {:?}: {got:?}", killed.elapsed());
                assert!(!a.is_connected(hc));
                // SAFETY: leaked, registered memory.
                match unsafe { a.post(2, &op) } {
                    Err(PostError::Failed(Error::PeerUnreachable { message, .. })) => {
                        assert!(message.contains("keep-alive"), "{message}")
                    }
                    other => panic!("{other:?}"),
                }
            }
            None => {
                idle(&mut a, &mut got, Duration::from_millis(1500));
                assert!(!down(&got) && a.is_connected(hc), "{got:?}");
                assert_eq!(a.keepalive_probes(hc), Some(0));
            }
        }
    }
}

/// Polls both domains until `a`'s revival of `peer` is settled (bounded by LIMIT).
fn settle(a: &mut VerbsDomain, c: Option<&mut VerbsDomain>, peer: u64, got: &mut Vec<Completion>) -> Revival {
    let start = Instant::now();
    let mut c = c;
    loop {
        for d in [Some(&mut *a), c.as_deref_mut()].into_iter().flatten() {
            d.flush();
            d.poll(got, 64).expect("poll");
        }
        match a.revival(peer) {
            Revival::Pending => {}
            settled => return settled,
        }
        assert!(start.elapsed() < LIMIT, "a revival still pending after {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `Domain::revive_peer` and `Domain::revival`, the engine's revival of a peer it marked
/// down: started at once whatever the connection's state (here connected, as when only the
/// engine's `op_timeout` marked the peer down), `Pending` until the peer's domain answers the
/// handshake. A peer whose domain is not polled (its process stopped: its NIC would still
/// acknowledge writes) fails within `revive_timeout`, with no `PeerDown`; polled again, it
/// comes back (`Up`, the next epoch, writes land); a peer whose domain is gone fails too.
#[test]
fn a_revived_peer_comes_back_only_if_it_answers_within_the_bound() {
    let _device = shared();
    let bound = Duration::from_millis(500);
    let cfg = VerbsConfig { revive_timeout: bound, ..VerbsConfig::default() };
    let Some(mut a) = open_with(cfg) else { return };
    let Some(mut c) = open() else { return };
    let abuf = Buf::new(&mut a, 4096);
    let cbuf = Buf::new(&mut c, 4096);
    let hc = a.add_peer(&c.address()).expect("add c");
    let op = || Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None };
    let mut got = vec![Vec::new(), Vec::new()];
    {
        let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
        post(ds, &mut got, 0, 1, op());
        pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 1 }));
    }
    let epoch = a.connection_epoch(hc).expect("peer");

    // `c` is not polled: its "process" does not answer.
    let t = Instant::now();
    a.revive_peer(hc).expect("a revival starts");
    // (A revival that waited for its answer would take the whole bound; half of it leaves a
    // loaded VM room.)
    assert!(t.elapsed() < bound / 2, "revive_peer waited: {:?}", t.elapsed());
    assert!(matches!(a.revival(hc), Revival::Pending));
    let mut mine = Vec::new();
    let failed = settle(&mut a, None, hc, &mut mine);
    let took = t.elapsed();
    eprintln!("an unanswered revival failed after {took:?}: {failed:?}");
    match failed {
        Revival::Failed(Error::PeerUnreachable { message, .. }) => {
            assert!(message.contains("no answer"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(took >= bound && took < bound + Duration::from_secs(1), "failed after {took:?}");
    assert!(!a.is_connected(hc));
    assert!(!mine.iter().any(|c| matches!(c, Completion::PeerDown { .. })), "{mine:?}");
    // SAFETY: leaked, registered memory.
    assert!(matches!(unsafe { a.post(2, &op()) }, Err(PostError::Failed(Error::PeerUnreachable { .. }))));

    // `c` runs again (it answers the stale REQs; `a` ignores those REPs: the peer is failed)
    // and `a` revives it again: up.
    {
        let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
        let t = Instant::now();
        pump(ds, &mut got, |_| t.elapsed() > Duration::from_millis(300));
    }
    assert!(!a.is_connected(hc));
    let t = Instant::now();
    a.revive_peer(hc).expect("a revival starts");
    let up = settle(&mut a, Some(&mut c), hc, &mut got[0]);
    eprintln!("an answered revival was up after {:?}", t.elapsed());
    assert!(matches!(up, Revival::Up), "{up:?}");
    assert!(a.is_connected(hc));
    assert!(a.connection_epoch(hc).expect("peer") > epoch);
    let data = pattern(5, 64);
    abuf.fill(0, &data);
    {
        let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
        post(ds, &mut got, 0, 3, op());
        pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 3 }));
    }
    assert_eq!(cbuf.bytes(0, 64), data);

    // Gone (its domain dropped, as when its process is killed): the revival fails too.
    drop(c);
    let t = Instant::now();
    a.revive_peer(hc).expect("a revival starts");
    let gone = settle(&mut a, None, hc, &mut got[0]);
    eprintln!("a dead peer's revival failed after {:?}", t.elapsed());
    assert!(matches!(gone, Revival::Failed(Error::PeerUnreachable { .. })), "{gone:?}");
}
