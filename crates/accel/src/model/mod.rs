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

mod fully_sharded;
mod registration;
mod sharded;
mod stages;
mod strategy;

#[cfg(test)]
mod tests;

use ddp_core::zero::FlatShards;
use sharded::{GradientChunks, ShardedDataParallel};
use stages::{full_shape, Gather, Stages};
#[cfg(test)]
use strategy::AddSegment;
pub(crate) use strategy::{GradientStrategy, PipelineStage, ReplicatedDataParallel, TiedWeights};

use crate::sharding::ShardingStrategy;
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
    /// them (fp32, 1-D; cut as `storage` says).
    optimized: Vec<Var>,
    /// How the parameters rest between steps: replicated, ZeRO-1/2 or FULL_SHARD.
    storage: Storage,
    /// Each parameter's layout over `tp` (in `names` order).
    layouts: Vec<ParamLayout>,
    /// Each parameter's shape on this rank (its tp piece) — what the model computes with; under FULL_SHARD the
    /// `Var`s are 1-D chunks and this is the shape they are gathered into.
    local_dims: Vec<Vec<usize>>,
    /// Optimizer steps taken, for FULL_SHARD's check that no gathered weight outlives a step.
    generation: Arc<fully_sharded::Generation>,
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

/// How a prepared model's parameters rest between steps: one variant per data-parallel strategy, each of which
/// makes its group's [`GradientStrategy`] ([`Storage::data_strategy`]).
enum Storage {
    /// DDP (and NO_SHARD): the whole parameters on every data-parallel rank.
    Replicated,
    /// ZeRO-1 / ZeRO-2: the whole parameters; the optimizer steps this rank's fp32 chunks over `group` (under
    /// mixed precision those chunks are the masters; the compute-dtype parameters are refreshed from their
    /// all-gather after each step).
    Sharded { group: ProcessGroup, shards: FlatShards },
    /// FULL_SHARD (ZeRO-3): `params`, `masters` and `optimized` are the same fp32 1-D chunks; the whole
    /// parameters exist only while a forward uses them (`param_builder`, `accel::nn`'s layers), in `dtype`, the
    /// next unit's gathered ahead by `prefetcher`.
    FullShard { group: ProcessGroup, shards: FlatShards, dtype: DType, prefetcher: fully_sharded::Prefetcher },
}

impl Storage {
    /// The dp_shard group and how every parameter is cut over it, when the model is sharded.
    fn sharding(&self) -> Option<(&ProcessGroup, &FlatShards)> {
        match self {
            Storage::Replicated => None,
            Storage::Sharded { group, shards } | Storage::FullShard { group, shards, .. } => Some((group, shards)),
        }
    }

    /// FULL_SHARD's gather dtype.
    fn full_shard(&self) -> Option<DType> {
        match self {
            Storage::FullShard { dtype, .. } => Some(*dtype),
            _ => None,
        }
    }

    fn prefetcher(&self) -> Option<&fully_sharded::Prefetcher> {
        match self {
            Storage::FullShard { prefetcher, .. } => Some(prefetcher),
            _ => None,
        }
    }

