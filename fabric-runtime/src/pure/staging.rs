//! Planning a staged transfer of GPU memory: chunks, and a bounded pool of bounce slots.
//!
//! Where the NIC cannot read GPU memory itself, a transfer moves through pinned host
//! "bounce" buffers, one chunk at a time, so that the copy of one chunk overlaps the network
//! write of the one before:
//!
//! ```text
//!   sender:   chunk k:   D2H copy ──► write from slot ──► slot free
//!             chunk k+1:            D2H copy ──► write from slot ──► ...
//!   receiver: chunk k lands in a slot ──► H2D copy ──► slot free; counted when all are in
//! ```
//!
//! [`ChunkPlan`] cuts `len` bytes into chunks of at most one slot; [`SlotPool`] hands out
//! the slots of a fixed pool and takes them back, so at most `capacity` chunks are between
//! their copy and their write. Plain data, no I/O: the engine drives them.

use crate::error::{Error, Result};

/// How GPU bytes of a region travel (see `docs/gpu.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GpuPath {
    /// Every NIC of the owning engine registered the GPU memory itself: the NIC reads and
    /// writes it (`ibv_reg_dmabuf_mr`, `FI_HMEM_CUDA`).
    GpuDirect,
    /// The NICs cannot reach the GPU memory: the engine moves its bytes chunk by chunk
    /// through a bounded pool of pinned bounce slots (a GPU destination pulls:
    /// `pure::control`).
    Staged,
    /// A peer on this host: copied by the copy engine into its CUDA IPC mapping.
    Ipc,
}

impl std::fmt::Display for GpuPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuPath::GpuDirect => "gpudirect",
            GpuPath::Staged => "staged",
            GpuPath::Ipc => "cuda-ipc",
        })
    }
}

/// One piece of a staged transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Position in the plan, from 0.
    pub index: u64,
    /// Offset from the start of the transfer.
    pub offset: u64,
    /// Length in bytes (all chunks are the plan's chunk size except a shorter last one).
    pub len: u64,
}

/// `len` bytes cut into chunks of `chunk` bytes, the last one shorter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlan {
    len: u64,
    chunk: u64,
}

impl ChunkPlan {
    /// A plan for `len` bytes in chunks of `chunk` bytes. `Config` if `chunk` is zero. A
    /// zero-length transfer has no chunks.
    pub fn new(len: u64, chunk: u64) -> Result<ChunkPlan> {
        if chunk == 0 {
            return Err(Error::Config("staging chunk size must be at least 1 byte".into()));
        }
        Ok(ChunkPlan { len, chunk })
    }

    /// Total length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there is nothing to move.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Chunk size.
    pub fn chunk_size(&self) -> u64 {
        self.chunk
    }

    /// Number of chunks: `ceil(len / chunk)`.
    pub fn count(&self) -> u64 {
        self.len.div_ceil(self.chunk)
    }

    /// Chunk `index`, or `None` past the end.
    pub fn get(&self, index: u64) -> Option<Chunk> {
        let offset = index.checked_mul(self.chunk).filter(|&o| o < self.len)?;
        Some(Chunk { index, offset, len: self.chunk.min(self.len - offset) })
    }

    /// The chunks in order.
    pub fn iter(&self) -> Chunks {
        Chunks { plan: *self, next: 0 }
    }
}

impl IntoIterator for ChunkPlan {
    type Item = Chunk;
    type IntoIter = Chunks;
    fn into_iter(self) -> Chunks {
        self.iter()
    }
}

/// Iterator over the chunks of a [`ChunkPlan`].
#[derive(Debug, Clone)]
pub struct Chunks {
    plan: ChunkPlan,
    next: u64,
}

impl Iterator for Chunks {
    type Item = Chunk;
    fn next(&mut self) -> Option<Chunk> {
        let c = self.plan.get(self.next)?;
        self.next += 1;
        Some(c)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::try_from(self.plan.count() - self.next).unwrap_or(usize::MAX);
        (left, Some(left))
    }
}

impl ExactSizeIterator for Chunks {}

