//! `accel test`: a distributed self-check of this machine and this build.
//!
//! The `accel` binary launches itself on N processes (hidden subcommand `self-test-worker`, through
//! [`ddp_core::launch`], so the launcher, the rendezvous store and the CPU backend are all exercised). Every rank
//! runs the same checks against values known in closed form:
//!
//! - collectives: all_reduce sum / avg / max, broadcast from the last rank, all_gather, all_reduce of a bf16 tensor;
//! - training equivalence: a linear regression trained on P processes with micro-batch b must end with the same
//!   parameters as 1 process trained on the same data with batch P·b (gradient averaging of equal-size shards
//!   equals the full-batch gradient), in fp32 (relative error ≤ 1e-5) and with bf16 compute (≤ 2e-2, bf16's
//!   8-bit mantissa after a few steps) — once with ddp-core's DDP directly (level 1), once through the
//!   Accelerator with fp32 master weights (level 2).
//!
//! A check passes only when it passes on every rank (the verdicts are all-reduced). Rank 0 writes the results as
//! JSON to the file named by [`REPORT_ENV`]; the parent prints the table and exits non-zero on any failure.

use crate::error::{CliError, CliResult};
use accel::{Accelerator, AcceleratorConfig, MixedPrecision, Sgd, SgdConfig};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use ddp_core::{DdpOptions, DistributedDataParallel, LaunchConfig, ProcessGroup, ReduceOp};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::io::Write;
use std::path::Path;

/// Environment variable: where rank 0 of the self-test writes its JSON report.
pub const REPORT_ENV: &str = "ACCEL_SELF_TEST_REPORT";
/// Environment variable (for testing the self-test): this rank feeds a wrong value into the all_reduce sum check,
/// which must then FAIL on every rank.
pub const FAULT_RANK_ENV: &str = "ACCEL_SELF_TEST_FAULT_RANK";

/// Relative tolerance of the fp32 training equivalence.
pub const FP32_TOLERANCE: f64 = 1e-5;
/// Relative tolerance of the bf16 training equivalence.
pub const BF16_TOLERANCE: f64 = 2e-2;

/// The verdict of one check.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CheckResult {
    /// What was checked, e.g. `all_reduce sum (f32)`.
    pub name: String,
    /// Passed on every rank.
    pub passed: bool,
    /// Expected vs. got, or the error.
    pub detail: String,
}

/// What rank 0 writes for the parent.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SelfTestReport {
    /// Processes in the run.
    pub world_size: usize,
    /// Collective backend used (`cpu`, `nccl`, ...).
    pub backend: String,
    /// The checks, in order.
    pub checks: Vec<CheckResult>,
}

/// Runs the self-test on `num_processes` local processes by re-executing `worker_program` with `worker_args`
/// (the `accel` binary passes itself and `["self-test-worker"]`), prints the table to `out`, and fails with
/// [`CliError::SelfTestFailed`] when any check fails (or with the launcher's error when a worker crashed).
pub fn run(num_processes: usize, worker_program: &Path, worker_args: &[String], out: &mut dyn Write) -> CliResult<()> {
    let dir = tempfile::tempdir().map_err(|e| CliError::io("cannot create a temporary directory for accel test", e))?;
    let report_path = dir.path().join("report.json");
    let mut cfg = LaunchConfig::local(num_processes, worker_program, worker_args.to_vec());
    cfg.env.push((REPORT_ENV.to_string(), report_path.display().to_string()));
    cfg.env.push(("OMP_NUM_THREADS".to_string(), "1".to_string()));
    let say = |out: &mut dyn Write, s: String| {
        out.write_all(s.as_bytes()).map_err(|e| CliError::io("cannot write to stdout", e))
    };
    say(out, format!("accel test: running the self-check on {num_processes} process(es)...\n"))?;
    let launched = ddp_core::launch(&cfg);
    let report = std::fs::read(&report_path).ok().and_then(|b| serde_json::from_slice::<SelfTestReport>(&b).ok());
    if let Some(report) = &report {
        say(out, render_table(report))?;
    }
    launched?;
    let report = report.ok_or_else(|| {
        CliError::io(
            format!("rank 0 of accel test wrote no report to {}", report_path.display()),
            std::io::Error::from(std::io::ErrorKind::NotFound),
        )
    })?;
    let failed = report.checks.iter().filter(|c| !c.passed).count();
    if failed > 0 {
        return Err(CliError::SelfTestFailed { failed, total: report.checks.len() });
    }
    say(out, format!("accel test: all {} checks PASSED\n", report.checks.len()))?;
    Ok(())
}

