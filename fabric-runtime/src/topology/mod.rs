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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::{Error, Result};

/// The environment variable that [`Topology::detect_with_env`] reads a
/// [`TopologyOverride`] from.
pub const OVERRIDE_ENV: &str = "FABRIC_TOPOLOGY";

const NVIDIA_VENDOR: u32 = 0x10de;
const AMAZON_VENDOR: u32 = 0x1d0f;
/// PCI classes of GPUs: VGA controller and 3D controller (the class file holds
/// class, subclass and programming interface; these are the top 16 bits).
const GPU_CLASSES: [u32; 2] = [0x0300, 0x0302];
/// CPU numbers at or above this are refused in CPU lists (Linux's NR_CPUS tops out at 8192).
const MAX_CPU: u32 = 1 << 16;

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
        match fs::metadata(root) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(sysfs_err(root, "not a directory")),
            Err(e) => return Err(sysfs_err(root, e)),
        }
        let sysfs = Sysfs::new(root);
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

    fn make_plans(&self) -> Vec<GpuPlan> {
        let assigned = assign_nics(&self.gpus, &self.nics);
        let allowed: Option<BTreeSet<u32>> = self.allowed_cpus.as_ref().map(|a| a.iter().copied().collect());
        let mut plans: Vec<GpuPlan> = self
            .gpus
            .iter()
            .zip(assigned)
            .map(|(gpu, nics)| {
                let ov = self.overrides.get(&gpu.index);
                let nics = match ov.and_then(|o| o.nics.clone()) {
                    Some(names) => names
                        .iter()
                        .filter_map(|name| self.nics.iter().position(|n| &n.name == name))
                        .collect(),
                    None => nics,
                };
                let numa_node = ov.and_then(|o| o.numa_node).or(gpu.numa_node);
                let (cpus, cores) = match ov.and_then(|o| o.cores.clone()) {
                    Some(cores) => (cores.clone(), cores),
                    None => {
                        let node_cpus = numa_node
                            .and_then(|id| self.nodes.iter().find(|n| n.id == id))
                            .map_or(&self.online_cpus, |n| &n.cpus);
                        let cpus = match &allowed {
                            None => node_cpus.clone(),
                            Some(allowed) => {
                                let mine: Vec<u32> =
                                    node_cpus.iter().copied().filter(|c| allowed.contains(c)).collect();
                                if mine.is_empty() {
                                    allowed.iter().copied().collect()
                                } else {
                                    mine
                                }
                            }
                        };
                        let cores = physical_cores(&cpus, &self.core_of);
                        (cpus, cores)
                    }
                };
                GpuPlan {
                    gpu: gpu.index,
                    pci: gpu.pci.clone(),
                    affinity: nics.iter().map(|&n| affinity(gpu, &self.nics[n]).0).max(),
                    nics: nics.iter().map(|&n| self.nics[n].name.clone()).collect(),
                    numa_node,
                    cpus,
                    cores,
                    reactor_core: ov.and_then(|o| o.reactor_core),
                    overridden: ov.is_some(),
                }
            })
            .collect();
        pick_reactor_cores(&mut plans);
        plans
    }
}

/// Gives each plan without an explicit reactor core the least-used of its cores, the
/// highest-numbered first (CPU 0 and the low cores take most interrupts and housekeeping,
/// and thread pools usually fill them first). Explicit choices count as uses.
fn pick_reactor_cores(plans: &mut [GpuPlan]) {
    let mut uses: HashMap<u32, usize> = HashMap::new();
    for p in plans.iter() {
        if let Some(c) = p.reactor_core {
            *uses.entry(c).or_default() += 1;
        }
    }
    for p in plans.iter_mut().filter(|p| p.reactor_core.is_none()) {
        // `min_by_key` keeps the first minimum, so walk the cores from the highest.
        let pick = p.cores.iter().rev().copied().min_by_key(|c| uses.get(c).copied().unwrap_or(0));
        if let Some(c) = pick {
            *uses.entry(c).or_default() += 1;
        }
        p.reactor_core = pick;
    }
}

