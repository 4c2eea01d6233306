//! Fault injection for tests (cargo feature `faults`): [`Faulty`] wraps any [`Domain`] and
//! makes its posts refuse with [`PostError::Again`] at random and turns a fraction of its
//! completions into failures, so the engine's backlog and error paths run under load.
//!
//! ```text
//!  reactor ──post──► Faulty ──(draw < again: Again, nothing posted)
//!                      │ └────(else: posted; draw < fail: token doomed)──► inner Domain
//!  reactor ◄─poll──  Faulty ◄── Done{doomed token} becomes Failed{EIO, "injected fault"}
//! ```
//!
//! What stays within the [`Domain`] contract:
//!
//! * An injected `Again` means the operation was **not** posted; the engine keeps it in its
//!   backlog and posts it again later, as for a full queue.
//! * An injected failure keeps exactly one completion per token: the operation is really
//!   posted and runs to completion, and only its local `Done` is replaced by
//!   [`Completion::Failed`] with errno `EIO` and a message saying it was injected. The data
//!   (and the immediate) of such a write **land at the target** as for any success, since
//!   the real completion was one: only the local outcome changes, as after a real failure
//!   whose write had already been placed. `EIO` is not a peer errno, so the peer is not
//!   marked failed.
//! * Receives ([`Op::Recv`]), their completions and remote immediates ([`Completion::Imm`])
//!   are never touched; sends may be refused with `Again` but never failed (the engine's
//!   own control messages travel as sends). A real failure of a doomed operation is passed
//!   on unchanged, and every other completion ([`Completion::PeerDown`] included) is
//!   forwarded as is.
//!
//! Every method of [`Domain`] is forwarded, those with a default included: a method added to
//! the trait must be added here too.
//!
//! Nothing here is compiled without the feature, and with it an engine built without a
//! [`FaultPlan`] opens its domains unwrapped: no cost either way.

use std::collections::HashSet;
use std::fmt;
use std::os::fd::RawFd;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{
    Completion, Domain, FailCause, MemoryLocation, Op, PeerHandle, PostError, Registration, Revival,
};
use crate::error::{Error, Result};

/// The errno of an injected completion failure (not one of the reactor's peer errnos).
pub const INJECTED_ERRNO: i32 = libc::EIO;

/// The start of the message of every injected completion failure.
pub const INJECTED_MESSAGE: &str = "injected fault";

/// What to inject, set with `EngineBuilder::faults` or the environment variable
/// `FABRIC_FAULTS=again=0.1,fail=0.01,seed=7` ([`FaultPlan::from_env`]).
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Probability that a post (other than a receive) is refused with `Again`.
    pub again: f64,
    /// Probability that a posted write or read completes as a failure.
    pub fail: f64,
    /// Seed of the draws (each NIC of the engine draws from its own stream of it).
    pub seed: u64,
    /// Counts what was injected; can pause injection. Clone it before handing the plan over.
    pub handle: FaultHandle,
}

impl FaultPlan {
    /// A plan with these probabilities, seed 0 and a fresh [`FaultHandle`].
    pub fn new(again: f64, fail: f64) -> Self {
        FaultPlan { again, fail, seed: 0, handle: FaultHandle::default() }
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The plan in `FABRIC_FAULTS`, if it is set (and not empty).
    pub fn from_env() -> Result<Option<FaultPlan>> {
        match std::env::var("FABRIC_FAULTS") {
            Ok(v) if !v.trim().is_empty() => v.parse().map(Some),
            _ => Ok(None),
        }
    }

    /// Refuses probabilities outside `0..=1`.
    pub(crate) fn validate(&self) -> Result<()> {
        for (name, p) in [("again", self.again), ("fail", self.fail)] {
            if !(0.0..=1.0).contains(&p) {
                return Err(Error::Config(format!("fault plan: {name}={p} is not a probability in 0..=1")));
            }
        }
        Ok(())
    }
}

impl FromStr for FaultPlan {
    type Err = Error;

