//! [`Layout`]: one candidate — the four mesh sizes, what dp_shard shards, the pipeline's schedule, stages per rank,
//! micro-batches and layers per stage, the micro-batch size and accumulation, activation checkpointing — and the
//! settings it becomes: a [`ParallelismConfig`], the per-process batch, the accumulation steps, the
//! `layers_per_stage` that `Accelerator::pipeline_stages` accepts.

use super::units::plural;
use crate::parallelism::ParallelismConfig;
use crate::pipeline::{split_layers, ScheduleKind};
use crate::sharding::ShardingStrategy;

/// One layout of a job (see the module documentation). The product of the four sizes is the world size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    /// Data-parallel replicas (DDP).
    pub dp_replicate: usize,
    /// Sharded data-parallel ranks (ZeRO / FSDP), sharding [`Self::sharding`].
    pub dp_shard: usize,
    /// Tensor-parallel ranks (innermost: consecutive ranks).
    pub tp: usize,
    /// Pipeline ranks (outermost).
    pub pp: usize,
    /// What dp_shard shards; `NoShard` when dp_shard is 1.
    pub sharding: ShardingStrategy,
    /// The pipeline schedule; `None` when pp is 1.
    pub schedule: Option<ScheduleKind>,
    /// Stages per pp rank (v): 1 except for interleaved 1F1B.
    pub virtual_stages: usize,
    /// Pipeline micro-batches per optimizer step (m); 1 when pp is 1.
    pub microbatches: usize,
    /// Gradient-accumulation steps per optimizer step (k); 1 when pp > 1 (the pipeline's micro-batches take its
    /// place).
    pub accumulation_steps: usize,
    /// Sequences per micro-batch on one rank (b).
    pub micro_batch_size: usize,
    /// Blocks recomputed in the backward pass (`activation_checkpointing`). FULL_SHARD recomputes its units
    /// whatever this says.
    pub activation_checkpointing: bool,
    /// Blocks per pipeline stage when not the even split (`Accelerator::pipeline_stages(n, Some(list))`); `None`:
    /// [`split_layers`]'s even split.
    pub layers_per_stage: Option<Vec<usize>>,
}

impl Layout {
    /// Processes: `dp_replicate × dp_shard × tp × pp`.
    pub fn world_size(&self) -> usize {
        self.dp_replicate * self.dp_shard * self.tp * self.pp
    }

    /// Data-parallel ranks: `dp_replicate × dp_shard`.
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// Micro-batches a rank runs per optimizer step: `m` at pp > 1, `k` at pp 1.
    pub fn microbatches_per_step(&self) -> usize {
        self.microbatches * self.accumulation_steps
    }

    /// Sequences one rank reads per call of its training step: the micro-batch at pp 1 (each accumulation step
    /// reads one), the `m` micro-batches at pp > 1 (`pipeline_backward` splits the batch it is handed).
    pub fn per_process_batch(&self) -> usize {
        self.micro_batch_size * self.microbatches
    }

    /// The ZeRO stage that applies: the strategy's when dp_shard > 1, else 0.
    pub fn zero_stage(&self) -> u8 {
        if self.dp_shard > 1 {
            self.sharding.zero_stage()
        } else {
            0
        }
    }

    /// Whether blocks are recomputed in the backward: checkpointing asked for, or FULL_SHARD (its units are
    /// always recomputed in a recorded forward — `pipeline_backward` records the whole forward at pp 1 and each
    /// stage's forward under pp).
    pub fn recomputes(&self) -> bool {
        self.activation_checkpointing || self.zero_stage() == 3
    }

    /// Blocks per global stage (`pp · v` of them, stage `s` on pp rank `s mod pp`): the listed split, else the
    /// even one. `None` when the model has fewer blocks than stages and no list is given.
    pub fn stage_layers(&self, n_layer: usize) -> Option<Vec<usize>> {
        if let Some(list) = &self.layers_per_stage {
            return Some(list.clone());
        }
        let ranges = split_layers(n_layer, self.pp * self.virtual_stages, None).ok()?;
        Some(ranges.into_iter().map(|r| r.len()).collect())
    }

    /// Blocks per pp rank (its stages' blocks summed).
    pub fn rank_layers(&self, n_layer: usize) -> Option<Vec<usize>> {
        let stages = self.stage_layers(n_layer)?;
        let mut per_rank = vec![0; self.pp];
        for (s, n) in stages.iter().enumerate() {
            per_rank[s % self.pp] += n;
        }
        Some(per_rank)
    }

