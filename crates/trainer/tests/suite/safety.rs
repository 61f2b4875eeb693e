//! Nothing silently wrong (the short form of docs/faults.md): a new run never adopts another run's files, a
//! resumed run ends exactly as the uninterrupted one (weights and the whole `trainer_state.json`), a failed resume
//! changes no file, damaged checkpoint files are named, and a diverging loss stops training with the step, the
//! rank and the last finite loss.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::{classification_data, run_ranks, snapshot, Mlp};
use accel::dist::ProcessGroup;
use trainer::{
    losses, CallbackContext, IntervalStrategy, ReportTo, SaveStrategy, Trainer, TrainerCallback, TrainerControl,
    TrainerError, TrainingArguments,
};

type Snapshot = Vec<(String, Vec<u32>)>;

fn args(out: &Path, ga: usize) -> TrainingArguments {
    TrainingArguments {
        save_steps: 2.0,
        // Not a multiple of save_steps: checkpoints fall between logs, so the loss tally must travel with them.
        logging_steps: 3.0,
        ..crate::resume::args(out, ga)
    }
}

/// Fails `on_save` at global step `step` (a kill just after that checkpoint was written).
struct FailAfterSave(u64);

impl TrainerCallback for FailAfterSave {
    fn on_save(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        if ctx.state.global_step == self.0 {
            return Err(TrainerError::Callback { context: "test".into(), message: "injected kill after save".into() });
        }
        Ok(())
    }
}

/// How a run is interrupted.
#[derive(Clone, Copy)]
enum Kill {
    /// The loss fails at its n-th call (inside the loop).
    AtMicroBatch(usize),
    /// Right after the checkpoint of this step was written.
    AfterSave(u64),
}

/// Trains `a` on 90 samples; `kill` makes the run fail. Returns the final parameters, or the error.
fn train(a: TrainingArguments, kill: Option<Kill>, pg: Option<ProcessGroup>) -> Result<Snapshot, TrainerError> {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let fail_at = match kill {
        Some(Kill::AtMicroBatch(n)) => Some(n),
        _ => None,
    };
    let loss = move |y: &candle_core::Tensor, t: &candle_core::Tensor| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        if Some(n) == fail_at {
            candle_core::bail!("injected failure at micro-batch {n}");
        }
        losses::cross_entropy(y, t)
    };
    let mut t = Trainer::new(a, Mlp::new, classification_data(90), Some(classification_data(30)), loss);
    if let Some(Kill::AfterSave(step)) = kill {
        t = t.callback(FailAfterSave(step));
    }
    if let Some(pg) = pg {
        t = t.process_group(pg);
    }
    t.train().map(|_| snapshot(&t))
}

/// `output_dir/trainer_state.json` as JSON, with the run-time measurements removed and the output directory
/// replaced by `OUT` (two runs in two directories are compared).
fn final_state(out: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(out.join("trainer_state.json")).unwrap();
    let text = text.replace(&out.display().to_string(), "OUT");
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for entry in v["log_history"].as_array_mut().unwrap() {
        entry.as_object_mut().unwrap().retain(|k, _| !(k.ends_with("_runtime") || k.ends_with("_per_second")));
    }
    v
}

fn checkpoints(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    names.sort();
    names
}

/// Every file under `dir` with its content (to prove that nothing changed).
fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

// ---- 1. A new run never adopts another run's files ----

#[test]
fn rerun_into_an_output_dir_with_checkpoints_is_refused_unless_overwrite() {
    let with_eval = |out: &Path, seed: u64, lr: f64| TrainingArguments {
        seed,
        learning_rate: lr,
        eval_strategy: IntervalStrategy::Epoch,
        save_strategy: SaveStrategy::Epoch,
        load_best_model_at_end: true,
        save_total_limit: Some(2),
        ..args(out, 1)
    };
    let dir = tempfile::tempdir().unwrap();
    train(with_eval(dir.path(), 1, 0.05), None, None).unwrap();
    let first = tree(dir.path());

    // Another seed and learning rate into the same directory: refused, naming the directory and both fixes.
    let err = train(with_eval(dir.path(), 2, 0.01), None, None).unwrap_err().to_string();
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
    assert!(err.contains("resume_from_checkpoint") && err.contains("overwrite_output_dir"), "{err}");
    assert_eq!(tree(dir.path()), first, "a refused run changes nothing");

    // With overwrite_output_dir the old checkpoints go first, and the result is exactly the second run's own.
    let fresh = tempfile::tempdir().unwrap();
    let expected = train(with_eval(fresh.path(), 2, 0.01), None, None).unwrap();
    let mut a = with_eval(dir.path(), 2, 0.01);
    a.overwrite_output_dir = true;
    assert_eq!(train(a, None, None).unwrap(), expected, "the second run's best model is its own");
    assert_eq!(final_state(dir.path()), final_state(fresh.path()));
}

