//! The measuring harness of `examples/moe_gpu.rs` and `fabric-bench moe`: one world of
//! ranks on the GPUs of this host, every step checked, dispatch and combine timed on the GPU.
//! It is not part of the all-to-all's API; it uses only its public methods.
//!
//! ```text
//!  leader (the example's rank 0, or fabric-bench)       ranks (copies of the running binary)
//!  TcpStoreServer on 127.0.0.1:0 ── spawn(args) ──────►  follow(): connect, run_rank()
//!  [rank 0 here: run_rank()]                              AllToAll::new, the passes, checks
//!  wait for the ranks, then get {KEY}/{r} ◄── put ─────  RankReport::encode(), close
//! ```
//!
//! [`lead`] starts a [`TcpStoreServer`], starts ranks with the caller's `spawn` (each binary
//! re-runs itself: the example with its own flags, fabric-bench with a hidden subcommand; both
//! pass [`Params::args`] plus `--rank R --store ADDR`), runs rank 0 in this process or as one
//! more copy ([`Rank0`]), waits for the copies and returns every rank's [`RankReport`]. A copy
//! calls [`follow`]. [`Params::parse_args`] reads the arguments back for binaries whose own
//! command line does not take them.
//!
//! Each rank, per step, on its stream and with no host wait inside:
//!
//! ```text
//! barrier (GPU) ─ event ─ dispatch ─ event ─ toy experts ─ barrier ─ event ─ combine ─ event
//! ```
//!
//! Passes of `warmup + steps` steps each, each stage timed between CUDA events recorded on
//! the stream around it (as the NCCL baseline is timed; a pass whose events cannot be
//! captured in a CUDA graph falls back to GPU clock kernels and says so): **checked** (after
//! each step the host compares every received row and combined element with
//! [`crate::reference`], so the GPU idles between steps), **back to back** (batches of
//! [`BATCH`] steps with no host wait, the last of each checked), **CUDA graph** ([`BATCH`]
//! steps captured once and replayed, the last step of each replay checked) and, with
//! [`Params::stages`], each stage between clocks of its own.

use std::net::SocketAddr;
use std::process::Child;
use std::sync::Arc;
use std::time::Duration;

use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::cuda::{self, DeviceBuffer, Stream};
use fabric_async::process::{exit_with_parent, wait_child};
use fabric_async::{Engine, ReactorMode};

use crate::reference::{self, check_combined, check_received, Inputs, Routing};
use crate::{AllToAll, Config, DispatchInput, ProxyTimes, RecvLayout, TopkIdx, Transport, CLOCK_SLOTS};

/// The harness's error type.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Distinct input sets, uploaded once and used in turn (step `s` uses set `s % SETS`).
pub const SETS: usize = 8;
/// The seed of the inputs (`reference::inputs`).
pub const SEED: u64 = 0x6d6f_655f_6770;
/// Steps launched back to back between host waits, and captured per CUDA graph (four
/// timing points each).
pub const BATCH: usize = CLOCK_SLOTS / 4;
/// Where each rank puts its report in the store.
const KEY: &str = "moe_gpu/report";

mod report;

/// How a pass marks its timing points.
#[derive(Clone, Copy, Debug)]
enum Stamp {
    /// CUDA events (`captured`: recorded as nodes of a graph being captured).
    Events { captured: bool },
    /// `AllToAll::clock` kernels (GPU `%globaltimer`).
    Clocks,
}

/// One world's shape and run: what every rank must agree on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    /// Ranks (processes); rank r uses GPU r % devices.
    pub ranks: usize,
    /// Timed steps per pass (after the warm-up).
    pub steps: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Tokens per rank per step.
    pub tokens: usize,
    /// Elements (bf16) per token.
    pub hidden: usize,
    /// Experts in all (a multiple of `ranks`).
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// Rows each expert can receive per step (`None`: every token of every rank).
    pub capacity: Option<usize>,
    /// Also time each stage alone.
    pub stages: bool,
    /// Launch dispatch and combine as their two stages each (`dispatch_send` then
    /// `dispatch_recv`, ...) instead of [`AllToAll::dispatch`]'s one kernel: the comparison.
    pub split: bool,
    /// How ranks reach each other.
    pub transport: Transport,
    /// The engine's provider (what the proxy writes with).
    pub provider: String,
    /// Where each rank's dispatch leaves the rows it received.
    pub layout: RecvLayout,
    /// [`Config::streamed_combine`](crate::Config::streamed_combine) (`None`: by shape).
    pub streamed_combine: Option<bool>,
    /// [`Config::ordered_rows`](crate::Config::ordered_rows).
    pub ordered_rows: bool,
}

