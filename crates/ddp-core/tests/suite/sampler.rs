//! DistributedSampler against PyTorch's `torch.utils.data.DistributedSampler` rules (property tests).
//!
//! Reference arithmetic (torch/utils/data/distributed.py): `num_samples = ceil((N − R) / R)` when `drop_last`
//! and `N % R != 0`, else `ceil(N / R)`; `total = num_samples · R`; the epoch order is padded by repeating its
//! head cyclically, or truncated; rank r takes `order[r : total : R]`.

use ddp_core::DistributedSampler;
use proptest::prelude::*;
use std::collections::HashSet;

/// PyTorch's formula evaluated in floating point, as Python does (`math.ceil` of a true division).
fn torch_num_samples(n: usize, r: usize, drop_last: bool) -> usize {
    let v = if drop_last && !n.is_multiple_of(r) {
        ((n as f64 - r as f64) / r as f64).ceil()
    } else {
        (n as f64 / r as f64).ceil()
    };
    // math.ceil(-0.5) is 0 in Python (N < R with drop_last): no sample for any rank.
    v.max(0.0) as usize
}

fn samplers(n: usize, r: usize, shuffle: bool, seed: u64, drop_last: bool, epoch: u64) -> Vec<DistributedSampler> {
    (0..r)
        .map(|rank| {
            let mut s = DistributedSampler::new(n, r, rank).unwrap().shuffle(shuffle).seed(seed).drop_last(drop_last);
            s.set_epoch(epoch);
            s
        })
        .collect()
}

/// Interleaves the shards back into the global (padded or truncated) order: `global[j·R + r] = shard_r[j]`.
fn global_order(shards: &[Vec<usize>]) -> Vec<usize> {
    let per = shards[0].len();
    assert!(shards.iter().all(|s| s.len() == per), "every rank must get the same count");
    (0..per).flat_map(|j| shards.iter().map(move |s| s[j])).collect()
}

fn shards(n: usize, r: usize, shuffle: bool, seed: u64, drop_last: bool, epoch: u64) -> Vec<Vec<usize>> {
    samplers(n, r, shuffle, seed, drop_last, epoch).iter().map(|s| s.indices()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn lengths_follow_pytorch(n in 0usize..500, r in 1usize..9, drop_last: bool, shuffle: bool, seed: u64, epoch in 0u64..5) {
        let want = torch_num_samples(n, r, drop_last);
        for s in samplers(n, r, shuffle, seed, drop_last, epoch) {
            prop_assert_eq!(s.num_samples(), want);
            prop_assert_eq!(s.total_size(), want * r);
            prop_assert_eq!(s.indices().len(), want);
            prop_assert_eq!(s.dataset_len(), n);
        }
    }

    #[test]
    fn shards_disjoint_before_padding_and_cover_the_data_set(
        n in 0usize..500, r in 1usize..9, shuffle: bool, seed: u64, epoch in 0u64..5,
    ) {
        let global = global_order(&shards(n, r, shuffle, seed, false, epoch));
        // The first N positions are a permutation of 0..N: disjoint shards whose union is the data set.
        let head: HashSet<usize> = global[..n].iter().copied().collect();
        prop_assert_eq!(head.len(), n);
        prop_assert!(global.iter().all(|&i| i < n));
        // The padding repeats the order's head, cyclically (also when N < R and it wraps several times).
        for (p, &i) in global.iter().enumerate().skip(n) {
            prop_assert_eq!(i, global[p % n]);
        }
    }

    #[test]
    fn drop_last_truncates_to_distinct_indices(n in 0usize..500, r in 1usize..9, shuffle: bool, seed: u64) {
        let global = global_order(&shards(n, r, shuffle, seed, true, 0));
        let distinct: HashSet<usize> = global.iter().copied().collect();
        prop_assert_eq!(distinct.len(), global.len());
        prop_assert!(global.iter().all(|&i| i < n));
        prop_assert_eq!(global.len(), torch_num_samples(n, r, true) * r);
        prop_assert!(n - global.len() < r, "drops fewer than R samples");
    }

    #[test]
    fn no_shuffle_is_strided_range(n in 1usize..500, r in 1usize..9, drop_last: bool, seed: u64, epoch in 0u64..5) {
        for (rank, s) in samplers(n, r, false, seed, drop_last, epoch).iter().enumerate() {
            let want: Vec<usize> = (rank..s.total_size()).step_by(r).map(|i| i % n).collect();
            prop_assert_eq!(s.indices(), want);
        }
    }

    #[test]
    fn same_seed_same_order_and_epoch_changes_it(n in 10usize..500, r in 1usize..9, seed: u64, epoch in 0u64..100) {
        let a = global_order(&shards(n, r, true, seed, false, epoch));
        let b = global_order(&shards(n, r, true, seed, false, epoch));
        prop_assert_eq!(&a, &b);
        // A different permutation of ≥ 10 elements by chance has probability ≤ 1/10! per case.
        let next = global_order(&shards(n, r, true, seed, false, epoch + 1));
        prop_assert_ne!(&a[..n], &next[..n]);
    }

    #[test]
    fn batches_chunk_the_indices(n in 0usize..300, r in 1usize..5, bs in 1usize..40, seed: u64) {
        let s = DistributedSampler::new(n, r, 0).unwrap().seed(seed);
        let batches = s.batches(bs).unwrap();
        prop_assert!(batches.iter().all(|b| !b.is_empty() && b.len() <= bs));
        prop_assert!(batches.iter().rev().skip(1).all(|b| b.len() == bs), "only the last batch may be short");
        prop_assert_eq!(batches.concat(), s.indices());
    }
}

#[test]
fn padding_wraps_cyclically_when_fewer_samples_than_ranks() {
    // N = 2, R = 5, no shuffle: order 0, 1 padded cyclically to 5 → ranks get 0, 1, 0, 1, 0.
    let got: Vec<Vec<usize>> = shards(2, 5, false, 0, false, 0);
    assert_eq!(got, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
    // With drop_last nobody gets anything (ceil((2 − 5) / 5) = 0).
    assert!(shards(2, 5, false, 0, true, 0).iter().all(Vec::is_empty));
}

#[test]
fn pytorch_worked_example() {
    // N = 10, R = 3: ceil(10/3) = 4 per rank, total 12, pad with 0, 1; rank 1 takes positions 1, 4, 7, 10.
    let s = DistributedSampler::new(10, 3, 1).unwrap().shuffle(false);
    assert_eq!(s.indices(), vec![1, 4, 7, 0]);
    // drop_last: ceil((10 − 3)/3) = 3 per rank, total 9: rank 2 takes 2, 5, 8.
    let s = DistributedSampler::new(10, 3, 2).unwrap().shuffle(false).drop_last(true);
    assert_eq!(s.indices(), vec![2, 5, 8]);
}

#[test]
fn invalid_arguments_are_errors_naming_the_problem() {
    let e = DistributedSampler::new(10, 2, 2).unwrap_err().to_string();
    assert!(e.contains("rank 2 is out of range for 2 replicas"), "{e}");
    let e = DistributedSampler::new(10, 0, 0).unwrap_err().to_string();
    assert!(e.contains("num_replicas must be at least 1"), "{e}");
    let e = DistributedSampler::new(10, 1, 0).unwrap().batches(0).unwrap_err().to_string();
    assert!(e.contains("batch_size must be at least 1"), "{e}");
}
