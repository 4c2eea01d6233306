//! Reading the machine: NVIDIA GPUs on the PCI bus, RDMA devices in the `infiniband`
//! class, NUMA nodes, online CPUs and SMT siblings from a sysfs tree, and the process's
//! allowed CPUs from `/proc/self/status`. The only file of the topology module that
//! touches the file system; the others work on what this returns.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::cpulist::parse_cpulist;
use super::{Gpu, Nic, NicKind, NicPort};
use crate::error::{Error, Result};

const NVIDIA_VENDOR: u32 = 0x10de;
const AMAZON_VENDOR: u32 = 0x1d0f;
/// PCI classes of GPUs: VGA controller and 3D controller (the class file holds
/// class, subclass and programming interface; these are the top 16 bits).
const GPU_CLASSES: [u32; 2] = [0x0300, 0x0302];

/// A PCI address as numbers: (domain, bus, device, function).
pub(super) type Bdf = (u32, u8, u8, u8);

/// Parses `DDDD:BB:DD.F` (any domain width, any case) or `BB:DD.F` (domain 0).
pub(super) fn parse_bdf(s: &str) -> Option<Bdf> {
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

pub(super) struct Sysfs {
    root: PathBuf,
    /// `root`, canonical, so device paths can be taken apart relative to it.
    canon_root: PathBuf,
}

impl Sysfs {
    /// The tree at `root`; an [`Error::Sysfs`] if `root` is not a directory.
    pub(super) fn open(root: &Path) -> Result<Sysfs> {
        match fs::metadata(root) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(sysfs_err(root, "not a directory")),
            Err(e) => return Err(sysfs_err(root, e)),
        }
        let canon_root = fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        Ok(Sysfs { root: root.to_path_buf(), canon_root })
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

    pub(super) fn gpus(&self) -> Result<Vec<Gpu>> {
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

    pub(super) fn nics(&self) -> Result<Vec<Nic>> {
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
    pub(super) fn numa_nodes(&self) -> Result<Vec<(u32, Vec<u32>)>> {
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
    pub(super) fn online_cpus(&self, nodes: &[(u32, Vec<u32>)]) -> Result<Vec<u32>> {
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
    pub(super) fn core_map(&self, cpus: &BTreeSet<u32>) -> Result<BTreeMap<u32, u32>> {
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

/// `Cpus_allowed_list` of `/proc/self/status`, where readable.
pub(super) fn process_allowed_cpus() -> Option<Vec<u32>> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    parse_cpulist(list.trim()).ok()
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
}
