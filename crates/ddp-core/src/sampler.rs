//! [`DistributedSampler`]: which sample indices each rank reads in an epoch, with PyTorch's arithmetic
//! (`torch.utils.data.DistributedSampler`).
//!
//! With `N` samples and `R` replicas: per-rank count `n = ceil(N / R)`, or `ceil((N − R) / R)` with `drop_last`
//! when `N % R != 0`; `total = n · R`. The epoch order is `0..N`, or a permutation seeded by `seed + epoch` when
//! shuffling; it is padded by repeating indices from its start (cyclically) up to `total`, or truncated with
//! `drop_last`. Rank `r` takes `indices[r..total].step_by(R)`.
//!
//! Difference from PyTorch on purpose: the permutation comes from ChaCha8 (Fisher–Yates), not torch's Philox
//! `randperm`, so orders match PyTorch's *rules* (same seed + epoch → same order on every rank) but not its exact
//! sequence.

use crate::{DdpError, ProcessGroup, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Shards `0..len` across replicas, epoch by epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `rank` of `num_replicas`; shuffling on with seed 0 (PyTorch's defaults).
    pub fn new(len: usize, num_replicas: usize, rank: usize) -> Result<Self> {
        if num_replicas == 0 {
            return Err(DdpError::InvalidArgument("DistributedSampler: num_replicas must be at least 1".into()));
        }
        if rank >= num_replicas {
            return Err(DdpError::InvalidArgument(format!(
                "DistributedSampler: rank {rank} is out of range for {num_replicas} replicas (expected 0..{num_replicas})"
            )));
        }
        Ok(DistributedSampler { len, num_replicas, rank, shuffle: true, seed: 0, drop_last: false, epoch: 0 })
    }

    /// A sampler for this process's rank in `pg`.
    pub fn for_group(len: usize, pg: &ProcessGroup) -> Result<Self> {
        Self::new(len, pg.world_size(), pg.rank())
    }

    /// Turns shuffling on or off (default on).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Sets the shuffling seed (default 0). Every rank must use the same seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drops the tail instead of padding so every rank gets the same count (default off).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch; the shuffled order depends on `seed + epoch`, so call it at the start of every epoch.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Number of samples in the data set.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// Samples this rank yields per epoch.
    pub fn num_samples(&self) -> usize {
        let (n, r) = (self.len, self.num_replicas);
        if self.drop_last && n % r != 0 {
            // ceil((N - R) / R), saturating for N < R.
            n.saturating_sub(r).div_ceil(r)
        } else {
            n.div_ceil(r)
        }
    }

    /// Samples over all ranks per epoch (`num_samples · num_replicas`).
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.num_replicas
    }

    /// The indices this rank reads this epoch, in order.
    pub fn indices(&self) -> Vec<usize> {
        let mut order =
            if self.shuffle { epoch_permutation(self.len, self.seed, self.epoch) } else { (0..self.len).collect() };
        let total = self.total_size();
        if order.len() < total && !order.is_empty() {
            let pad = total - order.len();
            let padding: Vec<usize> = order.iter().copied().cycle().take(pad).collect();
            order.extend(padding);
        } else {
            order.truncate(total);
        }
        order.into_iter().skip(self.rank).step_by(self.num_replicas).collect()
    }

    /// This rank's indices cut into batches of `batch_size` (the last one may be shorter).
    pub fn batches(&self, batch_size: usize) -> Result<Vec<Vec<usize>>> {
        if batch_size == 0 {
            return Err(DdpError::InvalidArgument("DistributedSampler::batches: batch_size must be at least 1".into()));
        }
        Ok(self.indices().chunks(batch_size).map(|c| c.to_vec()).collect())
    }
}
/// The shuffled order of an epoch: `0..len` permuted by Fisher–Yates with `ChaCha8Rng::seed_from_u64(seed + epoch)`
/// (wrapping). Every rank computes the same permutation from the same `(seed, epoch)`; the one definition shared by
/// [`DistributedSampler`] and accel's data loader, so both levels visit samples in the same order.
pub fn epoch_permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch)));
    order
}
