//! MoE dispatch and combine across R ranks (processes), step after step, every token checked.
//!
//! ```text
//! cargo run --release --example moe -- [--ranks 4] [--steps 200] [--tokens 128] [--hidden 2048]
//!                                      [--topk 2] [--modes spin,inline,event] [--provider shm]
//! ```
//!
//! Each step, every rank routes each of its tokens to `topk` experts on other ranks (a
//! different, pseudo-random routing every step, so counts per destination vary), gathers the
//! tokens per destination and **dispatches** them with one `write_imm` per destination: a
//! 16-byte header (token count, step) followed by the tokens, into that rank's landing slot
//! for this source. Every source writes to every other rank, also when it has no token for it
//! (a header alone), so an expert knows it has everything when `ranks - 1` dispatch
//! immediates have arrived, whatever the counts. Experts read the counts from the headers,
//! transform the tokens (XOR with a per-expert key) and **combine**: one `write_imm` back to
//! each source, into the source's slot for that expert, in the order the source sent them.
//! The source waits for `ranks - 1` combine immediates and checks that every token came back
//! transformed by the expert it was routed to, at its own position.
//!
//! The same steps run in three ways, each timed (µs per dispatch + combine, on rank 0):
//!
//! - `spin`: a `BusyPoll` reactor, and the synchronous spin path (`post_write_imm`,
//!   `ImmCounter::spin_wait`) on a thread of its own;
//! - `inline`: `ReactorMode::Inline`: ordinary futures (`write_imm(..).await`,
//!   `wait_for(n).await`) on a current-thread runtime of their own, which drive the NICs
//!   themselves and never park the thread;
//! - `event`: `ReactorMode::Event`: the same futures on the main runtime, woken by the reactor.
//!
//! With `--nics N` each peer's writes are pinned to one NIC (peers spread over the NICs), so
//! every write is one arrival. With `--location cuda` every buffer is GPU memory (staged or
//! CUDA IPC, `docs/gpu.md`); the spin path is skipped there (it does not stage GPU memory).
//!
//! Rank 0 starts the other ranks (copies of this program); they meet through a `TcpStore` on
//! 127.0.0.1. Any wrong byte, missing arrival or failed write makes the run exit non-zero.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use fabric_async::bootstrap::{all_gather, TcpStore, TcpStoreServer};
use fabric_async::{Engine, MemoryRegion, OpBatch, PeerId, ReactorMode, RemoteRegion, TransferOpts};
use fabric_examples::{
    engine_builder, percentiles, positive, unless_down, wait_arrivals, BoxError, DownWatch, LocationArg,
    NicsArg, ProviderArg,
};

const IMM_DISPATCH: u32 = 21;
const IMM_COMBINE: u32 = 22;
const HEADER: usize = 16;
/// Longest a step may wait for its arrivals before the run fails (never a hang).
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// MoE dispatch/combine across --ranks processes for --steps steps, every token checked, in
/// the spin path, Inline futures and Event futures; prints µs per step (p50/p99) of each.
#[derive(Parser, Debug, Clone)]
#[command(name = "moe", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    provider: ProviderArg,
    #[command(flatten)]
    nics: NicsArg,
    #[command(flatten)]
    location: LocationArg,
    /// Ranks (processes), each holding experts for the others' tokens.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = positive)]
    ranks: usize,
    /// Dispatch + combine steps per mode (each with its own routing).
    #[arg(long, value_name = "N", default_value_t = 200, value_parser = positive)]
    steps: usize,
    /// Tokens per rank per step.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = positive)]
    tokens: usize,
    /// Bytes per token (the hidden state: 2048 = 1024 bf16 values).
    #[arg(long, value_name = "BYTES", default_value_t = 2048, value_parser = positive)]
    hidden: usize,
    /// Experts per token (each on a different rank; at most ranks - 1).
    #[arg(long, value_name = "K", default_value_t = 2, value_parser = positive)]
    topk: usize,
    /// The ways to run the steps, in order.
    #[arg(long, value_delimiter = ',', default_value = "spin,inline,event")]
    modes: Vec<Mode>,
    /// Internal: this process's rank, started by rank 0 whose TcpStore is at --store.
    #[arg(long, hide = true, default_value_t = 0)]
    rank: usize,
    /// Internal: rank 0's TcpStore.
    #[arg(long, hide = true)]
    store: Option<String>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// BusyPoll reactor + post_write_imm / spin_wait on a dedicated thread.
    Spin,
    /// ReactorMode::Inline futures on a current-thread runtime of their own.
    Inline,
    /// ReactorMode::Event futures on the main runtime.
    Event,
}