    /// `again=0.1,fail=0.01,seed=7` (any subset, any order).
    fn from_str(s: &str) -> Result<Self> {
        let mut plan = FaultPlan::new(0.0, 0.0);
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let bad =
                || Error::Config(format!("fault plan {s:?}: bad item {item:?} (again=P,fail=P,seed=N)"));
            let (k, v) = item.split_once('=').ok_or_else(bad)?;
            match k.trim() {
                "again" => plan.again = v.trim().parse().map_err(|_| bad())?,
                "fail" => plan.fail = v.trim().parse().map_err(|_| bad())?,
                "seed" => plan.seed = v.trim().parse().map_err(|_| bad())?,
                _ => return Err(bad()),
            }
        }
        plan.validate()?;
        Ok(plan)
    }
}

#[derive(Debug)]
struct Counts {
    enabled: AtomicBool,
    again: AtomicU64,
    failed: AtomicU64,
}

impl Default for Counts {
    fn default() -> Self {
        Counts { enabled: AtomicBool::new(true), again: AtomicU64::new(0), failed: AtomicU64::new(0) }
    }
}

/// Shared with every [`Faulty`] domain of one plan: what they injected so far, and a switch.
#[derive(Debug, Clone, Default)]
pub struct FaultHandle(Arc<Counts>);

impl FaultHandle {
    /// Posts refused with an injected `Again` so far.
    pub fn again_injected(&self) -> u64 {
        self.0.again.load(Ordering::Relaxed)
    }

    /// Completions turned into injected failures so far (handed to the engine).
    pub fn failures_injected(&self) -> u64 {
        self.0.failed.load(Ordering::Relaxed)
    }

    /// Turns injection on or off (on when the plan is made). Operations already doomed
    /// while it was on still complete as failures.
    pub fn set_enabled(&self, on: bool) {
        self.0.enabled.store(on, Ordering::Relaxed);
    }

    /// Whether injection is on.
    pub fn is_enabled(&self) -> bool {
        self.0.enabled.load(Ordering::Relaxed)
    }
}

/// A [`Domain`] that injects the faults of a [`FaultPlan`] into another. See the module docs.
pub struct Faulty<D> {
    inner: D,
    again: f64,
    fail: f64,
    rng: u64,
    /// Posted operations whose `Done` becomes a failure.
    doomed: HashSet<u64>,
    handle: FaultHandle,
}

impl<D: Domain> Faulty<D> {
    /// Wraps `inner`; `stream` picks this domain's own stream of the plan's seed.
    pub fn new(inner: D, plan: &FaultPlan, stream: u64) -> Self {
        Faulty {
            inner,
            again: plan.again,
            fail: plan.fail,
            rng: plan.seed ^ stream.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            doomed: HashSet::new(),
            handle: plan.handle.clone(),
        }
    }

    /// A uniform draw in `0..1` (splitmix64).
    fn draw(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn hit(&mut self, p: f64) -> bool {
        p > 0.0 && self.handle.is_enabled() && self.draw() < p
    }
}

impl<D> fmt::Debug for Faulty<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faulty")
            .field("again", &self.again)
            .field("fail", &self.fail)
            .field("doomed", &self.doomed.len())
            .finish_non_exhaustive()
    }
}

impl<D: Domain> Domain for Faulty<D> {
    fn transport(&self) -> &str {
        self.inner.transport()
    }

    fn address(&self) -> Vec<u8> {
        self.inner.address()
    }

    fn max_msg_size(&self) -> usize {
        self.inner.max_msg_size()
    }

    fn delivery_complete(&self) -> bool {
        self.inner.delivery_complete()
    }

    /// # Safety
    ///
    /// As [`Domain::register`]: the caller's promise is passed on unchanged.
    unsafe fn register(&mut self, addr: u64, len: usize, location: MemoryLocation) -> Result<Registration> {
        // SAFETY: the caller upholds `Domain::register`'s contract for `addr..addr+len`.
        unsafe { self.inner.register(addr, len, location) }
    }

    fn deregister(&mut self, reg: Registration) {
        self.inner.deregister(reg)
    }

    fn add_peer(&mut self, addr: &[u8]) -> Result<PeerHandle> {
        self.inner.add_peer(addr)
    }