#[test]
fn a_second_job_on_the_same_output_dir_fails_at_once_and_stale_locks_are_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let lock = dir.path().join(".trainer.lock");
    let host = trainer::checkpoint::host_name();
    // A job that is running: this very process.
    let me = std::process::id();
    std::fs::write(&lock, format!(r#"{{"pid":{me},"host":"{host}","started":1}}"#)).unwrap();
    let err = train(args(dir.path(), 1), None, None).unwrap_err().to_string();
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
    assert!(err.contains(&format!("pid {me}")) && err.contains(&host), "{err}");
    assert!(checkpoints(dir.path()).is_empty(), "the second job wrote nothing");

    // A lock left by a process that is gone: taken over, and removed at the end of the run.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    std::fs::write(&lock, format!(r#"{{"pid":{dead},"host":"{host}","started":1}}"#)).unwrap();
    train(args(dir.path(), 1), None, None).unwrap();
    assert!(!lock.exists(), "the lock is removed when training ends");
    assert_eq!(checkpoints(dir.path()).len(), 18);
}

// ---- 2. A resumed run ends exactly as the uninterrupted one ----

fn resumed_equals_uninterrupted(ga: usize, kill: Kill) {
    let reference_dir = tempfile::tempdir().unwrap();
    let reference = train(args(reference_dir.path(), ga), None, None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    assert!(train(args(dir.path(), ga), Some(kill), None).is_err());
    let mut a = args(dir.path(), ga);
    a.resume_from_checkpoint = Some("latest".into());
    assert_eq!(train(a, None, None).unwrap(), reference, "weights");
    assert_eq!(final_state(dir.path()), final_state(reference_dir.path()), "trainer_state.json");
}

#[test]
fn resumed_trainer_state_equals_the_uninterrupted_one_mid_epoch() {
    // 12 steps per epoch; micro-batch 10 fails in step 10: resume from checkpoint-8, two steps after the last log.
    resumed_equals_uninterrupted(1, Kill::AtMicroBatch(10));
}

#[test]
fn resumed_trainer_state_equals_the_uninterrupted_one_inside_an_accumulation_window() {
    // GA 5 over 12 micro-batches: windows 5, 5, 2. Micro-batch 19 is inside step 5: resume from checkpoint-4.
    resumed_equals_uninterrupted(5, Kill::AtMicroBatch(19));
}

#[test]
fn resumed_trainer_state_equals_the_uninterrupted_one_after_the_last_save() {
    // Killed right after the final checkpoint (step 36 of 36): the resumed run only finishes.
    resumed_equals_uninterrupted(1, Kill::AfterSave(36));
}

#[test]
fn resumed_trainer_state_equals_the_uninterrupted_one_on_two_ranks() {
    let rd = tempfile::tempdir().unwrap();
    let r = rd.path().to_path_buf();
    let reference = run_ranks(2, move |pg| train(args(&r, 2), None, Some(pg)).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    // Per rank 6 micro-batches per epoch, GA 2: call 9 is in step 5; resume from checkpoint-4.
    let failed = run_ranks(2, move |pg| train(args(&d, 2), Some(Kill::AtMicroBatch(9)), Some(pg)).is_err());
    assert_eq!(failed, vec![true, true]);
    let d = dir.path().to_path_buf();
    let resumed = run_ranks(2, move |pg| {
        let mut a = args(&d, 2);
        a.resume_from_checkpoint = Some("latest".into());
        train(a, None, Some(pg)).unwrap()
    });
    assert_eq!(resumed, reference);
    assert_eq!(final_state(dir.path()), final_state(rd.path()));
}

#[test]
fn resuming_an_early_stopped_run_only_finishes_it() {
    let early = |out: &Path| TrainingArguments {
        num_train_epochs: 5.0,
        eval_strategy: IntervalStrategy::Epoch,
        save_strategy: SaveStrategy::Epoch,
        // The eval loss falls, which "greater is better" counts as no improvement: stops after the 2nd eval.
        metric_for_best_model: Some("loss".into()),
        greater_is_better: Some(true),
        early_stopping_patience: Some(1),
        load_best_model_at_end: true,
        save_total_limit: Some(1),
        ..args(out, 1)
    };
    let dir = tempfile::tempdir().unwrap();
    let finished = train(early(dir.path()), None, None).unwrap();
    let state = final_state(dir.path());
    assert_eq!(state["global_step"], 24, "stopped early after two of five epochs");
    let before = checkpoints(dir.path());

    let mut a = early(dir.path());
    a.resume_from_checkpoint = Some("latest".into());
    assert_eq!(train(a, None, None).unwrap(), finished, "the same (best) weights");
    assert_eq!(checkpoints(dir.path()), before, "nothing deleted or added");
    assert_eq!(final_state(dir.path()), state);
}

// ---- 3. A failed resume changes nothing; damaged files are named ----

#[test]
fn a_resume_from_a_truncated_or_flipped_weight_file_fails_naming_it_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = args(dir.path(), 1);
    a.report_to = ReportTo(vec!["jsonl".into()]);
    assert!(train(a.clone(), Some(Kill::AtMicroBatch(8)), None).is_err());
    let weights = dir.path().join("checkpoint-6/model.safetensors");
    let good = std::fs::read(&weights).unwrap();

    let mut resume = a.clone();
    resume.resume_from_checkpoint = Some("latest".into());
    resume.learning_rate = 0.01; // would rewrite training_args.yaml

    std::fs::write(&weights, &good[..good.len() / 2]).unwrap();
    let before = tree(dir.path());
    let err = train(resume.clone(), None, None).unwrap_err().to_string();
    assert!(err.contains("model.safetensors") && err.contains("checkpoint-6"), "{err}");
    assert_eq!(tree(dir.path()), before, "a failed resume changes no file");

    let mut flipped = good.clone();
    let i = flipped.len() - 17; // inside the tensor data: the file still parses
    flipped[i] ^= 0x40;
    std::fs::write(&weights, &flipped).unwrap();
    let before = tree(dir.path());
    let err = train(resume, None, None).unwrap_err().to_string();
    assert!(err.contains("model.safetensors") && err.contains("sha256"), "{err}");
    assert_eq!(tree(dir.path()), before);
}

// ---- 5b. A diverging loss stops training ----

#[test]
fn a_non_finite_loss_stops_training_naming_step_rank_and_last_finite_loss() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = args(dir.path(), 1);
    a.learning_rate = 1e30;
    a.warmup_steps = 0;
    a.lr_scheduler_type = accel::scheduler::SchedulerKind::Constant;
    a.save_steps = 1.0;
    let err = train(a, None, None).unwrap_err();
    assert!(matches!(err, TrainerError::NonFinite(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("global step") && msg.contains("rank 0") && msg.contains("last finite loss"), "{msg}");
    // No checkpoint holds non-finite weights.
    let saved = checkpoints(dir.path());
    assert!(!saved.is_empty() && saved.len() < 36, "{saved:?}");
    for c in saved {
        let w =
            accel::state::load_safetensors(&dir.path().join(&c).join("model.safetensors"), &candle_core::Device::Cpu)
                .unwrap();
        for (name, t) in w {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{c}/{name} holds non-finite weights");
        }
    }
}

#[test]
fn a_non_finite_loss_on_one_rank_stops_every_rank_at_the_same_step() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let errors = run_ranks(2, move |pg| {
        let rank = pg.rank();
        let calls = Arc::new(AtomicUsize::new(0));
        let loss = move |y: &candle_core::Tensor, t: &candle_core::Tensor| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let mut out = losses::cross_entropy(y, t)?;
            if rank == 1 && n >= 3 {
                // Infinite loss, finite gradient (d(x + c)/dx = 1): only the loss check can notice.
                out.loss_sum = out.loss_sum.affine(1.0, f64::INFINITY)?;
            }
            Ok(out)
        };
        let mut t = Trainer::new(args(&d, 1), Mlp::new, classification_data(90), None, loss).process_group(pg);
        t.train().unwrap_err().to_string()
    });
    for e in &errors {
        assert!(e.contains("global step 3") && e.contains("rank 1"), "{e}");
    }
}

/// `on_nonfinite_loss: skip_step`: rank 1's loss turns infinite at its 3rd micro-batch only; both ranks skip
/// exactly that optimizer step (weights and schedule stay), train on, and end with finite weights, the same on
/// both ranks, and different from a run that took every step.
#[test]
fn skip_step_drops_only_the_non_finite_step_on_every_rank() {
    let run = |skip_at: Option<usize>| {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        run_ranks(2, move |pg| {
            let rank = pg.rank();
            let calls = Arc::new(AtomicUsize::new(0));
            let loss = move |y: &candle_core::Tensor, t: &candle_core::Tensor| {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let mut out = losses::cross_entropy(y, t)?;
                if rank == 1 && Some(n) == skip_at {
                    out.loss_sum = out.loss_sum.affine(1.0, f64::INFINITY)?;
                }
                Ok(out)
            };
            let mut a = args(&d, 1);
            a.on_nonfinite_loss = trainer::NonFiniteLoss::SkipStep;
            a.max_steps = 5;
            let mut t = Trainer::new(a, Mlp::new, classification_data(90), None, loss).process_group(pg);
            let out = t.train().unwrap();
            (out.global_step, snapshot(&t))
        })
    };
    let skipped = run(Some(3));
    let all = run(None);
    assert_eq!(skipped[0].0, 5, "the global step still advances over the skipped step");
    assert_eq!(skipped[0].1, skipped[1].1, "both ranks skipped the same step");
    assert_ne!(skipped[0].1, all[0].1, "the skipped step left a trace-free but different trajectory");
    for (_, bits) in &skipped[0].1 {
        assert!(bits.iter().all(|b| f32::from_bits(*b).is_finite()));
    }
}
