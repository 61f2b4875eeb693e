//! One integration-test binary for the crate (each test binary links candle: one link instead of one per file).

mod collectives;
mod common;
#[path = "../conformance/mod.rs"]
mod conformance;
mod conformance_cpu;
mod ddp;
mod env;
mod fault;
mod functional;
mod invariants;
mod launcher;
mod mesh;
mod multiprocess;
mod nccl_unavailable;
mod overlap;
mod p2p_shm;
mod probe;
mod sampler;
mod segments;
mod store;
mod subgroups;
mod zero;
