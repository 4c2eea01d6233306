//! Which NICs and CPU cores belong to which GPU, read from sysfs.
//!
//! A GPU should send through the RDMA NICs behind its own PCIe switch, and the reactor
//! thread that drives them should run on a physical core of the GPU's NUMA node. This module
//! finds those from the files Linux exposes under `/sys`; it reads files and nothing else.
//! The sysfs root is a parameter ([`Topology::from_sysfs`]), so the same code runs on trees
//! shaped like real servers in the tests.
//!
//! ```text
//!  pci0000:15 (host bridge, NUMA 0)          /sys/devices/system/node/node0/cpulist
//!    └─ 0000:15:01.0 root port                  0-55,112-167 → physical cores 0-55
//!         └─ 0000:16:00.0 PCIe switch                                   │
//!              ├─ 0000:17:00.0 ── GPU0   0000:18:00.0 ─┐                │
//!              └─ 0000:17:01.0 ── mlx5_0 0000:19:00.0 ─┴─► GpuPlan { nics: [mlx5_0],
//!                                                                  cores: 0-55, reactor: 55 }
//! ```
//!
//! Detection ([`Topology::from_sysfs`]) finds NVIDIA GPUs on the PCI bus, RDMA devices in
//! the `infiniband` class (ConnectX and other verbs NICs, AWS EFA, rxe/siw software devices),
//! the NUMA nodes with their CPUs and which CPUs are SMT siblings. Planning
//! ([`Topology::plans`]) gives each GPU its NICs, NUMA node, physical cores and a reactor
//! core; the rules are in `docs/topology.md`. A [`TopologyOverride`] (the
//! [`OVERRIDE_ENV`] variable) replaces any of these per GPU.
#![forbid(unsafe_code)]

mod cpulist; // the kernel's CPU list format (`0-55,112-167`), read and written
mod display; // `Display for Topology`: the summary in the spirit of `nvidia-smi topo -m`
mod overrides; // `TopologyOverride` (`FABRIC_TOPOLOGY`): parsed and printed
mod plan; // NICs, cores and a reactor core per GPU, from what was read: no I/O
mod sysfs; // reading `/sys` (and `/proc/self/status`): the only file access

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub use overrides::{GpuOverride, TopologyOverride, OVERRIDE_ENV};

use cpulist::CpuList;
use plan::{affinity, physical_cores, switch_groups};
use sysfs::{parse_bdf, process_allowed_cpus, Sysfs};