impl Mode {
    fn reactor(self) -> ReactorMode {
        match self {
            Mode::Spin => ReactorMode::BusyPoll,
            Mode::Inline => ReactorMode::Inline,
            Mode::Event => ReactorMode::Event,
        }
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if cli.topk >= cli.ranks {
        eprintln!("moe: --topk {} needs more than {} ranks", cli.topk, cli.ranks);
        std::process::exit(2);
    }
    if let Err(e) = run(cli).await {
        eprintln!("moe failed: {e}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> Result<(), BoxError> {
    // Rank 0 owns the store and starts the others.
    let (_server, addr, mut children) = match &cli.store {
        Some(a) => (None, a.parse()?, Vec::new()),
        None => {
            let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
            let addr = server.local_addr();
            let children =
                (1..cli.ranks).map(|r| spawn_rank(&cli, r, addr)).collect::<Result<Vec<_>, _>>()?;
            (Some(server), addr, children)
        }
    };
    let store = TcpStore::connect(addr).await?.with_timeout(Duration::from_secs(120));
    if cli.rank == 0 {
        println!(
            "moe: {} ranks on {}, {} tokens x {} B per rank, top-{}, {} steps per mode",
            cli.ranks, cli.provider.name, cli.tokens, cli.hidden, cli.topk, cli.steps
        );
    }
    let mut failed = false;
    for mode in cli.modes.clone() {
        if mode == Mode::Spin && cli.location.memory() != fabric_async::MemoryLocation::Host {
            if cli.rank == 0 {
                println!("moe: spin   skipped: the synchronous path does not stage GPU memory yet");
            }
            continue;
        }
        let times = match run_mode(&cli, &store, mode).await {
            Ok(t) => t,
            Err(e) => {
                eprintln!("moe rank {}: {mode:?}: {e}", cli.rank);
                failed = true;
                break;
            }
        };
        if cli.rank == 0 {
            let (p50, p99) = percentiles(times);
            println!(
                "moe: {:<6} {:>5} steps   dispatch+combine p50 {p50:>8.1} us   p99 {p99:>8.1} us   every token checked",
                format!("{mode:?}").to_lowercase(),
                cli.steps
            );
        }
    }
    for c in children.iter_mut() {
        let status = c.wait()?;
        failed |= !status.success();
    }
    if failed {
        return Err("a rank failed (see above)".into());
    }
    Ok(())
}

fn spawn_rank(cli: &Cli, rank: usize, store: std::net::SocketAddr) -> Result<Child, BoxError> {
    let modes: Vec<String> = cli.modes.iter().map(|m| format!("{m:?}").to_lowercase()).collect();
    Ok(Command::new(std::env::current_exe()?)
        .args(["--rank", &rank.to_string(), "--store", &store.to_string()])
        .args(["--provider", &cli.provider.name, "--ranks", &cli.ranks.to_string()])
        .args(["--steps", &cli.steps.to_string(), "--tokens", &cli.tokens.to_string()])
        .args(["--hidden", &cli.hidden.to_string(), "--topk", &cli.topk.to_string()])
        .args(["--modes", &modes.join(",")])
        .args(["--nics", &cli.nics.n.to_string(), "--location", cli.location.name()])
        .stdin(Stdio::null())
        .spawn()?)
}

/// One rank's engine and memory for one mode.
struct Rank {
    engine: Engine,
    rank: usize,
    ranks: usize,
    tokens: usize,
    hidden: usize,
    topk: usize,
    /// Gathered tokens per destination: block `d` holds a header and its tokens.
    send: MemoryRegion,
    /// Dispatch landing slots, one per source (header + tokens).
    recv: MemoryRegion,
    /// Transformed tokens per source, to be combined back.
    xform: MemoryRegion,
    /// Combine landing slots, one per expert.
    back: MemoryRegion,
    /// Every other rank's `recv` and `back`.
    peer_recv: Vec<Option<RemoteRegion>>,
    peer_back: Vec<Option<RemoteRegion>>,
}

impl Rank {
    /// The transfer methods for peer `r`: pinned to one NIC (peers spread over the NICs), so
    /// every write is one arrival whatever its size and `--nics`.
    fn route(&self, r: usize) -> fabric_async::Transfers<'_> {
        self.engine.with(TransferOpts::pinned(r % self.engine.nics()))
    }

    /// Every other rank, as a peer of this engine.
    fn peers(&self) -> Vec<PeerId> {
        self.peer_recv.iter().flatten().map(|r| r.peer()).collect()
    }

    /// Bytes of one destination's block: a header and at most every token once.
    fn block(&self) -> usize {
        HEADER + self.tokens * self.hidden
    }
}

async fn run_mode(cli: &Cli, store: &TcpStore, mode: Mode) -> Result<Vec<Duration>, BoxError> {
    let (rank, ranks) = (cli.rank, cli.ranks);
    let engine = engine_builder(&cli.provider.name, cli.nics.n).mode(mode.reactor()).build()?;
    cli.location.exit_if_unavailable(&engine).await;
    let block = HEADER + cli.tokens * cli.hidden;
    let loc = cli.location.memory();
    let (send, recv) =
        (engine.alloc_in(block * ranks, loc).await?, engine.alloc_in(block * ranks, loc).await?);
    let (xform, back) =
        (engine.alloc_in(block * ranks, loc).await?, engine.alloc_in(block * ranks, loc).await?);
    let tag = format!("{mode:?}");
    let mut mine = recv.descriptor().to_bytes();
    let split = mine.len() as u32;
    mine.extend(back.descriptor().to_bytes());
    mine.extend(split.to_le_bytes());
    let all = all_gather(store, &format!("{tag}/desc"), rank, ranks, mine).await?;
    let (mut peer_recv, mut peer_back) = (Vec::new(), Vec::new());
    for (r, bytes) in all.iter().enumerate() {
        if r == rank {
            peer_recv.push(None);
            peer_back.push(None);
            continue;
        }
        let (descs, split) = bytes.split_at(bytes.len() - 4);
        let split = u32::from_le_bytes(split.try_into()?) as usize;
        peer_recv.push(Some(engine.remote_region(&descs[..split]).await?));
        peer_back.push(Some(engine.remote_region(&descs[split..]).await?));
    }
    let me = Arc::new(Rank {
        engine,
        rank,
        ranks,
        tokens: cli.tokens,
        hidden: cli.hidden,
        topk: cli.topk,
        send,
        recv,
        xform,
        back,
        peer_recv,
        peer_back,
    });
    // Everybody's regions are known before anybody writes. From here on every wait is raced
    // against the other ranks' death: a rank killed mid-run ends the others at once.
    let peers = me.peers();
    let key = format!("{tag}/ready");
    unless_down(&me.engine, &peers, all_gather(store, &key, rank, ranks, Vec::new())).await?;
    if rank != 0 && cli.modes.first() == Some(&mode) {
        println!("moe: rank {rank} (pid {}) up", std::process::id());
    }
    let steps = cli.steps;
    let times = match mode {
        Mode::Spin => {
            let me = me.clone();
            // The spin path cannot await: a task watches the peers, the spin waits look.
            let watch = DownWatch::spawn(&me.engine, peers.clone());
            tokio::task::spawn_blocking(move || (0..steps).map(|s| step_spin(&me, &watch, s)).collect())
                .await?
        }
        Mode::Inline => {
            let me = me.clone();
            tokio::task::spawn_blocking(move || -> Result<Vec<Duration>, BoxError> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async {
                    let mut v = Vec::with_capacity(steps);
                    for s in 0..steps {
                        v.push(step_async(&me, s).await?);
                    }
                    Ok(v)
                })
            })
            .await?
        }
        Mode::Event => {
            let mut v = Vec::with_capacity(steps);
            for s in 0..steps {
                v.push(step_async(&me, s).await?);
            }
            Ok(v)
        }
    };
    // Nobody tears down an engine a peer may still write to.
    let times = times?;
    let key = format!("{tag}/done");
    unless_down(&me.engine, &peers, all_gather(store, &key, rank, ranks, Vec::new())).await?;
    Ok(times)
}

