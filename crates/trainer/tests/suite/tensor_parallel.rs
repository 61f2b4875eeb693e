//! `Trainer::with_plan` (a model on `accel::nn`'s builder, laid out by a plan) and the tp-aware loss
//! `losses::VocabParallelCrossEntropy`: a bigram language model (vocab-parallel embedding → vocab-parallel head
//! with a padded vocabulary) trained by the Trainer is reproducible for a seed, learns, and evaluates its loss;
//! split over tp2 and dp2 × tp2 (ranks as threads) it logs the single process's losses with the global batch
//! held fixed; a tp-split model's evaluation refuses `compute_metrics`. `Trainer::with_plan` (a model on
//! `accel::nn`'s builder, laid out by a plan) logs the single process's losses at dp 2, FULL_SHARD, tp 2 and
//! dp 2 × tp 2.

use std::path::Path;

use accel::data::TensorDataset;
use accel::nn::{self, Init, VarBuilder};
use accel::plan::{ParallelPlan, ParallelStyle};
use candle_core::{Device, Tensor};
use trainer::{losses, IntervalStrategy, ReportTo, SaveStrategy, Trainer, TrainingArguments};

use crate::common::{run_ranks, snapshot};
use accel::ParallelismConfig;

const VOCAB: usize = 5;
const SEQ: usize = 6;

/// ids `[b, s]` → vocabulary-sharded logits `[b, s, padded / tp]`: a vocab-parallel embedding into a
/// vocab-parallel head, on `accel::nn`'s builder, laid out by [`bigram_plan`].
fn bigram(vb: VarBuilder) -> candle_core::Result<candle_nn::Sequential> {
    let wte = nn::embedding_init(VOCAB, 8, Init::Randn { mean: 0.0, stdev: 0.5 }, vb.pp("wte"))?;
    let head = nn::linear(8, VOCAB, vb.pp("head"))?;
    Ok(candle_nn::seq().add(wte).add(head))
}

fn bigram_plan() -> ParallelPlan {
    ParallelPlan::default().with("wte", ParallelStyle::VocabParallel).with("head", ParallelStyle::VocabParallel)
}

/// `n` sequences of a deterministic walk over the vocabulary: the next token is `(3 · t + 1) mod 5`, learnable
/// from the current one.
fn walks(n: usize) -> TensorDataset {
    let mut inputs = Vec::with_capacity(n * SEQ);
    let mut targets = Vec::with_capacity(n * SEQ);
    for i in 0..n {
        let mut t = (i % VOCAB) as u32;
        for _ in 0..SEQ {
            let next = (3 * t + 1) % VOCAB as u32;
            inputs.push(t);
            targets.push(next);
            t = next;
        }
    }
    TensorDataset::new(
        Tensor::from_vec(inputs, (n, SEQ), &Device::Cpu).unwrap(),
        Tensor::from_vec(targets, (n, SEQ), &Device::Cpu).unwrap(),
    )
    .unwrap()
}

fn args(out: &Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps: 30,
        per_device_train_batch_size: 8,
        per_device_eval_batch_size: 16,
        learning_rate: 0.05,
        eval_strategy: IntervalStrategy::No,
        save_strategy: SaveStrategy::No,
        logging_steps: 10.0,
        report_to: ReportTo(vec!["none".into()]),
        save_plots: false,
        disable_tqdm: true,
        seed: 3,
        ..Default::default()
    }
}

fn trainer(out: &Path) -> Trainer<candle_nn::Sequential, TensorDataset> {
    Trainer::with_plan(
        args(out),
        bigram_plan(),
        bigram,
        walks(64),
        Some(walks(20)),
        losses::VocabParallelCrossEntropy { vocab_size: VOCAB },
    )
    .process_group(accel::dist::ProcessGroup::single_process().unwrap())
}

/// Parameters come from the ParamBuilder, drawn from `args.seed`: two runs train to the same bits; the bigram
/// is learnt (eval loss far below ln 5 = 1.61), and the loss is evaluated through `compute_parallel`.
#[test]
fn with_plan_is_reproducible_and_learns() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut a = trainer(d1.path());
    let mut b = trainer(d2.path());
    let out_a = a.train().unwrap();
    let out_b = b.train().unwrap();
    assert_eq!(out_a.training_loss, out_b.training_loss);
    assert_eq!(snapshot(&a), snapshot(&b));
    let names: Vec<String> = snapshot(&a).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["head.bias", "head.weight", "wte.weight"]);
    let eval = a.evaluate().unwrap();
    let loss = eval["eval_loss"];
    assert!(loss < 0.5, "eval loss {loss} (ln 5 = 1.61 before training)");
}

