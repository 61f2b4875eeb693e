//! A decoder-only character-level GPT (Radford et al. 2019, GPT-2's pre-norm block; sizes as Karpathy's nanoGPT
//! `shakespeare_char`, scaled down), written once with accel's tensor-parallel layers (Megatron-LM, Shoeybi et
//! al. 2019, §3) so the same code runs at tp = 1 (no communication) and split over tp = 2 / 4 ranks.
//!
//! ```text
//! ids [b, s] u32
//!  → wte (VocabParallelEmbedding, vocab rows sharded) + wpe (replicated, learned) → x [b, s, d]
//!  → n_layer × { x += attn(ln_1(x));  x += mlp(ln_2(x)) }
//!        attn: f → q, k, v (three ColumnParallelLinear, n_head/tp heads per rank) → causal softmax(q kᵀ/√hd) v
//!              → c_proj (RowParallelLinear, g)
//!        mlp:  c_fc (ColumnParallelLinear, d → d_ff/tp) → GELU (tanh) → c_proj (RowParallelLinear, g)
//!  → ln_f → lm_head (ColumnParallelLinear, no bias, vocabulary padded to a multiple of tp, not gathered)
//!  → logits [b, s, padded_vocab / tp]  (this rank's vocabulary columns)
//! ```
//!
//! Layer norms, the position embedding and the row-parallel biases are replicated (every tp rank holds them
//! whole). No dropout and no weight tying, so a tp run computes exactly what the single process computes up to
//! floating-point summation order. Every parameter is created through accel's
//! [`ParamBuilder`]: drawn on the full model from one seed (per parameter name), each rank keeping its slice, so
//! every layout starts from the same weights. Initialisation follows GPT-2: Normal(0, 0.02²) for the embeddings and
//! linear weights, Normal(0, (0.02/√(2·n_layer))²) for the two residual projections, zero biases, layer norms at
//! weight 1, bias 0.
//!
//! The linear layers, layer norm, causal self-attention and GELU are `accel_nn::ops`'s fused ops (one kernel forward and one backward
//! on the CPU in f32, candle's composed ops on other devices and dtypes; `ACCEL_FUSED_OPS=0` turns the fused
//! kernels off), so the same code runs fast on the CPU and unchanged on CUDA or in bf16.
//!
//! The default model for the examples ([`GptConfig::small`], Shakespeare's 76 characters): d_model 128, 4 heads,
//! 4 layers, context 64, d_ff 512 — 820 992 parameters ([`GptConfig::num_parameters`]).

use accel::pipeline::{Stage, StagedModel};
use accel::tensor_parallel::{
    dropout, vocab_parallel_cross_entropy, ColumnParallelLinear, ParallelLinearConfig, ParamBuilder, ParamInit,
    RowParallelLinear, ShardedDim, TensorParallel, VocabParallelEmbedding,
};
use accel::{AccelError, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use rand::Rng;

/// The sizes of a [`CharGpt`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    /// Number of tokens (characters); the embedding and the head are padded to a multiple of tp.
    pub vocab_size: usize,
    /// Context length: the longest sequence the model reads (rows of the position embedding).
    pub block_size: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block (split across the tp ranks).
    pub n_head: usize,
    /// Width of the residual stream; `n_head` must divide it (head size `d_model / n_head`).
    pub d_model: usize,
    /// Hidden width of the MLP (GPT-2 uses `4 · d_model`).
    pub d_ff: usize,
    /// The head reads its weight from the token embedding (`wte.weight`; GPT-2's weight tying): no
    /// `lm_head.weight`. Under pipeline parallelism the first and the last stage each hold a copy, kept equal.
    pub tie_embeddings: bool,
    /// Dropout probability in training (nanoGPT's Shakespeare config uses 0.2; 0: off): after the embedding, on
    /// both residual branches (nanoGPT's places) and on the MLP's hidden activation, which is sharded over tp (in
    /// place of nanoGPT's attention-probability dropout, which the fused attention kernel does not do). Masks from
    /// [`accel::tensor_parallel::dropout`]: the single-process mask at every layout.
    pub dropout: f64,
}

impl GptConfig {
    /// The examples' default: d_model 128, 4 heads, 4 layers, context 64, d_ff 512 (820 992 parameters for the
    /// 76-character Shakespeare vocabulary).
    pub fn small(vocab_size: usize) -> Self {
        GptConfig {
            vocab_size,
            block_size: 64,
            n_layer: 4,
            n_head: 4,
            d_model: 128,
            d_ff: 512,
            tie_embeddings: false,
            dropout: 0.0,
        }
    }

