//! Exact resume: a run interrupted at various points (mid-epoch, at an epoch boundary, inside a gradient
//! accumulation window, on 1 and 2 ranks) and resumed from its latest checkpoint ends with bit-identical
//! parameters to an uninterrupted run; a checkpoint with another global batch is refused (resuming at another
//! layout with the same global batch: `layout_free_resume.rs`).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::{classification_data, run_ranks, snapshot, Mlp};
use accel::dist::ProcessGroup;
use trainer::{losses, ReportTo, SaveStrategy, Trainer, TrainingArguments};

/// The resume tests' arguments (also the base of the safety tests').
pub(crate) fn args(out: &Path, ga: usize) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        num_train_epochs: 3.0,
        per_device_train_batch_size: 8,
        gradient_accumulation_steps: ga,
        learning_rate: 0.05,
        warmup_steps: 2,
        lr_scheduler_type: accel::scheduler::SchedulerKind::Cosine,
        save_strategy: SaveStrategy::Steps,
        save_steps: 1.0,
        logging_steps: 2.0,
        report_to: ReportTo(vec!["none".into()]),
        save_plots: false,
        disable_tqdm: true,
        ..Default::default()
    }
}

type Snapshot = Vec<(String, Vec<u32>)>;

/// Trains on 90 samples; the loss function fails at its `fail_at`-th call (a crash inside the loop). Returns
/// the final parameters, or None when the run failed.
fn run(out: &Path, ga: usize, fail_at: Option<usize>, resume: bool, pg: Option<ProcessGroup>) -> Option<Snapshot> {
    run_saving(out, ga, fail_at, resume, pg, false)
}

/// [`run`], its checkpoints written in the background when `background` (`async_checkpointing`).
fn run_saving(
    out: &Path,
    ga: usize,
    fail_at: Option<usize>,
    resume: bool,
    pg: Option<ProcessGroup>,
    background: bool,
) -> Option<Snapshot> {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let loss = move |y: &candle_core::Tensor, t: &candle_core::Tensor| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        if Some(n) == fail_at {
            candle_core::bail!("injected failure at micro-batch {n}");
        }
        losses::cross_entropy(y, t)
    };
    let mut a = args(out, ga);
    a.async_checkpointing = background;
    if resume {
        a.resume_from_checkpoint = Some("latest".into());
    }
    let mut t = Trainer::new(a, Mlp::new, classification_data(90), None, loss);
    if let Some(pg) = pg {
        t = t.process_group(pg);
    }
    match t.train() {
        Ok(_) => Some(snapshot(&t)),
        Err(e) => {
            assert!(fail_at.is_some(), "unexpected failure: {e}");
            assert!(e.to_string().contains("injected failure"), "{e}");
            None
        }
    }
}

fn interrupted_then_resumed(ga: usize, fail_at: usize) -> Snapshot {
    let dir = tempfile::tempdir().unwrap();
    assert!(run(dir.path(), ga, Some(fail_at), false, None).is_none());
    run(dir.path(), ga, None, true, None).expect("resumed run finishes")
}

#[test]
fn resume_is_bit_exact_without_accumulation() {
    let reference = run(tempfile::tempdir().unwrap().path(), 1, None, false, None).unwrap();
    // 90 samples / batch 8 = 12 micro-batches per epoch = 12 steps. Fail in step 7 (resume from checkpoint-6,
    // mid-epoch) and in step 13 (resume from checkpoint-12, an epoch boundary).
    for fail_at in [7, 13] {
        assert_eq!(interrupted_then_resumed(1, fail_at), reference, "interrupted at micro-batch {fail_at}");
    }
}

/// Checkpoints written in the background (a save every step, each waiting for the previous; the crash's pending
/// save completed as the run ends) resume as exactly as those written in place, on 1 and 2 ranks, and hold the
/// same weights, optimizer state and checksums.
#[test]
fn resume_is_bit_exact_from_checkpoints_written_in_the_background() {
    let sync_dir = tempfile::tempdir().unwrap();
    let reference = run(sync_dir.path(), 1, None, false, None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    assert!(run_saving(dir.path(), 1, Some(7), false, None, true).is_none());
    assert_eq!(run_saving(dir.path(), 1, None, true, None, true).unwrap(), reference, "resumed from checkpoint-6");
    for file in ["model.safetensors", "optimizer.safetensors", "scheduler.json", "checksums.json"] {
        let (a, b) = (sync_dir.path().join("checkpoint-6").join(file), dir.path().join("checkpoint-6").join(file));
        assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "{file} differs");
    }
    trainer::checkpoint::verify_checksums(&dir.path().join("checkpoint-6")).unwrap();

    let two = tempfile::tempdir().unwrap();
    let d = two.path().to_path_buf();
    let reference = run_ranks(2, move |pg| run(&d, 2, None, false, Some(pg)).unwrap());
    let d = two.path().join("background");
    let resumed = run_ranks(2, move |pg| {
        assert!(run_saving(&d, 2, Some(7), false, Some(pg.clone()), true).is_none());
        run_saving(&d, 2, None, true, Some(pg), true).unwrap()
    });
    assert_eq!(resumed, reference);
}

#[test]
fn resume_is_bit_exact_inside_accumulation_windows() {
    // GA = 5 over 12 micro-batches: windows of 5, 5, 2 (3 steps per epoch).
    let reference = run(tempfile::tempdir().unwrap().path(), 5, None, false, None).unwrap();
    // 8: inside step 2's window (resume at step 1, skipping 5 micro-batches); 13: first micro-batch of epoch 2
    // (resume at step 3, an epoch boundary after a short window); 19: inside step 5 (resume at step 4).
    for fail_at in [8, 13, 19] {
        assert_eq!(interrupted_then_resumed(5, fail_at), reference, "interrupted at micro-batch {fail_at}");
    }
}

#[test]
fn resume_is_bit_exact_on_two_ranks_and_refuses_another_global_batch() {
    let reference_dir = tempfile::tempdir().unwrap();
    let rd = reference_dir.path().to_path_buf();
    let reference = run_ranks(2, move |pg| run(&rd, 2, None, false, Some(pg)).unwrap());
    assert_eq!(reference[0], reference[1], "ranks agree");

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    // Per rank: 45 samples → 6 micro-batches of 8 per epoch, GA 2 → 3 steps per epoch. Call 9 is the first
    // micro-batch of step 5 (epoch 2): resume from checkpoint-4, mid-epoch.
    let failed = run_ranks(2, move |pg| run(&d, 2, Some(9), false, Some(pg)));
    assert!(failed.iter().all(Option::is_none));
    let d = dir.path().to_path_buf();
    let resumed = run_ranks(2, move |pg| run(&d, 2, None, true, Some(pg)).unwrap());
    assert_eq!(resumed[0], reference[0]);
    assert_eq!(resumed[1], reference[0]);

    // The same checkpoints on one process with the same per-device batch: half the global batch, refused, naming
    // both global batches and the per-device batch that keeps it.
    let mut a = args(dir.path(), 2);
    a.resume_from_checkpoint = Some("latest".into());
    let mut t = Trainer::new(a, Mlp::new, classification_data(90), None, losses::cross_entropy);
    let err = t.train().unwrap_err().to_string();
    assert!(
        err.contains(
            "was written with a global batch of 32 samples per optimizer step (8 per device × 2 data-parallel \
             processes × GA 2); this run's is 16 (8 per device × 1 data-parallel process × GA 2)"
        ) && err.contains("use --per-device-train-batch-size 16 on this layout"),
        "{err}"
    );
}