/// The affinity of two PCI devices, and how many bridges they share (deeper = closer).
fn affinity(gpu: &Gpu, nic: &Nic) -> (Affinity, usize) {
    if let (Some(a), Some(b)) = (&gpu.host_bridge, &nic.host_bridge) {
        if a == b {
            let shared = gpu.pci_path.iter().zip(&nic.pci_path).take_while(|(x, y)| x == y).count();
            return if shared > 0 { (Affinity::Switch, shared) } else { (Affinity::HostBridge, 0) };
        }
    }
    match (gpu.numa_node, nic.numa_node) {
        (Some(a), Some(b)) if a == b => (Affinity::NumaNode, 0),
        _ => (Affinity::System, 0),
    }
}

/// NIC indices per GPU (see `docs/topology.md`, "Assignment"):
/// 1. each GPU's candidates are the hardware NICs closest to it (the best [`Affinity`], and
///    under a switch the most shared bridges); software NICs only where there is no
///    hardware one;
/// 2. GPUs whose candidates are behind their own switch split them evenly in PCI order
///    among the GPUs with the same candidates (2 GPUs, 2 NICs: one each; 2 GPUs, 1 NIC:
///    they share it);
/// 3. the others (fallbacks), in GPU order, take `max(1, candidates / GPUs with the same
///    candidates)` of their candidates, the least loaded first.
fn assign_nics(gpus: &[Gpu], nics: &[Nic]) -> Vec<Vec<usize>> {
    let hardware: Vec<usize> = (0..nics.len()).filter(|&i| nics[i].kind != NicKind::Software).collect();
    let pool: Vec<usize> = if hardware.is_empty() { (0..nics.len()).collect() } else { hardware };
    // Per GPU: its candidates and how close they are (affinity, then more shared bridges).
    type Score = (Affinity, std::cmp::Reverse<usize>);
    let candidates: Vec<(Vec<usize>, Option<Score>)> = gpus
        .iter()
        .map(|g| {
            let scored: Vec<(usize, Score)> = pool
                .iter()
                .map(|&n| {
                    let (a, shared) = affinity(g, &nics[n]);
                    (n, (a, std::cmp::Reverse(shared)))
                })
                .collect();
            let best = scored.iter().map(|(_, s)| *s).min();
            (scored.iter().filter(|(_, s)| Some(*s) == best).map(|(n, _)| *n).collect(), best)
        })
        .collect();
    // GPUs with the same candidates at the same closeness share them.
    let mut sharing: HashMap<(&[usize], Option<Score>), Vec<usize>> = HashMap::new();
    for (g, (cands, score)) in candidates.iter().enumerate() {
        sharing.entry((cands.as_slice(), *score)).or_default().push(g);
    }
    let on_switch = |score: &Option<Score>| matches!(score, Some((Affinity::Switch, _)));
    let mut out = vec![Vec::new(); gpus.len()];
    let mut load = vec![0usize; nics.len()];
    for (g, (cands, score)) in candidates.iter().enumerate() {
        if !on_switch(score) {
            continue;
        }
        let peers = &sharing[&(cands.as_slice(), *score)];
        let rank = peers.iter().position(|&p| p == g).unwrap_or(0);
        let chosen = even_share(cands, peers.len(), rank);
        for &n in &chosen {
            load[n] += 1;
        }
        out[g] = chosen;
    }
    for (g, (cands, score)) in candidates.iter().enumerate() {
        if on_switch(score) || cands.is_empty() {
            continue;
        }
        let want = (cands.len() / sharing[&(cands.as_slice(), *score)].len()).max(1);
        let mut by_load = cands.clone();
        by_load.sort_by_key(|&n| load[n]); // stable: PCI order among equals
        let mut chosen: Vec<usize> = by_load.into_iter().take(want).collect();
        chosen.sort_unstable();
        for &n in &chosen {
            load[n] += 1;
        }
        out[g] = chosen;
    }
    out
}

