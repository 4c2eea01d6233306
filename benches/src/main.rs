//! fabric-bench: the engine measured beside its ceiling, in the same run.
//!
//! ```text
//! cargo run --release -p fabric-bench -- <bw|lat|rate|wake|scale|all> [--provider tcp|shm|verbs[:DEV]]
//!     [--domains N] [--sizes 4K,1M,..] [--iters N] [--window N] [--json PATH] [--plot PATH] [--quick]
//! ```
//!
//! This process is the leader. It starts a second copy of itself as the peer; the two meet
//! through a `TcpStore` on 127.0.0.1 and then run the same sequence of phases, each side
//! playing its role. Every engine figure is printed beside a baseline measured in the same
//! run: the raw provider loop (`raw.rs`: the provider's domain driven through the `Domain`
//! trait by a plain thread), iperf3 for tcp bandwidth when it is installed, and perftest's
//! `ib_write_bw` / `ib_write_lat` for verbs (`perftest.rs`). On verbs the test sizes are
//! smaller (`Budget`): the only verbs device here is Soft-RoCE in an emulated VM, ~20-45 MB/s.

mod perftest;
mod progress;
mod raw;
mod report;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::{Engine, MemoryRegion, OpBatch, ReactorMode, RemoteRegion};
use futures::future::join_all;

use progress::Progress;
use raw::Raw;
use report::{Report, Row};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = std::result::Result<T, BoxError>;

// Immediates used by the phases (any distinct values do).
const IMM_DATA: u32 = 1;
const IMM_ACK: u32 = 2;
const IMM_PING: u32 = 3;
const IMM_PONG: u32 = 4;
/// Warm-up writes: they set up the connection (rxm connects on first use) outside timings.
const IMM_WARM: u32 = 5;

const TESTS: [&str; 5] = ["bw", "lat", "rate", "wake", "scale"];

#[derive(Clone, Debug)]
struct Opts {
    test: String,
    provider: String,
    sizes: Option<Vec<usize>>,
    iters: Option<usize>,
    window: usize,
    json: Option<PathBuf>,
    plot: Option<PathBuf>,
    quick: bool,
    /// Reactor mode of the engine in bw and rate (default Event).
    mode: ReactorMode,
    peer_of: Option<String>,
    /// NICs (domains) per engine: `EngineBuilder::domains`. The raw baselines use one.
    domains: usize,
}

/// Whether the run is on the ibverbs backend. The only verbs device on these machines is
/// Soft-RoCE inside an emulated (TCG) VM: ~20-45 MB/s and tens of microseconds per operation,
/// so every test moves less data there (sized for `all --quick` in well under a minute of VM
/// time and `all` in a few minutes); the figures' meaning does not change.
fn on_verbs(o: &Opts) -> bool {
    raw::is_verbs(&o.provider)
}

/// An engine builder for the run's provider and NIC count. `--domains N` shards every
/// engine transfer over N domains (the default 1 MiB shards); the raw baselines stay on one.
fn builder(o: &Opts) -> fabric_async::EngineBuilder {
    let b = Engine::builder().provider(&o.provider);
    if o.domains > 1 {
        b.domains(o.domains)
    } else {
        b
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: fabric-bench <bw|lat|rate|wake|scale|all> [--provider tcp|shm|verbs[:DEV]] [--domains N]\n\
         \x20                   [--sizes 4K,64K,1M,..] [--iters N] [--window N] [--json PATH]\n\
         \x20                   [--plot PATH] [--quick] [--mode event|adaptive|busypoll]\n\
         \n\
         bw     write_imm bandwidth, 4 KiB..64 MiB, `window` writes in flight (default 16;\n\
         \x20      verbs: 128, ib_write_bw's default -t; verbs sizes 4 KiB..1 MiB)\n\
         lat    write_imm ping-pong round trip p50/p99 (8 B, 256 B, 4 KiB)\n\
         rate   imm-only operations per second\n\
         wake   8 B ping-pong in Event, Adaptive, BusyPoll and the sync spin path, with CPU use\n\
         scale  1..256 peer engines, and 1..100,000 futures in flight\n\
         all    every test\n\
         --iters sets the operations per bw point / round trips per latency case.\n\
         --mode is the engine's reactor mode in bw and rate (default event).\n\
         --quick is a smoke run (seconds). Baselines: the raw provider loop, iperf3 on tcp,\n\
         \x20      ib_write_bw / ib_write_lat (perftest) on verbs."
    );
    std::process::exit(2)
}

/// `4096`, `4K`, `4KiB`, `1M`, `64MiB`, `1G`.
fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim().trim_end_matches("iB").trim_end_matches('B');
    let (num, mul) = match t.chars().last()? {
        'K' | 'k' => (&t[..t.len() - 1], 1usize << 10),
        'M' | 'm' => (&t[..t.len() - 1], 1 << 20),
        'G' | 'g' => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>().ok().map(|n| n * mul).filter(|&n| n > 0)
}

fn parse() -> Opts {
    let mut o = Opts {
        test: String::new(),
        provider: "tcp".into(),
        sizes: None,
        iters: None,
        window: 16,
        json: None,
        plot: None,
        quick: false,
        mode: ReactorMode::Event,
        peer_of: None,
        domains: 1,
    };
    let mut window = None;
    let mut args = std::env::args().skip(1);
    while let Some(k) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match k.as_str() {
            "--provider" => o.provider = val(),
            "--domains" => {
                o.domains = val().parse().ok().filter(|n| *n > 0).unwrap_or_else(|| usage());
            }
            "--sizes" => {
                let v: Option<Vec<usize>> = val().split(',').map(parse_size).collect();
                o.sizes = Some(v.unwrap_or_else(|| usage()));
            }
            "--iters" => o.iters = Some(val().parse().ok().filter(|&n| n > 0).unwrap_or_else(|| usage())),
            "--window" => window = Some(val().parse().ok().filter(|&n| n > 0).unwrap_or_else(|| usage())),
            "--json" => o.json = Some(val().into()),
            "--plot" => o.plot = Some(val().into()),
            "--quick" => o.quick = true,
            "--mode" => {
                o.mode = match val().as_str() {
                    "event" => ReactorMode::Event,
                    "adaptive" => ReactorMode::Adaptive { spin: Duration::from_micros(200) },
                    "busypoll" => ReactorMode::BusyPoll,
                    _ => usage(),
                }
            }
            "--peer-of" => o.peer_of = Some(val()),
            "-h" | "--help" => usage(),
            t if !t.starts_with('-') && o.test.is_empty() => o.test = t.to_string(),
            _ => usage(),
        }
    }
    if o.test != "all" && !TESTS.contains(&o.test.as_str()) {
        usage();
    }
    if !matches!(o.provider.as_str(), "tcp" | "shm") && !raw::is_verbs(&o.provider) {
        eprintln!("fabric-bench: --provider {}: only tcp, shm and verbs[:DEV] are benchmarked", o.provider);
        std::process::exit(2);
    }
    // On verbs the baseline is ib_write_bw, whose default send queue depth (`-t`) is 128: the
    // engine gets as many writes in flight. With 16, its bandwidth on Soft-RoCE in the VM
    // depends on how soon the (sleeping) reactor reaps each completion: docs/performance.md.
    o.window = window.unwrap_or(if on_verbs(&o) { 128 } else { 16 });
    o
}

