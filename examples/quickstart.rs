//! Quickstart: a real RDMA-style transfer between two processes on this machine.
//!
//! ```text
//! cargo run --release --example quickstart -- [--provider tcp|shm|udp|verbs[:DEV]] [--size MiB]
//!                                             [--chunk KiB] [--window N] [--rounds N]
//!                                             [--rendezvous tcp|etcd://HOST:PORT] [--stats]
//! cargo run --release --example quickstart -- --help    # every option, with its default
//! ```
//!
//! This process is the sender. It starts a second copy of itself as the receiver; the two
//! meet through a `TcpStore` on 127.0.0.1 (or, with `--rendezvous etcd://HOST:PORT`, through
//! an `EtcdStore` on that etcd, under a prefix of their own) and exchange engine addresses and
//! a region descriptor. Each round the sender streams `size` bytes as `write_imm` operations (a
//! window of them in flight), the receiver awaits its `ImmCounter` for that many arrivals
//! (no reset between rounds: waits consume), tells the sender with a two-sided message,
//! then checks every byte and reports back.
//!
//! Neither waits on a dead peer: the sender takes the receiver's messages with
//! `recv_from(receiver)`, which fails once the receiver is found dead (on shm its writes still
//! complete into the dead process's memory, so only that can end it), and the receiver's
//! counter wait is tied to the sender (`ImmCounterExt::wait_for_from`). Kill either process with
//! SIGKILL and the other exits 1 with `quickstart failed: ... peer N is unreachable: ...`.

use std::collections::VecDeque;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use fabric_async::bootstrap::{Rendezvous, TcpStore, TcpStoreServer};
use fabric_async::{Engine, EtcdOptions, EtcdStore, ImmCounterExt};
use fabric_examples::{positive, BoxError, ProviderArg};

const IMM_DATA: u32 = 1;

/// A real RDMA-style transfer between two processes on this machine, every byte checked.
///
/// This process is the sender; it starts a second copy of itself as the receiver. Each round
/// the sender streams --size MiB as write_imm operations of --chunk KiB, --window of them in
/// flight; the receiver waits for that many arrivals on its immediate counter, checks every
/// byte and reports back. Prints each round's time and bandwidth, then the median and best.
#[derive(Parser, Debug)]
#[command(name = "quickstart", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    provider: ProviderArg,
    /// MiB moved per round (a region of this size on each side).
    #[arg(long, value_name = "MiB", default_value_t = 128, value_parser = positive)]
    size: usize,
    /// KiB per write_imm: a round is size/chunk writes (the last one shorter if it does not divide).
    #[arg(long, value_name = "KiB", default_value_t = 4096, value_parser = positive)]
    chunk: usize,
    /// write_imm operations in flight at once (0 counts as 1).
    #[arg(long, value_name = "N", default_value_t = 16)]
    window: usize,
    /// Rounds, each with its own byte pattern (0 counts as 1).
    #[arg(long, value_name = "N", default_value_t = 5)]
    rounds: usize,
    /// Where the two processes meet: `tcp` (a TcpStore this process serves on 127.0.0.1) or
    /// `etcd://HOST:PORT` (an etcd v3 server; keys under `fabric-quickstart/<pid>`, under a
    /// lease per process).
    #[arg(long, value_name = "URL", default_value = "tcp", value_parser = rendezvous)]
    rendezvous: Meet,
    /// Print the sender engine's statistics (engine.stats(): per NIC, per peer, reactor,
    /// counters) every second during the run, and once at the end.
    #[arg(long)]
    stats: bool,
    /// Internal: run as the receiver for the sender whose TcpStore is at ADDR (or, with etcd,
    /// whose keys are under prefix ADDR).
    #[arg(long, value_name = "ADDR", hide = true)]
    receiver_of: Option<String>,
}

/// Where the processes meet (`--rendezvous`).
#[derive(Clone, Debug)]
enum Meet {
    Tcp,
    /// `HOST:PORT` of an etcd server.
    Etcd(String),
}

fn rendezvous(s: &str) -> Result<Meet, String> {
    if s == "tcp" {
        return Ok(Meet::Tcp);
    }
    match s.strip_prefix("etcd://") {
        Some(ep) if !ep.is_empty() => Ok(Meet::Etcd(ep.trim_end_matches('/').to_string())),
        _ => Err(format!("{s:?}: expected tcp or etcd://HOST:PORT")),
    }
}

