//! Uneven pipeline splits: how many blocks each pp rank holds when the machines differ.
//!
//! With one stage per rank (GPipe, 1F1B), each rank's memory and time per micro-batch grow with its blocks. A rank
//! can hold at most `cap_r` blocks — the most whose predicted peak fits its smallest process's usable memory
//! ([`capacities`]) — and the pipeline runs at the pace of its slowest rank. [`balance`] gives every rank one block
//! (a stage without blocks would only relay activations, and a program builds a stage's parameters from its
//! blocks), then hands the rest out one at a time, each to the rank that would finish its micro-batch soonest with
//! it and still has room: the greedy
//! rule that minimises the slowest rank's time for blocks of equal cost (each block costs a rank the same extra
//! time whatever it already holds), within the capacities. A smaller machine so gets fewer blocks when its memory
//! binds, a slower one when its speed does; on equal machines the split comes out even, the embedding's and the
//! head's ranks taking fewer blocks when their extra work is worth one.
//!
//! Interleaved schedules keep the even split: their stages loop over the ranks, and accel's
//! `pipeline_stages(n, Some(list))` lists stages, not ranks.

/// For each rank, the most blocks (up to `n_layer`) whose memory `fits(rank, blocks)`; `None` when a rank does
/// not fit even without blocks. Memory grows with blocks, so the scan stops at the first that does not fit.
pub(crate) fn capacities(ranks: usize, n_layer: usize, fits: impl Fn(usize, usize) -> bool) -> Vec<Option<usize>> {
    (0..ranks).map(|r| (0..=n_layer).take_while(|&n| fits(r, n)).last()).collect()
}

/// `n_layer` blocks over ranks of capacities `caps`: one each, the rest each to the rank whose `time(rank, blocks)`
/// with it is the smallest (the lowest rank on ties); `None` when the capacities hold fewer than `n_layer` blocks,
/// a rank cannot hold one, or there are fewer blocks than ranks.
pub(crate) fn balance(n_layer: usize, caps: &[usize], time: impl Fn(usize, usize) -> f64) -> Option<Vec<usize>> {
    if caps.iter().sum::<usize>() < n_layer || caps.contains(&0) || n_layer < caps.len() {
        return None;
    }
    let mut counts = vec![1; caps.len()];
    for _ in caps.len()..n_layer {
        let (r, _) = (0..caps.len()).filter(|&r| counts[r] < caps[r]).map(|r| (r, time(r, counts[r] + 1))).fold(
            None,
            |best: Option<(usize, f64)>, (r, t)| match best {
                Some((_, bt)) if bt <= t => best,
                _ => Some((r, t)),
            },
        )?;
        counts[r] += 1;
    }
    Some(counts)
}