/// An NVIDIA GPU on the PCI bus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Position in PCI address order: the index `nvidia-smi` shows, and CUDA's with
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID` and no `CUDA_VISIBLE_DEVICES`.
    pub index: usize,
    /// PCI address, `domain:bus:device.function` (`0000:18:00.0`).
    pub pci: String,
    /// PCI device id (`0x2330` is an H100 SXM), if readable.
    pub device_id: Option<u16>,
    /// NUMA node from the device's `numa_node` file; `None` where it says `-1` or is absent.
    pub numa_node: Option<u32>,
    /// The PCI host bridge (root complex) above the device, `pci0000:15`.
    pub host_bridge: Option<String>,
    /// The PCI bridges between the host bridge and the device, root port first.
    pub pci_path: Vec<String>,
}

/// What kind of RDMA device a [`Nic`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NicKind {
    /// A hardware verbs NIC: ConnectX (`mlx5_*`), or any other on the PCI bus.
    Verbs,
    /// AWS Elastic Fabric Adapter (driver `efa`, or PCI vendor `0x1d0f`).
    Efa,
    /// A software device over an Ethernet netdev (Soft-RoCE `rxe`, `siw`): no PCI device
    /// of its own.
    Software,
}

impl fmt::Display for NicKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NicKind::Verbs => "verbs",
            NicKind::Efa => "efa",
            NicKind::Software => "software",
        })
    }
}

/// One port of a [`Nic`], from `ports/N/*`. Fields are `None` where the file is absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPort {
    /// Port number (1 for most devices).
    pub port: u32,
    /// Port state without its number: `ACTIVE`, `DOWN`, ...
    pub state: Option<String>,
    /// `InfiniBand`, `Ethernet` (RoCE) or `Unspecified` (EFA).
    pub link_layer: Option<String>,
    /// Link rate as the kernel prints it: `400 Gb/sec (4X NDR)`.
    pub rate: Option<String>,
}

/// An RDMA device from `/sys/class/infiniband`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// The device name verbs and libfabric use: `mlx5_0`, `rdmap16s27`, `rxe0`.
    pub name: String,
    /// Hardware verbs, EFA or software.
    pub kind: NicKind,
    /// PCI address, if the device is a PCI function.
    pub pci: Option<String>,
    /// NUMA node of its PCI device; `None` where unknown or for software devices.
    pub numa_node: Option<u32>,
    /// The PCI host bridge above the device.
    pub host_bridge: Option<String>,
    /// The PCI bridges between the host bridge and the device, root port first.
    pub pci_path: Vec<String>,
    /// The Ethernet/IPoIB netdev: `parent` (rxe), the PCI device's `net/` entry, or the GID
    /// table's first netdev.
    pub netdev: Option<String>,
    /// Its ports, in port order.
    pub ports: Vec<NicPort>,
}

/// A NUMA node and its CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// The `N` of `/sys/devices/system/node/nodeN`.
    pub id: u32,
    /// Every CPU (hardware thread) of the node, ascending.
    pub cpus: Vec<u32>,
    /// One CPU per physical core: the lowest-numbered SMT sibling of each core, ascending.
    pub cores: Vec<u32>,
}

/// GPUs and NICs behind one PCIe root port: a PCIe switch (or one device directly on the
/// port). Devices without any PCI bridge above them belong to no group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchGroup {
    /// The root port (first bridge below the host bridge) that the switch hangs from.
    pub root_port: String,
    /// The host bridge above it.
    pub host_bridge: Option<String>,
    /// NUMA node of its devices (the first one that knows).
    pub numa_node: Option<u32>,
    /// GPU indices, in PCI order.
    pub gpus: Vec<usize>,
    /// NIC names, in PCI order.
    pub nics: Vec<String>,
}

/// How close a GPU and a NIC are on the PCIe fabric, closest first (the order derives
/// `Ord`: `Switch < HostBridge < NumaNode < System`). Compare `nvidia-smi topo -m`'s PIX/PXB,
/// PHB, NODE and SYS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Affinity {
    /// They share a PCIe bridge: traffic stays inside the switch, peer to peer.
    Switch,
    /// Same host bridge (root complex), different root ports.
    HostBridge,
    /// Different host bridges of one NUMA node.
    NumaNode,
    /// Across sockets, or unknown (software devices, `numa_node` of `-1`).
    System,
}

impl fmt::Display for Affinity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Affinity::Switch => "switch",
            Affinity::HostBridge => "host-bridge",
            Affinity::NumaNode => "numa",
            Affinity::System => "system",
        })
    }
}

/// What a GPU's engine should use: its NICs, where its threads should run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPlan {
    /// The GPU's [`Gpu::index`].
    pub gpu: usize,
    /// The GPU's PCI address.
    pub pci: String,
    /// NIC names to open, in PCI order (or as an override lists them). Empty where the
    /// machine has no RDMA NIC.
    pub nics: Vec<String>,
    /// The farthest [`Affinity`] between the GPU and its NICs; `None` without NICs.
    pub affinity: Option<Affinity>,
    /// NUMA node whose CPUs the plan uses; `None` where unknown (then all CPUs are used).
    pub numa_node: Option<u32>,
    /// CPUs (hardware threads) to run the GPU's threads on: the NUMA node's, within the
    /// process's allowed CPUs.
    pub cpus: Vec<u32>,
    /// One CPU per physical core of `cpus`.
    pub cores: Vec<u32>,
    /// Where to pin the reactor thread: one of `cores`, distinct from other GPUs' where
    /// there are enough. `None` if there is no core.
    pub reactor_core: Option<u32>,
    /// Whether a [`TopologyOverride`] changed anything in this plan.
    pub overridden: bool,
}

/// The GPUs, RDMA NICs and NUMA nodes of a machine, and a [`GpuPlan`] per GPU.
///
/// ```no_run
/// # fn main() -> fabric_runtime::Result<()> {
/// use fabric_runtime::topology::Topology;
///
/// let topo = Topology::detect_with_env()?; // sysfs, then FABRIC_TOPOLOGY on top
/// if let Some(plan) = topo.plan(0) {
///     println!("GPU0 uses {:?}, reactor on CPU {:?}", plan.nics, plan.reactor_core);
/// }
/// println!("{topo}");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    root: PathBuf,
    gpus: Vec<Gpu>,
    nics: Vec<Nic>,
    nodes: Vec<NumaNode>,
    groups: Vec<SwitchGroup>,
    online_cpus: Vec<u32>,
    /// CPU → the representative CPU of its physical core.
    core_of: BTreeMap<u32, u32>,
    allowed_cpus: Option<Vec<u32>>,
    overrides: BTreeMap<usize, GpuOverride>,
    plans: Vec<GpuPlan>,
}

impl Topology {
    /// Detects the topology of this machine from `/sys`, restricted to the CPUs this
    /// process may run on (`Cpus_allowed_list` of `/proc/self/status`, where readable).
    pub fn detect() -> Result<Topology> {
        let mut topo = Topology::from_sysfs(Path::new("/"))?;
        if let Some(allowed) = process_allowed_cpus() {
            topo.restrict_cpus(&allowed);
        }
        Ok(topo)
    }

    /// [`Topology::detect`], then the [`TopologyOverride`] in the [`OVERRIDE_ENV`]
    /// environment variable if it is set and not blank.
    pub fn detect_with_env() -> Result<Topology> {
        let mut topo = Topology::detect()?;
        match std::env::var(OVERRIDE_ENV) {
            Ok(spec) if !spec.trim().is_empty() => topo.apply_override(&spec.parse()?)?,
            Ok(_) | Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(Error::TopologyOverride {
                    token: v.to_string_lossy().into_owned(),
                    reason: format!("{OVERRIDE_ENV} is not valid UTF-8"),
                })
            }
        }
        Ok(topo)
    }

    /// Reads the topology from a sysfs tree rooted at `root` (`root/sys/bus/pci/...`);
    /// `/` for this machine. Missing directories mean "none of those" (a machine without
    /// RDMA NICs has no `/sys/class/infiniband`); files that exist but cannot be read or
    /// parsed are an [`Error::Sysfs`] naming the file, and so is a `root` that is not a
    /// directory.
    pub fn from_sysfs(root: &Path) -> Result<Topology> {
        let sysfs = Sysfs::open(root)?;
        let gpus = sysfs.gpus()?;
        let nics = sysfs.nics()?;
        let nodes_cpus = sysfs.numa_nodes()?;
        let mut online_cpus = sysfs.online_cpus(&nodes_cpus)?;
        let mut all: BTreeSet<u32> = online_cpus.iter().copied().collect();
        all.extend(nodes_cpus.iter().flat_map(|(_, cpus)| cpus.iter().copied()));
        let core_of = sysfs.core_map(&all)?;
        online_cpus.sort_unstable();
        let nodes = nodes_cpus
            .into_iter()
            .map(|(id, cpus)| NumaNode { id, cores: physical_cores(&cpus, &core_of), cpus })
            .collect();
        let groups = switch_groups(&gpus, &nics);
        let mut topo = Topology {
            root: root.to_path_buf(),
            gpus,
            nics,
            nodes,
            groups,
            online_cpus,
            core_of,
            allowed_cpus: None,
            overrides: BTreeMap::new(),
            plans: Vec::new(),
        };
        topo.plans = topo.make_plans();
        Ok(topo)
    }

    /// The sysfs root this was read from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// NVIDIA GPUs, in PCI order (`gpus()[i].index == i`).
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// RDMA devices: PCI ones in PCI order, then software ones by name.
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// The NIC called `name`.
    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|n| n.name == name)
    }

    /// NUMA nodes by id. Empty on kernels without NUMA support.
    pub fn numa_nodes(&self) -> &[NumaNode] {
        &self.nodes
    }

    /// Online CPUs, ascending.
    pub fn online_cpus(&self) -> &[u32] {
        &self.online_cpus
    }

    /// One CPU per physical core among `cpus` (the first SMT sibling met of each core), in
    /// the order given.
    pub fn physical_cores(&self, cpus: &[u32]) -> Vec<u32> {
        physical_cores(cpus, &self.core_of)
    }

    /// The PCIe switch groups that hold a GPU or a NIC, in PCI order of their root ports.
    pub fn groups(&self) -> &[SwitchGroup] {
        &self.groups
    }

    /// The GPU at PCI address `pci`, in any spelling (`0000:1B:00.0`, `00000000:1b:00.0` as
    /// `nvidia-smi` prints it, `1b:00.0`); for mapping a CUDA device (`cudaDeviceGetPCIBusId`)
    /// to its plan.
    pub fn gpu_by_pci(&self, pci: &str) -> Option<&Gpu> {
        let want = parse_bdf(pci)?;
        self.gpus.iter().find(|g| parse_bdf(&g.pci) == Some(want))
    }

    /// How close GPU `gpu` and NIC `nic` are; `None` if either is unknown.
    pub fn affinity(&self, gpu: usize, nic: &str) -> Option<Affinity> {
        Some(affinity(self.gpus.get(gpu)?, self.nic(nic)?).0)
    }

    /// The plan for GPU `gpu` (its [`Gpu::index`]).
    pub fn plan(&self, gpu: usize) -> Option<&GpuPlan> {
        self.plans.get(gpu)
    }

    /// The plans of all GPUs, by GPU index. Empty without GPUs.
    pub fn plans(&self) -> &[GpuPlan] {
        &self.plans
    }

    /// CPUs the plans are restricted to, if [`Topology::restrict_cpus`] was called.
    pub fn allowed_cpus(&self) -> Option<&[u32]> {
        self.allowed_cpus.as_deref()
    }

    /// Restricts the plans' CPUs to `allowed` (a container's cpuset, `taskset`): each plan
    /// keeps the allowed CPUs of its NUMA node, or, where the node has none, all allowed
    /// CPUs. An `allowed` with no online CPU in it is ignored. [`Topology::detect`] does this
    /// with the process's own affinity.
    pub fn restrict_cpus(&mut self, allowed: &[u32]) {
        let online: BTreeSet<u32> = self.online_cpus.iter().copied().collect();
        let mut allowed: Vec<u32> = allowed.iter().copied().filter(|c| online.contains(c)).collect();
        allowed.sort_unstable();
        allowed.dedup();
        self.allowed_cpus =
            if allowed.is_empty() || allowed == self.online_cpus { None } else { Some(allowed) };
        self.plans = self.make_plans();
    }

    /// Applies `ov` on top of detection: for each GPU it names, its NICs, NUMA node, cores
    /// or reactor core are replaced. Everything is checked first (the GPUs, NICs, NUMA nodes
    /// and CPUs must exist here); on error nothing changes. Later overrides of the same field
    /// replace earlier ones.
    pub fn apply_override(&mut self, ov: &TopologyOverride) -> Result<()> {
        let bad = |token: String, reason: String| Error::TopologyOverride { token, reason };
        let online: BTreeSet<u32> = self.online_cpus.iter().copied().collect();
        let check_cpu = |cpu: u32, token: &dyn Fn() -> String| -> Result<()> {
            if online.is_empty() || online.contains(&cpu) {
                Ok(())
            } else {
                Err(bad(
                    token(),
                    format!("CPU {cpu} is not online here (online: {})", CpuList(&self.online_cpus)),
                ))
            }
        };
        for e in &ov.entries {
            if e.gpu >= self.gpus.len() {
                return Err(bad(
                    e.gpu.to_string(),
                    format!("no GPU {} here ({} GPUs detected)", e.gpu, self.gpus.len()),
                ));
            }
            for name in e.nics.iter().flatten() {
                if self.nic(name).is_none() {
                    let known: Vec<&str> = self.nics.iter().map(|n| n.name.as_str()).collect();
                    let known = if known.is_empty() { "none".to_string() } else { known.join(", ") };
                    return Err(bad(
                        name.clone(),
                        format!("no RDMA device of that name (detected: {known})"),
                    ));
                }
            }
            if let Some(node) = e.numa_node {
                if !self.nodes.iter().any(|n| n.id == node) {
                    let ids: Vec<String> = self.nodes.iter().map(|n| n.id.to_string()).collect();
                    return Err(bad(
                        format!("numa:{node}"),
                        format!("no NUMA node {node} here (nodes: {})", ids.join(",")),
                    ));
                }
            }
            for &cpu in e.cores.iter().flatten() {
                let cores = e.cores.as_deref().unwrap_or_default();
                check_cpu(cpu, &|| format!("cores:{}", CpuList(cores)))?;
            }
            if let Some(cpu) = e.reactor_core {
                check_cpu(cpu, &|| format!("reactor:{cpu}"))?;
            }
        }
        for e in &ov.entries {
            let cur = self.overrides.entry(e.gpu).or_insert_with(|| GpuOverride::new(e.gpu));
            if e.nics.is_some() {
                cur.nics.clone_from(&e.nics);
            }
            if e.numa_node.is_some() {
                cur.numa_node = e.numa_node;
            }
            if e.cores.is_some() {
                cur.cores.clone_from(&e.cores);
            }
            if e.reactor_core.is_some() {
                cur.reactor_core = e.reactor_core;
            }
        }
        self.plans = self.make_plans();
        Ok(())
    }

    /// The overrides applied so far, merged per GPU.
    pub fn overrides(&self) -> TopologyOverride {
        TopologyOverride { entries: self.overrides.values().cloned().collect() }
    }
}
