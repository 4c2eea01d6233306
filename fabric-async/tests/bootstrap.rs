//! TcpStore and all_gather over loopback TCP. Every test is bounded by a timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fabric_async::bootstrap::{MAX_KEY_LEN, MAX_VALUE_LEN};
use fabric_async::{all_gather, BootstrapError, Rendezvous, TcpStore, TcpStoreServer};

const BOUND: Duration = Duration::from_secs(20);

fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

async fn bounded<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(BOUND, f).await.expect("test hung")
}

#[allow(dead_code)]
fn static_assertions(store: &dyn Rendezvous) {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<TcpStore>();
    send_sync::<TcpStoreServer>();
    send_sync::<BootstrapError>();
    send(&store.get("k"));
    send(&store.put("k", vec![]));
    send(&all_gather(store, "p", 0, 1, vec![]));
    send(&TcpStore::connect(localhost()));
    send(&TcpStoreServer::bind(localhost()));
}

#[tokio::test]
async fn put_then_get() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let store = TcpStore::connect(server.local_addr()).await.unwrap();
        store.put("a", b"hello".to_vec()).await.unwrap();
        store.put("empty", vec![]).await.unwrap();
        assert_eq!(store.get("a").await.unwrap(), b"hello");
        assert_eq!(store.get("empty").await.unwrap(), b"");
        // A second client sees the same keys; the last write wins.
        let other = TcpStore::connect(server.local_addr()).await.unwrap();
        assert_eq!(other.get("a").await.unwrap(), b"hello");
        other.put("a", b"again".to_vec()).await.unwrap();
        assert_eq!(store.get("a").await.unwrap(), b"again");
    })
    .await;
}

#[tokio::test]
async fn get_before_put_waits_then_resolves() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let store = Arc::new(TcpStore::connect(server.local_addr()).await.unwrap());
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move { store.get("late").await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished(), "get returned before the key existed");
        // A put through the same handle must not be blocked by the waiting get.
        store.put("late", b"value".to_vec()).await.unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), b"value");
    })
    .await;
}

#[tokio::test]
async fn waiting_get_does_not_block_other_clients() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let a = Arc::new(TcpStore::connect(server.local_addr()).await.unwrap());
        let b = TcpStore::connect(server.local_addr()).await.unwrap();
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.get("never-yet").await })
        };
        for i in 0..20 {
            b.put(&format!("k{i}"), vec![i as u8]).await.unwrap();
            assert_eq!(a.get(&format!("k{i}")).await.unwrap(), vec![i as u8]);
        }
        assert!(!waiter.is_finished());
        waiter.abort();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_clients_all_gather() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let addr = server.local_addr();
        let world = 4;
        let tasks: Vec<_> = (0..world)
            .map(|rank| {
                tokio::spawn(async move {
                    let store = TcpStore::connect(addr).await.unwrap();
                    let mine = format!("addr-of-{rank}").into_bytes();
                    let first = all_gather(&store, "addr", rank, world, mine).await.unwrap();
                    // A second exchange under a fresh prefix.
                    let second =
                        all_gather(&store, "desc/0", rank, world, vec![rank as u8; 1000]).await.unwrap();
                    (first, second)
                })
            })
            .collect();
        for task in tasks {
            let (first, second) = task.await.unwrap();
            let expected: Vec<Vec<u8>> = (0..world).map(|r| format!("addr-of-{r}").into_bytes()).collect();
            assert_eq!(first, expected);
            assert_eq!(second, (0..world).map(|r| vec![r as u8; 1000]).collect::<Vec<_>>());
        }
    })
    .await;
}

#[tokio::test]
async fn all_gather_rejects_bad_rank() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let store = TcpStore::connect(server.local_addr()).await.unwrap();
        let err = all_gather(&store, "p", 4, 4, vec![]).await.unwrap_err();
        assert!(matches!(err, BootstrapError::InvalidRank { rank: 4, world: 4 }), "{err}");
    })
    .await;
}

