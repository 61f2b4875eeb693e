//! [`GradientStrategy`]: what one parameter group of a prepared model does with its gradients — the one road
//! every gradient takes between the backward pass and the optimizer.
//!
//! A prepared model is a list of parameter groups, each with one strategy. The step owner (`crate::step`) never
//! reduces, norms or checks gradients itself: it asks each group's strategy, on every path —
//!
//! - **each micro-batch** (or backward segment), before its gradients join the window's:
//!   [`GradientStrategy::reduce_micro_batch`] (ZeRO-2 reduce-scatters them there);
//! - **after backward** (plain `backward`, accumulated windows, fp16-scaled losses): [`GradientStrategy::reduce`]
//!   on the sync step;
//! - **overlapped with backward** (`backward_segments`): [`GradientStrategy::backward_overlapped`], which runs the
//!   segmented backward and launches the reduction bucket by bucket as gradients become final;
//! - **clipping and fp16 overflow**: [`GradientStrategy::squared_norm`] and [`GradientStrategy::any_rank`], summed
//!   or agreed over the group the strategy names ([`GradientStrategy::norm_group`]);
//! - **after the optimizer step**: [`GradientStrategy::after_optimizer_step`].
//!
//! The strategies: [`ReplicatedDataParallel`], DDP's bucketed all-reduce over the mesh's `dp` group (Li et al.,
//! "PyTorch Distributed", VLDB 2020), under tensor parallelism too — a tp shard is averaged with its data-parallel
//! replicas only, never with its tp peers, which hold different pieces (Megatron-LM, Shoeybi et al. 2019);
//! [`PipelineStage`] (below: norm and overflow over pp × tp, tied weights; Narayanan et al. 2021); and
//! `ShardedDataParallel` (`sharded.rs`: ZeRO-1 and ZeRO-2, Rajbhandari et al. 2020 — reduce-scatter over
//! `dp_shard`, each rank stepping its chunks, all-gather in `after_optimizer_step`; ZeRO-2 reduce-scatters every
//! micro-batch in `reduce_micro_batch`, so the slots hold chunks between micro-batches).
//!
//! How the variants fit without the step owner changing: the step owner hands each group's strategy the group's
//! slots and asks it to reduce them; what a slot holds afterwards is the strategy's business. A sharded group's
//! `reduce` reduce-scatters and leaves each slot holding this rank's chunk; the optimizer steps the model's
//! *optimized* weights (`PreparedModel::optimizer_params`: the fp32 masters, or a sharded model's chunks of them,
//! so the moments are the size of the chunks), and the group's `after_optimizer_step` all-gathers the updated
//! chunks into the whole masters before they are copied into the compute-dtype parameters. Its `squared_norm` sums
//! the chunks' squares over `dp_shard`, each element counted once. A pipeline stage's `squared_norm` and `any_rank`
//! reduce over the model-parallel group whatever the layouts (every stage holds different parameters), and its
//! `reduce` adds one all-reduce of a tied weight's gradient over the stages holding it.

use crate::tensor_parallel::ParamLayout;
use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use ddp_core::functional::{BackwardGuard, ShardGradient};
use ddp_core::segments::BackwardSegments;
use ddp_core::zero::FlatChunk;
use ddp_core::{DistributedDataParallel, ProcessGroup, ReduceOp};

/// Adds one segment's gradients (taken out of the `GradStore`) into a group's slots; returns the slot indices it
/// filled. What [`GradientStrategy::backward_overlapped`] calls after each segment.
pub(crate) type AddSegment<'a> = dyn FnMut(GradStore, &mut [Option<Tensor>]) -> ddp_core::Result<Vec<usize>> + 'a;

/// How one parameter group's gradients are reduced, normed, checked and followed up (module documentation).
///
/// Slot `i` of every call is the group's `i`-th parameter; slots are fp32, on the model's device, `None` where no
/// micro-batch produced a gradient. Every method that communicates is collective over the group it names: every
/// rank of that group calls it, in the same order.
pub(crate) trait GradientStrategy: Send + Sync + std::fmt::Debug {
    /// Reduces the slots after a sync step's backward pass, the results replacing them (collective).
    fn reduce(&self, slots: &mut [Option<Tensor>]) -> Result<()>;

