//! Pieces shared by the benchmark binaries.

pub mod allreduce_sweep;
