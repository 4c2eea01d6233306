//! Immediate counters, peer events and peer groups as Python objects.

use std::sync::Arc;

use fabric_async::{Engine, ImmCounter, PeerEvent, PeerGroup, PeerId};
use futures::StreamExt;
use pyo3::exceptions::PyStopAsyncIteration;
use pyo3::prelude::*;

use crate::bridge::{none, pending, Pending};
use crate::errors::IntoPy;

/// The arrival counter of one immediate value (`Engine.imm_counter`). Arrivals that landed
/// before it was asked for are counted; every counter of one value shares one count.
#[pyclass(module = "fabric_rdma", name = "ImmCounter", frozen)]
pub struct PyImmCounter {
    pub(crate) counter: ImmCounter,
    /// The engine, for stream waits (`wait_on_stream`: its GPU counter of the immediate).
    pub(crate) engine: Engine,
}

#[pymethods]
impl PyImmCounter {
    /// The immediate value.
    #[getter]
    fn imm(&self) -> u32 {
        self.counter.imm()
    }

    /// Arrivals not consumed yet.
    #[getter]
    fn available(&self) -> u64 {
        self.counter.available()
    }

    /// Arrivals ever counted.
    #[getter]
    fn total_arrived(&self) -> u64 {
        self.counter.total_arrived()
    }

    /// Waits until `n` arrivals are available and consumes them. Cancel safe: a cancelled or
    /// timed-out wait consumes nothing. Raises `Shutdown`, `CounterLimit`, `CounterRetired`.
    /// `peers`: the peer ids the arrivals come from; the wait then raises `PeerUnreachable`
    /// once one of them is down or removed (and the wait has not ended within a 250 ms
    /// grace), instead of waiting for a dead sender until your own timeout.
    #[pyo3(signature = (n, peers=None))]
    fn wait_for(&self, n: u64, peers: Option<Vec<u32>>) -> Pending {
        match peers {
            None => pending(self.counter.wait_for(n), none),
            Some(peers) => {
                let (engine, counter) = (self.engine.clone(), self.counter.clone());
                let peers: Vec<PeerId> = peers.into_iter().map(PeerId).collect();
                // The grace after a peer went down is a tokio timer: run on the timer thread.
                let wait =
                    async move { fabric_async::unless_down(&engine, &peers, counter.wait_for(n)).await };
                pending(crate::bridge::on_timers(wait), none)
            }
        }
    }

    /// Consumes `n` arrivals if they are there; never waits.
    fn try_consume(&self, n: u64) -> bool {
        self.counter.try_consume(n)
    }

    /// Makes the work queued on `stream` after this call wait, on the GPU, for the next `n`
    /// arrivals of this immediate, so kernels launched there afterwards see their bytes; the
    /// calling thread does not wait (`GpuCounter::wait_on_stream`). Arrivals are taken in
    /// order across calls (the first waits for arrivals 1..=n ever counted, the next for the
    /// `n` after), apart from what `wait_for` consumes on the host. `stream`: a
    /// `torch.cuda.Stream`, an object with `__cuda_stream__` or `cuda_stream`, or a raw
    /// `CUstream` int of `device` (default 0). If the arrivals never come, the stream waits
    /// forever: bound the wait on the host (`wait_for` with a timeout) before synchronizing
    /// with it. Raises `Unsupported` without a CUDA driver with stream memory operations.
    #[pyo3(signature = (stream, n, device=0))]
    fn wait_on_stream(&self, stream: &Bound<'_, PyAny>, n: u64, device: u32) -> PyResult<()> {
        let s = crate::streams::stream_of(stream, device)?;
        let gpu = self.engine.gpu_counter(self.counter.imm(), s.ordinal).py_err()?;
        // SAFETY: the handle is that of a live stream object of device `s.ordinal` (or the
        // caller's raw handle, documented to be one).
        unsafe { gpu.wait_on_stream(s.handle, n) }.py_err()
    }

    fn __repr__(&self) -> String {
        format!("<fabric_rdma.ImmCounter imm={} available={}>", self.counter.imm(), self.counter.available())
    }
}

/// A change of a peer's state: `kind` is `"up"`, `"down"` (with `reason`) or `"removed"`.
#[pyclass(module = "fabric_rdma", name = "PeerEvent", frozen, get_all)]
pub struct PyPeerEvent {
    kind: &'static str,
    peer: u32,
    reason: Option<String>,
}

#[pymethods]
impl PyPeerEvent {
    fn __repr__(&self) -> String {
        match &self.reason {
            Some(r) => format!("PeerEvent({:?}, peer={}, reason={r:?})", self.kind, self.peer),
            None => format!("PeerEvent({:?}, peer={})", self.kind, self.peer),
        }
    }
}

fn event(py: Python<'_>, ev: Option<PeerEvent>) -> PyResult<Py<PyAny>> {
    let (kind, peer, reason) = match ev {
        None => return Err(PyStopAsyncIteration::new_err(())),
        Some(PeerEvent::Up { peer }) => ("up", peer, None),
        Some(PeerEvent::Down { peer, reason }) => ("down", peer, Some(reason)),
        Some(PeerEvent::Removed { peer }) => ("removed", peer, None),
        // Non-exhaustive: a kind added later.
        Some(other) => return Ok(format!("{other:?}").into_pyobject(py)?.into_any().unbind()),
    };
    Ok(Py::new(py, PyPeerEvent { kind, peer: peer.0, reason })?.into_any())
}

/// `Engine.peer_events()`: an async iterator of `PeerEvent`s, starting with the current
/// state of every peer and ending at shutdown.
#[pyclass(module = "fabric_rdma", name = "PeerEvents", frozen)]
pub struct PyPeerEvents {
    pub(crate) events: Arc<futures::lock::Mutex<fabric_async::PeerEvents>>,
}

#[pymethods]
impl PyPeerEvents {
    fn __aiter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next event (raises `StopAsyncIteration` at shutdown). Cancel safe: a cancelled
    /// wait loses no event.
    fn __anext__(&self) -> Pending {
        let events = self.events.clone();
        pending(async move { Ok(events.lock().await.next().await) }, event)
    }

    /// Blocking: the next event, or None at shutdown; raises `fabric_rdma.Timeout` after
    /// `timeout` seconds.
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        match self.__anext__().wait(py, timeout) {
            Err(e) if e.is_instance_of::<PyStopAsyncIteration>(py) => Ok(py.None()),
            r => r,
        }
    }
}

/// Several peers' regions, the target of `scatter` and `barrier` (`Engine.peer_group`).
#[pyclass(module = "fabric_rdma", name = "PeerGroup", frozen)]
pub struct PyPeerGroup {
    pub(crate) group: PeerGroup,
}

#[pymethods]
impl PyPeerGroup {
    fn __len__(&self) -> usize {
        self.group.len()
    }

    /// The members' peer ids, in order.
    #[getter]
    fn peers(&self) -> Vec<u32> {
        self.group.members().iter().map(|m| m.peer().0).collect()
    }
}