/// The PASS/FAIL table.
pub fn render_table(report: &SelfTestReport) -> String {
    let width = report.checks.iter().map(|c| c.name.len()).max().unwrap_or(5).max(5);
    let mut s = format!("\n{} process(es), backend {}\n", report.world_size, report.backend);
    s += &format!("{:<width$}  {:<6}  {}\n", "CHECK", "RESULT", "DETAIL");
    for c in &report.checks {
        s += &format!("{:<width$}  {:<6}  {}\n", c.name, if c.passed { "PASS" } else { "FAIL" }, c.detail);
    }
    s.push('\n');
    s
}

/// One rank of the self-test (the hidden `self-test-worker` subcommand): joins the job from the environment, runs
/// every check, agrees on the verdicts with the other ranks, and (rank 0) writes the report.
pub fn run_worker() -> CliResult<()> {
    let pg = ProcessGroup::init_from_env()?;
    let mut checks = Vec::new();
    let outcome = run_checks(&pg, &mut checks);
    // Agree: a check passes only if it passed everywhere (MIN over 0/1 flags).
    let agreed = if outcome.is_ok() {
        let mut flags: Vec<u8> = checks.iter().map(|c| c.passed as u8).collect();
        pg.all_reduce(&mut flags, ReduceOp::Min)?;
        for (c, f) in checks.iter_mut().zip(flags) {
            if c.passed && f == 0 {
                c.passed = false;
                c.detail = format!("failed on another rank ({})", c.detail);
            }
        }
        Ok(())
    } else {
        outcome
    };
    if let Err(e) = &agreed {
        checks.push(CheckResult { name: "(aborted)".into(), passed: false, detail: e.to_string() });
    }
    if pg.rank() == 0 {
        if let Ok(path) = std::env::var(REPORT_ENV) {
            let report = SelfTestReport { world_size: pg.world_size(), backend: pg.backend_name().to_string(), checks };
            let bytes = serde_json::to_vec_pretty(&report).expect("a report is plain data");
            crate::config_file::write_atomically(Path::new(&path), &bytes)?;
        }
    }
    agreed
}

fn run_checks(pg: &ProcessGroup, checks: &mut Vec<CheckResult>) -> CliResult<()> {
    let p = pg.world_size();
    let r = pg.rank();
    let pf = p as f32;
    let s = pf * (pf + 1.0) / 2.0; // 1 + 2 + ... + P

    let mut v = vec![(r + 1) as f32, -((r + 1) as f32), 0.5];
    if std::env::var(FAULT_RANK_ENV).ok().and_then(|s| s.parse::<usize>().ok()) == Some(r) {
        v[0] += 1.0;
    }
    pg.all_reduce(&mut v, ReduceOp::Sum)?;
    checks.push(compare("all_reduce sum (f32)", &v, &[s, -s, 0.5 * pf]));

    let mut v = vec![(r + 1) as f32, 2.0 * (r + 1) as f32];
    pg.all_reduce(&mut v, ReduceOp::Avg)?;
    checks.push(compare("all_reduce avg (f32)", &v, &[(pf + 1.0) / 2.0, pf + 1.0]));

    let mut v = vec![r as f32, 5.0 - r as f32];
    pg.all_reduce(&mut v, ReduceOp::Max)?;
    checks.push(compare("all_reduce max (f32)", &v, &[pf - 1.0, 5.0]));

    let root = p - 1;
    let mut v = vec![r as f32 * 10.0 + 1.0; 3];
    pg.broadcast(&mut v, root)?;
    checks.push(compare(&format!("broadcast from rank {root}"), &v, &[root as f32 * 10.0 + 1.0; 3]));

    let input = [r as f32, 10.0 * r as f32];
    let mut gathered = vec![0f32; 2 * p];
    pg.all_gather(&input, &mut gathered)?;
    let expected: Vec<f32> = (0..p).flat_map(|q| [q as f32, 10.0 * q as f32]).collect();
    checks.push(compare("all_gather (f32)", &gathered, &expected));

    let t = (Tensor::ones(4, DType::BF16, &Device::Cpu)? * (r + 1) as f64)?;
    let summed = pg.all_reduce_tensor(&t, ReduceOp::Sum)?;
    let got: Vec<f32> = summed.to_dtype(DType::F32)?.to_vec1()?;
    checks.push(compare("all_reduce sum (bf16 tensor)", &got, &[s; 4]));

    pg.barrier()?;
    checks.push(CheckResult { name: "barrier".into(), passed: true, detail: "all ranks arrived".into() });

    for (dtype, tol, name) in [(DType::F32, FP32_TOLERANCE, "fp32"), (DType::BF16, BF16_TOLERANCE, "bf16")] {
        checks.push(training_equivalence(pg, dtype, tol, name)?);
    }
    for (mp, tol) in [(MixedPrecision::No, FP32_TOLERANCE), (MixedPrecision::Bf16, BF16_TOLERANCE)] {
        checks.push(accelerator_equivalence(pg, mp, tol)?);
    }
    Ok(())
}

