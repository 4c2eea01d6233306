//! The fast GPU path: 1000 writes of random sizes (1 B to 4 MiB) at random unaligned offsets
//! into one GPU region, through CUDA IPC and staged, every byte compared after each round of
//! 100; many small blocks in one `write_paged` through CUDA IPC (one gate, one arrival);
//! such a batch dropped right after its first poll (its bytes still land, nothing it uses is
//! freed under the copy engine); and the per-stage breakdown of one 64 KiB IPC `write_imm`
//! (`gpu_ipc_breakdown`, a report: `--nocapture` prints it).
//!
//! The receiving process is this binary again, as `batch::gpu_rounds_child`: it publishes
//! its region's descriptor, then per round waits for the round's arrivals and publishes the
//! hash of its whole region (or, in timing mode, when each arrival came).

use std::time::{Duration, Instant};

use fabric_async::bootstrap::{Rendezvous, TcpStore};
use fabric_async::PageLayout;
use fabric_runtime::{cuda, Error, GpuPath, MemoryLocation};
use integration_tests::{get, get_str, hash, store};

use super::{builder, gpu, loc_name, loc_parse, pattern, source, two_gpus, ChildProc, GPU, GPU1, MIB};

const ROUNDS_ENV: &str = "FABRIC_GPU_ROUNDS_CHILD";

/// Monotonic ns, comparable between the processes of one host.
fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Log-uniform in 1..=max: as many tiny writes as large ones.
    fn size(&mut self, max: u64) -> u64 {
        let bits = 64 - max.leading_zeros() as u64;
        let b = self.below(bits) + 1;
        (self.below(1 << b) + 1).min(max)
    }
}

/// The child: `store|provider|loc|size|imm|mode` (`mode`: `hash` or `times`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_rounds_child() {
    let Ok(spec) = std::env::var(ROUNDS_ENV) else { return };
    let f: Vec<&str> = spec.split('|').collect();
    let [addr, provider, loc, size, imm, mode] = f[..] else { panic!("bad child spec {spec}") };
    let store = TcpStore::connect(addr.parse().unwrap()).await.expect("store");
    let r = async {
        let engine = builder(provider).build()?;
        let size: usize = size.parse().unwrap();
        let region = engine.alloc_in(size, loc_parse(loc)).await?;
        region.write_at(0, &vec![0u8; size])?;
        // A plain device buffer of the same size, exported for the breakdown's baseline: the
        // writer's own copy into a CUDA IPC mapping, without the engine.
        let _raw = match loc_parse(loc) {
            MemoryLocation::Cuda { ordinal } => {
                let b = cuda::DeviceBuffer::new(&cuda::context(ordinal as usize)?, size)?;
                let export = b.ipc_export(0, size)?;
                store.put("rawipc", export.to_bytes().to_vec()).await.unwrap();
                Some(b)
            }
            _ => None,
        };
        // A host region too: the breakdown's transport floor is a lone 8 B host write_imm into it.
        let host = engine.alloc(4096).await?;
        store.put("hostdesc", host.descriptor().to_bytes()).await.unwrap();
        store.put("desc", region.descriptor().to_bytes()).await.unwrap();
        let counter = engine.imm_counter(imm.parse().unwrap());
        for round in 0.. {
            let n = get_str(&store, &format!("r{round}/count")).await;
            if n == "end" {
                break;
            }
            let n: u64 = n.parse().unwrap();
            let mut times = Vec::new();
            let deadline = Duration::from_secs(120);
            if mode == "times" || mode == "spin" {
                for _ in 0..n {
                    if mode == "spin" {
                        // The synchronous spin path: this thread drives the NICs until the
                        // arrival is counted (a `BusyPoll` engine), no wake-up on the path.
                        let c = counter.clone();
                        let ok = tokio::task::block_in_place(move || c.spin_wait(1, deadline));
                        if !ok {
                            return Err(Error::Config("no arrival in 120 s".into()));
                        }
                    } else {
                        tokio::time::timeout(deadline, counter.wait_for(1))
                            .await
                            .map_err(|_| Error::Config("no arrival in 120 s".into()))??;
                    }
                    times.push(mono_ns().to_string());
                }
                store.put(&format!("r{round}/times"), times.join(",").into_bytes()).await.unwrap();
                continue;
            }
            tokio::time::timeout(deadline, counter.wait_for(n)).await.map_err(|_| {
                Error::Config(format!("round {round}: {} of {n} arrivals in 120 s", counter.available()))
            })??;
            let mut bytes = vec![0u8; size];
            region.read_at(0, &mut bytes)?;
            store.put(&format!("r{round}/hash"), hash(&bytes).to_string().into_bytes()).await.unwrap();
        }
        // Nothing beyond what was announced.
        tokio::time::sleep(Duration::from_millis(200)).await;
        store.put("extra", counter.available().to_string().into_bytes()).await.unwrap();
        Ok::<_, Error>(())
    }
    .await;
    if let Err(e) = r {
        store.put("error", e.to_string().into_bytes()).await.unwrap();
        panic!("gpu rounds child: {e}");
    }
}

