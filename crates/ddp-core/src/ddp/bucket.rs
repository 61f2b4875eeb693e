//! Bucket assignment: which parameters' gradients travel together in one all_reduce.
//!
//! Follows PyTorch's `compute_bucket_assignment_by_size` (torch/csrc/distributed/c10d/reducer.cpp) as DDP calls
//! it: parameters are visited in *reverse* registration order (an approximation of the order backward produces
//! their gradients), one open bucket per dtype, the first bucket of each dtype capped at `first_cap_bytes` and
//! every later one at `cap_bytes`. Buckets are then ordered by the position of their first parameter in that
//! visiting order, which is the order they are all-reduced in.
//!
//! One difference on purpose: PyTorch closes a bucket once it *reaches* its cap, so a bucket may overshoot by one
//! tensor; here a parameter that would overflow a non-empty bucket starts a new one, so every bucket holding
//! more than one parameter stays within its cap. A parameter larger than the cap gets a bucket of its own.

/// One bucket: parameters (registration indices) of a single dtype, reduced by one all_reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// Parameter indices in bucket order (reverse registration order).
    pub params: Vec<usize>,
    /// Total size of the parameters, bytes.
    pub bytes: usize,
}

/// Assigns parameters to buckets.
///
/// `params[i] = (size in bytes, dtype)` of parameter `i` in registration order. Returns each bucket's parameter
/// indices, in communication order; within a bucket, indices are in reverse registration order. Caps are in
/// bytes; a cap of 0 puts every parameter in its own bucket.
#[cfg(test)]
fn compute_bucket_layout<D: Copy + Eq>(
    params: &[(usize, D)],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> Vec<Vec<usize>> {
    assign(params, first_cap_bytes, cap_bytes).into_iter().map(|b| b.params).collect()
}

pub(crate) fn assign<D: Copy + Eq>(params: &[(usize, D)], first_cap_bytes: usize, cap_bytes: usize) -> Vec<Bucket> {
    let order: Vec<usize> = (0..params.len()).rev().collect();
    assign_in_order(params, &order, &vec![0; params.len()], first_cap_bytes, cap_bytes)
}

/// Like [`assign`], visiting the parameters in `order` (a permutation of the registration indices) instead of
/// reverse registration order, and closing every open bucket where `stage` (one value per visited position,
/// non-decreasing) changes: no bucket holds parameters of two stages. The overlapped backward uses it with the
/// order in which gradients become final and the backward segment after which each one does, so a bucket is
/// complete as soon as its segment is (PyTorch rebuilds its buckets after the first iteration for the same
/// reason).
pub(crate) fn assign_in_order<D: Copy + Eq>(
    params: &[(usize, D)],
    order: &[usize],
    stage: &[usize],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> Vec<Bucket> {
    struct Open<D> {
        dtype: D,
        bucket: Bucket,
        /// Whether this dtype has already closed a bucket (its next ones get `cap_bytes`).
        closed_one: bool,
    }
    // (visiting position of the first parameter, bucket): sorted at the end.
    let mut done: Vec<(usize, Bucket)> = Vec::new();
    let mut open: Vec<Open<D>> = Vec::new();
    let mut first_pos: Vec<usize> = Vec::new();
    let close = |o: &mut Open<D>, pos: usize, done: &mut Vec<(usize, Bucket)>| {
        let b = std::mem::replace(&mut o.bucket, Bucket { params: Vec::new(), bytes: 0 });
        done.push((pos, b));
        o.closed_one = true;
    };
    for (pos, &index) in order.iter().enumerate() {
        if pos > 0 && stage[pos] != stage[pos - 1] {
            for (slot, o) in open.iter_mut().enumerate() {
                if !o.bucket.params.is_empty() {
                    close(o, first_pos[slot], &mut done);
                }
            }
        }
        let (bytes, dtype) = params[index];
        let slot = match open.iter().position(|o| o.dtype == dtype) {
            Some(s) => s,
            None => {
                open.push(Open { dtype, bucket: Bucket { params: Vec::new(), bytes: 0 }, closed_one: false });
                first_pos.push(pos);
                open.len() - 1
            }
        };
        let o = &mut open[slot];
        let cap = if o.closed_one { cap_bytes } else { first_cap_bytes };
        if !o.bucket.params.is_empty() && o.bucket.bytes + bytes > cap {
            close(o, first_pos[slot], &mut done);
        }
        let o = &mut open[slot];
        if o.bucket.params.is_empty() {
            first_pos[slot] = pos;
        }
        o.bucket.params.push(index);
        o.bucket.bytes += bytes;
        let cap = if o.closed_one { cap_bytes } else { first_cap_bytes };
        if o.bucket.bytes >= cap {
            close(o, first_pos[slot], &mut done);
        }
    }
    for (slot, o) in open.iter_mut().enumerate() {
        if !o.bucket.params.is_empty() {
            close(o, first_pos[slot], &mut done);
        }
    }
    done.sort_by_key(|(pos, _)| *pos);
    done.into_iter().map(|(_, b)| b).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn first_bucket_small_then_big_in_reverse_order() {
        // Ten 0.5 MiB parameters: first bucket holds 2 (1 MiB), then 2 MiB buckets of 4.
        let p = vec![(MIB / 2, 'f'); 10];
        let got = compute_bucket_layout(&p, MIB, 2 * MIB);
        assert_eq!(got, vec![vec![9, 8], vec![7, 6, 5, 4], vec![3, 2, 1, 0]]);
    }

    #[test]
    fn oversized_parameter_gets_its_own_bucket() {
        let p = vec![(100, 'f'), (5 * MIB, 'f'), (100, 'f'), (100, 'f')];
        let got = compute_bucket_layout(&p, MIB, 2 * MIB);
        // Visiting 3, 2 (first bucket, 200 B), then 1 would overflow it: close; 1 alone ≥ cap: its own bucket.
        assert_eq!(got, vec![vec![3, 2], vec![1], vec![0]]);
    }

    #[test]
    fn never_exceeds_cap_with_more_than_one_parameter() {
        let p = vec![(600, 'f'), (600, 'f'), (600, 'f')];
        let got = assign(&p, 1000, 1000);
        assert_eq!(got.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![2], vec![1], vec![0]]);
        assert!(got.iter().all(|b| b.bytes <= 1000));
    }

    #[test]
    fn dtypes_are_bucketed_separately_and_ordered_by_first_visit() {
        // Registration: 0 f32, 1 f16, 2 f32, 3 f16. Visiting 3 (f16), 2 (f32), 1 (f16), 0 (f32).
        let p = vec![(10, 'f'), (10, 'h'), (10, 'f'), (10, 'h')];
        let got = compute_bucket_layout(&p, MIB, MIB);
        assert_eq!(got, vec![vec![3, 1], vec![2, 0]]);
    }

    #[test]
    fn stages_close_buckets_and_the_order_is_followed() {
        // Visiting 2, 3 (stage 0), then 0, 1 (stage 1): a stage change closes the open bucket although it has
        // room; within a stage the caps apply as usual.
        let p = vec![(10, 'f'); 4];
        let got = assign_in_order(&p, &[2, 3, 0, 1], &[0, 0, 1, 1], MIB, MIB);
        assert_eq!(got.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![2, 3], vec![0, 1]]);
        let got = assign_in_order(&p, &[2, 3, 0, 1], &[0, 0, 1, 1], 10, 10);
        assert_eq!(got.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![2], vec![3], vec![0], vec![1]]);
    }

    #[test]
    fn zero_cap_and_empty() {
        assert_eq!(compute_bucket_layout(&[(4, 0u8), (4, 0)], 0, 0), vec![vec![1], vec![0]]);
        assert!(compute_bucket_layout::<u8>(&[], MIB, MIB).is_empty());
    }
}
