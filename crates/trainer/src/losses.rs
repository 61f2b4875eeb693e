//! Loss functions in the form the trainer needs: the **sum** of per-item losses and the **number of items**
//! ([`LossOutput`]), so the trainer can normalise by the item count of a whole gradient-accumulation window summed
//! across processes. That makes `GA = k` with batch `b` give the same update as `GA = 1` with batch `k·b`, even
//! when the number of target tokens differs between micro-batches — the bug HF fixed in transformers 4.46 (2024),
//! where averaging per-micro-batch means weighted short sequences too much.

use accel::ops::cross_entropy::cross_entropy_sum;
use accel::tensor_parallel::{vocab_parallel_cross_entropy, TensorParallel};
use candle_core::{DType, Tensor, D};

use crate::metrics::IGNORE_INDEX;

/// What a loss function returns for one micro-batch.
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// Scalar (0-d) tensor: the sum of the per-item losses (F32; it carries the autograd graph).
    pub loss_sum: Tensor,
    /// How many items (samples, target tokens) that sum is over.
    pub num_items: usize,
}

impl LossOutput {
    /// A sum of `num_items` per-item losses.
    pub fn new(loss_sum: Tensor, num_items: usize) -> Self {
        LossOutput { loss_sum, num_items }
    }

    /// From a mean over `num_items` items (e.g. `candle_nn::loss::cross_entropy`'s output): sum = mean · n.
    pub fn from_mean(mean: &Tensor, num_items: usize) -> candle_core::Result<Self> {
        Ok(LossOutput { loss_sum: mean.affine(num_items as f64, 0.0)?, num_items })
    }
}

/// A loss function for the trainer: model outputs (F32; the trainer casts bf16/fp16 outputs up first) and targets
/// → [`LossOutput`]. Closures `Fn(&Tensor, &Tensor) -> candle_core::Result<LossOutput>` implement it; the
/// built-in [`CrossEntropy`], [`TokenCrossEntropy`] and [`Mse`] also say whether their item count is fixed per
/// row, which lets the trainer skip one collective per optimizer step.
///
/// The Trainer calls [`Loss::compute_parallel`], which sees the tensor-parallel group; it defaults to
/// [`Loss::compute`] (outputs that are whole on every rank), and [`VocabParallelCrossEntropy`] overrides it for a
/// model whose head leaves the logits split by vocabulary.
pub trait Loss: Send + Sync {
    /// The loss of one micro-batch.
    fn compute(&self, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput>;

    /// The loss of one micro-batch of a model split over the tensor-parallel group `tp` (a one-rank group when
    /// there is no tensor parallelism). Every tp rank sees the same batch and must return the same
    /// [`LossOutput`] (the same sum and count): the Trainer counts items over all ranks, so each tp rank's copy
    /// is counted alike and the normalisation `Σ loss / N` is unchanged. Default: [`Loss::compute`], for outputs
    /// that are whole (replicated) on every tp rank.
    fn compute_parallel(
        &self,
        outputs: &Tensor,
        targets: &Tensor,
        tp: &TensorParallel,
    ) -> candle_core::Result<LossOutput> {
        let _ = tp;
        self.compute(outputs, targets)
    }

    /// Whether `num_items` is always the batch's row count times a constant (one item per sample, or per
    /// element of a fixed-size output). Then, as every rank holds the same number of rows at every step
    /// (`even_batches` or `drop_last`), the window's item count over all ranks is `world_size ×` the local one
    /// and needs no communication. Default false (token-level losses: counts differ between ranks).
    fn items_fixed_per_row(&self) -> bool {
        false
    }

    /// The item count [`Loss::compute`] will return for `targets`, when it is known before the forward pass
    /// (HF's Trainer counts `num_items_in_batch` from the labels the same way). With it the Trainer runs forward
    /// and backward one micro-batch at a time, so memory does not grow with `gradient_accumulation_steps`;
    /// `None` (the default, and what closures give) makes it keep a window's graphs until the count is known.
    fn count_items(&self, targets: &Tensor) -> candle_core::Result<Option<usize>> {
        let _ = targets;
        Ok(None)
    }
}

impl<F> Loss for F
where
    F: Fn(&Tensor, &Tensor) -> candle_core::Result<LossOutput> + Send + Sync,
{
    fn compute(&self, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
        self(outputs, targets)
    }
}

/// [`cross_entropy`] as a [`Loss`] with one item per row.
#[derive(Debug, Clone, Copy, Default)]
pub struct CrossEntropy;

impl Loss for CrossEntropy {
    fn compute(&self, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
        cross_entropy(outputs, targets)
    }
    fn items_fixed_per_row(&self) -> bool {
        true
    }
    fn count_items(&self, targets: &Tensor) -> candle_core::Result<Option<usize>> {
        Ok(Some(targets.dim(0)?))
    }
}

/// [`token_cross_entropy`] as a [`Loss`] (item counts vary with the sequences' lengths).
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenCrossEntropy;

impl Loss for TokenCrossEntropy {
    fn compute(&self, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
        token_cross_entropy(outputs, targets)
    }
    fn count_items(&self, targets: &Tensor) -> candle_core::Result<Option<usize>> {
        Ok(Some(if targets.dtype() == DType::I64 {
            let ignore = Tensor::full(IGNORE_INDEX, targets.shape(), targets.device())?;
            targets.ne(&ignore)?.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize
        } else {
            targets.elem_count()
        }))
    }
}

/// [`mse`] as a [`Loss`] (one item per output element: fixed per row).
#[derive(Debug, Clone, Copy, Default)]
pub struct Mse;

impl Loss for Mse {
    fn compute(&self, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
        mse(outputs, targets)
    }
    fn items_fixed_per_row(&self) -> bool {
        true
    }
    fn count_items(&self, targets: &Tensor) -> candle_core::Result<Option<usize>> {
        Ok(Some(targets.elem_count()))
    }
}

/// Token-level cross entropy of a language model whose head is column-parallel over the vocabulary (Megatron-LM's
/// vocab-parallel cross entropy): `outputs` `[b, s, padded_vocab / tp]` (this rank's logits, F32), `targets`
/// `[b, s]` token ids (u32, or any integer dtype; all `< vocab_size`, no ignore index) → the summed negative
/// log-likelihood over the `b · s` positions. The full logits are never gathered: the max, the sum of
/// exponentials and the target logit are all-reduced over the tp group
/// ([`accel::tensor_parallel::vocab_parallel_cross_entropy`]); padding columns (`≥ vocab_size`) get no
/// probability. One item per target token, a fixed count per row.
///
/// [`Loss::compute`] (no tp group) takes full logits `[b, s, ≥ vocab_size]` and ignores the columns past
/// `vocab_size` (the padding a tp = 1 head does not have, or a gathered padded head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabParallelCrossEntropy {
    /// The unpadded vocabulary size.
    pub vocab_size: usize,
}

