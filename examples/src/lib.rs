//! What the examples share. The examples live in this folder; run them with
//! `cargo run --release --example NAME -- --help`:
//!
//! - `quickstart.rs`: a real transfer between two processes, every byte checked.
//! - `shapes.rs`: the transfer shapes over several NICs and the arrivals each produces.
//! - `topology.rs`: this machine's GPUs, RDMA NICs and NUMA nodes, and what fabric gives each GPU.
//! - `moe.rs`: MoE dispatch/combine across R processes, busy-poll and Inline against Event.
//! - `kv_transfer.rs`: prefill/decode disaggregation, paged KV-cache blocks, decode workers
//!   joining and leaving mid-run.
//! - `rl_weights.rs`: a trainer streaming weight versions to inference workers.
//!
//! This crate holds only the plumbing two or more of them would otherwise repeat: the
//! `--provider`, `--nics` and `--location` options, a counter wait that fails instead of
//! hanging, starting copies of the running program as peer processes and waiting for them
//! with a deadline, percentiles, and a parser for counts that must not be 0.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fabric_async::{Engine, EngineBuilder, ImmCounter, ImmCounterExt, MemoryLocation};

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

/// In a process started by [`spawn_self`]: exits (status 1) as soon as the parent process is
/// gone, so a parent that failed or was killed never leaves its peers behind. Checks every
/// 200 ms on a tokio task.
pub fn exit_with_parent(who: &'static str) {
    let parent = std::os::unix::process::parent_id();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if std::os::unix::process::parent_id() != parent {
                eprintln!("{who}: the parent process is gone; exiting");
                std::process::exit(1);
            }
        }
    });
}

/// Waits up to `timeout` for `child` to exit, without blocking the runtime; after that, kills
/// it (SIGKILL) and returns an error (a stuck peer is a failure, not a hang).
pub async fn wait_child(child: &mut Child, timeout: Duration) -> Result<ExitStatus, BoxError> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("process {} did not exit within {} s", child.id(), timeout.as_secs()).into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The 50th and 99th percentiles of `v` in µs (nearest rank; 0 for an empty list).
pub fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.99))
}
