//! The MNIST MLP at the Trainer level — the README's first command:
//!
//! ```text
//! cargo run -p accel-examples --bin train_mnist
//! cargo run -p accel-examples --bin train_mnist -- --resume-from-checkpoint latest
//! ```
//!
//! Without `RANK` in the environment it launches `--nproc` copies of itself (default 2) with
//! `ddp_core::launch`, which set RANK / WORLD_SIZE / MASTER_ADDR / ...; each copy is a data-parallel worker. The
//! Trainer does the rest: 9 000 training images (the first 9 000 of the shipped `train10k`), evaluation on the
//! other 1 000 every epoch, a checkpoint every epoch (the best and the newest kept), early stopping on validation
//! accuracy, the best model reloaded at the end, curves in `output_dir/training_curves.{png,svg}`; then the test
//! accuracy on the 10 000 `t10k` images.
//!
//! Every training argument can be given as a flag (`--learning-rate 3e-4`, `--num-train-epochs 3`, ...) or in a
//! YAML/JSON file (`--config train.yaml`); `--help` lists them.
//!
//! Guide markers: `// guide:begin NAME` … `// guide:end NAME` mark the regions `args`, `job`, `data`, `model`,
//! `loop` and `eval`, which docs/guide/00-levels.md compares with the same regions of `ddp_mnist.rs` and `accel_mnist.rs`.
//! The test `guide_diffs` (examples/tests/suite) fails when the chapter's diffs no longer match them; after
//! changing a marked region, `ACCEL_BLESS_GUIDE=1 cargo test -p accel-examples --test suite guide_diffs`
//! rewrites the diffs (then check the chapter's text under each).
//!
//! Hyperparameter search: `--hp-search examples/hp_mnist.yaml` runs a study instead of one training (the search
//! space, sampler, pruner and process budget are in the file; `--n-trials`, `--hp-processes` and `--output-dir`
//! (the study directory) override it).
//! Trial 0 uses this program's settings (the flags' values), so the table compares the best trial with them:
//!
//! ```text
//! cargo run -p accel-examples --bin train_mnist -- --hp-search examples/hp_mnist.yaml \
//!     --n-trials 20 --num-train-epochs 2 --train-size 4000
//! ```

use std::path::PathBuf;

use accel::data::{load_mnist, Dataset, TensorDataset};
use accel_examples::{default_data_dir, Mlp};
use clap::Parser;
use trainer::hpsearch::{HyperparameterSearch, Params, TrialState};
use trainer::{losses, metrics, IntervalStrategy, SaveStrategy, Trainer, TrainingArguments, TrainingArgumentsCli};

/// Global allocator: mimalloc keeps freed blocks for reuse, where glibc's malloc returns large ones to the kernel
/// and faults them in again on the next step (candle allocates every temporary anew: thousands of page faults per
/// training step). Measured in docs/benchmarks.md ("Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// guide:begin args
/// Train an MLP on MNIST with the Trainer, data-parallel over several processes.
#[derive(Parser, Debug)]
#[command(name = "train_mnist", version)]
struct Cli {
    /// Processes to launch when not started by a launcher (ignored inside a worker); 1 trains in this process.
    #[arg(long, default_value_t = 2, value_parser = accel_examples::parse_nproc)]
    nproc: usize,
    /// Hidden layer widths, comma-separated (784-…-10).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    hidden: Vec<usize>,
    /// Directory with {train10k,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (default: the repository's data/mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Training samples taken from train10k (the rest is the validation set).
    #[arg(long, default_value_t = 9000)]
    train_size: usize,
    /// Run a hyperparameter search described by this YAML file instead of one training.
    #[arg(long, value_name = "FILE")]
    hp_search: Option<PathBuf>,
    /// Trials this run starts (overrides the file's n_trials); a resumed study runs N more (Optuna's optimize).
    #[arg(long, value_name = "N")]
    n_trials: Option<usize>,
    /// Process budget of the search (overrides the file's `processes`).
    #[arg(long, value_name = "N")]
    hp_processes: Option<usize>,
    #[command(flatten)]
    train: TrainingArgumentsCli,
}