impl VocabParallelCrossEntropy {
    fn shapes(&self, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<(usize, usize, usize)> {
        let (b, s, v) = outputs.dims3().map_err(|_| {
            candle_core::Error::Msg(format!(
                "VocabParallelCrossEntropy: outputs must be [batch, seq, vocab shard], got {:?}",
                outputs.dims()
            ))
        })?;
        if targets.dims() != [b, s] {
            candle_core::bail!(
                "VocabParallelCrossEntropy: targets {:?} do not match the outputs' [batch, seq] = [{b}, {s}]",
                targets.dims()
            );
        }
        Ok((b, s, v))
    }
}

impl Loss for VocabParallelCrossEntropy {
    fn compute(&self, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
        let (_, _, v) = self.shapes(outputs, targets)?;
        if v < self.vocab_size {
            candle_core::bail!(
                "VocabParallelCrossEntropy: the outputs have {v} vocabulary columns, fewer than vocab_size = {}; \
                 vocabulary-sharded logits need the tensor-parallel group (Loss::compute_parallel)",
                self.vocab_size
            );
        }
        let full = outputs.narrow(D::Minus1, 0, self.vocab_size)?.contiguous()?;
        token_cross_entropy(&full, &targets.to_dtype(DType::U32)?)
    }

    fn compute_parallel(
        &self,
        outputs: &Tensor,
        targets: &Tensor,
        tp: &TensorParallel,
    ) -> candle_core::Result<LossOutput> {
        let (b, s, v) = self.shapes(outputs, targets)?;
        let per_token = vocab_parallel_cross_entropy(
            &outputs.reshape((b * s, v))?,
            &targets.to_dtype(DType::U32)?.reshape(b * s)?,
            tp,
            self.vocab_size,
        )
        .map_err(|e| match e {
            accel::AccelError::Candle(e) => e,
            e => candle_core::Error::wrap(e),
        })?;
        Ok(LossOutput { loss_sum: per_token.sum_all()?, num_items: b * s })
    }

    fn items_fixed_per_row(&self) -> bool {
        true
    }

