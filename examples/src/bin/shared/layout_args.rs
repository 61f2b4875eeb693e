//! The model-parallel flags the GPT and Llama examples share (`accel_gpt`, `train_gpt`, `accel_llama`,
//! `train_llama`: `#[path]`-included by each, so that only binaries know clap).

/// The model-parallel flags of the GPT examples (`accel_gpt`, `train_gpt`), flattened into their command lines.
#[derive(clap::Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Tensor-parallel size: ranks each model is split over (must divide --nproc and the model's head counts and
    /// widths). Passed to the workers as PARALLELISM_CONFIG_TP_SIZE; data parallelism takes the rest.
    #[arg(long, default_value_t = 1)]
    pub tp_size: usize,
    /// Pipeline stages: ranks the model's blocks are cut over (tp × pp must divide --nproc; at most the layers).
    /// Passed to the workers as PARALLELISM_CONFIG_PP_SIZE.
    #[arg(long, default_value_t = 1)]
    pub pp_size: usize,
    /// Pipeline schedule: GPipe, 1F1B (default) or Interleaved1F1B (2 stages per rank).
    #[arg(long)]
    pub pp_schedule: Option<accel::pipeline::ScheduleKind>,
    /// Micro-batches per pipeline step (default: one per stage); must divide the batch size.
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Model stages per pp rank (default: 2 for Interleaved1F1B, else 1). Passed to the workers as
    /// PARALLELISM_CONFIG_PP_VIRTUAL_STAGES.
    #[arg(long)]
    pub pp_virtual_stages: Option<usize>,
    /// Data-parallel processes that shard the model (ZeRO / FSDP; must divide the data-parallel processes); the
    /// rest replicate it (HSDP). Passed to the workers as PARALLELISM_CONFIG_DP_SHARD_SIZE.
    #[arg(long, default_value_t = 1)]
    pub dp_shard_size: usize,
    /// What the dp_shard ranks shard: SHARD_OPTIM (ZeRO-1), SHARD_GRAD_OP (ZeRO-2, default), FULL_SHARD (ZeRO-3),
    /// NO_SHARD. Passed to the workers as FSDP_SHARDING_STRATEGY.
    #[arg(long)]
    pub sharding_strategy: Option<accel::ShardingStrategy>,
}

impl LayoutArgs {
    /// The layout these flags ask for.
    pub fn layout(&self) -> accel_examples::ModelLayout {
        accel_examples::ModelLayout {
            tp: self.tp_size,
            pp: self.pp_size,
            schedule: self.pp_schedule,
            microbatches: self.microbatches,
            virtual_stages: self.pp_virtual_stages,
            dp_shard: self.dp_shard_size,
            sharding: self.sharding_strategy,
        }
    }