impl Params {
    /// DeepSeek-V3's decode shape: 2 ranks, 128 tokens x 7168 bf16 per rank, 256 experts,
    /// top-8, 200 steps after 10, NVLink, an shm engine.
    pub fn decode() -> Params {
        Params {
            ranks: 2,
            steps: 200,
            warmup: 10,
            tokens: 128,
            hidden: 7168,
            experts: 256,
            topk: 8,
            capacity: None,
            stages: false,
            split: false,
            transport: Transport::Nvlink,
            provider: "shm".into(),
            layout: RecvLayout::ExpertMajor,
            streamed_combine: None,
            ordered_rows: false,
        }
    }

    /// The prefill shape: as [`Params::decode`] with 4096 tokens per rank, rank-major rows
    /// ([`RecvLayout::RankMajor`]: no copy per expert), experts bounded to 1024 rows each,
    /// 20 steps after 3.
    pub fn prefill() -> Params {
        Params {
            tokens: 4096,
            capacity: Some(1024),
            steps: 20,
            warmup: 3,
            layout: RecvLayout::RankMajor,
            ..Params::decode()
        }
    }

    /// What no rank can run: counts of 0, experts not a multiple of ranks or fewer than top-k.
    pub fn check(&self) -> Result<(), String> {
        if [self.ranks, self.steps, self.tokens, self.hidden, self.experts, self.topk].contains(&0) {
            return Err("ranks, steps, tokens, hidden, experts and topk must be above 0".into());
        }
        if !self.experts.is_multiple_of(self.ranks) || self.topk > self.experts {
            return Err(format!(
                "--experts {} must be a multiple of --ranks {} and at least --topk",
                self.experts, self.ranks
            ));
        }
        Ok(())
    }

    /// The options a rank is started with (the example's flags), without `--rank`/`--store`.
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        for (k, v) in [
            ("--ranks", self.ranks),
            ("--steps", self.steps),
            ("--warmup", self.warmup),
            ("--tokens", self.tokens),
            ("--hidden", self.hidden),
            ("--experts", self.experts),
            ("--topk", self.topk),
        ] {
            a.extend([k.to_string(), v.to_string()]);
        }
        if let Some(c) = self.capacity {
            a.extend(["--capacity".to_string(), c.to_string()]);
        }
        if self.stages {
            a.push("--stages".into());
        }
        if self.split {
            a.push("--split".into());
        }
        a.extend([
            "--transport".to_string(),
            self.transport.to_string(),
            "--provider".into(),
            self.provider.clone(),
            "--layout".into(),
            self.layout.to_string(),
        ]);
        if let Some(on) = self.streamed_combine {
            a.extend(["--streamed-combine".to_string(), if on { "on" } else { "off" }.to_string()]);
        }
        if self.ordered_rows {
            a.extend(["--ordered-rows".to_string(), "on".to_string()]);
        }
        a
    }

    /// Reads [`Params::args`] plus `--rank R --store ADDR` back: the parameters, the rank and
    /// the store. Options not given keep [`Params::decode`]'s values.
    pub fn parse_args<S: AsRef<str>>(args: &[S]) -> Result<(Params, usize, SocketAddr), String> {
        let mut p = Params::decode();
        let (mut rank, mut store) = (None, None);
        let mut it = args.iter().map(AsRef::as_ref);
        while let Some(k) = it.next() {
            if k == "--stages" {
                p.stages = true;
                continue;
            }
            if k == "--split" {
                p.split = true;
                continue;
            }
            let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
            let n = || v.parse::<usize>().map_err(|_| format!("{k} {v}: not a count"));
            match k {
                "--ranks" => p.ranks = n()?,
                "--steps" => p.steps = n()?,
                "--warmup" => p.warmup = n()?,
                "--tokens" => p.tokens = n()?,
                "--hidden" => p.hidden = n()?,
                "--experts" => p.experts = n()?,
                "--topk" => p.topk = n()?,
                "--capacity" => p.capacity = Some(n()?),
                "--rank" => rank = Some(n()?),
                "--transport" => p.transport = v.parse().map_err(|e| format!("--transport {v}: {e}"))?,
                "--provider" => p.provider = v.to_string(),
                "--layout" => p.layout = v.parse().map_err(|e| format!("--layout {v}: {e}"))?,
                "--streamed-combine" => p.streamed_combine = on_off(k, v)?,
                "--ordered-rows" => p.ordered_rows = on_off(k, v)?.unwrap_or(false),
                "--store" => store = Some(v.parse().map_err(|_| format!("--store {v}: not an address"))?),
                _ => return Err(format!("unexpected argument {k}")),
            }
        }
        p.check()?;
        let rank = rank.ok_or("no --rank")?;
        if rank >= p.ranks {
            return Err(format!("--rank {rank} of {} ranks", p.ranks));
        }
        Ok((p, rank, store.ok_or("no --store")?))
    }

    /// The line rank 0 prints first (`prog`: the program's name), given rank 0's report.
    pub fn header(&self, prog: &str, rank0: &RankReport) -> String {
        format!(
            "{prog}: {} ranks ({}), transport {} (engine {}), {} rows, {} tokens x {} bf16 per rank, {} experts, top-{}, {} steps (+{} warm-up)",
            self.ranks,
            rank0.device_name,
            self.transport,
            rank0.engine,
            self.layout,
            self.tokens,
            self.hidden,
            self.experts,
            self.topk,
            self.steps,
            self.warmup
        )
    }
}

