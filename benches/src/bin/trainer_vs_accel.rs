//! Trainer overhead: the step time of `Trainer::train` against the hand-written Accelerator loop doing the same
//! work (MNIST MLP 784-256-10, AdamW, gradient clipping at 1.0, linear LR schedule, batch 64 per process, fp32),
//! on 2 processes, in one run.
//!
//! ```text
//! cargo run -p accel-benches --bin trainer_vs_accel                 # 2 processes, 400 timed steps
//! cargo run -p accel-benches --bin trainer_vs_accel -- --steps 1000 --logging-steps 10
//! ```
//!
//! The two loops run interleaved in the same processes, so the load of a shared machine hits both alike: a
//! callback of the Trainer runs one step of the Accelerator loop after every Trainer step. On rank 0 each
//! Accelerator step is timed on its own, and each Trainer step is the time between two consecutive callback calls
//! minus the Accelerator step in between — so it includes everything the Trainer does per step: fetching the
//! window, the loss normalisation, callbacks (flow control, progress bar — hidden, as stderr is not a terminal
//! under the launcher — printer, JSONL + TensorBoard trackers), logging every `--logging-steps` (HF's default
//! 500) and the step bookkeeping. Reported: median and central-half mean per step, and the overhead
//! `trainer / accel − 1` (target ≤ 2 %). A control — a second, identical Accelerator loop run right after the
//! first and timed the same way — shows how much of a difference the interleaved measurement itself produces.
//! Both Accelerator loops start from the Trainer's seeded weights and data order, so all three compute the same
//! trajectory; the parameters are compared at the end.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use accel::data::{DataLoader, DataLoaderConfig, DataLoaderIter, TensorDataset};
use accel::optim::{AdamW, AdamWConfig};
use accel::scheduler::{LrScheduler, Scheduler, SchedulerKind};
use accel::{AcceleratedOptimizer, Accelerator, AcceleratorConfig};
use anyhow::Context;
use candle_core::{Module, Tensor};
use candle_nn::VarMap;
use clap::Parser;
use ddp_core::ProcessGroup;
use trainer::{
    losses, CallbackContext, ReportTo, SaveStrategy, Trainer, TrainerCallback, TrainerControl, TrainingArguments,
};

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Trainer step time vs the Accelerator loop.
#[derive(Parser, Debug, Clone)]
struct Cli {
    /// Processes (launched with ddp_core::launch when RANK is unset).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Timed steps of each loop.
    #[arg(long, default_value_t = 400)]
    steps: u64,
    /// Untimed steps of each loop before the timed ones.
    #[arg(long, default_value_t = 20)]
    warmup: u64,
    /// Batch size per process.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Trainer logging interval in steps (HF's default 500).
    #[arg(long, default_value_t = 500.0)]
    logging_steps: f64,
    /// Skip the control (a second Accelerator loop timed against the first, which measures the bias of the
    /// interleaved measurement itself).
    #[arg(long)]
    no_control: bool,
    /// MNIST directory (default: the repository's data/mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

struct Mlp {
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
}

impl Mlp {
    fn new(vb: candle_nn::VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp { fc1: candle_nn::linear(784, 256, vb.pp("fc1"))?, fc2: candle_nn::linear(256, 10, vb.pp("fc2"))? })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(xs)?.relu()?)
    }
}

