//! `train_gpt`'s run folder as a user meets it: Ctrl-C (a real SIGINT to the running program, launcher or lone
//! process) leaves no lock, so the next run does not warn about a stale one; a stale lock left by a killed
//! process is reported once; a second run into the same folder (no checkpoints) is refused until it overwrites.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

/// A tiny, fast `train_gpt` run into `out` for `max_steps`, logging every step to `metrics.jsonl`.
fn train_gpt(out: &Path, nproc: usize, max_steps: u64, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train_gpt"));
    cmd.args(["--nproc", &nproc.to_string(), "--block-size", "16", "--sample-len", "0"])
        .args(["--max-steps", &max_steps.to_string(), "--logging-steps", "1", "--eval-steps", "1000000"])
        .args(["--per-device-train-batch-size", "4", "--per-device-eval-batch-size", "64"])
        .args(["--report-to", "jsonl", "--disable-tqdm", "true", "--output-dir"])
        .arg(out)
        .args(extra)
        .env_remove("RANK");
    cmd
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// `out/runs/<name>/metrics.jsonl` (the tracker folder of the default run name).
fn metrics(out: &Path) -> PathBuf {
    out.join("runs").join(out.file_name().unwrap()).join("metrics.jsonl")
}

/// Waits until the run has logged its first step (the lock is taken before that), then sends `signal`.
fn interrupt_when_training(child: &mut Child, out: &Path, signal: &str) -> ExitStatus {
    let start = Instant::now();
    while std::fs::read_to_string(metrics(out)).map_or(true, |t| t.is_empty()) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("train_gpt ended before its first logged step: {status}");
        }
        assert!(start.elapsed() < Duration::from_secs(300), "train_gpt logged no step in 300 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(out.join(".trainer.lock").exists(), "the run holds its lock while it trains");
    let kill = Command::new("kill").args(["-s", signal, &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    child.wait().unwrap()
}

#[test]
fn ctrl_c_releases_the_lock_and_the_rerun_does_not_warn() {
    // 1 process (the training process itself gets the signal) and 2 (the launcher gets it and forwards it).
    for nproc in [1, 2] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("gpt");
        // Output to a file: a pipe nobody reads could fill up and stall the run.
        let log = dir.path().join("interrupted.log");
        let file = std::fs::File::create(&log).unwrap();
        let mut child =
            train_gpt(&out, nproc, 1_000_000, &[]).stdout(file.try_clone().unwrap()).stderr(file).spawn().unwrap();
        let status = interrupt_when_training(&mut child, &out, "INT");
        let said = std::fs::read_to_string(&log).unwrap();
        assert!(!status.success(), "nproc {nproc}: {said}");
        if nproc == 1 {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(2), "ends by SIGINT, as without the lock's handler: {said}");
        } else {
            // The launcher stops its workers and exits 130, as a shell reports Ctrl-C, saying so once.
            assert_eq!(status.code(), Some(130), "{said}");
            let lines: Vec<&str> = said.lines().filter(|l| l.contains("interrupted")).collect();
            assert_eq!(lines, ["Error: launcher interrupted by SIGINT; its 2 worker(s) were stopped"], "{said}");
        }
        assert!(!out.join(".trainer.lock").exists(), "nproc {nproc}: the lock survived Ctrl-C");

        // The interrupted run's files are there (no checkpoint): the rerun must say how to start over...
        let refused = train_gpt(&out, 1, 2, &[]).output().unwrap();
        let said = text(&refused);
        assert!(!refused.status.success(), "{said}");
        assert!(said.contains("already holds another run's files") && said.contains("--overwrite-output-dir true"));
        // ...and with it, starts clean, without a word about a stale lock.
        let rerun = train_gpt(&out, 1, 2, &["--overwrite-output-dir", "true"]).output().unwrap();
        let said = text(&rerun);
        assert!(rerun.status.success(), "{said}");
        assert!(!said.contains("stale lock"), "nproc {nproc}: the rerun warned about a stale lock:\n{said}");
        assert!(said.contains("overwrite_output_dir: deleted"), "{said}");
        let steps: Vec<u64> = std::fs::read_to_string(metrics(&out))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps.iter().filter(|s| **s <= 2).count(), steps.len(), "only the rerun's metrics: {steps:?}");
    }
}

#[test]
fn a_stale_lock_is_reported_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpt");
    std::fs::create_dir_all(&out).unwrap();
    // A process that is gone, on this host.
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let host = trainer::checkpoint::host_name();
    std::fs::write(out.join(".trainer.lock"), format!(r#"{{"pid":{pid},"host":"{host}","started":1}}"#)).unwrap();
    let run = train_gpt(&out, 1, 2, &[]).output().unwrap();
    let said = text(&run);
    assert!(run.status.success(), "{said}");
    assert_eq!(said.matches("stale lock").count(), 1, "{said}");
    assert!(said.contains(&format!("taking over the stale lock of process {pid} on {host}")), "{said}");
    assert!(!out.join(".trainer.lock").exists());
}