/// The experts of each of this rank's tokens at `step`: `topk` distinct other ranks.
fn routing(me: &Rank, step: usize) -> Vec<Vec<usize>> {
    let mut s = (step as u64) << 32 | (me.rank as u64) << 8 | 0x9e37;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..me.tokens)
        .map(|_| {
            let mut experts = Vec::with_capacity(me.topk);
            while experts.len() < me.topk {
                let e = (next() % me.ranks as u64) as usize;
                if e != me.rank && !experts.contains(&e) {
                    experts.push(e);
                }
            }
            experts
        })
        .collect()
}

/// Token `t` of `rank` at `step`.
fn token(rank: usize, step: usize, t: usize, hidden: usize) -> Vec<u8> {
    let seed = (rank * 1_000_003 + step * 7919 + t * 31) as u64;
    (0..hidden)
        .map(|i| (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i as u64 * 0x2545) >> 24) as u8)
        .collect()
}

/// What expert `e` does to a token.
fn key(e: usize) -> u8 {
    0x5b ^ (e as u8).wrapping_mul(37)
}

/// Gathers this step's tokens per destination into `send` (header + tokens). Returns, per
/// destination, the token indices in the order they were gathered.
fn gather(me: &Rank, step: usize) -> Result<Vec<Vec<usize>>, BoxError> {
    let route = routing(me, step);
    let mut per_dest = vec![Vec::new(); me.ranks];
    for (t, experts) in route.iter().enumerate() {
        for &e in experts {
            per_dest[e].push(t);
        }
    }
    for (d, toks) in per_dest.iter().enumerate() {
        let base = (d * me.block()) as u64;
        let mut header = [0u8; HEADER];
        header[..4].copy_from_slice(&(toks.len() as u32).to_le_bytes());
        header[4..8].copy_from_slice(&(step as u32).to_le_bytes());
        me.send.write_at(base, &header)?;
        for (j, &t) in toks.iter().enumerate() {
            me.send.write_at(base + (HEADER + j * me.hidden) as u64, &token(me.rank, step, t, me.hidden))?;
        }
    }
    Ok(per_dest)
}

