//! The engine's table of immediate counters, bounded by `EngineBuilder::max_counters`.
//!
//! A peer chooses the immediates it sends, and each distinct value that arrives would get a
//! counter of its own (about 170 bytes) that lives until somebody consumes it. The table
//! bounds that:
//!
//! * an **arrival** creates a counter only while the table holds fewer than `limit`
//!   counters; past that, the arrival is **refused**: counted ([`CounterTable::refused`]),
//!   and its value remembered among the last [`REMEMBERED`] refused values, so that a counter
//!   created for it later knows its count is short ([`Birth::Refused`]);
//! * a counter **the application asks for** is always created (it counts toward the table's
//!   size, so it leaves less room for arrivals): the application bounds those itself, and
//!   gives them back with [`CounterTable::remove`] (`Engine::retire_counter`);
//! * arrivals of a value that has a counter are never refused, whatever the table's size.
//!
//! Generic over the counter (`C`), so this file has no atomics, no threads and no clock:
//! the caller passes the time in and logs what [`Refused::report`] says.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// `EngineBuilder::max_counters`' default: the counters arrivals may create.
pub(crate) const DEFAULT_LIMIT: usize = 65_536;

/// How many refused values the table remembers (the most recent ones), so that a counter
/// created for one of them later is born [`Birth::Refused`]. About 40 bytes each.
pub(crate) const REMEMBERED: usize = 4096;

/// How often a refusal is reported (logged) at most, after the first.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(10);

/// What a counter created now must know about its value's past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Birth {
    /// Nothing was lost: every arrival of the value lands in this counter.
    Fresh,
    /// Arrivals of this value were refused (the table was full) before this counter existed:
    /// its count is short.
    Refused,
}

/// An arrival the table refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused {
    /// `Some` when this refusal should be logged (the first one, then at most one per
    /// [`REPORT_EVERY`]).
    pub(crate) report: Option<Report>,
}

/// What to log about refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Report {
    /// Arrivals refused since the previous report, this one included.
    pub(crate) since_last: u64,
    /// Arrivals refused since the engine started.
    pub(crate) total: u64,
}

/// The counters by immediate value, and what was refused.
#[derive(Debug)]
pub(crate) struct CounterTable<C> {
    map: HashMap<u32, C>,
    limit: usize,
    refused: RefusedValues,
    /// Arrivals refused since the start.
    refused_total: u64,
    /// `refused_total` at the last report, and when it was made.
    reported: Option<(u64, Instant)>,
}

impl<C: Clone> CounterTable<C> {
    /// An empty table in which arrivals create at most `limit` counters.
    pub(crate) fn new(limit: usize) -> Self {
        CounterTable {
            map: HashMap::new(),
            limit,
            refused: RefusedValues::default(),
            refused_total: 0,
            reported: None,
        }
    }

    /// The most counters arrivals may create.
    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Arrivals refused since the start.
    pub(crate) fn refused(&self) -> u64 {
        self.refused_total
    }

    /// Every counter.
    pub(crate) fn values(&self) -> impl Iterator<Item = &C> {
        self.map.values()
    }

    /// The application asks for the counter of `imm`: the one in the table, or a new one
    /// made by `make` (never refused).
    pub(crate) fn get_or_create(&mut self, imm: u32, make: impl FnOnce(Birth) -> C) -> C {
        if let Some(c) = self.map.get(&imm) {
            return c.clone();
        }
        let c = make(self.birth(imm));
        self.map.insert(imm, c.clone());
        c
    }

    /// An arrival of `imm` needs its counter: the one in the table, a new one made by `make`
    /// while the table holds fewer than `limit`, or a refusal.
    pub(crate) fn for_arrival(
        &mut self,
        imm: u32,
        now: Instant,
        make: impl FnOnce(Birth) -> C,
    ) -> Result<C, Refused> {
        if let Some(c) = self.map.get(&imm) {
            return Ok(c.clone());
        }
        if self.map.len() < self.limit {
            let c = make(self.birth(imm));
            self.map.insert(imm, c.clone());
            return Ok(c);
        }
        self.refused_total += 1;
        self.refused.remember(imm);
        let due = match self.reported {
            None => true,
            Some((_, at)) => now.saturating_duration_since(at) >= REPORT_EVERY,
        };
        let report = due.then(|| {
            let before = self.reported.map_or(0, |(n, _)| n);
            self.reported = Some((self.refused_total, now));
            Report { since_last: self.refused_total - before, total: self.refused_total }
        });
        Err(Refused { report })
    }