fn main() {
    let o = parse();
    // Set before any thread exists (LibfabricDomain::open would set it lazily otherwise).
    if std::env::var_os("FI_TCP_IFACE").is_none() {
        std::env::set_var("FI_TCP_IFACE", "lo");
    }
    raise_fd_limit();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let result = rt.block_on(async {
        match o.peer_of.clone() {
            Some(addr) => peer_main(o, addr).await,
            None => leader_main(o).await,
        }
    });
    if let Err(e) = result {
        eprintln!("\nfabric-bench failed: {e}");
        std::process::exit(1);
    }
}

/// The scale test opens hundreds of endpoints in one process.
fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain get/setrlimit on a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Process plumbing: the two sides run the same phases; `swap` is their meeting point.
// ---------------------------------------------------------------------------------------------

struct Ctx {
    o: Opts,
    lead: bool,
    store: TcpStore,
    phase: u64,
    progress: Progress,
}

impl Ctx {
    /// Gives our bytes for this phase to the other side and returns theirs.
    async fn swap(&mut self, tag: &str, mine: Vec<u8>) -> Res<Vec<u8>> {
        self.phase += 1;
        let (me, them) = if self.lead { ("L", "P") } else { ("P", "L") };
        self.store.put(&format!("{}/{tag}/{me}", self.phase), mine).await?;
        Ok(self.store.get(&format!("{}/{tag}/{them}", self.phase)).await?)
    }

    async fn barrier(&mut self, tag: &str) -> Res<()> {
        self.swap(tag, Vec::new()).await.map(drop)
    }

    /// The progress bar (leader only): `test` has done `frac` of its steps and runs `what`.
    fn progress(&mut self, test: &str, frac: f64, what: &str) {
        self.progress.update(test, frac, what);
    }

    /// A line on stdout during the run, on a line of its own (not after the bar).
    fn note(&mut self, msg: &str) {
        self.progress.clear();
        println!("{msg}");
    }
}

async fn leader_main(o: Opts) -> Res<()> {
    let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
    let store = TcpStore::connect(server.local_addr()).await?.with_timeout(Duration::from_secs(300));
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    args.extend(["--peer-of".to_string(), server.local_addr().to_string()]);
    let mut child = Command::new(std::env::current_exe()?).args(&args).stdin(Stdio::null()).spawn()?;
    let mut ctx = Ctx { o: o.clone(), lead: true, store, phase: 0, progress: Progress::new(true) };
    let mut rep = Report::new(&o.provider);
    eprintln!(
        "fabric-bench {} on {} ({} cores){}{}",
        o.test,
        o.provider,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if o.quick { ", quick" } else { "" },
        if o.domains > 1 {
            format!(", engines with {} domains (raw baselines: 1)", o.domains)
        } else {
            String::new()
        }
    );
    let t0 = Instant::now();
    let result = run_tests(&mut ctx, &mut rep).await;
    ctx.progress.clear();
    eprintln!("done in {:.1} s", t0.elapsed().as_secs_f64());
    if result.is_err() {
        // The peer may be waiting for this side at the store (up to its 300 s timeout).
        let _ = child.kill();
    }
    let status = tokio::task::spawn_blocking(move || child.wait()).await??;
    result?;
    if !status.success() {
        return Err(format!("the peer process exited with {status}").into());
    }
    rep.print();
    if let Some(p) = &o.json {
        rep.write_json(p)?;
        println!("json: {}", p.display());
    }
    if rep.has_bw() {
        let path = o.plot.clone().unwrap_or_else(|| {
            let dir = PathBuf::from("target/fabric-bench");
            let _ = std::fs::create_dir_all(&dir);
            dir.join(format!("bw-{}.png", o.provider))
        });
        let engine = match o.domains {
            1 => format!("futures, {}", mode_name(o.mode)),
            n => format!("futures, {}, {n} domains", mode_name(o.mode)),
        };
        match rep.plot_bw(&path, &engine) {
            Ok(()) => println!("plot: {}", path.display()),
            Err(e) => println!("plot: not written: {e}"),
        }
    }
    Ok(())
}

async fn peer_main(o: Opts, addr: String) -> Res<()> {
    let store = TcpStore::connect(addr.parse()?).await?.with_timeout(Duration::from_secs(300));
    let mut ctx = Ctx { o, lead: false, store, phase: 0, progress: Progress::new(false) };
    let mut rep = Report::new("");
    run_tests(&mut ctx, &mut rep).await
}

