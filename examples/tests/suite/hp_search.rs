//! `train_mnist --hp-search`: a small study runs to its table, and an explicit `--output-dir` is where the study
//! lands (over the file's `study_dir`), as HF puts a search's trials under `output_dir`.

use std::process::Command;

#[test]
fn an_explicit_output_dir_holds_the_study() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("hp.yaml"),
        "metric: eval_accuracy\nn_trials: 2\nprocesses: 1\nstudy_dir: from_the_file\nparams:\n  \
         learning_rate: {type: float, low: 1.0e-3, high: 3.0e-3, log: true}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_train_mnist"))
        .current_dir(dir.path())
        .args(["--hp-search", "hp.yaml", "--output-dir", "study", "--num-train-epochs", "1", "--train-size", "1000"])
        .env_remove("RANK")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let study = dir.path().join("study");
    assert!(study.join("study.jsonl").is_file(), "{text}");
    assert!(study.join("trial-0000").is_dir() && study.join("trial-0001").is_dir(), "{text}");
    assert!(!dir.path().join("from_the_file").exists(), "the file's study_dir was used despite --output-dir");
    // Both trials completed and the table names the best one, with a value that is an accuracy.
    let best = text.lines().find(|l| l.starts_with("best trial ")).unwrap_or_else(|| panic!("{text}"));
    let value: f64 = best.split("eval_accuracy = ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!((0.3..=1.0).contains(&value), "{best}");
}

/// Optuna's `study.optimize(n_trials=N)`: run again on the same study, `--n-trials 1` runs one more trial, and the
/// first line says so.
#[test]
fn a_resumed_study_runs_n_trials_more_and_says_so_first() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("hp.yaml"),
        "metric: eval_accuracy\nn_trials: 5\nprocesses: 1\nstudy_dir: study\nparams:\n  \
         learning_rate: {type: float, low: 1.0e-3, high: 3.0e-3, log: true}\n",
    )
    .unwrap();
    let run = || {
        let out = Command::new(env!("CARGO_BIN_EXE_train_mnist"))
            .current_dir(dir.path())
            .args(["--hp-search", "hp.yaml", "--n-trials", "1", "--num-train-epochs", "1", "--train-size", "1000"])
            .env_remove("RANK")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{text}");
        text
    };
    let first_line = |text: &str| text.lines().find(|l| l.starts_with("[hp]")).unwrap_or_default().to_string();

    let text = run();
    // The driver names the study file by its canonical path.
    let file = dir.path().join("study").canonicalize().unwrap().join("study.jsonl");
    assert_eq!(first_line(&text), format!("[hp] new study {}: running 1 trial(s) (0)", file.display()));
    assert!(text.contains("hyperparameter search: 1 trials ("), "{text}");

    let text = run();
    assert_eq!(
        first_line(&text),
        format!(
            "[hp] resuming {}: 1 finished trial(s) kept; running 1 more (n_trials counts this run's trials, as \
             Optuna's optimize(n_trials=N)): 1 new: 1",
            file.display()
        )
    );
    assert!(text.contains("hyperparameter search: 2 trials (") && text.contains("), 1 of them run now in"), "{text}");
    let study = dir.path().join("study");
    assert!(study.join("trial-0001").is_dir() && !study.join("trial-0002").exists(), "{text}");
}
