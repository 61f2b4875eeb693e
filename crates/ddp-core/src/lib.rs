//! # ddp-core — level 1 of accel-rs
//!
//! What `torch.distributed` + `DistributedDataParallel` + torchrun give a PyTorch user, for candle:
//!
//! - [`store`]: a TCP rendezvous key-value store (like `TCPStore`) with a run token.
//! - [`ProcessGroup`]: rank, world size and collectives (all_reduce, broadcast, all_gather, reduce_scatter,
//!   send/recv, barrier, sub-groups) on slices and candle tensors, over a [`Backend`]: the CPU backend over TCP
//!   (default, multi-process and multi-machine) or NCCL (feature `nccl`).
//! - [`DistributedSampler`]: per-rank sample indices with PyTorch's arithmetic.
//! - [`DistributedDataParallel`]: bucketed, averaged gradient all-reduce for candle `Var`s, overlapped with the
//!   backward pass when the model marks [`segments`] (cut points).
//! - [`ZeroRedundancyOptimizer`] ([`zero`]): PyTorch's `ZeroRedundancyOptimizer` — each rank's optimizer keeps
//!   state for its own chunk of every parameter (AdamW's moments: `1/N` of the model per rank); a step
//!   reduce-scatters the gradients (mean), steps the chunks and all-gathers them into the parameters (`2Ψ` per
//!   step, like DDP's all-reduce; Rajbhandari et al. 2020, ZeRO §5.1). [`zero::FlatChunk`] and
//!   [`zero::FlatShards`] are the sharding primitives (chunking, rank-major reduce-scatter with hooks and HSDP,
//!   all-gather) the Accelerator's ZeRO stages use too.
//! - [`probe`]: measure a group's link (ping-pong, all-reduce) and fit it to the α–β model (`α + n/β`).
//! - [`launcher`]: spawn N workers with torchrun's environment and fail fast when one dies.
//!
//! The computation these collectives serve — fused training ops, the optimizers, the state-dict format — is
//! accel-nn's: ddp-core communicates and computes nothing else.
//!
//! Invariant: ddp-core knows nothing of `accel-nn`, `accel` or `trainer`; it depends only on candle and small
//! libraries.
//!
//! ```no_run
//! use ddp_core::{ProcessGroup, ReduceOp};
//! let pg = ProcessGroup::init_from_env()?;          // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...
//! let mut v = vec![pg.rank() as f32; 4];
//! pg.all_reduce(&mut v, ReduceOp::Sum)?;            // every rank: [0+1+..+(P-1); 4]
//! # Ok::<(), ddp_core::DdpError>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
pub mod cpu;
pub mod ddp;
pub mod dtype;
pub mod env;
pub mod error;
pub mod fingerprint;
pub mod functional;
pub mod launcher;
pub mod mesh;
#[cfg(feature = "mpi")]
#[cfg_attr(docsrs, doc(cfg(feature = "mpi")))]
pub mod mpi;
pub mod mpirun;
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub mod nccl;
pub mod probe;
pub mod process_group;
pub mod sampler;
pub mod segments;
pub mod store;
/// The workspace's one mutex helper. Hidden: shared by the accel-rs crates, no part of the level-1 API.
#[doc(hidden)]
pub mod sync;
mod tensor_ops;
pub mod token;
pub mod traffic;
pub mod zero;

pub use backend::{Backend, BackendKind, PiecewiseBuffer};
pub use ddp::{CommHook, DdpOptions, DistributedDataParallel, Overlap};
pub use dtype::{DType, Element, ReduceOp};
pub use env::{DistEnv, EnvSource};
pub use error::{DdpError, Result};
pub use launcher::{launch, LaunchConfig};
pub use mesh::{DeviceMesh, MeshCoord, MeshDim, MeshShape};
pub use process_group::{GroupOptions, InitOptions, ProcessGroup, DEFAULT_COLLECTIVE_TIMEOUT};
pub use sampler::DistributedSampler;
pub use store::{PrefixStore, Store, TcpStore, TcpStoreServer};
pub use token::{RunToken, RUN_TOKEN_ENV};
pub use traffic::{OpTraffic, TrafficStats};
pub use zero::ZeroRedundancyOptimizer;

// Handles users move into threads must stay Send + Sync (checked at compile time, tokio-style).
#[allow(dead_code)]
const _: () = {
    fn assert_send_sync<T: Send + Sync>() {}
    fn check() {
        assert_send_sync::<ProcessGroup>();
        assert_send_sync::<TcpStore>();
        assert_send_sync::<TcpStoreServer>();
        assert_send_sync::<DdpError>();
        assert_send_sync::<DistributedSampler>();
        assert_send_sync::<PrefixStore>();
        assert_send_sync::<store::MemoryStore>();
        assert_send_sync::<cpu::CpuBackend>();
        assert_send_sync::<RunToken>();
        assert_send_sync::<DistributedDataParallel>();
        assert_send_sync::<DeviceMesh>();
        assert_send_sync::<zero::FlatShards>();
        assert_send_sync::<ZeroRedundancyOptimizer<candle_nn::AdamW>>();
    }
};