async fn run_tests(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let all = ctx.o.test == "all";
    let want = |t: &str| all || ctx.o.test == t;
    let (bw, lat, rate, wake, scale) = (want("bw"), want("lat"), want("rate"), want("wake"), want("scale"));
    if bw {
        bw_test(ctx, rep).await?;
        if ctx.lead {
            iperf3(ctx, rep).await;
        }
    }
    if lat {
        lat_test(ctx, rep).await?;
        if ctx.lead {
            perftest_lat(ctx, rep).await?;
        }
    }
    if rate {
        rate_test(ctx, rep).await?;
    }
    if wake {
        wake_test(ctx, rep).await?;
    }
    if scale {
        scale_test(ctx, rep).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Shared helpers.
// ---------------------------------------------------------------------------------------------

/// An engine in `mode` with a registered region of `len` bytes, connected to the other
/// side's region.
struct Side {
    engine: Engine,
    region: MemoryRegion,
    remote: RemoteRegion,
}

async fn engine_side(ctx: &mut Ctx, mode: ReactorMode, len: usize) -> Res<Side> {
    let engine = builder(&ctx.o).mode(mode).build()?;
    let region = engine.alloc(len).await?;
    fill(&region)?;
    let theirs = ctx.swap("engine", region.descriptor().to_bytes()).await?;
    let remote = engine.remote_region(&theirs).await?;
    // Connect both ways before anything is timed.
    engine.imm(&remote, IMM_WARM).await?;
    engine.imm_counter(IMM_WARM).wait_for(1).await.expect("engine shut down during the benchmark");
    Ok(Side { engine, region, remote })
}

/// Touches every page, so that the engine and the raw loop both move resident memory.
fn fill(r: &MemoryRegion) -> Res<()> {
    let chunk = vec![0x5au8; 1 << 20];
    let mut off = 0;
    while off < r.len() {
        let n = chunk.len().min(r.len() - off);
        r.write_at(off as u64, &chunk[..n])?;
        off += n;
    }
    Ok(())
}

async fn raw_side(ctx: &mut Ctx, len: usize) -> Res<Raw> {
    let (mut raw, mine) = Raw::open(&ctx.o.provider, len)?;
    let theirs = ctx.swap("raw", mine).await?;
    raw.connect(&theirs)?;
    on_thread(raw, |r| r.warm_up(IMM_WARM)).await.map(|(r, ())| r)
}

/// Runs `f` on a plain thread with the raw side (the runtime thread keeps serving the store).
async fn on_thread<T: Send + 'static>(
    raw: Raw,
    f: impl FnOnce(&mut Raw) -> Res<T> + Send + 'static,
) -> Res<(Raw, T)> {
    tokio::task::spawn_blocking(move || {
        let mut raw = raw;
        let r = f(&mut raw);
        r.map(|t| (raw, t))
    })
    .await?
}

fn cpu_time() -> Duration {
    // SAFETY: `rusage` is plain C data (integers and `timeval`s) for which all-zero bytes is
    // a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Gives freed heap back to the kernel, so that RSS deltas measure what is live.
fn trim() {
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
}

/// MemAvailable of /proc/meminfo, bytes.
fn mem_available() -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Resident set size of this process, bytes. From `smaps_rollup`, which walks the page
/// tables: `VmRSS` in `status` comes from counters that kernels before 6.2 (the test VM's
/// 6.1) update per thread in batches of 64 pages, so a few hundred KiB of growth could read 0.
fn rss() -> u64 {
    let field = |file: &str, key: &str| {
        let s = std::fs::read_to_string(file).ok()?;
        let l = s.lines().find(|l| l.starts_with(key))?;
        l.split_whitespace().nth(1)?.parse::<u64>().ok()
    };
    field("/proc/self/smaps_rollup", "Rss:")
        .or_else(|| field("/proc/self/status", "VmRSS:"))
        .map_or(0, |kb| kb * 1024)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// (p50, p99) in microseconds, after dropping the first 10% as warm-up.
fn percentiles(rtts: &[Duration]) -> (f64, f64) {
    let skip = rtts.len() / 10;
    let mut v: Vec<f64> = rtts[skip..].iter().map(|d| d.as_secs_f64() * 1e6).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[(v.len() * 99 / 100).min(v.len() - 1)])
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 * 8.0 / t.as_secs_f64() / 1e9
}

/// Streams `ops` write_imm of `size` (`size == 0`: imm-only) with `window` in flight, then
/// waits for the receiver's ack.
async fn engine_stream(s: &Side, size: usize, ops: u64, window: usize) -> Res<Duration> {
    let slots = (s.region.len() / size.max(1)).max(1);
    let ack = s.engine.imm_counter(IMM_ACK);
    let t0 = Instant::now();
    let mut inflight = VecDeque::with_capacity(window);
    for i in 0..ops {
        let f = if size == 0 {
            s.engine.imm(&s.remote, IMM_DATA)
        } else {
            let off = ((i as usize % slots) * size) as u64;
            s.engine.write_imm(&s.region, off, &s.remote, off, size as u64, IMM_DATA)
        };
        inflight.push_back(f);
        if inflight.len() >= window {
            inflight.pop_front().expect("non-empty").await?;
        }
    }
    for f in inflight {
        f.await?;
    }
    ack.wait_for(1).await.expect("engine shut down during the benchmark");
    Ok(t0.elapsed())
}

/// Waits for the arrivals of `ops` write_imm of `size` bytes (`0`: imm-only): with several
/// domains a write larger than a shard is several arrivals (`Engine::write_arrivals`).
async fn engine_absorb(s: &Side, ops: u64, size: usize) -> Res<()> {
    let per_op = s.engine.write_arrivals(&s.remote, size as u64)?;
    s.engine
        .imm_counter(IMM_DATA)
        .wait_for(ops * per_op)
        .await
        .expect("engine shut down during the benchmark");
    s.engine.imm(&s.remote, IMM_ACK).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// bw
// ---------------------------------------------------------------------------------------------

fn bw_sizes(o: &Opts) -> Vec<usize> {
    if let Some(s) = &o.sizes {
        return s.clone();
    }
    match (on_verbs(o), o.quick) {
        (false, true) => vec![4 << 10, 64 << 10, 1 << 20, 4 << 20],
        (false, false) => (0..8).map(|i| (4usize << 10) << (2 * i)).collect(), // 4 KiB .. 64 MiB, x4
        (true, true) => vec![4 << 10, 64 << 10, 1 << 20],
        (true, false) => (0..5).map(|i| (4usize << 10) << (2 * i)).collect(), // 4 KiB .. 1 MiB, x4
    }
}

/// Writes per measured burst: about 1 GiB (quick: 16 MiB; verbs: 32 MiB, quick 8 MiB), at
/// least two windows (verbs: 32 writes), bounded.
fn bw_ops(o: &Opts, size: usize) -> u64 {
    if let Some(n) = o.iters {
        return n as u64;
    }
    let (target, max) = match (on_verbs(o), o.quick) {
        (false, true) => (16usize << 20, 1000),
        (false, false) => (1 << 30, 30_000),
        (true, true) => (8 << 20, 1000),
        (true, false) => (32 << 20, 4000),
    };
    if on_verbs(o) {
        // ~30 MB/s: two windows of 128 x 1 MiB would take 8 s per burst. At least 32 writes;
        // fewer than the window means every write is posted at once (ib_write_bw, given the
        // same -n and -t, does the same).
        return (target / size).clamp(32, max) as u64;
    }
    (target / size).clamp(2 * o.window, max) as u64
}

/// Region per side: up to `window` slots of the largest size, capped at 256 MiB (verbs:
/// 64 MiB; the test VM has 2 GiB for both processes, and writes in flight may share a slot).
fn region_len(o: &Opts, sizes: &[usize]) -> usize {
    let max = sizes.iter().copied().max().unwrap_or(1 << 20);
    let cap = if on_verbs(o) { 64 << 20 } else { 256 << 20 };
    (max * o.window).min(cap).max(max).max(1 << 20)
}

async fn bw_test(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let sizes = bw_sizes(&ctx.o);
    let reps = if ctx.o.quick { 1 } else { 3 };
    let window = ctx.o.window;
    let len = region_len(&ctx.o, &sizes);
    // Event mode: engine and raw loop alternate per size, so drift on this shared machine hits
    // both (an idle Event reactor sleeps). A spinning reactor would steal a core from the raw
    // loop on 2 cores, so other modes run the engine sweep, drop the engine, then the raw one.
    let interleave = ctx.o.mode == ReactorMode::Event;
    let passes: &[(bool, bool)] = if interleave { &[(true, true)] } else { &[(true, false), (false, true)] };
    let (mut e, mut b) = (vec![Vec::new(); sizes.len()], vec![Vec::new(); sizes.len()]);
    // On verbs, perftest's ib_write_bw too, run by the leader after each raw burst (so that
    // drift hits all three alike), with as many bytes and as many writes in flight (`-t`).
    let verbs = on_verbs(&ctx.o);
    let perftest = if verbs && ctx.lead { perftest_target(ctx, "ib_write_bw").await? } else { None };
    let mut p = vec![Vec::new(); sizes.len()];
    let mut side = Some(engine_side(ctx, ctx.o.mode, len).await?);
    let mut raw = if interleave { Some(raw_side(ctx, len).await?) } else { None };
    let steps = (passes.len() * sizes.len() * reps) as f64;
    for (pass, &(do_engine, do_raw)) in passes.iter().enumerate() {
        if !do_engine && side.is_some() {
            ctx.barrier("bw-engine-end").await?;
            side = None;
            raw = Some(raw_side(ctx, len).await?);
        }
        for (k, &size) in sizes.iter().enumerate() {
            let ops = bw_ops(&ctx.o, size);
            for r in 0..reps {
                let side_of = match (do_engine, do_raw) {
                    (true, true) => "",
                    (true, false) => "engine ",
                    _ => "raw ",
                };
                let what =
                    format!("{side_of}{}/{} {} x{ops} rep {}/{reps}", k + 1, sizes.len(), human(size), r + 1);
                let frac = ((pass * sizes.len() + k) * reps + r) as f64 / steps;
                ctx.progress("bw", frac, &what);
                if do_engine {
                    let s = side.as_ref().expect("engine side");
                    if ctx.lead {
                        e[k].push(gbps(size as u64 * ops, engine_stream(s, size, ops, window).await?));
                    } else {
                        engine_absorb(s, ops, size).await?;
                    }
                }
                if do_raw {
                    let w = window as u64;
                    if ctx.lead {
                        let (r2, t) = on_thread(raw.take().expect("raw"), move |r| {
                            r.stream(size, ops, w, IMM_DATA, IMM_ACK)
                        })
                        .await?;
                        raw = Some(r2);
                        b[k].push(gbps(size as u64 * ops, t));
                    } else {
                        let (r2, ()) =
                            on_thread(raw.take().expect("raw"), move |r| r.absorb(ops, IMM_DATA, IMM_ACK))
                                .await?;
                        raw = Some(r2);
                    }
                    if verbs {
                        if let Some(t) = perftest.clone() {
                            ctx.progress(
                                "bw",
                                frac,
                                &format!("{what}: ib_write_bw -s {size} -n {ops} -t {window}"),
                            );
                            let run = move || perftest::write_bw(&t, size, ops, window);
                            p[k].push(tokio::task::spawn_blocking(run).await??);
                        }
                        ctx.barrier("bw-perftest").await?;
                    }
                }
            }
        }
    }
    if ctx.lead {
        for (k, &size) in sizes.iter().enumerate() {
            let case = match ctx.o.mode {
                ReactorMode::Event => human(size),
                m => format!("{} [{}]", human(size), mode_name(m)),
            };
            let row = Row::new("bw", &case, "gbps", median(e[k].clone())).size(size);
            rep.push(row.baseline("raw", median(b[k].clone())));
        }
        for (k, &size) in sizes.iter().enumerate().filter(|_| verbs) {
            let case = format!("{} vs ib_write_bw -t {window}", human(size));
            let row = Row::new("bw", &case, "gbps", median(e[k].clone())).size(size);
            rep.push(if p[k].is_empty() { row } else { row.baseline("ib_write_bw", median(p[k].clone())) });
        }
    }
    ctx.barrier("bw-end").await?;
    Ok(())
}

/// iperf3 over loopback, when installed and the provider is tcp.
async fn iperf3(ctx: &mut Ctx, rep: &mut Report) {
    if ctx.o.provider != "tcp" {
        return;
    }
    if Command::new("iperf3").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
        ctx.note("iperf3 not installed: skipped");
        return;
    }
    ctx.progress("bw", 1.0, "baseline: iperf3 -l 1M");
    let secs = if ctx.o.quick { "1" } else { "2" };
    let res = tokio::task::spawn_blocking(move || run_iperf3(secs)).await;
    match res {
        Ok(Ok(g)) => {
            let engine = rep.bw_at(1 << 20);
            let mut row = Row::new("bw", "1 MiB vs iperf3 -l 1M", "gbps", engine.unwrap_or(f64::NAN));
            row = row.size(1 << 20).baseline("iperf3", g);
            rep.push(row);
        }
        Ok(Err(e)) => ctx.note(&format!("iperf3 failed: {e}")),
        Err(e) => ctx.note(&format!("iperf3 failed: {e}")),
    }
}

/// perftest's `ib_write_lat -s 8` beside the engine's 8 B round trip (verbs only). perftest
/// reports half a round trip, so its figures are doubled here.
async fn perftest_lat(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    if !on_verbs(&ctx.o) {
        return Ok(());
    }
    let tool = "ib_write_lat";
    let size = 8usize;
    let m = mode_name(lat_mode(&ctx.o));
    let e50 = rep.engine_of("lat", &format!("8 B p50 [{m}]")).unwrap_or(f64::NAN);
    let e99 = rep.engine_of("lat", &format!("8 B p99 [{m}]")).unwrap_or(f64::NAN);
    let r50 = Row::new("lat", &format!("8 B p50 [{m}] vs {tool} (2 x t_typical)"), "us", e50).size(size);
    let r99 = Row::new("lat", &format!("8 B p99 [{m}] vs {tool} (2 x 99%)"), "us", e99).size(size);
    let Some(t) = perftest_target(ctx, tool).await? else {
        rep.push(r50);
        rep.push(r99);
        return Ok(());
    };
    let iters = lat_iters(&ctx.o) as u64;
    ctx.progress("lat", 1.0, &format!("baseline: {tool} -s {size} -n {iters}"));
    let (typ, p99) = tokio::task::spawn_blocking(move || perftest::write_lat(&t, size, iters)).await??;
    rep.push(r50.baseline(tool, 2.0 * typ));
    rep.push(r99.baseline(tool, 2.0 * p99));
    Ok(())
}

/// Where perftest runs, or `None` (with a note) when `tool` is not installed.
async fn perftest_target(ctx: &mut Ctx, tool: &'static str) -> Res<Option<perftest::Target>> {
    if !perftest::installed(tool) {
        ctx.note(&format!("{tool} not installed (Debian package perftest): its rows have no baseline"));
        return Ok(None);
    }
    let provider = ctx.o.provider.clone();
    Ok(Some(tokio::task::spawn_blocking(move || perftest::Target::for_provider(&provider)).await??))
}

fn run_iperf3(secs: &str) -> Res<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let mut out = None;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(100));
        let o = Command::new("iperf3")
            .args(["-c", "127.0.0.1", "-B", "127.0.0.1", "-p", &port, "-l", "1M", "-t", secs, "-J"])
            .output()?;
        if o.status.success() {
            out = Some(o.stdout);
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = out.ok_or("the iperf3 client never connected")?;
    let v: serde_json::Value = serde_json::from_slice(&out)?;
    let bps =
        v["end"]["sum_received"]["bits_per_second"].as_f64().ok_or("no end.sum_received in iperf3 -J")?;
    Ok(bps / 1e9)
}

// ---------------------------------------------------------------------------------------------
// lat and wake: ping-pong
// ---------------------------------------------------------------------------------------------

fn mode_name(m: ReactorMode) -> &'static str {
    match m {
        ReactorMode::Event => "Event",
        ReactorMode::Adaptive { .. } => "Adaptive",
        ReactorMode::BusyPoll => "BusyPoll",
        _ => "?",
    }
}

