//! Small two-sided messages through real libfabric, echoed by a peer process.

use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::Engine;
use integration_tests::{fill_pattern, get, get_str, providers, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_echo() {
    for p in providers() {
        let (_server, store, addr) = store().await;
        let engine = Engine::builder().provider(p.as_str()).build().expect("engine");
        store.put("test/addr", engine.address()).await.unwrap();
        let n = 50;
        let mut peer = Peer::spawn(PEER, addr, &p, &["echo", "--count", &n.to_string()]);
        let peer_id = engine.add_peer(&get(&store, "echo/addr").await).await.expect("add peer");
        assert_eq!(get_str(&store, "echo/ready").await, "ok");
        let max = engine.max_msg_size();
        for i in 0..n {
            let len = 1 + (i * 977) % max;
            let mut msg = vec![0u8; len];
            fill_pattern(&mut msg, i as u64, 0);
            engine.send(peer_id, &msg).await.expect("send");
            let (from, back) = tokio::time::timeout(Duration::from_secs(30), engine.recv())
                .await
                .expect("echo within 30 s")
                .expect("recv");
            assert_eq!(from, Some(peer_id), "{p}: the sender is known");
            assert_eq!(&back[..], &msg[..], "{p}: message {i} of {len} bytes");
        }
        store.put("echo/exit", vec![]).await.unwrap();
        assert!(peer.wait_success(Duration::from_secs(20)).await);
    }
}
