//! RL weight streaming: a trainer pushes each new version of its weights to M inference
//! workers while it keeps training.
//!
//! ```text
//! cargo run --release --example rl_weights -- [--workers 2] [--model-mib 256] [--tensors 64]
//!                  [--versions 5] [--window 16] [--provider tcp|shm|verbs] [--nics N]
//!                  [--location host|cuda]
//! ```
//!
//! The model is `tensors` tensors of uneven sizes (large MLP and embedding matrices, smaller
//! attention ones, 8 KiB norms) packed into `model-mib` MiB. Every byte of every tensor is a
//! function of the version and the tensor, so a reader can tell which version each tensor
//! belongs to.
//!
//! ```text
//!  trainer                                         worker w (one of M processes)
//!  weights ──train v+1 (spawn_blocking)──┐          landing buffers [0] [1] (double buffer)
//!     │ snapshot v                       │           ▲ tensors of v into buffer v % 2
//!     ▼                                  │           │ one write_imm per tensor, imm = version
//!  staging[v % 2] ── write_imm x tensors ┼───────────┘
//!                                        │          wait_for(arrivals of v) ─► check all ─►
//!  ◄──────────────── ack v ──────────────┼────────── switch to v, serve it ─► ack v
//! ```
//!
//! The trainer never blocks its runtime: training steps and snapshots run on
//! `spawn_blocking`, and every wait (writes, acknowledgements) is an `.await` with a
//! deadline. Version v goes into the worker's buffer `v % 2` while the worker serves v - 1
//! from the other one; the trainer starts pushing v to a worker only once that worker has
//! acknowledged v - 1 (so the buffer it writes is not the one being served), and reuses its
//! own staging buffer `v % 2` only once v - 2's writes have completed. A worker switches to
//! v only when every tensor of v has landed (`wait_for` of exactly the arrivals the
//! `write_arrivals` function promises), checks every byte of every tensor (a torn version
//! fails the run), checks that the version it was serving is still intact, switches and
//! acknowledges with a message.
//!
//! Prints, per version, the time to update all workers, and GB/s per worker.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::{Engine, MemoryRegion, PeerId, RemoteRegion};
use fabric_examples::{
    engine_builder, exit_with_parent, percentiles, positive, spawn_self, transport_args, unless_down,
    wait_arrivals, wait_child, BoxError, LocationArg, NicsArg, ProviderArg,
};
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;

/// Version `v`'s tensors carry immediate `IMM_BASE + v`.
const IMM_BASE: u32 = 0x5257_0000;
/// Rendezvous, a version's landing, an acknowledgement: the longest any wait may take.
const TIMEOUT: Duration = Duration::from_secs(120);

/// A trainer streams weight versions to --workers inference processes while it keeps
/// training; each worker double-buffers, switches to a version only when all of its tensors
/// have landed, checks every byte (never a torn version) and acknowledges. Prints the time to
/// update all workers and GB/s per worker.
#[derive(Parser, Debug, Clone)]
#[command(name = "rl_weights", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    provider: ProviderArg,
    #[command(flatten)]
    nics: NicsArg,
    #[command(flatten)]
    location: LocationArg,
    /// Inference worker processes.
    #[arg(long, value_name = "M", default_value_t = 2, value_parser = positive)]
    workers: usize,
    /// Model size in MiB (the trainer holds it three times: weights and two staging
    /// buffers; each worker twice).
    #[arg(long, value_name = "MiB", default_value_t = 256, value_parser = positive)]
    model_mib: usize,
    /// Tensors the model is cut into, of uneven sizes.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = positive)]
    tensors: usize,
    /// Weight versions trained and pushed.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = positive)]
    versions: usize,
    /// Tensor writes in flight per worker.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = positive)]
    window: usize,
    /// Internal: run as inference worker --id for the trainer whose TcpStore is at ADDR.
    #[arg(long, value_name = "ADDR", hide = true)]
    worker_of: Option<String>,
    /// Internal: this worker's id.
    #[arg(long, hide = true, default_value_t = 0)]
    id: usize,
}

