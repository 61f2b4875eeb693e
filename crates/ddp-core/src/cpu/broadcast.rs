//! Broadcast: the root's buffer to every rank.
//!
//! Small buffers (or two ranks): the root sends the buffer, in segments, straight to every peer — one hop.
//! Large buffers with more than two ranks: a pipelined chain root → root+1 → … → root+P−1, each rank forwarding
//! segment k as soon as it has arrived, so the root sends the buffer once instead of P−1 times and the time tends
//! to one buffer transfer plus (P−2) segment hops (the classic pipelined broadcast; Gloo's `broadcast_one_to_all`
//! is the direct variant, MPICH's large-message broadcast the pipelined one).

use super::frame::CallId;
use super::ring::split_even;
use super::transport::{Buf, OnRecv, Plan, RecvUnit, SendUnit};

/// Builds the plan for `n` bytes from `root`, cut into segments of at most `segment_bytes`.
pub(crate) fn plan(
    rank: usize,
    world_size: usize,
    root: usize,
    n: usize,
    segment_bytes: usize,
    chain: bool,
    call: CallId,
) -> Plan {
    let k = n.div_ceil(segment_bytes.max(1)).max(1);
    let segs = split_even(0, n, 1, k);
    let mut plan = Plan::new(call);
    if !chain || world_size <= 2 {
        if rank == root {
            for p in (0..world_size).filter(|&p| p != root) {
                for s in &segs {
                    plan.sends.push(SendUnit { peer: p, buf: Buf::Work, range: s.clone(), after_recv: None });
                }
            }
        } else {
            for s in &segs {
                plan.recvs.push(RecvUnit { peer: root, buf: Buf::Work, range: s.clone(), on_recv: OnRecv::Keep });
            }
        }
        return plan;
    }
    let pos = (rank + world_size - root) % world_size;
    let prev = (rank + world_size - 1) % world_size;
    let next = (rank + 1) % world_size;
    for (i, s) in segs.iter().enumerate() {
        if pos > 0 {
            plan.recvs.push(RecvUnit { peer: prev, buf: Buf::Work, range: s.clone(), on_recv: OnRecv::Keep });
        }
        if pos + 1 < world_size {
            let after_recv = (pos > 0).then_some(i);
            plan.sends.push(SendUnit { peer: next, buf: Buf::Work, range: s.clone(), after_recv });
        }
    }
    plan
}
