//! [`ParallelismConfig`]: how many ways a job splits along each parallel dimension (Accelerate's
//! `ParallelismConfig`, `src/accelerate/parallelism_config.py`, plus a pipeline size and schedule of our own).
//!
//! The sizes are `dp_replicate` (data-parallel replicas, DDP), `dp_shard` (sharded data parallelism, ZeRO/FSDP),
//! `tp` (tensor parallelism), `pp` (pipeline stages, not in Accelerate) and `cp` (context parallelism, refused
//! until it exists). They come from code (a struct literal or the `with_*` builders), from Accelerate's YAML block
//!
//! ```yaml
//! parallelism_config:
//!   parallelism_config_dp_replicate_size: 2
//!   parallelism_config_tp_size: 2
//! ```
//!
//! (also spelled `data_parallel_size`, `tensor_parallel_size`, `pipeline_parallel_size`, as Axolotl and vLLM name
//! them), or from the `PARALLELISM_CONFIG_*_SIZE` variables `accelerate launch` / `accel launch` set
//! ([`ParallelismConfig::from_env`]).
//!
//! Rules (Accelerate's `_validate_accelerator`, minus its FSDP requirement): every size is at least 1; if every size
//! is 1 the job is data parallel over all its processes (dp_replicate = world size); otherwise the product must be
//! the world size. [`ParallelismConfig::mesh_shape`] applies them and gives the [`ddp_core::MeshShape`] the
//! Accelerator lays its [`ddp_core::DeviceMesh`] out with (`[pp, dp_replicate, dp_shard, tp]`, tp innermost).
//!
//! ## Pipeline settings (read only when pp > 1)
//!
//! | YAML key (same block)              | variable                               | default                          |
//! |------------------------------------|----------------------------------------|----------------------------------|
//! | `pipeline_parallel_schedule`       | `PARALLELISM_CONFIG_PP_SCHEDULE`       | `1F1B`                           |
//! | `pipeline_parallel_microbatches`   | `PARALLELISM_CONFIG_PP_MICROBATCHES`   | one per stage: pp × stages/rank  |
//! | `pipeline_parallel_virtual_stages` | `PARALLELISM_CONFIG_PP_VIRTUAL_STAGES` | 2 for `Interleaved1F1B`, else 1  |
//!
//! - `pipeline_parallel_schedule` is torchtitan's key and spelling: `GPipe`, `1F1B` or `Interleaved1F1B`
//!   ([`ScheduleKind`]; read case-insensitively, `-` and `_` ignored).
//! - `pipeline_parallel_microbatches`: the micro-batches each optimizer step's batch is split into for the
//!   pipeline (torchtitan's `num_pp_microbatches`, Megatron's `num_microbatches`).
//! - `pipeline_parallel_virtual_stages`: model stages per pp rank (Megatron's virtual pipeline size,
//!   `virtual_pipeline_model_parallel_size`); the model is cut into pp × this many stages.
//!
//! Rules ([`ParallelismConfig::validate_sizes`], the facts [`crate::pipeline::PipelineSchedule::new`] checks, named
//! with these keys): micro-batches and virtual stages are at least 1; with pp > 1, `Interleaved1F1B` needs at least
//! 2 stages per rank and `GPipe` / `1F1B` exactly 1; there are at least as many micro-batches as stages (pp ×
//! stages per rank: fewer would leave stages idle most of the step); `Interleaved1F1B` takes the micro-batches in
//! groups of pp, so their count is a multiple of pp (Megatron's rule). The variables are written by
//! [`ParallelismConfig::env_vars`] only when set (the schedule: when not 1F1B), so the defaults travel as absence.
//!
//! ## Sharding strategy (read only when dp_shard > 1)
//!
//! What the dp_shard group shards, [`ParallelismConfig::sharding_strategy`] ([`ShardingStrategy`]: FSDP's names
//! mapped to the ZeRO stages). Not a key of the `parallelism_config` block: Accelerate keeps it in its
//! `fsdp_config` block (`fsdp_sharding_strategy`, which `accel launch` reads) and passes it to the workers as
//! [`SHARDING_STRATEGY_ENV`] (`FSDP_SHARDING_STRATEGY`), which [`ParallelismConfig::with_overrides_from`] reads
//! (FSDP's names, `SHARD_OPTIM`, or torch's numbers 1-5; an empty value is unset) and
//! [`ParallelismConfig::env_vars`] writes only when dp_shard > 1. Default `SHARD_GRAD_OP` (ZeRO-2). `FULL_SHARD`
//! (ZeRO-3) asks more of the program: its model is built for training from the prepared model's
//! [`crate::PreparedModel::param_builder`] (each weight gathered at each use), not from a candle `VarBuilder`.

use crate::pipeline::ScheduleKind;
use crate::sharding::ShardingStrategy;
use crate::{AccelError, Result};
use ddp_core::MeshShape;

