//! Staged transfers through a small staging pool, and the shapes beyond `write_imm` with a
//! GPU end: paged writes, scatters, and reads. Every test checks the bytes at the receiver
//! (hashed) and the exact arrival count (nothing left over after a settle).

use std::time::{Duration, Instant};

use fabric_async::{Engine, PageLayout, ScatterEntry};
use fabric_runtime::{Error, GpuPath, MemoryLocation};
use integration_tests::{hash, providers};

use super::{builder, gpu, libfabric_gpu_path, pattern, source, target, target_filled, CHILD_ENV, GPU, MIB};

/// Whether GPU regions of `provider` are registered with the NIC (GPUDirect through
/// libfabric's `FI_HMEM`): then they count arrivals as host memory does (per page, per entry).
fn direct(provider: &str) -> bool {
    libfabric_gpu_path(provider) == GpuPath::GpuDirect
}

const HOST: MemoryLocation = MemoryLocation::Host;

/// `provider` with a staging pool of `slots` x `chunk` bytes (see `builder`).
fn pooled(provider: &str, slots: usize, chunk: usize) -> String {
    format!("{provider}@{}/{chunk}", slots * chunk)
}

/// A 64 MiB (+ a ragged tail) write_imm through a pool of 2 x 1 MiB slots on both sides: 65
/// chunks through 2 slots, in every direction, over every provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_32x_the_pool_every_direction() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("region_32x_the_pool_every_direction") {
        return;
    }
    let len = 64 * MIB + 4099;
    for p in providers() {
        let prov = pooled(&p, 2, MIB);
        for (s, d) in [(HOST, GPU), (GPU, HOST), (GPU, GPU)] {
            let what = format!("{p} {s:?} -> {d:?} through 2 x 1 MiB");
            let engine = builder(&prov).cuda_ipc(false).build().expect("engine");
            let data = pattern(len, 0xb16 ^ len as u64);
            let src = source(&engine, s, &data).await;
            let arrivals =
                if d == HOST { engine.transfer_opts().write_arrivals(len as u64, 1).unwrap() } else { 1 };
            let (t, desc, _) = target(&prov, d, len, 21, arrivals).await;
            let dst = engine.remote_region(&desc).await.unwrap();
            assert_eq!(engine.write_arrivals(&dst, len as u64).unwrap(), arrivals, "{what}");
            let start = Instant::now();
            tokio::time::timeout(
                Duration::from_secs(120),
                engine.write_imm(&src, 0, &dst, 0, len as u64, 21),
            )
            .await
            .unwrap_or_else(|_| panic!("{what}: no completion in 120 s"))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let took = start.elapsed();
            let (h, extra) = t.finish().await;
            assert_eq!(h, hash(&data).to_string(), "{what}: bytes");
            assert_eq!(extra, 0, "{what}: exactly {arrivals} arrival(s)");
            println!("{what}: {:.2} GB/s", len as f64 / took.as_secs_f64() / 1e9);
        }
    }
}

/// write_paged with GPU ends (GPU -> GPU, host -> GPU, GPU -> host), pages larger than a
/// slot and a permuted page order: every page in place, untouched pages untouched, and
/// `paged_arrivals` exact (one into GPU memory, one per page into host memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_paged_with_gpu_ends() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("write_paged_with_gpu_ends") {
        return;
    }
    let page = 3 * MIB / 2; // a page spans two 1 MiB slots
    let layout = PageLayout::packed(page as u64);
    let (src_pages, dst_pages) = ([0u32, 1, 2, 3, 4], [7u32, 0, 5, 2, 3]);
    let (src_n, dst_n) = (5usize, 8usize);
    for p in providers() {
        let prov = pooled(&p, 2, MIB);
        for (s, d) in [(GPU, GPU), (HOST, GPU), (GPU, HOST)] {
            let what = format!("write_paged {p} {s:?} -> {d:?}");
            let engine = builder(&prov).cuda_ipc(false).build().expect("engine");
            let data = pattern(src_n * page, 0x9a9e);
            let src = source(&engine, s, &data).await;
            let per_page = if d == HOST || direct(&p) { src_pages.len() as u64 } else { 1 };
            let (t, desc, _) = target(&prov, d, dst_n * page, 31, per_page).await;
            let dst = engine.remote_region(&desc).await.unwrap();
            assert_eq!(engine.paged_arrivals(&dst, src_pages.len()).unwrap(), per_page, "{what}");
            tokio::time::timeout(
                Duration::from_secs(120),
                engine.write_paged(&src, &dst, &layout, &src_pages, &dst_pages, Some(31)),
            )
            .await
            .unwrap_or_else(|_| panic!("{what}: no completion in 120 s"))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut want = vec![0xEE; dst_n * page];
            for (sp, dp) in src_pages.iter().zip(&dst_pages) {
                let (sp, dp) = (*sp as usize * page, *dp as usize * page);
                want[dp..dp + page].copy_from_slice(&data[sp..sp + page]);
            }
            let (h, extra) = t.finish().await;
            assert_eq!(h, hash(&want).to_string(), "{what}: bytes");
            assert_eq!(extra, 0, "{what}: exactly {per_page} arrival(s)");
        }
    }
}