#[tokio::test]
async fn get_times_out_and_store_stays_usable() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let store =
            TcpStore::connect(server.local_addr()).await.unwrap().with_timeout(Duration::from_millis(200));
        let err = store.get("missing").await.unwrap_err();
        match &err {
            BootstrapError::Timeout { key } => assert_eq!(key, "missing"),
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(err.to_string().contains("missing"));
        store.put("missing", b"now".to_vec()).await.unwrap();
        assert_eq!(store.get("missing").await.unwrap(), b"now");
    })
    .await;
}

#[tokio::test]
async fn too_large_is_rejected_before_sending() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let store = TcpStore::connect(server.local_addr()).await.unwrap();
        let long_key = "k".repeat(MAX_KEY_LEN + 1);
        let err = store.put(&long_key, vec![]).await.unwrap_err();
        assert!(
            matches!(err, BootstrapError::TooLarge { what: "key", len, max } if len == MAX_KEY_LEN + 1 && max == MAX_KEY_LEN),
            "{err}"
        );
        assert!(matches!(store.get(&long_key).await, Err(BootstrapError::TooLarge { what: "key", .. })));
        let err = store.put("v", vec![0; MAX_VALUE_LEN + 1]).await.unwrap_err();
        assert!(matches!(err, BootstrapError::TooLarge { what: "value", .. }), "{err}");
        assert!(err.to_string().contains("67108865 bytes"), "{err}");
        // The limits themselves are fine, and the store still works.
        let key = "k".repeat(MAX_KEY_LEN);
        store.put(&key, vec![7; MAX_VALUE_LEN]).await.unwrap();
        let value = store.get(&key).await.unwrap();
        assert_eq!(value.len(), MAX_VALUE_LEN);
        assert!(value.iter().all(|&b| b == 7));
    })
    .await;
}

#[tokio::test]
async fn server_drop_fails_clients_instead_of_hanging() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let store = Arc::new(TcpStore::connect(server.local_addr()).await.unwrap());
        store.put("k", b"v".to_vec()).await.unwrap();
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move { store.get("never").await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(server);
        let err = waiter.await.unwrap().unwrap_err();
        assert!(matches!(err, BootstrapError::Io { .. }), "{err}");
        // Later requests fail too (pooled connection closed, new connections refused).
        assert!(store.get("k").await.is_err());
        assert!(store.put("k2", vec![]).await.is_err());
    })
    .await;
}

#[tokio::test]
async fn connect_retries_until_the_server_starts() {
    bounded(async {
        // Find a free port, release it, and start the server there a little later.
        let addr = std::net::TcpListener::bind(localhost()).unwrap().local_addr().unwrap();
        let client = tokio::spawn(TcpStore::connect_timeout(addr, Duration::from_secs(10)));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!client.is_finished());
        let server = TcpStoreServer::bind(addr).await.unwrap();
        let store = client.await.unwrap().unwrap();
        store.put("x", b"y".to_vec()).await.unwrap();
        assert_eq!(store.get("x").await.unwrap(), b"y");
        drop(server);
    })
    .await;
}

#[tokio::test]
async fn connect_gives_up_after_its_timeout() {
    bounded(async {
        let addr = std::net::TcpListener::bind(localhost()).unwrap().local_addr().unwrap();
        let started = std::time::Instant::now();
        let err = TcpStore::connect_timeout(addr, Duration::from_millis(300)).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        match &err {
            BootstrapError::Io { context, .. } => assert!(context.contains("gave up"), "{err}"),
            other => panic!("expected Io, got {other:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn dropped_get_leaves_store_usable() {
    bounded(async {
        let server = TcpStoreServer::bind(localhost()).await.unwrap();
        let store = TcpStore::connect(server.local_addr()).await.unwrap();
        // Cancel a waiting get by timing it out from the outside.
        assert!(tokio::time::timeout(Duration::from_millis(100), store.get("later")).await.is_err());
        store.put("later", b"v".to_vec()).await.unwrap();
        assert_eq!(store.get("later").await.unwrap(), b"v");
    })
    .await;
}
