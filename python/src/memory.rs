//! Regions as Python objects: local ones (`Region`: the engine's memory from `alloc`, or a
//! buffer the program owns, registered in place), remote ones (`RemoteRegion`, from a
//! peer's descriptor bytes), and the page geometry of paged writes.
//!
//! Registering a buffer-protocol object (`bytearray`, a NumPy array, a CPU torch tensor,
//! whose bytes are reached through `numpy()`) takes a `memoryview` of it: the view holds the object's buffer export,
//! which pins it (a `bytearray` cannot be resized, a NumPy array cannot be resized or freed)
//! for as long as the view lives. The view is the owner handed to
//! `Engine::register_host`, so it lives until the engine has closed every registration of
//! the memory: after the `Region` and every operation that uses it are gone, whatever
//! happens to the Python names of the object meanwhile (`del arr` while a write from it is
//! in flight is fine). The engine's reactor thread drops it without the GIL; PyO3 then
//! defers the decref to the next time Python code of this module runs.
//!
//! CUDA memory (a torch CUDA tensor, any `__cuda_array_interface__` object) is registered
//! in place the same way through `Engine::register_cuda_owned`, the owner being the object
//! (and, for a tensor, its storage): nothing pins device memory as a buffer export does, so
//! the owner is what keeps it allocated until the engine has let go of it.

use std::ffi::c_int;

use fabric_async::{MemoryLocation, MemoryRegion, PageLayout, RemoteRegion};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyMemoryView, PyTuple};
use pyo3::{ffi, PyErr};

use crate::errors::IntoPy;

/// Host memory of a Python object, pinned by the memoryview that owns its export (or, for a
/// DLPack tensor, kept by the object and its capsule).
pub(crate) struct HostBuffer {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    /// The memoryview (or the DLPack object and capsule); the owner of the registration.
    pub(crate) view: Py<PyAny>,
}

