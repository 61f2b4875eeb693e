//! The start-up probe ([`probe_cluster`]): what [`super::ClusterSpec`] the job runs on, measured on the real
//! backend — which ranks share a machine, each process's memory, its FLOP/s, and the links within and across
//! machines (α–β, [`ddp_core::probe`]).
//!
//! Collective over the job's process group: every rank calls it at the same point, and every rank returns the same
//! [`ClusterProbe`] (each measures its own part, then the parts are all-gathered), so the chooser, which is
//! deterministic, picks the same layout everywhere.
//!
//! - **Machines**: ranks with the same host name and launcher node rank (`GROUP_RANK`, `SLURM_NODEID`) share a
//!   machine. Launchers number ranks machine by machine, so each machine's ranks are consecutive; a job whose ranks
//!   are not is refused (the cost model places groups by rank).
//! - **Memory per process**: given ([`super::AutoLayoutRequest::memory_per_process`], `ACCEL_AUTO_LAYOUT_MEMORY`),
//!   else on CUDA the device's memory (with the `nccl` feature), else on the CPU the machine's RAM (`MemTotal`)
//!   shared by its ranks, or less when the process's memory cgroup (v1 or v2) has a limit: that limit shared by the
//!   ranks in the same cgroup. A machine's value is its smallest rank's.
//! - **FLOP/s per process**: a matrix product of the model's shape (`[b·s, d_model] × [d_model, d_ff]`) timed on
//!   every rank at once — so processes sharing cores measure their share — for about [`FLOPS_PROBE_SECONDS`]; a
//!   machine's value is its slowest rank's.
//! - **Operator latency**: the median time of a 1 × 1 product (dispatch, allocation, launch), the largest rank's:
//!   the fixed cost per operator call that makes small micro-batches slower per sequence than large ones.
//! - **Links**: within each machine, [`ddp_core::probe::all_reduce_probe`] over its ranks (the collectives' own
//!   path: shared memory or the device); across machines, [`ddp_core::probe::ping_pong`] between machine 0's first
//!   rank and each other machine's first rank (the TCP path), the slowest kept.
//! - **Memory bandwidth per process**: an element-wise add of buffers of the model's gradient size (at most
//!   16 MiB) timed on every rank at once (what accumulating a gradient over micro-batches moves), the machine's
//!   slowest rank's.
//! - **Synchronisation under load**: inside each machine, rounds of a ~2 ms product then a one-element
//!   all-reduce on every rank at once; a round's time beyond the product's is the wait for peers the operating
//!   system has not scheduled yet (milliseconds when processes outnumber cores), the machine's slowest rank's.
//! - **Runtime overhead**: each process's resident memory when the probe runs (the program, its libraries, the
//!   communicator's buffers; before the model), the largest kept: the chooser's
//!   [`super::Assumptions::runtime_overhead_bytes`] unless the request fixes it.

use super::cluster::{ClusterSpec, Link, Machine};
use super::units;
use crate::{AccelError, Result};
use candle_core::{DType, Device, Tensor};
use ddp_core::probe::{self, LinkEstimate};
use ddp_core::ProcessGroup;
use std::time::Instant;

/// Environment variable: memory per process the automatic layout plans for, instead of the detected one (`350MiB`,
/// `8GiB`, `2G`, or bytes).
pub const MEMORY_ENV: &str = "ACCEL_AUTO_LAYOUT_MEMORY";

/// Seconds the FLOP/s probe runs on every rank (after one untimed product).
pub const FLOPS_PROBE_SECONDS: f64 = 0.05;

