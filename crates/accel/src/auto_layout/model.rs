//! [`ModelSpec`]: the decoder-only transformer a layout is chosen for — its shape, its parameters per rank under
//! tensor and pipeline parallelism, its FLOPs per token, and the activation bytes a block keeps for its backward
//! ([`ActivationSpec`]).
//!
//! The shape is GPT-2's, as `accel_examples::gpt::CharGpt` builds it (h = `d_model`, f = `d_ff`, V = `vocab`,
//! s = `seq_len`, a = `n_head`):
//!
//! | part                | parameters                                   | split over tp                          |
//! |---------------------|----------------------------------------------|----------------------------------------|
//! | token embedding     | V·h                                          | rows: ⌈V/t⌉·h per rank (padded)        |
//! | position embedding  | s·h                                          | replicated                             |
//! | block (× n_layer)   | 4h² + 2hf + 9h + f                           | (4h² + 2hf + 3h + f)/t + 6h            |
//! | final layer norm    | 2h                                           | replicated                             |
//! | head (untied)       | V·h (no bias)                                | rows: ⌈V/t⌉·h                          |
//!
//! A block is two layer norms (4h), q, k, v and the output projection with biases (4h² + 4h), the MLP's two
//! linears with biases (2hf + f + h). Under Megatron's tp (Shoeybi et al. 2019) q, k, v and the MLP's first linear
//! are column-parallel (weights and biases split), the two output projections row-parallel (weights split, biases
//! replicated), the layer norms replicated: 6h replicated per block. Under pp the first stage holds the
//! embeddings, the last the final norm and the head — with tied embeddings the head reads the token embedding, so
//! at pp > 1 the last stage holds a copy of it (as accel does), at pp 1 nothing more.

use super::error::AutoLayoutError;

/// The activation bytes a transformer block keeps for its backward pass, per Korthikanti et al. 2022 ("Reducing
/// Activation Recomputation in Large Transformer Models", §4.1), with what varies between implementations made
/// explicit. Per block, per micro-batch of `b` sequences of `s` tokens, at tp `t`, with `e` bytes per activation
/// element (the compute dtype's: [`super::StateBytes::activation`]):
///
/// ```text
/// b·s·[ e·(4h + (4h + 2f)/t) + mask·(h_masks·h + f_masks·f/t) ] + b·(a/t)·s²·(score_tensors·e + score_masks·mask)
/// ```
///
/// - `4h` replicated over tp: the two layer-norm inputs, the q/k/v projections' input, the MLP's input.
/// - `(4h + 2f)/t` split over tp: q, k, v (3h), the output projection's input (h), the GELU's input and output (2f).
/// - dropout masks: `h_masks` of `[b, s, h]` (after attention and after the MLP), `f_masks` of `[b, s, f/t]`.
/// - attention scores: `score_tensors` `[b, a/t, s, s]` tensors kept (softmax output, its dropout's output) and
///   `score_masks` masks (the attention-probability dropout).
///
/// With Korthikanti's settings (16-bit values, 1-byte masks, two h-masks, two score tensors and one score mask,
/// f = 4h) this is their `s·b·h·(10 + 24/t + 5·a·s/(h·t))`, `s·b·h·(34 + 5·a·s/h)` at t = 1 (tested).
///
/// **Our CPU f32 case** ([`ActivationSpec::accel`]): the values are f32 (e = 4 — also under bf16 on the CPU, which
/// is autocast over f32 tensors); the fused attention kernel keeps only q, k and v and recomputes the
/// probabilities in its backward (as FlashAttention), so no `s²` tensor is kept; with dropout on, accel's masks are
/// tensors of the activations' dtype (e bytes) at both residual branches and on the MLP's hidden activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationSpec {
    /// Bytes per dropout-mask element; 0 when dropout is off.
    pub mask_bytes: u64,
    /// `[b, s, h]` dropout masks per block (replicated over tp).
    pub h_masks: u64,
    /// `[b, s, f/t]` dropout masks per block (split over tp).
    pub f_masks: u64,
    /// `[b, a/t, s, s]` value tensors kept per block (attention probabilities and their dropout's output).
    pub score_tensors: u64,
    /// `[b, a/t, s, s]` dropout masks per block.
    pub score_masks: u64,
    /// Further `[b, s, h]` value tensors a block keeps, replicated over tp (beyond Korthikanti's count).
    pub extra_h: u64,
    /// Further `[b, s, h/t]` value tensors a block keeps, split over tp.
    pub extra_h_split: u64,
    /// Further `[b, s, f/t]` value tensors a block keeps.
    pub extra_f: u64,
    /// Further `[b, s, h]` tensors a block keeps only under tensor parallelism (t > 1): the tp region's copies
    /// (the identity before a column-parallel layer, a row-parallel layer's partial sum before its all-reduce).
    pub tp_extra_h: u64,
    /// Blocks whose full activations are alive at once while checkpointed blocks are recomputed in the backward
    /// (1 in the ideal; see [`ActivationSpec::accel`]).
    pub recomputed_blocks_live: u64,
}

