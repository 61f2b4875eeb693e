//! The Llama decoder written once on [`crate::nn`]'s builder: no style, unit, prefetch or stage code in it — the
//! plan ([`Llama::plan`]) lays it out, the Accelerator cuts it into pipeline stages and shards it.

use super::config::LlamaConfig;
use super::rope::RotaryTables;
use crate::nn::{
    self, ActivationSpec, Dropout, Embedding, Init, Linear, LinearInit, Module, ModuleT, RmsNorm, ShardedDim, Staged,
    VarBuilder,
};
use crate::pipeline::StagedModel;
use crate::plan::{ParallelPlan, ParallelStyle};
use crate::tensor_parallel::{dropout_context, vocab_parallel_cross_entropy, TensorParallel};
use crate::{AccelError, Result};
use accel_nn::ops::{attention::causal_self_attention, softmax::causal_softmax};
use candle_core::{DType, Tensor, D};
use std::sync::Arc;

/// A Llama-family causal language model (`LlamaForCausalLM`; Touvron et al. 2023): token embedding, decoder
/// layers of pre-norm grouped-query attention with rotary positions and a SwiGLU MLP, a final RMS norm and a
/// vocabulary head (its own, or tied to the embedding).
///
/// Parameters carry transformers' names (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`,
/// …, `model.norm.weight`, `lm_head.weight`), so [`crate::PreparedModel::state_dict`] is a Hugging Face
/// checkpoint's contents at every layout ([`super::save_pretrained`], [`super::load_pretrained`]).
///
/// Shapes: ids `[b, s]` (u32 or i64, `s ≤ max_position_embeddings`) → logits `[b, s, vocab_size]`, or this rank's
/// `vocab_size.div_ceil(tp)` columns when the head is vocab-parallel (the default plan; [`Llama::loss`] reads
/// them as they are, [`Llama::full_logits`] gathers them).
pub struct Llama {
    model: Staged<Embedding, Block, Head>,
    config: LlamaConfig,
    tp: TensorParallel,
    device: candle_core::Device,
}

/// The last stage's part: the final norm and the head.
struct Head {
    norm: RmsNorm,
    lm_head: Linear,
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.lm_head.forward(&self.norm.forward(x)?)
    }
}

/// One decoder layer (`model.layers.{i}`): `x + attn(norm(x))`, then `x + mlp(norm(x))`, each branch's output
/// through the residual dropout.
#[derive(Clone)]
struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    attn_dropout: Dropout,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    mlp_dropout: Dropout,
}

/// Causal grouped-query self-attention with rotary positions (`self_attn`).
#[derive(Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    head_dim: usize,
    rotary: Arc<RotaryTables>,
    probs_dropout: Dropout,
}

/// SwiGLU (Shazeer 2020): `down(silu(gate(x)) · up(x))`.
#[derive(Clone)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// transformers' initialisation of a model trained from scratch: every linear and the embedding Normal(0, σ²)
/// with σ = `initializer_range`, biases zero (norms one, as every RMS norm starts).
fn linear(
    config: &LlamaConfig,
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
) -> candle_core::Result<Linear> {
    let weight = Init::Randn { mean: 0.0, stdev: config.initializer_range };
    nn::linear_init(in_dim, out_dim, LinearInit { weight, bias: bias.then_some(Init::Const(0.0)) }, vb)
}

