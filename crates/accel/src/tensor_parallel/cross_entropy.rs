//! Vocab-parallel cross entropy (Megatron-LM `tensor_parallel/cross_entropy.py`).
//!
//! TODO(helper tp-layers): implement.

use super::TensorParallel;
use crate::Result;
use candle_core::Tensor;

/// Per-token cross entropy from vocabulary-sharded logits, without gathering them: the max, the sum of
/// exponentials and the target's logit are all-reduced over the tp group (the max without gradient).
///
/// `logits`: `[n, padded_vocab / tp]` (this rank's columns of a column-parallel head; any float dtype, computed
/// in f32); `targets`: `[n]` u32 ids `< vocab_size`; `vocab_size`: the unpadded vocabulary — columns at or past it
/// are padding and get probability 0. Returns `[n]` f32 losses (`−log softmax(logits)[target]`), the same on
/// every tp rank; their gradient reaches each rank's logit shard only.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    tp: &TensorParallel,
    vocab_size: usize,
) -> Result<Tensor> {
    let _ = (logits, targets, tp, vocab_size);
    todo!()
}