impl ActivationSpec {
    /// Korthikanti et al.'s accounting (Megatron on GPUs): 1-byte masks, dropout after attention and after the MLP
    /// and on the attention probabilities, the probabilities and their dropout's output kept.
    pub fn korthikanti() -> Self {
        ActivationSpec {
            mask_bytes: 1,
            h_masks: 2,
            f_masks: 0,
            score_tensors: 2,
            score_masks: 1,
            extra_h: 0,
            extra_h_split: 0,
            extra_f: 0,
            tp_extra_h: 0,
            recomputed_blocks_live: 1,
        }
    }

    /// accel's char-GPT with the fused ops: no score tensor kept (the attention backward recomputes them); with
    /// `dropout`, masks of `mask_bytes` each (the activation element size: accel's masks are tensors of the
    /// activations' dtype) after both residual branches and on the MLP's hidden activation. candle's autograd
    /// keeps every op's inputs, so each biased linear keeps its product before the bias too — q, k, v's (`3h/t`),
    /// the MLP's first (`f/t`), both row-parallel projections' (`h` each) — and the heads' contiguous q, k, v
    /// (`3h/t`): 2 more `h`, 6 more `h/t` and 1 more `f/t` tensor per token than Korthikanti's count (measured:
    /// the 1-process char-GPT's peak grows 3.7 MiB per sequence of 64 tokens, 4 blocks, h 128, f 512; the formula
    /// with these gives 3.6). Under tp, 8 more `h` tensors per token (the tp regions' copies and partial sums;
    /// measured at tp 2: 3.2 MiB per sequence, the formula 2.3 without them, 3.2 with). While checkpointed blocks are
    /// recomputed, two blocks' activations are alive (the recomputed block's and the previous one's, still held
    /// when the next recomputation starts; measured with checkpointing and FULL_SHARD: 2.1 and 2.3 MiB per
    /// sequence, the formula with one block 1.3).
    pub fn accel(dropout: bool, mask_bytes: u64) -> Self {
        let (mask_bytes, h_masks, f_masks) = if dropout { (mask_bytes, 2, 1) } else { (0, 0, 0) };
        ActivationSpec {
            mask_bytes,
            h_masks,
            f_masks,
            score_tensors: 0,
            score_masks: 0,
            extra_h: 2,
            extra_h_split: 6,
            extra_f: 1,
            tp_extra_h: 8,
            recomputed_blocks_live: 2,
        }
    }
}

/// A decoder-only transformer (see the module documentation for the parameter count).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Transformer blocks (L).
    pub n_layer: usize,
    /// Width of the residual stream (h).
    pub d_model: usize,
    /// Attention heads (a).
    pub n_head: usize,
    /// Hidden width of the MLP (f).
    pub d_ff: usize,
    /// Vocabulary size (V).
    pub vocab: usize,
    /// Sequence length in tokens (s): every sequence of a batch has this many.
    pub seq_len: usize,
    /// The head reads the token embedding's weight (GPT-2's weight tying).
    pub tied_embeddings: bool,
    /// What a block keeps for its backward.
    pub activations: ActivationSpec,
    /// One block's parameters when given raw ([`ModelSpec::with_total_params`]) instead of derived.
    block_params_given: Option<u64>,
    /// What of a raw count does not share equally among the blocks (counted with the embeddings).
    remainder_given: u64,
}

impl ModelSpec {
    /// GPT-2's shape (untied, accel's activations without dropout: [`ActivationSpec::accel`]).
    pub fn gpt(n_layer: usize, d_model: usize, n_head: usize, d_ff: usize, vocab: usize, seq_len: usize) -> Self {
        ModelSpec {
            n_layer,
            d_model,
            n_head,
            d_ff,
            vocab,
            seq_len,
            tied_embeddings: false,
            activations: ActivationSpec::accel(false, 0),
            block_params_given: None,
            remainder_given: 0,
        }
    }

    /// Builder: ties the head to the token embedding.
    pub fn with_tied_embeddings(mut self, tied: bool) -> Self {
        self.tied_embeddings = tied;
        self
    }

    /// Builder: what a block keeps for its backward.
    pub fn with_activations(mut self, activations: ActivationSpec) -> Self {
        self.activations = activations;
        self
    }