/// What [`probe_cluster`] measured: the cluster the chooser costs layouts on, and how each number was found.
#[derive(Debug, Clone)]
pub struct ClusterProbe {
    /// The machines, their memory and FLOP/s per process, the links.
    pub spec: ClusterSpec,
    /// Where each machine's memory per process came from (`"given by ACCEL_AUTO_LAYOUT_MEMORY or the program"`, `"cgroup limit
    /// 350 MiB shared by 1 process"`, `"RAM 23.4 GiB shared by 4 processes"`, `"CUDA device 0: 80 GiB"`).
    pub memory_source: Vec<String>,
    /// The all-reduce probe of each machine with more than one process (`None` for the others).
    pub intra: Vec<Option<LinkEstimate>>,
    /// The slowest ping-pong between machine 0 and another machine (`None` on one machine).
    pub inter: Option<LinkEstimate>,
    /// The largest resident memory of a process when the probe ran, bytes (0 where it cannot be read).
    pub baseline_rss: u64,
    /// Seconds the probe took on this rank.
    pub seconds: f64,
}

impl std::fmt::Display for ClusterProbe {
    /// `measured in 0.21 s: machine 0: 4 processes, 5.8 GiB each (RAM 23.4 GiB shared by 4 processes), 2.1e9
    /// FLOP/s each, all-reduce link α 9.1 µs β 1.2 GB/s; across machines (ping-pong) α 85 µs β 11.9 MB/s`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "measured in {}:", units::seconds(self.seconds))?;
        for (i, m) in self.spec.machines.iter().enumerate() {
            let link = match &self.intra[i] {
                Some(_) => format!(", all-reduce link {}", m.intra),
                None => String::new(),
            };
            let sync = match &self.intra[i] {
                Some(_) if m.sync_latency == 0.0 => {
                    ", no wait for peers per collective while computing, beyond its own time".into()
                }
                Some(_) => format!(", {} per collective while computing", units::seconds(m.sync_latency)),
                None => String::new(),
            };
            write!(
                f,
                "{}machine {i}: {} × {} ({}), {:.3e} FLOP/s, {} per operator call and {:.1} GB/s element-wise each{link}{sync}",
                if i == 0 { " " } else { "; " },
                units::plural(m.processes, "process", "processes"),
                units::bytes(m.memory_per_process),
                self.memory_source[i],
                m.flops_per_process,
                units::seconds(m.op_latency),
                m.memory_bandwidth / 1e9
            )?;
        }
        if self.inter.is_some() {
            write!(f, "; across machines (ping-pong) {}", self.spec.inter)?;
        }
        write!(f, "; resident memory before the model {}", units::bytes(self.baseline_rss))
    }
}

/// The f64s each rank all-gathers (RankFacts' from `cgroup_limit` on).
const FACTS: usize = 7;

/// What one rank contributes to the probe, as the f64s and i64s it all-gathers.
struct RankFacts {
    /// Host name and launcher node rank, hashed.
    machine: i64,
    /// The memory cgroup's path, hashed (0: none found).
    cgroup: i64,
    /// The cgroup's limit in bytes (`f64::INFINITY`: none).
    cgroup_limit: f64,
    /// `MemTotal` in bytes (CUDA: the device's memory; given: the given value).
    ram: f64,
    /// 0: RAM, 1: CUDA device, 2: given.
    source: f64,
    rss: f64,
    flops: f64,
    op_latency: f64,
    memory_bandwidth: f64,
}

