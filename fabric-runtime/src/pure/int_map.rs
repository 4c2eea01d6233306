//! A hash map for integer keys that this process hands out itself (AV handles, registration
//! handles): std's SipHash guards against keys chosen by an adversary, at ~20 ns a lookup,
//! which showed on the per-operation path of a spinning caller. Keys a peer chooses (an
//! immediate value) keep SipHash.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// `HashMap` keyed by integers this process assigned, with [`IntHasher`].
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// Fibonacci hashing of one integer: a multiply, spreading consecutive keys over the table.
/// Only for integer keys (`write` of bytes folds them in, for completeness).
#[derive(Default, Clone, Copy)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_and_finds_integer_keys() {
        let mut m: IntMap<u64, u64> = IntMap::default();
        for k in 0..10_000u64 {
            m.insert(k * 4096, k);
        }
        assert_eq!(m.len(), 10_000);
        assert!((0..10_000u64).all(|k| m.get(&(k * 4096)) == Some(&k)));
        assert_eq!(m.remove(&4096), Some(1));
        assert_eq!(m.get(&4096), None);
    }

    #[test]
    fn consecutive_keys_spread_over_the_high_bits() {
        // hashbrown takes its group index from the high bits.
        let tops: std::collections::HashSet<u64> = (0..64u64)
            .map(|k| {
                let mut h = IntHasher::default();
                h.write_u64(k);
                h.finish() >> 58
            })
            .collect();
        assert!(tops.len() > 32, "{} distinct top bits of 64", tops.len());
    }
}
