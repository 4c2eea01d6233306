//! How one transfer is cut into shards over the NICs of an engine, and how many arrivals of
//! its immediate the target counts. Pure functions of the request, the options and the
//! number of NICs in the destination's descriptor: the receiver can compute what to wait
//! for without asking the sender.
//!
//! Rules (the same ones the engine posts by):
//!
//! * [`Route::Pinned`]: one shard, on that NIC.
//! * [`Route::Sharded`] with one NIC, or a transfer of at most `chunk` bytes, or an imm-only
//!   transfer: one shard. Otherwise `ceil(len / chunk)` shards of `chunk` bytes (the last
//!   one shorter), dealt round-robin over the NICs starting at a NIC the engine rotates per
//!   transfer (which NIC starts never changes the count).
//! * Paged writes are sharded by page: one shard per page, pages dealt round-robin (a page
//!   is never split).
//! * [`Arrivals::PerShard`]: every shard carries the immediate, so the target counts one
//!   arrival per shard. [`Arrivals::One`]: the shards carry no immediate and one imm-only
//!   write follows once all of them have completed locally: exactly one arrival.
#![forbid(unsafe_code)]

use crate::error::Error;

/// Default shard size of [`Route::Sharded`]: 1 MiB.
pub const DEFAULT_CHUNK: u64 = 1 << 20;

/// How a transfer is spread over the NICs of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Route {
    /// Cut into shards of `chunk` bytes dealt round-robin over every NIC; a transfer of at
    /// most `chunk` bytes goes whole to one NIC (the engine rotates which one per transfer).
    Sharded {
        /// Shard size in bytes (non-zero).
        chunk: u64,
    },
    /// Everything on NIC `nic` (an index into the engine's NICs, in builder order).
    Pinned {
        /// The NIC's index.
        nic: usize,
    },
}

impl Default for Route {
    fn default() -> Self {
        Route::Sharded { chunk: DEFAULT_CHUNK }
    }
}

/// What the target counts for one transfer with an immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Arrivals {
    /// One arrival per shard: every shard is a write with the immediate. No added latency,
    /// but the count depends on the sharding (see the module docs; compute it with
    /// [`TransferOpts::write_arrivals`]).
    #[default]
    PerShard,
    /// Exactly one arrival however the transfer is sharded: the shards are written without
    /// an immediate, then one imm-only write follows once all of them have completed
    /// locally. Costs one extra one-way trip plus the sender's completion round (see
    /// `docs/transfers.md`). Needs delivery-complete writes when sharded over several NICs
    /// (see [`TransferOpts::check_one_arrival`]).
    One,
}

/// Routing and arrival options of a transfer. The engine has defaults (set on its builder);
/// `Engine::with` applies others to a few calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferOpts {
    /// How shards are spread over the NICs.
    pub route: Route,
    /// What the target counts.
    pub arrivals: Arrivals,
}

impl TransferOpts {
    /// Sharded in `chunk`-byte shards, one arrival per shard.
    pub fn sharded(chunk: u64) -> Self {
        TransferOpts { route: Route::Sharded { chunk }, arrivals: Arrivals::PerShard }
    }

    /// Everything on NIC `nic`, one arrival.
    pub fn pinned(nic: usize) -> Self {
        TransferOpts { route: Route::Pinned { nic }, arrivals: Arrivals::PerShard }
    }

    /// The same routing, with exactly one arrival per transfer.
    pub fn one_arrival(self) -> Self {
        TransferOpts { arrivals: Arrivals::One, ..self }
    }

    /// Checks the options against an engine (or descriptor) with `nics` NICs.
    pub fn validate(&self, nics: usize) -> Result<(), Error> {
        match self.route {
            Route::Sharded { chunk: 0 } => Err(Error::Config("the shard size of Route::Sharded is 0".into())),
            Route::Pinned { nic } if nic >= nics => {
                Err(Error::Config(format!("Route::Pinned names NIC {nic}, but there are only {nics}")))
            }
            _ => Ok(()),
        }
    }

