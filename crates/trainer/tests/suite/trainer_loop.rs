//! The training loop end to end on small data: early stopping at the right evaluation, checkpoint rotation
//! that keeps the best and the newest, best-model reloading, trainer_state.json content, the LR schedule as
//! logged, and evaluation / prediction that return exactly one row per sample on 2 ranks.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::{classification_data, run_ranks, snapshot, Mlp, CLASSES, FEATURES};
use accel::plan::ParallelPlan;
use candle_core::DType;
use trainer::checkpoint::{checkpoint_dir, sorted_checkpoints, step_of};
use trainer::metrics::{EvalPrediction, Metrics};
use trainer::{losses, metrics, IntervalStrategy, ReportTo, SaveStrategy, Trainer, TrainerState, TrainingArguments};

fn base(out: &Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        num_train_epochs: 10.0,
        per_device_train_batch_size: 16,
        per_device_eval_batch_size: 16,
        learning_rate: 0.01,
        report_to: ReportTo(vec!["none".into()]),
        save_plots: false,
        disable_tqdm: true,
        ..Default::default()
    }
}

/// A compute_metrics returning `scores[i]` as "score" at the i-th evaluation.
fn scripted(scores: Vec<f64>) -> impl Fn(&EvalPrediction) -> trainer::Result<Metrics> + Send {
    let calls = Arc::new(AtomicUsize::new(0));
    move |_p: &EvalPrediction| {
        let i = calls.fetch_add(1, Ordering::SeqCst);
        Ok(Metrics::from([("score".to_string(), scores[i.min(scores.len() - 1)])]))
    }
}

fn eval_steps(state: &TrainerState) -> Vec<u64> {
    state.log_history.iter().filter(|e| e.get("eval_score").is_some()).map(|e| e.step).collect()
}

#[test]
fn early_stopping_stops_at_the_right_evaluation_with_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        eval_strategy: IntervalStrategy::Epoch,
        save_strategy: SaveStrategy::No,
        metric_for_best_model: Some("score".into()),
        early_stopping_patience: Some(2),
        early_stopping_threshold: 0.05,
        ..base(dir.path())
    };
    // 64 samples / 16 = 4 steps per epoch. Evaluations: 0.5 (first: reset), 0.6 (+0.1 > 0.05: reset), 0.62 (+0.02:
    // counter 1), 0.64 (+0.02 over the new best 0.62: counter 2 = patience) → stop after epoch 4 of 10.
    let mut t =
        Trainer::new(args, Mlp::new, classification_data(64), Some(classification_data(20)), losses::cross_entropy)
            .compute_metrics(scripted(vec![0.5, 0.6, 0.62, 0.64, 0.99, 0.99]));
    let out = t.train().unwrap();
    assert_eq!(eval_steps(t.state()), vec![4, 8, 12, 16]);
    assert_eq!(out.global_step, 16);
    assert_eq!(t.state().epoch, 4.0);
    assert_eq!(t.state().best_metric, Some(0.64));
    assert!(t.args().greater_is_better_resolved(), "score does not end in loss: greater is better");
}