/// Measures the cluster (module documentation). `matmul` is the probe's product shape `(rows, d_model, d_ff)`;
/// `gradient_bytes` the model's gradient (the bandwidth probe's buffers take its size, at most
/// [`BANDWIDTH_PROBE_BYTES`]); `memory_per_process`: the given memory, which replaces the detection.
///
/// Errors: backend failures (naming the probe), a job whose machines' ranks are not consecutive, a CUDA device
/// whose memory cannot be read without the `nccl` feature (set [`MEMORY_ENV`]).
pub fn probe_cluster(
    pg: &ProcessGroup,
    device: &Device,
    matmul: (usize, usize, usize),
    gradient_bytes: usize,
    memory_per_process: Option<u64>,
) -> Result<ClusterProbe> {
    let start = Instant::now();
    let (ram, source) = match memory_per_process {
        Some(bytes) => (bytes as f64, 2.0),
        None => match device.location() {
            candle_core::DeviceLocation::Cpu => (mem_total().unwrap_or(0) as f64, 0.0),
            _ => (device_memory(device)? as f64, 1.0),
        },
    };
    let (cgroup, cgroup_limit) = match (source, cgroup_memory_limit()) {
        (0.0, Some((path, limit))) => (stable_hash(&path), limit as f64),
        _ => (0, f64::INFINITY),
    };
    pg.barrier()?;
    let flops = measure_flops(device, matmul)?;
    let op_latency = measure_op_latency(device)?;
    // Before the bandwidth probe, whose buffers the allocator may keep (they are not the program's).
    let rss = resident_bytes().unwrap_or(0) as f64;
    let memory_bandwidth = measure_memory_bandwidth(device, gradient_bytes)?;
    let facts = RankFacts {
        machine: stable_hash(&format!("{}|{}", hostname(), node_rank())),
        cgroup,
        cgroup_limit,
        ram,
        source,
        rss,
        flops,
        op_latency,
        memory_bandwidth,
    };
    let world = pg.world_size();
    let ints = all_gather(pg, &[facts.machine, facts.cgroup])?;
    let floats = all_gather(
        pg,
        &[
            facts.cgroup_limit,
            facts.ram,
            facts.source,
            facts.rss,
            facts.flops,
            facts.op_latency,
            facts.memory_bandwidth,
        ],
    )?;
    let machine_keys: Vec<i64> = (0..world).map(|r| ints[2 * r]).collect();
    let (machine_of, first_rank) = place_machines(&machine_keys)?;
    let n_machines = first_rank.len();
    let fact = |r: usize, k: usize| floats[FACTS * r + k];

    let machine_of = &machine_of;
    let ranks_on = |m: usize| (0..world).filter(move |&r| machine_of[r] == m);
    let (memory, memory_source) = memory_per_machine(machine_of, n_machines, &ints, &floats)?;
    let flops_of = |m: usize| ranks_on(m).map(|r| fact(r, 4)).fold(f64::INFINITY, f64::min);
    let op_latency_of = |m: usize| ranks_on(m).map(|r| fact(r, 5)).fold(0.0, f64::max);
    let bandwidth_of = |m: usize| ranks_on(m).map(|r| fact(r, 6)).fold(f64::INFINITY, f64::min);
    let baseline_rss = (0..world).map(|r| fact(r, 3) as u64).max().unwrap_or(0);

    // Links within each machine: an all-reduce probe over its ranks (every machine at once, on its own group).
    let my_machine = machine_of[pg.rank()];
    let local_group = pg.split(Some(my_machine as u32), pg.rank())?;
    let mine = match &local_group {
        Some(g) if g.world_size() > 1 => {
            let e = probe::all_reduce_probe(g, &probe::DEFAULT_SIZES, probe::DEFAULT_REPEATS)?;
            [e.alpha, e.beta]
        }
        _ => [f64::NAN, f64::NAN],
    };
    // Synchronisation under load, inside each machine (every machine at once): see `measure_sync_latency`.
    let sync = match &local_group {
        Some(g) if g.world_size() > 1 => {
            let quiet = super::time::all_reduce_time(g.world_size(), 4.0, &Link::new(mine[0], mine[1]));
            measure_sync_latency(g, device, (matmul.1, matmul.2), flops, quiet)?
        }
        _ => 0.0,
    };
    let syncs = all_gather(pg, &[sync])?;
    let sync_of = |m: usize| ranks_on(m).map(|r| syncs[r]).fold(0.0, f64::max);
    let links = all_gather(pg, &mine)?;
    let intra: Vec<Option<LinkEstimate>> = first_rank
        .iter()
        .map(|&r| {
            (links[2 * r].is_finite()).then(|| LinkEstimate {
                alpha: links[2 * r],
                beta: links[2 * r + 1],
                samples: Vec::new(),
            })
        })
        .collect();

    let inter = link_across_machines(pg, &first_rank)?;

    let to_link = |e: &LinkEstimate| Link::new(e.alpha, e.beta);
    // A machine with one process has no link inside it that any group uses; it gets the fastest measured one.
    let fallback = intra
        .iter()
        .flatten()
        .chain(inter.iter())
        .min_by(|a, b| a.message_time(1048576.0).total_cmp(&b.message_time(1048576.0)))
        .map(to_link)
        .unwrap_or_else(|| Link::new(0.0, f64::MAX));
    let machines: Vec<Machine> = (0..n_machines)
        .map(|m| Machine {
            processes: ranks_on(m).count(),
            memory_per_process: memory[m],
            flops_per_process: flops_of(m),
            op_latency: op_latency_of(m),
            sync_latency: sync_of(m),
            memory_bandwidth: bandwidth_of(m),
            intra: intra[m].as_ref().map(to_link).unwrap_or(fallback),
        })
        .collect();
    let spec = ClusterSpec { machines, inter: inter.as_ref().map(to_link).unwrap_or(fallback) };
    spec.validate().map_err(|e| AccelError::InvalidArgument(format!("auto layout probe: {e}")))?;
    Ok(ClusterProbe { spec, memory_source, intra, inter, baseline_rss, seconds: start.elapsed().as_secs_f64() })
}