    /// Whether a transfer with data under these options may be posted on an engine of `nics`
    /// NICs whose write completions are (or are not) delivery-complete.
    ///
    /// [`Arrivals::One`] posts its imm-only write once every shard has completed locally.
    /// That arrival means "all bytes landed" only if a local completion means the data was
    /// placed at the target; otherwise the imm-only write, on one NIC, may overtake a shard
    /// still in flight on another. So `Arrivals::One` with [`Route::Sharded`] over more than
    /// one NIC without delivery-complete completions is [`Error::Unsupported`]. With one NIC
    /// or [`Route::Pinned`], the shards and the imm-only write share one endpoint and are
    /// allowed.
    pub fn check_one_arrival(&self, nics: usize, delivery_complete: bool) -> Result<(), Error> {
        match (self.arrivals, self.route) {
            (Arrivals::One, Route::Sharded { .. }) if nics > 1 && !delivery_complete => {
                Err(Error::Unsupported(format!(
                    "Arrivals::One with Route::Sharded over {nics} NICs: this transport's write \
                     completions are not delivery-complete, so the one arrival could overtake \
                     shards on other NICs; use Arrivals::PerShard or Route::Pinned"
                )))
            }
            _ => Ok(()),
        }
    }

    /// How many shards a transfer of `len` bytes is cut into over `nics` NICs.
    pub fn shard_count(&self, len: u64, nics: usize) -> Result<u64, Error> {
        self.validate(nics)?;
        Ok(match self.route {
            Route::Sharded { chunk } if nics > 1 && len > chunk => len.div_ceil(chunk),
            _ => 1,
        })
    }

    /// Arrivals of the immediate at the target of one `write_imm` of `len` bytes into a
    /// region of `nics` NICs (`RegionDescriptor::domains.len()`).
    pub fn write_arrivals(&self, len: u64, nics: usize) -> Result<u64, Error> {
        let shards = self.shard_count(len, nics)?;
        Ok(match self.arrivals {
            Arrivals::PerShard => shards,
            Arrivals::One => 1,
        })
    }

    /// Arrivals of a paged write of `pages` pages with an immediate (one shard per page).
    pub fn paged_arrivals(&self, pages: usize, nics: usize) -> Result<u64, Error> {
        self.validate(nics)?;
        Ok(match self.arrivals {
            Arrivals::PerShard => pages as u64,
            Arrivals::One => u64::from(pages > 0),
        })
    }

    /// The shards of a transfer of `len` bytes over `nics` NICs, the first on NIC
    /// `start % nics` (ignored when pinned).
    pub fn shards(&self, len: u64, nics: usize, start: usize) -> Result<Vec<Shard>, Error> {
        let count = self.shard_count(len, nics)?;
        Ok(match self.route {
            Route::Pinned { nic } => vec![Shard { nic, offset: 0, len }],
            Route::Sharded { chunk } => (0..count)
                .map(|i| {
                    let offset = i * chunk;
                    let len = if count == 1 { len } else { chunk.min(len - offset) };
                    Shard { nic: (start + i as usize) % nics, offset, len }
                })
                .collect(),
        })
    }

    /// The NIC of the `i`-th item (page, member) of a transfer made of single-shard items.
    pub fn nic_of(&self, i: usize, nics: usize, start: usize) -> usize {
        match self.route {
            Route::Pinned { nic } => nic,
            Route::Sharded { .. } => (start + i) % nics.max(1),
        }
    }
}

/// One piece of a transfer: `len` bytes at `offset` (relative to the transfer's start) on
/// NIC `nic`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// NIC index.
    pub nic: usize,
    /// Offset from the start of the transfer.
    pub offset: u64,
    /// Bytes in this shard.
    pub len: u64,
}

