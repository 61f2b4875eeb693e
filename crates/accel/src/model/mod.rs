//! [`PreparedModel`]: a model's parameters as the Accelerator manages them — the compute-dtype `Var`s the model
//! reads, their fp32 master copies the optimizer updates (the same `Var`s in fp32), how each is laid out over the
//! tensor-parallel group ([`ParamLayout`]), and the parameter groups whose gradients one [`GradientStrategy`]
//! reduces, norms and checks (`strategy.rs`). Its gradients are not here: the Accelerator's step owner holds them
//! (see `crate::step`), and asks the groups' strategies what to do with them.
//!
//! This module sits below the step owner and the Accelerator: it imports neither.
//!
//! Under tensor parallelism a rank holds a shard of some parameters: their gradients are averaged over the
//! data-parallel group only (tp peers hold different pieces), their squared norms summed over the tp group, and
//! checkpoints hold the full tensors under the single-process names (gathered on save, sliced on load), so any
//! layout reads any other's `model.safetensors`.

mod registration;
mod sharded;
mod stages;
mod strategy;

#[cfg(test)]
mod tests;

use sharded::{FlatChunk, ShardedDataParallel};
use stages::{full_shape, Gather, Stages};
#[cfg(test)]
use strategy::AddSegment;
pub(crate) use strategy::{GradientStrategy, PipelineStage, ReplicatedDataParallel, TiedWeights};

use crate::state::StateDict;
use crate::tensor_parallel::{ParamLayout, TensorParallel};
use crate::{AccelError, Result};
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use ddp_core::{DeviceMesh, DistributedDataParallel, MeshDim, ProcessGroup};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Handle to a prepared model. Cheap to clone; clones share parameters.
#[derive(Clone)]
pub struct PreparedModel {
    inner: Arc<ModelInner>,
}

struct ModelInner {
    /// Registration index with the Accelerator (where its gradient slots live).
    index: usize,
    /// `VarMap` names, sorted (the same order on every rank).
    names: Vec<String>,
    /// The model's `Var`s, in the compute dtype.
    params: Vec<Var>,
    /// fp32 master weights; the very same `Var`s as `params` when the compute dtype is F32.
    masters: Vec<Var>,
    /// Whether `masters` are separate copies (bf16 / fp16 compute).
    has_masters: bool,
    /// What the optimizer steps: the very `masters`, or under sharded data parallelism this rank's chunks of
    /// them (fp32, 1-D), with how each parameter is cut and the dp_shard group.
    optimized: Vec<Var>,
    sharding: Option<(ProcessGroup, Vec<FlatChunk>)>,
    /// Each parameter's layout over `tp` (in `names` order).
    layouts: Vec<ParamLayout>,
    /// The tensor-parallel group the sharded parameters are split over.
    tp: TensorParallel,
    /// Parameter groups: every parameter is in exactly one, whose strategy handles its gradients.
    groups: Vec<ParamGroup>,
    /// Under pipeline parallelism: the pp group and every pp rank's parameters (names and single-process
    /// shapes, by pp rank), so a state dict can be gathered from and loaded into the stages.
    stages: Option<Stages>,
    find_unused_parameters: bool,
}

/// Some of a model's parameters and the one strategy their gradients take.
#[derive(Debug)]
pub(crate) struct ParamGroup {
    /// Indices into the model's parameters (`names` order), ascending.
    pub(crate) params: Vec<usize>,
    pub(crate) strategy: Box<dyn GradientStrategy>,
}

impl std::fmt::Debug for PreparedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedModel")
            .field("parameters", &self.inner.names.len())
            .field("master_weights", &self.inner.has_masters)
            .finish()
    }
}

