//! Process plumbing and what every test shares.
//!
//! The leader starts a second copy of this binary as the peer (`--peer-of ADDR`,
//! [`Ctx::leader`]); both processes then run the same sequence of phases (`run.rs`), each
//! side playing its role, and meet at [`Ctx::swap`] / [`Ctx::barrier`] (keys in a `TcpStore`
//! on 127.0.0.1). The tests use this module; it uses none of them.
//!
//! ```text
//!  leader (this process)                         peer (current_exe --peer-of ADDR)
//!  TcpStoreServer 127.0.0.1:0 <--- swap/barrier ---> TcpStore client
//!  Engine / Raw  ====== write_imm, imm (provider: tcp, shm, verbs) ======  Engine / Raw
//!  Report: table, --json, plot                   (no output)
//! ```

use std::collections::VecDeque;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::{Engine, EngineBuilder, MemoryRegion, ReactorMode, RemoteRegion};

use crate::pattern::Pattern;
use crate::perftest;
use crate::progress::Progress;
use crate::raw::Raw;
use crate::Opts;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Res<T> = std::result::Result<T, BoxError>;

// Immediates used by the phases (any distinct values do).
pub const IMM_DATA: u32 = 1;
pub const IMM_ACK: u32 = 2;
pub const IMM_PING: u32 = 3;
pub const IMM_PONG: u32 = 4;
/// Warm-up writes: they set up the connection (rxm connects on first use) outside timings.
pub const IMM_WARM: u32 = 5;

/// One side's state: its role, the meeting point and the progress display.
pub struct Ctx {
    pub o: Opts,
    /// This process is the leader (it reports); the peer only plays its part.
    pub lead: bool,
    store: TcpStore,
    /// The leader's: the store's server, alive as long as the context.
    _server: Option<TcpStoreServer>,
    phase: u64,
    progress: Progress,
}

impl Ctx {
    /// The leader's side: a store on 127.0.0.1:0, and the peer, this binary started with our
    /// arguments and `--peer-of ADDR`. The caller waits for the child (or kills it).
    pub async fn leader(o: Opts) -> Res<(Ctx, Child)> {
        let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
        let store = TcpStore::connect(server.local_addr()).await?.with_timeout(Duration::from_secs(300));
        let mut args: Vec<String> = std::env::args().skip(1).collect();
        args.extend(["--peer-of".to_string(), server.local_addr().to_string()]);
        let child = Command::new(std::env::current_exe()?).args(&args).stdin(Stdio::null()).spawn()?;
        let ctx =
            Ctx { o, lead: true, store, _server: Some(server), phase: 0, progress: Progress::new(true) };
        Ok((ctx, child))
    }

    /// The peer's side: connected to the leader's store at `addr`.
    pub async fn peer(o: Opts, addr: &str) -> Res<Ctx> {
        let store = TcpStore::connect(addr.parse()?).await?.with_timeout(Duration::from_secs(300));
        Ok(Ctx { o, lead: false, store, _server: None, phase: 0, progress: Progress::new(false) })
    }

    /// Clears the progress bar (the leader, once the tests are done).
    pub fn finish_progress(&mut self) {
        self.progress.finish();
    }

    /// Gives our bytes for this phase to the other side and returns theirs.
    pub async fn swap(&mut self, tag: &str, mine: Vec<u8>) -> Res<Vec<u8>> {
        self.phase += 1;
        let (me, them) = if self.lead { ("L", "P") } else { ("P", "L") };
        self.store.put(&format!("{}/{tag}/{me}", self.phase), mine).await?;
        Ok(self.store.get(&format!("{}/{tag}/{them}", self.phase)).await?)
    }

    pub async fn barrier(&mut self, tag: &str) -> Res<()> {
        self.swap(tag, Vec::new()).await.map(drop)
    }

    /// The progress bar (leader only): `test` has done `frac` of its steps and runs `what`.
    pub fn progress(&mut self, test: &str, frac: f64, what: &str) {
        self.progress.update(test, frac, what);
    }

    /// A line on stdout during the run, on a line of its own (not after the bar).
    pub fn note(&mut self, msg: &str) {
        self.progress.println(msg);
    }
}

/// An engine builder for the run's provider and NIC count. `--domains N` shards every
/// engine transfer over N domains (the default 1 MiB shards); the raw baselines stay on one.
pub fn builder(o: &Opts) -> fabric_async::EngineBuilder {
    builder_domains(o, o.domains)
}