/// The leader's round trips through futures: write_imm PING, await the PONG counter.
async fn engine_ping(s: &Side, size: usize, iters: usize) -> Res<Vec<Duration>> {
    let pong = s.engine.imm_counter(IMM_PONG);
    let mut writes = Vec::with_capacity(iters);
    let mut rtts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        // The write is posted when created; its local completion is collected at the end,
        // as the raw loop does.
        writes.push(s.engine.write_imm(&s.region, 0, &s.remote, 0, size as u64, IMM_PING));
        pong.wait_for(1).await.expect("engine shut down during the benchmark");
        rtts.push(t.elapsed());
    }
    for r in join_all(writes).await {
        r?;
    }
    Ok(rtts)
}

async fn engine_pong(s: &Side, size: usize, iters: usize) -> Res<()> {
    let ping = s.engine.imm_counter(IMM_PING);
    let mut writes = Vec::with_capacity(iters);
    for _ in 0..iters {
        ping.wait_for(1).await.expect("engine shut down during the benchmark");
        writes.push(s.engine.write_imm(&s.region, 0, &s.remote, 0, size as u64, IMM_PONG));
    }
    for r in join_all(writes).await {
        r?;
    }
    Ok(())
}

/// The synchronous path: post_write_imm into an OpBatch, spin_wait on the counter.
fn spin_ping(s: &Side, size: usize, iters: usize, lead: bool) -> Res<Vec<Duration>> {
    let batch = OpBatch::new();
    let (wait, send) = if lead { (IMM_PONG, IMM_PING) } else { (IMM_PING, IMM_PONG) };
    let counter = s.engine.imm_counter(wait);
    let mut rtts = Vec::with_capacity(iters);
    let tmo = Duration::from_secs(30);
    for _ in 0..iters {
        let t = Instant::now();
        if lead {
            s.engine.post_write_imm(&batch, &s.region, 0, &s.remote, 0, size as u64, send)?;
        }
        if !counter.spin_wait(1, tmo) {
            return Err("spin_wait timed out".into());
        }
        if !lead {
            s.engine.post_write_imm(&batch, &s.region, 0, &s.remote, 0, size as u64, send)?;
        }
        rtts.push(t.elapsed());
    }
    if !batch.spin_until(iters as u64, tmo)? {
        return Err("OpBatch::spin_until timed out".into());
    }
    Ok(rtts)
}

