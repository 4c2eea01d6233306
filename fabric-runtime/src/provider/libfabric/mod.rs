//! The libfabric backend: one `FI_EP_RDM` endpoint on one libfabric domain.
//!
//! ```text
//!   LibfabricDomain ──owns──▶ ep ──bound to──▶ cq (FI_CQ_FORMAT_DATA, TRANSMIT|RECV)
//!                     │        └──bound to──▶ av (FI_AV_TABLE: PeerHandle = fi_addr_t)
//!                     ├──▶ mrs (fid_mr, closed before ep)          all of them opened on
//!                     ├──▶ domain ──▶ fabric ──▶ fi_info            the domain / fabric
//!                     └──▶ CtxPool: stable `OpCtx { fi_context2, token }` slots, one per op
//! ```
//!
//! Every libfabric call goes through the C shim of `fabric-libfabric-sys` (most of libfabric's
//! API is `static inline`), and every negative return code goes through `check`, which turns
//! it into [`Error::Provider`] with libfabric's own `fi_strerror` text.
//!
//! Provider names: `"tcp"` → `"tcp;ofi_rxm"`, `"udp"` → `"udp;ofi_rxd"`, `"shm"`, `"efa"`; any
//! other string is passed to `fi_getinfo` unchanged. For `tcp`/`udp` the endpoint binds to
//! `127.0.0.1` (or [`LibfabricConfig::node`]) with `FI_SOURCE` and `FI_SOCKADDR_IN`, and
//! `FI_TCP_IFACE=lo` is set in the environment if it is unset (see [`LibfabricDomain::open`]),
//! so that test traffic never leaves the machine.
//!
//! Progress: `tcp;ofi_rxm` progresses data only when the CQ is read (manual progress), on
//! *both* sides, connection setup included. The engine's reactor polls every domain it owns,
//! which is what drives it.
//!
//! # Files
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | these docs, the re-exports |
//! | `config.rs` | [`LibfabricConfig`], provider names (`"tcp"` → `"tcp;ofi_rxm"`) |
//! | `info.rs` | the `fi_getinfo` hints (caps, `mr_mode`, optional extras) and what a refusal means |
//! | `domain.rs` | the [`LibfabricDomain`] struct, `open` (fabric, domain, AV, CQ, endpoint), `Drop` |
//! | `fid.rs` | the owning wrappers: `fi_info` lists and `fi_close`d objects |
//! | `ctx.rs` | the operation contexts: stable `fi_context2` slots mapped back to tokens |
//! | `memory.rs` | memory registration under the provider's `mr_mode` |
//! | `address.rs` | our own address (`fi_getname`), checking a peer's before `fi_av_insert` |
//! | `datapath.rs` | the [`Domain`] impl: post, poll (CQ entries and error entries), arm |
//! | `shm/` | shm only: peers' liveness (pidfds), the replaceable one-sided endpoint, in-process peers closing (`mod.rs`); a dead peer's region lock, libfabric < 1.18 (`lock.rs`) |
//! | `liveness.rs` | tcp only: a TCP connection per peer whose closing says the peer died |
//! | `error.rs` | return codes as [`Error`]s (`fi_strerror` text) |
//!
//! All `unsafe` of the libfabric backend lives in this folder (and the `-sys` crate).

#[cfg(doc)]
use super::Domain;
#[cfg(doc)]
use crate::error::Error;

mod address;
mod config;
mod ctx;
mod datapath;
mod domain;
mod error;
mod fid;
mod info;
mod liveness;
mod memory;
mod shm;

pub use config::{LibfabricConfig, DEFAULT_MAX_MSG_SIZE};
pub use domain::LibfabricDomain;

/// The version of the libfabric library loaded (`fi_version()`), as (major, minor): behaviour
/// differs between releases (docs/faults.md, "libfabric versions").
pub fn version() -> (u32, u32) {
    // SAFETY: fi_version takes nothing and returns the library's version.
    let v = unsafe { libfabric_sys::fi_version() };
    (v >> 16, v & 0xffff)
}

/// Bytes of immediate data the engine needs (a `u32`).
const IMM_BYTES: usize = 4;