/// `on`, `off` or `auto` (`None`).
pub fn on_off(k: &str, v: &str) -> Result<Option<bool>, String> {
    match v {
        "on" => Ok(Some(true)),
        "off" => Ok(Some(false)),
        "auto" => Ok(None),
        _ => Err(format!("{k} {v}: on, off or auto")),
    }
}

pub use report::{PassTimes, Pcts, RankReport};

/// Where [`lead`] runs rank 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rank0 {
    /// In this process (the example).
    Here,
    /// As one more copy, like the others (fabric-bench: every world in fresh processes).
    Spawned,
}

/// Runs one world of `p.ranks` ranks and returns their reports in rank order. `spawn(args)`
/// starts a copy of the running binary that calls [`follow`] with those arguments
/// ([`Params::args`], `--rank R`, `--store ADDR`); ranks started this way get `deadline` to
/// exit after the last rank started (rank 0 here: after rank 0 is done), then are killed.
///
/// # Cancel safety
///
/// Not cancel safe as a measurement: dropping the future drops the store, and the started
/// ranks then fail at the store's timeout and exit (each also exits when its parent does).
pub async fn lead<F>(
    p: &Params,
    rank0: Rank0,
    deadline: Duration,
    mut spawn: F,
) -> Result<Vec<RankReport>, BoxError>
where
    F: FnMut(Vec<String>) -> Result<Child, BoxError>,
{
    p.check()?;
    let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
    let addr = server.local_addr();
    let first = match rank0 {
        Rank0::Here => 1,
        Rank0::Spawned => 0,
    };
    let mut children = Vec::new();
    for r in first..p.ranks {
        let mut a = p.args();
        a.extend(["--rank".to_string(), r.to_string(), "--store".into(), addr.to_string()]);
        match spawn(a) {
            Ok(c) => children.push((r, c)),
            Err(e) => {
                for (_, c) in children.iter_mut() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start rank {r}: {e}").into());
            }
        }
    }
    let store = TcpStore::connect(addr).await?.with_timeout(Duration::from_secs(120));
    let mut failed = Vec::new();
    if rank0 == Rank0::Here {
        if let Err(e) = run_rank(p, 0, &store).await {
            failed.push(format!("rank 0: {e}"));
        }
    }
    for (r, c) in children.iter_mut() {
        match wait_child(c, deadline).await {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {r}: exited with {s}")),
            Err(e) => failed.push(format!("rank {r}: {e}")),
        }
    }
    if !failed.is_empty() {
        return Err(format!("a rank failed: {}", failed.join("; ")).into());
    }
    let mut out = Vec::new();
    for r in 0..p.ranks {
        let v = store.get(&format!("{KEY}/{r}")).await?;
        out.push(RankReport::decode(&String::from_utf8_lossy(&v))?);
    }
    drop(server);
    Ok(out)
}