    /// Called with each micro-batch's gradients before the step owner adds them to the window's slots (`micro[i]`
    /// for slot `i`; `None` where this micro-batch — or this backward segment — produced none). A strategy that
    /// keeps its gradients reduced between micro-batches (ZeRO-2) reduces them here and leaves what the slots
    /// should accumulate; the others leave them as they are. Collective for the former: every rank of the group
    /// calls it with gradients for the same parameters.
    fn reduce_micro_batch(&self, _micro: &mut [Option<Tensor>]) -> Result<()> {
        Ok(())
    }

    /// How the slots are cut when they hold this rank's chunks between micro-batches (ZeRO-2: a slot is a 1-D
    /// fp32 `[chunk]`, not the parameter's shape); `None` when they hold whole gradients.
    fn gradient_chunks(&self) -> Option<&[FlatChunk]> {
        None
    }

    /// Whether [`GradientStrategy::backward_overlapped`] can run the reduction during the backward pass.
    fn overlaps(&self) -> bool {
        false
    }

    /// The backward pass of `loss` over `segments`, segment by segment, `add` putting each segment's gradients
    /// into `slots`; on a sync step (`sync`) the reduction runs overlapped with the later segments and its
    /// results replace the slots at the end. Only called when [`GradientStrategy::overlaps`]; the default
    /// refuses.
    fn backward_overlapped(
        &self,
        _loss: &Tensor,
        _segments: BackwardSegments,
        _slots: &mut [Option<Tensor>],
        _sync: bool,
        _add: &mut AddSegment<'_>,
    ) -> Result<()> {
        Err(crate::AccelError::Usage(format!("{self:?} cannot overlap its reduction with the backward pass")))
    }

    /// The group whose ranks hold different pieces of one model replica: a norm's partial sums and the fp16
    /// overflow flag are reduced over it (the mesh's model-parallel group, pp × tp).
    fn norm_group(&self) -> &ProcessGroup;

    /// The group over which each parameter's gradient is cut into chunks, so that a parameter's squares on this
    /// rank are a part of its squares (sharded data parallelism: dp_shard); `None` when every rank of the
    /// data-parallel group holds whole gradients.
    fn chunked_over(&self) -> Option<&ProcessGroup> {
        None
    }

    /// How the backward of each gathered use of a parameter reduces its gradient into this rank's chunk, for a
    /// group whose parameters rest as chunks (FULL_SHARD): the reduce-scatter runs inside that backward
    /// (`ddp_core::functional::gather_shards_with`), so the gathered whole never outlives its unit, but the strategy
    /// defines it (compression, the fp16 divisor) — `guard` the gather's staleness check. `None` for any other
    /// group.
    fn per_use_reduction(&self, _guard: BackwardGuard) -> Option<ShardGradient> {
        None
    }

    /// The group's squared L2 norm from each parameter's squared gradient norm on this rank (`per_param[i]`,
    /// with `layouts[i]`): every element of the single-process model counted once — tp shards summed over
    /// [`GradientStrategy::norm_group`], replicated parameters taken as they are (each rank of the group holds
    /// the same copy; transformers#36132 and torchtune#2420 were norms counting replicas tp times). Collective
    /// over the norm group when the group holds shards.
    fn squared_norm(&self, per_param: &[f64], layouts: &[ParamLayout]) -> Result<f64> {
        let (mut sharded, mut replicated) = (0.0, 0.0);
        for (sq, layout) in per_param.iter().zip(layouts) {
            match layout {
                ParamLayout::Replicated => replicated += sq,
                ParamLayout::Sharded { .. } => sharded += sq,
            }
        }
        if has_shards(self.norm_group(), layouts) {
            let mut buf = [sharded];
            self.norm_group().all_reduce(&mut buf, ReduceOp::Sum)?;
            sharded = buf[0];
        }
        Ok(sharded + replicated)
    }

