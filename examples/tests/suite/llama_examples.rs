//! The Llama examples end to end: `accel_llama` prints the single-process losses at tp 2 × pp 2 and FULL_SHARD,
//! saves a Hugging Face directory that a fine-tuning run (another layout) starts from exactly, and `train_llama`
//! trains at tp 2 × pp 2; `accel_llama --parallelism auto` chooses its layout from the model's described build and
//! predicts its peak memory within 40 %; bad command lines are refused before any worker starts.

use crate::gpt_tp::{logged_losses, run_example};
use std::process::Command;

/// A tiny Llama (two layers of width 64, 4 heads over 2 key/value heads), short sequences, two logged steps.
#[rustfmt::skip]
const TINY: &[&str] = &[
    "--hidden-size", "64", "--intermediate-size", "128", "--num-hidden-layers", "2", "--num-attention-heads", "4",
    "--num-key-value-heads", "2", "--seq-len", "32", "--steps", "2", "--log-every", "1", "--eval-batches", "2",
    "--sample-tokens", "5",
];

fn validation_loss(out: &str) -> f64 {
    let line =
        out.lines().find(|l| l.contains("validation loss ")).unwrap_or_else(|| panic!("no validation loss:\n{out}"));
    line.split("validation loss ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap()
}

/// Validation losses equal to 1e-5 relative (the sums run in another order at another layout).
fn assert_same_loss(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() <= 1e-5 * want, "{what}: validation loss {got} vs {want}");
}

#[test]
fn accel_llama_trains_alike_at_every_layout_and_resumes_from_its_directory() {
    let bin = env!("CARGO_BIN_EXE_accel_llama");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    let dir_arg = dir.to_str().unwrap();
    let single = run_example(bin, &[TINY, &["--batch-size", "4", "--output-dir", dir_arg]].concat());
    let losses = logged_losses(&single);
    assert_eq!(losses.len(), 2, "two logged steps:\n{single}");
    assert!(single.contains("greedy sample:\nROMEO:"), "{single}");
    // The same global batch of 4 sequences: --batch-size is per data-parallel replica.
    for layout in [
        &["--nproc", "4", "--tp-size", "2", "--pp-size", "2", "--microbatches", "2", "--batch-size", "4"][..],
        &["--nproc", "2", "--dp-shard-size", "2", "--sharding-strategy", "FULL_SHARD", "--batch-size", "2"][..],
    ] {
        let other = tmp.path().join("other");
        let out = run_example(bin, &[layout, TINY, &["--output-dir", other.to_str().unwrap()]].concat());
        assert_eq!(logged_losses(&out), losses, "{layout:?}:\n{out}");
        assert_same_loss(validation_loss(&out), validation_loss(&single), &format!("{layout:?}:\n{out}"));
    }
    for file in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(dir.join(file).is_file(), "{file} missing from the saved directory");
    }
    // Fine-tuning from the directory at another layout, at learning rate 0: the saved model, exactly.
    let again = tmp.path().join("again");
    let resumed = run_example(
        bin,
        &[
            "--nproc",
            "2",
            "--tp-size",
            "2",
            "--model-dir",
            dir_arg,
            "--lr",
            "0",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--steps",
            "1",
            "--eval-batches",
            "2",
            "--sample-tokens",
            "0",
            "--output-dir",
            again.to_str().unwrap(),
        ],
    );
    assert!(resumed.contains(&format!("fine-tuned from {dir_arg}")), "{resumed}");
    assert_same_loss(validation_loss(&resumed), validation_loss(&single), &resumed);
    // `--steps 0` evaluates and saves the directory's model as it is.
    let evaluated = run_example(
        bin,
        &[
            "--model-dir",
            dir_arg,
            "--steps",
            "0",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--eval-batches",
            "2",
            "--sample-tokens",
            "0",
            "--output-dir",
            tmp.path().join("zero").to_str().unwrap(),
        ],
    );
    assert!(evaluated.contains("--steps 0, no training"), "{evaluated}");
    // Fine-tuning in place keeps the tokenizer (read at start-up, written in the same commit) and the other files.
    std::fs::write(dir.join("README.md"), "my model").unwrap();
    run_example(
        bin,
        &[
            "--model-dir",
            dir_arg,
            "--output-dir",
            dir_arg,
            "--steps",
            "1",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--eval-batches",
            "0",
            "--sample-tokens",
            "0",
        ],
    );
    for file in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"] {
        assert!(dir.join(file).is_file(), "{file} lost by fine-tuning in place");
    }
    assert_eq!(validation_loss(&evaluated), validation_loss(&single), "{evaluated}");
}