/// A rank started by [`lead`]: exits as soon as its parent is gone, meets the others at
/// `store`, runs the passes and puts its report there.
///
/// # Cancel safety
///
/// As [`run_rank`]'s.
pub async fn follow(p: &Params, rank: usize, store: SocketAddr) -> Result<(), BoxError> {
    exit_with_parent("moe rank");
    let store = TcpStore::connect(store).await?.with_timeout(Duration::from_secs(120));
    run_rank(p, rank, &store).await
}

/// One input set of this rank on its device, and every rank's inputs for the checks.
struct Set {
    all: Vec<Inputs>,
    x: DeviceBuffer,
    idx: DeviceBuffer,
    weights: DeviceBuffer,
}

fn upload(ctx: &Arc<cuda::Context>, c: &Config, all: Vec<Inputs>) -> Result<Set, BoxError> {
    let mine = &all[c.rank];
    let x = DeviceBuffer::new(ctx, c.max_tokens * c.hidden * 2)?;
    let idx = DeviceBuffer::new(ctx, c.max_tokens * c.topk * 8)?;
    let weights = DeviceBuffer::new(ctx, c.max_tokens * c.topk * 4)?;
    x.copy_from_host(0, &mine.x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>())?;
    idx.copy_from_host(0, &mine.topk_idx.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>())?;
    weights.copy_from_host(0, &mine.topk_weights.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>())?;
    Ok(Set { all, x, idx, weights })
}

