//! [`ShardedDataParallel`]: sharded optimizer state (ZeRO stage 1) and gradients (stage 2) over the mesh's
//! `dp_shard` group (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
//! Models", §5.1–5.2; DeepSpeed's `stage_1_and_2.py`; PyTorch's `ZeroRedundancyOptimizer`, FSDP's `SHARD_GRAD_OP`).
//!
//! Every parameter is flattened and cut into `dp_shard` equal chunks (the last padded with zeros: uneven and tiny
//! parameters work alike, [`FlatChunk`]); rank `r` of the dp_shard group owns chunk `r` of every parameter. On a
//! sync step the gradients are reduce-scattered over dp_shard — one collective over a rank-major buffer, each rank
//! receiving the mean of its chunks — and averaged over `dp_replicate` (HSDP: shard inside a group, replicate
//! across groups). The optimizer steps only the owned chunks (fp32 copies of them: the AdamW moments are the size
//! of the chunks, 1/dp_shard of the model's), and after its step the chunks are all-gathered back into the whole
//! parameters. Communication per step: a reduce-scatter and an all-gather of the model, 2Ψ like DDP's all-reduce
//! (ZeRO paper §7).
//!
//! The gradient norm counts every element once: the chunks' squares summed over dp_shard (and the tp shards' over
//! tp); the fp16 overflow verdict is agreed over dp_shard too (ranks hold different chunks). Checkpoints hold the
//! optimizer state as one process would (chunks all-gathered into whole parameters; [`FlatChunk::unslice`]), so a
//! sharded run resumes at another layout and a replicated one resumes sharded.
//!
//! **ZeRO-2** (`SHARD_GRAD_OP`, [`GradientChunks::ReducedPerMicroBatch`]): no rank holds a whole gradient longer
//! than one backward segment. Each micro-batch's gradients are reduce-scattered (summed over dp_shard) as soon as
//! they exist — segment by segment during a segmented backward (`backward_segments`, the Trainer, `pipeline_backward`
//! at pp 1: the parameters one segment reached form one bucket), after the pass otherwise — and the window's sums
//! are kept as this rank's chunks only; the sync step averages them (and all-reduces them over dp_replicate). The
//! price is one reduce-scatter per micro-batch instead of per window: (k + 1)Ψ per optimizer step over k
//! micro-batches, 2Ψ without accumulation. The chunks' sums are those of ZeRO-1 in another order (micro-batch
//! sums reduced, rather than reduced sums of micro-batches): equal without accumulation, within fp32 rounding with
//! it.
//!
//! **FULL_SHARD** ([`GradientChunks::ReducedInBackward`]): the parameters themselves are the chunks
//! (`fully_sharded.rs`); the backward pass of each gathered use reduce-scatters its gradient, so the slots hold
//! chunk sums as under ZeRO-2, and nothing is all-gathered after the optimizer step.

use super::strategy::GradientStrategy;
use crate::tensor_parallel::ParamLayout;
use crate::Result;
use candle_core::{Device, Tensor, Var};
use ddp_core::functional::{BackwardGuard, ShardGradient};
pub(crate) use ddp_core::zero::FlatChunk;
use ddp_core::zero::FlatShards;
use ddp_core::{CommHook, ProcessGroup, ReduceOp};

/// Sharded optimizer state (and gradients, [`GradientChunks`]) over dp_shard, replicated over dp_replicate (see
/// the module documentation). The arithmetic (packing, reduce-scatter, hooks, averaging, all-gather) is ddp-core's
/// `zero::FlatShards`, the level-1 `ZeroRedundancyOptimizer`'s too.
#[derive(Debug)]
pub(crate) struct ShardedDataParallel {
    shard: ProcessGroup,
    replicate: ProcessGroup,
    /// The mesh's model-parallel group (pp × tp): norms and overflow.
    model_parallel: ProcessGroup,
    /// How every parameter is cut over dp_shard.
    layout: FlatShards,
    device: Device,
    /// Gradient compression of the reduce-scatter (DDP's hook, the same semantics: half the bytes).
    hook: CommHook,
    /// Whether the slots hold whole gradients until the sync step (ZeRO-1) or this rank's chunks (ZeRO-2,
    /// FULL_SHARD), and who reduced them.
    gradients: GradientChunks,
}

/// What a sharded group's gradient slots hold between micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GradientChunks {
    /// Whole gradients, reduce-scattered on the sync step (ZeRO-1).
    Whole,
    /// Chunks: each micro-batch's (or backward segment's) whole gradients reduce-scattered by
    /// `reduce_micro_batch` (ZeRO-2).
    ReducedPerMicroBatch,
    /// Chunks: the parameters are the chunks, and the backward pass reduce-scatters the gradient of each gathered
    /// use (`ddp_core::functional::gather_shards`; FULL_SHARD).
    ReducedInBackward,
}

impl ShardedDataParallel {
    pub(crate) fn new(
        shard: ProcessGroup,
        replicate: ProcessGroup,
        model_parallel: ProcessGroup,
        layout: FlatShards,
        device: Device,
        hook: CommHook,
        gradients: GradientChunks,
    ) -> Self {
        ShardedDataParallel { shard, replicate, model_parallel, layout, device, hook, gradients }
    }

