//! GPU memory end to end: staged transfers (host→GPU, GPU→host, GPU→GPU) over every
//! provider, CUDA IPC between two processes on one GPU, GPU0 → GPU1 staged and through CUDA
//! IPC where two GPUs exist (else `skipped: needs 2 CUDA devices ...`; `FABRIC_REQUIRE_GPUS=2`
//! makes that a failure), 8 writer tasks into GPU memory, and a staged transfer dropped
//! mid-flight. `shapes.rs`: a region 32 times the staging pool in every direction, paged
//! writes, scatters and reads with GPU ends.
//!
//! The second process is this test binary, re-run as `gpu_child` with `FABRIC_GPU_CHILD`
//! set (as `fabric-runtime/tests/cuda.rs` does), so nothing but this one binary has to be
//! shipped to a GPU machine. Without a CUDA driver each test prints one line,
//! `skipped: no CUDA driver (...): <test>`, and passes; `FABRIC_REQUIRE_CUDA=1` makes that a
//! failure. On a GPU machine (no cargo there):
//!
//! ```sh
//! cargo test -p integration-tests --test gpu --release --no-run   # prints target/release/deps/gpu-<hash>
//! FI_TCP_IFACE=lo FABRIC_REQUIRE_CUDA=1 ./gpu-<hash> --test-threads 1
//! ```

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_async::bootstrap::{Rendezvous, TcpStore};
use fabric_async::Engine;
use fabric_runtime::{cuda, Error, GpuPath, MemoryLocation, MemoryRegion};
use integration_tests::{fill_pattern, get, get_str, hash, providers, store};

const CHILD_ENV: &str = "FABRIC_GPU_CHILD";
const MIB: usize = 1 << 20;
const GPU: MemoryLocation = MemoryLocation::Cuda { ordinal: 0 };

/// Whether a GPU is usable; prints the skip line when not.
/// The path a GPU region takes with libfabric `provider` when it is not written through CUDA
/// IPC: `GpuDirect` where the run says its libfabric registers CUDA memory for that provider
/// (`FABRIC_EXPECT_GPUDIRECT=shm,...`, with `FABRIC_LIBFABRIC_HMEM=1` and a libfabric built
/// `--with-cuda`: `scripts/gpu-hmem-run.sh`), else `Staged`.
fn libfabric_gpu_path(provider: &str) -> GpuPath {
    let base = provider.split(['!', ':', '@']).next().unwrap_or(provider);
    let expect = std::env::var("FABRIC_EXPECT_GPUDIRECT").unwrap_or_default();
    if expect.split(',').any(|p| p.trim() == base) {
        GpuPath::GpuDirect
    } else {
        GpuPath::Staged
    }
}

/// `FABRIC_TEST_LOG=1`: the engine's debug events on stderr (why a GPU region is staged, ...).
fn log_if_asked() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if std::env::var_os("FABRIC_TEST_LOG").is_some_and(|v| v == "1") {
        ONCE.call_once(|| {
            let _ = tracing_subscriber::fmt()
                .with_max_level(tracing_subscriber::filter::LevelFilter::DEBUG)
                .with_writer(std::io::stderr)
                .try_init();
        });
    }
}

fn gpu(test: &str) -> bool {
    log_if_asked();
    let why = match cuda::available() {
        Ok(0) => "no CUDA device (the driver sees none)".to_string(),
        Ok(_) => match cuda::context(0) {
            Ok(_) => return true,
            Err(e) => format!("no CUDA device (device 0: {e})"),
        },
        Err(Error::Unsupported(m)) => {
            format!("no CUDA driver ({})", m.strip_prefix("no CUDA driver: ").unwrap_or(&m))
        }
        Err(e) => format!("no CUDA driver ({e})"),
    };
    if std::env::var_os("FABRIC_REQUIRE_CUDA").is_some_and(|v| v != "0") {
        panic!("{test}: FABRIC_REQUIRE_CUDA is set but: {why}");
    }
    let _ = writeln!(std::io::stderr(), "skipped: {why}: {test}");
    false
}