/// One rank's whole run: the all-to-all, the passes, every check; its report goes into the
/// store under `moe_gpu/report/{rank}` before the all-to-all closes.
///
/// # Cancel safety
///
/// Dropping the future drops the all-to-all without `close` (`AllToAll::close`'s section:
/// the other ranks fail at their timeouts); let it run to the end.
pub async fn run_rank(p: &Params, rank: usize, store: &TcpStore) -> Result<(), BoxError> {
    let ranks = p.ranks;
    // The proxy's writes complete as soon as the engine's reactor sees them: a spinning
    // reactor (the MoE paths' mode); NVLink does not use the engine.
    let mode = if p.transport == Transport::Nvlink { ReactorMode::Event } else { ReactorMode::BusyPoll };
    let engine = Engine::builder().provider(&p.provider).mode(mode).build()?;
    let mut c = Config::new(ranks, rank, p.experts / ranks, p.tokens, p.hidden, p.topk);
    c.expert_capacity = p.capacity;
    c.transport = p.transport;
    c.layout = p.layout;
    c.streamed_combine = p.streamed_combine;
    c.ordered_rows = p.ordered_rows;
    let a2a = AllToAll::new(&engine, store, c.clone()).await?;
    let ctx = cuda::context(a2a.device())?;
    let sets: Vec<Set> = (0..SETS)
        .map(|s| {
            let all = (0..ranks)
                .map(|r| reference::inputs(&c, Routing::Random { masked: false }, SEED, r, s, p.tokens))
                .collect();
            upload(&ctx, &c, all)
        })
        .collect::<Result<_, _>>()?;
    // Copies from pageable memory may return before their DMA lands; the stream below does
    // not wait for them.
    ctx.synchronize()?;
    let rows: usize = sets.iter().map(|s| rows_sent(&c, &s.all[rank])).sum::<usize>() / SETS;
    let stream = Stream::new(&ctx)?;
    let out = DeviceBuffer::new(&ctx, a2a.expert_out_len())?;
    // Its zero-fill ran on the legacy stream, which `stream` does not wait for.
    ctx.synchronize()?;
    let input = |set: &Set| DispatchInput {
        x: set.x.device_ptr(),
        topk_idx: TopkIdx::I64(set.idx.device_ptr()),
        topk_weights: set.weights.device_ptr(),
        num_tokens: p.tokens,
    };
    // Timing points: CUDA events (one per point of a batch), or GPU clock kernels.
    let events: Vec<cuda::Event> =
        (0..4 * BATCH).map(|_| cuda::Event::timed(&ctx)).collect::<Result<_, _>>()?;
    let mark = |slot: usize, stamp: Stamp| -> Result<(), BoxError> {
        match stamp {
            Stamp::Clocks => a2a.clock(&stream, slot)?,
            // SAFETY: `stream` is a live stream of the event's device.
            Stamp::Events { captured } => unsafe { events[slot].record_raw(stream.handle(), captured)? },
        }
        Ok(())
    };
    // One step on the stream, its four timing points in slots `4 * i ..`.
    let enqueue = |set: &Set, i: usize, stamp: Stamp| -> Result<(), BoxError> {
        let input = input(set);
        a2a.barrier(&stream)?;
        mark(4 * i, stamp)?;
        // SAFETY: for every stage below, the set's buffers and `out` outlive the step
        // (synchronized before they go).
        unsafe {
            if p.split {
                a2a.dispatch_send(&stream, &input)?;
                a2a.dispatch_recv(&stream)?;
            } else {
                a2a.dispatch(&stream, &input)?;
            }
            mark(4 * i + 1, stamp)?;
            a2a.toy_experts(&stream, out.device_ptr())?;
            a2a.barrier(&stream)?;
            mark(4 * i + 2, stamp)?;
            if p.split {
                a2a.combine_send(&stream, out.device_ptr())?;
                a2a.combine_recv(&stream)?;
            } else {
                a2a.combine(&stream, out.device_ptr())?;
            }
        }
        mark(4 * i + 3, stamp)?;
        Ok(())
    };
    let check = |set: &Set, step: usize| -> Result<(), BoxError> {
        a2a.check()?;
        let got = a2a.read_received()?;
        check_received(&c, &set.all, rank, &got.sources, &got.rows)
            .map_err(|e| format!("step {step}: {e}"))?;
        check_combined(&c, &set.all[rank], rank, &a2a.read_combined(p.tokens)?)
            .map_err(|e| format!("step {step}: {e}"))?;
        Ok(())
    };
    // Dispatch and combine of step `i` of the last batch, in ns.
    let times = |i: usize, stamp: Stamp| -> Result<(u64, u64), BoxError> {
        let span = |a: usize, b: usize| -> Result<u64, BoxError> {
            Ok(match stamp {
                Stamp::Clocks => a2a.clock_ns(b).saturating_sub(a2a.clock_ns(a)),
                Stamp::Events { .. } => (f64::from(events[a].elapsed_ms(&events[b])?) * 1e6).max(0.0) as u64,
            })
        };
        Ok((span(4 * i, 4 * i + 1)?, span(4 * i + 2, 4 * i + 3)?))
    };
    let plain = Stamp::Events { captured: false };
    let total = p.warmup + p.steps;
    // Pass 1, checked: every step's received rows and combined rows are read back and
    // compared, so the GPU idles for the host's check between steps.
    let (mut dispatch, mut combine) = (Vec::new(), Vec::new());
    for step in 0..total {
        let set = &sets[step % SETS];
        enqueue(set, 0, plain)?;
        stream.synchronize()?;
        check(set, step)?;
        if step >= p.warmup {
            let (d, k) = times(0, plain)?;
            dispatch.push(d);
            combine.push(k);
        }
    }
    let checked = PassTimes { dispatch: Pcts::of(dispatch), combine: Pcts::of(combine) };
    // Pass 2, back to back: steps are launched in batches of up to BATCH with no host wait
    // between them, as a model's layers run; the last step of each batch is checked.
    let (mut dispatch, mut combine) = (Vec::new(), Vec::new());
    let mut step = 0;
    while step < total {
        let n = BATCH.min(total - step);
        for i in 0..n {
            enqueue(&sets[(step + i) % SETS], i, plain)?;
        }
        stream.synchronize()?;
        check(&sets[(step + n - 1) % SETS], step + n - 1)?;
        for i in 0..n {
            if step + i >= p.warmup {
                let (d, k) = times(i, plain)?;
                dispatch.push(d);
                combine.push(k);
            }
        }
        step += n;
    }
    let back_to_back = PassTimes { dispatch: Pcts::of(dispatch), combine: Pcts::of(combine) };
    // Pass 3, CUDA graph: a batch of BATCH steps captured once, then replayed (no host
    // launch inside a replay); the last step of each replay is checked.
    // Events recorded as nodes of the graph where the driver times them; GPU clocks if not.
    let probing = std::env::var_os("FABRIC_MOE_PROBE").is_some();
    let probes = std::cell::RefCell::new(Vec::new());
    let graph_pass = |stamp: Stamp| -> Result<PassTimes, BoxError> {
        let (mut dispatch, mut combine) = (Vec::new(), Vec::new());
        stream.begin_capture()?;
        let captured = (0..BATCH).try_for_each(|i| enqueue(&sets[i % SETS], i, stamp));
        let graph = stream.end_capture()?;
        captured?;
        // The first replay warms up; then enough replays for `steps` steps.
        for replay in 0..=p.steps.div_ceil(BATCH) {
            // SAFETY: every buffer the captured steps use (the sets, `out`, the all-to-all's)
            // lives until after the synchronize below.
            unsafe { graph.launch(&stream)? };
            stream.synchronize()?;
            check(&sets[(BATCH - 1) % SETS], BATCH - 1)?;
            if replay > 0 && probing {
                probes.borrow_mut().push(a2a.probe_ns());
            }
            if replay > 0 {
                for i in 0..BATCH {
                    let (d, k) = times(i, stamp)?;
                    dispatch.push(d);
                    combine.push(k);
                }
            }
        }
        Ok(PassTimes { dispatch: Pcts::of(dispatch), combine: Pcts::of(combine) })
    };
    let (graph, graph_clocks) = match graph_pass(Stamp::Events { captured: true }) {
        Ok(t) => (t, None),
        Err(e) => {
            // A failed capture leaves the stream out of capture mode (end_capture ran) and
            // nothing launched: the pass runs again with clock kernels.
            a2a.check()?;
            (graph_pass(Stamp::Clocks)?, Some(e.to_string()))
        }
    };
    if probing {
        eprintln!("{}", probe_line(rank, &probes.borrow()));
    }
    // Pass 4 (stages): each stage between clocks of its own, back to back.
    let mut stages: Vec<Vec<u64>> = vec![Vec::new(); 4];
    if p.stages {
        const SLOTS: usize = 6;
        let per_batch = CLOCK_SLOTS / SLOTS;
        let mut step = 0;
        while step < total {
            let n = per_batch.min(total - step);
            for i in 0..n {
                let inp = input(&sets[(step + i) % SETS]);
                let at = |j: usize| SLOTS * i + j;
                a2a.barrier(&stream)?;
                a2a.clock(&stream, at(0))?;
                // SAFETY: as in `enqueue`.
                unsafe { a2a.dispatch_send(&stream, &inp)? };
                a2a.clock(&stream, at(1))?;
                a2a.dispatch_recv(&stream)?;
                a2a.clock(&stream, at(2))?;
                // SAFETY: as above.
                unsafe { a2a.toy_experts(&stream, out.device_ptr())? };
                a2a.barrier(&stream)?;
                a2a.clock(&stream, at(3))?;
                // SAFETY: as above.
                unsafe { a2a.combine_send(&stream, out.device_ptr())? };
                a2a.clock(&stream, at(4))?;
                a2a.combine_recv(&stream)?;
                a2a.clock(&stream, at(5))?;
            }
            stream.synchronize()?;
            check(&sets[(step + n - 1) % SETS], step + n - 1)?;
            for i in 0..n {
                if step + i >= p.warmup {
                    let t = |j: usize| a2a.clock_ns(SLOTS * i + j);
                    for (k, (a, b)) in [(0, 1), (1, 2), (3, 4), (4, 5)].into_iter().enumerate() {
                        stages[k].push(t(b).saturating_sub(t(a)));
                    }
                }
            }
            step += n;
        }
    }
    drop(stream);
    let peer = (rank + 1) % ranks;
    let span = |t: ProxyTimes| t.completed_ns.saturating_sub(t.seen_ns) as f64 / 1e3;
    let gate = |t: ProxyTimes| match t.gate_ns {
        0 => -1.0,
        g => g.saturating_sub(t.seen_ns) as f64 / 1e3,
    };
    let report = RankReport {
        rank,
        device: a2a.device(),
        device_name: ctx.name().to_string(),
        engine: engine.transport().to_string(),
        peer,
        to_peer: match a2a.proxy_path(peer) {
            Some(path) => format!("{} ({path:?})", a2a.transport_to(peer)),
            None => a2a.transport_to(peer).to_string(),
        },
        rows,
        mib: (rows * p.hidden * 2) as f64 / (1 << 20) as f64,
        back_to_back,
        graph,
        graph_clocks,
        checked,
        streamed: a2a.streamed_combine(),
        stages: p.stages.then(|| {
            let q = |v: &mut Vec<u64>| pct(v, 0.5);
            [q(&mut stages[0]), q(&mut stages[1]), q(&mut stages[2]), q(&mut stages[3])]
        }),
        proxy: a2a.proxy_times().map(|[d, c]| [span(d), span(c), gate(d), gate(c)]),
        gates: a2a.proxy_times().map(|_| {
            let g = engine.stats().gpu;
            let per = |d: Duration| d.as_secs_f64() * 1e6 / g.gates.max(1) as f64;
            [g.gates as f64, per(g.plan), per(g.handoff), per(g.enqueue), per(g.copy), per(g.signal)]
        }),
    };
    store.put(&format!("{KEY}/{rank}"), report.encode().into_bytes()).await?;
    a2a.close(store).await?;
    Ok(())
}

