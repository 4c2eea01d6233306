//! fabric-async
