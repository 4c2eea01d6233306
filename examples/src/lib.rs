//! Examples live in this folder; run them with `cargo run --example NAME`.