/// Each rank's machine (machines numbered in order of their first rank) and each machine's first rank, from every
/// rank's machine key; refused when a machine's ranks are not consecutive.
fn place_machines(machine_keys: &[i64]) -> Result<(Vec<usize>, Vec<usize>)> {
    let world = machine_keys.len();
    let mut machine_of = vec![0usize; world];
    let mut first_rank: Vec<usize> = Vec::new();
    for r in 0..world {
        match first_rank.iter().position(|&f| machine_keys[f] == machine_keys[r]) {
            Some(m) if m + 1 == first_rank.len() => machine_of[r] = m,
            Some(m) => {
                return Err(AccelError::InvalidArgument(format!(
                    "auto layout: rank {r} is on machine {m} but the ranks before it are on machine {}; the layout \
                     places groups by rank, so each machine's ranks must be consecutive (as torchrun and accel launch \
                     number them); set the sizes instead of auto",
                    first_rank.len() - 1
                )))
            }
            None => {
                machine_of[r] = first_rank.len();
                first_rank.push(r);
            }
        }
    }
    Ok((machine_of, first_rank))
}

/// Memory per process and where it came from, per machine: its smallest rank's (given, a device's, the RAM's share
/// or a memory cgroup's limit shared by the processes in it), from the gathered facts (`ints`: 2 per rank, `floats`:
/// [`FACTS`] per rank).
fn memory_per_machine(
    machine_of: &[usize],
    n_machines: usize,
    ints: &[i64],
    floats: &[f64],
) -> Result<(Vec<u64>, Vec<String>)> {
    let world = machine_of.len();
    let fact = |r: usize, k: usize| floats[FACTS * r + k];
    let ranks_on = |m: usize| (0..world).filter(move |&r| machine_of[r] == m);
    let mut memory = vec![u64::MAX; n_machines];
    let mut memory_source = vec![String::new(); n_machines];
    for r in 0..world {
        let m = machine_of[r];
        let local = ranks_on(m).count();
        let (bytes, why) = match fact(r, 2) as u8 {
            2 => (fact(r, 1), format!("given by {MEMORY_ENV} or the program")),
            1 => (fact(r, 1), format!("device memory {}", units::bytes(fact(r, 1) as u64))),
            _ => {
                let share = fact(r, 1) / local as f64;
                let sharing = ranks_on(m).filter(|&q| ints[2 * q + 1] == ints[2 * r + 1]).count();
                let limit = fact(r, 0) / sharing as f64;
                if limit < share {
                    let total = units::bytes(fact(r, 0) as u64);
                    (
                        limit,
                        format!(
                            "memory cgroup limit {total} shared by {}",
                            units::plural(sharing, "process", "processes")
                        ),
                    )
                } else {
                    let total = units::bytes(fact(r, 1) as u64);
                    (share, format!("RAM {total} shared by {}", units::plural(local, "process", "processes")))
                }
            }
        };
        if (bytes as u64) < memory[m] {
            memory[m] = bytes as u64;
            memory_source[m] = why;
        }
    }
    if let Some(m) = memory.iter().position(|&b| b == 0) {
        return Err(AccelError::InvalidArgument(format!(
            "auto layout: the memory of machine {m}'s processes could not be read (no /proc/meminfo); set \
             {MEMORY_ENV} (e.g. 8GiB per process)"
        )));
    }
    Ok((memory, memory_source))
}

