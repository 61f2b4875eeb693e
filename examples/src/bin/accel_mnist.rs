//! Level 2: the MNIST MLP trained with the Accelerator (compare `ddp_mnist.rs`, the same job on raw ddp-core).
//!
//! ```text
//! cargo run -p accel-examples --bin accel_mnist -- --nproc 2 --min-accuracy 0.95
//! cargo run -p accel-examples --bin accel_mnist -- --nproc 2 --mixed-precision bf16 --gradient-accumulation-steps 2
//! accel launch -n 2 target/debug/accel_mnist          # the same program under the launcher
//! ```
//!
//! Without RANK in the environment and with `--nproc N > 1` the program launches N copies of itself (ddp-core's
//! launcher) and waits for them; with RANK set (or `--nproc 1`) it is a worker. Mixed precision and gradient
//! accumulation come from the flags, else from `accel launch` (ACCELERATE_* variables): no model code changes.
//!
//! Compared with a plain single-process candle loop, the lines that change are marked `// accel:`.
//!
//! Guide markers: `// guide:begin NAME` … `// guide:end NAME` mark the regions `args`, `job`, `data`, `model`,
//! `loop` and `eval`, which docs/guide/00-levels.md compares with the same regions of `ddp_mnist.rs` and `train_mnist.rs`.
//! The test `guide_diffs` (examples/tests/suite) fails when the chapter's diffs no longer match them; after
//! changing a marked region, `ACCEL_BLESS_GUIDE=1 cargo test -p accel-examples --test suite guide_diffs`
//! rewrites the diffs (then check the chapter's text under each).

use accel::data::load_mnist;
use accel::{segments, Dataset, ReduceKind, TensorDataset};
use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, DataLoader, DataLoaderConfig, MixedPrecision};
use accel_examples::{default_data_dir, seed_parameters, Mlp};
use anyhow::bail;
use candle_core::{DType, Module, Tensor};
use candle_nn::VarMap;
use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// guide:begin args
/// MNIST MLP at level 2: a candle loop with the Accelerator (mixed precision, gradient accumulation).
#[derive(Parser, Debug)]
struct Cli {
    /// Processes to launch when not started by a launcher (ignored inside a worker); 1 trains in this process.
    #[arg(long, default_value_t = 2, value_parser = accel_examples::parse_nproc)]
    nproc: usize,
    /// Passes over the training set.
    #[arg(long, default_value_t = 8)]
    epochs: u64,
    /// Micro-batch size per process (per optimizer step: this × processes × gradient accumulation steps).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the parameter initialisation, of the shuffle and of the Accelerator's RNG, the same on every process.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hidden layer widths, comma-separated (784-…-10).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    hidden: Vec<usize>,
    /// Directory with {train10k,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (default: the repository's data/mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// no | fp16 | bf16 (default: ACCELERATE_MIXED_PRECISION, else no).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// Micro-batches per optimizer step (default: ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 1).
    #[arg(long)]
    gradient_accumulation_steps: Option<usize>,
    /// Exit with an error when the final test accuracy is below this (e.g. 0.95 in CI).
    #[arg(long)]
    min_accuracy: Option<f64>,
}
// guide:end args

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn run() -> anyhow::Result<()> {
    let cli = accel_examples::parse_args!(Cli); // a bad command line is reported once under a launcher
    if ddp_core::launcher::launch_self(cli.nproc)? {
        return Ok(());
    }
    train(&cli)
}

