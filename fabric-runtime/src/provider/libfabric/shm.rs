//! What the `shm` provider needs to survive a peer that dies: noticing it, and one-sided
//! endpoints that a dead peer cannot block.
//!
//! **Liveness.** An shm address is `"fi_shm://PID:UID:N"`: the peer's process id. When a
//! peer is added, a pidfd of that process is opened; every [`CHECK_EVERY`] the domain's
//! poll asks which pidfds became readable (one `poll` call for all of them). A dead peer's
//! operations in flight fail at once (`ECONNRESET`, "shm peer process PID exited") and a
//! [`Completion::PeerDown`] follows, so nothing waits for `op_timeout`. This assumes the
//! peers share this process's pid namespace, as shm's own CMA path does; set
//! `FABRIC_SHM_LIVENESS=0` where they do not.
//!
//! **One one-sided endpoint per peer.** libfabric 1.17's shm completes a sender's writes
//! over 4 KiB (and reads) from one response queue per endpoint, strictly in order, and stops
//! at the first entry its peer has not answered (`smr_progress_resp`). A peer killed before
//! answering leaves its entry unanswered forever, so no later write of that endpoint, to
//! *any* peer, would complete. So writes and reads to a peer go out on an endpoint of that
//! peer's own, opened when the peer is added and bound to the domain's AV and CQ: a dead
//! peer blocks only its own endpoint, which is closed when the peer is found dead or
//! removed (its operations are failed first; once it is closed the provider touches their
//! memory no more). The main endpoint keeps the address peers know, the receives and the
//! two-sided sends (the receiver names the sender by it); up to 4 KiB a message never
//! waits in the response queue. A message over 4 KiB in flight to a peer that dies can hold
//! back later large messages until `op_timeout` (see `docs/faults.md`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use libfabric_sys as sys;

use super::fid::Fid;
use super::LibfabricDomain;
use crate::provider::{Completion, PeerHandle};
use crate::pure::int_map::IntMap;

/// The CQ binding of a one-sided endpoint: shm refuses to enable an endpoint without a
/// receive CQ, though this one never has a receive posted nor an address anyone writes to.
pub(super) const RMA_EP_CQ_FLAGS: u64 = (sys::FI_TRANSMIT | sys::FI_RECV) as u64;
/// How often the peers' pidfds (and tcp's liveness connections) are checked, at most; the
/// reactor's polling paces it.
pub(super) const CHECK_EVERY: Duration = Duration::from_millis(5);
/// Polls between two looks at the clock.
const POLLS_PER_CLOCK: u32 = 16;

/// Paces the periodic liveness work of a domain's poll: a look at the clock every few
/// polls, the work at most every [`CHECK_EVERY`].
pub(super) struct Tick {
    polls: u32,
    next: Instant,
}

impl Tick {
    pub(super) fn new() -> Tick {
        Tick { polls: 0, next: Instant::now() }
    }

    /// The domain is about to sleep: the first poll after it looks at the clock (a
    /// sleeping reactor polls once per wake-up, so waiting for the 16th poll would put the
    /// check 16 wake-ups off).
    pub(super) fn slept(&mut self) {
        self.polls = POLLS_PER_CLOCK - 1;
    }

    /// Whether the work is due now.
    pub(super) fn due(&mut self) -> bool {
        self.polls = self.polls.wrapping_add(1);
        if !self.polls.is_multiple_of(POLLS_PER_CLOCK) {
            return false;
        }
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        self.next = now + CHECK_EVERY;
        true
    }
}

/// The process id in an shm address (`"fi_shm://PID:..."`), if it has one.
pub(super) fn shm_pid(addr: &[u8]) -> Option<libc::pid_t> {
    let rest = addr.strip_prefix(b"fi_shm://")?;
    let end = rest.iter().position(|&b| b == b':')?;
    let digits = std::str::from_utf8(&rest[..end]).ok()?;
    digits.parse::<libc::pid_t>().ok().filter(|&p| p > 0)
}

/// One watched peer.
struct Watched {
    peer: PeerHandle,
    pid: libc::pid_t,
    /// `None`: the process was already gone when the peer was added.
    pidfd: Option<OwnedFd>,
}

/// The shm state of a [`LibfabricDomain`]: peer liveness and the one-sided endpoints.
#[derive(Default)]
pub(super) struct ShmState {
    /// Each peer's one-sided endpoint.
    rma_eps: IntMap<PeerHandle, Fid<sys::fid_ep>>,
    watched: Vec<Watched>,
    liveness_off: bool,
    /// The pidfd check's `poll` buffers, reused (a check in a pass allocates nothing).
    scratch: crate::sys::PollScratch,
}

impl ShmState {
    pub(super) fn new() -> ShmState {
        let liveness_off = !crate::env::switch("FABRIC_SHM_LIVENESS", true);
        ShmState { liveness_off, ..Default::default() }
    }

