//! Level 3: a Llama ([`accel::models::llama`]) on the shipped Shakespeare text with the Trainer — from scratch or
//! fine-tuned from a Hugging Face directory, at any layout — saved as a Hugging Face directory:
//!
//! ```text
//! cargo run -p accel-examples --bin train_llama                                  # 1 process
//! cargo run -p accel-examples --bin train_llama -- --nproc 4 --tp-size 2 --pp-size 2 --per-device-train-batch-size 4
//! cargo run -p accel-examples --bin train_llama -- --model-dir runs/train_llama/model --max-steps 50
//! ```
//!
//! [`Trainer::with_plan`] builds the model, written once, on accel's builder laid out by `Llama::plan` (from the
//! seed, or from `--model-dir`'s weights: each rank reads its stages' tensors and keeps its slice), drives each
//! batch through the pipeline schedule under pp, evaluates the validation loss (and its perplexity) on the last
//! 5 % of the tokens, and [`losses::VocabParallelCrossEntropy`] reads the vocabulary-sharded logits where they
//! are. At the end the model is saved under `<output_dir>/model` as `config.json`, the weights and the
//! tokenizer, which transformers' `AutoModelForCausalLM` / `AutoTokenizer` load.
//!
//! Every training argument is a flag (`--learning-rate 1e-3`, `--max-steps 500`, ...) or comes from a YAML/JSON
//! file (`--config train.yaml`); `--help` lists them.

use std::path::PathBuf;

use accel::models::llama::{self, Llama, LlamaConfig, PretrainedWeights, SaveOptions};
use accel_examples::llama::{check_tp, copy_tokenizer, load_tokenizer, num_parameters, token_datasets, LlamaShape};
use anyhow::{bail, Context};
use clap::Parser;
use trainer::{losses, IntervalStrategy, SaveStrategy, Trainer, TrainingArguments, TrainingArgumentsCli};

/// Global allocator: mimalloc keeps freed blocks for reuse (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "shared/layout_args.rs"]
mod layout_args;

/// Train a Llama on Shakespeare with the Trainer, data-, tensor- and/or pipeline-parallel.
#[derive(Parser, Debug)]
#[command(name = "train_llama", version)]
struct Cli {
    /// Processes to launch when not started by a launcher (RANK unset): pp × dp × tp.
    #[arg(long, default_value_t = 1, value_parser = accel_examples::parse_nproc)]
    nproc: usize,
    #[command(flatten)]
    layout: layout_args::LayoutArgs,
    /// Fine-tune the model of this Hugging Face directory instead of training one from scratch.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    #[command(flatten)]
    shape: LlamaShape,
    /// Directory with shakespeare8.txt and tokenizer.json (default: the repository's data/shakespeare).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Tokens to generate greedily at the end (0: none; pp 1 only).
    #[arg(long, default_value_t = 40)]
    sample_tokens: usize,
    #[command(flatten)]
    train: TrainingArgumentsCli,
}

/// This example's defaults; the file given with `--config` and the flags override them.
fn defaults() -> TrainingArguments {
    TrainingArguments {
        output_dir: PathBuf::from("runs/train_llama"),
        max_steps: 200,
        per_device_train_batch_size: 8,
        per_device_eval_batch_size: 8,
        learning_rate: 1e-3,
        weight_decay: 0.1,
        lr_scheduler_type: accel::scheduler::SchedulerKind::Cosine,
        warmup_ratio: 0.05,
        max_grad_norm: 1.0,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(100.0),
        save_strategy: SaveStrategy::No,
        logging_steps: 25.0,
        ..TrainingArguments::default()
    }
}

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn text_path(cli: &Cli) -> PathBuf {
    match &cli.data_dir {
        Some(dir) => dir.join("shakespeare8.txt"),
        None => accel_examples::default_text_path(),
    }
}

fn tokenizer_fallback(cli: &Cli) -> PathBuf {
    match &cli.data_dir {
        Some(dir) => dir.join("tokenizer.json"),
        None => accel_examples::llama::default_tokenizer_path(),
    }
}

fn model_config(cli: &Cli, vocab_size: usize) -> anyhow::Result<LlamaConfig> {
    match &cli.model_dir {
        Some(dir) => Ok(LlamaConfig::from_pretrained(dir)?),
        None => cli.shape.config(vocab_size, cli.seq_len.max(2048)),
    }
}