impl Llama {
    /// Builds the parts of the model this rank holds (its pipeline stages; all of it without pipeline
    /// parallelism), each parameter laid out by `vb`'s plan — [`Llama::plan`] for transformers' layout — and
    /// drawn from the run's seed, or read from a checkpoint when `vb` has weights
    /// (`vb.with_weights(PretrainedWeights::open(dir, config)?)`, [`super::PretrainedWeights`]); a checkpoint can
    /// also be loaded into the prepared model ([`super::load_pretrained`]).
    ///
    /// Errors: [`LlamaConfig::check`]'s; [`LlamaConfig::check_tp_size`]'s; the plan's.
    pub fn new(config: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        config.check()?;
        config.check_tp_size(vb.tp().size())?;
        vb.declare_activations(Llama::activations(config));
        let rotary = Arc::new(RotaryTables::new(
            &config.rope()?,
            config.head_dim(),
            config.max_position_embeddings,
            vb.device(),
        )?);
        let (vocab, hidden) = (config.vocab_size, config.hidden_size);
        let init = Init::Randn { mean: 0.0, stdev: config.initializer_range };
        let embed = |vb: VarBuilder| nn::embedding_init(vocab, hidden, init, vb.pp("embed_tokens"));
        let root = vb.clone();
        let body = vb.pp("model");
        let model = nn::staged(
            &body,
            config.num_hidden_layers,
            "layers",
            embed,
            |vb| Block::new(config, vb, rotary.clone()),
            |vb, first: Option<&Embedding>| {
                let lm_head = match (config.tie_word_embeddings, first) {
                    (false, _) => linear(config, hidden, vocab, false, root.pp("lm_head"))?,
                    (true, Some(embedding)) => Linear::tied(embedding),
                    // A last stage apart from the first holds its own copy (same name, same values).
                    (true, None) => Linear::tied(&embed(vb.clone())?),
                };
                Ok(Head { norm: nn::rms_norm(hidden, config.rms_norm_eps, vb.pp("norm"))?, lm_head })
            },
        )?;
        Ok(Llama { model, config: config.clone(), tp: vb.tp().clone(), device: vb.device().clone() })
    }

    /// transformers' plan for Llama (`base_model_tp_plan`, Megatron-LM's split): q/k/v and gate/up column-wise,
    /// o and down row-wise, so each layer communicates twice forward (after o and after down); the embedding
    /// and the head vocab-parallel (the loss reads the head's columns where they are,
    /// [`vocab_parallel_cross_entropy`]; transformers gathers the logits instead, `colwise_rep`). A tied head is
    /// the embedding's weight and follows its rule.
    pub fn plan(config: &LlamaConfig) -> ParallelPlan {
        let mut plan = ParallelPlan::new()
            .with("model.embed_tokens", ParallelStyle::VocabParallel)
            .with("model.layers.*.self_attn.q_proj", ParallelStyle::Colwise)
            .with("model.layers.*.self_attn.k_proj", ParallelStyle::Colwise)
            .with("model.layers.*.self_attn.v_proj", ParallelStyle::Colwise)
            .with("model.layers.*.self_attn.o_proj", ParallelStyle::Rowwise)
            .with("model.layers.*.mlp.gate_proj", ParallelStyle::Colwise)
            .with("model.layers.*.mlp.up_proj", ParallelStyle::Colwise)
            .with("model.layers.*.mlp.down_proj", ParallelStyle::Rowwise);
        if !config.tie_word_embeddings {
            plan = plan.with("lm_head", ParallelStyle::VocabParallel);
        }
        plan
    }

    /// What one decoder layer keeps for its backward, for the automatic layout's memory model (declared on the
    /// builder by [`Llama::new`], so [`crate::auto_layout::ModelSpec::of_model`] reads it): accel's
    /// transformer accounting ([`ActivationSpec::accel`]: the fused attention keeps no `s × s` tensor; dropout
    /// masks when `attention_dropout` or `hidden_dropout` is above 0) plus what this layer keeps beyond a GPT
    /// block — the rotary products on q and k, the key/value heads repeated for grouped-query attention, the RMS
    /// norms' intermediates, SwiGLU's activation and product: 18 more `[b, s, h]` tensors (12 of them split over
    /// tp, the norms' 6 whole) and 3 more `[b, s, f/t]` per layer. Measured at one process (h 384, f 1024, 6 query
    /// and 2 key/value heads, 128 tokens): a layer adds 9.2 MiB of peak memory per sequence, which these extras
    /// give within 2 % (without them the accounting gives half); at tp > 1 the split of the extras is not measured.
    pub fn activations(config: &LlamaConfig) -> ActivationSpec {
        let dropout = config.attention_dropout > 0.0 || config.hidden_dropout > 0.0;
        let base = ActivationSpec::accel(dropout, 4);
        ActivationSpec {
            extra_h: base.extra_h + 6,
            extra_h_split: base.extra_h_split + 12,
            extra_f: base.extra_f + 3,
            ..base
        }
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Logits of `ids` `[b, s]` (the whole model; under pipeline parallelism use
    /// [`crate::Accelerator::pipeline_backward`], which runs the stages through [`StagedModel`]).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(self.model.forward(ids)?)
    }

    /// Mean cross-entropy of `logits` `[b, s, v]` (as [`Llama::forward`] gives them: whole, or this rank's
    /// vocab-parallel columns) against `targets` `[b, s]` — to train a causal model, the ids shifted by one
    /// (transformers' `labels` are shifted inside its loss; here the caller passes `ids[.., ..s]` and
    /// `ids[.., 1..]`). f32 scalar; the same on every tp rank.
    pub fn loss(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, s, v) = logits.dims3()?;
        let (logits, targets) = (logits.reshape((b * s, v))?, targets.flatten_all()?);
        if v == self.config.vocab_size && self.tp.size() > 1 {
            // A head the plan kept whole (replicated, colwise_rep): the plain loss.
            let logits = logits.to_dtype(DType::F32)?;
            return Ok(candle_nn::loss::cross_entropy(&logits, &targets.to_dtype(DType::U32)?)?);
        }
        vocab_parallel_cross_entropy(&logits, &targets, &self.tp, self.config.vocab_size)?
            .mean_all()
            .map_err(Into::into)
    }

