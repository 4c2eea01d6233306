//! fabric-async

pub mod bootstrap;

pub use bootstrap::{all_gather, BootstrapError, Rendezvous, TcpStore, TcpStoreServer};
