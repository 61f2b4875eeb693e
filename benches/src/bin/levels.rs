//! The levels benchmark, accel-rs side: one training run of the MNIST MLP or the char-GPT written at one level —
//! a plain single-process candle loop, raw ddp-core (level 1), the Accelerator (level 2) or the Trainer (level 3)
//! — printing one JSON line on rank 0. `scripts/bench-levels.sh` runs every level at 1 and 2 processes,
//! interleaved with the PyTorch equivalents (`scripts/torch_ref/levels.py`: plain loop, DDP, Accelerate, HF
//! Trainer), and `scripts/torch_ref/report.py` writes the table into docs/benchmarks.md.
//!
//! ```text
//! cargo run -p accel-benches --bin levels -- --model mlp --level accel --nproc 2
//! cargo run -p accel-benches --bin levels -- --model gpt --level trainer --nproc 1 --steps 200
//! ```
//!
//! The task is the same at every level and in both frameworks: MLP 784-512-512-10 (the examples' [`Mlp`], input
//! standardised), batch 64 per process, 3 epochs over the shipped 10k MNIST training images, test accuracy on
//! t10k after training; or the examples' [`CharGpt`] (default [`GptConfig::small`], context 64), 16 sequences per
//! process, `--steps` optimizer steps over the first 95 % of data/shakespeare, the validation loss on the last 5 %
//! after training. The optimizer is accel-nn's AdamW, lr 1e-3 and PyTorch's other defaults (weight decay 0.01),
//! at the plain, ddp and accel levels; the Trainer levels use the Trainer's defaults (HF's: linear decay, gradient
//! clipping at 1.0, weight decay 0) with lr 1e-3. Each process gets `--threads` threads (default 1): the program
//! sets RAYON_NUM_THREADS / OMP_NUM_THREADS before anything starts a thread, and the launcher keeps them.
//!
//! Timing: the clock starts when the training loop starts (the model, optimizer and data are built) and stamps the
//! end of every optimizer step; `first_step_ms` is the first stamp, `step_ms` the median gap between the others,
//! and the throughput counts the samples (tokens) of every step but the first over the time from the first stamp
//! to the last, so it includes data loading and everything else the level does between steps. At the Trainer
//! level the stamps come from a callback's `on_step_end` (from `on_train_begin`). `wall_s` runs from
//! `LEVELS_T0_NS` (Unix time in ns, set by the benchmark script just before the command, so it includes process
//! start and launching) or from this process's start, to the JSON line. Evaluation runs after the clock stops.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use accel::data::{Dataset, TextDataset};
use accel::nn;
use accel::tensor_parallel::TensorParallel;
use accel::{Accelerator, AcceleratorConfig, DataLoader, DataLoaderConfig};
use accel_examples::gpt::{to_candle, CharGpt, GptConfig};
use accel_examples::{correct_count, default_data_dir, load_mnist, seed_parameters, Mlp, Mnist};
use accel_nn::optim::{grads_for, AdamW, AdamWConfig, Optimizer};
use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::{Parser, ValueEnum};
use ddp_core::{segments, DdpOptions, DistributedDataParallel, DistributedSampler, Overlap, ProcessGroup};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use trainer::{losses, CallbackContext, ReportTo, SaveStrategy, Trainer, TrainerCallback, TrainerControl};

/// Global allocator: mimalloc, as in every binary of the workspace (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The environment variable carrying the benchmark's start time (Unix time in nanoseconds).
const T0_ENV: &str = "LEVELS_T0_NS";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// MNIST MLP 784-hidden-10.
    Mlp,
    /// The char-level GPT on Shakespeare.
    Gpt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Level {
    /// A plain single-process candle loop (1 process only).
    Candle,
    /// ddp-core: ProcessGroup + DistributedSampler + DistributedDataParallel (level 1).
    Ddp,
    /// The Accelerator: prepare / backward / step (level 2).
    Accel,
    /// The Trainer (level 3).
    Trainer,
}

