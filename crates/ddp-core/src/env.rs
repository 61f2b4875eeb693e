//! Reading the job layout from the environment, the way torchrun, Slurm and MPI launchers publish it.
//!
//! Order of precedence: torchrun/Accelerate names (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//! MASTER_PORT), then Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE/…), then Open MPI
//! (OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK/_LOCAL_SIZE), then PMI (PMI_RANK, PMI_SIZE). A variable that is
//! missing or does not parse is an error naming it.

use crate::backend::BackendKind;
use crate::token::{RunToken, RUN_TOKEN_ENV};
use crate::{DdpError, InitOptions, Result};
use std::time::Duration;

/// Environment variable: set by the launcher when it hosts the store itself (workers then only connect).
pub const AGENT_STORE_ENV: &str = "ACCEL_USE_AGENT_STORE";
/// Environment variable: collective timeout in seconds (default 1800).
pub const TIMEOUT_ENV: &str = "ACCEL_TIMEOUT";
/// Environment variable: backend name (`cpu`, `nccl`, `mpi`, `auto`).
pub const BACKEND_ENV: &str = "ACCEL_BACKEND";
/// Environment variable: how many times the worker group has been restarted (0 on the first run; an elastic job's
/// round), like torchrun's TORCHELASTIC_RESTART_COUNT. Set by the launcher; process groups namespace their store
/// keys by it.
pub const RESTART_COUNT_ENV: &str = "ACCEL_RESTART_COUNT";
/// Environment variable: the launch's `max_restarts`, like torchrun's TORCHELASTIC_MAX_RESTARTS.
pub const MAX_RESTARTS_ENV: &str = "ACCEL_MAX_RESTARTS";
/// Environment variable: an elastic job's `MIN:MAX` machines (set for its workers; unset in a static job), as
/// torchrun's `--nnodes MIN:MAX`. A program that keeps its global batch across sizes reads it (the Trainer does).
pub const ELASTIC_NNODES_ENV: &str = "ACCEL_ELASTIC_NNODES";
/// Default timeout of a collective: 30 min, as PyTorch's non-NCCL backends (ACCEL_TIMEOUT or
/// [`crate::InitOptions::timeout`] change it).
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
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

    /// Reads from any lookup function (tests pass a map). Empty values count as unset.
    ///
    /// The first launcher family whose rank or size variable is present wins (torchrun, Slurm, Open MPI, PMI).
    /// Within a family the rank and size are required together; the local rank/size and node rank are optional:
    /// without a local size the job is taken to be on one machine (local rank = rank), and the node rank
    /// defaults to `rank / local_world_size` (block placement, as every launcher here uses by default).
    ///
    /// Errors ([`DdpError::Env`] naming the variable): rank without size or the reverse, a value that is not a
    /// number, `rank >= world_size`, `local_rank >= local_world_size`, a local size outside `1..=world_size`,
    /// MASTER_PORT not a port (or 0 for a multi-process job the launcher does not host), MASTER_ADDR unset for a
    /// job spanning several machines, a bad ACCEL_USE_AGENT_STORE, or no layout at all (listing what was looked
    /// for).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let family = FAMILIES
            .iter()
            .find(|f| f.detect.iter().any(|v| get(v).is_some()))
            .ok_or_else(|| DdpError::Env { var: "RANK".into(), reason: no_layout_message() })?;
        let layout = family.read(&get)?;

        let agent_store = match get(AGENT_STORE_ENV) {
            None => false,
            Some(v) => parse_bool(AGENT_STORE_ENV, &v)?,
        };
        let master_port = match get("MASTER_PORT") {
            None => DEFAULT_MASTER_PORT,
            Some(v) => parse_var::<u16>("MASTER_PORT", &v)?,
        };
        if master_port == 0 && layout.world_size > 1 && !agent_store {
            return Err(DdpError::Env {
                var: "MASTER_PORT".into(),
                reason: "0 means \"pick a free port\", which only works when a launcher hosts the store and tells \
                         the workers its port; set a fixed port (e.g. 29500) or start the job with `accel launch`"
                    .into(),
            });
        }
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None if layout.local_world_size < layout.world_size => {
                return Err(DdpError::Env {
                    var: "MASTER_ADDR".into(),
                    reason: format!(
                        "not set, but the job spans several machines ({} = {} of {} = {} processes are on this \
                         one); export the address of the machine running rank 0 on every machine{}",
                        family.local_size_name(),
                        layout.local_world_size,
                        family.size,
                        layout.world_size,
                        if family.source == EnvSource::Slurm {
                            " (e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1))"
                        } else {
                            ""
                        }
                    ),
                })
            }
            None => DEFAULT_MASTER_ADDR.to_string(),
        };
        Ok(DistEnv {
            rank: layout.rank,
            world_size: layout.world_size,
            local_rank: layout.local_rank,
            local_world_size: layout.local_world_size,
            node_rank: layout.node_rank,
            master_addr,
            master_port,
            source: family.source,
            agent_store,
        })
    }

    /// The job layout when the environment describes one; `None` when no launcher family's rank or size
    /// variable is set — a plain single-process run, or a shell inside a Slurm allocation (`salloc` sets
    /// `SLURM_NTASKS`, but a process that `srun` did not start has no `SLURM_PROCID`: it is no task of a step).
    /// This is the one place that decides "distributed or not": higher levels ask it instead of reading
    /// variables themselves. Errors as [`Self::from_lookup`] when a layout is present but inconsistent.
    pub fn detect(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let present = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty());
        if FAMILIES.iter().any(|f| f.detect.iter().any(|v| present(v))) {
            Self::from_lookup(get).map(Some)
        } else {
            Ok(None)
        }
    }

    /// [`Self::detect`] over the process environment.
    pub fn detect_from_env() -> Result<Option<Self>> {
        Self::detect(|k| std::env::var(k).ok())
    }

    /// Whether the job spans more than one machine.
    pub fn is_multi_node(&self) -> bool {
        self.local_world_size < self.world_size
    }
}

