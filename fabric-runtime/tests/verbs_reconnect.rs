//! Faults on a verbs connection against a real RDMA device (two `VerbsDomain`s in one
//! process, loopback RC QPs, as in `verbs_backend.rs`): a bad remote access fails that
//! operation only and the RC connection is re-established; work behind it, or chained during
//! the reconnection, is accounted for; a failed peer that answers again is revived. Needs an
//! RDMA device (the VM of `scripts/rxe-vm.sh`); without one every test prints a `SKIPPED` line
//! and passes.
#![cfg(feature = "verbs")]

use std::time::{Duration, Instant};

use fabric_runtime::provider::verbs::{VerbsConfig, VerbsDomain};
use fabric_runtime::provider::{Completion, Domain, FailCause, MemoryLocation, Op, PostError, RemoteSlice};
use fabric_runtime::Error;

mod verbs_util;
use verbs_util::*;

/// A bad remote access (a forged key, the key of a dropped region) fails that
/// operation only, promptly, as a remote access error; the RC connection is re-established
/// (both sides replace the QP) and later operations to the peer's live regions succeed, on
/// both sides, with immediates counted once. Three rounds of write, write with immediate and
/// read through each kind of bad descriptor.
#[test]
fn bad_remote_access_fails_that_operation_only_and_the_connection_is_re_established() {
    let _device = alone();
    let Some(mut a) = open() else { return };
    let Some(mut c) = open() else { return };
    let abuf = Buf::new(&mut a, 65536);
    let cbuf = Buf::new(&mut c, 65536);
    // A region of `c` that is dropped: its descriptor is stale.
    let dropped = {
        let v: &'static mut [u8] = Box::leak(vec![0u8; 4096].into_boxed_slice());
        // SAFETY: leaked memory, valid for the process.
        let reg = unsafe { c.register(v.as_mut_ptr() as u64, 4096, MemoryLocation::Host) }.expect("register");
        let r = RemoteSlice { addr: reg.remote_base, key: reg.remote_key };
        c.deregister(reg);
        r
    };
    let hc = a.add_peer(&c.address()).expect("add c");
    let ha = c.add_peer(&a.address()).expect("add a");
    let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
    let mut got = vec![Vec::new(), Vec::new()];
    let forged = RemoteSlice { addr: cbuf.base, key: cbuf.key ^ 0x5a00 };
    let mut token = 1000u64;
    let mut imm_sent = Vec::new();
    let (mut fail_times, mut reconnect_times) = (Vec::new(), Vec::new());
    for round in 0..3u8 {
        for (what, bad) in [("forged key", forged), ("dropped region", dropped)] {
            for kind in ["write", "write_imm", "read"] {
                let local = abuf.slice(0, 256);
                let op = match kind {
                    "write" => Op::Write { peer: hc, local, remote: bad, imm: None },
                    "write_imm" => {
                        Op::Write { peer: hc, local, remote: bad, imm: Some(0xbad0_0000 | token as u32) }
                    }
                    _ => Op::Read { peer: hc, local, remote: bad },
                };
                token += 1;
                let bad_token = token;
                post(ds, &mut got, 0, bad_token, op);
                let t0 = Instant::now();
                pump(ds, &mut got, |g| {
                    g[0].iter().any(|c| matches!(c, Completion::Failed { token: t, .. } if *t == bad_token))
                });
                let failed_in = t0.elapsed();
                match got[0]
                    .iter()
                    .find(|c| matches!(c, Completion::Failed { token: t, .. } if *t == bad_token))
                {
                    Some(Completion::Failed { errno, message, cause, .. }) => {
                        assert_eq!(*cause, FailCause::RemoteAccess, "{kind} through a {what}: {message}");
                        assert_eq!(*errno, libc::EACCES, "{message}");
                    }
                    other => panic!("{other:?}"),
                }
                assert!(
                    failed_in <= Duration::from_millis(100),
                    "{kind} through a {what} failed after {failed_in:?}"
                );
                fail_times.push(failed_in);

                // A write with immediate to a live region of the same owner: every byte lands,
                // the immediate arrives once.
                let data = pattern(round.wrapping_mul(7).wrapping_add(token as u8), 4096);
                abuf.fill(4096, &data);
                token += 1;
                let live = token;
                let imm = 0x1000_0000 | live as u32;
                imm_sent.push(imm);
                let off = 4096 * (1 + (live as usize % 8));
                post(
                    ds,
                    &mut got,
                    0,
                    live,
                    Op::Write {
                        peer: hc,
                        local: abuf.slice(4096, 4096),
                        remote: cbuf.remote(off),
                        imm: Some(imm),
                    },
                );
                pump(ds, &mut got, |g| {
                    g[0].iter().any(|c| matches!(c, Completion::Done { token: t } | Completion::Failed { token: t, .. } if *t == live))
                        && (!has(&g[0], &Completion::Done { token: live }) || has(&g[1], &Completion::Imm { imm }))
                });
                assert!(
                    has(&got[0], &Completion::Done { token: live }),
                    "live write after a bad {kind}: {:?}",
                    got[0]
                );
                reconnect_times.push(t0.elapsed());
                assert_eq!(cbuf.bytes(off, 4096), data, "round {round}: {kind} through a {what}");

                // And the other way: c writes and reads a's live memory.
                let back = pattern(round.wrapping_add(101), 1024);
                cbuf.fill(0, &back);
                token += 1;
                let w = token;
                post(
                    ds,
                    &mut got,
                    1,
                    w,
                    Op::Write { peer: ha, local: cbuf.slice(0, 1024), remote: abuf.remote(16384), imm: None },
                );
                token += 1;
                let r = token;
                post(
                    ds,
                    &mut got,
                    1,
                    r,
                    Op::Read { peer: ha, local: cbuf.slice(2048, 1024), remote: abuf.remote(16384) },
                );
                pump(ds, &mut got, |g| {
                    has(&g[1], &Completion::Done { token: w }) && has(&g[1], &Completion::Done { token: r })
                });
                assert_eq!(abuf.bytes(16384, 1024), back);
                assert_eq!(cbuf.bytes(2048, 1024), back);
            }
        }
    }
    // Let any late completion in; then check: every live immediate arrived exactly once,
    // no bad one landed, nothing failed but the bad operations, nobody lost the peer.
    let end = Instant::now();
    pump(ds, &mut got, |_| end.elapsed() > Duration::from_millis(200));
    for imm in &imm_sent {
        let n = got[1].iter().filter(|c| **c == Completion::Imm { imm: *imm }).count();
        assert_eq!(n, 1, "immediate {imm:#x} arrived {n} times");
    }
    assert!(!got[1].iter().any(|c| matches!(c, Completion::Imm { imm } if imm & 0xffff_0000 == 0xbad0_0000)));
    let failed: Vec<_> = got.iter().flatten().filter(|c| matches!(c, Completion::Failed { .. })).collect();
    assert_eq!(failed.len(), 18, "only the bad operations fail: {failed:?}");
    assert!(ds[0].is_connected(hc) && ds[1].is_connected(ha));
    let epochs = (ds[0].connection_epoch(hc).unwrap(), ds[1].connection_epoch(ha).unwrap());
    assert_eq!(epochs.0, epochs.1);
    assert!(epochs.0 >= 18, "the connection was re-established after each bad access: {epochs:?}");
    let max = |v: &[Duration]| v.iter().max().copied().unwrap_or_default();
    let mean = |v: &[Duration]| v.iter().sum::<Duration>() / v.len().max(1) as u32;
    eprintln!(
        "bad access -> RemoteAccess: mean {:?}, max {:?}; bad access -> live write with imm done (reconnected): mean {:?}, max {:?}; epoch {}",
        mean(&fail_times),
        max(&fail_times),
        mean(&reconnect_times),
        max(&reconnect_times),
        epochs.0
    );
}