fn main() -> anyhow::Result<()> {
    accel_examples::keep_freed_memory();
    let cli = Cli::parse();
    // The launcher gives each worker its share of the cores (RAYON_NUM_THREADS).
    if ddp_core::launcher::launch_self(cli.nproc).context("benchmark workers failed")? {
        return Ok(());
    }
    let data_dir = cli
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("data").join("mnist"));
    let data = accel::data::load_mnist(&data_dir, "train10k")?;
    let pg =
        if ddp_core::launcher::is_worker() { ProcessGroup::init_from_env()? } else { ProcessGroup::single_process()? };
    let total = cli.warmup + cli.steps;
    let accel_loop = AccelLoop::new(&cli, &pg, data.clone(), total)?;
    let times = Arc::new(Mutex::new(Times::default()));
    let accel_model = accel_loop.prepared.clone();
    let control = if cli.no_control { None } else { Some(AccelLoop::new(&cli, &pg, data.clone(), total)?) };
    let interleave = Interleave {
        accel: accel_loop,
        control,
        warmup: cli.warmup,
        last_mark: None,
        step_begin: None,
        times: times.clone(),
    };

    let out = std::env::temp_dir().join(format!("trainer_vs_accel_{}", std::process::id()));
    let args = TrainingArguments {
        output_dir: out.clone(),
        max_steps: total as i64,
        per_device_train_batch_size: cli.batch_size,
        learning_rate: 1e-3,
        logging_steps: cli.logging_steps,
        save_strategy: SaveStrategy::No,
        report_to: ReportTo::default(),
        save_plots: false,
        ..Default::default()
    };
    let mut t =
        Trainer::new(args, Mlp::new, data, None, losses::CrossEntropy).process_group(pg.clone()).callback(interleave);
    t.train()?;
    // Same initial weights, data order and arithmetic: the two loops should end with the same parameters.
    let (ours, theirs) = (t.prepared_model().expect("trained").state_dict()?, accel_model.state_dict()?);
    let mut max_diff = 0f32;
    for (name, w) in &ours {
        let d = (w - &theirs[name])?.abs()?.max_all()?.to_scalar::<f32>()?;
        max_diff = max_diff.max(d);
    }
    if pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&out);
        let mut times = times.lock().unwrap();
        println!(
            "trainer_vs_accel: {} process(es), batch {}/process, {} timed steps of each loop, interleaved, logging \
             every {} steps",
            pg.world_size(),
            cli.batch_size,
            times.trainer.full.len(),
            cli.logging_steps
        );
        let Times { accel, trainer, control } = &mut *times;
        for (what, pick) in [("whole step", 0), ("step without the wait for the batch", 1)] {
            let get = |s: &mut Series| if pick == 0 { stats(&mut s.full) } else { stats(&mut s.core) };
            let (a_med, a_mean) = get(accel);
            let (t_med, t_mean) = get(trainer);
            println!("  {what}:");
            println!("    accelerator loop {:.3} ms (median), {:.3} ms (central-half mean)", a_med * 1e3, a_mean * 1e3);
            println!("    trainer          {:.3} ms (median), {:.3} ms (central-half mean)", t_med * 1e3, t_mean * 1e3);
            println!(
                "    trainer overhead {:+.2} % (median), {:+.2} % (central-half mean); target ≤ 2 %",
                (t_med / a_med - 1.0) * 100.0,
                (t_mean / a_mean - 1.0) * 100.0
            );
            if !control.full.is_empty() {
                let (c_med, c_mean) = get(control);
                println!(
                    "    control          {:+.2} % (median), {:+.2} % (central-half mean): a 2nd accelerator loop vs \
                     the 1st, the measurement's own bias",
                    (c_med / a_med - 1.0) * 100.0,
                    (c_mean / a_mean - 1.0) * 100.0
                );
            }
        }
        println!("  same work check: max |trainer − accel| over all parameters after the run = {max_diff:e}");
    }
    Ok(())
}

/// Median and mean of the central half (25th–75th percentile) of `v`, in seconds.
fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    let central = &v[n / 4..(3 * n / 4).max(n / 4 + 1)];
    (v[n / 2], central.iter().sum::<f64>() / central.len() as f64)
}

/// The hand-written Accelerator loop, one step at a time.
struct AccelLoop {
    acc: Accelerator,
    model: Mlp,
    prepared: accel::PreparedModel,
    opt: AcceleratedOptimizer<AdamW>,
    sched: Scheduler,
    loader: DataLoader<TensorDataset>,
    iter: Option<DataLoaderIter<TensorDataset>>,
}