/// The slowest link across machines: a ping-pong between machine 0's first rank and each other machine's first
/// rank (a message of 1 MiB decides which is slower: latency and bandwidth both count); `None` on one machine.
fn link_across_machines(pg: &ProcessGroup, first_rank: &[usize]) -> Result<Option<LinkEstimate>> {
    let mut slowest = [f64::NAN, f64::NAN];
    for &other in first_rank.iter().skip(1) {
        if let Some(e) = probe::ping_pong(pg, first_rank[0], other, &probe::DEFAULT_SIZES, probe::DEFAULT_REPEATS)? {
            if slowest[0].is_nan() || e.message_time(1048576.0) > slowest[0] + 1048576.0 / slowest[1] {
                slowest = [e.alpha, e.beta];
            }
        }
    }
    if first_rank.len() <= 1 {
        return Ok(None);
    }
    pg.broadcast(&mut slowest, first_rank[0])?;
    Ok(Some(LinkEstimate { alpha: slowest[0], beta: slowest[1], samples: Vec::new() }))
}

/// Every rank's `mine`, concatenated in rank order.
fn all_gather<T: ddp_core::Element + Default + Copy>(pg: &ProcessGroup, mine: &[T]) -> Result<Vec<T>> {
    let mut out = vec![T::default(); mine.len() * pg.world_size()];
    pg.all_gather(mine, &mut out)?;
    Ok(out)
}

/// FLOP/s of `[rows, k] × [k, n]` products on `device` for about [`FLOPS_PROBE_SECONDS`] (one untimed first).
fn measure_flops(device: &Device, (rows, k, n): (usize, usize, usize)) -> Result<f64> {
    let (rows, k, n) = (rows.clamp(1, 1024), k.max(1), n.max(1));
    let a = Tensor::ones((rows, k), DType::F32, device)?;
    let b = Tensor::ones((k, n), DType::F32, device)?;
    a.matmul(&b)?;
    let start = Instant::now();
    let mut products = 0u64;
    while start.elapsed().as_secs_f64() < FLOPS_PROBE_SECONDS || products == 0 {
        let c = a.matmul(&b)?;
        device.synchronize()?;
        drop(c);
        products += 1;
    }
    Ok(2.0 * (rows * k * n) as f64 * products as f64 / start.elapsed().as_secs_f64().max(1e-9))
}