/// The `rank`-th of `peers` GPUs' share of `nics`: contiguous slices in order, the first
/// ones one larger where it does not divide; with fewer NICs than GPUs, GPU `rank` gets
/// NIC `rank * nics / peers`.
fn even_share(nics: &[usize], peers: usize, rank: usize) -> Vec<usize> {
    let (n, p) = (nics.len(), peers.max(1));
    if n >= p {
        let (base, extra) = (n / p, n % p);
        let start = rank * base + rank.min(extra);
        let len = base + usize::from(rank < extra);
        nics[start..start + len].to_vec()
    } else {
        vec![nics[rank * n / p]]
    }
}

fn switch_groups(gpus: &[Gpu], nics: &[Nic]) -> Vec<SwitchGroup> {
    fn group<'a>(
        groups: &'a mut BTreeMap<Bdf, SwitchGroup>,
        path: &[String],
        host: &Option<String>,
        numa: Option<u32>,
    ) -> Option<&'a mut SwitchGroup> {
        let port = path.first()?;
        let g = groups.entry(parse_bdf(port)?).or_insert_with(|| SwitchGroup {
            root_port: port.clone(),
            host_bridge: host.clone(),
            numa_node: None,
            gpus: Vec::new(),
            nics: Vec::new(),
        });
        g.numa_node = g.numa_node.or(numa);
        Some(g)
    }
    let mut groups = BTreeMap::new();
    for gpu in gpus {
        if let Some(g) = group(&mut groups, &gpu.pci_path, &gpu.host_bridge, gpu.numa_node) {
            g.gpus.push(gpu.index);
        }
    }
    for nic in nics {
        if let Some(g) = group(&mut groups, &nic.pci_path, &nic.host_bridge, nic.numa_node) {
            g.nics.push(nic.name.clone());
        }
    }
    groups.into_values().collect()
}

fn physical_cores(cpus: &[u32], core_of: &BTreeMap<u32, u32>) -> Vec<u32> {
    let mut seen = BTreeSet::new();
    cpus.iter().copied().filter(|c| seen.insert(core_of.get(c).copied().unwrap_or(*c))).collect()
}

/// `Cpus_allowed_list` of `/proc/self/status`, where readable.
fn process_allowed_cpus() -> Option<Vec<u32>> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    parse_cpulist(list.trim()).ok()
}

// ---------------------------------------------------------------------------------------
// Reading sysfs
// ---------------------------------------------------------------------------------------

/// A PCI address as numbers: (domain, bus, device, function).
type Bdf = (u32, u8, u8, u8);

/// Parses `DDDD:BB:DD.F` (any domain width, any case) or `BB:DD.F` (domain 0).
fn parse_bdf(s: &str) -> Option<Bdf> {
    let (rest, func) = s.rsplit_once('.')?;
    let mut parts = rest.rsplit(':');
    let dev = parts.next()?;
    let bus = parts.next()?;
    let domain = parts.next().unwrap_or("0");
    if parts.next().is_some() || [domain, bus, dev, func].iter().any(|p| p.is_empty()) {
        return None;
    }
    let dev = u8::from_str_radix(dev, 16).ok().filter(|d| *d < 32)?;
    let func = u8::from_str_radix(func, 16).ok().filter(|f| *f < 8)?;
    Some((u32::from_str_radix(domain, 16).ok()?, u8::from_str_radix(bus, 16).ok()?, dev, func))
}

/// `pciDDDD:BB`: a host bridge's directory under `/sys/devices`.
fn is_host_bridge(s: &str) -> bool {
    s.strip_prefix("pci").and_then(|r| r.split_once(':')).is_some_and(|(d, b)| {
        !d.is_empty() && !b.is_empty() && d.chars().chain(b.chars()).all(|c| c.is_ascii_hexdigit())
    })
}

fn sysfs_err(path: &Path, message: impl fmt::Display) -> Error {
    Error::Sysfs { path: path.to_path_buf(), message: message.to_string() }
}

