//! Batches (`Engine::batch`, the shape of a NIXL request): many writes, or many reads,
//! between several local and several remote regions in one call, over engines of 1 and 2
//! NICs, with every byte compared; and bad batches refused before anything is posted.
//!
//! The engines live in this one process; on libfabric the N NICs are N domains on loopback,
//! on verbs (the rxe VM, `FABRIC_TEST_PROVIDERS=verbs`) the devices in `RXE_VM_DEVICES`.

use std::time::Duration;

use fabric_async::{BatchEntry, BatchOp, Engine, Error, MemoryRegion, RemoteRegion, Side};
use integration_tests::{fill_pattern, nic_engine, pattern_byte};

const WAIT: Duration = Duration::from_secs(30);
const LEN: usize = 1 << 20;

/// An engine of `nics` NICs on the primary provider ([`nic_engine`]).
fn engine(nics: usize) -> Option<Engine> {
    nic_engine(nics)
}

async fn patterned(e: &Engine, seed: u64) -> MemoryRegion {
    let mut v = vec![0u8; LEN];
    fill_pattern(&mut v, seed, 0);
    e.register_copy(v).await.expect("register")
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// `n` pieces `(dst, dst_off, src, src_off, len)` over 2 destination and 2 source regions:
/// random lengths (1 B to 64 KiB) at random offsets, no two pieces overlapping in their
/// destination (each destination region cut into n/2 disjoint slots, one piece per slot,
/// taken in a shuffled order).
fn pieces(rng: &mut Rng, n: usize) -> Vec<(usize, u64, usize, u64, u64)> {
    let slots = n.div_ceil(2) as u64;
    let slot = LEN as u64 / slots;
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order
        .into_iter()
        .map(|k| {
            let len = 1 + rng.below(slot.min(64 << 10));
            let dst_off = (k as u64 / 2) * slot + rng.below(slot - len + 1);
            let src_off = rng.below(LEN as u64 - len + 1);
            (k % 2, dst_off, rng.below(2) as usize, src_off, len)
        })
        .collect()
}

async fn run(op: BatchOp, nics: usize, n: usize, seed: u64) {
    let Some(a) = engine(nics) else { return };
    let b = engine(nics).expect("second engine");
    // `a` posts; its regions are the local side, `b`'s the remote side.
    let local = [patterned(&a, seed).await, patterned(&a, seed + 1).await];
    let far = [patterned(&b, seed + 2).await, patterned(&b, seed + 3).await];
    let remote: Vec<RemoteRegion> = {
        let mut v = Vec::new();
        for r in &far {
            v.push(a.remote_region(&r.descriptor().to_bytes()).await.expect("remote region"));
        }
        v
    };
    let mut rng = Rng(seed | 1);
    // As (local, local_off, remote, remote_off, len): the destination is remote for a write.
    let list: Vec<(usize, u64, usize, u64, u64)> = pieces(&mut rng, n)
        .into_iter()
        .map(|(d, doff, s, soff, len)| match op {
            BatchOp::Write => (s, soff, d, doff, len),
            BatchOp::Read => (d, doff, s, soff, len),
        })
        .collect();
    let entries: Vec<BatchEntry<'_>> = list
        .iter()
        .map(|&(l, lo, r, ro, len)| BatchEntry {
            local: &local[l],
            local_off: lo,
            remote: &remote[r],
            remote_off: ro,
            len,
        })
        .collect();
    tokio::time::timeout(WAIT, a.batch(op, &entries)).await.expect("batch timed out").expect("batch");
    // The expected contents of the destination side, from the patterns.
    let (dst_regions, src_seed, dst_seed): (&[MemoryRegion; 2], u64, u64) = match op {
        BatchOp::Write => (&far, seed, seed + 2),
        BatchOp::Read => (&local, seed + 2, seed),
    };
    let mut want: Vec<Vec<u8>> = (0..2u64)
        .map(|i| {
            let mut v = vec![0u8; LEN];
            fill_pattern(&mut v, dst_seed + i, 0);
            v
        })
        .collect();
    for &(l, lo, r, ro, len) in &list {
        let (s, so, d, doff) = match op {
            BatchOp::Write => (l, lo, r, ro),
            BatchOp::Read => (r, ro, l, lo),
        };
        for i in 0..len {
            want[d][(doff + i) as usize] = pattern_byte(src_seed + s as u64, so + i);
        }
    }
    for (i, r) in dst_regions.iter().enumerate() {
        let got = r.to_vec();
        if let Some(at) = got.iter().zip(&want[i]).position(|(g, w)| g != w) {
            panic!(
                "{op:?}, {nics} NIC(s), {n} entries: region {i} byte {at} is {}, not {}",
                got[at], want[i][at]
            );
        }
    }
    eprintln!("{op:?}: {n} entries over {nics} NIC(s), every byte of 2 x {LEN} checked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_batches_move_every_entry() {
    for (nics, n, seed) in [(1, 1, 10), (1, 64, 20), (1, 2000, 30), (2, 500, 40)] {
        run(BatchOp::Write, nics, n, seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_batches_move_every_entry() {
    for (nics, n, seed) in [(1, 1, 50), (1, 64, 60), (1, 2000, 70), (2, 500, 80)] {
        run(BatchOp::Read, nics, n, seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_batches_are_refused_before_anything_is_posted() {
    let Some(a) = engine(1) else { return };
    let b = engine(1).unwrap();
    let src = a.alloc(1 << 16).await.unwrap();
    let dst = b.alloc(1 << 16).await.unwrap();
    let rdst = a.remote_region(&dst.descriptor().to_bytes()).await.unwrap();
    let entry =
        |local_off, remote_off, len| BatchEntry { local: &src, local_off, remote: &rdst, remote_off, len };
    // The second entry runs past the remote region: nothing of the first is posted either.
    let e = a.batch(BatchOp::Write, &[entry(0, 0, 8), entry(0, (1 << 16) - 4, 8)]).await.unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { side: Side::Remote, .. }), "{e}");
    let e = a.batch(BatchOp::Read, &[entry((1 << 16) - 4, 0, 8)]).await.unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { side: Side::Local, .. }), "{e}");
    // A region of another engine.
    let other = engine(1).unwrap();
    let foreign = other.alloc(4096).await.unwrap();
    let e = a
        .batch(
            BatchOp::Write,
            &[BatchEntry { local: &foreign, local_off: 0, remote: &rdst, remote_off: 0, len: 8 }],
        )
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(ref m) if m.contains("another engine")), "{e}");
    assert!(dst.to_vec().iter().all(|&x| x == 0), "a refused batch wrote into the target");
    // An empty batch, and zero-length entries, complete at once.
    a.batch(BatchOp::Write, &[]).await.expect("empty batch");
    a.batch(BatchOp::Read, &[entry(0, 0, 0)]).await.expect("zero-length entry");
}

/// Entries that continue each other on both sides (KV blocks laid out alike at both ends)
/// are posted as one operation per run: 250 blocks of 4 KiB in 3 runs (broken by a gap on
/// one side and by a change of remote region) are 3 operations, and every byte lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_entries_are_one_operation() {
    let Some(a) = engine(1) else { return };
    let b = engine(1).unwrap();
    let src = patterned(&a, 90).await;
    let far = [b.alloc(LEN).await.unwrap(), b.alloc(LEN).await.unwrap()];
    let rem = [
        a.remote_region(&far[0].descriptor().to_bytes()).await.unwrap(),
        a.remote_region(&far[1].descriptor().to_bytes()).await.unwrap(),
    ];
    const BLOCK: u64 = 4096;
    // Blocks 0..100 into region 0 at the same offsets; 100..175 into region 0 one block
    // further on (a gap on the remote side only); 175..250 into region 1.
    let place = |k: u64| match k {
        0..100 => (0, k * BLOCK),
        100..175 => (0, (k + 1) * BLOCK),
        _ => (1, (k - 175) * BLOCK),
    };
    let entries: Vec<BatchEntry<'_>> = (0..250u64)
        .map(|k| {
            let (r, off) = place(k);
            BatchEntry { local: &src, local_off: k * BLOCK, remote: &rem[r], remote_off: off, len: BLOCK }
        })
        .collect();
    let before = a.stats().total().posted_ops;
    tokio::time::timeout(WAIT, a.batch(BatchOp::Write, &entries)).await.expect("timed out").expect("batch");
    assert_eq!(a.stats().total().posted_ops - before, 3, "250 contiguous entries in 3 runs: 3 operations");
    let got = [far[0].to_vec(), far[1].to_vec()];
    for k in 0..250u64 {
        let (r, off) = place(k);
        for i in [0, BLOCK / 2, BLOCK - 1] {
            assert_eq!(got[r][(off + i) as usize], pattern_byte(90, k * BLOCK + i), "block {k} byte {i}");
        }
    }
    assert!(
        got[0][(100 * BLOCK) as usize..(101 * BLOCK) as usize].iter().all(|&x| x == 0),
        "the gap was written"
    );
}