/// Pins `obj`'s buffer and says where it is. Refuses read-only objects (`bytes`: peers
/// write into registered memory) and non-contiguous ones (a region is one range).
pub(crate) fn host_buffer(obj: &Bound<'_, PyAny>) -> PyResult<HostBuffer> {
    let py = obj.py();
    let view = PyMemoryView::from(obj).map_err(|e| {
        PyTypeError::new_err(format!(
            "cannot register a {}: not a buffer-protocol object ({e})",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    let buf = PyUntypedBuffer::get(view.as_any())?;
    let (ptr, len, readonly, contiguous) =
        (buf.buf_ptr() as u64, buf.len_bytes(), buf.readonly(), buf.is_c_contiguous());
    buf.release(py);
    if readonly {
        return Err(PyTypeError::new_err(
            "cannot register a read-only buffer (peers write into registered memory): use a bytearray or a writable array",
        ));
    }
    if !contiguous {
        return Err(PyValueError::new_err(
            "cannot register a non-contiguous buffer: a region is one range (numpy.ascontiguousarray)",
        ));
    }
    Ok(HostBuffer { ptr, len, view: view.into_any().unbind() })
}

/// Where a buffer-protocol object's bytes are (`None`: not one, e.g. a torch tensor or a CUDA
/// array), with the checks of [`host_buffer`], through one short-lived buffer export and no
/// memoryview: what `Engine.register` needs to find the registration a view lies in.
pub(crate) fn host_range(obj: &Bound<'_, PyAny>) -> PyResult<Option<(u64, usize)>> {
    // SAFETY: `obj` is a live object (the GIL is held); the call only reads its type's slots.
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 0 {
        return Ok(None);
    }
    let buf = PyUntypedBuffer::get(obj)?;
    let (ptr, len, readonly, contiguous) =
        (buf.buf_ptr() as u64, buf.len_bytes(), buf.readonly(), buf.is_c_contiguous());
    buf.release(obj.py());
    if readonly || !contiguous || len == 0 {
        return Ok(None); // host_buffer says why
    }
    Ok(Some((ptr, len)))
}

/// Device memory of a Python object and what keeps it allocated.
pub(crate) struct CudaBuffer {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) ordinal: u32,
    /// The object (a tensor: with its storage), handed to `Engine::register_cuda_owned`.
    pub(crate) owner: Py<PyAny>,
}

/// The memory `Engine.register` registers for an object.
pub(crate) enum Memory {
    Host(HostBuffer),
    Cuda(CudaBuffer),
}

/// Where `obj`'s memory is: a torch tensor (CUDA: its device memory; CPU: its bytes through
/// `numpy()`), an object with `__cuda_array_interface__`, the buffer protocol, else a
/// DLPack tensor (`__dlpack__`: JAX, CuPy, TensorFlow, ...).
/// Refuses non-contiguous tensors and arrays (`ValueError`) and read-only CUDA arrays
/// (`TypeError`), as for host buffers.
pub(crate) fn memory_of(obj: &Bound<'_, PyAny>) -> PyResult<Memory> {
    let py = obj.py();
    // A torch tensor can only exist if torch is imported: no import here.
    let torch = py.import("sys")?.getattr("modules")?.get_item("torch").ok();
    if let Some(torch) = torch {
        if obj.is_instance(&torch.getattr("Tensor")?)? {
            return tensor_memory(&torch, obj);
        }
    }
    if obj.hasattr("__cuda_array_interface__")? {
        return cuda_array_memory(obj).map(Memory::Cuda);
    }
    // SAFETY: `obj` is a live object (the GIL is held); the call only reads its type's slots.
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 0 && obj.hasattr("__dlpack__")? {
        return dlpack_memory(obj);
    }
    host_buffer(obj).map(Memory::Host)
}

/// A DLPack tensor's memory (`dlpack.rs`), owned by the object and its capsule.
fn dlpack_memory(obj: &Bound<'_, PyAny>) -> PyResult<Memory> {
    let py = obj.py();
    let e = crate::dlpack::export(obj)?;
    let owner = PyTuple::new(py, [obj.clone().unbind(), e.capsule])?.into_any().unbind();
    Ok(match e.location {
        crate::dlpack::DlMemory::Host => Memory::Host(HostBuffer { ptr: e.ptr, len: e.len, view: owner }),
        crate::dlpack::DlMemory::Cuda { ordinal } => {
            Memory::Cuda(CudaBuffer { ptr: e.ptr, len: e.len, ordinal, owner })
        }
    })
}

fn tensor_memory(torch: &Bound<'_, PyAny>, t: &Bound<'_, PyAny>) -> PyResult<Memory> {
    let py = t.py();
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err(
            "cannot register a non-contiguous tensor: a region is one range (tensor.contiguous() makes a copy)",
        ));
    }
    let device = t.getattr("device")?;
    let kind: String = device.getattr("type")?.extract()?;
    let len =
        t.call_method0("numel")?.extract::<usize>()? * t.call_method0("element_size")?.extract::<usize>()?;
    match kind.as_str() {
        "cuda" => {
            let ordinal: Option<u32> = device.getattr("index")?.extract()?;
            let ptr: u64 = t.call_method0("data_ptr")?.extract()?;
            // The storage too: it keeps the memory even if the tensor is later pointed at
            // other memory (`set_`).
            let storage = t.call_method0("untyped_storage")?;
            let owner = PyTuple::new(py, [t.clone(), storage])?.into_any().unbind();
            Ok(Memory::Cuda(CudaBuffer { ptr, len, ordinal: ordinal.unwrap_or(0), owner }))
        }
        "cpu" => {
            // Bytes of any dtype (bfloat16 has no NumPy type): a flat uint8 view, whose
            // array keeps the tensor (and its storage) alive.
            let flat = t.call_method0("detach")?.call_method1("reshape", (-1,))?;
            let bytes = flat.call_method1("view", (torch.getattr("uint8")?,))?.call_method0("numpy")?;
            let buf = host_buffer(&bytes)?;
            if buf.len != len {
                return Err(PyValueError::new_err(format!(
                    "the tensor's numpy() view has {} bytes, not {len}",
                    buf.len
                )));
            }
            Ok(Memory::Host(buf))
        }
        other => Err(PyTypeError::new_err(format!(
            "cannot register a tensor on device {other:?}: CPU and CUDA tensors only"
        ))),
    }
}

/// `__cuda_array_interface__` (versions 2 and 3): C-contiguous, writable; the device is
/// the one the driver says the pointer belongs to.
fn cuda_array_memory(obj: &Bound<'_, PyAny>) -> PyResult<CudaBuffer> {
    let cai = obj.getattr("__cuda_array_interface__")?;
    let cai =
        cai.cast::<PyDict>().map_err(|_| PyTypeError::new_err("__cuda_array_interface__ is not a dict"))?;
    let need = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(k)?.ok_or_else(|| PyTypeError::new_err(format!("__cuda_array_interface__ has no {k:?}")))
    };
    let (ptr, readonly): (u64, bool) = need("data")?.extract()?;
    if readonly {
        return Err(PyTypeError::new_err(
            "cannot register read-only CUDA memory (peers write into registered memory)",
        ));
    }
    if cai.get_item("mask")?.is_some_and(|m| !m.is_none()) {
        return Err(PyValueError::new_err("cannot register a masked CUDA array"));
    }
    let shape: Vec<usize> = need("shape")?.extract()?;
    let typestr: String = need("typestr")?.extract()?;
    let itemsize: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| PyValueError::new_err(format!("unknown typestr {typestr:?}")))?;
    let strides: Option<Vec<isize>> = match cai.get_item("strides")? {
        Some(s) if !s.is_none() => Some(s.extract()?),
        _ => None,
    };
    if let Some(strides) = strides {
        // C order: the last dimension moves by one item, each other by the product of
        // the sizes after it (dimensions of size 1 may have any stride).
        let mut want = itemsize as isize;
        for (&n, &st) in shape.iter().zip(&strides).rev() {
            if n > 1 && st != want {
                return Err(PyValueError::new_err(
                    "cannot register a non-contiguous CUDA array: a region is one range",
                ));
            }
            want *= n as isize;
        }
    }
    let len = shape.iter().product::<usize>() * itemsize;
    let info = fabric_async::cuda::pointer_info(ptr).py_err()?;
    let ordinal = info.ordinal.and_then(|o| u32::try_from(o).ok()).unwrap_or(0);
    Ok(CudaBuffer { ptr, len, ordinal, owner: obj.clone().unbind() })
}