/// One training run of the levels benchmark; rank 0 prints one JSON line.
/// The levels benchmark, accel-rs side: one training run of the MNIST MLP or the char-GPT at one level (plain
/// candle, ddp-core, the Accelerator, the Trainer), printing one JSON line; scripts/bench-levels.sh runs it next to
/// PyTorch.
#[derive(Parser, Debug, Clone)]
struct Cli {
    /// The task.
    #[arg(long, value_enum, default_value = "mlp")]
    model: ModelKind,
    /// The level of accel-rs the training loop is written at.
    #[arg(long, value_enum, default_value = "candle")]
    level: Level,
    /// Processes (the program launches its workers when RANK is unset); `candle` runs 1 only.
    #[arg(long, default_value_t = 1, value_parser = accel_examples::parse_nproc)]
    nproc: usize,
    /// Threads per process (RAYON_NUM_THREADS / OMP_NUM_THREADS of every process).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Passes over the 10k MNIST training images (mlp).
    #[arg(long, default_value_t = 3)]
    epochs: u64,
    /// Optimizer steps (gpt).
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Samples per process per step: images (mlp, default 64) or sequences of 64 characters (gpt, default 16).
    #[arg(long)]
    batch: Option<usize>,
    /// Hidden widths of the MLP, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "512,512")]
    hidden: Vec<usize>,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Seed of the initialisation and the shuffle.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// MNIST directory (default: the repository's data/mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Text file for the GPT (default: the repository's data/shakespeare/shakespeare8.txt).
    #[arg(long)]
    text: Option<PathBuf>,
    /// ddp and accel levels: `auto` / `on` record the forward pass (`segments::record`) and call
    /// `DistributedDataParallel::backward` / `Accelerator::backward_segments` with `DdpOptions::overlap` Auto / On
    /// (the all-reduce overlapped with the backward pass: always with `on`; with `auto` where a spare core per
    /// rank exists); `off` runs `backward()` and then the all-reduce. (The Trainer records its forward pass and
    /// uses Auto.)
    #[arg(long, value_enum, default_value = "auto")]
    overlap: OverlapArg,
    /// ddp level with `--overlap off`: time each step's parts on every rank — forward + backward, waiting for the
    /// slowest rank (a barrier added after the backward pass, so the step gets one more collective) and
    /// `sync_gradients` — and print their medians per rank at the end.
    #[arg(long)]
    breakdown: bool,
    /// Free text copied into the JSON line as `tag`, for the scripts that group runs (`scripts/bench-overlap.sh`
    /// tags the two 1-process runs it starts side by side with their round).
    #[arg(long)]
    tag: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OverlapArg {
    Auto,
    On,
    Off,
}

impl OverlapArg {
    fn ddp_options(self) -> DdpOptions {
        let overlap = if self == OverlapArg::On { Overlap::On } else { Overlap::Auto };
        DdpOptions { overlap, ..DdpOptions::default() }
    }
}

impl Cli {
    fn batch(&self) -> usize {
        self.batch.unwrap_or(match self.model {
            ModelKind::Mlp => 64,
            ModelKind::Gpt => 16,
        })
    }

