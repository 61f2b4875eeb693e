//! [`GradientReduction`]: how one group of a model's parameters has its gradients reduced across ranks on a
//! sync step.
//!
//! A prepared model is a list of parameter groups, each with its own reduction. Today every parameter is
//! replicated on every rank (data parallelism), so a model has one group reduced by DDP's bucketed all-reduce.
//! N-D parallelism adds variants here, and nothing else in the step changes: sharded data parallelism
//! reduce-scatters over the `dp_shard` group (ZeRO, Rajbhandari et al. 2020; FSDP), and a tensor-parallel shard
//! is all-reduced over the data-parallel group only — never over its tensor-parallel peers, whose shards are
//! different parameters (Megatron-LM, Shoeybi et al. 2019).

use crate::Result;
use candle_core::Tensor;
use ddp_core::DistributedDataParallel;

/// The reduction of one parameter group (see the module documentation).
#[derive(Debug)]
#[non_exhaustive]
pub enum GradientReduction {
    /// Replicated parameters: averaged over all ranks of the process group by DDP (reverse-order buckets, each
    /// read from the slots and written into new ones by the all_reduce; Li et al., VLDB 2020).
    AllReduce(DistributedDataParallel),
}

impl GradientReduction {
    /// Reduces the group's gradient slots in place (slot `i` = the group's `i`-th parameter). Collective over the
    /// group's process group.
    pub(crate) fn reduce(&self, slots: &mut [Option<Tensor>]) -> Result<()> {
        match self {
            GradientReduction::AllReduce(ddp) => Ok(ddp.reduce_gradients(slots)?),
        }
    }
}
