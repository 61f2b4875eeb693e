//! The layers of [`crate::nn`], made by candle's constructors (`linear`, `embedding`, `layer_norm`, `rms_norm`)
//! over a [`VarBuilder`]: each draws candle's initial distribution from the run's seed and takes the
//! tensor-parallel style the plan gives its path.

use super::builder::{LayerKind, Param, VarBuilder};
use crate::plan::ParallelStyle;
use crate::tensor_parallel::{
    dropout as tp_dropout, ColumnParallelLinear, ParallelLinearConfig, ParamInit, RowParallelLinear, ShardedDim,
    TensorParallel, VocabParallelEmbedding,
};
use crate::{AccelError, Result};
use accel_nn::ops::linear::Activation;
use candle_core::{DType, Module, ModuleT, Shape, Tensor, D};
use candle_nn::{Init, LayerNormConfig};

/// A linear layer `y = x Wᵀ + b` (`weight` `[out, in]`, `bias` `[out]`), split over the tp group as the plan says:
///
/// | style | this rank's weight | input | output |
/// |---|---|---|---|
/// | `replicate` | `[out, in]` | `[.., in]` | `[.., out]` |
/// | `colwise` | `[out/tp, in]` | `[.., in]` | `[.., out/tp]` |
/// | `colwise_rep` | `[out/tp, in]` | `[.., in]` | `[.., out]` (all-gathered) |
/// | `vocab_parallel` | `[out_padded/tp, in]` | `[.., in]` | `[.., out_padded/tp]` (for a vocab-parallel loss) |
/// | `rowwise` | `[out, in/tp]` | `[.., in/tp]` | `[.., out]` (summed over the group) |
///
/// At tp = 1 every style computes `candle_nn::Linear`'s product (through `accel_nn::ops::linear`). Any float dtype.
#[derive(Clone)]
pub struct Linear {
    weight: Param,
    bias: Option<Param>,
    style: ParallelStyle,
    path: String,
    in_dim: usize,
    out_dim: usize,
    tp: TensorParallel,
    activation: Activation,
}

/// A linear layer with a bias (candle-nn's `linear`: weight Kaiming-normal over the input features, bias
/// Uniform(−1/√in, 1/√in), drawn from the run's seed on the full shape). Errors: the plan's (see
/// [`crate::plan`]): a linear no rule covers at tp > 1, sizes the tp size does not divide (naming the parameter,
/// its shape and the tp sizes that fit), a name already taken.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> candle_core::Result<Linear> {
    linear_b(in_dim, out_dim, true, vb)
}

/// A linear layer without bias (candle-nn's `linear_no_bias`). Errors: as [`linear`].
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> candle_core::Result<Linear> {
    linear_b(in_dim, out_dim, false, vb)
}

/// A linear layer with or without bias (candle-nn's `linear_b`). Errors: as [`linear`].
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> candle_core::Result<Linear> {
    let bias = bias.then(|| Init::Uniform { lo: -1.0 / (in_dim as f64).sqrt(), up: 1.0 / (in_dim as f64).sqrt() });
    Ok(Linear::build(in_dim, out_dim, LinearInit { weight: candle_nn::init::DEFAULT_KAIMING_NORMAL, bias }, &vb)?)
}

/// The initial distributions of a linear layer's parameters, for [`linear_init`] (candle-nn's `linear` draws a
/// Kaiming-normal weight and a Uniform(±1/√in) bias; GPT-2 draws Normal(0, 0.02²) and zeros).
#[derive(Debug, Clone, Copy)]
pub struct LinearInit {
    /// The weight's distribution, over its full `[out, in]` shape (Kaiming's fan is the full layer's).
    pub weight: Init,
    /// The bias's distribution; `None`: no bias.
    pub bias: Option<Init>,
}

/// A linear layer whose parameters are drawn from `init` (by name, from the run's seed, on the full shape) instead
/// of candle's defaults; otherwise [`linear`] (the plan's style, its errors).
pub fn linear_init(in_dim: usize, out_dim: usize, init: LinearInit, vb: VarBuilder) -> candle_core::Result<Linear> {
    Ok(Linear::build(in_dim, out_dim, init, &vb)?)
}