/// `"tcp"`, or `"tcp:2"` for an engine of 2 domains (the loopback stand-in for 2 NICs),
/// with an optional `@POOL/CHUNK` (bytes) staging pool: `"shm@2097152/1048576"`.
fn builder(provider: &str) -> fabric_async::EngineBuilder {
    // "PROVIDER!busy": a `BusyPoll` engine (its awaiting callers run the passes).
    if let Some(p) = provider.strip_suffix("!busy") {
        return builder(p).mode(fabric_async::ReactorMode::BusyPoll);
    }
    let (provider, pool) = match provider.split_once('@') {
        Some((p, pool)) => (p, Some(pool)),
        None => (provider, None),
    };
    let b = match provider.split_once(':') {
        Some((p, n)) => Engine::builder().provider(p).domains(n.parse().expect("domain count")),
        None => Engine::builder().provider(provider),
    };
    match pool.and_then(|p| p.split_once('/')) {
        Some((bytes, chunk)) => {
            b.staging_pool(bytes.parse().expect("pool bytes")).staging_chunk(chunk.parse().expect("chunk"))
        }
        None => b,
    }
}

mod batch;
mod shapes;

const GPU1: MemoryLocation = MemoryLocation::Cuda { ordinal: 1 };

/// Whether two GPUs are usable (after [`gpu`]); prints the skip line when not.
/// `FABRIC_REQUIRE_GPUS=2` makes fewer than two a failure.
fn two_gpus(test: &str) -> bool {
    if !gpu(test) {
        return false;
    }
    let n = cuda::available().unwrap_or(0);
    if n >= 2 {
        return true;
    }
    if std::env::var("FABRIC_REQUIRE_GPUS").is_ok_and(|v| v.parse::<usize>().is_ok_and(|w| w >= 2)) {
        panic!("{test}: FABRIC_REQUIRE_GPUS=2 but the driver sees {n} CUDA device(s)");
    }
    let _ = writeln!(std::io::stderr(), "skipped: needs 2 CUDA devices, the driver sees {n}: {test}");
    false
}

/// `host`, or `gpu:N` (the child's spec).
fn loc_name(l: MemoryLocation) -> String {
    match l {
        MemoryLocation::Cuda { ordinal } => format!("gpu:{ordinal}"),
        _ => "host".into(),
    }
}

fn loc_parse(s: &str) -> MemoryLocation {
    match s.strip_prefix("gpu:") {
        Some(n) => MemoryLocation::Cuda { ordinal: n.parse().expect("ordinal") },
        None => MemoryLocation::Host,
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, seed, 0);
    v
}

/// The receiving process: this binary, running `gpu_child`.
struct ChildProc(Option<Child>);