struct Rounds {
    child: ChildProc,
    store: TcpStore,
    _server: fabric_async::bootstrap::TcpStoreServer,
    round: u64,
}

impl Rounds {
    async fn start(
        provider: &str,
        loc: MemoryLocation,
        size: usize,
        imm: u32,
        mode: &str,
    ) -> (Rounds, Vec<u8>) {
        let (server, store, addr) = store().await;
        let c = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "batch::gpu_rounds_child", "--nocapture", "--test-threads", "1"])
            .env(ROUNDS_ENV, format!("{addr}|{provider}|{}|{size}|{imm}|{mode}", loc_name(loc)))
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("re-run this test binary as the child");
        let desc = get(&store, "desc").await;
        (Rounds { child: ChildProc(Some(c)), store, _server: server, round: 0 }, desc)
    }

    /// Announces a round of `n` arrivals; returns the child's answer under `what`.
    async fn round(&mut self, n: u64, what: &str) -> String {
        let r = self.round;
        self.round += 1;
        self.store.put(&format!("r{r}/count"), n.to_string().into_bytes()).await.unwrap();
        get_str(&self.store, &format!("r{r}/{what}")).await
    }

    async fn end(mut self) -> u64 {
        let r = self.round;
        self.store.put(&format!("r{r}/count"), b"end".to_vec()).await.unwrap();
        let extra: u64 = get_str(&self.store, "extra").await.parse().unwrap();
        assert!(self.child.wait_success(Duration::from_secs(30)).await, "child failed");
        extra
    }
}