/// Environment variable: data-parallel replicas (Accelerate's name).
pub const DP_REPLICATE_SIZE_ENV: &str = "PARALLELISM_CONFIG_DP_REPLICATE_SIZE";
/// Environment variable: sharded data-parallel size (Accelerate's name).
pub const DP_SHARD_SIZE_ENV: &str = "PARALLELISM_CONFIG_DP_SHARD_SIZE";
/// Environment variable: tensor-parallel size (Accelerate's name).
pub const TP_SIZE_ENV: &str = "PARALLELISM_CONFIG_TP_SIZE";
/// Environment variable: the tensor-parallel plan as a JSON map from module-path patterns to styles
/// ([`ParallelismConfig::tp_plan`]).
pub const TP_PLAN_ENV: &str = "PARALLELISM_CONFIG_TP_PLAN";
/// Environment variable: context-parallel size (Accelerate's name).
pub const CP_SIZE_ENV: &str = "PARALLELISM_CONFIG_CP_SIZE";
/// Environment variable: pipeline-parallel size (ours, in Accelerate's naming scheme).
pub const PP_SIZE_ENV: &str = "PARALLELISM_CONFIG_PP_SIZE";
/// Environment variable: context-parallel communication strategy (kept verbatim).
pub const CP_COMM_STRATEGY_ENV: &str = "PARALLELISM_CONFIG_CP_COMM_STRATEGY";
/// Environment variable: pipeline schedule, `GPipe`, `1F1B` or `Interleaved1F1B` (ours, in Accelerate's naming
/// scheme; YAML `pipeline_parallel_schedule`).
pub const PP_SCHEDULE_ENV: &str = "PARALLELISM_CONFIG_PP_SCHEDULE";
/// Environment variable: pipeline micro-batches per optimizer step (ours; YAML `pipeline_parallel_microbatches`).
pub const PP_MICROBATCHES_ENV: &str = "PARALLELISM_CONFIG_PP_MICROBATCHES";
/// Environment variable: stages per pp rank (ours; YAML `pipeline_parallel_virtual_stages`).
pub const PP_VIRTUAL_STAGES_ENV: &str = "PARALLELISM_CONFIG_PP_VIRTUAL_STAGES";
/// Environment variable: what the dp_shard group shards ([`ShardingStrategy`]; the name `accelerate launch` sets
/// for FSDP runs). Written by [`ParallelismConfig::env_vars`] only when dp_shard > 1.
pub const SHARDING_STRATEGY_ENV: &str = "FSDP_SHARDING_STRATEGY";
/// The parallel sizes of a job (see the module documentation). `Default`: every size 1, i.e. data parallelism
/// over all processes. The `accel` CLI reads and writes it as Accelerate's `parallelism_config` YAML block.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParallelismConfig {
    /// Context-parallel communication strategy (`allgather` / `alltoall`), kept verbatim for round trips.
    pub cp_comm_strategy: Option<String>,
    /// Context-parallel size. Only 1 is accepted: context parallelism is not implemented.
    pub cp_size: usize,
    /// Data-parallel replicas (DDP): ranks holding the same model piece and seeing different data.
    pub dp_replicate_size: usize,
    /// Sharded data parallelism (ZeRO / FSDP's shard dimension): what it shards is [`Self::sharding_strategy`].
    pub dp_shard_size: usize,
    /// Pipeline ranks (ours; Accelerate has none): the model is cut into pp × [`Self::pp_stages_per_rank`]
    /// stages, run in the schedule [`Self::pp_schedule`]. The program must split its model into stages (as
    /// `accel_gpt` does).
    pub pp_size: usize,
    /// Tensor-parallel size (Megatron-style layers split over neighbouring ranks).
    pub tp_size: usize,
    /// Micro-batches each optimizer step's batch is split into for the pipeline (`pipeline_parallel_microbatches`,
    /// torchtitan's `num_pp_microbatches`); `None`: one per stage (pp × virtual stages). Only read when pp > 1.
    pub pp_microbatches: Option<usize>,
    /// Pipeline schedule (`pipeline_parallel_schedule`, torchtitan's key): GPipe, 1F1B (default) or
    /// Interleaved1F1B. Only read when pp > 1.
    pub pp_schedule: ScheduleKind,
    /// Stages per pp rank (`pipeline_parallel_virtual_stages`, Megatron's virtual pipeline size); `None`: 2 for
    /// Interleaved1F1B, 1 otherwise. Only read when pp > 1.
    pub pp_virtual_stages: Option<usize>,
    /// What the dp_shard group shards (FSDP's names: [`ShardingStrategy`]); only read when dp_shard > 1. Not a
    /// key of this block: Accelerate keeps it in `fsdp_config` (`fsdp_sharding_strategy`), and
    /// `accel launch` passes it as `FSDP_SHARDING_STRATEGY` ([`SHARDING_STRATEGY_ENV`]).
    pub sharding_strategy: ShardingStrategy,
    /// The tensor-parallel plan (`parallelism_config_tp_plan`: a map from module-path patterns to styles, as
    /// transformers writes a `tp_plan`; [`crate::plan`]), which replaces the model's default plan in
    /// [`crate::Accelerator::builder`]; `None`: the model's own. Carried to workers as [`TP_PLAN_ENV`] (JSON).
    pub tp_plan: Option<crate::plan::ParallelPlan>,
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        ParallelismConfig {
            cp_comm_strategy: None,
            cp_size: 1,
            dp_replicate_size: 1,
            dp_shard_size: 1,
            pp_size: 1,
            tp_size: 1,
            pp_microbatches: None,
            pp_schedule: ScheduleKind::default(),
            pp_virtual_stages: None,
            sharding_strategy: ShardingStrategy::default(),
            tp_plan: None,
        }
    }
}

impl std::fmt::Display for ParallelismConfig {
    /// `dp_replicate 2 × dp_shard 1 × tp 2 × pp 1 × cp 1`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.sizes().iter().map(|&(name, n)| format!("{name} {}", size_text(n))).collect();
        f.write_str(&parts.join(" × "))
    }
}

impl ParallelismConfig {
    /// A size left to the automatic layout (`auto` in a config file or a `PARALLELISM_CONFIG_*_SIZE` variable):
    /// the Accelerator chooses it at start-up from the model the program describes
    /// ([`crate::AcceleratorConfig::auto_layout`]) and the measured machines ([`crate::auto_layout`]). The
    /// other sizes stay fixed and constrain the choice.
    pub const AUTO: usize = 0;

    /// Every size (dp_replicate, dp_shard, tp, pp) left to the automatic layout, with the sharding strategy, the
    /// pipeline schedule and micro-batches (`accel launch --parallelism auto`).
    pub fn auto() -> Self {
        ParallelismConfig {
            dp_replicate_size: Self::AUTO,
            dp_shard_size: Self::AUTO,
            tp_size: Self::AUTO,
            pp_size: Self::AUTO,
            ..Self::default()
        }
    }

    /// Whether any size is [`Self::AUTO`] (the Accelerator chooses the layout before laying out its mesh).
    pub fn is_auto(&self) -> bool {
        self.sizes().iter().any(|&(_, n)| n == Self::AUTO)
    }

    /// The sizes fixed by this config, `[dp_replicate, dp_shard, tp, pp]`: `None` where [`Self::AUTO`].
    pub fn fixed_sizes(&self) -> [Option<usize>; 4] {
        [self.dp_replicate_size, self.dp_shard_size, self.tp_size, self.pp_size].map(|n| (n != Self::AUTO).then_some(n))
    }

    /// Pure data parallelism over `n` processes (dp_replicate = n, every other size 1).
    pub fn data_parallel(n: usize) -> Self {
        ParallelismConfig { dp_replicate_size: n, ..Self::default() }
    }

    /// Builder: sets the data-parallel replicas.
    pub fn with_dp_replicate_size(mut self, n: usize) -> Self {
        self.dp_replicate_size = n;
        self
    }

    /// Builder: sets the sharded data-parallel size.
    pub fn with_dp_shard_size(mut self, n: usize) -> Self {
        self.dp_shard_size = n;
        self
    }

    /// Builder: sets what the dp_shard group shards.
    pub fn with_sharding_strategy(mut self, s: ShardingStrategy) -> Self {
        self.sharding_strategy = s;
        self
    }

