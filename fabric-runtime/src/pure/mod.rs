//! The pure core: plain data structures with no FFI, no threads and no I/O.
//!
//! Everything here is deterministic and can be tested without a NIC. Inputs (bytes from a
//! peer, completions, time) are passed in; results are pulled out.
//!
//! Every byte format of this crate that a peer can send us is decoded here, and nowhere else:
//! engine addresses and region descriptors (`descriptor.rs`), and the verbs backend's address
//! and connection handshake (`verbs_wire.rs`). Each decoder treats its input as hostile (never
//! panics, answers `Error::Malformed`) and has a bounded fuzz test beside it. (A libfabric
//! address is the provider's own format: that backend only checks its shape before handing it
//! to `fi_av_insert`.)
#![forbid(unsafe_code)]

pub mod control;
pub(crate) mod counter_table;
pub mod descriptor;
pub(crate) mod int_map;
mod reader;
pub mod revoke;
pub mod route;
#[doc(hidden)]
pub mod slab;
pub mod staging;
#[cfg(test)]
pub(crate) mod test_rng;
pub mod verbs_wire;