fn parse_hex(s: &str, path: &Path) -> Result<u32> {
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    u32::from_str_radix(digits, 16).map_err(|_| sysfs_err(path, format!("not a hex number: {s:?}")))
}

struct Sysfs {
    root: PathBuf,
    /// `root`, canonical, so device paths can be taken apart relative to it.
    canon_root: PathBuf,
}

impl Sysfs {
    fn new(root: &Path) -> Sysfs {
        let canon_root = fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        Sysfs { root: root.to_path_buf(), canon_root }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// The trimmed contents of a file; `None` if it does not exist.
    fn read_opt(&self, path: &Path) -> Result<Option<String>> {
        match fs::read(path) {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(s) => Ok(Some(s.trim().to_string())),
                Err(_) => Err(sysfs_err(path, "not UTF-8")),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(sysfs_err(path, e)),
        }
    }

    /// The trimmed contents of a file every device of its kind has.
    fn read_req(&self, path: &Path) -> Result<String> {
        self.read_opt(path)?.ok_or_else(|| sysfs_err(path, "missing"))
    }

    /// Entry names of a directory, sorted; empty if it does not exist.
    fn list(&self, dir: &Path) -> Result<Vec<String>> {
        let rd = match fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(sysfs_err(dir, e)),
        };
        let mut names = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| sysfs_err(dir, e))?;
            // Names that are not UTF-8 are no device this module looks for.
            if let Ok(name) = entry.file_name().into_string() {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    /// The canonical path of `path` (following the symlinks); `None` if it does not exist.
    fn canonical(&self, path: &Path) -> Result<Option<PathBuf>> {
        match fs::canonicalize(path) {
            Ok(p) => Ok(Some(p)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(sysfs_err(path, e)),
        }
    }

    /// Host bridge and bridge chain of a PCI device, from its canonical path
    /// (`/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0`).
    /// Components that are neither (a VMD domain, a Hyper-V bus) are skipped.
    fn pci_location(&self, canon: &Path) -> (Option<String>, Vec<String>) {
        let rel = canon.strip_prefix(&self.canon_root).unwrap_or(canon);
        let parts: Vec<String> = rel.iter().filter_map(|c| c.to_str().map(str::to_string)).collect();
        let Some(host) = parts.iter().position(|p| is_host_bridge(p)) else {
            return (None, Vec::new());
        };
        let below = &parts[host + 1..parts.len().saturating_sub(1).max(host + 1)];
        let bridges = below.iter().filter(|p| parse_bdf(p).is_some()).cloned().collect();
        (Some(parts[host].clone()), bridges)
    }

    fn numa_node(&self, file: &Path) -> Result<Option<u32>> {
        match self.read_opt(file)? {
            None => Ok(None),
            Some(s) => {
                let n: i64 = s.parse().map_err(|_| sysfs_err(file, format!("not a NUMA node: {s:?}")))?;
                Ok(u32::try_from(n).ok())
            }
        }
    }

    fn gpus(&self) -> Result<Vec<Gpu>> {
        let dir = self.path("sys/bus/pci/devices");
        let mut found: Vec<(Bdf, Gpu)> = Vec::new();
        for name in self.list(&dir)? {
            let Some(bdf) = parse_bdf(&name) else { continue };
            let dev = dir.join(&name);
            let vendor_file = dev.join("vendor");
            if parse_hex(&self.read_req(&vendor_file)?, &vendor_file)? != NVIDIA_VENDOR {
                continue;
            }
            let class_file = dev.join("class");
            if !GPU_CLASSES.contains(&(parse_hex(&self.read_req(&class_file)?, &class_file)? >> 8)) {
                continue; // NVSwitch (a bridge), the HDMI audio function, ...
            }
            let id_file = dev.join("device");
            let device_id = match self.read_opt(&id_file)? {
                Some(s) => Some(
                    u16::try_from(parse_hex(&s, &id_file)?).map_err(|_| sysfs_err(&id_file, "not 16-bit"))?,
                ),
                None => None,
            };
            let (host_bridge, pci_path) = match self.canonical(&dev)? {
                Some(canon) => self.pci_location(&canon),
                None => (None, Vec::new()),
            };
            let numa_node = self.numa_node(&dev.join("numa_node"))?;
            found.push((bdf, Gpu { index: 0, pci: name, device_id, numa_node, host_bridge, pci_path }));
        }
        found.sort_by_key(|a| a.0);
        Ok(found.into_iter().enumerate().map(|(index, (_, gpu))| Gpu { index, ..gpu }).collect())
    }

    fn nics(&self) -> Result<Vec<Nic>> {
        let dir = self.path("sys/class/infiniband");
        let mut found: Vec<(Option<Bdf>, Nic)> = Vec::new();
        for name in self.list(&dir)? {
            let ibdev = dir.join(&name);
            let link = ibdev.join("device");
            let canon = self.canonical(&link)?;
            // rxe has a `parent` attribute naming its netdev; rxe and siw are named so
            // by default. A software device can still have a `device` link (siw points at
            // its netdev's PCI function), so these come first.
            let parent = self.read_opt(&ibdev.join("parent"))?;
            let software =
                parent.is_some() || canon.is_none() || name.starts_with("rxe") || name.starts_with("siw");
            let (mut numa_node, mut host_bridge, mut pci_path, mut netdev) = (None, None, Vec::new(), parent);
            let mut pci = None;
            let kind = if software {
                NicKind::Software
            } else {
                let driver = match fs::read_link(link.join("driver")) {
                    Ok(p) => p.file_name().and_then(|n| n.to_str()).map(str::to_string),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                    Err(e) => return Err(sysfs_err(&link.join("driver"), e)),
                };
                let vendor_file = link.join("vendor");
                let vendor = match self.read_opt(&vendor_file)? {
                    Some(v) => Some(parse_hex(&v, &vendor_file)?),
                    None => None,
                };
                if let Some(canon) = &canon {
                    pci = canon.file_name().and_then(|n| n.to_str()).filter(|n| parse_bdf(n).is_some());
                    if pci.is_some() {
                        (host_bridge, pci_path) = self.pci_location(canon);
                    }
                }
                numa_node = self.numa_node(&link.join("numa_node"))?;
                netdev = self.list(&link.join("net"))?.into_iter().next();
                if driver.as_deref() == Some("efa") || vendor == Some(AMAZON_VENDOR) {
                    NicKind::Efa
                } else {
                    NicKind::Verbs
                }
            };
            let ports = self.ports(&ibdev.join("ports"))?;
            if netdev.is_none() {
                if let Some(p) = ports.first() {
                    // Reading an empty GID slot fails (EINVAL) on real systems: best effort.
                    let ndev = ibdev.join(format!("ports/{}/gid_attrs/ndevs/0", p.port));
                    netdev = self.read_opt(&ndev).ok().flatten().filter(|s| !s.is_empty());
                }
            }
            let key = pci.and_then(parse_bdf);
            let pci = pci.map(str::to_string);
            found.push((key, Nic { name, kind, pci, numa_node, host_bridge, pci_path, netdev, ports }));
        }
        // PCI devices in PCI order, then the others by name (`None` sorts first: flip it).
        found.sort_by(|a, b| (a.0.is_none(), a.0, &a.1.name).cmp(&(b.0.is_none(), b.0, &b.1.name)));
        Ok(found.into_iter().map(|(_, nic)| nic).collect())
    }

    fn ports(&self, dir: &Path) -> Result<Vec<NicPort>> {
        let mut ports = Vec::new();
        for name in self.list(dir)? {
            let Ok(port) = name.parse::<u32>() else { continue };
            let p = dir.join(&name);
            let state = self.read_opt(&p.join("state"))?;
            ports.push(NicPort {
                port,
                // "4: ACTIVE" → "ACTIVE"
                state: state.map(|s| s.split_once(": ").map_or(s.clone(), |(_, name)| name.to_string())),
                link_layer: self.read_opt(&p.join("link_layer"))?,
                rate: self.read_opt(&p.join("rate"))?,
            });
        }
        ports.sort_by_key(|p| p.port);
        Ok(ports)
    }

    /// `(id, cpus)` of each `nodeN` under `/sys/devices/system/node`, by id.
    fn numa_nodes(&self) -> Result<Vec<(u32, Vec<u32>)>> {
        let dir = self.path("sys/devices/system/node");
        let mut nodes = Vec::new();
        for name in self.list(&dir)? {
            let Some(id) = name.strip_prefix("node").and_then(|n| n.parse::<u32>().ok()) else { continue };
            let file = dir.join(&name).join("cpulist");
            let cpus = match self.read_opt(&file)? {
                Some(list) => parse_cpulist(&list).map_err(|e| sysfs_err(&file, e))?,
                None => Vec::new(),
            };
            nodes.push((id, cpus));
        }
        nodes.sort_by_key(|n| n.0);
        Ok(nodes)
    }

    /// `cpu/online`; else the NUMA nodes' CPUs; else the `cpuN` directories.
    fn online_cpus(&self, nodes: &[(u32, Vec<u32>)]) -> Result<Vec<u32>> {
        let file = self.path("sys/devices/system/cpu/online");
        if let Some(list) = self.read_opt(&file)? {
            return parse_cpulist(&list).map_err(|e| sysfs_err(&file, e));
        }
        let from_nodes: BTreeSet<u32> = nodes.iter().flat_map(|(_, c)| c.iter().copied()).collect();
        if !from_nodes.is_empty() {
            return Ok(from_nodes.into_iter().collect());
        }
        let mut cpus: Vec<u32> = self
            .list(&self.path("sys/devices/system/cpu"))?
            .iter()
            .filter_map(|n| n.strip_prefix("cpu")?.parse().ok())
            .collect();
        cpus.sort_unstable();
        Ok(cpus)
    }

    /// CPU → representative CPU of its core: the lowest of `thread_siblings_list`; else
    /// the first CPU met with the same `(physical_package_id, core_id)`; else itself.
    fn core_map(&self, cpus: &BTreeSet<u32>) -> Result<BTreeMap<u32, u32>> {
        let mut by_ids: HashMap<(String, String), u32> = HashMap::new();
        let mut map = BTreeMap::new();
        for &cpu in cpus {
            let topo = self.path(&format!("sys/devices/system/cpu/cpu{cpu}/topology"));
            let siblings_file = topo.join("thread_siblings_list");
            let rep = if let Some(list) = self.read_opt(&siblings_file)? {
                let siblings = parse_cpulist(&list).map_err(|e| sysfs_err(&siblings_file, e))?;
                siblings.into_iter().min().unwrap_or(cpu)
            } else if let (Some(pkg), Some(core)) =
                (self.read_opt(&topo.join("physical_package_id"))?, self.read_opt(&topo.join("core_id"))?)
            {
                *by_ids.entry((pkg, core)).or_insert(cpu)
            } else {
                cpu
            };
            map.insert(cpu, rep);
        }
        Ok(map)
    }
}

/// Parses a kernel CPU list (`0-55,112-167`; empty is no CPU).
fn parse_cpulist(s: &str) -> std::result::Result<Vec<u32>, String> {
    let mut cpus = BTreeSet::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let num = |t: &str| -> std::result::Result<u32, String> {
            t.trim()
                .parse::<u32>()
                .ok()
                .filter(|&c| c < MAX_CPU)
                .ok_or_else(|| format!("{item:?} is not a CPU number or range (N or N-M, N < {MAX_CPU})"))
        };
        match item.split_once('-') {
            None => {
                cpus.insert(num(item)?);
            }
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("{item:?} is a descending range"));
                }
                cpus.extend(a..=b);
            }
        }
    }
    Ok(cpus.into_iter().collect())
}