fn compare(name: &str, got: &[f32], expected: &[f32]) -> CheckResult {
    let passed =
        got.len() == expected.len() && got.iter().zip(expected).all(|(g, e)| (g - e).abs() <= 1e-6 * e.abs().max(1.0));
    let detail = if passed { format!("{got:?}") } else { format!("expected {expected:?}, got {got:?}") };
    CheckResult { name: name.into(), passed, detail }
}

/// Problem size of the training check: features, micro-batch per rank, optimizer steps, learning rate.
const FEATURES: usize = 8;
const MICRO_BATCH: usize = 4;
const STEPS: usize = 5;
const LR: f64 = 0.05;

/// The same equivalence through the Accelerator (prepare_model, backward, AcceleratedOptimizer over SGD), whose
/// bf16 path keeps fp32 master weights: P × b on the job's group vs 1 × P·b on a single-process group.
fn accelerator_equivalence(pg: &ProcessGroup, mp: MixedPrecision, tol: f64) -> CliResult<CheckResult> {
    let p = pg.world_size();
    let global = p * MICRO_BATCH;
    let data = regression_data(global)?;
    let distributed = train_accelerated(pg.clone(), &data, mp)?;
    let reference = train_accelerated(ProcessGroup::single_process()?, &data, mp)?;
    let precision = if mp == MixedPrecision::No { "fp32" } else { mp.as_str() };
    Ok(verdict(format!("Accelerator {p}×{MICRO_BATCH} = 1×{global} ({precision})"), &distributed, &reference, tol))
}

/// Trains `fc: Linear(FEATURES → 1)` (zero-initialised) with the Accelerator: each rank of `pg` takes its
/// micro-batch of every global batch. Returns the fp32 master weights, flattened in name order.
fn train_accelerated(pg: ProcessGroup, data: &[(Tensor, Tensor)], mp: MixedPrecision) -> CliResult<Vec<f32>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let acc = Accelerator::with_process_group(AcceleratorConfig { mixed_precision: mp, ..Default::default() }, pg)?;
    let varmap = VarMap::new();
    let model = candle_nn::linear(FEATURES, 1, acc.var_builder(&varmap).pp("fc"))?;
    for var in varmap.all_vars() {
        var.set(&var.zeros_like()?)?;
    }
    let prepared = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(LR))?)?;
    let b = data[0].0.dim(0)? / world;
    for (x, y) in data {
        let (x, y) = (x.narrow(0, rank * b, b)?, y.narrow(0, rank * b, b)?);
        let x = x.to_device(acc.device())?.to_dtype(acc.compute_dtype())?;
        // accel's linear (not candle's Linear::forward): under bf16 on a CPU it is where autocast rounds the
        // operands and results, so the bf16 line measures bf16 and not fp32 again.
        let pred = accel::ops::linear::linear(&x, model.weight(), model.bias(), accel::ops::linear::Activation::None)?
            .to_dtype(DType::F32)?;
        let loss = (pred - y.to_device(acc.device())?)?.sqr()?.mean_all()?;
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad();
    }
    let mut out = Vec::new();
    for m in prepared.master_weights() {
        out.extend(m.as_tensor().to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// Compares final parameters: max |a − b| relative to the largest reference value.
fn verdict(name: String, got: &[f32], reference: &[f32], tol: f64) -> CheckResult {
    let scale = reference.iter().fold(1e-12f64, |m, v| m.max(v.abs() as f64));
    let max_diff = got.iter().zip(reference).fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    let rel = max_diff / scale;
    let moved = reference.iter().any(|v| v.abs() > 1e-3);
    let passed = rel <= tol && moved && got.len() == reference.len() && got.iter().all(|v| v.is_finite());
    let detail = if moved {
        format!("max relative difference {rel:.2e} (tolerance {tol:.0e}) after {STEPS} SGD steps")
    } else {
        "the reference run did not train (parameters still zero)".to_string()
    };
    CheckResult { name, passed, detail }
}

/// P × b with DDP vs 1 × P·b without: final parameters must agree within `tol` (relative to the largest one).
fn training_equivalence(pg: &ProcessGroup, dtype: DType, tol: f64, name: &str) -> CliResult<CheckResult> {
    let p = pg.world_size();
    let global = p * MICRO_BATCH;
    let data = regression_data(global)?;
    let distributed = train(Some(pg), &data, dtype)?;
    let reference = train(None, &data, dtype)?;
    Ok(verdict(format!("DDP {p}×{MICRO_BATCH} = 1×{global} ({name})"), &distributed, &reference, tol))
}

/// `STEPS` global batches of `global` rows: `x` (`[global, FEATURES]`) and `y = x·w* + 0.5 + noise` (`[global, 1]`),
/// the same on every rank (fixed seed).
fn regression_data(global: usize) -> CliResult<Vec<(Tensor, Tensor)>> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5e1f_7e57);
    let w_true: Vec<f32> = (0..FEATURES).map(|i| (i as f32 - 3.5) / 4.0).collect();
    (0..STEPS)
        .map(|_| {
            let x: Vec<f32> = (0..global * FEATURES).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let y: Vec<f32> = x
                .chunks(FEATURES)
                .map(|row| {
                    row.iter().zip(&w_true).map(|(a, b)| a * b).sum::<f32>() + 0.5 + rng.random_range(-0.05f32..0.05)
                })
                .collect();
            Ok((
                Tensor::from_vec(x, (global, FEATURES), &Device::Cpu)?,
                Tensor::from_vec(y, (global, 1), &Device::Cpu)?,
            ))
        })
        .collect()
}