#[test]
fn rotation_keeps_best_and_newest_and_the_best_model_is_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        eval_strategy: IntervalStrategy::Epoch,
        save_strategy: SaveStrategy::Epoch,
        save_total_limit: Some(1),
        load_best_model_at_end: true,
        metric_for_best_model: Some("score".into()),
        early_stopping_patience: Some(2),
        report_to: ReportTo(vec!["jsonl".into()]),
        save_plots: cfg!(feature = "plots"),
        ..base(dir.path())
    };
    // Best at epoch 2 (step 8), then two evaluations without improvement: stop after epoch 4 (step 16).
    let mut t =
        Trainer::new(args, Mlp::new, classification_data(64), Some(classification_data(20)), losses::cross_entropy)
            .compute_metrics(scripted(vec![0.5, 0.9, 0.6, 0.7]));
    t.train().unwrap();
    let kept: Vec<u64> = sorted_checkpoints(dir.path(), None).unwrap().iter().filter_map(|p| step_of(p)).collect();
    assert_eq!(kept, vec![8, 16], "limit 1 keeps the best and the newest");
    let best = checkpoint_dir(dir.path(), 8);
    assert_eq!(t.state().best_model_checkpoint.as_deref(), Some(best.to_str().unwrap()));
    assert_eq!((t.state().best_metric, t.state().best_global_step), (Some(0.9), Some(8)));

    // The model now holds the best checkpoint's weights.
    let saved = accel::state::load_safetensors(&best.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    for (name, bits) in snapshot(&t) {
        let w: Vec<u32> = saved[&name]
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(w, bits, "{name} is the best checkpoint's");
    }

    // trainer_state.json of the newest checkpoint: HF layout and our values.
    let st = TrainerState::load_from_json(&checkpoint_dir(dir.path(), 16).join("trainer_state.json")).unwrap();
    assert_eq!((st.global_step, st.max_steps, st.epoch), (16, 40, 4.0));
    assert_eq!(st.best_model_checkpoint.as_deref(), Some(best.to_str().unwrap()));
    assert_eq!(st.stateful_callbacks["EarlyStoppingCallback"].attributes["early_stopping_patience_counter"], 2);
    assert_eq!(st.stateful_callbacks["TrainerControl"].args["should_training_stop"], true);
    assert_eq!(st.world_size, Some(1));
    let raw: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoint_dir(dir.path(), 16).join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(raw["log_history"].as_array().unwrap().iter().filter(|e| e.get("eval_score").is_some()).count(), 4);

    // Plots and the JSONL tracker.
    for f in ["training_curves.png", "training_curves.svg", "trainer_state.json", "training_args.yaml"] {
        let plot = f.starts_with("training_curves");
        assert_eq!(dir.path().join(f).is_file(), !plot || cfg!(feature = "plots"), "{f}");
    }
    let jsonl = std::fs::read_dir(dir.path().join("runs")).unwrap().next().unwrap().unwrap().path();
    assert!(std::fs::read_dir(jsonl).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".jsonl")));
}

#[test]
fn logged_learning_rates_follow_the_schedule_and_count_only_real_steps() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        max_steps: 6,
        learning_rate: 0.1,
        warmup_steps: 2,
        lr_scheduler_type: accel::scheduler::SchedulerKind::Linear,
        logging_steps: 1.0,
        save_strategy: SaveStrategy::No,
        ..base(dir.path())
    };
    let mut t = Trainer::new(args, Mlp::new, classification_data(64), None, losses::cross_entropy);
    t.train().unwrap();
    // After step k the optimizer holds the rate for step k + 1: 0.1 · lr_lambda(k), W = 2, T = 6.
    let logged: Vec<(u64, f64)> = t.state().series("learning_rate");
    let expected = [(1, 0.05), (2, 0.1), (3, 0.075), (4, 0.05), (5, 0.025), (6, 0.0)];
    assert_eq!(logged.len(), expected.len(), "{logged:?}");
    for ((s, lr), (es, elr)) in logged.iter().zip(expected) {
        assert_eq!(*s, es);
        assert!((lr - elr).abs() < 1e-12, "step {s}: {lr} vs {elr}");
    }
    assert!(t.state().series("loss").iter().all(|(_, l)| l.is_finite() && *l > 0.0));
}