    fn text_path(&self) -> PathBuf {
        self.text.clone().unwrap_or_else(accel_examples::default_text_path)
    }
}

/// The context length of the benchmark's GPT ([`GptConfig::small`]'s).
const GPT_BLOCK: usize = 64;

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if cli.level == Level::Candle && cli.nproc != 1 {
        bail!("--level candle is a plain single-process loop: give --nproc 1 (or pick --level ddp|accel|trainer)");
    }
    if cli.breakdown && (cli.level != Level::Ddp || cli.overlap != OverlapArg::Off) {
        bail!(
            "--breakdown times the parts of a level-1 step that syncs after the backward pass: give --level ddp \
             --overlap off (got --level {} --overlap {})",
            format!("{:?}", cli.level).to_lowercase(),
            format!("{:?}", cli.overlap).to_lowercase()
        );
    }
    if cli.threads == 0 || cli.batch() == 0 {
        bail!("--threads and --batch must be at least 1");
    }
    // Before any thread starts (candle's thread pool, the launcher): setting the environment is sound here. The
    // launcher keeps variables the user set, so every worker gets the same count.
    let t0_ns = match std::env::var(T0_ENV).ok().and_then(|v| v.trim().parse::<u128>().ok()) {
        Some(t) => t,
        None => {
            let now = unix_ns();
            std::env::set_var(T0_ENV, now.to_string());
            now
        }
    };
    std::env::set_var("RAYON_NUM_THREADS", cli.threads.to_string());
    std::env::set_var("OMP_NUM_THREADS", cli.threads.to_string());
    if ddp_core::launcher::launch_self(cli.nproc).context("the benchmark workers failed")? {
        return Ok(());
    }
    let outcome = match (cli.model, cli.level) {
        (ModelKind::Mlp, Level::Candle) => mlp_candle(&cli)?,
        (ModelKind::Mlp, Level::Ddp) => mlp_ddp(&cli)?,
        (ModelKind::Mlp, Level::Accel) => mlp_accel(&cli)?,
        (ModelKind::Mlp, Level::Trainer) => mlp_trainer(&cli)?,
        (ModelKind::Gpt, Level::Candle) => gpt_candle(&cli)?,
        (ModelKind::Gpt, Level::Ddp) => gpt_ddp(&cli)?,
        (ModelKind::Gpt, Level::Accel) => gpt_accel(&cli)?,
        (ModelKind::Gpt, Level::Trainer) => gpt_trainer(&cli)?,
    };
    if outcome.rank == 0 {
        let wall_s = (unix_ns().saturating_sub(t0_ns)) as f64 * 1e-9;
        println!("{}", outcome.json(&cli, wall_s)?);
    }
    Ok(())
}

fn unix_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// Step end stamps of one run.
#[derive(Debug, Clone)]
struct Clock {
    start: Instant,
    ends: Vec<Instant>,
    /// Samples (images / sequences) of each step over all processes.
    samples: Vec<usize>,
}

impl Clock {
    fn start() -> Self {
        Clock { start: Instant::now(), ends: Vec::new(), samples: Vec::new() }
    }

    fn step_done(&mut self, global_samples: usize) {
        self.ends.push(Instant::now());
        self.samples.push(global_samples);
    }
}

/// What a run reports (rank 0 prints it).
struct Outcome {
    rank: usize,
    world: usize,
    clock: Clock,
    /// Mean training loss over the run.
    train_loss: f64,
    /// Test accuracy (mlp) or validation loss (gpt).
    quality: f64,
    parameters: usize,
    /// Samples every process together saw in the first epoch (mlp).
    samples_per_epoch: Option<usize>,
}

impl Outcome {
    fn json(&self, cli: &Cli, wall_s: f64) -> Result<String> {
        let c = &self.clock;
        let Some(first) = c.ends.first() else { bail!("no optimizer step was taken") };
        let mut gaps: Vec<f64> = c.ends.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3).collect();
        gaps.sort_by(f64::total_cmp);
        let timed: Duration = *c.ends.last().unwrap_or(first) - *first;
        let timed_samples: usize = c.samples.iter().skip(1).sum();
        let per_s = if c.ends.len() > 1 { timed_samples as f64 / timed.as_secs_f64().max(1e-12) } else { f64::NAN };
        let (rate_key, rate, quality_key) = match cli.model {
            ModelKind::Mlp => ("samples_per_s", per_s, "test_accuracy"),
            ModelKind::Gpt => ("tokens_per_s", per_s * GPT_BLOCK as f64, "val_loss"),
        };
        let mut j = serde_json::json!({
            "framework": "accel-rs",
            "model": format!("{:?}", cli.model).to_lowercase(),
            "level": format!("{:?}", cli.level).to_lowercase(),
            "nproc": self.world,
            "threads": candle_core::utils::get_num_threads(),
            "batch_per_process": cli.batch(),
            "step_ms": gaps.get(gaps.len() / 2).copied().unwrap_or(f64::NAN),
            "first_step_ms": (*first - c.start).as_secs_f64() * 1e3,
            "wall_s": wall_s,
            "train_loss": self.train_loss,
            "steps": c.ends.len(),
            "parameters": self.parameters,
            "samples_seen": c.samples.iter().sum::<usize>(),
            "fused_ops": accel_nn::ops::fused_ops_enabled(),
            "overlap": format!("{:?}", cli.overlap).to_lowercase(),
        });
        j[rate_key] = rate.into();
        if let Some(tag) = &cli.tag {
            j["tag"] = tag.clone().into();
        }
        j[quality_key] = self.quality.into();
        if let Some(n) = self.samples_per_epoch {
            j["samples_per_epoch"] = n.into();
        }
        Ok(serde_json::to_string(&j)?)
    }
}