/// Trains `y ≈ x·w + b` with plain SGD on the mean squared error; with `pg`, each rank takes its micro-batch of
/// every global batch and DDP averages the gradients. Parameters are fp32 masters; forward and backward run in
/// `dtype`. Returns `w` then `b`, flattened.
fn train(pg: Option<&ProcessGroup>, data: &[(Tensor, Tensor)], dtype: DType) -> CliResult<Vec<f32>> {
    let w = Var::from_tensor(&Tensor::zeros((FEATURES, 1), DType::F32, &Device::Cpu)?)?;
    let b = Var::from_tensor(&Tensor::zeros(1, DType::F32, &Device::Cpu)?)?;
    let ddp = match pg {
        Some(pg) => Some(DistributedDataParallel::from_named_vars(
            pg,
            vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())],
            DdpOptions::default(),
        )?),
        None => None,
    };
    for (x, y) in data {
        let (x, y) = match pg {
            Some(pg) => {
                (x.narrow(0, pg.rank() * MICRO_BATCH, MICRO_BATCH)?, y.narrow(0, pg.rank() * MICRO_BATCH, MICRO_BATCH)?)
            }
            None => (x.clone(), y.clone()),
        };
        let pred = x
            .to_dtype(dtype)?
            .matmul(&w.as_tensor().to_dtype(dtype)?)?
            .broadcast_add(&b.as_tensor().to_dtype(dtype)?)?;
        let loss = (pred - y.to_dtype(dtype)?)?.sqr()?.mean_all()?;
        let mut grads = loss.backward()?;
        if let Some(ddp) = &ddp {
            ddp.sync_gradients(&mut grads)?;
        }
        for var in [&w, &b] {
            let g = grads.get(var).ok_or_else(|| candle_core::Error::Msg("a parameter got no gradient".into()))?;
            var.set(&(var.as_tensor() - (g.to_dtype(DType::F32)? * LR)?)?)?;
        }
    }
    let mut out: Vec<f32> = w.as_tensor().flatten_all()?.to_vec1()?;
    out.extend(b.as_tensor().to_vec1::<f32>()?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accelerator_bf16_check_trains_in_bf16() {
        let data = regression_data(2 * MICRO_BATCH).unwrap();
        let fp32 = train_accelerated(ProcessGroup::single_process().unwrap(), &data, MixedPrecision::No).unwrap();
        let bf16 = train_accelerated(ProcessGroup::single_process().unwrap(), &data, MixedPrecision::Bf16).unwrap();
        let diff = fp32.iter().zip(&bf16).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff > 1e-4, "bf16 autocast rounds the products: the weights differ from fp32's ({diff:e})");
    }

    #[test]
    fn table_lists_every_check() {
        let report = SelfTestReport {
            world_size: 2,
            backend: "cpu".into(),
            checks: vec![
                CheckResult { name: "a".into(), passed: true, detail: "ok".into() },
                CheckResult { name: "longer name".into(), passed: false, detail: "expected 1, got 2".into() },
            ],
        };
        let t = render_table(&report);
        assert!(t.contains("a            PASS    ok"), "{t}");
        assert!(t.contains("longer name  FAIL    expected 1, got 2"), "{t}");
    }

    #[test]
    fn single_process_training_is_deterministic_and_learns() {
        let data = regression_data(8).unwrap();
        let a = train(None, &data, DType::F32).unwrap();
        let b = train(None, &data, DType::F32).unwrap();
        assert_eq!(a, b);
        assert!(a.iter().any(|v| v.abs() > 1e-3), "{a:?}");
        let c = train(None, &data, DType::BF16).unwrap();
        let rel = a.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
            / a.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(rel < BF16_TOLERANCE as f32, "{rel}");
    }
}