    /// Size of one attention head, `d_model / n_head`.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head.max(1)
    }

    /// Parameters of the full (unsharded, unpadded) model.
    pub fn num_parameters(&self) -> usize {
        let (v, d, f) = (self.vocab_size, self.d_model, self.d_ff);
        let ln = 2 * d;
        let block = ln + 3 * (d * d + d) + (d * d + d) + ln + (d * f + f) + (f * d + d);
        let head = if self.tie_embeddings { 0 } else { v * d };
        v * d + self.block_size * d + self.n_layer * block + ln + head
    }

    /// The tensor-parallel sizes this model can be split over: the common divisors of `n_head`, `d_model` and
    /// `d_ff` (the vocabulary is padded, so it does not constrain tp).
    pub fn fitting_tp_sizes(&self) -> Vec<usize> {
        (1..=self.n_head)
            .filter(|t| {
                self.n_head.is_multiple_of(*t) && self.d_model.is_multiple_of(*t) && self.d_ff.is_multiple_of(*t)
            })
            .collect()
    }

    /// Checks the sizes, and that a tensor-parallel group of `tp_size` ranks can split the model.
    ///
    /// Errors ([`AccelError::Config`], naming the sizes and what would fit): a size of 0; `n_head` not dividing
    /// `d_model`; `tp_size` 0 or not dividing `n_head`, `d_model` or `d_ff` (listing the tp sizes that would).
    pub fn validate(&self, tp_size: usize) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("block_size", self.block_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_model", self.d_model),
            ("d_ff", self.d_ff),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(config_error(name, 0, "must be at least 1".into()));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(AccelError::Config {
                key: "GptConfig.dropout".into(),
                value: self.dropout.to_string(),
                reason: "a probability in [0, 1) (0 turns dropout off; nanoGPT's Shakespeare config uses 0.2)".into(),
            });
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            let heads: Vec<usize> = (1..=self.d_model).filter(|h| self.d_model.is_multiple_of(*h)).collect();
            return Err(config_error(
                "n_head",
                self.n_head,
                format!(
                    "does not divide d_model = {} (the head size would not be whole); head counts that divide it: \
                     {heads:?}",
                    self.d_model
                ),
            ));
        }
        let fits = self.fitting_tp_sizes();
        if tp_size == 0 || !fits.contains(&tp_size) {
            let mut wrong = Vec::new();
            for (name, v) in [("n_head", self.n_head), ("d_model", self.d_model), ("d_ff", self.d_ff)] {
                if tp_size == 0 || !v.is_multiple_of(tp_size) {
                    wrong.push(format!("{name} = {v}"));
                }
            }
            return Err(config_error(
                "tp_size",
                tp_size,
                format!(
                    "tensor parallelism splits the attention heads, d_model and d_ff evenly over the tp ranks, but \
                     {tp_size} does not divide {}; tp sizes that fit this model (n_head {}, d_model {}, d_ff {}): \
                     {fits:?}",
                    wrong.join(", "),
                    self.n_head,
                    self.d_model,
                    self.d_ff
                ),
            ));
        }
        Ok(())
    }
}

fn config_error(key: &str, value: usize, reason: String) -> AccelError {
    AccelError::Config { key: format!("GptConfig.{key}"), value: value.to_string(), reason }
}

/// `LayerNorm(d)` with replicated `weight` (ones) and `bias` (zeros), eps 1e-5 (PyTorch's default), computed by
/// [`accel_nn::ops::layer_norm::layer_norm`] (fused on the CPU in f32; candle-nn's `layer_norm_slow` elsewhere, in
/// f32 for bf16/f16 inputs).
#[derive(Clone)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(pb: &ParamBuilder, d: usize) -> Result<Self> {
        Ok(LayerNorm {
            weight: pb.replicated("weight", d, ParamInit::Ones)?,
            bias: pb.replicated("bias", d, ParamInit::Zeros)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(accel_nn::ops::layer_norm::layer_norm(x, &self.weight, &self.bias, 1e-5)?)
    }
}

/// Causal self-attention with this rank's `n_head / tp` heads.
#[derive(Clone)]
struct Attention {
    q: ColumnParallelLinear,
    k: ColumnParallelLinear,
    v: ColumnParallelLinear,
    c_proj: RowParallelLinear,
    tp: TensorParallel,
    local_heads: usize,
    head_dim: usize,
    /// Dropout on the output (the residual branch): probability and site.
    dropout: (f64, u64),
}

impl Attention {
    fn new(pb: &ParamBuilder, cfg: &GptConfig, layer: usize) -> Result<Self> {
        let d = cfg.d_model;
        let col = ParallelLinearConfig::default();
        let proj = ParallelLinearConfig { init: residual_init(cfg), ..Default::default() };
        Ok(Attention {
            q: ColumnParallelLinear::new(&pb.pp("q"), d, d, col)?,
            k: ColumnParallelLinear::new(&pb.pp("k"), d, d, col)?,
            v: ColumnParallelLinear::new(&pb.pp("v"), d, d, col)?,
            c_proj: RowParallelLinear::new(&pb.pp("c_proj"), d, d, proj)?,
            tp: pb.tp().clone(),
            local_heads: cfg.n_head / pb.tp().size(),
            head_dim: cfg.head_dim(),
            dropout: (cfg.dropout, site(layer, 0)),
        })
    }

