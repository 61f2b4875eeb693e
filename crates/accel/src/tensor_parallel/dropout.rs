//! Dropout whose masks do not depend on the layout: the mask of an element is a hash of the run's seed, the
//! micro-step, the dropout site and the element's coordinates *in the single-process model* — its global row in
//! the micro-step's global batch and its index in the unsharded feature dimensions — so one process, every tp
//! shard, every data-parallel replica and every pipeline micro-batch draw exactly the single-process mask for the
//! elements they hold.
//!
//! This is Megatron-LM's model-parallel RNG discipline (`tensor_parallel/random.py`: regions replicated across tp
//! draw the same mask on every tp rank; sharded regions draw a different one per tp rank; every data-parallel rank
//! and micro-batch its own), reached by addressing instead of by seeding: replicated regions hash the same
//! coordinates on every tp rank, so their masks agree; a sharded region hashes the shard's global feature indices,
//! so each tp rank draws its own part of the single-process mask; rows are the micro-step's global rows, so every
//! dp replica and micro-batch draws its own. Counter-based, like the Philox generator PyTorch's CUDA dropout uses
//! (Salmon et al. 2011), so no generator state exists to save: a resumed run draws the masks it would have drawn
//! from the step counter it restores.
//!
//! The coordinates come from a [`DropoutContext`] that the training step sets around each forward pass
//! (`Accelerator::pipeline_backward` and the Trainer's step do, per pipeline micro-batch); outside one — evaluation,
//! generation, a plain forward — [`dropout`] is the identity, as `model.eval()` makes it in PyTorch.

use crate::Result;
use candle_core::Tensor;
use rayon::prelude::*;
use std::cell::Cell;

/// Where the current forward pass sits in the single-process run (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutContext {
    /// The run's seed (`AcceleratorConfig::seed`).
    pub seed: u64,
    /// The micro-step (backward calls since the start of training: the same on every rank, restored on resume).
    pub step: u64,
    /// The global row of this forward's first row in the micro-step's global batch (data-parallel rank × rows per
    /// replica + the pipeline micro-batch's offset).
    pub row_offset: u64,
}

thread_local! {
    static CONTEXT: Cell<Option<DropoutContext>> = const { Cell::new(None) };
}

/// Runs `f` with `ctx` as this thread's dropout context (restored afterwards, also on panic).
pub fn with_dropout_context<R>(ctx: DropoutContext, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<DropoutContext>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CONTEXT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CONTEXT.with(|c| c.replace(Some(ctx))));
    f()
}

/// This thread's dropout context, if a training step set one.
pub fn dropout_context() -> Option<DropoutContext> {
    CONTEXT.with(Cell::get)
}

/// How a tensor's dimension is split over the tp group: `dim` holds `full` features in the single-process model,
/// this rank the ones from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardedDim {
    /// The split dimension (≥ 1: dim 0 is the rows).
    pub dim: usize,
    /// Its size in the single-process model.
    pub full: usize,
    /// The first of this rank's features.
    pub start: usize,
}

/// Inverted dropout of `x` (`[rows, …]`, rows = the forward's batch rows): each element zeroed with probability
/// `p`, the others scaled by `1 / (1 − p)`, the mask drawn from the current [`DropoutContext`] at `site` (a number
/// the model gives each dropout place, e.g. `16 · (layer + 1) + k`); `shard` says which dimension is a tp shard.
/// The identity outside a context, or with `p = 0`. The mask is a constant of the graph: the backward multiplies
/// by it too.
///
/// Errors: `p` outside `[0, 1)`; a scalar `x`; a `shard` dimension out of range or larger than its `full`.
pub fn dropout(x: &Tensor, p: f64, site: u64, shard: Option<ShardedDim>) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        return Err(crate::AccelError::InvalidArgument(format!(
            "dropout: probability {p} is outside [0, 1); 0 turns dropout off"
        )));
    }
    let Some(ctx) = dropout_context() else { return Ok(x.clone()) };
    if p == 0.0 {
        return Ok(x.clone());
    }
    let mask = dropout_mask(x.dims(), p, site, shard, ctx)?;
    let mask = Tensor::from_vec(mask, x.dims(), x.device())?.to_dtype(x.dtype())?;
    Ok((x * mask)?)
}

