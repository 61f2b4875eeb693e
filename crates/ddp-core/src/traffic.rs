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