fn lat_iters(o: &Opts) -> usize {
    o.iters.unwrap_or(if o.quick { 200 } else { 3000 })
}

/// The engine mode of latency rows: Event on tcp; shm has no CQ wait fd (Event mode polls it
/// with a backoff up to 1 ms once 1 ms passed without activity), so BusyPoll there.
fn lat_mode(o: &Opts) -> ReactorMode {
    if o.provider == "shm" {
        ReactorMode::BusyPoll
    } else {
        ReactorMode::Event
    }
}

async fn lat_test(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let iters = lat_iters(&ctx.o);
    let mode = lat_mode(&ctx.o);
    let sizes = [8usize, 256, 4096];
    // The engine first, then the raw loop with the engine gone: a BusyPoll reactor left
    // spinning would steal a core from the raw loop on this 2-core machine.
    let mut eng = Vec::new();
    {
        let side = engine_side(ctx, mode, 1 << 20).await?;
        for (i, size) in sizes.into_iter().enumerate() {
            let frac = i as f64 / (2 * sizes.len()) as f64;
            ctx.progress("lat", frac, &format!("engine {} x{iters}", human(size)));
            ctx.barrier("ping").await?;
            if ctx.lead {
                eng.push(percentiles(&engine_ping(&side, size, iters).await?));
            } else {
                engine_pong(&side, size, iters).await?;
            }
        }
        ctx.barrier("lat-engine-end").await?;
    }
    let mut raw = Some(raw_side(ctx, 1 << 20).await?);
    for (i, size) in sizes.into_iter().enumerate() {
        let frac = (sizes.len() + i) as f64 / (2 * sizes.len()) as f64;
        ctx.progress("lat", frac, &format!("raw {} x{iters}", human(size)));
        ctx.barrier("ping").await?;
        if ctx.lead {
            let (r2, rtts) =
                on_thread(raw.take().expect("raw"), move |r| r.ping(size, iters, IMM_PING, IMM_PONG)).await?;
            raw = Some(r2);
            let ((e50, e99), (b50, b99)) = (eng[i], percentiles(&rtts));
            let m = mode_name(mode);
            let h = human(size);
            rep.push(Row::new("lat", &format!("{h} p50 [{m}]"), "us", e50).size(size).baseline("raw", b50));
            rep.push(Row::new("lat", &format!("{h} p99 [{m}]"), "us", e99).size(size).baseline("raw", b99));
        } else {
            let (r2, ()) =
                on_thread(raw.take().expect("raw"), move |r| r.pong(size, iters, IMM_PING, IMM_PONG)).await?;
            raw = Some(r2);
        }
    }
    ctx.barrier("lat-end").await?;
    Ok(())
}