/// Work posted behind a refused access on the same queue pair is lost with it
/// (`ConnectionLost`, naming the first cause); a send in flight on the other queue pair (the
/// message lane) is not touched.
#[test]
fn work_behind_a_bad_access_is_connection_lost_and_the_message_lane_carries_on() {
    let _device = shared();
    let Some(mut a) = open() else { return };
    let Some(mut c) = open() else { return };
    let abuf = Buf::new(&mut a, 65536);
    let cbuf = Buf::new(&mut c, 65536);
    let hc = a.add_peer(&c.address()).expect("add c");
    let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
    let mut got = vec![Vec::new(), Vec::new()];
    // Connected (the first write waits for the handshake).
    post(
        ds,
        &mut got,
        0,
        1,
        Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None },
    );
    pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 1 }));
    for t in 0..4 {
        post(ds, &mut got, 1, 100 + t, Op::Recv { local: cbuf.slice(32768 + 8192 * t as usize, 8192) });
    }
    let forged = RemoteSlice { addr: cbuf.base, key: cbuf.key ^ 0x5a00 };
    // One batch (one doorbell per QP): the bad write, 8 good writes behind it, 4 sends.
    post(ds, &mut got, 0, 2, Op::Write { peer: hc, local: abuf.slice(0, 4096), remote: forged, imm: None });
    for t in 3..11 {
        post(
            ds,
            &mut got,
            0,
            t,
            Op::Write { peer: hc, local: abuf.slice(0, 4096), remote: cbuf.remote(4096), imm: None },
        );
    }
    for t in 20..24 {
        post(ds, &mut got, 0, t, Op::Send { peer: hc, local: abuf.slice(0, 512) });
    }
    let settled = |g: &[Vec<Completion>], t: u64| {
        g[0].iter().any(
            |c| matches!(c, Completion::Done { token } | Completion::Failed { token, .. } if *token == t),
        )
    };
    pump(ds, &mut got, |g| (2..11).chain(20..24).all(|t| settled(g, t)));
    let mut lost = 0;
    for c in &got[0] {
        match c {
            Completion::Failed { token: 2, cause, .. } => assert_eq!(*cause, FailCause::RemoteAccess),
            Completion::Failed { token, cause, message, .. } => {
                assert!((3..11).contains(token), "only writes behind the bad one may fail: {c:?}");
                assert_eq!(*cause, FailCause::ConnectionLost, "{message}");
                assert!(message.contains("remote access"), "names the first cause: {message}");
                lost += 1;
            }
            Completion::Done { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert!((20..24).all(|t| has(&got[0], &Completion::Done { token: t })), "sends: {:?}", got[0]);
    pump(ds, &mut got, |g| g[1].iter().filter(|c| matches!(c, Completion::Recv { .. })).count() == 4);
    eprintln!("writes behind the refused one lost with the QP: {lost} of 8");
    // And the peer is still there.
    post(
        ds,
        &mut got,
        0,
        30,
        Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None },
    );
    pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 30 }));

    // The responder's side: its QP went to the error state too (rxe does, as the spec says).
    // A write it posts on that QP before the requester's REQ has been read is lost with it:
    // `ConnectionLost`, never a lost peer; then both directions work again.
    let ha = ds[1].add_peer(&ds[0].address()).expect("c knows a");
    post(ds, &mut got, 0, 40, Op::Write { peer: hc, local: abuf.slice(0, 64), remote: forged, imm: None });
    let start = Instant::now();
    while !got[0].iter().any(|c| matches!(c, Completion::Failed { token: 40, .. })) {
        ds[0].flush();
        ds[0].poll(&mut got[0], 64).expect("poll");
        assert!(start.elapsed() < LIMIT);
    }
    std::thread::sleep(Duration::from_millis(20)); // the responder's QP has moved to ERR
    let back = pattern(3, 512);
    cbuf.fill(0, &back);
    let w41 = Op::Write { peer: ha, local: cbuf.slice(0, 512), remote: abuf.remote(8192), imm: None };
    post(ds, &mut got, 1, 41, w41);
    let is41 =
        |c: &Completion| matches!(c, Completion::Done { token: 41 } | Completion::Failed { token: 41, .. });
    pump(ds, &mut got, |g| g[1].iter().any(is41));
    let c41 = got[1].iter().find(|c| is41(c)).cloned();
    eprintln!("a write the responder posted on its torn-down QP: {c41:?}");
    match c41 {
        Some(Completion::Done { .. }) => {}
        Some(Completion::Failed { cause: FailCause::ConnectionLost, .. }) => {
            post(ds, &mut got, 1, 42, w41);
            pump(ds, &mut got, |g| has(&g[1], &Completion::Done { token: 42 }));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(abuf.bytes(8192, 512), back);
    post(
        ds,
        &mut got,
        0,
        43,
        Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None },
    );
    pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 43 }));
    assert!(ds[0].is_connected(hc) && ds[1].is_connected(ha));
    assert!(!got
        .iter()
        .flatten()
        .any(|c| matches!(c, Completion::Failed { cause: FailCause::PeerLost, .. })));
}

