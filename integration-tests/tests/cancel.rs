//! Dropping in-flight write futures at random points never frees memory the NIC still
//! uses, never writes outside the intended ranges, and leaves the engine working.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::Engine;
use integration_tests::{fill_pattern, get, get_str, hash, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
const SIZE: usize = 1 << 20;
const SENTINEL: u8 = 0xEE;
const WRITES: usize = 100;

fn range(i: usize) -> (u64, u64) {
    ((i * 10_000 + (i % 7) * 13) as u64, (1000 + (i * 37) % 5000) as u64)
}

async fn cancel(provider: &str) {
    let (_server, store, addr) = store().await;
    let wait = format!("5={}", WRITES + 1);
    let mut peer = Peer::spawn(
        PEER,
        addr,
        provider,
        &["target", "--size", &SIZE.to_string(), "--sentinel", &SENTINEL.to_string(), "--wait", &wait],
    );
    let engine = Engine::builder().provider(provider).build().expect("engine");
    let mut data = vec![0u8; SIZE];
    fill_pattern(&mut data, 9, 0);
    let src = engine.register(data.clone()).await.expect("register");
    let dst = engine.remote_region(&get(&store, "target/desc").await).await.expect("remote region");

    let mut rng: u64 = 0x1234_5678;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let waker = futures::task::noop_waker();
    for i in 0..WRITES {
        let (off, len) = range(i);
        let mut f = engine.write_imm(&src, off, &dst, off, len, 5);
        match next() % 4 {
            0 => drop(f), // never polled
            1 => {
                // polled once, then dropped
                let _ = Pin::new(&mut f).poll(&mut Context::from_waker(&waker));
                drop(f);
            }
            2 => {
                // raced against a short timer, dropped if the timer wins
                let d = Duration::from_micros(next() % 200);
                let _ = tokio::time::timeout(d, f).await;
            }
            _ => f.await.expect("an awaited write succeeds"),
        }
    }
    // The source region handle goes away too while writes may still be in flight: the
    // operations keep its memory registered and alive until they complete.
    drop(src);

    // The engine keeps working: one more write, awaited.
    let src2 = engine.register(data.clone()).await.expect("register again");
    let (off, len) = range(WRITES);
    engine.write_imm(&src2, off, &dst, off, len, 5).await.expect("engine still works");

    let mut expected = vec![SENTINEL; SIZE];
    for i in 0..=WRITES {
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
