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

/// Level 2 (`accel_mnist`) is reproducible like levels 1 and 3: `--seed` seeds the model initialisation, the shuffle
/// and the Accelerator, so two runs print the same losses and accuracies; another seed prints others.
#[test]
fn accel_mnist_runs_are_reproducible_for_a_seed() {
    let run = |seed: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_accel_mnist"))
            .args(["--nproc", "1", "--epochs", "1", "--hidden", "32", "--seed", seed])
            .env_remove("RANK")
            .output()
            .expect("running accel_mnist");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "accel_mnist failed:\n{text}");
        // The run banner, once, before the first step.
        let banner = "accel_mnist: config none: defaults | 1 process × 1 machine | dp_replicate 1 × dp_shard 1 × tp 1 \
                      × pp 1 | mixed precision no | gradient accumulation 1 | backend cpu";
        assert_eq!(text.lines().filter(|l| l.contains("config none")).collect::<Vec<_>>(), [banner], "{text}");
        // The epoch line without its wall time: "epoch 0: train loss …, test accuracy … (…/10000)".
        let line = text.lines().find(|l| l.contains("epoch 0: train loss")).expect("an epoch line").to_string();
        line.split(", test accuracy").next().unwrap().to_string()
            + line.split("test accuracy").nth(1).unwrap().split(')').next().unwrap()
    };
    let (a, b, c) = (run("7"), run("7"), run("8"));
    assert_eq!(a, b, "the same seed gives the same run");
    assert_ne!(a, c, "another seed gives another run");
}

/// Under `srun` a task has Slurm's variables but no RANK: ddp_mnist is then one worker of the Slurm job, as
/// docs/guide/cli.md ("Slurm") describes (it used to check RANK only and train alone in every task). Two tasks on
/// one node, with the variables srun sets and the ones the guide's batch script exports.
#[test]
fn slurm_tasks_form_one_job() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let task = |rank: &str| {
        Command::new(env!("CARGO_BIN_EXE_ddp_mnist"))
            .args(["--epochs", "1", "--hidden", "32"])
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .envs([("SLURM_PROCID", rank), ("SLURM_LOCALID", rank), ("SLURM_NODEID", "0")])
            .envs([("SLURM_NTASKS", "2"), ("SLURM_NTASKS_PER_NODE", "2")])
            .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str())])
            .envs([("ACCEL_RUN_TOKEN", "00112233445566778899aabbccddeeff"), ("RAYON_NUM_THREADS", "1")])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting ddp_mnist")
    };
    let (rank1, rank0) = (task("1"), task("0"));
    let mut outputs = Vec::new();
    for (rank, child) in [(0, rank0), (1, rank1)] {
        let out = child.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "task {rank} failed:\n{text}");
        outputs.push(text);
    }
    assert!(outputs[0].contains("2 ranks × batch 64 (global 128)"), "one job of two ranks:\n{}", outputs[0]);
    assert!(outputs[0].contains("/10000), "), "{}", outputs[0]);
    assert!(!outputs[1].contains("epoch 1/1"), "only rank 0 prints:\n{}", outputs[1]);
}

/// An Accelerate FSDP config (FULL_SHARD over the 2 processes, the variables `accel launch --config_file` sets for
/// one) trains the level-2 and level-3 programs — their MLP is built on accel's builder, so its layers fetch the
/// gathered weights at each forward — to the same printed losses and accuracies as plain DDP (with 2 ranks a
/// reduce-scatter sums the same two numbers an all-reduce does).
#[test]
fn an_fsdp_config_trains_the_mnist_programs_as_ddp_does() {
    let out_dir = tempfile::tempdir().unwrap();
    let run = |bin: &str, full_shard: bool| {
        let mut cmd = Command::new(bin);
        cmd.args(["--nproc", "2", "--hidden", "32"]).env_remove("RANK").env("RUST_BACKTRACE", "0");
        if bin.ends_with("train_mnist") {
            let dir = out_dir.path().join(if full_shard { "full_shard" } else { "ddp" });
            cmd.args(["--num-train-epochs", "1", "--output-dir", dir.to_str().unwrap()]);
        } else {
            cmd.args(["--epochs", "1"]);
        }
        if full_shard {
            cmd.env("FSDP_SHARDING_STRATEGY", "FULL_SHARD").env("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2");
        }
        let out = cmd.output().expect("running an MNIST example");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{bin} (FULL_SHARD {full_shard}) failed:\n{text}");
        let layout =
            if full_shard { "dp_replicate 1 × dp_shard 2 (FULL_SHARD)" } else { "dp_replicate 2 × dp_shard 1" };
        assert!(text.contains(layout), "{bin}: the banner shows {layout}:\n{text}");
        // Rank 0's losses and accuracies: its decimal figures up to a line's timings (`eval_runtime`, …), less
        // the durations (a figure followed by `s`).
        let figures = |l: &str| {
            let words: Vec<&str> = l
                .split("runtime")
                .next()
                .unwrap()
                .split([' ', ',', '|', '(', ')', ';'])
                .filter(|w| !w.is_empty())
                .collect();
            let timed = |i: usize| words.get(i + 1) == Some(&"s");
            (0..words.len())
                .filter(|&i| words[i].contains('.') && words[i].parse::<f64>().is_ok() && !timed(i))
                .map(|i| words[i].to_string())
                .collect::<Vec<_>>()
        };
        let lines: Vec<Vec<String>> = text
            .lines()
            .filter(|l| l.starts_with("[rank 0]") && (l.contains("loss") || l.contains("accuracy")))
            .filter(|l| !l.contains("train_runtime"))
            .map(figures)
            .collect();
        assert!(lines.len() >= 2 && lines.iter().all(|f| !f.is_empty()), "{bin}: figures found:\n{text}");
        lines
    };
    for bin in [env!("CARGO_BIN_EXE_accel_mnist"), env!("CARGO_BIN_EXE_train_mnist")] {
        assert_eq!(run(bin, true), run(bin, false), "{bin}: FULL_SHARD vs DDP");
    }
}
