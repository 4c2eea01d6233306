//! What the examples share. The examples live in this folder; run them with
//! `cargo run --release --example NAME -- --help`:
//!
//! - `quickstart.rs`: a real transfer between two processes, every byte checked.
//! - `shapes.rs`: the transfer shapes over several NICs and the arrivals each produces.
//! - `topology.rs`: this machine's GPUs, RDMA NICs and NUMA nodes, and what fabric gives each GPU.
//! - `moe.rs`: MoE dispatch/combine across R processes, busy-poll and Inline against Event.
//! - `moe_gpu.rs`: MoE dispatch/combine on GPUs with `fabric-moe` (NVLink kernels), timed on
//!   the GPU; `moe_gpu_nccl.py` times NCCL's `all_to_all_single` of the same bytes.
//! - `kv_transfer/` (`main.rs`, `prefill.rs`, `decode.rs`): prefill/decode disaggregation, paged KV-cache blocks, decode workers
//!   joining and leaving mid-run.
//! - `rl_weights.rs`: a trainer streaming weight versions to inference workers.
//!
//! This crate holds only the plumbing two or more of them would otherwise repeat: the
//! `--provider`, `--nics` and `--location` options, a counter wait that fails instead of
//! hanging, a wait raced against the death of the peers it waits on ([`unless_down`],
//! [`DownWatch`] for the spin paths),
//! starting copies of the running program as peer processes and waiting for them with a
//! deadline, percentiles, and a parser for counts that must not be 0.
//!
//! **No wait outlives its peer.** Every wait of an example on another process is either
//! `engine.recv_from(peer)`, which fails with `Error::PeerUnreachable` once that peer is
//! found dead, or raced against `engine.peer_events()` with [`unless_down`]: a counter's
//! `wait_for` cannot know whose writes it counts, and on shm a sender's writes complete into
//! a dead receiver's memory, so only the peer's `Down` event can end such a wait. A process
//! killed with SIGKILL therefore ends the examples' other processes within about the
//! transport's detection time (docs/faults.md, "Waits and peer death"), with a non-zero
//! exit and a message that names the peer and the error, instead of a hang.

use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_async::{Engine, EngineBuilder, Error, ImmCounter, ImmCounterExt, MemoryLocation, PeerId};

/// The error type of the examples' `main`s.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The `--provider` option of the examples that move data (`#[command(flatten)]` it).
#[derive(clap::Args, Clone, Debug)]
pub struct ProviderArg {
    /// The transport: tcp, shm, udp, efa, verbs or verbs:DEV[,DEV..].
    ///
    /// tcp: libfabric's tcp;ofi_rxm on 127.0.0.1. shm: libfabric's shared memory (this
    /// machine). udp: udp;ofi_rxd, very slow, for small tests. efa: AWS EFA. verbs: ibverbs RC
    /// queue pairs on the first device with an active port; verbs:DEV on device DEV;
    /// verbs:DEV0,DEV1 names one NIC per engine domain. README.md, "Providers and environment".
    #[arg(long = "provider", value_name = "PROVIDER", env = "FABRIC_PROVIDER", default_value = "tcp")]
    pub name: String,
}

/// Waits for `n` arrivals on `counter` and consumes them; after `timeout` without them, an
/// error saying how many came (a lost write is an error, not a hang).
///
/// # Cancel safety
///
/// As [`ImmCounterExt::wait_for_timeout`]: a dropped wait consumes nothing.
pub async fn wait_arrivals(counter: &ImmCounter, n: u64, timeout: Duration) -> Result<(), BoxError> {
    if counter.wait_for_timeout(n, timeout).await? {
        return Ok(());
    }
    Err(format!(
        "only {} of {n} arrivals of imm {} came within {} s",
        counter.available(),
        counter.imm(),
        timeout.as_secs_f64()
    )
    .into())
}

// Waits tied to peers are the library's (`fabric_async::{peer_down, race_down}`); this
// module adds `unless_down` for waits whose errors are not `fabric_async::Error`.
pub use fabric_async::{peer_down, race_down, DOWN_GRACE};

/// [`race_down`] for a fallible wait: its own error, or the peer's death. Use it for waits
/// that cannot fail by themselves when their peer dies: counter waits, acknowledgements that
/// come through a channel or the store, and `recv()` where the sender is not known.
///
/// # Cancel safety
///
/// As cancel safe as `wait`: dropping this (or losing the race) drops `wait`. A counter's
/// `wait_for` and `recv`/`recv_from` consume nothing when dropped.
pub async fn unless_down<T, E>(
    engine: &Engine,
    peers: &[PeerId],
    wait: impl Future<Output = Result<T, E>>,
) -> Result<T, BoxError>
where
    E: Into<BoxError>,
{
    match race_down(engine, peers, wait).await {
        Ok(r) => r.map_err(Into::into),
        Err(e) => Err(e.into()),
    }
}

