//! All-reduce bandwidth of the MPI backend (feature `mpi`), the same table as `allreduce_bw` (nccl-tests style)
//! so `scripts/bench-allreduce-mpi.sh` can put the two side by side.
//!
//! ```text
//! cargo build --release -p accel-benches --features mpi --bin allreduce_bw_mpi
//! mpirun -np 2 target/release/allreduce_bw_mpi
//! ```
//!
//! Every row: f32 SUM in place through `ProcessGroup::all_reduce` on the MPI backend (one blocking
//! `MPI_Allreduce` with `MPI_IN_PLACE`, i.e. what the MPI library's tuned algorithms give), `iters` =
//! clamp(volume / size, min_iters, max_iters) timed back-to-back after warm-up, slowest rank's mean;
//! `algbw` = size / time (GB/s = 10^9 B/s), `busbw` = algbw · 2(P−1)/P.

use anyhow::{Context, Result};
use clap::Parser;
use ddp_core::{ProcessGroup, ReduceOp};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "All-reduce bandwidth of ddp-core's MPI backend (run under mpirun)")]
struct Args {
    /// Smallest message, bytes (K/M/G suffixes, powers of 1024).
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
    let pg = ProcessGroup::init_mpi(Duration::from_secs(600)).context("MPI process group (run under mpirun)")?;
    let p = pg.world_size();
    if pg.rank() == 0 {
        let lib = pg.backend().as_any().and_then(|a| a.downcast_ref::<ddp_core::mpi::MpiBackend>());
        println!(
            "# ddp-core MPI backend all_reduce, {p} processes, f32 SUM in place, {}",
            lib.map_or("?", |b| b.library())
        );
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
        for _ in 0..(iters / 10).max(2) {
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
