//! The model-parallel flags the GPT examples share (`accel_gpt`, `train_gpt`: `#[path]`-included by each, so that
//! only binaries know clap).

/// The model-parallel flags of the GPT examples (`accel_gpt`, `train_gpt`), flattened into their command lines.
#[derive(clap::Args, Debug, Clone)]
pub struct LayoutArgs {
    /// Tensor-parallel size: ranks each model is split over (must divide --nproc and the model's n_head, d_model
    /// and d_ff). Passed to the workers as PARALLELISM_CONFIG_TP_SIZE; data parallelism takes the rest.
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
}

impl LayoutArgs {
    /// The layout these flags ask for.
    pub fn layout(&self) -> accel_examples::ModelLayout {
        accel_examples::ModelLayout {
            tp: self.tp_size,
            pp: self.pp_size,
            schedule: self.pp_schedule,
            microbatches: self.microbatches,
        }
    }

    /// Checks the flags before any worker starts (one message instead of one per rank): the sizes against the
    /// process count (`accel_examples::check_layout`), and under pp the schedule (micro-batches against the stages), the stages
    /// against `n_layer` and the micro-batches against `batch_size` (the rows each pipeline step splits).
    pub fn check(&self, nproc: usize, n_layer: usize, batch_size: usize) -> anyhow::Result<()> {
        let layout = self.layout();
        accel_examples::check_layout(nproc, &layout)?;
        if layout.pp > 1 {
            let p = layout.config(nproc);
            p.validate_sizes()?;
            accel::pipeline::PipelineSchedule::new(
                p.pp_schedule,
                p.pp_size,
                p.pp_microbatches_per_step(),
                p.pp_stages_per_rank(),
            )?;
            accel::pipeline::split_layers(n_layer, p.pp_size * p.pp_stages_per_rank(), None)?;
            let m = p.pp_microbatches_per_step();
            anyhow::ensure!(
                batch_size.is_multiple_of(m),
                "the batch size {batch_size} does not split into the {m} micro-batches of a pipeline step; use a \
                 multiple of {m}, or --microbatches dividing {batch_size}"
            );
        }
        Ok(())
    }
}
