//! How a [`Topology`] prints: NUMA nodes, PCIe switch groups, a GPU × NIC affinity
//! matrix, the NICs and the plans (`examples/topology.rs` prints this for this machine).

use std::fmt;

use super::cpulist::CpuList;
use super::plan::affinity;
use super::{Affinity, Topology};

/// Shows at most this many NICs as matrix columns.
const MATRIX_MAX_NICS: usize = 16;

impl fmt::Display for Topology {
    /// A summary in the spirit of `nvidia-smi topo -m`: NUMA nodes, switch groups, an
    /// affinity matrix (up to 16 NICs), the NICs and the plan of each GPU.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        writeln!(
            f,
            "topology of {}: {} GPU(s), {} RDMA NIC(s), {} NUMA node(s), {} online CPU(s)",
            self.root.display(),
            self.gpus.len(),
            self.nics.len(),
            self.nodes.len(),
            self.online_cpus.len()
        )?;
        if let Some(allowed) = &self.allowed_cpus {
            writeln!(f, "this process may run on CPUs {}", CpuList(allowed))?;
        }
        for n in &self.nodes {
            writeln!(f, "NUMA node {}: CPUs {} ({} physical cores)", n.id, CpuList(&n.cpus), n.cores.len())?;
        }
        if !self.groups.is_empty() {
            writeln!(f, "\nPCIe switches (by root port):")?;
            for g in &self.groups {
                let mut members: Vec<String> = g.gpus.iter().map(|i| format!("GPU{i}")).collect();
                members.extend(g.nics.iter().cloned());
                writeln!(
                    f,
                    "  {} {:<11} NUMA {:<2} {}",
                    g.root_port,
                    g.host_bridge.as_deref().unwrap_or("-"),
                    opt(g.numa_node),
                    members.join(" ")
                )?;
            }
        }
        if !self.gpus.is_empty() && !self.nics.is_empty() && self.nics.len() <= MATRIX_MAX_NICS {
            writeln!(
                f,
                "\nAffinity (SW: same PCIe switch, HB: same host bridge, NODE: same NUMA node, SYS: other):"
            )?;
            let mut header = "     ".to_string();
            for i in 0..self.nics.len() {
                header.push_str(&format!(" {:<5}", format!("NIC{i}")));
            }
            writeln!(f, "{}", header.trim_end())?;
            for g in &self.gpus {
                let mut row = format!("{:<5}", format!("GPU{}", g.index));
                for n in &self.nics {
                    let cell = match affinity(g, n).0 {
                        Affinity::Switch => "SW",
                        Affinity::HostBridge => "HB",
                        Affinity::NumaNode => "NODE",
                        Affinity::System => "SYS",
                    };
                    row.push_str(&format!(" {cell:<5}"));
                }
                writeln!(f, "{}", row.trim_end())?;
            }
        }
        if !self.nics.is_empty() {
            writeln!(f, "\nRDMA NICs:")?;
            for (i, n) in self.nics.iter().enumerate() {
                let port = n.ports.first().map(|p| {
                    [p.state.as_deref(), p.link_layer.as_deref(), p.rate.as_deref()]
                        .into_iter()
                        .flatten()
                        .collect::<Vec<_>>()
                        .join(" ")
                });
                writeln!(
                    f,
                    "  NIC{i:<3} {:<12} {:<8} {:<12} NUMA {:<2} netdev {:<10} {}",
                    n.name,
                    n.kind.to_string(),
                    n.pci.as_deref().unwrap_or("-"),
                    opt(n.numa_node),
                    n.netdev.as_deref().unwrap_or("-"),
                    port.unwrap_or_default()
                )?;
            }
        }
        if self.plans.is_empty() {
            writeln!(f, "\nNo NVIDIA GPU: no plans.")?;
        } else {
            writeln!(f, "\nPlans:")?;
            for p in &self.plans {
                let nics = if p.nics.is_empty() { "-".to_string() } else { p.nics.join(",") };
                writeln!(
                    f,
                    "  GPU{:<2} {} NUMA {:<2} NICs {} ({}) cores {} ({}) reactor {}{}",
                    p.gpu,
                    p.pci,
                    opt(p.numa_node),
                    nics,
                    p.affinity.map_or_else(|| "none".to_string(), |a| a.to_string()),
                    CpuList(&p.cores),
                    p.cores.len(),
                    opt(p.reactor_core),
                    if p.overridden { " [override]" } else { "" }
                )?;
            }
        }
        Ok(())
    }
}
