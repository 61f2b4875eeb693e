//! [`VarBuilder`]: candle's builder vocabulary over the seeded, tensor-parallel [`ParamBuilder`] and a
//! [`ParallelPlan`].

use crate::plan::{generalize, ParallelPlan, ParallelStyle};
use crate::tensor_parallel::{divisors, ParamBuilder, ParamInit, ParamSource, TensorParallel};
use crate::{lock, AccelError, Result};
use candle_core::{DType, Device, Shape, Tensor, TensorId};
use candle_nn::VarMap;
use std::sync::{Arc, Mutex, RwLock};

/// A parameter as an `accel::nn` layer holds it: its tensor — or, once `prepare_model` took a FULL_SHARD model's
/// weights into dp_shard chunks, only its name, the prepared model gathering it at each use. The layer asks at
/// every forward ([`Param::get`]), so its code is the same at every layout.
#[derive(Clone)]
pub(crate) struct Param {
    name: Arc<str>,
    held: Arc<RwLock<Option<Tensor>>>,
    book: Arc<PlanBook>,
}

impl Param {
    /// The record of the builder that made the parameter.
    pub(crate) fn book(&self) -> &Arc<PlanBook> {
        &self.book
    }

    /// The parameter now: the tensor held, or (FULL_SHARD) its chunks gathered — a copy for this use, whose
    /// gradient the backward pass reduce-scatters into this rank's chunk.
    pub(crate) fn get(&self) -> Result<Tensor> {
        if let Some(t) = self.held.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
            return Ok(t.clone());
        }
        match self.book.source() {
            Some(source) => source.get(&self.name),
            None => Err(AccelError::Usage(format!("parameter `{}` is neither held nor gathered", self.name))),
        }
    }
}

/// What kind of layer asked the plan for its style (the errors and the plan report name it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// A linear layer (`linear`, `linear_no_bias`, `linear_b`).
    Linear,
    /// A token embedding (`embedding`).
    Embedding,
    /// A layer norm or RMS norm.
    Norm,
}

impl LayerKind {
    fn name(self) -> &'static str {
        match self {
            LayerKind::Linear => "linear",
            LayerKind::Embedding => "embedding",
            LayerKind::Norm => "norm",
        }
    }
}

/// One layer the builder made, as the plan laid it out.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedLayer {
    /// Module path (`layers.0.self_attn.q_proj`).
    pub path: String,
    /// What the layer is.
    pub kind: LayerKind,
    /// The style it got.
    pub style: ParallelStyle,
    /// The pattern that gave the style; `None`: no pattern matched (replicated by default).
    pub pattern: Option<String>,
    /// Its parameters: full name, single-process shape, this rank's shape.
    pub params: Vec<(String, Vec<usize>, Vec<usize>)>,
}

/// The plan one model is built under, and what the builder made with it (shared by every `pp` of one builder).
pub(crate) struct PlanBook {
    plan: ParallelPlan,
    tp_size: usize,
    /// Per rule: whether it matched a layer.
    used: Mutex<Vec<bool>>,
    layers: Mutex<Vec<PlannedLayer>>,
    /// Every parameter this builder created or handed out.
    params: Mutex<Vec<TensorId>>,
    /// The parameters the layers hold (their cells are emptied when FULL_SHARD gathers them instead).
    cells: Mutex<Vec<Arc<RwLock<Option<Tensor>>>>>,
    /// Parameters handed out as bare tensors by `get` / `get_with_hints` (a layer of the user's keeps them).
    bare: Mutex<Vec<String>>,
    /// The prefixes of the units (`accel::nn::unit`), in build order: FULL_SHARD gathers and frees each as a whole
    /// and prefetches the next.
    units: Mutex<Vec<String>>,
    /// Under FULL_SHARD, the prepared model the layers gather their parameters from.
    source: RwLock<Option<Arc<dyn ParamSource>>>,
    /// Which pipeline stages of a model of `n` blocks this rank holds (the Accelerator's, for a builder it made).
    stages: std::sync::OnceLock<StageOracle>,
    /// The blocks per stage the program lists for the oracle (`VarBuilder::with_layers_per_stage`).
    layers_per_stage: Mutex<Option<Vec<usize>>>,
    /// Stages given outright (`VarBuilder::with_stages`), which the oracle is then not asked for.
    fixed_stages: Mutex<Option<Vec<crate::pipeline::Stage>>>,
    /// The model `accel::nn::staged` built here, as the pipeline runs it (weak: the model holds this record).
    staged: Mutex<Option<std::sync::Weak<dyn crate::pipeline::StagedModel + Send + Sync>>>,
    /// The last input a column-wise layer copied to the tp group, and the copy (see [`PlanBook::copy_for_columns`]).
    column_input: Mutex<Option<(TensorId, Tensor)>>,
    /// What a block keeps for its backward, as the model declared it ([`VarBuilder::declare_activations`]).
    activations: Mutex<Option<super::ActivationSpec>>,
}

