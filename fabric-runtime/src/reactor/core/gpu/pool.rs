//! The engine's pool of pinned bounce slots, as the reactor uses it (`pure::staging::SlotPool`
//! does the accounting). A leaf of the reactor's GPU folder.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::pure::control::PullSource;
use crate::pure::staging::{Slot, SlotPool};
use crate::shared::memory::RegionShared;

/// The engine's bounce slots: one pinned buffer registered with every NIC, cut into equal
/// slots (`pure::staging::SlotPool` does the accounting).
pub(crate) struct Pool {
    pub(crate) region: Arc<RegionShared>,
    pub(crate) slots: SlotPool,
    /// The taken slots, by index.
    held: Vec<Option<Slot>>,
    /// Slots holding a staged source's chunk until a peer's pull of it is ACKed.
    held_for_pulls: usize,
}

impl Pool {
    pub(crate) fn new(region: Arc<RegionShared>, slots: u32, slot_len: u64) -> Result<Pool> {
        let slots = SlotPool::new(slots, slot_len)?;
        if slots.buffer_len() > region.len() as u64 {
            return Err(Error::Config("the staging pool buffer is smaller than its slots".into()));
        }
        Ok(Pool { region, held: (0..slots.capacity()).map(|_| None).collect(), slots, held_for_pulls: 0 })
    }

    pub(crate) fn region(&self) -> &Arc<RegionShared> {
        &self.region
    }

    pub(crate) fn slot_len(&self) -> u64 {
        self.slots.slot_len()
    }

    /// A free slot's index. A chunk that will wait for a peer's pull (`for_pull`) may not
    /// take the last free slot of a pool of two or more: that one stays for incoming pulls,
    /// so two engines writing GPU to GPU into each other cannot hold all each other's slots.
    pub(crate) fn acquire(&mut self, for_pull: bool) -> Option<u32> {
        if for_pull && self.slots.capacity() > 1 && self.slots.available() <= 1 {
            return None;
        }
        let slot = self.slots.acquire()?;
        let i = slot.index();
        self.held[i as usize] = Some(slot);
        if for_pull {
            self.held_for_pulls += 1;
        }
        Some(i)
    }

    pub(crate) fn release(&mut self, index: u32, for_pull: bool) {
        if let Some(slot) = self.held.get_mut(index as usize).and_then(Option::take) {
            if let Err(e) = self.slots.release(slot) {
                tracing::error!(error = %e, "staging slot accounting");
            }
            if for_pull {
                self.held_for_pulls = self.held_for_pulls.saturating_sub(1);
            }
        }
    }

    /// Host address of slot `index`.
    pub(crate) fn addr(&self, index: u32) -> u64 {
        self.region.backing().addr() + u64::from(index) * self.slots.slot_len()
    }

    /// Where a peer reads slot `index`, per NIC.
    pub(crate) fn sources(&self, index: u32) -> Vec<PullSource> {
        let off = u64::from(index) * self.slots.slot_len();
        self.region
            .regs
            .iter()
            .map(|r| PullSource { addr: r.remote_base.wrapping_add(off), key: r.remote_key })
            .collect()
    }
}
