//! Level 2: a Llama ([`accel::models::llama`], transformers' `LlamaForCausalLM`) on the shipped Shakespeare text
//! with the Accelerator — trained from scratch, or fine-tuned from a Hugging Face directory — at any layout of
//! data, tensor and pipeline parallelism, saved as a Hugging Face directory that transformers loads:
//!
//! ```text
//! cargo run -p accel-examples --bin accel_llama                                   # 1 process, 11.0 M parameters
//! cargo run -p accel-examples --bin accel_llama -- --nproc 2 --tp-size 2          # tp2
//! cargo run -p accel-examples --bin accel_llama -- --nproc 4 --tp-size 2 --pp-size 2 --microbatches 4
//! cargo run -p accel-examples --bin accel_llama -- --nproc 2 --dp-shard-size 2 --sharding-strategy FULL_SHARD
//! cargo run -p accel-examples --bin accel_llama -- --nproc 4 --parallelism auto --global-batch-size 16
//! cargo run -p accel-examples --bin accel_llama -- --model-dir runs/accel_llama --steps 50   # fine-tune it
//! ```
//!
//! The text is tokenized with a byte-level BPE of 2048 ids (`data/shakespeare/tokenizer.json`,
//! `scripts/train-tokenizer.py`; a `--model-dir` with its own `tokenizer.json` brings its own) into windows of
//! `--seq-len` tokens, 95 % for training and 5 % for validation. The model is built by the Accelerator's builder
//! under transformers' plan (`Llama::plan`: q/k/v/gate/up column-wise, o/down row-wise, embedding and head
//! vocab-parallel), each rank building the blocks of its pipeline stages — from the seed, or from the directory's
//! weights, each rank reading only its stages' tensors and keeping its slice. Each batch runs through
//! `pipeline_backward` (the schedule under pp; the plain forward, loss and overlapped backward at pp 1).
//!
//! It prints the loss every `--log-every` steps with the throughput (tokens/s over all replicas, the first
//! interval excluded as warm-up), the validation loss and perplexity, every rank's peak RSS, and a greedy sample;
//! then `--output-dir` holds `config.json`, `model.safetensors` (or shards with `--max-shard-size`) and
//! `tokenizer.json`: `LlamaForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load it.
//!
//! The lines that differ from a plain single-process candle loop are marked `// accel:`.

use accel::auto_layout::ModelSpec;
use accel::data::TokenDataset;
use accel::models::llama::{self, Llama, PretrainedWeights, SaveOptions};
use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, DataLoader, DataLoaderConfig, MixedPrecision};
use accel::{Dataset, ReduceKind};
use accel_examples::llama::{num_parameters, save_dtype, token_datasets, tokenizer_files};
use anyhow::{bail, Context};
use candle_core::Tensor;
use candle_nn::VarMap;
use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;

/// Global allocator: mimalloc keeps freed blocks for reuse (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "shared/auto_args.rs"]
mod auto_args;
#[path = "shared/layout_args.rs"]
mod layout_args;
#[path = "shared/llama_args.rs"]
mod llama_args;