/// Seconds per call of a tiny operator (a 1 × 1 product: the framework's dispatch and allocation, a launch on
/// a device), the median of [`OP_LATENCY_SAMPLES`] calls.
fn measure_op_latency(device: &Device) -> Result<f64> {
    let a = Tensor::ones((1, 1), DType::F32, device)?;
    a.matmul(&a)?;
    let mut times = Vec::with_capacity(OP_LATENCY_SAMPLES);
    for _ in 0..OP_LATENCY_SAMPLES {
        let t = Instant::now();
        let c = a.matmul(&a)?;
        device.synchronize()?;
        drop(c);
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Bytes per second one process moves through an element-wise add of two buffers of `bytes` (the model's
/// gradient, at most [`BANDWIDTH_PROBE_BYTES`], at least 64 KiB: the caches the accumulation of this model's
/// gradient sees, without the probe raising a small program's peak memory) into a third (2 read, 1 written, as a
/// gradient accumulated over micro-batches), all ranks at once so that processes sharing memory channels measure
/// their share, for about [`BANDWIDTH_PROBE_SECONDS`] (one untimed first).
fn measure_memory_bandwidth(device: &Device, bytes: usize) -> Result<f64> {
    let bytes = bytes.clamp(64 << 10, BANDWIDTH_PROBE_BYTES);
    let n = bytes / 4;
    let a = Tensor::ones(n, DType::F32, device)?;
    let b = Tensor::ones(n, DType::F32, device)?;
    drop((&a + &b)?);
    let start = Instant::now();
    let mut adds = 0u64;
    while start.elapsed().as_secs_f64() < BANDWIDTH_PROBE_SECONDS || adds == 0 {
        let c = (&a + &b)?;
        device.synchronize()?;
        drop(c);
        adds += 1;
    }
    Ok(3.0 * (4 * n) as f64 * adds as f64 / start.elapsed().as_secs_f64().max(1e-9))
}

/// The largest buffers of [`measure_memory_bandwidth`], bytes each.
pub const BANDWIDTH_PROBE_BYTES: usize = 16 << 20;

/// Seconds [`measure_memory_bandwidth`] runs.
pub const BANDWIDTH_PROBE_SECONDS: f64 = 0.02;

/// Calls [`measure_op_latency`] times (about a millisecond on a CPU).
pub const OP_LATENCY_SAMPLES: usize = 201;

/// Seconds of computation between two synchronisations in [`measure_sync_latency`] (at the rank's measured
/// FLOP/s: about a tensor-parallel half-block of a small micro-batch).
pub const SYNC_PROBE_CHUNK_SECONDS: f64 = 0.002;

/// Rounds of [`measure_sync_latency`] (after one untimed round).
pub const SYNC_PROBE_ROUNDS: usize = 16;

/// Seconds a blocking collective costs beyond its α–β time while the group's processes compute: every rank of
/// `group` (one machine's) runs [`SYNC_PROBE_ROUNDS`] rounds of a product of about [`SYNC_PROBE_CHUNK_SECONDS`]
/// at its measured `flops` (`[rows, k] × [k, n]`, `rows` sized to it) followed by a one-element all-reduce over
/// the group, as tensor parallelism alternates computation and all-reduces. A round's wall time minus the
/// product's time at `flops` and minus `quiet`, the all-reduce's own α–β time on the idle group (which the cost
/// model already counts), is the wait for the peers: about 0 when every process has a core, a scheduling delay
/// (milliseconds) when they share cores and a peer must first be run again. Never negative.
fn measure_sync_latency(
    group: &ProcessGroup,
    device: &Device,
    (k, n): (usize, usize),
    flops: f64,
    quiet: f64,
) -> Result<f64> {
    let (k, n) = (k.max(1), n.max(1));
    let rows = ((SYNC_PROBE_CHUNK_SECONDS * flops / (2.0 * (k * n) as f64)).round() as usize).clamp(1, 4096);
    let chunk = 2.0 * (rows * k * n) as f64 / flops.max(1.0);
    let a = Tensor::ones((rows, k), DType::F32, device)?;
    let b = Tensor::ones((k, n), DType::F32, device)?;
    let mut one = [1.0f32];
    let mut round = || -> Result<()> {
        let c = a.matmul(&b)?;
        device.synchronize()?;
        drop(c);
        group.all_reduce(&mut one, ddp_core::ReduceOp::Sum)?;
        Ok(())
    };
    round()?;
    let start = Instant::now();
    for _ in 0..SYNC_PROBE_ROUNDS {
        round()?;
    }
    let per_round = start.elapsed().as_secs_f64() / SYNC_PROBE_ROUNDS as f64;
    Ok((per_round - chunk - if quiet.is_finite() { quiet } else { 0.0 }).max(0.0))
}

/// CUDA (or another accelerator) device memory in bytes; with the `nccl` feature from the driver.
fn device_memory(device: &Device) -> Result<u64> {
    #[cfg(feature = "nccl")]
    if let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() {
        return Ok(ddp_core::nccl::device::total_memory(gpu_id)?);
    }
    Err(AccelError::InvalidArgument(format!(
        "auto layout: the memory of {:?} cannot be read in this build (it needs the `nccl` feature); set {MEMORY_ENV} \
         to each process's memory (e.g. 80GiB)",
        device.location()
    )))
}

/// `MemTotal` of `/proc/meminfo`, bytes.
fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    kib_field(&text, "MemTotal:")
}

/// `VmRSS` of `/proc/self/status`, bytes.
fn resident_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&text, "VmRSS:")
}

