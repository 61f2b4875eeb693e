//! Which sample indices each rank reads at each step of an epoch: Accelerate's `BatchSamplerShard` rules
//! (`accelerate/data_loader.py`), as pure arithmetic so they can be tested for many `(N, P, batch)` at once.
//!
//! The epoch order (`0..N`, or a seeded permutation) is cut into **global steps** of `G` samples, where
//! `G = batch_size × world_size` without `split_batches` and `G = batch_size` with it. In every step rank `r`
//! takes the contiguous slice `[r·s, (r+1)·s)` of the step, `s = G / world_size`, so concatenating the ranks'
//! batches in rank order (what `gather` does) gives back the step in epoch order — the property that makes
//! `P` processes with batch `b` compute the same averaged gradient as one process with batch `P·b`.
//!
//! The tail (`N % G != 0`):
//! - `drop_last`: the incomplete step is dropped on every rank (`⌊N / G⌋` batches each).
//! - `even_batches` (Accelerate's default) with more than one process: the order is padded to `⌈N / G⌉·G` by reusing samples from the epoch
//!   start (cyclically when `N < G`), so every rank yields `⌈N / G⌉` full batches; the padded samples are
//!   counted ([`ShardBatch::padding`], [`ShardBatch::global_padding`]) so `gather_for_metrics` can trim them.
//! - neither (or a single process, which Accelerate does not shard): the last step is cut short; ranks whose
//!   slice starts past `N` yield one batch fewer.

use crate::{AccelError, Result};

/// The layout of one rank's share of an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    /// Samples in the data set (`N`).
    pub dataset_len: usize,
    /// The configured batch size: per rank without `split_batches`, global with it.
    pub batch_size: usize,
    /// Number of processes (`P`).
    pub world_size: usize,
    /// This process's rank.
    pub rank: usize,
    /// `batch_size` is the global batch, split across ranks.
    pub split_batches: bool,
    /// Pad the tail with samples from the epoch start so every rank yields the same number of full batches
    /// (only when `world_size > 1`: a single process is not sharded, its last batch is just shorter).
    pub even_batches: bool,
    /// Drop the incomplete last step (wins over `even_batches`).
    pub drop_last: bool,
}

/// One batch of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardBatch {
    /// Sample indices, in order.
    pub indices: Vec<usize>,
    /// How many of `indices` (at the end) are `even_batches` duplicates of samples from the epoch start.
    pub padding: usize,
    /// Duplicates in the whole global step (all ranks), all at the end of the rank-ordered concatenation.
    pub global_padding: usize,
    /// Whether this is the last batch this rank yields in the epoch.
    pub is_last: bool,
}

impl ShardSpec {
    /// Checks the layout: non-zero batch, rank in range, divisible global batch under `split_batches`.
    ///
    /// Errors: [`AccelError::Data`] ("data loader: ...") naming the offending values and the fix.
    pub fn validate(&self) -> Result<()> {
        let reason = if self.batch_size == 0 {
            "batch_size must be at least 1".to_string()
        } else if self.world_size == 0 || self.rank >= self.world_size {
            let (rank, world_size) = (self.rank, self.world_size);
            format!("rank {rank} is out of range for world size {world_size} (expected 0..{world_size})")
        } else if self.split_batches && !self.batch_size.is_multiple_of(self.world_size) {
            let (batch_size, world_size) = (self.batch_size, self.world_size);
            format!(
                "split_batches: batch_size {batch_size} is not divisible by the {world_size} processes; use a \
                 multiple of {world_size} or turn split_batches off"
            )
        } else {
            return Ok(());
        };
        Err(AccelError::Data(format!("data loader: {reason}")))
    }

    /// Samples per rank per step (`s`).
    pub fn per_rank_batch_size(&self) -> usize {
        if self.split_batches {
            self.batch_size / self.world_size.max(1)
        } else {
            self.batch_size
        }
    }

    /// Samples per global step over all ranks (`G = s · P`).
    pub fn global_batch_size(&self) -> usize {
        self.per_rank_batch_size() * self.world_size
    }

    /// Whether the tail is padded: `even_batches`, more than one process, and not `drop_last`.
    pub fn pads_tail(&self) -> bool {
        self.even_batches && !self.drop_last && self.world_size > 1
    }

    /// Global steps in the epoch (the batch count of rank 0).
    pub fn num_steps(&self) -> usize {
        let g = self.global_batch_size();
        if g == 0 {
            return 0;
        }
        if self.drop_last {
            self.dataset_len / g
        } else {
            self.dataset_len.div_ceil(g)
        }
    }

