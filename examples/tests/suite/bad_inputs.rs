//! Inputs that used to be accepted and silently did something else: each is refused with a clear message
//! before any worker starts.

use std::process::Command;

fn refused(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).env_remove("RANK").output().expect("running the example");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{bin} {args:?} was accepted:\n{text}");
    text
}

#[test]
fn nproc_zero_is_refused_by_every_example() {
    for bin in [env!("CARGO_BIN_EXE_train_mnist"), env!("CARGO_BIN_EXE_accel_mnist"), env!("CARGO_BIN_EXE_ddp_mnist")] {
        let text = refused(bin, &["--nproc", "0"]);
        assert!(text.contains("--nproc") && text.contains("at least 1"), "{bin}:\n{text}");
    }
}

#[test]
fn launch_self_refuses_zero_processes() {
    let err = ddp_core::launcher::launch_self(0).unwrap_err().to_string();
    assert!(err.contains("nproc is 0"), "{err}");
}

/// The guides and the programs' doc headers build with the README's profile (the dev profile, which optimises
/// dependencies; see Cargo.toml), so a user following them builds once.
#[test]
fn docs_and_headers_use_the_dev_profile() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs"), root.join("examples/src/bin"), root.join("benches/src/bin")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md" || e == "rs") {
                files.push(path);
            }
        }
    }
    assert!(files.len() > 10, "{files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, line) in text.lines().enumerate() {
            for bad in ["cargo run --release", "cargo build --release", "target/release/"] {
                assert!(!line.contains(bad), "{}:{}: `{bad}` (use the dev profile): {line}", file.display(), i + 1);
            }
        }
    }
}

/// `--data-dir` that does not exist: the message names the directory searched and the files expected, and does not
/// tell the user to pass the flag they passed.
#[test]
fn missing_data_dir_names_the_directory() {
    for bin in [env!("CARGO_BIN_EXE_accel_mnist"), env!("CARGO_BIN_EXE_ddp_mnist"), env!("CARGO_BIN_EXE_train_mnist")] {
        let text = refused(bin, &["--nproc", "1", "--data-dir", "/nonexistent/mnist"]);
        assert!(text.contains("/nonexistent/mnist"), "{bin}:\n{text}");
        assert!(text.contains("labels-idx1-ubyte"), "{bin}: names the expected files:\n{text}");
        assert!(!text.contains("pass --data-dir"), "{bin}:\n{text}");
    }
}

/// The guide's `train.yaml` (docs/guide/03-trainer.md) works as written with `train_mnist --config train.yaml`,
/// and `--epochs` is accepted as `--num-train-epochs`: both get past argument validation to the data check (a
/// missing `--data-dir` here, so that nothing trains).
#[test]
fn guide_train_yaml_and_epochs_alias_are_accepted() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let guide = std::fs::read_to_string(root.join("docs/guide/03-trainer.md")).unwrap();
    let start = guide.find("```yaml\n# train.yaml").expect("the guide's train.yaml block") + "```yaml\n".len();
    let yaml = &guide[start..start + guide[start..].find("```").unwrap()];
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("train.yaml");
    std::fs::write(&file, yaml).unwrap();
    let bin = env!("CARGO_BIN_EXE_train_mnist");
    for args in [
        vec!["--config", file.to_str().unwrap(), "--nproc", "1"],
        vec!["--epochs", "3"],
        vec!["--num-train-epochs", "3"],
    ] {
        let mut argv = args.clone();
        argv.extend(["--data-dir", "/nonexistent/mnist"]);
        let text = refused(bin, &argv);
        assert!(text.contains("--data-dir /nonexistent/mnist: no MNIST files there"), "{args:?}:\n{text}");
    }
}

#[test]
fn best_checkpoint_line_names_the_metric_that_chose_it() {
    assert_eq!(
        accel_examples::best_checkpoint_line("runs/x/checkpoint-426", "accuracy", 0.961),
        "best checkpoint: runs/x/checkpoint-426 (validation accuracy 0.9610)"
    );
    assert_eq!(
        accel_examples::best_checkpoint_line("runs/x/checkpoint-100", "eval_loss", 0.2012),
        "best checkpoint: runs/x/checkpoint-100 (validation loss 0.2012)"
    );
}

/// Every rank of a two-process run fails with the same error: it is printed once (the first failing rank's
/// report, through the launcher), then the launcher's one-line summary naming the rank — and no backtrace, even
/// with `RUST_BACKTRACE=1` set, as many Rust users have it.
#[test]
fn an_error_on_every_rank_is_printed_once_without_a_backtrace() {
    let out = Command::new(env!("CARGO_BIN_EXE_accel_mnist"))
        .args(["--nproc", "2", "--data-dir", "/nonexistent/mnist"])
        .env_remove("RANK")
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("running accel_mnist");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    let reports: Vec<&&str> = lines.iter().filter(|l| l.contains("/nonexistent/mnist does not exist")).collect();
    assert_eq!(reports.len(), 1, "one copy of the error:\n{text}");
    assert!(reports[0].starts_with("[rank ") && reports[0].contains("] Error: data: MNIST directory"), "{text}");
    let summary: Vec<&&str> = lines.iter().filter(|l| l.contains("failed first")).collect();
    assert_eq!(summary.len(), 1, "{text}");
    assert!(summary[0].starts_with("Error: worker rank ") && summary[0].ends_with("the other workers were stopped"));
    assert!(!lines.iter().any(|l| l.trim_start().starts_with("0: ") || l.contains("stack backtrace")), "{text}");
    assert_eq!(lines.len(), 2, "nothing else:\n{text}");
}