/// A write posted (chained, not yet handed to the NIC) when the error of a bad access on the
/// same QP is read is not lost: it moves to the fresh QP and goes out once the connection is
/// re-established. If the peer does not answer the new handshake within the connect timeout,
/// it fails with the peer (`PeerLost`), not at `op_timeout`.
#[test]
fn work_chained_during_a_reconnection_goes_out_on_the_new_queue_pair() {
    for answering in [true, false] {
        let cfg = VerbsConfig { connect_timeout: Duration::from_millis(500), ..VerbsConfig::default() };
        let Some(mut a) = open_with(cfg) else { return };
        let Some(mut c) = open() else { return };
        let abuf = Buf::new(&mut a, 8192);
        let cbuf = Buf::new(&mut c, 8192);
        let hc = a.add_peer(&c.address()).expect("add c");
        let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
        let mut got = vec![Vec::new(), Vec::new()];
        let good = |t: usize| Op::Write {
            peer: hc,
            local: abuf.slice(0, 64),
            remote: cbuf.remote(t * 64),
            imm: None,
        };
        post(ds, &mut got, 0, 1, good(1));
        pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 1 }));
        let forged = RemoteSlice { addr: cbuf.base, key: cbuf.key ^ 0x5a00 };
        post(ds, &mut got, 0, 2, Op::Write { peer: hc, local: abuf.slice(0, 64), remote: forged, imm: None });
        ds[0].flush();
        std::thread::sleep(Duration::from_millis(50)); // its error completion is in the CQ
        let data = pattern(5, 64);
        abuf.fill(0, &data);
        // SAFETY: leaked, registered memory.
        assert!(matches!(unsafe { ds[0].post(3, &good(3)) }, Ok(())), "chained on the connected QP");
        // Poll before flushing: the error is read while write 3 is still in the chain.
        ds[0].poll(&mut got[0], 64).expect("poll");
        assert!(
            got[0]
                .iter()
                .any(|c| matches!(c, Completion::Failed { token: 2, cause: FailCause::RemoteAccess, .. })),
            "{:?}",
            got[0]
        );
        let settled3 = |g: &[Vec<Completion>]| {
            g[0].iter()
                .any(|c| matches!(c, Completion::Done { token: 3 } | Completion::Failed { token: 3, .. }))
        };
        if answering {
            pump(ds, &mut got, settled3);
            assert!(has(&got[0], &Completion::Done { token: 3 }), "{:?}", got[0]);
            assert_eq!(cbuf.bytes(192, 64), data);
        } else {
            // `c` is not polled: nobody answers the new REQ.
            let start = Instant::now();
            while !settled3(&got) {
                ds[0].flush();
                ds[0].poll(&mut got[0], 64).expect("poll");
                assert!(start.elapsed() < LIMIT, "{:?}", got[0]);
                std::thread::sleep(Duration::from_millis(5));
            }
            let waited = start.elapsed();
            match got[0].iter().find(|c| matches!(c, Completion::Failed { token: 3, .. })) {
                Some(Completion::Failed { cause: FailCause::PeerLost, message, .. }) => {
                    assert!(message.contains("timed out"), "{message}")
                }
                other => panic!("{other:?}"),
            }
            assert!(
                waited < Duration::from_secs(5),
                "failed with the peer at the connect timeout: {waited:?}"
            );
        }
    }
}

