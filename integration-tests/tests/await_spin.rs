//! `EngineBuilder::await_spin`: on an engine with a reactor thread (Event mode here), a
//! pending future first runs reactor passes on its own thread for up to the spin, and only
//! then registers its waker and parks until the reactor thread wakes it. Every test moves
//! real bytes through libfabric (tcp, shm) between two engines.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use fabric_async::{Engine, ReactorMode};
use integration_tests::{primary, providers};

/// A waker that counts its wake-ups.
#[derive(Default)]
struct Wakes(AtomicUsize);

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn engine(p: &str, spin: Duration) -> Engine {
    // Direct posting off: without the spin, a write is posted by the reactor thread, so its
    // first poll always finds it pending (the control below relies on that).
    Engine::builder()
        .provider(p)
        .mode(ReactorMode::Event)
        .direct_post(false)
        .await_spin(spin)
        .build()
        .unwrap()
}

/// `n` writes of 256 bytes from `a` to `b`, each polled once by hand with a counting waker:
/// how many of those first polls were already `Ready`, and how often the waker was woken.
/// Every write's bytes are checked at `b`.
async fn first_polls(p: &str, spin: Duration, n: u64) -> (u64, usize) {
    let (a, b) = (engine(p, spin), engine(p, Duration::ZERO));
    let (ra, rb) = (a.alloc(4096).await.unwrap(), b.alloc(4096).await.unwrap());
    let to_b = a.remote_region(&rb.descriptor().to_bytes()).await.unwrap();
    let c = b.imm_counter(3);
    let wakes = Arc::new(Wakes::default());
    let waker = Waker::from(wakes.clone());
    let mut ready = 0;
    for i in 0..n {
        let bytes = [i as u8 ^ 0x5a; 256];
        ra.write_at(0, &bytes).unwrap();
        let mut f = a.write_imm(&ra, 0, &to_b, 256, 256, 3);
        match Pin::new(&mut f).poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(r) => {
                r.unwrap();
                ready += 1;
            }
            Poll::Pending => tokio::time::timeout(Duration::from_secs(10), f).await.unwrap().unwrap(),
        }
        // A completion means the source may be reused (on shm, not that the bytes are
        // placed): the immediate's arrival at `b` says they are.
        tokio::time::timeout(Duration::from_secs(10), c.wait_for(1))
            .await
            .expect("the immediate arrived")
            .unwrap();
        let mut got = [0u8; 256];
        rb.read_at(256, &mut got).unwrap();
        assert_eq!(got, bytes, "{p}: write {i} landed");
    }
    assert!(!a.is_inline(), "an Event engine with a spin is not inline");
    assert!(!a.progress(), "Engine::progress stays an Inline engine's");
    (ready, wakes.0.load(Ordering::SeqCst))
}

/// With a spin far longer than a write takes, the first poll of every write returns its
/// result: the write was posted and completed by passes on this thread, and the reactor
/// thread never had a waker to wake. Without a spin (the control), first polls are pending.
#[tokio::test]
async fn a_write_completes_inside_the_spin_of_its_first_poll() {
    for p in providers() {
        let (ready, woken) = first_polls(&p, Duration::from_secs(5), 50).await;
        assert_eq!((ready, woken), (50, 0), "{p}: every first poll is ready, nobody is woken");
        let (ready, _) = first_polls(&p, Duration::ZERO, 20).await;
        assert!(ready < 20, "{p}: without a spin, some first poll is pending ({ready} of 20 were ready)");
    }
}

/// A wait longer than the spin: the first poll spins for the budget, then returns pending
/// with its waker registered; the reactor thread wakes it when the immediate arrives, and
/// the poll after that wake-up answers without spinning again.
#[tokio::test]
async fn a_wait_past_the_spin_parks_and_the_reactor_thread_wakes_it() {
    let p = primary();
    let spin = Duration::from_millis(200);
    let (a, b) = (engine(&p, spin), engine(&p, Duration::ZERO));
    let ra = a.alloc(4096).await.unwrap();
    let rb = b.alloc(4096).await.unwrap();
    let to_a = b.remote_region(&ra.descriptor().to_bytes()).await.unwrap();
    let c = a.imm_counter(9);
    let mut w = Box::pin(c.wait_for(1));
    let wakes = Arc::new(Wakes::default());
    let waker = Waker::from(wakes.clone());
    let t0 = Instant::now();
    assert!(Pin::new(&mut w).poll(&mut Context::from_waker(&waker)).is_pending());
    let spun = t0.elapsed();
    assert!(spun >= spin, "the first poll spun for the budget ({spun:?})");
    assert!(spun < Duration::from_secs(5), "and not much longer ({spun:?})");
    assert_eq!(wakes.0.load(Ordering::SeqCst), 0, "a pending future does not wake itself");
    b.write_imm(&rb, 0, &to_a, 0, 64, 9).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while wakes.0.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the reactor thread never woke the parked wait");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Woken, it answers at once: a second spin would only delay the answer by the budget.
    let t1 = Instant::now();
    match Pin::new(&mut w).poll(&mut Context::from_waker(&waker)) {
        Poll::Ready(r) => r.unwrap(),
        Poll::Pending => panic!("woken, yet still pending"),
    }
    assert!(t1.elapsed() < spin / 2, "the woken wait spun again ({:?})", t1.elapsed());
}