impl Linear {
    fn build(in_dim: usize, out_dim: usize, init: LinearInit, vb: &VarBuilder) -> Result<Self> {
        let (style, rule) = vb.style_for(LayerKind::Linear, &[out_dim, in_dim])?;
        let full = Shape::from((out_dim, in_dim));
        let bias = init.bias.is_some();
        let bias_init = init.bias.map_or(ParamInit::Zeros, |b| ParamInit::from_candle(b, &Shape::from(out_dim)));
        let init = ParamInit::from_candle(init.weight, &full);
        let cfg = ParallelLinearConfig { bias, init, bias_init, gather_output: false, pad_output: false };
        let pb = vb.param_builder();
        let in_plan = |e: AccelError| match e {
            AccelError::InvalidArgument(m) => AccelError::InvalidArgument(format!(
                "parallel plan: linear `{}` is {style}{}: {m}",
                vb.prefix(),
                rule.map(|i| format!(" (from `{}`)", vb.plan().pattern(i))).unwrap_or_default()
            )),
            e => e,
        };
        // The parallel layers draw and register the parameters; the layer keeps them as `Param`s.
        let column = |cfg| -> Result<(Tensor, Option<Tensor>)> {
            let c = ColumnParallelLinear::new(pb, in_dim, out_dim, cfg).map_err(in_plan)?;
            Ok((c.weight().clone(), c.bias().cloned()))
        };
        let (weight, bias_t) = match style {
            ParallelStyle::Colwise | ParallelStyle::ColwiseRep => column(cfg)?,
            ParallelStyle::VocabParallel => column(ParallelLinearConfig { pad_output: true, ..cfg })?,
            ParallelStyle::Rowwise => {
                let r = RowParallelLinear::new(pb, in_dim, out_dim, cfg).map_err(in_plan)?;
                (r.weight().clone(), r.bias().cloned())
            }
            ParallelStyle::Replicate => (
                pb.replicated("weight", full, init)?,
                if bias { Some(pb.replicated("bias", out_dim, bias_init)?) } else { None },
            ),
        };
        let mut params = vec![("weight", &weight, vec![out_dim, in_dim])];
        if let Some(b) = &bias_t {
            params.push(("bias", b, vec![out_dim]));
        }
        let mut held = vb.record(LayerKind::Linear, style, rule, &params).into_iter();
        let (weight, bias) = (held.next().expect("a weight"), held.next());
        let (path, tp) = (vb.prefix(), vb.tp().clone());
        Ok(Linear { weight, bias, style, path, in_dim, out_dim, tp, activation: Activation::None })
    }

    /// A head whose weight is `embedding`'s (weight tying, Press & Wolf 2017): `[vocab, d]` → logits `[.., vocab]`,
    /// no bias; a vocab-parallel embedding gives a vocab-parallel head (this rank's `vocab_padded/tp` logits).
    pub fn tied(embedding: &Embedding) -> Self {
        let style = if embedding.dense { ParallelStyle::Replicate } else { ParallelStyle::VocabParallel };
        Linear {
            weight: embedding.weight.clone(),
            bias: None,
            style,
            path: embedding.path.clone(),
            in_dim: embedding.hidden_size,
            out_dim: embedding.vocab_size,
            tp: embedding.tp.clone(),
            activation: Activation::None,
        }
    }

    /// The same layer with `activation` applied to its output (`relu(x Wᵀ + b)`): fused into the product for a
    /// replicated layer (`accel_nn::ops::linear`, one kernel forward and backward on the CPU in f32), after it
    /// otherwise — on this rank's columns for a column-wise layer (an element-wise function of its own outputs),
    /// after the sum for a row-wise one.
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// This rank's weight (see the type's table for its shape); under FULL_SHARD gathered for this call.
    pub fn weight(&self) -> candle_core::Result<Tensor> {
        Ok(self.weight.get()?)
    }

