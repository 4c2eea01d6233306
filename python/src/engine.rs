//! `fabric_rdma.Engine`: the Rust `Engine`'s methods, each operation returned as a `Pending`
//! (await it, or `.wait()`), memory registration blocking (it is set-up, not the data path).

use std::mem::ManuallyDrop;
use std::time::Duration;

use bytes::Bytes;
use std::sync::Mutex;

use fabric_async::{
    BatchEntry, BatchOp, Engine, LatencyProfile, MemoryLocation, PeerId, ReactorMode, ScatterEntry,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use pyo3::IntoPyObjectExt;

use crate::bridge::{none, pending, Pending};
use crate::counter::{PyImmCounter, PyPeerEvents, PyPeerGroup};
use crate::errors::IntoPy;
use crate::memory::{
    host_range, memory_of, parse_device, CudaBuffer, Memory, PyPageLayout, PyRemoteRegion, Region,
};
use crate::views::Registry;

/// A transfer engine: one reactor thread driving the NIC(s) of one process or GPU.
#[pyclass(module = "fabric_rdma", name = "Engine", frozen)]
pub struct PyEngine {
    /// Dropped in `Drop` with the GIL released: the last handle joins the reactor thread.
    engine: ManuallyDrop<Engine>,
    /// Host memory registered by `register` and `alloc`, for views of it.
    registry: Mutex<Registry>,
}

fn mode(name: &str, spin: Option<f64>) -> PyResult<ReactorMode> {
    Ok(match name {
        "event" => ReactorMode::Event,
        "adaptive" => ReactorMode::Adaptive { spin: seconds("spin", spin.unwrap_or(50e-6))? },
        "busy_poll" | "busypoll" => ReactorMode::BusyPoll,
        "inline" => ReactorMode::Inline,
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown mode {other:?}: \"event\", \"adaptive\", \"busy_poll\" or \"inline\""
            )))
        }
    })
}

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("{what} must be >= 0 seconds, not {s}")))
}

fn bytes_of(py: Python<'_>, b: Bytes) -> PyResult<Py<PyAny>> {
    Ok(PyBytes::new(py, &b).into_any().unbind())
}

fn int<T: for<'py> IntoPyObject<'py>>(py: Python<'_>, v: T) -> PyResult<Py<PyAny>> {
    v.into_py_any(py)
}

/// An entry of `write_many` / `read_many`: (local region, its offset, remote region, its
/// offset, bytes).
type ManyEntry<'py> = (PyRef<'py, Region>, u64, PyRef<'py, PyRemoteRegion>, u64, u64);

