//! The level-1 main job end to end: `ddp_mnist` launches its own worker processes (loopback only), trains on the
//! shipped MNIST subset and reports the test accuracy over all 10 000 test images.

use std::process::Command;

/// Runs the example with `args`; returns its stdout + stderr after asserting it succeeded.
fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ddp_mnist"))
        .args(args)
        .env_remove("RANK")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running ddp_mnist");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "ddp_mnist {args:?} failed ({}):\n{text}", out.status);
    text
}

/// The final accuracy printed by rank 0: `final test accuracy 0.9592 after …`.
fn final_accuracy(text: &str) -> f64 {
    let line =
        text.lines().find(|l| l.contains("final test accuracy")).unwrap_or_else(|| panic!("no final line:\n{text}"));
    let value = line.split("final test accuracy ").nth(1).and_then(|s| s.split_whitespace().next()).unwrap();
    value.parse().unwrap()
}

/// The documented default run (2 processes, 10 epochs, 784-256-10, AdamW lr 2e-3, batch 64 per rank) reaches
/// the target of 0.95 on t10k.
#[test]
fn two_process_default_run_reaches_95_percent() {
    let text = run(&["--nproc", "2", "--min-accuracy", "0.95"]);
    assert!(text.contains("[rank 0] epoch 10/10: train loss"), "rank 0 reports every epoch:\n{text}");
    assert!(!text.contains("[rank 1] epoch"), "only rank 0 prints progress:\n{text}");
    let acc = final_accuracy(&text);
    assert!(acc >= 0.95, "final accuracy {acc}:\n{text}");
}

/// With 3 ranks the test set (10 000) does not split evenly: the sampler's padding must not be counted.
#[test]
fn uneven_sharding_counts_every_test_image_once() {
    let text = run(&["--nproc", "3", "--epochs", "1"]);
    assert!(text.contains("/10000), "), "accuracy counts over exactly 10000 images:\n{text}");
    assert!(final_accuracy(&text) > 0.85, "one epoch already learns most of MNIST:\n{text}");
}