impl Cli {
    fn engine(&self) -> Result<Engine, BoxError> {
        Ok(engine_builder(&self.provider.name, self.nics.n).op_timeout(Some(TIMEOUT)).build()?)
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let result = match cli.worker_of.clone() {
        Some(addr) => worker(cli, addr).await,
        None => trainer(cli).await,
    };
    if let Err(e) = result {
        eprintln!("rl_weights failed: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------
// The model: tensors of uneven sizes, content derived from the version.

/// One tensor: where it lives in the model.
#[derive(Clone, Copy, Debug)]
struct Tensor {
    offset: usize,
    len: usize,
}

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The model's tensors, packed: every 8th is a small norm (8 KiB), the others share the
/// rest of `model` bytes by uneven weights (a big MLP/embedding matrix every 4th). Both the
/// trainer and the workers compute it from the same two numbers.
fn model_tensors(model: usize, count: usize) -> Vec<Tensor> {
    const PAGE: usize = 4096;
    let norm = 2 * PAGE;
    let weight = |t: usize| -> u64 {
        match t % 8 {
            7 => 0,
            0 | 4 => 8 + mix(t as u64) % 8,
            _ => 1 + mix(t as u64) % 4,
        }
    };
    let norms = (0..count).filter(|t| weight(*t) == 0).count();
    let rest = model.saturating_sub(norms * norm) as u64;
    let total: u64 = (0..count).map(weight).sum::<u64>().max(1);
    let mut lens: Vec<usize> = (0..count)
        .map(|t| match weight(t) {
            0 => norm,
            w => ((rest * w / total) as usize / PAGE).max(1) * PAGE,
        })
        .collect();
    // Rounding to pages left a little over: the first (big) tensor takes it.
    let sum: usize = lens.iter().sum();
    lens[0] += model.saturating_sub(sum) / PAGE * PAGE;
    let mut offset = 0;
    lens.into_iter()
        .map(|len| {
            let tensor = Tensor { offset, len };
            offset += len;
            tensor
        })
        .collect()
}

fn model_len(tensors: &[Tensor]) -> usize {
    tensors.last().map_or(0, |t| t.offset + t.len)
}

/// Word `w` of tensor `t` at version `v`.
fn word(seed: u64, w: usize) -> u64 {
    (seed ^ w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn tensor_seed(version: usize, t: usize) -> u64 {
    mix((version as u64) << 32 | t as u64)
}

/// One "training step": the weights become version `version` (every tensor changes).
fn train(weights: &mut [u8], tensors: &[Tensor], version: usize) {
    for (t, tensor) in tensors.iter().enumerate() {
        let seed = tensor_seed(version, t);
        let bytes = &mut weights[tensor.offset..tensor.offset + tensor.len];
        for (w, b) in bytes.chunks_exact_mut(8).enumerate() {
            b.copy_from_slice(&word(seed, w).to_le_bytes());
        }
    }
}

/// The first word of `got` that is not version `version`'s tensor `t`.
fn first_wrong(got: &[u8], version: usize, t: usize) -> Option<usize> {
    let seed = tensor_seed(version, t);
    got.chunks_exact(8).enumerate().position(|(w, b)| b != word(seed, w).to_le_bytes())
}

// ---------------------------------------------------------------------------------------
// Inference worker.

async fn worker(cli: Cli, store_addr: String) -> Result<(), BoxError> {
    exit_with_parent("rl_weights worker");
    let id = cli.id;
    let tensors = model_tensors(cli.model_mib << 20, cli.tensors);
    let model = model_len(&tensors);
    let store = TcpStore::connect(store_addr.parse()?).await?.with_timeout(TIMEOUT);
    let engine = cli.engine()?;
    // Two landing buffers: version v lands in buffer v % 2 while v - 1 is served from the other.
    let buffers = engine.alloc_in(2 * model, cli.location.memory()).await?;
    let trainer = engine.add_peer(&store.get("trainer/addr").await?).await?;
    store.put(&format!("worker/{id}/desc"), buffers.descriptor().to_bytes()).await?;
    // What the trainer's write_arrivals promises, computed from this side's knowledge.
    let opts = engine.transfer_opts();
    let arrivals =
        tensors.iter().map(|t| opts.write_arrivals(t.len as u64, engine.nics())).sum::<Result<u64, _>>()?;
    let promised = String::from_utf8(store.get(&format!("worker/{id}/arrivals")).await?)?;
    if promised != arrivals.to_string() {
        return Err(format!(
            "worker {id}: the trainer promises {promised} arrivals per version, {arrivals} expected"
        )
        .into());
    }
    let mut serving: Option<usize> = None;
    let mut buf = vec![0u8; tensors.iter().map(|t| t.len).max().unwrap_or(0)];
    for v in 1..=cli.versions {
        // Raced against the trainer's death: the counter cannot tell.
        let counter = engine.imm_counter(IMM_BASE + v as u32);
        unless_down(&engine, &[trainer], wait_arrivals(&counter, arrivals, TIMEOUT))
            .await
            .map_err(|e| format!("worker {id}: version {v}: waiting for the trainer's writes: {e}"))?;
        // Every tensor of v has landed: check all of it before switching.
        let base = (v % 2) * model;
        let mut verdict = "ok".to_string();
        for (t, tensor) in tensors.iter().enumerate() {
            let got = &mut buf[..tensor.len];
            buffers.read_at((base + tensor.offset) as u64, got)?;
            if let Some(w) = first_wrong(got, v, t) {
                verdict = format!("bad: version {v} is torn: tensor {t} differs at byte {}", w * 8);
                break;
            }
        }
        // The version being served was never written under it (first and last word of each
        // tensor: a tensor write would have changed them).
        if let Some(old) = serving {
            let base = (old % 2) * model;
            for (t, tensor) in tensors.iter().enumerate() {
                let (mut first, mut last) = ([0u8; 8], [0u8; 8]);
                buffers.read_at((base + tensor.offset) as u64, &mut first)?;
                buffers.read_at((base + tensor.offset + tensor.len - 8) as u64, &mut last)?;
                let seed = tensor_seed(old, t);
                if first != word(seed, 0).to_le_bytes()
                    || last != word(seed, tensor.len / 8 - 1).to_le_bytes()
                {
                    verdict = format!("bad: served version {old} changed under it (tensor {t})");
                }
            }
        }
        if verdict == "ok" {
            serving = Some(v);
        }
        engine
            .send(trainer, format!("ack {id} {v} {verdict}").as_bytes())
            .await
            .map_err(|e| format!("worker {id}: version {v}: acknowledging to the trainer: {e}"))?;
        if v == 1 {
            println!("rl_weights: worker {id} (pid {}) has version 1", std::process::id());
        }
        if verdict != "ok" {
            return Err(format!("worker {id}: {verdict}").into());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Trainer.

/// One worker as the trainer sees it.
struct Peer {
    dst: RemoteRegion,
    /// The last version this worker acknowledged.
    acked: watch::Receiver<usize>,
}

/// Per version and worker: when its writes started, how long they took, when it acked.
#[derive(Default, Clone)]
struct Timing {
    pushed: Option<Instant>,
    writes: Vec<Duration>,
    acks: Vec<Option<Instant>>,
}

async fn trainer(cli: Cli) -> Result<(), BoxError> {
    let tensors = Arc::new(model_tensors(cli.model_mib << 20, cli.tensors));
    let model = model_len(&tensors);
    let engine = cli.engine()?;
    cli.location.exit_if_unavailable(&engine).await;
    let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
    let store = TcpStore::connect(server.local_addr()).await?.with_timeout(TIMEOUT);
    store.put("trainer/addr", engine.address()).await?;
    let mut children = Vec::new();
    for id in 0..cli.workers {
        let head =
            ["--worker-of".to_string(), server.local_addr().to_string(), "--id".into(), id.to_string()];
        let tail = [
            "--model-mib".to_string(),
            cli.model_mib.to_string(),
            "--tensors".into(),
            cli.tensors.to_string(),
            "--versions".into(),
            cli.versions.to_string(),
        ];
        let args =
            head.into_iter().chain(transport_args(&cli.provider, &cli.nics, &cli.location)).chain(tail);
        children.push(spawn_self(args)?);
    }
    let (min, max) = tensors.iter().fold((usize::MAX, 0), |(a, b), t| (a.min(t.len), b.max(t.len)));
    println!(
        "rl_weights: trainer + {} workers on {} ({} NIC(s)): {} MiB in {} tensors ({} KiB .. {} MiB), {} versions",
        cli.workers,
        engine.transport(),
        engine.nics(),
        model >> 20,
        tensors.len(),
        min >> 10,
        max >> 20,
        cli.versions
    );
    // Staging buffers: the snapshot of version v is pushed from staging[v % 2] while the
    // weights go on changing.
    let staging = [
        engine.alloc_in(model, cli.location.memory()).await?,
        engine.alloc_in(model, cli.location.memory()).await?,
    ];
    let mut peers = Vec::new();
    let mut ack_tx = Vec::new();
    for id in 0..cli.workers {
        let dst = engine.remote_region(&store.get(&format!("worker/{id}/desc")).await?).await?;
        // What each version produces at the worker, which it computes on its own too.
        let arrivals =
            tensors.iter().map(|t| engine.write_arrivals(&dst, t.len as u64)).sum::<Result<u64, _>>()?;
        store.put(&format!("worker/{id}/arrivals"), arrivals.to_string().into_bytes()).await?;
        let (tx, rx) = watch::channel(0);
        ack_tx.push(tx);
        peers.push(Arc::new(Peer { dst, acked: rx }));
    }
    let timing = Arc::new(Mutex::new(vec![
        Timing {
            writes: vec![Duration::ZERO; cli.workers],
            acks: vec![None; cli.workers],
            pushed: None
        };
        cli.versions + 1
    ]));
    let bad = Arc::new(AtomicBool::new(false));
    let receiver = tokio::spawn({
        let (engine, timing, bad) = (engine.clone(), timing.clone(), bad.clone());
        async move {
            while let Ok((_, msg)) = engine.recv().await {
                let text = String::from_utf8_lossy(&msg).to_string();
                let words: Vec<&str> = text.splitn(4, ' ').collect();
                let (w, v) = match (words.first(), words.get(1), words.get(2)) {
                    (Some(&"ack"), Some(w), Some(v)) => match (w.parse::<usize>(), v.parse::<usize>()) {
                        (Ok(w), Ok(v)) if w < ack_tx.len() && v < timing.lock().expect("timing").len() => {
                            (w, v)
                        }
                        _ => continue,
                    },
                    _ => continue,
                };
                if words.get(3) != Some(&"ok") {
                    eprintln!("rl_weights: worker {w}: version {v}: {}", words.get(3).unwrap_or(&"?"));
                    bad.store(true, Ordering::Relaxed);
                }
                timing.lock().expect("timing")[v].acks[w] = Some(Instant::now());
                let _ = ack_tx[w].send(v);
            }
        }
    });

    let start = Instant::now();
    // Every wait below is raced against the workers' death (a dead worker never acks, and on
    // shm the writes to it complete into its dead memory): one dies, the trainer fails.
    let workers: Vec<PeerId> = peers.iter().map(|p| p.dst.peer()).collect();
    let run = async {
        let mut weights = vec![0u8; model];
        let mut pushes: Vec<Option<tokio::task::JoinHandle<Result<(), BoxError>>>> = Vec::new();
        let mut train_time = Duration::ZERO;
        for v in 1..=cli.versions {
            // Train: the weights become version v, off the runtime (other versions keep moving).
            let t = Instant::now();
            let tensors2 = tensors.clone();
            weights = tokio::task::spawn_blocking(move || {
                train(&mut weights, &tensors2, v);
                weights
            })
            .await?;
            train_time += t.elapsed();
            // Staging buffer v % 2 is free once version v - 2's writes have all completed.
            if v >= 3 {
                if let Some(p) = pushes[v - 3].take() {
                    p.await??;
                }
            }
            let stage = staging[v % 2].clone();
            weights = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, fabric_async::Error> {
                stage.write_at(0, &weights)?;
                Ok(weights)
            })
            .await??;
            timing.lock().expect("timing")[v].pushed = Some(Instant::now());
            // Push v to every worker, each as soon as it acknowledged v - 1; meanwhile, train on.
            let per_worker: Vec<_> = peers
                .iter()
                .enumerate()
                .map(|(w, peer)| {
                    let (engine, peer, tensors, timing) =
                        (engine.clone(), peer.clone(), tensors.clone(), timing.clone());
                    let (src, window) = (staging[v % 2].clone(), cli.window);
                    async move {
                        let mut acked = peer.acked.clone();
                        tokio::time::timeout(TIMEOUT, acked.wait_for(|a| *a + 1 >= v))
                            .await
                            .map_err(|_| format!("worker {w} did not acknowledge version {}", v - 1))??;
                        let t = Instant::now();
                        push(&engine, &src, &peer.dst, &tensors, v, model, window).await?;
                        timing.lock().expect("timing")[v].writes[w] = t.elapsed();
                        Ok::<_, BoxError>(())
                    }
                })
                .collect();
            pushes.push(Some(tokio::spawn(async move {
                futures::future::try_join_all(per_worker).await?;
                Ok(())
            })));
        }
        for p in pushes.iter_mut() {
            if let Some(p) = p.take() {
                p.await??;
            }
        }
        // Every worker acknowledged the last version.
        for (w, peer) in peers.iter().enumerate() {
            let mut acked = peer.acked.clone();
            tokio::time::timeout(TIMEOUT, acked.wait_for(|a| *a >= cli.versions))
                .await
                .map_err(|_| format!("worker {w} did not acknowledge version {}", cli.versions))??;
        }
        Ok::<_, BoxError>(train_time)
    };
    let train_time = unless_down(&engine, &workers, run).await.map_err(|e| {
        let who = match e.downcast_ref::<fabric_async::Error>() {
            Some(fabric_async::Error::PeerUnreachable { peer, .. }) => {
                workers.iter().position(|p| p.0 == *peer).map_or("a worker".into(), |w| format!("worker {w}"))
            }
            _ => return e,
        };
        format!("{who} is gone mid-run: {e}").into()
    })?;
    let total = start.elapsed();
    let mut failed = bad.load(Ordering::Relaxed);
    for mut c in children {
        failed |= !wait_child(&mut c, TIMEOUT).await?.success();
    }
    receiver.abort();
    if failed {
        return Err("a worker reported a wrong or torn version (see above)".into());
    }
    let timing = timing.lock().expect("timing").clone();
    let mut update_all = Vec::new();
    for (v, t) in timing.iter().enumerate().skip(1) {
        let pushed = t.pushed.ok_or("a version was never pushed")?;
        let last =
            t.acks.iter().map(|a| a.ok_or("a missing acknowledgement")).collect::<Result<Vec<_>, _>>()?;
        let all = last.iter().max().map_or(Duration::ZERO, |a| a.duration_since(pushed));
        update_all.push(all);
        let writes: Vec<String> =
            t.writes.iter().map(|d| format!("{:.2}", model as f64 / d.as_secs_f64() / 1e9)).collect();
        println!(
            "rl_weights: version {v}: all {} workers updated, checked and switched in {:>7.1} ms; GB/s per worker {}",
            cli.workers,
            all.as_secs_f64() * 1e3,
            writes.join(" ")
        );
    }
    let (p50, _) = percentiles(update_all.clone());
    let max = update_all.iter().max().copied().unwrap_or_default();
    let per_worker: Vec<String> = (0..cli.workers)
        .map(|w| {
            let mut g: Vec<f64> =
                timing.iter().skip(1).map(|t| model as f64 / t.writes[w].as_secs_f64() / 1e9).collect();
            g.sort_by(|a, b| a.total_cmp(b));
            format!("worker {w} {:.2}", g[g.len() / 2])
        })
        .collect();
    println!(
        "rl_weights: update all workers p50 {:.1} ms, max {:.1} ms; GB/s per worker (median over versions, {} MiB each): {}",
        p50 / 1e3,
        max.as_secs_f64() * 1e3,
        model >> 20,
        per_worker.join(", ")
    );
    println!(
        "rl_weights: ok: {} versions x {} workers in {:.2} s (training {:.2} s of it, off the runtime), every tensor of every version checked, none torn",
        cli.versions,
        cli.workers,
        total.as_secs_f64(),
        train_time.as_secs_f64()
    );
    Ok(())
}
/// Writes version `v` (staged in `src`) into buffer `v % 2` of one worker: one write_imm per
/// tensor, `window` in flight.
async fn push(
    engine: &Engine,
    src: &MemoryRegion,
    dst: &RemoteRegion,
    tensors: &[Tensor],
    v: usize,
    model: usize,
    window: usize,
) -> Result<(), BoxError> {
    let base = ((v % 2) * model) as u64;
    let imm = IMM_BASE + v as u32;
    let mut in_flight = FuturesUnordered::new();
    for t in tensors {
        if in_flight.len() == window {
            in_flight.next().await.expect("non-empty")?;
        }
        in_flight.push(engine.write_imm(
            src,
            t.offset as u64,
            dst,
            base + t.offset as u64,
            t.len as u64,
            imm,
        ));
    }
    while let Some(done) = in_flight.next().await {
        done?;
    }
    Ok(())
}
