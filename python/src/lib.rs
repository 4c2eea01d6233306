//! The Python package `fabric_rdma` (distribution `fabric-rdma`, module
//! `fabric_rdma._fabric`): the engine of `fabric-async` with every operation as an asyncio
//! awaitable that the engine completes, or a blocking call.
//!
//! Files: `engine.rs` (the `Engine` class), `memory.rs` (regions, buffer registration),
//! `dlpack.rs` (DLPack tensors), `views.rs` (which host memory is registered, for views of
//! it), `counter.rs` (counters, peer events, peer groups), `bridge.rs` (Rust futures as
//! awaitables and blocking calls), `errors.rs` (exceptions), `streams.rs` (CUDA streams of
//! Python frameworks, for stream order), `stats.rs`. The Python side
//! (`fabric_rdma/__init__.py`, the `.pyi` stubs) and the tests live beside this crate;
//! `docs/python.md` is the guide.

mod bridge;
mod counter;
mod dlpack;
mod engine;
mod errors;
mod memory;
mod stats;
mod streams;
mod views;

use pyo3::prelude::*;

#[pymodule]
fn _fabric(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<memory::Region>()?;
    m.add_class::<memory::PyRemoteRegion>()?;
    m.add_class::<memory::PyPageLayout>()?;
    m.add_class::<counter::PyImmCounter>()?;
    m.add_class::<counter::PyPeerEvent>()?;
    m.add_class::<counter::PyPeerEvents>()?;
    m.add_class::<counter::PyPeerGroup>()?;
    m.add_class::<bridge::Pending>()?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
