//! The run banner: what a run is, printed once before its first step — which config file was read, processes ×
//! machines, the layout and the backend (Accelerate prints the config it resolved, torchrun the layout), with what
//! a higher level adds (accel: the sharding and the pipeline inside the layout, mixed precision, gradient
//! accumulation) as its own words: ddp-core knows none of them.
//!
//! `accel launch` prints it from its launch plan and hands its settings to the workers in [`LAUNCH_BANNER_ENV`]
//! (and the config file it read in [`CONFIG_SOURCE_ENV`]); a worker's rank 0 prints its own only when its
//! settings differ from those (its program's flags or code changed them), so that a launched run says what it is
//! once. A program started on its own (`cargo run … --nproc 2`) prints it from rank 0.

use crate::mesh::MeshShape;
use std::fmt;

/// Environment variable: the settings `accel launch` printed ([`RunBanner::settings`]), for its workers.
pub const LAUNCH_BANNER_ENV: &str = "ACCEL_LAUNCH_BANNER";
/// Environment variable: the config file `accel launch` read, as its banner names it, for its workers.
pub const CONFIG_SOURCE_ENV: &str = "ACCEL_CONFIG_SOURCE";
/// What a banner says when no config file was read.
pub const NO_CONFIG: &str = "none: defaults";

/// What a run is. Rendered on one line, `config … | 4 processes × 1 machine | dp_replicate 2 × dp_shard 1 × tp 2
/// × pp 1 | mixed precision bf16 | gradient accumulation 1 | backend cpu`: the config, the processes and machines,
/// the layout, each of `details`, the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunBanner {
    /// The config file read (path, and what it changed) or [`NO_CONFIG`].
    pub config: String,
    /// Processes over all machines.
    pub processes: usize,
    /// Machines.
    pub machines: usize,
    /// The layout in the words of the program's level: [`RunBanner::mesh_layout`] of its device mesh at level 1;
    /// accel adds the sharding strategy and the pipeline schedule, or says which sizes it chooses at start-up.
    pub layout: String,
    /// What a higher level adds after the layout, each its own `| …` segment (accel: `mixed precision bf16`,
    /// `gradient accumulation 2`).
    pub details: Vec<String>,
    /// Collective backend: `cpu`, `nccl` or `mpi`.
    pub backend: String,
}

impl RunBanner {
    /// A device mesh's sizes as the banner's layout: `dp_replicate 2 × dp_shard 1 × tp 2 × pp 1`.
    pub fn mesh_layout(shape: &MeshShape) -> String {
        format!("dp_replicate {} × dp_shard {} × tp {} × pp {}", shape.dp_replicate, shape.dp_shard, shape.tp, shape.pp)
    }

    /// Everything but the config source: what a launcher and its workers compare.
    pub fn settings(&self) -> String {
        let processes = format!("{} process{}", self.processes, if self.processes == 1 { "" } else { "es" });
        let machines = format!("{} machine{}", self.machines, if self.machines == 1 { "" } else { "s" });
        let details: String = self.details.iter().map(|d| format!(" | {d}")).collect();
        format!("{processes} × {machines} | {}{details} | backend {}", self.layout, self.backend)
    }

    /// The config source a worker reports: what its launcher read ([`CONFIG_SOURCE_ENV`]), else [`NO_CONFIG`].
    pub fn config_from_env() -> String {
        std::env::var(CONFIG_SOURCE_ENV).ok().filter(|s| !s.trim().is_empty()).unwrap_or_else(|| NO_CONFIG.into())
    }

    /// Whether a launcher already printed exactly these settings ([`LAUNCH_BANNER_ENV`]): then a worker does not
    /// print them again.
    pub fn announced_by_launcher(&self) -> bool {
        std::env::var(LAUNCH_BANNER_ENV).is_ok_and(|s| s == self.settings())
    }

    /// The line a worker's rank 0 prints, `{program}: {banner}`, or `None` when its launcher printed the same
    /// settings already. A banner that differs from its launcher's says so.
    pub fn worker_line(&self, program: &str) -> Option<String> {
        let note = match std::env::var(LAUNCH_BANNER_ENV) {
            Ok(announced) if announced == self.settings() => return None,
            Ok(_) => " (the program changed what its launcher printed)",
            Err(_) => "",
        };
        Some(format!("{program}: {self}{note}"))
    }
}

impl fmt::Display for RunBanner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "config {} | {}", self.config, self.settings())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_with_every_field() {
        let b = RunBanner {
            config: NO_CONFIG.into(),
            processes: 4,
            machines: 2,
            layout: RunBanner::mesh_layout(&MeshShape::new(1, 2, 1, 2).unwrap()),
            details: vec!["mixed precision bf16".into(), "gradient accumulation 2".into()],
            backend: "cpu".into(),
        };
        assert_eq!(
            b.to_string(),
            "config none: defaults | 4 processes × 2 machines | dp_replicate 2 × dp_shard 1 × tp 2 × pp 1 | mixed \
             precision bf16 | gradient accumulation 2 | backend cpu"
        );
        let one = RunBanner { processes: 1, machines: 1, details: Vec::new(), ..b };
        assert_eq!(one.settings(), "1 process × 1 machine | dp_replicate 2 × dp_shard 1 × tp 2 × pp 1 | backend cpu");
    }
}
