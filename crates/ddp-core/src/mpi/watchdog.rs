//! A watchdog for blocking MPI calls: MPI collectives have no timeout, so a thread checks the calls in flight
//! and, past a call's deadline, reports it like the CPU backend would and stops the job.
//!
//! Stopping is the only sound choice: MPI cannot cancel a collective, and returning an error while the call
//! still owns the caller's buffer would let MPI write into freed memory. So the error (op, sequence number,
//! rank, group size, time waited) is logged and printed, then `MPI_Abort` ends every rank of the job (`mpirun`
//! reports it). This is what PyTorch's NCCL watchdog does with `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`.
//! A dead rank needs no watchdog: `mpirun`/`srun` notice the exit and stop the job, naming the rank.

use crate::DdpError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

struct InFlight {
    op: &'static str,
    seq: u64,
    rank: usize,
    world_size: usize,
    started: Instant,
    timeout: Duration,
}

struct Watchdog {
    calls: Mutex<HashMap<u64, InFlight>>,
    next_id: AtomicU64,
}

static WATCHDOG: OnceLock<Watchdog> = OnceLock::new();

/// How often the watchdog looks (a timeout fires at most this late).
const TICK: Duration = Duration::from_millis(200);

fn watchdog() -> &'static Watchdog {
    WATCHDOG.get_or_init(|| {
        std::thread::Builder::new()
            .name("ddp-mpi-watchdog".into())
            .spawn(run)
            .expect("spawning the MPI watchdog thread");
        Watchdog { calls: Mutex::new(HashMap::new()), next_id: AtomicU64::new(0) }
    })
}

/// Registers a blocking call; dropping the guard (when the call returns) unregisters it.
pub(crate) fn watch(op: &'static str, seq: u64, rank: usize, world_size: usize, timeout: Duration) -> Guard {
    let w = watchdog();
    let id = w.next_id.fetch_add(1, Ordering::Relaxed);
    let call = InFlight { op, seq, rank, world_size, started: Instant::now(), timeout };
    crate::sync::lock(&w.calls).insert(id, call);
    Guard { id }
}

/// Unregisters its call on drop.
pub(crate) struct Guard {
    id: u64,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(w) = WATCHDOG.get() {
            crate::sync::lock(&w.calls).remove(&self.id);
        }
    }
}

/// The error a timed-out call reports (also used in tests).
pub(crate) fn timeout_error(op: &'static str, seq: u64, rank: usize, world_size: usize, waited: Duration) -> DdpError {
    DdpError::Collective {
        op,
        seq,
        rank,
        world_size,
        peer: None,
        reason: format!(
            "timed out after {:.1} s (a rank is stuck or called a different collective); MPI cannot cancel a \
             collective, so the job is aborted (MPI_Abort)",
            waited.as_secs_f64()
        ),
    }
}

fn run() {
    loop {
        std::thread::sleep(TICK);
        let Some(w) = WATCHDOG.get() else { continue };
        let expired = {
            let calls = crate::sync::lock(&w.calls);
            calls
                .values()
                .find(|c| c.started.elapsed() >= c.timeout)
                .map(|c| timeout_error(c.op, c.seq, c.rank, c.world_size, c.started.elapsed()))
        };
        if let Some(err) = expired {
            tracing::error!("{err}");
            eprintln!("ddp-core MPI backend: {err}");
            abort_job();
        }
    }
}

fn abort_job() -> ! {
    let thread_multiple = super::runtime::runtime().map(|r| r.thread_multiple).unwrap_or(false);
    if thread_multiple {
        // SAFETY: MPI is initialised (a call was in flight) and thread-multiple, so any thread may call it.
        unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 124) };
    }
    // Without MPI_THREAD_MULTIPLE this thread may not call MPI: leave without running atexit handlers (which
    // would finalise MPI under the blocked call); mpirun sees the exit and stops the other ranks.
    // SAFETY: _exit ends the process immediately; nothing here relies on destructors.
    unsafe { libc::_exit(124) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_errors_read_like_the_cpu_backend() {
        let msg = timeout_error("all_reduce", 12, 1, 4, Duration::from_secs(3)).to_string();
        assert!(msg.contains("all_reduce (sequence number 12, group of 4) failed on rank 1"), "{msg}");
        assert!(msg.contains("timed out after 3.0 s"), "{msg}");
    }
}
