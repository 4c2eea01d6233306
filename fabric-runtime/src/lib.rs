//! fabric-runtime: NIC backends, the transfer engine and its reactor threads.
#![warn(missing_debug_implementations)]

pub mod error;
pub mod provider;
pub mod pure;

pub use error::{Error, Result, Side};
