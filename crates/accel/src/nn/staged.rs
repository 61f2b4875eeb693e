//! [`Staged`]: a model declared as its blocks — an input part, `n` repeated blocks, an output part — which the
//! Accelerator cuts into pipeline stages, each rank building only the parts of its stages.

use super::builder::VarBuilder;
use super::unit::{unit, Unit};
use crate::pipeline::{Stage, StagedModel};
use crate::{AccelError, Result};
use candle_core::{Module, Tensor};
use std::sync::Arc;

/// A model as a sequence of blocks (torchtitan's `module_fqns_per_model_part`, a decoder's embedding, layers and
/// head), cut into pipeline stages by the Accelerator (the config's pp size and schedule; the blocks split evenly,
/// or as the automatic layout split them): this rank holds the parts of its stages only — the input part on the
/// first stage, its share of the blocks (each a [`Unit`]), the output part on the last.
///
/// - Without pipeline parallelism it is the whole model: `forward(x)` = `output(blocks(input(x)))` ([`Module`]).
/// - Under pp it is what [`crate::Accelerator::pipeline_backward`] runs ([`StagedModel`]): every schedule
///   (GPipe, 1F1B, interleaved 1F1B) drives it unchanged.
///
/// Built by [`staged`]. `I`, `B`, `O` are candle modules: `I` reads the model's input (ids `[b, s]`), the blocks
/// map activations to activations of the same shape, `O` gives what the loss reads (logits).
pub struct Staged<I, B, O> {
    /// The builder's record keeps a weak handle on it ([`VarBuilder::staged_model`]: the Trainer runs the pipeline
    /// through it); a strong one would be a cycle — the layers hold the record — and keep the model, and its
    /// process groups' connections, alive after the program dropped it.
    inner: Arc<Parts<I, B, O>>,
}

impl<I, B, O> Clone for Staged<I, B, O> {
    fn clone(&self) -> Self {
        Staged { inner: self.inner.clone() }
    }
}

/// The parts this rank holds, and how many stages the model has.
struct Parts<I, B, O> {
    parts: Vec<Part<I, B, O>>,
    num_stages: usize,
}

struct Part<I, B, O> {
    stage: Stage,
    input: Option<I>,
    blocks: Vec<Unit<B>>,
    output: Option<O>,
}

/// Builds the parts of a model of `n_blocks` blocks that this rank's pipeline stages hold (all of them without
/// pipeline parallelism): `input(vb)` on the first stage, `block(vb.pp(blocks_at).pp(i))` for each block `i` of
/// this rank's stages (a [`Unit`] each), `output(vb, input)` on the last stage — `input` is the first stage's part
/// when this rank holds it too (at pp 1), so a head can tie its weight to the embedding's
/// ([`super::Linear::tied`]); on a last stage apart from the first, build the embedding again under the same name
/// (the same seeded values; the Accelerator sums the two copies' gradients, as for any weight several stages
/// hold). Parameters keep their single-process names, so every layout starts from the same weights and saves the
/// same checkpoint.
///
/// The builder keeps a handle on the result ([`VarBuilder::staged_model`]), through which a caller that only has
/// the builder — the Trainer — runs the pipeline.
///
/// Errors: more stages than blocks (naming both), and each part's own.
pub fn staged<I, B, O>(
    vb: &VarBuilder,
    n_blocks: usize,
    blocks_at: &str,
    input: impl FnOnce(VarBuilder) -> candle_core::Result<I>,
    block: impl Fn(VarBuilder) -> candle_core::Result<B>,
    output: impl FnOnce(VarBuilder, Option<&I>) -> candle_core::Result<O>,
) -> candle_core::Result<Staged<I, B, O>>
where
    I: Module + Send + Sync + 'static,
    B: Module + Clone + Send + Sync + 'static,
    O: Module + Send + Sync + 'static,
{
    let stages = vb.stages(n_blocks)?;
    let num_stages = stages.first().map_or(1, |s| s.num_stages);
    let (mut input, mut output) = (Some(input), Some(output));
    let mut parts = Vec::with_capacity(stages.len());
    for stage in stages {
        let first = match stage.is_first() {
            true => input.take().map(|build| build(vb.clone())).transpose()?,
            false => None,
        };
        let blocks = stage
            .layers
            .clone()
            .map(|i| unit(vb.pp(blocks_at).pp(i), &block))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let last = match stage.is_last() {
            true => output.take().map(|build| build(vb.clone(), first.as_ref())).transpose()?,
            false => None,
        };
        parts.push(Part { stage, input: first, blocks, output: last });
    }
    let inner = Arc::new(Parts { parts, num_stages });
    let weak: std::sync::Weak<dyn StagedModel + Send + Sync> = Arc::downgrade(&inner) as _;
    vb.book().set_staged(weak);
    Ok(Staged { inner })
}