/// A bounce slot taken from a [`SlotPool`]: `slot_len` bytes at [`Slot::offset`] of the pool's
/// buffer. Not `Clone`: the one value is given back with [`SlotPool::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a slot that is dropped instead of released is lost to its pool"]
pub struct Slot {
    index: u32,
    offset: u64,
}

impl Slot {
    /// Index in the pool.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Byte offset in the pool's buffer.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// The accounting of a fixed pool of equal bounce slots (one pinned buffer of
/// `capacity * slot_len` bytes). Lowest free index first, so a lightly used pool stays in
/// the same few pages.
#[derive(Debug, Clone)]
pub struct SlotPool {
    slot_len: u64,
    /// Free indices, highest first (pop gives the lowest).
    free: Vec<u32>,
    busy: Vec<bool>,
}

impl SlotPool {
    /// A pool of `capacity` slots of `slot_len` bytes. `Config` if either is zero.
    pub fn new(capacity: u32, slot_len: u64) -> Result<SlotPool> {
        if capacity == 0 || slot_len == 0 {
            return Err(Error::Config(format!(
                "a staging pool needs at least one slot of at least one byte (got {capacity} x {slot_len})"
            )));
        }
        if slot_len.checked_mul(u64::from(capacity)).is_none() {
            return Err(Error::Config(format!("a staging pool of {capacity} x {slot_len} bytes overflows")));
        }
        Ok(SlotPool { slot_len, free: (0..capacity).rev().collect(), busy: vec![false; capacity as usize] })
    }

    /// Bytes of the whole pool (the pinned buffer to allocate).
    pub fn buffer_len(&self) -> u64 {
        self.slot_len * self.capacity() as u64
    }

    /// Bytes per slot: the largest chunk.
    pub fn slot_len(&self) -> u64 {
        self.slot_len
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.busy.len()
    }