/// The page geometry of a paged write (KV-cache blocks): page `p` of the source starts at
/// `src_offset + p * src_stride`, page `q` of the destination at `dst_offset + q * dst_stride`,
/// and each page moves `page_len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLayout {
    /// Bytes moved per page (non-zero).
    pub page_len: u64,
    /// Distance between consecutive source pages (at least `page_len`).
    pub src_stride: u64,
    /// Distance between consecutive destination pages (at least `page_len`).
    pub dst_stride: u64,
    /// Offset of source page 0 in the source region.
    pub src_offset: u64,
    /// Offset of destination page 0 in the destination region.
    pub dst_offset: u64,
}

impl PageLayout {
    /// Pages of `page_len` bytes packed back to back on both sides, starting at offset 0.
    pub fn packed(page_len: u64) -> Self {
        PageLayout { page_len, src_stride: page_len, dst_stride: page_len, src_offset: 0, dst_offset: 0 }
    }

    /// Checks the geometry and the page lists and returns each page's (source offset,
    /// destination offset). Nothing is posted unless this succeeds: both lists have the
    /// same length, strides are at least a page (pages never overlap), every page is inside
    /// its region, and no destination page is listed twice (two writes racing into the same
    /// bytes would leave them undefined).
    pub fn resolve(
        &self,
        src_pages: &[u32],
        dst_pages: &[u32],
        src_len: u64,
        dst_len: u64,
    ) -> Result<Vec<(u64, u64)>, Error> {
        if src_pages.len() != dst_pages.len() {
            return Err(Error::Config(format!(
                "paged write: {} source pages but {} destination pages",
                src_pages.len(),
                dst_pages.len()
            )));
        }
        if self.page_len == 0 {
            return Err(Error::Config("paged write: page_len is 0".into()));
        }
        if self.src_stride < self.page_len || self.dst_stride < self.page_len {
            return Err(Error::Config(format!(
                "paged write: strides ({} source, {} destination) must be at least page_len {}",
                self.src_stride, self.dst_stride, self.page_len
            )));
        }
        let at = |side, base: u64, stride: u64, page: u32, region_len: u64| -> Result<u64, Error> {
            let off = u64::from(page).checked_mul(stride).and_then(|o| o.checked_add(base));
            match off {
                Some(o) if o.checked_add(self.page_len).is_some_and(|end| end <= region_len) => Ok(o),
                _ => Err(Error::OutOfBounds {
                    side,
                    offset: off.unwrap_or(u64::MAX),
                    len: self.page_len,
                    region_len,
                }),
            }
        };
        let mut seen = std::collections::HashSet::with_capacity(dst_pages.len());
        let mut out = Vec::with_capacity(src_pages.len());
        for (&s, &d) in src_pages.iter().zip(dst_pages) {
            if !seen.insert(d) {
                return Err(Error::Config(format!("paged write: destination page {d} is listed twice")));
            }
            let so = at(crate::error::Side::Local, self.src_offset, self.src_stride, s, src_len)?;
            let dof = at(crate::error::Side::Remote, self.dst_offset, self.dst_stride, d, dst_len)?;
            out.push((so, dof));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_nic_never_splits() {
        let o = TransferOpts::sharded(4096);
        assert_eq!(o.shard_count(1 << 30, 1).unwrap(), 1);
        assert_eq!(o.shards(1 << 20, 1, 7).unwrap(), vec![Shard { nic: 0, offset: 0, len: 1 << 20 }]);
    }

    #[test]
    fn sharded_covers_every_byte_once_round_robin() {
        let o = TransferOpts::sharded(1000);
        for len in [0u64, 1, 999, 1000, 1001, 2000, 4567, 10_000] {
            for nics in 1..=4 {
                for start in 0..5 {
                    let shards = o.shards(len, nics, start).unwrap();
                    assert_eq!(shards.len() as u64, o.shard_count(len, nics).unwrap());
                    assert_eq!(shards.iter().map(|s| s.len).sum::<u64>(), len);
                    let mut next = 0;
                    for (i, s) in shards.iter().enumerate() {
                        assert_eq!(s.offset, next, "contiguous");
                        next += s.len;
                        assert_eq!(s.nic, (start + i) % nics);
                        assert!(s.len <= 1000 || shards.len() == 1);
                    }
                }
            }
        }
    }

    #[test]
    fn arrivals_per_mode() {
        let o = TransferOpts::sharded(1 << 20);
        assert_eq!(o.write_arrivals(4 << 20, 4).unwrap(), 4);
        assert_eq!(o.write_arrivals((4 << 20) + 1, 4).unwrap(), 5);
        assert_eq!(o.write_arrivals(4 << 20, 1).unwrap(), 1);
        assert_eq!(o.write_arrivals(0, 4).unwrap(), 1, "an imm-only write is one arrival");
        assert_eq!(o.one_arrival().write_arrivals(64 << 20, 4).unwrap(), 1);
        assert_eq!(TransferOpts::pinned(1).write_arrivals(64 << 20, 2).unwrap(), 1);
        assert_eq!(o.paged_arrivals(17, 2).unwrap(), 17);
        assert_eq!(o.one_arrival().paged_arrivals(17, 2).unwrap(), 1);
    }

    #[test]
    fn one_arrival_over_several_nics_needs_delivery_complete() {
        let sharded = TransferOpts::sharded(1 << 20);
        let one = sharded.one_arrival();
        let e = one.check_one_arrival(2, false).unwrap_err();
        assert!(
            matches!(e, Error::Unsupported(ref m) if m.contains("Arrivals::One") && m.contains("2 NICs")),
            "{e}"
        );
        assert!(matches!(one.check_one_arrival(4, false), Err(Error::Unsupported(_))));
        // Delivery-complete NICs, one NIC, pinned, or one arrival per shard: allowed.
        assert!(one.check_one_arrival(4, true).is_ok());
        assert!(one.check_one_arrival(1, false).is_ok());
        assert!(TransferOpts::pinned(1).one_arrival().check_one_arrival(2, false).is_ok());
        assert!(sharded.check_one_arrival(4, false).is_ok());
    }

    #[test]
    fn bad_options_are_errors() {
        assert!(TransferOpts::sharded(0).shard_count(10, 2).is_err());
        let e = TransferOpts::pinned(2).validate(2).unwrap_err().to_string();
        assert!(e.contains("NIC 2") && e.contains("only 2"), "{e}");
    }

    #[test]
    fn pages_resolve_and_refuse_bad_lists() {
        let l = PageLayout { page_len: 100, src_stride: 128, dst_stride: 100, src_offset: 8, dst_offset: 0 };
        assert_eq!(l.resolve(&[0, 2], &[3, 1], 1000, 1000).unwrap(), vec![(8, 300), (264, 100)]);
        assert!(matches!(l.resolve(&[0], &[0, 1], 1000, 1000), Err(Error::Config(_))));
        assert!(matches!(l.resolve(&[0, 1], &[2, 2], 1000, 1000), Err(Error::Config(_))));
        assert!(matches!(
            l.resolve(&[7], &[0], 1000, 1000),
            Err(Error::OutOfBounds { side: crate::error::Side::Local, offset: 904, .. })
        ));
        assert!(matches!(
            l.resolve(&[0], &[10], 1000, 1000),
            Err(Error::OutOfBounds { side: crate::error::Side::Remote, .. })
        ));
        assert!(matches!(l.resolve(&[u32::MAX], &[0], 1000, 1000), Err(Error::OutOfBounds { .. })));
        let overlapping = PageLayout { src_stride: 50, ..l };
        assert!(matches!(overlapping.resolve(&[0], &[0], 1000, 1000), Err(Error::Config(_))));
        assert_eq!(l.resolve(&[], &[], 0, 0).unwrap(), vec![]);
    }
}
