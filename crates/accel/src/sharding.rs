//! [`ShardingStrategy`]: what the `dp_shard` group shards — FSDP's names (PyTorch's
//! `torch.distributed.fsdp.ShardingStrategy`, Accelerate's `fsdp_sharding_strategy`) mapped to the ZeRO stages
//! (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5), plus
//! ZeRO stage 1, which FSDP does not name.
//!
//! | name            | ZeRO   | sharded over dp_shard                              | per-rank resting memory (Ψ params) |
//! |-----------------|--------|----------------------------------------------------|------------------------------------|
//! | `NO_SHARD`      | 0      | nothing: DDP over dp_replicate × dp_shard          | params + grads + optimizer         |
//! | `SHARD_OPTIM`   | 1      | optimizer state (AdamW moments, fp32 masters)      | optimizer / N                      |
//! | `SHARD_GRAD_OP` | 2      | optimizer state and gradients                      | (grads + optimizer) / N            |
//! | `FULL_SHARD`    | 3      | optimizer state, gradients and parameters          | everything / N                     |
//!
//! `HYBRID_SHARD` and `_HYBRID_SHARD_ZERO2` are FSDP's names for FULL_SHARD and SHARD_GRAD_OP inside a group,
//! replicated across groups: here that is the mesh (dp_replicate × dp_shard), so they read as FULL_SHARD and
//! SHARD_GRAD_OP. The numbers `1`…`5` are `torch.distributed.fsdp.ShardingStrategy`'s values, which older
//! Accelerate versions write into `FSDP_SHARDING_STRATEGY`.
//!
//! Communication per optimizer step with gradient accumulation over `k` micro-batches (Ψ = model elements):
//! ZeRO-1 reduce-scatters once per window (its gradients are whole on every rank until then) and all-gathers the
//! updated chunks: 2Ψ, as DDP. ZeRO-2 reduce-scatters every micro-batch (so no rank ever holds a window's whole
//! gradient sums): (k + 1)Ψ.

use crate::{AccelError, Result};

/// What sharded data parallelism (`dp_shard_size > 1`) shards (module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ShardingStrategy {
    /// Nothing: the dp_shard group is one more data-parallel dimension of DDP (FSDP's `NO_SHARD`).
    NoShard,
    /// ZeRO stage 1: each rank keeps the optimizer state (and fp32 masters) of its 1/N chunk of every parameter
    /// (`SHARD_OPTIM`; PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed stage 1).
    ShardOptim,
    /// ZeRO stage 2: optimizer state and gradients (FSDP's `SHARD_GRAD_OP`, DeepSpeed stage 2). The default: it
    /// trains any model unchanged, where FULL_SHARD needs the model built from `PreparedModel::param_builder`.
    #[default]
    ShardGradOp,
    /// ZeRO stage 3: optimizer state, gradients and parameters (FSDP's `FULL_SHARD`): the parameters rest as this
    /// rank's dp_shard chunks and are gathered at each use. The model must be built for training from
    /// [`crate::PreparedModel::param_builder`] after `prepare_model` (its weights built inside the forward, so each
    /// use gathers them; a candle `VarBuilder` model keeps its weights and is refused), its units checkpointed
    /// ([`crate::activation_checkpoint::unit`]) so that a unit's gathered weights live only while it runs.
    FullShard,
}

impl ShardingStrategy {
    /// Every accepted spelling, for error messages.
    pub const NAMES: &'static str = "NO_SHARD, SHARD_OPTIM (ZeRO-1), SHARD_GRAD_OP (ZeRO-2), FULL_SHARD (ZeRO-3), \
                                     HYBRID_SHARD, _HYBRID_SHARD_ZERO2, or torch's numbers 1-5";

    /// FSDP's name (`SHARD_OPTIM` for ZeRO-1).
    pub fn name(self) -> &'static str {
        match self {
            ShardingStrategy::NoShard => "NO_SHARD",
            ShardingStrategy::ShardOptim => "SHARD_OPTIM",
            ShardingStrategy::ShardGradOp => "SHARD_GRAD_OP",
            ShardingStrategy::FullShard => "FULL_SHARD",
        }
    }

    /// The ZeRO stage (0 = no sharding).
    pub fn zero_stage(self) -> u8 {
        match self {
            ShardingStrategy::NoShard => 0,
            ShardingStrategy::ShardOptim => 1,
            ShardingStrategy::ShardGradOp => 2,
            ShardingStrategy::FullShard => 3,
        }
    }

    /// Whether gradients live only as this rank's chunks (ZeRO-2 and above).
    pub fn shards_gradients(self) -> bool {
        self.zero_stage() >= 2
    }
}

impl std::fmt::Display for ShardingStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ShardingStrategy {
    type Err = AccelError;

    /// FSDP's names (case-insensitive, `-` read as `_`), `SHARD_OPTIM`, or torch's enum values `1`…`5`.
    fn from_str(s: &str) -> Result<Self> {
        let key = s.trim().to_ascii_uppercase().replace('-', "_");
        Ok(match key.trim_start_matches('_') {
            "NO_SHARD" | "3" => ShardingStrategy::NoShard,
            "SHARD_OPTIM" => ShardingStrategy::ShardOptim,
            "SHARD_GRAD_OP" | "HYBRID_SHARD_ZERO2" | "2" | "5" => ShardingStrategy::ShardGradOp,
            "FULL_SHARD" | "HYBRID_SHARD" | "1" | "4" => ShardingStrategy::FullShard,
            _ => {
                return Err(AccelError::InvalidArgument(format!(
                    "unknown sharding strategy {s:?}: use one of {}",
                    ShardingStrategy::NAMES
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::ShardingStrategy::{self, *};

    #[test]
    fn reads_fsdp_names_torch_numbers_and_zero_1_and_refuses_others_listing_them() {
        for (s, want) in [
            ("FULL_SHARD", FullShard),
            ("full-shard", FullShard),
            ("HYBRID_SHARD", FullShard),
            ("1", FullShard),
            ("SHARD_GRAD_OP", ShardGradOp),
            ("_HYBRID_SHARD_ZERO2", ShardGradOp),
            ("2", ShardGradOp),
            ("NO_SHARD", NoShard),
            ("3", NoShard),
            ("shard_optim", ShardOptim),
        ] {
            assert_eq!(s.parse::<ShardingStrategy>().unwrap(), want, "{s}");
        }
        for s in [NoShard, ShardOptim, ShardGradOp, FullShard] {
            assert_eq!(s.name().parse::<ShardingStrategy>().unwrap(), s);
        }
        let e = "ZERO".parse::<ShardingStrategy>().unwrap_err().to_string();
        assert!(e.contains("unknown sharding strategy \"ZERO\": use one of NO_SHARD, SHARD_OPTIM (ZeRO-1)"), "{e}");
        assert_eq!(ShardingStrategy::default(), ShardGradOp);
        assert_eq!([NoShard, ShardOptim, ShardGradOp, FullShard].map(ShardingStrategy::zero_stage), [0, 1, 2, 3]);
    }
}