    /// Builder: the model's parameter count given raw (a model of this shape but other blocks — gated MLPs, no
    /// biases, …): the embeddings, the final norm and the head are counted from the shape, the rest shared
    /// equally by the blocks (6h of each replicated over tp, the rest split, as a GPT block); the remainder of
    /// that division (fewer than `n_layer` parameters) is counted with the first stage's embeddings.
    ///
    /// Errors: a total smaller than the embeddings, norm and head plus 6h per block.
    pub fn with_total_params(mut self, total: u64) -> Result<Self, AutoLayoutError> {
        self.block_params_given = None;
        self.remainder_given = 0;
        let n = self.n_layer.max(1) as u64;
        let outside = self.total_params() - self.n_layer as u64 * self.block_params();
        let h = self.d_model as u64;
        match total.checked_sub(outside) {
            Some(blocks) if blocks / n >= 6 * h => {
                self.block_params_given = Some(blocks / n);
                self.remainder_given = blocks % n;
                Ok(self)
            }
            _ => Err(AutoLayoutError::InvalidSpec(format!(
                "{total} parameters are too few for this shape: the embeddings, final norm and head alone hold \
                 {outside}, and each of the {} blocks at least {} (its layer norms and row-parallel biases)",
                self.n_layer,
                6 * h
            ))),
        }
    }

    /// Checks the shape: no size 0, `n_head` dividing `d_model`.
    pub fn validate(&self) -> Result<(), AutoLayoutError> {
        let sizes = [
            ("n_layer", self.n_layer),
            ("d_model", self.d_model),
            ("n_head", self.n_head),
            ("d_ff", self.d_ff),
            ("vocab", self.vocab),
            ("seq_len", self.seq_len),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return Err(AutoLayoutError::InvalidSpec(format!("the model's {name} is 0; every size is at least 1")));
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(AutoLayoutError::InvalidSpec(format!(
                "n_head {} does not divide d_model {}",
                self.n_head, self.d_model
            )));
        }
        Ok(())
    }

    /// Whether a tp group of `tp` ranks can split the model: `tp` divides `n_head`, `d_model` and `d_ff` (the
    /// vocabulary is padded, so it does not constrain tp).
    pub fn tp_fits(&self, tp: usize) -> bool {
        tp >= 1 && self.n_head.is_multiple_of(tp) && self.d_model.is_multiple_of(tp) && self.d_ff.is_multiple_of(tp)
    }

    /// One block's parameters (single process).
    pub fn block_params(&self) -> u64 {
        let (h, f) = (self.d_model as u64, self.d_ff as u64);
        self.block_params_given.unwrap_or(4 * h * h + 2 * h * f + 9 * h + f)
    }

    /// One block's parameters on one rank of a tp group of `tp`: the split part divided, the 6h of layer norms
    /// and row-parallel biases replicated.
    pub fn block_params_per_rank(&self, tp: usize) -> u64 {
        let replicated = 6 * self.d_model as u64;
        (self.block_params() - replicated).div_ceil(tp as u64) + replicated
    }

    /// The parameters of a block's matrix products (4h² + 2hf for a GPT block; a given block's count less its 9h + f
    /// of biases and norms): the FLOPs are 2 per such parameter per token forward.
    pub fn block_matmul_params(&self) -> u64 {
        let (h, f) = (self.d_model as u64, self.d_ff as u64);
        self.block_params().saturating_sub(9 * h + f)
    }

    /// Rows of the token embedding (and untied head) on one tp rank: ⌈V/t⌉ (padded).
    pub fn vocab_per_rank(&self, tp: usize) -> u64 {
        self.vocab.div_ceil(tp) as u64
    }

    /// The first stage's parameters besides its blocks, per tp rank: the token embedding's ⌈V/t⌉·h and the
    /// replicated position embedding's s·h.
    pub fn embedding_params_per_rank(&self, tp: usize) -> u64 {
        let h = self.d_model as u64;
        self.vocab_per_rank(tp) * h + self.seq_len as u64 * h + self.remainder_given
    }

    /// The last stage's parameters besides its blocks, per tp rank: the final norm's 2h, and ⌈V/t⌉·h of head
    /// weight unless the embeddings are tied and the last stage is also the first (`pp == 1`).
    pub fn head_params_per_rank(&self, tp: usize, pp: usize) -> u64 {
        let h = self.d_model as u64;
        let weight = if self.tied_embeddings && pp == 1 { 0 } else { self.vocab_per_rank(tp) * h };
        2 * h + weight
    }

