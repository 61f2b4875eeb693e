//! FULL_SHARD (ZeRO stage 3; Rajbhandari et al. 2020 §5.3; PyTorch FSDP, Zhao et al. 2023): a prepared model
//! whose parameters rest as this rank's 1-D chunks over `dp_shard` and are made whole only for a use.
//!
//! candle has no module hooks and its autograd graph keeps every tensor a backward needs, so FSDP's "unshard before
//! the unit's forward, reshard after it" is built from two pieces:
//!
//! - **Gathering at each use**: `PreparedModel::param_builder` hands the model a builder whose every parameter
//!   request all-gathers the chunks (`ddp_core::functional::gather_shards`, whose backward reduce-scatters the
//!   gradient into the chunk). A model builds its parts from it inside the forward that uses them (the char-GPT
//!   holds its parts as "gathered at each forward" when its builder gathers).
//! - **Units**: a block built inside `accel::activation_checkpoint::unit` keeps neither its gathered weights nor its
//!   activations after its forward (checkpointed); the backward pass gathers and recomputes it, and its weights'
//!   gradients are reduce-scattered before the backward moves to the unit before it — FSDP's reshard after
//!   forward, its backward prefetch replaced by the recomputation's own gather.
//!
//! So between steps a rank holds 1/dp_shard of the parameters, their gradients and their optimizer state; during a
//! recorded (segmented) backward, the whole weights of one unit at a time plus those outside any unit (the
//! embeddings and the head). Communication per micro-batch: an all-gather of the model for the forward, one more
//! for each unit's recomputation and a reduce-scatter of the gradients — 3Ψ as FSDP's (ZeRO paper §7.2.2).
//!
//! A gathered weight is a copy of the chunks at that moment: one kept past an optimizer step would train the
//! stale value: the gather's backward guard makes that an error at the backward pass that reaches it.

use super::PreparedModel;
use crate::{AccelError, Result};
use candle_core::Tensor;
use ddp_core::functional::{BackwardGuard, ShardGradient};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Counts the optimizer steps a FULL_SHARD model took, so a gathered weight knows whether it is still current.
#[derive(Debug, Default)]
pub(crate) struct Generation(AtomicU64);

impl Generation {
    pub(crate) fn advance(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn current(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl PreparedModel {
    /// Parameter `i` of a FULL_SHARD model, whole (this rank's tp piece) in `dtype`: its chunks all-gathered over
    /// `dp_shard` now, the gradient reduce-scattered back by the backward pass (compressed as the run's
    /// `comm_hook` says, with the same arithmetic as ZeRO-2's reduce-scatter: the sync step then averages as for
    /// it), checked not to be stale there.
    pub(super) fn gathered(&self, i: usize, dtype: candle_core::DType) -> Result<Tensor> {
        let (group, chunks) = self
            .inner
            .sharding
            .as_ref()
            .ok_or_else(|| AccelError::Usage("gathered: the model is not fully sharded".into()))?;
        let (name, gathered_at, generation) =
            (self.inner.names[i].clone(), self.inner.generation.current(), self.inner.generation.clone());
        let guard: BackwardGuard = Arc::new(move || {
            if generation.current() == gathered_at {
                return Ok(());
            }
            Err(format!(
                "FULL_SHARD: parameter `{name}` was gathered before optimizer step {} and used after it (a stale \
                 copy); build the model's parts from model.param_builder() inside the forward that uses them, not \
                 once before training (CharGpt does; a candle layer built from a VarBuilder keeps its weights)",
                gathered_at + 1
            ))
        });
        let chunk = self.inner.optimized[i].as_tensor();
        let (hook, ranks) = self.inner.shard_reduction;
        let how = ShardGradient { guard: Some(guard), hook, fp16_divisor: ranks as f64 };
        let whole = ddp_core::functional::gather_shards_with(chunk, group, how)?;
        Ok(chunks[i].unslice(&whole, &self.inner.local_dims[i])?.to_dtype(dtype)?)
    }
}