/// The mask (`0` or `1 / (1 − p)`) of a tensor of `dims` at `site` under `ctx` (see [`dropout`]).
pub fn dropout_mask(
    dims: &[usize],
    p: f64,
    site: u64,
    shard: Option<ShardedDim>,
    ctx: DropoutContext,
) -> Result<Vec<f32>> {
    let Some((&rows, features)) = dims.split_first() else {
        return Err(crate::AccelError::InvalidArgument("dropout: a scalar has no rows to drop".into()));
    };
    // The single-process shape of one row's features.
    let mut global: Vec<usize> = features.to_vec();
    if let Some(s) = shard {
        if s.dim == 0 || s.dim > features.len() || s.start + features[s.dim - 1] > s.full {
            return Err(crate::AccelError::InvalidArgument(format!(
                "dropout: shard {s:?} does not fit a tensor of shape {dims:?} (dimension 1..{} of at most `full` \
                 features from `start`)",
                features.len()
            )));
        }
        global[s.dim - 1] = s.full;
    }
    let per_row: usize = features.iter().product();
    // Each element's index in the single-process row, the same for every row (last dimension fastest).
    let mut cols = Vec::with_capacity(per_row);
    let mut coords = vec![0usize; features.len()];
    for _ in 0..per_row {
        let mut col = 0u64;
        for (d, &c) in coords.iter().enumerate() {
            let c = match shard {
                Some(s) if s.dim - 1 == d => c + s.start,
                _ => c,
            };
            col = col * global[d] as u64 + c as u64;
        }
        cols.push(col.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for d in (0..coords.len()).rev() {
            coords[d] += 1;
            if coords[d] < features[d] {
                break;
            }
            coords[d] = 0;
        }
    }
    let keep_scale = (1.0 / (1.0 - p)) as f32;
    // An element is kept when its uniform draw (53 bits) is at least p.
    let threshold = (p * (1u64 << 53) as f64) as u64;
    let mut mask = vec![0f32; rows * per_row];
    mask.par_chunks_mut(per_row.max(1)).enumerate().for_each(|(r, row)| {
        let row_key = mix(mix(mix(mix(ctx.seed) ^ ctx.step) ^ site) ^ (ctx.row_offset + r as u64));
        for (m, col) in row.iter_mut().zip(&cols) {
            *m = if mix(row_key ^ col) >> 11 >= threshold { keep_scale } else { 0.0 };
        }
    });
    Ok(mask)
}

/// splitmix64's finaliser (Steele et al. 2014): a 64-bit mixing bijection.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    const CTX: DropoutContext = DropoutContext { seed: 7, step: 3, row_offset: 0 };

    #[test]
    fn masks_are_the_single_process_mask_for_every_shard_and_row_range() {
        // [rows 6, seq 4, features 10] in one process.
        let full = dropout_mask(&[6, 4, 10], 0.2, 5, None, CTX).unwrap();
        let at = |r: usize, s: usize, f: usize| full[(r * 4 + s) * 10 + f];
        // A tp shard of features 4..9 of rows 2..5 (a dp replica's rows, from offset 2).
        let shard = ShardedDim { dim: 2, full: 10, start: 4 };
        let ctx = DropoutContext { row_offset: 2, ..CTX };
        let part = dropout_mask(&[3, 4, 5], 0.2, 5, Some(shard), ctx).unwrap();
        for r in 0..3 {
            for s in 0..4 {
                for f in 0..5 {
                    assert_eq!(part[(r * 4 + s) * 5 + f], at(r + 2, s, f + 4), "row {r} pos {s} feature {f}");
                }
            }
        }
        // About p of the elements dropped, the rest scaled by 1 / (1 − p).
        let dropped = full.iter().filter(|&&m| m == 0.0).count() as f64 / full.len() as f64;
        assert!((dropped - 0.2).abs() < 0.06, "dropped {dropped}");
        assert!(full.iter().all(|&m| m == 0.0 || (m - 1.25).abs() < 1e-6));
        // Another site, step or seed draws another mask.
        for other in [
            dropout_mask(&[6, 4, 10], 0.2, 6, None, CTX).unwrap(),
            dropout_mask(&[6, 4, 10], 0.2, 5, None, DropoutContext { step: 4, ..CTX }).unwrap(),
            dropout_mask(&[6, 4, 10], 0.2, 5, None, DropoutContext { seed: 8, ..CTX }).unwrap(),
        ] {
            assert_ne!(other, full);
        }
    }

    #[test]
    fn dropout_is_the_identity_outside_a_training_step_and_checks_its_arguments() {
        let x = Tensor::ones((4, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        let same = dropout(&x, 0.5, 1, None).unwrap();
        assert_eq!(same.to_vec2::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
        let dropped = with_dropout_context(CTX, || dropout(&x, 0.5, 1, None)).unwrap();
        let v: Vec<f32> = dropped.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.contains(&0.0) && v.contains(&2.0), "{v:?}");
        assert_eq!(dropout_context(), None, "the context ends with the call");
        let e = dropout(&x, 1.0, 1, None).unwrap_err().to_string();
        assert!(e.contains("probability 1 is outside [0, 1)"), "{e}");
        let bad = ShardedDim { dim: 1, full: 8, start: 4 };
        let e = with_dropout_context(CTX, || dropout(&x, 0.5, 1, Some(bad))).unwrap_err().to_string();
        assert!(e.contains("does not fit a tensor of shape [4, 8]"), "{e}");
    }
}