    /// Builder: sets the tensor-parallel size.
    pub fn with_tp_size(mut self, n: usize) -> Self {
        self.tp_size = n;
        self
    }

    /// Builder: sets the pipeline-parallel size.
    pub fn with_pp_size(mut self, n: usize) -> Self {
        self.pp_size = n;
        self
    }

    /// Builder: sets the pipeline schedule.
    pub fn with_pp_schedule(mut self, kind: ScheduleKind) -> Self {
        self.pp_schedule = kind;
        self
    }

    /// Builder: sets the pipeline micro-batches per optimizer step.
    pub fn with_pp_microbatches(mut self, m: usize) -> Self {
        self.pp_microbatches = Some(m);
        self
    }

    /// Builder: sets the stages per pp rank (interleaved schedules).
    pub fn with_pp_virtual_stages(mut self, v: usize) -> Self {
        self.pp_virtual_stages = Some(v);
        self
    }

    /// Stages per pp rank: `pp_virtual_stages`, else 2 for Interleaved1F1B and 1 otherwise.
    pub fn pp_stages_per_rank(&self) -> usize {
        self.pp_virtual_stages.unwrap_or(match self.pp_schedule {
            ScheduleKind::Interleaved1F1B => 2,
            _ => 1,
        })
    }

    /// Micro-batches per pipeline step: `pp_microbatches`, else one per stage (`pp_size × pp_stages_per_rank`).
    pub fn pp_microbatches_per_step(&self) -> usize {
        self.pp_microbatches.unwrap_or(self.pp_size * self.pp_stages_per_rank())
    }

    /// Builder: sets the context-parallel size (only 1 validates).
    pub fn with_cp_size(mut self, n: usize) -> Self {
        self.cp_size = n;
        self
    }

    /// The defaults overridden by the `PARALLELISM_CONFIG_*` variables (see [`Self::with_overrides_from`]).
    pub fn from_env() -> Result<Self> {
        Self::default().with_overrides_from(|k| std::env::var(k).ok())
    }

    /// Overrides the sizes with the variables present in `get` ([`DP_REPLICATE_SIZE_ENV`], [`DP_SHARD_SIZE_ENV`],
    /// [`TP_SIZE_ENV`], [`CP_SIZE_ENV`], [`PP_SIZE_ENV`], [`CP_COMM_STRATEGY_ENV`] verbatim), the pipeline
    /// settings ([`PP_SCHEDULE_ENV`], [`PP_MICROBATCHES_ENV`], [`PP_VIRTUAL_STAGES_ENV`]) and the sharding strategy
    /// ([`SHARDING_STRATEGY_ENV`], `FSDP_SHARDING_STRATEGY`: an empty value counts as unset); absent variables keep
    /// the field.
    ///
    /// Errors: [`AccelError::Config`] naming the variable and its value when a size, the micro-batches or the
    /// virtual stages are not a whole number ≥ 1, the schedule is none of `GPipe`, `1F1B`, `Interleaved1F1B`, or
    /// the sharding strategy none of [`ShardingStrategy::NAMES`].
    pub fn with_overrides_from(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        for (var, slot) in [
            (DP_REPLICATE_SIZE_ENV, &mut self.dp_replicate_size),
            (DP_SHARD_SIZE_ENV, &mut self.dp_shard_size),
            (TP_SIZE_ENV, &mut self.tp_size),
            (CP_SIZE_ENV, &mut self.cp_size),
            (PP_SIZE_ENV, &mut self.pp_size),
        ] {
            if let Some(v) = get(var) {
                *slot = match v.trim().eq_ignore_ascii_case("auto") {
                    true => Self::AUTO,
                    false => whole_number(var, v, "1 = that dimension is off; or auto")?,
                };
            }
        }
        if let Some(v) = get(CP_COMM_STRATEGY_ENV) {
            self.cp_comm_strategy = Some(v).filter(|s| !s.trim().is_empty());
        }
        if let Some(v) = get(PP_SCHEDULE_ENV) {
            self.pp_schedule = v.trim().parse().map_err(|_| AccelError::Config {
                key: PP_SCHEDULE_ENV.into(),
                value: v.clone(),
                reason: format!("expected one of {} (the pipeline schedule)", ScheduleKind::CHOICES),
            })?;
        }
        if let Some(v) = get(PP_MICROBATCHES_ENV) {
            self.pp_microbatches = Some(whole_number(PP_MICROBATCHES_ENV, v, "micro-batches per optimizer step")?);
        }
        if let Some(v) = get(PP_VIRTUAL_STAGES_ENV) {
            self.pp_virtual_stages = Some(whole_number(PP_VIRTUAL_STAGES_ENV, v, "model stages per pp rank")?);
        }
        if let Some(v) = get(TP_PLAN_ENV).filter(|v| !v.trim().is_empty()) {
            self.tp_plan = Some(serde_json::from_str(&v).map_err(|e| AccelError::Config {
                key: TP_PLAN_ENV.into(),
                value: v.clone(),
                reason: format!(
                    "{e}; expected a JSON map from module-path patterns to styles, e.g. \
                     {{\"layers.*.mlp.up_proj\": \"colwise\", \"layers.*.mlp.down_proj\": \"rowwise\"}}"
                ),
            })?);
        }
        if let Some(v) = get(SHARDING_STRATEGY_ENV).filter(|v| !v.trim().is_empty()) {
            self.sharding_strategy = v.parse().map_err(|_| AccelError::Config {
                key: SHARDING_STRATEGY_ENV.into(),
                value: v.clone(),
                reason: format!("expected one of {} (what the dp_shard group shards)", ShardingStrategy::NAMES),
            })?;
        }
        Ok(self)
    }

