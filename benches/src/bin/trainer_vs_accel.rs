//! Trainer overhead: step time of `Trainer::train` vs the hand-written Accelerator loop doing the same work
//! (MNIST MLP 784-256-10, AdamW, gradient clipping at 1.0, linear LR schedule, batch 64 per process), on 2
//! processes, in one run.
//!
//! ```text
//! cargo run --release -p accel-benches --bin trainer_vs_accel            # 2 processes, 3 rounds
//! cargo run --release -p accel-benches --bin trainer_vs_accel -- --steps 600 --rounds 5
//! ```
//!
//! Each round runs the Accelerator loop, then the Trainer (default logging: HF's logging_steps 500 unless
//! `--logging-steps` is given, JSONL + TensorBoard trackers, printer, progress bar — hidden as stderr is not a
//! terminal under the launcher), each for `--warmup` + `--steps` optimizer steps, timing the last `--steps` on
//! rank 0. Prints the median per-step time of each and the Trainer's overhead `median(trainer) / median(accel)
//! − 1` (target ≤ 2 %).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use accel::data::{DataLoader, DataLoaderConfig, TensorDataset};
use accel::optim::{AdamW, AdamWConfig};
use accel::scheduler::{LrScheduler, Scheduler, SchedulerKind};
use accel::{Accelerator, AcceleratorConfig};
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
    /// Timed optimizer steps per measurement.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Untimed steps before the timed ones.
    #[arg(long, default_value_t = 30)]
    warmup: u64,
    /// Alternating rounds (Accelerator loop, then Trainer).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
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
        let cfg = ddp_core::LaunchConfig::local(cli.nproc, exe, std::env::args().skip(1).collect());
        ddp_core::launch(&cfg).context("benchmark workers failed")?;
        return Ok(());
    }
    let data_dir = cli
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("data").join("mnist"));
    let data = accel::data::load_mnist(&data_dir, "train10k")?;
    let pg = ProcessGroup::init_from_env()?;
    let (mut accel_times, mut trainer_times) = (Vec::new(), Vec::new());
    for round in 0..cli.rounds {
        let a = accel_loop(&cli, &pg, data.clone())?;
        let t = trainer_loop(&cli, &pg, data.clone(), round)?;
        if pg.rank() == 0 {
            println!("round {round}: accel {:.3} ms/step, trainer {:.3} ms/step ({:+.2} %)", a * 1e3, t * 1e3, (t / a - 1.0) * 100.0);
        }
        accel_times.push(a);
        trainer_times.push(t);
    }
    if pg.rank() == 0 {
        let (a, t) = (median(&mut accel_times), median(&mut trainer_times));
        println!(
            "trainer_vs_accel: {} processes, batch {}/process, {} timed steps × {} rounds: accelerator loop {:.3} ms/step, \
             trainer {:.3} ms/step, overhead {:+.2} % (target ≤ 2 %)",
            pg.world_size(),
            cli.batch_size,
            cli.steps,
            cli.rounds,
            a * 1e3,
            t * 1e3,
            (t / a - 1.0) * 100.0
        );
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds per step of the hand-written Accelerator loop.
fn accel_loop(cli: &Cli, pg: &ProcessGroup, data: TensorDataset) -> anyhow::Result<f64> {
    let acc = Accelerator::with_process_group(AcceleratorConfig { seed: Some(42), ..Default::default() }, pg.clone())?;
    let varmap = VarMap::new();
    let model = Mlp::new(acc.var_builder(&varmap))?;
    let prepared = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::new(1e-3) })?)?;
    let total = cli.warmup + cli.steps;
    let mut sched = Scheduler::new(SchedulerKind::Linear, 1e-3, 0, total);
    let cfg = DataLoaderConfig { batch_size: cli.batch_size, shuffle: true, seed: 42, ..Default::default() };
    let mut loader = acc.prepare_data_loader(DataLoader::new(data, cfg))?;
    let mut step = 0u64;
    let mut started = None;
    'outer: for epoch in 0.. {
        loader.set_epoch(epoch);
        for batch in loader.iter() {
            let batch = batch?;
            let logits = model.forward(&batch.inputs)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &batch.targets)?;
            acc.backward(&loss)?;
            acc.clip_grad_norm(1.0)?;
            if opt.step()? {
                sched.step();
                opt.set_learning_rate(sched.lr());
            }
            step += 1;
            if step == cli.warmup {
                started = Some(Instant::now());
            }
            if step == total {
                break 'outer;
            }
        }
    }
    Ok(started.expect("warmup < total").elapsed().as_secs_f64() / cli.steps as f64)
}

/// Records when the timed region starts and ends.
struct StepTimer {
    warmup: u64,
    total: u64,
    times: Arc<Mutex<(Option<Instant>, Option<Instant>)>>,
}

impl TrainerCallback for StepTimer {
    fn on_step_end(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        let mut t = self.times.lock().unwrap();
        if ctx.state.global_step == self.warmup {
            t.0 = Some(Instant::now());
        } else if ctx.state.global_step == self.total {
            t.1 = Some(Instant::now());
        }
        Ok(())
    }
}

/// Seconds per step of `Trainer::train` on the same work.
fn trainer_loop(cli: &Cli, pg: &ProcessGroup, data: TensorDataset, round: usize) -> anyhow::Result<f64> {
    let total = cli.warmup + cli.steps;
    let out = std::env::temp_dir().join(format!("trainer_vs_accel_{}_{round}", std::process::id()));
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
    let times = Arc::new(Mutex::new((None, None)));
    let timer = StepTimer { warmup: cli.warmup, total, times: times.clone() };
    let mut t = Trainer::new(args, Mlp::new, data, None, losses::cross_entropy).process_group(pg.clone()).callback(timer);
    t.train()?;
    if pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&out);
    }
    let (a, b) = *times.lock().unwrap();
    Ok((b.expect("end") - a.expect("start")).as_secs_f64() / cli.steps as f64)
}