impl PyEngine {
    fn many(&self, op: BatchOp, entries: &[ManyEntry<'_>], imm: Option<u32>) -> PyResult<Pending> {
        let mut local_offs = Vec::with_capacity(entries.len());
        for (local, local_off, _, _, n) in entries {
            local_offs.push(local.at(*local_off, *n)?);
        }
        let batch: Vec<BatchEntry<'_>> = entries
            .iter()
            .zip(local_offs)
            .map(|((local, _, remote, remote_off, n), local_off)| BatchEntry {
                local: &local.region,
                local_off,
                remote: &remote.remote,
                remote_off: *remote_off,
                len: *n,
            })
            .collect();
        let fut = self.engine.batch(op, &batch);
        let Some(imm) = imm else { return Ok(pending(fut, none)) };
        // One imm-only write per peer written to, after the batch: each counts one arrival.
        let mut peers = Vec::new();
        let mut targets = Vec::new();
        for (_, _, remote, _, _) in entries {
            if !peers.contains(&remote.remote.peer()) {
                peers.push(remote.remote.peer());
                targets.push(remote.remote.clone());
            }
        }
        let e = (*self.engine).clone();
        let task = async move {
            fut.await?;
            futures::future::try_join_all(targets.iter().map(|t| e.imm(t, imm))).await?;
            Ok(())
        };
        Ok(pending(task, none))
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        // A panic while holding it leaves nothing half-done that a lookup could trip over.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a registration of host memory, for views of it.
    fn remember(&self, region: &fabric_async::MemoryRegion) {
        self.registry().insert(region);
    }
}

#[pymethods]
impl PyEngine {
    /// Builds an engine and starts its reactor thread.
    ///
    /// `provider`: "tcp" (default, or `FABRIC_PROVIDER`), "shm", "udp", "verbs", "verbs:DEV".
    /// `mode`: "event" (sleeps when idle; the default), "adaptive" (spins `spin` seconds after
    /// activity), "busy_poll" (spins a core, `pin_core`), "inline" (awaiting drives the NICs).
    /// `profile`: "low_cpu", "balanced" or "low_latency" sets the mode and the latency options
    /// together (`LatencyProfile`; a `mode` given beside it wins); `stats()["settings"]` says
    /// what the engine runs with.
    /// `nics`: NIC names; `domains`: N domains of the provider (loopback testing).
    /// `op_timeout`: seconds an operation may go without completing (None: forever).
    /// `cuda_ipc`: False makes writes into GPU memory of a process on this host take the
    /// region's NIC path (GPUDirect or staged) instead of CUDA IPC (`docs/gpu.md`).
    #[new]
    #[pyo3(signature = (provider=None, mode=None, *, profile=None, nics=None, domains=None, op_timeout=Some(30.0),
                        spin=None, pin_core=None, node=None, huge_pages=None, max_counters=None,
                        max_msg_size=None, cuda_ipc=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        provider: Option<String>,
        mode: Option<&str>,
        profile: Option<&str>,
        nics: Option<Vec<String>>,
        domains: Option<usize>,
        op_timeout: Option<f64>,
        spin: Option<f64>,
        pin_core: Option<usize>,
        node: Option<String>,
        huge_pages: Option<bool>,
        max_counters: Option<usize>,
        max_msg_size: Option<usize>,
        cuda_ipc: Option<bool>,
    ) -> PyResult<Self> {
        let mut b = Engine::builder();
        if let Some(p) = profile {
            b = b.latency_profile(match p {
                "low_cpu" => LatencyProfile::LowCpu,
                "balanced" => LatencyProfile::Balanced,
                "low_latency" => LatencyProfile::LowLatency,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "unknown profile {other:?}: \"low_cpu\", \"balanced\" or \"low_latency\""
                    )))
                }
            });
        }
        // A mode given with a profile overrides the profile's.
        if mode.is_some() || profile.is_none() {
            b = b.mode(self::mode(mode.unwrap_or("event"), spin)?);
        }
        if let Some(p) = provider {
            b = b.provider(p);
        }
        if let Some(n) = nics {
            b = b.nics(n);
        }
        if let Some(d) = domains {
            b = b.domains(d);
        }
        b = b.op_timeout(op_timeout.map(|s| seconds("op_timeout", s)).transpose()?);
        if let Some(c) = pin_core {
            b = b.pin_core(c);
        }
        if let Some(n) = node {
            b = b.node(n);
        }
        if let Some(h) = huge_pages {
            b = b.huge_pages(h);
        }
        if let Some(m) = max_counters {
            b = b.max_counters(m);
        }
        if let Some(m) = max_msg_size {
            b = b.messages(m, 64);
        }
        if let Some(on) = cuda_ipc {
            b = b.cuda_ipc(on);
        }
        let engine = py.detach(|| b.build()).py_err()?;
        Ok(PyEngine { engine: ManuallyDrop::new(engine), registry: Mutex::default() })
    }

    /// This engine's address: bytes for a peer's `add_peer`.
    #[getter]
    fn address<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.engine.address())
    }

    /// The transport every NIC speaks (e.g. "tcp;ofi_rxm").
    #[getter]
    fn transport(&self) -> String {
        self.engine.transport().to_string()
    }

    /// How many NICs the engine drives.
    #[getter]
    fn nics(&self) -> usize {
        self.engine.nics()
    }

    /// The largest message `send` accepts.
    #[getter]
    fn max_msg_size(&self) -> usize {
        self.engine.max_msg_size()
    }

    /// Makes the engine at `address` a peer; the result is its id (int).
    fn add_peer(&self, address: Vec<u8>) -> Pending {
        let e = (*self.engine).clone();
        pending(async move { e.add_peer(&address).await.map(|p| p.0) }, int)
    }

    /// Removes a peer: its waiting operations fail with `PeerUnreachable`.
    fn remove_peer(&self, peer: u32) -> Pending {
        let e = (*self.engine).clone();
        pending(async move { e.remove_peer(PeerId(peer)).await }, none)
    }

    /// Peer changes as an async iterator of `PeerEvent` (current state first).
    fn peer_events(&self) -> PyPeerEvents {
        PyPeerEvents { events: std::sync::Arc::new(futures::lock::Mutex::new(self.engine.peer_events())) }
    }

    /// A snapshot of the engine's statistics as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::stats::to_dict(py, &self.engine.stats())
    }

    /// Allocates and registers `n` zeroed bytes: host memory, or `device="cuda:N"` (raises
    /// `Unsupported` without a CUDA driver). Blocks (GIL released) for the registration.
    #[pyo3(signature = (n, device=None))]
    fn alloc(&self, py: Python<'_>, n: usize, device: Option<&str>) -> PyResult<Py<PyAny>> {
        let location = parse_device(device)?;
        let e = (*self.engine).clone();
        let p = pending(async move { e.alloc_in(n, location).await }, |py, region| {
            Ok(Py::new(py, Region::whole(region, None))?.into_any())
        });
        let region = p.wait(py, None)?;
        if location == MemoryLocation::Host {
            self.remember(&region.bind(py).cast::<Region>()?.get().region);
        }
        Ok(region)
    }

    /// Registers `obj`'s memory in place, without copying: any writable, contiguous
    /// buffer-protocol object (bytearray, numpy array), a torch tensor (CPU or CUDA), an
    /// object with `__cuda_array_interface__` (CuPy, Numba), or a DLPack tensor
    /// (`__dlpack__`: JAX, TensorFlow, ...). The object is kept alive (a
    /// host buffer also pinned: not resizable) until the region and every operation that
    /// uses it are gone. Blocks (GIL released) for the registration.
    ///
    /// Host memory that lies inside a live registration of this engine (a slice of a
    /// registered array, a view of a registered pool) becomes a view of it: a range lookup,
    /// no new registration (`Region.is_view`).
    fn register(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let keep = obj.clone().unbind();
        // A buffer-protocol object inside a registration: a view, found before anything else.
        if let Some((ptr, len)) = host_range(obj)? {
            if let Some((region, base)) = self.registry().find(ptr, len as u64) {
                return Ok(Py::new(py, Region { region, obj: Some(keep), base, len: len as u64 })?.into_any());
            }
        }
        let e = (*self.engine).clone();
        match memory_of(obj)? {
            Memory::Host(buf) => {
                let (ptr, len, view) = (buf.ptr, buf.len, buf.view);
                if let Some((region, base)) = self.registry().find(ptr, len as u64) {
                    let r = Region { region, obj: Some(keep), base, len: len as u64 };
                    return Ok(Py::new(py, r)?.into_any());
                }
                // SAFETY: `view` is a memoryview holding the object's buffer export: the
                // `len` bytes at `ptr` stay allocated and in place (the exporter refuses to
                // resize or free them) until it is released, which only its drop does, after
                // the engine closed the registration. It was checked writable and contiguous.
                let fut = async move { unsafe { e.register_host(ptr, len, view) }.await };
                let done = move |py: Python<'_>, region| {
                    Ok(Py::new(py, Region::whole(region, Some(keep)))?.into_any())
                };
                let region = pending(fut, done).wait(py, None)?;
                self.remember(&region.bind(py).cast::<Region>()?.get().region);
                Ok(region)
            }
            Memory::Cuda(buf) => {
                let CudaBuffer { ptr, len, ordinal, owner } = buf;
                // SAFETY: `owner` holds a reference to the object (for a torch tensor also to
                // its storage), and device memory is freed only when its last reference goes
                // (torch, CuPy and Numba free, or return to their caching allocator, on
                // deallocation of the storage/array object): `ptr..+len` stays allocated while
                // `owner` lives. The engine drops it only after closing every registration
                // and finishing every operation on it. The range is checked against the
                // driver's allocation before anything is registered.
                let fut = async move { unsafe { e.register_cuda_owned(ptr, len, ordinal, owner) }.await };
                let done = move |py: Python<'_>, region| {
                    Ok(Py::new(py, Region::whole(region, Some(keep)))?.into_any())
                };
                pending(fut, done).wait(py, None)
            }
        }
    }

    /// A peer's region from its descriptor bytes, adding the owner as a peer if needed.
    fn remote_region(&self, descriptor: Vec<u8>) -> Pending {
        let e = (*self.engine).clone();
        pending(async move { e.remote_region(&descriptor).await }, |py, remote| {
            Ok(Py::new(py, PyRemoteRegion { remote })?.into_any())
        })
    }

    /// The arrival counter of immediate `imm`.
    fn imm_counter(&self, imm: u32) -> PyImmCounter {
        PyImmCounter { counter: self.engine.imm_counter(imm), engine: (*self.engine).clone() }
    }

    /// Retires the counter of `imm`; the result is how many arrivals it discarded.
    fn retire_counter(&self, imm: u32) -> Pending {
        let e = (*self.engine).clone();
        pending(async move { e.retire_counter(imm).await }, int)
    }

    /// Writes `n` bytes of `src` at `src_off` into `dst` at `dst_off`. `after`: a CUDA
    /// stream (or `torch.cuda.Event`) the transfer waits for: it starts once the stream has
    /// reached this point (the kernels that fill `src` are done), and nothing on this thread
    /// synchronizes.
    #[pyo3(signature = (src, src_off, dst, dst_off, n, *, after=None))]
    fn write(
        &self,
        src: PyRef<'_, Region>,
        src_off: u64,
        dst: PyRef<'_, PyRemoteRegion>,
        dst_off: u64,
        n: u64,
        after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Pending> {
        let src_off = src.at(src_off, n)?;
        Ok(match after {
            None => pending(self.engine.write(&src.region, src_off, &dst.remote, dst_off, n), none),
            Some(a) => {
                let ev = crate::streams::after_point(a, ordinal_of(&src))?;
                pending(self.engine.after(&ev).write(&src.region, src_off, &dst.remote, dst_off, n), none)
            }
        })
    }

    /// Like `write`, and the target counts arrivals of `imm` once the bytes have landed
    /// (`write_arrivals` says how many: one with one NIC).
    /// `after` as for `write`.
    #[pyo3(signature = (src, src_off, dst, dst_off, n, imm, *, after=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_imm(
        &self,
        src: PyRef<'_, Region>,
        src_off: u64,
        dst: PyRef<'_, PyRemoteRegion>,
        dst_off: u64,
        n: u64,
        imm: u32,
        after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Pending> {
        let src_off = src.at(src_off, n)?;
        Ok(match after {
            None => pending(self.engine.write_imm(&src.region, src_off, &dst.remote, dst_off, n, imm), none),
            Some(a) => {
                let ev = crate::streams::after_point(a, ordinal_of(&src))?;
                let t = self.engine.after(&ev);
                pending(t.write_imm(&src.region, src_off, &dst.remote, dst_off, n, imm), none)
            }
        })
    }

    /// An imm-only write: no bytes, one arrival of `imm` at the owner of `dst`.
    fn imm(&self, dst: PyRef<'_, PyRemoteRegion>, imm: u32) -> Pending {
        pending(self.engine.imm(&dst.remote, imm), none)
    }

    /// Reads `n` bytes of the remote `src` at `src_off` into the local `dst` at `dst_off`.
    fn read(
        &self,
        dst: PyRef<'_, Region>,
        dst_off: u64,
        src: PyRef<'_, PyRemoteRegion>,
        src_off: u64,
        n: u64,
    ) -> PyResult<Pending> {
        let dst_off = dst.at(dst_off, n)?;
        Ok(pending(self.engine.read(&dst.region, dst_off, &src.remote, src_off, n), none))
    }

    /// Arrivals of `imm` that `write_imm` of `n` bytes into `dst` makes at its owner.
    fn write_arrivals(&self, dst: PyRef<'_, PyRemoteRegion>, n: u64) -> PyResult<u64> {
        self.engine.write_arrivals(&dst.remote, n).py_err()
    }

    /// Arrivals of `imm` that `write_paged` of `pages` pages into `dst` makes.
    fn paged_arrivals(&self, dst: PyRef<'_, PyRemoteRegion>, pages: usize) -> PyResult<u64> {
        self.engine.paged_arrivals(&dst.remote, pages).py_err()
    }

    /// Writes pages `src_pages[i]` of `src` into pages `dst_pages[i]` of `dst` (`layout`
    /// gives the geometry), with arrivals of `imm` if given; `after` as for `write`.
    #[pyo3(signature = (src, dst, layout, src_pages, dst_pages, imm=None, *, after=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_paged(
        &self,
        src: PyRef<'_, Region>,
        dst: PyRef<'_, PyRemoteRegion>,
        layout: PyRef<'_, PyPageLayout>,
        src_pages: Vec<u32>,
        dst_pages: Vec<u32>,
        imm: Option<u32>,
        after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Pending> {
        let mut geometry = layout.layout;
        if src.view() {
            // Every source page inside the view, then the pages as the registration's.
            if let Some(&last) = src_pages.iter().max() {
                let end = u64::from(last)
                    .checked_mul(geometry.src_stride)
                    .and_then(|o| o.checked_add(geometry.src_offset))
                    .unwrap_or(u64::MAX);
                src.at(end, geometry.page_len)?;
            }
            geometry.src_offset += src.base;
        }
        Ok(match after {
            None => pending(
                self.engine.write_paged(&src.region, &dst.remote, &geometry, &src_pages, &dst_pages, imm),
                none,
            ),
            Some(a) => {
                let ev = crate::streams::after_point(a, ordinal_of(&src))?;
                let t = self.engine.after(&ev);
                pending(t.write_paged(&src.region, &dst.remote, &geometry, &src_pages, &dst_pages, imm), none)
            }
        })
    }

    /// A group of peers' regions for `scatter` and `barrier`.
    fn peer_group(&self, members: Vec<PyRef<'_, PyRemoteRegion>>) -> PyResult<PyPeerGroup> {
        let members = members.iter().map(|m| m.remote.clone()).collect();
        Ok(PyPeerGroup { group: self.engine.peer_group(members).py_err()? })
    }

    /// Writes pieces of `src` to members of `group`: `entries` is a list of
    /// `(member, src_off, dst_off, n)`; each member counts arrivals of `imm` if given.
    #[pyo3(signature = (src, group, entries, imm=None))]
    fn scatter(
        &self,
        src: PyRef<'_, Region>,
        group: PyRef<'_, PyPeerGroup>,
        entries: Vec<(usize, u64, u64, u64)>,
        imm: Option<u32>,
    ) -> PyResult<Pending> {
        let mut entries = scatter_entries(&entries);
        for e in &mut entries {
            e.src_off = src.at(e.src_off, e.len)?;
        }
        Ok(pending(self.engine.scatter(&src.region, &group.group, &entries, imm), none))
    }

    /// Many writes as one transfer: `entries` is a list of `(src, src_off, dst, dst_off, n)`
    /// (local `Region`s, peers' `RemoteRegion`s, any mix of them: a model's per-layer
    /// tensors, its parameters), posted as one batch; entries that continue each other on
    /// both sides are merged. With `imm`, once every byte has landed, each peer written to
    /// counts **one** arrival of `imm`, whatever the entries, sizes and NICs:
    /// `counter.wait_for(1)` at each receiver. Everything is checked before anything is
    /// posted. Host memory and GPU memory the NICs reach directly (see `Region.gpu_path`).
    #[pyo3(signature = (entries, imm=None))]
    fn write_many(&self, entries: Vec<ManyEntry<'_>>, imm: Option<u32>) -> PyResult<Pending> {
        self.many(BatchOp::Write, &entries, imm)
    }

    /// Many reads as one transfer: `entries` is a list of `(dst, dst_off, src, src_off, n)`,
    /// a local `Region` filled from a peer's `RemoteRegion` each; as `write_many`, without
    /// immediates.
    fn read_many(&self, entries: Vec<ManyEntry<'_>>) -> PyResult<Pending> {
        self.many(BatchOp::Read, &entries, None)
    }

    /// Arrivals of `imm` that `scatter` with `entries` makes at each member.
    fn scatter_arrivals(
        &self,
        group: PyRef<'_, PyPeerGroup>,
        entries: Vec<(usize, u64, u64, u64)>,
    ) -> PyResult<Vec<u64>> {
        self.engine.scatter_arrivals(&group.group, &scatter_entries(&entries)).py_err()
    }

    /// One imm-only write of `imm` to every member of `group`.
    fn barrier(&self, group: PyRef<'_, PyPeerGroup>, imm: u32) -> Pending {
        pending(self.engine.barrier(&group.group, imm), none)
    }

    /// Sends a small message (at most `max_msg_size` bytes, copied) to `peer`.
    fn send(&self, peer: u32, msg: &Bound<'_, PyAny>) -> PyResult<Pending> {
        let msg: Vec<u8> = if let Ok(b) = msg.cast::<PyBytes>() {
            b.as_bytes().to_vec()
        } else {
            let b = pyo3::buffer::PyUntypedBuffer::get(msg)
                .map_err(|_| PyTypeError::new_err("msg must be bytes or a bytes-like object"))?;
            // SAFETY: the export holds `len_bytes` readable bytes at `buf_ptr` until `b` is
            // released, after the copy.
            let v = unsafe { std::slice::from_raw_parts(b.buf_ptr() as *const u8, b.len_bytes()) }.to_vec();
            b.release(msg.py());
            v
        };
        Ok(pending(self.engine.send(PeerId(peer), &msg), none))
    }

    /// The next message from any peer: `(peer or None, bytes)`.
    fn recv(&self) -> Pending {
        pending(self.engine.recv(), message)
    }

    /// The next message from `peer`: `(peer, bytes)`; raises `PeerUnreachable` once the
    /// peer is down.
    fn recv_from(&self, peer: u32) -> Pending {
        pending(self.engine.recv_from(PeerId(peer)), message)
    }

    /// Whether awaiting drives the NICs on the awaiting thread (mode "inline").
    #[getter]
    fn is_inline(&self) -> bool {
        self.engine.is_inline()
    }

    /// Stops the engine: later operations raise `Shutdown`.
    fn shutdown(&self) {
        self.engine.shutdown();
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(&self, _t: &Bound<'_, PyAny>, _v: &Bound<'_, PyAny>, _tb: &Bound<'_, PyAny>) {
        self.engine.shutdown();
    }

    fn __repr__(&self) -> String {
        format!("<fabric_rdma.Engine {} nics={}>", self.engine.transport(), self.engine.nics())
    }
}

fn message(py: Python<'_>, (peer, data): (Option<PeerId>, Bytes)) -> PyResult<Py<PyAny>> {
    let data = bytes_of(py, data)?;
    Ok((peer.map(|p| p.0), data).into_pyobject(py)?.into_any().unbind())
}

/// The device an `after=` stream handle given as an int belongs to: the source's.
fn ordinal_of(src: &Region) -> u32 {
    match src.region.location() {
        MemoryLocation::Cuda { ordinal } => ordinal,
        _ => 0,
    }
}

fn scatter_entries(e: &[(usize, u64, u64, u64)]) -> Vec<ScatterEntry> {
    e.iter().map(|&(member, src_off, dst_off, len)| ScatterEntry { member, src_off, dst_off, len }).collect()
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        // SAFETY: taken once, here; nothing uses the field after `drop`.
        let engine = unsafe { ManuallyDrop::take(&mut self.engine) };
        // The last handle waits for the reactor thread to stop (in-flight operations get
        // `shutdown_grace`): let other Python threads run meanwhile.
        // Without a thread state (interpreter finalizing), the closure is dropped unrun and
        // the engine with it.
        let _ = Python::try_attach(move |py| py.detach(move || drop(engine)));
    }
}
