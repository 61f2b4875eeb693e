//! All-reduce bandwidth table of ddp-core's CPU backend, in the style of nccl-tests' `all_reduce_perf`.
//!
//! ```text
//! cargo run --release -p accel-benches --bin allreduce_bw -- --nproc 2
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

use anyhow::{Context, Result};
use clap::Parser;
use ddp_core::{launch, LaunchConfig, ProcessGroup, ReduceOp};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "All-reduce bandwidth of ddp-core's CPU backend (nccl-tests style table)")]
struct Args {
    /// Worker processes to launch on this machine (ignored when already launched: RANK set).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Smallest message, bytes (accepts K/M/G suffixes, powers of 1024).
    #[arg(long, default_value = "1K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest message, bytes.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    max_bytes: usize,
    /// Bytes moved per size (iterations = clamp(volume / size, min_iters, max_iters)).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    volume: usize,
    /// Fewest timed iterations per size.
    #[arg(long, default_value_t = 5)]
    min_iters: usize,
    /// Most timed iterations per size.
    #[arg(long, default_value_t = 2000)]
    max_iters: usize,
    /// Pin worker LOCAL_RANK to CPU LOCAL_RANK mod #CPUs (steadier numbers on a busy machine).
    #[arg(long)]
    pin: bool,
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().map(|n| n * mult).map_err(|e| format!("{s:?}: {e}"))
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if std::env::var_os("RANK").is_none() && std::env::var_os("SLURM_PROCID").is_none() {
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
    let p = pg.world_size();
    if pg.rank() == 0 {
        println!("# ddp-core CPU backend all_reduce, {p} processes, f32 SUM in place, tuning {:?}", tuning());
        println!(
            "# {:>10} {:>12} {:>6} {:>6} {:>12} {:>10} {:>10}",
            "size", "count", "type", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)"
        );
    }
    let mut size = args.min_bytes.max(4);
    while size <= args.max_bytes {
        let count = size / 4;
        let mut buf = vec![1e-3f32; count];
        let iters = (args.volume / size).clamp(args.min_iters, args.max_iters);
        let warmup = (iters / 10).max(2);
        for _ in 0..warmup {
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        pg.barrier()?;
        let start = Instant::now();
        for _ in 0..iters {
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        let mut mean = [start.elapsed().as_secs_f64() / iters as f64];
        pg.all_reduce(&mut mean, ReduceOp::Max)?;
        if pg.rank() == 0 {
            let algbw = size as f64 / mean[0] / 1e9;
            let busbw = algbw * 2.0 * (p as f64 - 1.0) / p as f64;
            println!(
                "  {:>10} {:>12} {:>6} {:>6} {:>12.1} {:>10.3} {:>10.3}",
                human(size),
                count,
                "f32",
                iters,
                mean[0] * 1e6,
                algbw,
                busbw
            );
        }
        size *= 2;
    }
    pg.barrier()?;
    Ok(())
}

fn tuning() -> String {
    match ddp_core::cpu::CpuTuning::from_env() {
        Ok(t) => format!(
            "segment {} / small ≤ {} / socket buffers {}",
            human(t.segment_bytes),
            human(t.small_all_reduce_bytes),
            t.socket_buffer_bytes.map_or("auto".into(), human)
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