    /// Checks the flags before any worker starts (one message instead of one per rank): the sizes against the
    /// process count (`accel_examples::check_layout`), the flags against what a launcher set
    /// (`accel_examples::effective_layout`), and under pp the schedule (micro-batches against the stages), the
    /// stages against `n_layer` (the model's flag for it: `layers_flag`) and the micro-batches against the batch size (`batch_flag` = `batch_size`, the
    /// rows each pipeline step splits), and a `--layers-per-stage` list against the stages and the layers.
    /// Pipeline flags without pipeline parallelism are ignored with a warning.
    pub fn check(
        &self,
        nproc: usize,
        n_layer: usize,
        layers_flag: &str,
        layers_per_stage: Option<&[usize]>,
        batch_flag: &str,
        batch_size: usize,
    ) -> anyhow::Result<()> {
        let layout = self.layout();
        accel_examples::check_layout(nproc, &layout)?;
        let (n, _) = accel_examples::job_size(nproc);
        let p = accel_examples::effective_layout(n, &layout)?;
        if let Some(list) = layers_per_stage {
            // One count per stage, adding up to the model's layers: refused here, once, not by every worker.
            accel::pipeline::split_layers(n_layer, p.pp_size * p.pp_stages_per_rank(), Some(list))
                .map_err(|e| anyhow::anyhow!("--layers-per-stage: {e}"))?;
        }
        if let (Some(s), 1) = (self.sharding_strategy, p.dp_shard_size) {
            anyhow::bail!(
                "--sharding-strategy {s} applies to sharded data parallelism, and no process shards: add \
                 --dp-shard-size (the data-parallel processes that shard; {} here), or drop the flag",
                n / (p.tp_size * p.pp_size).max(1)
            );
        }
        if p.pp_size <= 1 {
            let first = !ddp_core::launcher::is_worker()
                || matches!(ddp_core::env::DistEnv::detect_from_env(), Ok(Some(env)) if env.rank == 0);
            let pipeline_flags = layout.schedule.is_some() || layout.microbatches.is_some();
            if first && (pipeline_flags || layout.virtual_stages.is_some()) {
                eprintln!(
                    "warning: --pp-schedule, --microbatches and --pp-virtual-stages only apply with --pp-size above 1: \
                     ignored"
                );
            }
            return Ok(());
        }
        p.validate_sizes()?;
        let stages = p.pp_size * p.pp_stages_per_rank();
        accel::pipeline::PipelineSchedule::new(
            p.pp_schedule,
            p.pp_size,
            p.pp_microbatches_per_step(),
            p.pp_stages_per_rank(),
        )?;
        if n_layer < stages {
            anyhow::bail!(
                "the model has {n_layer} layers but the pipeline cuts it into {stages} stages (--pp-size {} × {} per \
                 rank{}): every stage needs a layer; use more layers ({layers_flag} {stages}) or fewer stages",
                p.pp_size,
                p.pp_stages_per_rank(),
                if p.pp_stages_per_rank() > 1 { ", interleaved; 1F1B runs 1 per rank" } else { "" }
            );
        }
        let m = p.pp_microbatches_per_step();
        if !batch_size.is_multiple_of(m) {
            let fits: Vec<usize> = (stages..=batch_size).filter(|d| batch_size.is_multiple_of(*d)).collect();
            let fix = match fits.first() {
                Some(_) => format!("or --microbatches dividing it and at least {stages}: {fits:?}"),
                None => format!("the pipeline needs at least {stages} micro-batches, so at least {stages} rows"),
            };
            anyhow::bail!(
                "{batch_flag} {batch_size} does not split into the {m} micro-batches of a pipeline step; use a \
                 multiple of {m}, {fix}"
            );
        }
        Ok(())
    }

    /// Under `--parallelism auto` the layout is chosen: every layout flag must be left at its default, and none of
    /// `chosen` (a program's further flags the choice sets, `(flag, given)`) given — one message naming them all.
    pub fn check_unset_under_auto(&self, chosen: &[(&str, bool)]) -> anyhow::Result<()> {
        let mut given = Vec::new();
        for (flag, size) in
            [("--tp-size", self.tp_size), ("--pp-size", self.pp_size), ("--dp-shard-size", self.dp_shard_size)]
        {
            if size != 1 {
                given.push(format!("{flag} {size}"));
            }
        }
        if let Some(s) = self.pp_schedule {
            given.push(format!("--pp-schedule {s}"));
        }
        if let Some(m) = self.microbatches {
            given.push(format!("--microbatches {m}"));
        }
        if let Some(s) = self.sharding_strategy {
            given.push(format!("--sharding-strategy {s}"));
        }
        if let Some(v) = self.pp_virtual_stages {
            given.push(format!("--pp-virtual-stages {v}"));
        }
        given.extend(chosen.iter().filter(|(_, set)| *set).map(|(flag, _)| flag.to_string()));
        anyhow::ensure!(
            given.is_empty(),
            "--parallelism auto chooses the layout, and {} would fix part of it: drop {}, or drop --parallelism auto \
             to run the layout you give",
            given.join(", "),
            if given.len() == 1 { "it" } else { "them" }
        );
        Ok(())
    }
}
