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