fn train(cli: &Cli) -> anyhow::Result<()> {
    // guide:begin job
    let mut cfg = AcceleratorConfig::from_env()?;
    if let Some(mp) = cli.mixed_precision {
        cfg.mixed_precision = mp;
    }
    if let Some(ga) = cli.gradient_accumulation_steps {
        cfg.gradient_accumulation_steps = ga;
    }
    cfg.seed = Some(cli.seed); // accel: set_seed for every process
    let acc = Accelerator::new(cfg)?; // accel: process group, device, precision, accumulation

    // guide:end job
    // guide:begin data
    let data_dir = cli.data_dir.clone().unwrap_or_else(default_data_dir);
    let train_set = load_mnist(&data_dir, "train10k")?;
    let test_set = load_mnist(&data_dir, "t10k")?;
    let n_test = test_set.len();
    let train_cfg =
        DataLoaderConfig { batch_size: cli.batch_size, shuffle: true, seed: cli.seed, ..Default::default() };
    let train_loader = DataLoader::new(train_set, train_cfg);
    let test_loader = DataLoader::new(test_set, DataLoaderConfig::with_batch_size(500));
    // guide:end data

    // guide:begin model
    let varmap = VarMap::new();
    let vb = acc.builder(&varmap, Mlp::plan()); // accel: device, dtype and layout (FULL_SHARD too) from acc
    let model = Mlp::on_builder(vb, &cli.hidden)?;

    // The initial weights ddp_mnist (level 1) draws, so the two levels compare bit for bit.
    seed_parameters(&varmap, cli.seed)?;
    let opt = AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::new(cli.lr) })?;
    let (_prepared, mut opt, train_loader) = acc.prepare(&varmap, opt, train_loader)?; // accel: DDP, shards, masters
    let test_loader = acc.prepare_eval_data_loader(test_loader)?; // accel

    // guide:end model

    acc.print_banner("accel_mnist"); // accel: config, processes, layout, precision, accumulation, backend (once)
    acc.print(format!(
        "accel_mnist: batch {} per process ({} per optimizer step), {} train batches per process per epoch",
        cli.batch_size,
        cli.batch_size * acc.world_size() * acc.gradient_accumulation_steps(),
        train_loader.len()
    ));
    let start = Instant::now();
    let mut accuracy = 0.0;
    // guide:begin loop
    for epoch in 0..cli.epochs {
        let epoch_start = Instant::now();
        let (mut loss_sum, mut batches) = (0f64, 0usize);
        for batch in &train_loader {
            let batch = batch?;
            let x = batch.inputs.to_dtype(acc.compute_dtype())?;
            let (loss, cuts) = segments::record(|| -> candle_core::Result<_> {
                let logits = model.forward(&x)?.to_dtype(DType::F32)?;
                candle_nn::loss::cross_entropy(&logits, &batch.targets)
            })?;
            acc.backward_segments(&loss, cuts)?; // accel: instead of loss.backward(); the all-reduce overlaps it
            opt.step()?; // accel: a no-op between gradient-accumulation syncs
            loss_sum += f64::from(loss.to_scalar::<f32>()?);
            batches += 1;
        }
        let mean_loss = Tensor::new(&[(loss_sum / batches.max(1) as f64) as f32], acc.device())?;
        let mean_loss = acc.reduce(&mean_loss, ReduceKind::Mean)?.to_vec1::<f32>()?[0];
        let (correct, total) = evaluate(&acc, &model, &test_loader)?;
        if total != n_test {
            bail!("evaluation saw {total} test rows, expected {n_test}");
        }
        accuracy = correct as f64 / total as f64;
        acc.print(format!(
            "epoch {epoch}: train loss {mean_loss:.4}, test accuracy {accuracy:.4} ({correct}/{total}), {:.1} s, {} \
             optimizer steps",
            epoch_start.elapsed().as_secs_f64(),
            acc.optimizer_step_count()
        )); // accel: printed once, by the main process
    }
    // guide:end loop
    acc.print(format!("final test accuracy {accuracy:.4} after {:.1} s", start.elapsed().as_secs_f64()));
    if let Some(min) = cli.min_accuracy.filter(|&min| accuracy < min) {
        bail!("test accuracy {accuracy:.4} is below --min-accuracy {min}");
    }
    Ok(())
}

// guide:begin eval
/// Test accuracy over the whole test set: every rank scores its shard of each batch and `gather_for_metrics`
/// returns all ranks' rows without the padding `even_batches` added, so every image counts once.
fn evaluate(acc: &Accelerator, model: &Mlp, test_loader: &DataLoader<TensorDataset>) -> anyhow::Result<(usize, usize)> {
    let (mut correct, mut total) = (0usize, 0usize);
    for batch in test_loader {
        let batch = batch?;
        let logits = model.forward(&batch.inputs.to_dtype(acc.compute_dtype())?)?;
        let predictions = acc.gather_for_metrics(&logits.argmax(1)?)?; // accel: all ranks' rows, padding dropped
        let labels = acc.gather_for_metrics(&batch.targets)?;
        correct += predictions.eq(&labels)?.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize;
        total += labels.dim(0)?;
    }
    Ok((correct, total))
}
// guide:end eval
