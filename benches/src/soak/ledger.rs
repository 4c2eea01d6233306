//! What the soak leader knows about every operation it created, per peer incarnation, and
//! the checks against what the peer really has: its immediate count and its bytes.
//!
//! An operation counts as **posted** once its future exists: the engine does not cancel an
//! operation whose future is dropped (`OpFuture`'s cancel safety), so a dropped write still
//! lands and a dropped write_imm's immediate still arrives. An injected failure (`--faults`)
//! changes only the local outcome of an operation that ran (`docs/operations.md`, "Fault
//! injection"). So for an incarnation that was never killed every created write must be in
//! place and the peer must have counted exactly the immediates of every created write_imm
//! and imm-only write, whatever their futures said.
//!
//! With one exception, "what the transport really lost": on tcp, a bad remote access (a
//! stale or forged descriptor, `bad.rs`) makes the target close the connection, and every
//! operation in flight on it fails with `Error::ConnectionLost`, live ones included. Such an
//! operation may or may not have landed (and its immediate may or may not have been
//! counted). The ledger knows which awaited ones they are ([`Outcome::Lost`]); of dropped
//! futures it knows how many the engine failed (its per-peer error count minus the failures
//! the soak saw through futures: [`Ledger::errors_at_start`]). Only those are tolerated:
//! a [`Outcome::Lost`] write's bytes, at most that many dropped writes' bytes, and at most
//! the immediates of those operations (`docs/operations.md`, "Soak").

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use fabric_async::{PeerId, RemoteRegion};

use super::bad::{Extra, BAD_OUTCOMES};

/// The three kinds of operation the soak sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Write = 0,
    WriteImm = 1,
    Imm = 2,
}

/// What the leader saw of one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Pending,
    Ok,
    /// Failed with the injected `Error::Completion` (`--faults`).
    Injected,
    /// Failed with any other typed error.
    Failed,
    /// Its future was dropped before it resolved (at once, or after a short timeout).
    Dropped,
    /// Failed with `Error::ConnectionLost` (tcp: the connection was torn down under it by a
    /// bad remote access to the same peer): it may or may not have landed.
    Lost,
}

/// One write (plain or with immediate): `len` bytes of the leader's source at `src` went to
/// `dst` of the peer's region.
#[derive(Clone, Copy, Debug)]
pub struct WriteRec {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub outcome: Outcome,
}

/// Counts of operations, by outcome.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// Created (= posted), by [`Kind`].
    pub created: [u64; 3],
    pub ok: u64,
    pub injected: u64,
    pub failed: u64,
    pub dropped: u64,
    /// Futures raced against a short timeout, and those that lost it (also in `dropped`).
    pub raced: u64,
    pub raced_lost: u64,
    /// Awaited futures that did not resolve within the bound (each one is a violation).
    pub hung: u64,
    /// Operations to live regions that failed with `ConnectionLost` ([`Outcome::Lost`]).
    pub lost: u64,
    /// Dropped futures whose operation the engine failed (its error count for the peer
    /// minus the failures seen through futures), summed over rounds.
    pub dropped_failed: u64,
    /// Operations through the descriptors of short-lived regions (`bad.rs`), by
    /// [`super::bad::Phase`] and [`super::bad::BadOutcome`].
    pub stale: [[u64; BAD_OUTCOMES]; 3],
    /// Operations through a forged descriptor, by [`super::bad::BadOutcome`].
    pub forged: [u64; BAD_OUTCOMES],
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        for k in 0..3 {
            self.created[k] += o.created[k];
        }
        self.ok += o.ok;
        self.injected += o.injected;
        self.failed += o.failed;
        self.dropped += o.dropped;
        self.raced += o.raced;
        self.raced_lost += o.raced_lost;
        self.hung += o.hung;
        self.lost += o.lost;
        self.dropped_failed += o.dropped_failed;
        for p in 0..3 {
            for k in 0..BAD_OUTCOMES {
                self.stale[p][k] += o.stale[p][k];
            }
        }
        for k in 0..BAD_OUTCOMES {
            self.forged[k] += o.forged[k];
        }
    }

    pub fn created_total(&self) -> u64 {
        self.created.iter().sum()
    }
}

