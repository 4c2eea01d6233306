//! Pure code: no FFI, no threads, no unsafe.
#![forbid(unsafe_code)]
pub mod descriptor;
