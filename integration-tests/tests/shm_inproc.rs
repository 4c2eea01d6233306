//! shm engines of one process: an owner lives through every round, and each round a writer
//! engine is made, writes to the owner (writes with immediate and plain writes, small and
//! large) and is dropped while the owner goes on. libfabric 1.17's shm keeps, for a peer in
//! the same process, a pointer to that peer's own region; a writer that closed while the
//! owner still had it as a peer left the owner's provider writing through that pointer into
//! whatever was mapped there next (docs/faults.md, "Engines of one process"). Here the owner
//! checks, every round, that its regions hold exactly the bytes written to them and nothing
//! else: the ones written this round, the ones it keeps from earlier rounds, and fresh ones
//! allocated after the writer closed (where a closed region's range is likely to be reused).

use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use fabric_async::{Engine, MemoryRegion};

/// Rounds, each with a fresh writer; bounded in time too.
const ROUNDS: usize = 10;
const TIME_LIMIT: Duration = Duration::from_secs(60);
/// The owner's target region per round: a large write with immediate (shm's iov path, whose
/// response the owner's provider writes into the writer's region), a small one, plain writes.
const LEN: usize = 256 * 1024;
/// Fresh regions the owner allocates after each writer is gone, of the size of an shm region
/// (16 MiB: where a closed endpoint's region was is where they may land) and smaller.
const FRESH: [usize; 3] = [16 << 20, 4 << 20, 64 * 1024];
/// How long a write without delivery-complete may take to be placed after its completion.
const SETTLE: Duration = Duration::from_secs(2);

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("answered within 30 s")
}

fn digest(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// What a round writes: byte `i` of the round's target region.
fn pattern(round: usize, i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(round as u8).wrapping_add(1) | 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_dropped_one_per_round_leave_the_owner_untouched() {
    let t0 = Instant::now();
    let owner = Engine::builder().provider("shm").build().expect("owner");
    // Regions of earlier rounds with their digests: they must not change afterwards.
    let mut kept: Vec<(usize, MemoryRegion, u64)> = Vec::new();
    let mut rounds = 0;
    for round in 0..ROUNDS {
        if t0.elapsed() > TIME_LIMIT {
            break;
        }
        rounds += 1;
        let writer = Engine::builder().provider("shm").build().expect("writer");
        let dst = owner.alloc(LEN).await.unwrap();
        let expect: Vec<u8> = (0..LEN).map(|i| pattern(round, i)).collect();
        let src = writer.register_copy(expect.clone()).await.unwrap();
        let remote = writer.remote_region(&dst.descriptor().to_bytes()).await.unwrap();
        let imm = 1000 + round as u32;
        let counter = owner.imm_counter(imm);
        // The first half: one large write with immediate, then small ones with immediate;
        // the second half: plain writes of several sizes.
        let half = LEN / 2;
        bounded(writer.write_imm(&src, 0, &remote, 0, (half - 4096) as u64, imm))
            .await
            .expect("large write_imm");
        for k in 0..4 {
            let off = (half - 4096 + k * 1024) as u64;
            bounded(writer.write_imm(&src, off, &remote, off, 1024, imm)).await.expect("small write_imm");
        }
        let mut off = half;
        for len in [8, 4096, 60 * 1024, half - 8 - 4096 - 60 * 1024] {
            bounded(writer.write(&src, off as u64, &remote, off as u64, len as u64)).await.expect("write");
            off += len;
        }
        assert_eq!(off, LEN);
        assert!(bounded(async { counter.wait_for(5).await.is_ok() }).await, "round {round}: 5 arrivals");
        let t = Instant::now();
        while dst.to_vec() != expect && t.elapsed() < SETTLE {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(dst.to_vec() == expect, "round {round}: the bytes written landed, exactly");
        // A region the owner frees while the writer still is its peer: a revocation goes out.
        drop(owner.alloc(64 * 1024).await.unwrap());
        // The writer goes; the owner stays.
        writer.shutdown();
        drop((src, remote, counter));
        drop(writer);
        let mut fresh = Vec::new();
        for len in FRESH {
            fresh.push(owner.alloc(len).await.unwrap());
        }
        // Give the owner's provider the time to do what it would still do.
        tokio::time::sleep(Duration::from_millis(20)).await;
        for (j, r) in fresh.iter().enumerate() {
            assert!(r.to_vec().iter().all(|&b| b == 0), "round {round}: fresh region {j} changed");
        }
        assert!(dst.to_vec() == expect, "round {round}: the written region changed after the writer left");
        for (r, region, d) in &kept {
            assert_eq!(digest(&region.to_vec()), *d, "round {round}: the region of round {r} changed");
        }
        let d = digest(&expect);
        kept.push((round, dst, d));
        // The fresh regions go; a later round's may be placed where they were.
        drop(fresh);
    }
    eprintln!("{rounds} rounds in {:?}", t0.elapsed());
    assert!(rounds >= 3, "at least 3 rounds ran");
    owner.shutdown();
    drop(kept);
}
