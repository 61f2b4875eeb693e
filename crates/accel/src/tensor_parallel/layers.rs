//! The tensor-parallel layers (Megatron-LM §3): column- and row-parallel linear, vocab-parallel embedding.
//!
//! TODO(helper tp-layers): implement.

use super::{ParamBuilder, ParamInit, TensorParallel};
use crate::Result;
use candle_core::Tensor;

/// Options of the parallel linear layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParallelLinearConfig {
    /// Add a bias (default true).
    pub bias: bool,
    /// Initialisation of the full weight (default Normal(0, 0.02²), GPT-2's); the bias starts at zero.
    pub init: ParamInit,
    /// Column-parallel only: all-gather the output so every rank gets `[.., out]` (default false: `[.., out/tp]`).
    pub gather_output: bool,
    /// Column-parallel only: pad `out` up to a multiple of tp instead of refusing it (vocabulary heads; the padded
    /// outputs are zero-weight columns a vocab-parallel loss masks out). Default false.
    pub pad_output: bool,
}

impl Default for ParallelLinearConfig {
    fn default() -> Self {
        ParallelLinearConfig {
            bias: true,
            init: ParamInit::Normal { std: 0.02 },
            gather_output: false,
            pad_output: false,
        }
    }
}

/// `y = x Wᵀ + b` with `W` (`[out, in]`, parameter `weight`) split by rows — output features — over the tp group
/// (`[out/tp, in]` per rank; bias `[out/tp]`). Input `[.., in]` replicated; output `[.., out/tp]`, or `[.., out]`
/// with `gather_output`.
pub struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TensorParallel,
    gather_output: bool,
}

impl ColumnParallelLinear {
    /// Creates `weight` (and `bias`) under `pb`. Errors: `out_dim` not divisible by tp without `pad_output`.
    pub fn new(pb: &ParamBuilder, in_dim: usize, out_dim: usize, cfg: ParallelLinearConfig) -> Result<Self> {
        let _ = (pb, in_dim, out_dim, cfg);
        todo!()
    }

    /// Forward from a replicated input: applies *f* (`copy_to_group`) then [`ColumnParallelLinear::forward_copied`].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _ = x;
        todo!()
    }

    /// Forward from an input that already went through `copy_to_group` (several column-parallel layers reading
    /// one input — attention's q, k and v — share one *f*, so the backward all-reduces once).
    pub fn forward_copied(&self, x: &Tensor) -> Result<Tensor> {
        let _ = (x, &self.weight, &self.bias, &self.tp, self.gather_output);
        todo!()
    }
}

/// `y = x Wᵀ + b` with `W` (`[out, in]`) split by columns — input features — over the tp group (`[out, in/tp]` per
/// rank). Input `[.., in/tp]` (a column-parallel layer's output); the partial products are summed by *g*
/// (`reduce_from_group`), then the replicated bias `[out]` is added once. Output `[.., out]` replicated.
pub struct RowParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TensorParallel,
}

impl RowParallelLinear {
    /// Creates `weight` (and `bias`) under `pb`. Errors: `in_dim` not divisible by tp.
    pub fn new(pb: &ParamBuilder, in_dim: usize, out_dim: usize, cfg: ParallelLinearConfig) -> Result<Self> {
        let _ = (pb, in_dim, out_dim, cfg);
        todo!()
    }

    /// Forward (see the type's documentation).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _ = (x, &self.weight, &self.bias, &self.tp);
        todo!()
    }
}

/// A token embedding (`weight` `[vocab, dim]`) split by vocabulary rows over the tp group (padded to a multiple
/// of tp). Each rank looks up the ids in its range, zeros the others, and *g* sums the pieces. Input ids `[..]`
/// (u32); output `[.., dim]` replicated.
pub struct VocabParallelEmbedding {
    weight: Tensor,
    tp: TensorParallel,
    vocab_size: usize,
}

impl VocabParallelEmbedding {
    /// Creates `weight` under `pb` with `init` (padding rows are zero).
    pub fn new(pb: &ParamBuilder, vocab_size: usize, dim: usize, init: ParamInit) -> Result<Self> {
        let _ = (pb, vocab_size, dim, init);
        todo!()
    }

    /// Forward (see the type's documentation). Errors: an id ≥ vocab_size.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let _ = (ids, &self.weight, &self.tp, self.vocab_size);
        todo!()
    }
}