fn parameter_count(varmap: &VarMap) -> usize {
    varmap.all_vars().iter().map(|v| v.elem_count()).sum()
}

fn mean(losses: &[f64]) -> f64 {
    losses.iter().sum::<f64>() / losses.len().max(1) as f64
}

/// Test accuracy of the MLP on all of t10k (after training, untimed).
fn test_accuracy(model: &Mlp, cli: &Cli) -> Result<f64> {
    let test = load_mnist(&cli.data_dir.clone().unwrap_or_else(default_data_dir), "t10k", &Device::Cpu)?;
    let indices: Vec<usize> = (0..test.len()).collect();
    let mut correct = 0;
    for chunk in indices.chunks(1000) {
        let (x, y) = test.batch(chunk)?;
        correct += correct_count(&model.forward(&x)?, &y)?;
    }
    Ok(correct as f64 / test.len() as f64)
}

/// Mean next-character loss of the GPT over every validation window (after training, untimed).
fn val_loss(model: &CharGpt, val: &TextDataset) -> Result<f64> {
    let indices: Vec<usize> = (0..val.len()).collect();
    let mut sum = 0.0;
    for chunk in indices.chunks(64) {
        let batch = val.get_batch(chunk)?;
        sum += f64::from(model.loss(&batch.inputs, &batch.targets)?.to_scalar::<f32>()?) * chunk.len() as f64;
    }
    Ok(sum / val.len().max(1) as f64)
}

fn gpt_datasets(cli: &Cli) -> Result<(TextDataset, TextDataset, GptConfig)> {
    let (train, val) = accel_examples::split_text_datasets(&cli.text_path(), GPT_BLOCK)?;
    let cfg = GptConfig { block_size: GPT_BLOCK, ..GptConfig::small(train.vocab().len()) };
    Ok((train, val, cfg))
}

fn process_group() -> Result<ProcessGroup> {
    Ok(if ddp_core::launcher::is_worker() {
        ProcessGroup::init_from_env().context("joining the process group (a launcher started this process)")?
    } else {
        ProcessGroup::single_process()?
    })
}

// ---------------------------------------------------------------------------------------------- plain candle

fn mlp_candle(cli: &Cli) -> Result<Outcome> {
    let train = load_mnist(&cli.data_dir.clone().unwrap_or_else(default_data_dir), "train10k", &Device::Cpu)?;
    let varmap = VarMap::new();
    let model = Mlp::with_hidden(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cli.hidden)?;
    seed_parameters(&varmap, cli.seed)?;
    let vars = varmap.all_vars();
    let mut opt = AdamW::new(AdamWConfig::new(cli.lr))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cli.seed);
    let mut order: Vec<usize> = (0..train.len()).collect();
    let (mut losses, mut first_epoch) = (Vec::new(), 0);
    let mut clock = Clock::start();
    for epoch in 0..cli.epochs {
        order.shuffle(&mut rng);
        for idx in order.chunks(cli.batch()) {
            let (x, y) = train.batch(idx)?;
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            let grads = loss.backward()?;
            opt.step(&vars, &grads_for(&vars, &grads))?;
            losses.push(f64::from(loss.to_scalar::<f32>()?));
            clock.step_done(idx.len());
            if epoch == 0 {
                first_epoch += idx.len();
            }
        }
    }
    Ok(Outcome {
        rank: 0,
        world: 1,
        clock,
        train_loss: mean(&losses),
        quality: test_accuracy(&model, cli)?,
        parameters: parameter_count(&varmap),
        samples_per_epoch: Some(first_epoch),
    })
}

