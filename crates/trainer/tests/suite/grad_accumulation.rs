//! Gradient accumulation with token-level losses: sequences of very different lengths (targets padded with
//! -100), normalised by the number of target tokens of the whole accumulation window summed over all ranks, so
//! that GA = k with batch b gives the same parameters as GA = 1 with batch k·b, on 2 ranks and on 1 — and the
//! per-micro-batch-mean normalisation (the pre-4.46 HF Trainer bug) would not.
//!
//! Tolerance: 3e-5 relative (denominator floored at 1e-3). The runs see the same samples in every optimizer step
//! but sum them in a different order, so only f32 rounding differs; SGD keeps that rounding from being amplified,
//! though 8 steps at learning rate 0.5 grow it to ~100 ulps (1.2e-5 measured). The normalisation bug the test
//! guards against moves the parameters by more than 1e-3, 30× the tolerance.

use std::path::Path;

use crate::common::{max_rel_diff, run_ranks, snapshot, TokenData, TokenModel};
use accel::dist::ProcessGroup;
use trainer::losses::{self, LossOutput};
use trainer::{OptimizerKind, ReportTo, SaveStrategy, Trainer, TrainingArguments};

const TOLERANCE: f64 = 3e-5;

fn args(out: &Path, batch: usize, ga: usize) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 8, // 64 samples / 16 per step = 4 steps per epoch: two epochs
        per_device_train_batch_size: batch,
        gradient_accumulation_steps: ga,
        optim: OptimizerKind::Sgd,
        learning_rate: 0.5,
        lr_scheduler_type: accel::scheduler::SchedulerKind::Constant,
        save_strategy: SaveStrategy::No,
        logging_steps: 2.0,
        report_to: ReportTo(vec!["none".into()]),
        save_plots: false,
        disable_tqdm: true,
        ..Default::default()
    }
}

type Snapshot = Vec<(String, Vec<u32>)>;

/// Final parameters and the logged training losses (every 2 steps).
type Run = (Snapshot, Vec<f64>);

fn train(batch: usize, ga: usize, pg: Option<ProcessGroup>, mean_of_means: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let loss = move |y: &candle_core::Tensor, t: &candle_core::Tensor| {
        let out = losses::token_cross_entropy(y, t)?;
        if mean_of_means {
            // Each micro-batch's mean counts as one item: the normalisation the bug used.
            let mean = out.loss_sum.affine(1.0 / out.num_items.max(1) as f64, 0.0)?;
            return Ok(LossOutput::new(mean, 1));
        }
        Ok(out)
    };
    let mut t = Trainer::new(args(dir.path(), batch, ga), TokenModel::new, TokenData::new(64), None, loss);
    if let Some(pg) = pg {
        t = t.process_group(pg);
    }
    let out = t.train().unwrap();
    assert_eq!(out.global_step, 8);
    (snapshot(&t), t.state().series("loss").into_iter().map(|(_, l)| l).collect())
}

fn on_two_ranks(batch: usize, ga: usize, mean_of_means: bool) -> Run {
    let mut r = run_ranks(2, move |pg| train(batch, ga, Some(pg), mean_of_means));
    assert_eq!(r[0].0, r[1].0, "ranks hold the same parameters");
    r.remove(0)
}

#[test]
fn accumulation_equals_larger_batches_with_variable_length_targets() {
    let reference = train(16, 1, None, false); // 1 process, 16 sequences per step
    let cases = [
        ("2 ranks, GA 2, batch 4", on_two_ranks(4, 2, false)),
        ("2 ranks, GA 1, batch 8", on_two_ranks(8, 1, false)),
        ("1 rank, GA 4, batch 4", train(4, 4, None, false)),
    ];
    for (name, (params, losses)) in &cases {
        let d = max_rel_diff(params, &reference.0);
        assert!(d <= TOLERANCE, "{name}: max relative difference {d:e} > {TOLERANCE:e}");
        // The logged loss is the token-weighted mean over all ranks: the same in every layout.
        assert_eq!(losses.len(), 4, "{name}");
        for (a, b) in losses.iter().zip(&reference.1) {
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{name}: logged loss {a} vs {b}");
        }
    }
    // The test can tell: averaging per-micro-batch means weighs short sequences more and ends elsewhere.
    let buggy = on_two_ranks(4, 2, true).0;
    let d = max_rel_diff(&buggy, &reference.0);
    assert!(d > 1e-3, "mean-of-means normalisation should differ, max relative difference only {d:e}");
}

/// Per-sample losses whose item count is fixed per row ([`losses::CrossEntropy`]) skip the count all-reduce; 2
/// ranks × GA 2 × batch 4 must still equal 1 rank × batch 16 (same tolerance).
#[test]
fn fixed_items_per_row_needs_no_count_reduction_and_stays_exact() {
    fn run(batch: usize, ga: usize, pg: Option<ProcessGroup>) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Trainer::new(
            args(dir.path(), batch, ga),
            crate::common::Mlp::new,
            crate::common::classification_data(64),
            None,
            losses::CrossEntropy,
        );
        if let Some(pg) = pg {
            t = t.process_group(pg);
        }
        t.train().unwrap();
        (snapshot(&t), t.state().series("loss").into_iter().map(|(_, l)| l).collect())
    }
    let reference = run(16, 1, None);
    let two = run_ranks(2, |pg| run(4, 2, Some(pg)));
    assert_eq!(two[0], two[1]);
    let d = max_rel_diff(&two[0].0, &reference.0);
    assert!(d <= TOLERANCE, "max relative difference {d:e}");
    for (a, b) in two[0].1.iter().zip(&reference.1) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "logged loss {a} vs {b}");
    }
}

