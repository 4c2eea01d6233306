//! # fabric-async: RDMA transfers as ordinary futures
//!
//! The tokio-facing API of fabric. An [`Engine`] drives the NIC(s) of one GPU or process
//! through a dedicated reactor thread; its operations return futures that the reactor wakes
//! directly from the completion queue, so they compose with `select!`, timeouts and
//! `spawn`, and cost no CPU while idle (in [`ReactorMode::Event`]).
//!
//! ```no_run
//! use fabric_async::{Engine, ReactorMode};
//!
//! # async fn demo(peer_descriptor: Vec<u8>) -> Result<(), fabric_async::Error> {
//! let engine = Engine::builder().provider("tcp").mode(ReactorMode::Event).build()?;
//! let src = engine.alloc(1 << 20).await?;              // registered, zeroed, 4 KiB aligned
//! let dst = engine.remote_region(&peer_descriptor).await?; // a peer's region
//! engine.write_imm(&src, 0, &dst, 0, 1 << 20, 7).await?;   // bytes, then imm 7 at the peer
//! // On the peer: engine.imm_counter(7).wait_for(1).await?;
//! # Ok(()) }
//! ```
//!
//! Bootstrapping (exchanging addresses and descriptors between processes) goes through the
//! [`bootstrap::Rendezvous`] trait; [`bootstrap::TcpStore`] is a ready-made implementation, and
//! with the `etcd` feature `EtcdStore` (module `etcd`) is one over etcd v3 that also reports
//! processes joining and leaving (`docs/operations.md`).
#![warn(missing_debug_implementations)]

pub mod bootstrap;
mod down;
#[cfg(feature = "etcd")]
pub mod etcd;
mod ext;
pub mod process;
mod watch;

pub use bootstrap::{all_gather, BootstrapError, Rendezvous, TcpStore, TcpStoreServer};
#[cfg(feature = "etcd")]
pub use etcd::{EtcdOptions, EtcdStore, MemberEvent, MemberEvents};

pub use down::{peer_down, race_down, unless_down, DOWN_GRACE};
pub use ext::{fetch_region, publish_region, FetchError, ImmCounterExt};
/// The CUDA layer (driver loaded at run time): devices, memory, streams, events, kernels
/// (`docs/gpu.md`); [`Engine::after`] takes its events.
pub use fabric_runtime::cuda;
/// Test-only fault injection (feature `faults`): [`faults::FaultPlan`] for
/// `EngineBuilder::faults` (docs/operations.md, "Fault injection").
#[cfg(feature = "faults")]
pub use fabric_runtime::provider::faults;
/// GPU/NIC topology from sysfs: which NICs and cores each GPU should use
/// (`docs/topology.md`).
pub use fabric_runtime::topology;
pub use fabric_runtime::GpuCounter;
pub use fabric_runtime::{
    Arrivals, BatchEntry, BatchOp, CompletionWakeups, ControlFuture, CounterStats, Engine, EngineBuilder,
    EngineSettings, EngineStats, Error, GpuPath, GpuStats, ImmCounter, LatencyProfile, MemoryLocation,
    MemoryRegion, OpBatch, OpFuture, OpStats, PageLayout, PeerEvent, PeerEvents, PeerGroup, PeerId,
    ReactorMode, ReactorStats, RecvFuture, RegionDescriptor, RemoteRegion, Result, Route, ScatterEntry, Side,
    TransferOpts, Transfers, WaitFor, WeakMemoryRegion,
};
pub use watch::CompletionWatch;

/// The README's Rust examples, compiled by `cargo test --doc` so that they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExamples;

/// The concepts page's Rust examples, compiled (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../docs/concepts.md")]
pub struct ConceptsExamples;

/// The transfers reference's Rust examples, compiled (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../docs/transfers.md")]
pub struct TransfersExamples;

/// The counter reference's Rust examples, compiled (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../docs/imm-counter.md")]
pub struct ImmCounterExamples;

/// The getting-started guide's Rust examples, compiled (`cargo test --doc`; its fleet example
/// needs the `etcd` feature, which the workspace's tests enable).
#[cfg(all(doctest, feature = "etcd"))]
#[doc = include_str!("../../docs/getting-started.md")]
pub struct GettingStartedExamples;
