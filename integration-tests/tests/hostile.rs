//! Hostile and absurd input to the transfer methods and to allocation: overflowing offsets
//! and lengths on every method, against local and remote regions, give
//! `Error::OutOfBounds` before anything is posted; 0-byte transfers are defined; absurd
//! allocations are errors, never aborts (see `docs/security.md`).

use std::time::Duration;

use fabric_async::{Engine, Error, MemoryRegion, OpBatch, PageLayout, RemoteRegion, ScatterEntry, Side};
use integration_tests::primary;

const LEN: u64 = 4096;

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("answered within 30 s")
}

/// (offset, len) pairs that are out of bounds of a `LEN`-byte region, most by overflow.
fn bad_ranges() -> Vec<(u64, u64)> {
    vec![
        (u64::MAX, 1),
        (1, u64::MAX),
        (u64::MAX, u64::MAX),
        (u64::MAX, 0),
        (LEN + 1, 0),
        (LEN, 1),
        (u64::MAX - 10, 20),               // wraps to 9
        (LEN - 100, u64::MAX - LEN + 200), // wraps to 100
    ]
}

/// Whether `r` is the bounds error of `side`'s range `offset+len` (a length that no region
/// of `LEN` bytes can hold may be reported for the other side, which is checked first).
fn is_oob(r: &Result<(), Error>, side: Side, offset: u64, len: u64) -> bool {
    match r {
        Err(Error::OutOfBounds { side: s, offset: o, len: l, region_len: LEN }) => {
            (*s == side && *o == offset && *l == len) || (len > LEN && *l == len)
        }
        _ => false,
    }
}

