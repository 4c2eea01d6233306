//! Planning: which NICs, CPUs and reactor core each GPU gets, from what `sysfs` read, the
//! allowed CPUs and the overrides (the rules are in `docs/topology.md`). Plain functions of
//! the detected devices, with no I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::sysfs::{parse_bdf, Bdf};
use super::{Affinity, Gpu, GpuPlan, Nic, NicKind, SwitchGroup, Topology};

impl Topology {
    /// The plan of every GPU from detection, the allowed CPUs and the overrides; called
    /// again whenever one of those changes.
    pub(super) fn make_plans(&self) -> Vec<GpuPlan> {
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
pub(super) fn affinity(gpu: &Gpu, nic: &Nic) -> (Affinity, usize) {
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

/// The PCIe switch groups (devices under one root port) that hold a GPU or a NIC, in PCI
/// order of their root ports.
pub(super) fn switch_groups(gpus: &[Gpu], nics: &[Nic]) -> Vec<SwitchGroup> {
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

/// One CPU per physical core among `cpus` (the first SMT sibling met of each core, by
/// `core_of`), in the order given.
pub(super) fn physical_cores(cpus: &[u32], core_of: &BTreeMap<u32, u32>) -> Vec<u32> {
    let mut seen = BTreeSet::new();
    cpus.iter().copied().filter(|c| seen.insert(core_of.get(c).copied().unwrap_or(*c))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_shares() {
        let nics = [10, 11, 12, 13, 14];
        assert_eq!(even_share(&nics, 2, 0), vec![10, 11, 12]);
        assert_eq!(even_share(&nics, 2, 1), vec![13, 14]);
        assert_eq!(even_share(&nics[..1], 2, 1), vec![10]);
        assert_eq!(even_share(&nics[..2], 4, 3), vec![11]);
    }
}
