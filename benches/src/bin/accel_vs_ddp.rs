//! Accelerator overhead: step time of the Accelerator loop vs the raw ddp-core loop doing the same work (MLP
//! 784-256-10, batch 64 per process, the same AdamW, the same pre-built batches, the same process group), on 2
//! processes, in one run.
//!
//! ```text
//! cargo run -p accel-benches --bin accel_vs_ddp                     # 2 processes
//! cargo run -p accel-benches --bin accel_vs_ddp -- --steps 1000
//! ```
//!
//! Raw loop (level 1): `forward → loss.backward() → ddp.sync_gradients(&mut grads) → optimizer.step(vars, grads)`.
//! Accelerator loop (level 2): `forward → acc.backward(&loss) → opt.step()` (fp32, no accumulation). The two
//! loops' steps alternate one by one (order flipped every pair) and each step is timed on its own, so machine-load
//! drift hits both alike. Prints the median (and central-half mean) per-step time of each and the overhead
//! `median(accel) / median(raw) − 1` (target ≤ 1 %).

use accel::optim::{AdamW, AdamWConfig, Optimizer};
use accel::{Accelerator, AcceleratorConfig};
use anyhow::Context;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use ddp_core::{DdpOptions, DistributedDataParallel};
use std::time::Instant;

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Accelerator step time vs the raw ddp-core loop.
#[derive(Parser, Debug, Clone)]
struct Cli {
    /// Processes (launched with ddp_core::launch when RANK is unset).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Timed steps of each loop (they alternate).
    #[arg(long, default_value_t = 400)]
    steps: usize,
    /// Untimed steps of each loop first.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Batch size per process.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Hidden width of the MLP.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
}

struct Mlp {
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
}

impl Mlp {
    fn new(vb: VarBuilder, hidden: usize) -> candle_core::Result<Self> {
        Ok(Mlp {
            fc1: candle_nn::linear(784, hidden, vb.pp("fc1"))?,
            fc2: candle_nn::linear(hidden, 10, vb.pp("fc2"))?,
        })
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
    if ddp_core::launcher::launch_self(cli.nproc).context("running the benchmark workers")? {
        return Ok(());
    }
    run(&cli)
}

/// The same parameter values in both models: copy `from`'s Vars into `to`'s (by name).
fn copy_weights(from: &VarMap, to: &VarMap) -> anyhow::Result<()> {
    let src = from.data().lock().unwrap();
    for (name, var) in to.data().lock().unwrap().iter() {
        var.set(src.get(name).context("parameter missing")?.as_tensor())?;
    }
    Ok(())
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let acc = Accelerator::new(AcceleratorConfig::default())?;
    let pg = acc.process_group().clone();

    // Pre-built batches (the same for both loops): inputs [b, 784] f32, labels [b] u32.
    let n_batches = 16;
    let batches: Vec<(Tensor, Tensor)> = (0..n_batches)
        .map(|_| {
            let x = Tensor::rand(0f32, 1f32, (cli.batch_size, 784), &Device::Cpu)?;
            let y = Tensor::rand(0f32, 1f32, (cli.batch_size, 10), &Device::Cpu)?.argmax(1)?;
            Ok((x, y))
        })
        .collect::<candle_core::Result<_>>()?;

    // Level 2: the Accelerator loop.
    let acc_varmap = VarMap::new();
    let acc_model = Mlp::new(acc.var_builder(&acc_varmap), cli.hidden)?;
    let acc_prepared = acc.prepare_model(&acc_varmap)?;
    let mut acc_opt = acc.prepare_optimizer(&acc_prepared, AdamW::new(AdamWConfig::new(1e-3))?)?;

    // Level 1: the raw ddp-core loop, same initial weights, same optimizer implementation.
    let raw_varmap = VarMap::new();
    let raw_model = Mlp::new(VarBuilder::from_varmap(&raw_varmap, DType::F32, &Device::Cpu), cli.hidden)?;
    copy_weights(&acc_varmap, &raw_varmap)?;
    let ddp = DistributedDataParallel::new(&pg, &raw_varmap, DdpOptions::default())?;
    let raw_vars: Vec<Var> = ddp.named_vars().iter().map(|(_, v)| v.clone()).collect();
    let mut raw_opt = AdamW::new(AdamWConfig::new(1e-3))?;

    let mut i = 0usize;
    let mut next = || {
        i += 1;
        &batches[i % n_batches]
    };
    let mut raw_step = |(x, y): &(Tensor, Tensor)| -> anyhow::Result<()> {
        let loss = candle_nn::loss::cross_entropy(&raw_model.forward(x)?, y)?;
        let mut grads = loss.backward()?;
        ddp.sync_gradients(&mut grads)?;
        let g: Vec<Option<Tensor>> = raw_vars.iter().map(|v| grads.get(v).cloned()).collect();
        raw_opt.step(&raw_vars, &g)?;
        Ok(())
    };
    let mut acc_step = |(x, y): &(Tensor, Tensor)| -> anyhow::Result<()> {
        let loss = candle_nn::loss::cross_entropy(&acc_model.forward(x)?, y)?;
        acc.backward(&loss)?;
        acc_opt.step()?;
        Ok(())
    };

    for _ in 0..cli.warmup {
        raw_step(next())?;
        acc_step(next())?;
    }
    pg.barrier()?;
    // Steps alternate (raw, accel, then accel, raw, ...), each timed on its own: load changes on the machine hit
    // both loops alike, and medians ignore the steps a burst of other work landed on.
    let (mut raw_times, mut acc_times) = (Vec::with_capacity(cli.steps), Vec::with_capacity(cli.steps));
    for i in 0..cli.steps {
        for which in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            let b = next();
            let t0 = Instant::now();
            if which == 0 {
                raw_step(b)?
            } else {
                acc_step(b)?
            }
            let dt = t0.elapsed().as_secs_f64();
            if which == 0 {
                raw_times.push(dt)
            } else {
                acc_times.push(dt)
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    // Mean of the central half: uses more of the samples than the median, still ignores the outliers.
    let trimmed_mean = |v: &Vec<f64>| {
        let (lo, hi) = (v.len() / 4, v.len() - v.len() / 4);
        v[lo..hi].iter().sum::<f64>() / (hi - lo) as f64
    };
    let (raw, accel) = (median(&mut raw_times), median(&mut acc_times));
    let (raw_tm, accel_tm) = (trimmed_mean(&raw_times), trimmed_mean(&acc_times));
    acc.print(format!(
        "accel_vs_ddp: {} processes, MLP 784-{}-10, batch {} per process, AdamW, fp32, {} alternating steps of each",
        acc.world_size(),
        cli.hidden,
        cli.batch_size,
        cli.steps
    ));
    acc.print(format!(
        "raw ddp-core loop : median {:.3} ms/step, central-half mean {:.3} ms/step",
        raw * 1e3,
        raw_tm * 1e3
    ));
    acc.print(format!(
        "Accelerator loop  : median {:.3} ms/step, central-half mean {:.3} ms/step",
        accel * 1e3,
        accel_tm * 1e3
    ));
    acc.print(format!(
        "ratio accel / raw : {:.4} (median), {:.4} (central-half mean) → overhead {:+.2} % (target ≤ 1 %)",
        accel / raw,
        accel_tm / raw_tm,
        (accel / raw - 1.0) * 100.0
    ));
    Ok(())
}
