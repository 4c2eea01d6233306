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

use fabric_async::topology::{Topology, TopologyOverride, OVERRIDE_ENV};

fn usage() -> ! {
    eprintln!(
        "usage: topology [--sysfs ROOT] [--override SPEC]   (without --sysfs: /sys and ${OVERRIDE_ENV})"
    );
    std::process::exit(2)
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
    let (mut sysfs, mut spec) = (None, None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--sysfs" => sysfs = Some(PathBuf::from(args.next().unwrap_or_else(|| usage()))),
            "--override" => spec = Some(args.next().unwrap_or_else(|| usage())),
            _ => usage(),
        }
    }
    match run(sysfs, spec) {
        Ok(topo) => print!("{topo}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    }
}
