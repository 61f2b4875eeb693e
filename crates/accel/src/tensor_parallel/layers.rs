//! The tensor-parallel layers (Megatron-LM §3, `megatron/core/tensor_parallel/layers.py`): column- and
//! row-parallel linear, vocab-parallel embedding.
//!
//! A column-parallel layer followed by a row-parallel one (an MLP, attention's projections) communicates twice
//! per step: *f* all-reduces the input gradient in the backward, *g* the output in the forward. At tp = 1 the
//! layers compute what `candle_nn::Linear` / `candle_nn::Embedding` compute with the full weights (the linear
//! products through `accel_nn::ops::linear`, one matrix product over all leading dimensions, equal to candle-nn's
//! within f32 rounding).

use super::{ParamBuilder, ParamInit, TensorParallel};
use crate::{AccelError, Result};
use accel_nn::ops::linear::{linear, Activation};
use candle_core::{DType, Module, Tensor, D};
use ddp_core::functional::{copy_to_group, gather_from_group, reduce_from_group};

/// Options of the parallel linear layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParallelLinearConfig {
    /// Add a bias (default true).
    pub bias: bool,
    /// Initialisation of the full weight (default Normal(0, 0.02²), GPT-2's).
    pub init: ParamInit,
    /// Initialisation of the full bias (default zeros, GPT-2's; candle-nn's `linear` draws
    /// Uniform(−1/√in, 1/√in)).
    pub bias_init: ParamInit,
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
            bias_init: ParamInit::Zeros,
            gather_output: false,
            pad_output: false,
        }
    }
}

/// `y = x Wᵀ + b` with `W` (`[out, in]`, parameter `weight`) split by rows — output features — over the tp group
/// (`[out/tp, in]` per rank; bias `[out/tp]`). Input `[.., in]` replicated; output `[.., out/tp]`, or `[.., out]`
/// with `gather_output`. With `pad_output`, `out` reads `out_padded` (the next multiple of tp) in these shapes,
/// except the gathered output, whose padding columns are cut off (`[.., out]`). Any float dtype (the parameters').
/// Megatron-LM's `ColumnParallelLinear`.
#[derive(Clone)]
pub struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TensorParallel,
    gather_output: bool,
    out_dim: usize,
}

impl ColumnParallelLinear {
    /// Creates `weight` (and `bias`) under `pb`. Errors: `out_dim` not divisible by tp without `pad_output` (the
    /// message names the parameter, the sizes, the tp sizes that divide and `pad_output`); a name already in the
    /// `VarMap`.
    pub fn new(pb: &ParamBuilder, in_dim: usize, out_dim: usize, cfg: ParallelLinearConfig) -> Result<Self> {
        let weight = if cfg.pad_output {
            pb.sharded_padded("weight", (out_dim, in_dim), 0, cfg.init)?
        } else {
            pb.sharded("weight", (out_dim, in_dim), 0, cfg.init).map_err(|e| hint_pad_output(e, pb.tp().size()))?
        };
        let bias = if !cfg.bias {
            None
        } else if cfg.pad_output {
            Some(pb.sharded_padded("bias", out_dim, 0, cfg.bias_init)?)
        } else {
            Some(pb.sharded("bias", out_dim, 0, cfg.bias_init)?)
        };
        Ok(ColumnParallelLinear { weight, bias, tp: pb.tp().clone(), gather_output: cfg.gather_output, out_dim })
    }

    /// A head whose weight is a [`VocabParallelEmbedding`]'s (weight tying, as GPT-2 ties its token embedding
    /// and its output projection; Press & Wolf 2017): `[vocab_padded/tp, d]` vocabulary-sharded, the same layout
    /// as a column-parallel `d → vocab` weight with `pad_output`, no bias, outputs not gathered (feed
    /// [`crate::tensor_parallel::vocab_parallel_cross_entropy`]). The gradient of the shared weight sums both
    /// uses. Under pipeline parallelism the last stage builds its own copy of the embedding's parameter (same
    /// name, same values) and the Accelerator sums the two copies' gradients (see `PipelineStage`).
    pub fn tied(embedding: &VocabParallelEmbedding) -> Self {
        ColumnParallelLinear {
            weight: embedding.weight.clone(),
            bias: None,
            tp: embedding.tp.clone(),
            gather_output: false,
            out_dim: embedding.vocab_size,
        }
    }