    /// The data-parallel strategy of this storage: DDP (`replicated`), or sharded over dp_shard and averaged over
    /// `replicate` (`sharded.rs`), its gradients reduced at the sync step (ZeRO-1), per micro-batch (ZeRO-2,
    /// `shards_gradients`) or by each gathered use's backward (FULL_SHARD).
    fn data_strategy(
        &self,
        replicated: ReplicatedDataParallel,
        replicate: ProcessGroup,
        model_parallel: ProcessGroup,
        device: &candle_core::Device,
        hook: ddp_core::CommHook,
        shards_gradients: bool,
    ) -> Box<dyn GradientStrategy> {
        let (group, shards, gradients) = match self {
            Storage::Replicated => return Box::new(replicated),
            Storage::Sharded { group, shards } if shards_gradients => {
                (group, shards, GradientChunks::ReducedPerMicroBatch)
            }
            Storage::Sharded { group, shards } => (group, shards, GradientChunks::Whole),
            Storage::FullShard { group, shards, .. } => (group, shards, GradientChunks::ReducedInBackward),
        };
        let (group, shards, device) = (group.clone(), shards.clone(), device.clone());
        Box::new(ShardedDataParallel::new(group, replicate, model_parallel, shards, device, hook, gradients))
    }
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
        sharding_strategy: ShardingStrategy,
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
        let local_dims: Vec<Vec<usize>> = params.iter().map(|v| v.dims().to_vec()).collect();
        // One group: every parameter — replicated over tp or a tp shard — is averaged over its data-parallel
        // replicas, which hold the same piece (Megatron-LM: a shard is never reduced with its tp peers; the
        // replicated ones have equal gradients on every tp rank already). Gradients are reduced in fp32.
        let replicated = DistributedDataParallel::from_named_vars(
            mesh.dp(),
            names.iter().cloned().zip(masters.iter().cloned()).collect(),
            ddp.clone(),
        )?;
        let replicated = ReplicatedDataParallel::new(replicated, mesh.model_parallel().clone());
        // dp_shard > 1: ZeRO-1 or ZeRO-2 (sharded.rs); the DDP above only checked the names and broadcast rank 0's
        // values. NO_SHARD: the dp_shard ranks are DDP replicas like the dp_replicate ones (mesh.dp() spans both).
        let shard_group = mesh.group(MeshDim::DpShard).clone();
        let sharded_stage = shard_group.world_size() > 1 && sharding_strategy != ShardingStrategy::NoShard;
        let full_shard = sharded_stage && sharding_strategy == ShardingStrategy::FullShard;
        if sharded_stage && ddp.find_unused_parameters {
            // A chunk of an unused parameter would be stepped with a zero gradient (moments decaying, weight decay
            // applied) where DDP skips it: refuse rather than train something else.
            return Err(AccelError::Usage(
                "prepare_model: find_unused_parameters is not supported with sharded data parallelism \
                 (dp_shard_size > 1) yet: use every parameter in every step, or dp_shard_size 1"
                    .into(),
            ));
        }
        // Under pp every stage's names and shapes are exchanged once (state dicts gather and load through them);
        // a stage holds its own parameters, so norms and overflow cover every stage, and a weight held by several
        // stages (tied) has its copies made equal here (before any sharding) and its gradients summed over them
        // (strategy.rs).
        let pipeline = if mesh.pp().world_size() > 1 {
            let mine: Vec<(String, Vec<usize>)> =
                names.iter().enumerate().map(|(i, n)| (n.clone(), full_shape(&local_dims[i], layouts[i]))).collect();
            let stages = Stages::exchange(mesh.pp(), mine)?;
            let tied = stages.tied_weights(&masters)?;
            Some((stages, tied))
        } else {
            None
        };
        let sharding = sharded_stage.then(|| {
            let numels: Vec<usize> = masters.iter().map(|m| m.elem_count()).collect();
            (shard_group.clone(), FlatShards::new(&numels, shard_group.world_size()))
        });
        let optimized: Vec<Var> = match &sharding {
            Some((g, shards)) => masters
                .iter()
                .zip(shards.chunks())
                .map(|(m, c)| Ok(Var::from_tensor(&c.slice(m.as_tensor(), g.rank())?)?))
                .collect::<Result<_>>()?,
            None => masters.clone(),
        };
        // FULL_SHARD: the chunks are the parameters. The whole ones leave the VarMap (replaced by the chunks under
        // the same names), so nothing keeps them once the program dropped the model it initialised with.
        let compute_dtype = params[0].dtype();
        let (params, masters, has_masters) = if full_shard {
            let mut data = crate::lock(varmap.data());
            for (name, chunk) in names.iter().zip(&optimized) {
                data.insert(name.clone(), chunk.clone());
            }
            (optimized.clone(), optimized.clone(), false)
        } else if sharding.is_some() && has_masters {
            // ZeRO-1/2 under bf16/fp16: the fp32 masters are this rank's chunks (what the optimizer steps); the
            // whole compute-dtype parameters take rank 0's broadcast values now and the all-gathered chunks after
            // every step, so no rank holds the whole model in fp32.
            for (p, m) in params.iter().zip(&masters) {
                p.set(&m.as_tensor().to_dtype(p.dtype())?)?;
            }
            (params, optimized.clone(), true)
        } else {
            (params, masters, has_masters)
        };
        let storage = match sharding {
            None => Storage::Replicated,
            Some((group, shards)) if full_shard => {
                // FULL_SHARD's prefetch thread talks over its own communicator of the dp_shard ranks (collective
                // here).
                let own = group.split(Some(0), group.rank())?.expect("every dp_shard rank joins");
                let prefetcher = fully_sharded::Prefetcher::new(own);
                Storage::FullShard { group, shards, dtype: compute_dtype, prefetcher }
            }
            Some((group, shards)) => Storage::Sharded { group, shards },
        };
        // The data-parallel strategy the storage makes; under pp wrapped by the stage's (norm and overflow over
        // every stage, tied weights).
        let data = storage.data_strategy(
            replicated,
            mesh.group(MeshDim::DpReplicate).clone(),
            mesh.model_parallel().clone(),
            device,
            ddp.comm_hook,
            sharding_strategy.shards_gradients(),
        );
        let (strategy, stages): (Box<dyn GradientStrategy>, _) = match pipeline {
            Some((stages, tied)) => (Box::new(PipelineStage::new(data, mesh.pp().clone(), tied)), Some(stages)),
            None => (data, None),
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
                storage,
                layouts,
                local_dims,
                generation: Arc::default(),
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

    /// The fp32 master weights the optimizer updates (the same `Var`s as [`PreparedModel::parameters`] in fp32);
    /// under sharded data parallelism with mixed precision, and under FULL_SHARD, this rank's 1-D chunks of them.
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
        self.inner.local_dims.iter().map(|d| d.iter().product::<usize>()).sum()
    }

