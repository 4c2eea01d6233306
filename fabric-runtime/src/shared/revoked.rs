//! Regions their owners have freed, as this engine learned from the owners' `Revoke`
//! messages (`pure/revoke.rs`): every `RemoteRegion` made from a descriptor of such a region
//! shares one flag, set when the revocation arrives, so that an operation through it fails
//! with `Error::Stale` before anything is posted; and the latest revocations are kept, so
//! that `remote_region` of such a descriptor is refused too.
//!
//! Bounded: one entry per distinct descriptor with a live `RemoteRegion` (entries whose
//! regions are all dropped are swept as the table grows), plus the last [`RECENT`]
//! revocations.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::pure::revoke::RegionKey;
use crate::sync::lock;

/// How many revocations are remembered for descriptors that no `RemoteRegion` uses yet.
pub(crate) const RECENT: usize = 4096;

#[derive(Default)]
struct Inner {
    /// The flag shared by the `RemoteRegion`s of each descriptor.
    live: HashMap<RegionKey, Weak<AtomicBool>>,
    /// The table is swept of dropped flags when it grows past this.
    sweep_at: usize,
    recent: VecDeque<RegionKey>,
    recent_set: HashSet<RegionKey>,
}

/// See the module docs.
#[derive(Default)]
pub(crate) struct Revocations {
    inner: Mutex<Inner>,
}

impl Revocations {
    /// The revocation flag for a descriptor's region, shared with every other
    /// `RemoteRegion` of it; `None` when the region is known to be revoked already.
    pub(crate) fn flag(&self, key: RegionKey) -> Option<Arc<AtomicBool>> {
        let mut g = lock(&self.inner);
        if g.recent_set.contains(&key) {
            return None;
        }
        if let Some(flag) = g.live.get(&key).and_then(Weak::upgrade) {
            return Some(flag);
        }
        if g.live.len() >= g.sweep_at {
            g.live.retain(|_, w| w.strong_count() > 0);
            g.sweep_at = (2 * g.live.len()).max(64);
        }
        let flag = Arc::new(AtomicBool::new(false));
        g.live.insert(key, Arc::downgrade(&flag));
        Some(flag)
    }

    /// The owner freed `key`'s region: its `RemoteRegion`s are revoked, and so is a
    /// descriptor of it handed to `remote_region` later (while it is among the last
    /// [`RECENT`]).
    pub(crate) fn revoke(&self, key: RegionKey) {
        let mut g = lock(&self.inner);
        if let Some(flag) = g.live.remove(&key).and_then(|w| w.upgrade()) {
            flag.store(true, Ordering::Release);
        }
        if g.recent_set.insert(key) {
            g.recent.push_back(key);
            if g.recent.len() > RECENT {
                if let Some(old) = g.recent.pop_front() {
                    g.recent_set.remove(&old);
                }
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn key(i: u64) -> RegionKey {
        RegionKey { incarnation: 1, base: i << 20, key: i }
    }

    #[test]
    fn one_flag_per_descriptor_set_by_its_revocation() {
        let r = Revocations::default();
        let a = r.flag(key(1)).unwrap();
        let b = r.flag(key(1)).unwrap();
        let other = r.flag(key(2)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        r.revoke(key(1));
        assert!(a.load(Ordering::Acquire) && b.load(Ordering::Acquire));
        assert!(!other.load(Ordering::Acquire));
        assert!(r.flag(key(1)).is_none(), "a revoked descriptor is refused");
        // A revocation that came before any RemoteRegion of it.
        r.revoke(key(3));
        assert!(r.flag(key(3)).is_none());
    }

    #[test]
    fn bounded() {
        let r = Revocations::default();
        for i in 0..(3 * RECENT as u64) {
            r.revoke(key(i));
        }
        for i in 0..10_000 {
            drop(r.flag(key(1_000_000 + i)));
        }
        let g = lock(&r.inner);
        assert_eq!(g.recent.len(), RECENT);
        assert_eq!(g.recent_set.len(), RECENT);
        assert!(g.live.len() <= 128, "dropped flags are swept: {}", g.live.len());
    }
}