    /// Removes the counter of `imm` and forgets that its arrivals were ever refused: the
    /// next counter of `imm` is [`Birth::Fresh`].
    pub(crate) fn remove(&mut self, imm: u32) -> Option<C> {
        self.refused.forget(imm);
        self.map.remove(&imm)
    }

    /// Empties the table (counts of refusals stay).
    #[cfg_attr(not(feature = "bench-hooks"), allow(dead_code))]
    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.refused = RefusedValues::default();
    }

    /// How a counter of `imm` created now is born; a remembered refusal is passed on to it.
    fn birth(&mut self, imm: u32) -> Birth {
        if self.refused.forget(imm) {
            Birth::Refused
        } else {
            Birth::Fresh
        }
    }
}

/// The last [`REMEMBERED`] distinct values refused, oldest first.
#[derive(Debug, Default)]
struct RefusedValues {
    /// Value → the sequence number of its entry in `order`.
    seq: HashMap<u32, u64>,
    order: VecDeque<(u32, u64)>,
    next: u64,
}

impl RefusedValues {
    fn remember(&mut self, imm: u32) {
        if self.seq.contains_key(&imm) {
            return;
        }
        while self.seq.len() >= REMEMBERED {
            let Some((old, s)) = self.order.pop_front() else { break };
            // An entry forgotten meanwhile (its counter was created) has no `seq` left, or
            // a newer one.
            if self.seq.get(&old) == Some(&s) {
                self.seq.remove(&old);
            }
        }
        self.seq.insert(imm, self.next);
        self.order.push_back((imm, self.next));
        self.next += 1;
        // Entries forgotten out of order pile up in `order`: drop them now and then, so it
        // stays within twice the values remembered.
        if self.order.len() >= 2 * REMEMBERED {
            let seq = &self.seq;
            self.order.retain(|(v, s)| seq.get(v) == Some(s));
        }
    }

