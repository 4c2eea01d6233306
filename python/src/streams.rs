//! CUDA streams and events of Python frameworks, for stream-ordered transfers: `after=` of
//! the write methods (the transfer starts when the stream reaches this point) and
//! `ImmCounter.wait_on_stream` (the stream waits for arrivals).
//!
//! Accepted: a `torch.cuda.Stream` (or `ExternalStream`), a `torch.cuda.Event` (for
//! `after=`: the point it was recorded at), any object with `__cuda_stream__` (the CUDA
//! Python stream protocol: `(version, handle)`) or a `cuda_stream` attribute, and a raw
//! `CUstream` as an int (0: the legacy default stream).

use std::sync::Arc;

use fabric_async::cuda::{self, Event};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::IntoPy;

/// A stream: its raw handle and device.
pub(crate) struct StreamRef {
    pub(crate) handle: u64,
    pub(crate) ordinal: u32,
}

/// The stream `obj` names; `ordinal` is the device for a raw handle (which says none).
pub(crate) fn stream_of(obj: &Bound<'_, PyAny>, ordinal: u32) -> PyResult<StreamRef> {
    if let Ok(handle) = obj.extract::<u64>() {
        return Ok(StreamRef { handle, ordinal });
    }
    let device = |o: &Bound<'_, PyAny>| -> PyResult<u32> {
        match o.getattr("device") {
            Ok(d) => Ok(d.getattr("index").ok().and_then(|i| i.extract::<u32>().ok()).unwrap_or(ordinal)),
            Err(_) => Ok(ordinal),
        }
    };
    if obj.hasattr("__cuda_stream__")? {
        let (_version, handle): (u64, u64) = obj.call_method0("__cuda_stream__")?.extract()?;
        return Ok(StreamRef { handle, ordinal: device(obj)? });
    }
    if let Ok(h) = obj.getattr("cuda_stream") {
        return Ok(StreamRef { handle: h.extract()?, ordinal: device(obj)? });
    }
    Err(PyTypeError::new_err(format!(
        "not a CUDA stream: a torch.cuda.Stream, an object with __cuda_stream__ or cuda_stream, or a CUstream int (got {})",
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
    )))
}

/// For `after=`: an event of the engine's, recorded at the point `obj` names (a stream's
/// current end, or a `torch.cuda.Event`'s record point) on device `ordinal`.
pub(crate) fn after_point(obj: &Bound<'_, PyAny>, ordinal: u32) -> PyResult<Arc<Event>> {
    let py = obj.py();
    let torch = py.import("sys")?.getattr("modules")?.get_item("torch").ok();
    let stream = match torch {
        Some(torch) if obj.is_instance(&torch.getattr("cuda")?.getattr("Event")?)? => {
            // A torch event: a side stream of torch's waits for it, and the engine's event
            // is recorded there (torch's event handle is not the engine's to wait on).
            let device = torch.getattr("device")?.call1(("cuda", ordinal))?;
            let side = torch.getattr("cuda")?.getattr("Stream")?.call1((device,))?;
            side.call_method1("wait_event", (obj,))?;
            stream_of(&side, ordinal)?
        }
        _ => stream_of(obj, ordinal)?,
    };
    let ev = Event::new(&cuda::context(stream.ordinal as usize).py_err()?).py_err()?;
    // SAFETY: the handle comes from a live stream object of that device (or is the caller's
    // raw handle, which the API documents must be a live stream of the device), and the
    // record is a stream operation that does not outlive the call's use of the handle.
    unsafe { ev.record_raw(stream.handle, false) }.py_err()?;
    Ok(Arc::new(ev))
}
