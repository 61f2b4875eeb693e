//! Send/recv ping-pong between ranks 0 and 1 of the CPU backend, shared-memory rings and TCP side by side in one
//! run (`allreduce_bw --pingpong`), in the style of OSU's `osu_latency`.
//!
//! For every size from `min_bytes` to `max_bytes` (doubling), on each of the two groups in turn (so both see the
//! same background load): `max(iters/10, 2)` warm-up round trips, a barrier, then `iters = clamp(volume / size,
//! min_iters, max_iters)` timed round trips (rank 0 sends, rank 1 receives and sends the buffer back). Reported:
//! one-way time = round-trip time / 2 in µs (the slower of ranks 0 and 1), and bandwidth = size / one-way time in
//! GB/s (10^9 B/s). Ranks beyond 1 only join the barriers.

use crate::allreduce_sweep::{human, SweepArgs};
use anyhow::{ensure, Result};
use ddp_core::{ProcessGroup, ReduceOp};
use std::time::Instant;

/// Runs the sweep on `shm` (send/recv through the shared-memory rings) and `tcp` (the same ranks with shared
/// memory off); rank 0 prints `title`, the header and one row per size. Every rank of both groups calls it.
pub fn run(shm: &ProcessGroup, tcp: &ProcessGroup, args: &SweepArgs, title: &str) -> Result<()> {
    ensure!(shm.world_size() >= 2, "the ping-pong needs at least 2 processes");
    if shm.rank() == 0 {
        println!("# {title}");
        println!(
            "# {:>10} {:>6} {:>12} {:>10} {:>12} {:>10} {:>8}",
            "size", "iters", "shm(us)", "shm(GB/s)", "tcp(us)", "tcp(GB/s)", "shm/tcp"
        );
    }
    let mut size = args.min_bytes.max(1);
    while size <= args.max_bytes {
        let iters = (args.volume / size).clamp(args.min_iters, args.max_iters);
        let mut buf = vec![1u8; size];
        let on_shm = one_way_seconds(shm, &mut buf, iters)?;
        let on_tcp = one_way_seconds(tcp, &mut buf, iters)?;
        if shm.rank() == 0 {
            let gbps = |t: f64| size as f64 / t / 1e9;
            println!(
                "  {:>10} {:>6} {:>12.2} {:>10.3} {:>12.2} {:>10.3} {:>8.2}",
                human(size),
                iters,
                on_shm * 1e6,
                gbps(on_shm),
                on_tcp * 1e6,
                gbps(on_tcp),
                on_tcp / on_shm
            );
        }
        size *= 2;
    }
    shm.barrier()?;
    Ok(())
}

/// Mean one-way time of `iters` round trips of `buf` between ranks 0 and 1 (the slower rank's), seconds.
fn one_way_seconds(pg: &ProcessGroup, buf: &mut [u8], iters: usize) -> Result<f64> {
    let round_trip = |buf: &mut [u8]| -> Result<()> {
        match pg.rank() {
            0 => {
                pg.send(buf, 1)?;
                pg.recv(buf, 1)?;
            }
            1 => {
                pg.recv(buf, 0)?;
                pg.send(buf, 0)?;
            }
            _ => {}
        }
        Ok(())
    };
    for _ in 0..(iters / 10).max(2) {
        round_trip(buf)?;
    }
    pg.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        round_trip(buf)?;
    }
    let mut mean = [start.elapsed().as_secs_f64() / iters as f64 / 2.0];
    if pg.rank() > 1 {
        mean[0] = 0.0;
    }
    pg.all_reduce(&mut mean, ReduceOp::Max)?;
    Ok(mean[0])
}
