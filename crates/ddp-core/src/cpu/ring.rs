//! Bandwidth-optimal ring schedules: reduce-scatter, all-gather, and all_reduce as one followed by the other.
//!
//! Reference: Gloo's `AllreduceRing` / `ReduceScatterHalvingDoubling` family and Patarasuk & Yuan, "Bandwidth
//! optimal all-reduce algorithms for clusters of workstations" (JPDC 2009). The buffer is cut into one chunk per
//! rank; in each of the P−1 reduce-scatter steps rank r sends one chunk to its right neighbour and reduces the
//! chunk arriving from its left neighbour, so after P−1 steps each rank holds one fully reduced chunk; P−1
//! all-gather steps then pass the reduced chunks around. Every rank sends 2·(P−1)/P of the buffer in total.
//!
//! Each chunk is cut into `K` segments (≤ the configured segment size, and at least two when the chunk is large
//! enough) and every step is pipelined per segment: segment k of step s+1 is forwarded as soon as segment k of
//! step s has been received and reduced, so the network and the reduction overlap (Gloo does the same).
//!
//! Bit-identical results: every chunk is reduced exactly once, along one chain of ranks, and then copied
//! verbatim to all ranks, so every rank ends with the same bits (for floats too).
//!
//! Indexing: at global step t rank r sends chunk `(start − t) mod P` and receives chunk `(start − t − 1) mod P`
//! from rank r−1. The first `reduce_steps` steps reduce the received segment into the work buffer, the following
//! `gather_steps` steps store it as is.

use super::frame::CallId;
use super::transport::{Buf, OnRecv, Plan, RecvUnit, SendUnit};
use crate::{DType, ReduceOp};
use std::ops::Range;

/// Segmentation of a ring.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Segmenting {
    /// Largest segment in bytes (Gloo: 1 MiB).
    pub max_segment_bytes: usize,
    /// Chunks of at least this many bytes are cut into ≥ 2 segments so that even one-segment-sized chunks
    /// pipeline.
    pub split_threshold_bytes: usize,
}

/// A ring schedule over `chunks` (byte ranges of the work buffer, one per rank, element-aligned).
pub(crate) struct Ring<'a> {
    pub rank: usize,
    pub world_size: usize,
    pub chunks: &'a [Range<usize>],
    pub elem: usize,
    pub reduce_steps: usize,
    pub gather_steps: usize,
    pub start: usize,
    pub seg: Segmenting,
    /// Set for all_reduce Avg: divide each segment of the rank's final reduced chunk by this.
    pub divide_last_reduce_by: Option<usize>,
    pub reduce: Option<(DType, ReduceOp)>,
}

/// Splits `len_bytes` (a multiple of `elem`) into `parts` element-aligned ranges of near-equal size.
pub(crate) fn split_even(base: usize, len_bytes: usize, elem: usize, parts: usize) -> Vec<Range<usize>> {
    let elems = len_bytes / elem;
    (0..parts)
        .map(|i| {
            let a = elems * i / parts;
            let b = elems * (i + 1) / parts;
            base + a * elem..base + b * elem
        })
        .collect()
}

impl Ring<'_> {
    /// Segments per chunk: the same on every rank (it depends only on the chunk sizes).
    fn segments_per_chunk(&self) -> usize {
        let max_chunk = self.chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let k = max_chunk.div_ceil(self.seg.max_segment_bytes.max(self.elem)).max(1);
        if k == 1 && max_chunk >= self.seg.split_threshold_bytes {
            2
        } else {
            k
        }
    }

    /// Largest segment in bytes (the scratch space a reducing ring needs).
    pub(crate) fn max_segment_bytes(&self) -> usize {
        let k = self.segments_per_chunk();
        self.chunks.iter().map(|c| (c.len() / self.elem).div_ceil(k) * self.elem).max().unwrap_or(0)
    }

    /// Builds the plan; reducing receives land in `scratch[0..max_segment_bytes]`.
    pub(crate) fn plan(&self, call: CallId) -> Plan {
        let p = self.world_size;
        let right = (self.rank + 1) % p;
        let left = (self.rank + p - 1) % p;
        let k = self.segments_per_chunk();
        let segs: Vec<Vec<Range<usize>>> =
            self.chunks.iter().map(|c| split_even(c.start, c.len(), self.elem, k)).collect();
        let steps = self.reduce_steps + self.gather_steps;
        let mut plan = Plan::new(call);
        plan.reduce = self.reduce;
        for t in 0..steps {
            let send_chunk = (self.start + p * steps - t) % p;
            let recv_chunk = (self.start + p * steps - t - 1) % p;
            for (s, range) in segs[send_chunk].iter().enumerate() {
                // Unit i = t·K + s depends on the receive of the same segment one step earlier.
                let after_recv = (t > 0).then(|| (t - 1) * k + s);
                plan.sends.push(SendUnit { peer: right, buf: Buf::Work, range: range.clone(), after_recv });
            }
            for range in &segs[recv_chunk] {
                if t < self.reduce_steps {
                    let divide_by = if t + 1 == self.reduce_steps { self.divide_last_reduce_by } else { None };
                    plan.recvs.push(RecvUnit {
                        peer: left,
                        buf: Buf::Scratch,
                        range: 0..range.len(),
                        on_recv: OnRecv::ReduceInto { into: range.clone(), divide_by },
                    });
                } else {
                    plan.recvs.push(RecvUnit {
                        peer: left,
                        buf: Buf::Work,
                        range: range.clone(),
                        on_recv: OnRecv::Keep,
                    });
                }
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_even_covers_everything_element_aligned() {
        let r = split_even(8, 7 * 4, 4, 3);
        assert_eq!(r, vec![8..16, 16..24, 24..36]);
        let r = split_even(0, 0, 2, 4);
        assert!(r.iter().all(|x| x.is_empty()));
    }
}
