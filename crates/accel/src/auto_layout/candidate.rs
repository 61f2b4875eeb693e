//! A costed layout: what the chooser ranks ([`Candidate`]) and what it is made of — each pp rank's predicted memory,
//! the groups it communicates over, and with an uneven pipeline split what the even one would have given. Its own
//! module so that the chooser and its error both read it without reading each other.

use super::assumptions::Assumptions;
use super::layout::Layout;
use super::memory::MemoryBreakdown;
use super::placement::{GroupKind, GroupLink};
use super::time::TimeBreakdown;

/// One pp rank's prediction (every rank of a pp rank holds the same share; its smallest process bounds it).
#[derive(Debug, Clone, PartialEq)]
pub struct RankPrediction {
    /// The pp rank.
    pub pp_rank: usize,
    /// Blocks it holds (over its stages).
    pub layers: usize,
    /// Its predicted memory per process.
    pub memory: MemoryBreakdown,
    /// What its smallest process may use ([`Assumptions::usable`]).
    pub usable: u64,
    /// The machines its processes are on.
    pub machines: Vec<usize>,
}

impl RankPrediction {
    /// Whether its predicted peak fits.
    pub fn fits(&self) -> bool {
        self.memory.total() <= self.usable
    }
}

/// A group kind a layout communicates over, its size and its slowest link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupUse {
    /// Which groups.
    pub kind: GroupKind,
    /// Ranks per group.
    pub size: usize,
    /// The slowest of them.
    pub link: GroupLink,
}

/// What the even pipeline split would have given, when the chosen split is uneven.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitComparison {
    /// Blocks per pp rank, even.
    pub layers: Vec<usize>,
    /// Whether it fits.
    pub fits: bool,
    /// Its predicted step, seconds.
    pub step: f64,
    /// Its tightest pp rank: (pp rank, peak, usable).
    pub tightest: (usize, u64, u64),
}

/// A costed layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The layout (with `layers_per_stage` when the split is uneven).
    pub layout: Layout,
    /// Per pp rank: blocks, memory, what fits.
    pub ranks: Vec<RankPrediction>,
    /// The predicted step.
    pub time: TimeBreakdown,
    /// The groups it communicates over, each with its slowest link.
    pub groups: Vec<GroupUse>,
    /// With an uneven split: what the even one would have given.
    pub even_split: Option<SplitComparison>,
}

impl Candidate {
    /// Whether every pp rank fits.
    pub fn fits(&self) -> bool {
        self.ranks.iter().all(RankPrediction::fits)
    }

    /// The largest predicted peak of any rank, bytes.
    pub fn peak_memory(&self) -> u64 {
        self.ranks.iter().map(|r| r.memory.total()).max().unwrap_or(0)
    }

    /// The pp rank closest to (or furthest past) its memory: the highest peak / usable.
    pub fn tightest(&self) -> &RankPrediction {
        let ratio = |r: &RankPrediction| r.memory.total() as f64 / r.usable.max(1) as f64;
        self.ranks.iter().fold(&self.ranks[0], |a, b| if ratio(b) > ratio(a) { b } else { a })
    }

    /// The memory per process it needs everywhere: its peak over the usable fraction.
    pub fn needed_per_process(&self, assumptions: &Assumptions) -> u64 {
        assumptions.needed(self.peak_memory())
    }

    /// The step in whole nanoseconds, for a total order.
    pub(super) fn time_ns(&self) -> u64 {
        (self.time.total * 1e9).round() as u64
    }

    /// The ranking of the runners-up: step time, then the simpler layout, then peak memory.
    pub(super) fn sort_key(&self) -> (u64, impl Ord, u64) {
        // Equal predicted times go to the simpler layout (fewer dimensions, a lower ZeRO stage, …), then to less
        // memory: a layout that already fits gains nothing from more sharding, and the copies sharding adds are
        // real (docs/benchmarks.md) though the α–β model does not see them.
        (self.time_ns(), self.layout.complexity(), self.peak_memory())
    }
}
