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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use fabric_async::{PeerId, RemoteRegion};

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
}

/// One peer incarnation as the traffic tasks see it.
pub struct Target {
    pub name: String,
    pub peer: PeerId,
    pub remote: RemoteRegion,
    /// Cleared right before the process is killed: no new operations go to it.
    pub alive: AtomicBool,
    pub ledger: Mutex<Ledger>,
}

impl Target {
    pub fn new(name: String, peer: PeerId, remote: RemoteRegion) -> Target {
        Target { name, peer, remote, alive: AtomicBool::new(true), ledger: Mutex::default() }
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
            Outcome::Dropped => l.counts.dropped += 1,
            Outcome::Pending => {}
        }
        if let Some(i) = rec {
            l.writes[i].outcome = outcome;
        }
    }
}

/// Compares every write of `writes` with what the peer's region holds (`region`, read back
/// from offset 0) against the leader's source `src`. Returns (bytes verified, bytes lost,
/// the first few mismatches described).
pub fn verify(writes: &[WriteRec], region: &[u8], src: &[u8]) -> (u64, u64, Vec<String>) {
    let (mut ok, mut lost, mut bad) = (0u64, 0u64, Vec::new());
    for w in writes {
        let (d, s, n) = (w.dst as usize, w.src as usize, w.len as usize);
        if region[d..d + n] == src[s..s + n] {
            ok += w.len;
        } else {
            lost += w.len;
            if bad.len() < 5 {
                let first = (0..n).find(|&i| region[d + i] != src[s + i]).unwrap_or(0);
                bad.push(format!(
                    "{} B at {d} (source {s}, future {:?}): first wrong byte at +{first}",
                    n, w.outcome
                ));
            }
        }
    }
    (ok, lost, bad)
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
        let (ok, lost, bad) = verify(&[w(10, 30, 10), w(40, 0, 8)], &region, &src);
        assert_eq!((ok, lost), (10, 8));
        assert!(bad[0].contains("8 B at 40"), "{bad:?}");
        let (rss, fds) = rss_and_fds();
        assert!(rss > 0 && fds >= 3, "{rss} {fds}");
    }
}