    /// `x` `[b, s, d]` replicated → `[b, s, d]` replicated.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // One f for the three projections: their input gradients are summed locally, then all-reduced once.
        let x = ddp_core::functional::copy_to_group(x, self.tp.group())?;
        let (q, k, v) = (self.q.forward_copied(&x)?, self.k.forward_copied(&x)?, self.v.forward_copied(&x)?);
        // softmax(q kᵀ / √hd) v per head, keys after the query masked; the heads stay side by side in the last
        // dimension, where the projections put them and c_proj reads them.
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let y = accel_nn::ops::attention::causal_self_attention(&q, &k, &v, self.local_heads, scale)?;
        dropout(&self.c_proj.forward(&y)?, self.dropout.0, self.dropout.1, None)
    }
}

/// `c_proj(GELU(c_fc(x)))`: d → d_ff/tp per rank → d (summed by g).
#[derive(Clone)]
struct Mlp {
    c_fc: ColumnParallelLinear,
    c_proj: RowParallelLinear,
    p: f64,
    /// Dropout sites: the hidden activation (this rank's `d_ff / tp` features of `d_ff`) and the output.
    hidden: (u64, ShardedDim),
    output: u64,
}

impl Mlp {
    fn new(pb: &ParamBuilder, cfg: &GptConfig, layer: usize) -> Result<Self> {
        let proj = ParallelLinearConfig { init: residual_init(cfg), ..Default::default() };
        let local = cfg.d_ff / pb.tp().size();
        Ok(Mlp {
            c_fc: ColumnParallelLinear::new(&pb.pp("c_fc"), cfg.d_model, cfg.d_ff, ParallelLinearConfig::default())?,
            c_proj: RowParallelLinear::new(&pb.pp("c_proj"), cfg.d_ff, cfg.d_model, proj)?,
            p: cfg.dropout,
            hidden: (site(layer, 1), ShardedDim { dim: 2, full: cfg.d_ff, start: pb.tp().rank() * local }),
            output: site(layer, 2),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = accel_nn::ops::activation::gelu(&self.c_fc.forward(x)?)?;
        let h = dropout(&h, self.p, self.hidden.0, Some(self.hidden.1))?;
        dropout(&self.c_proj.forward(&h)?, self.p, self.output, None)
    }
}

/// The dropout site of place `k` of block `layer` (site 0 is the embedding).
fn site(layer: usize, k: u64) -> u64 {
    16 * (layer as u64 + 1) + k
}

/// GPT-2's scaled initialisation of the projections that write into the residual stream.
fn residual_init(cfg: &GptConfig) -> ParamInit {
    ParamInit::Normal { std: 0.02 / ((2 * cfg.n_layer) as f64).sqrt() }
}

#[derive(Clone)]
struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    /// Block `h.{layer}`'s parameters through `pb` (already at `h.{layer}`).
    fn new(pb: &ParamBuilder, cfg: &GptConfig, layer: usize) -> Result<Self> {
        Ok(Block {
            ln_1: LayerNorm::new(&pb.pp("ln_1"), cfg.d_model)?,
            attn: Attention::new(&pb.pp("attn"), cfg, layer)?,
            ln_2: LayerNorm::new(&pb.pp("ln_2"), cfg.d_model)?,
            mlp: Mlp::new(&pb.pp("mlp"), cfg, layer)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln_1.forward(x)?)?)?;
        Ok((&x + self.mlp.forward(&self.ln_2.forward(&x)?)?)?)
    }
}

/// The char-level GPT (see the module documentation). Parameter names (single-process, unpadded shapes):
/// `wte.weight` `[vocab, d]`, `wpe.weight` `[block, d]`, `h.{i}.ln_1.{weight,bias}`,
/// `h.{i}.attn.{q,k,v,c_proj}.{weight,bias}`, `h.{i}.ln_2.*`, `h.{i}.mlp.{c_fc,c_proj}.{weight,bias}`,
/// `ln_f.{weight,bias}`, `lm_head.weight` `[vocab, d]`.
///
/// The same type holds one pipeline stage ([`CharGpt::new_stage`]): a run of blocks, with the embeddings on the
/// first stage and `ln_f` and the head on the last.
pub struct CharGpt {
    cfg: GptConfig,
    /// The embeddings (first stage only).
    embed: Option<Held<(VocabParallelEmbedding, Tensor)>>,
    blocks: Vec<Held<Block>>,
    /// The blocks this model holds, `h.{start}` … `h.{end − 1}`.
    layers: std::ops::Range<usize>,
    /// The final norm and the head (last stage only).
    head: Option<Held<(LayerNorm, ColumnParallelLinear)>>,
    tp: TensorParallel,
    device: Device,
}

/// A part of the model as it holds it: built, or — from a prepared FULL_SHARD model's gathering builder — built
/// from the builder at each forward, so its weights are gathered for that forward only (a block inside its own
/// unit: gathered again for its backward, never kept).
#[derive(Clone)]
enum Held<T> {
    Built(T),
    Gathered(ParamBuilder),
}

impl<T> Held<T> {
    /// `build(pb)` now when `pb` creates or looks parameters up, at each use when it gathers them.
    fn new(pb: ParamBuilder, build: impl FnOnce(&ParamBuilder) -> Result<T>) -> Result<Self> {
        Ok(match pb.gathers() {
            true => Held::Gathered(pb),
            false => Held::Built(build(&pb)?),
        })
    }
}

/// The embeddings `wte` (vocabulary-parallel) and `wpe` `[block, d]`.
fn build_embed(pb: &ParamBuilder, cfg: &GptConfig) -> Result<(VocabParallelEmbedding, Tensor)> {
    let emb = ParamInit::Normal { std: 0.02 };
    let wte = VocabParallelEmbedding::new(&pb.pp("wte"), cfg.vocab_size, cfg.d_model, emb)?;
    let wpe = pb.pp("wpe").replicated("weight", (cfg.block_size, cfg.d_model), emb)?;
    Ok((wte, wpe))
}

/// `ln_f` and the head; a tied head reuses `embed`'s weight, or without it (a last stage apart from the first, or
/// a FULL_SHARD head gathered on its own) its own copy of `wte.weight` (same name, same per-name stream: the same
/// values; the Accelerator sums the two copies' gradients).
fn build_head(
    pb: &ParamBuilder,
    cfg: &GptConfig,
    embed: Option<&VocabParallelEmbedding>,
) -> Result<(LayerNorm, ColumnParallelLinear)> {
    let ln_f = LayerNorm::new(&pb.pp("ln_f"), cfg.d_model)?;
    let lm_head = match (cfg.tie_embeddings, embed) {
        (true, Some(wte)) => ColumnParallelLinear::tied(wte),
        (true, None) => ColumnParallelLinear::tied(&VocabParallelEmbedding::new(
            &pb.pp("wte"),
            cfg.vocab_size,
            cfg.d_model,
            ParamInit::Normal { std: 0.02 },
        )?),
        (false, _) => {
            let head = ParallelLinearConfig { bias: false, pad_output: true, ..Default::default() };
            ColumnParallelLinear::new(&pb.pp("lm_head"), cfg.d_model, cfg.vocab_size, head)?
        }
    };
    Ok((ln_f, lm_head))
}

/// Which part of the model a pipeline stage holds: its blocks, and whether it is the first stage (embeddings)
/// and the last (final norm, head, loss).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePart {
    /// Blocks `h.{start}` … `h.{end − 1}`.
    pub layers: std::ops::Range<usize>,
    /// The first stage: it embeds the ids.
    pub first: bool,
    /// The last stage: it computes the logits.
    pub last: bool,
}

