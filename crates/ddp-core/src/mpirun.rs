//! Handing a job to MPI's own launchers: the `mpirun` / `srun` command lines that `accel launch --backend mpi`
//! runs, for programs built with the `mpi` feature. Always compiled (the launcher does not need MPI itself).
//!
//! The workers find their rank and size through MPI, and `ACCEL_BACKEND=mpi` is exported to them, so a program
//! calling `ProcessGroup::init_from_env()` (or `Accelerator::new`) runs on the MPI backend unchanged.
//!
//! ```
//! use ddp_core::mpirun::{mpirun_command, MpiLaunch, MpiFlavor};
//! let mut job = MpiLaunch::new(4, "target/release/train", vec!["--epochs".into(), "3".into()]);
//! job.flavor = MpiFlavor::OpenMpi;
//! let cmd = mpirun_command(&job);
//! assert_eq!(cmd.get_program(), "mpirun");
//! ```

use crate::{DdpError, Result};
use std::path::PathBuf;
use std::process::Command;

/// Which `mpirun` the machine has: they spell exported variables differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiFlavor {
    /// Open MPI (`-x NAME=VALUE`, `--host`, `--oversubscribe`, `--allow-run-as-root`).
    OpenMpi,
    /// MPICH / Intel MPI Hydra (`-genv NAME VALUE`, `-hosts`).
    Mpich,
}

impl MpiFlavor {
    /// Asks `mpirun --version`. Errors: [`DdpError::BackendUnavailable`] when `mpirun` is not installed.
    pub fn detect() -> Result<Self> {
        let out = Command::new("mpirun").arg("--version").output().map_err(|e| DdpError::BackendUnavailable {
            backend: "mpi",
            reason: format!(
                "cannot run `mpirun` ({e}): install Open MPI (Debian/Ubuntu: apt-get install openmpi-bin \
                 libopenmpi-dev) or MPICH, or launch with `accel launch` on the CPU backend"
            ),
        })?;
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        Ok(if text.contains("Open MPI") || text.contains("OpenRTE") { MpiFlavor::OpenMpi } else { MpiFlavor::Mpich })
    }
}

/// What to launch through MPI.
#[derive(Debug, Clone)]
pub struct MpiLaunch {
    /// Total processes (`-np`).
    pub nproc: usize,
    /// Hosts with slots, e.g. `"node1:4,node2:4"` (`--host` / `-hosts`); `None` = this machine or the
    /// scheduler's allocation.
    pub hosts: Option<String>,
    /// Program to run on every rank.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment for every rank (ACCEL_BACKEND=mpi is always exported).
    pub env: Vec<(String, String)>,
    /// Allow more processes than cores (Open MPI `--oversubscribe`; default true: a laptop or CI box).
    pub oversubscribe: bool,
    /// Add `--allow-run-as-root` (Open MPI refuses root otherwise); default: when running as root.
    pub allow_run_as_root: bool,
    /// Which launcher spelling to use (default: [`MpiFlavor::OpenMpi`]; see [`MpiFlavor::detect`]).
    pub flavor: MpiFlavor,
    /// Anything else for mpirun, placed before the program (e.g. `--mca btl tcp,self`).
    pub extra_args: Vec<String>,
}

impl MpiLaunch {
    /// `nproc` ranks of `program args` on this machine.
    pub fn new(nproc: usize, program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        MpiLaunch {
            nproc,
            hosts: None,
            program: program.into(),
            args,
            env: Vec::new(),
            oversubscribe: true,
            allow_run_as_root: root,
            flavor: MpiFlavor::OpenMpi,
            extra_args: Vec::new(),
        }
    }

    fn all_env(&self) -> Vec<(String, String)> {
        let mut env = vec![(crate::env::BACKEND_ENV.to_string(), "mpi".to_string())];
        env.extend(self.env.iter().filter(|(k, _)| k != crate::env::BACKEND_ENV).cloned());
        env
    }
}

/// The `mpirun` command for `job` (not started: call `.status()` or `.spawn()`).
pub fn mpirun_command(job: &MpiLaunch) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &job.nproc.to_string()]);
    match job.flavor {
        MpiFlavor::OpenMpi => {
            if let Some(h) = &job.hosts {
                cmd.args(["--host", h]);
            }
            if job.oversubscribe {
                cmd.arg("--oversubscribe");
            }
            if job.allow_run_as_root {
                cmd.arg("--allow-run-as-root");
            }
            for (k, v) in job.all_env() {
                cmd.args(["-x", &format!("{k}={v}")]);
            }
        }
        MpiFlavor::Mpich => {
            if let Some(h) = &job.hosts {
                cmd.args(["-hosts", h]);
            }
            for (k, v) in job.all_env() {
                cmd.args(["-genv", &k, &v]);
            }
        }
    }
    cmd.args(&job.extra_args);
    cmd.arg(&job.program);
    cmd.args(&job.args);
    cmd
}

/// The Slurm `srun` command for `job` inside an allocation (`salloc`/`sbatch`): `srun -n N --mpi=pmix`,
/// exporting the environment plus ACCEL_BACKEND=mpi. `hosts`, `oversubscribe` and `flavor` do not apply
/// (Slurm places the tasks). Use `--mpi=pmi2` instead on clusters whose MPI was built for PMI-2.
pub fn srun_command(job: &MpiLaunch) -> Command {
    let mut cmd = Command::new("srun");
    cmd.args(["-n", &job.nproc.to_string(), "--mpi=pmix"]);
    let exports: Vec<String> = job.all_env().into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    cmd.arg(format!("--export=ALL,{}", exports.join(",")));
    cmd.args(&job.extra_args);
    cmd.arg(&job.program);
    cmd.args(&job.args);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn open_mpi_command_line() {
        let mut job = MpiLaunch::new(4, "/bin/train", vec!["--epochs".into(), "2".into()]);
        job.allow_run_as_root = true;
        job.hosts = Some("a:2,b:2".into());
        job.env = vec![("ACCELERATE_MIXED_PRECISION".into(), "bf16".into())];
        let cmd = mpirun_command(&job);
        assert_eq!(cmd.get_program(), "mpirun");
        assert_eq!(
            args(&cmd),
            [
                "-np",
                "4",
                "--host",
                "a:2,b:2",
                "--oversubscribe",
                "--allow-run-as-root",
                "-x",
                "ACCEL_BACKEND=mpi",
                "-x",
                "ACCELERATE_MIXED_PRECISION=bf16",
                "/bin/train",
                "--epochs",
                "2"
            ]
        );
    }

    #[test]
    fn mpich_and_srun_command_lines() {
        let mut job = MpiLaunch::new(2, "prog", vec![]);
        job.flavor = MpiFlavor::Mpich;
        job.env = vec![("ACCEL_BACKEND".into(), "cpu".into())]; // the backend stays mpi
        assert_eq!(args(&mpirun_command(&job)), ["-np", "2", "-genv", "ACCEL_BACKEND", "mpi", "prog"]);
        let srun = srun_command(&job);
        assert_eq!(srun.get_program(), "srun");
        assert_eq!(args(&srun), ["-n", "2", "--mpi=pmix", "--export=ALL,ACCEL_BACKEND=mpi", "prog"]);
    }
}