/// Round trips between two threads that sleep in `thread::park` (futex) and wake each other.
fn thread_handoff(iters: usize) -> Vec<Duration> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let turn = Arc::new(AtomicU64::new(0));
    let main = std::thread::current();
    let t2 = turn.clone();
    let other = std::thread::spawn(move || {
        for i in 0..iters as u64 {
            while t2.load(Ordering::Acquire) != 2 * i + 1 {
                std::thread::park();
            }
            t2.store(2 * i + 2, Ordering::Release);
            main.unpark();
        }
    });
    let mut rtts = Vec::with_capacity(iters);
    for i in 0..iters as u64 {
        let t = Instant::now();
        turn.store(2 * i + 1, Ordering::Release);
        other.thread().unpark();
        while turn.load(Ordering::Acquire) != 2 * i + 2 {
            std::thread::park();
        }
        rtts.push(t.elapsed());
    }
    other.join().expect("handoff thread");
    rtts
}

#[derive(Clone, Copy)]
enum WakeCase {
    Mode(ReactorMode),
    /// post_write_imm + spin_wait on the caller's thread, reactor in this mode.
    Spin(ReactorMode),
}

async fn run_wake(ctx: &Ctx, case: WakeCase, side: &Arc<Side>, size: usize, n: usize) -> Res<Vec<Duration>> {
    Ok(match case {
        WakeCase::Mode(_) if ctx.lead => engine_ping(side, size, n).await?,
        WakeCase::Mode(_) => {
            engine_pong(side, size, n).await?;
            Vec::new()
        }
        WakeCase::Spin(_) => {
            let (s, lead) = (side.clone(), ctx.lead);
            tokio::task::spawn_blocking(move || spin_ping(&s, size, n, lead)).await??
        }
    })
}