fn run() -> anyhow::Result<()> {
    let cli = accel_examples::parse_args!(Cli); // a bad command line is reported once under a launcher
    if cli.model_dir.is_some() && !cli.shape.is_default() {
        bail!("--model-dir takes the model's shape from its config.json: drop the shape flags (--hidden-size, …)");
    }
    // Checked once, here, before any worker starts.
    let args = cli.train.resolve(defaults())?;
    let (tokenizer, _) = load_tokenizer(cli.model_dir.as_deref(), &tokenizer_fallback(&cli))?;
    let config = model_config(&cli, tokenizer.get_vocab_size(true))?;
    check_tp(&config, cli.layout.tp_size)?;
    let batch = args.per_device_train_batch_size;
    cli.layout.check(cli.nproc, config.num_hidden_layers, None, "--per-device-train-batch-size", batch)?;
    let path = text_path(&cli);
    anyhow::ensure!(path.is_file(), "--data-dir: no text at {}", path.display());
    if !ddp_core::launcher::is_worker() && cli.nproc > 1 {
        let exe = std::env::current_exe().context("locating this executable to launch its workers")?;
        let mut launch = ddp_core::LaunchConfig::local(cli.nproc, exe, std::env::args().skip(1).collect());
        launch.env.extend(accel_examples::parallel_env(cli.nproc, &cli.layout.layout()));
        ddp_core::launch(&launch)?; // its error is the one-line summary naming the failing rank
        return Ok(());
    }
    accel_examples::apply_layout(&cli.layout.layout())?; // the sizes, unless the launcher set PARALLELISM_CONFIG_*
    worker(cli)
}

fn worker(cli: Cli) -> anyhow::Result<()> {
    let args = cli.train.resolve(defaults())?;
    let out_dir = args.output_dir.join("model");
    let (tokenizer, tokenizer_path) = load_tokenizer(cli.model_dir.as_deref(), &tokenizer_fallback(&cli))?;
    let (train, validation) = token_datasets(&text_path(&cli), &tokenizer, cli.seq_len)?;
    let config = model_config(&cli, tokenizer.get_vocab_size(true))?;
    let weights = match &cli.model_dir {
        Some(dir) => Some(PretrainedWeights::open(dir, &config)?),
        None => None,
    };
    let build_config = config.clone();
    let mut trainer = Trainer::with_plan(
        args,
        Llama::plan(&config),
        move |vb| {
            let vb = match &weights {
                Some(w) => vb.with_weights(w.clone()), // each rank: its stages' tensors, its slice of each
                None => vb,
            };
            Llama::new(&build_config, vb).map_err(candle_core::Error::wrap)
        },
        train,
        Some(validation),
        losses::VocabParallelCrossEntropy { vocab_size: config.vocab_size },
    );
    let out = trainer.train()?;
    let eval = trainer.evaluate()?;
    let acc = trainer.accelerator().expect("the trainer is set up after train()").clone();
    let eval_loss = eval.get("eval_loss").copied().unwrap_or(f64::NAN);
    acc.print(format!(
        "\ntrain_llama: {} parameters, {} process(es) = pp {} × dp {} × tp {}; {} optimizer steps in {:.1} s, mean \
         training loss {:.4}; validation loss {eval_loss:.4} (perplexity {:.2})",
        num_parameters(&config),
        acc.world_size(),
        acc.mesh().shape().pp,
        acc.data_parallel_size(),
        acc.mesh().shape().tp,
        out.global_step,
        out.metrics.get("train_runtime").copied().unwrap_or_default(),
        out.training_loss,
        eval_loss.exp()
    ));
    let prepared = trainer.prepared_model().expect("the trainer is set up after train()");
    llama::save_pretrained(&acc, prepared, &config, &out_dir, &SaveOptions::default())?;
    if acc.is_main_process() {
        copy_tokenizer(&tokenizer_path, &out_dir)?;
    }
    acc.print(format!("saved {} (config.json, model.safetensors, tokenizer.json)", out_dir.display()));
    if cli.sample_tokens > 0 && acc.mesh().shape().pp == 1 {
        let model = trainer.model().expect("the trainer is set up after train()");
        let prompt = tokenizer.encode("ROMEO:", false).map_err(|e| anyhow::anyhow!("the prompt: {e}"))?;
        let ids = model.generate_greedy(prompt.get_ids(), cli.sample_tokens)?;
        let text = tokenizer.decode(&ids, false).map_err(|e| anyhow::anyhow!("decoding the sample: {e}"))?;
        acc.print(format!("greedy sample:\n{text}"));
    }
    Ok(())
}
