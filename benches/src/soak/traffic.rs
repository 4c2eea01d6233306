//! One traffic task of the soak: until the round's deadline, random writes, write_imm and
//! imm-only writes of random sizes to random live peers at random offsets, about
//! `drop_pct`% of their futures dropped (half at once, half after a short timeout), the
//! others awaited, up to `window` at once, with a bound: a future that does not resolve
//! within it is a hang.
//!
//! Task `t` owns bytes `[t * slot, (t + 1) * slot)` of every peer's region and fills them
//! from the front with a random gap before each write, so no two writes of a round overlap
//! and each one's bytes can be checked after the round; once no live peer's slot has room
//! for the next write, the task's round ends. Its source is a slice of the
//! leader's source region, which never changes, so a dropped write may land any time.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabric_async::faults::{INJECTED_ERRNO, INJECTED_MESSAGE};
use fabric_async::{Engine, Error, MemoryRegion};
use futures::stream::{FuturesUnordered, StreamExt};

use super::ledger::{Kind, Outcome, Target};
use super::peer::IMM;

/// xorshift64*: the soak's only randomness, seeded per task from `--seed`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What one task does in one round.
pub struct TaskPlan {
    pub task: usize,
    /// Bytes of every peer region this task owns.
    pub slot: u64,
    pub max_size: u64,
    /// Bytes of the leader's source region.
    pub src_len: u64,
    pub drop_pct: u64,
    /// Awaited futures in flight at once.
    pub window: usize,
    /// Test hook (`--tamper`): record this task's first write with a wrong source offset
    /// and one immediate too many, so the checks must fail.
    pub tamper: bool,
    /// How long an awaited future may take before it counts as hung.
    pub hang_after: Duration,
    pub deadline: Instant,
    pub seed: u64,
}

/// A size from 1 byte to `max`, log-uniform: as many below 1 KiB as above 64 KiB.
fn size(rng: &mut Rng, max: u64) -> u64 {
    let bits = 64 - max.leading_zeros() as u64;
    let b = rng.below(bits + 1);
    let hi = (1u64 << b).min(max);
    1 + rng.below(hi)
}

/// Runs the task; returns the violations it saw.
pub async fn run(
    engine: Engine,
    src: Arc<MemoryRegion>,
    targets: Vec<Arc<Target>>,
    mut p: TaskPlan,
) -> Vec<String> {
    let mut rng = Rng::new(p.seed);
    let mut cursor = vec![0u64; targets.len()];
    // Peers whose slot this round has no room for the write drawn last.
    let mut full = vec![false; targets.len()];
    let mut violations = Vec::new();
    let mut window = FuturesUnordered::new();
    let base = p.task as u64 * p.slot;
    while Instant::now() < p.deadline && !targets.is_empty() {
        let i = rng.below(targets.len() as u64) as usize;
        let t = &targets[i];
        if targets.iter().zip(&full).all(|(t, f)| *f || !t.is_alive()) {
            // Every live peer's slot is full (or none is alive): this task's round is over.
            break;
        }
        if !t.is_alive() || full[i] {
            continue;
        }
        let kind = match rng.below(10) {
            0..=3 => Kind::Write,
            4..=7 => Kind::WriteImm,
            _ => Kind::Imm,
        };
        let len = size(&mut rng, p.max_size);
        let dst = cursor[i] + rng.below(4096);
        if kind != Kind::Imm && dst + len > p.slot {
            full[i] = true;
            continue;
        }
        let src_off = rng.below(p.src_len - len + 1);
        let (fut, arrivals, write) = match kind {
            Kind::Write => (engine.write(&src, src_off, &t.remote, base + dst, len), 0, true),
            Kind::WriteImm => {
                let arrivals = engine.write_arrivals(&t.remote, len).unwrap_or(1);
                (engine.write_imm(&src, src_off, &t.remote, base + dst, len, IMM), arrivals, true)
            }
            Kind::Imm => (engine.imm(&t.remote, IMM), 1, false),
        };
        if write {
            cursor[i] = dst + len;
        }
        let mut recorded = (base + dst, src_off, len);
        let mut counted = arrivals;
        if p.tamper && write {
            p.tamper = false;
            recorded.1 = (src_off + 1) % (p.src_len - len + 1);
            counted += 1;
        }
        let rec = t.created(kind, counted, write.then_some(recorded));
        let roll = rng.below(100);
        if roll < p.drop_pct / 2 {
            drop(fut);
            t.resolved(rec, arrivals, Outcome::Dropped);
        } else if roll < p.drop_pct {
            t.ledger().counts.raced += 1;
            let wait = Duration::from_micros(rng.below(500));
            let outcome = match tokio::time::timeout(wait, fut).await {
                Ok(r) => classify(r, t, kind, &mut violations),
                Err(_) => {
                    t.ledger().counts.raced_lost += 1;
                    Outcome::Dropped
                }
            };
            t.resolved(rec, arrivals, outcome);
        } else {
            let (t, hang_after) = (t.clone(), p.hang_after);
            window.push(async move {
                let r = tokio::time::timeout(hang_after, fut).await;
                Awaited { t, rec, arrivals, kind, len, r }
            });
            while window.len() >= p.window {
                let a = window.next().await.expect("not empty");
                a.settle(hang_after, &mut violations);
            }
        }
    }
    while let Some(a) = window.next().await {
        a.settle(p.hang_after, &mut violations);
    }
    violations
}

