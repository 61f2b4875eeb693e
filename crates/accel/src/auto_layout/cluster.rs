//! [`ClusterSpec`]: the machines a job runs on, in rank order — each with its processes, their memory and compute
//! throughput, and the link between its processes — and the link between machines. Links are α–β (Hockney's
//! model, as Galvatron's and Colossal-AI's profilers fit them): a message of `n` bytes takes `α + n/β` seconds.
//! Machines may differ (an uneven cluster): memory, FLOP/s, process count and the link inside each.

use super::invalid::InvalidSpec;
use super::units;

/// An α–β link: `α` seconds per message (latency), `β` bytes per second (bandwidth).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Seconds per message.
    pub alpha: f64,
    /// Bytes per second.
    pub beta: f64,
}

impl Link {
    /// A link of latency `alpha` seconds and bandwidth `beta` bytes/s.
    pub fn new(alpha: f64, beta: f64) -> Self {
        Link { alpha, beta }
    }

    /// Seconds to send one message of `bytes`: `α + bytes/β`.
    pub fn message_time(&self, bytes: f64) -> f64 {
        self.alpha + bytes / self.beta
    }
}

impl std::fmt::Display for Link {
    /// `α 5.0 µs, β 10.0 GB/s`; a latency of exactly 0 is one the start-up probe could not tell from 0 (its
    /// ping-pong fit gave none), and says so rather than "0 s".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.alpha {
            0.0 => write!(f, "α below the probe's resolution, β {}", units::bandwidth(self.beta)),
            alpha => write!(f, "α {}, β {}", units::seconds(alpha), units::bandwidth(self.beta)),
        }
    }
}

/// One machine: `processes` ranks sharing `intra`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Machine {
    /// Processes (ranks) on this machine; consecutive ranks, in machine order.
    pub processes: usize,
    /// Memory one process may use, bytes (a GPU's memory, or the machine's memory / processes on a CPU).
    pub memory_per_process: u64,
    /// Sustained compute throughput of one process on the model's products, FLOP/s.
    pub flops_per_process: f64,
    /// The link between two processes of this machine (shared memory, NVLink).
    pub intra: Link,
    /// Fixed seconds per operator call besides its FLOPs (the framework's dispatch, a kernel launch): what makes
    /// many small micro-batches slower than few large ones. 0 in [`ClusterSpec::uniform`]; the probe measures it.
    pub op_latency: f64,
    /// Seconds a blocking collective or send between this machine's processes costs beyond its α–β time while
    /// they compute: waiting for a peer the operating system has not scheduled yet, when the machine runs more
    /// processes than it has cores (a few milliseconds then; about 0 otherwise). 0 in [`ClusterSpec::uniform`];
    /// the probe measures it.
    pub sync_latency: f64,
    /// Bytes per second one process moves through element-wise work (2 read, 1 written), while the others do the
    /// same: what accumulating gradients over micro-batches costs. `f64::INFINITY` (free) in
    /// [`ClusterSpec::uniform`]; the probe measures it.
    pub memory_bandwidth: f64,
}

/// The machines of a job, in rank order (machine 0 holds ranks `0..processes₀`, machine 1 the next, …), and the
/// link between machines: `inter.beta` is one machine's bandwidth to the others, shared by every flow leaving it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSpec {
    /// The machines, in rank order.
    pub machines: Vec<Machine>,
    /// Between machines.
    pub inter: Link,
}

impl ClusterSpec {
    /// `machines` identical machines of `processes` each.
    pub fn uniform(
        machines: usize,
        processes: usize,
        memory_per_process: u64,
        flops_per_process: f64,
        intra: Link,
        inter: Link,
    ) -> Self {
        ClusterSpec {
            machines: vec![
                Machine {
                    processes,
                    memory_per_process,
                    flops_per_process,
                    intra,
                    op_latency: 0.0,
                    sync_latency: 0.0,
                    memory_bandwidth: f64::INFINITY,
                };
                machines
            ],
            inter,
        }
    }

    /// All processes.
    pub fn world_size(&self) -> usize {
        self.machines.iter().map(|m| m.processes).sum()
    }

    /// The machine of every rank, in rank order.
    pub fn machine_of_ranks(&self) -> Vec<usize> {
        self.machines.iter().enumerate().flat_map(|(i, m)| std::iter::repeat_n(i, m.processes)).collect()
    }

    /// Whether the machines differ in memory per process.
    pub fn memory_is_uneven(&self) -> bool {
        self.machines.windows(2).any(|w| w[0].memory_per_process != w[1].memory_per_process)
    }

    /// Whether the machines differ in FLOP/s per process.
    pub fn compute_is_uneven(&self) -> bool {
        self.machines.windows(2).any(|w| w[0].flops_per_process != w[1].flops_per_process)
    }

    /// Checks: at least one machine, each with ≥ 1 process, memory, positive finite FLOP/s and links (α ≥ 0,
    /// β > 0).
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        let bad = |what: String| Err(InvalidSpec(what));
        if self.machines.is_empty() {
            return bad("the cluster has no machine".into());
        }
        let link_ok = |l: &Link| l.alpha.is_finite() && l.alpha >= 0.0 && l.beta.is_finite() && l.beta > 0.0;
        for (i, m) in self.machines.iter().enumerate() {
            if m.processes == 0 || m.memory_per_process == 0 {
                return bad(format!(
                    "machine {i} has {} processes of {} bytes each; both are at least 1",
                    m.processes, m.memory_per_process
                ));
            }
            if !(m.op_latency.is_finite() && m.op_latency >= 0.0) {
                return bad(format!("machine {i}: {} s per operator call; give a finite number ≥ 0", m.op_latency));
            }
            if m.memory_bandwidth.is_nan() || m.memory_bandwidth <= 0.0 {
                return bad(format!(
                    "machine {i}: {} bytes/s of memory bandwidth; give a number > 0",
                    m.memory_bandwidth
                ));
            }
            if !(m.sync_latency.is_finite() && m.sync_latency >= 0.0) {
                return bad(format!(
                    "machine {i}: {} s of synchronisation per collective; give a finite number ≥ 0",
                    m.sync_latency
                ));
            }
            if !(m.flops_per_process.is_finite() && m.flops_per_process > 0.0) {
                return bad(format!("machine {i}: {} FLOP/s per process; give a positive number", m.flops_per_process));
            }
            if !link_ok(&m.intra) {
                return bad(format!("machine {i}'s link {:?}: α ≥ 0 seconds and β > 0 bytes/s", m.intra));
            }
        }
        if !link_ok(&self.inter) {
            return bad(format!("the link between machines {:?}: α ≥ 0 seconds and β > 0 bytes/s", self.inter));
        }
        Ok(())
    }

    /// `2 machines × 2 processes` or `machines of 2 + 1 processes`.
    pub fn describe(&self) -> String {
        let counts: Vec<usize> = self.machines.iter().map(|m| m.processes).collect();
        if counts.windows(2).all(|w| w[0] == w[1]) {
            format!(
                "{} × {}",
                units::plural(self.machines.len(), "machine", "machines"),
                units::plural(counts[0], "process", "processes")
            )
        } else {
            let list: Vec<String> = counts.iter().map(ToString::to_string).collect();
            format!("{} of {} processes", units::plural(self.machines.len(), "machine", "machines"), list.join(" + "))
        }
    }
}