fn gpt_candle(cli: &Cli) -> Result<Outcome> {
    let (train, val, cfg) = gpt_datasets(cli)?;
    let varmap = VarMap::new();
    let tp = TensorParallel::new(ProcessGroup::single_process()?);
    let model =
        CharGpt::new(cfg, &nn::VarBuilder::new(&varmap, &tp, cli.seed, DType::F32, &Device::Cpu, CharGpt::plan(&cfg)))?;
    let vars = varmap.all_vars();
    let mut opt = AdamW::new(AdamWConfig::new(cli.lr))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cli.seed);
    let mut order: Vec<usize> = (0..train.len()).collect();
    let mut losses = Vec::new();
    let mut clock = Clock::start();
    'training: loop {
        order.shuffle(&mut rng);
        for idx in order.chunks_exact(cli.batch()) {
            let batch = train.get_batch(idx)?;
            let loss = model.loss(&batch.inputs, &batch.targets)?;
            let grads = loss.backward()?;
            opt.step(&vars, &grads_for(&vars, &grads))?;
            losses.push(f64::from(loss.to_scalar::<f32>()?));
            clock.step_done(idx.len());
            if clock.ends.len() as u64 >= cli.steps {
                break 'training;
            }
        }
    }
    Ok(Outcome {
        rank: 0,
        world: 1,
        clock,
        train_loss: mean(&losses),
        quality: val_loss(&model, &val)?,
        parameters: parameter_count(&varmap),
        samples_per_epoch: None,
    })
}

// ------------------------------------------------------------------------------------------ level 1: ddp-core

/// One step's backward and gradient average at level 1: overlapped (`--overlap`: the forward recorded,
/// `DistributedDataParallel::backward`) or after the backward pass (`loss.backward()` + `sync_gradients`).
fn ddp_backward(
    cli: &Cli,
    ddp: &DistributedDataParallel,
    breakdown: &mut Breakdown,
    forward: impl FnOnce() -> Result<Tensor>,
) -> Result<(Tensor, GradStore)> {
    if cli.overlap != OverlapArg::Off {
        let (loss, cuts) = segments::record(forward)?;
        let grads = ddp.backward(&loss, cuts)?;
        Ok((loss, grads))
    } else {
        if !cli.breakdown {
            let loss = forward()?;
            let mut grads = loss.backward()?;
            ddp.sync_gradients(&mut grads)?;
            return Ok((loss, grads));
        }
        let start = Instant::now();
        let loss = forward()?;
        let mut grads = loss.backward()?;
        let computed = Instant::now();
        ddp.process_group().barrier()?;
        let aligned = Instant::now();
        ddp.sync_gradients(&mut grads)?;
        breakdown.record([computed - start, aligned - computed, aligned.elapsed()]);
        Ok((loss, grads))
    }
}

/// `--breakdown`: the parts of every step on this rank (forward + backward, waiting for the slowest rank, gradient
/// sync), printed as medians when the run ends.
#[derive(Debug, Default)]
struct Breakdown {
    steps: Vec<[Duration; 3]>,
}

impl Breakdown {
    fn record(&mut self, parts: [Duration; 3]) {
        self.steps.push(parts);
    }

