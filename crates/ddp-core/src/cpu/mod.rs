//! The CPU backend: pure Rust, TCP between processes (loopback or across machines).
