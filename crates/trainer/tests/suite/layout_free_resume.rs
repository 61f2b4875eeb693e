//! Layout-free resume: a checkpoint of a run on 2 ranks × 8 samples resumes on 1 rank × 16, on 4 ranks × 4, on
//! 2 ranks × 4 with GA 2 and on 1 rank × 8 with GA 2 — every layout whose optimizer step covers the same 16
//! samples — and each resumed run logs the uninterrupted 2-rank run's losses (the loss tally since the last log
//! and the run totals carried over to the new number of ranks) and ends with its weights; another global batch is
//! refused naming the per-device batch that keeps it, and a checkpoint written before the global batch was
//! recorded keeps the old rule (the same world size).

use std::path::{Path, PathBuf};

use crate::common::{classification_data, max_rel_diff, run_ranks, snapshot, Mlp};
use trainer::state::{LogEntry, TrainerState, TRAINER_STATE_NAME};
use trainer::{checkpoint, losses, Trainer, TrainingArguments};

type Snapshot = Vec<(String, Vec<u32>)>;

/// 96 samples: 6 optimizer steps of 16 per epoch in every layout below, with no `even_batches` padding.
const SAMPLES: usize = 96;
/// The checkpoint resumed from: epoch 2, step 3 of 6, one step after the log at step 8 (logging every 2).
const RESUME_AT: u64 = 9;

fn args(out: &Path, per_device: usize, ga: usize) -> TrainingArguments {
    TrainingArguments { per_device_train_batch_size: per_device, ..crate::resume::args(out, ga) }
}

/// Trains on `world` ranks (`per_device` samples each, accumulation `ga`) in `out`, resuming from its latest
/// checkpoint when `resume`; returns rank 0's state and every rank's final weights, or every rank's error.
fn train(
    out: &Path,
    world: usize,
    per_device: usize,
    ga: usize,
    resume: bool,
) -> Result<(TrainerState, Vec<Snapshot>), Vec<String>> {
    let out = out.to_path_buf();
    let results = run_ranks(world, move |pg| {
        let mut a = args(&out, per_device, ga);
        if resume {
            a.resume_from_checkpoint = Some("latest".into());
        }
        let mut t =
            Trainer::new(a, Mlp::new, classification_data(SAMPLES), None, losses::CrossEntropy).process_group(pg);
        t.train().map(|_| (t.state().clone(), snapshot(&t))).map_err(|e| e.to_string())
    });
    if results.iter().any(Result::is_err) {
        return Err(results.into_iter().filter_map(Result::err).collect());
    }
    let mut ok: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    let state = ok[0].0.clone();
    Ok((state, ok.drain(..).map(|(_, s)| s).collect()))
}

/// A new output directory holding a copy of `from/checkpoint-{step}` (the run that wrote it is left alone).
fn copy_checkpoint(from: &Path, step: u64) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let (src, dst) = (checkpoint::checkpoint_dir(from, step), checkpoint::checkpoint_dir(out.path(), step));
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    out
}

/// The uninterrupted run: 2 ranks × 8 samples, GA 1, 18 steps, a checkpoint at every step.
fn reference() -> (tempfile::TempDir, TrainerState, Snapshot) {
    let dir = tempfile::tempdir().unwrap();
    let (state, weights) = train(dir.path(), 2, 8, 1, false).unwrap();
    assert_eq!(weights[0], weights[1], "ranks agree");
    assert_eq!(state.global_step, 18);
    assert_eq!(
        (state.global_batch_size, state.data_parallel_size, state.steps_per_epoch, state.world_size),
        (Some(16), Some(2), Some(6), Some(2))
    );
    (dir, state, weights[0].clone())
}

/// The logged values that describe training (not the run times), by name.
fn training_values(e: &LogEntry) -> Vec<(String, f64)> {
    let timing = |k: &str| k.ends_with("_runtime") || k.ends_with("_per_second");
    e.values.iter().filter(|(k, _)| !timing(k)).map(|(k, v)| (k.clone(), *v)).collect()
}

/// Every log entry of `resumed` (the restored ones and those after the resume: loss, learning_rate, grad_norm,
/// and at the end train_loss) matches `reference`'s within 1e-5 relative, at the same steps and epochs.
fn assert_logs_match(resumed: &TrainerState, reference: &TrainerState, what: &str) {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1e-6);
    assert_eq!(resumed.log_history.len(), reference.log_history.len(), "{what}: {:?}", resumed.log_history);
    for (r, e) in resumed.log_history.iter().zip(&reference.log_history) {
        let (rv, ev) = (training_values(r), training_values(e));
        assert_eq!((r.step, rv.iter().map(|v| &v.0).collect::<Vec<_>>()), (e.step, ev.iter().map(|v| &v.0).collect()));
        assert!(close(r.epoch, e.epoch), "{what}: step {} epoch {} vs {}", r.step, r.epoch, e.epoch);
        for ((k, a), (_, b)) in rv.iter().zip(&ev) {
            assert!(close(*a, *b), "{what}: step {} {k} {a} vs the uninterrupted run's {b}", r.step);
        }
    }
    let logged_after = resumed.log_history.iter().filter(|e| e.step > RESUME_AT && e.get("loss").is_some()).count();
    assert_eq!(logged_after, 5, "{what}: losses logged at steps 10, 12, .., 18");
    assert!(resumed.log_history.last().unwrap().get("train_loss").is_some(), "{what}");
}