    /// A layer over `weight` and `bias` already laid out (this rank's pieces): what `accel::nn`'s `Linear`
    /// computes with after fetching its parameters (gathered under FULL_SHARD).
    pub(crate) fn from_parts(
        weight: Tensor,
        bias: Option<Tensor>,
        tp: &TensorParallel,
        gather_output: bool,
        out_dim: usize,
    ) -> Self {
        ColumnParallelLinear { weight, bias, tp: tp.clone(), gather_output, out_dim }
    }

    /// This rank's weight, `[out_padded/tp, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's bias, `[out_padded/tp]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Forward from a replicated input: applies *f* (`copy_to_group`) then [`ColumnParallelLinear::forward_copied`].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_copied(&copy_to_group(x, self.tp.group())?)
    }

    /// Forward from an input that already went through `copy_to_group` (several column-parallel layers reading
    /// one input — attention's q, k and v — share one *f*, so the backward all-reduces once).
    pub fn forward_copied(&self, x: &Tensor) -> Result<Tensor> {
        let y = linear(x, &self.weight, self.bias.as_ref(), Activation::None)?;
        if !self.gather_output {
            return Ok(y);
        }
        let y = gather_from_group(&y, self.tp.group(), y.rank() - 1)?;
        // Padded output features (pad_output) are not part of the model's output.
        if y.dim(D::Minus1)? > self.out_dim {
            return Ok(y.narrow(D::Minus1, 0, self.out_dim)?);
        }
        Ok(y)
    }
}

/// `y = x Wᵀ + b` with `W` (`[out, in]`) split by columns — input features — over the tp group (`[out, in/tp]` per
/// rank). Input `[.., in/tp]` (a column-parallel layer's output); the partial products are summed by *g*
/// (`reduce_from_group`), then the replicated bias `[out]` is added once. Output `[.., out]` replicated.
/// Megatron-LM's `RowParallelLinear` (with `input_is_parallel=True`).
#[derive(Clone)]
pub struct RowParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    tp: TensorParallel,
}

impl RowParallelLinear {
    /// Creates `weight` (and `bias`) under `pb`. Errors: `in_dim` not divisible by tp (naming the parameter, the
    /// sizes and the tp sizes that divide); a name already in the `VarMap`.
    pub fn new(pb: &ParamBuilder, in_dim: usize, out_dim: usize, cfg: ParallelLinearConfig) -> Result<Self> {
        let weight = pb.sharded("weight", (out_dim, in_dim), 1, cfg.init)?;
        let bias = if cfg.bias { Some(pb.replicated("bias", out_dim, cfg.bias_init)?) } else { None };
        Ok(RowParallelLinear { weight, bias, tp: pb.tp().clone() })
    }

    /// A layer over `weight` and `bias` already laid out (see `ColumnParallelLinear::from_parts`).
    pub(crate) fn from_parts(weight: Tensor, bias: Option<Tensor>, tp: &TensorParallel) -> Self {
        RowParallelLinear { weight, bias, tp: tp.clone() }
    }

    /// This rank's weight, `[out, in/tp]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The (replicated) bias, `[out]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Forward (see the type's documentation).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.tp.size() == 1 {
            // g is the identity on one rank: the bias goes into the product's own pass (one op forward and
            // backward instead of a broadcast add and the reduction of its gradient over all rows).
            return Ok(linear(x, &self.weight, self.bias.as_ref(), Activation::None)?);
        }
        let partial = linear(x, &self.weight, None, Activation::None)?;
        let y = reduce_from_group(&partial, self.tp.group())?;
        // The bias after the sum, so it is added once, not tp times.
        match &self.bias {
            Some(b) => Ok(y.broadcast_add(b)?),
            None => Ok(y),
        }
    }
}

/// A token embedding (`weight` `[vocab, dim]`) split by vocabulary rows over the tp group (padded to a multiple
/// of tp). Each rank looks up the ids in its range, zeros the others, and *g* sums the pieces. Input ids `[..]`
/// (u32); output `[.., dim]` replicated. Megatron-LM's `VocabParallelEmbedding`.
#[derive(Clone)]
pub struct VocabParallelEmbedding {
    weight: Tensor,
    tp: TensorParallel,
    vocab_size: usize,
}