/// (logged training losses, final eval loss, train_batch_size) of a run on `world` ranks laid out by `layout`,
/// `per_device` sequences per replica, 3 evaluations of the loss on the way.
fn layout_run(world: usize, layout: ParallelismConfig, per_device: usize) -> Vec<(Vec<f64>, f64, u64)> {
    run_ranks(world, move |pg| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args(dir.path());
        args.per_device_train_batch_size = per_device;
        args.eval_strategy = IntervalStrategy::Steps;
        args.eval_steps = Some(10.0);
        let mut t = Trainer::with_plan(
            args,
            bigram_plan(),
            bigram,
            walks(64),
            Some(walks(20)),
            losses::VocabParallelCrossEntropy { vocab_size: VOCAB },
        )
        .process_group(pg)
        .parallelism_config(layout.clone());
        t.train().unwrap();
        let state = t.state();
        let losses: Vec<f64> = state.log_history.iter().filter_map(|e| e.get("loss")).collect();
        let evals: Vec<f64> = state.log_history.iter().filter_map(|e| e.get("eval_loss")).collect();
        assert_eq!((losses.len(), evals.len()), (3, 3), "{:?}", state.log_history);
        (losses, *evals.last().unwrap(), state.train_batch_size)
    })
}

/// tp2 and dp2 × tp2 give the single process's logged losses and eval losses (relative 1e-5, f32: the
/// vocab-parallel loss and the row sums add in another order), with the global batch held fixed (16
/// sequences: 16 per replica at dp 1, 8 at dp 2); train_batch_size counts the data-parallel replicas only.
#[test]
fn tp2_and_dp2_tp2_log_the_single_process_losses() {
    let reference = layout_run(1, ParallelismConfig::default(), 16).pop().unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    for (world, layout, per_device) in [
        (2, ParallelismConfig::default().with_tp_size(2), 16),
        (4, ParallelismConfig::default().with_tp_size(2).with_dp_replicate_size(2), 8),
    ] {
        for (rank, (losses, eval, batch)) in layout_run(world, layout.clone(), per_device).into_iter().enumerate() {
            assert_eq!(batch, 16, "{layout:?} rank {rank}");
            assert!(
                losses.iter().zip(&reference.0).all(|(a, b)| close(*a, *b)) && close(eval, reference.1),
                "{layout:?} rank {rank}: losses {losses:?} eval {eval} vs {:?} {}",
                reference.0,
                reference.1
            );
        }
    }
}

/// compute_metrics would gather vocabulary shards: refused at tp 2 before training, naming the fix.
#[test]
fn compute_metrics_is_refused_for_a_tp_split_model() {
    let errors = run_ranks(2, |pg| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args(dir.path());
        args.eval_strategy = IntervalStrategy::Steps;
        let mut t = Trainer::with_plan(
            args,
            bigram_plan(),
            bigram,
            walks(64),
            Some(walks(20)),
            losses::VocabParallelCrossEntropy { vocab_size: VOCAB },
        )
        .process_group(pg)
        .parallelism_config(ParallelismConfig::default().with_tp_size(2))
        .compute_metrics(trainer::metrics::classification);
        t.train().unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("split over 2 tensor-parallel ranks") && e.contains("drop compute_metrics"), "{e}");
    }
}

