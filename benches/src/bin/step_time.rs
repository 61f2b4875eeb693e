//! One training step of a single process, split into forward (model + loss), backward and optimizer, with candle's
//! composed ops and with accel-rs's fused ops (`accel_nn::ops`), interleaved step by step in one run so a shared
//! machine's load hits both alike.
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run -p accel-benches --bin step_time -- --model mlp --ops both
//! RAYON_NUM_THREADS=2 cargo run -p accel-benches --bin step_time -- --model gpt --ops both --json
//! ```
//!
//! - `--model mlp`: the examples' `Mlp` 784 → `--hidden` (default 512,512) → 10, batch `--batch` (default 128) of
//!   random pixels in [0, 1] and random labels, cross entropy (`accel_nn::ops::cross_entropy`), accel-nn's AdamW
//!   (lr 1e-3, PyTorch's defaults otherwise).
//! - `--model gpt`: the examples' `CharGpt` with its default `GptConfig::small` (context 64, d 128, 4 heads,
//!   4 layers) over the 76-character vocabulary of the shipped Shakespeare text, `--batch` sequences (default 16)
//!   of 64 random token ids, its mean next-token cross entropy, the same AdamW.
//! - `--ops candle` / `fused` / `both`: `accel_nn::ops::set_fused_ops(false / true)`; `both` runs one step of each
//!   in turn (two models with the same seeded weights, each with its own optimizer, fed the same batches). `both`
//!   is for a quick look only: sharing caches and the allocator with candle's slower steps slows the fused step
//!   down (docs/benchmarks.md, section "One training step vs PyTorch", for by how much), so
//!   `scripts/bench-step.sh` runs `fused` and `candle` in processes of their own.
//!
//! Threads: candle's (`RAYON_NUM_THREADS`, set by the caller). Reported per variant: medians over `--steps` timed
//! steps (after `--warmup`) of forward, backward, optimizer and the whole step in ms, and the minor + major page
//! faults per step (`getrusage`). `--json` prints one object per line per variant with the keys of
//! `scripts/torch_ref/step.py` (`impl`, `model`, `batch`, `threads`, `forward_ms`, `backward_ms`, `optimizer_ms`,
//! `step_ms`, `faults_per_step`).

use std::time::Instant;

use accel::tensor_parallel::TensorParallel;
use accel_examples::gpt::{CharGpt, GptConfig};
use accel_examples::{seed_parameters, Mlp};
use accel_nn::optim::{grads_for, AdamW, AdamWConfig, Optimizer};
use anyhow::Context;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::{Parser, ValueEnum};
use ddp_core::ProcessGroup;

/// Global allocator, as every binary of the workspace (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The shipped Shakespeare text's character vocabulary size (what `train_gpt` / `accel_gpt` train on).
const GPT_VOCAB: usize = 76;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    Mlp,
    Gpt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Ops {
    /// candle's composed ops (the fused ops switched off).
    Candle,
    /// accel_nn::ops's fused ops.
    Fused,
    /// Both, interleaved step by step.
    Both,
}