/// Formats CPUs as a kernel CPU list: `0-55,112-167`.
struct CpuList<'a>(&'a [u32]);

impl fmt::Display for CpuList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sorted = self.0.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut first = true;
        let mut i = 0;
        while i < sorted.len() {
            let start = sorted[i];
            while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
                i += 1;
            }
            f.write_str(if first { "" } else { "," })?;
            first = false;
            if sorted[i] == start {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{}", sorted[i])?;
            }
            i += 1;
        }
        if first {
            f.write_str("-")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Overrides
// ---------------------------------------------------------------------------------------

/// Per-GPU replacements for what detection chose, parsed from a string such as
/// `0=mlx5_0,mlx5_1;1=mlx5_2@cores:8-15@reactor:15;2=@numa:1`.
///
/// ```text
/// spec    := entry (';' entry)*             empty entries and blanks around tokens are ignored
/// entry   := GPU '=' [nics] ('@' attr)*      GPU: the GPU's index
/// nics    := NAME (',' NAME)*               RDMA device names, replacing the detected ones
/// attr    := 'numa:' N                      use NUMA node N's CPUs
///          | 'cores:' CPULIST               use exactly these CPUs as cores (0-3,8,10-11)
///          | 'reactor:' CPU                 pin the reactor here
/// ```
///
/// An entry must change something; a GPU may appear once, and each attribute once per
/// entry. Parse errors ([`Error::TopologyOverride`]) name the offending token;
/// [`Topology::apply_override`] then checks that the GPUs, NICs, nodes and CPUs exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopologyOverride {
    /// One entry per GPU, in the order written.
    pub entries: Vec<GpuOverride>,
}

