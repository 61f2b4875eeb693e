//! What a checkpoint costs the training loop, written in place (`save_state`) or in the background
//! (`AcceleratorConfig::async_checkpointing`): one process trains a stack of linear layers with AdamW and saves
//! every `--save-every` steps; it reports the time `save_state` blocks the loop, the step right after a save (which
//! shares the cores with the writer thread in the background case), the other steps, and the whole run.
//!
//! ```text
//! cargo run -p accel-benches --bin checkpoint_save -- --mode sync
//! scripts/bench-checkpoint.sh   # sync, async and none, interleaved, 3 runs each
//! ```
//!
//! The model: `--layers` linear layers of `--width` × `--width` (default 6 × 2048²: 25.2 M parameters, 101 MB
//! of fp32 weights, 302 MB of checkpoint with AdamW's moments), a batch of `--batch` random rows, the mean square
//! of the output as the loss. Checkpoints go to `--dir` (automatic naming, `total_limit` 1: one on disk at a time).
//! One line per run: `mode, save_blocks_ms (mean), step_after_save_ms (mean), other_step_ms (median), total_s`.

use std::path::PathBuf;
use std::time::Instant;

use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig};
use candle_core::{Module, Tensor};
use candle_nn::VarMap;
use clap::{Parser, ValueEnum};

/// Global allocator, as every binary of the workspace (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// `save_state` writes before it returns.
    Sync,
    /// `save_state` copies, a writer thread writes.
    Async,
    /// No checkpoint (the baseline).
    None,
}

#[derive(Parser, Debug)]
#[command(name = "checkpoint_save")]
struct Args {
    #[arg(long, value_enum)]
    mode: Mode,
    #[arg(long, default_value_t = 6)]
    layers: usize,
    #[arg(long, default_value_t = 2048)]
    width: usize,
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    #[arg(long, default_value_t = 10)]
    save_every: usize,
    /// Where the checkpoints go (`checkpoints/checkpoint_{i}` under it, the newest kept).
    #[arg(long, default_value = "/tmp/accel-checkpoint-bench")]
    dir: PathBuf,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN; // no save: printed as NaN, not as a time
    }
    v.iter().sum::<f64>() / v.len() as f64
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _ = std::fs::remove_dir_all(&args.dir);
    let cfg = AcceleratorConfig {
        seed: Some(0),
        async_checkpointing: args.mode == Mode::Async,
        total_limit: Some(1),
        ..AcceleratorConfig::default()
    }
    .with_project_dir(&args.dir);
    let acc = Accelerator::new(cfg)?;
    let varmap = VarMap::new();
    let vb = acc.var_builder(&varmap);
    let layers = (0..args.layers)
        .map(|i| candle_nn::linear_no_bias(args.width, args.width, vb.pp(format!("layer{i}"))))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let prepared = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(1e-4))?)?;
    let x = Tensor::rand(0f32, 1.0, (args.batch, args.width), acc.device())?;

    let (mut blocked, mut after_save, mut others) = (Vec::new(), Vec::new(), Vec::new());
    let mut saved_last = false;
    let start = Instant::now();
    for step in 1..=args.steps {
        let t = Instant::now();
        let y = layers.iter().try_fold(x.clone(), |h, l| l.forward(&h)?.tanh())?;
        acc.backward(&y.sqr()?.mean_all()?)?;
        opt.step()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if saved_last {
            after_save.push(ms)
        } else {
            others.push(ms)
        }
        saved_last = false;
        if args.mode != Mode::None && step % args.save_every == 0 {
            let t = Instant::now();
            acc.save_state(None)?;
            blocked.push(t.elapsed().as_secs_f64() * 1e3);
            saved_last = true;
        }
    }
    acc.wait_for_checkpoint()?;
    let total = start.elapsed().as_secs_f64();
    let params: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    println!(
        "{:?}: {} parameters, {} saves; save_blocks_ms {:.1}, step_after_save_ms {:.1}, other_step_ms {:.1}, total_s {:.2}",
        args.mode,
        params,
        blocked.len(),
        mean(&blocked),
        mean(&after_save),
        median(&mut others),
        total
    );
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}
