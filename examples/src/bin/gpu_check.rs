//! GPU check (feature `cuda`): what a GPU machine with no Rust toolchain runs to validate the CUDA build.
//! Built on the dev machine by `scripts/check-cuda-build.sh --build-gpu-check`, run by `scripts/gpu-check.sh`.
//!
//! 1. NCCL on a world-size-1 communicator: known values through the host path (`ProcessGroup::all_reduce`),
//!    the device-slice path (`NcclBackend::all_reduce_slice`), candle CUDA tensors in place
//!    (`ddp_core::nccl::tensor`) and through `ProcessGroup::*_tensor`, then the whole collective conformance
//!    suite (`crates/ddp-core/tests/conformance`, world size 1: NCCL refuses two ranks on one GPU).
//! 2. The MNIST MLP (784-256-10, AdamW 1e-3, batch 64, fixed batch order, seed 42) trained through
//!    DistributedDataParallel on the CPU in f32, then on CUDA in f32 and bf16 over the NCCL group: per-epoch
//!    mean losses are compared with the CPU run (f32: ≤ 2 % relative, bf16: ≤ 15 %) and test accuracy checked.
//!
//! Prints a table and exits non-zero when a check fails.

#[path = "../../../crates/ddp-core/tests/conformance/mod.rs"]
mod conformance;

use accel_examples::{correct_count, default_data_dir, load_mnist, seed_parameters, Mlp};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use clap::Parser;
use ddp_core::{BackendKind, DdpOptions, DistributedDataParallel, InitOptions, ProcessGroup, ReduceOp};
use std::path::PathBuf;
use std::time::Instant;

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(about = "Checks NCCL collectives and CUDA training (f32, bf16) against the CPU on this GPU machine")]
struct Args {
    /// Folder with train10k-* and t10k-* MNIST files.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Training epochs per run.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Micro-batch size.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Only the NCCL checks.
    #[arg(long)]
    skip_training: bool,
}

/// One row of the result table.
struct Row {
    check: String,
    pass: Option<bool>,
    detail: String,
}

fn row(check: impl Into<String>, pass: Option<bool>, detail: impl Into<String>) -> Row {
    Row { check: check.into(), pass, detail: detail.into() }
}

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn run() -> anyhow::Result<()> {
    let args = accel_examples::parse_args!(Args); // a bad command line is reported once under a launcher
    let mut rows = Vec::new();

    match ddp_core::nccl::probe() {
        Ok(found) => rows.push(row(
            "CUDA driver + NCCL found",
            Some(true),
            format!("{} GPU(s), NCCL {}", found.device_count, found.nccl_version),
        )),
        Err(e) => {
            rows.push(row("CUDA driver + NCCL found", Some(false), e.to_string()));
            return finish(rows);
        }
    }

    let mut opts = InitOptions::single_process();
    opts.backend = BackendKind::Nccl;
    let pg = match ProcessGroup::init(opts) {
        Ok(pg) => pg,
        Err(e) => {
            rows.push(row("NCCL world-size-1 communicator", Some(false), e.to_string()));
            return finish(rows);
        }
    };
    rows.push(row("NCCL world-size-1 communicator", Some(pg.backend_name() == "nccl"), pg.backend_name()));
    rows.extend(nccl_known_values(&pg));

    let start = Instant::now();
    let suite = conformance::run(&pg, &conformance::SuiteOptions::default());
    let detail = format!("{} in {:.1} s", suite.summary(), start.elapsed().as_secs_f64());
    for f in suite.failed.iter().take(5) {
        eprintln!("conformance failure: {f}");
    }
    rows.push(row("conformance suite on NCCL (world 1)", Some(suite.failed.is_empty()), detail));

    if !args.skip_training {
        rows.extend(training(&args, &pg)?);
    }
    finish(rows)
}

/// Known values through every NCCL path; with one rank Sum/Avg/Max are the identity and broadcast keeps data.
fn nccl_known_values(pg: &ProcessGroup) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut check = |name: &str, r: Result<bool>| match r {
        Ok(ok) => rows.push(row(name, Some(ok), if ok { "values as expected" } else { "wrong values" })),
        Err(e) => rows.push(row(name, Some(false), format!("{e:#}"))),
    };
    check(
        "all_reduce host f32 Sum/Avg/Max",
        (|| {
            let mut ok = true;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let mut v = vec![1.5f32, -2.0, 3.25, 1e6];
                pg.all_reduce(&mut v, op)?;
                ok &= v == [1.5, -2.0, 3.25, 1e6];
            }
            let mut i = vec![7i64, -3, 9];
            pg.all_reduce(&mut i, ReduceOp::Avg)?;
            Ok(ok && i == [7, -3, 9])
        })(),
    );
    check(
        "all_reduce host bf16/f16 Sum",
        (|| {
            let mut b: Vec<half::bf16> = [1.0f32, 2.5, -4.0].iter().map(|&x| half::bf16::from_f32(x)).collect();
            let want = b.clone();
            pg.all_reduce(&mut b, ReduceOp::Sum)?;
            let mut h: Vec<half::f16> = [0.5f32, 8.0].iter().map(|&x| half::f16::from_f32(x)).collect();
            let want_h = h.clone();
            pg.all_reduce(&mut h, ReduceOp::Sum)?;
            Ok(b == want && h == want_h)
        })(),
    );
    check(
        "all_reduce device slice (cudarc)",
        (|| {
            let nccl = pg.nccl().context("not an NCCL group")?;
            let stream = nccl.stream();
            let host = [1.0f32, 2.0, 3.0, 4.0];
            let mut buf = stream.clone_htod(&host[..])?;
            nccl.all_reduce_slice(&mut buf, ReduceOp::Sum)?;
            nccl.broadcast_slice(&mut buf, 0)?;
            Ok(stream.clone_dtoh(&buf)? == [1.0, 2.0, 3.0, 4.0])
        })(),
    );
    check(
        "candle CUDA tensor in place + ProcessGroup::*_tensor",
        (|| {
            let nccl = pg.nccl().context("not an NCCL group")?;
            let dev = Device::new_cuda(nccl.device_ordinal())?;
            let t = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev)?;
            ddp_core::nccl::tensor::all_reduce_(nccl, &t, ReduceOp::Avg)?;
            let a = pg.all_reduce_tensor(&t.to_dtype(DType::BF16)?, ReduceOp::Sum)?.to_dtype(DType::F32)?;
            let g = pg.all_gather_tensor(&t)?;
            let s = pg.reduce_scatter_tensor(&t, ReduceOp::Max)?;
            let want = vec![vec![1.0f32, 2.0], vec![3.0, 4.0]];
            Ok(t.to_vec2::<f32>()? == want
                && a.to_vec2::<f32>()? == want
                && g.to_vec2::<f32>()? == want
                && s.to_vec2::<f32>()? == want
                && a.device().is_cuda())
        })(),
    );
    check("barrier", pg.barrier().map(|_| true).map_err(Into::into));
    rows
}

