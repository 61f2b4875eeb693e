//! All-reduce bandwidth table of ddp-core's CPU backend, in the style of nccl-tests' `all_reduce_perf`.
//!
//! ```text
//! cargo run -p accel-benches --bin allreduce_bw -- --nproc 2
//! ```
//!
//! Without RANK in the environment it launches `--nproc` copies of itself with `ddp_core::launch` (store on
//! 127.0.0.1, fresh run token); under a launcher (RANK/WORLD_SIZE set) it is one worker. For every size from
//! `--min-bytes` to `--max-bytes` (doubling) it runs warm-up iterations, then times `iters` back-to-back
//! all_reduce calls (f32, SUM, in place), takes the slowest rank's mean, and rank 0 prints one row:
//!
//! - `time`: mean time of one all_reduce, µs (max over ranks);
//! - `algbw` = size / time, GB/s (10^9 bytes per second);
//! - `busbw` = algbw · 2(P−1)/P, the per-rank wire traffic of a bandwidth-optimal all-reduce (nccl-tests'
//!   definition), comparable across world sizes and with `scripts/bench_allreduce_gloo.py`.
//!
//! `--op broadcast|all_gather|reduce_scatter` times that collective instead (nccl-tests' size and bus-bandwidth
//! conventions, see `accel_benches::allreduce_sweep`).
//!
//! With `--pingpong` it measures send/recv instead: a ping-pong between ranks 0 and 1, through the shared-memory
//! rings and over TCP (a second group of the same processes with shared memory off) side by side, size by size
//! (see `accel_benches::p2p_pingpong`):
//!
//! ```text
//! cargo run -p accel-benches --bin allreduce_bw -- --nproc 2 --pingpong --min-bytes 1K --max-bytes 64M
//! ```

use accel_benches::allreduce_sweep::{self, human, SweepArgs};
use accel_benches::p2p_pingpong;
use anyhow::{Context, Result};
use clap::Parser;
use ddp_core::cpu::CpuTuning;
use ddp_core::{launch, GroupOptions, LaunchConfig, ProcessGroup};

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    about = "Collectives of ddp-core's CPU backend (all_reduce, broadcast, all_gather, reduce_scatter; nccl-tests style \
             table), or a send/recv ping-pong over shared memory and TCP (--pingpong)"
)]
struct Args {
    /// Worker processes to launch on this machine (ignored when already launched: RANK set).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    #[command(flatten)]
    sweep: SweepArgs,
    /// Pin worker LOCAL_RANK to CPU LOCAL_RANK mod #CPUs (steadier numbers on a busy machine).
    #[arg(long)]
    pin: bool,
    /// Measure a send/recv ping-pong between ranks 0 and 1 instead, shared memory vs TCP side by side.
    #[arg(long)]
    pingpong: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !ddp_core::launcher::is_worker() {
        let exe = std::env::current_exe().context("locating this binary to launch its workers")?;
        let cfg = LaunchConfig::local(args.nproc, exe, std::env::args().skip(1).collect());
        launch(&cfg).context("all-reduce benchmark workers")?;
        return Ok(());
    }
    worker(&args)
}

fn worker(args: &Args) -> Result<()> {
    let pg = ProcessGroup::init_from_env().context("joining the benchmark's process group")?;
    if args.pin {
        pin_to_cpu(pg.local_rank())?;
    }
    if args.pingpong {
        return pingpong(&pg, args);
    }
    let title = format!(
        "ddp-core CPU backend {}, {} processes, f32, tuning {:?}",
        args.sweep.op.name(),
        pg.world_size(),
        tuning()
    );
    allreduce_sweep::run(&pg, &args.sweep, &title)
}

/// The ping-pong on `pg` (tuning from the environment: shared-memory rings by default) and on a second group of
/// the same processes with shared memory off (TCP).
fn pingpong(pg: &ProcessGroup, args: &Args) -> Result<()> {
    let env = CpuTuning::from_env()?;
    let opts = GroupOptions {
        timeout: pg.timeout(),
        local_rank: Some(pg.local_rank()),
        local_world_size: Some(pg.local_world_size()),
        cpu_tuning: Some(CpuTuning { shared_memory: false, ..env }),
        ..GroupOptions::default()
    };
    let tcp = ProcessGroup::from_store(pg.store(), pg.rank(), pg.world_size(), opts)
        .context("joining the TCP-only comparison group")?;
    let title = format!(
        "ddp-core CPU backend send/recv ping-pong, ranks 0 <-> 1 of {}; shm = rings of {} x {} per pair{}, tcp = \
         shared memory off; one-way time = round trip / 2",
        pg.world_size(),
        env.shm_p2p_chunks,
        human(env.shm_p2p_chunk_bytes),
        if rings_in_use(pg) { "" } else { " (NOT IN USE: shared memory unavailable or disabled)" }
    );
    p2p_pingpong::run(pg, &tcp, &args.sweep, &title)
}

/// Whether `pg`'s send/recv go through the shared-memory rings.
fn rings_in_use(pg: &ProcessGroup) -> bool {
    let cpu = pg.backend().as_any().and_then(|a| a.downcast_ref::<ddp_core::cpu::CpuBackend>());
    cpu.and_then(|c| c.shm_p2p_chunks((pg.rank() + 1) % pg.world_size())).is_some()
}

fn tuning() -> String {
    match ddp_core::cpu::CpuTuning::from_env() {
        Ok(t) => format!(
            "segment {} / small ≤ {} / socket buffers {} / shared memory {} (slots {}, pipelined above {})",
            human(t.segment_bytes),
            human(t.small_all_reduce_bytes),
            t.socket_buffer_bytes.map_or("auto".into(), human),
            if t.shared_memory { "on" } else { "off" },
            human(t.shm_slot_bytes),
            human(t.shm_min_bytes)
        ),
        Err(e) => format!("invalid: {e}"),
    }
}

/// Restricts this process to one CPU.
fn pin_to_cpu(local_rank: usize) -> Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity get valid pointers.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(local_rank % cpus, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error()).context("pinning the worker to a CPU");
        }
    }
    Ok(())
}