/// The leader's record of one incarnation.
#[derive(Default)]
pub struct Ledger {
    pub counts: Counts,
    /// Arrivals the peer must count for every created write_imm / imm-only write.
    pub created_arrivals: u64,
    /// Those of operations whose future resolved `Ok`.
    pub ok_arrivals: u64,
    /// This round's writes (cleared once verified).
    pub writes: Vec<WriteRec>,
    /// The peer's count at the last check.
    pub checked_arrivals: u64,
    /// Immediates that may never arrive: those of operations that may have been lost with
    /// a connection and were still missing at the last check (`created - arrived` then).
    pub unknown_arrivals: u64,
    /// This round: the engine's error count for the peer when it began, and the failures
    /// the soak saw through futures since (those the engine counts: not `Stale`, which
    /// fails before anything is handed to it).
    pub errors_at_start: u64,
    pub observed_errors: u64,
    /// This round: immediates of [`Outcome::Lost`] operations, and the dropped futures of
    /// write_imm / imm-only writes (how many, the most arrivals of one).
    pub lost_arrivals: u64,
    pub dropped_imm: u64,
    pub dropped_imm_max: u64,
}

/// One peer incarnation as the traffic tasks see it.
pub struct Target {
    pub name: String,
    pub peer: PeerId,
    pub remote: RemoteRegion,
    /// A forged copy of `remote`'s descriptor (`bad.rs`): must never reach the region.
    /// `None` on shm, whose owner refused to vouch for it (`remote_region` failed).
    pub forged: Option<RemoteRegion>,
    /// The latest short-lived regions of the peer (`bad.rs`), newest last.
    pub extras: Mutex<VecDeque<Arc<Extra>>>,
    /// Cleared right before the process is killed: no new operations go to it.
    pub alive: AtomicBool,
    /// Bad accesses that may make the transport tear the connection down (tcp), posted so
    /// far; and their count when the previous round began: a live operation may fail with
    /// `ConnectionLost` only if one was posted since.
    pub wire_bad: AtomicU64,
    pub wire_bad_mark: AtomicU64,
    pub wire_bad_prev: AtomicU64,
    pub ledger: Mutex<Ledger>,
}

impl Target {
    pub fn new(name: String, peer: PeerId, remote: RemoteRegion, forged: Option<RemoteRegion>) -> Target {
        Target {
            name,
            peer,
            remote,
            forged,
            extras: Mutex::default(),
            alive: AtomicBool::new(true),
            wire_bad: AtomicU64::new(0),
            wire_bad_mark: AtomicU64::new(0),
            wire_bad_prev: AtomicU64::new(0),
            ledger: Mutex::default(),
        }
    }

    /// Whether a live operation to it may have been lost with a connection torn down by a
    /// bad access (see [`Target::wire_bad`]).
    pub fn may_lose(&self) -> bool {
        self.wire_bad.load(Ordering::Acquire) > self.wire_bad_mark.load(Ordering::Acquire)
    }

