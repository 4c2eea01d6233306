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
//!
//! Among them, `stale_per_mille` / 1000 of the operations go through the descriptor of one
//! of the peer's short-lived extra regions, and `forged_per_mille` / 1000 through a forged
//! descriptor of its region, at a range this task wrote this round (`bad.rs`); those are
//! always awaited.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabric_async::faults::{INJECTED_ERRNO, INJECTED_MESSAGE};
use fabric_async::{Engine, Error, MemoryRegion, OpFuture};
use futures::stream::{FuturesUnordered, StreamExt};

use super::bad::{engine_counted, BadOutcome, Extra, Phase, IMM_BAD, OUTCOMES, PHASES};
use super::ledger::{Kind, Outcome, Target};
use super::peer::IMM;
use super::rng::Rng;

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
    /// Operations per 1000 through a stale descriptor, and through a forged one.
    pub stale_per_mille: u64,
    pub forged_per_mille: u64,
    /// Whether a bad access may make the transport tear the connection down and fail what
    /// else is in flight on it with `ConnectionLost` (tcp, verbs; not shm).
    pub tears_down: bool,
    /// shm: no write_imm through a descriptor that may be freed (`bad.rs`).
    pub shm: bool,
}

/// A size from 1 byte to `max`, log-uniform: as many below 1 KiB as above 64 KiB.
fn size(rng: &mut Rng, max: u64) -> u64 {
    let bits = 64 - max.leading_zeros() as u64;
    let b = rng.below(bits + 1);
    let hi = (1u64 << b).min(max);
    1 + rng.below(hi)
}

/// Runs the task; returns the violations it saw. `sink` takes the reads through stale and
/// forged descriptors.
pub async fn run(
    engine: Engine,
    src: Arc<MemoryRegion>,
    sink: Arc<MemoryRegion>,
    targets: Vec<Arc<Target>>,
    mut p: TaskPlan,
) -> Vec<String> {
    let mut rng = Rng::new(p.seed);
    let mut cursor = vec![0u64; targets.len()];
    // Peers whose slot this round has no room for the write drawn last.
    let mut full = vec![false; targets.len()];
    // Per peer, the last write of this task that resolved Ok this round: (dst, src, len).
    let mut last_ok: Vec<Option<(u64, u64, u64)>> = vec![None; targets.len()];
    let mut violations = Vec::new();
    let mut window = FuturesUnordered::new();
    let base = p.task as u64 * p.slot;
    let flags = Flags { tears_down: p.tears_down, hang_after: p.hang_after };
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
        let roll = rng.below(1000);
        let bad = if roll < p.forged_per_mille {
            forged_op(&engine, &src, &sink, t, last_ok[i], &mut rng, &p)
        } else if roll < p.forged_per_mille + p.stale_per_mille {
            stale_op(&engine, &src, &sink, t, &mut rng, &p)
        } else {
            None
        };
        if let Some((fut, what)) = bad {
            window.push(awaited(fut, t.clone(), i, what, p.hang_after));
            while window.len() >= p.window {
                let a = window.next().await.expect("not empty");
                a.settle(&flags, &mut last_ok, &mut violations);
            }
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
                Ok(r) => classify(r, t, kind, p.tears_down, &mut violations),
                Err(_) => {
                    t.ledger().counts.raced_lost += 1;
                    Outcome::Dropped
                }
            };
            t.resolved(rec, arrivals, outcome);
        } else {
            let write = write.then_some((base + dst, src_off, len));
            let what = What::Live { rec, arrivals, kind, len, write };
            window.push(awaited(fut, t.clone(), i, what, p.hang_after));
            while window.len() >= p.window {
                let a = window.next().await.expect("not empty");
                a.settle(&flags, &mut last_ok, &mut violations);
            }
        }
    }
    while let Some(a) = window.next().await {
        a.settle(&flags, &mut last_ok, &mut violations);
    }
    violations
}