/// `VerbsDomain::reconnect_failed`: a peer that failed (here: it did not answer the handshake within
/// the connect timeout, as after a transient outage) and answers again is brought back by a
/// fresh handshake (the next epoch); reviving a connected peer changes nothing.
#[test]
fn a_failed_peer_that_answers_again_is_revived() {
    let _device = shared();
    let cfg = VerbsConfig { connect_timeout: Duration::from_millis(500), ..VerbsConfig::default() };
    let Some(mut a) = open_with(cfg) else { return };
    let Some(mut c) = open() else { return };
    let abuf = Buf::new(&mut a, 4096);
    let cbuf = Buf::new(&mut c, 4096);
    let hc = a.add_peer(&c.address()).expect("add c");
    let op = || Op::Write { peer: hc, local: abuf.slice(0, 64), remote: cbuf.remote(0), imm: None };
    // `c` is not polled: no answer; after the connect timeout the post fails, the peer is lost.
    let start = Instant::now();
    let mut got = vec![Vec::new(), Vec::new()];
    loop {
        // SAFETY: leaked, registered memory.
        match unsafe { a.post(1, &op()) } {
            Err(PostError::Again) => {
                a.poll(&mut got[0], 64).expect("poll");
                assert!(start.elapsed() < LIMIT);
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(PostError::Failed(Error::PeerUnreachable { .. })) => break,
            other => panic!("{other:?}"),
        }
    }
    assert!(!a.is_connected(hc));
    // `c` wakes up (it answers the stale REQs; `a` ignores those REPs: the peer is failed).
    let ds: &mut [&mut VerbsDomain] = &mut [&mut a, &mut c];
    let t = Instant::now();
    pump(ds, &mut got, |_| t.elapsed() > Duration::from_millis(300));
    assert!(!ds[0].is_connected(hc));
    let t0 = Instant::now();
    ds[0].reconnect_failed(hc).expect("reconnect");
    let data = pattern(77, 64);
    abuf.fill(0, &data);
    post(ds, &mut got, 0, 2, op());
    pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 2 }));
    eprintln!("revived and written in {:?}", t0.elapsed());
    assert_eq!(cbuf.bytes(0, 64), data);
    assert!(ds[0].is_connected(hc));
    let epoch = ds[0].connection_epoch(hc);
    assert_eq!(epoch, Some(1));
    // Reviving a connected peer: nothing happens.
    ds[0].reconnect_failed(hc).expect("reconnect");
    assert_eq!(ds[0].connection_epoch(hc), epoch);
    post(ds, &mut got, 0, 3, op());
    pump(ds, &mut got, |g| has(&g[0], &Completion::Done { token: 3 }));
}