/// [`builder`] with `domains` NICs (bw's `--domains 1,2,4`).
pub fn builder_domains(o: &Opts, domains: usize) -> fabric_async::EngineBuilder {
    let mut b = Engine::builder().provider(&o.provider).huge_pages(o.huge_pages);
    if let Some(d) = o.await_spin {
        b = b.await_spin(d);
    }
    if let Some(d) = o.await_linger {
        b = b.await_linger(d);
    }
    if let Some(d) = o.poll_window {
        b = b.poll_window(d);
    }
    if let Some(n) = o.staging_pool {
        b = b.staging_pool(n as u64);
    }
    if let Some(n) = o.staging_chunk {
        b = b.staging_chunk(n as u64);
    }
    if domains > 1 {
        b.domains(domains)
    } else {
        b
    }
}

/// An engine in `mode` with a registered region of `len` bytes, connected to the other
/// side's region.
pub struct Side {
    pub engine: Engine,
    pub region: MemoryRegion,
    pub remote: RemoteRegion,
}

pub async fn engine_side(ctx: &mut Ctx, mode: ReactorMode, len: usize) -> Res<Side> {
    engine_side_with(ctx, builder(&ctx.o).mode(mode), len).await
}

/// [`engine_side`] with an engine of these settings.
pub async fn engine_side_with(ctx: &mut Ctx, b: EngineBuilder, len: usize) -> Res<Side> {
    let engine = b.build()?;
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
pub fn fill(r: &MemoryRegion) -> Res<()> {
    let chunk = vec![0x5au8; 1 << 20];
    let mut off = 0;
    while off < r.len() {
        let n = chunk.len().min(r.len() - off);
        r.write_at(off as u64, &chunk[..n])?;
        off += n;
    }
    Ok(())
}

pub async fn raw_side(ctx: &mut Ctx, len: usize) -> Res<Raw> {
    let (mut raw, mine) = Raw::open(&ctx.o.provider, len, ctx.o.huge_pages)?;
    let theirs = ctx.swap("raw", mine).await?;
    raw.connect(&theirs)?;
    on_thread(raw, |r| r.warm_up(IMM_WARM)).await.map(|(r, ())| r)
}

/// Runs `f` on a plain thread with the raw side (the runtime thread keeps serving the store).
pub async fn on_thread<T: Send + 'static>(
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

/// Streams `ops` write_imm of `size` (`size == 0`: imm-only) with `window` in flight, at the
/// offsets of `pattern` in the region (as `Raw::stream`), then waits for the receiver's ack.
pub async fn engine_stream(
    s: &Side,
    size: usize,
    ops: u64,
    window: usize,
    pattern: Pattern,
) -> Res<Duration> {
    let region = s.region.len();
    let ack = s.engine.imm_counter(IMM_ACK);
    let t0 = Instant::now();
    let mut inflight = VecDeque::with_capacity(window);
    for i in 0..ops {
        let f = if size == 0 {
            s.engine.imm(&s.remote, IMM_DATA)
        } else {
            let off = pattern.offset(i, size, region) as u64;
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
pub async fn engine_absorb(s: &Side, ops: u64, size: usize) -> Res<()> {
    let per_op = s.engine.write_arrivals(&s.remote, size as u64)?;
    s.engine
        .imm_counter(IMM_DATA)
        .wait_for(ops * per_op)
        .await
        .expect("engine shut down during the benchmark");
    s.engine.imm(&s.remote, IMM_ACK).await?;
    Ok(())
}

/// Where perftest runs, or `None` (with a note) when `tool` is not installed.
pub async fn perftest_target(ctx: &mut Ctx, tool: &'static str) -> Res<Option<perftest::Target>> {
    if !perftest::installed(tool) {
        ctx.note(&format!("{tool} not installed (Debian package perftest): its rows have no baseline"));
        return Ok(None);
    }
    let provider = ctx.o.provider.clone();
    Ok(Some(tokio::task::spawn_blocking(move || perftest::Target::for_provider(&provider)).await??))
}

pub fn mode_name(m: ReactorMode) -> &'static str {
    match m {
        ReactorMode::Event => "Event",
        ReactorMode::Adaptive { .. } => "Adaptive",
        ReactorMode::BusyPoll => "BusyPoll",
        ReactorMode::Inline => "Inline",
        _ => "?",
    }
}