/// This example's defaults; the file given with `--config` and the flags override them.
fn defaults() -> TrainingArguments {
    TrainingArguments {
        output_dir: PathBuf::from("runs/train_mnist"),
        num_train_epochs: 10.0,
        per_device_train_batch_size: 64,
        per_device_eval_batch_size: 500,
        learning_rate: 3e-3,
        weight_decay: 0.01,
        lr_scheduler_type: accel::scheduler::SchedulerKind::Linear,
        warmup_ratio: 0.05,
        eval_strategy: IntervalStrategy::Epoch,
        save_strategy: SaveStrategy::Epoch,
        save_total_limit: Some(2),
        load_best_model_at_end: true,
        metric_for_best_model: Some("accuracy".into()),
        early_stopping_patience: Some(2),
        early_stopping_threshold: 0.0,
        logging_steps: 35.0,
        ..TrainingArguments::default()
    }
}
// guide:end args

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn run() -> anyhow::Result<()> {
    let cli = accel_examples::parse_args!(Cli); // a bad command line is reported once under a launcher
                                                // Check the arguments and the data once, here, before any worker starts: one clear message instead of one
                                                // per rank.
    let args = cli.train.resolve(defaults())?;
    let data_dir = cli.data_dir.clone().unwrap_or_else(default_data_dir);
    anyhow::ensure!(
        data_dir.join("t10k-labels-idx1-ubyte.gz").exists() || data_dir.join("t10k-labels-idx1-ubyte").exists(),
        "--data-dir {}: no MNIST files there (expected t10k-labels-idx1-ubyte[.gz] and the other IDX files)",
        data_dir.display()
    );
    if let Some(path) = args.resume_from_checkpoint.as_deref().filter(|p| *p != "latest") {
        anyhow::ensure!(
            std::path::Path::new(path).is_dir(),
            "--resume-from-checkpoint {path}: no such checkpoint directory (give a checkpoint-N directory or `latest`)"
        );
    }
    if let Some(file) = cli.hp_search.clone() {
        return hp_search(&cli, &file);
    }
    if ddp_core::launcher::launch_self(cli.nproc)? {
        return Ok(());
    }
    worker(cli)
}

/// The first `--train-size` images of train10k for training, the rest for validation.
fn train_validation(cli: &Cli) -> anyhow::Result<(TensorDataset, TensorDataset)> {
    let data_dir = cli.data_dir.clone().unwrap_or_else(default_data_dir);
    let all = load_mnist(&data_dir, "train10k")?;
    let n = all.len();
    anyhow::ensure!(cli.train_size < n, "--train-size must be below the {n} images of train10k");
    Ok((all.narrow(0, cli.train_size)?, all.narrow(cli.train_size, n - cli.train_size)?))
}

