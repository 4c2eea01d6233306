//! `Engine.stats()` as plain dicts and lists (a snapshot; cheap).

use fabric_async::{EngineStats, OpStats};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

fn ops<'py>(py: Python<'py>, s: &OpStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("posted_ops", s.posted_ops)?;
    d.set_item("posted_bytes", s.posted_bytes)?;
    d.set_item("completed_ops", s.completed_ops)?;
    d.set_item("completed_bytes", s.completed_bytes)?;
    d.set_item("errors", s.errors)?;
    d.set_item("in_flight", s.in_flight)?;
    d.set_item("backlog", s.backlog)?;
    Ok(d)
}

/// `{"transport", "nics": [ops], "peers": [ops], "total": ops, "reactor": {...},
/// "counters": [{"imm", "arrivals", "available", "waiters"}], "max_counters", "imm_refused"}`;
/// durations in seconds.
pub(crate) fn to_dict<'py>(py: Python<'py>, s: &EngineStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("transport", &s.transport)?;
    let list = |v: &[OpStats]| -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, v.iter().map(|o| ops(py, o)).collect::<PyResult<Vec<_>>>()?)
    };
    d.set_item("nics", list(&s.nics)?)?;
    d.set_item("peers", list(&s.peers)?)?;
    d.set_item("total", ops(py, &s.total())?)?;
    let r = &s.reactor;
    let reactor = PyDict::new(py);
    reactor.set_item("passes", r.passes)?;
    reactor.set_item("caller_passes", r.caller_passes)?;
    reactor.set_item("sleeps", r.sleeps)?;
    reactor.set_item("wakeups", r.wakeups)?;
    reactor.set_item("uptime", r.uptime.as_secs_f64())?;
    reactor.set_item("slept", r.slept.as_secs_f64())?;
    reactor.set_item("polling", r.polling.as_secs_f64())?;
    d.set_item("reactor", reactor)?;
    let counters = PyList::empty(py);
    for c in &s.counters {
        let cd = PyDict::new(py);
        cd.set_item("imm", c.imm)?;
        cd.set_item("arrivals", c.arrivals)?;
        cd.set_item("available", c.available)?;
        cd.set_item("waiters", c.waiters)?;
        counters.append(cd)?;
    }
    d.set_item("counters", counters)?;
    d.set_item("max_counters", s.max_counters)?;
    d.set_item("imm_refused", s.imm_refused)?;
    let st = &s.settings;
    let settings = PyDict::new(py);
    settings.set_item("mode", format!("{:?}", st.mode))?;
    settings.set_item("await_linger", st.await_linger.as_secs_f64())?;
    settings.set_item("poll_window", st.poll_window.as_secs_f64())?;
    settings.set_item("await_spin", st.await_spin.as_secs_f64())?;
    settings.set_item("direct_post", st.direct_post)?;
    settings.set_item("cpus", st.cpus)?;
    d.set_item("settings", settings)?;
    Ok(d)
}
