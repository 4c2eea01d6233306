//! Which host memory an engine has registered, so that `Engine.register` of memory inside a
//! live registration (a slice of a registered array, a tensor view of a pool, a parameter of
//! a flat buffer) is a range lookup, not a new NIC registration (`Region`'s views).
//!
//! The registry holds [`WeakMemoryRegion`]s: it never keeps a registration alive. A view
//! holds its registration strongly, so the memory stays registered (and, for an object
//! registered in place, pinned) while any view of it lives, and is deregistered when the
//! last region and the last operation using it are gone, as without views.

use std::collections::BTreeMap;

use fabric_async::{MemoryRegion, WeakMemoryRegion};

/// Registrations of host memory by start address.
#[derive(Default)]
pub(crate) struct Registry {
    by_start: BTreeMap<u64, Vec<(u64, WeakMemoryRegion)>>,
    /// The longest registration recorded (since the last sweep): a lookup looks no further
    /// back than this from the range it wants.
    longest: u64,
    /// Inserts since the last sweep of dead entries.
    inserts: usize,
}

/// Dead entries are swept every this many inserts.
const SWEEP_EVERY: usize = 1024;

impl Registry {
    /// A live registration that holds `len` bytes at `ptr`, and where they start in it.
    pub(crate) fn find(&self, ptr: u64, len: u64) -> Option<(MemoryRegion, u64)> {
        let end = ptr.checked_add(len)?;
        // Only a registration that starts at most `longest` bytes before `end` can hold it.
        let from = end.saturating_sub(self.longest);
        if from > ptr {
            return None; // none is that long
        }
        self.by_start.range(from..=ptr).rev().find_map(|(&start, entries)| {
            entries
                .iter()
                .filter(|(l, _)| start.checked_add(*l).is_some_and(|e| e >= end))
                .find_map(|(_, w)| w.upgrade())
                .map(|region| (region, ptr - start))
        })
    }

    /// Records a new registration of host memory.
    pub(crate) fn insert(&mut self, region: &MemoryRegion) {
        self.inserts += 1;
        if self.inserts >= SWEEP_EVERY {
            self.inserts = 0;
            self.by_start.retain(|_, entries| {
                entries.retain(|(_, w)| w.upgrade().is_some());
                !entries.is_empty()
            });
            self.longest = self.by_start.values().flatten().map(|(l, _)| *l).max().unwrap_or(0);
        }
        let (start, len) = (region.as_ptr() as u64, region.len() as u64);
        self.longest = self.longest.max(len);
        self.by_start.entry(start).or_default().push((len, region.downgrade()));
    }
}