    /// Parameters one rank holds (Ψ of its stage, per tp rank): `layers` blocks, the embeddings on pp rank 0 (which
    /// holds stage 0), the final norm and head on pp rank `pp − 1` (which holds the last stage).
    pub fn params_on_rank(&self, tp: usize, pp: usize, pp_rank: usize, layers: usize) -> u64 {
        let mut n = layers as u64 * self.block_params_per_rank(tp);
        if pp_rank == 0 {
            n += self.embedding_params_per_rank(tp);
        }
        if pp_rank + 1 == pp {
            n += self.head_params_per_rank(tp, pp);
        }
        n
    }

    /// Parameters of the whole single-process model (Ψ).
    pub fn total_params(&self) -> u64 {
        let (h, v) = (self.d_model as u64, self.vocab as u64);
        let head = if self.tied_embeddings { 0 } else { v * h };
        v * h
            + self.seq_len as u64 * h
            + self.n_layer as u64 * self.block_params()
            + 2 * h
            + head
            + self.remainder_given
    }

    /// Forward FLOPs of one block per token at tp `tp`, per rank: 2 per matrix-product parameter, and 4·s·h for
    /// the attention scores and their weighted sum (Narayanan et al. 2021, eq. 3, which counts the full `s × s`
    /// products; a causal kernel computes about half), both divided by tp.
    pub fn block_forward_flops_per_token(&self, tp: usize) -> f64 {
        let (h, s) = (self.d_model as f64, self.seq_len as f64);
        (2.0 * self.block_matmul_params() as f64 + 4.0 * s * h) / tp as f64
    }

    /// Forward FLOPs of the head per token per tp rank: 2·h·⌈V/t⌉ (the embedding lookup computes nothing).
    pub fn head_forward_flops_per_token(&self, tp: usize) -> f64 {
        2.0 * self.d_model as f64 * self.vocab_per_rank(tp) as f64
    }

    /// Activation bytes one block keeps for its backward, per micro-batch of `b` sequences, at tp `tp`, with `e`
    /// bytes per activation element ([`ActivationSpec`]'s formula).
    pub fn block_activation_bytes(&self, b: usize, tp: usize, e: u64) -> u64 {
        let (b, s, h, f, a, t) =
            (b as u64, self.seq_len as u64, self.d_model as u64, self.d_ff as u64, self.n_head as u64, tp as u64);
        let act = &self.activations;
        let per_token = e * (4 * h + (4 * h + 2 * f) / t)
            + act.mask_bytes * (act.h_masks * h + act.f_masks * f / t)
            + e * (act.extra_h * h + (act.extra_h_split * h + act.extra_f * f) / t)
            + if t > 1 { e * act.tp_extra_h * h } else { 0 };
        let scores = b * (a / t) * s * s * (act.score_tensors * e + act.score_masks * act.mask_bytes);
        b * s * per_token + scores
    }

    /// What a checkpointed block keeps: its input, `b·s·h·e` (Korthikanti et al. 2022: 2·s·b·h per layer in
    /// 16-bit with full recomputation).
    pub fn checkpointed_block_bytes(&self, b: usize, e: u64) -> u64 {
        b as u64 * self.seq_len as u64 * self.d_model as u64 * e
    }

    /// What the first stage keeps besides its blocks: the embedding's output `b·s·h·e` (and its dropout mask).
    pub fn embedding_activation_bytes(&self, b: usize, e: u64) -> u64 {
        let bsh = b as u64 * self.seq_len as u64 * self.d_model as u64;
        bsh * (e + self.activations.mask_bytes)
    }

    /// What the last stage keeps besides its blocks: the final norm's and the head's inputs (2·b·s·h·e), the
    /// logits (b·s·⌈V/t⌉·e) and the cross entropy's f32 probabilities (b·s·⌈V/t⌉·4) — Korthikanti et al. count
    /// 4·s·b·V/t for the head and the loss in 16-bit; the f32 softmax is ours.
    pub fn head_activation_bytes(&self, b: usize, tp: usize, e: u64) -> u64 {
        let bs = b as u64 * self.seq_len as u64;
        bs * (2 * self.d_model as u64 * e + self.vocab_per_rank(tp) * (e + 4))
    }

    /// `n_layer 4, d_model 128, 4 heads, d_ff 512, vocab 76, seq 64 (820 992 parameters)`.
    pub fn describe(&self) -> String {
        format!(
            "n_layer {}, d_model {}, {} heads, d_ff {}, vocab {}, seq {}{} ({} parameters)",
            self.n_layer,
            self.d_model,
            self.n_head,
            self.d_ff,
            self.vocab,
            self.seq_len,
            if self.tied_embeddings { ", tied embeddings" } else { "" },
            super::units::count(self.total_params())
        )
    }
}
