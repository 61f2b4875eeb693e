//! One run, one set of files: a run killed by SIGINT or SIGTERM leaves no lock behind (a real signal to a real
//! training process), and a new run in a directory holding another run's files — without checkpoints too — is
//! refused unless it overwrites them, after which only its own files are there.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{classification_data, Mlp};
use trainer::{
    losses, CallbackContext, ReportTo, SaveStrategy, Trainer, TrainerCallback, TrainerControl, TrainingArguments,
};

/// A run without checkpoints (as `train_gpt`'s default) that logs every step to `metrics.jsonl`.
fn args(out: &Path, max_steps: i64) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        max_steps,
        per_device_train_batch_size: 8,
        learning_rate: 0.05,
        save_strategy: SaveStrategy::No,
        logging_steps: 1.0,
        report_to: ReportTo(vec!["jsonl".into()]),
        save_plots: false,
        disable_tqdm: true,
        ..Default::default()
    }
}

fn train(a: TrainingArguments) -> trainer::Result<()> {
    let mut t = Trainer::new(a, Mlp::new, classification_data(90), None, losses::cross_entropy);
    t.train().map(|_| ())
}

/// The `step` of every line of the run's `metrics.jsonl` (the tracker folder is `runs/<output_dir's name>`).
fn logged_steps(out: &Path) -> Vec<u64> {
    let name = out.file_name().unwrap();
    let text = std::fs::read_to_string(out.join("runs").join(name).join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap()).collect()
}

fn global_step(out: &Path) -> u64 {
    let text = std::fs::read_to_string(out.join("trainer_state.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["global_step"].as_u64().unwrap()
}

#[test]
fn a_rerun_without_checkpoints_is_refused_and_overwrite_leaves_only_its_own_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpt");
    train(args(&out, 3)).unwrap();
    assert_eq!(logged_steps(&out), vec![1, 2, 3, 3], "3 loss logs and the final summary");
    // Curves the first run left (a build with `plots`); the second run plots nothing.
    std::fs::write(out.join("training_curves.png"), b"first run").unwrap();
    let before = std::fs::read_dir(&out).unwrap().count();

    let err = train(args(&out, 5)).unwrap_err().to_string();
    assert!(err.contains(&out.display().to_string()), "{err}");
    for name in ["trainer_state.json", "training_args.yaml", "training_curves.png", "runs/gpt"] {
        assert!(err.contains(name), "the refusal names {name}: {err}");
    }
    assert!(err.contains("--overwrite-output-dir true"), "{err}");
    assert!(err.contains("no checkpoint to resume it from"), "{err}");
    assert!(!err.contains("--resume-from-checkpoint"), "nothing to resume, so not offered: {err}");
    assert_eq!(logged_steps(&out), vec![1, 2, 3, 3], "a refused run appends nothing");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), before, "a refused run writes nothing");

    let mut again = args(&out, 5);
    again.overwrite_output_dir = true;
    train(again).unwrap();
    assert_eq!(logged_steps(&out), vec![1, 2, 3, 4, 5, 5], "only the second run's metrics");
    assert_eq!(global_step(&out), 5);
    assert!(!out.join("training_curves.png").exists(), "no curves of the first run beside the second's state");
    assert!(!out.join(".trainer.lock").exists());
}

#[test]
fn a_tracker_folder_outside_output_dir_is_the_runs_own_too() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("shared_logs");
    let with_logs = |out: &Path| TrainingArguments {
        logging_dir: Some(logs.clone()),
        run_name: Some("lr0.05".into()),
        ..args(out, 2)
    };
    train(with_logs(&dir.path().join("a"))).unwrap();
    // Another output_dir, but the same run name in the same logging_dir: its metrics would be appended there.
    let err = train(with_logs(&dir.path().join("b"))).unwrap_err().to_string();
    assert!(err.contains(&logs.join("lr0.05").display().to_string()), "{err}");
    assert!(err.contains("another run_name"), "{err}");
    assert!(!dir.path().join("b").join("trainer_state.json").exists());
}

/// Set in the child process of [`the_lock_is_released_when_sigint_or_sigterm_ends_a_run`]: its output directory.
const CHILD_ENV: &str = "TRAINER_TEST_SIGNAL_CHILD";
/// That test's name, for the child (this test binary re-run on it).
const SIGNAL_TEST: &str = "run_folders::the_lock_is_released_when_sigint_or_sigterm_ends_a_run";

/// Creates `ready` after the first optimizer step, then slows the run down so that it is still training when the
/// signal arrives.
struct Ready(PathBuf);

impl TrainerCallback for Ready {
    fn on_step_end(&mut self, _ctx: &CallbackContext, _control: &mut TrainerControl) -> trainer::Result<()> {
        if !self.0.exists() {
            std::fs::write(&self.0, b"").unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
        Ok(())
    }
}

#[test]
fn the_lock_is_released_when_sigint_or_sigterm_ends_a_run() {
    if let Some(out) = std::env::var_os(CHILD_ENV) {
        // The child: a run far longer than the test waits; only the signal ends it.
        let out = PathBuf::from(out);
        let mut t = Trainer::new(args(&out, 1_000_000), Mlp::new, classification_data(90), None, losses::cross_entropy)
            .callback(Ready(out.join("ready")));
        t.train().unwrap();
        panic!("the run was meant to be ended by a signal");
    }
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", SIGNAL_TEST, "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, &out)
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !out.join("ready").exists() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the training process ended before its first step: {status}");
            }
            assert!(start.elapsed() < Duration::from_secs(120), "the training process never reached its first step");
            std::thread::sleep(Duration::from_millis(20));
        }
        let lock = out.join(".trainer.lock");
        assert!(lock.exists(), "the run holds its lock while it trains");
        // SAFETY: a plain kill(2) to our own child, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(signal), "the process ends by the signal, as without the handler: {status}");
        assert!(!lock.exists(), "signal {signal}: the lock was released");
        // The next run in the directory finds no lock to take over (no stale-lock warning) and only the files of
        // the interrupted run, which it replaces.
        assert!(!std::fs::read_dir(&out).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains("lock")));
        let mut rerun = args(&out, 2);
        rerun.overwrite_output_dir = true;
        train(rerun).unwrap();
        assert_eq!(logged_steps(&out), vec![1, 2, 2]);
    }
}