    /// Batches this rank yields in an epoch.
    pub fn num_batches(&self) -> usize {
        let (n, g, s) = (self.dataset_len, self.global_batch_size(), self.per_rank_batch_size());
        if g == 0 || self.drop_last || self.pads_tail() {
            return self.num_steps();
        }
        let rem = n % g;
        n / g + usize::from(rem > self.rank * s)
    }

    /// Samples yielded over all ranks that are padding (`num_steps·G − N` when [`Self::pads_tail`], else 0).
    pub fn total_padding(&self) -> usize {
        if !self.pads_tail() {
            0
        } else {
            self.num_steps() * self.global_batch_size() - self.dataset_len
        }
    }

    /// This rank's batch `step` of the epoch whose sample order is `order` (`order.len()` must be
    /// `dataset_len`); `None` past [`Self::num_batches`].
    pub fn batch(&self, order: &[usize], step: usize) -> Option<ShardBatch> {
        debug_assert_eq!(order.len(), self.dataset_len);
        let count = self.num_batches();
        if step >= count {
            return None;
        }
        let (n, g, s) = (self.dataset_len, self.global_batch_size(), self.per_rank_batch_size());
        let start = step * g + self.rank * s;
        let end = start + s;
        let pad_tail = self.pads_tail();
        let take_end = if pad_tail { end } else { end.min(n) };
        // Positions past N wrap to the epoch start: the cyclic reuse of Accelerate's `initial_data`.
        let indices: Vec<usize> = (start..take_end).map(|p| order[p % n]).collect();
        let padding = take_end.saturating_sub(n.max(start));
        let step_end = (step + 1) * g;
        let global_padding = if pad_tail { step_end.saturating_sub(n) } else { 0 };
        Some(ShardBatch { indices, padding, global_padding, is_last: step + 1 == count })
    }

    /// All of this rank's batches of the epoch, in order.
    pub fn batches(&self, order: &[usize]) -> Vec<ShardBatch> {
        (0..self.num_batches()).map_while(|k| self.batch(order, k)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n: usize, b: usize, p: usize, r: usize) -> ShardSpec {
        ShardSpec {
            dataset_len: n,
            batch_size: b,
            world_size: p,
            rank: r,
            split_batches: false,
            even_batches: true,
            drop_last: false,
        }
    }

    #[test]
    fn accelerate_example_ten_samples_two_ranks_batch_four() {
        // Accelerate pads [8, 9] with samples 0..6 so both ranks yield two full batches.
        let order: Vec<usize> = (0..10).collect();
        let r0 = spec(10, 4, 2, 0).batches(&order);
        let r1 = spec(10, 4, 2, 1).batches(&order);
        assert_eq!(r0.iter().map(|b| b.indices.clone()).collect::<Vec<_>>(), vec![vec![0, 1, 2, 3], vec![8, 9, 0, 1]]);
        assert_eq!(r1.iter().map(|b| b.indices.clone()).collect::<Vec<_>>(), vec![vec![4, 5, 6, 7], vec![2, 3, 4, 5]]);
        assert_eq!((r0[1].padding, r1[1].padding, r1[1].global_padding), (2, 4, 6));
        // Without even_batches rank 1 has nothing left for the second step.
        let uneven = ShardSpec { even_batches: false, ..spec(10, 4, 2, 1) };
        assert_eq!(uneven.num_batches(), 1);
        let uneven0 = ShardSpec { even_batches: false, ..spec(10, 4, 2, 0) };
        assert_eq!(uneven0.batches(&order)[1].indices, vec![8, 9]);
    }

    #[test]
    fn split_batches_cuts_the_global_batch() {
        let order: Vec<usize> = (0..7).collect();
        let s = ShardSpec { split_batches: true, ..spec(7, 4, 2, 1) };
        let b = s.batches(&order);
        assert_eq!(b.iter().map(|b| b.indices.clone()).collect::<Vec<_>>(), vec![vec![2, 3], vec![6, 0]]);
        let e = ShardSpec { split_batches: true, ..spec(7, 3, 2, 0) }.validate().unwrap_err().to_string();
        assert_eq!(
            e,
            "data: data loader: split_batches: batch_size 3 is not divisible by the 2 processes; use a multiple of 2 \
             or turn split_batches off"
        );
    }

    #[test]
    fn tiny_data_set_wraps_cyclically() {
        let order = vec![2, 0, 1];
        let b = spec(3, 4, 2, 1).batches(&order);
        assert_eq!(b[0].indices, vec![0, 1, 2, 0]);
        assert_eq!(b[0].padding, 4);
        assert_eq!(b[0].global_padding, 5);
    }
}
