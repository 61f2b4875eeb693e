//! [`describe`]: a model's parameters as the builder would make them — names, shapes, the plan's splits, which
//! part of the model each belongs to — without allocating or drawing any of them (PyTorch builds on the `meta`
//! device for the same purpose). What the automatic layout reads a model's shape from
//! ([`crate::auto_layout::ModelSpec::of_model`]), before the layout it chooses exists.

use super::builder::{LayerKind, PlannedLayer, VarBuilder};
use crate::pipeline::Stage;
use crate::plan::ParallelPlan;
use crate::tensor_parallel::{ParamBuilder, ShapeRecord, TensorParallel};
use crate::{lock, AccelError, Result};
use candle_core::{DType, Device};
use candle_nn::VarMap;
use ddp_core::ProcessGroup;
use std::sync::Arc;

/// Where a parameter sits in a model declared with [`super::staged`] (a model that is not is one block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelPart {
    /// The input part (the first pipeline stage's: embeddings).
    Input,
    /// Block `i` (a [`super::Unit`]).
    Block(usize),
    /// The output part (the last pipeline stage's: final norm, head).
    Output,
}

/// One parameter of a described model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapedParam {
    /// Full dotted name (`model.layers.0.mlp.gate_proj.weight`).
    pub name: String,
    /// The single-process shape.
    pub shape: Vec<usize>,
    /// The dim tensor parallelism splits under the plan, and whether a size tp does not divide is padded
    /// (a vocabulary) rather than refused; `None`: every tp rank holds it whole.
    pub split: Option<(usize, bool)>,
    /// Where it sits.
    pub part: ModelPart,
    /// A weight that multiplies the activations (a linear layer's, or the last stage's copy of a tied embedding,
    /// which the head multiplies by): 2 FLOPs per element per token forward.
    pub matmul: bool,
    /// A copy of a parameter an earlier part holds — a tied embedding, which a last pipeline stage apart from the
    /// first builds again (the model's single-process parameters leave it out).
    pub copy: bool,
}

impl ShapedParam {
    /// Elements (single process).
    pub fn elem_count(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// A model as [`describe`] saw it build: its parameters in build order, its layers with the plan's styles, its
/// blocks, and the head counts its attention splits.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    /// Every parameter the model asked for, in build order (copies of tied weights included, marked).
    pub params: Vec<ShapedParam>,
    /// The layers the builder made, with the style the plan gives each (at tp 1; the style is what the plan says).
    pub layers: Vec<PlannedLayer>,
    /// The blocks' module paths (`model.layers.3`) when the model is declared with [`super::staged`]; `None`: the
    /// model is one block and runs on one pipeline stage.
    pub blocks: Option<Vec<String>>,
    /// The head counts the attention split with [`VarBuilder::local_heads`] (query heads, key/value heads), with
    /// the module path that asked: tp must divide each.
    pub heads: Vec<(String, usize)>,
    /// Whether the model drops out (a [`super::dropout`] layer with a probability above 0): its masks are kept
    /// for the backward.
    pub dropout: bool,
    /// What one block keeps for its backward, as the model declared it ([`VarBuilder::declare_activations`]).
    pub activations: Option<super::ActivationSpec>,
}

impl ModelShape {
    /// The single-process parameter count (copies of tied weights not counted again).
    pub fn num_params(&self) -> u64 {
        self.params.iter().filter(|p| !p.copy).map(ShapedParam::elem_count).sum()
    }

    /// The layers of `part` (by their first parameter's part).
    pub fn layers_in(&self, part: ModelPart) -> impl Iterator<Item = &PlannedLayer> {
        self.layers.iter().filter(move |l| {
            l.params.first().and_then(|(name, ..)| self.params.iter().find(|p| &p.name == name)).map(|p| p.part)
                == Some(part)
        })
    }
}

/// Describes the model `build` makes on a builder laid out by `plan`, without allocating or drawing a parameter:
/// every parameter is recorded and handed to the model as a zero scalar broadcast to its shape. A model declared
/// with [`super::staged`] is built as two pipeline stages — all blocks on the first, the output part alone on the
/// second — so that a tied head's copy of the embedding shows (as [`ShapedParam::copy`]).
///
/// `build` must only construct the model (its forward is never run; a constructor that computes on its weights
/// computes on zeros). Errors: the model's own while it builds, and the plan's (a rule that matches no layer).
pub fn describe<M, E: Into<AccelError>>(
    plan: ParallelPlan,
    build: impl FnOnce(VarBuilder) -> std::result::Result<M, E>,
) -> Result<ModelShape> {
    let record = Arc::new(ShapeRecord::default());
    let tp = TensorParallel::new(ProcessGroup::single_process()?);
    let pb = ParamBuilder::new(&VarMap::new(), &tp, 0, DType::F32, &Device::Cpu).describing(record.clone());
    let vb = VarBuilder::from_param_builder(pb, plan);
    vb.set_stages(Box::new(|n, _| {
        Ok(vec![Stage { index: 0, num_stages: 2, layers: 0..n }, Stage { index: 1, num_stages: 2, layers: n..n }])
    }));
    let model = build(vb.clone()).map_err(Into::into)?;
    vb.check_plan()?;
    let staged = vb.staged_model().is_some();
    drop(model);
    let layers = vb.book().layers();
    let units = vb.book().units();
    let heads = lock(&record.heads).clone();
    let dropout = record.dropout.load(std::sync::atomic::Ordering::Relaxed);
    let activations = vb.book().activations();
    let recorded = lock(&record.params).clone();

    let block_of = |name: &str| units.iter().position(|u| name.starts_with(&format!("{u}.")));
    let in_block: Vec<Option<usize>> = recorded.iter().map(|p| block_of(&p.name)).collect();
    let first_block = in_block.iter().position(Option::is_some);
    let mut seen = std::collections::HashSet::new();
    let params = recorded
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let copy = !seen.insert(p.name.clone());
            let part = match (staged, in_block[i]) {
                (false, _) => ModelPart::Block(0),
                (true, Some(b)) => ModelPart::Block(b),
                (true, None) if copy || first_block.is_some_and(|f| i > f) => ModelPart::Output,
                (true, None) => ModelPart::Input,
            };
            let layer = layers.iter().find(|l| l.params.first().is_some_and(|(name, ..)| *name == p.name));
            let matmul = layer.is_some_and(|l| match l.kind {
                LayerKind::Linear => true,
                LayerKind::Embedding => part == ModelPart::Output,
                LayerKind::Norm => false,
            });
            ShapedParam { name: p.name, shape: p.shape, split: p.split, part, matmul, copy }
        })
        .collect();
    Ok(ModelShape { params, layers, blocks: staged.then_some(units), heads, dropout, activations })
}