#[test]
fn evaluation_and_prediction_return_every_sample_once_on_two_ranks() {
    // 37 samples over 2 ranks with batch 5: the last global step is padded with 3 duplicates that must go.
    let single = {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Trainer::new(
            base(dir.path()),
            Mlp::new,
            classification_data(64),
            Some(classification_data(37)),
            losses::cross_entropy,
        )
        .compute_metrics(metrics::classification);
        let m = t.evaluate().unwrap();
        let p = t.predict(classification_data(37)).unwrap();
        (m, p.predictions.to_vec2::<f32>().unwrap())
    };
    let results = run_ranks(2, |pg| {
        let dir = tempfile::tempdir().unwrap();
        let args = TrainingArguments { per_device_eval_batch_size: 5, ..base(dir.path()) };
        let mut t =
            Trainer::new(args, Mlp::new, classification_data(64), Some(classification_data(37)), losses::cross_entropy)
                .compute_metrics(metrics::classification)
                .process_group(pg);
        let m = t.evaluate().unwrap();
        let p = t.predict(classification_data(37)).unwrap();
        (m, p)
    });
    let labels: Vec<i64> =
        classification_data(37).targets().to_vec1::<u32>().unwrap().iter().map(|&l| l as i64).collect();
    for (m, p) in &results {
        assert_eq!(p.label_ids.to_vec1::<i64>().unwrap(), labels, "every sample once, in order");
        // Same initial weights (seeded) → same predictions and metrics as one process (tolerance: f32 summation).
        let preds = p.predictions.to_vec2::<f32>().unwrap();
        for (a, b) in preds.iter().flatten().zip(single.1.iter().flatten()) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
        assert!(
            (m["eval_loss"] - single.0["eval_loss"]).abs() < 1e-5,
            "{} vs {}",
            m["eval_loss"],
            single.0["eval_loss"]
        );
        assert_eq!(m["eval_accuracy"], single.0["eval_accuracy"]);
        assert!(m.contains_key("eval_f1") && m.contains_key("eval_samples_per_second"));
    }
}

#[test]
fn fp16_overflow_skips_the_step_and_the_schedule_does_not_move() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        max_steps: 6,
        learning_rate: 0.1,
        lr_scheduler_type: accel::scheduler::SchedulerKind::Linear,
        mixed_precision: accel::MixedPrecision::Fp16,
        logging_steps: 1.0,
        save_strategy: SaveStrategy::No,
        ..base(dir.path())
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let loss = move |y: &candle_core::Tensor, t: &candle_core::Tensor| {
        let out = losses::cross_entropy(y, t)?;
        if calls.fetch_add(1, Ordering::SeqCst) == 2 {
            // Step 3's gradients overflow fp16 once scaled: the optimizer step is skipped.
            return Ok(losses::LossOutput::new(out.loss_sum.affine(1e30, 0.0)?, out.num_items));
        }
        Ok(out)
    };
    let mut t = Trainer::new(args, Mlp::new, classification_data(64), None, loss);
    let out = t.train().unwrap();
    assert_eq!(out.global_step, 6, "the skipped step still counts as a global step (as HF)");
    let lr = |k: f64| 0.1 * (6.0 - k) / 6.0;
    let expected = [lr(1.0), lr(2.0), lr(2.0), lr(3.0), lr(4.0), lr(5.0)];
    let logged: Vec<f64> = t.state().series("learning_rate").into_iter().map(|(_, v)| v).collect();
    assert_eq!(logged.len(), 6);
    for (i, (a, b)) in logged.iter().zip(expected).enumerate() {
        assert!((a - b).abs() < 1e-12, "step {}: {a} vs {b}", i + 1);
    }
    assert_eq!(t.accelerator().unwrap().loss_scale(), Some(32768.0), "the overflow halved the loss scale");
}

#[test]
fn evaluation_strategy_without_eval_dataset_is_an_error_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments { eval_strategy: IntervalStrategy::Epoch, ..base(dir.path()) };
    let mut t = Trainer::new(args, Mlp::new, classification_data(64), None, losses::CrossEntropy);
    let err = t.train().unwrap_err().to_string();
    assert!(err.contains("eval_strategy") && err.contains("no eval dataset"), "{err}");
}

#[test]
fn save_model_writes_the_fp32_weights_and_the_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments { max_steps: 3, save_strategy: SaveStrategy::No, ..base(dir.path()) };
    let mut t = Trainer::new(args, Mlp::new, classification_data(64), None, losses::CrossEntropy);
    t.train().unwrap();
    let path = t.save_model(Some(&dir.path().join("final"))).unwrap();
    let saved = accel::state::load_safetensors(&path, &candle_core::Device::Cpu).unwrap();
    for (name, bits) in snapshot(&t) {
        let w = saved[&name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bits, "{name}");
    }
    let yaml = std::fs::read_to_string(dir.path().join("final/training_args.yaml")).unwrap();
    assert_eq!(TrainingArguments::from_yaml_str(&yaml).unwrap(), *t.args());
}