/// The value of a `Name:   123 kB` line, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    line[name.len()..].split_whitespace().next()?.parse::<u64>().ok().map(|k| k * 1024)
}

/// This process's memory cgroup and its limit (bytes), when it has one: cgroup v2 (`memory.max`) or v1
/// (`memory.limit_in_bytes`; its "no limit" value, near 2^63, reads as none).
fn cgroup_memory_limit() -> Option<(String, u64)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let files: Vec<String> = if controllers.is_empty() {
            vec![format!("/sys/fs/cgroup{path}/memory.max"), "/sys/fs/cgroup/memory.max".into()]
        } else if controllers.split(',').any(|c| c == "memory") {
            vec![
                format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"),
                "/sys/fs/cgroup/memory/memory.limit_in_bytes".into(),
            ]
        } else {
            continue;
        };
        for file in files {
            if let Ok(v) = std::fs::read_to_string(&file) {
                return match v.trim().parse::<u64>() {
                    Ok(limit) if limit < (1 << 60) => Some((format!("{controllers}:{path}"), limit)),
                    _ => None,
                };
            }
        }
    }
    None
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// The launcher's node rank (`GROUP_RANK`, `SLURM_NODEID`, ...), 0 without one.
fn node_rank() -> usize {
    ddp_core::DistEnv::detect_from_env().ok().flatten().map(|e| e.node_rank).unwrap_or(0)
}

/// FNV-1a of `s`: the same on every machine and build (std's hasher is seeded per process).
fn stable_hash(s: &str) -> i64 {
    ddp_core::fingerprint::fnv1a(s.as_bytes()) as i64
}

/// The memory per process [`MEMORY_ENV`] gives: `None` when it is unset or blank.
///
/// Errors: [`parse_memory`]'s, naming the variable.
pub fn memory_from_env() -> Result<Option<u64>> {
    std::env::var(MEMORY_ENV).ok().filter(|v| !v.trim().is_empty()).map(|v| parse_memory(&v)).transpose()
}

/// Parses a memory size: `350MiB`, `8GiB`, `2G`, `512M`, `1048576` (bytes); binary units either way.
///
/// Errors: [`AccelError::Config`] naming [`MEMORY_ENV`] and the value.
pub fn parse_memory(value: &str) -> Result<u64> {
    let v = value.trim();
    let split = v.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(v.len());
    let (number, unit) = v.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => 0,
    };
    match number.parse::<f64>() {
        Ok(n) if n.is_finite() && scale > 0 && n * scale as f64 >= 1.0 => Ok((n * scale as f64) as u64),
        _ => Err(AccelError::Config {
            key: MEMORY_ENV.into(),
            value: value.into(),
            reason: "expected a memory size per process above 0, such as 350MiB, 8GiB or a number of bytes (k, m, g \
                     and t are binary units with or without a b, as in Slurm and Docker: 300MB = 300 MiB)"
                .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_memory;
    use crate::auto_layout::Link;

    #[test]
    fn a_latency_the_fit_floored_at_zero_is_said_as_such() {
        assert_eq!(Link::new(0.0, 12.7e6).to_string(), "α below the probe's resolution, β 12.7 MB/s");
        assert_eq!(Link::new(5e-6, 511.9e6).to_string(), "α 5.0 µs, β 511.9 MB/s");
    }

    #[test]
    fn memory_sizes_read_with_binary_units_and_bad_ones_name_the_variable() {
        for (text, bytes) in [("350MiB", 350 << 20), ("2G", 2 << 30), ("350mb", 350 << 20), (" 1048576 ", 1 << 20)] {
            assert_eq!(parse_memory(text).unwrap(), bytes, "{text}");
        }
        for bad in ["abc", "0", "-5MiB", "0.5", "12 parsecs", ""] {
            let e = parse_memory(bad).unwrap_err().to_string();
            assert!(e.contains("ACCEL_AUTO_LAYOUT_MEMORY") && e.contains("such as 350MiB"), "{bad}: {e}");
        }
    }
}
