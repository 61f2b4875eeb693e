//! Barrier: every rank sends an empty frame to every other rank and waits for one from each. When a rank has
//! heard from all peers, all of them have entered the barrier. One round, P−1 tiny messages per rank (the
//! dissemination barrier would need ⌈log2 P⌉ rounds of one message; for the small P of CPU jobs one round wins).

use super::frame::CallId;
use super::transport::{Buf, OnRecv, Plan, RecvUnit, SendUnit};

pub(crate) fn plan(rank: usize, world_size: usize, call: CallId) -> Plan {
    let mut plan = Plan::new(call);
    for p in (0..world_size).filter(|&p| p != rank) {
        plan.sends.push(SendUnit { peer: p, buf: Buf::Work, range: 0..0, after_recv: None });
        plan.recvs.push(RecvUnit { peer: p, buf: Buf::Work, range: 0..0, on_recv: OnRecv::Keep });
    }
    plan
}