/// `fsdp` lays the data-parallel processes out as dp_shard with its strategy (HF: FSDP over all ranks).
#[test]
fn fsdp_shards_over_the_data_parallel_processes() {
    let layouts = run_ranks(2, |pg| {
        let dir = tempfile::tempdir().unwrap();
        let args = TrainingArguments { fsdp: Some("shard_optim auto_wrap".into()), ..base(dir.path()) };
        let mut t =
            Trainer::new(args, Mlp::new, classification_data(64), None, losses::cross_entropy).process_group(pg);
        t.setup().unwrap();
        let p = t.accelerator().unwrap().parallelism_config();
        (p.dp_replicate_size, p.dp_shard_size, p.tp_size, p.sharding_strategy)
    });
    assert_eq!(layouts, vec![(1, 2, 1, accel::ShardingStrategy::ShardOptim); 2]);
}

/// The 6 → 16 → 3 MLP of [`Mlp`] on `accel::nn`'s builder (`Trainer::with_plan`), each layer a unit, which
/// FULL_SHARD gathers and frees as a whole: the same code as at every other layout.
fn nn_mlp(vb: accel::nn::VarBuilder) -> candle_core::Result<candle_nn::Sequential> {
    use accel::nn::{linear, unit, Activation};
    let fc1 = unit(vb.pp("fc1"), |vb| Ok(linear(FEATURES, 16, vb)?.with_activation(Activation::Relu)))?;
    let fc2 = unit(vb.pp("fc2"), |vb| linear(16, CLASSES, vb))?;
    Ok(candle_nn::seq().add(fc1).add(fc2))
}

/// `fsdp: "full_shard"` (ZeRO-3) on 2 ranks: a `Trainer::with_plan` model on `accel::nn`'s builder (built once; its
/// layers gather their weights at each use, its units recomputed) logs plain DDP's losses over the same 2 ranks
/// (relative 1e-5: the gradients are reduce-scattered instead of all-reduced); a `Trainer::new` model, built from
/// a candle VarBuilder, keeps its weights and is refused at setup, on every rank, saying why.
#[test]
fn fsdp_full_shard_trains_a_model_on_the_builder_like_ddp_and_refuses_a_var_builder_model() {
    let run = |fsdp: Option<&'static str>| {
        run_ranks(2, move |pg| {
            let dir = tempfile::tempdir().unwrap();
            let args = TrainingArguments {
                fsdp: fsdp.map(str::to_string),
                max_steps: 6,
                logging_steps: 1.0,
                save_strategy: SaveStrategy::No,
                ..base(dir.path())
            };
            let mut t = Trainer::with_plan(
                args,
                ParallelPlan::default(),
                nn_mlp,
                classification_data(64),
                None,
                losses::cross_entropy,
            )
            .process_group(pg);
            t.train().unwrap();
            let p = t.accelerator().unwrap().parallelism_config();
            let layout = (p.dp_replicate_size, p.dp_shard_size, t.prepared_model().unwrap().is_fully_sharded());
            let losses: Vec<f64> = t.state().log_history.iter().filter_map(|e| e.get("loss")).collect();
            (layout, losses)
        })
    };
    let ddp = run(None);
    let full = run(Some("full_shard"));
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    for (rank, ((ddp_layout, want), (full_layout, got))) in ddp.into_iter().zip(full).enumerate() {
        assert_eq!((ddp_layout, full_layout), ((2, 1, false), (1, 2, true)), "rank {rank}");
        assert_eq!(want.len(), 6, "rank {rank}: {want:?}");
        assert!(want.windows(2).any(|w| w[0] != w[1]), "rank {rank}: the losses move: {want:?}");
        assert!(
            got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| close(*a, *b)),
            "rank {rank}: FULL_SHARD losses {got:?} vs DDP {want:?}"
        );
    }

    let errors = run_ranks(2, |pg| {
        let dir = tempfile::tempdir().unwrap();
        let args = TrainingArguments { fsdp: Some("full_shard".into()), ..base(dir.path()) };
        let mut t =
            Trainer::new(args, Mlp::new, classification_data(64), None, losses::cross_entropy).process_group(pg);
        t.setup().unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("built by a candle VarBuilder") && e.contains("FULL_SHARD"), "{e}");
        assert!(e.contains("accelerator.builder(&varmap, plan)"), "names the way out: {e}");
    }
}