async fn setup() -> (Engine, Engine, MemoryRegion, MemoryRegion, RemoteRegion) {
    let p = primary();
    let a = Engine::builder().provider(p.as_str()).build().unwrap();
    let b = Engine::builder().provider(p.as_str()).build().unwrap();
    let src = a.alloc(LEN as usize).await.unwrap();
    let theirs = b.alloc(LEN as usize).await.unwrap();
    let dst = a.remote_region(&theirs.descriptor().to_bytes()).await.unwrap();
    (a, b, src, theirs, dst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflowing_ranges_fail_on_every_method_before_posting() {
    let (a, _b, src, theirs, dst) = setup().await;
    src.write_at(0, &[0x5A; LEN as usize]).unwrap();
    let batch = OpBatch::new();
    for (off, len) in bad_ranges() {
        for side in [Side::Local, Side::Remote] {
            let (so, doff) = if side == Side::Local { (off, 0) } else { (0, off) };
            let what = format!("{side} {off}+{len}");
            let r = bounded(a.write(&src, so, &dst, doff, len)).await;
            assert!(is_oob(&r, side, off, len), "write {what}: {r:?}");
            let r = bounded(a.write_imm(&src, so, &dst, doff, len, 7)).await;
            assert!(is_oob(&r, side, off, len), "write_imm {what}: {r:?}");
            let r = bounded(a.read(&src, so, &dst, doff, len)).await;
            assert!(is_oob(&r, side, off, len), "read {what}: {r:?}");
            let r = a.post_write_imm(&batch, &src, so, &dst, doff, len, 7);
            assert!(is_oob(&r, side, off, len), "post_write_imm {what}: {r:?}");
            let group = a.peer_group(vec![dst.clone()]).unwrap();
            let e = [ScatterEntry { member: 0, src_off: so, dst_off: doff, len }];
            let r = bounded(a.scatter(&src, &group, &e, Some(7))).await;
            assert!(is_oob(&r, side, off, len), "scatter {what}: {r:?}");
        }
    }
    // Paged writes: page indices, strides and offsets whose products and sums overflow.
    let layouts = [
        (
            PageLayout { page_len: 512, src_stride: u64::MAX, dst_stride: 512, src_offset: 0, dst_offset: 0 },
            Side::Local,
        ),
        (
            PageLayout { page_len: 512, src_stride: 512, dst_stride: u64::MAX, src_offset: 0, dst_offset: 0 },
            Side::Remote,
        ),
        (
            PageLayout {
                page_len: 512,
                src_stride: 512,
                dst_stride: 512,
                src_offset: u64::MAX,
                dst_offset: 0,
            },
            Side::Local,
        ),
        (
            PageLayout {
                page_len: 512,
                src_stride: 512,
                dst_stride: 512,
                src_offset: 0,
                dst_offset: u64::MAX - 600,
            },
            Side::Remote,
        ),
        (
            PageLayout {
                page_len: u64::MAX,
                src_stride: u64::MAX,
                dst_stride: u64::MAX,
                src_offset: 0,
                dst_offset: 0,
            },
            Side::Local,
        ),
    ];
    for (layout, side) in layouts {
        let r = bounded(a.write_paged(&src, &dst, &layout, &[0, 1], &[0, 1], Some(7))).await;
        assert!(matches!(&r, Err(Error::OutOfBounds { side: s, .. }) if *s == side), "{layout:?}: {r:?}");
    }
    let layout = PageLayout::packed(512);
    let r = bounded(a.write_paged(&src, &dst, &layout, &[u32::MAX], &[0], None)).await;
    assert!(matches!(r, Err(Error::OutOfBounds { side: Side::Local, .. })), "{r:?}");
    let r = bounded(a.write_paged(&src, &dst, &layout, &[0], &[u32::MAX], None)).await;
    assert!(matches!(r, Err(Error::OutOfBounds { side: Side::Remote, .. })), "{r:?}");

    // Nothing was posted and nothing landed; the engine still works.
    assert_eq!(a.stats().nics[0].posted_ops, 0, "{}", a.stats());
    assert_eq!(batch.completed() + batch.failed(), 0);
    assert!(theirs.to_vec().iter().all(|&b| b == 0), "no bad write landed");
    bounded(a.write(&src, 0, &dst, 0, LEN)).await.expect("a good write after all that");
    assert_eq!(theirs.to_vec(), vec![0x5A; LEN as usize]);
}

/// A 0-byte transfer inside the bounds (offset up to the region's length) is valid: posted,
/// completed, no bytes moved; with an immediate, the immediate arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_byte_transfers_complete_and_move_nothing() {
    let (a, b, src, theirs, dst) = setup().await;
    src.write_at(0, &[0x77; LEN as usize]).unwrap();
    for off in [0, 1, LEN - 1, LEN] {
        bounded(a.write(&src, off, &dst, off, 0))
            .await
            .unwrap_or_else(|e| panic!("0-byte write at {off}: {e}"));
        bounded(a.read(&src, off, &dst, off, 0))
            .await
            .unwrap_or_else(|e| panic!("0-byte read at {off}: {e}"));
    }
    let counter = b.imm_counter(31);
    bounded(a.write_imm(&src, LEN, &dst, LEN, 0, 31)).await.expect("0-byte write_imm at the edge");
    let batch = OpBatch::new();
    a.post_write_imm(&batch, &src, 0, &dst, 0, 0, 31).expect("0-byte post_write_imm");
    assert!(batch.spin_until(1, Duration::from_secs(10)).unwrap(), "the posted 0-byte write completed");
    assert_eq!(batch.failed(), 0);
    bounded(counter.wait_for(2)).await.expect("both immediates arrived");
    let group = a.peer_group(vec![dst.clone()]).unwrap();
    let e = [ScatterEntry { member: 0, src_off: 5, dst_off: 5, len: 0 }];
    bounded(a.scatter(&src, &group, &e, None)).await.expect("0-byte scatter entry");
    assert!(theirs.to_vec().iter().all(|&b| b == 0), "0-byte transfers moved nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_allocations_are_errors_not_aborts() {
    let a = Engine::builder().provider(primary()).build().unwrap();
    let e = a.alloc(0).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "alloc(0): {e}");
    let e = a.register_copy(Vec::new()).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "register(empty): {e}");
    for len in [1usize << 40, 1 << 62, usize::MAX - 4095, usize::MAX] {
        let e = a.alloc(len).await.unwrap_err();
        assert!(matches!(e, Error::RegisterMemory { len: l, .. } if l == len), "alloc({len}): {e}");
    }
    // The engine is fine afterwards.
    let r = a.alloc(1).await.expect("a 1-byte region");
    assert_eq!(r.len(), 1);
    assert_eq!(r.to_vec(), [0]);
}
