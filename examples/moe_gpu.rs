//! MoE dispatch and combine on GPUs with `fabric-moe`, across R processes of one host, every
//! step checked, dispatch and combine timed on the GPU.
//!
//! ```text
//! cargo run --release --example moe_gpu -- [--ranks 2] [--steps 200] [--tokens 128]
//!                                          [--hidden 7168] [--experts 256] [--topk 8]
//!                                          [--transport nvlink|proxy|auto] [--provider shm|tcp]
//! ```
//!
//! Defaults are DeepSeek-V3's decode shape: 128 tokens per rank, hidden 7168 (bf16), 256
//! experts, top-8. Rank 0 starts the other ranks (copies of this program; they meet through
//! a `TcpStore` on 127.0.0.1); rank `r` uses GPU `r % devices` (two ranks share a GPU when
//! there is one). Each step, on every rank's stream, with no host wait inside:
//!
//! ```text
//! barrier (GPU) ─ clock ─ dispatch_send ─ dispatch_recv ─ clock ─ toy experts ─ clock ─ combine_send ─ combine_recv ─ clock
//! ```
//!
//! Three passes of `--warmup` + `--steps` steps each. **Back to back** (the headline): steps
//! are launched in batches of 64 with no host wait between them, as a model's layers run,
//! and the last step of each batch is checked. **Checked**: after each step the host checks
//! every received row and every combined element against the reference computed from the
//! same seeds (`fabric_moe::reference`), so the GPU idles (and may lower its clocks) for
//! milliseconds between steps. **CUDA graph**: 64 steps captured once and replayed (no host
//! launch inside a replay), the last step of each replay checked. All take the times between the GPU clocks: dispatch and
//! combine each from a common start (the barrier) to the moment this rank has everything,
//! as an NCCL all-to-all is timed between CUDA events.
//! The first `--warmup` steps are not counted. `examples/moe_gpu_nccl.py` times NCCL's
//! `all_to_all_single` of the same bytes for comparison (`scripts/moe-gpu-run.sh` runs both).
//!
//! `--transport proxy` sends every rank's rows through the proxy transport instead of NVLink
//! stores (outbox, doorbell, a proxy thread writing with the engine of `--provider`, receive
//! kernels waiting on `GpuCounter`s; `docs/moe.md`, "Phase 2"), on one host as between
//! hosts; each line then also gives the proxy's last doorbell-to-completion times.
//!
//! Without a CUDA driver or device it prints one `moe_gpu: skipped: ...` line and exits 0.

use std::time::Duration;

