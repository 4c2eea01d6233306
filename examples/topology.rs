//! Prints the GPUs, RDMA NICs and NUMA nodes of this machine, and which NICs and cores
//! fabric would give each GPU.
//!
//! ```text
//! cargo run --example topology                          # /sys, then $FABRIC_TOPOLOGY
//! cargo run --example topology -- --sysfs ROOT [--override SPEC]
//! ```
//!
//! `--sysfs` reads a copy of a machine's sysfs tree (`ROOT/sys/...`) instead of `/sys`;
//! `--override` applies a topology override such as `0=mlx5_0,mlx5_1@cores:8-15`
//! (see `docs/topology.md`).

use std::path::PathBuf;

use clap::Parser;
use fabric_async::topology::{Topology, TopologyOverride};

/// Prints the GPUs, RDMA NICs and NUMA nodes of this machine, and which NICs and cores fabric
/// would give each GPU.
///
/// With no option: /sys, then the override in $FABRIC_TOPOLOGY if it is set. docs/topology.md
/// explains the output and the override grammar.
#[derive(Parser, Debug)]
#[command(name = "topology", args_override_self = true)]
struct Cli {
    /// Reads a copy of a machine's sysfs tree (ROOT/sys/...) instead of /sys.
    ///
    /// $FABRIC_TOPOLOGY is then not read.
    #[arg(long, value_name = "ROOT")]
    sysfs: Option<PathBuf>,
    /// Applies a topology override, such as 0=mlx5_0,mlx5_1@cores:8-15, instead of
    /// $FABRIC_TOPOLOGY.
    #[arg(long = "override", value_name = "SPEC")]
    spec: Option<String>,
}

fn run(sysfs: Option<PathBuf>, spec: Option<String>) -> Result<Topology, fabric_async::Error> {
    let mut topo = match &sysfs {
        None if spec.is_none() => return Topology::detect_with_env(),
        None => Topology::detect()?,
        Some(root) => Topology::from_sysfs(root)?,
    };
    if let Some(spec) = spec {
        topo.apply_override(&spec.parse::<TopologyOverride>()?)?;
    }
    Ok(topo)
}

fn main() {
    let Cli { sysfs, spec } = Cli::parse();
    match run(sysfs, spec) {
        Ok(topo) => print!("{topo}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    }
}