/// `Trainer::with_plan`: one model written on `accel::nn`'s builder (candle's calls; no style in its code), laid
/// out by a plan (`fc1` column-wise, `fc2` row-wise), logs the single process's training losses at dp 2, FULL_SHARD
/// 2 (`fsdp: "full_shard"`), tp 2 and dp 2 × tp 2 (relative 1e-5: sums in another order), the global batch held at
/// 16 — built once, at every layout.
#[test]
fn with_plan_trains_one_model_at_every_layout_like_one_process() {
    use crate::common::{classification_data, CLASSES, FEATURES};
    use accel::nn::{linear, Activation};
    use accel::plan::{ParallelPlan, ParallelStyle};

    let run = |world: usize, layout: ParallelismConfig, fsdp: Option<&'static str>, per_device: usize| {
        run_ranks(world, move |pg| {
            let dir = tempfile::tempdir().unwrap();
            let args = TrainingArguments {
                per_device_train_batch_size: per_device,
                fsdp: fsdp.map(str::to_string),
                max_steps: 8,
                logging_steps: 2.0,
                ..args(dir.path())
            };
            let plan = ParallelPlan::default().with("fc1", ParallelStyle::Colwise).with("fc2", ParallelStyle::Rowwise);
            let mlp = |vb: accel::nn::VarBuilder| -> candle_core::Result<candle_nn::Sequential> {
                let fc1 = linear(FEATURES, 8, vb.pp("fc1"))?.with_activation(Activation::Relu);
                Ok(candle_nn::seq().add(fc1).add(linear(8, CLASSES, vb.pp("fc2"))?))
            };
            let data = classification_data(64);
            let mut t = Trainer::with_plan(args, plan, mlp, data, None, losses::cross_entropy)
                .process_group(pg)
                .parallelism_config(layout.clone());
            t.train().unwrap();
            let p = t.accelerator().unwrap().parallelism_config();
            let shape =
                (p.dp_replicate_size, p.dp_shard_size, p.tp_size, t.prepared_model().unwrap().is_fully_sharded());
            let losses: Vec<f64> = t.state().log_history.iter().filter_map(|e| e.get("loss")).collect();
            (shape, losses)
        })
    };
    let (_, reference) = run(1, ParallelismConfig::default(), None, 16).pop().unwrap();
    assert_eq!(reference.len(), 4, "{reference:?}");
    assert!(reference.windows(2).any(|w| w[0] != w[1]), "the losses move: {reference:?}");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    let tp2 = ParallelismConfig::default().with_tp_size(2);
    for (world, layout, fsdp, per_device, shape) in [
        (2, ParallelismConfig::default(), None, 8, (2, 1, 1, false)),
        (2, ParallelismConfig::default(), Some("full_shard"), 8, (1, 2, 1, true)),
        (2, tp2.clone(), None, 16, (1, 1, 2, false)),
        (4, tp2.with_dp_replicate_size(2), None, 8, (2, 1, 2, false)),
    ] {
        for (rank, (got_shape, losses)) in run(world, layout, fsdp, per_device).into_iter().enumerate() {
            assert_eq!(got_shape, shape, "rank {rank}");
            assert!(
                losses.len() == reference.len() && losses.iter().zip(&reference).all(|(a, b)| close(*a, *b)),
                "{shape:?} rank {rank}: losses {losses:?} vs one process {reference:?}"
            );
        }
    }
}

/// `Trainer::with_plan` under pipeline parallelism: a model declared as stages with `accel::nn::staged` (an input
/// layer, two blocks, a head) needs no other constructor — the Trainer drives the stages the builder made through
/// the schedule — and logs the single process's losses at pp 2 (1F1B, 2 micro-batches) and dp 2 × pp 2 (relative
/// 1e-5); each pp rank holds its stages' parameters only.
#[test]
fn with_plan_trains_a_staged_model_under_pp_like_one_process() {
    use crate::common::{classification_data, CLASSES, FEATURES};
    use accel::nn::{linear, staged, Activation};
    use accel::plan::ParallelPlan;

    let run = |world: usize, layout: ParallelismConfig, per_device: usize| {
        run_ranks(world, move |pg| {
            let dir = tempfile::tempdir().unwrap();
            let args = TrainingArguments {
                per_device_train_batch_size: per_device,
                max_steps: 8,
                logging_steps: 2.0,
                ..args(dir.path())
            };
            let model = |vb: accel::nn::VarBuilder| {
                let relu = |l: accel::nn::Linear| l.with_activation(Activation::Relu);
                staged(
                    &vb,
                    2,
                    "blocks",
                    |vb| Ok(relu(linear(FEATURES, 8, vb.pp("input"))?)),
                    |vb| Ok(relu(linear(8, 8, vb)?)),
                    |vb, _| linear(8, CLASSES, vb.pp("head")),
                )
            };
            let mut t = Trainer::with_plan(
                args,
                ParallelPlan::default(),
                model,
                classification_data(64),
                None,
                losses::CrossEntropy,
            )
            .process_group(pg)
            .parallelism_config(layout.clone());
            t.train().unwrap();
            // This rank's own parameters (the checkpoint's state dict would gather every stage's).
            let mut names: Vec<String> = t.varmap().unwrap().data().lock().unwrap().keys().cloned().collect();
            names.sort();
            let losses: Vec<f64> = t.state().log_history.iter().filter_map(|e| e.get("loss")).collect();
            (t.accelerator().unwrap().mesh().pp().rank(), names, losses)
        })
    };
    let (_, names, reference) = run(1, ParallelismConfig::default(), 16).pop().unwrap();
    assert_eq!(names.len(), 8, "{names:?}");
    assert!(reference.windows(2).any(|w| w[0] != w[1]), "the losses move: {reference:?}");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    let pp2 = ParallelismConfig::default().with_pp_size(2).with_pp_microbatches(2);
    for (world, layout, per_device) in [(2, pp2.clone(), 16), (4, pp2.with_dp_replicate_size(2), 8)] {
        for (rank, (stage, names, losses)) in run(world, layout.clone(), per_device).into_iter().enumerate() {
            // Stage 0 holds the input layer and block 0, stage 1 block 1 and the head.
            let first = ["blocks.0.bias", "blocks.0.weight", "input.bias", "input.weight"];
            let last = ["blocks.1.bias", "blocks.1.weight", "head.bias", "head.weight"];
            assert_eq!(names, if stage == 0 { first } else { last }, "{layout:?} rank {rank}");
            assert!(
                losses.len() == reference.len() && losses.iter().zip(&reference).all(|(a, b)| close(*a, *b)),
                "{layout:?} rank {rank}: losses {losses:?} vs one process {reference:?}"
            );
        }
    }
}