#[test]
fn accel_llama_chooses_its_layout_from_the_model() {
    let bin = env!("CARGO_BIN_EXE_accel_llama");
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("auto");
    let args =
        ["--nproc", "2", "--parallelism", "auto", "--global-batch-size", "8", "--steps", "2", "--log-every", "1"];
    let rest = ["--eval-batches", "0", "--sample-tokens", "0", "--output-dir", out_dir.to_str().unwrap()];
    let out = run_example(bin, &[&args[..], &rest].concat());
    // The default 11.0 M-parameter Llama, its shape read from its build, not given by hand.
    let model = "model n_layer 6, d_model 384, 6 heads, d_ff 1024, vocab 2048, seq 128 (11 015 040 parameters)";
    assert!(out.contains(&format!("auto layout for 2 processes (1 machine × 2 processes): {model}")), "{out}");
    assert!(out.contains("auto_layout flags: --tp-size"), "{out}");
    assert_eq!(logged_losses(&out).len(), 2, "{out}");
    // The choice depends on what the probe measures (a loaded machine picks pipelines of micro-batch 1, whose
    // fixed costs the memory model under-counts by up to about a third: docs/guide/04-nd-parallel-auto-layout.md).
    let (predicted, measured) = crate::auto_layout::predicted_and_measured(&out);
    assert!((predicted / measured - 1.0).abs() <= 0.4, "predicted {predicted} MiB, measured {measured} MiB:\n{out}");
    assert!(out_dir.join("model.safetensors").is_file());
}

#[test]
fn train_llama_trains_at_tp2_pp2() {
    let bin = env!("CARGO_BIN_EXE_train_llama");
    let tmp = tempfile::tempdir().unwrap();
    let shape = &TINY[..10]; // the model's shape flags
    let args = |nproc: &'static str, out: &str| -> Vec<String> {
        let mut a: Vec<String> = ["--nproc", nproc, "--max-steps", "2", "--logging-steps", "1", "--eval-steps", "100"]
            .iter()
            .chain(shape)
            .chain(&["--seq-len", "32", "--per-device-train-batch-size", "4", "--sample-tokens", "0"])
            .map(|s| s.to_string())
            .collect();
        a.extend(["--output-dir".into(), out.into()]);
        a
    };
    let losses = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| !l.contains("[rank 1]") && !l.contains("[rank 2]") && !l.contains("[rank 3]"))
            .filter_map(|l| l.split("| loss ").nth(1).map(|r| r.split(' ').next().unwrap().to_string()))
            .collect()
    };
    let one = tmp.path().join("one");
    let a = args("1", one.to_str().unwrap());
    let single = run_example(bin, &a.iter().map(String::as_str).collect::<Vec<_>>());
    let mut b = args("4", tmp.path().join("nd").to_str().unwrap());
    b.extend(["--tp-size", "2", "--pp-size", "2"].map(String::from));
    let nd = run_example(bin, &b.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(losses(&single).len(), 2, "{single}");
    assert_eq!(losses(&nd), losses(&single), "tp2 × pp2:\n{nd}");
    assert!(one.join("model/model.safetensors").is_file());
}

#[test]
fn llama_examples_refuse_what_cannot_run_before_launching() {
    let refused = |bin: &str, args: &[&str]| -> String {
        let out = Command::new(bin).args(args).env_remove("RANK").output().expect("running the example");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{bin} {args:?} was accepted:\n{text}");
        text
    };
    for bin in [env!("CARGO_BIN_EXE_accel_llama"), env!("CARGO_BIN_EXE_train_llama")] {
        let text = refused(bin, &["--nproc", "4", "--tp-size", "4"]);
        assert!(text.contains("tp size 4 does not divide num_key_value_heads = 2"), "{text}");
        assert_eq!(text.matches("does not divide").count(), 1, "one message, not one per rank:\n{text}");
        let text = refused(bin, &["--model-dir", "somewhere", "--hidden-size", "64"]);
        assert!(text.contains("--model-dir takes the model's shape from its config.json"), "{text}");
        let text = refused(bin, &["--model-dir", "/nonexistent/llama"]);
        assert!(text.contains("--model-dir /nonexistent/llama is not a directory"), "{text}");
        let text = refused(bin, &["--nproc", "2", "--tp-size", "2", "--intermediate-size", "1023"]);
        assert!(text.contains("tp size 2 does not divide intermediate_size = 1023"), "{text}");
        let text = refused(bin, &["--nproc", "2", "--pp-size", "2", "--num-hidden-layers", "1"]);
        assert!(text.contains("use more layers (--num-hidden-layers 2)"), "{text}");
        let text = refused(bin, &["--nproc", "2", "--parallelism", "auto", "--tp-size", "2"]);
        assert!(text.contains("--parallelism auto chooses the layout, and --tp-size 2 would fix part of it"), "{text}");
        // Where it would save is checked before training, not after it.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("notes.txt"), "mine").unwrap();
        let out = tmp.path().to_str().unwrap();
        let text = match bin.ends_with("accel_llama") {
            true => refused(bin, &["--output-dir", out]),
            false => {
                let model = tmp.path().join("model");
                std::fs::create_dir_all(&model).unwrap();
                std::fs::write(model.join("notes.txt"), "mine").unwrap();
                refused(bin, &["--output-dir", out, "--overwrite-output-dir", "true"])
            }
        };
        assert!(text.contains("is not a model directory") && !text.contains("step 1"), "{text}");
    }
}

/// `--save-steps` without a save strategy that uses it (the Trainer examples default to `no`) is refused, naming
/// the flag to add, instead of training without saving.
#[test]
fn save_steps_without_a_save_strategy_is_refused() {
    for bin in [env!("CARGO_BIN_EXE_train_gpt"), env!("CARGO_BIN_EXE_train_llama")] {
        let out = Command::new(bin).args(["--save-steps", "2"]).env_remove("RANK").output().expect("running it");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{bin} accepted it:\n{text}");
        assert!(text.contains("add --save-strategy steps"), "{text}");
    }
}
