//! # accel — level 2 of accel-rs (like Hugging Face Accelerate)
//!
//! A single-process candle training loop becomes a distributed, mixed-precision, gradient-accumulating one by
//! adding a handful of lines; the same program then runs on one CPU, N processes (`accel launch -n N`) or N
//! machines, unchanged:
//!
//! ```no_run
//! use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig};
//! use candle_core::Tensor;
//! use candle_nn::{Module, VarMap};
//! # fn batches() -> Vec<(Tensor, Tensor)> { vec![] }
//! # fn main() -> accel::Result<()> {
//! let acc = Accelerator::new(AcceleratorConfig::from_env()?)?;      // process group, device, precision, GA
//! let varmap = VarMap::new();
//! let model = candle_nn::linear(784, 10, acc.var_builder(&varmap).pp("fc"))?; // device + dtype from acc
//! let prepared = acc.prepare_model(&varmap)?;                       // DDP + fp32 master weights
//! let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(1e-3))?)?;
//! for (x, y) in batches() {
//!     let logits = model.forward(&x)?.to_dtype(candle_core::DType::F32)?;
//!     let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
//!     acc.backward(&loss)?;                                         // GA, loss scaling, gradient sync
//!     opt.step()?;                                                  // no-op between syncs
//! }
//! acc.print("done");                                                // main process only
//! # Ok(()) }
//! ```
//!
//! Modules: [`Accelerator`] (prepare, backward, accumulation, clipping, collectives, process control),
//! [`config`], [`parallelism`] (the dp / tp / pp sizes and the device mesh they give), [`optim`] (SGD, AdamW with saveable state), [`mixed_precision`] (fp16 loss scaling), `data`
//! (datasets, sharded loaders), `state` (checkpoints), `tracking` (JSONL / TensorBoard), `scheduler` (LR schedules).

#![cfg_attr(docsrs, feature(doc_cfg))]

mod accelerator;
pub mod activation_checkpoint;
pub mod auto_layout;
pub mod banner;
pub mod config;
pub mod error;
pub mod logging;
pub mod mixed_precision;
mod model;
pub mod models;
pub mod nn;
pub mod optim;
pub mod parallelism;
pub mod pipeline;
pub mod plan;
pub mod scheduler;
pub mod sharding;
pub mod state;
mod step;
pub mod tensor_parallel;
pub mod tracking;

pub mod data;

/// accel-nn's fused training ops (linear, attention, softmax, layer norm, GELU, cross entropy), re-exported: what
/// the tensor-parallel layers and the Trainer's losses compute with.
pub use accel_nn::ops;
pub use accelerator::{Accelerator, ReduceKind};
pub use config::{AcceleratorConfig, MixedPrecision};
pub use data::{Batch, DataLoader, DataLoaderConfig, Dataset, TensorDataset};
/// Backward segments (`record`, `cut`, `BackwardSegments`): where a model lets its gradient all-reduce start
/// during the backward pass ([`Accelerator::backward_segments`]); ddp-core's module, re-exported.
pub use ddp_core::segments;
pub use error::{AccelError, Result};
pub use mixed_precision::{GradScaler, GradScalerConfig};
pub use model::PreparedModel;
pub use optim::{AcceleratedOptimizer, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
pub use parallelism::ParallelismConfig;
pub use sharding::ShardingStrategy;
pub use step::StepCounters;
pub use tensor_parallel::{ParamBuilder, ParamInit, ParamLayout, TensorParallel};
#[cfg(feature = "tensorboard")]
#[cfg_attr(docsrs, doc(cfg(feature = "tensorboard")))]
pub use tracking::TensorBoardTracker;
pub use tracking::{JsonlTracker, Tracker, TrackerKind};

// Handles users move into threads (and the Trainer shares) must stay Send + Sync; checked at compile time.
#[allow(dead_code)]
const _: () = {
    fn assert_send_sync<T: Send + Sync>() {}
    fn check() {
        assert_send_sync::<Accelerator>();
        assert_send_sync::<PreparedModel>();
        assert_send_sync::<AcceleratedOptimizer<AdamW>>();
        assert_send_sync::<AccelError>();
        assert_send_sync::<TensorParallel>();
        assert_send_sync::<ParamBuilder>();
    }
};

/// ddp-core's mutex helper (poisoning ignored: a panicking rank takes the job down anyway), for this crate's own
/// locks; no part of the Accelerator's API.
pub(crate) use ddp_core::sync::lock;

/// The level-1 pieces a user of the Accelerator or the Trainer reaches without depending on ddp-core: the
/// process group the Accelerator hands out and its reduce ops, the job layout (`env`), ddp-core's error (what
/// [`AccelError::Ddp`] wraps), the worker launcher (`accel launch`'s engine, which the Trainer's parallel
/// hyperparameter trials use), and the in-process store that runs ranks as threads in tests. All are ddp-core's
/// items, re-exported unchanged.
pub mod dist {
    pub use ddp_core::launcher::{self, launch, LaunchConfig};
    pub use ddp_core::store::{MemoryStore, Store};
    pub use ddp_core::{env, DdpError, DeviceMesh, GroupOptions, ProcessGroup, ReduceOp, RunToken};
}
