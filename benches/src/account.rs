//! `bw --time-calls`: where each side's NIC thread spends a burst, for the engine's reactor
//! thread (`EngineBuilder::time_reactor`, read from `Engine::stats`) and the raw loop's
//! thread (`Raw::time_calls`) alike, so a gap between the two can be put down to one of:
//! the provider's own work (time inside its post and poll calls, per write), the engine's
//! work per completion (waking the awaiting task, counting arrivals), or time the thread had
//! nothing to do (busy share under 100%: it waited for the other side or for the task that
//! submits). Both processes keep their own bursts; the peer sends its (the receiving side's)
//! to the leader at the end (`encode`, `decode`), which makes the `bw-time` rows.

use std::collections::HashMap;
use std::time::Duration;

use fabric_async::EngineStats;

use crate::measure::{human, median};
use crate::pattern::Pattern;
use crate::report::{Report, Row};

/// Time inside a NIC thread's calls into the provider, and handling what its polls returned
/// (the engine's; the raw loop's own bookkeeping is a few counters and is not timed).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Calls {
    pub post: Duration,
    pub poll: Duration,
    pub complete: Duration,
    /// Times the thread slept in `ppoll` (the engine's reactor; the raw loop never sleeps).
    pub sleeps: u64,
}

impl Calls {
    /// An engine's reactor's totals so far (zero unless it was built with `time_reactor`).
    pub fn of_engine(s: &EngineStats) -> Calls {
        Calls {
            post: s.reactor.in_post,
            poll: s.reactor.in_poll,
            complete: s.reactor.completing,
            sleeps: s.reactor.sleeps,
        }
    }

    /// What was spent between `before` and `self` (both totals of one thread).
    pub fn since(self, before: Calls) -> Calls {
        Calls {
            post: self.post.saturating_sub(before.post),
            poll: self.poll.saturating_sub(before.poll),
            complete: self.complete.saturating_sub(before.complete),
            sleeps: self.sleeps.saturating_sub(before.sleeps),
        }
    }
}

/// Which NIC thread a burst was measured on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Who {
    Engine,
    Raw,
}

impl Who {
    fn name(self) -> &'static str {
        match self {
            Who::Engine => "engine",
            Who::Raw => "raw",
        }
    }
}

/// One burst on one side: its NIC thread's calls, the burst's wall time, the writes in it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Burst {
    pub calls: Calls,
    pub wall: Duration,
    pub writes: u64,
}

impl Burst {
    /// Microseconds inside the provider's post and poll calls per write.
    pub fn nic_us(&self) -> f64 {
        (self.calls.post + self.calls.poll).as_secs_f64() * 1e6 / self.writes.max(1) as f64
    }

    /// Microseconds handling completions per write.
    pub fn complete_us(&self) -> f64 {
        self.calls.complete.as_secs_f64() * 1e6 / self.writes.max(1) as f64
    }

    /// Times the thread slept per write (a reactor that sleeps mid-stream stalls tcp's
    /// progress: its polls are what move the socket's bytes).
    pub fn sleeps_per_write(&self) -> f64 {
        self.calls.sleeps as f64 / self.writes.max(1) as f64
    }

    /// The share of the burst (percent) the thread spent in the provider's calls and
    /// handling completions; the rest it had nothing to do (or ran the loop itself).
    pub fn busy_pct(&self) -> f64 {
        let busy = self.calls.post + self.calls.poll + self.calls.complete;
        100.0 * busy.as_secs_f64() / self.wall.as_secs_f64().max(1e-9)
    }
}

/// The bursts of one process (one side), by NIC thread, pattern and size index.
#[derive(Debug, Default)]
pub struct Account {
    bursts: HashMap<(Who, Pattern, usize), Vec<Burst>>,
}

impl Account {
    pub fn push(&mut self, who: Who, pat: Pattern, k: usize, b: Burst) {
        self.bursts.entry((who, pat, k)).or_default().push(b);
    }