/// The rank variable each launcher family sets in the processes it starts (torchrun / `accel launch`, Slurm's
/// `srun`, Open MPI, PMI): a process that has one is a worker of a launched job.
const WORKER_RANK_VARS: [&str; 4] = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];

/// Whether this process is a worker of a launched job: a launcher's rank variable is set, even empty (RANK from
/// torchrun / `accel launch`, SLURM_PROCID, OMPI_COMM_WORLD_RANK or PMI_RANK). What
/// [`crate::launcher::is_worker`] answers; the job's layout itself is [`DistEnv::from_env`]'s.
pub fn is_launched_worker() -> bool {
    WORKER_RANK_VARS.iter().any(|v| std::env::var_os(v).is_some())
}

/// Whether an MPI launcher started this process (`mpirun` / `mpiexec` of Open MPI, MPICH or a PMIx runtime):
/// OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK is set, even empty.
pub fn is_mpi_launched() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"].iter().any(|v| std::env::var_os(v).is_some())
}

/// MASTER_ADDR when it names a host (set and not blank): the store address the user chose, which the MPI
/// bootstrap prefers to the processor name. `None` leaves the choice to the caller (unlike
/// [`DistEnv::master_addr`], which defaults it).
pub fn explicit_master_addr() -> Option<String> {
    std::env::var("MASTER_ADDR").ok().filter(|a| !a.trim().is_empty())
}

/// The variable names one launcher family publishes.
struct Family {
    source: EnvSource,
    /// Presence of any of these selects the family.
    detect: &'static [&'static str],
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    /// Local size variables, tried in order (Slurm has two, the second in its compressed list form).
    local_size: &'static [&'static str],
    node_rank: Option<&'static str>,
}

const FAMILIES: [Family; 4] = [
    Family {
        source: EnvSource::Torchrun,
        detect: &["RANK", "WORLD_SIZE"],
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: &["LOCAL_WORLD_SIZE"],
        node_rank: Some("GROUP_RANK"),
    },
    Family {
        source: EnvSource::Slurm,
        // SLURM_NTASKS alone is also set in an `salloc` shell, where this process is no task of a step.
        detect: &["SLURM_PROCID"],
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_size: &["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"],
        node_rank: Some("SLURM_NODEID"),
    },
    Family {
        source: EnvSource::OpenMpi,
        detect: &["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"],
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: &["OMPI_COMM_WORLD_LOCAL_SIZE"],
        node_rank: None,
    },
    Family {
        source: EnvSource::Pmi,
        detect: &["PMI_RANK", "PMI_SIZE"],
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        // Set by MPICH's and Intel MPI's Hydra process manager.
        local_rank: "MPI_LOCALRANKID",
        local_size: &["MPI_LOCALNRANKS"],
        node_rank: None,
    },
];

