//! `--buffer hot|cold`: where bw's writes go, the same for the engine and the raw loop.
//!
//! ```text
//! hot:  every write  [0, size) of the source  ->  [0, size) of the target  (as fi_rma_bw does)
//! cold: write i      [o, o + size)            ->  [o, o + size),  o = (i mod slots) x size,
//!       slots = region / size, region = max(4 x LLC, window x largest size), capped
//! ```
//!
//! Pure: the last-level cache size is read from sysfs by [`llc_bytes`] and passed in.

use std::fmt;

/// LLC size assumed when sysfs does not say (`/sys/devices/system/cpu/cpu0/cache`).
pub const LLC_FALLBACK: usize = 32 << 20;

/// The access pattern of a bw point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// Every write from offset 0 of the source to offset 0 of the target: `size` bytes that
    /// stay in cache (fabtests' `fi_rma_bw` writes its one `tx_buf` to one remote address).
    Hot,
    /// Writes swept sequentially over a region several times the last-level cache.
    Cold,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Hot => "hot",
            Pattern::Cold => "cold",
        }
    }

    /// Offset (both sides) of write number `i` of `size` bytes in a region of `region` bytes.
    pub fn offset(self, i: u64, size: usize, region: usize) -> usize {
        match self {
            Pattern::Hot => 0,
            Pattern::Cold if size == 0 => 0,
            Pattern::Cold => {
                let slots = (region / size).max(1) as u64;
                (i % slots) as usize * size
            }
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `hot`, `cold`, `hot,cold` (duplicates dropped, order kept).
pub fn parse_list(s: &str) -> Result<Vec<Pattern>, String> {
    let mut v = Vec::new();
    for w in s.split(',') {
        let p = match w.trim() {
            "hot" => Pattern::Hot,
            "cold" => Pattern::Cold,
            other => return Err(format!("{other:?}: expected hot, cold or hot,cold")),
        };
        if !v.contains(&p) {
            v.push(p);
        }
    }
    Ok(v)
}

/// The least bw registers per side: 4 MiB, so that engine and raw loop memory is in huge
/// pages at every size with `--huge-pages on` (the engine gives them to regions from 2 MiB),
/// and in small pages with `off`: a hot sweep up to 1 MiB is not silently in small pages.
pub const REGION_FLOOR: usize = 4 << 20;

/// Bytes per side that bw registers: the largest size for `hot` alone; for `cold`,
/// max(4 x `llc`, `window` x largest size), at most `cap` (but never below the largest
/// size, nor below [`REGION_FLOOR`]).
pub fn region_len(patterns: &[Pattern], llc: usize, window: usize, max_size: usize, cap: usize) -> usize {
    let floor = max_size.max(REGION_FLOOR);
    if !patterns.contains(&Pattern::Cold) {
        return floor;
    }
    (4 * llc).max(window.saturating_mul(max_size)).min(cap).max(floor)
}

/// The cap of [`region_len`]: 256 MiB, or 4 x LLC up to 1 GiB where the LLC is larger than
/// 64 MiB (verbs: 64 MiB, the test VM has 2 GiB for both processes).
pub fn region_cap(llc: usize, verbs: bool) -> usize {
    if verbs {
        64 << 20
    } else {
        (256usize << 20).max(4 * llc).min(1 << 30)
    }
}

/// The largest level-3 cache of cpu0 in sysfs, or [`LLC_FALLBACK`].
pub fn llc_bytes() -> usize {
    let mut best = None;
    if let Ok(dir) = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache") {
        for e in dir.flatten() {
            let p = e.path();
            let level = std::fs::read_to_string(p.join("level")).unwrap_or_default();
            if level.trim() != "3" {
                continue;
            }
            if let Some(n) =
                std::fs::read_to_string(p.join("size")).ok().as_deref().and_then(parse_cache_size)
            {
                best = Some(best.unwrap_or(0).max(n));
            }
        }
    }
    best.unwrap_or(LLC_FALLBACK)
}

/// sysfs cache sizes: `32768K`, `512K`, `1M`, `65536`.
pub fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|n| n * mul).filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse() {
        assert_eq!(parse_list("hot").unwrap(), [Pattern::Hot]);
        assert_eq!(parse_list("cold,hot").unwrap(), [Pattern::Cold, Pattern::Hot]);
        assert_eq!(parse_list("hot,hot").unwrap(), [Pattern::Hot]);
        assert!(parse_list("warm").is_err());
        assert!(parse_list("hot,").is_err());
    }

    #[test]
    fn offsets() {
        let region = 4 << 20;
        for i in [0, 1, 7, 1000] {
            assert_eq!(Pattern::Hot.offset(i, 1 << 20, region), 0);
        }
        let cold: Vec<usize> = (0..6).map(|i| Pattern::Cold.offset(i, 1 << 20, region)).collect();
        assert_eq!(cold, [0, 1 << 20, 2 << 20, 3 << 20, 0, 1 << 20]);
        // A size that does not divide the region: every write stays inside it.
        for i in 0..100 {
            let o = Pattern::Cold.offset(i, 3 << 20, region);
            assert!(o + (3 << 20) <= region);
        }
        // Larger than the region (not done by bw) and imm-only writes: offset 0.
        assert_eq!(Pattern::Cold.offset(5, 8 << 20, region), 0);
        assert_eq!(Pattern::Cold.offset(5, 0, region), 0);
    }

    #[test]
    fn region_lengths() {
        let llc = 32 << 20;
        let cap = region_cap(llc, false);
        assert_eq!(cap, 256 << 20);
        // Hot: the largest size, at least REGION_FLOOR (4 MiB).
        assert_eq!(region_len(&[Pattern::Hot], llc, 16, 64 << 10, cap), 4 << 20);
        assert_eq!(region_len(&[Pattern::Hot], llc, 16, 16 << 20, cap), 16 << 20);
        assert_eq!(region_len(&[Pattern::Hot], llc, 16, 4 << 20, cap), 4 << 20);
        // Cold: 4 x LLC, or window x largest size when that is more, within the cap.
        assert_eq!(region_len(&[Pattern::Cold], llc, 16, 64 << 10, cap), 128 << 20);
        assert_eq!(region_len(&[Pattern::Hot, Pattern::Cold], llc, 16, 16 << 20, cap), 256 << 20);
        assert_eq!(region_len(&[Pattern::Cold], llc, 16, 64 << 20, cap), 256 << 20);
        // A large LLC raises the cap, up to 1 GiB.
        assert_eq!(region_cap(105 << 20, false), 420 << 20);
        assert_eq!(region_cap(512 << 20, false), 1 << 30);
        assert_eq!(
            region_len(&[Pattern::Cold], 105 << 20, 16, 64 << 10, region_cap(105 << 20, false)),
            420 << 20
        );
        // Verbs keeps its 64 MiB.
        assert_eq!(region_len(&[Pattern::Cold], llc, 128, 1 << 20, region_cap(llc, true)), 64 << 20);
    }

    #[test]
    fn sysfs_sizes() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("512K"), Some(512 << 10));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("xK"), None);
        assert!(llc_bytes() > 0);
    }
}