/// With every size `auto` the Trainer describes its model on the builder (the bigram: no blocks, 85 parameters,
/// tokens per sample read from the ids) and the Accelerator chooses the layout; whatever it chooses trains the
/// single process's losses with the global batch the arguments give (8 per device × 2 processes = 16).
#[test]
fn an_automatic_layout_is_chosen_from_the_model_and_trains_like_one_process() {
    let reference = layout_run(1, ParallelismConfig::default(), 16).pop().unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    let runs = run_ranks(2, |pg| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args(dir.path());
        args.eval_strategy = IntervalStrategy::Steps;
        args.eval_steps = Some(10.0);
        let mut t = Trainer::with_plan(
            args,
            bigram_plan(),
            bigram,
            walks(64),
            Some(walks(20)),
            losses::VocabParallelCrossEntropy { vocab_size: VOCAB },
        )
        .process_group(pg)
        .parallelism_config(ParallelismConfig::auto());
        t.train().unwrap();
        let decision = t.accelerator().unwrap().auto_layout().expect("an automatic layout").clone();
        let state = t.state();
        let losses: Vec<f64> = state.log_history.iter().filter_map(|e| e.get("loss")).collect();
        let evals: Vec<f64> = state.log_history.iter().filter_map(|e| e.get("eval_loss")).collect();
        let global = t.args().per_device_train_batch_size
            * t.accelerator().unwrap().data_parallel_size()
            * t.args().gradient_accumulation_steps
            / decision.layout().microbatches;
        (decision.choice.to_string(), losses, *evals.last().unwrap(), global)
    });
    for (rank, (choice, losses, eval, global)) in runs.into_iter().enumerate() {
        assert!(choice.contains("(85 parameters)") && choice.contains("seq 6"), "{choice}");
        assert!(choice.contains("global batch 16 sequences"), "{choice}");
        assert_eq!(global, 16, "rank {rank}: {choice}");
        assert!(
            losses.iter().zip(&reference.0).all(|(a, b)| close(*a, *b)) && close(eval, reference.1),
            "rank {rank}: losses {losses:?} eval {eval} vs {:?} {}\n{choice}",
            reference.0,
            reference.1
        );
    }
}

/// A model written with candle's own VarBuilder cannot be described: an automatic layout is refused, naming the
/// constructor to use.
#[test]
fn an_automatic_layout_needs_a_model_on_the_builder() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(
        args(dir.path()),
        |vb| candle_nn::linear(SEQ, VOCAB, vb.pp("fc")),
        walks(8),
        None,
        losses::cross_entropy,
    )
    .process_group(accel::dist::ProcessGroup::single_process().unwrap())
    .parallelism_config(ParallelismConfig::auto());
    let err = t.train().unwrap_err().to_string();
    assert!(err.contains("reads the model's shape from its build") && err.contains("Trainer::with_plan"), "{err}");
}

/// An automatic layout whose global batch (per device × processes × accumulation) is more than the training set
/// is refused before training, naming the argument and both sizes.
#[test]
fn an_automatic_layout_larger_than_the_data_is_refused() {
    let errors = run_ranks(2, |pg| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args(dir.path());
        args.per_device_train_batch_size = 40; // × 2 processes = 80 > 64 samples
        let mut t = Trainer::with_plan(args, bigram_plan(), bigram, walks(64), None, losses::cross_entropy)
            .process_group(pg)
            .parallelism_config(ParallelismConfig::auto());
        t.train().unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("per_device_train_batch_size") && e.contains("= 80 samples"), "{e}");
        assert!(e.contains("more than the 64 samples of the training set"), "{e}");
    }
}