fn no_layout_message() -> String {
    let looked: Vec<String> = FAMILIES.iter().map(|f| format!("{}/{}", f.rank, f.size)).collect();
    format!(
        "no job layout found in the environment (looked for {} — set by torchrun/accel launch, Slurm srun, \
         Open MPI mpirun and MPICH/Intel MPI); start the program with `accel launch -n N <program>`, or set RANK \
         and WORLD_SIZE (plus MASTER_ADDR/MASTER_PORT) yourself",
        looked.join(", ")
    )
}

struct Layout {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    node_rank: usize,
}

impl Family {
    fn local_size_name(&self) -> &'static str {
        self.local_size[0]
    }

    fn read(&self, get: &impl Fn(&str) -> Option<String>) -> Result<Layout> {
        let required = |var: &str, other: &str| -> Result<usize> {
            let v = get(var).ok_or_else(|| DdpError::Env {
                var: var.to_string(),
                reason: format!("not set, but {other} is; a launcher sets both (set {var} too, or unset {other})"),
            })?;
            parse_var::<usize>(var, &v)
        };
        let rank = required(self.rank, self.size)?;
        let world_size = required(self.size, self.rank)?;
        if world_size == 0 {
            return Err(DdpError::Env { var: self.size.into(), reason: "must be at least 1".into() });
        }
        if rank >= world_size {
            return Err(DdpError::Env {
                var: self.rank.into(),
                reason: format!("{} = {rank} is not below {} = {world_size}", self.rank, self.size),
            });
        }
        let optional = |var: &str| get(var).map(|v| parse_var::<usize>(var, &v)).transpose();
        let local_rank = optional(self.local_rank)?;
        let node_rank = self.node_rank.map(optional).transpose()?.flatten();

        // The local size: the first variable present, with Slurm's compressed list form for the last one.
        let mut local_size: Option<(usize, &str)> = None;
        for var in self.local_size {
            if let Some(v) = get(var) {
                let n = if *var == "SLURM_TASKS_PER_NODE" {
                    slurm_tasks_on_node(var, &v, node_rank, self.node_rank.unwrap_or("SLURM_NODEID"))?
                } else {
                    parse_var::<usize>(var, &v)?
                };
                local_size = Some((n, var));
                break;
            }
        }
        let (local_world_size, lws_var) = match (local_size, local_rank) {
            (Some((n, var)), _) => (n, var),
            // No local size: one machine, unless the local rank says otherwise.
            (None, None) => (world_size, self.local_size_name()),
            (None, Some(lr)) if lr == rank => (world_size, self.local_size_name()),
            (None, Some(lr)) => {
                return Err(DdpError::Env {
                    var: self.local_size_name().into(),
                    reason: format!(
                        "not set, but {} = {lr} differs from {} = {rank}, so the job spans several machines; \
                         set {} to the number of processes on this machine",
                        self.local_rank,
                        self.rank,
                        self.local_size_name()
                    ),
                })
            }
        };
        if local_world_size == 0 || local_world_size > world_size {
            return Err(DdpError::Env {
                var: lws_var.into(),
                reason: format!("{local_world_size} is outside 1..={world_size} ({} = {world_size})", self.size),
            });
        }
        let local_rank = local_rank.unwrap_or(rank % local_world_size);
        if local_rank >= local_world_size {
            return Err(DdpError::Env {
                var: self.local_rank.into(),
                reason: format!("{} = {local_rank} is not below {lws_var} = {local_world_size}", self.local_rank),
            });
        }
        let node_rank = node_rank.unwrap_or(rank / local_world_size);
        Ok(Layout { rank, world_size, local_rank, local_world_size, node_rank })
    }
}

