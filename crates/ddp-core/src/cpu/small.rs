//! Latency-optimal all_reduce for small buffers: direct exchange.
//!
//! Every rank sends its whole buffer to every other rank in one frame and reduces the P inputs itself, in rank
//! order `((x0 ⊕ x1) ⊕ x2) ⊕ …` — the same order on every rank, so the results are bit-identical. One network
//! round instead of the ring's 2·(P−1) dependent steps; it moves (P−1)·n bytes per rank instead of 2·(P−1)/P·n,
//! which does not matter below the small-message threshold (and for P = 2 is the same volume as the ring).
//! (MPICH and Gloo use recursive doubling for the same purpose; for the small P of CPU jobs one round of direct
//! sends is at least as fast and has no power-of-two special cases.)

use super::frame::CallId;
use super::transport::{Buf, OnRecv, Plan, RecvUnit, SendUnit};
use crate::dtype::{divide_in_place, reduce_into};
use crate::{DType, ReduceOp};

/// The exchange: `work` (n bytes) to every peer; peer p's buffer into `scratch[p·n..(p+1)·n]`.
pub(crate) fn plan(rank: usize, world_size: usize, n: usize, call: CallId) -> Plan {
    let mut plan = Plan::new(call);
    for p in (0..world_size).filter(|&p| p != rank) {
        plan.sends.push(SendUnit { peer: p, buf: Buf::Work, range: 0..n, after_recv: None });
        plan.recvs.push(RecvUnit { peer: p, buf: Buf::Scratch, range: p * n..(p + 1) * n, on_recv: OnRecv::Keep });
    }
    plan
}

/// Scratch bytes the exchange needs.
pub(crate) fn scratch_bytes(world_size: usize, n: usize) -> usize {
    world_size * n
}

/// After the exchange: `work = x0 ⊕ x1 ⊕ … ⊕ x(P−1)` in rank order (then divided for Avg).
pub(crate) fn combine(rank: usize, world_size: usize, work: &mut [u8], scratch: &mut [u8], dtype: DType, op: ReduceOp) {
    let n = work.len();
    if rank != 0 {
        scratch[rank * n..(rank + 1) * n].copy_from_slice(work);
        work.copy_from_slice(&scratch[0..n]);
    }
    for p in 1..world_size {
        reduce_into(dtype, op, work, &scratch[p * n..(p + 1) * n]);
    }
    if op == ReduceOp::Avg {
        divide_in_place(dtype, work, world_size);
    }
}