    /// Whether `local` holds on any rank of [`GradientStrategy::norm_group`] (fp16 overflow: ranks holding
    /// different pieces must skip the same steps). Collective over the norm group when the group holds shards;
    /// `local` otherwise.
    fn any_rank(&self, local: bool, layouts: &[ParamLayout]) -> Result<bool> {
        if !has_shards(self.norm_group(), layouts) {
            return Ok(local);
        }
        let mut flag = [i32::from(local)];
        self.norm_group().all_reduce(&mut flag, ReduceOp::Max)?;
        Ok(flag[0] != 0)
    }

    /// After the optimizer updated `optimized` (what it steps, group order: the fp32 masters themselves, or a
    /// sharded group's chunks of them); `full` are the group's whole fp32 masters. Nothing for replicated data
    /// parallelism; a sharded group all-gathers its chunks into `full` here.
    fn after_optimizer_step(&self, _optimized: &[Var], _full: &[Var]) -> Result<()> {
        Ok(())
    }
}

/// Whether some parameter is split over a group of more than one rank (the same answer on every rank of it:
/// the model is built by the same code).
fn has_shards(group: &ProcessGroup, layouts: &[ParamLayout]) -> bool {
    group.world_size() > 1 && layouts.iter().any(|l| matches!(l, ParamLayout::Sharded { .. }))
}

/// Replicated data parallelism: every rank of the `dp` group holds the same parameters (whole, or the same tp
/// shard); gradients are averaged over `dp` by DDP — after the backward pass, or bucket by bucket during it
/// (reverse-order buckets, each read from the slots and written into new ones by the all_reduce).
#[derive(Debug)]
pub(crate) struct ReplicatedDataParallel {
    ddp: DistributedDataParallel,
    model_parallel: ProcessGroup,
}

impl ReplicatedDataParallel {
    /// `ddp` over the mesh's `dp` group; `model_parallel` = the mesh's model-parallel group (norms, overflow).
    pub(crate) fn new(ddp: DistributedDataParallel, model_parallel: ProcessGroup) -> Self {
        ReplicatedDataParallel { ddp, model_parallel }
    }
}

impl GradientStrategy for ReplicatedDataParallel {
    fn reduce(&self, slots: &mut [Option<Tensor>]) -> Result<()> {
        Ok(self.ddp.reduce_gradients(slots)?)
    }

    /// DDP decides per step whether a bucket can go out early (with `find_unused_parameters` or a compression
    /// hook it reduces after the pass, inside the same call).
    fn overlaps(&self) -> bool {
        true
    }

    fn backward_overlapped(
        &self,
        loss: &Tensor,
        segments: BackwardSegments,
        slots: &mut [Option<Tensor>],
        sync: bool,
        add: &mut AddSegment<'_>,
    ) -> Result<()> {
        Ok(self.ddp.backward_segments_into(loss, segments, slots, sync, add)?)
    }

    fn norm_group(&self) -> &ProcessGroup {
        &self.model_parallel
    }
}

/// A pipeline stage's parameters: data parallelism as the stage's data strategy does it — replicated over `dp` as
/// [`ReplicatedDataParallel`] (DDP's
/// all-reduce once per optimizer step, after the last micro-batch's backward — the step owner reduces only on the
/// sync step), but every pp rank holds different parameters, so the norm and the fp16 overflow flag always cover
/// the whole model: tp shards' squares summed over pp × tp, replicated parameters' over pp only (each tp rank of
/// a stage holds the same copy), overflow agreed over pp × tp (torchtitan's `clip_grad_norm_(…, pp_mesh)`,
/// torchtitan#596; Megatron-LM's model-parallel norm). Every rank calls the same collectives whatever its stage
/// holds, so a stage without shards never leaves its peers waiting.
///
/// A weight several stages hold (tied: the token embedding the first stage reads and the last stage's head
/// reuses) is one parameter of the single-process model: after the dp reduction its copies' gradients are summed
/// over the stages holding it (Megatron-LM's `_allreduce_word_embedding_grads` over the embedding group), so the
/// copies take the same step and stay equal, and only the lowest of those stages counts it in the norm
/// (Megatron's `param_is_not_shared`).
#[derive(Debug)]
pub(crate) struct PipelineStage {
    /// The data-parallel strategy of this stage's parameters: DDP over dp, or sharded over dp_shard.
    data: Box<dyn GradientStrategy>,
    pp: ProcessGroup,
    tied: Vec<TiedWeights>,
}