    /// A [`crate::ParamBuilder`] handing out this model's parameters by name instead of creating them: build the
    /// model's layers from it in the forward pass (what a model written on the `ParamBuilder` does under FULL_SHARD;
    /// `accel::nn`'s layers do it themselves). Each call returns
    /// this rank's piece in the compute dtype — the prepared `Var`'s tensor, or under FULL_SHARD the whole
    /// parameter all-gathered from the dp_shard ranks' chunks at that moment, whose gradient is reduce-scattered
    /// back to the chunks by the backward pass ([`ddp_core::functional::gather_shards`]). Required under
    /// FULL_SHARD (the `Var`s are chunks); the same code trains every other layout.
    pub fn param_builder(&self) -> crate::ParamBuilder {
        let dtype = self.inner.storage.full_shard().unwrap_or_else(|| self.inner.params[0].dtype());
        crate::ParamBuilder::lookup(Arc::new(self.clone()), &self.inner.tp, dtype, self.inner.params[0].device())
    }

    /// FULL_SHARD: how many weight gathers a prefetch served (the rest were gathered when asked for).
    pub fn prefetched_gathers(&self) -> u64 {
        self.inner.storage.prefetcher().map_or(0, |p| p.hits())
    }

    /// FULL_SHARD: the collectives the prefetch thread ran over its own communicator of the dp_shard ranks (not in
    /// the mesh's groups' counters); `None` otherwise.
    pub fn prefetch_traffic(&self) -> Option<ddp_core::TrafficStats> {
        self.inner.storage.prefetcher().map(|p| p.traffic())
    }

    /// Whether the parameters rest as dp_shard chunks between uses (FULL_SHARD).
    pub fn is_fully_sharded(&self) -> bool {
        self.inner.storage.full_shard().is_some()
    }

    /// Whether the fp32 masters are this rank's chunks (the same `Var`s as `optimized`): FULL_SHARD, and ZeRO-1/2
    /// under mixed precision (the whole compute-dtype `params` are refreshed from the all-gathered chunks after
    /// each step).
    fn masters_sharded(&self) -> bool {
        match self.inner.storage {
            Storage::Replicated => false,
            Storage::Sharded { .. } => self.inner.has_masters,
            Storage::FullShard { .. } => true,
        }
    }

