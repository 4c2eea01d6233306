//! The synchronous fast path allocates nothing per operation: `post_write_imm`, `post_imm`
//! and `OpBatch::spin_until`, measured with a counting global allocator on the posting
//! thread, while real writes move through the provider to a `fabric-peer` process. On the
//! `BusyPoll` engine the spinning thread runs the reactor's passes itself, so those are
//! counted too (the periodic peer liveness check included).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fabric_async::bootstrap::Rendezvous;
use fabric_async::{Engine, OpBatch, ReactorMode};
use integration_tests::{fill_pattern, get, get_str, hash, primary, store, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_fabric-peer");

/// Counts allocations (and reallocations) made by threads that turned counting on.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    // `try_with`: the allocator also runs while thread-locals are being torn down.
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only
// an atomic and a `const`-initialised thread-local (no allocation, no reentrancy).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract for `GlobalAlloc::alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: the caller's contract for `GlobalAlloc::realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `GlobalAlloc::dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Operations per round; rounds of warm-up let the submission queue's two buffers reach
/// their working capacity first (they are swapped, never freed).
const ROUND: u64 = 256;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_fast_path_does_not_allocate() {
    for mode in [ReactorMode::BusyPoll, ReactorMode::Event] {
        let p = primary();
        let (_server, store, addr) = store().await;
        let size = 64 * 1024;
        let (warm, measured) = (4, 8);
        let total = (warm + measured) * ROUND;
        let wait = format!("21={total},22={total}");
        let mut peer = Peer::spawn(PEER, addr, &p, &["target", "--size", &size.to_string(), "--wait", &wait]);
        let engine = Engine::builder().provider(p.as_str()).mode(mode).build().unwrap();
        let mut data = vec![0u8; size];
        fill_pattern(&mut data, 21, 0);
        let src = engine.register_copy(data.clone()).await.unwrap();
        let dst = engine.remote_region(&get(&store, "target/desc").await).await.unwrap();
        let (e2, s2, d2) = (engine.clone(), src.clone(), dst.clone());
        let allocs = tokio::task::spawn_blocking(move || {
            let batch = OpBatch::new();
            let chunk = size as u64 / ROUND;
            let mut done = 0;
            let mut round = |count: bool| {
                COUNTING.with(|c| c.set(count));
                for i in 0..ROUND {
                    let off = i * chunk;
                    e2.post_write_imm(&batch, &s2, off, &d2, off, chunk, 21).expect("post_write_imm");
                    e2.post_imm(&batch, &d2, 22).expect("post_imm");
                }
                done += 2 * ROUND;
                let ok = batch.spin_until(done, Duration::from_secs(60));
                COUNTING.with(|c| c.set(false));
                assert!(ok.expect("no failed operation"), "{mode:?}: round completes");
            };
            for _ in 0..warm {
                round(false);
            }
            let before = ALLOCS.load(Ordering::Relaxed);
            for _ in 0..measured {
                round(true);
            }
            assert_eq!(batch.completed(), 2 * total);
            ALLOCS.load(Ordering::Relaxed) - before
        })
        .await
        .unwrap();
        assert_eq!(
            allocs,
            0,
            "{p} {mode:?}: the sync path allocated {allocs} times in {} operations",
            2 * measured * ROUND
        );
        assert_eq!(get_str(&store, "target/hash").await, hash(&data).to_string(), "{p} {mode:?}: bytes");
        assert_eq!(get_str(&store, "target/extra").await, "21=0,22=0", "{p} {mode:?}: exact counts");
        store.put("target/exit", vec![]).await.unwrap();
        assert!(peer.wait_success(Duration::from_secs(20)).await);
    }
}