/// Memory registered with every NIC of an engine: from `Engine.alloc` (the engine's own,
/// zeroed) or `Engine.register` (an object of yours, in place).
///
/// Its bytes: the buffer protocol (`memoryview(region)`, `numpy.frombuffer(region, dtype)`;
/// host memory only), `read`/`write`, or the registered object itself. Peers write into it
/// at any time: read what a counter wait says has landed.
///
/// A region may be a **view**: `Engine.register` of memory that lies inside a live
/// registration of host memory (a slice of a registered array, a view of a pool) returns
/// the range of that registration, with no new NIC registration. Offsets are the view's
/// own (0 is its first byte), its descriptor names its range alone, and it keeps the
/// registration it lies in alive.
#[pyclass(module = "fabric_rdma", name = "Region", frozen)]
pub struct Region {
    /// The registration (the whole of it, for a view).
    pub(crate) region: MemoryRegion,
    /// The object registered in place, if any.
    pub(crate) obj: Option<Py<PyAny>>,
    /// Where this region starts in `region`, and its length (`0, region.len()` unless a view).
    pub(crate) base: u64,
    pub(crate) len: u64,
}

impl Region {
    /// The whole of a registration.
    pub(crate) fn whole(region: MemoryRegion, obj: Option<Py<PyAny>>) -> Self {
        let len = region.len() as u64;
        Region { region, obj, base: 0, len }
    }

    /// Whether this region is a range of a larger registration.
    pub(crate) fn view(&self) -> bool {
        self.base != 0 || self.len != self.region.len() as u64
    }