async fn wake_test(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let iters = lat_iters(&ctx.o);
    let idle = Duration::from_millis(if ctx.o.quick { 300 } else { 1000 });
    let size = 8;
    // The raw baseline, once, with its CPU use.
    let mut raw = Some(raw_side(ctx, 1 << 20).await?);
    ctx.barrier("wake-raw").await?;
    let (raw50, raw_cpu) = if ctx.lead {
        let (c0, t0) = (cpu_time(), Instant::now());
        let (_, rtts) =
            on_thread(raw.take().expect("raw"), move |r| r.ping(size, iters, IMM_PING, IMM_PONG)).await?;
        let cpu = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0;
        (percentiles(&rtts).0, cpu)
    } else {
        on_thread(raw.take().expect("raw"), move |r| r.pong(size, iters, IMM_PING, IMM_PONG)).await?;
        (0.0, 0.0)
    };
    ctx.barrier("wake-raw-end").await?;
    if ctx.lead {
        // What one cross-thread wake-up costs on this machine: the engine hands every
        // operation from the caller to the reactor and every completion back.
        let (p50, p99) = percentiles(&thread_handoff(iters));
        rep.push(Row::new("wake", "OS: thread park/unpark round trip p50", "us", p50));
        rep.push(Row::new("wake", "OS: thread park/unpark round trip p99", "us", p99));
    }
    let cases = [
        WakeCase::Mode(ReactorMode::Event),
        WakeCase::Mode(ReactorMode::Adaptive { spin: Duration::from_micros(200) }),
        WakeCase::Mode(ReactorMode::BusyPoll),
        WakeCase::Spin(ReactorMode::Event),
        WakeCase::Spin(ReactorMode::BusyPoll),
    ];
    let ncases = cases.len() as f64;
    for (c, case) in cases.into_iter().enumerate() {
        let (name, mode) = match case {
            WakeCase::Mode(m) => (mode_name(m).to_string(), m),
            WakeCase::Spin(m) => (format!("spin path ({})", mode_name(m)), m),
        };
        ctx.progress("wake", c as f64 / ncases, &format!("{name}: probe"));
        let side = Arc::new(engine_side(ctx, mode, 1 << 20).await?);
        // Some cases are pathological on 2 cores (four spinning threads): a short probe sets
        // how many round trips fit in about 3 s (verbs in the VM: 1.5 s, quick 0.5 s), so the
        // run stays bounded in time.
        let (probe, budget_us) = match (on_verbs(&ctx.o), ctx.o.quick) {
            (false, _) => (20, 3e6),
            (true, false) => (10, 1.5e6),
            (true, true) => (10, 0.5e6),
        };
        let rt = run_wake(ctx, case, &side, size, probe).await?;
        let n = if ctx.lead {
            let p50 = percentiles(&rt).0.max(1.0);
            let n = (iters as f64).min(budget_us / p50).max(probe as f64) as u64;
            ctx.swap("wake-n", n.to_le_bytes().to_vec()).await?;
            n as usize
        } else {
            u64::from_le_bytes(ctx.swap("wake-n", Vec::new()).await?[..8].try_into()?) as usize
        };
        ctx.progress("wake", (c as f64 + 0.1) / ncases, &format!("{name} x{n}"));
        ctx.barrier("wake-go").await?;
        let (c0, t0) = (cpu_time(), Instant::now());
        let rtts = run_wake(ctx, case, &side, size, n).await?;
        let busy_cpu = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0;
        // Idle: both sides keep their engines and do nothing.
        ctx.barrier("wake-idle").await?;
        let (c1, t1) = (cpu_time(), Instant::now());
        tokio::time::sleep(idle).await;
        let idle_cpu = (cpu_time() - c1).as_secs_f64() / t1.elapsed().as_secs_f64() * 100.0;
        ctx.barrier("wake-end").await?;
        drop(side);
        if ctx.lead {
            let (p50, p99) = percentiles(&rtts);
            let name = format!("{name} ({} RT)", rtts.len());
            rep.push(
                Row::new("wake", &format!("{name} 8 B p50"), "us", p50).size(size).baseline("raw", raw50),
            );
            rep.push(Row::new("wake", &format!("{name} 8 B p99"), "us", p99).size(size));
            rep.push(
                Row::new("wake", &format!("{name} CPU while ping-pong"), "cpu_pct", busy_cpu)
                    .baseline("raw", raw_cpu),
            );
            rep.push(Row::new("wake", &format!("{name} CPU idle"), "cpu_pct", idle_cpu));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// rate
// ---------------------------------------------------------------------------------------------

fn rate_ops(o: &Opts) -> u64 {
    let n = match (on_verbs(o), o.quick) {
        (false, true) => 5_000,
        (false, false) => 200_000,
        (true, true) => 2_000,
        (true, false) => 20_000,
    };
    o.iters.map_or(n, |n| n as u64)
}

const RATE_WINDOW: usize = 64;

/// Imm-only ops/s through the sync path: post_imm into an OpBatch, keep `window` in flight.
fn batch_stream(s: &Side, ops: u64, window: u64) -> Res<Duration> {
    let batch = OpBatch::new();
    let ack = s.engine.imm_counter(IMM_ACK);
    let t0 = Instant::now();
    let mut posted = 0;
    while posted < ops {
        if posted - batch.completed() < window {
            s.engine.post_imm(&batch, &s.remote, IMM_DATA)?;
            posted += 1;
        } else {
            std::hint::spin_loop();
        }
    }
    if !batch.spin_until(ops, Duration::from_secs(60))? {
        return Err("batch never completed".into());
    }
    if !ack.spin_wait(1, Duration::from_secs(60)) {
        return Err("no ack".into());
    }
    Ok(t0.elapsed())
}

async fn rate_test(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let ops = rate_ops(&ctx.o);
    let reps = if ctx.o.quick { 1 } else { 3 };
    let side = Arc::new(engine_side(ctx, ctx.o.mode, 1 << 20).await?);
    let mut raw = Some(raw_side(ctx, 1 << 20).await?);
    let (mut e, mut b) = (Vec::new(), Vec::new());
    for r in 0..reps {
        ctx.progress(
            "rate",
            r as f64 / (reps + 1) as f64,
            &format!("imm futures x{ops} rep {}/{reps}", r + 1),
        );
        if ctx.lead {
            e.push(ops as f64 / engine_stream(&side, 0, ops, RATE_WINDOW).await?.as_secs_f64());
            let (r2, t) = on_thread(raw.take().expect("raw"), move |r| {
                r.stream(0, ops, RATE_WINDOW as u64, IMM_DATA, IMM_ACK)
            })
            .await?;
            raw = Some(r2);
            b.push(ops as f64 / t.as_secs_f64());
        } else {
            engine_absorb(&side, ops, 0).await?;
            let (r2, ()) =
                on_thread(raw.take().expect("raw"), move |r| r.absorb(ops, IMM_DATA, IMM_ACK)).await?;
            raw = Some(r2);
        }
    }
    ctx.barrier("rate-end").await?;
    if ctx.lead {
        let base = median(b);
        rep.push(
            Row::new("rate", &format!("imm futures, window {RATE_WINDOW}"), "ops_per_s", median(e))
                .baseline("raw", base),
        );
        rep.set_raw_rate(base);
    }
    // The same through post_imm + OpBatch (Event reactor; the caller spins on the batch).
    ctx.progress("rate", reps as f64 / (reps + 1) as f64, &format!("post_imm+OpBatch x{ops}"));
    ctx.barrier("rate-batch").await?;
    if ctx.lead {
        let s = side.clone();
        let t = tokio::task::spawn_blocking(move || batch_stream(&s, ops, RATE_WINDOW as u64)).await??;
        let v = ops as f64 / t.as_secs_f64();
        let row = Row::new("rate", &format!("imm post_imm+OpBatch, window {RATE_WINDOW}"), "ops_per_s", v);
        rep.push(row.baseline("raw", rep.raw_rate().unwrap_or(f64::NAN)));
    } else {
        engine_absorb(&side, ops, 0).await?;
    }
    ctx.barrier("rate-batch-end").await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// scale
// ---------------------------------------------------------------------------------------------

async fn scale_test(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let verbs = on_verbs(&ctx.o);
    let peer_counts: Vec<usize> = match (verbs, ctx.o.quick) {
        (_, true) => vec![1, 4],
        (false, false) => vec![1, 4, 16, 64, 256],
        (true, false) => vec![1, 4, 16],
    };
    let size = 64usize << 10;
    // About 256 MiB per point (quick: 16 MiB; verbs: 16 MiB, quick 4 MiB), spread evenly over
    // the peers.
    let total: u64 = match (verbs, ctx.o.quick) {
        (false, true) => 256,
        (false, false) => 4096,
        (true, true) => 64,
        (true, false) => 256,
    };
    let mut one_peer = None;
    for (j, &k) in peer_counts.iter().enumerate() {
        let what = format!("{}/{} {k} peers", j + 1, peer_counts.len());
        ctx.progress("scale", 0.5 * j as f64 / peer_counts.len() as f64, &what);
        let per_peer = total.div_ceil(k as u64).max(16);
        // The peer process hosts k engines (k reactor threads, k endpoints); the leader has
        // one engine with k peers.
        if ctx.lead {
            let engine = builder(&ctx.o).build()?;
            let src = engine.alloc(size).await?;
            fill(&src)?;
            let theirs = ctx.swap("scale", src.descriptor().to_bytes()).await?;
            let descs = decode_descs(&theirs)?;
            trim();
            let rss0 = rss();
            let mut remotes = Vec::with_capacity(k);
            for d in &descs {
                let r = engine.remote_region(d).await?;
                engine.imm(&r, IMM_WARM).await?;
                remotes.push(r);
            }
            let ops = per_peer * k as u64;
            let ack = engine.imm_counter(IMM_ACK);
            let t0 = Instant::now();
            let mut inflight = VecDeque::new();
            for i in 0..ops {
                let dst = &remotes[i as usize % k];
                inflight.push_back(engine.write_imm(&src, 0, dst, 0, size as u64, IMM_DATA));
                if inflight.len() >= ctx.o.window {
                    inflight.pop_front().expect("non-empty").await?;
                }
            }
            for f in inflight {
                f.await?;
            }
            ack.wait_for(1).await.expect("engine shut down during the benchmark");
            let g = gbps(size as u64 * ops, t0.elapsed());
            let lead_per_peer = rss().saturating_sub(rss0) as f64 / k as f64;
            let base = *one_peer.get_or_insert(g);
            let msg = ctx.swap("scale-rss", Vec::new()).await?;
            let rss_peer = f64::from_le_bytes(msg[..8].try_into()?);
            let stop = msg[8] != 0;
            let label = format!("{k} peers, 64 KiB write_imm");
            rep.push(Row::new("scale", &label, "gbps", g).baseline("1 peer", base));
            rep.push(Row::new(
                "scale",
                &format!("{k} peers: leader RSS per peer"),
                "kib",
                lead_per_peer / 1024.0,
            ));
            rep.push(Row::new(
                "scale",
                &format!("{k} peers: peer-process RSS per engine"),
                "kib",
                rss_peer / 1024.0,
            ));
            ctx.barrier("scale-end").await?;
            if stop {
                ctx.note(&format!(
                    "scale: stopped after {k} peer engines: the next step would need more than half \
                     the free memory"
                ));
                break;
            }
        } else {
            trim();
            let rss0 = rss();
            let mut engines = Vec::with_capacity(k);
            for _ in 0..k {
                let e = builder(&ctx.o).build()?;
                let r = e.alloc(size).await?;
                engines.push((e, r));
            }
            let mut msg = Vec::new();
            for (_, r) in &engines {
                let d = r.descriptor().to_bytes();
                msg.extend_from_slice(&(d.len() as u32).to_le_bytes());
                msg.extend_from_slice(&d);
            }
            let lead_desc = ctx.swap("scale", msg).await?;
            // Engine 0 acks into the leader's region once every engine has its arrivals.
            let (e0, _) = &engines[0];
            let back = e0.remote_region(&lead_desc).await?;
            let waits = engines.iter().map(|(e, _)| e.imm_counter(IMM_DATA).wait_for(per_peer));
            for r in join_all(waits).await {
                r?;
            }
            e0.imm(&back, IMM_ACK).await?;
            // After traffic, so that pools the provider fills lazily are counted.
            let per = rss().saturating_sub(rss0) as f64 / k as f64;
            // Each engine costs tens of MiB on tcp (provider buffer pools): do not let the
            // next step exhaust the machine.
            let next = peer_counts.iter().find(|&&n| n > k).copied().unwrap_or(0);
            let stop = per * next as f64 > mem_available() as f64 / 2.0;
            let mut msg = per.to_le_bytes().to_vec();
            msg.push(stop as u8);
            ctx.swap("scale-rss", msg).await?;
            drop(engines);
            ctx.barrier("scale-end").await?;
            if stop {
                break;
            }
        }
    }
    inflight_test(ctx, rep).await
}

fn decode_descs(b: &[u8]) -> Res<Vec<Vec<u8>>> {
    let mut v = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let n = u32::from_le_bytes(b[i..i + 4].try_into()?) as usize;
        v.push(b[i + 4..i + 4 + n].to_vec());
        i += 4 + n;
    }
    Ok(v)
}

async fn inflight_test(ctx: &mut Ctx, rep: &mut Report) -> Res<()> {
    let counts: Vec<u64> = match (on_verbs(&ctx.o), ctx.o.quick) {
        (_, true) => vec![1, 100, 1000],
        (false, false) => vec![1, 10, 100, 1000, 10_000, 100_000],
        (true, false) => vec![1, 10, 100, 1000, 10_000],
    };
    let side = engine_side(ctx, ReactorMode::Event, 1 << 20).await?;
    // The baseline is the raw loop's imm-only rate: measured by `rate`, or here if it did not run.
    if !(ctx.o.test == "all" || ctx.o.test == "rate") {
        let ops = match (on_verbs(&ctx.o), ctx.o.quick) {
            (false, true) => 5_000,
            (false, false) => 50_000,
            (true, true) => 2_000,
            (true, false) => 20_000,
        };
        let raw = raw_side(ctx, 1 << 20).await?;
        if ctx.lead {
            let (_, t) =
                on_thread(raw, move |r| r.stream(0, ops, RATE_WINDOW as u64, IMM_DATA, IMM_ACK)).await?;
            rep.set_raw_rate(ops as f64 / t.as_secs_f64());
        } else {
            on_thread(raw, move |r| r.absorb(ops, IMM_DATA, IMM_ACK)).await?;
        }
        ctx.barrier("inflight-raw").await?;
    }
    for (i, &n) in counts.iter().enumerate() {
        let what = format!("{}/{} {n} futures in flight", i + 1, counts.len());
        ctx.progress("scale", 0.5 + 0.5 * i as f64 / counts.len() as f64, &what);
        ctx.barrier("inflight").await?;
        if ctx.lead {
            trim();
            let rss0 = rss();
            let ack = side.engine.imm_counter(IMM_ACK);
            let t0 = Instant::now();
            let futs: Vec<_> = (0..n).map(|_| side.engine.imm(&side.remote, IMM_DATA)).collect();
            let rss1 = rss();
            for r in join_all(futs).await {
                r?;
            }
            ack.wait_for(1).await.expect("engine shut down during the benchmark");
            let rate = n as f64 / t0.elapsed().as_secs_f64();
            let row = Row::new("scale", &format!("{n} imm futures in flight"), "ops_per_s", rate);
            rep.push(row.baseline("raw rate", rep.raw_rate().unwrap_or(f64::NAN)));
            let per = rss1.saturating_sub(rss0) as f64 / n as f64;
            rep.push(Row::new("scale", &format!("{n} in flight: RSS per future"), "bytes", per));
        } else {
            engine_absorb(&side, n, 0).await?;
        }
    }
    ctx.barrier("inflight-end").await?;
    Ok(())
}
