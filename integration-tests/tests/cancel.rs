//! Dropping in-flight write futures at random points never frees memory the NIC still
//! uses, never writes outside the intended ranges, and leaves the engine working.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, OpFuture};
use integration_tests::{fill_pattern, get, get_str, hash, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
const SIZE: usize = 2 << 20;
const SENTINEL: u8 = 0xEE;
const WRITES: usize = 100;
/// Writes awaited to completion in between (one per 10 created), to other ranges.
const AWAITED: usize = WRITES / 10;

fn range(i: usize) -> (u64, u64) {
    ((i * 10_000 + (i % 7) * 13) as u64, (1000 + (i * 37) % 5000) as u64)
}

async fn cancel(provider: &str) {
    let (_server, store, addr) = store().await;
    let wait = format!("5={}", WRITES + AWAITED + 1);
    let mut peer = Peer::spawn(
        PEER,
        addr,
        provider,
        &["target", "--size", &SIZE.to_string(), "--sentinel", &SENTINEL.to_string(), "--wait", &wait],
    );
    let engine = Engine::builder().provider(provider).build().expect("engine");
    let mut data = vec![0u8; SIZE];
    fill_pattern(&mut data, 9, 0);
    let src = engine.register_copy(data.clone()).await.expect("register");
    let dst = engine.remote_region(&get(&store, "target/desc").await).await.expect("remote region");

    let mut rng: u64 = 0x1234_5678;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // All WRITES futures are dropped, none awaited to its end: each is created (which
    // submits its write), polled a random number of times at random moments, and dropped at
    // a random later point, in random order. Awaited writes to other ranges run in
    // between, so the engine is busy with live and abandoned operations at once.
    let waker = futures::task::noop_waker();
    let mut live = Vec::new();
    let mut dropped = 0;
    let mut pending_at_drop = 0;
    let mut awaited = 0;
    let mut drop_one = |live: &mut Vec<(OpFuture, bool)>, i: usize| {
        let (f, pending) = live.swap_remove(i);
        pending_at_drop += pending as usize;
        dropped += 1;
        drop(f);
    };
    for i in 0..WRITES {
        let (off, len) = range(i);
        live.push((engine.write_imm(&src, off, &dst, off, len, 5), true));
        for _ in 0..next() % 3 {
            let k = next() as usize % live.len();
            let (f, pending) = &mut live[k];
            *pending = Pin::new(f).poll(&mut Context::from_waker(&waker)).is_pending();
        }
        if next() % 2 == 0 {
            let k = next() as usize % live.len();
            drop_one(&mut live, k);
        }
        if i % 10 == 9 {
            let (off, len) = range(WRITES + awaited);
            engine.write_imm(&src, off, &dst, off, len, 5).await.expect("an awaited write succeeds");
            awaited += 1;
        } else if next() % 4 == 0 {
            tokio::task::yield_now().await;
        }
    }
    while !live.is_empty() {
        let k = next() as usize % live.len();
        drop_one(&mut live, k);
    }
    assert_eq!((dropped, awaited), (WRITES, AWAITED), "every write future dropped");
    eprintln!(
        "{provider}: {dropped} write futures dropped, {pending_at_drop} of them pending at their last poll"
    );
    // The source region handle goes away too while writes may still be in flight: the
    // operations keep its memory registered and alive until they complete.
    drop(src);

    // The engine keeps working: one more write, awaited.
    let src2 = engine.register_copy(data.clone()).await.expect("register again");
    let (off, len) = range(WRITES + AWAITED);
    engine.write_imm(&src2, off, &dst, off, len, 5).await.expect("engine still works");

    let mut expected = vec![SENTINEL; SIZE];
    for i in 0..=WRITES + AWAITED {
        let (off, len) = range(i);
        let (o, l) = (off as usize, len as usize);
        expected[o..o + l].copy_from_slice(&data[o..o + l]);
    }
    assert_eq!(
        get_str(&store, "target/hash").await,
        hash(&expected).to_string(),
        "{provider}: region differs"
    );
    assert_eq!(get_str(&store, "target/extra").await, "5=0");
    store.put("target/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(Duration::from_secs(20)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_write_futures_lose_nothing_and_corrupt_nothing() {
    for p in providers() {
        cancel(&p).await;
    }
}
