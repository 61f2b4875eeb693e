//! The run banner: what a run is, printed once before its first step — which config file was read, processes ×
//! machines, the layout, mixed precision, gradient accumulation and the backend (Accelerate prints the config it
//! resolved, torchrun the layout).
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
/// × pp 1 | mixed precision bf16 | gradient accumulation 1 | backend cpu` (with sharded data parallelism, its
/// strategy after dp_shard: `… × dp_shard 2 (FULL_SHARD) × …`; with a pipeline, its schedule after the layout:
/// `… × pp 2 (1F1B, 4 micro-batches) | …`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunBanner {
    /// The config file read (path, and what it changed) or [`NO_CONFIG`].
    pub config: String,
    /// Processes over all machines.
    pub processes: usize,
    /// Machines.
    pub machines: usize,
    /// The device mesh: dp_replicate × dp_shard × tp × pp.
    pub layout: MeshShape,
    /// When the sizes are left to the program's automatic layout (accel's `auto` sizes), what is fixed of them
    /// (`dp_replicate auto × dp_shard auto × tp 2 × pp auto`): printed instead of `layout`, with `(chosen at
    /// start-up)`. `None` otherwise.
    pub auto_layout: Option<String>,
    /// What the dp_shard group shards when dp_shard > 1, printed after dp_shard in parentheses (`FULL_SHARD`:
    /// accel's `ParallelismConfig::sharding_string`); `None` without sharding.
    pub sharding: Option<String>,
    /// The pipeline schedule when pp > 1, printed after the layout in parentheses (`1F1B, 4 micro-batches`:
    /// accel's `ParallelismConfig::pipeline_string`); `None` without a pipeline.
    pub pipeline: Option<String>,
    /// Compute precision: `no`, `fp16` or `bf16`.
    pub mixed_precision: String,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Collective backend: `cpu`, `nccl` or `mpi`.
    pub backend: String,
}

impl RunBanner {
    /// Everything but the config source: what a launcher and its workers compare.
    pub fn settings(&self) -> String {
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "es" });
        let machines = if self.machines == 1 { "1 machine".to_string() } else { format!("{} machines", self.machines) };
        let l = &self.layout;
        let sharding = self.sharding.as_ref().map(|s| format!(" ({s})")).unwrap_or_default();
        let pipeline = self.pipeline.as_ref().map(|p| format!(" ({p})")).unwrap_or_default();
        let layout = match &self.auto_layout {
            Some(sizes) => format!("{sizes} (chosen at start-up)"),
            None => format!(
                "dp_replicate {} × dp_shard {}{sharding} × tp {} × pp {}{pipeline}",
                l.dp_replicate, l.dp_shard, l.tp, l.pp
            ),
        };
        format!(
            "{} × {machines} | {layout} | mixed precision {} | gradient accumulation {} | backend {}",
            plural(self.processes, "process"),
            self.mixed_precision,
            self.gradient_accumulation_steps,
            self.backend
        )
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
            layout: MeshShape::new(1, 2, 1, 2).unwrap(),
            auto_layout: None,
            sharding: None,
            pipeline: None,
            mixed_precision: "bf16".into(),
            gradient_accumulation_steps: 2,
            backend: "cpu".into(),
        };
        assert_eq!(
            b.to_string(),
            "config none: defaults | 4 processes × 2 machines | dp_replicate 2 × dp_shard 1 × tp 2 × pp 1 | mixed \
             precision bf16 | gradient accumulation 2 | backend cpu"
        );
        let one = RunBanner { processes: 1, machines: 1, layout: MeshShape::new(1, 1, 1, 1).unwrap(), ..b.clone() };
        assert!(one.settings().starts_with("1 process × 1 machine | "), "{}", one.settings());
        // A pipeline's schedule follows the layout.
        let pp = RunBanner {
            layout: MeshShape::new(2, 1, 1, 2).unwrap(),
            pipeline: Some("1F1B, 4 micro-batches".into()),
            ..b.clone()
        };
        assert_eq!(
            pp.settings(),
            "4 processes × 2 machines | dp_replicate 1 × dp_shard 1 × tp 2 × pp 2 (1F1B, 4 micro-batches) | mixed \
             precision bf16 | gradient accumulation 2 | backend cpu"
        );
        // A sharding strategy follows dp_shard.
        let sharded =
            RunBanner { layout: MeshShape::new(1, 1, 2, 2).unwrap(), sharding: Some("FULL_SHARD".into()), ..b };
        assert_eq!(
            sharded.settings(),
            "4 processes × 2 machines | dp_replicate 1 × dp_shard 2 (FULL_SHARD) × tp 2 × pp 1 | mixed precision bf16 \
             | gradient accumulation 2 | backend cpu"
        );
    }
}
