//! Level 3: a Llama ([`accel::models::llama`]) on the shipped Shakespeare text with the Trainer — from scratch or
//! fine-tuned from a Hugging Face directory, at any layout — saved as a Hugging Face directory:
//!
//! ```text
//! cargo run -p accel-examples --bin train_llama                                  # 1 process
//! cargo run -p accel-examples --bin train_llama -- --nproc 4 --tp-size 2 --pp-size 2 --per-device-train-batch-size 4
//! cargo run -p accel-examples --bin train_llama -- --model-dir runs/train_llama/model --max-steps 50 \
//!     --output-dir runs/train_llama-finetuned
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

use accel::models::llama::{self, Llama, PretrainedWeights, SaveOptions};
use accel_examples::llama::{num_parameters, save_dtype, token_datasets, tokenizer_files};
use anyhow::Context;
use clap::Parser;
use trainer::{losses, IntervalStrategy, SaveStrategy, Trainer, TrainingArguments, TrainingArgumentsCli};

/// Global allocator: mimalloc keeps freed blocks for reuse (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "shared/layout_args.rs"]
mod layout_args;
#[path = "shared/llama_args.rs"]
mod llama_args;

/// Train a Llama on Shakespeare with the Trainer, data-, tensor- and/or pipeline-parallel.
#[derive(Parser, Debug)]
#[command(name = "train_llama", version)]
struct Cli {
    /// Processes to launch when not started by a launcher (RANK unset): pp × dp × tp.
    #[arg(long, default_value_t = 1, value_parser = accel_examples::parse_nproc)]
    nproc: usize,
    #[command(flatten)]
    layout: layout_args::LayoutArgs,
    #[command(flatten)]
    llama: llama_args::LlamaArgs,
    /// Tokens to generate greedily at the end (0: none; pp 1 only).
    #[arg(long, default_value_t = 40)]
    sample_tokens: usize,
    /// `auto`: the Accelerator chooses dp_replicate × dp_shard × tp × pp, the sharding, the pipeline schedule, the
    /// micro-batches and their size at start-up, from the model's described build, each process's memory and the
    /// links it measures; it prints the choice and why. Replaces the layout flags; the global batch is
    /// --per-device-train-batch-size × the processes × --gradient-accumulation-steps.
    #[arg(long, value_parser = ["auto"], ignore_case = true)]
    parallelism: Option<String>,
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

fn run() -> anyhow::Result<()> {
    // A bad command line is reported once under a launcher.
    let cli = accel_examples::parse_args!(Cli);
    // Checked once, here, before any worker starts: the files, the config, the sizes, where it saves.
    let args = cli.train.resolve(defaults())?;
    accel_examples::check_save_steps(&args, &defaults())?;
    let setup = cli.llama.setup(cli.layout.tp_size)?;
    let auto = cli.parallelism.is_some();
    if auto {
        cli.layout.check_unset_under_auto(&[])?;
    } else {
        let (layers, batch) = (setup.config.num_hidden_layers, args.per_device_train_batch_size);
        cli.layout.check(cli.nproc, layers, "--num-hidden-layers", None, "--per-device-train-batch-size", batch)?;
    }
    llama::check_save_dir(&args.output_dir.join("model"))?;
    let prompt = setup.tokenizer.encode(PROMPT, false).map_err(|e| anyhow::anyhow!("the prompt: {e}"))?;
    let max = setup.config.max_position_embeddings;
    anyhow::ensure!(
        cli.sample_tokens == 0 || prompt.get_ids().len() + cli.sample_tokens <= max,
        "--sample-tokens {} passes the model's max_position_embeddings ({max}) after the prompt: use fewer",
        cli.sample_tokens
    );
    if !ddp_core::launcher::is_worker() && cli.nproc > 1 {
        let exe = std::env::current_exe().context("locating this executable to launch its workers")?;
        let mut launch = ddp_core::LaunchConfig::local(cli.nproc, exe, std::env::args().skip(1).collect());
        launch.env.extend(match auto {
            true => accel::ParallelismConfig::auto().env_vars(), // every size chosen by the workers' Accelerator
            false => accel_examples::parallel_env(cli.nproc, &cli.layout.layout()),
        });
        ddp_core::launch(&launch)?; // its error is the one-line summary naming the failing rank
        return Ok(());
    }
    if !auto {
        accel_examples::apply_layout(&cli.layout.layout())?; // the sizes, unless the launcher set them
    }
    worker(cli, setup)
}

/// The greedy sample's prompt.
const PROMPT: &str = "ROMEO:";

fn worker(cli: Cli, setup: llama_args::LlamaSetup) -> anyhow::Result<()> {
    let args = cli.train.resolve(defaults())?;
    let out_dir = args.output_dir.join("model");
    let llama_args::LlamaSetup { config, tokenizer, tokenizer_path } = setup;
    // Read now: fine-tuning a directory in place replaces the files they come from.
    let tokenizer_files = tokenizer_files(&tokenizer_path)?;
    let (train, validation) = token_datasets(&cli.llama.text_path(), &tokenizer, cli.llama.seq_len)?;
    let weights = match &cli.llama.model_dir {
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
    if cli.parallelism.is_some() && !ddp_core::launcher::is_worker() {
        // One process without the launcher: the sizes `auto` here (a launched worker reads them from its env).
        trainer = trainer.parallelism_config(accel::ParallelismConfig::auto());
    }
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
    let options = SaveOptions { dtype: save_dtype(None, &config), files: tokenizer_files, ..Default::default() };
    llama::save_pretrained(&acc, prepared, &config, &out_dir, &options)?;
    acc.print(format!("saved {} (config.json, model.safetensors, tokenizer.json)", out_dir.display()));
    if cli.sample_tokens > 0 && acc.mesh().shape().pp == 1 {
        let model = trainer.model().expect("the trainer is set up after train()");
        let prompt = tokenizer.encode(PROMPT, false).map_err(|e| anyhow::anyhow!("the prompt: {e}"))?;
        let ids = model.generate_greedy(prompt.get_ids(), cli.sample_tokens)?;
        let text = tokenizer.decode(&ids, false).map_err(|e| anyhow::anyhow!("decoding the sample: {e}"))?;
        acc.print(format!("greedy sample:\n{text}"));
    }
    Ok(())
}