impl CharGpt {
    /// Builds the model's parameters through `pb` (its dtype, device, tp group and seed) — or, with a prepared
    /// model's `PreparedModel::param_builder`, takes them from it (the same tensors; under FULL_SHARD nothing is
    /// gathered here: every forward gathers the embeddings and the head for itself and each block inside its own
    /// unit, so the model built once stays current across optimizer steps).
    ///
    /// Errors: [`GptConfig::validate`] for `pb.tp().size()`; a parameter name already in the builder's VarMap.
    pub fn new(cfg: GptConfig, pb: &ParamBuilder) -> Result<Self> {
        Self::new_stage(cfg, pb, StagePart { layers: 0..cfg.n_layer, first: true, last: true })
    }

    /// Builds one pipeline stage: only `part`'s parameters, drawn from the same per-name streams as the whole
    /// model's (so every pipeline layout starts from the single-process weights) under the same names.
    ///
    /// Errors: [`GptConfig::validate`]; blocks outside `0..n_layer`.
    pub fn new_stage(cfg: GptConfig, pb: &ParamBuilder, part: StagePart) -> Result<Self> {
        cfg.validate(pb.tp().size())?;
        if part.layers.end > cfg.n_layer {
            return Err(AccelError::InvalidArgument(format!(
                "CharGpt::new_stage: blocks {:?} of a model of {} layers",
                part.layers, cfg.n_layer
            )));
        }
        let embed = match part.first {
            true => Some(Held::new(pb.clone(), |pb| build_embed(pb, &cfg))?),
            false => None,
        };
        let blocks = part
            .layers
            .clone()
            .map(|i| Held::new(pb.pp("h").pp(i), |pb| Block::new(pb, &cfg, i)))
            .collect::<Result<Vec<_>>>()?;
        let head = match part.last {
            true => Some(Held::new(pb.clone(), |pb| {
                let wte = match &embed {
                    Some(Held::Built((wte, _))) => Some(wte),
                    _ => None,
                };
                build_head(pb, &cfg, wte)
            })?),
            false => None,
        };
        let (tp, device) = (pb.tp().clone(), pb.device().clone());
        Ok(CharGpt { cfg, embed, blocks, layers: part.layers, head, tp, device })
    }

