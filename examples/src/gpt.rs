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
//! floating-point summation order. The model is written once on [`accel::nn`]'s builder — candle's calls, no
//! parallel style in its code — and laid out from outside by [`CharGpt::plan`] (Megatron's split above) and the
//! Accelerator's sizes: its blocks are [`accel::nn::Unit`]s (FULL_SHARD gathers each as a whole, activation
//! checkpointing recomputes it) declared with [`accel::nn::staged`] (the Accelerator cuts the pipeline stages;
//! each rank builds only its own). Every parameter is drawn on the full model from one seed (per parameter name),
//! each rank keeping its slice, so every layout starts from the same weights. Initialisation follows GPT-2: Normal(0, 0.02²) for the embeddings and
//! linear weights, Normal(0, (0.02/√(2·n_layer))²) for the two residual projections, zero biases, layer norms at
//! weight 1, bias 0.
//!
//! The linear layers, layer norm, causal self-attention and GELU are `accel_nn::ops`'s fused ops (one kernel forward and one backward
//! on the CPU in f32, candle's composed ops on other devices and dtypes; `ACCEL_FUSED_OPS=0` turns the fused
//! kernels off), so the same code runs fast on the CPU and unchanged on CUDA or in bf16.
//!
//! The default model for the examples ([`GptConfig::small`], Shakespeare's 76 characters): d_model 128, 4 heads,
//! 4 layers, context 64, d_ff 512 — 820 992 parameters ([`GptConfig::num_parameters`]).

use accel::nn::{self, Init, LinearInit, Module, Staged, VarBuilder};
use accel::pipeline::{Stage, StagedModel};
use accel::plan::{ParallelPlan, ParallelStyle};
use accel::tensor_parallel::{vocab_parallel_cross_entropy, TensorParallel};
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

/// GPT-2's initialisation: Normal(0, 0.02²) weights, zero biases; the two projections that write into the
/// residual stream scaled by 1/√(2·n_layer).
fn gpt2_init(std: f64, bias: bool) -> LinearInit {
    LinearInit { weight: Init::Randn { mean: 0.0, stdev: std }, bias: bias.then_some(Init::Const(0.0)) }
}

/// The standard deviation of the residual projections' weights.
fn residual_std(cfg: &GptConfig) -> f64 {
    0.02 / ((2 * cfg.n_layer) as f64).sqrt()
}

/// The embeddings: `wte` (its vocabulary rows split over tp by the plan) + `wpe` `[block, d]` (replicated), then
/// dropout. Ids `[b, s]` u32 → `[b, s, d]`.
#[derive(Clone)]
struct Embed {
    wte: nn::Embedding,
    wpe: nn::Embedding,
    drop: nn::Dropout,
    block_size: usize,
}

impl Embed {
    fn new(cfg: &GptConfig, vb: &VarBuilder) -> candle_core::Result<Self> {
        let std = Init::Randn { mean: 0.0, stdev: 0.02 };
        Ok(Embed {
            wte: nn::embedding_init(cfg.vocab_size, cfg.d_model, std, vb.pp("wte"))?,
            wpe: nn::embedding_init(cfg.block_size, cfg.d_model, std, vb.pp("wpe"))?,
            drop: nn::dropout(cfg.dropout, vb.pp("drop"))?,
            block_size: cfg.block_size,
        })
    }
}

impl Module for Embed {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (_b, s) = ids.dims2()?;
        if s == 0 || s > self.block_size {
            return Err(candle_core::Error::Msg(format!(
                "CharGpt: a sequence of {s} tokens; the model reads 1 to block_size = {} tokens",
                self.block_size
            )));
        }
        let x = self.wte.forward(ids)?.broadcast_add(&self.wpe.embeddings()?.narrow(0, 0, s)?)?;
        self.drop.forward_split(&x, None)
    }
}

/// Causal self-attention: q, k, v → softmax(q kᵀ/√hd) v over this rank's heads → c_proj, dropout. `[b, s, d]` →
/// `[b, s, d]`.
#[derive(Clone)]
struct Attention {
    q: nn::Linear,
    k: nn::Linear,
    v: nn::Linear,
    c_proj: nn::Linear,
    /// The heads this rank computes: the builder's count (whole heads per tp rank), never the global config's.
    local_heads: usize,
    head_dim: usize,
    drop: nn::Dropout,
}

impl Attention {
    fn new(cfg: &GptConfig, vb: &VarBuilder) -> candle_core::Result<Self> {
        let (d, init) = (cfg.d_model, gpt2_init(0.02, true));
        Ok(Attention {
            q: nn::linear_init(d, d, init, vb.pp("q"))?,
            k: nn::linear_init(d, d, init, vb.pp("k"))?,
            v: nn::linear_init(d, d, init, vb.pp("v"))?,
            c_proj: nn::linear_init(d, d, gpt2_init(residual_std(cfg), true), vb.pp("c_proj"))?,
            local_heads: vb.local_heads(cfg.n_head)?,
            head_dim: cfg.head_dim(),
            drop: nn::dropout(cfg.dropout, vb.pp("drop"))?,
        })
    }
}

