//! Vocab-parallel cross entropy (Megatron-LM `tensor_parallel/cross_entropy.py`,
//! `_VocabParallelCrossEntropy`).
//!
//! With the logits split by vocabulary over the tp group, `loss = log Σ_v exp(z_v − m) − (z_t − m)` needs three
//! reductions over the group instead of the full `[n, vocab]` logits: the row max `m` (all-reduce MAX, outside
//! the graph: the loss does not depend on it, it only keeps `exp` in range), the sum of exponentials and the
//! target's logit (each through *g*, `reduce_from_group`, whose backward is the identity — so each rank's logit
//! shard gets `softmax − onehot` of its own columns and nothing is communicated in the backward).

use super::layers::{check_ids, local_ids};
use super::TensorParallel;
use crate::{AccelError, Result};
use candle_core::{DType, Tensor, D};
use ddp_core::functional::reduce_from_group;
use ddp_core::ReduceOp;

/// Per-token cross entropy from vocabulary-sharded logits, without gathering them: the max, the sum of
/// exponentials and the target's logit are all-reduced over the tp group (the max without gradient).
///
/// `logits`: `[n, padded_vocab / tp]` (this rank's columns of a column-parallel head; any float dtype, computed
/// in f32); `targets`: `[n]` u32 ids `< vocab_size`; `vocab_size`: the unpadded vocabulary — columns at or past it
/// are padding and get probability 0. Returns `[n]` f32 losses (`−log softmax(logits)[target]`), the same on
/// every tp rank; their gradient reaches each rank's logit shard only.
///
/// Errors: logits not 2-d or not `vocab_size.div_ceil(tp)` columns wide, targets not `[n]`, a target ≥
/// `vocab_size`, a failed collective.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    tp: &TensorParallel,
    vocab_size: usize,
) -> Result<Tensor> {
    let (n, cols) = logits.dims2().map_err(|_| {
        AccelError::InvalidArgument(format!(
            "vocab_parallel_cross_entropy: logits must be [n, padded_vocab / tp], got shape {:?} (flatten the \
             batch and sequence dims first)",
            logits.dims()
        ))
    })?;
    let (size, rank) = (tp.size(), tp.rank());
    let expected = vocab_size.div_ceil(size);
    if cols != expected {
        return Err(AccelError::InvalidArgument(format!(
            "vocab_parallel_cross_entropy: logits have {cols} columns, but a vocabulary of {vocab_size} over tp \
             size {size} gives {expected} per rank ({} padded)",
            expected * size
        )));
    }
    if targets.dims() != [n] {
        return Err(AccelError::InvalidArgument(format!(
            "vocab_parallel_cross_entropy: targets must be [{n}] (one id per logits row), got shape {:?}",
            targets.dims()
        )));
    }
    let targets = check_ids(targets, vocab_size, "vocab_parallel_cross_entropy")?;
    let group = tp.group();
    let device = logits.device();
    let start = rank * cols;

    let mut logits = logits.to_dtype(DType::F32)?;
    // Padding columns (global index ≥ vocab_size) get −inf: exp gives 0, so probability 0 and zero gradient.
    let valid = cols.min(vocab_size.saturating_sub(start));
    if valid < cols {
        let col_mask = Tensor::arange(0u32, cols as u32, device)?.lt(valid as f64)?;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, device)?.broadcast_as((n, cols))?;
        logits = col_mask.broadcast_as((n, cols))?.where_cond(&logits, &neg_inf)?;
    }

    // The row max over the whole vocabulary, without gradient (the loss is invariant to it).
    let local_max = logits.detach().max_keepdim(D::Minus1)?;
    let max = group.all_reduce_tensor(&local_max, ReduceOp::Max)?;
    let shifted = logits.broadcast_sub(&max)?;

    let sum_exp = reduce_from_group(&shifted.exp()?.sum(D::Minus1)?, group)?;

    // The target's shifted logit lives on one rank; the others contribute 0. `where_cond` rather than a product
    // with the mask: a clamped lookup may land on a −inf padding column, and −inf · 0 is NaN.
    let (owned, local) = local_ids(&targets, start, cols)?;
    let picked = shifted.gather(&local.unsqueeze(1)?, 1)?.squeeze(1)?;
    let picked = owned.where_cond(&picked, &Tensor::zeros(n, DType::F32, device)?)?;
    let target_logit = reduce_from_group(&picked, group)?;

    Ok(sum_exp.log()?.sub(&target_logit)?)
}
