//! Remote memory safety: a descriptor outlives its region only as a dead key. A write
//! through the descriptor of a dropped region fails at the writer with a typed error (or,
//! racing the revocation on shm, lands in the dropped region, which its owner keeps until the
//! writer has acknowledged the revocation) and never lands in memory the owner reuses for a
//! new region (see `docs/security.md`).

use std::time::Duration;

use fabric_async::{Engine, Error, MemoryRegion};
use integration_tests::providers;

/// Region sizes. Each region is its own mapping; without the engine's retired ranges the
/// kernel places a new mapping of the same size in the hole the dropped one left (which is
/// how this test fails when `sys::retire_mapping` merely unmaps). 4 MiB: a region aligned to
/// huge pages (`EngineBuilder::huge_pages`, on by default), mapped with slack around it.
const LENS: [usize; 2] = [64 * 1024, 4 << 20];
/// How many regions of the same size the owner allocates after dropping the first.
const REALLOCS: usize = 8;

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("answered within 30 s")
}

fn all_zero(r: &MemoryRegion) -> bool {
    r.to_vec().iter().all(|&b| b == 0)
}

/// Rounds per provider, each with a fresh writer (a stale write may leave the writer's
/// peer marked failed, see `docs/security.md`, and each round must reach the owner again).
const ROUNDS: usize = 3;
/// How long a write without delivery-complete may take to be placed after its completion.
const SETTLE: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_descriptor_never_lands_in_a_reused_region() {
    for (p, len) in providers().into_iter().flat_map(|p| LENS.map(|len| (p.clone(), len))) {
        // A short op_timeout bounds the worst case (shm: see docs/security.md).
        let timeout = Some(Duration::from_secs(3));
        let owner = Engine::builder().provider(p.as_str()).op_timeout(timeout).build().unwrap();
        let mut reused = 0;
        // Every round's writer lives to the end of the provider's rounds: the owner and the
        // writers are engines of this one process, and on shm an engine that closes while
        // another still has it as a peer leaves libfabric 1.17 a pointer to its unmapped
        // region (docs/faults.md, "Engines of one process"), which the owner's provider may
        // still write through, into whatever is mapped there next (a new region here).
        let mut writers = Vec::new();
        let mut outcomes = Vec::new();
        for round in 0..ROUNDS {
            let writer = Engine::builder().provider(p.as_str()).op_timeout(timeout).build().unwrap();
            writers.push(writer.clone());
            let src = writer.alloc(len).await.unwrap();
            src.write_at(0, &vec![0xA5; len]).unwrap();

            // A live region first: the path works and the peer is connected.
            let first = owner.alloc(len).await.unwrap();
            let first_addr = first.as_ptr() as u64;
            let stale = writer.remote_region(&first.descriptor().to_bytes()).await.unwrap();
            bounded(writer.write(&src, 0, &stale, 0, 64)).await.expect("a write to a live region");
            // Without delivery-complete writes (shm) the completion means the write was
            // handed over, not placed (docs/transfers.md): wait for the bytes, bounded.
            let t = std::time::Instant::now();
            while first.to_vec()[..64] != [0xA5; 64] && !writer.delivery_complete() && t.elapsed() < SETTLE {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert_eq!(first.to_vec()[..64], [0xA5; 64], "{p}: the live write landed");
            drop(first);

            // New regions of the same size, where the allocator would like to put them.
            let mut fresh = Vec::new();
            for _ in 0..REALLOCS {
                let r = owner.alloc(len).await.unwrap();
                reused += usize::from(r.as_ptr() as u64 == first_addr);
                fresh.push(r);
            }
            let r = bounded(writer.write(&src, 0, &stale, 0, len as u64)).await;
            // Let anything still in flight land before looking.
            tokio::time::sleep(Duration::from_millis(50)).await;
            for (j, r) in fresh.iter().enumerate() {
                assert!(all_zero(r), "{p} {len}: round {round}: the stale write landed in new region {j}");
            }
            // Revoked by the owner before it was posted (`Stale`), or racing the revocation
            // (docs/faults.md). On shm the owner keeps a freed region registered, and its
            // memory, until the writer has acknowledged the revocation, which it does once
            // what it posted before is done: a racing write lands in the freed region (never
            // in a new one: checked above) and completes `Ok`; nothing else is possible on
            // libfabric 1.17. libfabric >= 1.18's shm refuses a racing write that does not
            // take its CMA path without telling the writer: it completes `Ok` and lands
            // nowhere (docs/faults.md, "libfabric versions"). tcp: `Stale`, or the owner's
            // provider refuses the key and closes the connection.
            let shm = p.starts_with("shm");
            let ok = match &r {
                Err(Error::Stale { .. }) | Ok(()) if shm => true,
                Err(Error::RemoteAccess { .. } | Error::ConnectionLost { .. }) if shm => {
                    fabric_runtime::provider::libfabric::version() >= (1, 18)
                }
                Err(Error::Stale { .. } | Error::RemoteAccess { .. } | Error::ConnectionLost { .. }) => true,
                _ => false,
            };
            assert!(ok, "{p} {len}: round {round}: a write through a stale descriptor: {r:?}");
            outcomes.push(if r.is_ok() { "Ok" } else { "Stale/refused" });
        }
        eprintln!(
            "{p}, {len} B: {reused} of {} new regions were placed at a dropped region's address; the stale writes: {outcomes:?}",
            ROUNDS * REALLOCS
        );
        // The owner first, then every writer, with nothing allocated in between.
        drop(owner);
        drop(writers);
    }
}

/// Two engines do not hand out the same keys: libfabric keys start at a random value per
/// domain, so a later engine (which may get an earlier one's address, its port) does not
/// accept the descriptors of the earlier one. Verbs keys are the NIC's own, so the check is
/// for libfabric providers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_do_not_share_keys() {
    for p in providers() {
        if p.starts_with("verbs") {
            integration_tests::skipped("engines_do_not_share_keys", "verbs: NIC-chosen keys");
            continue;
        }
        let (mut keys, mut engines) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            let e = Engine::builder().provider(p.as_str()).build().unwrap();
            let mut mine = Vec::new();
            for _ in 0..4 {
                let r = e.alloc(4096).await.unwrap();
                mine.push(r.descriptor().domains[0].key);
            }
            keys.push(mine);
            engines.push(e);
        }
        assert!(keys[0].iter().all(|k| !keys[1].contains(k)), "{p}: keys of two engines overlap: {keys:?}");
    }
}
