//! `--parallelism auto` and `--global-batch-size`: the flags of a level-2 program whose layout the Accelerator may
//! choose at start-up (`accel::auto_layout`), the checks they need before any worker starts, and the lines the
//! programs print with the choice. Shared by the example binaries through `#[path]` (a sibling of
//! `layout_args.rs`).

use super::layout_args::LayoutArgs;
use accel::auto_layout::{AutoLayoutRequest, Candidate, Checkpointing, Layout, ModelSpec, Precision, TrainSpec};

/// The automatic layout's flags.
#[derive(clap::Args, Debug, Clone)]
pub struct AutoArgs {
    /// `auto`: the Accelerator chooses dp_replicate × dp_shard × tp × pp, the sharding, the pipeline schedule, the
    /// micro-batches and their size at start-up, from the model (its build described: parameters per rank,
    /// widths, heads), each process's memory (detected, or ACCEL_AUTO_LAYOUT_MEMORY) and the links it measures
    /// (accel::auto_layout); it prints the choice and why. Replaces the layout flags; the micro-batch is chosen
    /// within the global batch, --global-batch-size (default --batch-size × the processes).
    #[arg(long, value_parser = ["auto"], ignore_case = true)]
    pub parallelism: Option<String>,
    /// Sequences per optimizer step over all replicas under an automatic layout (default: --batch-size × the
    /// processes, what data parallelism over all of them would train).
    #[arg(long)]
    pub global_batch_size: Option<usize>,
}

impl AutoArgs {
    /// Whether this run chooses its layout (`--parallelism auto`).
    pub fn is_auto(&self) -> bool {
        self.parallelism.is_some()
    }

    /// The checks before any worker starts: `--global-batch-size` only with an automatic layout (given here, or by
    /// `accel launch --parallelism auto`, which hands its workers `auto` sizes); under `--parallelism auto`
    /// [`LayoutArgs::check_unset_under_auto`].
    pub fn check(&self, layout: &LayoutArgs, chosen: &[(&str, bool)]) -> anyhow::Result<()> {
        let launched_auto = accel::ParallelismConfig::from_env().is_ok_and(|p| p.is_auto());
        anyhow::ensure!(
            self.is_auto() || launched_auto || self.global_batch_size.is_none(),
            "--global-batch-size applies with --parallelism auto; without it the global batch is --batch-size × the \
             data-parallel processes × --gradient-accumulation-steps"
        );
        if !self.is_auto() {
            return Ok(());
        }
        layout.check_unset_under_auto(chosen)
    }

    /// The environment the launcher gives the workers: every size `auto`, or the flags' mesh.
    pub fn launch_env(&self, nproc: usize, layout: &LayoutArgs) -> Vec<(String, String)> {
        match self.is_auto() {
            true => accel::ParallelismConfig::auto().env_vars(), // accel: every size `auto`
            false => accel_examples::parallel_env(nproc, &layout.layout()), // accel: the workers' mesh
        }
    }

    /// What the automatic layout needs to know of the program: its `model`, the global batch (the flag's, else
    /// `batch_size × world`), the micro-batch sizes it may split it into (any divisor), and that it runs every
    /// layout (tp layers, pipeline stages, every sharding strategy and schedule); checkpointing chosen where it
    /// saves memory. Precision and bytes are the Accelerator's to fill in (`auto_layout::completed_request`).
    pub fn request(&self, model: ModelSpec, batch_size: usize, world: usize) -> AutoLayoutRequest {
        let global_batch = self.global_batch(batch_size, world);
        let train = TrainSpec::any_micro_batch(global_batch, Precision::Fp32).with_checkpointing(Checkpointing::Auto);
        AutoLayoutRequest::new(model, train)
    }
}

impl AutoArgs {
    /// The global batch of an automatic layout: `--global-batch-size`, else `batch_size × world`.
    pub fn global_batch(&self, batch_size: usize, world: usize) -> usize {
        self.global_batch_size.unwrap_or(batch_size * world)
    }

    /// Errors: a global batch larger than the `samples` the training data holds (no optimizer step could be
    /// filled), naming both.
    pub fn check_data(&self, global_batch: usize, samples: usize, what: &str) -> anyhow::Result<()> {
        anyhow::ensure!(
            global_batch <= samples,
            "the global batch of {global_batch} sequences is more than the {samples} {what} of the training data: \
             give --global-batch-size {samples} or less"
        );
        Ok(())
    }
}

/// The rows a rank reads per training step: the automatic layout's (its flags and prediction printed once), or
/// `flag`'s without one.
pub fn batch_size(acc: &accel::Accelerator, flag: usize) -> usize {
    match acc.auto_layout() {
        Some(decision) => {
            acc.print(format!("auto_layout flags: {}", layout_flags(decision.layout())));
            acc.print(prediction_line(&decision.choice.best));
            decision.layout().per_process_batch()
        }
        None => flag,
    }
}

/// The flags that run `layout` without `--parallelism auto` (printed with the choice, for the benchmarks and
/// for a user who wants to pin it).
pub fn layout_flags(layout: &Layout) -> String {
    let mut flags = format!("--tp-size {} --pp-size {} --dp-shard-size {}", layout.tp, layout.pp, layout.dp_shard);
    if layout.dp_shard > 1 {
        flags += &format!(" --sharding-strategy {}", layout.sharding);
    }
    if let (true, Some(kind)) = (layout.pp > 1, layout.schedule) {
        flags += &format!(" --pp-schedule {kind} --microbatches {}", layout.microbatches);
        if layout.virtual_stages > 1 {
            flags += &format!(" --pp-virtual-stages {}", layout.virtual_stages);
        }
        if let Some(list) = &layout.layers_per_stage {
            let list: Vec<String> = list.iter().map(ToString::to_string).collect();
            flags += &format!(" --layers-per-stage {}", list.join(","));
        }
    }
    flags += &format!(
        " --batch-size {} --gradient-accumulation-steps {}",
        layout.per_process_batch(),
        layout.accumulation_steps
    );
    if layout.activation_checkpointing {
        flags += " --activation-checkpointing";
    }
    flags
}

/// `auto_layout predicted: peak 123.4 MiB per rank, step 45.6 ms (compute …)` — the cost model's figures for a
/// layout, in the line the benchmark scripts read.
pub fn prediction_line(c: &Candidate) -> String {
    format!(
        "auto_layout predicted: peak {:.1} MiB per rank, step {}",
        c.peak_memory() as f64 / (1024.0 * 1024.0),
        c.time
    )
}
