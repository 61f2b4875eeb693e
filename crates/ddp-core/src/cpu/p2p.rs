//! Point-to-point send/recv: the message identity both paths use, and the TCP plans.
//!
//! Messages between two ranks carry a per-pair, per-direction counter (the n-th send from A to B is the n-th
//! recv on B from A), the byte count and the number of collectives the sender had issued on the group, so a recv
//! of a different size than the matching send is an error naming both, and so is a message received on the other
//! side of a collective than it was sent. The rule, the same on both paths: **a message sent between the sender's
//! collectives c and c + 1 must be received between the receiver's collectives c and c + 1**; between two ranks,
//! sends, receives and collectives must be issued in an order that matches, as with blocking MPI calls.
//!
//! Over TCP (these plans) a message travels as frames on the pair's ordered connection, behind and before the
//! collectives' frames, so a collective that meets a message frame (or a recv that meets a collective's) fails
//! on the header check. Between ranks of one machine it goes through the shared segment's per-pair ring instead
//! (`shm_p2p`), where the same rule is checked explicitly and a send runs ahead of its receiver by at most the
//! ring's capacity (8 × 64 KiB by default; over TCP, by what the socket buffers hold).

use super::frame::{CallId, Op};
use super::ring::split_even;
use super::transport::{Buf, OnRecv, Plan, RecvUnit, SendUnit};

/// The identity of the `seq`-th message between two ranks (in one direction), `n` bytes, issued after
/// `collectives` collectives on the group: both sides build the same one for matching calls.
pub(crate) fn call(seq: u64, n: usize, collectives: u64) -> CallId {
    CallId { op: Op::Send, seq, size: n as u64, dtype: None, redop: None, param: collectives }
}

/// `n` bytes of the input to `dst`, in segments of at most `segment_bytes`.
pub(crate) fn send_plan(dst: usize, n: usize, segment_bytes: usize, call: CallId) -> Plan {
    let mut plan = Plan::new(call);
    for s in split_even(0, n, 1, n.div_ceil(segment_bytes.max(1)).max(1)) {
        plan.sends.push(SendUnit { peer: dst, buf: Buf::Input, range: s, after_recv: None });
    }
    plan
}

/// `n` bytes from `src` into the work buffer.
pub(crate) fn recv_plan(src: usize, n: usize, segment_bytes: usize, call: CallId) -> Plan {
    let mut plan = Plan::new(call);
    for s in split_even(0, n, 1, n.div_ceil(segment_bytes.max(1)).max(1)) {
        plan.recvs.push(RecvUnit { peer: src, buf: Buf::Work, range: s, on_recv: OnRecv::Keep });
    }
    plan
}
