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

use super::invalid::InvalidSpec;
use crate::nn::{ActivationSpec, ShapedParam};

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
    /// The counts read from a built model ([`ModelSpec::of_model`]), which replace the GPT formulas.
    measured: Option<Box<Measured>>,
}

/// Parameters of one part of a described model: those every tp rank holds whole, and the split ones (each
/// `size` rows along its split dim of `rest` elements; a rank holds ⌈size/t⌉ rows — padded rows included).
#[derive(Debug, Clone, PartialEq, Default)]
struct Counts {
    whole: u64,
    split: Vec<(u64, u64)>,
}

impl Counts {
    fn add(&mut self, p: &ShapedParam) {
        match p.split {
            None => self.whole += p.elem_count(),
            Some((dim, _)) => {
                let size = p.shape[dim].max(1) as u64;
                self.split.push((size, p.elem_count() / size));
            }
        }
    }

    fn per_rank(&self, tp: usize) -> u64 {
        self.whole + self.split.iter().map(|&(size, rest)| size.div_ceil(tp as u64) * rest).sum::<u64>()
    }
}

/// What [`ModelSpec::of_model`] read from the model (see there).
#[derive(Debug, Clone, PartialEq)]
struct Measured {
    input: Counts,
    /// The largest block.
    block: Counts,
    /// The output part on a last stage apart from the first (a tied embedding's copy included).
    output: Counts,
    /// The output part at pp 1 (copies left out).
    output_alone: Counts,
    /// The largest block's weights that multiply activations.
    block_matmul: Counts,
    /// The output part's weights that multiply activations (the head, tied or not).
    output_matmul: Counts,
    /// Sizes tp must divide, with what they are (`model.layers.0.mlp.gate_proj.weight dim 0`, `attention heads`).
    must_divide: Vec<(String, usize)>,
    /// Declared with `accel::nn::staged` (else one block, one pipeline stage).
    staged: bool,
    /// Row-wise linear layers per block: an all-reduce each forward, and one backward at the column-wise input.
    rowwise_per_block: u64,
    /// Without attention: the elements per token a block keeps for its backward, (whole, split over tp).
    kept_per_token: Option<(u64, u64)>,
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
            measured: None,
        }
    }

    /// The shape of the model `build` makes on a builder laid out by `plan` — read without allocating it
    /// ([`crate::nn::describe`]) — for sequences of `seq_len` tokens (1 for a model whose sample is one row):
    /// [`ModelSpec::from_shape`].
    ///
    /// ```
    /// use accel::auto_layout::ModelSpec;
    /// use accel::models::llama::{Llama, LlamaConfig};
    /// let config = LlamaConfig::new(2048, 256, 688, 4, 4, 2);
    /// let spec = ModelSpec::of_model(Llama::plan(&config), 128, |vb| Llama::new(&config, vb))?;
    /// assert_eq!((spec.n_layer, spec.d_model, spec.n_head, spec.d_ff, spec.vocab), (4, 256, 4, 688, 2048));
    /// assert!(spec.tp_fits(2) && !spec.tp_fits(4)); // 2 key/value heads
    /// # Ok::<(), accel::AccelError>(())
    /// ```
    ///
    /// Errors: the model's and the plan's while it builds; [`ModelSpec::from_shape`]'s.
    pub fn of_model<M, E: Into<crate::AccelError>>(
        plan: crate::plan::ParallelPlan,
        seq_len: usize,
        build: impl FnOnce(crate::nn::VarBuilder) -> Result<M, E>,
    ) -> crate::Result<Self> {
        let shape = crate::nn::describe(plan, build)?;
        Ok(ModelSpec::from_shape(&shape, seq_len)?)
    }

    /// The spec of a described model (a model on `accel::nn`'s builder, any architecture) for sequences of
    /// `seq_len` tokens. Read from it, not assumed:
    ///
    /// - blocks `L`: the units of a model declared with `accel::nn::staged`; a model that is not is one block
    ///   (and pipeline parallelism is ruled out for it);
    /// - parameters per rank of the input part, of a block (the largest, if they differ), of the output part at
    ///   pp 1 and on a last stage apart from the first (a tied embedding's copy), each split as the plan splits
    ///   it (padded rows counted);
    /// - FLOPs: 2 per element of each weight that multiplies activations (linear layers, a tied head) per token
    ///   forward, plus attention's 4·s·h when the model splits attention heads;
    /// - h = the input embedding's width (else the first layer's input), f = a block's widest linear output,
    ///   V = the head's output rows, a = the largest head count given to `VarBuilder::local_heads`;
    /// - what tp must divide: every split size that is not padded, and every head count;
    /// - tp all-reduces: two per row-wise layer of a block (its output forward, its column-wise input's gradient
    ///   backward), three with recomputation;
    /// - activations: with attention, the transformer accounting over h, f and a of what the model declares
    ///   (`VarBuilder::declare_activations`), else of a GPT block ([`ActivationSpec::accel`], with dropout masks
    ///   when a dropout layer of the model drops out); without attention,
    ///   every layer's input and output per token (a linear's split side divided by tp, a norm's input and output),
    ///   which omits what runs between layers (activation functions, products) — an estimate.
    ///
    /// Errors: a staged model of 0 blocks, `seq_len` 0, a model without parameters.
    pub fn from_shape(shape: &crate::nn::ModelShape, seq_len: usize) -> Result<Self, InvalidSpec> {
        use crate::nn::{LayerKind, ModelPart};
        use crate::plan::ParallelStyle;
        let invalid = |what: String| Err(InvalidSpec(what));
        if seq_len == 0 {
            return invalid(
                "the sequence length is 0; it is at least 1 (1 for a model whose sample is one row)".into(),
            );
        }
        if shape.params.is_empty() {
            return invalid("the model has no parameters to lay out".into());
        }
        let n_layer = match &shape.blocks {
            Some(b) if b.is_empty() => return invalid("the model is declared with 0 blocks".into()),
            Some(b) => b.len(),
            None => 1,
        };
        let (mut input, mut output, mut output_alone, mut output_matmul) =
            (Counts::default(), Counts::default(), Counts::default(), Counts::default());
        let mut blocks: Vec<(Counts, Counts)> = vec![Default::default(); n_layer];
        let mut must_divide: Vec<(String, usize)> = Vec::new();
        for p in &shape.params {
            match p.part {
                ModelPart::Input => input.add(p),
                ModelPart::Block(i) => {
                    blocks[i].0.add(p);
                    if p.matmul {
                        blocks[i].1.add(p);
                    }
                }
                ModelPart::Output => {
                    output.add(p);
                    if !p.copy {
                        output_alone.add(p);
                    }
                    if p.matmul {
                        output_matmul.add(p);
                    }
                }
            }
            if let Some((dim, false)) = p.split {
                must_divide.push((format!("{} dim {dim}", p.name), p.shape[dim]));
            }
        }
        let largest = (0..n_layer).max_by_key(|&i| blocks[i].0.per_rank(1)).unwrap_or(0);
        let (block, block_matmul) = blocks.swap_remove(largest);
        let n_head = shape.heads.iter().map(|(_, n)| *n).max().unwrap_or(0);
        for (path, n) in &shape.heads {
            must_divide.push((format!("the heads split under `{}`", crate::plan::generalize(path)), *n));
        }
        // Every block asks the same: each size once.
        let mut seen = std::collections::HashSet::new();
        must_divide.retain(|(what, n)| seen.insert((crate::plan::generalize(what), *n)));

        let block_layers: Vec<_> = shape.layers_in(ModelPart::Block(largest)).collect();
        let first_width = |l: &crate::nn::PlannedLayer| {
            let dims = &l.params.first()?.1;
            Some(match l.kind {
                LayerKind::Norm => dims[0],
                _ => *dims.last()?,
            })
        };
        let d_model = shape
            .layers_in(ModelPart::Input)
            .find(|l| l.kind == LayerKind::Embedding)
            .and_then(first_width)
            .or_else(|| block_layers.first().and_then(|l| first_width(l)))
            .unwrap_or(1);
        let linear_dims = |l: &crate::nn::PlannedLayer| match (l.kind, l.params.first()) {
            (LayerKind::Linear, Some((_, dims, _))) if dims.len() == 2 => Some((dims[0], dims[1])),
            _ => None,
        };
        let d_ff = block_layers.iter().filter_map(|l| linear_dims(l)).map(|(out, _)| out).max().unwrap_or(d_model);
        let vocab = shape
            .params
            .iter()
            .filter(|p| p.part == ModelPart::Output && p.matmul)
            .map(|p| p.shape[0])
            .max()
            .unwrap_or(0);
        let rowwise_per_block =
            block_layers.iter().filter(|l| l.kind == LayerKind::Linear && l.style == ParallelStyle::Rowwise).count()
                as u64;
        let kept_per_token = (n_head == 0).then(|| {
            let (mut whole, mut split) = (0u64, 0u64);
            for l in &block_layers {
                match (linear_dims(l), l.style) {
                    (Some((out, inp)), ParallelStyle::Rowwise) => {
                        (split, whole) = (split + inp as u64, whole + out as u64)
                    }
                    (Some((out, inp)), ParallelStyle::Replicate) => whole += (inp + out) as u64,
                    (Some((out, inp)), _) => (whole, split) = (whole + inp as u64, split + out as u64),
                    (None, _) => whole += 2 * first_width(l).unwrap_or(0) as u64,
                }
            }
            (whole, split)
        });
        let tied = shape.params.iter().any(|p| p.copy);
        let measured = Measured {
            input,
            block,
            output,
            output_alone,
            block_matmul,
            output_matmul,
            must_divide,
            staged: shape.blocks.is_some(),
            rowwise_per_block,
            kept_per_token,
        };
        Ok(ModelSpec {
            n_layer,
            d_model,
            n_head,
            d_ff,
            vocab,
            seq_len,
            tied_embeddings: tied,
            // As the model declared it; else a GPT block's, its dropout masks tensors of the activations' dtype
            // (f32 on the CPU: bf16 autocasts over f32).
            activations: shape.activations.unwrap_or(ActivationSpec::accel(shape.dropout, 4)),
            block_params_given: None,
            remainder_given: 0,
            measured: Some(Box::new(measured)),
        })
    }

    /// Whether the model is declared as pipeline blocks (a spec of the GPT formulas always is).
    pub fn has_stages(&self) -> bool {
        self.measured.as_ref().is_none_or(|m| m.staged)
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
    /// Errors: a total smaller than the embeddings, norm and head plus 6h per block; a spec read from a model.
    pub fn with_total_params(mut self, total: u64) -> Result<Self, InvalidSpec> {
        if self.measured.is_some() {
            return Err(InvalidSpec(
                "this spec was read from the built model (ModelSpec::of_model): its parameters are counted already"
                    .into(),
            ));
        }
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
            _ => Err(InvalidSpec(format!(
                "{total} parameters are too few for this shape: the embeddings, final norm and head alone hold \
                 {outside}, and each of the {} blocks at least {} (its layer norms and row-parallel biases)",
                self.n_layer,
                6 * h
            ))),
        }
    }

    /// Checks the shape: no size 0, `n_head` dividing `d_model`.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        if self.measured.is_some() {
            // Read from a built model: its sizes are what they are (from_shape checked what it needs).
            return Ok(());
        }
        let sizes = [
            ("n_layer", self.n_layer),
            ("d_model", self.d_model),
            ("n_head", self.n_head),
            ("d_ff", self.d_ff),
            ("vocab", self.vocab),
            ("seq_len", self.seq_len),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return Err(InvalidSpec(format!("the model's {name} is 0; every size is at least 1")));
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(InvalidSpec(format!("n_head {} does not divide d_model {}", self.n_head, self.d_model)));
        }
        Ok(())
    }

    /// Whether a tp group of `tp` ranks can split the model: `tp` divides `n_head`, `d_model` and `d_ff` (the
    /// vocabulary is padded, so it does not constrain tp).
    pub fn tp_fits(&self, tp: usize) -> bool {
        self.tp_misfit(tp).is_none()
    }

    /// Why a tp group of `tp` ranks cannot split the model (`tp 4 does not divide …`), `None` when it can: for a
    /// model read from its build, the first sizes it does not divide (by name), else `n_head`, `d_model`, `d_ff`.
    pub fn tp_misfit(&self, tp: usize) -> Option<String> {
        if tp == 0 {
            return Some("tp 0: a tp group has at least one rank".into());
        }
        match &self.measured {
            Some(m) => {
                let misfits: Vec<String> = m
                    .must_divide
                    .iter()
                    .filter(|(_, n)| !n.is_multiple_of(tp))
                    .map(|(what, n)| format!("{what} of {n}"))
                    .collect();
                (!misfits.is_empty()).then(|| {
                    let shown = misfits.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
                    let more =
                        if misfits.len() > 3 { format!(" and {} more", misfits.len() - 3) } else { String::new() };
                    format!("tp {tp} does not divide {shown}{more}")
                })
            }
            None => {
                let fits =
                    self.n_head.is_multiple_of(tp) && self.d_model.is_multiple_of(tp) && self.d_ff.is_multiple_of(tp);
                (!fits).then(|| {
                    format!(
                        "tp {tp} does not divide n_head {}, d_model {} and d_ff {}",
                        self.n_head, self.d_model, self.d_ff
                    )
                })
            }
        }
    }

    /// Tensor-parallel all-reduces of one block per micro-batch (`recompute`: its forward runs twice): two per
    /// row-wise layer (Megatron's *g* forward, *f* backward), three with recomputation — 4 and 6 for a GPT block.
    pub fn tp_all_reduces_per_block(&self, recompute: bool) -> f64 {
        let rowwise = self.measured.as_ref().map_or(2, |m| m.rowwise_per_block) as f64;
        rowwise * if recompute { 3.0 } else { 2.0 }
    }

    /// One block's parameters (single process).
    pub fn block_params(&self) -> u64 {
        if let Some(m) = &self.measured {
            return m.block.per_rank(1);
        }
        let (h, f) = (self.d_model as u64, self.d_ff as u64);
        self.block_params_given.unwrap_or(4 * h * h + 2 * h * f + 9 * h + f)
    }

    /// One block's parameters on one rank of a tp group of `tp`: the split part divided, the 6h of layer norms
    /// and row-parallel biases replicated.
    pub fn block_params_per_rank(&self, tp: usize) -> u64 {
        if let Some(m) = &self.measured {
            return m.block.per_rank(tp);
        }
        let replicated = 6 * self.d_model as u64;
        (self.block_params() - replicated).div_ceil(tp as u64) + replicated
    }

    /// The parameters of a block's matrix products (4h² + 2hf for a GPT block; a given block's count less its 9h + f
    /// of biases and norms): the FLOPs are 2 per such parameter per token forward.
    pub fn block_matmul_params(&self) -> u64 {
        if let Some(m) = &self.measured {
            return m.block_matmul.per_rank(1);
        }
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
        if let Some(m) = &self.measured {
            return m.input.per_rank(tp);
        }
        let h = self.d_model as u64;
        self.vocab_per_rank(tp) * h + self.seq_len as u64 * h + self.remainder_given
    }

    /// The last stage's parameters besides its blocks, per tp rank: the final norm's 2h, and ⌈V/t⌉·h of head
    /// weight unless the embeddings are tied and the last stage is also the first (`pp == 1`).
    pub fn head_params_per_rank(&self, tp: usize, pp: usize) -> u64 {
        if let Some(m) = &self.measured {
            return if pp == 1 { m.output_alone.per_rank(tp) } else { m.output.per_rank(tp) };
        }
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
        if let Some(m) = &self.measured {
            return m.input.per_rank(1) + self.n_layer as u64 * m.block.per_rank(1) + m.output_alone.per_rank(1);
        }
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
        match &self.measured {
            Some(m) => {
                let attention = if self.n_head > 0 { 4.0 * s * h / tp as f64 } else { 0.0 };
                2.0 * m.block_matmul.per_rank(tp) as f64 + attention
            }
            None => (2.0 * self.block_matmul_params() as f64 + 4.0 * s * h) / tp as f64,
        }
    }

    /// Forward FLOPs of the head per token per tp rank: 2·h·⌈V/t⌉ (the embedding lookup computes nothing).
    pub fn head_forward_flops_per_token(&self, tp: usize) -> f64 {
        match &self.measured {
            Some(m) => 2.0 * m.output_matmul.per_rank(tp) as f64,
            None => 2.0 * self.d_model as f64 * self.vocab_per_rank(tp) as f64,
        }
    }

    /// Activation bytes one block keeps for its backward, per micro-batch of `b` sequences, at tp `tp`, with `e`
    /// bytes per activation element ([`ActivationSpec`]'s formula).
    pub fn block_activation_bytes(&self, b: usize, tp: usize, e: u64) -> u64 {
        if let Some((whole, split)) = self.measured.as_ref().and_then(|m| m.kept_per_token) {
            return b as u64 * self.seq_len as u64 * e * (whole + split.div_ceil(tp as u64));
        }
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