    /// `logits` `[b, s, v]` with every vocabulary column (all-gathered over the tp group when the head is
    /// vocab-parallel, padding dropped): `[b, s, vocab_size]`. Collective over tp when it gathers.
    pub fn full_logits(&self, logits: &Tensor) -> Result<Tensor> {
        let vocab = self.config.vocab_size;
        let (b, s, v) = logits.dims3()?;
        // Whole already: one rank, or a head the plan kept whole.
        if v == vocab {
            return Ok(logits.clone());
        }
        // [tp·b, s, v] → tp pieces side by side along the vocabulary.
        let all = self.tp.group().all_gather_tensor(&logits.contiguous()?)?;
        let pieces = (0..self.tp.size()).map(|r| all.narrow(0, r * b, b)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&pieces, 2)?.narrow(2, 0, vocab)?.reshape((b, s, vocab))?)
    }

    /// Greedy decoding (transformers' `generate(do_sample=False)`): `max_new_tokens` ids appended to `prompt`, each
    /// the argmax of the last position's logits (recomputed over the whole sequence: no key/value cache). Runs
    /// the whole model (pp 1), at any tp (collective over it). Errors: an empty prompt, a sequence longer than
    /// `max_position_embeddings`.
    pub fn generate_greedy(&self, prompt: &[u32], max_new_tokens: usize) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(AccelError::InvalidArgument(
                "generate_greedy: the prompt is empty; give at least one id".into(),
            ));
        }
        let mut ids = prompt.to_vec();
        for _ in 0..max_new_tokens {
            let input = Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?;
            let logits = self.full_logits(&self.forward(&input)?)?;
            let last = logits.narrow(1, ids.len() - 1, 1)?.flatten_all()?.to_dtype(DType::F32)?;
            ids.push(last.argmax(D::Minus1)?.to_scalar::<u32>()?);
        }
        Ok(ids)
    }
}

/// [`Llama::forward`] as a candle module (what the Trainer calls).
impl Module for Llama {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.model.forward(ids)
    }
}

/// The stages this rank holds, as [`crate::Accelerator::pipeline_backward`] drives them.
impl StagedModel for Llama {
    fn stage_forward(&self, stage: usize, input: &Tensor) -> Result<Tensor> {
        self.model.stage_forward(stage, input)
    }
}