/// The overrides for one GPU; `None` fields keep what detection chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuOverride {
    /// The GPU's index.
    pub gpu: usize,
    /// NIC names to use instead of the detected ones.
    pub nics: Option<Vec<String>>,
    /// NUMA node whose CPUs to use.
    pub numa_node: Option<u32>,
    /// CPUs to use as the GPU's cores, exactly as given.
    pub cores: Option<Vec<u32>>,
    /// The reactor's CPU.
    pub reactor_core: Option<u32>,
}

impl GpuOverride {
    /// An override of GPU `gpu` that changes nothing yet.
    pub fn new(gpu: usize) -> GpuOverride {
        GpuOverride { gpu, nics: None, numa_node: None, cores: None, reactor_core: None }
    }
}

impl FromStr for TopologyOverride {
    type Err = Error;

    fn from_str(spec: &str) -> Result<TopologyOverride> {
        let bad = |token: &str, reason: &str| Error::TopologyOverride {
            token: token.to_string(),
            reason: reason.to_string(),
        };
        let mut entries: Vec<GpuOverride> = Vec::new();
        for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((gpu_tok, rest)) = entry.split_once('=') else {
                return Err(bad(entry, "expected GPU=NICS[@ATTR...], e.g. 0=mlx5_0,mlx5_1@cores:0-7"));
            };
            let gpu_tok = gpu_tok.trim();
            let gpu: usize = gpu_tok.parse().map_err(|_| bad(gpu_tok, "GPU index must be a number"))?;
            if entries.iter().any(|e| e.gpu == gpu) {
                return Err(bad(gpu_tok, "this GPU already has an entry"));
            }
            let mut ov = GpuOverride::new(gpu);
            let mut parts = rest.split('@');
            let nics_tok = parts.next().unwrap_or_default().trim();
            if !nics_tok.is_empty() {
                let mut nics = Vec::new();
                for name in nics_tok.split(',').map(str::trim) {
                    let valid = !name.is_empty()
                        && name.len() <= 64
                        && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
                    if !valid {
                        return Err(bad(name, "not a NIC name (letters, digits, '_', '-', '.')"));
                    }
                    if nics.iter().any(|n| n == name) {
                        return Err(bad(name, "NIC listed twice"));
                    }
                    nics.push(name.to_string());
                }
                ov.nics = Some(nics);
            }
            for attr in parts.map(str::trim) {
                let Some((key, value)) = attr.split_once(':') else {
                    return Err(bad(attr, "expected numa:N, cores:CPULIST or reactor:CPU"));
                };
                let value = value.trim();
                let number = || -> Result<u32> {
                    value
                        .parse::<u32>()
                        .ok()
                        .filter(|&v| v < MAX_CPU)
                        .ok_or_else(|| bad(attr, "expected a number"))
                };
                let dup = match key.trim() {
                    "numa" => ov.numa_node.replace(number()?).is_some(),
                    "reactor" => ov.reactor_core.replace(number()?).is_some(),
                    "cores" => {
                        let cpus = parse_cpulist(value).map_err(|reason| bad(attr, &reason))?;
                        if cpus.is_empty() {
                            return Err(bad(attr, "empty CPU list"));
                        }
                        ov.cores.replace(cpus).is_some()
                    }
                    _ => return Err(bad(attr, "unknown attribute: expected numa:, cores: or reactor:")),
                };
                if dup {
                    return Err(bad(attr, "attribute given twice for this GPU"));
                }
            }
            if ov == GpuOverride::new(gpu) {
                return Err(bad(entry, "overrides nothing"));
            }
            entries.push(ov);
        }
        Ok(TopologyOverride { entries })
    }
}

