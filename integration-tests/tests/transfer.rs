//! Bytes verified end to end between two processes, 1 B to 64 MiB, on every provider.

use fabric_async::bootstrap::Rendezvous;
use fabric_async::Engine;
use integration_tests::{fill_pattern, get, get_str, hash, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");
const CHUNK: usize = 8 << 20;

async fn transfer(provider: &str, size: usize) {
    let (_server, store, addr) = store().await;
    let chunks = size.div_ceil(CHUNK);
    let wait = format!("1={chunks}");
    let mut peer = Peer::spawn(
        PEER,
        addr,
        provider,
        &["target", "--size", &size.to_string(), "--sentinel", "0", "--wait", &wait],
    );
    let engine = Engine::builder().provider(provider).build().expect("engine");
    let mut data = vec![0u8; size];
    fill_pattern(&mut data, size as u64, 0);
    let expected = hash(&data);
    let src = engine.register(data).await.expect("register");
    let dst = engine.remote_region(&get(&store, "target/desc").await).await.expect("remote region");
    assert_eq!(dst.len(), size as u64);
    let writes = (0..chunks).map(|i| {
        let off = (i * CHUNK) as u64;
        let len = CHUNK.min(size - i * CHUNK) as u64;
        engine.write_imm(&src, off, &dst, off, len, 1)
    });
    futures::future::try_join_all(writes).await.expect("writes complete");
    assert_eq!(get_str(&store, "target/hash").await, expected.to_string(), "{provider}: {size} bytes differ");
    assert_eq!(get_str(&store, "target/extra").await, "1=0", "exactly one arrival per write");
    store.put("target/exit", vec![]).await.unwrap();
    assert!(peer.wait_success(std::time::Duration::from_secs(20)).await, "peer exits cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_end_to_end_1b_to_64mib() {
    for p in providers() {
        for size in [1, 4097, (1 << 20) + 13, 64 << 20] {
            transfer(&p, size).await;
            eprintln!("{p}: {size} bytes verified");
        }
    }
}

/// The reference design panics on a current-thread runtime (`block_in_place`); here the
/// reactor wakes futures from its own thread, so any executor works.
#[tokio::test(flavor = "current_thread")]
async fn works_on_a_current_thread_runtime() {
    transfer(&integration_tests::primary(), 100_000).await;
}