    /// This rank's bias, if any; under FULL_SHARD gathered for this call.
    pub fn bias(&self) -> candle_core::Result<Option<Tensor>> {
        Ok(self.bias.as_ref().map(Param::get).transpose()?)
    }

    /// The style the plan gave this layer.
    pub fn style(&self) -> ParallelStyle {
        self.style
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let book = self.weight.book();
        let (weight, bias) = (self.weight()?, self.bias()?);
        let column = |keep: bool, gather: bool| -> Result<Tensor> {
            let x = book.copy_for_columns(x, &self.tp, keep)?;
            ColumnParallelLinear::from_parts(weight.clone(), bias.clone(), &self.tp, gather, self.out_dim)
                .forward_copied(&x)
        };
        let y = match self.style {
            ParallelStyle::Colwise => column(true, false)?,
            ParallelStyle::ColwiseRep => column(true, true)?,
            ParallelStyle::VocabParallel => {
                // The model's last layer: its input copy is not kept past it.
                let y = column(false, false)?;
                book.forget_column_input();
                y
            }
            ParallelStyle::Replicate => {
                book.forget_column_input();
                return accel_nn::ops::linear::linear(x, &weight, bias.as_ref(), self.activation);
            }
            ParallelStyle::Rowwise => {
                book.forget_column_input();
                let local = weight.dim(1)?;
                let width = x.dim(D::Minus1)?;
                if width != local {
                    return Err(AccelError::InvalidArgument(format!(
                        "row-wise linear `{}` reads {local} of its {} input features on this rank but got an input \
                         of width {width}; a row-wise layer takes the split output of a column-wise layer before it \
                         (give that layer `colwise`), or give this one `replicate`",
                        self.path, self.in_dim
                    ))
                    .into());
                }
                RowParallelLinear::from_parts(weight, bias, &self.tp).forward(x)?
            }
        };
        match self.activation {
            Activation::None => Ok(y),
            Activation::Relu => y.relu(),
        }
    }
}

impl Linear {
    /// Where this layer's output `y` (`[.., features]`) sits in the single-process output when it is split over
    /// the tp group (column-wise, vocab-parallel: this rank's slice of the last dimension), for a dropout whose
    /// mask must be the single-process mask's slice ([`Dropout::forward_split`]); `None` for a whole output.
    pub fn output_split(&self, y: &Tensor) -> candle_core::Result<Option<ShardedDim>> {
        if !matches!(self.style, ParallelStyle::Colwise | ParallelStyle::VocabParallel) || self.tp.size() == 1 {
            return Ok(None);
        }
        let dim = y.rank() - 1;
        let local = y.dim(dim)?;
        Ok(Some(ShardedDim { dim, full: local * self.tp.size(), start: self.tp.rank() * local }))
    }
}

/// A token embedding (`weight` `[vocab, d]`): ids `[..]` (an integer dtype) → `[.., d]`. Replicated, or under
/// `vocab_parallel` (also `rowwise`, torchtitan's name for it) split by vocabulary rows, padded to a multiple of
/// tp, each rank looking up its ids and the pieces summed over the group.
#[derive(Clone)]
pub struct Embedding {
    weight: Param,
    dense: bool,
    path: String,
    vocab_size: usize,
    hidden_size: usize,
    tp: TensorParallel,
}

/// An embedding of `in_size` tokens into `out_size` features (candle-nn's `embedding`: Normal(0, 1) drawn from
/// the run's seed). Errors: a plan style other than `vocab_parallel`, `rowwise` or `replicate`; a name already
/// taken.
pub fn embedding(in_size: usize, out_size: usize, vb: VarBuilder) -> candle_core::Result<Embedding> {
    embedding_init(in_size, out_size, Init::Randn { mean: 0.0, stdev: 1.0 }, vb)
}

/// An embedding whose weight is drawn from `init` (GPT-2: Normal(0, 0.02²)) instead of candle's Normal(0, 1);
/// otherwise [`embedding`].
pub fn embedding_init(in_size: usize, out_size: usize, init: Init, vb: VarBuilder) -> candle_core::Result<Embedding> {
    Ok(Embedding::build(in_size, out_size, init, &vb)?)
}