impl Meet {
    fn arg(&self) -> String {
        match self {
            Meet::Tcp => "tcp".into(),
            Meet::Etcd(ep) => format!("etcd://{ep}"),
        }
    }

    /// The store of one side: `meet` is the TcpStore address, or the etcd key prefix.
    async fn connect(&self, meet: &str) -> Result<Box<dyn Rendezvous>, BoxError> {
        Ok(match self {
            Meet::Tcp => {
                Box::new(TcpStore::connect(meet.parse()?).await?.with_timeout(Duration::from_secs(60)))
            }
            Meet::Etcd(ep) => {
                let opts = EtcdOptions::default().get_timeout(Duration::from_secs(60));
                Box::new(EtcdStore::connect(&[ep.as_str()], meet, opts).await?)
            }
        })
    }
}

/// The run in bytes.
#[derive(Clone)]
struct Opts {
    provider: String,
    size: usize,
    chunk: usize,
    window: usize,
    rounds: usize,
    store: Option<String>,
    rendezvous: Meet,
    stats: bool,
}

impl From<Cli> for Opts {
    fn from(c: Cli) -> Opts {
        Opts {
            provider: c.provider.name,
            size: c.size << 20,
            chunk: c.chunk << 10,
            window: c.window.max(1),
            rounds: c.rounds.max(1),
            store: c.receiver_of,
            rendezvous: c.rendezvous,
            stats: c.stats,
        }
    }
}

/// The byte at `offset` in round `round`.
fn pattern(round: usize, offset: usize) -> u8 {
    (offset as u64).wrapping_mul(2654435761).wrapping_add(round as u64 * 97).to_le_bytes()[1]
}

fn fill(buf: &mut [u8], round: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(round, i);
    }
}

#[tokio::main]
async fn main() {
    let o = Opts::from(Cli::parse());
    let result = match &o.store {
        Some(addr) => receiver(o.clone(), addr.clone()).await,
        None => sender(o).await,
    };
    if let Err(e) = result {
        eprintln!("quickstart failed: {e}");
        std::process::exit(1);
    }
}

async fn sender(o: Opts) -> Result<(), BoxError> {
    // A TcpStore served here, or a fresh prefix on the etcd server.
    let (_server, meet) = match &o.rendezvous {
        Meet::Tcp => {
            let server = TcpStoreServer::bind("127.0.0.1:0".parse()?).await?;
            let addr = server.local_addr().to_string();
            (Some(server), addr)
        }
        Meet::Etcd(_) => (None, format!("fabric-quickstart/{}", std::process::id())),
    };
    let store = o.rendezvous.connect(&meet).await?;
    println!("sender:   rendezvous {} ({meet})", o.rendezvous.arg());

    // The receiver: this same program, started again.
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--receiver-of", &meet, "--rendezvous", &o.rendezvous.arg(), "--provider", &o.provider])
        .args(["--size", &(o.size >> 20).to_string(), "--chunk", &(o.chunk >> 10).to_string()])
        .args(["--rounds", &o.rounds.to_string()])
        .stdin(Stdio::null())
        .spawn()?;

    let engine = Engine::builder().provider(&o.provider).build()?;
    println!("sender:   engine up on {} (reactor mode Event)", engine.transport());
    // --stats: a snapshot every second while the rounds run (stopped below).
    let stats_task = o.stats.then(|| {
        let engine = engine.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(1));
            every.tick().await;
            loop {
                every.tick().await;
                println!("stats:\n{}", engine.stats());
            }
        })
    });
    store.put("sender/addr", engine.address()).await?;
    let src = engine.alloc(o.size).await?;
    let dst = engine.remote_region(&store.get("receiver/desc").await?).await?;
    let receiver = dst.peer();
    let chunks = o.size.div_ceil(o.chunk);
    println!(
        "sender:   {} MiB per round in {chunks} write_imm of {} KiB, window {}, {} rounds",
        o.size >> 20,
        o.chunk >> 10,
        o.window,
        o.rounds
    );

    let mut rates = Vec::new();
    let mut buf = vec![0u8; o.size];
    for round in 0..o.rounds {
        fill(&mut buf, round);
        src.write_at(0, &buf)?;
        let start = Instant::now();
        let mut inflight = VecDeque::with_capacity(o.window);
        for i in 0..chunks {
            let off = (i * o.chunk) as u64;
            let len = o.chunk.min(o.size - i * o.chunk) as u64;
            inflight.push_back(engine.write_imm(&src, off, &dst, off, len, IMM_DATA));
            if inflight.len() == o.window {
                inflight.pop_front().expect("non-empty").await.map_err(|e| to_receiver(round, e))?;
            }
        }
        for f in inflight {
            f.await.map_err(|e| to_receiver(round, e))?;
        }
        // The receiver's counter reached `chunks`: every byte has landed. Its messages come
        // with `recv_from`, which fails if it dies instead (on shm the writes above complete
        // into a dead receiver's memory: only its `Down` tells).
        let (_, msg) = engine.recv_from(receiver).await.map_err(|e| from_receiver(round, e))?;
        let secs = start.elapsed().as_secs_f64();
        if &msg[..] != b"arrived" {
            return Err(format!("unexpected message {msg:?}").into());
        }
        let gbps = o.size as f64 * 8.0 / secs / 1e9;
        rates.push(gbps);
        let (_, verdict) = engine.recv_from(receiver).await.map_err(|e| from_receiver(round, e))?;
        let verdict = String::from_utf8_lossy(&verdict).to_string();
        println!("round {round}: {:>7.2} ms  {gbps:>7.2} Gbit/s  receiver: {verdict}", secs * 1e3);
        if verdict != "all bytes verified" {
            return Err(format!("round {round}: {verdict}").into());
        }
        if round + 1 < o.rounds {
            engine.send(receiver, b"next").await.map_err(|e| to_receiver(round, e))?;
        }
    }
    if let Some(t) = stats_task {
        t.abort();
        println!("stats at the end:\n{}", engine.stats());
    }
    let status = tokio::task::spawn_blocking(move || child.wait()).await??;
    if !status.success() {
        return Err(format!("receiver exited with {status}").into());
    }
    rates.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    println!(
        "moved {} MiB x {} rounds over {}: median {:.2} Gbit/s, best {:.2} Gbit/s; every byte verified",
        o.size >> 20,
        o.rounds,
        engine.transport(),
        rates[rates.len() / 2],
        rates[rates.len() - 1]
    );
    Ok(())
}