#[test]
fn a_checkpoint_resumes_at_another_number_of_processes_with_the_same_global_batch() {
    let (ref_dir, ref_state, ref_weights) = reference();
    // (ranks, per-device batch, GA): each step covers the same 16 samples of the epoch's order.
    for (world, per_device, ga) in [(1, 16, 1), (4, 4, 1), (2, 4, 2), (1, 8, 2)] {
        let what = format!("{world} rank(s) × {per_device} samples × GA {ga}");
        let out = copy_checkpoint(ref_dir.path(), RESUME_AT);
        let (state, weights) =
            train(out.path(), world, per_device, ga, true).unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!(state.global_step, 18, "{what}");
        assert_logs_match(&state, &ref_state, &what);
        for (rank, w) in weights.iter().enumerate() {
            let diff = max_rel_diff(w, &ref_weights);
            assert!(diff <= 1e-5, "{what}: rank {rank}'s final weights differ by {diff:e} (relative)");
        }
        // The checkpoints it wrote describe its own layout, and resume at it.
        let written =
            TrainerState::load_from_json(&checkpoint::checkpoint_dir(out.path(), 18).join(TRAINER_STATE_NAME)).unwrap();
        let dp = world as u64;
        assert_eq!(
            (written.global_batch_size, written.data_parallel_size, written.gradient_accumulation_steps),
            (Some(16), Some(dp), Some(ga as u64)),
            "{what}"
        );
        assert_eq!((written.world_size, written.loss_tally.len()), (Some(dp), world), "{what}");
    }
}

#[test]
fn another_global_batch_is_refused_naming_the_per_device_batch_that_keeps_it() {
    let ref_dir = tempfile::tempdir().unwrap();
    // 4 steps of 16 samples on 2 ranks: enough for a checkpoint.
    let out = ref_dir.path().to_path_buf();
    run_ranks(2, move |pg| {
        let a = TrainingArguments { max_steps: 4, ..args(&out, 8, 1) };
        Trainer::new(a, Mlp::new, classification_data(SAMPLES), None, losses::CrossEntropy)
            .process_group(pg)
            .train()
            .unwrap();
    });
    let out = copy_checkpoint(ref_dir.path(), 4);
    let before: Vec<PathBuf> = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().path()).collect();
    for (world, per_device, ga, fix) in [
        (1, 8, 1, "use --per-device-train-batch-size 16 on this layout (or --gradient-accumulation-steps 2)"),
        (4, 8, 1, "use --per-device-train-batch-size 4 on this layout"),
        (2, 4, 1, "use --per-device-train-batch-size 8 on this layout (or --gradient-accumulation-steps 2)"),
    ] {
        let errors = train(out.path(), world, per_device, ga, true).map(|_| ()).unwrap_err();
        let global = world * per_device * ga;
        for e in errors {
            assert!(
                e.contains(
                    "was written with a global batch of 16 samples per optimizer step (8 per device × 2 \
                     data-parallel processes × GA 1)"
                ) && e.contains(&format!("this run's is {global} ("))
                    && e.contains(fix),
                "{world} × {per_device} × GA {ga}: {e}"
            );
        }
    }
    let after: Vec<PathBuf> = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(after, before, "a refused resume writes nothing");
}

/// `trainer_state.json` of `dir/checkpoint-{step}` as a trainer without the global batch wrote it (the checksums
/// rewritten to match).
fn strip_the_global_batch(dir: &Path, step: u64) {
    let ckpt = checkpoint::checkpoint_dir(dir, step);
    let path = ckpt.join(TRAINER_STATE_NAME);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let obj = v.as_object_mut().unwrap();
    for key in ["global_batch_size", "data_parallel_size", "steps_per_epoch"] {
        assert!(obj.remove(key).is_some(), "{key} recorded");
    }
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    checkpoint::write_checksums(&ckpt, &[]).unwrap();
}

#[test]
fn a_checkpoint_without_the_global_batch_keeps_the_same_world_size_rule() {
    let (ref_dir, ref_state, ref_weights) = reference();
    // At another world size with the same global batch: today's refusal, naming both world sizes.
    let out = copy_checkpoint(ref_dir.path(), RESUME_AT);
    strip_the_global_batch(out.path(), RESUME_AT);
    let errors = train(out.path(), 1, 16, 1, true).map(|_| ()).unwrap_err();
    for e in errors {
        assert!(e.contains("was written by 2 processes but this run has 1") && e.contains("--nproc 2"), "{e}");
    }
    // At its own layout it resumes bit for bit, as before.
    let (state, weights) = train(out.path(), 2, 8, 1, true).unwrap();
    assert_eq!(weights[0], ref_weights);
    assert_eq!(weights[1], ref_weights);
    assert_logs_match(&state, &ref_state, "the same layout");
}