/// `--hp-search`: a study over the file's space; every trial trains a fresh MLP (a `hidden` parameter sets the
/// hidden width, the others are training arguments) and is evaluated on the validation images.
fn hp_search(cli: &Cli, file: &std::path::Path) -> anyhow::Result<()> {
    let base = cli.train.resolve(defaults())?;
    let mut search = HyperparameterSearch::from_yaml_file(file)?;
    if let Some(n) = cli.n_trials {
        search = search.n_trials(n);
    }
    if let Some(p) = cli.hp_processes {
        search = search.processes(p);
    }
    // An explicit --output-dir holds the study (HF puts its trials under output_dir too), over the file's study_dir.
    if let Some(dir) = &cli.train.output_dir {
        search = search.study_dir(dir);
    }
    // Trial 0 runs this program's own settings: the baseline the search has to beat.
    let base_json = serde_json::to_value(&base)?;
    let baseline: Params = search
        .config()
        .space
        .names()
        .filter_map(|name| {
            let v = if name == "hidden" {
                Some(serde_json::Value::from(cli.hidden[0]))
            } else {
                base_json.get(name).cloned()
            };
            v.map(|v| (name.to_string(), v))
        })
        .collect();
    let search = search.enqueue_trial(baseline);
    let metric = search.config().metric.clone();
    let summary = search.run_trainer(|trial| {
        let args = trial.training_args(&base)?;
        let hidden = match trial.params().contains_key("hidden") {
            true => vec![trial.get_usize("hidden")?],
            false => cli.hidden.clone(),
        };
        let (train, validation) = train_validation(cli).map_err(|e| trainer::TrainerError::Usage(format!("{e:#}")))?;
        let mlp = move |vb| Mlp::on_builder(vb, &hidden);
        Ok(Trainer::with_plan(args, Mlp::plan(), mlp, train, Some(validation), losses::CrossEntropy)
            .compute_metrics(metrics::classification))
    })?;
    let Some(summary) = summary else { return Ok(()) }; // a trial's process: its trial is done
    let default = summary.trial(0).and_then(|t| t.value.filter(|_| t.state == TrialState::Complete));
    if let (Some(default), Some(best)) = (default, summary.best.as_ref()) {
        println!(
            "default settings (trial 0): {metric} {default:.4}   best trial {}: {metric} {:.4} ({:+.4})",
            best.number,
            best.value.unwrap_or(f64::NAN),
            best.value.unwrap_or(f64::NAN) - default
        );
    }
    anyhow::ensure!(summary.best.is_some(), "no trial of the search completed (see the table above)");
    Ok(())
}

fn worker(cli: Cli) -> anyhow::Result<()> {
    // guide:begin job
    let args = cli.train.resolve(defaults())?;
    // guide:end job
    // guide:begin data
    let data_dir = cli.data_dir.clone().unwrap_or_else(default_data_dir);
    let (train_set, validation_set) = train_validation(&cli)?;
    let test_set = load_mnist(&data_dir, "t10k")?;
    // guide:end data

    // guide:begin model
    let hidden = cli.hidden.clone();
    let mut trainer = Trainer::with_plan(
        args,
        Mlp::plan(),
        move |vb| Mlp::on_builder(vb, &hidden),
        train_set,
        Some(validation_set),
        losses::CrossEntropy,
    )
    .compute_metrics(metrics::classification);
    // guide:end model

    // guide:begin loop
    let out = trainer.train()?;
    // guide:end loop
    // guide:begin eval
    let test_metrics = trainer.evaluate_dataset(test_set, "test")?;
    let accuracy = test_metrics.get("test_accuracy").copied().unwrap_or(f64::NAN);
    // guide:end eval

    let acc = trainer.accelerator().expect("the trainer is set up after train()").clone();
    let args = trainer.args();
    acc.print(format!(
        "\nreached optimizer step {} ({:.2} epochs) on {} processes; this run: {:.1} s, mean training loss {:.4}",
        out.global_step,
        out.metrics.get("epoch").copied().unwrap_or_default(),
        acc.world_size(),
        out.metrics.get("train_runtime").copied().unwrap_or_default(),
        out.training_loss
    ));
    if let (Some(best), Some(metric)) = (&trainer.state().best_model_checkpoint, trainer.state().best_metric) {
        let best_metric_name = args.metric_for_best_model.as_deref().unwrap_or("loss");
        acc.print(accel_examples::best_checkpoint_line(best, best_metric_name, metric));
    }
    acc.print(format!(
        "test accuracy (t10k, 10000 images): {accuracy:.4}   test loss {:.4}",
        test_metrics.get("test_loss").copied().unwrap_or(f64::NAN)
    ));
    acc.print(format!(
        "files: {0}/checkpoint-*/  {0}/trainer_state.json  {0}/training_curves.png|svg  {1}/",
        args.output_dir.display(),
        args.tracker_dir().display()
    ));
    Ok(())
}