impl ChildProc {
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        store: SocketAddr,
        provider: &str,
        loc: MemoryLocation,
        size: usize,
        imm: u32,
        count: u64,
        key: &str,
        fill: Option<u64>,
    ) -> Self {
        let fill = fill.map_or("ee".to_string(), |s| s.to_string());
        let c = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "gpu_child", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, format!("{store}|{provider}|{}|{size}|{imm}|{count}|{key}|{fill}", loc_name(loc)))
            .stdin(Stdio::null())
            .spawn()
            .expect("re-run this test binary as the child");
        ChildProc(Some(c))
    }

    async fn wait_success(&mut self, timeout: Duration) -> bool {
        let Some(c) = self.0.as_mut() else { return false };
        let deadline = Instant::now() + timeout;
        loop {
            match c.try_wait() {
                Ok(Some(s)) => {
                    self.0 = None;
                    return s.success();
                }
                Ok(None) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
                _ => return false,
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The child's side: a region at the given location filled with 0xEE (or `pattern(size,
/// fill)`), its descriptor
/// published under `<key>/desc`; waits for `count` arrivals of `imm`, then publishes the
/// region's hash and the arrivals left over after a settle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let f: Vec<&str> = spec.split('|').collect();
    let [addr, provider, loc, size, imm, count, key, fill] = f[..] else { panic!("bad child spec {spec}") };
    let store = TcpStore::connect(addr.parse().unwrap()).await.expect("store");
    let r = async {
        let engine = builder(provider).build()?;
        let loc = loc_parse(loc);
        let size: usize = size.parse().unwrap();
        let region = engine.alloc_in(size, loc).await?;
        match fill.parse::<u64>() {
            Ok(seed) => region.write_at(0, &pattern(size, seed))?,
            Err(_) => region.write_at(0, &vec![0xEE; size])?,
        }
        store.put(&format!("{key}/path"), format!("{:?}", region.gpu_path()).into_bytes()).await.unwrap();
        store.put(&format!("{key}/desc"), region.descriptor().to_bytes()).await.unwrap();
        let counter = engine.imm_counter(imm.parse().unwrap());
        let count: u64 = count.parse().unwrap();
        match tokio::time::timeout(Duration::from_secs(120), counter.wait_for(count)).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Config(format!(
                    "only {} of {count} arrivals in 120 s",
                    counter.available()
                )))
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let extra = counter.available();
        let mut bytes = vec![0u8; size];
        region.read_at(0, &mut bytes)?;
        store.put(&format!("{key}/hash"), hash(&bytes).to_string().into_bytes()).await.unwrap();
        store.put(&format!("{key}/extra"), extra.to_string().into_bytes()).await.unwrap();
        Ok::<_, Error>(())
    }
    .await;
    if let Err(e) = r {
        store.put(&format!("{key}/hash"), format!("error: {e}").into_bytes()).await.unwrap();
        panic!("gpu child: {e}");
    }
    let _ = tokio::time::timeout(Duration::from_secs(60), store.get(&format!("{key}/exit"))).await;
}

struct Target {
    child: ChildProc,
    store: TcpStore,
    _server: fabric_async::bootstrap::TcpStoreServer,
    key: String,
}

/// Starts a child with a region of `size` bytes at `loc` that waits for `count` arrivals of
/// `imm`; returns it with the descriptor bytes and the path it reports.
async fn target(
    provider: &str,
    loc: MemoryLocation,
    size: usize,
    imm: u32,
    count: u64,
) -> (Target, Vec<u8>, String) {
    target_filled(provider, loc, size, imm, count, None).await
}

/// [`target`] with the child's region filled with `pattern(size, seed)` instead of 0xEE.
async fn target_filled(
    provider: &str,
    loc: MemoryLocation,
    size: usize,
    imm: u32,
    count: u64,
    fill: Option<u64>,
) -> (Target, Vec<u8>, String) {
    let (server, store, addr) = store().await;
    let key = "t".to_string();
    let child = ChildProc::spawn(addr, provider, loc, size, imm, count, &key, fill);
    let desc = get(&store, &format!("{key}/desc")).await;
    let path = get_str(&store, &format!("{key}/path")).await;
    (Target { child, store, _server: server, key }, desc, path)
}

impl Target {
    /// The child's region hash and its left-over arrivals; ends the child.
    async fn finish(mut self) -> (String, u64) {
        let h = get_str(&self.store, &format!("{}/hash", self.key)).await;
        assert!(!h.starts_with("error"), "child: {h}");
        let extra: u64 = get_str(&self.store, &format!("{}/extra", self.key)).await.parse().unwrap();
        self.store.put(&format!("{}/exit", self.key), vec![]).await.unwrap();
        assert!(self.child.wait_success(Duration::from_secs(30)).await, "child failed");
        (h, extra)
    }
}

async fn source(engine: &Engine, loc: MemoryLocation, data: &[u8]) -> MemoryRegion {
    let r = engine.alloc_in(data.len(), loc).await.expect("source region");
    r.write_at(0, data).unwrap();
    r
}

/// One write_imm of a whole region from `src_loc` to a child's `dst_loc` region; bytes
/// and the exact count verified.
async fn one_transfer(
    test: &str,
    provider: &str,
    src_loc: MemoryLocation,
    dst_loc: MemoryLocation,
    ipc: bool,
) -> Duration {
    let len = 24 * MIB + 4099; // several 4 MiB chunks and a ragged end
    let imm = 0x600d;
    let engine = builder(provider).cuda_ipc(ipc).build().expect("engine");
    let nics = engine.nics();
    let data = pattern(len, 0x5eed ^ len as u64);
    let src = source(&engine, src_loc, &data).await;
    // Into host memory (and GPU memory the NIC writes itself): one per shard, as for any
    // write; into GPU memory through staging or CUDA IPC: exactly one.
    let nic_writes_gpu = !ipc && libfabric_gpu_path(provider) == GpuPath::GpuDirect;
    let expected_arrivals = if dst_loc == MemoryLocation::Host || nic_writes_gpu {
        engine.transfer_opts().write_arrivals(len as u64, nics).unwrap()
    } else {
        1
    };
    let (t, desc, child_path) = target(provider, dst_loc, len, imm, expected_arrivals).await;
    let dst = engine.remote_region(&desc).await.expect("remote region");
    let want_path = match (dst_loc, ipc) {
        (MemoryLocation::Host, _) => None,
        (_, true) => Some(GpuPath::Ipc),
        _ => Some(libfabric_gpu_path(provider)),
    };
    assert_eq!(dst.gpu_path(), want_path, "{test}/{provider}: the path a write takes (child: {child_path})");
    assert_eq!(engine.write_arrivals(&dst, len as u64).unwrap(), expected_arrivals);
    let start = Instant::now();
    tokio::time::timeout(Duration::from_secs(120), engine.write_imm(&src, 0, &dst, 0, len as u64, imm))
        .await
        .unwrap_or_else(|_| panic!("{test}/{provider}: no completion in 120 s"))
        .unwrap_or_else(|e| panic!("{test}/{provider}: {e}"));
    let took = start.elapsed();
    let (h, extra) = t.finish().await;
    assert_eq!(h, hash(&data).to_string(), "{test}/{provider}: bytes at the target");
    assert_eq!(extra, 0, "{test}/{provider}: exactly {expected_arrivals} arrival(s)");
    println!(
        "{test} over {provider}: {} MiB in {took:?} ({:.2} GB/s, future to future)",
        len / MIB,
        len as f64 / took.as_secs_f64() / 1e9
    );
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_region_basics() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("gpu_region_basics") {
        return;
    }
    let engine = Engine::builder().provider("tcp").build().expect("engine");
    let len = 3 * MIB + 5;
    let r = engine.alloc_in(len, GPU).await.expect("alloc_in(Cuda)");
    assert_eq!(r.location(), GPU);
    let want = libfabric_gpu_path("tcp");
    assert_eq!(r.gpu_path(), Some(want), "libfabric stages unless it registers CUDA memory (FI_HMEM)");
    assert_eq!(engine.gpu_path(0).await.unwrap(), want);
    let data = pattern(len, 9);
    r.write_at(0, &data).unwrap();
    assert_eq!(r.to_vec(), data);
    let mut part = vec![0u8; 1000];
    r.read_at(MIB as u64 + 3, &mut part).unwrap();
    assert_eq!(&part[..], &data[MIB + 3..MIB + 1003]);
    assert!(matches!(r.read_at(len as u64 - 1, &mut part), Err(Error::OutOfBounds { .. })));
    let d = r.descriptor();
    let g = d.gpu.as_ref().expect("a GPU descriptor");
    assert!(
        g.staged == (want == GpuPath::Staged)
            && g.ipc.as_ref().is_some_and(|i| i.len() == 80)
            && !g.host.is_empty()
    );
    assert_eq!(fabric_runtime::RegionDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);

    // register_cuda: the user's memory, validated.
    let ctx = cuda::context(0).unwrap();
    let dev = cuda::DeviceBuffer::new(&ctx, 2 * MIB).unwrap();
    dev.copy_from_host(0, &pattern(2 * MIB, 4)).unwrap();
    // SAFETY: `dev` outlives the region (dropped at the end of this test, after it).
    let user = unsafe { engine.register_cuda(dev.device_ptr() + 4096, MIB, 0) }.await.expect("register_cuda");
    assert_eq!(user.to_vec(), pattern(2 * MIB, 4)[4096..4096 + MIB]);
    let host = vec![0u8; 4096];
    // SAFETY: refused before anything is registered.
    let e = unsafe { engine.register_cuda(host.as_ptr() as u64, 4096, 0) }.await.unwrap_err();
    assert!(matches!(e, Error::NotDeviceMemory { .. }), "{e}");
    // SAFETY: as above.
    let e = unsafe { engine.register_cuda(dev.device_ptr() + MIB as u64, 2 * MIB, 0) }.await.unwrap_err();
    assert!(matches!(e, Error::NotDeviceMemory { .. }), "past the allocation: {e}");

    // register_cuda_owned: the engine keeps the owner until nothing may touch the memory,
    // and drops it at once when registration is refused.
    let keep = std::sync::Arc::new(cuda::DeviceBuffer::new(&ctx, MIB).unwrap());
    keep.copy_from_host(0, &pattern(MIB, 5)).unwrap();
    // SAFETY: the owner is the allocation itself.
    let owned = unsafe { engine.register_cuda_owned(keep.device_ptr(), MIB, 0, keep.clone()) }
        .await
        .expect("register_cuda_owned");
    assert!(std::sync::Arc::strong_count(&keep) >= 2, "the region holds its owner");
    assert_eq!(owned.to_vec(), pattern(MIB, 5));
    drop(owned);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::sync::Arc::strong_count(&keep) > 1 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(std::sync::Arc::strong_count(&keep), 1, "the owner is dropped once the region is closed");
    // SAFETY: refused before anything is registered.
    let e =
        unsafe { engine.register_cuda_owned(host.as_ptr() as u64, 4096, 0, keep.clone()) }.await.unwrap_err();
    assert!(matches!(e, Error::NotDeviceMemory { .. }), "{e}");
    assert_eq!(std::sync::Arc::strong_count(&keep), 1, "a refused owner is dropped");

    // The synchronous path refuses bytes with a staged GPU end.
    let peer_desc = r.descriptor().to_bytes();
    let me = engine.remote_region(&peer_desc).await.unwrap();
    let batch = fabric_runtime::OpBatch::new();
    let e = engine.post_write_imm(&batch, &r, 0, &me, 0, 16, 1).unwrap_err();
    assert!(matches!(&e, Error::Unsupported(m) if m.contains("synchronous path")), "{e}");
    drop(user);
    drop(dev);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_to_gpu_staged() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("host_to_gpu_staged") {
        return;
    }
    for p in providers() {
        one_transfer("host_to_gpu_staged", &p, MemoryLocation::Host, GPU, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_host_staged() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("gpu_to_host_staged") {
        return;
    }
    for p in providers() {
        one_transfer("gpu_to_host_staged", &p, GPU, MemoryLocation::Host, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_gpu_staged() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("gpu_to_gpu_staged") {
        return;
    }
    for p in providers() {
        one_transfer("gpu_to_gpu_staged", &p, GPU, GPU, false).await;
    }
}

/// Staged writes between `BusyPoll` engines on both sides, whose awaiting callers run the
/// passes and so the staging's CUDA copies and event queries on their own threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_on_busy_poll_engines() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("staged_on_busy_poll_engines") {
        return;
    }
    for p in providers() {
        for (s, d) in [(GPU, MemoryLocation::Host), (MemoryLocation::Host, GPU), (GPU, GPU)] {
            one_transfer("staged_on_busy_poll_engines", &format!("{p}!busy"), s, d, false).await;
        }
    }
}

/// Two domains on each side: a GPU source's shards each gated on their own D2H copy, and
/// pulls whose chunk reads alternate between the two NICs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_over_two_nics() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("staged_over_two_nics") {
        return;
    }
    for (s, d) in [(GPU, MemoryLocation::Host), (MemoryLocation::Host, GPU), (GPU, GPU)] {
        one_transfer("staged_over_two_nics", "tcp:2", s, d, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_gpu_cuda_ipc() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("gpu_to_gpu_cuda_ipc") {
        return;
    }
    one_transfer("gpu_to_gpu_cuda_ipc", "tcp", GPU, GPU, true).await;
    one_transfer("host_to_gpu_cuda_ipc", "tcp", MemoryLocation::Host, GPU, true).await;
}

/// GPU0 → GPU1 staged over every provider: a region on ordinal 0 in this process, on
/// ordinal 1 in the child (D2H on GPU0, the transport, pull, H2D on GPU1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gpus_staged() {
    if std::env::var_os(CHILD_ENV).is_some() || !two_gpus("two_gpus_staged") {
        return;
    }
    for p in providers() {
        one_transfer("two_gpus_staged", &p, GPU, GPU1, false).await;
    }
    // And back: GPU1 → GPU0.
    one_transfer("two_gpus_staged_back", "tcp", GPU1, GPU, false).await;
}

/// GPU0 → GPU1 through CUDA IPC between two processes: the writer's copy engine writes
/// GPU1's memory through the IPC mapping (a peer copy over NVLink where there is one), then
/// the imm over tcp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gpus_cuda_ipc() {
    if std::env::var_os(CHILD_ENV).is_some() || !two_gpus("two_gpus_cuda_ipc") {
        return;
    }
    one_transfer("two_gpus_cuda_ipc", "tcp", GPU, GPU1, true).await;
    one_transfer("two_gpus_cuda_ipc_back", "tcp", GPU1, GPU, true).await;
    one_transfer("host_to_gpu1_cuda_ipc", "tcp", MemoryLocation::Host, GPU1, true).await;
}

/// 8 tasks, 16 staged writes each into distinct 64 KiB ranges of one GPU region, one
/// immediate, the writer's pool 2 slots of 64 KiB: exactly 128 arrivals, every byte in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_writer_tasks_into_gpu_memory() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("eight_writer_tasks_into_gpu_memory") {
        return;
    }
    let (tasks, per, piece) = (8usize, 16usize, 64 * 1024usize);
    let len = tasks * per * piece;
    // The writer stages through 2 slots of one piece each: the tasks queue for them.
    let engine = builder(&format!("tcp@{}/{piece}", 2 * piece)).cuda_ipc(false).build().expect("engine");
    let data = pattern(len, 77);
    let src = source(&engine, GPU, &data).await;
    let (t, desc, _) = target("tcp", GPU, len, 7, (tasks * per) as u64).await;
    let dst = engine.remote_region(&desc).await.unwrap();
    let mut handles = Vec::new();
    for k in 0..tasks {
        let (engine, src, dst) = (engine.clone(), src.clone(), dst.clone());
        handles.push(tokio::spawn(async move {
            for i in 0..per {
                let off = ((i * tasks + k) * piece) as u64;
                engine.write_imm(&src, off, &dst, off, piece as u64, 7).await.expect("staged write");
            }
        }));
    }
    for h in handles {
        tokio::time::timeout(Duration::from_secs(120), h).await.expect("writers in time").unwrap();
    }
    let (h, extra) = t.finish().await;
    assert_eq!(h, hash(&data).to_string(), "bytes");
    assert_eq!(extra, 0, "exactly {} arrivals", tasks * per);
}