impl Module for Attention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // Under tp the three projections share one copy of x to the group (their input gradients are summed,
        // then all-reduced once): accel::nn does that for column-wise layers reading the same input.
        let (q, k, v) = (self.q.forward(x)?, self.k.forward(x)?, self.v.forward(x)?);
        // The heads stay side by side in the last dimension, where the projections put them and c_proj reads them.
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let y = accel_nn::ops::attention::causal_self_attention(&q, &k, &v, self.local_heads, scale)?;
        self.drop.forward_split(&self.c_proj.forward(&y)?, None)
    }
}

/// `c_proj(dropout(GELU(c_fc(x))))`, then dropout: d → d_ff → d.
#[derive(Clone)]
struct Mlp {
    c_fc: nn::Linear,
    c_proj: nn::Linear,
    drop_hidden: nn::Dropout,
    drop: nn::Dropout,
}

impl Mlp {
    fn new(cfg: &GptConfig, vb: &VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            c_fc: nn::linear_init(cfg.d_model, cfg.d_ff, gpt2_init(0.02, true), vb.pp("c_fc"))?,
            c_proj: nn::linear_init(cfg.d_ff, cfg.d_model, gpt2_init(residual_std(cfg), true), vb.pp("c_proj"))?,
            drop_hidden: nn::dropout(cfg.dropout, vb.pp("drop_hidden"))?,
            drop: nn::dropout(cfg.dropout, vb.pp("drop"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = accel_nn::ops::activation::gelu(&self.c_fc.forward(x)?)?;
        // The hidden activation may be split over tp (by c_fc's style): its mask is its slice of the whole one.
        let h = self.drop_hidden.forward_split(&h, self.c_fc.output_split(&h)?)?;
        self.drop.forward_split(&self.c_proj.forward(&h)?, None)
    }
}

/// One pre-norm transformer block, `h.{i}`.
#[derive(Clone)]
struct Block {
    ln_1: nn::LayerNorm,
    attn: Attention,
    ln_2: nn::LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn new(cfg: &GptConfig, vb: &VarBuilder) -> candle_core::Result<Self> {
        Ok(Block {
            ln_1: nn::layer_norm(cfg.d_model, 1e-5, vb.pp("ln_1"))?,
            attn: Attention::new(cfg, &vb.pp("attn"))?,
            ln_2: nn::layer_norm(cfg.d_model, 1e-5, vb.pp("ln_2"))?,
            mlp: Mlp::new(cfg, &vb.pp("mlp"))?,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln_1.forward(x)?)?)?;
        &x + self.mlp.forward(&self.ln_2.forward(&x)?)?
    }
}

/// The final norm and the head: `[b, s, d]` → this rank's logits `[b, s, padded_vocab / tp]`.
#[derive(Clone)]
struct Head {
    ln_f: nn::LayerNorm,
    lm_head: nn::Linear,
}

impl Head {
    /// A tied head reads `wte`'s weight: the first stage's embedding when this rank holds it, else its own copy
    /// of `wte.weight` (same name, same per-name stream: the same values; the Accelerator sums the two copies'
    /// gradients).
    fn new(cfg: &GptConfig, vb: &VarBuilder, embed: Option<&Embed>) -> candle_core::Result<Self> {
        let lm_head = match (cfg.tie_embeddings, embed) {
            (true, Some(embed)) => nn::Linear::tied(&embed.wte),
            (true, None) => nn::Linear::tied(&nn::embedding_init(
                cfg.vocab_size,
                cfg.d_model,
                Init::Randn { mean: 0.0, stdev: 0.02 },
                vb.pp("wte"),
            )?),
            (false, _) => nn::linear_init(cfg.d_model, cfg.vocab_size, gpt2_init(0.02, false), vb.pp("lm_head"))?,
        };
        Ok(Head { ln_f: nn::layer_norm(cfg.d_model, 1e-5, vb.pp("ln_f"))?, lm_head })
    }
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.lm_head.forward(&self.ln_f.forward(x)?)
    }
}

/// The char-level GPT (see the module documentation). Parameter names (single-process, unpadded shapes):
/// `wte.weight` `[vocab, d]`, `wpe.weight` `[block, d]`, `h.{i}.ln_1.{weight,bias}`,
/// `h.{i}.attn.{q,k,v,c_proj}.{weight,bias}`, `h.{i}.ln_2.*`, `h.{i}.mlp.{c_fc,c_proj}.{weight,bias}`,
/// `ln_f.{weight,bias}`, `lm_head.weight` `[vocab, d]` (none when tied).
///
/// As one rank holds it: the whole model without pipeline parallelism, else the parts of this rank's stages (the
/// embeddings on the first, `ln_f` and the head on the last) — what [`accel::Accelerator::pipeline_backward`]
/// runs ([`StagedModel`]).
#[derive(Clone)]
pub struct CharGpt {
    cfg: GptConfig,
    model: Staged<Embed, Block, Head>,
    tp: TensorParallel,
    device: Device,
}

impl CharGpt {
    /// The model's parallel plan (Megatron-LM's split): the token embedding and the head vocab-parallel, q, k, v
    /// and c_fc column-wise, the two c_proj row-wise; the norms and `wpe` replicated (no rule). At tp = 1 it
    /// changes nothing.
    pub fn plan(cfg: &GptConfig) -> ParallelPlan {
        let mut plan = ParallelPlan::default()
            .with("wte", ParallelStyle::VocabParallel)
            .with("h.*.attn.q", ParallelStyle::Colwise)
            .with("h.*.attn.k", ParallelStyle::Colwise)
            .with("h.*.attn.v", ParallelStyle::Colwise)
            .with("h.*.attn.c_proj", ParallelStyle::Rowwise)
            .with("h.*.mlp.c_fc", ParallelStyle::Colwise)
            .with("h.*.mlp.c_proj", ParallelStyle::Rowwise);
        if !cfg.tie_embeddings {
            plan = plan.with("lm_head", ParallelStyle::VocabParallel);
        }
        plan
    }

