//! Measuring: process CPU time and memory, percentiles, units.

use std::time::Duration;

pub fn cpu_time() -> Duration {
    // SAFETY: `rusage` is plain C data (integers and `timeval`s) for which all-zero bytes is
    // a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Gives freed heap back to the kernel, so that RSS deltas measure what is live.
pub fn trim() {
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
}

/// MemAvailable of /proc/meminfo, bytes.
pub fn mem_available() -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Resident set size of this process, bytes. From `smaps_rollup`, which walks the page
/// tables: `VmRSS` in `status` comes from counters that kernels before 6.2 (the test VM's
/// 6.1) update per thread in batches of 64 pages, so a few hundred KiB of growth could read 0.
pub fn rss() -> u64 {
    let field = |file: &str, key: &str| {
        let s = std::fs::read_to_string(file).ok()?;
        let l = s.lines().find(|l| l.starts_with(key))?;
        l.split_whitespace().nth(1)?.parse::<u64>().ok()
    };
    field("/proc/self/smaps_rollup", "Rss:")
        .or_else(|| field("/proc/self/status", "VmRSS:"))
        .map_or(0, |kb| kb * 1024)
}

/// The median; of an even count, the mean of the two middle values.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// The median of `v` and its range.
pub fn spread(v: &[f64]) -> (f64, f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (median(v.to_vec()), lo, hi)
}

/// A distribution-free ~95% confidence interval for the median of `v`: the `k`-th smallest
/// and `k`-th largest values, `k` the largest rank with P(Binomial(n, 1/2) < k) <= 2.5%
/// (at least 95% coverage whatever the distribution). `None` under 6 values, where no
/// such interval exists (the range then covers only 1 - 2^(1-n)).
pub fn median_ci(v: &[f64]) -> Option<(f64, f64)> {
    let n = v.len();
    // P(X <= j) for X ~ Binomial(n, 1/2), accumulated term by term.
    let (mut term, mut cdf, mut k) = (0.5f64.powi(n as i32), 0.0, 0);
    for j in 0..n {
        cdf += term;
        if cdf > 0.025 {
            break;
        }
        k = j + 1;
        term *= (n - j) as f64 / (j + 1) as f64;
    }
    if k == 0 {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    Some((s[k - 1], s[n - k]))
}

/// (p50, p99) in microseconds, after dropping the first 10% as warm-up.
pub fn percentiles(rtts: &[Duration]) -> (f64, f64) {
    let skip = rtts.len() / 10;
    let mut v: Vec<f64> = rtts[skip..].iter().map(|d| d.as_secs_f64() * 1e6).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[(v.len() * 99 / 100).min(v.len() - 1)])
}

pub fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

pub fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 * 8.0 / t.as_secs_f64() / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_median_and_range() {
        assert_eq!(spread(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        // The textbook ranks: n = 6..8 -> 1st and n-th; 9 -> 2nd and 8th; 15 -> 4th and
        // 12th; 20 -> 6th and 15th (P(X <= 5) = 2.07% for Binomial(20, 1/2)).
        assert_eq!(median_ci(&[1.0, 2.0, 3.0, 4.0, 5.0]), None);
        let n = |k: usize| (1..=k).map(|x| x as f64).rev().collect::<Vec<_>>();
        assert_eq!(median_ci(&n(6)), Some((1.0, 6.0)));
        assert_eq!(median_ci(&n(8)), Some((1.0, 8.0)));
        assert_eq!(median_ci(&n(9)), Some((2.0, 8.0)));
        assert_eq!(median_ci(&n(15)), Some((4.0, 12.0)));
        assert_eq!(median_ci(&n(20)), Some((6.0, 15.0)));
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
        assert_eq!(median(vec![1.0, 9.0, 3.0, 5.0]), 4.0);
    }
}