/// A staged GPU→GPU write whose future and source region are dropped at once: the transfer
/// still completes with the right bytes (the operation held the source), and the engine
/// serves the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_staged_transfer_frees_nothing_in_use() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("dropped_staged_transfer_frees_nothing_in_use") {
        return;
    }
    for p in providers() {
        let (a, b) = (64 * MIB, 8 * MIB);
        let engine = Engine::builder().provider(p.as_str()).cuda_ipc(false).build().expect("engine");
        let first = pattern(a, 1);
        let second = pattern(b, 2);
        let (t, desc, _) = target(&p, GPU, a + b, 9, 2).await;
        let dst = engine.remote_region(&desc).await.unwrap();
        {
            let src = source(&engine, GPU, &first).await;
            let mut fut = Box::pin(engine.write_imm(&src, 0, &dst, 0, a as u64, 9));
            // Poll once, then drop the future and the region mid-flight.
            let _ = futures::poll!(fut.as_mut());
            drop(fut);
            drop(src);
        }
        let src2 = source(&engine, GPU, &second).await;
        tokio::time::timeout(
            Duration::from_secs(120),
            engine.write_imm(&src2, 0, &dst, a as u64, b as u64, 9),
        )
        .await
        .expect("second write in time")
        .expect("the engine still serves");
        let (h, extra) = t.finish().await;
        let mut all = first.clone();
        all.extend_from_slice(&second);
        assert_eq!(h, hash(&all).to_string(), "{p}: both transfers' bytes");
        assert_eq!(extra, 0, "{p}: exactly 2 arrivals");
        println!("dropped staged transfer over {p}: both transfers landed, 2 arrivals");
    }
}