/// A Llama on Shakespeare at level 2: the Accelerator, data × tensor × pipeline parallel, Hugging Face
/// directories in and out.
#[derive(Parser, Debug)]
#[command(name = "accel_llama", version)]
struct Args {
    /// Processes to launch on this machine when not started by a launcher (RANK unset): pp × dp × tp.
    #[arg(long, default_value_t = 1, value_parser = accel_examples::parse_nproc)]
    nproc: usize,
    #[command(flatten)]
    layout: layout_args::LayoutArgs,
    #[command(flatten)]
    auto: auto_args::AutoArgs,
    #[command(flatten)]
    llama: llama_args::LlamaArgs,
    /// Where the trained model goes, as a Hugging Face directory (a model directory there is replaced, keeping
    /// its other files; anything else is refused before training).
    #[arg(long, default_value = "runs/accel_llama")]
    output_dir: PathBuf,
    /// The weights' dtype on disk: f32, bf16 or f16 (default: the --model-dir's, else f32).
    #[arg(long, value_parser = ["f32", "bf16", "f16"])]
    save_dtype: Option<String>,
    /// Shard the weights into files of at most this many bytes (with model.safetensors.index.json).
    #[arg(long)]
    max_shard_size: Option<u64>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Sequences per micro-batch per data-parallel replica (under --parallelism auto the size is chosen, and this
    /// × the processes is the default --global-batch-size).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Clip the gradient norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// Seed of the initial weights (drawn on the full model: every layout starts from the same), and the shuffle.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// no | fp16 | bf16 (default: ACCELERATE_MIXED_PRECISION, else no).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// Micro-batches per optimizer step (default: ACCELERATE_GRADIENT_ACCUMULATION_STEPS, else 1).
    #[arg(long)]
    gradient_accumulation_steps: Option<usize>,
    /// Recompute each decoder layer's activations in the backward pass instead of keeping them.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Print the loss every this many optimizer steps.
    #[arg(long, default_value_t = 25)]
    log_every: u64,
    /// Validation batches (of the global batch's sequences, on every rank) to evaluate at the end (0: none).
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
    /// Tokens to generate greedily at the end (0: none; pp 1 only).
    #[arg(long, default_value_t = 40)]
    sample_tokens: usize,
    /// The sample's prompt.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
}

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn run() -> anyhow::Result<()> {
    // A bad command line is reported once under a launcher.
    let args = accel_examples::parse_args!(Args);
    // Everything checked once, here, before any worker starts: the files, the config, the sizes, where it saves.
    let setup = args.llama.setup(args.layout.tp_size)?;
    args.auto.check(&args.layout, &[("--gradient-accumulation-steps", args.gradient_accumulation_steps.is_some())])?;
    if !args.auto.is_auto() {
        let layers = setup.config.num_hidden_layers;
        args.layout.check(args.nproc, layers, "--num-hidden-layers", None, "--batch-size", args.batch_size)?;
    }
    llama::check_save_dir(&args.output_dir)?;
    check_sample(&args, &setup)?;
    if !ddp_core::launcher::is_worker() && args.nproc > 1 {
        let exe = std::env::current_exe().context("locating this executable to launch its workers")?;
        let mut launch = ddp_core::LaunchConfig::local(args.nproc, exe, std::env::args().skip(1).collect());
        launch.env.extend(args.auto.launch_env(args.nproc, &args.layout)); // accel: the sizes, or `auto`
        ddp_core::launch(&launch)?; // its error is the one-line summary naming the failing rank
        return Ok(());
    }
    if !args.auto.is_auto() {
        accel_examples::apply_layout(&args.layout.layout())?; // the flags, unless the launcher set them
    }
    train(&args, setup)
}

/// The prompt and the sample's tokens fit the model's positions (checked before training, not after it).
fn check_sample(args: &Args, setup: &llama_args::LlamaSetup) -> anyhow::Result<()> {
    let prompt = setup.tokenizer.encode(args.prompt.as_str(), false).map_err(|e| anyhow::anyhow!("--prompt: {e}"))?;
    let (n, max) = (prompt.get_ids().len(), setup.config.max_position_embeddings);
    anyhow::ensure!(
        args.sample_tokens == 0 || n + args.sample_tokens <= max,
        "--prompt ({n} tokens) and --sample-tokens {} pass the model's max_position_embeddings ({max}): use \
         --sample-tokens {} or less",
        args.sample_tokens,
        max.saturating_sub(n)
    );
    Ok(())
}

fn train(args: &Args, setup: llama_args::LlamaSetup) -> anyhow::Result<()> {
    let mut cfg = AcceleratorConfig::from_env()?; // accel: sizes from PARALLELISM_CONFIG_*
    if let Some(mp) = args.mixed_precision {
        cfg.mixed_precision = mp;
    }
    if let Some(ga) = args.gradient_accumulation_steps {
        cfg.gradient_accumulation_steps = ga;
    }
    cfg.seed = Some(args.seed);
    cfg.activation_checkpointing |= args.activation_checkpointing;
    if args.auto.is_auto() {
        cfg.parallelism = accel::ParallelismConfig::auto(); // accel: every size chosen at start-up
    }
    let llama_args::LlamaSetup { config, tokenizer, tokenizer_path } = setup;
    if cfg.parallelism.is_auto() {
        // accel: the model's shape for the automatic layout, read from its build (described, nothing allocated)
        let model = ModelSpec::of_model(Llama::plan(&config), args.llama.seq_len, |vb| Llama::new(&config, vb))?;
        let world = accel_examples::job_size(args.nproc).0;
        cfg.auto_layout = Some(args.auto.request(model, args.batch_size, world));
    }
    let acc = Accelerator::new(cfg)?; // accel: process group, mesh (pp × dp × tp), device, precision

    // Sequences per micro-batch per replica: the automatic layout's, or the flag's.
    let batch_size = auto_args::batch_size(&acc, args.batch_size);
    // Read now: fine-tuning a directory in place replaces the files they come from.
    let tokenizer_files = tokenizer_files(&tokenizer_path)?;
    let (train_data, validation) = token_datasets(&args.llama.text_path(), &tokenizer, args.llama.seq_len)?;
    if acc.auto_layout().is_some() {
        let global = args.auto.global_batch(args.batch_size, acc.world_size());
        let what = format!("windows of {} tokens", args.llama.seq_len);
        args.auto.check_data(global, train_data.len(), &what)?;
    }

    let varmap = VarMap::new();
    // accel: the model written once, laid out by its plan: each rank builds its pipeline stages' layers, split
    // over tp, from the seed or from the directory's weights (only the tensors of its stages, its slice of each)
    let mut vb = acc.builder(&varmap, Llama::plan(&config));
    if let Some(dir) = &args.llama.model_dir {
        vb = vb.with_weights(PretrainedWeights::open(dir, &config)?);
    }
    let model = Llama::new(&config, vb)?;
    let prepared = acc.prepare_model(&varmap)?; // accel: gradient sync over dp, masters, sharding
    let opt = AdamW::new(AdamWConfig { lr: args.lr, weight_decay: 0.1, ..Default::default() })?;
    let mut opt = acc.prepare_optimizer(&prepared, opt)?;
    let loader_cfg =
        DataLoaderConfig { batch_size, shuffle: true, seed: args.seed, drop_last: true, ..Default::default() };
    let n_windows = train_data.len();
    let mut loader = acc.prepare_data_loader(DataLoader::new(train_data, loader_cfg))?; // accel: by dp rank
    let dp = acc.data_parallel_size();
    if loader.is_empty() {
        bail!("--batch-size {} leaves no full batch per replica ({n_windows} windows, dp {dp})", batch_size);
    }
    let ga = acc.gradient_accumulation_steps();
    let tokens_per_step = (batch_size * args.llama.seq_len * dp * ga) as f64;
    acc.print_banner("accel_llama"); // accel: config, processes, layout, precision, accumulation, backend (once)
    acc.print(format!(
        "accel_llama: {} process(es) = pp {} × dp {dp} × tp {}, Llama of {} parameters ({} layers, hidden {}, {} \
         heads over {} key/value heads, MLP {}, vocabulary {}{}), {}, global batch {} sequences of {} tokens",
        acc.world_size(),
        acc.mesh().pp().world_size(),
        acc.tensor_parallel().size(),
        num_parameters(&config),
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads(),
        config.intermediate_size,
        config.vocab_size,
        if config.tie_word_embeddings { ", tied head" } else { "" },
        match &args.llama.model_dir {
            Some(d) => format!("fine-tuned from {}", d.display()),
            None => "trained from scratch".into(),
        },
        batch_size * dp * ga,
        args.llama.seq_len
    ));

    let start = Instant::now();
    let mut measured: Option<(Instant, u64)> = None; // after the first logged interval (warm-up)
    let (mut step, mut epoch) = (0u64, 0u64);
    let (mut loss_sum, mut loss_count) = (0f64, 0usize);
    let mut last_loss = f64::NAN;
    // `--steps 0` trains nothing: evaluate, save and sample the model as built (a directory loaded and re-saved).
    'training: while step < args.steps {
        loader.set_epoch(epoch);
        for batch in &loader {
            let batch = batch?;
            let loss = acc.accumulate(|| -> anyhow::Result<Tensor> {
                // accel: forward, vocab-parallel cross entropy and backward in one call, at any pp
                Ok(acc.pipeline_backward(&model, &batch.inputs, &batch.targets, |logits, y| model.loss(logits, y))?)
            })?;
            loss_sum += f64::from(loss.to_scalar::<f32>()?);
            loss_count += 1;
            if !acc.sync_gradients() {
                continue;
            }
            if args.max_grad_norm > 0.0 {
                acc.clip_grad_norm(args.max_grad_norm)?; // accel: each parameter counted once over dp × tp
            }
            opt.step()?;
            step += 1;
            if step % args.log_every == 0 || step == args.steps {
                let mean = Tensor::new(&[(loss_sum / loss_count.max(1) as f64) as f32], acc.device())?;
                last_loss = f64::from(acc.reduce(&mean, ReduceKind::Mean)?.to_vec1::<f32>()?[0]);
                if !last_loss.is_finite() {
                    bail!("the training loss is {last_loss} at step {step}: lower --lr or check the data");
                }
                let speed = match measured {
                    Some((t0, s0)) => format!(
                        "{:.0} tokens/s",
                        (step - s0) as f64 * tokens_per_step / t0.elapsed().as_secs_f64().max(1e-9)
                    ),
                    None => "warm-up".into(),
                };
                acc.print(format!(
                    "step {step}/{}: loss {last_loss:.4}, {speed}, {:.1} s",
                    args.steps,
                    start.elapsed().as_secs_f64()
                ));
                measured.get_or_insert((Instant::now(), step));
                (loss_sum, loss_count) = (0.0, 0);
            }
            if step >= args.steps {
                break 'training;
            }
        }
        epoch += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let throughput = match measured {
        Some((t0, s0)) if step > s0 => (step - s0) as f64 * tokens_per_step / t0.elapsed().as_secs_f64().max(1e-9),
        _ => step as f64 * tokens_per_step / elapsed.max(1e-9),
    };
    if step == 0 {
        acc.print("accel_llama: --steps 0, no training: the model as built is evaluated and saved");
    } else {
        acc.print(format!(
            "accel_llama done: {step} steps in {elapsed:.1} s, final loss {last_loss:.4}, {throughput:.0} tokens/s (pp {} \
             × dp {dp} × tp {})",
            acc.mesh().pp().world_size(),
            acc.tensor_parallel().size()
        ));
    }
    if args.eval_batches > 0 {
        // Batches of the global batch's rows, so every layout of one global batch evaluates the same windows.
        let loss = validation_loss(&acc, &model, validation, batch_size * dp, args.eval_batches)?;
        acc.print(format!("validation loss {loss:.6} (perplexity {:.2})", loss.exp()));
    }
    acc.wait_for_everyone()?;
    println!(
        "rank {} (pp {} dp {} tp {}): peak RSS {:.1} MiB",
        acc.rank(),
        acc.mesh().pp().rank(),
        acc.data_parallel_rank(),
        acc.tensor_parallel().rank(),
        accel_examples::peak_rss_mib()
    );
    acc.wait_for_everyone()?;

    // accel: one logical checkpoint from any layout, in transformers' names and files
    let dtype = save_dtype(args.save_dtype.as_deref(), &config);
    let options = SaveOptions { dtype, max_shard_size: args.max_shard_size, files: tokenizer_files };
    llama::save_pretrained(&acc, &prepared, &config, &args.output_dir, &options)?;
    acc.print(format!(
        "saved {} (config.json, weights, tokenizer.json, tokenizer_config.json)",
        args.output_dir.display()
    ));

    if args.sample_tokens > 0 && acc.mesh().pp().world_size() == 1 {
        let prompt = tokenizer.encode(args.prompt.as_str(), false).map_err(|e| anyhow::anyhow!("--prompt: {e}"))?;
        let ids = model.generate_greedy(prompt.get_ids(), args.sample_tokens)?; // every tp rank in step
        let text = tokenizer.decode(&ids, false).map_err(|e| anyhow::anyhow!("decoding the sample: {e}"))?;
        acc.print(format!("greedy sample:\n{text}"));
    }
    Ok(())
}

/// The mean loss over the first `batches` validation batches of `rows` sequences, every rank's same batches
/// (evaluation at any layout: `pipeline_forward` runs the stages without a backward).
fn validation_loss(
    acc: &Accelerator,
    model: &Llama,
    data: TokenDataset,
    rows: usize,
    batches: usize,
) -> anyhow::Result<f64> {
    let n = (data.len() / rows).min(batches);
    anyhow::ensure!(n > 0, "the validation text holds no batch of {rows} windows");
    let mut sum = 0.0;
    for b in 0..n {
        let batch = data.get_batch(&(b * rows..(b + 1) * rows).collect::<Vec<_>>())?;
        let loss = acc.pipeline_forward(model, &batch.inputs, &batch.targets, |l, t| model.loss(l, t))?;
        sum += f64::from(loss.to_scalar::<f32>()?);
    }
    Ok(sum / n as f64)
}