    /// The sizes.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// The tensor-parallel group the model is split over.
    pub fn tp(&self) -> &TensorParallel {
        &self.tp
    }

    /// The vocabulary padded to a multiple of the tp size (the head's full output width).
    pub fn padded_vocab(&self) -> usize {
        self.cfg.vocab_size.div_ceil(self.tp.size()) * self.tp.size()
    }

    /// This rank's vocabulary-sharded logits: `ids` `[b, s]` u32 (`s ≤ block_size`, ids `< vocab_size`) →
    /// `[b, s, padded_vocab / tp]` in the parameters' dtype; rank `r` holds the columns
    /// `r · padded_vocab/tp ..`, the padding columns (`≥ vocab_size`) are zero-weight logits (0) that
    /// [`vocab_parallel_cross_entropy`] and [`CharGpt::generate`] ignore.
    ///
    /// Errors: `ids` not 2-D, `s` 0 or longer than the context; an id outside the vocabulary.
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        if self.embed.is_none() || self.head.is_none() {
            return Err(AccelError::InvalidArgument(format!(
                "CharGpt::logits on a pipeline stage (blocks {:?}): run the stages with stage_forward",
                self.layers
            )));
        }
        self.stage_forward(ids)
    }

    /// This stage's forward: `input` is the ids `[b, s]` u32 on the first stage, else the previous stage's
    /// output `[b, s, d_model]`; returns the logits (as [`CharGpt::logits`]) on the last stage, else `[b, s,
    /// d_model]` for the next.
    ///
    /// Errors: as [`CharGpt::logits`] on the first stage.
    pub fn stage_forward(&self, input: &Tensor) -> Result<Tensor> {
        let mut x = match &self.embed {
            Some(held) => {
                let (_b, s) = input.dims2()?;
                if s == 0 || s > self.cfg.block_size {
                    return Err(AccelError::InvalidArgument(format!(
                        "CharGpt: a sequence of {s} tokens; the model reads 1 to block_size = {} tokens",
                        self.cfg.block_size
                    )));
                }
                let gathered;
                let (wte, wpe) = match held {
                    Held::Built(e) => e,
                    Held::Gathered(pb) => {
                        gathered = build_embed(pb, &self.cfg)?;
                        &gathered
                    }
                };
                dropout(&wte.forward(input)?.broadcast_add(&wpe.narrow(0, 0, s)?)?, self.cfg.dropout, 0, None)?
            }
            None => input.clone(),
        };
        for (k, (held, layer)) in self.blocks.iter().zip(self.layers.clone()).enumerate() {
            let block = match held {
                Held::Built(block) => block,
                Held::Gathered(pb) => {
                    // FULL_SHARD: the block's weights are gathered inside the unit, so they live only while it
                    // computes (and again while its backward does). The unit after it is prefetched while it
                    // computes; when the backward recomputes it, the unit before it (the next to be recomputed).
                    let gathered = |j: Option<usize>| match j.and_then(|j| self.blocks.get(j)) {
                        Some(Held::Gathered(pb)) => Some(pb.clone()),
                        _ => None,
                    };
                    if let Some(next) = gathered(Some(k + 1)) {
                        next.prefetch()?;
                    }
                    let (pb, cfg, before) = (pb.clone(), self.cfg, gathered(k.checked_sub(1)));
                    let recomputing = std::cell::Cell::new(false);
                    x = accel::activation_checkpoint::unit(&x, move |x| {
                        if recomputing.replace(true) {
                            if let Some(before) = &before {
                                before.prefetch().map_err(to_candle)?;
                            }
                        }
                        Block::new(&pb, &cfg, layer).and_then(|b| b.forward(x)).map_err(to_candle)
                    })?;
                    continue;
                }
            };
            if accel::activation_checkpoint::enabled() {
                // Activation checkpointing: the block keeps no activations and is recomputed in the backward pass
                // (its own cuts before and after it, as the cut below).
                let block = block.clone();
                x = accel::activation_checkpoint::block(&x, move |x| block.forward(x).map_err(to_candle))?;
                continue;
            }
            // A backward-segment cut before each block (the identity unless the forward pass is recorded): the
            // gradient all-reduce of the blocks after it starts while the backward pass computes this one.
            x = ddp_core::segments::cut(&x)?;
            x = block.forward(&x)?;
        }
        let gathered;
        let (ln_f, lm_head) = match &self.head {
            None => return Ok(x),
            Some(Held::Built(h)) => h,
            Some(Held::Gathered(pb)) => {
                gathered = build_head(pb, &self.cfg, None)?;
                &gathered
            }
        };
        lm_head.forward(&ln_f.forward(&x)?)
    }

    /// Mean next-character cross entropy: `ids`, `targets` `[b, s]` u32 → scalar f32, the mean over the `b · s`
    /// positions of [`vocab_parallel_cross_entropy`] (the full logits are never gathered; the value is the same
    /// on every tp rank and equals the single-process `cross_entropy` of the unsharded model).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        Ok(self.token_losses(ids, targets)?.mean_all()?)
    }

    /// The per-position losses `[b · s]` f32 behind [`CharGpt::loss`] (for a sum-and-count loss).
    pub fn token_losses(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.token_losses_of(&self.logits(ids)?, targets)
    }

    /// The per-position losses `[b · s]` f32 of the logits `[b, s, padded_vocab / tp]` (the last pipeline
    /// stage's output) against `targets` `[b, s]` u32.
    pub fn token_losses_of(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, s, v) = logits.dims3()?;
        vocab_parallel_cross_entropy(
            &logits.reshape((b * s, v))?,
            &targets.reshape(b * s)?,
            &self.tp,
            self.cfg.vocab_size,
        )
    }

    /// The full-vocabulary logits of the last position, `[vocab_size]` f32: this rank's columns gathered from the
    /// tp group, padding dropped.
    fn last_logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let ctx = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        let logits = self.logits(&ctx)?.detach();
        let last = logits.i((0, ids.len() - 1))?.contiguous()?;
        let full = ddp_core::functional::gather_from_group(&last, self.tp.group(), 0)?;
        Ok(full.narrow(0, 0, self.cfg.vocab_size)?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }

    /// Samples `n` characters after `prompt` (ids `< vocab_size`), feeding back at most the last `block_size`
    /// tokens. Each step gathers the last position's logits from the tp group, drops the padding and samples
    /// from `softmax(logits / temperature)` with `rng` (`temperature ≤ 0`: the arg-max). Every tp rank must call
    /// it with an rng in the same state (e.g. seeded alike): they then draw the same tokens and stay in step.
    /// Returns the `n` new ids.
    ///
    /// Errors: an empty prompt; those of [`CharGpt::logits`].
    pub fn generate(&self, prompt: &[u32], n: usize, temperature: f64, rng: &mut impl Rng) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(AccelError::InvalidArgument(
                "CharGpt::generate: the prompt is empty; give at least one token".into(),
            ));
        }
        let mut ids = prompt.to_vec();
        for _ in 0..n {
            let start = ids.len().saturating_sub(self.cfg.block_size);
            let logits = self.last_logits(&ids[start..])?;
            ids.push(sample(&logits, temperature, rng));
        }
        Ok(ids.split_off(prompt.len()))
    }
}