    fn remove_peer(&mut self, peer: PeerHandle) {
        self.inner.remove_peer(peer)
    }

    fn revive_peer(&mut self, peer: PeerHandle) -> Result<()> {
        self.inner.revive_peer(peer)
    }

    fn revival(&mut self, peer: PeerHandle) -> Revival {
        self.inner.revival(peer)
    }

    /// # Safety
    ///
    /// As [`Domain::post`]: the caller's promise is passed on unchanged.
    unsafe fn post(&mut self, token: u64, op: &Op) -> std::result::Result<(), PostError> {
        if matches!(op, Op::Recv { .. }) {
            // SAFETY: the caller upholds `Domain::post`'s contract for `op`'s memory.
            return unsafe { self.inner.post(token, op) };
        }
        if self.hit(self.again) {
            self.handle.0.again.fetch_add(1, Ordering::Relaxed);
            return Err(PostError::Again);
        }
        // SAFETY: the caller upholds `Domain::post`'s contract for `op`'s memory.
        unsafe { self.inner.post(token, op) }?;
        if matches!(op, Op::Write { .. } | Op::Read { .. }) && self.hit(self.fail) {
            self.doomed.insert(token);
        }
        Ok(())
    }

    fn flush(&mut self) {
        self.inner.flush()
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let start = out.len();
        let n = self.inner.poll(out, max)?;
        if self.doomed.is_empty() {
            return Ok(n);
        }
        for c in &mut out[start..] {
            match c {
                Completion::Done { token } if self.doomed.remove(token) => {
                    self.handle.0.failed.fetch_add(1, Ordering::Relaxed);
                    *c = Completion::Failed {
                        token: *token,
                        errno: INJECTED_ERRNO,
                        message: format!(
                            "{INJECTED_MESSAGE} (feature `faults`): the operation itself succeeded; only this report is failed"
                        ),
                        cause: FailCause::Op,
                    };
                }
                // A real failure wins over the injected one.
                Completion::Failed { token, .. } => {
                    self.doomed.remove(token);
                }
                _ => {}
            }
        }
        Ok(n)
    }

    fn wait_fd(&self) -> Option<RawFd> {
        self.inner.wait_fd()
    }

    fn arm(&mut self) -> bool {
        self.inner.arm()
    }

    fn ack_wakeup(&mut self) {
        self.inner.ack_wakeup()
    }

