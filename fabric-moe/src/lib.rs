//! # fabric-moe: MoE dispatch and combine on GPUs
//!
//! An [`AllToAll`] moves the tokens of a mixture-of-experts layer to the ranks that hold
//! their top-k experts (**dispatch**) and brings the experts' outputs back, weighted and
//! summed per token (**combine**), between processes, each with its own GPU or sharing one.
//! Between ranks of one host, kernels write straight into the peers' GPU memory through CUDA
//! IPC mappings (NVLink between GPUs) and raise a per-step sequence flag there; receive
//! kernels spin on the flags. Ranks on other hosts (or all, with [`Transport::Proxy`]) go
//! through the **proxy**: the kernels pack their rows into a local outbox and ring a
//! doorbell in pinned host memory, a host thread writes the rows with the engine
//! (`write_imm`), and the receive kernels wait for the immediates' [`GpuCounter`]s
//! (`fabric_async::GpuCounter`). The host only launches: every stage goes on the caller's
//! CUDA stream, with no synchronization, so a step can be captured in a CUDA graph.
//!
//! [`GpuCounter`]: fabric_async::GpuCounter
//!
//! ```text
//!  rank a                                               rank b
//!  x, topk_idx ─► route ─► dispatch_send ══ NVLink ══►  window_b.rx[a], flag[a] = seq
//!                                                       dispatch_recv: spin on flags,
//!                                                         rows → recv_x[expert][pos]
//!                                                       experts(recv_x) → expert_out
//!  window_a.cx[b], cflag[b] = seq  ◄══ NVLink ══ combine_send: sum_k w_k * expert_out
//!  combine_recv: spin, sum over ranks → combined[t]
//! ```
//!
//! The kernels are CUDA C ([`kernels::SOURCE`]) compiled by NVRTC for the device when the
//! all-to-all is made; nothing CUDA is needed to build. On a machine without a driver
//! [`AllToAll::new`] fails with `fabric_async::Error::Unsupported` (inside
//! [`MoeError::Cuda`]). `docs/moe.md` has the design, the figures and what is left.
//! [`harness`] is the measuring harness of `examples/moe_gpu.rs` and `fabric-bench moe`
//! (ranks started as processes, the timed and checked passes), not part of the API.
//!
//! ```no_run
//! # async fn demo(engine: fabric_async::Engine, store: fabric_async::TcpStore,
//! #               stream: fabric_async::cuda::Stream, x: u64, idx: u64, w: u64, out: u64)
//! #               -> Result<(), fabric_moe::MoeError> {
//! use fabric_moe::{AllToAll, Config, DispatchInput, TopkIdx};
//! let a2a = AllToAll::new(&engine, &store, Config::new(2, 0, 128, 128, 7168, 8)).await?;
//! let input = DispatchInput { x, topk_idx: TopkIdx::I64(idx), topk_weights: w, num_tokens: 128 };
//! // SAFETY: x, idx, w hold 128 tokens on this rank's device and outlive the step; `out`
//! // has a2a.expert_out_len() bytes.
//! unsafe { a2a.dispatch(&stream, &input)? };
//! // ... the experts read a2a.recv_x() and write `out` ...
//! unsafe { a2a.combine(&stream, out)? };
//! stream.synchronize()?;
//! a2a.check()?; // a timed-out wait or an overflow, as the kernels reported it
//! # Ok(()) }
//! ```
#![warn(missing_docs, missing_debug_implementations)]

mod alltoall;
mod config;
mod error;
pub mod harness;
pub mod kernels;
mod layout;
mod nvlink;
mod proxy;
pub mod reference;

pub use alltoall::{AllToAll, Received, CLOCK_SLOTS, PROBES};
pub use config::{
    Config, DispatchInput, Dtype, RecvLayout, TopkIdx, Transport, MAX_RANKS, ORDERED_ROWS_MAX_EXPERTS,
};
pub use error::{MoeError, Result};
pub use kernels::CudaStream;
pub use proxy::ProxyTimes;