impl PreparedModel {
    /// Sorts `varmap`'s variables by name, checks their device and their tensor-parallel registration, makes
    /// fp32 masters under bf16/fp16 and puts every parameter in one group whose strategy is DDP over the mesh's
    /// data-parallel group (names and shapes checked across its ranks, its rank 0's values broadcast), with norms
    /// over the mesh's model-parallel group. Layouts come from `tp`'s registry (parameters built by a
    /// [`crate::ParamBuilder`]; see `registration.rs` for the others). `index` is the slot the step owner keeps
    /// this model's gradients in.
    pub(crate) fn new(
        index: usize,
        mesh: &DeviceMesh,
        tp: &TensorParallel,
        device: &candle_core::Device,
        ddp: &ddp_core::DdpOptions,
        varmap: &VarMap,
    ) -> Result<Self> {
        let mut named: Vec<(String, Var)> =
            crate::lock(varmap.data()).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if named.is_empty() {
            return Err(AccelError::Usage(
                "prepare_model: the VarMap has no variables; build the model with accelerator.var_builder(&varmap) \
                 before preparing it"
                    .into(),
            ));
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, v) in &named {
            if !v.device().same_device(device) {
                return Err(AccelError::InvalidArgument(format!(
                    "prepare_model: parameter {name:?} is on {:?} but the Accelerator uses {device:?}; build the \
                     model with accelerator.var_builder(&varmap)",
                    v.device(),
                )));
            }
        }
        let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
        let params: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        let has_masters = params.iter().any(|v| v.dtype() != DType::F32);
        let masters: Vec<Var> = if has_masters {
            params
                .iter()
                .map(|v| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?))
                .collect::<candle_core::Result<_>>()?
        } else {
            params.clone()
        };
        let layouts = registration::layouts(tp, &names, &params)?;
        // One group: every parameter — replicated over tp or a tp shard — is averaged over its data-parallel
        // replicas, which hold the same piece (Megatron-LM: a shard is never reduced with its tp peers; the
        // replicated ones have equal gradients on every tp rank already). Gradients are reduced in fp32.
        let replicated = DistributedDataParallel::from_named_vars(
            mesh.dp(),
            names.iter().cloned().zip(masters.iter().cloned()).collect(),
            ddp.clone(),
        )?;
        let replicated = ReplicatedDataParallel::new(replicated, mesh.model_parallel().clone());
        // dp_shard > 1: ZeRO-1 (sharded.rs); the DDP above only checked the names and broadcast rank 0's values.
        let shard_group = mesh.group(MeshDim::DpShard).clone();
        if shard_group.world_size() > 1 && ddp.find_unused_parameters {
            // A chunk of an unused parameter would be stepped with a zero gradient (moments decaying, weight decay
            // applied) where DDP skips it: refuse rather than train something else.
            return Err(AccelError::Usage(
                "prepare_model: find_unused_parameters is not supported with sharded data parallelism \
                 (dp_shard_size > 1) yet: use every parameter in every step, or dp_shard_size 1"
                    .into(),
            ));
        }
        let sharding = (shard_group.world_size() > 1).then(|| {
            let chunks: Vec<FlatChunk> =
                masters.iter().map(|m| FlatChunk::of(m.elem_count(), shard_group.world_size())).collect();
            (shard_group.clone(), chunks)
        });
        let optimized: Vec<Var> = match &sharding {
            Some((g, chunks)) => masters
                .iter()
                .zip(chunks)
                .map(|(m, c)| Ok(Var::from_tensor(&c.slice(m.as_tensor(), g.rank())?)?))
                .collect::<Result<_>>()?,
            None => masters.clone(),
        };
        // Under pp every stage's names and shapes are exchanged once (state dicts gather and load through them);
        // a stage holds its own parameters, so norms and overflow cover every stage, and a weight held by several
        // stages (tied) has its gradients summed over them (strategy.rs).
        let (strategy, stages): (Box<dyn GradientStrategy>, _) = if mesh.pp().world_size() > 1 {
            let mine: Vec<(String, Vec<usize>)> =
                names.iter().enumerate().map(|(i, n)| (n.clone(), full_shape(&masters[i], layouts[i]))).collect();
            let stages = Stages::exchange(mesh.pp(), mine)?;
            let tied = stages.tied_weights(&masters)?;
            (Box::new(PipelineStage::new(replicated, mesh.pp().clone(), tied)), Some(stages))
        } else if let Some((g, chunks)) = &sharding {
            let sharded = ShardedDataParallel::new(
                g.clone(),
                mesh.group(MeshDim::DpReplicate).clone(),
                mesh.model_parallel().clone(),
                chunks.clone(),
                device.clone(),
                ddp.comm_hook,
            );
            (Box::new(sharded), None)
        } else {
            (Box::new(replicated), None)
        };
        let model = PreparedModel {
            inner: Arc::new(ModelInner {
                index,
                stages,
                groups: vec![ParamGroup { params: (0..params.len()).collect(), strategy }],
                names,
                params,
                masters,
                has_masters,
                optimized,
                sharding,
                layouts,
                tp: tp.clone(),
                find_unused_parameters: ddp.find_unused_parameters,
            }),
        };
        // DDP broadcast rank 0's values into the masters: make the compute copies agree.
        model.copy_masters_to_params()?;
        Ok(model)
    }

    /// Parameter names (the `VarMap` names, sorted).
    pub fn names(&self) -> &[String] {
        &self.inner.names
    }

    /// The model's `Var`s in the compute dtype, in [`PreparedModel::names`] order.
    pub fn parameters(&self) -> &[Var] {
        &self.inner.params
    }

    /// The fp32 master weights the optimizer updates (the same `Var`s as [`PreparedModel::parameters`] in fp32).
    pub fn master_weights(&self) -> &[Var] {
        &self.inner.masters
    }

    /// What the optimizer steps, one per parameter: the fp32 masters, or under sharded data parallelism
    /// (`dp_shard_size > 1`) this rank's 1-D chunks of them (ZeRO-1; `sharded.rs`).
    pub(crate) fn optimizer_params(&self) -> &[Var] {
        &self.inner.optimized
    }

    /// Number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.inner.params.iter().map(|v| v.elem_count()).sum()
    }

    /// Each parameter's layout over the tensor-parallel group, in [`PreparedModel::names`] order.
    pub fn layouts(&self) -> &[ParamLayout] {
        &self.inner.layouts
    }

    /// The tensor-parallel group the sharded parameters are split over (one rank without tensor parallelism).
    pub fn tensor_parallel(&self) -> &TensorParallel {
        &self.inner.tp
    }

    /// The full fp32 weights by single-process name (what `model.safetensors` holds): tp shards are gathered and
    /// their padding dropped, and under pipeline parallelism every stage's tensors are collected, so the result
    /// is the same for every layout. Collective over the tp group when the model has sharded parameters and over
    /// the pp group under pipeline parallelism (every rank must call it); no communication otherwise.
    pub fn state_dict(&self) -> Result<BTreeMap<String, Tensor>> {
        self.gathered_state_dict(Gather::Everyone)
    }

    /// [`PreparedModel::state_dict`] for a checkpoint: under pipeline parallelism only pp rank 0 receives the
    /// other stages' tensors (the job's rank 0 writes the file; no other rank holds the whole model); the others
    /// return their own.
    pub(crate) fn checkpoint_state_dict(&self) -> Result<BTreeMap<String, Tensor>> {
        self.gathered_state_dict(Gather::FirstStage)
    }

    fn gathered_state_dict(&self, to: Gather) -> Result<BTreeMap<String, Tensor>> {
        let full = self.full_tensors(self.inner.masters.iter().map(|v| Some(v.as_tensor().clone())).collect())?;
        let mut dict: BTreeMap<String, Tensor> =
            self.inner.names.iter().cloned().zip(full.into_iter().flatten()).collect();
        if let Some(stages) = &self.inner.stages {
            dict = stages.gather(dict, self.inner.masters[0].device(), to)?;
        }
        Ok(dict)
    }

    /// Per-parameter tensors in this rank's layout → full tensors (see [`PreparedModel::state_dict`]); `None`
    /// entries stay `None` but must be `None` on every tp rank alike.
    pub(crate) fn full_tensors(&self, local: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        local
            .into_iter()
            .zip(&self.inner.layouts)
            .map(|(t, layout)| t.map(|t| layout.gather(&t, &self.inner.tp)).transpose())
            .collect()
    }

    /// Full tensors (single-process shapes) → this rank's pieces (the inverse of [`PreparedModel::full_tensors`]).
    pub(crate) fn local_tensors(&self, full: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        let (rank, size) = (self.inner.tp.rank(), self.inner.tp.size());
        full.into_iter()
            .zip(&self.inner.layouts)
            .map(|(t, layout)| t.map(|t| layout.slice(&t, rank, size)).transpose())
            .collect()
    }

    /// An optimizer state for this model's parameters with the buffers of tp shards gathered into full tensors
    /// (collective over the tp group when the model has sharded parameters) and, under pipeline parallelism, every
    /// stage's renumbered to the whole model's parameters on pp rank 0 (collective over pp; the others return
    /// their own, renumbered): what a checkpoint holds.
    pub(crate) fn optimizer_state_to_full(&self, sd: StateDict) -> Result<StateDict> {
        let tp = &self.inner.tp;
        // Sharded: each buffer is this rank's chunk; all-gathered over dp_shard into the whole (tp-local) shape.
        let sd = match &self.inner.sharding {
            Some((g, chunks)) => accel_nn::optim::map_param_tensors(sd, |i, t| -> Result<Tensor> {
                self.layout_of(i)?; // names a parameter the model does not have
                let all = g.all_gather_tensor(&t.to_dtype(DType::F32)?)?;
                chunks[i].unslice(&all, self.inner.masters[i].dims())
            })?,
            None => sd,
        };
        let sd = accel_nn::optim::map_param_tensors(sd, |i, t| self.layout_of(i)?.gather(&t, tp))?;
        match &self.inner.stages {
            Some(stages) => stages.gather_optimizer_state(sd, self.inner.masters[0].device(), Gather::FirstStage),
            None => Ok(sd),
        }
    }

    /// The inverse of [`PreparedModel::optimizer_state_to_full`]: this rank's pieces of a full optimizer state
    /// (no communication).
    pub(crate) fn optimizer_state_to_local(&self, sd: StateDict) -> Result<StateDict> {
        let sd = match &self.inner.stages {
            Some(stages) => stages.own_optimizer_state(sd)?,
            None => sd,
        };
        let (rank, size) = (self.inner.tp.rank(), self.inner.tp.size());
        let sd = accel_nn::optim::map_param_tensors(sd, |i, t| self.layout_of(i)?.slice(&t, rank, size))?;
        match &self.inner.sharding {
            Some((g, chunks)) => accel_nn::optim::map_param_tensors(sd, |i, t| chunks[i].slice(&t, g.rank())),
            None => Ok(sd),
        }
    }

    fn layout_of(&self, i: usize) -> Result<ParamLayout> {
        self.inner.layouts.get(i).copied().ok_or_else(|| {
            AccelError::InvalidArgument(format!(
                "the optimizer state names parameter {i}, but the model has {} parameters: the state belongs to \
                 another model; load it into the optimizer of the model it was saved with",
                self.inner.layouts.len()
            ))
        })
    }

    /// The shape parameter `i` has in a single-process model.
    fn full_shape(&self, i: usize) -> Vec<usize> {
        full_shape(&self.inner.masters[i], self.inner.layouts[i])
    }

    /// Loads full weights by single-process name (any layout's `model.safetensors`, or a single-process one)
    /// into the masters and the compute-dtype parameters (cast as needed; tp shards sliced out). No
    /// communication. Errors name a missing, unexpected or mis-shaped tensor.
    pub fn load_state_dict(&self, weights: &BTreeMap<String, Tensor>) -> Result<()> {
        // Under pipeline parallelism the other stages' tensors are expected and skipped.
        let elsewhere = |name: &String| self.inner.stages.as_ref().is_some_and(|st| st.holds(name));
        for name in weights.keys() {
            if !self.inner.names.contains(name) && !elsewhere(name) {
                return Err(AccelError::InvalidArgument(format!(
                    "load_state_dict: tensor {name:?} is not a parameter of this model (the weights are another \
                     model's, or its names carry another prefix: rename the keys to this model's names())"
                )));
            }
        }
        let mut full = Vec::with_capacity(self.inner.names.len());
        for (i, name) in self.inner.names.iter().enumerate() {
            let t = weights.get(name).ok_or_else(|| {
                AccelError::InvalidArgument(format!(
                    "load_state_dict: no tensor for parameter {name:?} (the weights are another model's, or a \
                     partial set: every parameter needs one)"
                ))
            })?;
            let want = self.full_shape(i);
            if t.dims() != want.as_slice() {
                return Err(AccelError::InvalidArgument(format!(
                    "load_state_dict: parameter {name:?} has shape {want:?} but the tensor has shape {:?}",
                    t.shape()
                )));
            }
            full.push(Some(t.to_device(self.inner.masters[i].device())?.to_dtype(DType::F32)?));
        }
        for (master, t) in self.inner.masters.iter().zip(self.local_tensors(full)?) {
            master.set(&t.expect("every parameter has a tensor"))?;
        }
        if let Some((g, chunks)) = &self.inner.sharding {
            for ((opt, master), c) in self.inner.optimized.iter().zip(&self.inner.masters).zip(chunks) {
                opt.set(&c.slice(master.as_tensor(), g.rank())?)?;
            }
        }
        self.copy_masters_to_params()
    }

    /// Casts the fp32 masters back into the compute-dtype `Var`s (no-op in fp32).
    pub(crate) fn copy_masters_to_params(&self) -> Result<()> {
        if self.inner.has_masters {
            for (p, m) in self.inner.params.iter().zip(&self.inner.masters) {
                p.set(&m.as_tensor().to_dtype(p.dtype())?)?;
            }
        }
        Ok(())
    }

    pub(crate) fn index(&self) -> usize {
        self.inner.index
    }

    pub(crate) fn find_unused_parameters(&self) -> bool {
        self.inner.find_unused_parameters
    }

    /// The group that covers every parameter, slot `i` = parameter `i`, when it can overlap its reduction with
    /// the backward pass (what `backward_segments` drives); `None` otherwise.
    pub(crate) fn overlapping_group(&self) -> Option<&dyn GradientStrategy> {
        match &self.inner.groups[..] {
            [g] if g.strategy.overlaps() && g.params.iter().copied().eq(0..self.inner.params.len()) => {
                Some(g.strategy.as_ref())
            }
            _ => None,
        }
    }

    /// The squared L2 norm of the whole model from each parameter's squared gradient norm on this rank
    /// (`per_param[i]`, `names` order): each group's strategy counts its parameters once over its norm group.
    /// Collective over the groups' norm groups.
    pub(crate) fn squared_norm(&self, per_param: &[f64]) -> Result<f64> {
        let mut total = 0.0;
        for g in &self.inner.groups {
            let sq: Vec<f64> = g.params.iter().map(|&i| per_param[i]).collect();
            total += g.strategy.squared_norm(&sq, &self.group_layouts(g))?;
        }
        Ok(total)
    }

    /// Whether `local` holds on any rank that holds another piece of this model (fp16 overflow), as each group's
    /// strategy agrees it (collective over the groups' norm groups).
    pub(crate) fn any_rank(&self, local: bool) -> Result<bool> {
        let mut any = local;
        for g in &self.inner.groups {
            any |= g.strategy.any_rank(local, &self.group_layouts(g))?;
        }
        Ok(any)
    }

    fn group_layouts(&self, g: &ParamGroup) -> Vec<ParamLayout> {
        g.params.iter().map(|&i| self.inner.layouts[i]).collect()
    }

    /// Reduces this model's gradient slots after the backward pass, group by group, each by its strategy
    /// (collective).
    pub(crate) fn reduce_gradients(&self, slots: &mut [Option<Tensor>]) -> Result<()> {
        for g in &self.inner.groups {
            let mut group: Vec<Option<Tensor>> = g.params.iter().map(|&i| slots[i].take()).collect();
            let reduced = g.strategy.reduce(&mut group);
            for (&i, t) in g.params.iter().zip(group) {
                slots[i] = t;
            }
            reduced?;
        }
        Ok(())
    }

    /// What each group's strategy does once the optimizer updated the masters, then the compute-dtype copies.
    pub(crate) fn after_optimizer_step(&self) -> Result<()> {
        for g in &self.inner.groups {
            let masters: Vec<Var> = g.params.iter().map(|&i| self.inner.masters[i].clone()).collect();
            let optimized: Vec<Var> = g.params.iter().map(|&i| self.inner.optimized[i].clone()).collect();
            g.strategy.after_optimizer_step(&optimized, &masters)?;
        }
        self.copy_masters_to_params()
    }
}

#[cfg(test)]
impl PreparedModel {
    /// The same model with every group's strategy wrapped by `wrap` (tests count what goes through them).
    pub(crate) fn map_strategies(&mut self, wrap: impl Fn(Box<dyn GradientStrategy>) -> Box<dyn GradientStrategy>) {
        let inner = Arc::get_mut(&mut self.inner).expect("map_strategies before the model is shared");
        inner.groups = std::mem::take(&mut inner.groups)
            .into_iter()
            .map(|g| ParamGroup { params: g.params, strategy: wrap(g.strategy) })
            .collect();
    }
}
