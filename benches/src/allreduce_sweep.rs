//! The collective size sweep behind `allreduce_bw` (CPU backend) and `allreduce_bw_mpi` (MPI backend), in the style
//! of nccl-tests' `all_reduce_perf` / `broadcast_perf` / `all_gather_perf` / `reduce_scatter_perf`, so both print
//! the same table and can be joined side by side.
//!
//! For every size from `min_bytes` to `max_bytes` (doubling): `max(iters/10, 2)` warm-up calls, a barrier, then
//! `iters = clamp(volume / size, min_iters, max_iters)` back-to-back calls of `--op` (f32; SUM for the reductions;
//! broadcast from rank 0); the slowest rank's mean is reported. With `evict_mb` > 0 every timed call starts after
//! writing that much other memory (untimed), as in training, where a step's compute evicts the gradient buffers
//! and the shared segment from the caches between two all-reduces. `size` is nccl-tests' message size: the buffer of
//! all_reduce and broadcast, the gathered output of all_gather, the input of reduce_scatter (each rank contributes
//! or keeps size / P). Columns: `time` in µs; `algbw` = size / time in GB/s (10^9 B/s); `busbw` = algbw times
//! nccl-tests' factor for the op — 2(P−1)/P for all_reduce, 1 for broadcast, (P−1)/P for all_gather and
//! reduce_scatter — the per-rank wire traffic of a bandwidth-optimal algorithm, comparable across world sizes and
//! with `scripts/bench_allreduce_gloo.py`.

use anyhow::Result;
use ddp_core::{ProcessGroup, ReduceOp};
use std::time::Instant;

/// Sizes and iteration counts of a sweep (flattened into each binary's command line).
#[derive(clap::Args, Debug, Clone)]
pub struct SweepArgs {
    /// Smallest message, bytes (accepts K/M/G suffixes, powers of 1024).
    #[arg(long, default_value = "1K", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest message, bytes.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Bytes moved per size (iterations = clamp(volume / size, min_iters, max_iters)).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    pub volume: usize,
    /// Fewest timed iterations per size.
    #[arg(long, default_value_t = 5)]
    pub min_iters: usize,
    /// Most timed iterations per size.
    #[arg(long, default_value_t = 2000)]
    pub max_iters: usize,
    /// The collective to time.
    #[arg(long, value_enum, default_value_t = Op::AllReduce)]
    pub op: Op,
    /// Before each timed call, write this many MiB of other memory and wait for every rank (a barrier; both
    /// outside the timed region), so that the call starts with cold caches as it does in training, where the
    /// step's compute runs between two all-reduces; 0 (default) times back-to-back calls, with the buffer and the
    /// shared segment warm. (Cold calls start right after a barrier, so small ones include its wake-up.)
    #[arg(long, default_value_t = 0)]
    pub evict_mb: usize,
}

/// A collective of the sweep.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
#[value(rename_all = "snake_case")]
pub enum Op {
    /// `all_reduce` (SUM, in place).
    AllReduce,
    /// `broadcast` from rank 0 (in place).
    Broadcast,
    /// `all_gather` of size / P elements per rank.
    AllGather,
    /// `reduce_scatter` (SUM) of size elements into size / P per rank.
    ReduceScatter,
}

impl Op {
    /// nccl-tests' bus-bandwidth factor for `p` ranks.
    pub fn busbw_factor(self, p: usize) -> f64 {
        let p = p as f64;
        match self {
            Op::AllReduce => 2.0 * (p - 1.0) / p,
            Op::Broadcast => 1.0,
            Op::AllGather | Op::ReduceScatter => (p - 1.0) / p,
        }
    }

    /// The name ddp-core gives the collective.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
        }
    }
}

/// Parses `4096`, `64K`, `1M`, `2G` (powers of 1024).
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().map(|n| n * mult).map_err(|e| format!("{s:?}: {e}"))
}

/// `1 KiB`, `64 MiB`, `1000 B`.
pub fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Runs the sweep on `pg`; rank 0 prints `title` as a comment line, the header, then one row per size.
/// Every rank of the group must call it with the same arguments.
pub fn run(pg: &ProcessGroup, args: &SweepArgs, title: &str) -> Result<()> {
    let p = pg.world_size();
    if pg.rank() == 0 {
        println!("# {title}");
        println!(
            "# {:>10} {:>12} {:>6} {:>6} {:>12} {:>10} {:>10}",
            "size", "count", "type", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)"
        );
    }
    let mut scratch = vec![0u8; args.evict_mb << 20];
    // Sizes are whole f32 counts divisible by P, so every rank's share of all_gather / reduce_scatter is equal.
    let mut size = args.min_bytes.max(4 * p);
    while size <= args.max_bytes {
        let count = size / 4 / p * p;
        let mut buf = vec![1e-3f32; count];
        let mut share = vec![0f32; count / p];
        let mut call = || -> Result<()> {
            match args.op {
                Op::AllReduce => pg.all_reduce(&mut buf, ReduceOp::Sum)?,
                Op::Broadcast => pg.broadcast(&mut buf, 0)?,
                Op::AllGather => pg.all_gather(&share, &mut buf)?,
                Op::ReduceScatter => pg.reduce_scatter(&buf, &mut share, ReduceOp::Sum)?,
            }
            Ok(())
        };
        let iters = (args.volume / size).clamp(args.min_iters, args.max_iters);
        for _ in 0..(iters / 10).max(2) {
            call()?;
        }
        pg.barrier()?;
        let mut spent = std::time::Duration::ZERO;
        if args.evict_mb == 0 {
            let start = Instant::now();
            for _ in 0..iters {
                call()?;
            }
            spent = start.elapsed();
        } else {
            for i in 0..iters {
                scratch.iter_mut().for_each(|b| *b = b.wrapping_add(i as u8 | 1));
                std::hint::black_box(&scratch);
                // Every rank has evicted before the clock starts: the call's time is its own, not the time this
                // rank waits for a peer still writing its scratch.
                pg.barrier()?;
                let start = Instant::now();
                call()?;
                spent += start.elapsed();
            }
        }
        let mut mean = [spent.as_secs_f64() / iters as f64];
        pg.all_reduce(&mut mean, ReduceOp::Max)?;
        if pg.rank() == 0 {
            let algbw = (count * 4) as f64 / mean[0] / 1e9;
            let busbw = algbw * args.op.busbw_factor(p);
            println!(
                "  {:>10} {:>12} {:>6} {:>6} {:>12.1} {:>10.3} {:>10.3}",
                human(count * 4),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("x").is_err());
        assert_eq!(human(64 << 20), "64 MiB");
        assert_eq!(human(1000), "1000 B");
    }

    #[test]
    fn bus_bandwidth_factors_are_nccl_tests() {
        assert_eq!(Op::AllReduce.busbw_factor(2), 1.0);
        assert_eq!(Op::AllReduce.busbw_factor(4), 1.5);
        assert_eq!(Op::Broadcast.busbw_factor(4), 1.0);
        assert_eq!(Op::AllGather.busbw_factor(4), 0.75);
        assert_eq!(Op::ReduceScatter.busbw_factor(2), 0.5);
    }
}