/// The char-GPT cut into pipeline stages, as one rank holds it: a [`CharGpt`] part for each of the rank's
/// [`Stage`]s (one, or `v` under interleaved 1F1B), what [`accel::Accelerator::pipeline_backward`] runs. Without
/// pipeline parallelism it is one part holding the whole model.
pub struct GptStages {
    /// `(stage index, part)`, in stage order.
    parts: Vec<(usize, CharGpt)>,
}

impl GptStages {
    /// Builds the parts of `stages` (from [`accel::Accelerator::pipeline_stages`] for `cfg.n_layer` blocks)
    /// through `pb`: only their parameters, under the single-process names.
    ///
    /// Errors: [`CharGpt::new_stage`]'s; no stage.
    pub fn new(cfg: GptConfig, pb: &ParamBuilder, stages: &[Stage]) -> Result<Self> {
        if stages.is_empty() {
            return Err(AccelError::InvalidArgument("GptStages::new: no stage to build".into()));
        }
        let parts = stages
            .iter()
            .map(|s| {
                let part = StagePart { layers: s.layers.clone(), first: s.is_first(), last: s.is_last() };
                Ok((s.index, CharGpt::new_stage(cfg, pb, part)?))
            })
            .collect::<Result<_>>()?;
        Ok(GptStages { parts })
    }

    /// The part of stage `stage`, if this rank holds it.
    pub fn part(&self, stage: usize) -> Option<&CharGpt> {
        self.parts.iter().find(|(s, _)| *s == stage).map(|(_, p)| p)
    }

    /// The whole model, when this rank holds every stage (no pipeline parallelism).
    pub fn whole(&self) -> Option<&CharGpt> {
        match &self.parts[..] {
            [(_, p)] if p.embed.is_some() && p.head.is_some() => Some(p),
            _ => None,
        }
    }

    /// The mean next-character cross entropy of the last stage's `logits` against `targets` (the loss function
    /// to give `pipeline_backward`; it only reads the sizes and the tp group, so any part computes it).
    pub fn loss_of(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        Ok(self.parts[0].1.token_losses_of(logits, targets)?.mean_all()?)
    }
}