impl AccelLoop {
    fn new(cli: &Cli, pg: &ProcessGroup, data: TensorDataset, total: u64) -> anyhow::Result<Self> {
        let acc =
            Accelerator::with_process_group(AcceleratorConfig { seed: Some(42), ..Default::default() }, pg.clone())?;
        let varmap = VarMap::new();
        // The Trainer's seeded initialisation and data seed: both loops compute the same trajectory.
        let model = Mlp::new(trainer::init::seeded_var_builder(&varmap, 42, acc.compute_dtype(), acc.device()))?;
        let prepared = acc.prepare_model(&varmap)?;
        let opt =
            acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::new(1e-3) })?)?;
        let sched = Scheduler::new(SchedulerKind::Linear, 1e-3, 0, total);
        let cfg = DataLoaderConfig { batch_size: cli.batch_size, shuffle: true, seed: 42, ..Default::default() };
        let loader = acc.prepare_data_loader(DataLoader::new(data, cfg))?;
        Ok(AccelLoop { acc, model, prepared, opt, sched, loader, iter: None })
    }

    /// One optimizer step: the loop a user writes at level 2. Returns the seconds spent waiting for the batch.
    fn step(&mut self) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let batch = loop {
            if let Some(b) = self.iter.as_mut().and_then(|it| it.next()) {
                break b?;
            }
            self.iter = Some(self.loader.iter()); // the loader moves to the next epoch by itself
        };
        let t1 = Instant::now();
        let logits = self.model.forward(&batch.inputs)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &batch.targets)?;
        self.acc.backward(&loss)?;
        self.acc.clip_grad_norm(1.0)?;
        if self.opt.step()? {
            self.sched.step();
            self.opt.set_learning_rate(self.sched.lr());
        }
        Ok((t1 - t0).as_secs_f64())
    }
}

/// Per-step seconds of one loop: the whole step, and the step without waiting for its batch.
#[derive(Default)]
struct Series {
    full: Vec<f64>,
    core: Vec<f64>,
}

#[derive(Default)]
struct Times {
    accel: Series,
    trainer: Series,
    control: Series,
}

/// Runs one Accelerator step (and one control step) after every Trainer step and times them all (see the module
/// documentation).
struct Interleave {
    accel: AccelLoop,
    control: Option<AccelLoop>,
    warmup: u64,
    last_mark: Option<Instant>,
    step_begin: Option<Instant>,
    times: Arc<Mutex<Times>>,
}

fn step_error(what: &str, e: anyhow::Error) -> trainer::TrainerError {
    trainer::TrainerError::Callback { context: what.into(), message: e.to_string() }
}

impl TrainerCallback for Interleave {
    fn on_step_begin(&mut self, _ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        self.step_begin = Some(Instant::now());
        Ok(())
    }

    fn on_step_end(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        let trainer_end = Instant::now();
        let timed = ctx.state.global_step > self.warmup;
        let mut times = self.times.lock().unwrap();
        if let (Some(mark), Some(begin), true) = (self.last_mark, self.step_begin, timed) {
            times.trainer.full.push((trainer_end - mark).as_secs_f64());
            times.trainer.core.push((trainer_end - begin).as_secs_f64());
        }
        let start = Instant::now();
        let wait = self.accel.step().map_err(|e| step_error("accelerator step", e))?;
        let mut end = Instant::now();
        if timed {
            times.accel.full.push((end - start).as_secs_f64());
            times.accel.core.push((end - start).as_secs_f64() - wait);
        }
        if let Some(control) = self.control.as_mut() {
            let start = end;
            let wait = control.step().map_err(|e| step_error("control step", e))?;
            end = Instant::now();
            if timed {
                times.control.full.push((end - start).as_secs_f64());
                times.control.core.push((end - start).as_secs_f64() - wait);
            }
        }
        self.last_mark = Some(end);
        Ok(())
    }
}