/// [`peer_down`] for synchronous spin paths (a busy-poll thread cannot await): a tokio task
/// records the first death of one of the peers; [`DownWatch::check`] reads it. Dropping the
/// watch ends the task.
#[derive(Debug)]
pub struct DownWatch {
    /// The death and when it was seen.
    down: std::sync::Arc<std::sync::Mutex<Option<(Error, Instant)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl DownWatch {
    /// Starts watching `peers` of `engine` (on the current tokio runtime).
    pub fn spawn(engine: &Engine, peers: Vec<PeerId>) -> DownWatch {
        let down = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (engine, d) = (engine.clone(), down.clone());
        let task = tokio::spawn(async move {
            let e = peer_down(&engine, &peers).await;
            *d.lock().unwrap_or_else(|p| p.into_inner()) = Some((e, Instant::now()));
        });
        DownWatch { down, task }
    }

    /// `Err` once a watched peer has been down for [`DOWN_GRACE`]: the error [`peer_down`]
    /// gave.
    pub fn check(&self) -> Result<(), BoxError> {
        match &*self.down.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((_, since)) if since.elapsed() < DOWN_GRACE => Ok(()),
            None | Some((Error::Shutdown, _)) => Ok(()),
            Some((Error::PeerUnreachable { peer, message }, _)) => {
                Err(Error::PeerUnreachable { peer: *peer, message: message.clone() }.into())
            }
            Some((e, _)) => Err(e.to_string().into()),
        }
    }

    /// `counter.spin_wait(n, timeout)` in 10 ms slices with a [`DownWatch::check`] between
    /// them: `Ok(true)` once `n` arrivals were consumed, `Ok(false)` after `timeout`, `Err`
    /// when a watched peer went down first (nothing consumed then).
    pub fn spin_wait(&self, counter: &ImmCounter, n: u64, timeout: Duration) -> Result<bool, BoxError> {
        let end = Instant::now() + timeout;
        loop {
            let now = Instant::now();
            if now >= end {
                return Ok(false);
            }
            if counter.spin_wait(n, (end - now).min(Duration::from_millis(10))) {
                return Ok(true);
            }
            self.check()?;
        }
    }
}

impl Drop for DownWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A clap `value_parser` for a count or size that must be above 0.
pub fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("expected a whole number above 0".into()),
    }
}

/// The `--nics` option (`#[command(flatten)]` it).
#[derive(clap::Args, Clone, Debug)]
pub struct NicsArg {
    /// NICs per engine: on libfabric, N domains of the provider on loopback stand for N NICs
    /// (every transfer is sharded over them, and arrival counts follow; docs/transfers.md).
    /// Ignored when the provider names its devices, as in verbs:DEV0,DEV1.
    #[arg(long = "nics", value_name = "N", default_value_t = 1, value_parser = positive)]
    pub n: usize,
}

/// An engine builder for `provider` with `nics` NICs (domains), as `--provider` and `--nics` say.
pub fn engine_builder(provider: &str, nics: usize) -> EngineBuilder {
    let b = Engine::builder().provider(provider);
    // `verbs:dev0,dev1` names the NICs; elsewhere N domains stand for N NICs.
    if provider.contains(',') {
        b
    } else {
        b.domains(nics)
    }
}

/// Where the example's transfer buffers live.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Ordinary host memory.
    Host,
    /// Memory of CUDA device 0.
    Cuda,
}

/// The `--location` option (`#[command(flatten)]` it).
#[derive(clap::Args, Clone, Debug)]
pub struct LocationArg {
    /// Where the transfer buffers live: host memory, or CUDA device 0 (GPUDirect where the
    /// NICs can, else staged through pinned memory, or CUDA IPC on one host; docs/gpu.md). Where
    /// GPU memory cannot be registered, the example says `skipped: --location cuda: <why>`
    /// and exits 0.
    #[arg(long = "location", value_enum, default_value_t = Location::Host)]
    pub location: Location,
}

impl LocationArg {
    /// The engine's memory location.
    pub fn memory(&self) -> MemoryLocation {
        match self.location {
            Location::Host => MemoryLocation::Host,
            Location::Cuda => MemoryLocation::Cuda { ordinal: 0 },
        }
    }

    /// The name to pass on to child processes.
    pub fn name(&self) -> &'static str {
        match self.location {
            Location::Host => "host",
            Location::Cuda => "cuda",
        }
    }

    /// Tries a small allocation in this location on `engine`. If it fails (GPU memory is not
    /// available or not implemented), prints `skipped: --location cuda: <error>` and exits
    /// the process with 0: a clean skip, not a failure.
    pub async fn exit_if_unavailable(&self, engine: &Engine) {
        if self.location == Location::Host {
            return;
        }
        if let Err(e) = engine.alloc_in(4096, self.memory()).await {
            println!("skipped: --location {}: {e}", self.name());
            std::process::exit(0);
        }
    }
}

/// The transport options a parent passes on to the copies it starts: `--provider`, `--nics`
/// and `--location` as the parent has them.
pub fn transport_args(provider: &ProviderArg, nics: &NicsArg, location: &LocationArg) -> [String; 6] {
    [
        "--provider".into(),
        provider.name.clone(),
        "--nics".into(),
        nics.n.to_string(),
        "--location".into(),
        location.name().into(),
    ]
}

/// Starts a copy of the running program with `args` (stdin closed, stdout and stderr shared).
pub fn spawn_self<I, S>(args: I) -> Result<Child, BoxError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Ok(Command::new(std::env::current_exe()?).args(args).stdin(Stdio::null()).spawn()?)
}

/// In a process started by [`spawn_self`]: exits as soon as its parent is gone; waiting for
/// a child without blocking the runtime, bounded (`fabric_async::process`).
pub use fabric_async::process::{exit_with_parent, wait_child};

/// The 50th and 99th percentiles of `v` in µs (nearest rank; 0 for an empty list).
pub fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.99))
}
