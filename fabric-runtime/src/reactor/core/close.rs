//! The reactor's shutdown ([`Core::close`]): refuse new work, give in-flight operations the
//! grace period, cancel the rest, release waiters, close every registration and the NIC
//! objects, and only then free memory. A child module of `core`, so it works on `Core`'s
//! fields directly.

use std::time::{Duration, Instant};

use super::Core;
use crate::error::Error;
use crate::provider::Domain;
use crate::shared::queue::{QueueState, Submission};
use crate::sync::lock;

impl<D: Domain> Core<D> {
    /// Shutdown: refuse new work, drain, cancel, close NIC objects, then free memory. Runs
    /// once; later passes do nothing.
    pub(crate) fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.closing = true;
        let _span =
            tracing::debug_span!("engine_close", in_flight = self.slab.len(), peers = self.peers.len())
                .entered();
        tracing::debug!("reactor closing: draining in-flight operations");
        self.drop_revivals();
        for v in self.vouching.drain(..) {
            v.fail(Error::Shutdown);
        }
        let items = std::mem::take(&mut lock(&self.shared.queue).items);
        for s in items {
            match s {
                Submission::Deregister { regs, backing } => self.deregister(regs, backing),
                other => other.fail(Error::Shutdown),
            }
        }
        for p in self.peers.iter_mut() {
            for (_, s) in p.pending.drain(..) {
                self.shared.stats.backlog(s.nic(), &p.stats, false, 1);
                self.shared.stats.failed(s.nic(), Some(&p.stats), false);
                s.fail(Error::Shutdown);
            }
        }
        // Give in-flight operations a chance to finish normally. Those already failed
        // (their peer is down, or they outlived `op_timeout`) are not waited for: a dead
        // peer's never complete on tcp, and shutdown must not wait on a dead peer either.
        // They are cancelled below with the rest, their memory freed after the NIC objects.
        let deadline = Instant::now() + self.cfg.shutdown_grace;
        while self.slab.iter_mut().any(|op| !op.expired) && Instant::now() < deadline {
            if !self.poll_domains() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        // Follow-ups posted during the grace period may have been queued behind a full NIC.
        for p in self.peers.iter_mut() {
            for (_, s) in p.pending.drain(..) {
                self.shared.stats.backlog(s.nic(), &p.stats, false, 1);
                self.shared.stats.failed(s.nic(), Some(&p.stats), false);
                s.fail(Error::Shutdown);
            }
        }
        let mut keep = Vec::new();
        for op in self.slab.drain() {
            let peer = self.peers.get(op.peer.0 as usize).map(|p| &*p.stats);
            if op.expired {
                self.shared.stats.landed(op.nic, peer);
            } else {
                self.shared.stats.failed(op.nic, peer, true);
            }
            keep.push(op.keep);
            op.notify.fail(Error::Shutdown);
        }
        // Waits for the copy engines, then fails what waited on them; their memory is
        // freed below, after the NIC objects.
        #[cfg(feature = "cuda")]
        let gpu_keep = self.close_staging();
        self.shared.close_counters();
        self.shared.peer_events.close();
        let waiters = {
            let mut inbox = lock(&self.shared.inbox);
            inbox.closed = true;
            inbox.take_waiters()
        };
        for w in waiters {
            w.wake();
        }
        // Close every registration, then the domains; only then free memory.
        for d in std::mem::take(&mut self.draining) {
            self.finish_drain(d);
        }
        self.acking.clear();
        for (d, live) in self.live.iter_mut().enumerate() {
            for (_, l) in live.drain() {
                self.domains[d].deregister(l.reg);
            }
        }
        for (d, p) in self.recv_pools.iter().chain(self.send_pools.iter()).enumerate() {
            let d = d % self.domains.len();
            self.domains[d].deregister(p.reg);
        }
        drop(std::mem::take(&mut self.domains));
        // Only now may the pools' memory go.
        drop(std::mem::take(&mut self.recv_pools));
        drop(std::mem::take(&mut self.send_pools));
        tracing::debug!("reactor closed: NIC objects closed");
        let graveyard = {
            let mut q = lock(&self.shared.queue);
            q.state = QueueState::Closed;
            std::mem::take(&mut q.graveyard)
        };
        drop(graveyard);
        drop(keep);
        #[cfg(feature = "cuda")]
        drop(gpu_keep);
    }
}