    fn timer(&self) -> Option<Duration> {
        self.inner.timer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_bad_ones_are_refused() {
        let p: FaultPlan = "again=0.25, fail=0.5,seed=9".parse().unwrap();
        assert_eq!((p.again, p.fail, p.seed), (0.25, 0.5, 9));
        let p: FaultPlan = "fail=1".parse().unwrap();
        assert_eq!((p.again, p.fail, p.seed), (0.0, 1.0, 0));
        for bad in ["again", "again=x", "fail=1.5", "again=-0.1", "drop=0.1", "seed=-1"] {
            assert!(matches!(bad.parse::<FaultPlan>(), Err(Error::Config(_))), "{bad} accepted");
        }
    }

    /// A domain that accepts every post and completes each at the next poll.
    #[derive(Default)]
    struct Echo {
        posted: Vec<u64>,
        done: Vec<Completion>,
    }

    impl Domain for Echo {
        fn transport(&self) -> &str {
            "echo"
        }
        fn address(&self) -> Vec<u8> {
            Vec::new()
        }
        fn max_msg_size(&self) -> usize {
            64
        }
        unsafe fn register(&mut self, _: u64, _: usize, _: MemoryLocation) -> Result<Registration> {
            Ok(Registration { local: 0, remote_key: 0, handle: 0, remote_base: 0 })
        }
        fn deregister(&mut self, _: Registration) {}
        fn add_peer(&mut self, _: &[u8]) -> Result<PeerHandle> {
            Ok(0)
        }
        unsafe fn post(&mut self, token: u64, op: &Op) -> std::result::Result<(), PostError> {
            self.posted.push(token);
            if let Op::Recv { .. } = op {
                self.done.push(Completion::Recv { token, len: 0, src: None });
                return Ok(());
            }
            self.done.push(if token % 10 == 3 {
                Completion::Failed { token, errno: 1, message: "real".into(), cause: FailCause::Op }
            } else {
                Completion::Done { token }
            });
            if token % 10 == 5 {
                self.done.push(Completion::Imm { imm: token as u32 });
            }
            Ok(())
        }
        fn poll(&mut self, out: &mut Vec<Completion>, _: usize) -> Result<usize> {
            let n = self.done.len();
            out.append(&mut self.done);
            Ok(n)
        }
        fn wait_fd(&self) -> Option<RawFd> {
            None
        }
        fn arm(&mut self) -> bool {
            true
        }
        fn ack_wakeup(&mut self) {}
    }

    fn write() -> Op {
        let local = super::super::LocalSlice { addr: 0, len: 8, desc: 0 };
        Op::Write { peer: 0, local, remote: super::super::RemoteSlice { addr: 0, key: 0 }, imm: Some(1) }
    }

    /// Posts `n` writes and `n` receives, retrying each write until it is taken; returns the
    /// completions and how many posts were refused.
    fn run(d: &mut Faulty<Echo>, n: u64) -> (Vec<Completion>, u64) {
        let mut refused = 0;
        let recv = Op::Recv { local: super::super::LocalSlice { addr: 0, len: 8, desc: 0 } };
        for t in 0..n {
            // SAFETY: Echo touches no memory.
            while let Err(PostError::Again) = unsafe { d.post(t, &write()) } {
                refused += 1;
            }
            // SAFETY: as above.
            assert!(unsafe { d.post(1 << 40 | t, &recv) }.is_ok(), "receives are never refused");
        }
        let mut out = Vec::new();
        d.poll(&mut out, usize::MAX).unwrap();
        (out, refused)
    }

    #[test]
    fn one_completion_per_token_and_counts_match() {
        let plan = FaultPlan::new(0.3, 0.2).seed(42);
        let h = plan.handle.clone();
        let mut d = Faulty::new(Echo::default(), &plan, 0);
        let (out, refused) = run(&mut d, 1000);
        assert_eq!(refused, h.again_injected());
        assert!((330..530).contains(&refused), "1000 taken at 70%: about 429 refused, got {refused}");
        assert_eq!(d.inner.posted.len(), 2000, "refused posts never reached the domain");
        let mut tokens: Vec<u64> = out
            .iter()
            .filter_map(|c| match c {
                Completion::Done { token }
                | Completion::Failed { token, .. }
                | Completion::Recv { token, .. } => Some(*token),
                _ => None,
            })
            .collect();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 2000, "exactly one completion per posted token");
        assert_eq!(out.iter().filter(|c| matches!(c, Completion::Imm { .. })).count(), 100, "imms untouched");
        assert_eq!(out.iter().filter(|c| matches!(c, Completion::Recv { .. })).count(), 1000);
        let injected = out
            .iter()
            .filter(|c| {
                matches!(c, Completion::Failed { errno, message, .. }
                if *errno == INJECTED_ERRNO && message.starts_with(INJECTED_MESSAGE))
            })
            .count() as u64;
        let real = out.iter().filter(|c| matches!(c, Completion::Failed { errno: 1, .. })).count();
        assert_eq!(real, 100, "real failures pass through unchanged");
        assert_eq!(injected, h.failures_injected());
        assert!((120..280).contains(&injected), "about 20% of 900 successes failed: {injected}");
        assert!(d.doomed.is_empty(), "nothing left doomed");
    }

    #[test]
    fn switched_off_injects_nothing() {
        let plan = FaultPlan::new(1.0, 1.0);
        plan.handle.set_enabled(false);
        let mut d = Faulty::new(Echo::default(), &plan, 3);
        let (out, refused) = run(&mut d, 100);
        assert_eq!((refused, plan.handle.failures_injected()), (0, 0));
        assert!(out.iter().all(|c| !matches!(c, Completion::Failed { errno: INJECTED_ERRNO, .. })));
    }
}