/// The probes' breakdown of the last step of each graph replay (medians, µs from the first
/// probe of each stage; `kernels/`'s PROBE numbers).
fn probe_line(rank: usize, probes: &[[u64; crate::PROBES]]) -> String {
    // A point no block stamped (the fused dispatch has no last block after its receive, so
    // no "end") reads n/a, not 0.
    let at = |i: usize, from: usize| {
        if probes.iter().all(|p| p[i] == 0) {
            return "n/a".to_string();
        }
        let mut v: Vec<u64> = probes.iter().map(|p| p[i].saturating_sub(p[from])).collect();
        format!("{:.1}", pct(&mut v, 0.5))
    };
    let d = [
        "route",
        "block 0 sent",
        "last block",
        "flags raised",
        "recv start",
        "flags seen",
        "block 0 placed",
        "end",
    ];
    let c =
        ["block 0 sent", "last block", "flags raised", "recv start", "flags seen", "block 0 summed", "end"];
    let dl: Vec<String> = d.iter().enumerate().map(|(j, n)| format!("{n} {}", at(j + 1, 0))).collect();
    let cl: Vec<String> = c.iter().enumerate().map(|(j, n)| format!("{n} {}", at(j + 11, 10))).collect();
    format!(
        "probe rank {rank}: dispatch (us from block 0's start): {}; combine: {}",
        dl.join(", "),
        cl.join(", ")
    )
}