/// Tasks on node `node` from Slurm's compressed per-node list, e.g. `"2(x3),1"` = 2, 2, 2, 1.
fn slurm_tasks_on_node(var: &str, value: &str, node: Option<usize>, node_var: &str) -> Result<usize> {
    let bad = |why: String| DdpError::Env {
        var: var.to_string(),
        reason: format!("{value:?} is not a Slurm task list like \"2(x3),1\": {why}"),
    };
    let mut per_node: Vec<(usize, usize)> = Vec::new(); // (tasks, repeat)
    for item in value.split(',') {
        let item = item.trim();
        let (count, repeat) = match item.split_once('(') {
            None => (item, "1"),
            Some((count, rest)) => {
                let rep = rest.strip_prefix('x').and_then(|r| r.strip_suffix(')'));
                (count, rep.ok_or_else(|| bad(format!("{item:?} should look like N(xM)")))?)
            }
        };
        let count = count.parse::<usize>().map_err(|e| bad(format!("{count:?}: {e}")))?;
        let repeat = repeat.parse::<usize>().map_err(|e| bad(format!("{repeat:?}: {e}")))?;
        per_node.push((count, repeat));
    }
    match node {
        Some(node) => {
            let mut first = 0usize;
            for (count, repeat) in &per_node {
                if node < first + repeat {
                    return Ok(*count);
                }
                first += repeat;
            }
            Err(DdpError::Env {
                var: node_var.into(),
                reason: format!("node {node} is not among the {first} nodes of {var} = {value:?}"),
            })
        }
        None if per_node.iter().all(|(c, _)| *c == per_node[0].0) => Ok(per_node[0].0),
        None => Err(DdpError::Env {
            var: node_var.into(),
            reason: format!("not set, and {var} = {value:?} differs between nodes, so this node's share is unknown"),
        }),
    }
}

/// Parses a boolean flag ("1"/"0", "true"/"false", "yes"/"no", any case), naming the variable on error.
pub fn parse_bool(var: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(DdpError::Env { var: var.to_string(), reason: format!("{value:?} is not a boolean; use 1 or 0") }),
    }
}

/// [`InitOptions`] from a lookup function: the layout of [`DistEnv::from_lookup`] plus [`TIMEOUT_ENV`]
/// (seconds, default 1800), [`BACKEND_ENV`] (default `cpu`) and [`RUN_TOKEN_ENV`] (32 hex digits, optional).
/// This process hosts the store when it is rank 0 and no launcher hosts it (`ACCEL_USE_AGENT_STORE` unset).
///
/// Errors: those of [`DistEnv::from_lookup`], and [`DdpError::Env`] naming a malformed timeout, backend or token.
pub fn init_options_from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<InitOptions> {
    let env = DistEnv::from_lookup(&get)?;
    let get = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let timeout = match get(TIMEOUT_ENV) {
        None => DEFAULT_COLLECTIVE_TIMEOUT,
        Some(v) => {
            let secs = v.parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0).ok_or_else(|| DdpError::Env {
                var: TIMEOUT_ENV.into(),
                reason: format!("{v:?} is not a positive number of seconds (e.g. 1800)"),
            })?;
            Duration::try_from_secs_f64(secs).map_err(|e| DdpError::Env {
                var: TIMEOUT_ENV.into(),
                reason: format!("{v:?} seconds is not a usable duration ({e})"),
            })?
        }
    };
    let backend = match get(BACKEND_ENV) {
        None => BackendKind::default(),
        Some(v) => v.parse::<BackendKind>().map_err(|e| DdpError::Env {
            var: BACKEND_ENV.into(),
            reason: match e {
                DdpError::InvalidArgument(m) => m,
                other => other.to_string(),
            },
        })?,
    };
    let token = get(RUN_TOKEN_ENV).map(|v| RunToken::from_hex(&v)).transpose()?;
    Ok(InitOptions {
        rank: env.rank,
        world_size: env.world_size,
        local_rank: env.local_rank,
        local_world_size: env.local_world_size,
        host_store: env.rank == 0 && !env.agent_store,
        store_bind_addr: None,
        master_addr: env.master_addr,
        master_port: env.master_port,
        backend,
        timeout,
        token,
    })
}

/// [`init_options_from_lookup`] on the process environment (what [`InitOptions::from_env`] calls).
pub fn init_options_from_env() -> Result<InitOptions> {
    init_options_from_lookup(|k| std::env::var(k).ok())
}

/// Parses an integer variable, naming it on error.
pub fn parse_var<T: std::str::FromStr>(var: &str, value: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    value
        .trim()
        .parse::<T>()
        .map_err(|e| DdpError::Env { var: var.to_string(), reason: format!("{value:?} is not a valid number ({e})") })
}