    /// `n` bytes at `off` of this region, as an offset in the registration; `OutOfBounds`
    /// (in this region's terms) if they do not fit.
    pub(crate) fn at(&self, off: u64, n: u64) -> PyResult<u64> {
        if off.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(fabric_async::Error::OutOfBounds {
                side: fabric_async::Side::Local,
                offset: off,
                len: n,
                region_len: self.len,
            })
            .py_err();
        }
        Ok(self.base + off)
    }
}

#[pymethods]
impl Region {
    fn __len__(&self) -> usize {
        self.len as usize
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len as usize
    }

    /// The descriptor peers need to reach this region (`Engine.remote_region`), as bytes;
    /// a view's names its range alone.
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let d = self.region.descriptor();
        let d = if self.view() { d.narrow(self.base, self.len).py_err()? } else { d };
        Ok(PyBytes::new(py, &d.to_bytes()))
    }

    /// Start address (a device address for GPU memory).
    #[getter]
    fn address(&self) -> u64 {
        self.region.as_ptr() as u64 + self.base
    }

    /// Whether this region is a view: a range of an earlier registration that contains it
    /// (`Engine.register` of memory already registered), with no registration of its own.
    #[getter]
    fn is_view(&self) -> bool {
        self.view()
    }

    /// `"host"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        location_name(self.region.location())
    }

    /// GPU memory: how the NICs reach it, `"gpudirect"` or `"staged"` (`docs/gpu.md`);
    /// None for host memory.
    #[getter]
    fn gpu_path(&self) -> Option<String> {
        self.region.gpu_path().map(|p| p.to_string())
    }

    /// The object registered in place (`Engine.register`), or None for `alloc`'s memory.
    #[getter]
    fn obj(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.obj.as_ref().map(|o| o.clone_ref(py))
    }

    /// A copy of `n` bytes at `offset` (to the end by default).
    #[pyo3(signature = (offset=0, n=None))]
    fn read<'py>(&self, py: Python<'py>, offset: u64, n: Option<u64>) -> PyResult<Bound<'py, PyBytes>> {
        let n = n.unwrap_or_else(|| self.len.saturating_sub(offset));
        let at = self.at(offset, n)?;
        let mut buf = vec![0u8; usize::try_from(n).map_err(|_| PyValueError::new_err("n too large"))?];
        self.region.read_at(at, &mut buf).py_err()?;
        Ok(PyBytes::new(py, &buf))
    }

    /// Copies `data` (any bytes-like object) into the region at `offset`.
    #[pyo3(signature = (offset, data))]
    fn write(&self, offset: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = PyUntypedBuffer::get(data)?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("data must be a contiguous buffer"));
        }
        // SAFETY: the export holds `len_bytes` readable bytes at `buf_ptr` until `buf` is
        // released, which is after the copy; the slice is only read.
        let bytes = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
        let r = self.at(offset, bytes.len() as u64).and_then(|at| self.region.write_at(at, bytes).py_err());
        buf.release(data.py());
        r
    }

    /// The buffer protocol over host memory: writable, one dimension of bytes.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let r = slf.get();
        if r.region.location() != MemoryLocation::Host {
            return Err(PyBufferError::new_err("GPU memory has no host buffer"));
        }
        let len = isize::try_from(r.len).map_err(|_| PyBufferError::new_err("region too large"))?;
        let ptr = r.region.as_ptr().wrapping_add(r.base as usize) as *mut _;
        // SAFETY: `view` is the exporter's `Py_buffer` that Python passes in; the memory is
        // `len` bytes of host memory at `base` in the registration (`base + len` is within it),
        // which stays registered and allocated while `slf` lives, and `PyBuffer_FillInfo`
        // takes a reference to `slf` for the view's lifetime.
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, len, 0, flags) };
        if rc < 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __repr__(&self) -> String {
        format!(
            "<fabric_rdma.Region {} bytes of {} at {:#x}{}>",
            self.len,
            location_name(self.region.location()),
            self.region.as_ptr() as u64 + self.base,
            if self.view() {
                ", a view of a registration"
            } else if self.obj.is_some() {
                ", registered in place"
            } else {
                ""
            }
        )
    }
}

pub(crate) fn location_name(l: MemoryLocation) -> String {
    match l {
        MemoryLocation::Cuda { ordinal } => format!("cuda:{ordinal}"),
        _ => "host".into(),
    }
}