/// An awaited operation's result, with what it takes to record it.
struct Awaited {
    t: Arc<Target>,
    rec: Option<usize>,
    arrivals: u64,
    kind: Kind,
    len: u64,
    r: Result<fabric_async::Result<()>, tokio::time::error::Elapsed>,
}

impl Awaited {
    fn settle(self, hang_after: Duration, violations: &mut Vec<String>) {
        let outcome = match self.r {
            Ok(r) => classify(r, &self.t, self.kind, violations),
            Err(_) => {
                violations.push(format!(
                    "hang: a {:?} of {} B to {} did not resolve within {hang_after:?}",
                    self.kind, self.len, self.t.name
                ));
                self.t.ledger().counts.hung += 1;
                Outcome::Dropped
            }
        };
        self.t.resolved(self.rec, self.arrivals, outcome);
    }
}

/// An operation's result as an [`Outcome`]; a failure other than an injected one while the
/// peer is alive is a violation (the soak's live peers never fail).
fn classify(r: fabric_async::Result<()>, t: &Target, kind: Kind, violations: &mut Vec<String>) -> Outcome {
    match r {
        Ok(()) => Outcome::Ok,
        Err(Error::Completion { errno, message, .. })
            if errno == INJECTED_ERRNO && message.starts_with(INJECTED_MESSAGE) =>
        {
            Outcome::Injected
        }
        Err(e) => {
            if t.is_alive() {
                violations.push(format!("a {kind:?} to the live peer {} failed: {e}", t.name));
            }
            Outcome::Failed
        }
    }
}

/// Probes a killed incarnation, after its process was reaped: a write, a write_imm and an
/// imm-only write, each of which must resolve within `bound` (a hang is a violation) and
/// should fail with a typed error (the caller decides about an `Ok`). Returns (typed
/// errors, oks, violations).
pub async fn probe_dead(
    engine: &Engine,
    src: &MemoryRegion,
    t: &Target,
    bound: Duration,
) -> (u64, u64, Vec<String>) {
    let futs = [
        engine.write(src, 0, &t.remote, 0, 4096),
        engine.write_imm(src, 0, &t.remote, 4096, 64, IMM),
        engine.imm(&t.remote, IMM),
    ];
    let mut errs = 0;
    let mut oks = 0;
    let mut violations = Vec::new();
    for f in futs {
        match tokio::time::timeout(bound, f).await {
            Ok(Ok(())) => oks += 1,
            Ok(Err(Error::Shutdown)) => {
                violations.push(format!("probe of dead {}: engine shut down", t.name))
            }
            Ok(Err(_)) => errs += 1,
            Err(_) => violations
                .push(format!("hang: a probe of the killed {} did not resolve within {bound:?}", t.name)),
        }
    }
    (errs, oks, violations)
}

/// Collects a set of task results, violations first.
pub fn merge(all: &Mutex<Vec<String>>, mut more: Vec<String>) {
    all.lock().unwrap_or_else(|p| p.into_inner()).append(&mut more);
}
