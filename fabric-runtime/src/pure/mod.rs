//! The pure core: plain data structures with no FFI, no threads and no I/O.
//!
//! Everything here is deterministic and can be tested without a NIC. Inputs (bytes from a
//! peer, completions, time) are passed in; results are pulled out.
#![forbid(unsafe_code)]

pub mod descriptor;
pub mod route;
#[doc(hidden)]
pub mod slab;
pub mod staging;