impl fmt::Display for TopologyOverride {
    /// The canonical spelling, which parses back to the same value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.entries.iter().enumerate() {
            write!(f, "{}{}=", if i > 0 { ";" } else { "" }, e.gpu)?;
            if let Some(nics) = &e.nics {
                f.write_str(&nics.join(","))?;
            }
            if let Some(n) = e.numa_node {
                write!(f, "@numa:{n}")?;
            }
            if let Some(c) = &e.cores {
                write!(f, "@cores:{}", CpuList(c))?;
            }
            if let Some(r) = e.reactor_core {
                write!(f, "@reactor:{r}")?;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Display
// ---------------------------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_spellings() {
        assert_eq!(parse_bdf("0000:18:00.0"), Some((0, 0x18, 0, 0)));
        assert_eq!(parse_bdf("00000000:1B:00.1"), Some((0, 0x1b, 0, 1)));
        assert_eq!(parse_bdf("1b:00.0"), Some((0, 0x1b, 0, 0)));
        assert_eq!(parse_bdf("10000:e0:1d.0"), Some((0x10000, 0xe0, 0x1d, 0)));
        for bad in ["", "pci0000:00", "0000:18:00", "0000:18:20.0", "0000:18:00.8", "x:18:00.0", "a:b:c:d.0"]
        {
            assert_eq!(parse_bdf(bad), None, "{bad}");
        }
        assert!(is_host_bridge("pci0000:15") && is_host_bridge("pci10000:e0"));
        assert!(!is_host_bridge("pci_bus") && !is_host_bridge("pci0000:") && !is_host_bridge("0000:15:01.0"));
    }

    #[test]
    fn cpulists() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n").unwrap(), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist("").unwrap(), Vec::<u32>::new());
        assert!(parse_cpulist("3-1").is_err());
        assert!(parse_cpulist("0-4294967295").is_err());
        assert!(parse_cpulist("a").is_err());
        assert_eq!(CpuList(&[0, 1, 2, 3, 8, 10, 11]).to_string(), "0-3,8,10-11");
        assert_eq!(CpuList(&[]).to_string(), "-");
    }

    #[test]
    fn even_shares() {
        let nics = [10, 11, 12, 13, 14];
        assert_eq!(even_share(&nics, 2, 0), vec![10, 11, 12]);
        assert_eq!(even_share(&nics, 2, 1), vec![13, 14]);
        assert_eq!(even_share(&nics[..1], 2, 1), vec![10]);
        assert_eq!(even_share(&nics[..2], 4, 3), vec![11]);
    }
}