/// Rows this rank sends in one step: one per token and destination rank holding one of its
/// experts.
fn rows_sent(c: &Config, inp: &Inputs) -> usize {
    (0..inp.tokens)
        .map(|t| {
            let mut ranks: Vec<usize> = inp.topk_idx[t * c.topk..(t + 1) * c.topk]
                .iter()
                .filter(|&&e| e >= 0)
                .map(|&e| e as usize / c.experts_per_rank)
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            ranks.len()
        })
        .sum()
}

/// The `q` quantile of `v` (ns) in µs, nearest rank.
fn pct(v: &mut [u64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_read_back() {
        let mut p = Params::prefill();
        p.stages = true;
        p.transport = Transport::Proxy;
        p.provider = "tcp".into();
        let mut a = p.args();
        a.extend(["--rank".into(), "1".into(), "--store".into(), "127.0.0.1:5".into()]);
        let (q, rank, store) = Params::parse_args(&a).unwrap();
        assert_eq!((q, rank, store), (p, 1, "127.0.0.1:5".parse().unwrap()));
        for bad in [
            &["--rank", "2", "--store", "127.0.0.1:5"][..],
            &["--rank", "0"],
            &["--store", "127.0.0.1:5"],
            &["--rank", "0", "--store", "127.0.0.1:5", "--experts", "255"],
            &["--rank", "0", "--store", "127.0.0.1:5", "--bogus", "1"],
            &["--rank", "0", "--store", "127.0.0.1:5", "--steps"],
        ] {
            assert!(Params::parse_args(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn probe_points_never_stamped_read_na() {
        // Two replays: block 0's start at 1000 / 2000 ns, the route 4 us later; no "end".
        let mut a = [0u64; crate::PROBES];
        let mut b = [0u64; crate::PROBES];
        (a[0], a[1], b[0], b[1]) = (1000, 5000, 2000, 6000);
        let line = probe_line(1, &[a, b]);
        assert!(line.starts_with("probe rank 1: dispatch (us from block 0's start): route 4.0,"), "{line}");
        assert!(line.contains("end n/a; combine:"), "{line}");
    }
}
