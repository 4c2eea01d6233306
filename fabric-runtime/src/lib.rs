//! fabric-runtime: NIC backends, the transfer engine and its reactor threads.
//!
//! Most users want the `fabric-async` crate, which re-exports what is here with the tokio
//! helpers (bootstrap, timeouts) around it. See `docs/architecture.md` for the data path.
#![warn(missing_debug_implementations)]
#![cfg_attr(not(feature = "libfabric"), allow(dead_code, unused_imports))]

// Under `--cfg loom` only the lock-free counter is compiled, against loom's atomics.
#[cfg(all(feature = "bench-hooks", not(loom)))]
#[doc(hidden)]
pub mod bench_hooks;
pub mod counter;
#[cfg(all(feature = "cuda", not(loom)))]
pub mod cuda;
#[cfg(not(loom))]
pub mod engine;
#[cfg(not(loom))]
pub(crate) mod env;
pub mod error;
#[cfg(not(loom))]
pub mod provider;
#[cfg(not(loom))]
pub mod pure;
#[cfg(not(loom))]
pub(crate) mod reactor;
#[cfg(not(loom))]
pub(crate) mod shared;
pub(crate) mod sync;
#[cfg(not(loom))]
pub(crate) mod sys;
#[cfg(not(loom))]
pub mod topology;

pub use counter::{ImmCounter, WaitFor};
#[cfg(all(feature = "cuda", not(loom)))]
pub use engine::GpuCounter;
#[cfg(not(loom))]
pub use engine::{
    BatchEntry, BatchOp, CompletionWakeups, ControlFuture, CounterStats, Engine, EngineBuilder,
    EngineSettings, EngineStats, GpuStats, LatencyProfile, MemoryRegion, OpBatch, OpFuture, OpStats,
    PeerGroup, PeerId, ReactorMode, ReactorStats, RecvFuture, RemoteRegion, ScatterEntry, Transfers,
    WeakMemoryRegion,
};
pub use error::{Error, Result, Side};
#[cfg(not(loom))]
pub use provider::MemoryLocation;
#[cfg(not(loom))]
pub use pure::descriptor::{EngineAddress, GpuRegion, RegionDescriptor};
#[cfg(not(loom))]
pub use pure::route::{Arrivals, PageLayout, Route, Shard, TransferOpts};
#[cfg(not(loom))]
pub use pure::staging::GpuPath;
#[cfg(not(loom))]
pub use shared::events::{PeerEvent, PeerEvents};