impl GptStages {
    /// Samples `n` characters after `prompt` at any layout (as [`CharGpt::generate`]): with the whole model on
    /// this rank, every rank samples (the tp peers in step, `rng` seeded alike); under pipeline parallelism the
    /// whole model is gathered from the stages (`prepared.state_dict()`, collective: every rank calls this) and
    /// only `main` samples. Returns `None` on the ranks that did not sample.
    pub fn sample(
        &self,
        prepared: &accel::PreparedModel,
        main: bool,
        prompt: &[u32],
        n: usize,
        temperature: f64,
        rng: &mut impl Rng,
    ) -> Result<Option<Vec<u32>>> {
        if let Some(whole) = self.whole() {
            return whole.generate(prompt, n, temperature, rng).map(Some);
        }
        let weights = prepared.state_dict()?;
        if !main {
            return Ok(None);
        }
        whole_model(*self.parts[0].1.config(), &weights)?.generate(prompt, n, temperature, rng).map(Some)
    }
}

/// The whole model as a candle module (the Trainer's `ModuleT`): `forward(ids)` = [`CharGpt::logits`]; an
/// error on a rank that holds only some stages (the Trainer drives those through [`StagedModel`]).
impl candle_core::Module for GptStages {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self.whole() {
            Some(whole) => whole.logits(ids).map_err(to_candle),
            None => Err(candle_core::Error::Msg(
                "GptStages::forward on a rank holding only some pipeline stages; run them with stage_forward".into(),
            )),
        }
    }
}

impl StagedModel for GptStages {
    fn stage_forward(&self, stage: usize, input: &Tensor) -> Result<Tensor> {
        self.part(stage)
            .ok_or_else(|| AccelError::InvalidArgument(format!("GptStages: this rank does not hold stage {stage}")))?
            .stage_forward(input)
    }
}

/// A single-process model holding `weights` (single-process names, as `PreparedModel::state_dict` gives under
/// any layout): what a pipeline run samples from on one rank. f32 on the CPU, no tensor parallelism.
///
/// Errors: a missing or mis-shaped tensor; the model's.
pub fn whole_model(cfg: GptConfig, weights: &std::collections::BTreeMap<String, Tensor>) -> Result<CharGpt> {
    let varmap = candle_nn::VarMap::new();
    let tp = TensorParallel::new(ddp_core::ProcessGroup::single_process()?);
    let model = CharGpt::new(cfg, &ParamBuilder::new(&varmap, &tp, 0, DType::F32, &Device::Cpu))?;
    for (name, var) in accel::lock(varmap.data()).iter() {
        let t = weights
            .get(name)
            .ok_or_else(|| AccelError::InvalidArgument(format!("whole_model: no tensor for {name:?}")))?;
        var.set(&t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)?;
    }
    Ok(model)
}

/// An index drawn from `softmax(logits / temperature)` (inverse CDF of one uniform draw), or the arg-max when
/// `temperature ≤ 0`.
fn sample(logits: &[f32], temperature: f64, rng: &mut impl Rng) -> u32 {
    let argmax = || logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best }) as u32;
    if temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / temperature).exp()).collect();
    let mut u = rng.random::<f64>() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    argmax()
}

/// The model as a candle module for the Trainer: `forward(ids)` = [`CharGpt::logits`].
impl candle_core::Module for CharGpt {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.logits(ids).map_err(to_candle)
    }
}