/// `"cpu"`/`"host"`/None → host, `"cuda"`/`"cuda:N"` → device N.
pub(crate) fn parse_device(device: Option<&str>) -> PyResult<MemoryLocation> {
    match device {
        None | Some("host") | Some("cpu") => Ok(MemoryLocation::Host),
        Some("cuda") => Ok(MemoryLocation::Cuda { ordinal: 0 }),
        Some(d) => match d.strip_prefix("cuda:").map(str::parse::<u32>) {
            Some(Ok(ordinal)) => Ok(MemoryLocation::Cuda { ordinal }),
            _ => {
                Err(PyValueError::new_err(format!("unknown device {d:?}: \"host\", \"cuda\" or \"cuda:N\"")))
            }
        },
    }
}

/// A peer's region, from its descriptor bytes (`Engine.remote_region`).
#[pyclass(module = "fabric_rdma", name = "RemoteRegion", frozen)]
pub struct PyRemoteRegion {
    pub(crate) remote: RemoteRegion,
}

#[pymethods]
impl PyRemoteRegion {
    fn __len__(&self) -> usize {
        self.remote.len() as usize
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.remote.len()
    }

    /// The peer that owns it (an id of this engine).
    #[getter]
    fn peer(&self) -> u32 {
        self.remote.peer().0
    }

    /// Whether its owner has freed it (operations through it raise `Stale`).
    #[getter]
    fn is_revoked(&self) -> bool {
        self.remote.is_revoked()
    }

    /// GPU memory: the path a write from this engine takes, `"cuda-ipc"` (a process on
    /// this host), `"gpudirect"` or `"staged"`; None for host memory.
    #[getter]
    fn gpu_path(&self) -> Option<String> {
        self.remote.gpu_path().map(|p| p.to_string())
    }

    /// The descriptor bytes.
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.remote.descriptor().to_bytes())
    }

    fn __repr__(&self) -> String {
        format!("<fabric_rdma.RemoteRegion {} bytes of peer {}>", self.remote.len(), self.remote.peer().0)
    }
}

/// The page geometry of a paged write (KV-cache blocks): page `p` of the source starts at
/// `src_offset + p * src_stride`, page `q` of the destination at `dst_offset + q * dst_stride`,
/// and each page moves `page_len` bytes. Strides default to `page_len` (packed pages).
#[pyclass(module = "fabric_rdma", name = "PageLayout", frozen, eq)]
#[derive(PartialEq)]
pub struct PyPageLayout {
    pub(crate) layout: PageLayout,
}

#[pymethods]
impl PyPageLayout {
    #[new]
    #[pyo3(signature = (page_len, src_stride=None, dst_stride=None, src_offset=0, dst_offset=0))]
    fn new(
        page_len: u64,
        src_stride: Option<u64>,
        dst_stride: Option<u64>,
        src_offset: u64,
        dst_offset: u64,
    ) -> Self {
        let mut layout = PageLayout::packed(page_len);
        layout.src_stride = src_stride.unwrap_or(page_len);
        layout.dst_stride = dst_stride.unwrap_or(page_len);
        layout.src_offset = src_offset;
        layout.dst_offset = dst_offset;
        PyPageLayout { layout }
    }

    #[getter]
    fn page_len(&self) -> u64 {
        self.layout.page_len
    }
    #[getter]
    fn src_stride(&self) -> u64 {
        self.layout.src_stride
    }
    #[getter]
    fn dst_stride(&self) -> u64 {
        self.layout.dst_stride
    }
    #[getter]
    fn src_offset(&self) -> u64 {
        self.layout.src_offset
    }
    #[getter]
    fn dst_offset(&self) -> u64 {
        self.layout.dst_offset
    }

    fn __repr__(&self) -> String {
        let l = &self.layout;
        format!(
            "PageLayout(page_len={}, src_stride={}, dst_stride={}, src_offset={}, dst_offset={})",
            l.page_len, l.src_stride, l.dst_stride, l.src_offset, l.dst_offset
        )
    }
}