/// `iters` back-to-back write_imm of `len` bytes (after one warm-up), awaited one at a time;
/// GB/s from the first send to the last completion. Bytes of the last write verified.
async fn throughput(
    provider: &str,
    src_loc: MemoryLocation,
    dst_loc: MemoryLocation,
    ipc: bool,
    len: usize,
    iters: u64,
) -> f64 {
    let engine = Engine::builder().provider(provider).cuda_ipc(ipc).build().expect("engine");
    let data = pattern(len, 3);
    let src = source(&engine, src_loc, &data).await;
    let per = if dst_loc == MemoryLocation::Host {
        engine.transfer_opts().write_arrivals(len as u64, 1).unwrap()
    } else {
        1
    };
    let (t, desc, _) = target(provider, dst_loc, len, 11, per * (iters + 1)).await;
    let dst = engine.remote_region(&desc).await.unwrap();
    engine.write_imm(&src, 0, &dst, 0, len as u64, 11).await.expect("warm-up");
    let start = Instant::now();
    for _ in 0..iters {
        engine.write_imm(&src, 0, &dst, 0, len as u64, 11).await.expect("write");
    }
    let gbps = (len as u64 * iters) as f64 / start.elapsed().as_secs_f64() / 1e9;
    let (h, extra) = t.finish().await;
    assert_eq!(h, hash(&data).to_string());
    assert_eq!(extra, 0);
    gbps
}

