//! An elastic Trainer job (torchrun's `--nnodes 1:2`, two launchers on this host as two machines): machine 1 is
//! lost mid-run, machine 0 goes on alone from the newest checkpoint keeping the global batch (gradient
//! accumulation 2 instead of 2 data-parallel processes), machine 1 comes back and joins; the run ends with exit
//! 0 on both, at the right step, with the losses of a run that was never interrupted.
//!
//! Each machine is this test binary re-executed (`zz_machine`), running ddp-core's launcher on `train_gpt`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: usize = 120;
/// The char-GPT, 4 sequences per process, a checkpoint every 10 steps, resumed from the newest when restarted.
fn train_args(out: &Path, resume: bool) -> Vec<String> {
    let mut args: Vec<String> = [
        "--max-steps",
        "120",
        "--save-strategy",
        "steps",
        "--save-steps",
        "10",
        "--logging-steps",
        "1",
        "--per-device-train-batch-size",
        "4",
        "--eval-strategy",
        "no",
        "--sample-len",
        "0",
        "--output-dir",
    ]
    .map(String::from)
    .to_vec();
    args.push(out.display().to_string());
    if resume {
        args.extend(["--resume-from-checkpoint".into(), "latest".into()]);
    }
    args
}

/// Machine `rank` of the elastic job, as a launcher process of its own.
fn machine(rank: usize, port: u16, token: &str, out: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["elastic::zz_machine", "--exact", "--nocapture", "--test-threads=1", "-q"])
        .env("ELASTIC_TEST_MACHINE", format!("{rank} {port} {token} {}", out.display()))
        .env_remove("RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Entry point of the re-executed machines; does nothing in a normal test run.
#[test]
fn zz_machine() {
    let Ok(spec) = std::env::var("ELASTIC_TEST_MACHINE") else { return };
    let w: Vec<&str> = spec.splitn(4, ' ').collect();
    let mut cfg = ddp_core::LaunchConfig::local(1, env!("CARGO_BIN_EXE_train_gpt"), train_args(Path::new(w[3]), true));
    cfg.nnodes = 2;
    cfg.min_nnodes = Some(1);
    cfg.node_rank = w[0].parse().unwrap();
    cfg.master_port = w[1].parse().unwrap();
    cfg.max_restarts = 3;
    cfg.last_call = Duration::from_secs(1);
    cfg.rdzv_timeout = Duration::from_secs(120);
    cfg.env.push(("ACCEL_RUN_TOKEN".into(), w[2].into()));
    cfg.env.push(("ACCEL_TIMEOUT".into(), "30".into()));
    cfg.env.push(("RUST_BACKTRACE".into(), "0".into()));
    let code = match ddp_core::launch(&cfg) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("machine failed: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Waits (up to 120 s) for a complete checkpoint of `step` (its trainer_state.json is written last).
fn wait_for_checkpoint(out: &Path, step: usize) {
    let path = out.join(format!("checkpoint-{step}/trainer_state.json"));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The `loss` of every logged step of a run's final trainer_state.json, in step order.
fn losses(out: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(out.join("trainer_state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap();
    state["log_history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["step"].as_u64()?, e.get("loss")?.as_f64()?)))
        .collect()
}

#[test]
fn an_elastic_trainer_job_loses_a_machine_goes_on_and_takes_it_back() {
    let tmp = tempfile::tempdir().unwrap();
    // The uninterrupted run: 2 processes of 4 sequences, a global batch of 8.
    let reference = tmp.path().join("reference");
    let mut args = vec!["--nproc".to_string(), "2".into()];
    args.extend(train_args(&reference, false));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    super::gpt_tp::run_example(env!("CARGO_BIN_EXE_train_gpt"), &refs);
    let expected = losses(&reference);
    assert_eq!(expected.len(), STEPS);

    let out = tmp.path().join("elastic");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let token = "00112233445566778899aabbccddeeff";
    let m0 = machine(0, port, token, &out);
    let mut m1 = machine(1, port, token, &out);
    wait_for_checkpoint(&out, 20);
    m1.kill().unwrap(); // machine 1 lost: its launcher at once, its worker with it
    let _ = m1.wait();
    // Machine 0 alone (dp 1, accumulating 2 micro-batches) writes checkpoint 60 at the latest in that round.
    wait_for_checkpoint(&out, 60);
    let m1 = machine(1, port, token, &out);
    let (o0, o1) = (m0.wait_with_output().unwrap(), m1.wait_with_output().unwrap());
    let text0 = format!("{}{}", String::from_utf8_lossy(&o0.stdout), String::from_utf8_lossy(&o0.stderr));
    let text1 = format!("{}{}", String::from_utf8_lossy(&o1.stdout), String::from_utf8_lossy(&o1.stderr));
    assert!(o0.status.success() && o1.status.success(), "machine 0:\n{text0}\nmachine 1:\n{text1}");
    assert!(text0.contains("round 1: machine 1 left"), "{text0}");
    assert!(
        text0.contains(
            "keeping the checkpoint's global batch of 8 samples at 1 data-parallel process(es): per-device batch 4, \
             gradient_accumulation_steps 2"
        ),
        "{text0}"
    );
    assert!(text0.contains("round 2: machine 1 joined"), "{text0}");
    assert!(text1.contains("round 2: machine 1 joined"), "{text1}");
    // The global batch was kept at every size: nothing says the updates differ from the original run's.
    let warned = |t: &str| t.contains("now sees another global batch");
    assert!(!warned(&text0) && !warned(&text1), "{text0}\n{text1}");

    let got = losses(&out);
    assert_eq!(got.iter().map(|l| l.0).collect::<Vec<_>>(), (1..=STEPS as u64).collect::<Vec<_>>(), "{text0}");
    // Rounds at dp 1 × GA 2 sum the gradients in another order than dp 2: f32 rounding only (measured 4.5e-8).
    let worst = got.iter().zip(&expected).map(|(a, b)| (a.1 - b.1).abs() / b.1).fold(0.0, f64::max);
    assert!(worst < 1e-5, "largest relative loss difference {worst:.2e}:\n{got:?}\n{expected:?}");
}

/// A restarted attempt of a launch adopts the files its earlier attempt left before any checkpoint (the marker holds
/// a digest of the launch's run token), and trains from the start when `latest` finds no checkpoint; the files of a
/// run with another token stay refused.
#[test]
fn a_restarted_attempt_adopts_only_its_own_launchs_files() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let attempt = |token: &str, restart: &str| {
        Command::new(env!("CARGO_BIN_EXE_train_gpt"))
            .args(["--max-steps", "2", "--sample-len", "0", "--eval-strategy", "no", "--output-dir"])
            .arg(&out)
            .args(["--resume-from-checkpoint", "latest"])
            .env_remove("RANK")
            .env("ACCEL_MAX_RESTARTS", "1")
            .env("ACCEL_RESTART_COUNT", restart)
            .env("ACCEL_RUN_TOKEN", token)
            .output()
            .unwrap()
    };
    let text = |o: &std::process::Output| {
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };
    let ours = "0123456789abcdef0123456789abcdef";
    let first = attempt(ours, "0");
    assert!(first.status.success(), "{}", text(&first));
    assert!(text(&first).contains("holds no checkpoint yet: training from the start"), "{}", text(&first));
    assert!(text(&first).contains("a restart starts over"), "{}", text(&first));
    assert!(out.join("trainer_state.json").is_file() && out.join(".accel-launch").is_file());
    let again = attempt(ours, "1");
    assert!(again.status.success(), "the launch's own files are adopted:\n{}", text(&again));
    let other = attempt("ffeeddccbbaa99887766554433221100", "0");
    assert!(!other.status.success(), "another launch's files are refused:\n{}", text(&other));
    assert!(text(&other).contains("already holds another run's files"), "{}", text(&other));
}