    /// At the start of a round: the mark moves to the previous round's start.
    pub fn new_round(&self, errors: u64) {
        let prev = self.wire_bad_prev.swap(self.wire_bad.load(Ordering::Acquire), Ordering::AcqRel);
        self.wire_bad_mark.store(prev, Ordering::Release);
        let mut l = self.ledger();
        l.errors_at_start = errors;
        l.observed_errors = 0;
        l.lost_arrivals = 0;
        l.dropped_imm = 0;
        l.dropped_imm_max = 0;
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    pub fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a created operation; returns the index of its write record, if it writes.
    pub fn created(&self, kind: Kind, arrivals: u64, write: Option<(u64, u64, u64)>) -> Option<usize> {
        let mut l = self.ledger();
        l.counts.created[kind as usize] += 1;
        l.created_arrivals += arrivals;
        write.map(|(dst, src, len)| {
            l.writes.push(WriteRec { dst, src, len, outcome: Outcome::Pending });
            l.writes.len() - 1
        })
    }

    /// Records how an operation created by [`Target::created`] ended.
    pub fn resolved(&self, rec: Option<usize>, arrivals: u64, outcome: Outcome) {
        let mut l = self.ledger();
        match outcome {
            Outcome::Ok => {
                l.counts.ok += 1;
                l.ok_arrivals += arrivals;
            }
            Outcome::Injected => l.counts.injected += 1,
            Outcome::Failed => l.counts.failed += 1,
            Outcome::Dropped => {
                l.counts.dropped += 1;
                if arrivals > 0 {
                    l.dropped_imm += 1;
                    l.dropped_imm_max = l.dropped_imm_max.max(arrivals);
                }
            }
            Outcome::Lost => {
                l.counts.lost += 1;
                l.lost_arrivals += arrivals;
            }
            Outcome::Pending => {}
        }
        if matches!(outcome, Outcome::Injected | Outcome::Failed | Outcome::Lost) {
            l.observed_errors += 1;
        }
        if let Some(i) = rec {
            l.writes[i].outcome = outcome;
        }
    }
}

/// What [`verify`] found.
#[derive(Debug, Default)]
pub struct Verified {
    /// Bytes of writes that are in place.
    pub ok: u64,
    /// Bytes of writes that are not, and may not be: a violation.
    pub lost: u64,
    /// Writes (and their bytes) that are not in place but may have been lost with a
    /// connection: [`Outcome::Lost`] ones, and up to `dropped_failed` dropped ones.
    pub tolerated: u64,
    pub tolerated_bytes: u64,
    /// The first few mismatches that are violations, described.
    pub bad: Vec<String>,
}

/// Compares every write of `writes` with what the peer's region holds (`region`, read back
/// from offset 0) against the leader's source `src`. A write that failed with
/// `ConnectionLost` may hold anything (its old bytes, its new ones, or a mix where the
/// connection broke mid-write); so may at most `dropped_failed` dropped writes (that many of
/// the dropped futures' operations failed, by injection or with a lost connection: the
/// engine's count). Anything else must be exact.
pub fn verify(writes: &[WriteRec], region: &[u8], src: &[u8], dropped_failed: u64) -> Verified {
    let mut v = Verified::default();
    let mut dropped_budget = dropped_failed;
    for w in writes {
        let (d, s, n) = (w.dst as usize, w.src as usize, w.len as usize);
        if region[d..d + n] == src[s..s + n] {
            v.ok += w.len;
            continue;
        }
        let tolerated = match w.outcome {
            Outcome::Lost => true,
            Outcome::Dropped if dropped_budget > 0 => {
                dropped_budget -= 1;
                true
            }
            _ => false,
        };
        if tolerated {
            v.tolerated += 1;
            v.tolerated_bytes += w.len;
            continue;
        }
        v.lost += w.len;
        if v.bad.len() < 5 {
            let first = (0..n).find(|&i| region[d + i] != src[s + i]).unwrap_or(0);
            v.bad.push(format!(
                "{} B at {d} (source {s}, future {:?}): first wrong byte at +{first}",
                n, w.outcome
            ));
        }
    }
    v
}

/// Resident memory (VmRSS) and open file descriptors of this process.
pub fn rss_and_fds() -> (u64, u64) {
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("VmRSS:"))?.to_owned();
            l.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    (rss, fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_counts_matching_and_lost_bytes() {
        let src: Vec<u8> = (0..64u8).collect();
        let mut region = vec![0u8; 64];
        region[10..20].copy_from_slice(&src[30..40]);
        let w = |dst, src, len| WriteRec { dst, src, len, outcome: Outcome::Ok };
        let v = verify(&[w(10, 30, 10), w(40, 0, 8)], &region, &src, 0);
        assert_eq!((v.ok, v.lost, v.tolerated), (10, 8, 0));
        assert!(v.bad[0].contains("8 B at 40"), "{:?}", v.bad);
        // A write lost with its connection may hold anything; so may as many dropped writes
        // as the engine failed, and no more.
        let o = |dst, src, len, outcome| WriteRec { dst, src, len, outcome };
        let writes =
            [o(40, 0, 8, Outcome::Lost), o(48, 0, 4, Outcome::Dropped), o(52, 0, 4, Outcome::Dropped)];
        let v = verify(&writes, &region, &src, 1);
        assert_eq!((v.tolerated, v.tolerated_bytes, v.lost), (2, 12, 4));
        let (rss, fds) = rss_and_fds();
        assert!(rss > 0 && fds >= 3, "{rss} {fds}");
    }
}