/// The figures of `docs/gpu.md`: each path beside its ceilings measured in the same run
/// (pinned H2D / D2H copy bandwidth, and a host→host write over the same provider).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_throughput_report() {
    if std::env::var_os(CHILD_ENV).is_some() || !gpu("gpu_throughput_report") {
        return;
    }
    let (len, iters) = (64 * MIB, 8u64);
    let ctx = cuda::context(0).unwrap();
    let dev = std::sync::Arc::new(cuda::DeviceBuffer::new(&ctx, len).unwrap());
    let pinned = std::sync::Arc::new(cuda::PinnedHostBuffer::new(&ctx, len).unwrap());
    let stream = cuda::Stream::new(&ctx).unwrap();
    let copy_bw = |h2d: bool| {
        let start = Instant::now();
        for _ in 0..iters {
            if h2d {
                stream.copy_h2d(&dev, 0, &pinned, 0, len).unwrap();
            } else {
                stream.copy_d2h(&pinned, 0, &dev, 0, len).unwrap();
            }
        }
        stream.synchronize().unwrap();
        (len as u64 * iters) as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let (_, _) = (copy_bw(true), copy_bw(false));
    let (h2d, d2h) = (copy_bw(true), copy_bw(false));
    println!("| ceiling | H2D pinned copy | {h2d:.1} GB/s |");
    println!("| ceiling | D2H pinned copy | {d2h:.1} GB/s |");
    let host = MemoryLocation::Host;
    for p in providers() {
        let raw = throughput(&p, host, host, false, len, iters).await;
        println!("| {p} | host -> host (network ceiling) | {raw:.2} GB/s |");
        for (name, s, d) in [
            ("host -> GPU staged", host, GPU),
            ("GPU -> host staged", GPU, host),
            ("GPU -> GPU staged", GPU, GPU),
        ] {
            let bw = throughput(&p, s, d, false, len, iters).await;
            println!("| {p} | {name} | {bw:.2} GB/s ({:.2}x host->host) |", bw / raw);
        }
    }
    let ipc = throughput("tcp", GPU, GPU, true, len, iters).await;
    println!("| tcp | GPU -> GPU CUDA IPC (same GPU, imm over tcp) | {ipc:.1} GB/s |");
    if cuda::available().unwrap_or(0) < 2 {
        let _ = writeln!(std::io::stderr(), "skipped: needs 2 CUDA devices: the GPU0 -> GPU1 rows");
        return;
    }
    // GPU0 → GPU1: the peer copy (ceiling of CUDA IPC), then the engine's paths.
    let ctx1 = cuda::context(1).unwrap();
    if ctx.can_access_peer(&ctx1).unwrap() {
        ctx.enable_peer_access(&ctx1).unwrap();
        ctx1.enable_peer_access(&ctx).unwrap();
    }
    let dev1 = std::sync::Arc::new(cuda::DeviceBuffer::new(&ctx1, len).unwrap());
    let peer_bw = || {
        let start = Instant::now();
        for _ in 0..iters {
            stream.copy_d2d(&dev1, 0, &dev, 0, len).unwrap();
        }
        stream.synchronize().unwrap();
        (len as u64 * iters) as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let _ = peer_bw();
    let peer = peer_bw();
    println!("| ceiling | peer copy GPU0 -> GPU1 | {peer:.1} GB/s |");
    let gpu1 = MemoryLocation::Cuda { ordinal: 1 };
    let ipc2 = throughput("tcp", GPU, gpu1, true, len, iters).await;
    println!(
        "| tcp | GPU0 -> GPU1 CUDA IPC (imm over tcp) | {ipc2:.1} GB/s ({:.2}x peer copy) |",
        ipc2 / peer
    );
    for p in providers() {
        let bw = throughput(&p, GPU, gpu1, false, len, iters).await;
        println!("| {p} | GPU0 -> GPU1 staged | {bw:.2} GB/s |");
    }
}
