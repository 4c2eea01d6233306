//! `fabric::Error` as Python exceptions: one class per variant under `FabricError`, with the
//! Rust message, and the variant's fields as attributes where a caller can act on them
//! (`peer`, `imm`, `side`/`offset`/`len`/`region_len`, `errno`).
//!
//! `Timeout` has no Rust variant: the blocking calls (`wait(timeout=...)`) raise it when
//! their deadline passes. It is also a `TimeoutError`, so `except TimeoutError` catches it
//! beside `asyncio.TimeoutError`.

use fabric_async::Error;
use pyo3::exceptions::{PyException, PyTimeoutError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};
use pyo3::{create_exception, PyErr};

create_exception!(fabric_rdma, FabricError, PyException, "Base class of every error the engine reports.");
create_exception!(
    fabric_rdma,
    OutOfBounds,
    FabricError,
    "A range falls outside its region; nothing was posted."
);
create_exception!(fabric_rdma, UnknownPeer, FabricError, "The peer id was never added to this engine.");
create_exception!(
    fabric_rdma,
    PeerUnreachable,
    FabricError,
    "The peer is gone (its process died, it was removed, or an operation outlived op_timeout)."
);
create_exception!(
    fabric_rdma,
    RemoteAccess,
    FabricError,
    "The peer refused this operation's access to its memory; only this operation failed."
);
create_exception!(
    fabric_rdma,
    ConnectionLost,
    FabricError,
    "The operation was lost with a connection the transport tore down; the peer stays up."
);
create_exception!(
    fabric_rdma,
    Malformed,
    FabricError,
    "Bytes that should be a descriptor or an address are not one."
);
create_exception!(
    fabric_rdma,
    Stale,
    FabricError,
    "A descriptor or address of a peer or region that is gone; nothing was written."
);
create_exception!(
    fabric_rdma,
    Foreign,
    FabricError,
    "A descriptor or address of another transport or NIC count."
);
create_exception!(fabric_rdma, NoRemoteCqData, FabricError, "The provider cannot deliver immediates.");
create_exception!(fabric_rdma, ProviderNotFound, FabricError, "No provider of that name on this machine.");
create_exception!(
    fabric_rdma,
    CompletionError,
    FabricError,
    "The operation completed with an error at the NIC."
);
create_exception!(fabric_rdma, ProviderError, FabricError, "A call into the provider failed.");
create_exception!(fabric_rdma, RegisterMemory, FabricError, "Registering memory failed.");
create_exception!(
    fabric_rdma,
    MessageTooLarge,
    FabricError,
    "A message larger than the transport's two-sided limit."
);
create_exception!(fabric_rdma, Shutdown, FabricError, "The engine has shut down.");
create_exception!(
    fabric_rdma,
    CounterLimit,
    FabricError,
    "Arrivals of this immediate were refused: the counter table was full."
);
create_exception!(fabric_rdma, CounterRetired, FabricError, "The counter of this immediate was retired.");
create_exception!(
    fabric_rdma,
    Unsupported,
    FabricError,
    "Valid, but not implemented for this transport or memory kind."
);
create_exception!(fabric_rdma, CudaError, FabricError, "A CUDA driver call failed.");
create_exception!(
    fabric_rdma,
    NotDeviceMemory,
    FabricError,
    "A range that is not CUDA device memory of that device."
);
create_exception!(fabric_rdma, ConfigError, FabricError, "An invalid configuration or argument.");
create_exception!(fabric_rdma, TopologyError, FabricError, "Topology detection or its override failed.");

/// `fabric_rdma.Timeout(FabricError, TimeoutError)`, made at import (an exception class with two
/// built-in bases of different layouts cannot be declared with `create_exception!`).
static TIMEOUT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The `fabric_rdma.Timeout` exception with `msg`.
pub(crate) fn timeout(py: Python<'_>, msg: String) -> PyErr {
    match TIMEOUT.get(py) {
        Some(t) => PyErr::from_type(t.bind(py).clone(), msg),
        None => PyTimeoutError::new_err(msg),
    }
}