    /// Slots taken and not released.
    pub fn in_use(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// Slots free.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// A plan for `len` bytes in chunks of one slot.
    pub fn plan(&self, len: u64) -> ChunkPlan {
        ChunkPlan { len, chunk: self.slot_len }
    }

    /// The lowest free slot, or `None` when all are taken (the caller waits for a release).
    pub fn acquire(&mut self) -> Option<Slot> {
        let index = self.free.pop()?;
        self.busy[index as usize] = true;
        Some(Slot { index, offset: u64::from(index) * self.slot_len })
    }

    /// Gives `slot` back. `Config` if it is not a taken slot of this pool (a slot of another
    /// pool); the pool is unchanged then.
    pub fn release(&mut self, slot: Slot) -> Result<()> {
        match self.busy.get_mut(slot.index as usize) {
            Some(b) if *b && slot.offset == u64::from(slot.index) * self.slot_len => {
                *b = false;
                // Keep `free` sorted descending, so `acquire` takes the lowest index.
                let at = self.free.partition_point(|&i| i > slot.index);
                self.free.insert(at, slot.index);
                Ok(())
            }
            _ => Err(Error::Config(format!("slot {} is not a taken slot of this staging pool", slot.index))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_transfer_exactly_once() {
        for len in [0u64, 1, 2, 7, 8, 9, 63, 64, 65, 1000, 4096, 4097, 1 << 20] {
            for chunk in [1u64, 2, 3, 8, 64, 4096, 1 << 20, 1 << 30] {
                let plan = ChunkPlan::new(len, chunk).unwrap();
                let chunks: Vec<Chunk> = plan.iter().collect();
                assert_eq!(chunks.len() as u64, plan.count(), "len {len} chunk {chunk}");
                assert_eq!(plan.iter().len(), chunks.len());
                let mut next = 0;
                for (i, c) in chunks.iter().enumerate() {
                    assert_eq!(c.index, i as u64);
                    assert_eq!(c.offset, next, "contiguous");
                    assert!(c.len > 0 && c.len <= chunk);
                    if i + 1 < chunks.len() {
                        assert_eq!(c.len, chunk, "only the last chunk is short");
                    }
                    assert_eq!(plan.get(i as u64), Some(*c));
                    next += c.len;
                }
                assert_eq!(next, len);
                assert_eq!(plan.get(plan.count()), None);
            }
        }
    }

    #[test]
    fn zero_chunk_is_a_config_error_and_huge_indices_do_not_overflow() {
        assert!(matches!(ChunkPlan::new(10, 0), Err(Error::Config(_))));
        let plan = ChunkPlan::new(u64::MAX, 1 << 40).unwrap();
        assert_eq!(plan.get(u64::MAX), None);
        let last = plan.get(plan.count() - 1).unwrap();
        assert_eq!(last.offset + last.len, u64::MAX);
    }

    #[test]
    fn pool_hands_out_lowest_first_and_never_more_than_capacity() {
        let mut pool = SlotPool::new(3, 4096).unwrap();
        assert_eq!(pool.buffer_len(), 3 * 4096);
        let a = pool.acquire().unwrap();
        let b = pool.acquire().unwrap();
        let c = pool.acquire().unwrap();
        assert_eq!((a.index(), b.index(), c.index()), (0, 1, 2));
        assert_eq!((a.offset(), b.offset(), c.offset()), (0, 4096, 8192));
        assert_eq!(pool.acquire(), None);
        assert_eq!((pool.in_use(), pool.available()), (3, 0));
        pool.release(b).unwrap();
        pool.release(a).unwrap();
        assert_eq!(pool.acquire().unwrap().index(), 0, "lowest free first");
        assert_eq!(pool.acquire().unwrap().index(), 1);
        assert_eq!(pool.acquire(), None);
        pool.release(c).unwrap();
        assert_eq!(pool.in_use(), 2);
    }

    #[test]
    fn foreign_slots_and_bad_sizes_are_refused() {
        let mut pool = SlotPool::new(2, 64).unwrap();
        let mut other = SlotPool::new(8, 64).unwrap();
        // Index 0 of `other` names a slot that is free in `pool`; index 5 one it does not have.
        let mut taken: Vec<Slot> = (0..6).map(|_| other.acquire().unwrap()).collect();
        assert!(matches!(pool.release(taken.pop().unwrap()), Err(Error::Config(_))));
        assert!(matches!(pool.release(taken.swap_remove(0)), Err(Error::Config(_))));
        assert_eq!(pool.available(), 2, "a refused release changes nothing");

        // Same index, taken in both, but the slot of a pool with another slot length.
        let (_a, _b) = (pool.acquire().unwrap(), pool.acquire().unwrap());
        let mut wide = SlotPool::new(2, 128).unwrap();
        let _w0 = wide.acquire().unwrap();
        let w1 = wide.acquire().unwrap();
        assert!(matches!(pool.release(w1), Err(Error::Config(_))));
        assert_eq!(pool.in_use(), 2);

        assert!(matches!(SlotPool::new(0, 64), Err(Error::Config(_))));
        assert!(matches!(SlotPool::new(4, 0), Err(Error::Config(_))));
        assert!(matches!(SlotPool::new(u32::MAX, u64::MAX), Err(Error::Config(_))));
    }

    #[test]
    fn a_pipeline_of_acquire_and_release_keeps_the_accounting_exact() {
        // Simulate a staged transfer: acquire while slots are free, retire the oldest when
        // none is, as completions would.
        let mut pool = SlotPool::new(4, 1 << 20).unwrap();
        let plan = pool.plan(10 * (1 << 20) + 5);
        assert_eq!(plan.count(), 11);
        let mut in_flight: std::collections::VecDeque<(Chunk, Slot)> = Default::default();
        let mut moved = 0;
        for chunk in plan {
            let slot = match pool.acquire() {
                Some(s) => s,
                None => {
                    let (done, slot) = in_flight.pop_front().unwrap();
                    moved += done.len;
                    pool.release(slot).unwrap();
                    pool.acquire().unwrap()
                }
            };
            assert!(chunk.len <= pool.slot_len());
            assert!(pool.in_use() <= pool.capacity());
            in_flight.push_back((chunk, slot));
        }
        for (done, slot) in in_flight {
            moved += done.len;
            pool.release(slot).unwrap();
        }
        assert_eq!(moved, plan.len());
        assert_eq!(pool.in_use(), 0);
    }
}