/// Per-epoch mean training loss, test accuracy and wall time of one run.
struct RunStats {
    losses: Vec<f64>,
    accuracy: f64,
    seconds: f64,
    steps: usize,
}

fn train(args: &Args, pg: &ProcessGroup, device: &Device, dtype: DType) -> Result<RunStats> {
    let dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let train = load_mnist(&dir, "train10k", device)?;
    let test = load_mnist(&dir, "t10k", device)?;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, dtype, device))?;
    seed_parameters(&varmap, 42)?;
    let ddp = DistributedDataParallel::new(pg, &varmap, DdpOptions::default())?;
    let mut opt = candle_nn::AdamW::new_lr(varmap.all_vars(), 1e-3)?;
    let order: Vec<usize> = (0..train.len()).collect();
    let start = Instant::now();
    let (mut losses, mut steps) = (Vec::new(), 0);
    for _ in 0..args.epochs {
        let (mut sum, mut n) = (0.0f64, 0usize);
        for idx in order.chunks(args.batch) {
            let (x, y) = train.batch(idx)?;
            let logits = model.forward(&x.to_dtype(dtype)?)?.to_dtype(DType::F32)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            let mut grads = loss.backward()?;
            ddp.sync_gradients(&mut grads)?;
            opt.step(&grads)?;
            sum += loss.to_scalar::<f32>()? as f64;
            n += 1;
            steps += 1;
        }
        losses.push(sum / n as f64);
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut correct = 0;
    let all: Vec<usize> = (0..test.len()).collect();
    for idx in all.chunks(1000) {
        let (x, y) = test.batch(idx)?;
        correct += correct_count(&model.forward(&x.to_dtype(dtype)?)?.to_dtype(DType::F32)?, &y)?;
    }
    Ok(RunStats { losses, accuracy: correct as f64 / test.len() as f64, seconds, steps })
}

fn training(args: &Args, gpu_pg: &ProcessGroup) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let cpu_pg = ProcessGroup::single_process()?;
    let cpu = train(args, &cpu_pg, &Device::Cpu, DType::F32)?;
    let fmt = |s: &RunStats| {
        let losses: Vec<String> = s.losses.iter().map(|l| format!("{l:.4}")).collect();
        format!(
            "losses [{}], test acc {:.4}, {:.1} s ({:.0} steps/s)",
            losses.join(", "),
            s.accuracy,
            s.seconds,
            s.steps as f64 / s.seconds
        )
    };
    rows.push(row("MNIST MLP CPU f32 (reference)", Some(cpu.accuracy >= 0.9), fmt(&cpu)));
    let gpu = Device::new_cuda(gpu_pg.nccl().map(|n| n.device_ordinal()).unwrap_or(0))?;
    for (name, dtype, tol, min_acc) in
        [("MNIST MLP CUDA f32", DType::F32, 0.02, 0.9), ("MNIST MLP CUDA bf16", DType::BF16, 0.15, 0.9)]
    {
        match train(args, gpu_pg, &gpu, dtype) {
            Ok(run) => {
                let worst = run
                    .losses
                    .iter()
                    .zip(&cpu.losses)
                    .map(|(g, c)| (g - c).abs() / c.abs().max(1e-6))
                    .fold(0.0f64, f64::max);
                let ok = worst <= tol && run.accuracy >= min_acc;
                let speedup = cpu.seconds / run.seconds;
                rows.push(row(
                    name,
                    Some(ok),
                    format!("{}; max rel. loss diff vs CPU {worst:.2e} (tol {tol}); {speedup:.1}x CPU", fmt(&run)),
                ));
            }
            Err(e) => rows.push(row(name, Some(false), format!("{e:#}"))),
        }
    }
    Ok(rows)
}

fn finish(rows: Vec<Row>) -> Result<()> {
    let width = rows.iter().map(|r| r.check.len()).max().unwrap_or(10);
    println!("\n{:width$}  {:6}  detail", "check", "result");
    println!("{:-<width$}  ------  {:-<40}", "", "");
    for r in &rows {
        let verdict = match r.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "-",
        };
        println!("{:width$}  {verdict:6}  {}", r.check, r.detail);
    }
    let failed = rows.iter().filter(|r| r.pass == Some(false)).count();
    let passed = rows.iter().filter(|r| r.pass == Some(true)).count();
    println!("\ngpu_check: {passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