impl Block {
    fn new(config: &LlamaConfig, vb: VarBuilder, rotary: Arc<RotaryTables>) -> candle_core::Result<Self> {
        let (hidden, eps) = (config.hidden_size, config.rms_norm_eps);
        let (attn, mlp) = (vb.pp("self_attn"), vb.pp("mlp"));
        let (q_out, kv_out) =
            (config.num_attention_heads * config.head_dim(), config.num_key_value_heads() * config.head_dim());
        // The projections split whole heads (LlamaConfig::check_tp_size said so already); asking the builder
        // records the head counts for a description of the model (what tp must divide).
        attn.local_heads(config.num_attention_heads)?;
        attn.local_heads(config.num_key_value_heads())?;
        let ab = config.attention_bias;
        let mb = config.mlp_bias;
        let inter = config.intermediate_size;
        Ok(Block {
            input_layernorm: nn::rms_norm(hidden, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention {
                q_proj: linear(config, hidden, q_out, ab, attn.pp("q_proj"))?,
                k_proj: linear(config, hidden, kv_out, ab, attn.pp("k_proj"))?,
                v_proj: linear(config, hidden, kv_out, ab, attn.pp("v_proj"))?,
                o_proj: linear(config, q_out, hidden, ab, attn.pp("o_proj"))?,
                head_dim: config.head_dim(),
                rotary,
                probs_dropout: nn::dropout(config.attention_dropout, attn.pp("attention_dropout"))?,
            },
            attn_dropout: nn::dropout(config.hidden_dropout, vb.pp("attn_residual_dropout"))?,
            post_attention_layernorm: nn::rms_norm(hidden, eps, vb.pp("post_attention_layernorm"))?,
            mlp: Mlp {
                gate_proj: linear(config, hidden, inter, mb, mlp.pp("gate_proj"))?,
                up_proj: linear(config, hidden, inter, mb, mlp.pp("up_proj"))?,
                down_proj: linear(config, inter, hidden, mb, mlp.pp("down_proj"))?,
            },
            mlp_dropout: nn::dropout(config.hidden_dropout, vb.pp("mlp_residual_dropout"))?,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // Dropout acts inside a training step's dropout context only (the identity in evaluation).
        let h = self.self_attn.forward(&self.input_layernorm.forward(x)?)?;
        let x = (x + self.attn_dropout.forward_t(&h, true)?)?;
        let h = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        &x + self.mlp_dropout.forward_t(&h, true)?
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)
    }
}

/// `[b, s, kv_heads, d]` → `[b, s, kv_heads · n_rep, d]`, each key/value head repeated for the `n_rep` query
/// heads it serves (query head `h` reads key/value head `h / n_rep`, transformers' `repeat_kv`).
fn repeat_kv(x: &Tensor, n_rep: usize) -> candle_core::Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, s, kv, d) = x.dims4()?;
    x.unsqueeze(3)?.broadcast_as((b, s, kv, n_rep, d))?.reshape((b, s, kv * n_rep, d))
}

impl Module for Attention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let hd = self.head_dim;
        let q = self.q_proj.forward(x)?;
        let (k, v) = (self.k_proj.forward(x)?, self.v_proj.forward(x)?);
        // This rank's head counts, from the projections' widths (the plan may have split them).
        let (heads, kv_heads) = (q.dim(2)? / hd, k.dim(2)? / hd);
        let split = self.q_proj.output_split(&q)?;
        let q = self.rotary.apply(&q.reshape((b, s, heads, hd))?)?;
        let k = repeat_kv(&self.rotary.apply(&k.reshape((b, s, kv_heads, hd))?)?, heads / kv_heads)?;
        let v = repeat_kv(&v.reshape((b, s, kv_heads, hd))?, heads / kv_heads)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let y = if self.probs_dropout.p() > 0.0 && dropout_context().is_some() {
            // Dropout on the probabilities needs them materialised: the composed form, heads split out.
            let heads_first = |t: &Tensor| t.transpose(1, 2)?.contiguous();
            let (q, k, v) = (heads_first(&q)?, heads_first(&k)?, heads_first(&v)?);
            let probs = causal_softmax(&q.matmul(&k.t()?)?, scale)?;
            // Under tp the probabilities are this rank's heads: its slice of the single-process mask.
            let split = split.map(|d| ShardedDim { dim: 1, full: d.full / hd, start: d.start / hd });
            let probs = self.probs_dropout.forward_split(&probs, split)?;
            probs.matmul(&v)?.transpose(1, 2)?.reshape((b, s, heads * hd))?
        } else {
            let flat = |t: Tensor| t.reshape((b, s, heads * hd));
            causal_self_attention(&flat(q)?, &flat(k)?, &flat(v)?, heads, scale)?
        };
        self.o_proj.forward(&y)
    }
}