    fn replicate(&self) -> Option<&ProcessGroup> {
        (self.replicate.world_size() > 1).then_some(&self.replicate)
    }
}

impl GradientStrategy for ShardedDataParallel {
    /// Whole gradients (ZeRO-1) or the window's chunk sums (ZeRO-2, FULL_SHARD) in, this rank's averaged chunks
    /// out (1-D fp32, averaged over dp_shard × dp_replicate). A parameter no micro-batch reached counts as a zero
    /// gradient.
    fn reduce(&self, slots: &mut [Option<Tensor>]) -> Result<()> {
        let reduced = match self.gradients {
            GradientChunks::Whole => {
                self.layout.reduce_scatter_mean(&self.shard, self.replicate(), self.hook, slots, &self.device)?
            }
            _ => self.layout.finish_mean(self.replicate(), self.hook, slots, &self.device)?,
        };
        for (slot, t) in slots.iter_mut().zip(reduced) {
            *slot = Some(t);
        }
        Ok(())
    }

    /// ZeRO-2: the micro-batch's gradients present in `micro` (every rank reached the same parameters: the same
    /// segment of the same model) are reduce-scattered now (summed over dp_shard; under the fp16 hook already
    /// divided, as the hook does) and replaced by this rank's chunks of their sums.
    fn reduce_micro_batch(&self, micro: &mut [Option<Tensor>]) -> Result<()> {
        if self.gradients != GradientChunks::ReducedPerMicroBatch {
            return Ok(());
        }
        let params: Vec<usize> = (0..micro.len()).filter(|&i| micro[i].is_some()).collect();
        if params.is_empty() {
            return Ok(());
        }
        let grads: Vec<Option<&Tensor>> = params.iter().map(|&i| micro[i].as_ref()).collect();
        let bucket = self.layout.subset(&params)?;
        let sums = bucket.reduce_scatter_sum(&self.shard, self.replicate(), self.hook, &grads, &self.device)?;
        for (&i, t) in params.iter().zip(sums) {
            micro[i] = Some(t);
        }
        Ok(())
    }

    fn gradient_chunks(&self) -> Option<&[FlatChunk]> {
        (self.gradients != GradientChunks::Whole).then_some(self.layout.chunks())
    }
    fn norm_group(&self) -> &ProcessGroup {
        &self.model_parallel
    }

    fn chunked_over(&self) -> Option<&ProcessGroup> {
        Some(&self.shard)
    }

    /// FULL_SHARD: summed over dp_shard by each use's backward, compressed as the sync step's reduce-scatter
    /// would be (the fp16 hook divides by every data-parallel rank first, dp_shard × dp_replicate), so the sync
    /// step's `finish_mean` averages as for ZeRO-2's chunk sums.
    fn per_use_reduction(&self, guard: BackwardGuard) -> Option<ShardGradient> {
        (self.gradients == GradientChunks::ReducedInBackward).then(|| ShardGradient {
            guard: Some(guard),
            hook: self.hook,
            fp16_divisor: (self.shard.world_size() * self.replicate.world_size()) as f64,
        })
    }

    /// The chunks' squares summed over dp_shard (every element once), the tp shards' also over tp.
    fn squared_norm(&self, per_param: &[f64], layouts: &[ParamLayout]) -> Result<f64> {
        let mut sums = [0.0f64; 2]; // [tp-sharded, tp-replicated]
        for (sq, layout) in per_param.iter().zip(layouts) {
            match layout {
                ParamLayout::Sharded { .. } => sums[0] += sq,
                ParamLayout::Replicated => sums[1] += sq,
            }
        }
        self.shard.all_reduce(&mut sums, ReduceOp::Sum)?;
        let mut sharded = [sums[0]];
        if self.model_parallel.world_size() > 1 {
            self.model_parallel.all_reduce(&mut sharded, ReduceOp::Sum)?;
        }
        Ok(sharded[0] + sums[1])
    }

    /// Agreed over dp_shard (the ranks hold different chunks) and the model-parallel group.
    fn any_rank(&self, local: bool, _layouts: &[ParamLayout]) -> Result<bool> {
        let mut flag = [i32::from(local)];
        self.shard.all_reduce(&mut flag, ReduceOp::Max)?;
        if self.model_parallel.world_size() > 1 {
            self.model_parallel.all_reduce(&mut flag, ReduceOp::Max)?;
        }
        Ok(flag[0] != 0)
    }

    /// All-gathers the updated chunks (`optimized`) over dp_shard into the whole parameters (`full`, cast to
    /// their dtype); nothing under FULL_SHARD, where the chunks are the parameters.
    fn after_optimizer_step(&self, optimized: &[Var], full: &[Var]) -> Result<()> {
        if self.gradients == GradientChunks::ReducedInBackward {
            return Ok(());
        }
        Ok(self.layout.all_gather_into(&self.shard, optimized, full)?)
    }
}