/// The expert's work once every dispatch has landed: check each header, transform. Returns
/// the token count from each source.
fn transform(me: &Rank, step: usize) -> Result<Vec<usize>, BoxError> {
    let mut counts = vec![0; me.ranks];
    let mut buf = vec![0u8; me.hidden];
    for (s, count) in counts.iter_mut().enumerate() {
        if s == me.rank {
            continue;
        }
        let base = (s * me.block()) as u64;
        let mut header = [0u8; HEADER];
        me.recv.read_at(base, &mut header)?;
        let n = u32::from_le_bytes(header[..4].try_into()?) as usize;
        let st = u32::from_le_bytes(header[4..8].try_into()?) as usize;
        if st != step || n > me.tokens {
            return Err(format!(
                "rank {}: dispatch from {s} says step {st}, {n} tokens at step {step}",
                me.rank
            )
            .into());
        }
        for j in 0..n {
            me.recv.read_at(base + (HEADER + j * me.hidden) as u64, &mut buf)?;
            buf.iter_mut().for_each(|b| *b ^= key(me.rank));
            me.xform.write_at((s * me.block() + j * me.hidden) as u64, &buf)?;
        }
        *count = n;
    }
    Ok(counts)
}

/// The source's check: every token came back from its expert, transformed, in place.
fn verify(me: &Rank, step: usize, per_dest: &[Vec<usize>]) -> Result<(), BoxError> {
    let mut got = vec![0u8; me.hidden];
    for (e, toks) in per_dest.iter().enumerate() {
        for (j, &t) in toks.iter().enumerate() {
            me.back.read_at((e * me.block() + j * me.hidden) as u64, &mut got)?;
            let want: Vec<u8> = token(me.rank, step, t, me.hidden).iter().map(|b| b ^ key(e)).collect();
            if got != want {
                return Err(
                    format!("rank {}: step {step}: token {t} from expert {e} is wrong", me.rank).into()
                );
            }
        }
    }
    Ok(())
}

