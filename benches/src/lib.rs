//! Pieces shared by the benchmark binaries.

pub mod allreduce_sweep;
pub mod p2p_pingpong;