/// Single-process training-step time: forward, backward, optimizer.
#[derive(Parser, Debug)]
struct Cli {
    /// Which model.
    #[arg(long, value_enum, default_value = "mlp")]
    model: ModelKind,
    /// Which ops.
    #[arg(long, value_enum, default_value = "both")]
    ops: Ops,
    /// Batch size: rows for the MLP (default 128), sequences of 64 tokens for the GPT (default 16).
    #[arg(long)]
    batch: Option<usize>,
    /// Hidden widths of the MLP.
    #[arg(long, value_delimiter = ',', default_value = "512,512")]
    hidden: Vec<usize>,
    /// Timed steps per variant.
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Untimed steps per variant first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// One JSON object per line per variant instead of the table.
    #[arg(long)]
    json: bool,
    /// Seed of the weights and the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

enum Model {
    Mlp(Mlp),
    Gpt(Box<CharGpt>),
}

impl Model {
    /// Forward and loss: a scalar.
    fn loss(&self, x: &Tensor, y: &Tensor) -> anyhow::Result<Tensor> {
        Ok(match self {
            Model::Mlp(m) => accel_nn::ops::cross_entropy::cross_entropy(&m.forward(x)?, y)?,
            Model::Gpt(m) => m.loss(x, y)?,
        })
    }
}

/// One variant: its switch position, model, parameters, optimizer and per-step timings.
struct Variant {
    fused: bool,
    model: Model,
    vars: Vec<Var>,
    opt: AdamW,
    forward: Vec<f64>,
    backward: Vec<f64>,
    optimizer: Vec<f64>,
    step: Vec<f64>,
    faults: u64,
}

fn page_faults() -> u64 {
    // SAFETY: getrusage only writes the struct we hand it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    (ru.ru_minflt + ru.ru_majflt) as u64
}

fn sorted_vars(varmap: &VarMap) -> Vec<Var> {
    let data = varmap.data().lock().expect("VarMap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    names.into_iter().map(|n| data[n].clone()).collect()
}

impl Variant {
    fn new(cli: &Cli, fused: bool) -> anyhow::Result<Self> {
        let varmap = VarMap::new();
        let model = match cli.model {
            ModelKind::Mlp => {
                let m = Mlp::with_hidden(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cli.hidden)?;
                seed_parameters(&varmap, cli.seed)?;
                Model::Mlp(m)
            }
            ModelKind::Gpt => {
                let tp = TensorParallel::new(ProcessGroup::single_process()?);
                let cfg = GptConfig::small(GPT_VOCAB);
                let vb =
                    accel::nn::VarBuilder::new(&varmap, &tp, cli.seed, DType::F32, &Device::Cpu, CharGpt::plan(&cfg));
                Model::Gpt(Box::new(CharGpt::new(cfg, &vb)?))
            }
        };
        let opt = AdamW::new(AdamWConfig::new(1e-3))?;
        Ok(Variant {
            fused,
            model,
            vars: sorted_vars(&varmap),
            opt,
            forward: vec![],
            backward: vec![],
            optimizer: vec![],
            step: vec![],
            faults: 0,
        })
    }

    fn run_step(&mut self, x: &Tensor, y: &Tensor, record: bool) -> anyhow::Result<f32> {
        accel_nn::ops::set_fused_ops(self.fused);
        let faults0 = page_faults();
        let t0 = Instant::now();
        let loss = self.model.loss(x, y)?;
        let t1 = Instant::now();
        let grads = loss.backward()?;
        let t2 = Instant::now();
        // The parameters' gradients only: the GradStore (every intermediate gradient) is freed before the step.
        let slots = grads_for(&self.vars, &grads);
        drop(grads);
        self.opt.step(&self.vars, &slots)?;
        drop(slots);
        let t3 = Instant::now();
        let faults1 = page_faults();
        if record {
            let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            self.forward.push(ms(t0, t1));
            self.backward.push(ms(t1, t2));
            self.optimizer.push(ms(t2, t3));
            self.step.push(ms(t0, t3));
            self.faults += faults1 - faults0;
        }
        Ok(loss.to_scalar::<f32>()?)
    }

    /// The variant's name in the report; a CANDLE_NUM_THREADS set by the caller is part of it (candle's own
    /// elementwise pool, next to rayon's: docs/benchmarks.md, "One training step vs PyTorch").
    fn name(&self) -> String {
        let base = if self.fused { "accel-rs fused" } else { "accel-rs candle-ops" };
        match std::env::var("CANDLE_NUM_THREADS") {
            Ok(n) => format!("{base} (CANDLE_NUM_THREADS={n})"),
            Err(_) => base.to_string(),
        }
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Deterministic batches (a small LCG: the data only has to be the same for both variants and every run).
struct Data {
    state: u64,
}

impl Data {
    fn next_u32(&mut self) -> u32 {
        self.state = self.state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.state >> 33) as u32
    }

    fn batch(&mut self, model: ModelKind, batch: usize) -> anyhow::Result<(Tensor, Tensor)> {
        let dev = Device::Cpu;
        Ok(match model {
            ModelKind::Mlp => {
                let px: Vec<f32> = (0..batch * 784).map(|_| (self.next_u32() % 256) as f32 / 255.0).collect();
                let labels: Vec<u32> = (0..batch).map(|_| self.next_u32() % 10).collect();
                (Tensor::from_vec(px, (batch, 784), &dev)?, Tensor::from_vec(labels, batch, &dev)?)
            }
            ModelKind::Gpt => {
                let s = GptConfig::small(GPT_VOCAB).block_size;
                let mut ids = || -> Vec<u32> { (0..batch * s).map(|_| self.next_u32() % GPT_VOCAB as u32).collect() };
                let (x, y) = (ids(), ids());
                (Tensor::from_vec(x, (batch, s), &dev)?, Tensor::from_vec(y, (batch, s), &dev)?)
            }
        })
    }
}

fn main() -> anyhow::Result<()> {
    accel_examples::keep_freed_memory();
    let cli = Cli::parse();
    let batch = cli.batch.unwrap_or(match cli.model {
        ModelKind::Mlp => 128,
        ModelKind::Gpt => 16,
    });
    anyhow::ensure!(batch > 0, "--batch must be at least 1");
    anyhow::ensure!(cli.steps > 0, "--steps must be at least 1");
    let fused: &[bool] = match cli.ops {
        Ops::Candle => &[false],
        Ops::Fused => &[true],
        Ops::Both => &[false, true],
    };
    let mut variants = fused.iter().map(|&f| Variant::new(&cli, f)).collect::<anyhow::Result<Vec<_>>>()?;
    let mut data = Data { state: cli.seed ^ 0x5eed };
    let mut last_losses = vec![0f32; variants.len()];
    for i in 0..cli.warmup + cli.steps {
        let (x, y) = data.batch(cli.model, batch)?;
        for (v, last) in variants.iter_mut().zip(&mut last_losses) {
            *last = v.run_step(&x, &y, i >= cli.warmup).with_context(|| format!("step {i} of {}", v.name()))?;
        }
    }
    let threads = candle_core::utils::get_num_threads();
    let model = match cli.model {
        ModelKind::Mlp => "mlp",
        ModelKind::Gpt => "gpt",
    };
    for (v, loss) in variants.iter().zip(&last_losses) {
        let (f, b, o, s) = (median(&v.forward), median(&v.backward), median(&v.optimizer), median(&v.step));
        let faults = v.faults as f64 / cli.steps as f64;
        if cli.json {
            println!(
                "{{\"impl\": \"{}\", \"model\": \"{model}\", \"batch\": {batch}, \"threads\": {threads}, \
                 \"forward_ms\": {f:.4}, \"backward_ms\": {b:.4}, \"optimizer_ms\": {o:.4}, \"step_ms\": {s:.4}, \
                 \"faults_per_step\": {faults:.1}}}",
                v.name()
            );
        } else {
            println!(
                "{:<20} {model} batch {batch} threads {threads}: forward {f:.3} ms, backward {b:.3} ms, optimizer \
                 {o:.3} ms, step {s:.3} ms, {faults:.1} page faults/step (last loss {loss:.4})",
                v.name()
            );
        }
    }
    if !cli.json && variants.len() == 2 {
        let ratio = |f: fn(&Variant) -> &Vec<f64>| median(f(&variants[0])) / median(f(&variants[1]));
        println!(
            "candle-ops / fused: forward {:.2}x, backward {:.2}x, optimizer {:.2}x, step {:.2}x ({} steps, medians)",
            ratio(|v| &v.forward),
            ratio(|v| &v.backward),
            ratio(|v| &v.optimizer),
            ratio(|v| &v.step),
            cli.steps
        );
    }
    Ok(())
}
