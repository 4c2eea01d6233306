//! [`EngineStats::record_metrics`]: a snapshot into the [`metrics`] facade (feature
//! `metrics`), so any exporter (Prometheus, StatsD, ...) the application installs sees it.
//!
//! Names (`engine` label on all; counters only grow, so they are set with `absolute`):
//!
//! ```text
//! fabric_nic_{posted,completed}_{ops,bytes}_total, fabric_nic_errors_total      {engine, nic}
//! fabric_nic_in_flight, fabric_nic_backlog (gauges)                             {engine, nic}
//! fabric_peer_... (the same eight)                                              {engine, peer}
//! fabric_reactor_{passes,sleeps,wakeups}_total                                  {engine}
//! fabric_reactor_{slept,polling}_seconds (gauges, since start)                  {engine}
//! fabric_counter_arrivals_total, fabric_counter_{available,waiters} (gauges)    {engine, imm}
//! fabric_counters, fabric_counters_max (gauges), fabric_counter_refused_total   {engine}
//! ```

use super::stats::{EngineStats, OpStats};

fn ops(kind: &'static str, id: String, engine: &str, s: &OpStats) {
    let labels = [("engine", engine.to_string()), (kind, id)];
    let counters = [
        ("posted_ops_total", s.posted_ops),
        ("posted_bytes_total", s.posted_bytes),
        ("completed_ops_total", s.completed_ops),
        ("completed_bytes_total", s.completed_bytes),
        ("errors_total", s.errors),
    ];
    for (name, v) in counters {
        metrics::counter!(format!("fabric_{kind}_{name}"), &labels).absolute(v);
    }
    metrics::gauge!(format!("fabric_{kind}_in_flight"), &labels).set(s.in_flight as f64);
    metrics::gauge!(format!("fabric_{kind}_backlog"), &labels).set(s.backlog as f64);
}

impl EngineStats {
    /// Records this snapshot into the `metrics` facade, every series labelled
    /// `engine = engine` (a name of yours: `"gpu0"`), per NIC (`nic`), per peer (`peer`),
    /// reactor, and per counter (`imm`); see the module docs for the names. Call it on a
    /// timer (`engine.stats().record_metrics("gpu0")` every few seconds); without a recorder
    /// installed it does nothing.
    pub fn record_metrics(&self, engine: &str) {
        for (i, n) in self.nics.iter().enumerate() {
            ops("nic", i.to_string(), engine, n);
        }
        for (i, p) in self.peers.iter().enumerate() {
            ops("peer", i.to_string(), engine, p);
        }
        let e = [("engine", engine.to_string())];
        let r = &self.reactor;
        metrics::counter!("fabric_reactor_passes_total", &e).absolute(r.passes);
        metrics::counter!("fabric_reactor_caller_passes_total", &e).absolute(r.caller_passes);
        metrics::counter!("fabric_reactor_sleeps_total", &e).absolute(r.sleeps);
        metrics::counter!("fabric_reactor_wakeups_total", &e).absolute(r.wakeups);
        metrics::gauge!("fabric_reactor_slept_seconds", &e).set(r.slept.as_secs_f64());
        metrics::gauge!("fabric_reactor_polling_seconds", &e).set(r.polling.as_secs_f64());
        // Zero unless `EngineBuilder::time_reactor`.
        metrics::gauge!("fabric_reactor_post_seconds", &e).set(r.in_post.as_secs_f64());
        metrics::gauge!("fabric_reactor_poll_seconds", &e).set(r.in_poll.as_secs_f64());
        metrics::gauge!("fabric_reactor_completing_seconds", &e).set(r.completing.as_secs_f64());
        metrics::gauge!("fabric_reactor_lingering", &e).set(r.lingering as f64);
        metrics::counter!("fabric_reactor_lingered_total", &e).absolute(r.lingered);
        metrics::counter!("fabric_reactor_linger_parked_total", &e).absolute(r.linger_parked);
        metrics::gauge!("fabric_counters", &e).set(self.counters.len() as f64);
        metrics::gauge!("fabric_counters_max", &e).set(self.max_counters as f64);
        metrics::counter!("fabric_counter_refused_total", &e).absolute(self.imm_refused);
        for c in &self.counters {
            let l = [("engine", engine.to_string()), ("imm", c.imm.to_string())];
            metrics::counter!("fabric_counter_arrivals_total", &l).absolute(c.arrivals);
            metrics::gauge!("fabric_counter_available", &l).set(c.available as f64);
            metrics::gauge!("fabric_counter_waiters", &l).set(c.waiters as f64);
        }
    }
}