    /// Forgets `imm`; whether it was remembered.
    fn forget(&mut self, imm: u32) -> bool {
        self.seq.remove(&imm).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A counter as the table sees it: its value and how it was born.
    type Cell = (u32, Birth);

    fn make(imm: u32) -> impl FnOnce(Birth) -> Cell {
        move |b| (imm, b)
    }

    #[test]
    fn arrivals_create_counters_up_to_the_limit_then_are_refused_and_counted() {
        let now = Instant::now();
        let mut t = CounterTable::<Cell>::new(3);
        for imm in 0..3 {
            assert_eq!(t.for_arrival(imm, now, make(imm)), Ok((imm, Birth::Fresh)));
        }
        assert_eq!(t.map.len(), 3);
        for imm in 3..1003 {
            assert!(t.for_arrival(imm, now, make(imm)).is_err(), "{imm}");
        }
        assert_eq!(t.map.len(), 3, "the table stays at its limit");
        assert_eq!(t.refused(), 1000);
        // A value that has a counter is never refused, however full the table is.
        for _ in 0..10 {
            assert_eq!(t.for_arrival(1, now, make(1)), Ok((1, Birth::Fresh)));
        }
        assert_eq!(t.refused(), 1000);
    }

    #[test]
    fn the_application_is_never_refused_and_a_refused_value_is_born_short() {
        let now = Instant::now();
        let mut t = CounterTable::<Cell>::new(1);
        assert!(t.for_arrival(10, now, make(10)).is_ok());
        assert!(t.for_arrival(11, now, make(11)).is_err());
        // The application's own counters: always created, the refused one born short ...
        assert_eq!(t.get_or_create(11, make(11)), (11, Birth::Refused));
        assert_eq!(t.get_or_create(12, make(12)), (12, Birth::Fresh));
        assert_eq!(t.map.len(), 3, "over the limit by what the application asked for");
        // ... once: the counter carries it now, and asking again finds that counter.
        assert_eq!(t.get_or_create(11, make(99)), (11, Birth::Refused));
        // The application's counters leave no room for arrivals of new values.
        assert!(t.for_arrival(13, now, make(13)).is_err());
        assert_eq!(t.refused(), 2);
    }

    #[test]
    fn a_limit_of_zero_counts_only_what_the_application_asked_for() {
        let now = Instant::now();
        let mut t = CounterTable::<Cell>::new(0);
        assert_eq!(t.get_or_create(5, make(5)), (5, Birth::Fresh));
        assert_eq!(t.for_arrival(5, now, make(5)), Ok((5, Birth::Fresh)));
        assert!(t.for_arrival(6, now, make(6)).is_err());
        assert_eq!(t.map.len(), 1);
    }

    #[test]
    fn removing_makes_room_and_forgets_the_refusal() {
        let now = Instant::now();
        let mut t = CounterTable::<Cell>::new(1);
        assert!(t.for_arrival(1, now, make(1)).is_ok());
        assert!(t.for_arrival(2, now, make(2)).is_err());
        assert_eq!(t.remove(1), Some((1, Birth::Fresh)));
        assert_eq!(t.map.len(), 0);
        // Room again: the refused value's next arrival gets a counter that knows it is short.
        assert_eq!(t.for_arrival(2, now, make(2)), Ok((2, Birth::Refused)));
        // Retiring it forgets: the next counter of 2 starts afresh.
        assert_eq!(t.remove(2), Some((2, Birth::Refused)));
        assert_eq!(t.for_arrival(2, now, make(2)), Ok((2, Birth::Fresh)));
        // Removing a value that only was refused (no counter) forgets the refusal too.
        assert!(t.for_arrival(3, now, make(3)).is_err());
        assert_eq!(t.remove(3), None);
        assert_eq!(t.remove(2), Some((2, Birth::Fresh)));
        assert_eq!(t.get_or_create(3, make(3)), (3, Birth::Fresh));
    }

    #[test]
    fn the_most_recent_refused_values_are_remembered_within_a_bound() {
        let now = Instant::now();
        let mut t = CounterTable::<Cell>::new(0);
        let n = 3 * REMEMBERED as u32;
        for imm in 0..n {
            assert!(t.for_arrival(imm, now, make(imm)).is_err());
            // Forget some out of order, as counters created for them would.
            if imm % 7 == 0 {
                assert!(t.refused.forget(imm));
            }
            assert!(t.refused.seq.len() <= REMEMBERED);
            assert!(t.refused.order.len() < 2 * REMEMBERED);
        }
        assert_eq!(t.refused(), u64::from(n));
        // The newest are remembered, the oldest forgotten.
        assert_eq!(t.get_or_create(n - 1, make(n - 1)).1, Birth::Refused);
        assert_eq!(t.get_or_create(1, make(1)).1, Birth::Fresh);
        // A value refused again while remembered keeps one entry.
        let mut t = CounterTable::<Cell>::new(0);
        for _ in 0..10 {
            assert!(t.for_arrival(42, now, make(42)).is_err());
        }
        assert_eq!((t.refused.seq.len(), t.refused.order.len(), t.refused()), (1, 1, 10));
    }

    #[test]
    fn refusals_are_reported_first_then_at_most_every_ten_seconds() {
        let t0 = Instant::now();
        let mut t = CounterTable::<Cell>::new(0);
        let report =
            |t: &mut CounterTable<Cell>, imm, at| t.for_arrival(imm, at, make(imm)).unwrap_err().report;
        assert_eq!(report(&mut t, 1, t0), Some(Report { since_last: 1, total: 1 }));
        for i in 0..1000 {
            assert_eq!(report(&mut t, 2 + i, t0 + Duration::from_millis(u64::from(i))), None);
        }
        assert_eq!(report(&mut t, 5000, t0 + REPORT_EVERY), Some(Report { since_last: 1001, total: 1002 }));
        assert_eq!(report(&mut t, 5001, t0 + REPORT_EVERY + Duration::from_secs(1)), None);
        // A clock that went backwards reports nothing rather than panicking.
        assert_eq!(report(&mut t, 5002, t0), None);
    }
}
