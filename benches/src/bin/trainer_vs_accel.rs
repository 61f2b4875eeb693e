//! Trainer overhead: the step time of `Trainer::train` against the hand-written Accelerator loop doing the same
//! work (MNIST MLP 784-256-10, AdamW, gradient clipping at 1.0, linear LR schedule, batch 64 per process, fp32),
//! on 2 processes, in one run.
//!
//! ```text
//! cargo run --release -p accel-benches --bin trainer_vs_accel                 # 2 processes, 400 timed steps
//! cargo run --release -p accel-benches --bin trainer_vs_accel -- --steps 1000 --logging-steps 10
//! ```
//!
//! The two loops run interleaved in the same processes, so the load of a shared machine hits both alike: a
//! callback of the Trainer runs one step of the Accelerator loop after every Trainer step. On rank 0 each
//! Accelerator step is timed on its own, and each Trainer step is the time between two consecutive callback calls
//! minus the Accelerator step in between — so it includes everything the Trainer does per step: fetching the
//! window, the loss normalisation, callbacks (flow control, progress bar — hidden, as stderr is not a terminal
//! under the launcher — printer, JSONL + TensorBoard trackers), logging every `--logging-steps` (HF's default
//! 500) and the step bookkeeping. Reported: median and central-half mean per step, and the overhead
//! `trainer / accel − 1` (target ≤ 2 %).

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
    let cli = Cli::parse();
    if std::env::var_os("RANK").is_none() && cli.nproc > 1 {
        let exe = std::env::current_exe()?;
        let mut cfg = ddp_core::LaunchConfig::local(cli.nproc, exe, std::env::args().skip(1).collect());
        // candle's CPU kernels use rayon: give each worker its share of the cores (as torchrun's OMP_NUM_THREADS).
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            cfg.env.push(("RAYON_NUM_THREADS".into(), (cores / cli.nproc.max(1)).max(1).to_string()));
        }
        ddp_core::launch(&cfg).context("benchmark workers failed")?;
        return Ok(());
    }
    let data_dir = cli
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("data").join("mnist"));
    let data = accel::data::load_mnist(&data_dir, "train10k")?;
    let pg = if std::env::var_os("RANK").is_some() {
        ProcessGroup::init_from_env()?
    } else {
        ProcessGroup::single_process()?
    };
    let total = cli.warmup + cli.steps;
    let accel_loop = AccelLoop::new(&cli, &pg, data.clone(), total)?;
    let times = Arc::new(Mutex::new(Times::default()));
    let interleave = Interleave { accel: accel_loop, warmup: cli.warmup, last_mark: None, times: times.clone() };

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
    if pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&out);
        let mut times = times.lock().unwrap();
        let (a_med, a_mean) = stats(&mut times.accel);
        let (t_med, t_mean) = stats(&mut times.trainer);
        println!(
            "trainer_vs_accel: {} process(es), batch {}/process, {} timed steps of each loop, interleaved, logging \
             every {} steps",
            pg.world_size(),
            cli.batch_size,
            times.trainer.len(),
            cli.logging_steps
        );
        println!(
            "  accelerator loop: median {:.3} ms/step, central-half mean {:.3} ms/step",
            a_med * 1e3,
            a_mean * 1e3
        );
        println!(
            "  trainer:          median {:.3} ms/step, central-half mean {:.3} ms/step",
            t_med * 1e3,
            t_mean * 1e3
        );
        println!(
            "  trainer overhead: {:+.2} % (median), {:+.2} % (central-half mean); target ≤ 2 %",
            (t_med / a_med - 1.0) * 100.0,
            (t_mean / a_mean - 1.0) * 100.0
        );
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
        let model = Mlp::new(acc.var_builder(&varmap))?;
        let prepared = acc.prepare_model(&varmap)?;
        let opt =
            acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::new(1e-3) })?)?;
        let sched = Scheduler::new(SchedulerKind::Linear, 1e-3, 0, total);
        let cfg = DataLoaderConfig { batch_size: cli.batch_size, shuffle: true, seed: 42, ..Default::default() };
        let loader = acc.prepare_data_loader(DataLoader::new(data, cfg))?;
        Ok(AccelLoop { acc, model, opt, sched, loader, iter: None })
    }

    /// One optimizer step: the loop a user writes at level 2.
    fn step(&mut self) -> anyhow::Result<()> {
        let batch = loop {
            if let Some(b) = self.iter.as_mut().and_then(|it| it.next()) {
                break b?;
            }
            self.iter = Some(self.loader.iter()); // the loader moves to the next epoch by itself
        };
        let logits = self.model.forward(&batch.inputs)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &batch.targets)?;
        self.acc.backward(&loss)?;
        self.acc.clip_grad_norm(1.0)?;
        if self.opt.step()? {
            self.sched.step();
            self.opt.set_learning_rate(self.sched.lr());
        }
        Ok(())
    }
}

#[derive(Default)]
struct Times {
    accel: Vec<f64>,
    trainer: Vec<f64>,
}

/// Runs one Accelerator step after every Trainer step and times both (see the module documentation).
struct Interleave {
    accel: AccelLoop,
    warmup: u64,
    last_mark: Option<Instant>,
    times: Arc<Mutex<Times>>,
}

impl TrainerCallback for Interleave {
    fn on_step_end(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        let trainer_end = Instant::now();
        let timed = ctx.state.global_step > self.warmup;
        if let (Some(mark), true) = (self.last_mark, timed) {
            self.times.lock().unwrap().trainer.push((trainer_end - mark).as_secs_f64());
        }
        let start = Instant::now();
        self.accel
            .step()
            .map_err(|e| trainer::TrainerError::Callback { context: "accel step".into(), message: e.to_string() })?;
        let end = Instant::now();
        if timed {
            self.times.lock().unwrap().accel.push((end - start).as_secs_f64());
        }
        self.last_mark = Some(end);
        Ok(())
    }
}