    fn count_items(&self, targets: &Tensor) -> candle_core::Result<Option<usize>> {
        Ok(Some(targets.elem_count()))
    }
}

/// Classification cross-entropy, one item per row: `logits` `[b, classes]`, `targets` `[b]` class indices (u8,
/// u32 or i64) → `Σ_i −log softmax(logits_i)[targets_i]` over `b` items. The kernel is accel-nn's
/// ([`accel::ops::cross_entropy::cross_entropy_sum`]: fused on the CPU in f32, candle's ops elsewhere).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
    let (loss_sum, num_items) = cross_entropy_sum(logits, targets, None)?;
    Ok(LossOutput { loss_sum, num_items })
}

/// Token-level cross-entropy for sequences with padding: `logits` `[b, T, vocab]`, `targets` `[b, T]` (I64 with
/// [`IGNORE_INDEX`] = −100 where there is no target, or U32/U8 without padding) → the summed negative
/// log-likelihood over the non-ignored positions, and their count. The same kernel as [`cross_entropy`], with
/// PyTorch's `ignore_index` rule (only i64 targets can hold −100).
pub fn token_cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
    logits.dims3()?;
    let (loss_sum, num_items) = cross_entropy_sum(logits, targets, Some(IGNORE_INDEX))?;
    Ok(LossOutput { loss_sum, num_items })
}

/// Squared error summed over all elements, one item per element (mean = MSE).
pub fn mse(outputs: &Tensor, targets: &Tensor) -> candle_core::Result<LossOutput> {
    let diff = (outputs - targets.to_dtype(outputs.dtype())?)?;
    Ok(LossOutput { loss_sum: diff.sqr()?.sum_all()?, num_items: outputs.elem_count() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cross_entropy_matches_candle_nn_mean_times_rows() {
        let dev = Device::Cpu;
        let logits = Tensor::new(&[[1.0f32, 2.0, 0.5], [0.1, -1.0, 3.0]], &dev).unwrap();
        let targets = Tensor::new(&[1u32, 2], &dev).unwrap();
        let ours = cross_entropy(&logits, &targets).unwrap();
        let mean = candle_nn::loss::cross_entropy(&logits, &targets).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(ours.num_items, 2);
        assert!((ours.loss_sum.to_scalar::<f32>().unwrap() - 2.0 * mean).abs() < 1e-6);
    }

    #[test]
    fn vocab_parallel_cross_entropy_at_tp1_is_token_cross_entropy() {
        let dev = Device::Cpu;
        // [1, 2, 4] logits over a vocabulary of 3 padded to 4 columns (the last is padding, logit 0).
        let logits = Tensor::new(&[[[1.0f32, 2.0, 0.5, 0.0], [0.1, -1.0, 3.0, 0.0]]], &dev).unwrap();
        let targets = Tensor::new(&[[1u32, 2]], &dev).unwrap();
        let reference = token_cross_entropy(&logits.narrow(2, 0, 3).unwrap(), &targets).unwrap();
        let loss = VocabParallelCrossEntropy { vocab_size: 3 };
        let tp = TensorParallel::new(accel::dist::ProcessGroup::single_process().unwrap());
        let expected = reference.loss_sum.to_scalar::<f32>().unwrap();
        // compute: full logits, padding column ignored; compute_parallel: a tp = 1 head has no padding column.
        let unpadded = logits.narrow(2, 0, 3).unwrap();
        for out in [loss.compute(&logits, &targets).unwrap(), loss.compute_parallel(&unpadded, &targets, &tp).unwrap()]
        {
            assert_eq!(out.num_items, 2);
            assert!((out.loss_sum.to_scalar::<f32>().unwrap() - expected).abs() < 1e-6);
        }
        assert_eq!(loss.count_items(&targets).unwrap(), Some(2));
        let err = VocabParallelCrossEntropy { vocab_size: 5 }.compute(&logits, &targets).unwrap_err().to_string();
        assert!(err.contains("4 vocabulary columns, fewer than vocab_size = 5"), "{err}");
        let err = loss.compute(&logits, &Tensor::new(&[1u32, 2], &dev).unwrap()).unwrap_err().to_string();
        assert!(err.contains("targets [2] do not match"), "{err}");
    }

    #[test]
    fn token_cross_entropy_ignores_padding() {
        let dev = Device::Cpu;
        // One sequence of 3 positions over 2 classes; the last target is padding.
        let logits = Tensor::new(&[[[0.0f32, 0.0], [0.0, 2.0f32.ln()], [9.0, -9.0]]], &dev).unwrap();
        let targets = Tensor::new(&[[0i64, 1, IGNORE_INDEX]], &dev).unwrap();
        let out = token_cross_entropy(&logits, &targets).unwrap();
        assert_eq!(out.num_items, 2);
        // −ln(1/2) − ln(2/3)
        let expected = 2f32.ln() + 1.5f32.ln();
        assert!((out.loss_sum.to_scalar::<f32>().unwrap() - expected).abs() < 1e-6);
    }
}
