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
//!
//! The ranks, the passes, the checks and the report are `fabric_moe::harness` (shared with
//! `fabric-bench moe`); this file is its command line.

use std::time::Duration;

use clap::Parser;
use fabric_async::cuda;
use fabric_examples::{positive, spawn_self};
use fabric_moe::harness::{self, Params, Rank0};
use fabric_moe::{RecvLayout, Transport};

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
    /// Also time each stage alone (a third run, back to back, a GPU clock between stages:
    /// each clock adds a launch to the step).
    #[arg(long)]
    stages: bool,
    /// Launch dispatch and combine as two stages each (send, then receive) instead of one
    /// fused kernel each (NVLink only: the proxy always runs the stages).
    #[arg(long)]
    split: bool,
    /// How ranks reach each other: NVLink stores (CUDA IPC), the proxy (the engine's writes
    /// from a host thread), or auto (NVLink on one host, the proxy between hosts).
    #[arg(long, value_name = "T", default_value = "nvlink", value_parser = ["nvlink", "proxy", "auto"])]
    transport: String,
    /// The engine's provider (what the proxy writes with).
    #[arg(long, value_name = "P", default_value = "shm", value_parser = ["shm", "tcp"])]
    provider: String,
    /// Where each rank's dispatch leaves the rows: by expert (decode: contiguous rows per
    /// expert) or by source rank (prefill: no copy per expert).
    #[arg(long, value_name = "L", default_value = "expert-major", value_parser = ["expert-major", "rank-major"])]
    layout: String,
    /// Whether the one-kernel combine streams (half its blocks send while the others sum the
    /// tokens whose rows have landed): auto (prefill shapes), on, off.
    #[arg(long, value_name = "S", default_value = "auto", value_parser = ["auto", "on", "off"])]
    streamed_combine: String,
    /// Rows in a fixed order (Config::ordered_rows: the same inputs leave the same recv_x;
    /// costs the route a few microseconds).
    #[arg(long)]
    ordered_rows: bool,
    /// Internal: this process's rank, started by rank 0 whose TcpStore is at --store.
    #[arg(long, hide = true, default_value_t = 0)]
    rank: usize,
    /// Internal: rank 0's TcpStore.
    #[arg(long, hide = true)]
    store: Option<String>,
}

impl Cli {
    fn params(&self) -> Params {
        Params {
            ranks: self.ranks,
            steps: self.steps,
            warmup: self.warmup,
            tokens: self.tokens,
            hidden: self.hidden,
            experts: self.experts,
            topk: self.topk,
            capacity: self.capacity,
            stages: self.stages,
            split: self.split,
            transport: self.transport.parse::<Transport>().expect("clap checked --transport"),
            provider: self.provider.clone(),
            layout: self.layout.parse::<RecvLayout>().expect("clap checked --layout"),
            streamed_combine: harness::on_off("--streamed-combine", &self.streamed_combine)
                .expect("clap checked it"),
            ordered_rows: self.ordered_rows,
        }
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let p = cli.params();
    if let Err(e) = p.check() {
        eprintln!("moe_gpu: {e}");
        std::process::exit(2);
    }
    if let Some(store) = &cli.store {
        // A rank started by rank 0.
        let r = match store.parse() {
            Ok(addr) => harness::follow(&p, cli.rank, addr).await,
            Err(e) => Err(format!("--store {store}: {e}").into()),
        };
        if let Err(e) = r {
            eprintln!("moe_gpu rank {}: {e}", cli.rank);
            std::process::exit(1);
        }
        return;
    }
    match cuda::available() {
        Ok(n) if n > 0 => {}
        Ok(_) => skip("no CUDA device (the driver sees none)"),
        Err(e) => skip(&format!("no CUDA driver ({e})")),
    }
    // Rank 0 here; the others get 60 s after it is done to finish and exit.
    match harness::lead(&p, Rank0::Here, Duration::from_secs(60), spawn_self).await {
        Ok(reports) => {
            println!("{}", p.header("moe_gpu", &reports[0]));
            for r in &reports {
                println!("{}", r.lines("moe_gpu"));
            }
        }
        Err(e) => {
            eprintln!("moe_gpu failed: {e}");
            std::process::exit(1);
        }
    }
}

fn skip(why: &str) -> ! {
    println!("moe_gpu: skipped: {why}");
    std::process::exit(0);
}
