//! DLPack (`__dlpack__`): the memory of a tensor of any framework that exports one (JAX,
//! CuPy, TensorFlow, PaddlePaddle, MLX, NumPy), for `Engine.register`.
//!
//! The object's `__dlpack__()` gives a capsule named `"dltensor"` that points at a
//! `DLManagedTensor`: the tensor (data pointer, device, shape, strides, dtype, byte offset)
//! and the producer's deleter. This module only reads it and never consumes it: the capsule
//! stays named `"dltensor"`, so its own destructor calls the producer's deleter when the
//! capsule goes. Holding the capsule (the registration's owner holds it) therefore keeps the
//! producer's memory allocated: that is the protocol's promise for an unconsumed capsule.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::{ffi, PyErr};

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`, the first member of `DLManagedTensor` (the rest, the manager context and the
/// deleter, is not read here).
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const CAPSULE: &CStr = c"dltensor";

/// Where a DLPack tensor lives.
pub(crate) enum DlMemory {
    Host,
    Cuda { ordinal: u32 },
}

/// A DLPack export: its memory, and the capsule that keeps it allocated.
pub(crate) struct DlExport {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) location: DlMemory,
    pub(crate) capsule: Py<PyAny>,
}

/// `obj.__dlpack__()`, read: C-contiguous, on the CPU, in pinned host memory or on a CUDA
/// device; a `ValueError` for strided tensors, a `TypeError` for other devices or a capsule
/// that is not a DLPack one.
pub(crate) fn export(obj: &Bound<'_, PyAny>) -> PyResult<DlExport> {
    let py = obj.py();
    let capsule = obj.call_method0("__dlpack__")?;
    // SAFETY: `capsule` is a live object; PyCapsule_GetPointer checks that it is a capsule
    // named "dltensor" and returns NULL with an exception set otherwise.
    let p = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE.as_ptr()) };
    if p.is_null() {
        let cause = PyErr::take(py).map(|e| e.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!(
            "__dlpack__() did not return an unconsumed \"dltensor\" capsule ({cause})"
        )));
    }
    // SAFETY: a "dltensor" capsule points at a DLManagedTensor, whose first member is the
    // DLTensor, valid (with its shape and strides arrays) until the producer's deleter runs,
    // which only the capsule's destructor does: `capsule` is alive for this whole function.
    let t = unsafe { &*(p as *const DlTensor) };
    let ndim = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err("DLPack tensor with ndim < 0"))?;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: `shape` points at `ndim` int64 values (DLPack), alive as above.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let strides: Option<&[i64]> = if t.strides.is_null() || ndim == 0 {
        None
    } else {
        // SAFETY: non-NULL `strides` points at `ndim` int64 values (DLPack), alive as above.
        Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) })
    };
    let bits = u64::from(t.dtype.bits) * u64::from(t.dtype.lanes);
    if bits == 0 || bits % 8 != 0 {
        return Err(PyValueError::new_err(format!("a DLPack dtype of {bits} bits is not whole bytes")));
    }
    let mut elems: u64 = 1;
    for &n in shape {
        let n =
            u64::try_from(n).map_err(|_| PyValueError::new_err("a DLPack tensor with a negative size"))?;
        elems = elems.checked_mul(n).ok_or_else(|| PyValueError::new_err("a DLPack tensor too large"))?;
    }
    if let Some(strides) = strides {
        // Row-major, in elements: the last dimension moves by 1, each other by the product
        // of the sizes after it (dimensions of size 1 may have any stride).
        let mut want: i64 = 1;
        for (&n, &st) in shape.iter().zip(strides).rev() {
            if n > 1 && st != want {
                return Err(PyValueError::new_err(
                    "cannot register a non-contiguous DLPack tensor: a region is one range",
                ));
            }
            want = want.saturating_mul(n);
        }
    }
    let len = elems.checked_mul(bits / 8).and_then(|l| usize::try_from(l).ok());
    let len = len.ok_or_else(|| PyValueError::new_err("a DLPack tensor too large"))?;
    let location = match t.device.device_type {
        KDL_CPU | KDL_CUDA_HOST => DlMemory::Host,
        KDL_CUDA => DlMemory::Cuda { ordinal: u32::try_from(t.device.device_id).unwrap_or(0) },
        other => {
            return Err(PyTypeError::new_err(format!(
            "cannot register a DLPack tensor on device type {other}: CPU, pinned host and CUDA memory only"
        )))
        }
    };
    let ptr = (t.data as u64)
        .checked_add(t.byte_offset)
        .ok_or_else(|| PyValueError::new_err("a DLPack tensor's address overflows"))?;
    Ok(DlExport { ptr, len, location, capsule: capsule.unbind() })
}
