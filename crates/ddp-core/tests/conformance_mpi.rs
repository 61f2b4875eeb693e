//! The shared conformance suite (`conformance/mod.rs`) on the MPI backend, under `mpirun -np 2, 3 and 4`.
//!
//! A test with its own `main` (harness = false): run by `cargo test -p ddp-core --features mpi`, it starts
//! `mpirun` on its own executable for each world size; the MPI processes (they see OMPI_COMM_WORLD_SIZE or
//! PMI_SIZE) run the suite and rank 0 prints the summary. It also checks the environment path
//! (`init_from_env` with ACCEL_BACKEND=mpi) and that a stuck rank makes the watchdog abort the job with an
//! error naming the collective. Needs `mpirun` (Debian: openmpi-bin); as root it passes --allow-run-as-root.

mod conformance;

use ddp_core::{ProcessGroup, ReduceOp};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

/// Environment variable selecting what an MPI process does.
const MODE_ENV: &str = "DDP_CONFORMANCE_MODE";

fn main() -> ExitCode {
    if ddp_core::env::is_mpi_launched() {
        return match std::env::var(MODE_ENV).as_deref() {
            Ok("env") => worker_env(),
            Ok("stuck") => worker_stuck(),
            _ => worker_suite(),
        };
    }
    driver()
}

/// `mpirun` with the flags a root-run CI container needs.
fn mpirun(np: usize, mode: &str) -> Command {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &np.to_string(), "--oversubscribe", "--bind-to", "none"]);
    // SAFETY-free check: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.args(["-x", &format!("{MODE_ENV}={mode}")]);
    cmd.arg(exe);
    cmd
}

fn driver() -> ExitCode {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("conformance_mpi: `mpirun` not found; install openmpi-bin (scripts/ci-mpi.sh does)");
        return ExitCode::FAILURE;
    }
    let (mut passed, mut failed) = (0, 0);
    let mut check = |name: String, ok: bool, detail: String| {
        println!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        if ok {
            passed += 1;
        } else {
            failed += 1;
            println!("{detail}");
        }
    };
    for np in [2, 3, 4] {
        let start = Instant::now();
        let out = mpirun(np, "suite").output().expect("running mpirun");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let summary = text.lines().find(|l| l.starts_with("MPI suite:")).unwrap_or("no summary").to_string();
        println!("mpirun -np {np}: {summary} ({:.1} s)", start.elapsed().as_secs_f64());
        check(format!("conformance_suite_np{np}"), out.status.success() && summary.contains(" 0 failed"), text);
    }
    let out = mpirun(2, "env").output().expect("running mpirun");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    check("init_from_env_with_accel_backend_mpi".into(), out.status.success() && text.contains("env ok"), text);

    let start = Instant::now();
    let out = mpirun(2, "stuck").output().expect("running mpirun");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let named =
        text.contains("all_reduce (sequence number 1, group of 2) failed on rank 0") && text.contains("timed out");
    check(
        format!("stuck_rank_aborts_the_job_naming_the_collective ({:.1} s)", start.elapsed().as_secs_f64()),
        !out.status.success() && named,
        text,
    );
    println!("\ntest result: {}. {passed} passed; {failed} failed", if failed == 0 { "ok" } else { "FAILED" });
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Runs the suite; rank 0 prints the job-wide summary; every rank exits non-zero if any rank failed.
fn worker_suite() -> ExitCode {
    let pg = ProcessGroup::init_mpi(Duration::from_secs(300)).expect("init_mpi");
    assert_eq!(pg.backend_name(), "mpi");
    let opts = conformance::SuiteOptions { large: 256 * 1024 + 3, ..Default::default() };
    let out = conformance::run(&pg, &opts);
    for f in &out.failed {
        eprintln!("rank {}: FAILED {f}", pg.rank());
    }
    let mut counts = [out.passed as i64, out.failed.len() as i64];
    pg.all_reduce(&mut counts, ReduceOp::Sum).expect("summing the counts");
    if pg.rank() == 0 {
        println!("MPI suite: {} passed, {} failed (world {})", counts[0], counts[1], pg.world_size());
    }
    if counts[1] == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `init_from_env` (ACCEL_BACKEND=mpi): the layout from OMPI_COMM_WORLD_*, checked against MPI's.
fn worker_env() -> ExitCode {
    std::env::set_var("ACCEL_BACKEND", "mpi");
    let pg = ProcessGroup::init_from_env().expect("init_from_env");
    let mut v = [pg.rank() as f32 + 1.0];
    pg.all_reduce(&mut v, ReduceOp::Sum).expect("all_reduce");
    let expected = (pg.world_size() * (pg.world_size() + 1) / 2) as f32;
    assert_eq!(v[0], expected);
    assert_eq!(pg.local_world_size(), pg.world_size(), "one machine: every rank is local");
    if pg.rank() == 0 {
        println!("env ok: {} ranks on {}", pg.world_size(), pg.backend_name());
    }
    ExitCode::SUCCESS
}

/// Rank 1 never joins the all_reduce: rank 0's watchdog must abort the job after the 1 s timeout.
fn worker_stuck() -> ExitCode {
    let pg = ProcessGroup::init_mpi(Duration::from_secs(1)).expect("init_mpi");
    if pg.rank() == 1 {
        std::thread::sleep(Duration::from_secs(30));
        return ExitCode::SUCCESS;
    }
    let mut v = [1.0f32];
    let r = pg.all_reduce(&mut v, ReduceOp::Sum);
    eprintln!("rank 0: all_reduce returned {r:?} instead of aborting");
    ExitCode::FAILURE
}
