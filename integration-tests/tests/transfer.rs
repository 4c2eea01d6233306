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
    let src = engine.register_copy(data).await.expect("register");
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

/// Memory the caller owns, freed (and `dropped` set) by its `Drop`: the owner handed to
/// `Engine::register_host`.
struct Owned {
    ptr: *mut u8,
    len: usize,
    dropped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

// SAFETY: `Owned` uniquely owns its allocation and only frees it in `Drop`.
unsafe impl Send for Owned {}
// SAFETY: `Owned` exposes nothing through `&self`.
unsafe impl Sync for Owned {}

impl Owned {
    fn new(data: Vec<u8>) -> (Owned, std::sync::Arc<std::sync::atomic::AtomicBool>) {
        let len = data.len();
        let ptr = Box::into_raw(data.into_boxed_slice()).cast::<u8>();
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        (Owned { ptr, len, dropped: dropped.clone() }, dropped)
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: exactly the boxed slice made in `new`, freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
        self.dropped.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// `register_host`: the caller's own memory is read and written in place (no copy), and its
/// owner is dropped only once the region is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_host_moves_the_callers_own_memory() {
    use std::sync::atomic::Ordering;
    for p in providers() {
        let a = Engine::builder().provider(&p).build().expect("engine");
        let b = Engine::builder().provider(&p).build().expect("engine");
        let size = (1 << 20) + 13;
        let mut data = vec![0u8; size];
        fill_pattern(&mut data, 31, 0);
        let expected = hash(&data);
        let (src_mem, src_dropped) = Owned::new(data);
        let (dst_mem, dst_dropped) = Owned::new(vec![0u8; size]);
        let (src_ptr, dst_ptr) = (src_mem.ptr as u64, dst_mem.ptr as u64);
        // SAFETY: each owner keeps its `size` bytes allocated until it is dropped, and
        // nothing else touches them meanwhile.
        let src = unsafe { a.register_host(src_ptr, size, src_mem) }.await.expect("register src");
        // SAFETY: as above.
        let dst = unsafe { b.register_host(dst_ptr, size, dst_mem) }.await.expect("register dst");
        assert_eq!((src.as_ptr() as u64, dst.as_ptr() as u64), (src_ptr, dst_ptr), "{p}: not copied");
        let remote = a.remote_region(&dst.descriptor().to_bytes()).await.expect("remote region");
        let arrivals = a.write_arrivals(&remote, size as u64).unwrap();
        a.write_imm(&src, 0, &remote, 0, size as u64, 4).await.expect("write_imm");
        b.imm_counter(4).wait_for(arrivals).await.expect("arrivals");
        // SAFETY: the write has landed and nothing writes the destination any more.
        let landed = unsafe { std::slice::from_raw_parts(dst_ptr as *const u8, size) };
        assert_eq!(hash(landed), expected, "{p}: bytes differ in the caller's memory");
        let empty = Engine::builder().provider(&p).build().expect("engine");
        // SAFETY: refused before anything touches the (null) range.
        let refused = unsafe { empty.register_host(0, 8, ()) }.await;
        assert!(matches!(refused, Err(fabric_async::Error::Config(_))), "{p}: {refused:?}");
        assert!(!src_dropped.load(Ordering::SeqCst) && !dst_dropped.load(Ordering::SeqCst));
        drop((src, dst, remote));
        // The reactor closes the registrations, then drops the owners.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !(src_dropped.load(Ordering::SeqCst) && dst_dropped.load(Ordering::SeqCst)) {
            assert!(std::time::Instant::now() < deadline, "{p}: owners not dropped");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        eprintln!("{p}: register_host verified");
    }
}