    /// The variables that carry this config to the workers of a launcher (`PARALLELISM_CONFIG_*`, what
    /// [`Self::from_env`] reads): every size, the cp strategy when set, the pipeline settings when they are
    /// not the defaults (the schedule when not 1F1B, the micro-batches and virtual stages when set), and
    /// `FSDP_SHARDING_STRATEGY` when dp_shard > 1 (the only layouts that read it).
    pub fn env_vars(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            (DP_REPLICATE_SIZE_ENV, self.dp_replicate_size),
            (DP_SHARD_SIZE_ENV, self.dp_shard_size),
            (TP_SIZE_ENV, self.tp_size),
            (CP_SIZE_ENV, self.cp_size),
            (PP_SIZE_ENV, self.pp_size),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), size_text(v)))
        .collect();
        if let Some(s) = &self.cp_comm_strategy {
            env.push((CP_COMM_STRATEGY_ENV.to_string(), s.clone()));
        }
        if self.pp_schedule != ScheduleKind::default() {
            env.push((PP_SCHEDULE_ENV.to_string(), self.pp_schedule.to_string()));
        }
        if let Some(m) = self.pp_microbatches {
            env.push((PP_MICROBATCHES_ENV.to_string(), m.to_string()));
        }
        if let Some(v) = self.pp_virtual_stages {
            env.push((PP_VIRTUAL_STAGES_ENV.to_string(), v.to_string()));
        }
        if self.dp_shard_size > 1 {
            env.push((SHARDING_STRATEGY_ENV.to_string(), self.sharding_strategy.name().to_string()));
        }
        if let Some(plan) = &self.tp_plan {
            env.push((TP_PLAN_ENV.to_string(), serde_json::to_string(plan).expect("a plan serialises")));
        }
        env
    }

    /// `(name, size)` in the order dp_replicate, dp_shard, tp, pp, cp.
    pub fn sizes(&self) -> [(&'static str, usize); 5] {
        [
            ("dp_replicate", self.dp_replicate_size),
            ("dp_shard", self.dp_shard_size),
            ("tp", self.tp_size),
            ("pp", self.pp_size),
            ("cp", self.cp_size),
        ]
    }

    /// The product of the sizes: the number of processes the layout needs (when not every size is 1).
    pub fn total_size(&self) -> usize {
        self.sizes().iter().map(|(_, n)| n).product()
    }

    /// Whether every size is 1 (data parallelism over however many processes the job has).
    pub fn is_default_layout(&self) -> bool {
        self.sizes().iter().all(|&(_, n)| n == 1)
    }

    /// Checks what does not depend on the world size: every size ≥ 1, cp = 1, and the pipeline settings
    /// ([`Self::validate_pipeline`]).
    ///
    /// Errors: [`AccelError::Config`] naming the key (`parallelism_config_tp_size`, ...), the value and the fix.
    pub fn validate_sizes(&self) -> Result<()> {
        if self.cp_size == 0 {
            return Err(AccelError::Config {
                key: "parallelism_config_cp_size".into(),
                value: "0".into(),
                reason: "every size is at least 1 (1 = that dimension is off)".into(),
            });
        }
        if self.cp_size > 1 {
            return Err(AccelError::Config {
                key: "parallelism_config_cp_size".into(),
                value: self.cp_size.to_string(),
                reason: "context parallelism is not implemented yet; set cp_size to 1".into(),
            });
        }
        self.validate_pipeline()
    }

    /// Checks the pipeline settings, with the facts [`crate::pipeline::PipelineSchedule::new`] checks and the
    /// config's key names. Always: `pipeline_parallel_microbatches` and `pipeline_parallel_virtual_stages` ≥ 1
    /// when set. With pp > 1 (they are not read otherwise): Interleaved1F1B runs ≥ 2 stages per rank, GPipe and
    /// 1F1B exactly 1; at least as many micro-batches as stages (pp × stages per rank); for Interleaved1F1B a
    /// multiple of pp micro-batches (Megatron's rule: it takes them in groups of pp).
    ///
    /// Errors: [`AccelError::Config`] naming the key, its value (the effective one when it is a default) and what
    /// fits.
    pub fn validate_pipeline(&self) -> Result<()> {
        let config = |key: &str, value: usize, reason: String| {
            Err(AccelError::Config { key: key.into(), value: value.to_string(), reason })
        };
        if self.pp_microbatches == Some(0) {
            return config(
                "pipeline_parallel_microbatches",
                0,
                "at least 1 micro-batch per optimizer step (leave it unset for one per pipeline stage)".into(),
            );
        }
        if self.pp_virtual_stages == Some(0) {
            return config(
                "pipeline_parallel_virtual_stages",
                0,
                "at least 1 stage per pp rank (leave it unset for 2 with Interleaved1F1B, 1 otherwise)".into(),
            );
        }
        if self.pp_size <= 1 {
            return Ok(());
        }
        let (pp, v, m, kind) =
            (self.pp_size, self.pp_stages_per_rank(), self.pp_microbatches_per_step(), self.pp_schedule);
        let stages = pp * v;
        match kind {
            ScheduleKind::Interleaved1F1B if v < 2 => config(
                "pipeline_parallel_virtual_stages",
                v,
                "Interleaved1F1B runs at least 2 stages per pp rank; set pipeline_parallel_virtual_stages 2 or more, \
                 or pipeline_parallel_schedule 1F1B for 1 stage per rank"
                    .into(),
            ),
            ScheduleKind::GPipe | ScheduleKind::OneFOneB if v != 1 => config(
                "pipeline_parallel_virtual_stages",
                v,
                format!(
                    "the {kind} schedule runs 1 stage per pp rank; set pipeline_parallel_schedule Interleaved1F1B or \
                     pipeline_parallel_virtual_stages 1"
                ),
            ),
            _ if m < stages => config(
                "pipeline_parallel_microbatches",
                m,
                format!(
                    "{} cannot fill the {stages} pipeline stages (pp {pp} × {v} per rank): each stage would idle \
                     most of the step; use at least {stages}",
                    plural(m, "micro-batch", "micro-batches")
                ),
            ),
            ScheduleKind::Interleaved1F1B if !m.is_multiple_of(pp) => config(
                "pipeline_parallel_microbatches",
                m,
                format!(
                    "Interleaved1F1B takes micro-batches in groups of pp = {pp}; use a multiple of {pp}: {} or {}",
                    m / pp * pp,
                    m.div_ceil(pp) * pp
                ),
            ),
            _ => Ok(()),
        }
    }

    /// The layout for a job of `world_size` processes: this config validated, with the all-ones rule applied
    /// (every size 1 → dp_replicate = `world_size`, as Accelerate).
    ///
    /// Errors ([`AccelError::Config`]): a size of 0, cp > 1, or a product ≠ `world_size` — the message names the
    /// sizes, their product, the world size and the dp_replicate_size that would fit (e.g. `with tp 2 and 4
    /// processes set dp_replicate_size 2`) or, when none does, what would.
    pub fn resolve(&self, world_size: usize) -> Result<ParallelismConfig> {
        self.validate_sizes()?;
        if self.is_auto() {
            return Err(AccelError::Config {
                key: "parallelism_config".into(),
                value: self.to_string(),
                reason:
                    "some sizes are `auto`: the Accelerator chooses them at start-up when the program describes its \
                         model (AcceleratorConfig::auto_layout, an accel::auto_layout::AutoLayoutRequest); give the \
                         program a model description, or set every size"
                        .into(),
            });
        }
        if world_size == 0 {
            return Err(AccelError::InvalidArgument("ParallelismConfig::resolve: a job has at least 1 process".into()));
        }
        if self.is_default_layout() {
            return Ok(ParallelismConfig { dp_replicate_size: world_size, ..self.clone() });
        }
        let total = self.total_size();
        if total == world_size {
            return Ok(self.clone());
        }
        // Everything but dp_replicate is what the model layout asks for; dp_replicate is what is usually adjusted.
        let model = total / self.dp_replicate_size;
        let named: Vec<String> =
            self.sizes().iter().skip(1).filter(|&&(_, n)| n > 1).map(|(name, n)| format!("{name} {n}")).collect();
        let fix = if named.is_empty() {
            format!(
                "set dp_replicate_size {world_size} (or leave every size 1: data parallelism over all {world_size} \
                 processes)"
            )
        } else if world_size.is_multiple_of(model) {
            let mut with = named;
            with.push(format!("{world_size} processes"));
            format!("with {} set dp_replicate_size {}", join_and(&with), world_size / model)
        } else {
            format!(
                "the model layout ({}) needs a multiple of {model} processes and {world_size} is not one: launch {} \
                 processes with dp_replicate_size {} (dp replicas × {model}), or choose sizes whose product divides \
                 {world_size}",
                named.join(", "),
                model * world_size.div_ceil(model),
                world_size.div_ceil(model)
            )
        };
        Err(AccelError::Config {
            key: "parallelism_config".into(),
            value: self.to_string(),
            reason: format!("the sizes multiply to {total} but the job has {world_size} processes; {fix}"),
        })
    }

    /// The [`MeshShape`] `[pp, dp_replicate, dp_shard, tp]` of this config on `world_size` processes
    /// ([`Self::resolve`]'s rules and errors).
    pub fn mesh_shape(&self, world_size: usize) -> Result<MeshShape> {
        let r = self.resolve(world_size)?;
        Ok(MeshShape::new(r.pp_size, r.dp_replicate_size, r.dp_shard_size, r.tp_size)?)
    }

    /// The four sizes a mesh lays out, `dp_replicate 2 × dp_shard 1 × tp 2 × pp 1` (cp, always 1 here, left out),
    /// with the sharding strategy after dp_shard when dp_shard > 1: `dp_replicate 1 × dp_shard 2 (SHARD_GRAD_OP) ×
    /// tp 1 × pp 1`.
    pub fn layout_string(&self) -> String {
        let sharding = self.sharding_string().map(|s| format!(" ({s})")).unwrap_or_default();
        format!(
            "dp_replicate {} × dp_shard {}{sharding} × tp {} × pp {}",
            size_text(self.dp_replicate_size),
            size_text(self.dp_shard_size),
            size_text(self.tp_size),
            size_text(self.pp_size)
        )
    }

    /// The sharding strategy's name when dp_shard > 1 (`SHARD_GRAD_OP`), as the layout shows it after dp_shard;
    /// `None` when dp_shard is 1 (nothing is sharded, the strategy is not read).
    pub fn sharding_string(&self) -> Option<String> {
        (self.dp_shard_size > 1).then(|| self.sharding_strategy.name().to_string())
    }

    /// The pipeline schedule when pp > 1, as the run banner appends it to the layout: `1F1B, 4 micro-batches`,
    /// `Interleaved1F1B, 2 stages per rank, 8 micro-batches` (stages per rank named when not 1). `None` when pp is
    /// 1 (no pipeline).
    pub fn pipeline_string(&self) -> Option<String> {
        if self.pp_size <= 1 {
            return None;
        }
        let v = self.pp_stages_per_rank();
        let stages = (v != 1).then(|| format!(", {}", plural(v, "stage per rank", "stages per rank")));
        Some(format!(
            "{}{}, {}",
            self.pp_schedule,
            stages.unwrap_or_default(),
            plural(self.pp_microbatches_per_step(), "micro-batch", "micro-batches")
        ))
    }

    /// [`Self::layout_string`] followed by [`Self::pipeline_string`] in parentheses when pp > 1: `dp_replicate 1 ×
    /// dp_shard 1 × tp 1 × pp 2 (1F1B, 4 micro-batches)`.
    pub fn layout_with_pipeline(&self) -> String {
        match self.pipeline_string() {
            Some(p) => format!("{} ({p})", self.layout_string()),
            None => self.layout_string(),
        }
    }
}

