//! Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; picotron / nanotron for the readable form): parameters
//! split across the ranks of a tensor-parallel group, the layers that compute with the pieces, and the
//! vocab-parallel cross entropy that never gathers the full logits.
//!
//! - [`TensorParallel`]: the tp group plus the layout of every parameter built through it ([`ParamLayout`]).
//!   The Accelerator reads those layouts to count a sharded parameter's norm once per shard, to gather full
//!   tensors into `model.safetensors` and to slice them back on load.
//! - [`ParamBuilder`]: creates a model's parameters from one seed on the *full* model (each parameter drawn from
//!   its own stream named after it), keeping this rank's slice, so every layout starts from the same weights.
//! - Layers: [`ColumnParallelLinear`], [`RowParallelLinear`], [`VocabParallelEmbedding`], and
//!   [`vocab_parallel_cross_entropy`].
//! - [`dropout`]: masks addressed by an element's single-process coordinates, so every layout draws the
//!   single-process mask (replicated regions alike on every tp rank, sharded regions per shard).
//!
//! At tp = 1 everything reduces to the dense computation (no communication).

mod cross_entropy;
mod dropout;
mod init;
mod layers;

pub use cross_entropy::vocab_parallel_cross_entropy;
pub use dropout::{dropout, dropout_context, dropout_mask, with_dropout_context, DropoutContext, ShardedDim};
pub(crate) use init::{divisors, draw_full, ParamSource, ShapeRecord};
pub use init::{InitialWeights, ParamBuilder, ParamInit};
pub use layers::{ColumnParallelLinear, ParallelLinearConfig, RowParallelLinear, VocabParallelEmbedding};

use crate::{lock, AccelError, Result};
use candle_core::{Tensor, TensorId, Var};
use ddp_core::ProcessGroup;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// How one parameter is laid out over the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamLayout {
    /// Every tp rank holds the whole parameter (layer norms, position embeddings, a row-parallel bias). Its
    /// gradient is the same on every tp rank.
    Replicated,
    /// Split along `dim` into `tp` equal chunks of `padded / tp`, rank `r` holding chunk `r`. `full` is the
    /// model's size along `dim`; `padded ≥ full` is the next multiple of tp (rows `full..padded` are padding:
    /// zero, never read as real values, and dropped from checkpoints).
    Sharded {
        /// The split dimension.
        dim: usize,
        /// The size along `dim` of the full, unpadded parameter.
        full: usize,
        /// `full` rounded up to a multiple of the tp size.
        padded: usize,
    },
}

impl ParamLayout {
    /// The rows (along the sharded dim, in padded coordinates) tp rank `rank` of `size` holds; `None` when
    /// replicated.
    pub fn shard_range(&self, rank: usize, size: usize) -> Option<Range<usize>> {
        match *self {
            ParamLayout::Replicated => None,
            ParamLayout::Sharded { padded, .. } => {
                let chunk = padded / size;
                Some(rank * chunk..(rank + 1) * chunk)
            }
        }
    }
}

/// The tensor-parallel group and the layouts of the parameters built through it. Cheap to clone; clones share
/// the layout registry.
#[derive(Clone)]
pub struct TensorParallel {
    group: ProcessGroup,
    layouts: Arc<Mutex<HashMap<TensorId, ParamLayout>>>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel").field("rank", &self.rank()).field("size", &self.size()).finish()
    }
}

impl TensorParallel {
    /// Tensor parallelism over `group` (a one-rank group: no tensor parallelism).
    pub fn new(group: ProcessGroup) -> Self {
        TensorParallel { group, layouts: Arc::default() }
    }

    /// The tp group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// This rank's index in the tp group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The tp size.
    pub fn size(&self) -> usize {
        self.group.world_size()
    }

    /// The layout of `var` ([`ParamLayout::Replicated`] for a parameter not built through a [`ParamBuilder`]
    /// and not yet prepared: `prepare_model` registers every parameter, checking that an unregistered one really
    /// is the same on every tp rank).
    pub fn layout(&self, var: &Var) -> ParamLayout {
        self.registered(var).unwrap_or(ParamLayout::Replicated)
    }

    /// The layout `var` was registered with, if any.
    pub(crate) fn registered(&self, var: &Var) -> Option<ParamLayout> {
        lock(&self.layouts).get(&var.as_tensor().id()).copied()
    }

    pub(crate) fn register(&self, var: &Var, layout: ParamLayout) {
        lock(&self.layouts).insert(var.as_tensor().id(), layout);
    }
}

impl ParamLayout {
    /// This tp rank's piece of a full parameter `full` (the model's shape: `full.dim(dim) == self.full`): padded
    /// with zeros to `padded` along `dim`, then narrowed to [`ParamLayout::shard_range`]. A replicated parameter
    /// comes back whole. Errors: a size along `dim` other than `full`.
    pub fn slice(&self, full: &Tensor, rank: usize, size: usize) -> Result<Tensor> {
        let ParamLayout::Sharded { dim, full: n, padded } = *self else { return Ok(full.clone()) };
        if full.dim(dim)? != n {
            return Err(AccelError::InvalidArgument(format!(
                "tensor parallelism: a tensor of shape {:?} has {} rows along dim {dim}, but the parameter has {n}",
                full.shape(),
                full.dim(dim)?
            )));
        }
        let padded_t = if padded > n {
            let mut pad_shape = full.dims().to_vec();
            pad_shape[dim] = padded - n;
            Tensor::cat(&[full, &Tensor::zeros(pad_shape, full.dtype(), full.device())?], dim)?
        } else {
            full.clone()
        };
        let range = self.shard_range(rank, size).expect("sharded");
        Ok(padded_t.narrow(dim, range.start, range.len())?.contiguous()?)
    }

    /// The full parameter from this rank's `shard`: all-gathers the shards over `tp`'s group along `dim` and drops
    /// the padding (collective over the tp group; every tp rank gets the full tensor). A replicated parameter
    /// comes back as is, without communication.
    pub fn gather(&self, shard: &Tensor, tp: &TensorParallel) -> Result<Tensor> {
        let ParamLayout::Sharded { dim, full, .. } = *self else { return Ok(shard.clone()) };
        if tp.size() == 1 {
            return Ok(shard.narrow(dim, 0, full)?);
        }
        // all_gather_tensor concatenates along dim 0: move `dim` to the front and back.
        let front = shard.transpose(0, dim)?.contiguous()?;
        let gathered = tp.group().all_gather_tensor(&front)?;
        Ok(gathered.transpose(0, dim)?.narrow(dim, 0, full)?.contiguous()?)
    }
}
