//! [`TopologyOverride`]: per-GPU replacements for what detection chose, from the
//! [`OVERRIDE_ENV`] variable or code; parsed ([`FromStr`]) and printed ([`fmt::Display`])
//! here, checked against the machine and applied by
//! [`Topology::apply_override`](super::Topology::apply_override).

use std::fmt;
use std::str::FromStr;

use super::cpulist::{parse_cpulist, CpuList, MAX_CPU};
use crate::error::{Error, Result};

/// The environment variable that [`Topology::detect_with_env`] reads a
/// [`TopologyOverride`] from.
///
/// [`Topology::detect_with_env`]: super::Topology::detect_with_env
pub const OVERRIDE_ENV: &str = "FABRIC_TOPOLOGY";

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
///
/// [`Topology::apply_override`]: super::Topology::apply_override
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