/// A size as configs and variables write it: the number, or `auto` for [`ParallelismConfig::AUTO`].
fn size_text(n: usize) -> String {
    match n {
        ParallelismConfig::AUTO => "auto".into(),
        n => n.to_string(),
    }
}

/// A whole number ≥ 1 from the variable `var`, or an error naming it, its value and what it is.
fn whole_number(var: &str, v: String, what: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(AccelError::Config {
            key: var.into(),
            value: v,
            reason: format!("expected a whole number ≥ 1 ({what})"),
        }),
    }
}

/// `1 micro-batch`, `4 micro-batches`.
fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// `a`, `a and b`, `a, b and c`.
fn join_and(parts: &[String]) -> String {
    match parts {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn from_env_reads_accelerates_variables() {
        let p = ParallelismConfig::default()
            .with_overrides_from(lookup(&[
                (DP_REPLICATE_SIZE_ENV, "2"),
                (TP_SIZE_ENV, " 4 "),
                (PP_SIZE_ENV, "1"),
                (DP_SHARD_SIZE_ENV, "1"),
                (CP_SIZE_ENV, "1"),
                (CP_COMM_STRATEGY_ENV, "alltoall"),
            ]))
            .unwrap();
        assert_eq!((p.dp_replicate_size, p.tp_size, p.pp_size, p.dp_shard_size, p.cp_size), (2, 4, 1, 1, 1));
        assert_eq!(p.cp_comm_strategy.as_deref(), Some("alltoall"));
        let back = ParallelismConfig::default().with_overrides_from(lookup(&[])).unwrap();
        assert_eq!(back, ParallelismConfig::default());
        // The launcher's variables read back into the same config.
        let env = p.env_vars();
        let again = ParallelismConfig::default()
            .with_overrides_from(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
            .unwrap();
        assert_eq!(again, p);
    }

    #[test]
    fn auto_sizes_travel_through_variables_and_files_and_refuse_to_resolve() {
        let p = ParallelismConfig::default()
            .with_overrides_from(lookup(&[
                (TP_SIZE_ENV, "auto"),
                (DP_REPLICATE_SIZE_ENV, " AUTO "),
                (PP_SIZE_ENV, "2"),
            ]))
            .unwrap();
        assert_eq!(p.fixed_sizes(), [None, Some(1), None, Some(2)]);
        assert!(p.is_auto() && !ParallelismConfig::default().is_auto());
        assert_eq!(p.to_string(), "dp_replicate auto × dp_shard 1 × tp auto × pp 2 × cp 1");
        // What a launcher writes, the workers read back.
        let env = p.env_vars();
        assert!(env.contains(&(TP_SIZE_ENV.to_string(), "auto".to_string())), "{env:?}");
        let again = ParallelismConfig::default()
            .with_overrides_from(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
            .unwrap();
        assert_eq!(again, p);
        assert_eq!(ParallelismConfig::auto().fixed_sizes(), [None; 4]);
        // Only the Accelerator, which chooses, can lay out auto sizes.
        let p = ParallelismConfig { tp_size: ParallelismConfig::AUTO, pp_size: 2, ..ParallelismConfig::default() };
        let e = p.resolve(4).unwrap_err().to_string();
        assert!(e.contains("some sizes are `auto`") && e.contains("AcceleratorConfig::auto_layout"), "{e}");
        assert!(p.validate_sizes().is_ok());
    }

    #[test]
    fn a_bad_variable_is_named() {
        for bad in ["0", "two", "-1", ""] {
            let e = ParallelismConfig::default().with_overrides_from(lookup(&[(TP_SIZE_ENV, bad)])).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "invalid configuration PARALLELISM_CONFIG_TP_SIZE = {bad:?}: expected a whole number ≥ 1 (1 = \
                     that dimension is off; or auto)"
                )
            );
        }
    }

    #[test]
    fn every_size_one_is_data_parallel_over_the_world() {
        let r = ParallelismConfig::default().resolve(4).unwrap();
        assert_eq!(r, ParallelismConfig::data_parallel(4));
        assert_eq!(ParallelismConfig::default().mesh_shape(3).unwrap(), MeshShape::data_parallel(3));
        let s = ParallelismConfig::default().with_tp_size(2).mesh_shape(2).unwrap();
        assert_eq!((s.pp, s.dp_replicate, s.dp_shard, s.tp), (1, 1, 1, 2));
        let s = ParallelismConfig::default().with_tp_size(2).with_dp_replicate_size(2).mesh_shape(4).unwrap();
        assert_eq!((s.pp, s.dp_replicate, s.dp_shard, s.tp), (1, 2, 1, 2));
        let s = ParallelismConfig::default().with_pp_size(2).with_dp_shard_size(2).mesh_shape(4).unwrap();
        assert_eq!((s.pp, s.dp_replicate, s.dp_shard, s.tp), (2, 1, 2, 1));
    }

    #[test]
    fn a_product_other_than_the_world_size_says_what_fits() {
        let e = ParallelismConfig::default().with_tp_size(2).resolve(4).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid configuration parallelism_config = \"dp_replicate 1 × dp_shard 1 × tp 2 × pp 1 × cp 1\": the \
             sizes multiply to 2 but the job has 4 processes; with tp 2 and 4 processes set dp_replicate_size 2"
        );
        let e = ParallelismConfig::default().with_tp_size(2).with_pp_size(2).resolve(8).unwrap_err().to_string();
        assert!(e.ends_with("with tp 2, pp 2 and 8 processes set dp_replicate_size 2"), "{e}");
        let e = ParallelismConfig::default().with_tp_size(3).resolve(4).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "the sizes multiply to 3 but the job has 4 processes; the model layout (tp 3) needs a multiple of 3 \
                 processes and 4 is not one: launch 6 processes with dp_replicate_size 2 (dp replicas × 3), or \
                 choose sizes whose product divides 4"
            ),
            "{e}"
        );
        let e = ParallelismConfig::data_parallel(2).resolve(4).unwrap_err().to_string();
        assert!(e.ends_with("set dp_replicate_size 4 (or leave every size 1: data parallelism over all 4 processes)"));
        let e = ParallelismConfig::data_parallel(2).with_tp_size(2).resolve(8).unwrap_err().to_string();
        assert!(e.contains("multiply to 4 but the job has 8") && e.ends_with("set dp_replicate_size 4"), "{e}");
    }

    #[test]
    fn a_zero_size_is_auto_and_context_parallelism_is_refused() {
        // In code a size of 0 is `ParallelismConfig::AUTO`: nothing lays it out but the Accelerator's chooser.
        let e = ParallelismConfig::default().with_dp_shard_size(0).resolve(1).unwrap_err().to_string();
        assert!(e.starts_with("invalid configuration parallelism_config = \"dp_replicate 1 × dp_shard auto"), "{e}");
        let e = ParallelismConfig::default().with_cp_size(0).resolve(1).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid configuration parallelism_config_cp_size = \"0\": every size is at least 1 (1 = that \
             dimension is off)"
        );
        let e = ParallelismConfig::default().with_cp_size(2).with_dp_replicate_size(2).resolve(4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration parallelism_config_cp_size = \"2\": context parallelism is not implemented yet; \
             set cp_size to 1"
        );
    }

    #[test]
    fn the_sharding_strategy_variable_is_read_and_written_only_with_dp_shard() {
        use ShardingStrategy::*;
        let read =
            |v: &str| ParallelismConfig::default().with_overrides_from(lookup(&[(SHARDING_STRATEGY_ENV, v)])).unwrap();
        assert_eq!(SHARDING_STRATEGY_ENV, "FSDP_SHARDING_STRATEGY");
        assert_eq!(read("SHARD_OPTIM").sharding_strategy, ShardOptim);
        assert_eq!(read(" full_shard ").sharding_strategy, FullShard);
        assert_eq!(read("NO_SHARD").sharding_strategy, NoShard);
        // Torch's numbers, as older Accelerate versions write them: 1 FULL_SHARD, 2 SHARD_GRAD_OP, 3 NO_SHARD.
        assert_eq!(["1", "2", "3"].map(|v| read(v).sharding_strategy), [FullShard, ShardGradOp, NoShard]);
        // Empty is unset: what code set is kept (and the default is ZeRO-2).
        let kept = ParallelismConfig::default()
            .with_sharding_strategy(NoShard)
            .with_overrides_from(lookup(&[(SHARDING_STRATEGY_ENV, "  ")]))
            .unwrap();
        assert_eq!(kept.sharding_strategy, NoShard);
        assert_eq!(read("").sharding_strategy, ShardGradOp);
        // Written only when dp_shard > 1, after the sizes, and read back into the same config.
        let names = |p: &ParallelismConfig| p.env_vars().into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        let unsharded = ParallelismConfig::data_parallel(2).with_sharding_strategy(ShardOptim);
        assert_eq!(
            names(&unsharded),
            [DP_REPLICATE_SIZE_ENV, DP_SHARD_SIZE_ENV, TP_SIZE_ENV, CP_SIZE_ENV, PP_SIZE_ENV]
        );
        let p = ParallelismConfig::data_parallel(2).with_dp_shard_size(2).with_sharding_strategy(ShardOptim);
        let env = p.env_vars();
        assert_eq!(env.last(), Some(&("FSDP_SHARDING_STRATEGY".to_string(), "SHARD_OPTIM".to_string())));
        assert_eq!(env.len(), 6);
        let back = ParallelismConfig::default()
            .with_overrides_from(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
            .unwrap();
        assert_eq!(back, p);
        let p = ParallelismConfig::default().with_dp_shard_size(4);
        assert_eq!(p.env_vars().last().map(|(_, v)| v.as_str()), Some("SHARD_GRAD_OP"));
    }

    #[test]
    fn a_bad_sharding_strategy_variable_is_named_with_the_accepted_names() {
        let e = ParallelismConfig::default()
            .with_overrides_from(lookup(&[(SHARDING_STRATEGY_ENV, "ZERO3")]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "invalid configuration FSDP_SHARDING_STRATEGY = \"ZERO3\": expected one of NO_SHARD, SHARD_OPTIM (ZeRO-1), \
             SHARD_GRAD_OP (ZeRO-2), FULL_SHARD (ZeRO-3), HYBRID_SHARD, _HYBRID_SHARD_ZERO2, or torch's numbers 1-5 \
             (what the dp_shard group shards)"
        );
        let e = ParallelismConfig::default().with_overrides_from(lookup(&[(SHARDING_STRATEGY_ENV, "6")])).unwrap_err();
        assert!(e.to_string().starts_with("invalid configuration FSDP_SHARDING_STRATEGY = \"6\": expected one of"));
    }

    #[test]
    fn the_layout_names_the_sharding_strategy_only_with_dp_shard() {
        use ShardingStrategy::*;
        assert_eq!(
            ParallelismConfig::default().with_dp_shard_size(2).layout_string(),
            "dp_replicate 1 × dp_shard 2 (SHARD_GRAD_OP) × tp 1 × pp 1"
        );
        let p = ParallelismConfig::data_parallel(2)
            .with_dp_shard_size(2)
            .with_tp_size(2)
            .with_sharding_strategy(ShardOptim);
        assert_eq!(p.layout_with_pipeline(), "dp_replicate 2 × dp_shard 2 (SHARD_OPTIM) × tp 2 × pp 1");
        assert_eq!(p.sharding_string().as_deref(), Some("SHARD_OPTIM"));
        // Without sharding the layout reads as before, whatever the strategy.
        let p = ParallelismConfig::data_parallel(2).with_sharding_strategy(FullShard);
        assert_eq!(p.layout_string(), "dp_replicate 2 × dp_shard 1 × tp 1 × pp 1");
        assert_eq!(p.sharding_string(), None);
    }

    #[test]
    fn pipeline_variables_are_read_and_written_only_when_set() {
        // Defaults travel as absence: the variables of a config without pipeline settings are the sizes only.
        let names: Vec<String> = ParallelismConfig::data_parallel(2).env_vars().into_iter().map(|(k, _)| k).collect();
        assert_eq!(names, [DP_REPLICATE_SIZE_ENV, DP_SHARD_SIZE_ENV, TP_SIZE_ENV, CP_SIZE_ENV, PP_SIZE_ENV]);
        let names: Vec<String> =
            ParallelismConfig::default().with_pp_size(2).env_vars().into_iter().map(|(k, _)| k).collect();
        assert_eq!(names.len(), 5, "1F1B and unset counts are not written: {names:?}");
        // Set values are written and read back.
        let p = ParallelismConfig::default()
            .with_pp_size(2)
            .with_pp_schedule(ScheduleKind::Interleaved1F1B)
            .with_pp_microbatches(8)
            .with_pp_virtual_stages(3);
        let env = p.env_vars();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get("PARALLELISM_CONFIG_PP_SCHEDULE").as_deref(), Some("Interleaved1F1B"));
        assert_eq!(get("PARALLELISM_CONFIG_PP_MICROBATCHES").as_deref(), Some("8"));
        assert_eq!(get("PARALLELISM_CONFIG_PP_VIRTUAL_STAGES").as_deref(), Some("3"));
        assert_eq!(ParallelismConfig::default().with_overrides_from(get).unwrap(), p);
        // Spellings as torchtitan's and case-insensitively; a set variable overrides what code set.
        let p = ParallelismConfig::default()
            .with_pp_microbatches(4)
            .with_overrides_from(lookup(&[
                (PP_SCHEDULE_ENV, " gpipe "),
                (PP_MICROBATCHES_ENV, "6"),
                (PP_VIRTUAL_STAGES_ENV, "1"),
            ]))
            .unwrap();
        assert_eq!((p.pp_schedule, p.pp_microbatches, p.pp_virtual_stages), (ScheduleKind::GPipe, Some(6), Some(1)));
        let p = ParallelismConfig::default().with_overrides_from(lookup(&[(PP_SCHEDULE_ENV, "interleaved_1f1b")]));
        assert_eq!(p.unwrap().pp_schedule, ScheduleKind::Interleaved1F1B);
    }

    #[test]
    fn a_bad_pipeline_variable_is_named_with_what_it_expects() {
        let err = |var: &str, value: &str| {
            ParallelismConfig::default().with_overrides_from(lookup(&[(var, value)])).unwrap_err().to_string()
        };
        assert_eq!(
            err(PP_SCHEDULE_ENV, "zigzag"),
            "invalid configuration PARALLELISM_CONFIG_PP_SCHEDULE = \"zigzag\": expected one of GPipe, 1F1B, \
             Interleaved1F1B (the pipeline schedule)"
        );
        for bad in ["0", "four", "-2", ""] {
            assert_eq!(
                err(PP_MICROBATCHES_ENV, bad),
                format!(
                    "invalid configuration PARALLELISM_CONFIG_PP_MICROBATCHES = {bad:?}: expected a whole number ≥ 1 \
                     (micro-batches per optimizer step)"
                )
            );
            assert_eq!(
                err(PP_VIRTUAL_STAGES_ENV, bad),
                format!(
                    "invalid configuration PARALLELISM_CONFIG_PP_VIRTUAL_STAGES = {bad:?}: expected a whole number ≥ \
                     1 (model stages per pp rank)"
                )
            );
        }
    }

    fn pipeline(pp: usize, kind: ScheduleKind) -> ParallelismConfig {
        ParallelismConfig::default().with_pp_size(pp).with_pp_schedule(kind)
    }

    #[test]
    fn pipeline_settings_are_validated_with_their_keys() {
        use ScheduleKind::{GPipe, Interleaved1F1B, OneFOneB};
        let msg = |p: ParallelismConfig| p.validate_sizes().unwrap_err().to_string();
        // The value checks apply with or without a pipeline.
        assert_eq!(
            msg(ParallelismConfig::default().with_pp_microbatches(0)),
            "invalid configuration pipeline_parallel_microbatches = \"0\": at least 1 micro-batch per optimizer \
             step (leave it unset for one per pipeline stage)"
        );
        assert_eq!(
            msg(pipeline(2, OneFOneB).with_pp_virtual_stages(0)),
            "invalid configuration pipeline_parallel_virtual_stages = \"0\": at least 1 stage per pp rank (leave it \
             unset for 2 with Interleaved1F1B, 1 otherwise)"
        );
        // Stages per rank must fit the schedule.
        assert_eq!(
            msg(pipeline(2, Interleaved1F1B).with_pp_virtual_stages(1)),
            "invalid configuration pipeline_parallel_virtual_stages = \"1\": Interleaved1F1B runs at least 2 stages \
             per pp rank; set pipeline_parallel_virtual_stages 2 or more, or pipeline_parallel_schedule 1F1B for 1 \
             stage per rank"
        );
        assert_eq!(
            msg(pipeline(2, OneFOneB).with_pp_virtual_stages(2)),
            "invalid configuration pipeline_parallel_virtual_stages = \"2\": the 1F1B schedule runs 1 stage per pp \
             rank; set pipeline_parallel_schedule Interleaved1F1B or pipeline_parallel_virtual_stages 1"
        );
        assert!(msg(pipeline(2, GPipe).with_pp_virtual_stages(3)).contains("the GPipe schedule runs 1 stage"));
        // Fewer micro-batches than stages, naming both and the smallest count that fits.
        assert_eq!(
            msg(pipeline(4, OneFOneB).with_pp_microbatches(3)),
            "invalid configuration pipeline_parallel_microbatches = \"3\": 3 micro-batches cannot fill the 4 \
             pipeline stages (pp 4 × 1 per rank): each stage would idle most of the step; use at least 4"
        );
        assert!(msg(pipeline(2, GPipe).with_pp_microbatches(1)).ends_with(
            "\"1\": 1 micro-batch cannot fill the 2 pipeline stages (pp 2 × 1 per rank): each stage would idle \
                 most of the step; use at least 2"
        ));
        // Interleaved: stages = pp × v (2 by default), and the count is a multiple of pp.
        assert!(msg(pipeline(2, Interleaved1F1B).with_pp_microbatches(2)).ends_with(
            "2 micro-batches cannot fill the 4 pipeline stages (pp 2 × 2 per rank): each stage would \
                        idle most of the step; use at least 4"
        ));
        assert_eq!(
            msg(pipeline(2, Interleaved1F1B).with_pp_microbatches(5)),
            "invalid configuration pipeline_parallel_microbatches = \"5\": Interleaved1F1B takes micro-batches in \
             groups of pp = 2; use a multiple of 2: 4 or 6"
        );
        assert!(msg(pipeline(4, Interleaved1F1B).with_pp_microbatches(10)).ends_with("use a multiple of 4: 8 or 12"));
        // What fits; the defaults always fit; nothing is read at pp 1 but the values.
        for ok in [
            pipeline(2, OneFOneB),
            pipeline(4, GPipe).with_pp_microbatches(4),
            pipeline(2, Interleaved1F1B),
            pipeline(4, Interleaved1F1B).with_pp_virtual_stages(3).with_pp_microbatches(16),
            pipeline(1, Interleaved1F1B).with_pp_virtual_stages(1).with_pp_microbatches(1),
        ] {
            ok.validate_sizes().unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        // resolve() checks them too.
        let e = pipeline(2, OneFOneB).with_pp_microbatches(1).with_dp_replicate_size(2).resolve(4).unwrap_err();
        assert!(e.to_string().starts_with("invalid configuration pipeline_parallel_microbatches"), "{e}");
    }

    #[test]
    fn the_config_accepts_only_schedules_that_build_and_refuses_more_only_for_idle_stages() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B] {
            for pp in 2..=4 {
                for v in 1..=3 {
                    for m in 1..=13 {
                        let p = pipeline(pp, kind).with_pp_virtual_stages(v).with_pp_microbatches(m);
                        let schedule = crate::pipeline::PipelineSchedule::new(kind, pp, m, v);
                        match (p.validate_sizes(), schedule) {
                            (Ok(()), Err(e)) => panic!("{p:?} validates but its schedule is refused: {e}"),
                            // The one rule the schedule does not have: fewer micro-batches than stages.
                            (Err(e), Ok(_)) => assert!(
                                m < pp * v && e.to_string().contains("cannot fill the"),
                                "{p:?}: refused with {e}"
                            ),
                            _ => {}
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_pipeline_string_describes_the_schedule() {
        use ScheduleKind::{GPipe, Interleaved1F1B, OneFOneB};
        assert_eq!(ParallelismConfig::default().pipeline_string(), None);
        assert_eq!(pipeline(1, GPipe).with_pp_microbatches(8).pipeline_string(), None);
        assert_eq!(pipeline(2, OneFOneB).pipeline_string().as_deref(), Some("1F1B, 2 micro-batches"));
        assert_eq!(
            pipeline(2, GPipe).with_pp_microbatches(4).pipeline_string().as_deref(),
            Some("GPipe, 4 micro-batches")
        );
        assert_eq!(
            pipeline(2, Interleaved1F1B).pipeline_string().as_deref(),
            Some("Interleaved1F1B, 2 stages per rank, 4 micro-batches")
        );
        assert_eq!(
            pipeline(2, OneFOneB).with_pp_microbatches(4).layout_with_pipeline(),
            "dp_replicate 1 × dp_shard 1 × tp 1 × pp 2 (1F1B, 4 micro-batches)"
        );
        assert_eq!(
            ParallelismConfig::data_parallel(2).layout_with_pipeline(),
            "dp_replicate 2 × dp_shard 1 × tp 1 × pp 1"
        );
    }
}