/// scatter with GPU ends: a GPU source into a GPU region named twice in the group (two
/// members, disjoint ranges: one arrival per member), and into a host region (as for
/// host memory); a host source into a GPU region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scatter_with_gpu_ends() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("scatter_with_gpu_ends") {
        return;
    }
    let len = 8 * MIB;
    for p in providers() {
        let prov = pooled(&p, 2, MIB);
        for (s, d) in [(GPU, GPU), (GPU, HOST), (HOST, GPU)] {
            let what = format!("scatter {p} {s:?} -> {d:?}");
            let engine = builder(&prov).cuda_ipc(false).build().expect("engine");
            let data = pattern(len, 0x5ca7);
            let src = source(&engine, s, &data).await;
            let entries = [
                ScatterEntry { member: 0, src_off: 0, dst_off: 4 * MIB as u64, len: 3 * MIB as u64 + 17 },
                ScatterEntry { member: 1, src_off: 3 * MIB as u64 + 17, dst_off: 0, len: 2 * MIB as u64 },
                ScatterEntry { member: 0, src_off: 6 * MIB as u64, dst_off: 2 * MIB as u64, len: 1000 },
            ];
            // Both members are the one child region: its counter sees both members'
            // arrivals. Into GPU memory one per member; into host memory one per entry (one
            // NIC: one shard each).
            let total: u64 = if d == GPU && !direct(&p) { 2 } else { entries.len() as u64 };
            let (t, desc, _) = target(&prov, d, len, 41, total).await;
            let m = engine.remote_region(&desc).await.unwrap();
            let group = engine.peer_group(vec![m.clone(), m]).unwrap();
            let per_member = engine.scatter_arrivals(&group, &entries).unwrap();
            assert_eq!(per_member.iter().sum::<u64>(), total, "{what}: scatter_arrivals {per_member:?}");
            tokio::time::timeout(Duration::from_secs(120), engine.scatter(&src, &group, &entries, Some(41)))
                .await
                .unwrap_or_else(|_| panic!("{what}: no completion in 120 s"))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut want = vec![0xEE; len];
            for e in &entries {
                let (so, dof, n) = (e.src_off as usize, e.dst_off as usize, e.len as usize);
                want[dof..dof + n].copy_from_slice(&data[so..so + n]);
            }
            let (h, extra) = t.finish().await;
            assert_eq!(h, hash(&want).to_string(), "{what}: bytes");
            assert_eq!(extra, 0, "{what}: exactly {total} arrivals");
        }
    }
}

/// read into a GPU region (staged: chunk reads into the pool, H2D) from a peer's host
/// region, 20 MiB through 2 x 1 MiB slots, bytes compared; a read from a peer's staged GPU
/// region into host memory (its owner pushes it through its slots), bytes compared; from
/// staged into staged GPU memory a clear `Unsupported`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_into_and_from_gpu() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("read_into_and_from_gpu") {
        return;
    }
    let len = 20 * MIB + 5;
    for p in providers() {
        let prov = pooled(&p, 2, MIB);
        let engine: Engine = builder(&prov).cuda_ipc(false).build().expect("engine");
        let (t, desc, _) = target_filled(&prov, HOST, len, 51, 0, Some(0x7ead)).await;
        let remote = engine.remote_region(&desc).await.unwrap();
        let local = engine.alloc_in(len + 4096, GPU).await.unwrap();
        tokio::time::timeout(Duration::from_secs(120), engine.read(&local, 4096, &remote, 0, len as u64))
            .await
            .unwrap_or_else(|_| panic!("read {p}: no completion in 120 s"))
            .unwrap_or_else(|e| panic!("read {p}: {e}"));
        let mut back = vec![0u8; len];
        local.read_at(4096, &mut back).unwrap();
        assert!(back == pattern(len, 0x7ead), "read {p}: bytes in GPU memory");
        let (_, extra) = t.finish().await;
        assert_eq!(extra, 0, "reads count nothing");

        let (t, desc, _) = target_filled(&prov, GPU, len, 52, 0, Some(0x9e7)).await;
        let remote = engine.remote_region(&desc).await.unwrap();
        let host = engine.alloc(len + 7).await.unwrap();
        tokio::time::timeout(Duration::from_secs(120), engine.read(&host, 7, &remote, 0, len as u64))
            .await
            .unwrap_or_else(|_| panic!("read from GPU {p}: no completion in 120 s"))
            .unwrap_or_else(|e| panic!("read from GPU {p}: {e}"));
        assert!(host.to_vec()[7..] == pattern(len, 0x9e7)[..], "read from GPU {p}: bytes");
        let gpu_dst = engine.alloc_in(MIB, GPU).await.unwrap();
        if direct(&p) {
            // Both ends registered with the NIC: a GPU-to-GPU read is one RDMA read.
            engine.read(&gpu_dst, 0, &remote, 0, 4096).await.unwrap_or_else(|e| panic!("{p}: {e}"));
            let mut back = vec![0u8; 4096];
            gpu_dst.read_at(0, &mut back).unwrap();
            assert!(back[..] == pattern(len, 0x9e7)[..4096], "read GPU to GPU {p}: bytes");
        } else {
            let e = engine.read(&gpu_dst, 0, &remote, 0, 4096).await.unwrap_err();
            assert!(matches!(&e, Error::Unsupported(m) if m.contains("staged GPU memory")), "{p}: {e}");
        }
        t.finish().await;
        println!("read {p}: {} MiB into and out of GPU memory, bytes equal", len / MIB);
    }
}