/// One step with futures (Inline or Event engines).
async fn step_async(me: &Rank, step: usize) -> Result<Duration, BoxError> {
    let per_dest = gather(me, step)?;
    let start = Instant::now();
    let mut writes = Vec::with_capacity(2 * me.ranks);
    for (d, toks) in per_dest.iter().enumerate() {
        if let Some(dst) = &me.peer_recv[d] {
            let len = (HEADER + toks.len() * me.hidden) as u64;
            let (off, slot) = ((d * me.block()) as u64, (me.rank * me.block()) as u64);
            writes.push(me.route(d).write_imm(&me.send, off, dst, slot, len, IMM_DISPATCH));
        }
    }
    let others = (me.ranks - 1) as u64;
    let peers = me.peers();
    let dispatch = me.engine.imm_counter(IMM_DISPATCH);
    unless_down(&me.engine, &peers, wait_arrivals(&dispatch, others, STEP_TIMEOUT))
        .await
        .map_err(|e| format!("rank {}: step {step}: waiting for the dispatches: {e}", me.rank))?;
    let counts = transform(me, step)?;
    for (s, &n) in counts.iter().enumerate() {
        if let Some(dst) = &me.peer_back[s] {
            let (off, slot) = ((s * me.block()) as u64, (me.rank * me.block()) as u64);
            writes.push(match n {
                0 => me.route(s).imm(dst, IMM_COMBINE),
                n => me.route(s).write_imm(&me.xform, off, dst, slot, (n * me.hidden) as u64, IMM_COMBINE),
            });
        }
    }
    let combine = me.engine.imm_counter(IMM_COMBINE);
    unless_down(&me.engine, &peers, wait_arrivals(&combine, others, STEP_TIMEOUT))
        .await
        .map_err(|e| format!("rank {}: step {step}: waiting for the combines: {e}", me.rank))?;
    let took = start.elapsed();
    for w in writes {
        w.await?;
    }
    verify(me, step, &per_dest)?;
    Ok(took)
}

/// One step on the synchronous spin path (BusyPoll engine, a thread of its own).
fn step_spin(me: &Rank, watch: &DownWatch, step: usize) -> Result<Duration, BoxError> {
    let per_dest = gather(me, step)?;
    let batch = OpBatch::new();
    let mut posted = 0;
    let start = Instant::now();
    for (d, toks) in per_dest.iter().enumerate() {
        if let Some(dst) = &me.peer_recv[d] {
            let len = (HEADER + toks.len() * me.hidden) as u64;
            let (off, slot) = ((d * me.block()) as u64, (me.rank * me.block()) as u64);
            me.engine.post_write_imm(&batch, &me.send, off, dst, slot, len, IMM_DISPATCH)?;
            posted += 1;
        }
    }
    let others = (me.ranks - 1) as u64;
    let dispatch = watch
        .spin_wait(&me.engine.imm_counter(IMM_DISPATCH), others, STEP_TIMEOUT)
        .map_err(|e| format!("rank {}: step {step}: waiting for the dispatches: {e}", me.rank))?;
    if !dispatch {
        return Err(format!("rank {}: step {step}: dispatches missing", me.rank).into());
    }
    let counts = transform(me, step)?;
    for (s, &n) in counts.iter().enumerate() {
        if let Some(dst) = &me.peer_back[s] {
            let (off, slot) = ((s * me.block()) as u64, (me.rank * me.block()) as u64);
            match n {
                0 => me.engine.post_imm(&batch, dst, IMM_COMBINE)?,
                n => me.engine.post_write_imm(
                    &batch,
                    &me.xform,
                    off,
                    dst,
                    slot,
                    (n * me.hidden) as u64,
                    IMM_COMBINE,
                )?,
            }
            posted += 1;
        }
    }
    let combine = watch
        .spin_wait(&me.engine.imm_counter(IMM_COMBINE), others, STEP_TIMEOUT)
        .map_err(|e| format!("rank {}: step {step}: waiting for the combines: {e}", me.rank))?;
    if !combine {
        return Err(format!("rank {}: step {step}: combines missing", me.rank).into());
    }
    let took = start.elapsed();
    if !batch.spin_until(posted, STEP_TIMEOUT)? {
        return Err(format!("rank {}: step {step}: writes did not complete", me.rank).into());
    }
    verify(me, step, &per_dest)?;
    Ok(took)
}