    /// The [`ParallelismConfig`] of this layout (sizes, sharding strategy, schedule, micro-batches, stages per
    /// rank), for `AcceleratorConfig::parallelism`. The accumulation steps, the per-process batch, activation
    /// checkpointing and `layers_per_stage` are the program's and the Accelerator config's other settings.
    pub fn parallelism_config(&self) -> ParallelismConfig {
        let mut c = ParallelismConfig::default()
            .with_dp_replicate_size(self.dp_replicate)
            .with_dp_shard_size(self.dp_shard)
            .with_tp_size(self.tp)
            .with_pp_size(self.pp);
        if self.dp_shard > 1 {
            c = c.with_sharding_strategy(self.sharding);
        }
        if let (true, Some(kind)) = (self.pp > 1, self.schedule) {
            c = c.with_pp_schedule(kind).with_pp_microbatches(self.microbatches);
            if kind == ScheduleKind::Interleaved1F1B {
                c = c.with_pp_virtual_stages(self.virtual_stages);
            }
        }
        c
    }

    /// The layout a resolved config runs (its sizes, sharding, schedule, micro-batches and stages per rank), with
    /// `accumulation_steps`, `micro_batch_size` sequences per micro-batch and `activation_checkpointing`: what the
    /// cost model evaluates for a run whose layout is given ([`super::predict`]).
    pub fn of_config(
        p: &ParallelismConfig,
        accumulation_steps: usize,
        micro_batch_size: usize,
        activation_checkpointing: bool,
    ) -> Layout {
        let pipelined = p.pp_size > 1;
        Layout {
            dp_replicate: p.dp_replicate_size,
            dp_shard: p.dp_shard_size,
            tp: p.tp_size,
            pp: p.pp_size,
            sharding: if p.dp_shard_size > 1 { p.sharding_strategy } else { ShardingStrategy::NoShard },
            schedule: pipelined.then_some(p.pp_schedule),
            virtual_stages: if pipelined { p.pp_stages_per_rank() } else { 1 },
            microbatches: if pipelined { p.pp_microbatches_per_step() } else { 1 },
            accumulation_steps,
            micro_batch_size,
            activation_checkpointing,
            layers_per_stage: None,
        }
    }

    /// How complex the layout is to run, for ties: parallel dimensions in use, then the ZeRO stage, pp, tp,
    /// stages per rank, the schedule (1F1B, GPipe, interleaved), checkpointing, an uneven split, accumulation.
    pub(crate) fn complexity(&self) -> impl Ord {
        let dims = [self.dp_replicate, self.dp_shard, self.tp, self.pp].iter().filter(|&&n| n > 1).count();
        let schedule = match self.schedule {
            None => 0,
            Some(ScheduleKind::OneFOneB) => 1,
            Some(ScheduleKind::GPipe) => 2,
            Some(ScheduleKind::Interleaved1F1B) => 3,
        };
        (
            dims,
            self.zero_stage(),
            self.pp,
            self.tp,
            self.virtual_stages,
            schedule,
            self.activation_checkpointing,
            self.layers_per_stage.is_some(),
            self.accumulation_steps,
            // The rest only makes the order total (deterministic whatever the enumeration order).
            std::cmp::Reverse(self.micro_batch_size),
            self.dp_shard,
            self.layers_per_stage.clone(),
        )
    }

    /// The shape without the batch split: the sizes, the strategy, the schedule and stages per rank — what the
    /// runners-up differ in.
    pub(crate) fn family(&self) -> (usize, usize, usize, usize, ShardingStrategy, Option<ScheduleKind>, usize) {
        (self.dp_replicate, self.dp_shard, self.tp, self.pp, self.sharding, self.schedule, self.virtual_stages)
    }
}

impl std::fmt::Display for Layout {
    /// `dp_replicate 2 × dp_shard 1 × tp 2 × pp 1, micro-batch 4 × 2 accumulation steps` or `dp_replicate 1 ×
    /// dp_shard 1 × tp 1 × pp 2 (1F1B, 4 micro-batches), micro-batch 2, layers per stage [3, 1]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, micro-batch {}", self.parallelism_config().layout_with_pipeline(), self.micro_batch_size)?;
        if self.accumulation_steps > 1 {
            write!(f, " × {}", plural(self.accumulation_steps, "accumulation step", "accumulation steps"))?;
        }
        if let Some(list) = &self.layers_per_stage {
            write!(f, ", layers per stage {list:?}")?;
        }
        if self.activation_checkpointing {
            write!(f, ", activation checkpointing")?;
        }
        Ok(())
    }
}
