//! [`TrafficStats`]: how many collective calls a [`crate::ProcessGroup`] made and how many payload bytes they
//! carried, per kind of operation — the figures benchmarks put next to a formula (e.g. Megatron-LM's tensor
//! parallel volume, 4·b·s·h·bytes per layer per micro-batch).
//!
//! Bytes are this rank's *payload*: the buffer it passes in (all_reduce, broadcast, all_gather's input,
//! reduce_scatter's input, send, recv). The bytes on the wire depend on the algorithm (a ring all-reduce moves
//! 2·(n−1)/n of the payload per rank) and are not counted here.

use std::sync::atomic::{AtomicU64, Ordering};

/// Calls and payload bytes of one kind of operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpTraffic {
    /// Number of calls.
    pub calls: u64,
    /// Payload bytes over all calls.
    pub bytes: u64,
}

/// A snapshot of a group's counters (see the module documentation). Subtract two snapshots for an interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrafficStats {
    /// all_reduce (typed and bytes).
    pub all_reduce: OpTraffic,
    /// broadcast.
    pub broadcast: OpTraffic,
    /// all_gather (input bytes).
    pub all_gather: OpTraffic,
    /// reduce_scatter (input bytes).
    pub reduce_scatter: OpTraffic,
    /// send.
    pub send: OpTraffic,
    /// recv.
    pub recv: OpTraffic,
}

impl TrafficStats {
    /// Payload bytes of every kind together.
    pub fn total_bytes(&self) -> u64 {
        self.ops().iter().map(|o| o.bytes).sum()
    }

    /// Calls of every kind together.
    pub fn total_calls(&self) -> u64 {
        self.ops().iter().map(|o| o.calls).sum()
    }

    /// The bytes this rank sends over the links when a group of `n` ranks runs these calls with ring algorithms
    /// (Patarasuk & Yuan 2009; NCCL's and gloo's large-message choice): an all-reduce sends 2(n−1)/n of its
    /// payload, a reduce-scatter (n−1)/n of its input, an all-gather n−1 times its input (every other rank's
    /// chunk passes through), a broadcast, send or recv its payload once. What a formula such as ZeRO's 2Ψ / 3Ψ
    /// per step (for large n) is compared with; the shared-memory backend moves the same data through memory.
    pub fn ring_bytes(&self, n: usize) -> u64 {
        if n <= 1 {
            return 0;
        }
        let (n, m) = (n as u64, n as u64 - 1);
        2 * m * self.all_reduce.bytes / n
            + m * self.reduce_scatter.bytes / n
            + m * self.all_gather.bytes
            + self.broadcast.bytes
            + self.send.bytes
    }

    fn ops(&self) -> [OpTraffic; 6] {
        [self.all_reduce, self.broadcast, self.all_gather, self.reduce_scatter, self.send, self.recv]
    }
}

impl std::ops::Sub for TrafficStats {
    type Output = TrafficStats;

    /// The traffic between two snapshots (`later - earlier`).
    fn sub(self, rhs: TrafficStats) -> TrafficStats {
        let d = |a: OpTraffic, b: OpTraffic| OpTraffic { calls: a.calls - b.calls, bytes: a.bytes - b.bytes };
        TrafficStats {
            all_reduce: d(self.all_reduce, rhs.all_reduce),
            broadcast: d(self.broadcast, rhs.broadcast),
            all_gather: d(self.all_gather, rhs.all_gather),
            reduce_scatter: d(self.reduce_scatter, rhs.reduce_scatter),
            send: d(self.send, rhs.send),
            recv: d(self.recv, rhs.recv),
        }
    }
}

/// The live counters a group owns.
#[derive(Debug, Default)]
pub(crate) struct TrafficCounters {
    counters: [(AtomicU64, AtomicU64); 6],
}

/// Which counter an operation adds to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    AllReduce = 0,
    Broadcast = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Send = 4,
    Recv = 5,
}

impl TrafficCounters {
    pub(crate) fn add(&self, op: Op, bytes: usize) {
        let (calls, total) = &self.counters[op as usize];
        calls.fetch_add(1, Ordering::Relaxed);
        total.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> TrafficStats {
        let get = |op: Op| {
            let (calls, bytes) = &self.counters[op as usize];
            OpTraffic { calls: calls.load(Ordering::Relaxed), bytes: bytes.load(Ordering::Relaxed) }
        };
        TrafficStats {
            all_reduce: get(Op::AllReduce),
            broadcast: get(Op::Broadcast),
            all_gather: get(Op::AllGather),
            reduce_scatter: get(Op::ReduceScatter),
            send: get(Op::Send),
            recv: get(Op::Recv),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{OpTraffic, TrafficStats};

    #[test]
    fn ring_bytes_follow_the_ring_algorithms() {
        let op = |bytes| OpTraffic { calls: 1, bytes };
        // ZeRO-2 on 4 ranks, Ψ = 400 B: a reduce-scatter of the whole gradient and an all-gather of a 100 B chunk.
        let zero = TrafficStats { reduce_scatter: op(400), all_gather: op(100), ..Default::default() };
        assert_eq!(zero.ring_bytes(4), 300 + 300); // 2Ψ(n−1)/n, as DDP's all-reduce:
        let ddp = TrafficStats { all_reduce: op(400), ..Default::default() };
        assert_eq!(ddp.ring_bytes(4), 600);
        assert_eq!(ddp.ring_bytes(1), 0);
        let p2p = TrafficStats { send: op(8), recv: op(8), broadcast: op(4), ..Default::default() };
        assert_eq!(p2p.ring_bytes(2), 12);
    }
}
