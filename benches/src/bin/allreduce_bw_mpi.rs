//! All-reduce bandwidth of the MPI backend (feature `mpi`), the same table as `allreduce_bw` (nccl-tests style)
//! so `scripts/bench-allreduce-mpi.sh` can put the two side by side.
//!
//! ```text
//! cargo build -p accel-benches --features mpi --bin allreduce_bw_mpi
//! mpirun -np 2 target/debug/allreduce_bw_mpi
//! ```
//!
//! Every row: f32 SUM in place through `ProcessGroup::all_reduce` on the MPI backend (one blocking
//! `MPI_Allreduce` with `MPI_IN_PLACE`, i.e. what the MPI library's tuned algorithms give), `iters` =
//! clamp(volume / size, min_iters, max_iters) timed back-to-back after warm-up, slowest rank's mean;
//! `algbw` = size / time (GB/s = 10^9 B/s), `busbw` = algbw · 2(P−1)/P.

use accel_benches::allreduce_sweep::{self, SweepArgs};
use anyhow::{Context, Result};
use clap::Parser;
use ddp_core::ProcessGroup;
use std::time::Duration;

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(about = "All-reduce bandwidth of ddp-core's MPI backend (run under mpirun)")]
struct Args {
    #[command(flatten)]
    sweep: SweepArgs,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let pg = ProcessGroup::init_mpi(Duration::from_secs(600)).context("MPI process group (run under mpirun)")?;
    let lib = pg.backend().as_any().and_then(|a| a.downcast_ref::<ddp_core::mpi::MpiBackend>());
    let title = format!(
        "ddp-core MPI backend {}, {} processes, f32, {}",
        args.sweep.op.name(),
        pg.world_size(),
        lib.map_or("?", |b| b.library())
    );
    allreduce_sweep::run(&pg, &args.sweep, &title)
}
