//! `accel_gpt --save-every` and `--resume` (Accelerate's `save_state()` / `load_state()` under automatic naming): a
//! run stopped after a checkpoint at step 3 and resumed goes on with the uninterrupted run's losses — bit for bit at
//! the same layout, written in place or in the background (`--async-checkpointing`), and within 1e-4 at dp 2 with
//! the same global batch (the gradients sum in another order).

use super::gpt_tp::{logged_losses, run_example};

/// The char-GPT, 6 steps of 8 sequences, a loss logged every step.
const RUN: [&str; 10] = ["--steps", "6", "--log-every", "1", "--sample-len", "0", "--seed", "3", "--batch-size", "8"];

#[test]
fn accel_gpt_resumes_from_its_checkpoints() {
    let bin = env!("CARGO_BIN_EXE_accel_gpt");
    let whole = logged_losses(&run_example(bin, &RUN));
    assert_eq!(whole.len(), 6);
    for background in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let project = tmp.path().to_str().unwrap();
        let mut first = [&RUN[..], &["--save-every", "3", "--project-dir", project]].concat();
        first[1] = "3"; // stopped after step 3
        if background {
            first.push("--async-checkpointing");
        }
        let stopped = run_example(bin, &first);
        assert_eq!(logged_losses(&stopped), whole[..3], "background {background}:\n{stopped}");
        assert!(tmp.path().join("checkpoints/checkpoint_0/accelerator.json").is_file(), "{stopped}");
        let resumed = run_example(bin, &[&RUN[..], &["--resume", "--project-dir", project]].concat());
        assert!(resumed.contains("checkpoint_0 at step 3"), "{resumed}");
        assert_eq!(logged_losses(&resumed), whole[3..], "background {background}:\n{resumed}");
        // Asked for fewer steps than the checkpoint has: said, nothing trained.
        let mut behind = [&RUN[..], &["--resume", "--project-dir", project]].concat();
        behind[1] = "2";
        let said = run_example(bin, &behind);
        assert!(said.contains("--steps 2: the checkpoint is there already, nothing to train"), "{said}");
        if background {
            // Another layout, the same global batch: 2 data-parallel replicas of 4 sequences.
            let mut dp2 = [&RUN[..], &["--resume", "--project-dir", project, "--nproc", "2"]].concat();
            dp2[9] = "4";
            let resumed = run_example(bin, &dp2);
            let got = logged_losses(&resumed);
            assert_eq!(got.len(), 3, "{resumed}");
            for (a, b) in got.iter().zip(&whole[3..]) {
                let (a, b): (f64, f64) = (a.parse().unwrap(), b.parse().unwrap());
                assert!((a - b).abs() <= 1e-4 * b, "dp 2: loss {a} vs {b}:\n{resumed}");
            }
        }
    }
}