    /// Medians over every step but the first, in ms, as one line (stderr; the launcher prefixes the rank).
    fn report(&self) {
        if self.steps.len() < 2 {
            return;
        }
        let median = |i: usize| {
            let mut v: Vec<f64> = self.steps[1..].iter().map(|p| p[i].as_secs_f64() * 1e3).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        eprintln!(
            "breakdown (median ms over {} steps): forward + backward {:.3}, waiting for the slowest rank {:.3}, \
             sync_gradients {:.3}",
            self.steps.len() - 1,
            median(0),
            median(1),
            median(2)
        );
    }
}

/// DDP over `pg` and the parameters in DDP's (fixed) registration order.
fn ddp_setup(cli: &Cli, pg: &ProcessGroup, varmap: &VarMap) -> Result<(DistributedDataParallel, Vec<Var>)> {
    let ddp = DistributedDataParallel::new(pg, varmap, cli.overlap.ddp_options())?;
    let vars = ddp.named_vars().iter().map(|(_, v)| v.clone()).collect();
    Ok((ddp, vars))
}

fn mlp_ddp(cli: &Cli) -> Result<Outcome> {
    let pg = process_group()?;
    let world = pg.world_size();
    let train: Mnist = load_mnist(&cli.data_dir.clone().unwrap_or_else(default_data_dir), "train10k", &Device::Cpu)?;
    let varmap = VarMap::new();
    let model = Mlp::with_hidden(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cli.hidden)?;
    seed_parameters(&varmap, cli.seed)?;
    let (ddp, vars) = ddp_setup(cli, &pg, &varmap)?;
    let mut opt = AdamW::new(AdamWConfig::new(cli.lr))?;
    let mut sampler = DistributedSampler::for_group(train.len(), &pg)?.seed(cli.seed);
    let (mut losses, mut first_epoch, mut breakdown) = (Vec::new(), 0, Breakdown::default());
    let mut clock = Clock::start();
    for epoch in 0..cli.epochs {
        sampler.set_epoch(epoch);
        for idx in sampler.batches(cli.batch())? {
            let (x, y) = train.batch(&idx)?;
            let (loss, grads) = ddp_backward(cli, &ddp, &mut breakdown, || {
                Ok(candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?)
            })?;
            opt.step(&vars, &grads_for(&vars, &grads))?;
            losses.push(f64::from(loss.to_scalar::<f32>()?));
            // Every rank's batch has the same size (the sampler pads the shards to equal length).
            clock.step_done(idx.len() * world);
            if epoch == 0 {
                first_epoch += idx.len() * world;
            }
        }
    }
    breakdown.report();
    Ok(Outcome {
        rank: pg.rank(),
        world,
        clock,
        train_loss: mean(&losses),
        quality: test_accuracy(&model, cli)?,
        parameters: parameter_count(&varmap),
        samples_per_epoch: Some(first_epoch),
    })
}

fn gpt_ddp(cli: &Cli) -> Result<Outcome> {
    let pg = process_group()?;
    let world = pg.world_size();
    let (train, val, cfg) = gpt_datasets(cli)?;
    let varmap = VarMap::new();
    // Data parallel only: the model's own tensor-parallel group is this process alone.
    let tp = TensorParallel::new(ProcessGroup::single_process()?);
    let model =
        CharGpt::new(cfg, &nn::VarBuilder::new(&varmap, &tp, cli.seed, DType::F32, &Device::Cpu, CharGpt::plan(&cfg)))?;
    let (ddp, vars) = ddp_setup(cli, &pg, &varmap)?;
    let mut opt = AdamW::new(AdamWConfig::new(cli.lr))?;
    let mut sampler = DistributedSampler::for_group(train.len(), &pg)?.seed(cli.seed).drop_last(true);
    let (mut losses, mut breakdown) = (Vec::new(), Breakdown::default());
    let mut clock = Clock::start();
    let mut epoch = 0;
    'training: loop {
        sampler.set_epoch(epoch);
        for idx in sampler.batches(cli.batch())?.into_iter().filter(|b| b.len() == cli.batch()) {
            let batch = train.get_batch(&idx)?;
            let (loss, grads) =
                ddp_backward(cli, &ddp, &mut breakdown, || Ok(model.loss(&batch.inputs, &batch.targets)?))?;
            opt.step(&vars, &grads_for(&vars, &grads))?;
            losses.push(f64::from(loss.to_scalar::<f32>()?));
            clock.step_done(idx.len() * world);
            if clock.ends.len() as u64 >= cli.steps {
                break 'training;
            }
        }
        epoch += 1;
    }
    breakdown.report();
    Ok(Outcome {
        rank: pg.rank(),
        world,
        clock,
        train_loss: mean(&losses),
        quality: val_loss(&model, &val)?,
        parameters: parameter_count(&varmap),
        samples_per_epoch: None,
    })
}

// -------------------------------------------------------------------------------------- level 2: Accelerator

/// One micro-batch's backward at level 2: `Accelerator::backward_segments` over the recorded forward pass
/// (`--overlap`) or `Accelerator::backward`. Returns the loss.
fn accel_backward(cli: &Cli, acc: &Accelerator, forward: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
    if cli.overlap != OverlapArg::Off {
        let (loss, cuts) = segments::record(forward)?;
        acc.backward_segments(&loss, cuts)?;
        Ok(loss)
    } else {
        let loss = forward()?;
        acc.backward(&loss)?;
        Ok(loss)
    }
}