impl Embedding {
    fn build(vocab: usize, d: usize, init: Init, vb: &VarBuilder) -> Result<Self> {
        let (style, rule) = vb.style_for(LayerKind::Embedding, &[vocab, d])?;
        let init = ParamInit::from_candle(init, &Shape::from((vocab, d)));
        let pb = vb.param_builder();
        let dense = style == ParallelStyle::Replicate;
        let weight = match dense {
            true => pb.replicated("weight", (vocab, d), init)?,
            false => VocabParallelEmbedding::new(pb, vocab, d, init)?.weight().clone(),
        };
        let weight = vb.record(LayerKind::Embedding, style, rule, &[("weight", &weight, vec![vocab, d])]).remove(0);
        Ok(Embedding { weight, dense, path: vb.prefix(), vocab_size: vocab, hidden_size: d, tp: vb.tp().clone() })
    }

    /// This rank's rows of the weight (`[vocab, d]`, or `[vocab_padded/tp, d]` vocab-parallel); under FULL_SHARD
    /// gathered for this call.
    pub fn embeddings(&self) -> candle_core::Result<Tensor> {
        Ok(self.weight.get()?)
    }

    /// The feature width `d`.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.weight.book().forget_column_input();
        let weight = self.embeddings()?;
        match self.dense {
            true => candle_nn::Embedding::new(weight, self.hidden_size).forward(ids),
            false => Ok(VocabParallelEmbedding::from_parts(weight, &self.tp, self.vocab_size).forward(ids)?),
        }
    }
}

/// Layer normalisation over the last dimension (Ba et al. 2016), or RMS normalisation without the mean (Zhang &
/// Sennrich 2019) — candle-nn's `LayerNorm`, with a backward: `[.., d]` → `[.., d]` in the input's dtype
/// (computed in f32 for bf16/f16). Replicated on every tp rank. With a bias and the mean removed, the fused
/// `accel_nn::ops::layer_norm` (CPU f32); otherwise composed candle ops.
#[derive(Clone)]
pub struct LayerNorm {
    weight: Param,
    bias: Option<Param>,
    remove_mean: bool,
    eps: f64,
}

/// A layer norm over `size` features (candle-nn's `layer_norm`: `weight` ones, `bias` zeros when `affine`).
/// Errors: a plan style other than `replicate`.
pub fn layer_norm<C: Into<LayerNormConfig>>(size: usize, config: C, vb: VarBuilder) -> candle_core::Result<LayerNorm> {
    let config = config.into();
    Ok(LayerNorm::build(size, config.eps, config.remove_mean, config.affine, &vb)?)
}

/// A layer norm without bias (candle-nn's `layer_norm_no_bias`). Errors: as [`layer_norm`].
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<LayerNorm> {
    Ok(LayerNorm::build(size, eps, true, false, &vb)?)
}

impl LayerNorm {
    fn build(size: usize, eps: f64, remove_mean: bool, affine: bool, vb: &VarBuilder) -> Result<Self> {
        let (style, rule) = vb.style_for(LayerKind::Norm, &[size])?;
        let weight = vb.param_builder().replicated("weight", size, ParamInit::Ones)?;
        let bias = if affine { Some(vb.param_builder().replicated("bias", size, ParamInit::Zeros)?) } else { None };
        let mut params = vec![("weight", &weight, vec![size])];
        if let Some(b) = &bias {
            params.push(("bias", b, vec![size]));
        }
        let mut held = vb.record(LayerKind::Norm, style, rule, &params).into_iter();
        let (weight, bias) = (held.next().expect("a weight"), held.next());
        Ok(LayerNorm { weight, bias, remove_mean, eps })
    }

    /// The scale `[d]`; under FULL_SHARD gathered for this call.
    pub fn weight(&self) -> candle_core::Result<Tensor> {
        Ok(self.weight.get()?)
    }

