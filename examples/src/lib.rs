//! What the examples share. The examples live in this folder; run them with
//! `cargo run --release --example NAME -- --help`:
//!
//! - `quickstart.rs`: a real transfer between two processes, every byte checked.
//! - `shapes.rs`: the transfer shapes over several NICs and the arrivals each produces.
//! - `topology.rs`: this machine's GPUs, RDMA NICs and NUMA nodes, and what fabric gives each GPU.
//!
//! This crate holds only the plumbing two or more of them would otherwise repeat: the
//! `--provider` option, a counter wait that fails instead of hanging, and a parser for counts
//! that must not be 0.

use std::time::Duration;

use fabric_async::{ImmCounter, ImmCounterExt};

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