/// 10 rounds of 100 concurrent writes (sizes 1 B .. 4 MiB, log-uniform; unaligned source
/// and destination offsets; no two overlapping in a round) from a GPU region into the
/// child's GPU region; after each round the child's whole region is compared (hash) with
/// the writer's copy of what it must hold.
async fn random_writes(test: &str, provider: &str, ipc: bool, dst_loc: MemoryLocation) {
    const ROUNDS: usize = 10;
    const PER_ROUND: usize = 100;
    const MAX: u64 = 4 << 20;
    let dst_len = 64 * MIB;
    let src_len = 8 * MIB + 77;
    let imm = 0x7a11;
    let engine = builder(provider).cuda_ipc(ipc).build().expect("engine");
    let src_bytes = pattern(src_len, 0xfeed);
    let src = source(&engine, GPU, &src_bytes).await;
    let (mut child, desc) = Rounds::start(provider, dst_loc, dst_len, imm, "hash").await;
    let dst = engine.remote_region(&desc).await.expect("remote region");
    let want = if ipc { GpuPath::Ipc } else { super::libfabric_gpu_path(provider) };
    assert_eq!(dst.gpu_path(), Some(want), "{test}: the writer's path");
    let mut shadow = vec![0u8; dst_len];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(ipc));
    let started = Instant::now();
    for round in 0..ROUNDS {
        // Destination ranges laid out one after another with random gaps, then shuffled.
        let mut writes = Vec::with_capacity(PER_ROUND);
        let mut at = rng.below(4096);
        for _ in 0..PER_ROUND {
            let len = rng.size(MAX);
            if at + len > dst_len as u64 {
                break;
            }
            let src_off = rng.below(src_len as u64 - len + 1);
            writes.push((src_off, at, len));
            at += len + rng.below(8192);
        }
        for i in (1..writes.len()).rev() {
            writes.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut arrivals = 0;
        let mut futs = Vec::with_capacity(writes.len());
        for &(so, doff, len) in &writes {
            arrivals += engine.write_arrivals(&dst, len).unwrap();
            futs.push(engine.write_imm(&src, so, &dst, doff, len, imm));
            shadow[doff as usize..(doff + len) as usize]
                .copy_from_slice(&src_bytes[so as usize..(so + len) as usize]);
        }
        for (k, r) in futures::future::join_all(futs).await.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("{test}: round {round} write {k} {:?}: {e}", writes[k]));
        }
        let h = child.round(arrivals, "hash").await;
        assert_eq!(h, hash(&shadow).to_string(), "{test}: bytes after round {round}");
    }
    let extra = child.end().await;
    assert_eq!(extra, 0, "{test}: arrivals beyond the announced ones");
    println!("{test}: {} writes in {:?}", ROUNDS * PER_ROUND, started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_cuda_ipc() {
    if std::env::var_os(ROUNDS_ENV).is_some() || !gpu("random_writes_cuda_ipc") {
        return;
    }
    random_writes("random_writes_cuda_ipc", "shm", true, GPU).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_staged() {
    if std::env::var_os(ROUNDS_ENV).is_some() || !gpu("random_writes_staged") {
        return;
    }
    // Small slots, so that writes share them and large ones cross several.
    random_writes("random_writes_staged", "shm@4194304/524288", false, GPU).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_two_gpus_cuda_ipc() {
    if std::env::var_os(ROUNDS_ENV).is_some() || !two_gpus("random_writes_two_gpus_cuda_ipc") {
        return;
    }
    random_writes("random_writes_two_gpus_cuda_ipc", "shm", true, GPU1).await;
}

/// `pages` permuted blocks of `page` bytes in one `write_paged` through CUDA IPC: one
/// arrival, every written page right, every other page untouched. With `drop_early` the
/// future and the source region are dropped right after the first poll.
async fn paged_ipc(test: &str, pages: u32, page: u64, drop_early: bool) {
    let imm = 0xb10c;
    let region_pages = pages * 2;
    let len = (u64::from(region_pages) * page) as usize;
    let engine = builder("shm").build().expect("engine");
    let data = pattern(len, 0xcafe);
    let src = source(&engine, GPU, &data).await;
    let (mut child, desc) = Rounds::start("shm", receiver_gpu(), len, imm, "hash").await;
    let dst = engine.remote_region(&desc).await.unwrap();
    assert_eq!(dst.gpu_path(), Some(GpuPath::Ipc), "{test}");
    let layout = PageLayout::packed(page);
    let mut rng = Rng(7 + u64::from(pages));
    // Source pages 0..pages, into a shuffled half of the destination's pages.
    let src_pages: Vec<u32> = (0..pages).collect();
    let mut all: Vec<u32> = (0..region_pages).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let dst_pages: Vec<u32> = all[..pages as usize].to_vec();
    assert_eq!(engine.paged_arrivals(&dst, pages as usize).unwrap(), 1, "{test}: one arrival");
    let mut shadow = vec![0u8; len];
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        let (s, d) = (u64::from(*s) * page, u64::from(*d) * page);
        shadow[d as usize..(d + page) as usize].copy_from_slice(&data[s as usize..(s + page) as usize]);
    }
    let fut = engine.write_paged(&src, &dst, &layout, &src_pages, &dst_pages, Some(imm));
    let started = Instant::now();
    if drop_early {
        let mut fut = Box::pin(fut);
        let _ = futures::poll!(fut.as_mut());
        drop(fut);
        drop(src);
    } else {
        tokio::time::timeout(Duration::from_secs(60), fut).await.expect("no completion in 60 s").unwrap();
    }
    let took = started.elapsed();
    let h = child.round(1, "hash").await;
    assert_eq!(h, hash(&shadow).to_string(), "{test}: bytes");
    assert_eq!(child.end().await, 0, "{test}: exactly one arrival");
    let stats = engine.stats().gpu;
    println!("{test}: {pages} x {page} B in {took:?}; gates {}, copies {}", stats.gates, stats.copies);
    assert!(stats.copies >= u64::from(pages), "{test}: every page a copy ({stats:?})");
}

/// The receiver's GPU: 1 where two exist, else 0.
fn receiver_gpu() -> MemoryLocation {
    if cuda::available().unwrap_or(0) >= 2 {
        GPU1
    } else {
        GPU
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_paged_many_blocks_cuda_ipc() {
    if std::env::var_os(ROUNDS_ENV).is_some() || !gpu("write_paged_many_blocks_cuda_ipc") {
        return;
    }
    paged_ipc("write_paged 512 x 16 KiB", 512, 16 << 10, false).await;
    paged_ipc("write_paged 64 x 64 KiB + 3", 64, (64 << 10) + 3, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_paged_batch_frees_nothing_in_use() {
    if std::env::var_os(ROUNDS_ENV).is_some() || !gpu("dropped_paged_batch_frees_nothing_in_use") {
        return;
    }
    paged_ipc("dropped write_paged 1024 x 64 KiB", 1024, 64 << 10, true).await;
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One 64 KiB `write_imm` GPU0 -> GPU1 (GPU0 -> GPU0 with one GPU) through CUDA IPC, 300
/// times one at a time: the call to the receiver's counter, against the copy's own time,
/// with the engine's per-stage breakdown (`EngineStats::gpu`). A report: it asserts bytes
/// and counts, never times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_ipc_breakdown() {
    if std::env::var_os(ROUNDS_ENV).is_some() || !gpu("gpu_ipc_breakdown") {
        return;
    }
    const N: usize = 300;
    let size = 64 << 10;
    let imm = 0xb0d;
    let dst_loc = receiver_gpu();
    let ordinal = match dst_loc {
        MemoryLocation::Cuda { ordinal } => ordinal as usize,
        _ => 0,
    };
    // The copy's own time: a 64 KiB peer copy, enqueue to synchronize, one at a time: back
    // to back (the device busy), and with the same 200 us idle between copies as the engine's
    // operations below have (a lone copy on an idle device pays a cold submission).
    let (copy_hot_us, copy_us, copy_enqueue_us) = {
        let c0 = cuda::context(0).unwrap();
        let c1 = cuda::context(ordinal).unwrap();
        if ordinal != 0 && c0.can_access_peer(&c1).unwrap() {
            c0.enable_peer_access(&c1).unwrap();
        }
        let a = std::sync::Arc::new(cuda::DeviceBuffer::new(&c0, size).unwrap());
        let b = std::sync::Arc::new(cuda::DeviceBuffer::new(&c1, size).unwrap());
        let s = cuda::Stream::new(&c0).unwrap();
        // `unified`: `cuMemcpyDtoDAsync` of the two pointers (as the engine's copy into an IPC
        // mapping), else `cuMemcpyPeerAsync` with both contexts.
        let run = |idle: bool, unified: bool| {
            let (mut total, mut enq) = (Vec::new(), Vec::new());
            for _ in 0..N {
                if idle {
                    std::thread::sleep(Duration::from_micros(200));
                }
                let t = Instant::now();
                if unified {
                    // SAFETY: both buffers are live device memory of `size` bytes, alive
                    // until the synchronize below; peer access was enabled (or one device).
                    unsafe { s.copy_d2d_raw(b.device_ptr(), a.device_ptr(), size).unwrap() };
                } else {
                    s.copy_d2d(&b, 0, &a, 0, size).unwrap();
                }
                enq.push(t.elapsed().as_secs_f64() * 1e6);
                s.synchronize().unwrap();
                total.push(t.elapsed().as_secs_f64() * 1e6);
            }
            (pct(&mut total, 0.5), pct(&mut enq, 0.5))
        };
        let (hot, _) = run(false, false);
        let (idle, enqueue) = run(true, false);
        let (uni, uni_enqueue) = run(true, true);
        println!(
            "gpu_ipc_breakdown: a lone 64 KiB copy after 200 us idle: cuMemcpyPeerAsync {idle:.1} us (enqueue \
             {enqueue:.1}), cuMemcpyDtoDAsync {uni:.1} us (enqueue {uni_enqueue:.1}); back to back {hot:.1} us"
        );
        (hot, idle, enqueue)
    };
    // Event engines; BusyPoll engines whose receiver awaits; and a receiver that spins on its
    // counter (`spin_wait`), the engine's floor without a wake-up on the receiving side.
    let mut ipc_copy: Option<f64> = None;
    for (provider, mode) in [("shm", "times"), ("shm!busy", "times"), ("shm!busy", "spin")] {
        let engine = builder(provider).build().expect("engine");
        let src = source(&engine, GPU, &pattern(size, 3)).await;
        let (mut child, desc) = Rounds::start(provider, dst_loc, size, imm, mode).await;
        let dst = engine.remote_region(&desc).await.unwrap();
        assert_eq!(dst.gpu_path(), Some(GpuPath::Ipc));
        if ipc_copy.is_none() {
            // The copy the engine makes, alone: GPU0 into another process's buffer through
            // its CUDA IPC mapping (cuMemcpyDtoDAsync), after the same 200 us idle.
            let export = cuda::IpcExport::from_bytes(&get(&child.store, "rawipc").await).unwrap();
            let c0 = cuda::context(0).unwrap();
            let mapping = cuda::IpcMapping::open(&c0, &export).unwrap();
            let a = cuda::DeviceBuffer::new(&c0, size).unwrap();
            let s = cuda::Stream::new(&c0).unwrap();
            let (mut total, mut enq) = (Vec::new(), Vec::new());
            for _ in 0..N {
                std::thread::sleep(Duration::from_micros(200));
                let t = Instant::now();
                // SAFETY: `a` and the mapping are live device memory of `size` bytes until the
                // synchronize below.
                unsafe { s.copy_d2d_raw(mapping.base(), a.device_ptr(), size).unwrap() };
                enq.push(t.elapsed().as_secs_f64() * 1e6);
                s.synchronize().unwrap();
                total.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let (t50, e50) = (pct(&mut total, 0.5), pct(&mut enq, 0.5));
            println!(
                "gpu_ipc_breakdown: a lone 64 KiB copy into a CUDA IPC mapping (another process's buffer) after 200 us idle: \
                 {t50:.1} us (enqueue {e50:.1})"
            );
            ipc_copy = Some(t50);
        }
        // Warm-up (mapping opened, streams created), then the timed run.
        engine.write_imm(&src, 0, &dst, 0, size as u64, imm).await.unwrap();
        let warm = child.round(1, "times").await;
        assert!(!warm.is_empty());
        let before = engine.stats().gpu;
        let key = format!("r{}/count", child.round);
        child.store.put(&key, N.to_string().into_bytes()).await.unwrap();
        let mut calls = Vec::with_capacity(N);
        let mut fut_us = Vec::with_capacity(N);
        // Per operation: plan, hand-off, enqueue, copy seen done, signal posted (us).
        let mut stages: [Vec<f64>; 5] = Default::default();
        for _ in 0..N {
            let b = engine.stats().gpu;
            let t = Instant::now();
            calls.push(mono_ns());
            engine.write_imm(&src, 0, &dst, 0, size as u64, imm).await.unwrap();
            fut_us.push(t.elapsed().as_secs_f64() * 1e6);
            let a = engine.stats().gpu;
            let us = |x: Duration, y: Duration| (x - y).as_secs_f64() * 1e6;
            for (v, x) in stages.iter_mut().zip([
                us(a.plan, b.plan),
                us(a.handoff, b.handoff),
                us(a.enqueue, b.enqueue),
                us(a.copy, b.copy),
                us(a.signal, b.signal),
            ]) {
                v.push(x);
            }
            // One at a time, and the receiver idle in between as a lone request finds it.
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let [p50_plan, h50, e50, c50, s50] = stages.map(|mut v| pct(&mut v, 0.5));
        let times = get_str(&child.store, &format!("r{}/times", child.round)).await;
        child.round += 1;
        let recv: Vec<u64> = times.split(',').map(|t| t.parse().unwrap()).collect();
        assert_eq!(recv.len(), N, "every arrival counted");
        let mut one_way: Vec<f64> =
            recv.iter().zip(&calls).map(|(r, c)| r.saturating_sub(*c) as f64 / 1e3).collect();
        let after = engine.stats().gpu;
        let per = |a: Duration, b: Duration| (a - b).as_secs_f64() * 1e6 / N as f64;
        let (handoff, enqueue, copy, signal) = (
            per(after.handoff, before.handoff),
            per(after.enqueue, before.enqueue),
            per(after.copy, before.copy),
            per(after.signal, before.signal),
        );
        // The transport's own share: a lone 8 B write_imm host -> host between the same two
        // engines (same imm, same counter, same idle), call -> the receiver's counter. The
        // imm-only write after an IPC copy is this operation with no bytes.
        let host_dst = engine.remote_region(&get(&child.store, "hostdesc").await).await.unwrap();
        let host_src = engine.alloc(4096).await.unwrap();
        let key = format!("r{}/count", child.round);
        child.store.put(&key, N.to_string().into_bytes()).await.unwrap();
        let mut host_calls = Vec::with_capacity(N);
        for _ in 0..N {
            host_calls.push(mono_ns());
            engine.write_imm(&host_src, 0, &host_dst, 0, 8, imm).await.unwrap();
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let host_times = get_str(&child.store, &format!("r{}/times", child.round)).await;
        child.round += 1;
        let host_recv: Vec<u64> = host_times.split(',').map(|t| t.parse().unwrap()).collect();
        assert_eq!(host_recv.len(), N, "every host arrival counted");
        let mut host_one_way: Vec<f64> =
            host_recv.iter().zip(&host_calls).map(|(r, c)| r.saturating_sub(*c) as f64 / 1e3).collect();
        let floor = pct(&mut host_one_way, 0.5);
        let fut_p50 = pct(&mut fut_us, 0.5);
        let ipc = ipc_copy.unwrap_or(copy_us);
        let p50 = pct(&mut one_way, 0.5);
        let p90 = pct(&mut one_way, 0.9);
        println!(
            "gpu_ipc_breakdown {provider} (receiver: {mode}) cuda:0->{}: 64 KiB write_imm, call -> receiver's counter p50 {p50:.1} us \
             (p90 {p90:.1}); the same copy alone (into an IPC mapping, same idle) {ipc:.1} us: over it {:.1} us; \
             a peer copy alone {copy_us:.1} us after the same idle (its enqueue {copy_enqueue_us:.1} us; \
             back to back {copy_hot_us:.1} us). Stages (means): hand-off \
             {handoff:.1} us, enqueue {enqueue:.1} us, enqueue -> copy seen done {copy:.1} us, posting the imm-only write \
             {signal:.1} us, then the transport and the receiver ~{:.1} us; call -> sender's future p50 {fut_p50:.1} us. \
             Stages (p50): plan {p50_plan:.1} us, hand-off {h50:.1} us, enqueue {e50:.1} us, seen done {c50:.1} us, posting {s50:.1} us, \
             then ~{:.1} us. A lone 8 B write_imm host -> host, same engines and idle (the transport's floor): \
             p50 {floor:.1} us; over the copy and that floor (the GPU path's own cost) {:.1} us",
            loc_name(dst_loc),
            p50 - ipc,
            (p50 - handoff - enqueue - copy - signal).max(0.0),
            (p50 - p50_plan - h50 - e50 - c50 - s50).max(0.0),
            p50 - ipc - floor,
        );
        assert_eq!(child.end().await, 0);
    }
}