    /// Builds the parts of the model this rank holds through `vb` (from `acc.builder(&varmap, CharGpt::plan(&cfg))`,
    /// or [`VarBuilder::new`] without an Accelerator): its dtype, device, tp group, seed and pipeline stages. Built
    /// once, before `prepare_model`, at every layout (under FULL_SHARD the layers fetch their gathered weights at
    /// each forward by themselves).
    ///
    /// Errors: [`GptConfig::validate`] for `vb.tp().size()`; more pipeline stages than blocks; a parameter name
    /// already in the builder's VarMap.
    pub fn new(cfg: GptConfig, vb: &VarBuilder) -> Result<Self> {
        cfg.validate(vb.tp().size())?;
        let model = nn::staged(
            vb,
            cfg.n_layer,
            "h",
            |vb| Embed::new(&cfg, &vb),
            |vb| Block::new(&cfg, &vb),
            |vb, embed| Head::new(&cfg, &vb, embed),
        )?;
        Ok(CharGpt { cfg, model, tp: vb.tp().clone(), device: vb.device().clone() })
    }

    /// The sizes.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// The tensor-parallel group the model is split over.
    pub fn tp(&self) -> &TensorParallel {
        &self.tp
    }

    /// The stages this rank holds.
    pub fn stages(&self) -> Vec<&Stage> {
        self.model.stages()
    }

    /// Whether this rank holds the whole model (no pipeline parallelism).
    pub fn is_whole(&self) -> bool {
        self.model.is_whole()
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
    /// Errors: `ids` not 2-D, `s` 0 or longer than the context; an id outside the vocabulary; a rank holding only
    /// some pipeline stages (run those with `stage_forward`).
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(self.model.forward(ids)?)
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

    /// The mean next-character cross entropy of the last stage's `logits` against `targets` (the loss function
    /// to give `pipeline_backward`; it only reads the sizes and the tp group, so any rank computes it).
    pub fn loss_of(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        Ok(self.token_losses_of(logits, targets)?.mean_all()?)
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
        if self.is_whole() {
            return self.generate(prompt, n, temperature, rng).map(Some);
        }
        let weights = prepared.state_dict()?;
        if !main {
            return Ok(None);
        }
        whole_model(self.cfg, &weights)?.generate(prompt, n, temperature, rng).map(Some)
    }
}

/// The whole model's logits as a candle module (the Trainer's `ModuleT`): `forward(ids)` = [`CharGpt::logits`];
/// an error on a rank that holds only some stages (those run through [`StagedModel`]).
impl Module for CharGpt {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.model.forward(ids)
    }
}

impl StagedModel for CharGpt {
    fn stage_forward(&self, stage: usize, input: &Tensor) -> Result<Tensor> {
        self.model.stage_forward(stage, input)
    }
}

/// A single-process model holding `weights` (single-process names, as `PreparedModel::state_dict` gives under
/// any layout): what a pipeline run samples from on one rank. f32 on the CPU, no tensor parallelism.
///
/// Errors: a missing or mis-shaped tensor; the model's.
pub fn whole_model(cfg: GptConfig, weights: &std::collections::BTreeMap<String, Tensor>) -> Result<CharGpt> {
    let varmap = candle_nn::VarMap::new();
    let tp = TensorParallel::new(ddp_core::ProcessGroup::single_process()?);
    let model = CharGpt::new(cfg, &VarBuilder::new(&varmap, &tp, 0, DType::F32, &Device::Cpu, CharGpt::plan(&cfg)))?;
    for (name, var) in varmap.data().lock().expect("the VarMap's lock").iter() {
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
        let vb = VarBuilder::new(&varmap, &tp, seed, DType::F32, &Device::Cpu, CharGpt::plan(&cfg));
        (CharGpt::new(cfg, &vb).unwrap(), varmap)
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