use clap::Parser;
use fabric_async::bootstrap::{all_gather, Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::cuda::{self, DeviceBuffer, Stream};
use fabric_async::{Engine, ReactorMode};
use fabric_examples::{exit_with_parent, positive, spawn_self, wait_child, BoxError};
use fabric_moe::reference::{self, check_combined, check_received, Inputs, Routing};
use fabric_moe::{AllToAll, Config, DispatchInput, TopkIdx, Transport};

/// Distinct input sets, uploaded once and used in turn (step `s` uses set `s % SETS`).
const SETS: usize = 8;
const SEED: u64 = 0x6d6f_655f_6770;
/// Steps launched back to back between host waits in the second pass (four clock slots each).
const BATCH: usize = fabric_moe::CLOCK_SLOTS / 4;

/// MoE dispatch/combine with fabric-moe across --ranks processes on the GPUs of this host.
#[derive(Parser, Debug, Clone)]
#[command(name = "moe_gpu", args_override_self = true)]
struct Cli {
    /// Ranks (processes); rank r uses GPU r % devices.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive)]
    ranks: usize,
    /// Timed steps (after the warm-up).
    #[arg(long, value_name = "N", default_value_t = 200, value_parser = positive)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, value_name = "N", default_value_t = 10)]
    warmup: usize,
    /// Tokens per rank per step.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = positive)]
    tokens: usize,
    /// Elements (bf16) per token.
    #[arg(long, value_name = "N", default_value_t = 7168, value_parser = positive)]
    hidden: usize,
    /// Experts in all (a multiple of --ranks).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = positive)]
    experts: usize,
    /// Experts per token.
    #[arg(long, value_name = "K", default_value_t = 8, value_parser = positive)]
    topk: usize,
    /// Rows each expert can receive per step (default: every token of every rank).
    #[arg(long, value_name = "ROWS")]
    capacity: Option<usize>,
    /// Also time each stage alone (a third pass, back to back, a GPU clock between stages:
    /// each clock adds a launch to the step).
    #[arg(long)]
    stages: bool,
    /// How ranks reach each other: NVLink stores (CUDA IPC), the proxy (the engine's writes
    /// from a host thread), or auto (NVLink on one host, the proxy between hosts).
    #[arg(long, value_name = "T", default_value = "nvlink", value_parser = ["nvlink", "proxy", "auto"])]
    transport: String,
    /// The engine's provider (what the proxy writes with).
    #[arg(long, value_name = "P", default_value = "shm", value_parser = ["shm", "tcp"])]
    provider: String,
    /// Internal: this process's rank, started by rank 0 whose TcpStore is at --store.
    #[arg(long, hide = true, default_value_t = 0)]
    rank: usize,
    /// Internal: rank 0's TcpStore.
    #[arg(long, hide = true)]
    store: Option<String>,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if cli.experts % cli.ranks != 0 || cli.topk > cli.experts {
        eprintln!(
            "moe_gpu: --experts {} must be a multiple of --ranks {} and at least --topk",
            cli.experts, cli.ranks
        );
        std::process::exit(2);
    }
    if cli.rank == 0 {
        match cuda::available() {
            Ok(n) if n > 0 => {}
            Ok(_) => skip("no CUDA device (the driver sees none)"),
            Err(e) => skip(&format!("no CUDA driver ({e})")),
        }
    }
    if let Err(e) = run(cli).await {
        eprintln!("moe_gpu failed: {e}");
        std::process::exit(1);
    }
}

fn skip(why: &str) -> ! {
    println!("moe_gpu: skipped: {why}");
    std::process::exit(0);
}

async fn run(cli: Cli) -> Result<(), BoxError> {
    let (_server, addr, mut children) = match &cli.store {
        Some(a) => {
            exit_with_parent("moe_gpu");
            (None, a.parse()?, Vec::new())
        }
        None => {
            let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
            let addr = server.local_addr();
            let mut children = Vec::new();
            for r in 1..cli.ranks {
                children.push(spawn_self(rank_args(&cli, r, addr))?);
            }
            (Some(server), addr, children)
        }
    };
    let store = TcpStore::connect(addr).await?.with_timeout(Duration::from_secs(120));
    let result = run_rank(&cli, &store).await;
    if let Err(e) = &result {
        eprintln!("moe_gpu rank {}: {e}", cli.rank);
    }
    let mut failed = result.is_err();
    for c in children.iter_mut() {
        failed |= !wait_child(c, Duration::from_secs(60)).await?.success();
    }
    if failed {
        return Err("a rank failed (see above)".into());
    }
    Ok(())
}

fn rank_args(cli: &Cli, rank: usize, store: std::net::SocketAddr) -> Vec<String> {
    let mut a = vec!["--rank".to_string(), rank.to_string(), "--store".into(), store.to_string()];
    for (k, v) in [
        ("--ranks", cli.ranks),
        ("--steps", cli.steps),
        ("--warmup", cli.warmup),
        ("--tokens", cli.tokens),
        ("--hidden", cli.hidden),
        ("--experts", cli.experts),
        ("--topk", cli.topk),
    ] {
        a.extend([k.to_string(), v.to_string()]);
    }
    if let Some(c) = cli.capacity {
        a.extend(["--capacity".to_string(), c.to_string()]);
    }
    if cli.stages {
        a.push("--stages".into());
    }
    a.extend(["--transport".to_string(), cli.transport.clone(), "--provider".into(), cli.provider.clone()]);
    a
}

/// One input set of this rank on its device, and every rank's inputs for the checks.
struct Set {
    all: Vec<Inputs>,
    x: DeviceBuffer,
    idx: DeviceBuffer,
    weights: DeviceBuffer,
}

fn upload(ctx: &std::sync::Arc<cuda::Context>, c: &Config, all: Vec<Inputs>) -> Result<Set, BoxError> {
    let mine = &all[c.rank];
    let x = DeviceBuffer::new(ctx, c.max_tokens * c.hidden * 2)?;
    let idx = DeviceBuffer::new(ctx, c.max_tokens * c.topk * 8)?;
    let weights = DeviceBuffer::new(ctx, c.max_tokens * c.topk * 4)?;
    x.copy_from_host(0, &mine.x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>())?;
    idx.copy_from_host(0, &mine.topk_idx.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>())?;
    weights.copy_from_host(0, &mine.topk_weights.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>())?;
    Ok(Set { all, x, idx, weights })
}

async fn run_rank(cli: &Cli, store: &TcpStore) -> Result<(), BoxError> {
    let (rank, ranks) = (cli.rank, cli.ranks);
    let transport = cli.transport.parse::<Transport>()?;
    // The proxy's writes complete as soon as the engine's reactor sees them: a spinning
    // reactor (the MoE paths' mode); NVLink does not use the engine.
    let mode = if transport == Transport::Nvlink { ReactorMode::Event } else { ReactorMode::BusyPoll };
    let engine = Engine::builder().provider(&cli.provider).mode(mode).build()?;
    let mut c = Config::new(ranks, rank, cli.experts / ranks, cli.tokens, cli.hidden, cli.topk);
    c.expert_capacity = cli.capacity;
    c.transport = transport;
    let a2a = AllToAll::new(&engine, store, c.clone()).await?;
    let ctx = cuda::context(a2a.device())?;
    if rank == 0 {
        println!(
            "moe_gpu: {ranks} ranks ({}), transport {} (engine {}), {} tokens x {} bf16 per rank, {} experts, top-{}, {} steps (+{} warm-up)",
            ctx.name(),
            c.transport,
            engine.transport(),
            cli.tokens,
            cli.hidden,
            cli.experts,
            cli.topk,
            cli.steps,
            cli.warmup
        );
    }
    let sets: Vec<Set> = (0..SETS)
        .map(|s| {
            let all = (0..ranks)
                .map(|r| reference::inputs(&c, Routing::Random { masked: false }, SEED, r, s, cli.tokens))
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
        num_tokens: cli.tokens,
    };
    // One step on the stream, its four GPU clocks in slots `4 * i ..`.
    let enqueue = |set: &Set, i: usize| -> Result<(), BoxError> {
        let input = input(set);
        a2a.barrier(&stream)?;
        a2a.clock(&stream, 4 * i)?;
        // SAFETY: the set's buffers and `out` outlive the step (synchronized before they go).
        unsafe { a2a.dispatch(&stream, &input)? };
        a2a.clock(&stream, 4 * i + 1)?;
        // SAFETY: as above.
        unsafe { a2a.toy_experts(&stream, out.device_ptr())? };
        a2a.barrier(&stream)?;
        a2a.clock(&stream, 4 * i + 2)?;
        // SAFETY: as above.
        unsafe { a2a.combine(&stream, out.device_ptr())? };
        a2a.clock(&stream, 4 * i + 3)?;
        Ok(())
    };
    let check = |set: &Set, step: usize| -> Result<(), BoxError> {
        a2a.check()?;
        let got = a2a.read_received()?;
        check_received(&c, &set.all, rank, &got.sources, &got.rows)
            .map_err(|e| format!("step {step}: {e}"))?;
        check_combined(&c, &set.all[rank], rank, &a2a.read_combined(cli.tokens)?)
            .map_err(|e| format!("step {step}: {e}"))?;
        Ok(())
    };
    let times = |i: usize| {
        (
            a2a.clock_ns(4 * i + 1).saturating_sub(a2a.clock_ns(4 * i)),
            a2a.clock_ns(4 * i + 3).saturating_sub(a2a.clock_ns(4 * i + 2)),
        )
    };
    // Pass 1, checked: every step's received rows and combined rows are read back and
    // compared, so the GPU idles for the host's check between steps.
    let (mut dispatch, mut combine) = (Vec::new(), Vec::new());
    for step in 0..cli.warmup + cli.steps {
        let set = &sets[step % SETS];
        enqueue(set, 0)?;
        stream.synchronize()?;
        check(set, step)?;
        if step >= cli.warmup {
            let (d, k) = times(0);
            dispatch.push(d);
            combine.push(k);
        }
    }
    // Pass 2, back to back: steps are launched in batches of up to BATCH with no host wait
    // between them, as a model's layers run; the last step of each batch is checked.
    let (mut dispatch_b2b, mut combine_b2b) = (Vec::new(), Vec::new());
    let mut step = 0;
    while step < cli.warmup + cli.steps {
        let n = BATCH.min(cli.warmup + cli.steps - step);
        for i in 0..n {
            enqueue(&sets[(step + i) % SETS], i)?;
        }
        stream.synchronize()?;
        check(&sets[(step + n - 1) % SETS], step + n - 1)?;
        for i in 0..n {
            if step + i >= cli.warmup {
                let (d, k) = times(i);
                dispatch_b2b.push(d);
                combine_b2b.push(k);
            }
        }
        step += n;
    }
    // Pass 3, CUDA graph: a batch of BATCH steps captured once, then replayed (no host
    // launch inside a replay); the last step of each replay is checked.
    let (mut dispatch_graph, mut combine_graph) = (Vec::new(), Vec::new());
    {
        stream.begin_capture()?;
        let captured = (0..BATCH).try_for_each(|i| enqueue(&sets[i % SETS], i));
        let graph = stream.end_capture()?;
        captured?;
        // The first replay warms up; then enough replays for --steps steps.
        for replay in 0..=cli.steps.div_ceil(BATCH) {
            // SAFETY: every buffer the captured steps use (the sets, `out`, the all-to-all's)
            // lives until after the synchronize below.
            unsafe { graph.launch(&stream)? };
            stream.synchronize()?;
            check(&sets[(BATCH - 1) % SETS], BATCH - 1)?;
            if replay > 0 {
                for i in 0..BATCH {
                    let (d, k) = times(i);
                    dispatch_graph.push(d);
                    combine_graph.push(k);
                }
            }
        }
    }
    // Pass 4 (--stages): each stage between clocks of its own, back to back.
    let mut stages: Vec<Vec<u64>> = vec![Vec::new(); 4];
    if cli.stages {
        const SLOTS: usize = 6;
        let per_batch = fabric_moe::CLOCK_SLOTS / SLOTS;
        let mut step = 0;
        while step < cli.warmup + cli.steps {
            let n = per_batch.min(cli.warmup + cli.steps - step);
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
                if step + i >= cli.warmup {
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
    // Rank 0 prints every rank's figures.
    // The proxy's last step: doorbell seen to writes completed, per stage.
    let proxy = a2a.proxy_times().map_or(String::new(), |[d, c]| {
        let span = |t: fabric_moe::ProxyTimes| t.completed_ns.saturating_sub(t.seen_ns) as f64 / 1e3;
        format!(
            "   proxy (last step, doorbell to done): dispatch {:.1} us, combine {:.1} us",
            span(d),
            span(c)
        )
    });
    let peer = (rank + 1) % ranks;
    let to = match a2a.proxy_path(peer) {
        Some(path) => format!("{} ({path:?})", a2a.transport_to(peer)),
        None => a2a.transport_to(peer).to_string(),
    };
    let mib = (rows * cli.hidden * 2) as f64 / (1 << 20) as f64;
    let mine = format!(
        "moe_gpu: rank {rank} (cuda:{}, {to} to rank {peer}): back to back: dispatch p50 {:7.1} us  p90 {:7.1} us   combine p50 {:7.1} us  p90 {:7.1} us   ({rows} rows = {mib:.2} MiB sent per step)\n\
         moe_gpu: rank {rank} (cuda:{}, {to} to rank {peer}): CUDA graph:   dispatch p50 {:7.1} us  p90 {:7.1} us   combine p50 {:7.1} us  p90 {:7.1} us   (batches of {BATCH} steps captured once and replayed)\n\
         moe_gpu: rank {rank} (cuda:{}, {to} to rank {peer}): checked:      dispatch p50 {:7.1} us  p90 {:7.1} us   combine p50 {:7.1} us  p90 {:7.1} us   (every step checked, the GPU idle between steps)",
        a2a.device(),
        pct(&mut dispatch_b2b, 0.5),
        pct(&mut dispatch_b2b, 0.9),
        pct(&mut combine_b2b, 0.5),
        pct(&mut combine_b2b, 0.9),
        a2a.device(),
        pct(&mut dispatch_graph, 0.5),
        pct(&mut dispatch_graph, 0.9),
        pct(&mut combine_graph, 0.5),
        pct(&mut combine_graph, 0.9),
        a2a.device(),
        pct(&mut dispatch, 0.5),
        pct(&mut dispatch, 0.9),
        pct(&mut combine, 0.5),
        pct(&mut combine, 0.9),
    ) + &proxy;
    let mine = if cli.stages {
        let [ds, dr, cs, cr] = &mut stages[..] else { unreachable!() };
        format!(
            "{mine}\nmoe_gpu: rank {rank} (cuda:{}): stages p50: dispatch_send {:6.1} us  dispatch_recv {:6.1} us  combine_send {:6.1} us  combine_recv {:6.1} us   (a clock between stages)",
            a2a.device(),
            pct(ds, 0.5),
            pct(dr, 0.5),
            pct(cs, 0.5),
            pct(cr, 0.5)
        )
    } else {
        mine
    };
    let lines =
        all_gather(store as &dyn Rendezvous, "moe_gpu/report", rank, ranks, mine.into_bytes()).await?;
    if rank == 0 {
        for l in lines {
            println!("{}", String::from_utf8_lossy(&l));
        }
    }
    a2a.close(store).await?;
    Ok(())
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