/// Parameters of this stage that other stages hold too, and the group of the pp ranks holding them.
#[derive(Debug)]
pub(crate) struct TiedWeights {
    /// The pp ranks holding these weights (this one among them).
    pub(crate) group: ProcessGroup,
    /// Indices into the group's slots (the model's parameters).
    pub(crate) params: Vec<usize>,
    /// Whether this rank counts them in the norm (the lowest pp rank of the group).
    pub(crate) counted_here: bool,
}

impl PipelineStage {
    /// `data`: the stage's data-parallel strategy (norm group: the model-parallel group pp × tp); `pp` = the
    /// mesh's pp group; `tied` = the weights shared with other stages.
    pub(crate) fn new(data: Box<dyn GradientStrategy>, pp: ProcessGroup, tied: Vec<TiedWeights>) -> Self {
        PipelineStage { data, pp, tied }
    }
}

impl GradientStrategy for PipelineStage {
    /// The data-parallel reduction, then a tied weight's gradient (whole, or this rank's chunk of it: the stages
    /// holding it cut it alike) summed over the stages holding it.
    fn reduce(&self, slots: &mut [Option<Tensor>]) -> Result<()> {
        self.data.reduce(slots)?;
        for t in &self.tied {
            for &i in &t.params {
                let g = slots[i].as_ref().ok_or_else(|| {
                    crate::AccelError::InvalidArgument(format!(
                        "parameter {i} is tied across pipeline stages but got no gradient on this stage: a shared \
                         weight must be used by every stage that holds it"
                    ))
                })?;
                slots[i] = Some(t.group.all_reduce_tensor(g, ReduceOp::Sum)?);
            }
        }
        Ok(())
    }

    fn reduce_micro_batch(&self, micro: &mut [Option<Tensor>]) -> Result<()> {
        self.data.reduce_micro_batch(micro)
    }

    fn gradient_chunks(&self) -> Option<&[FlatChunk]> {
        self.data.gradient_chunks()
    }

    fn norm_group(&self) -> &ProcessGroup {
        self.data.norm_group()
    }

    fn chunked_over(&self) -> Option<&ProcessGroup> {
        self.data.chunked_over()
    }

    fn per_use_reduction(&self, guard: BackwardGuard) -> Option<ShardGradient> {
        self.data.per_use_reduction(guard)
    }

    fn after_optimizer_step(&self, optimized: &[Var], full: &[Var]) -> Result<()> {
        self.data.after_optimizer_step(optimized, full)
    }

    fn squared_norm(&self, per_param: &[f64], layouts: &[ParamLayout]) -> Result<f64> {
        let not_counted: Vec<usize> =
            self.tied.iter().filter(|t| !t.counted_here).flat_map(|t| t.params.iter().copied()).collect();
        let (mut sharded, mut replicated) = (0.0, 0.0);
        for (i, (sq, layout)) in per_param.iter().zip(layouts).enumerate() {
            if not_counted.contains(&i) {
                continue;
            }
            match layout {
                ParamLayout::Replicated => replicated += sq,
                ParamLayout::Sharded { .. } => sharded += sq,
            }
        }
        if let Some(chunks) = self.chunked_over() {
            // Each parameter's squares are split over the dp_shard ranks' chunks: whole first.
            let mut both = [sharded, replicated];
            chunks.all_reduce(&mut both, ReduceOp::Sum)?;
            [sharded, replicated] = both;
        }
        let mut s = [sharded];
        self.norm_group().all_reduce(&mut s, ReduceOp::Sum)?;
        let mut r = [replicated];
        self.pp.all_reduce(&mut r, ReduceOp::Sum)?;
        Ok(s[0] + r[0])
    }

    fn any_rank(&self, local: bool, _layouts: &[ParamLayout]) -> Result<bool> {
        let mut flag = [i32::from(local)];
        if let Some(chunks) = self.chunked_over() {
            chunks.all_reduce(&mut flag, ReduceOp::Max)?;
        }
        self.norm_group().all_reduce(&mut flag, ReduceOp::Max)?;
        Ok(flag[0] != 0)
    }
}
