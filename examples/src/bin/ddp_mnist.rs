//! Level 1 of accel-rs: an MLP trained on the shipped MNIST subset with raw ddp-core — the process group, the
//! DistributedSampler, DistributedDataParallel and the gradient sync between backward and step, all explicit.
//!
//! One command runs the 2-process job (the program launches its own workers with `ddp_core::launch`):
//!
//! ```text
//! cargo run -p accel-examples --bin ddp_mnist -- --nproc 2
//! ```
//!
//! Started by a launcher (RANK from this launcher, `accel launch` or torchrun-style scripts; SLURM_PROCID from
//! `srun`; OMPI_COMM_WORLD_RANK / PMI_RANK from `mpirun`) it is one worker; without one and with `--nproc 1` it
//! trains in a single process.
//!
//! Guide markers: `// guide:begin NAME` … `// guide:end NAME` mark the regions `args`, `job`, `data`, `model`,
//! `loop` and `eval`, which docs/guide/00-levels.md compares with the same regions of `accel_mnist.rs` and `train_mnist.rs`.
//! The test `guide_diffs` (examples/tests/suite) fails when the chapter's diffs no longer match them; after
//! changing a marked region, `ACCEL_BLESS_GUIDE=1 cargo test -p accel-examples --test suite guide_diffs`
//! rewrites the diffs (then check the chapter's text under each).

use std::path::PathBuf;
use std::time::Instant;

use accel_examples::{correct_count, default_data_dir, load_mnist, seed_parameters, Mlp, Mnist};
use accel_nn::optim::{grads_for, AdamW, AdamWConfig, Optimizer};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use ddp_core::{segments, DdpOptions, DistributedDataParallel, DistributedSampler, ProcessGroup, ReduceOp};

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// guide:begin args
/// MNIST MLP at level 1: your own loop with ddp-core's process group, DistributedSampler and DDP.
#[derive(Parser, Debug)]
struct Cli {
    /// Processes to launch when not started by a launcher (ignored inside a worker); 1 trains in this process.
    #[arg(long, default_value_t = 2, value_parser = accel_examples::parse_nproc)]
    nproc: usize,
    /// Passes over the training set.
    #[arg(long, default_value_t = 10)]
    epochs: u64,
    /// Micro-batch size per process (the global batch is this × the number of processes).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Seed of the parameter initialisation and of the shuffle, the same on every process.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hidden layer widths, comma-separated (784-…-10).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    hidden: Vec<usize>,
    /// Directory with {train10k,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (default: the repository's data/mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
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
                                                // Without a launcher, run `--nproc` copies of this program as the workers (the launcher also gives each its
                                                // share of the cores: RAYON_NUM_THREADS, OMP_NUM_THREADS).
    if ddp_core::launcher::launch_self(cli.nproc)? {
        return Ok(());
    }
    train(&cli)
}