    /// One line per burst: `who pattern k post_ns poll_ns complete_ns wall_ns writes sleeps`.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = String::new();
        for (&(who, pat, k), v) in &self.bursts {
            for b in v {
                s.push_str(&format!(
                    "{} {} {k} {} {} {} {} {} {}\n",
                    who.name(),
                    pat.name(),
                    b.calls.post.as_nanos(),
                    b.calls.poll.as_nanos(),
                    b.calls.complete.as_nanos(),
                    b.wall.as_nanos(),
                    b.writes,
                    b.calls.sleeps
                ));
            }
        }
        s.into_bytes()
    }

    /// What [`Account::encode`] wrote; a malformed line is an error, not a silent gap.
    pub fn decode(bytes: &[u8]) -> Result<Account, String> {
        let text = std::str::from_utf8(bytes).map_err(|e| format!("bw --time-calls: peer's bursts: {e}"))?;
        let mut a = Account::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let bad = || format!("bw --time-calls: malformed burst line from the peer: {line:?}");
            if f.len() != 9 {
                return Err(bad());
            }
            let who = match f[0] {
                "engine" => Who::Engine,
                "raw" => Who::Raw,
                _ => return Err(bad()),
            };
            let pat = match crate::pattern::parse_list(f[1]).as_deref() {
                Ok([p]) => *p,
                _ => return Err(bad()),
            };
            let n: Vec<u64> =
                f[2..].iter().map(|x| x.parse::<u64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
            let ns = Duration::from_nanos;
            let calls = Calls { post: ns(n[1]), poll: ns(n[2]), complete: ns(n[3]), sleeps: n[6] };
            a.push(who, pat, n[0] as usize, Burst { calls, wall: ns(n[4]), writes: n[5] });
        }
        Ok(a)
    }

    fn median_of(&self, who: Who, pat: Pattern, k: usize, f: impl Fn(&Burst) -> f64) -> f64 {
        match self.bursts.get(&(who, pat, k)) {
            Some(v) if !v.is_empty() => median(v.iter().map(f).collect()),
            _ => f64::NAN,
        }
    }

    /// The `bw-time` rows of one side (`side`: "sender" or "receiver") for `size` (index
    /// `k`), pattern `pat`: medians over the rounds, engine beside raw loop.
    pub fn rows(&self, rep: &mut Report, side: &str, pat: Pattern, k: usize, size: usize) {
        let case = |what: &str| format!("{} {pat} {side}: {what}", human(size));
        // The engine's median, the raw loop's beside it where it has the figure.
        let row = |what: &str, unit: &'static str, f: fn(&Burst) -> f64, with_raw: bool| {
            let r = Row::new("bw-time", &case(what), unit, self.median_of(Who::Engine, pat, k, f))
                .size(size)
                .pattern(pat);
            if with_raw {
                r.baseline("raw", self.median_of(Who::Raw, pat, k, f))
            } else {
                r
            }
        };
        rep.push(row("NIC calls per write", "us", Burst::nic_us, true));
        rep.push(row("busy share", "pct", Burst::busy_pct, true));
        rep.push(row("completing per write", "us", Burst::complete_us, false));
        rep.push(row("reactor sleeps per write", "sleeps", Burst::sleeps_per_write, false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn burst(post: u64, poll: u64, complete: u64, wall: u64, writes: u64) -> Burst {
        let us = Duration::from_micros;
        Burst {
            calls: Calls { post: us(post), poll: us(poll), complete: us(complete), sleeps: writes / 2 },
            wall: us(wall),
            writes,
        }
    }

    #[test]
    fn per_write_figures_and_busy_share() {
        let b = burst(600, 200, 100, 1000, 100);
        assert_eq!(b.nic_us(), 8.0);
        assert_eq!(b.complete_us(), 1.0);
        assert!((b.busy_pct() - 90.0).abs() < 1e-9);
        assert_eq!(b.sleeps_per_write(), 0.5);
    }

    #[test]
    fn bursts_cross_between_the_processes_unchanged_and_bad_lines_are_refused() {
        let mut a = Account::default();
        a.push(Who::Engine, Pattern::Hot, 2, burst(1, 2, 3, 40, 5));
        a.push(Who::Raw, Pattern::Cold, 0, burst(7, 8, 0, 90, 10));
        let b = Account::decode(&a.encode()).expect("decodes");
        assert_eq!(b.bursts, a.bursts);
        for bad in [
            "engine hot 2 1 2 3 40 5",
            "nic hot 0 1 2 3 4 5 0",
            "raw warm 0 1 2 3 4 5 0",
            "raw hot x 1 2 3 4 5 0",
        ] {
            assert!(Account::decode(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn since_subtracts_totals() {
        let us = Duration::from_micros;
        let a = Calls { post: us(5), poll: us(7), complete: us(1), sleeps: 2 };
        let b = Calls { post: us(9), poll: us(10), complete: us(4), sleeps: 5 };
        assert_eq!(b.since(a), Calls { post: us(4), poll: us(3), complete: us(3), sleeps: 3 });
    }
}