    /// Parameter `i` whole in this rank's tp layout and fp32, outside any graph: the master, or when the masters are
    /// chunks (FULL_SHARD; ZeRO-1/2 under mixed precision) its chunks all-gathered (collective over dp_shard).
    fn local_master(&self, i: usize) -> Result<Tensor> {
        match (self.inner.storage.sharding(), self.masters_sharded()) {
            (Some((g, shards)), true) => {
                let chunks = shards.chunks();
                let all = g.all_gather_tensor(&self.inner.optimized[i].as_tensor().detach())?;
                Ok(chunks[i].unslice(&all, &self.inner.local_dims[i])?)
            }
            _ => Ok(self.inner.masters[i].as_tensor().clone()),
        }
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
        let local = (0..self.inner.names.len()).map(|i| self.local_master(i).map(Some)).collect::<Result<_>>()?;
        let full = self.full_tensors(local)?;
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
        let sd = match self.inner.storage.sharding() {
            Some((g, shards)) => accel_nn::optim::map_param_tensors(sd, |i, t| -> Result<Tensor> {
                let chunks = shards.chunks();
                self.layout_of(i)?; // names a parameter the model does not have
                let all = g.all_gather_tensor(&t.to_dtype(DType::F32)?)?;
                Ok(chunks[i].unslice(&all, &self.inner.local_dims[i])?)
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
        match self.inner.storage.sharding() {
            Some((g, shards)) => accel_nn::optim::map_param_tensors(sd, |i, t| -> Result<Tensor> {
                Ok(shards.chunks()[i].slice(&t, g.rank())?)
            }),
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
        full_shape(&self.inner.local_dims[i], self.inner.layouts[i])
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
        let local = self.local_tensors(full)?;
        if let Some((g, shards)) = self.inner.storage.sharding() {
            let chunks = shards.chunks();
            // This rank's chunks (what the optimizer steps), and the whole parameters unless FULL_SHARD's rest as
            // the chunks themselves.
            for (i, t) in local.into_iter().enumerate() {
                let t = t.expect("every parameter has a tensor");
                self.inner.optimized[i].set(&chunks[i].slice(&t, g.rank())?)?;
                if !self.is_fully_sharded() {
                    let p = &self.inner.params[i];
                    p.set(&t.to_dtype(p.dtype())?)?;
                }
            }
            return Ok(());
        }
        for (master, t) in self.inner.masters.iter().zip(local) {
            master.set(&t.expect("every parameter has a tensor"))?;
        }
        self.copy_masters_to_params()
    }

    /// Casts the fp32 masters back into the compute-dtype `Var`s (no-op in fp32, and when the masters are chunks:
    /// the sharded strategy's all-gather refreshed the parameters).
    pub(crate) fn copy_masters_to_params(&self) -> Result<()> {
        if self.inner.has_masters && !self.masters_sharded() {
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

    /// One micro-batch's (or backward segment's) gradients, `micro[i]` for parameter `i`, made what the window's
    /// slots accumulate: each group's strategy may reduce them now (ZeRO-2), collective then.
    pub(crate) fn reduce_micro_batch(&self, micro: &mut [Option<Tensor>]) -> Result<()> {
        for g in &self.inner.groups {
            let mut group: Vec<Option<Tensor>> = g.params.iter().map(|&i| micro[i].take()).collect();
            let reduced = g.strategy.reduce_micro_batch(&mut group);
            for (&i, t) in g.params.iter().zip(group) {
                micro[i] = t;
            }
            reduced?;
        }
        Ok(())
    }

    /// The shape of parameter `i`'s gradient slot between micro-batches: the master weight's, or under ZeRO-2
    /// this rank's 1-D chunk.
    pub(crate) fn gradient_dims(&self, i: usize) -> Vec<usize> {
        for g in &self.inner.groups {
            if let (Some(chunks), Some(k)) = (g.strategy.gradient_chunks(), g.params.iter().position(|&p| p == i)) {
                return vec![chunks[k].chunk];
            }
        }
        self.inner.local_dims[i].clone()
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
            // What a sharded group all-gathers its stepped chunks into: the whole parameters (the fp32 masters
            // themselves in fp32; the compute-dtype copies, cast, when the masters are chunks).
            let whole: Vec<Var> = g.params.iter().map(|&i| self.inner.params[i].clone()).collect();
            let optimized: Vec<Var> = g.params.iter().map(|&i| self.inner.optimized[i].clone()).collect();
            g.strategy.after_optimizer_step(&optimized, &whole)?;
        }
        self.inner.generation.advance();
        if let Some(p) = self.inner.storage.prefetcher() {
            p.clear();
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

impl crate::tensor_parallel::ParamSource for PreparedModel {
    fn get(&self, full_name: &str) -> Result<Tensor> {
        let i = self.inner.names.binary_search_by(|n| n.as_str().cmp(full_name)).map_err(|_| {
            AccelError::InvalidArgument(format!(
                "param_builder: the prepared model has no parameter `{full_name}` (build the model from the \
                 configuration and prefixes it was prepared with)"
            ))
        })?;
        match self.inner.storage.full_shard() {
            Some(dtype) => self.gathered(i, dtype),
            None => Ok(self.inner.params[i].as_tensor().clone()),
        }
    }

    fn gathers(&self) -> bool {
        self.is_fully_sharded()
    }

    fn prefetch(&self, prefix: &str) -> Result<()> {
        self.prefetch_prefix(prefix)
    }
}