fn train(cli: &Cli) -> Result<()> {
    // guide:begin job
    // A worker of a launched job (RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK or PMI_RANK set) joins its process
    // group; otherwise this process is the whole job.
    let pg = if ddp_core::launcher::is_worker() {
        ProcessGroup::init_from_env().context("joining the process group of the launched job")?
    } else {
        ProcessGroup::single_process()?
    };
    let device = Device::Cpu;
    // guide:end job
    // guide:begin data
    let data_dir = cli.data_dir.clone().unwrap_or_else(default_data_dir);
    let train_set = load_mnist(&data_dir, "train10k", &device)?;
    let test_set = load_mnist(&data_dir, "t10k", &device)?;
    // Each rank reads its own shard of a per-epoch shuffle; every rank uses the same seed.
    let mut sampler = DistributedSampler::for_group(train_set.len(), &pg)?.seed(cli.seed);
    // guide:end data

    // guide:begin model
    // The model: every rank builds it; DDP checks that they agree and copies rank 0's values to all.
    let varmap = VarMap::new();
    let model = Mlp::with_hidden(VarBuilder::from_varmap(&varmap, DType::F32, &device), &cli.hidden)?;
    seed_parameters(&varmap, cli.seed)?;
    let ddp = DistributedDataParallel::new(&pg, &varmap, DdpOptions::default())?;
    // accel-nn's AdamW (torch.optim.AdamW's defaults, saveable state), the one the Accelerator and the Trainer
    // use. Its per-parameter state follows the order of `vars`: DDP's registration order (sorted names), fixed.
    let vars: Vec<Var> = ddp.named_vars().iter().map(|(_, v)| v.clone()).collect();
    let mut opt = AdamW::new(AdamWConfig::new(cli.lr))?;
    // guide:end model

    let (rank, world) = (pg.rank(), pg.world_size());
    if rank == 0 {
        // What the run is, once (level 1 has no config file, mixed precision or accumulation: plain DDP in f32).
        let machines = ddp_core::env::DistEnv::detect_from_env()?.map_or(1, |e| e.world_size / e.local_world_size);
        let banner = ddp_core::launcher::RunBanner {
            config: ddp_core::launcher::RunBanner::config_from_env(),
            processes: world,
            machines,
            layout: ddp_core::launcher::RunBanner::mesh_layout(&ddp_core::MeshShape::new(1, world, 1, 1)?),
            // What `accel launch` announces for a run without them, so that a launched run says it once.
            details: vec!["mixed precision no".into(), "gradient accumulation 1".into()],
            backend: pg.backend_name().into(),
        };
        if let Some(line) = banner.worker_line("ddp_mnist") {
            println!("{line}");
        }
        let hidden: Vec<String> = cli.hidden.iter().map(ToString::to_string).collect();
        println!(
            "MLP 784-{}-10, {} ranks × batch {} (global {}), AdamW lr {}, {} train / {} test images, {} steps per epoch",
            hidden.join("-"),
            world,
            cli.batch_size,
            cli.batch_size * world,
            cli.lr,
            train_set.len(),
            test_set.len(),
            sampler.num_samples().div_ceil(cli.batch_size)
        );
    }
    let start = Instant::now();
    let mut accuracy = 0.0;
    // guide:begin loop
    for epoch in 0..cli.epochs {
        let epoch_start = Instant::now();
        sampler.set_epoch(epoch);
        // [Σ loss·rows, rows] over this rank's batches, summed across ranks below.
        let mut loss_sum = [0f64; 2];
        for batch in sampler.batches(cli.batch_size)? {
            let (x, y) = train_set.batch(&batch)?;
            // Recorded, so the all-reduce can start during the backward pass at the cuts Mlp::forward marks.
            let (loss, cuts) = segments::record(|| candle_nn::loss::cross_entropy(&model.forward(&x)?, &y))?;
            let grads = ddp.backward(&loss, cuts)?; // loss.backward() + bucketed, averaged all_reduce, overlapped
            opt.step(&vars, &grads_for(&vars, &grads))?;
            loss_sum[0] += f64::from(loss.to_scalar::<f32>()?) * batch.len() as f64;
            loss_sum[1] += batch.len() as f64;
        }
        pg.all_reduce(&mut loss_sum, ReduceOp::Sum)?;
        let (correct, total) = evaluate(&model, &test_set, &pg)?;
        accuracy = correct as f64 / total as f64;
        if rank == 0 {
            println!(
                "epoch {}/{}: train loss {:.4}, test accuracy {:.4} ({correct}/{total}), {:.1} s",
                epoch + 1,
                cli.epochs,
                loss_sum[0] / loss_sum[1],
                accuracy,
                epoch_start.elapsed().as_secs_f64()
            );
        }
    }
    // guide:end loop
    if rank == 0 {
        println!(
            "final test accuracy {accuracy:.4} after {} epochs on {world} rank(s) in {:.1} s",
            cli.epochs,
            start.elapsed().as_secs_f64()
        );
    }
    if let Some(min) = cli.min_accuracy {
        if accuracy < min {
            bail!("final test accuracy {accuracy:.4} is below --min-accuracy {min}");
        }
    }
    Ok(())
}

// guide:begin eval
/// Test accuracy over the whole test set: each rank scores its shard, counts are summed across ranks.
/// Padding of the sampler (when the set does not split evenly) is skipped so every image counts once.
fn evaluate(model: &Mlp, test_set: &Mnist, pg: &ProcessGroup) -> Result<(u64, u64)> {
    let sampler = DistributedSampler::for_group(test_set.len(), pg)?.shuffle(false);
    let (rank, world) = (pg.rank(), pg.world_size());
    // Rank r's j-th index sits at position j·world + r of the padded order; positions ≥ len are padding.
    let shard: Vec<usize> = sampler
        .indices()
        .into_iter()
        .enumerate()
        .filter(|(j, _)| j * world + rank < test_set.len())
        .map(|(_, i)| i)
        .collect();
    let mut counts = [0u64; 2];
    for batch in shard.chunks(1000) {
        let (x, y) = test_set.batch(batch)?;
        counts[0] += correct_count(&model.forward(&x)?, &y)? as u64;
        counts[1] += batch.len() as u64;
    }
    let mut reduced = [counts[0] as i64, counts[1] as i64];
    pg.all_reduce(&mut reduced, ReduceOp::Sum)?;
    Ok((reduced[0] as u64, reduced[1] as u64))
}
// guide:end eval