fn accelerator(cli: &Cli) -> Result<Accelerator> {
    let mut cfg = AcceleratorConfig::from_env()?;
    cfg.seed = Some(cli.seed);
    // Only the overlap comes from the flag; the environment's other DDP settings (ACCEL_DDP_COMM_HOOK) stay.
    cfg.ddp.overlap = cli.overlap.ddp_options().overlap;
    Ok(Accelerator::new(cfg)?)
}

fn mlp_accel(cli: &Cli) -> Result<Outcome> {
    let acc = accelerator(cli)?;
    let world = acc.world_size();
    let train = accel::data::load_mnist(&cli.data_dir.clone().unwrap_or_else(default_data_dir), "train10k")?;
    let loader_cfg = DataLoaderConfig { batch_size: cli.batch(), shuffle: true, seed: cli.seed, ..Default::default() };
    let varmap = VarMap::new();
    let model = Mlp::with_hidden(acc.var_builder(&varmap), &cli.hidden)?;
    seed_parameters(&varmap, cli.seed)?;
    let opt = AdamW::new(AdamWConfig::new(cli.lr))?;
    let (_prepared, mut opt, loader) = acc.prepare(&varmap, opt, DataLoader::new(train, loader_cfg))?;
    let (mut losses, mut first_epoch) = (Vec::new(), 0);
    let mut clock = Clock::start();
    for epoch in 0..cli.epochs {
        for batch in &loader {
            let batch = batch?;
            let loss = accel_backward(cli, &acc, || {
                Ok(candle_nn::loss::cross_entropy(&model.forward(&batch.inputs)?, &batch.targets)?)
            })?;
            opt.step()?;
            losses.push(f64::from(loss.to_scalar::<f32>()?));
            // Accelerate's even batches: every rank's batch has the same size.
            clock.step_done(batch.len() * world);
            if epoch == 0 {
                first_epoch += batch.len() * world;
            }
        }
    }
    Ok(Outcome {
        rank: acc.rank(),
        world,
        clock,
        train_loss: mean(&losses),
        quality: test_accuracy(&model, cli)?,
        parameters: parameter_count(&varmap),
        samples_per_epoch: Some(first_epoch),
    })
}

fn gpt_accel(cli: &Cli) -> Result<Outcome> {
    let acc = accelerator(cli)?;
    let world = acc.world_size();
    let (train, val, cfg) = gpt_datasets(cli)?;
    let loader_cfg = DataLoaderConfig {
        batch_size: cli.batch(),
        shuffle: true,
        seed: cli.seed,
        drop_last: true,
        ..Default::default()
    };
    let varmap = VarMap::new();
    let model = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let opt = AdamW::new(AdamWConfig::new(cli.lr))?;
    let (_prepared, mut opt, loader) = acc.prepare(&varmap, opt, DataLoader::new(train, loader_cfg))?;
    let mut losses = Vec::new();
    let mut clock = Clock::start();
    'training: loop {
        for batch in &loader {
            let batch = batch?;
            let loss = accel_backward(cli, &acc, || Ok(model.loss(&batch.inputs, &batch.targets)?))?;
            opt.step()?;
            losses.push(f64::from(loss.to_scalar::<f32>()?));
            clock.step_done(batch.len() * world);
            if clock.ends.len() as u64 >= cli.steps {
                break 'training;
            }
        }
    }
    Ok(Outcome {
        rank: acc.rank(),
        world,
        clock,
        train_loss: mean(&losses),
        quality: val_loss(&model, &val)?,
        parameters: parameter_count(&varmap),
        samples_per_epoch: None,
    })
}

// ------------------------------------------------------------------------------------------ level 3: Trainer

/// Stamps the start of training and the end of every optimizer step.
struct StepClock(Arc<Mutex<Option<Clock>>>);

impl TrainerCallback for StepClock {
    fn on_train_begin(&mut self, _ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        *ddp_core::sync::lock(&self.0) = Some(Clock::start());
        Ok(())
    }

    fn on_step_end(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        let global_batch = ctx.args.per_device_train_batch_size * ctx.world_size;
        if let Some(clock) = ddp_core::sync::lock(&self.0).as_mut() {
            clock.step_done(global_batch);
        }
        Ok(())
    }
}