impl VocabParallelEmbedding {
    /// Creates `weight` under `pb` with `init` (padding rows are zero).
    pub fn new(pb: &ParamBuilder, vocab_size: usize, dim: usize, init: ParamInit) -> Result<Self> {
        let weight = pb.sharded_padded("weight", (vocab_size, dim), 0, init)?;
        Ok(VocabParallelEmbedding { weight, tp: pb.tp().clone(), vocab_size })
    }

    /// An embedding over `weight`, this rank's rows (see `ColumnParallelLinear::from_parts`).
    pub(crate) fn from_parts(weight: Tensor, tp: &TensorParallel, vocab_size: usize) -> Self {
        VocabParallelEmbedding { weight, tp: tp.clone(), vocab_size }
    }

    /// This rank's rows of the weight, `[padded_vocab/tp, dim]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Forward (see the type's documentation). Errors: an id ≥ vocab_size, ids not of an integer dtype. The id
    /// check reads the largest id back to the host (one small device sync per call).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let ids = check_ids(ids, self.vocab_size, "VocabParallelEmbedding")?;
        if self.tp.size() == 1 {
            return Ok(candle_nn::Embedding::new(self.weight.clone(), self.weight.dim(1)?).forward(&ids)?);
        }
        let rows = self.weight.dim(0)?;
        let start = self.tp.rank() * rows;
        let (mask, local) = local_ids(&ids, start, rows)?;
        let emb = candle_nn::Embedding::new(self.weight.clone(), self.weight.dim(1)?).forward(&local)?;
        // Ids another rank owns were clamped into this rank's range: zero their rows so only the owner counts.
        let emb = emb.broadcast_mul(&mask.to_dtype(emb.dtype())?.unsqueeze(D::Minus1)?)?;
        Ok(reduce_from_group(&emb, self.tp.group())?)
    }
}

/// The layers as candle modules (the inherent `forward`s, with accel's error type, behind candle's): they compose
/// with `candle_nn::seq`, `Tensor::apply` and a user's own `Module`s.
impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(ColumnParallelLinear::forward(self, x)?)
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(RowParallelLinear::forward(self, x)?)
    }
}

impl Module for VocabParallelEmbedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Ok(VocabParallelEmbedding::forward(self, ids)?)
    }
}

/// A column-parallel size error, plus the pointer to `pad_output`.
fn hint_pad_output(e: AccelError, tp: usize) -> AccelError {
    match e {
        AccelError::InvalidArgument(m) if m.contains("does not divide") => AccelError::InvalidArgument(format!(
            "{m}; or set ParallelLinearConfig::pad_output to pad it to a multiple of {tp} (vocabulary heads)"
        )),
        e => e,
    }
}

/// `ids` as u32, checked to be `< vocab_size`. Errors name the layer, the offending id and the vocabulary size.
pub(crate) fn check_ids(ids: &Tensor, vocab_size: usize, what: &str) -> Result<Tensor> {
    let ids = match ids.dtype() {
        DType::U32 => ids.clone(),
        DType::U8 | DType::I64 | DType::I32 | DType::I16 => {
            let min = ids.flatten_all()?.to_dtype(DType::I64)?.min(0);
            if let Ok(min) = min.and_then(|m| m.to_scalar::<i64>()) {
                if min < 0 {
                    return Err(AccelError::InvalidArgument(format!(
                        "{what}: id {min} is negative (ids must lie in 0..{vocab_size})"
                    )));
                }
            }
            ids.to_dtype(DType::U32)?
        }
        dt => {
            return Err(AccelError::InvalidArgument(format!(
                "{what}: ids must be of an integer dtype (u32), not {dt:?}"
            )))
        }
    };
    if ids.elem_count() > 0 {
        let max = ids.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize;
        if max >= vocab_size {
            return Err(AccelError::InvalidArgument(format!(
                "{what}: id {max} is out of range for a vocabulary of {vocab_size} (ids must lie in 0..{vocab_size})"
            )));
        }
    }
    Ok(ids)
}

/// For the rows `start..start+len` this rank holds: a u8 mask of the ids in that range and the ids made local
/// (`id − start`, clamped into `0..len` where masked out, so every lookup is in bounds).
pub(crate) fn local_ids(ids: &Tensor, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
    let end = start + len;
    let mask = ids.ge(start as f64)?.mul(&ids.lt(end as f64)?)?;
    let start_t = Tensor::new(start as u32, ids.device())?;
    let local = ids.clamp(start as u32, (end - 1) as u32)?.broadcast_sub(&start_t)?;
    Ok((mask, local))
}