/// A loss that can count its items from the targets ([`losses::CrossEntropy`]) runs forward and backward one
/// micro-batch at a time; a closure (no count) keeps the window's graphs and backpropagates after. Both give the
/// same parameters, bit for bit, with GA 4 on 2 ranks.
#[test]
fn counting_items_first_changes_no_bit() {
    fn run(pg: ProcessGroup, loss: impl losses::Loss + 'static) -> Snapshot {
        let dir = tempfile::tempdir().unwrap();
        let data = crate::common::classification_data(64);
        let mut t = Trainer::new(args(dir.path(), 4, 4), crate::common::Mlp::new, data, None, loss).process_group(pg);
        t.train().unwrap();
        snapshot(&t)
    }
    let counted = run_ranks(2, |pg| run(pg, losses::CrossEntropy));
    let kept = run_ranks(2, |pg| run(pg, losses::cross_entropy));
    assert_eq!(counted, kept);
}

/// Peak memory does not grow with gradient accumulation: GA = 8 peaks within 10 % of GA = 1 at the same
/// micro-batch, and GA = 8 peaks where GA = 2 does (each run in its own process, reading VmHWM). With the window's
/// graphs kept alive (the old loop) GA = 8 held eight micro-batches' activations at once: 385 MB against 109 MB at
/// micro-batch 1024. What GA > 1 does cost is one fp32 gradient buffer (the window's sum; candle's backward returns
/// fresh gradients where PyTorch accumulates into `.grad` in place), 8.7 MB for this model.
#[test]
fn gradient_accumulation_costs_no_memory_per_micro_batch() {
    const CHILD: &str = "TRAINER_GA_MEMORY_CHILD";
    if let Ok(ga) = std::env::var(CHILD) {
        let peak = ga_memory_child(ga.parse().unwrap());
        println!("VmHWM_KB={peak}");
        return;
    }
    // The harness names tests by module path without the crate: `grad_accumulation::gradient_…`.
    let this_test = match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::gradient_accumulation_costs_no_memory_per_micro_batch"),
        None => "gradient_accumulation_costs_no_memory_per_micro_batch".to_string(),
    };
    let peak = |ga: usize| -> u64 {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", this_test.as_str(), "--nocapture", "--test-threads", "1"])
            .env(CHILD, ga.to_string())
            // glibc's dynamic mmap threshold keeps freed large blocks in the heap, so the peak would measure the
            // allocator's reuse pattern; a fixed threshold returns them and leaves what the loop holds.
            .env("MALLOC_MMAP_THRESHOLD_", "131072")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child with GA {ga} failed: {text} {}", String::from_utf8_lossy(&out.stderr));
        text.lines()
            .find_map(|l| l.strip_prefix("VmHWM_KB="))
            .expect("the child reports its peak")
            .trim()
            .parse()
            .unwrap()
    };
    let (one, two, eight) = (peak(1), peak(2), peak(8));
    eprintln!("peak RSS: GA 1 {one} KiB, GA 2 {two} KiB, GA 8 {eight} KiB");
    assert!(
        (eight as f64) <= 1.10 * one as f64,
        "peak RSS with GA 8 is {eight} KiB, with GA 1 {one} KiB: memory grows with accumulation"
    );
    assert!((eight as f64) <= 1.03 * two as f64, "GA 8 peaks at {eight} KiB, GA 2 at {two} KiB");
}

/// 64 → 1024 → 1024 → 1024 → 10 MLP, micro-batch 2048, one optimizer step with accumulation `ga`, on the same
/// data set whatever `ga`; returns this process's peak resident set (KiB).
fn ga_memory_child(ga: usize) -> u64 {
    struct Wide(Vec<candle_nn::Linear>);
    impl candle_core::Module for Wide {
        fn forward(&self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
            let mut h = x.clone();
            for (i, l) in self.0.iter().enumerate() {
                h = l.forward(&h)?;
                if i + 1 < self.0.len() {
                    h = h.relu()?;
                }
            }
            Ok(h)
        }
    }
    let wide = |vb: candle_nn::VarBuilder| -> candle_core::Result<Wide> {
        let dims = [64, 1024, 1024, 1024, 10];
        Ok(Wide(
            (0..4)
                .map(|i| candle_nn::linear(dims[i], dims[i + 1], vb.pp(format!("l{i}"))))
                .collect::<candle_core::Result<_>>()?,
        ))
    };
    let n = 2048 * 8;
    let x: Vec<f32> = (0..n * 64).map(|i| ((i % 97) as f32 * 0.01).sin()).collect();
    let y: Vec<u32> = (0..n).map(|i| (i % 10) as u32).collect();
    let dev = candle_core::Device::Cpu;
    let data = accel::data::TensorDataset::new(
        candle_core::Tensor::from_vec(x, (n, 64), &dev).unwrap(),
        candle_core::Tensor::from_vec(y, n, &dev).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut a = args(dir.path(), 2048, ga);
    a.max_steps = 1;
    let mut t = Trainer::new(a, wide, data, None, losses::CrossEntropy);
    t.train().unwrap();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap().trim().trim_end_matches("kB").trim().parse().unwrap()
}