/// The Trainer's arguments for the benchmark: its defaults (HF's) but lr, batch and seed, no checkpoints, no
/// evaluation during training, no trackers, no progress bar, no plots.
fn training_args(cli: &Cli, output_dir: PathBuf) -> trainer::TrainingArguments {
    trainer::TrainingArguments {
        output_dir,
        per_device_train_batch_size: cli.batch(),
        learning_rate: cli.lr,
        seed: cli.seed,
        save_strategy: SaveStrategy::No,
        report_to: ReportTo(vec!["none".into()]),
        disable_tqdm: true,
        save_plots: false,
        ..Default::default()
    }
}

/// Runs `trainer` with a [`StepClock`]; returns the clock, the mean training loss and the trainer.
fn train_timed<M, D>(mut t: Trainer<M, D>) -> Result<(Clock, f64, Trainer<M, D>)>
where
    M: candle_nn::ModuleT + 'static,
    D: Dataset + 'static,
{
    let clock = Arc::new(Mutex::new(None));
    t = t.callback(StepClock(clock.clone()));
    let out = t.train()?;
    let clock = ddp_core::sync::lock(&clock).take().context("the Trainer never began training")?;
    Ok((clock, out.training_loss, t))
}

/// The Trainer's output directory: one per job (the launcher's port, the same on every rank), or per process when
/// it runs alone (two single-process runs side by side must not share, and delete, one directory).
fn scratch_dir(cli: &Cli) -> PathBuf {
    let job = match ddp_core::env::DistEnv::detect_from_env() {
        Ok(Some(env)) => env.master_port.to_string(),
        _ => format!("pid{}", std::process::id()),
    };
    std::env::temp_dir().join(format!("levels-{:?}-{job}", cli.model))
}

fn mlp_trainer(cli: &Cli) -> Result<Outcome> {
    let train = accel::data::load_mnist(&cli.data_dir.clone().unwrap_or_else(default_data_dir), "train10k")?;
    let out = scratch_dir(cli);
    let args = trainer::TrainingArguments { num_train_epochs: cli.epochs as f64, ..training_args(cli, out.clone()) };
    let hidden = cli.hidden.clone();
    let t = Trainer::new(args, move |vb| Mlp::with_hidden(vb, &hidden), train, None, losses::CrossEntropy);
    let (clock, train_loss, t) = train_timed(t)?;
    let acc = t.accelerator().context("trained")?;
    let (rank, world) = (acc.rank(), acc.world_size());
    let steps_per_epoch = clock.ends.len() / (cli.epochs.max(1) as usize);
    let outcome = Outcome {
        rank,
        world,
        train_loss,
        quality: test_accuracy(t.model().context("trained")?, cli)?,
        parameters: parameter_count(t.varmap().context("trained")?),
        // The Trainer (as HF's) counts steps × batch × processes: the padded last batch included.
        samples_per_epoch: Some(steps_per_epoch * cli.batch() * world),
        clock,
    };
    if rank == 0 {
        let _ = std::fs::remove_dir_all(&out);
    }
    Ok(outcome)
}

fn gpt_trainer(cli: &Cli) -> Result<Outcome> {
    let (train, val, cfg) = gpt_datasets(cli)?;
    let out = scratch_dir(cli);
    let args = trainer::TrainingArguments {
        max_steps: cli.steps as i64,
        dataloader_drop_last: true,
        ..training_args(cli, out.clone())
    };
    let t = Trainer::with_plan(
        args,
        CharGpt::plan(&cfg),
        move |vb| CharGpt::new(cfg, &vb).map_err(to_candle),
        train,
        None,
        losses::VocabParallelCrossEntropy { vocab_size: cfg.vocab_size },
    );
    let (clock, train_loss, t) = train_timed(t)?;
    let acc = t.accelerator().context("trained")?;
    let outcome = Outcome {
        rank: acc.rank(),
        world: acc.world_size(),
        train_loss,
        quality: val_loss(t.model().context("trained")?, &val)?,
        parameters: parameter_count(t.varmap().context("trained")?),
        samples_per_epoch: None,
        clock,
    };
    if outcome.rank == 0 {
        let _ = std::fs::remove_dir_all(&out);
    }
    Ok(outcome)
}
