//! Reading the job layout from the environment, the way torchrun, Slurm and MPI launchers publish it.
//!
//! Order of precedence: torchrun/Accelerate names (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//! MASTER_PORT), then Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE/…), then Open MPI
//! (OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK/_LOCAL_SIZE), then PMI (PMI_RANK, PMI_SIZE). A variable that is
//! missing or does not parse is an error naming it.

use crate::{DdpError, Result};

/// Environment variable: set by the launcher when it hosts the store itself (workers then only connect).
pub const AGENT_STORE_ENV: &str = "ACCEL_USE_AGENT_STORE";
/// Environment variable: collective timeout in seconds (default 1800).
pub const TIMEOUT_ENV: &str = "ACCEL_TIMEOUT";
/// Environment variable: backend name (`cpu`, `nccl`, `mpi`, `auto`).
pub const BACKEND_ENV: &str = "ACCEL_BACKEND";
/// Default MASTER_ADDR.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// Default MASTER_PORT (as torchrun).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Where the layout came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// RANK / WORLD_SIZE (torchrun, accel launch).
    Torchrun,
    /// SLURM_PROCID / SLURM_NTASKS.
    Slurm,
    /// OMPI_COMM_WORLD_*.
    OpenMpi,
    /// PMI_RANK / PMI_SIZE (MPICH, Intel MPI).
    Pmi,
}

/// A job layout as read from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank on this machine.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Node (machine) rank, GROUP_RANK in torchrun.
    pub node_rank: usize,
    /// Address of the store.
    pub master_addr: String,
    /// Port of the store.
    pub master_port: u16,
    /// Which launcher's names were used.
    pub source: EnvSource,
    /// Whether the launcher hosts the store (workers must not start one).
    pub agent_store: bool,
}

impl DistEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads from any lookup function (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let _ = &get;
        todo!("ddp-core env: torchrun, then Slurm, then Open MPI, then PMI; errors name the variable")
    }
}

/// Parses an integer variable, naming it on error.
pub fn parse_var<T: std::str::FromStr>(var: &str, value: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    value.trim().parse::<T>().map_err(|e| DdpError::Env {
        var: var.to_string(),
        reason: format!("{value:?} is not a valid number ({e})"),
    })
}
