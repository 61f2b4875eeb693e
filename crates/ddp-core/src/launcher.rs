//! Worker launcher (library): spawns the local workers of a job with torchrun's environment, hosts the store,
//! prefixes their output with the rank, and stops everything when one fails. `accel launch` is a thin CLI on it.

use crate::Result;
use std::path::PathBuf;
use std::time::Duration;

/// What to launch and how.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Workers on this machine.
    pub nproc_per_node: usize,
    /// Machines in the job.
    pub nnodes: usize,
    /// This machine's rank (0 hosts the store).
    pub node_rank: usize,
    /// Store address (workers connect here; node 0 binds it).
    pub master_addr: String,
    /// Store port; 0 picks a free one (single-node only).
    pub master_port: u16,
    /// Program to run.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment for every worker (e.g. ACCELERATE_MIXED_PRECISION).
    pub env: Vec<(String, String)>,
    /// Write each rank's output to `log_dir/rank{r}.log` (as well as the console when `tee`).
    pub log_dir: Option<PathBuf>,
    /// Also print worker output (prefixed by `[rank r]`) when logging to files. Default true.
    pub tee: bool,
    /// Restart the whole worker group up to this many times after a failure (default 0).
    pub max_restarts: usize,
    /// How long to wait after SIGTERM before SIGKILL when stopping workers.
    pub stop_grace: Duration,
}

impl LaunchConfig {
    /// One machine, `n` workers, free port, output teed, no restarts.
    pub fn local(n: usize, program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        LaunchConfig {
            nproc_per_node: n,
            nnodes: 1,
            node_rank: 0,
            master_addr: crate::env::DEFAULT_MASTER_ADDR.into(),
            master_port: 0,
            program: program.into(),
            args,
            env: Vec::new(),
            log_dir: None,
            tee: true,
            max_restarts: 0,
            stop_grace: Duration::from_secs(5),
        }
    }
}

/// Runs the workers to completion. `Ok(())` when all exit 0; otherwise [`crate::DdpError::WorkerFailed`] naming
/// the first failing rank and its status, after stopping the others.
pub fn launch(cfg: &LaunchConfig) -> Result<()> {
    let _ = cfg;
    todo!("launcher")
}