/// An accel error as a candle error (the Trainer's model builder returns candle results); candle's own errors are
/// unwrapped.
pub fn to_candle(e: AccelError) -> candle_core::Error {
    match e {
        AccelError::Candle(e) => e,
        e => candle_core::Error::wrap(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::VarMap;
    use ddp_core::ProcessGroup;

    fn tiny() -> GptConfig {
        GptConfig {
            vocab_size: 11,
            block_size: 8,
            n_layer: 2,
            n_head: 4,
            d_model: 16,
            d_ff: 32,
            tie_embeddings: false,
            dropout: 0.0,
        }
    }

    fn build(cfg: GptConfig, seed: u64) -> (CharGpt, VarMap) {
        let varmap = VarMap::new();
        let tp = TensorParallel::new(ProcessGroup::single_process().unwrap());
        let pb = ParamBuilder::new(&varmap, &tp, seed, DType::F32, &Device::Cpu);
        (CharGpt::new(cfg, &pb).unwrap(), varmap)
    }

    #[test]
    fn shapes_and_parameter_count_at_tp1() {
        let cfg = tiny();
        let (model, varmap) = build(cfg, 0);
        let ids = Tensor::new(&[[1u32, 2, 3, 4, 5], [6, 7, 8, 9, 10]], &Device::Cpu).unwrap();
        let logits = model.logits(&ids).unwrap();
        assert_eq!(logits.dims(), &[2, 5, 11]);
        let loss = model.loss(&ids, &ids).unwrap();
        assert_eq!(loss.dims(), &[] as &[usize]);
        // A fresh model predicts almost uniformly: loss ≈ ln(11) = 2.398.
        let l = loss.to_scalar::<f32>().unwrap();
        assert!((l - 11f32.ln()).abs() < 0.1, "initial loss {l}");
        let count: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
        assert_eq!(count, cfg.num_parameters());
        let names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
        for name in
            ["wte.weight", "wpe.weight", "h.1.attn.q.weight", "h.0.mlp.c_proj.bias", "ln_f.bias", "lm_head.weight"]
        {
            assert!(names.iter().any(|n| n == name), "{name} missing from {names:?}");
        }
        assert!(!names.iter().any(|n| n == "lm_head.bias"), "the head has no bias");
    }

    #[test]
    fn default_size_is_as_documented() {
        assert_eq!(GptConfig::small(76).num_parameters(), 820_992);
        assert_eq!(GptConfig::small(76).fitting_tp_sizes(), vec![1, 2, 4]);
    }

    #[test]
    fn causal_and_deterministic() {
        let (a, _) = build(tiny(), 3);
        let (b, _) = build(tiny(), 3);
        let ids = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu).unwrap();
        let changed = Tensor::new(&[[1u32, 2, 3, 9]], &Device::Cpu).unwrap();
        let la = a.logits(&ids).unwrap();
        assert_eq!(la.to_vec3::<f32>().unwrap(), b.logits(&ids).unwrap().to_vec3::<f32>().unwrap());
        // Changing the last token leaves the earlier positions' logits unchanged.
        let lc = a.logits(&changed).unwrap();
        let first3 = |t: &Tensor| t.narrow(1, 0, 3).unwrap().to_vec3::<f32>().unwrap();
        assert_eq!(first3(&la), first3(&lc));
        assert_ne!(la.to_vec3::<f32>().unwrap(), lc.to_vec3::<f32>().unwrap());
    }

    #[test]
    fn generate_is_reproducible_for_a_seed() {
        use rand::SeedableRng;
        let (model, _) = build(tiny(), 1);
        let run = |seed| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            model.generate(&[1, 2], 12, 1.0, &mut rng).unwrap()
        };
        let out = run(5);
        assert_eq!(out.len(), 12, "longer than block_size 8: the context is cropped");
        assert!(out.iter().all(|&t| t < 11));
        assert_eq!(out, run(5));
        let greedy = model.generate(&[1], 3, 0.0, &mut rand_chacha::ChaCha8Rng::seed_from_u64(0)).unwrap();
        assert_eq!(greedy, model.generate(&[1], 3, 0.0, &mut rand_chacha::ChaCha8Rng::seed_from_u64(9)).unwrap());
        let err = model.generate(&[], 3, 1.0, &mut rand_chacha::ChaCha8Rng::seed_from_u64(0)).unwrap_err();
        assert!(err.to_string().contains("prompt is empty"), "{err}");
    }

    #[test]
    fn too_long_sequences_are_refused() {
        let (model, _) = build(tiny(), 0);
        let ids = Tensor::zeros((1, 9), DType::U32, &Device::Cpu).unwrap();
        let err = model.logits(&ids).unwrap_err().to_string();
        assert!(err.contains("9 tokens") && err.contains("block_size = 8"), "{err}");
    }

    #[test]
    fn validation_names_the_sizes_and_what_fits() {
        let cfg = GptConfig::small(76);
        for tp in [1, 2, 4] {
            cfg.validate(tp).unwrap();
        }
        let err = cfg.validate(3).unwrap_err().to_string();
        assert!(err.contains("GptConfig.tp_size = \"3\""), "{err}");
        assert!(err.contains("3 does not divide n_head = 4, d_model = 128, d_ff = 512"), "{err}");
        assert!(err.contains("tp sizes that fit this model (n_head 4, d_model 128, d_ff 512): [1, 2, 4]"), "{err}");

        let odd_ff = GptConfig { d_ff: 510, ..cfg };
        let err = odd_ff.validate(4).unwrap_err().to_string();
        assert!(err.contains("4 does not divide d_ff = 510;"), "{err}");
        assert!(err.contains("[1, 2]"), "{err}");

        let err = GptConfig { n_head: 6, ..cfg }.validate(1).unwrap_err().to_string();
        assert!(err.contains("GptConfig.n_head = \"6\"") && err.contains("does not divide d_model = 128"), "{err}");

        let err = GptConfig { n_layer: 0, ..cfg }.validate(1).unwrap_err().to_string();
        assert!(err.contains("GptConfig.n_layer = \"0\"") && err.contains("at least 1"), "{err}");

        let err = cfg.validate(0).unwrap_err().to_string();
        assert!(err.contains("GptConfig.tp_size = \"0\""), "{err}");
    }

    #[test]
    fn sampling_follows_the_distribution() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        // Probabilities 1/7, 2/7, 4/7.
        let logits = [0.0f32, 2f32.ln(), 4f32.ln()];
        let mut counts = [0usize; 3];
        for _ in 0..7000 {
            counts[sample(&logits, 1.0, &mut rng) as usize] += 1;
        }
        assert!((counts[2] as f64 / 7000.0 - 4.0 / 7.0).abs() < 0.03, "{counts:?}");
        assert_eq!(sample(&logits, 0.0, &mut rng), 2);
    }
}