    /// The shift `[d]`, if any; under FULL_SHARD gathered for this call.
    pub fn bias(&self) -> candle_core::Result<Option<Tensor>> {
        Ok(self.bias.as_ref().map(Param::get).transpose()?)
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.weight.book().forget_column_input();
        let (weight, bias) = (self.weight()?, self.bias()?);
        if let (true, Some(bias)) = (self.remove_mean, &bias) {
            return Ok(accel_nn::ops::layer_norm::layer_norm(x, &weight, bias, self.eps)?);
        }
        // candle-nn's composed path (differentiable): statistics in f32 for half-precision inputs.
        let dtype = x.dtype();
        let internal = if matches!(dtype, DType::F16 | DType::BF16) { DType::F32 } else { dtype };
        let d = x.dim(D::Minus1)? as f64;
        let x = x.to_dtype(internal)?;
        let x = if self.remove_mean { x.broadcast_sub(&(x.sum_keepdim(D::Minus1)? / d)?)? } else { x };
        let mean_sq = (x.sqr()?.sum_keepdim(D::Minus1)? / d)?;
        let normed = x.broadcast_div(&(mean_sq + self.eps)?.sqrt()?)?.to_dtype(dtype)?.broadcast_mul(&weight)?;
        match &bias {
            Some(b) => normed.broadcast_add(b),
            None => Ok(normed),
        }
    }
}

/// RMS normalisation (Zhang & Sennrich 2019; Llama's `RMSNorm`): `x / √(mean(x²) + eps) · weight`, `weight` `[d]`
/// ones. Replicated on every tp rank.
#[derive(Clone)]
pub struct RmsNorm(LayerNorm);

/// An RMS norm over `size` features (candle-nn's `rms_norm`). Errors: a plan style other than `replicate`.
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<RmsNorm> {
    Ok(RmsNorm(LayerNorm::build(size, eps, false, false, &vb)?))
}

impl RmsNorm {
    /// The scale `[d]`; under FULL_SHARD gathered for this call.
    pub fn weight(&self) -> candle_core::Result<Tensor> {
        self.0.weight()
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
}

/// Dropout whose mask is the single-process mask at every layout ([`crate::tensor_parallel::dropout`]), at a site
/// named by its builder path. `forward_t(x, true)` drops inside a training step's dropout context (outside one,
/// and with `train` false, the identity), for an activation every tp rank holds whole; an activation a
/// column-wise layer split goes through [`Dropout::forward_split`], which draws this rank's slice of the
/// single-process mask.
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    p: f64,
    site: u64,
}

/// Dropout with probability `p` at the site `vb`'s path names. Errors: `p` outside [0, 1).
pub fn dropout(p: f64, vb: VarBuilder) -> candle_core::Result<Dropout> {
    if !(0.0..1.0).contains(&p) {
        return Err(AccelError::InvalidArgument(format!(
            "dropout `{}`: probability {p} is outside [0, 1); 0 turns dropout off",
            vb.prefix()
        ))
        .into());
    }
    if let Some(record) = vb.param_builder().shape_record() {
        record.dropout.fetch_or(p > 0.0, std::sync::atomic::Ordering::Relaxed);
    }
    // Sites below 2^32 are the hand-numbered ones of `tensor_parallel::dropout`'s callers; a path's hash lives
    // above them.
    Ok(Dropout { p, site: ddp_core::fingerprint::fnv1a(vb.prefix().as_bytes()) | (1 << 32) })
}

impl Dropout {
    /// The probability of dropping an element.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Training-mode dropout of `x`, split as `split` says (from the layer that made it,
    /// [`Linear::output_split`]; `None`: whole on every rank).
    pub fn forward_split(&self, x: &Tensor, split: Option<ShardedDim>) -> candle_core::Result<Tensor> {
        Ok(tp_dropout(x, self.p, self.site, split)?)
    }
}

impl ModuleT for Dropout {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        if !train {
            return Ok(x.clone());
        }
        self.forward_split(x, None)
    }
}
