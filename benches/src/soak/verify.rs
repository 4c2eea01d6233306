//! The leader's check of one target at the end of a round (`mod.rs`, `Leader::round`): wait
//! until nothing is in flight to it, then compare its peer's immediate count and its region,
//! read back, with the ledger.

use std::time::{Duration, Instant};

use fabric_async::faults::{INJECTED_ERRNO, INJECTED_MESSAGE};
use fabric_async::Error;

use super::ledger::{self, Target};
use super::Leader;
use crate::pair::Res;

impl Leader {
    /// Waits until the engine has nothing in flight or queued for `t`, then compares the
    /// peer's immediate count and region with the ledger.
    pub(super) async fn check(&mut self, t: &Target) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(2 * self.a.op_timeout + 10);
        loop {
            let s = self.engine.stats().peer(t.peer).copied().unwrap_or_default();
            if s.in_flight == 0 && s.backlog == 0 {
                break;
            }
            if Instant::now() > deadline {
                self.violation(format!(
                    "hang: {} still has {} in flight, {} queued",
                    t.name, s.in_flight, s.backlog
                ));
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // How many dropped futures' operations the engine failed this round: its error
        // count for the peer, less the failures the futures that resolved reported.
        let errors = self.engine.stats().peer(t.peer).map_or(0, |s| s.errors);
        let (created, ok, unknown, dropped_failed, miscount) = {
            let mut l = t.ledger();
            let seen = l.errors_at_start + l.observed_errors;
            let miscount = (errors < seen).then(|| (errors - l.errors_at_start, l.observed_errors));
            let dropped_failed = errors.saturating_sub(seen);
            l.counts.dropped_failed += dropped_failed;
            // Immediates that may never arrive: those still missing at the last check, of
            // this round's operations lost with a connection, and of at most
            // `dropped_failed` dropped ones.
            let unknown =
                l.unknown_arrivals + l.lost_arrivals + dropped_failed.min(l.dropped_imm) * l.dropped_imm_max;
            (l.created_arrivals, l.ok_arrivals, unknown, dropped_failed, miscount)
        };
        if let Some((counted, reported)) = miscount {
            self.violation(format!(
                "{}: the engine counted {counted} failures this round, the futures reported {reported}",
                t.name
            ));
        }
        if dropped_failed > 0 {
            self.t.dropped_failed_rounds += 1;
        }
        let want = created.saturating_sub(unknown).max(ok);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut arrived = loop {
            let inc = self.places.iter().find(|p| p.1.name == t.name).ok_or("no such incarnation")?;
            let n = inc.0.arrivals(&self.store).await?;
            if n >= created || n >= want && unknown > 0 || Instant::now() > deadline {
                break n;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        if arrived < created && unknown > 0 {
            // Some may never come: give the late ones a few of the peer's publications.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let inc = self.places.iter().find(|p| p.1.name == t.name).ok_or("no such incarnation")?;
            arrived = inc.0.arrivals(&self.store).await?;
        }
        if arrived > created || arrived < want {
            self.violation(format!(
                "{}: {arrived} immediates arrived, {created} posted ({ok} of them Ok, {unknown} may \
                 have been lost with a connection)",
                t.name
            ));
        }
        {
            let mut l = t.ledger();
            self.t.arrivals_checked += arrived.min(created).saturating_sub(l.checked_arrivals);
            l.checked_arrivals = arrived;
            // What is still missing stays "may never arrive"; the rest of this round's
            // tolerance is used up.
            let still = created.saturating_sub(arrived).min(unknown);
            self.t.imm_missing = (self.t.imm_missing + still).saturating_sub(l.unknown_arrivals);
            l.unknown_arrivals = still;
        }
        let writes = std::mem::take(&mut t.ledger().writes);
        let Some(end) = writes.iter().map(|w| w.dst + w.len).max() else { return Ok(()) };
        self.read_back(t, end).await?;
        let region = &mut self.scratch[..end as usize];
        self.readback.read_at(0, region)?;
        let v = ledger::verify(&writes, region, &self.src_bytes, dropped_failed);
        self.t.bytes_verified += v.ok;
        self.t.bytes_lost += v.lost;
        self.t.lost_writes += v.tolerated;
        self.t.lost_bytes += v.tolerated_bytes;
        self.t.writes_verified += writes.len() as u64;
        for b in v.bad {
            self.violation(format!("{}: bytes lost: {b}", t.name));
        }
        Ok(())
    }

    /// Reads `t`'s region `[0, end)` into `readback`, in 4 MiB reads, each retried when it
    /// fails by injection.
    async fn read_back(&self, t: &Target, end: u64) -> Res<()> {
        let mut off = 0;
        while off < end {
            let n = (end - off).min(4 << 20);
            let mut tries = 0;
            loop {
                let f = self.engine.read(&self.readback, off, &t.remote, off, n);
                match tokio::time::timeout(Duration::from_secs(self.a.op_timeout + 10), f).await {
                    Ok(Ok(())) => break,
                    Ok(Err(Error::Completion { errno, message, .. }))
                        if tries < 20 && errno == INJECTED_ERRNO && message.starts_with(INJECTED_MESSAGE) =>
                    {
                        tries += 1;
                    }
                    Ok(Err(e)) => return Err(format!("reading back {}: {e}", t.name).into()),
                    Err(_) => return Err(format!("hang: reading back {}", t.name).into()),
                }
            }
            off += n;
        }
        Ok(())
    }
}