/// A failed write or send to the receiver, in round `round`.
fn to_receiver(round: usize, e: fabric_async::Error) -> BoxError {
    format!("round {round}: writing to the receiver: {e}").into()
}

/// A failed wait for the receiver's message, in round `round`.
fn from_receiver(round: usize, e: fabric_async::Error) -> BoxError {
    format!("round {round}: waiting for the receiver: {e}").into()
}

async fn receiver(o: Opts, meet: String) -> Result<(), BoxError> {
    let store = o.rendezvous.connect(&meet).await?;
    let engine = Engine::builder().provider(&o.provider).build()?;
    let dst = engine.alloc(o.size).await?;
    let sender = engine.add_peer(&store.get("sender/addr").await?).await?;
    store.put("receiver/desc", dst.descriptor().to_bytes()).await?;
    println!("receiver: pid {}, engine up on {}", std::process::id(), engine.transport());
    let chunks = o.size.div_ceil(o.chunk) as u64;
    let counter = engine.imm_counter(IMM_DATA);
    let mut expected = vec![0u8; o.size];
    let mut got = vec![0u8; o.size];
    for round in 0..o.rounds {
        // A counter alone cannot tell that the sender died: this wait fails once it is down.
        let senders = [sender];
        let wait = counter.wait_for_from(&engine, &senders, chunks);
        match tokio::time::timeout(Duration::from_secs(60), wait).await {
            Ok(r) => r.map_err(|e| format!("round {round}: waiting for the sender's writes: {e}"))?,
            Err(_) => {
                return Err(format!("round {round}: the sender's writes did not all come within 60 s").into())
            }
        }
        let to_sender = |e: fabric_async::Error| format!("round {round}: sending to the sender: {e}");
        engine.send(sender, b"arrived").await.map_err(to_sender)?;
        fill(&mut expected, round);
        dst.read_at(0, &mut got)?;
        let verdict = match got.iter().zip(&expected).position(|(a, b)| a != b) {
            None => "all bytes verified".to_string(),
            Some(i) => format!("MISMATCH at byte {i}: got {} expected {}", got[i], expected[i]),
        };
        engine.send(sender, verdict.as_bytes()).await.map_err(to_sender)?;
        if round + 1 < o.rounds {
            let (_, next) = engine
                .recv_from(sender)
                .await
                .map_err(|e| format!("round {round}: waiting for the sender: {e}"))?;
            debug_assert_eq!(&next[..], b"next");
        }
    }
    Ok(())
}