impl<I, B, O> Staged<I, B, O> {
    /// The stages this rank holds.
    pub fn stages(&self) -> Vec<&Stage> {
        self.inner.parts.iter().map(|p| &p.stage).collect()
    }

    /// The input part, when this rank holds the first stage.
    pub fn input(&self) -> Option<&I> {
        self.inner.parts.iter().find_map(|p| p.input.as_ref())
    }

    /// The output part, when this rank holds the last stage.
    pub fn output(&self) -> Option<&O> {
        self.inner.parts.iter().find_map(|p| p.output.as_ref())
    }

    /// The blocks this rank holds, with their indices in the whole model.
    pub fn blocks(&self) -> Vec<(usize, &B)> {
        self.inner.parts.iter().flat_map(|p| p.stage.layers.clone().zip(p.blocks.iter().map(Unit::inner))).collect()
    }

    /// Whether this rank holds the whole model (no pipeline parallelism).
    pub fn is_whole(&self) -> bool {
        self.inner.num_stages == 1
    }
}

impl<I: Module, B: Module + Clone + 'static, O: Module> Parts<I, B, O> {
    fn run(&self, part: &Part<I, B, O>, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = match &part.input {
            Some(input) => input.forward(x)?,
            None => x.clone(),
        };
        for block in &part.blocks {
            x = block.forward(&x)?;
        }
        match &part.output {
            Some(output) => output.forward(&x),
            None => Ok(x),
        }
    }
}

/// The whole model's forward; an error on a rank that holds only some pipeline stages (those run through
/// [`crate::Accelerator::pipeline_backward`]).
impl<I: Module, B: Module + Clone + 'static, O: Module> Module for Staged<I, B, O> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let inner = &self.inner;
        match inner.parts.as_slice() {
            [whole] if inner.num_stages == 1 => inner.run(whole, x),
            _ => Err(AccelError::Usage(format!(
                "this rank holds pipeline stages {:?} of {}, not the whole model: run them with \
                 accelerator.pipeline_backward (or pipeline_forward)",
                inner.parts.iter().map(|p| p.stage.index).collect::<Vec<_>>(),
                inner.num_stages
            ))
            .into()),
        }
    }
}

impl<I: Module, B: Module + Clone + 'static, O: Module> StagedModel for Parts<I, B, O> {
    fn stage_forward(&self, stage: usize, input: &Tensor) -> Result<Tensor> {
        let part =
            self.parts.iter().find(|p| p.stage.index == stage).ok_or_else(|| {
                AccelError::InvalidArgument(format!("this rank does not hold pipeline stage {stage}"))
            })?;
        Ok(self.run(part, input)?)
    }
}

impl<I: Module, B: Module + Clone + 'static, O: Module> StagedModel for Staged<I, B, O> {
    fn stage_forward(&self, stage: usize, input: &Tensor) -> Result<Tensor> {
        self.inner.stage_forward(stage, input)
    }
}
