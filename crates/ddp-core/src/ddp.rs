//! [`DistributedDataParallel`]: gradient averaging across ranks for candle parameters (like
//! `torch.nn.parallel.DistributedDataParallel`, reference: Li et al., "PyTorch Distributed: Experiences on
//! Accelerating Data Parallel Training", VLDB 2020).
//!
//! At construction parameter names and shapes are checked across ranks and rank 0's values are broadcast. After
//! `loss.backward()`, [`DistributedDataParallel::sync_gradients`] packs gradients into buckets (the first of
//! 1 MiB, then `bucket_cap_mb`, built in reverse parameter order), all-reduces them in bucket order and writes
//! the averages back into the `GradStore`.

use crate::{ProcessGroup, Result};
use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::VarMap;

/// Options of [`DistributedDataParallel`].
#[derive(Debug, Clone, PartialEq)]
pub struct DdpOptions {
    /// Cap of every bucket after the first, in MiB (default 25, as PyTorch).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in MiB (default 1, as PyTorch).
    pub first_bucket_cap_mb: f64,
    /// Allow parameters without a gradient (their slot is reduced as zeros) instead of failing (default false).
    pub find_unused_parameters: bool,
    /// Broadcast rank 0's parameter values at construction (default true).
    pub broadcast_parameters: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions { bucket_cap_mb: 25.0, first_bucket_cap_mb: 1.0, find_unused_parameters: false, broadcast_parameters: true }
    }
}

/// Keeps a model's gradients in sync across the ranks of a process group.
pub struct DistributedDataParallel {
    _pg: ProcessGroup,
}

impl DistributedDataParallel {
    /// Wraps the variables of a `VarMap` (sorted by name, so every rank sees the same order).
    pub fn new(pg: &ProcessGroup, varmap: &VarMap, opts: DdpOptions) -> Result<Self> {
        let _ = (pg, varmap, opts);
        todo!("ddp")
    }

    /// Wraps named variables in the given order (must be the same order on every rank).
    pub fn from_named_vars(pg: &ProcessGroup, vars: Vec<(String, Var)>, opts: DdpOptions) -> Result<Self> {
        let _ = (pg, vars, opts);
        todo!("ddp")
    }

    /// The wrapped parameters, in registration order.
    pub fn named_vars(&self) -> &[(String, Var)] {
        todo!("ddp")
    }

    /// Averages every parameter's gradient in `grads` across ranks (no-op while [`Self::set_require_sync`] is
    /// false). Errors name parameters with no gradient unless `find_unused_parameters`.
    pub fn sync_gradients(&self, grads: &mut GradStore) -> Result<()> {
        let _ = grads;
        todo!("ddp")
    }

    /// Turns gradient sync on or off (gradient accumulation: off for all but the last micro-batch).
    pub fn set_require_sync(&self, on: bool) {
        let _ = on;
        todo!("ddp")
    }

    /// Runs `f` with sync turned off, like PyTorch's `no_sync()` context manager.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        self.set_require_sync(false);
        let r = f();
        self.set_require_sync(true);
        r
    }

    /// Bucket layout: the parameter indices in each bucket, in communication order.
    pub fn bucket_layout(&self) -> Vec<Vec<usize>> {
        todo!("ddp")
    }
}
