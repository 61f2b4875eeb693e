//! [`Assumptions`]: the cost model's own parameters — what it keeps free, what a process holds besides the
//! model, how many runners-up it reports.

/// The cost model's parameters (see the fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Assumptions {
    /// Fraction of each process's memory kept free (fragmentation, allocator caches, what the model does not
    /// count): a layout fits a rank when its predicted peak is at most `(1 − margin) ×` the rank's memory.
    /// Default 0.2: measured peaks (RSS) ran 13 % above the predictions at the median and up to 45 % above
    /// (docs/benchmarks.md, "N-D layouts side by side"); with 0.2, no layout of the large char-GPT predicted to fit a
    /// 350 MiB cgroup was killed by it, with 0.1 three were.
    pub memory_margin: f64,
    /// Bytes a process holds besides the model's tensors (the runtime, communication buffers, the data loader).
    /// Default 128 MiB: a 1-process char-GPT run with activation checkpointing peaks at 102 MiB of RSS with about
    /// 20 MiB of tensors (docs/guide/04-nd-parallel-sharded.md, Activation checkpointing); a GPU's context is more, and
    /// the probe is expected to measure it.
    pub runtime_overhead_bytes: u64,
    /// How many runners-up a [`super::Choice`] reports (the fastest fitting layout of each other shape). Default 4.
    pub runners_up: usize,
    /// Predicted step times within this fraction of the fastest fitting one count as equal, and the simplest of
    /// those layouts is chosen (then the one needing least memory). Default 0.01: the probe's noise moves
    /// predictions by more than that between runs, so a smaller difference would choose by noise.
    pub tie_tolerance: f64,
}

impl Default for Assumptions {
    fn default() -> Self {
        Assumptions { memory_margin: 0.2, runtime_overhead_bytes: 128 << 20, runners_up: 4, tie_tolerance: 0.01 }
    }
}

impl Assumptions {
    /// What a layout may use of `memory` bytes: `(1 − margin) · memory`, rounded down.
    pub fn usable(&self, memory: u64) -> u64 {
        (memory as f64 * (1.0 - self.memory_margin)).floor() as u64
    }

    /// The least memory a process needs for a predicted peak of `peak` bytes: `peak / (1 − margin)`, rounded up
    /// (the smallest `n` with `usable(n) ≥ peak`).
    pub fn needed(&self, peak: u64) -> u64 {
        let mut n = (peak as f64 / (1.0 - self.memory_margin)).ceil() as u64;
        while n > 0 && self.usable(n - 1) >= peak {
            n -= 1;
        }
        while self.usable(n) < peak {
            n += 1;
        }
        n
    }
}