/// An operation through the descriptor of one of `t`'s extra regions (`bad.rs`); `None`
/// where it has none yet.
fn stale_op(
    engine: &Engine,
    src: &MemoryRegion,
    sink: &MemoryRegion,
    t: &Target,
    rng: &mut Rng,
    p: &TaskPlan,
) -> Option<(OpFuture, What)> {
    let extra = {
        let x = t.extras.lock().unwrap_or_else(|p| p.into_inner());
        // Half of them through the newest: the one most likely being freed right now.
        let n = x.len() as u64;
        let k = if n == 0 || rng.below(2) == 0 { n.checked_sub(1)? } else { rng.below(n) };
        x[k as usize].clone()
    };
    let mut kind = match rng.below(3) {
        0 => Kind::Write,
        1 => Kind::WriteImm,
        _ => Kind::Imm, // (a read, below)
    };
    let phase = extra.phase();
    if p.shm && phase == Phase::Racing && kind == Kind::WriteImm {
        kind = Kind::Write;
    }
    if phase == Phase::Racing && p.tears_down {
        t.wire_bad.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
    let region_len = extra.remote.len();
    let len = size(rng, region_len.min(p.max_size).min(sink.len() as u64));
    let off = rng.below(region_len - len + 1);
    let src_off = rng.below(p.src_len - len + 1);
    let r = &extra.remote;
    let fut = match kind {
        Kind::Write => engine.write(src, src_off, r, off, len),
        Kind::WriteImm => engine.write_imm(src, src_off, r, off, len, IMM_BAD),
        Kind::Imm => engine.read(sink, 0, r, off, len),
    };
    Some((fut, What::Stale { extra, phase, kind, len }))
}

/// An operation through `t`'s forged descriptor (`bad.rs`) to the range of `last_ok` (a
/// write of this task this round that resolved `Ok`), from other source bytes; `None` where
/// there is no such write.
fn forged_op(
    engine: &Engine,
    src: &MemoryRegion,
    sink: &MemoryRegion,
    t: &Target,
    last_ok: Option<(u64, u64, u64)>,
    rng: &mut Rng,
    p: &TaskPlan,
) -> Option<(OpFuture, What)> {
    let f = t.forged.as_ref()?;
    let (dst, written_from, len) = last_ok?;
    let len = len.min(sink.len() as u64);
    let mut src_off = rng.below(p.src_len - len + 1);
    if src_off == written_from {
        src_off = (src_off + 1) % (p.src_len - len + 1);
    }
    let kind = match rng.below(3) {
        0 => Kind::Write,
        1 => Kind::WriteImm,
        _ => Kind::Imm, // (a read, below)
    };
    if p.tears_down {
        t.wire_bad.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
    let fut = match kind {
        Kind::Write => engine.write(src, src_off, f, dst, len),
        Kind::WriteImm => engine.write_imm(src, src_off, f, dst, len, IMM_BAD),
        Kind::Imm => engine.read(sink, 0, f, dst, len),
    };
    Some((fut, What::Forged { kind, len }))
}

/// What an awaited operation was.
enum What {
    /// To the peer's region, recorded in the ledger (`write`: (dst, src, len)).
    Live { rec: Option<usize>, arrivals: u64, kind: Kind, len: u64, write: Option<(u64, u64, u64)> },
    /// Through an extra region's descriptor (`Kind::Imm` stands for a read).
    Stale { extra: Arc<Extra>, phase: Phase, kind: Kind, len: u64 },
    /// Through the forged descriptor (`Kind::Imm` stands for a read).
    Forged { kind: Kind, len: u64 },
}

/// The name of a bad access's kind (`Kind::Imm` stands for a read there).
fn bad_kind(k: Kind) -> &'static str {
    match k {
        Kind::Write => "write",
        Kind::WriteImm => "write_imm",
        Kind::Imm => "read",
    }
}

struct Flags {
    tears_down: bool,
    hang_after: Duration,
}

/// An awaited operation's result, with what it takes to record it.
struct Awaited {
    t: Arc<Target>,
    /// The index of `t` among the task's targets.
    ti: usize,
    what: What,
    r: Result<fabric_async::Result<()>, tokio::time::error::Elapsed>,
}

async fn awaited(fut: OpFuture, t: Arc<Target>, ti: usize, what: What, hang_after: Duration) -> Awaited {
    let r = tokio::time::timeout(hang_after, fut).await;
    Awaited { t, ti, what, r }
}

impl Awaited {
    fn settle(self, f: &Flags, last_ok: &mut [Option<(u64, u64, u64)>], violations: &mut Vec<String>) {
        let t = &self.t;
        match self.what {
            What::Live { rec, arrivals, kind, len, write } => {
                let outcome = match self.r {
                    Ok(r) => classify(r, t, kind, f.tears_down, violations),
                    Err(_) => {
                        violations.push(format!(
                            "hang: a {kind:?} of {len} B to {} did not resolve within {:?}",
                            t.name, f.hang_after
                        ));
                        t.ledger().counts.hung += 1;
                        Outcome::Dropped
                    }
                };
                if outcome == Outcome::Ok && write.is_some() {
                    last_ok[self.ti] = write;
                }
                t.resolved(rec, arrivals, outcome);
            }
            What::Stale { extra, phase, kind, len } => {
                if phase == Phase::Live {
                    extra.live_done();
                }
                let o = self.r.as_ref().map_or(BadOutcome::Other, BadOutcome::of);
                {
                    let mut l = t.ledger();
                    l.counts.stale[phase as usize][o as usize] += 1;
                    if self.r.as_ref().is_ok_and(engine_counted) {
                        l.observed_errors += 1;
                    }
                }
                let fine = match phase {
                    Phase::Live => {
                        matches!(o, BadOutcome::Ok | BadOutcome::Injected)
                            || o == BadOutcome::ConnectionLost && f.tears_down && t.may_lose()
                    }
                    Phase::Racing => o != BadOutcome::Other,
                    Phase::Revoked => o == BadOutcome::Stale,
                };
                if self.r.is_err() || !fine && t.is_alive() {
                    violations.push(format!(
                        "a {} of {len} B through a stale descriptor of {} ({}) ended {}: {:?}",
                        bad_kind(kind),
                        t.name,
                        PHASES[phase as usize],
                        OUTCOMES[o as usize],
                        self.r
                    ));
                }
            }
            What::Forged { kind, len } => {
                let o = self.r.as_ref().map_or(BadOutcome::Other, BadOutcome::of);
                {
                    let mut l = t.ledger();
                    l.counts.forged[o as usize] += 1;
                    if self.r.as_ref().is_ok_and(engine_counted) {
                        l.observed_errors += 1;
                    }
                }
                let fine =
                    matches!(o, BadOutcome::RemoteAccess | BadOutcome::ConnectionLost | BadOutcome::Injected);
                if self.r.is_err() || !fine && (t.is_alive() || o == BadOutcome::Ok) {
                    violations.push(format!(
                        "a {} of {len} B through a forged descriptor of {} ended {}: {:?}",
                        bad_kind(kind),
                        t.name,
                        OUTCOMES[o as usize],
                        self.r
                    ));
                }
            }
        }
    }
}

/// An operation's result as an [`Outcome`]; a failure other than an injected one while the
/// peer is alive is a violation (the soak's live peers never fail), except `ConnectionLost`
/// where a bad access to the peer may have torn the connection down (`tears_down`, and one
/// was posted since the previous round began): then it may or may not have landed.
fn classify(
    r: fabric_async::Result<()>,
    t: &Target,
    kind: Kind,
    tears_down: bool,
    violations: &mut Vec<String>,
) -> Outcome {
    match r {
        Ok(()) => Outcome::Ok,
        Err(Error::Completion { errno, message, .. })
            if errno == INJECTED_ERRNO && message.starts_with(INJECTED_MESSAGE) =>
        {
            Outcome::Injected
        }
        Err(Error::ConnectionLost { .. }) if tears_down && t.may_lose() => Outcome::Lost,
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
