//! The CUDA layer: device memory, pinned host memory, streams and events, CUDA IPC and
//! run-time compiled kernels, over the CUDA driver API (through `cudarc`'s bindings).
//!
//! This module is the foundation the GPU paths of the engine build on (staged transfers
//! through pinned bounce buffers, CUDA IPC between processes of one host, counters a kernel
//! can spin on). It does no networking itself.
//!
//! ```text
//!   GPU memory ──copy_d2h──► PinnedHostBuffer ──(NIC write)──► PinnedHostBuffer ──copy_h2d──► GPU memory
//!   (DeviceBuffer,            (bounce buffer,                   (bounce buffer)
//!    IpcMapping,               device-mapped:
//!    user memory)              kernels see it too)
//!        │  Stream: ordered copies and kernels; Event::query() says when they are done
//!        └─ never blocks the caller: the reactor polls events
//! ```
//!
//! # Loading the driver
//!
//! Nothing links against CUDA: `libcuda.so.1` (and `libnvrtc.so.*`, only for [`compile`])
//! are opened at run time on first use. The same binary runs on a machine without a GPU;
//! there every entry point returns [`Error::Unsupported`](crate::Error::Unsupported)
//! (`"no CUDA driver: ..."`) and nothing panics (cudarc's own loader would panic on a
//! missing library; the loader here probes first, see `loader.rs`). [`available()`] is the
//! cheap question "can I use CUDA, and how many devices".
//!
//! # Contexts and threads
//!
//! Every device is used through its **primary context** (the one the CUDA runtime and
//! PyTorch use), retained once per process ([`context`]). Each call that needs a current
//! context makes it current for its duration and restores the caller's afterwards, so every
//! type here can be used from any thread.
//!
//! # Ownership
//!
//! Everything allocated holds an `Arc<Context>`, so contexts outlive their allocations.
//! The safe copies and kernel launchers hold their buffers (as `Arc`s) until their
//! completion has been observed, so dropping a buffer while a copy engine uses it frees
//! nothing; the `*_raw` variants leave that to the caller (`# Safety`). A [`Stream`]'s drop
//! waits for its work. Failed calls are [`Error::Cuda`](crate::Error::Cuda) `{ call, code,
//! message }`.

mod driver;
mod emulation;
mod graph;
mod ipc;
mod kernels;
mod loader;
mod memory;
mod nvrtc;
mod stream;

pub use driver::{available, context, driver, Context, Driver};
#[doc(hidden)]
pub use emulation::{emulated_copy, is_emulated, EMULATED_ORDINAL};
pub use graph::Graph;
pub use ipc::{ipc_export, IpcExport, IpcMapping, IpcMemHandle};
pub use kernels::{pattern_byte, Kernels, SPIN_RELEASED, SPIN_TIMED_OUT};
pub use memory::{
    dmabuf_fd, pointer_info, AddressRange, DeviceBuffer, DeviceMemory, MemoryKind, PinnedHostBuffer,
    PointerInfo,
};
pub use nvrtc::{compile, nvrtc_version, Function, KernelArgs, LaunchConfig, Module};
pub use stream::{stream_memops_supported, Event, EventStatus, Stream, WaitValue};
