//! The kernel's CPU list format (`0-55,112-167`): parsed from sysfs, `/proc` and
//! overrides, and written back in overrides and the summary.

use std::collections::BTreeSet;
use std::fmt;

/// CPU numbers at or above this are refused in CPU lists (Linux's NR_CPUS tops out at 8192).
pub(super) const MAX_CPU: u32 = 1 << 16;

/// Parses a kernel CPU list (`0-55,112-167`; empty is no CPU).
pub(super) fn parse_cpulist(s: &str) -> std::result::Result<Vec<u32>, String> {
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
pub(super) struct CpuList<'a>(pub(super) &'a [u32]);

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