/// A staged model shared between its owner and the builder's record.
pub type SharedStagedModel = Arc<dyn crate::pipeline::StagedModel + Send + Sync>;

/// The stages of a model of `n` blocks this rank holds, the blocks split as listed (or evenly).
pub(crate) type StageOracle = Box<dyn Fn(usize, Option<&[usize]>) -> Result<Vec<crate::pipeline::Stage>> + Send + Sync>;

impl PlanBook {
    /// Whether any of `ids` was made through this book.
    pub(crate) fn made_any(&self, ids: &[TensorId]) -> bool {
        let made = lock(&self.params);
        ids.iter().any(|id| made.contains(id))
    }

    /// Marks as used the rules `used` says another pipeline stage's layers matched.
    pub(crate) fn merge_used(&self, used: &[bool]) {
        for (mine, theirs) in lock(&self.used).iter_mut().zip(used) {
            *mine |= *theirs;
        }
    }

    /// Per rule: whether a layer made here matched it.
    pub(crate) fn used(&self) -> Vec<bool> {
        lock(&self.used).clone()
    }

    /// Errors: a rule that matched no layer, named with the layer paths the model has (a typo in a pattern would
    /// otherwise leave its layers replicated without a word).
    pub(crate) fn check_all_rules_used(&self) -> Result<()> {
        let used = lock(&self.used);
        let unused: Vec<String> =
            (0..used.len()).filter(|&i| !used[i]).map(|i| format!("`{}`", self.plan.pattern(i))).collect();
        if unused.is_empty() {
            return Ok(());
        }
        let mut paths: Vec<String> = Vec::new();
        for path in lock(&self.layers).iter().map(|l| generalize(&l.path)) {
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
        let shown = paths.iter().take(12).cloned().collect::<Vec<_>>().join(", ");
        Err(AccelError::InvalidArgument(format!(
            "parallel plan: pattern(s) {} match no layer of the model; its layers are: {}{} (a pattern is the whole \
             module path from the model's root, `*` standing for one segment; a parameter taken with get / \
             get_with_hints is no layer and takes no style)",
            unused.join(", "),
            if shown.is_empty() { "none".to_string() } else { shown },
            if paths.len() > 12 { ", …" } else { "" }
        )))
    }

    /// The layers made so far, in build order.
    pub(crate) fn layers(&self) -> Vec<PlannedLayer> {
        lock(&self.layers).clone()
    }

    /// The prepared FULL_SHARD model the layers gather from, once set.
    pub(crate) fn source(&self) -> Option<Arc<dyn ParamSource>> {
        self.source.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// FULL_SHARD: from now on the layers gather every parameter from `source` (the prepared model) at each use,
    /// and the whole tensors they held are dropped (the chunks are all a rank keeps). Errors: parameters handed
    /// out bare by `get` / `get_with_hints`, which a layer would keep whole and stale.
    pub(crate) fn gather_from(&self, source: Arc<dyn ParamSource>) -> Result<()> {
        let bare = lock(&self.bare);
        if !bare.is_empty() {
            return Err(AccelError::Usage(format!(
                "prepare_model: under FULL_SHARD parameter(s) {bare:?} were taken with VarBuilder::get / \
                 get_with_hints, which hands out a tensor the model keeps whole (stale after the first optimizer \
                 step); build them as accel::nn layers, or use SHARD_GRAD_OP"
            )));
        }
        *self.source.write().unwrap_or_else(|e| e.into_inner()) = Some(source);
        for cell in lock(&self.cells).iter() {
            *cell.write().unwrap_or_else(|e| e.into_inner()) = None;
        }
        Ok(())
    }

    /// Registers a unit at `prefix`; returns its index.
    pub(crate) fn add_unit(&self, prefix: String) -> usize {
        let mut units = lock(&self.units);
        units.push(prefix);
        units.len() - 1
    }

    /// Megatron's *f* (`copy_to_group`: the identity forward, an all-reduce of the gradient backward) for a
    /// column-wise layer's input `x`, shared by the column-wise layers that read the same `x` one after another —
    /// attention's q, k and v, an MLP's gate and up: their input gradients are summed before the one all-reduce,
    /// as a fused QKV layer's would be (Megatron-LM's single *f* per block half), instead of one all-reduce each.
    /// `keep`: remember the copy for the next layer (a column-wise layer); the copy is forgotten when a layer of
    /// another kind runs ([`PlanBook::forget_column_input`]), so it never outlives the block that made it.
    /// Sharing is by tensor identity: a hit is always the same tensor.
    pub(crate) fn copy_for_columns(&self, x: &Tensor, tp: &TensorParallel, keep: bool) -> Result<Tensor> {
        if tp.size() == 1 {
            return Ok(x.clone());
        }
        let mut last = lock(&self.column_input);
        if let Some((id, copied)) = last.as_ref() {
            if *id == x.id() {
                return Ok(copied.clone());
            }
        }
        let copied = ddp_core::functional::copy_to_group(x, tp.group())?;
        *last = keep.then(|| (x.id(), copied.clone()));
        Ok(copied)
    }

    /// Forgets the column-wise layers' shared input copy (a layer of another kind ran).
    pub(crate) fn forget_column_input(&self) {
        *lock(&self.column_input) = None;
    }

    /// Records the staged model built on this book (the last one, if a program builds several).
    pub(crate) fn set_staged(&self, model: std::sync::Weak<dyn crate::pipeline::StagedModel + Send + Sync>) {
        *lock(&self.staged) = Some(model);
    }

    /// What the model declared a block keeps for its backward, if it did.
    pub(crate) fn activations(&self) -> Option<super::ActivationSpec> {
        *lock(&self.activations)
    }

    /// The units' prefixes, in build order.
    pub(crate) fn units(&self) -> Vec<String> {
        lock(&self.units).clone()
    }

    /// The prefix of unit `index`, if there is one.
    pub(crate) fn unit(&self, index: usize) -> Option<String> {
        lock(&self.units).get(index).cloned()
    }
}

/// Builds a model's parameters the way candle's `VarBuilder` does — `pp`, `get`, `get_with_hints` and the layer
/// constructors of [`crate::nn`] (`linear`, `embedding`, `layer_norm`, `rms_norm`, …) — so that porting a candle
/// model is changing the builder's type, not its calls. Underneath:
///
/// - every parameter is drawn from the run's seed per name, on the *full* (single-process) shape, with candle's
///   distribution for that layer (Kaiming for a linear weight, …): the same seed gives the same weights at every
///   layout and in every run ([`ParamBuilder`]);
/// - each layer's tensor-parallel style comes from the [`ParallelPlan`], looked up by the layer's module path
///   (this builder's prefix): column-wise, row-wise, vocab-parallel or replicated. The model's code never names a
///   style.
///
/// Made by [`crate::Accelerator::builder`] (the config's seed, compute dtype, device and tp group), or by
/// [`VarBuilder::new`] without an Accelerator. Cheap to clone; clones and `pp`s share the plan's record.
#[derive(Clone)]
pub struct VarBuilder {
    pb: ParamBuilder,
    book: Arc<PlanBook>,
}

impl VarBuilder {
    /// A builder creating parameters in `varmap` (`dtype` on `device`, drawn from `seed`), laid out over `tp` by
    /// `plan`.
    pub fn new(
        varmap: &VarMap,
        tp: &TensorParallel,
        seed: u64,
        dtype: DType,
        device: &Device,
        plan: ParallelPlan,
    ) -> Self {
        VarBuilder::from_param_builder(ParamBuilder::new(varmap, tp, seed, dtype, device), plan)
    }

    /// A builder over `pb` (its VarMap, seed, dtype, device, tp group and prefix) laid out by `plan`.
    pub fn from_param_builder(pb: ParamBuilder, plan: ParallelPlan) -> Self {
        let used = Mutex::new(vec![false; plan.rules().count()]);
        let tp_size = pb.tp().size();
        let book = PlanBook {
            plan,
            tp_size,
            used,
            layers: Mutex::default(),
            params: Mutex::default(),
            cells: Mutex::default(),
            bare: Mutex::default(),
            units: Mutex::default(),
            source: RwLock::default(),
            stages: std::sync::OnceLock::new(),
            layers_per_stage: Mutex::default(),
            fixed_stages: Mutex::default(),
            staged: Mutex::default(),
            column_input: Mutex::default(),
            activations: Mutex::default(),
        };
        VarBuilder { pb, book: Arc::new(book) }
    }

    pub(crate) fn book(&self) -> &Arc<PlanBook> {
        &self.book
    }

    /// The same builder creating every parameter from `weights` — a checkpoint's full tensors by name, this rank
    /// keeping its slice — instead of drawing it from the seed (candle's `VarBuilder::from_mmaped_safetensors`).
    /// Under pipeline parallelism each rank reads only its stages' tensors. A parameter the weights lack fails the
    /// build, naming it (never a silent random start); so does a shape that differs from the layer's.
    pub fn with_weights(self, weights: Arc<dyn crate::tensor_parallel::InitialWeights>) -> Self {
        VarBuilder { pb: self.pb.with_weights(weights), book: self.book }
    }

    /// Where [`VarBuilder::stages`] asks (set once, by the Accelerator that made the builder).
    pub(crate) fn set_stages(&self, oracle: StageOracle) {
        let _ = self.book.stages.set(oracle);
    }

    /// The pipeline stages of a model of `n_blocks` blocks this rank holds: those given by
    /// [`VarBuilder::with_stages`]; else the Accelerator's (`Accelerator::pipeline_stages`: the config's pp size and
    /// schedule, the blocks split as [`VarBuilder::with_layers_per_stage`] lists them, or as the automatic layout
    /// split them, or evenly) for a builder it made; else one stage holding every block. Errors: more stages than
    /// blocks, a list that does not fit.
    pub fn stages(&self, n_blocks: usize) -> candle_core::Result<Vec<crate::pipeline::Stage>> {
        if let Some(stages) = lock(&self.book.fixed_stages).clone() {
            return Ok(stages);
        }
        let listed = lock(&self.book.layers_per_stage).clone();
        match self.book.stages.get() {
            Some(oracle) => Ok(oracle(n_blocks, listed.as_deref())?),
            None => {
                let ranges = crate::pipeline::split_layers(n_blocks, 1, listed.as_deref())?;
                Ok(vec![crate::pipeline::Stage { index: 0, num_stages: 1, layers: ranges[0].clone() }])
            }
        }
    }

    /// The same builder, asking for the blocks split over the pipeline stages as `layers_per_stage` lists them
    /// (torchtitan's `pipeline_parallel_layers_per_stage`, one count per stage, 0 allowed) instead of evenly.
    pub fn with_layers_per_stage(self, layers_per_stage: Vec<usize>) -> Self {
        *lock(&self.book.layers_per_stage) = Some(layers_per_stage);
        self
    }

    /// The same builder, building the parts of `stages` (a pipeline runtime of the program's own, without the
    /// Accelerator's schedule).
    pub fn with_stages(self, stages: Vec<crate::pipeline::Stage>) -> Self {
        *lock(&self.book.fixed_stages) = Some(stages);
        self
    }

    /// The model [`crate::nn::staged`] built on this builder (or on a `pp` or clone of it), as the pipeline
    /// schedules run it ([`crate::Accelerator::pipeline_backward`]); `None` before, or for a model not declared
    /// as stages, or once the model is dropped. What lets a caller that made the builder — the Trainer — drive the
    /// model it did not write.
    pub fn staged_model(&self) -> Option<SharedStagedModel> {
        lock(&self.book.staged).as_ref().and_then(std::sync::Weak::upgrade)
    }

    /// A builder whose names get `s.` in front (candle's `VarBuilder::pp`).
    pub fn pp<S: ToString>(&self, s: S) -> Self {
        VarBuilder { pb: self.pb.pp(s), book: self.book.clone() }
    }

    /// The same as [`VarBuilder::pp`] (candle's other name for it).
    pub fn push_prefix<S: ToString>(&self, s: S) -> Self {
        self.pp(s)
    }

    /// The dotted module path of this builder (`layers.3.self_attn`).
    pub fn prefix(&self) -> String {
        self.pb.prefix()
    }

    /// The parameters' dtype.
    pub fn dtype(&self) -> DType {
        self.pb.dtype()
    }

    /// The parameters' device.
    pub fn device(&self) -> &Device {
        self.pb.device()
    }

    /// The tensor-parallel group the plan splits layers over.
    pub fn tp(&self) -> &TensorParallel {
        self.pb.tp()
    }

    /// The seeded, tensor-parallel builder underneath (parameters with an explicit layout: `sharded`, …).
    pub fn param_builder(&self) -> &ParamBuilder {
        &self.pb
    }

    /// The plan the layers are laid out by.
    pub fn plan(&self) -> &ParallelPlan {
        &self.book.plan
    }

    /// Whether parameter `name` exists under this prefix.
    pub fn contains_tensor(&self, name: &str) -> bool {
        self.pb.existing(name).is_some()
    }

    /// Parameter `name` of shape `s`, zeros when new (candle's `get`). See [`VarBuilder::get_with_hints`].
    pub fn get<S: Into<Shape>>(&self, s: S, name: &str) -> candle_core::Result<Tensor> {
        self.get_with_hints(s, name, candle_nn::Init::Const(0.))
    }

    /// Parameter `name` of shape `s`: the existing one (shape-checked) or a new one drawn from `init`, seeded by
    /// name (candle's `get_with_hints`). Held whole by every tp rank: a parameter asked for by name has no
    /// parallel style (use the layer constructors, or [`VarBuilder::param_builder`]'s `sharded`). Errors: an
    /// existing parameter of another shape.
    pub fn get_with_hints<S: Into<Shape>>(
        &self,
        s: S,
        name: &str,
        init: candle_nn::Init,
    ) -> candle_core::Result<Tensor> {
        let shape: Shape = s.into();
        if let Some(t) = self.pb.existing(name) {
            if t.dims() != shape.dims() {
                return Err(AccelError::InvalidArgument(format!(
                    "parameter `{}` exists with shape {:?}; it is asked for with shape {:?}",
                    self.pb.full_name(name),
                    t.dims(),
                    shape.dims()
                ))
                .into());
            }
            self.made(&t);
            lock(&self.book.bare).push(self.pb.full_name(name));
            return Ok(t);
        }
        let t = self.pb.replicated(name, shape.clone(), ParamInit::from_candle(init, &shape))?;
        self.made(&t);
        lock(&self.book.bare).push(self.pb.full_name(name));
        Ok(t)
    }

    /// Declares what one block of the model keeps for its backward pass, for the automatic layout's memory model
    /// ([`crate::auto_layout::ModelSpec::of_model`]; without a declaration it counts a GPT block's,
    /// [`super::ActivationSpec::accel`]). Changes nothing in the model; only a description reads it.
    pub fn declare_activations(&self, activations: super::ActivationSpec) {
        *lock(&self.book.activations) = Some(activations);
    }

    /// The number of attention heads (or key/value heads) this tp rank computes, of `n_heads` in the model: a
    /// column-wise projection splits whole heads, so `n_heads` must divide by tp. Attention code asks this (or
    /// reads the projections' output widths) instead of the model's config. Errors: a tp size that does not divide
    /// `n_heads`, with the sizes that do.
    pub fn local_heads(&self, n_heads: usize) -> candle_core::Result<usize> {
        if let Some(record) = self.pb.shape_record() {
            lock(&record.heads).push((self.prefix(), n_heads));
        }
        let tp = self.tp().size();
        if n_heads == 0 || !n_heads.is_multiple_of(tp) {
            return Err(AccelError::InvalidArgument(format!(
                "tensor parallelism splits the {n_heads} attention heads under `{}` into whole heads per rank, but \
                 tp size {tp} does not divide {n_heads}; tp sizes that fit: {}",
                self.prefix(),
                divisors(n_heads)
            ))
            .into());
        }
        Ok(n_heads / tp)
    }

    /// The style of the layer at this builder's path, checked against what the layer is, and the rule that gave
    /// it. A layer no rule matches is replicated, except a linear layer at tp > 1 (an error naming the pattern to
    /// add). Errors: a style that does not fit the layer; two rules disagreeing; a linear left out at tp > 1.
    pub(crate) fn style_for(&self, kind: LayerKind, weight_shape: &[usize]) -> Result<(ParallelStyle, Option<usize>)> {
        let path = self.prefix();
        let found = self.book.plan.style_of(&path)?;
        if let Some((rule, _)) = found {
            lock(&self.book.used)[rule] = true;
        }
        let style = match (found, kind) {
            (Some((_, style)), _) => style,
            (None, LayerKind::Linear) if self.book.tp_size > 1 => {
                // A typo in a pattern shows here first, before prepare_model could name the unmatched rule.
                let unmatched: Vec<String> = lock(&self.book.used)
                    .iter()
                    .enumerate()
                    .filter(|(_, used)| !**used)
                    .map(|(i, _)| format!("`{}`", self.book.plan.pattern(i)))
                    .collect();
                let typo = match unmatched.is_empty() {
                    true => String::new(),
                    false => format!(" (the plan's patterns that matched no layer so far: {})", unmatched.join(", ")),
                };
                return Err(AccelError::InvalidArgument(format!(
                    "parallel plan: linear layer `{path}` (weight {weight_shape:?}) has no style in the plan at tp \
                     size {}; add a rule for it, e.g. `{}: colwise` (or `rowwise` after a column-wise layer, or \
                     `replicate` to keep it whole on every rank){typo}",
                    self.book.tp_size,
                    generalize(&path)
                )));
            }
            (None, _) => ParallelStyle::Replicate,
        };
        let fits = match kind {
            LayerKind::Linear => true,
            LayerKind::Embedding => {
                matches!(style, ParallelStyle::VocabParallel | ParallelStyle::Rowwise | ParallelStyle::Replicate)
            }
            LayerKind::Norm => style == ParallelStyle::Replicate,
        };
        if !fits {
            let what = match kind {
                LayerKind::Embedding => {
                    "an embedding is split by vocabulary rows: give it `vocab_parallel` (or \
                                         `replicate`)"
                }
                _ => "a norm is held whole by every tp rank: give it `replicate`, or leave it out of the plan",
            };
            let pattern = found.map(|(i, _)| self.book.plan.pattern(i).to_string()).unwrap_or_default();
            return Err(AccelError::InvalidArgument(format!(
                "parallel plan: {} `{path}` (weight {weight_shape:?}) gets `{style}` from pattern `{pattern}`, which \
                 does not fit it; {what}",
                kind.name()
            )));
        }
        Ok((style, found.map(|(i, _)| i)))
    }

    /// Records a layer the plan laid out, with its parameters (`(name, tensor, full shape)`), and returns them
    /// as the layer holds them.
    pub(crate) fn record(
        &self,
        kind: LayerKind,
        style: ParallelStyle,
        rule: Option<usize>,
        params: &[(&str, &Tensor, Vec<usize>)],
    ) -> Vec<Param> {
        for (_, t, _) in params {
            self.made(t);
        }
        let held: Vec<Param> = params
            .iter()
            .map(|(n, t, _)| {
                let cell = Arc::new(RwLock::new(Some((*t).clone())));
                lock(&self.book.cells).push(cell.clone());
                Param { name: self.pb.full_name(n).into(), held: cell, book: self.book.clone() }
            })
            .collect();
        let layer = PlannedLayer {
            path: self.prefix(),
            kind,
            style,
            pattern: rule.map(|i| self.book.plan.pattern(i).to_string()),
            params: params.iter().map(|(n, t, full)| (self.pb.full_name(n), full.clone(), t.dims().to_vec())).collect(),
        };
        lock(&self.book.layers).push(layer);
        held
    }

    fn made(&self, t: &Tensor) {
        lock(&self.book.params).push(t.id());
    }

    /// Errors: a rule of the plan that matched no layer of the model (named, with the layers the model has).
    /// [`crate::Accelerator::prepare_model`] checks this itself for a builder made by
    /// [`crate::Accelerator::builder`].
    pub fn check_plan(&self) -> candle_core::Result<()> {
        Ok(self.book.check_all_rules_used()?)
    }

    /// Which parameter got which style, one line per parameter (`name [full shape] style (pattern) → [this
    /// rank's shape]`): what `ACCEL_PRINT_PLAN=1` prints when the model is prepared.
    pub fn plan_report(&self) -> String {
        plan_report(&self.book.layers(), self.book.tp_size)
    }
}

/// The lines of [`VarBuilder::plan_report`].
pub(crate) fn plan_report(layers: &[PlannedLayer], tp_size: usize) -> String {
    let mut out = format!("parallel plan at tp size {tp_size} ({} layers):\n", layers.len());
    for layer in layers {
        let pattern = match &layer.pattern {
            Some(p) => format!("from `{p}`"),
            None => "by default".to_string(),
        };
        for (name, full, local) in &layer.params {
            out.push_str(&format!("  {name} {full:?} {} {pattern} → {local:?} per rank\n", layer.style));
        }
    }
    out
}
