//! Regions their owners have freed, as this engine learned from the owners' `Revoke`
//! messages (`pure/revoke.rs`): every `RemoteRegion` made from a descriptor of such a region
//! shares one flag, set when the revocation arrives, so that an operation through it fails
//! with `Error::Stale` before anything is posted; and the latest revocations are kept, so
//! that `remote_region` of such a descriptor is refused too.
//!
//! On transports whose target refuses a bad key without telling the writer (shm), the same
//! entry remembers which descriptors of the region its owner vouched for (`pure/revoke.rs`,
//! `Vouch`), so that `remote_region` asks the owner once per descriptor, not once per call.
//! A revocation forgets them with the rest.
//!
//! Bounded: one entry per distinct descriptor with a live `RemoteRegion` (entries whose
//! regions are all dropped are swept as the table grows; each remembers at most [`VOUCHED`]
//! vouched descriptors), plus the last [`RECENT`] revocations.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::pure::revoke::RegionKey;
use crate::shared::PeerId;
use crate::sync::lock;

/// How many revocations are remembered for descriptors that no `RemoteRegion` uses yet.
pub(crate) const RECENT: usize = 4096;
/// How many vouched descriptors one region's entry remembers (the latest).
pub(crate) const VOUCHED: usize = 8;

/// A descriptor its owner vouched for: the peer that owns it, every NIC's (base, key), and
/// its length (a shorter one at the same bases is covered too).
struct Vouched {
    peer: PeerId,
    nics: Box<[(u64, u64)]>,
    len: u64,
}

/// What this engine knows of one region its peers own.
struct Entry {
    /// The flag shared by the `RemoteRegion`s of its descriptors.
    flag: Weak<AtomicBool>,
    /// Its descriptors that the owner vouched for, at most [`VOUCHED`].
    vouched: Vec<Vouched>,
}

#[derive(Default)]
struct Inner {
    /// Per region named by descriptors of live `RemoteRegion`s.
    live: HashMap<RegionKey, Entry>,
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
        if let Some(flag) = g.live.get(&key).and_then(|e| e.flag.upgrade()) {
            return Some(flag);
        }
        if g.live.len() >= g.sweep_at {
            g.live.retain(|_, e| e.flag.strong_count() > 0);
            g.sweep_at = (2 * g.live.len()).max(64);
        }
        let flag = Arc::new(AtomicBool::new(false));
        g.live.insert(key, Entry { flag: Arc::downgrade(&flag), vouched: Vec::new() });
        Some(flag)
    }

    /// Whether `peer` vouched for a descriptor of `key`'s region with these NICs' (base,
    /// key) and at least `len` bytes, since the region's entry was made (while a
    /// `RemoteRegion` of it lived) and not revoked.
    pub(crate) fn is_vouched(&self, key: RegionKey, peer: PeerId, nics: &[(u64, u64)], len: u64) -> bool {
        let g = lock(&self.inner);
        g.live.get(&key).is_some_and(|e| {
            e.flag.strong_count() > 0
                && e.vouched.iter().any(|v| v.peer == peer && *v.nics == *nics && v.len >= len)
        })
    }

    /// `peer` vouched for a descriptor of `key`'s region ([`Revocations::is_vouched`]).
    /// Remembered while a `RemoteRegion` of the region lives (the caller holds its
    /// [`Revocations::flag`]) and it is not revoked; the oldest of more than [`VOUCHED`] is
    /// forgotten.
    pub(crate) fn vouched(&self, key: RegionKey, peer: PeerId, nics: &[(u64, u64)], len: u64) {
        let mut g = lock(&self.inner);
        let Some(e) = g.live.get_mut(&key).filter(|e| e.flag.strong_count() > 0) else { return };
        if let Some(v) = e.vouched.iter_mut().find(|v| v.peer == peer && *v.nics == *nics) {
            v.len = v.len.max(len);
            return;
        }
        if e.vouched.len() >= VOUCHED {
            e.vouched.remove(0);
        }
        e.vouched.push(Vouched { peer, nics: nics.into(), len });
    }

    /// The owner freed `key`'s region: its `RemoteRegion`s are revoked, and so is a
    /// descriptor of it handed to `remote_region` later (while it is among the last
    /// [`RECENT`]).
    pub(crate) fn revoke(&self, key: RegionKey) {
        let mut g = lock(&self.inner);
        if let Some(flag) = g.live.remove(&key).and_then(|e| e.flag.upgrade()) {
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
    fn vouched_descriptors_are_remembered_until_revoked() {
        let r = Revocations::default();
        let (p, nics) = (PeerId(1), [(1u64 << 20, 1u64)]);
        // Nothing is remembered for a region no RemoteRegion holds.
        r.vouched(key(1), p, &nics, 4096);
        assert!(!r.is_vouched(key(1), p, &nics, 1));
        let flag = r.flag(key(1)).unwrap();
        r.vouched(key(1), p, &nics, 4096);
        assert!(r.is_vouched(key(1), p, &nics, 4096) && r.is_vouched(key(1), p, &nics, 64));
        assert!(!r.is_vouched(key(1), p, &nics, 4097), "a longer descriptor");
        assert!(!r.is_vouched(key(1), PeerId(2), &nics, 64), "another peer");
        assert!(!r.is_vouched(key(1), p, &[(1 << 20, 1), (0, 2)], 64), "other NICs");
        for i in 0..VOUCHED as u64 {
            r.vouched(key(1), p, &[(i, i)], 1);
        }
        assert!(!r.is_vouched(key(1), p, &nics, 64), "the oldest is forgotten");
        r.vouched(key(1), p, &nics, 64);
        r.revoke(key(1));
        assert!(flag.load(Ordering::Acquire));
        assert!(!r.is_vouched(key(1), p, &nics, 64), "a revocation forgets what was vouched");
        drop(flag);
        let flag = r.flag(key(2)).unwrap();
        r.vouched(key(2), p, &nics, 64);
        drop(flag);
        assert!(!r.is_vouched(key(2), p, &nics, 64), "nor once its RemoteRegions are gone");
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