/// Adds every exception class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let ns = PyDict::new(py);
    ns.set_item("__module__", "fabric_rdma")?;
    ns.set_item(
        "__doc__",
        "A blocking call's deadline passed; its operation was dropped as a cancelled awaitable's is.",
    )?;
    let bases = (py.get_type::<FabricError>(), py.get_type::<PyTimeoutError>());
    let t = py.get_type::<PyType>().call1(("Timeout", bases, ns))?.cast_into::<PyType>()?;
    m.add("Timeout", &t)?;
    let _ = TIMEOUT.set(py, t.unbind());
    macro_rules! add {
        ($($t:ident),*) => { $( m.add(stringify!($t), py.get_type::<$t>())?; )* };
    }
    add!(
        FabricError,
        OutOfBounds,
        UnknownPeer,
        PeerUnreachable,
        RemoteAccess,
        ConnectionLost,
        Malformed,
        Stale,
        Foreign,
        NoRemoteCqData,
        ProviderNotFound,
        CompletionError,
        ProviderError,
        RegisterMemory,
        MessageTooLarge,
        Shutdown,
        CounterLimit,
        CounterRetired,
        Unsupported,
        CudaError,
        NotDeviceMemory,
        ConfigError,
        TopologyError
    );
    Ok(())
}

/// The Python exception of `e`, its message the Rust `Display`.
pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    let retryable = e.is_retryable();
    let (err, mut attrs): (PyErr, Vec<(&str, Attr)>) = match e {
        Error::OutOfBounds { side, offset, len, region_len } => (
            OutOfBounds::new_err(msg),
            vec![
                ("side", Attr::Str(side.to_string())),
                ("offset", Attr::Int(offset as i64)),
                ("len", Attr::Int(len as i64)),
                ("region_len", Attr::Int(region_len as i64)),
            ],
        ),
        Error::UnknownPeer { peer } => (UnknownPeer::new_err(msg), vec![("peer", Attr::Int(peer.into()))]),
        Error::PeerUnreachable { peer, .. } => {
            (PeerUnreachable::new_err(msg), vec![("peer", Attr::Int(peer.into()))])
        }
        Error::RemoteAccess { peer, .. } => {
            (RemoteAccess::new_err(msg), vec![("peer", Attr::Int(peer.into()))])
        }
        Error::ConnectionLost { peer, .. } => {
            (ConnectionLost::new_err(msg), vec![("peer", Attr::Int(peer.into()))])
        }
        Error::Malformed { .. } => (Malformed::new_err(msg), vec![]),
        Error::Stale { .. } => (Stale::new_err(msg), vec![]),
        Error::Foreign { .. } => (Foreign::new_err(msg), vec![]),
        Error::NoRemoteCqData { .. } => (NoRemoteCqData::new_err(msg), vec![]),
        Error::ProviderNotFound { .. } => (ProviderNotFound::new_err(msg), vec![]),
        Error::Completion { errno, .. } => {
            (CompletionError::new_err(msg), vec![("errno", Attr::Int(errno.into()))])
        }
        Error::Provider { errno, .. } => {
            (ProviderError::new_err(msg), vec![("errno", Attr::Int(errno.into()))])
        }
        Error::RegisterMemory { .. } => (RegisterMemory::new_err(msg), vec![]),
        Error::MessageTooLarge { .. } => (MessageTooLarge::new_err(msg), vec![]),
        Error::Shutdown => (Shutdown::new_err(msg), vec![]),
        Error::CounterLimit { imm, .. } => (CounterLimit::new_err(msg), vec![("imm", Attr::Int(imm.into()))]),
        Error::CounterRetired { imm } => (CounterRetired::new_err(msg), vec![("imm", Attr::Int(imm.into()))]),
        Error::Unsupported(_) => (Unsupported::new_err(msg), vec![]),
        Error::Cuda { .. } => (CudaError::new_err(msg), vec![]),
        Error::NotDeviceMemory { .. } => (NotDeviceMemory::new_err(msg), vec![]),
        Error::Config(_) => (ConfigError::new_err(msg), vec![]),
        Error::Sysfs { .. } | Error::TopologyOverride { .. } => (TopologyError::new_err(msg), vec![]),
        // `Error` is non-exhaustive: a variant added later is still a `FabricError`.
        _ => (FabricError::new_err(msg), vec![]),
    };
    // Every exception says whether the same call can succeed later (`Error::is_retryable`).
    attrs.push(("retryable", Attr::Bool(retryable)));
    Python::attach(|py| {
        let value = err.value(py);
        for (name, a) in attrs {
            // Attributes are a convenience: an exception that refuses them keeps its message.
            let _ = match a {
                Attr::Int(v) => value.setattr(name, v),
                Attr::Str(s) => value.setattr(name, s),
                Attr::Bool(b) => value.setattr(name, b),
            };
        }
    });
    err
}

enum Attr {
    Int(i64),
    Str(String),
    Bool(bool),
}

/// `Result<T, fabric::Error>` into `PyResult<T>`.
pub(crate) trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