    /// The endpoint that one-sided operations to `peer` go out on.
    pub(super) fn rma_ep(&self, peer: PeerHandle) -> Option<*mut sys::fid_ep> {
        self.rma_eps.get(&peer).map(Fid::as_ptr)
    }

    /// Starts watching the process behind a newly added peer's address.
    fn watch(&mut self, peer: PeerHandle, addr: &[u8]) {
        if self.liveness_off {
            return;
        }
        let Some(pid) = shm_pid(addr) else {
            tracing::debug!(peer, "shm address without a process id; its death is found by op_timeout");
            return;
        };
        if pid == std::process::id() as libc::pid_t {
            return; // ourselves (another domain of this process)
        }
        let pidfd = match crate::sys::pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => None,
            Err(e) => {
                tracing::debug!(peer, pid, error = %e, "no pidfd for an shm peer; its death is found by op_timeout");
                return;
            }
        };
        self.watched.retain(|w| w.peer != peer);
        self.watched.push(Watched { peer, pid, pidfd });
    }

    /// The watched peers whose process has exited, taken off the watch list: (peer, pid).
    /// Allocates nothing while every peer lives (it runs in reactor passes, which may run on
    /// the synchronous fast path's threads).
    fn take_dead(&mut self) -> Vec<(PeerHandle, libc::pid_t)> {
        if self.watched.is_empty() {
            return Vec::new();
        }
        let mut dead: Vec<usize> =
            self.watched.iter().enumerate().filter(|(_, w)| w.pidfd.is_none()).map(|(i, _)| i).collect();
        let fds = self.watched.iter().map(|w| w.pidfd.as_ref().map_or(-1, |f| f.as_raw_fd()));
        match self.scratch.readable_now(fds) {
            Ok(ready) => dead.extend(ready.iter().copied().filter(|&i| self.watched[i].pidfd.is_some())),
            Err(e) => tracing::warn!(error = %e, "checking the shm peers' pidfds failed"),
        }
        dead.sort_unstable();
        dead.dedup();
        let mut out = Vec::with_capacity(dead.len());
        for i in dead.into_iter().rev() {
            let w = self.watched.swap_remove(i);
            out.push((w.peer, w.pid));
        }
        out
    }
}

impl LibfabricDomain {
    /// A new shm peer: its own one-sided endpoint, and a watch on its process.
    pub(super) fn shm_add_peer(&mut self, peer: PeerHandle, addr: &[u8]) -> Result<(), crate::error::Error> {
        let ep = self.open_endpoint(RMA_EP_CQ_FLAGS)?;
        let shm = self.shm.as_mut().expect("an shm domain");
        shm.rma_eps.insert(peer, ep);
        shm.watch(peer, addr);
        Ok(())
    }

    /// A peer is gone (dead or removed): its operations in flight fail with `errno` and
    /// `message`, then its one-sided endpoint is closed. Those completions go to `out`.
    pub(super) fn shm_drop_peer(
        &mut self,
        peer: PeerHandle,
        errno: i32,
        message: &str,
        out: &mut std::collections::VecDeque<Completion>,
    ) {
        let Some(shm) = self.shm.as_mut() else { return };
        shm.watched.retain(|w| w.peer != peer);
        let ep = shm.rma_eps.remove(&peer);
        for op in self.ctxs.in_flight().into_iter().filter(|o| o.peer() == Some(peer)) {
            // Nothing will answer for this memory any more: once the endpoint holding it is
            // closed (below; sends on the main endpoint: the peer is gone) the provider
            // does not touch it again.
            self.ctxs.abandon(op.slot);
            out.push_back(Completion::Failed { token: op.token, errno, message: message.to_owned() });
        }
        drop(ep);
    }

    /// The periodic shm work of a poll: peers whose process exited go down.
    pub(super) fn shm_maintenance(&mut self, out: &mut std::collections::VecDeque<Completion>) {
        let Some(shm) = self.shm.as_mut() else { return };
        for (peer, pid) in shm.take_dead() {
            let message = format!("shm peer process {pid} exited");
            tracing::warn!(peer, pid, "shm peer process exited; failing its operations");
            self.shm_drop_peer(peer, libc::ECONNRESET, &message, out);
            out.push_back(Completion::PeerDown { peer, message });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pid_of_an_shm_address() {
        assert_eq!(shm_pid(b"fi_shm://1234:1000:0\0"), Some(1234));
        assert_eq!(shm_pid(b"fi_shm://1:0:7"), Some(1));
        assert_eq!(shm_pid(b"fi_shm://0:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://-5:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://x:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://99999999999:0:0\0"), None);
        assert_eq!(shm_pid(b"fi_shm://123"), None);
        assert_eq!(shm_pid(b"fi_ns://123:0:0"), None);
        assert_eq!(shm_pid(b""), None);
    }
}
