//! Shared pieces of the MNIST examples (the same task written at each level of accel-rs):
//!
//! - [`Mlp`]: a multi-layer perceptron 784 → hidden… → 10 with ReLU — from candle's `VarBuilder` at level 1 (raw
//!   ddp-core), from accel's builder at levels 2 (Accelerator) and 3 (Trainer) — so the three programs train
//!   the exact same model.
//! - [`load_mnist`]: the shipped MNIST subsets (`data/mnist/{train10k,t10k}-*-idx*-ubyte.gz`) as tensors on a
//!   device, read by the library's one loader ([`accel::data::load_mnist`], which the level-2/3 examples call
//!   directly for a `TensorDataset`).
//! - [`seed_parameters`]: a reproducible re-initialisation (candle's CPU RNG cannot be seeded).
//! - [`default_data_dir`], [`select_rows`], [`correct_count`]: small helpers every level needs.
//! - [`run_main`]: what every example's `main` does around its body (log subscriber, error chain, exit status).
//!
//! Keep this file small: it is what the three examples have in common, nothing more.
//!
//! [`gpt`]: the char-level GPT of the tensor-parallel examples (`accel_gpt`, `train_gpt`), written once with
//! accel's tensor-parallel layers; [`default_text_path`] finds the shipped Shakespeare text. [`llama`]: what the
//! Llama examples (`accel_llama`, `train_llama`) share — the tokenized text, the model's shape, the tokenizer.

use std::path::{Path, PathBuf};

use accel_nn::ops::linear::{Activation, Linear};
use anyhow::{bail, Context};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

pub mod gpt;
pub mod llama;

/// Parses `--nproc`: a whole number ≥ 1 (0 is refused instead of silently training as one process).
pub fn parse_nproc(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1 (the number of worker processes; 1 trains in this process)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?} is not a process count: {e}")),
    }
}

pub use accel::data::{MNIST_CLASSES, MNIST_PIXELS};
/// Mean pixel intensity of the MNIST training set (in `[0, 1]`), as used by PyTorch's MNIST example.
pub const MNIST_MEAN: f64 = 0.1307;
/// Standard deviation of the MNIST training set's pixel intensities, as used by PyTorch's MNIST example.
pub const MNIST_STD: f64 = 0.3081;
/// Hidden widths of [`Mlp::new`]: 784-256-10 reaches ≥ 0.95 test accuracy on t10k (≈ 0.959) after 10 epochs of
/// AdamW (lr 2e-3, global batch 128) on the shipped 10k training images.
pub const DEFAULT_HIDDEN: &[usize] = &[256];

/// A multi-layer perceptron for MNIST: standardise → `Linear(784, h1) → ReLU → … → Linear(h_last, 10)`, logits out.
///
/// The input (pixels in `[0, 1]`) is first standardised with the fixed constants [`MNIST_MEAN`] / [`MNIST_STD`]
/// (`(x − mean) / std`, as torchvision's MNIST examples do); it has no parameters and makes AdamW converge in
/// fewer epochs. Parameters are named `fc1.weight` (shape `[h1, 784]`), `fc1.bias` (`[h1]`), `fc2.weight`, … in
/// the builder's namespace, initialised as candle_nn's `linear` does (Kaiming-normal weights, uniform bias;
/// call [`seed_parameters`] for PyTorch's init). The dtype and device are those of the builder. Each layer
/// has its ReLU fused (one candle custom op forward and backward on the CPU in f32, candle's own ops elsewhere;
/// `ACCEL_FUSED_OPS=0` switches it off). The forward pass marks a backward-segment cut
/// ([`ddp_core::segments::cut`]) between layers, for DDP's overlapped backward.
///
/// Two builders make the same model: candle's `VarBuilder` ([`Mlp::with_hidden`], level 1: no accel types) and
/// accel's ([`Mlp::on_builder`], levels 2 and 3), whose layers fetch their weights at each forward — so the
/// model trains under every data-parallel layout, FULL_SHARD (an Accelerate FSDP config) included.
#[derive(Clone)]
pub struct Mlp {
    layers: Vec<MlpLayer>,
}

/// One layer of an [`Mlp`], as the builder that made it holds it.
#[derive(Clone)]
enum MlpLayer {
    /// From candle's `VarBuilder`: the weights it was built with.
    Candle(Linear),
    /// From `accel::nn`'s builder: weights fetched at each forward (gathered under FULL_SHARD).
    Planned(accel::nn::Linear),
}

impl Mlp {
    /// The default model, 784-256-10 ([`DEFAULT_HIDDEN`]).
    pub fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Self::with_hidden(vb, DEFAULT_HIDDEN)
    }

    /// A model 784 → `hidden[0]` → … → 10 from candle's builder. An empty `hidden` gives multinomial logistic
    /// regression (784-10).
    pub fn with_hidden(vb: VarBuilder, hidden: &[usize]) -> candle_core::Result<Self> {
        let layers = Self::layer_sizes(hidden)
            .map(|(name, (in_dim, out_dim), act)| {
                Ok(MlpLayer::Candle(Linear::new_vb(in_dim, out_dim, vb.pp(name))?.with_activation(act)))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { layers })
    }

    /// The same model from accel's builder (`acc.builder(&varmap, Mlp::plan())`, or the Trainer's
    /// `Trainer::with_plan`): the same names, shapes and initial distribution.
    pub fn on_builder(vb: accel::nn::VarBuilder, hidden: &[usize]) -> candle_core::Result<Self> {
        let layers = Self::layer_sizes(hidden)
            .map(|(name, (in_dim, out_dim), act)| {
                Ok(MlpLayer::Planned(accel::nn::linear(in_dim, out_dim, vb.pp(name))?.with_activation(act)))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { layers })
    }

    /// The model's parallel plan: none of its rules (every layer replicated), as data parallelism — replicated
    /// or sharded, FULL_SHARD included — needs; at tp > 1 the builder refuses it, naming `fc1`.
    pub fn plan() -> accel::plan::ParallelPlan {
        accel::plan::ParallelPlan::default()
    }

    /// `(name, (in, out), activation)` of each layer: `fc1` … `fcN`, ReLU on all but the last.
    fn layer_sizes(hidden: &[usize]) -> impl Iterator<Item = (String, (usize, usize), Activation)> {
        let widths: Vec<usize> =
            std::iter::once(MNIST_PIXELS).chain(hidden.iter().copied()).chain([MNIST_CLASSES]).collect();
        let last = widths.len() - 2;
        (0..=last).map(move |i| {
            let act = if i == last { Activation::None } else { Activation::Relu };
            (format!("fc{}", i + 1), (widths[i], widths[i + 1]), act)
        })
    }
}

impl Module for Mlp {
    /// `xs`: `[batch, 784]` (the builder's dtype) → logits `[batch, 10]`.
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = xs.affine(1.0 / MNIST_STD, -MNIST_MEAN / MNIST_STD)?;
        for (i, layer) in self.layers.iter().enumerate() {
            if i > 0 {
                // A backward-segment cut between layers (the identity unless the forward pass is recorded with
                // ddp_core::segments::record): DDP all-reduces the later layers' gradients while the backward
                // pass computes the earlier ones.
                h = ddp_core::segments::cut(&h)?;
            }
            // ReLU fused into every layer but the last.
            h = match layer {
                MlpLayer::Candle(l) => l.forward(&h)?,
                MlpLayer::Planned(l) => l.forward(&h)?,
            };
        }
        Ok(h)
    }
}

/// Re-initialises every `<layer>.weight` / `<layer>.bias` of `varmap` like PyTorch's `nn.Linear.reset_parameters`
/// — uniform in `±1/sqrt(fan_in)` with `fan_in = weight.dims()[1]` — from a ChaCha8 stream seeded with `seed`,
/// visiting variables in name order, so the same seed gives the same model on every run and every machine
/// (candle's own CPU initialisers draw from an unseedable thread RNG). Other variables are left alone.
///
/// Errors: a `.weight` that is not 2-D, or a `.bias` without its `.weight`, naming the variable.
pub fn seed_parameters(varmap: &VarMap, seed: u64) -> anyhow::Result<()> {
    let data = varmap.data().lock().map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for name in names {
        let layer = match name.strip_suffix(".weight").or_else(|| name.strip_suffix(".bias")) {
            Some(layer) => layer,
            None => continue,
        };
        let weight = data
            .get(&format!("{layer}.weight"))
            .with_context(|| format!("{name} has no matching {layer}.weight to take fan_in from"))?;
        let fan_in = match weight.dims() {
            [_, fan_in] => *fan_in,
            dims => bail!("{layer}.weight has shape {dims:?}, expected [out, in]"),
        };
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        let var = &data[name];
        let values: Vec<f64> = (0..var.elem_count()).map(|_| rng.random_range(-bound..bound)).collect();
        let t = Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
        var.set(&t)?;
    }
    Ok(())
}

/// One MNIST split held in memory.
#[derive(Debug, Clone)]
pub struct Mnist {
    /// `[n, 784]` f32, pixel intensities scaled to `[0, 1]` (byte / 255), row-major 28 × 28.
    pub images: Tensor,
    /// `[n]` u32, digits 0–9.
    pub labels: Tensor,
}

impl Mnist {
    /// Number of examples `n`.
    pub fn len(&self) -> usize {
        self.labels.dim(0).unwrap_or(0)
    }

    /// Whether the split has no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The rows `indices` (e.g. one micro-batch from a `DistributedSampler`): images `[b, 784]`, labels `[b]`.
    pub fn batch(&self, indices: &[usize]) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((select_rows(&self.images, indices)?, select_rows(&self.labels, indices)?))
    }
}

/// Loads the split `split` of MNIST from `dir` with [`accel::data::load_mnist`] (files
/// `{split}-images-idx3-ubyte[.gz]` and `{split}-labels-idx1-ubyte[.gz]`; the repository ships `train10k` — the
/// first 10 000 training images — and `t10k`, the full test set) and moves the tensors to `device`.
///
/// Errors name the missing or malformed file, or the mismatch between image and label counts.
pub fn load_mnist(dir: &Path, split: &str, device: &Device) -> anyhow::Result<Mnist> {
    let ds = accel::data::load_mnist(dir, split)?;
    Ok(Mnist { images: ds.inputs().to_device(device)?, labels: ds.targets().to_device(device)? })
}

/// The summary line naming the best checkpoint and the metric that chose it (`metric_for_best_model`, with or
/// without its `eval_` prefix), e.g. "best checkpoint: runs/x/checkpoint-426 (validation accuracy 0.9610)".
pub fn best_checkpoint_line(checkpoint: &str, metric: &str, value: f64) -> String {
    let name = metric.strip_prefix("eval_").unwrap_or(metric);
    format!("best checkpoint: {checkpoint} (validation {name} {value:.4})")
}

/// The repository's `data/mnist`, found from this crate's manifest directory (so it works from any working
/// directory of a `cargo run` in this workspace).
pub fn default_data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("data").join("mnist")
}

/// The parallel layout the GPT examples take on their command line (`--tp-size`, `--pp-size`, `--pp-schedule`,
/// `--microbatches`, `--dp-shard-size`, `--sharding-strategy`): the processes are laid out as `pp × dp × tp` with
/// `dp = nproc / (tp · pp)`, of which `dp_shard` shard the model (ZeRO / FSDP) and the rest replicate it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLayout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline stages (pp ranks).
    pub pp: usize,
    /// The pipeline schedule (`None`: the config's default, 1F1B).
    pub schedule: Option<accel::pipeline::ScheduleKind>,
    /// Micro-batches per pipeline step (`None`: one per stage).
    pub microbatches: Option<usize>,
    /// Model stages per pp rank (`None`: the config's default, 2 for Interleaved1F1B, else 1).
    pub virtual_stages: Option<usize>,
    /// Data-parallel ranks sharding the model (1: none).
    pub dp_shard: usize,
    /// What they shard (`None`: the config's default, SHARD_GRAD_OP).
    pub sharding: Option<accel::ShardingStrategy>,
}

impl ModelLayout {
    /// The config of `nproc` processes in this layout.
    pub fn config(&self, nproc: usize) -> accel::ParallelismConfig {
        let dp = nproc / (self.tp * self.pp).max(1);
        let mut p = accel::ParallelismConfig::default()
            .with_tp_size(self.tp)
            .with_pp_size(self.pp)
            .with_dp_shard_size(self.dp_shard)
            .with_dp_replicate_size(dp / self.dp_shard.max(1));
        if let Some(s) = self.sharding {
            p = p.with_sharding_strategy(s);
        }
        if let Some(kind) = self.schedule {
            p = p.with_pp_schedule(kind);
        }
        if let Some(m) = self.microbatches {
            p = p.with_pp_microbatches(m);
        }
        if let Some(v) = self.virtual_stages {
            p = p.with_pp_virtual_stages(v);
        }
        p
    }
}

/// The `PARALLELISM_CONFIG_*` variables (Accelerate's, read by `AcceleratorConfig::from_env`) that lay `nproc`
/// processes out as `layout`: what the GPT examples hand the workers they launch.
pub fn parallel_env(nproc: usize, layout: &ModelLayout) -> Vec<(String, String)> {
    layout.config(nproc).env_vars()
}

/// Checks `--tp-size` and `--pp-size` against the process count before any worker starts (one message instead
/// of one per rank): the processes are laid out as pp × dp × tp, so tp · pp must divide them. The count is
/// `--nproc`, or, in a worker of a launched job (`accel launch`, where `--nproc` is ignored), the job's
/// `WORLD_SIZE`.
pub fn check_layout(nproc: usize, layout: &ModelLayout) -> anyhow::Result<()> {
    let (n, what) = job_size(nproc);
    let fits: Vec<usize> = (1..=n).filter(|t| n.is_multiple_of(*t)).collect();
    for (flag, size) in [("--tp-size", layout.tp), ("--pp-size", layout.pp)] {
        if size == 0 {
            let dim = if flag == "--tp-size" { "tensor-parallel" } else { "pipeline-parallel" };
            anyhow::bail!(
                "{flag} 0: the {dim} size is at least 1 (1 = off); with {what} {n} it could be one of {fits:?}"
            );
        }
    }
    if !n.is_multiple_of(layout.tp) {
        anyhow::bail!(
            "--tp-size {} must divide {what} {n} (the processes are laid out as dp × tp); with {what} {n} it could \
             be one of {fits:?}",
            layout.tp
        );
    }
    if layout.dp_shard == 0 || !n.is_multiple_of(layout.tp * layout.pp * layout.dp_shard) {
        let dp = n / (layout.tp * layout.pp).max(1);
        let fits: Vec<usize> = (1..=dp).filter(|d| dp.is_multiple_of(*d)).collect();
        if n.is_multiple_of(layout.tp * layout.pp) {
            anyhow::bail!(
                "--dp-shard-size {} must divide the {dp} data-parallel processes ({what} {n} / (tp {} × pp {})); it \
                 could be one of {fits:?}",
                layout.dp_shard,
                layout.tp,
                layout.pp
            );
        }
    }
    if !n.is_multiple_of(layout.tp * layout.pp) {
        let pp_fits: Vec<usize> = (1..=n / layout.tp).filter(|p| (n / layout.tp).is_multiple_of(*p)).collect();
        anyhow::bail!(
            "--pp-size {} × --tp-size {} must divide {what} {n} (the processes are laid out as pp × dp × tp); with \
             tp {} the pp size could be one of {pp_fits:?}",
            layout.pp,
            layout.tp,
            layout.tp
        );
    }
    Ok(())
}

/// The parallel layout a GPT example runs on `world` processes: the launcher's `PARALLELISM_CONFIG_*` when it set
/// the tp or pp size (`accel launch --parallelism-config-pp-size …`, or this program's own launch), else the
/// flags'. A flag given explicitly that disagrees with what the launcher set — a size other than 1, a schedule, a
/// micro-batch count — is an error naming both, never silently dropped.
pub fn effective_layout(world: usize, layout: &ModelLayout) -> anyhow::Result<accel::ParallelismConfig> {
    use accel::parallelism::{DP_SHARD_SIZE_ENV, PP_MICROBATCHES_ENV, PP_SCHEDULE_ENV, PP_SIZE_ENV, TP_SIZE_ENV};
    let set = |var: &str| std::env::var(var).ok();
    if !launcher_set_layout() {
        return Ok(layout.config(world));
    }
    let launched = accel::ParallelismConfig::from_env()?;
    let disagree = |flag: &str, mine: String, var: &str, theirs: String| {
        anyhow::anyhow!(
            "{flag} {mine} disagrees with {var}={theirs} set by the launcher; give the setting once (the flag, or \
             the launcher's)"
        )
    };
    for (flag, var, size, theirs) in [
        ("--tp-size", TP_SIZE_ENV, layout.tp, launched.tp_size),
        ("--pp-size", PP_SIZE_ENV, layout.pp, launched.pp_size),
        ("--dp-shard-size", DP_SHARD_SIZE_ENV, layout.dp_shard, launched.dp_shard_size),
    ] {
        if size != 1 && size != theirs {
            let theirs = if theirs == accel::ParallelismConfig::AUTO { "auto".to_string() } else { theirs.to_string() };
            return Err(disagree(flag, size.to_string(), var, theirs));
        }
    }
    if let Some(s) = layout.sharding.filter(|s| *s != launched.sharding_strategy) {
        let theirs = set(accel::parallelism::SHARDING_STRATEGY_ENV)
            .unwrap_or_else(|| format!("unset (the default, {})", launched.sharding_strategy));
        return Err(disagree("--sharding-strategy", s.to_string(), accel::parallelism::SHARDING_STRATEGY_ENV, theirs));
    }
    if let Some(kind) = layout.schedule.filter(|k| *k != launched.pp_schedule) {
        let theirs = set(PP_SCHEDULE_ENV).unwrap_or_else(|| format!("unset (the default, {})", launched.pp_schedule));
        return Err(disagree("--pp-schedule", kind.to_string(), PP_SCHEDULE_ENV, theirs));
    }
    if let Some(m) = layout.microbatches.filter(|m| *m != launched.pp_microbatches_per_step()) {
        let theirs = set(PP_MICROBATCHES_ENV)
            .unwrap_or_else(|| format!("unset (one per stage: {})", launched.pp_microbatches_per_step()));
        return Err(disagree("--microbatches", m.to_string(), PP_MICROBATCHES_ENV, theirs));
    }
    Ok(launched)
}

/// Whether a launcher set the model layout for this worker (`PARALLELISM_CONFIG_TP_SIZE`, `_PP_SIZE`,
/// `_DP_SHARD_SIZE` or `FSDP_SHARDING_STRATEGY`): then its settings win over the flags.
fn launcher_set_layout() -> bool {
    use accel::parallelism::{DP_SHARD_SIZE_ENV, PP_SIZE_ENV, SHARDING_STRATEGY_ENV, TP_SIZE_ENV};
    [TP_SIZE_ENV, PP_SIZE_ENV, DP_SHARD_SIZE_ENV, SHARDING_STRATEGY_ENV].iter().any(|v| std::env::var(v).is_ok())
}

/// The number of processes the layout is checked against: the job's `WORLD_SIZE` in a worker of a launched job
/// (`accel launch`, where `--nproc` is ignored), else `--nproc`; and how to name it.
pub fn job_size(nproc: usize) -> (usize, &'static str) {
    match ddp_core::env::DistEnv::detect_from_env() {
        Ok(Some(env)) if ddp_core::launcher::is_worker() => (env.world_size, "the job's WORLD_SIZE"),
        _ => (nproc, "--nproc"),
    }
}

/// In a worker of the GPT examples: makes the Accelerator's layout follow the flags, unless the launcher set it
/// ([`effective_layout`]'s rules and errors): the variables of [`parallel_env`] for `WORLD_SIZE` (1 when unset).
/// Call it before anything starts a thread.
pub fn apply_layout(layout: &ModelLayout) -> anyhow::Result<()> {
    let world = match ddp_core::env::DistEnv::detect_from_env() {
        Ok(Some(env)) => env.world_size,
        _ => 1,
    };
    if launcher_set_layout() {
        effective_layout(world, layout)?; // the launcher's wins; a disagreeing flag is an error
        return Ok(());
    }
    let model = layout.tp * layout.pp;
    if model == 0 || !world.is_multiple_of(model) {
        bail!(
            "--tp-size {} × --pp-size {} must divide the {world} processes of this job (laid out as pp × dp × tp)",
            layout.tp,
            layout.pp
        );
    }
    if model > 1
        || layout.dp_shard > 1
        || layout.sharding.is_some()
        || layout.schedule.is_some()
        || layout.microbatches.is_some()
    {
        for (k, v) in parallel_env(world, layout) {
            // Before the Accelerator (or anything else) starts a thread: setting the environment is sound here.
            std::env::set_var(k, v);
        }
    }
    Ok(())
}

/// The repository's `data/shakespeare/shakespeare8.txt` (eight plays, 1.1 MB, 76 distinct characters; see
/// `data/PROVENANCE-shared.md`), found from this crate's manifest directory.
pub fn default_text_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("data").join("shakespeare").join("shakespeare8.txt")
}

/// The GPT examples' and benchmarks' datasets from the text file at `path`: non-overlapping windows of
/// `block_size` characters (targets shifted by one) over the first 95 % of the characters for training and over
/// the last 5 % for validation, both with the vocabulary of the whole text (the shipped text's 76 characters,
/// sorted). `scripts/torch_ref/models.py` reads the text the same way.
///
/// Errors name the file that cannot be read, or a `block_size` of 0.
pub fn split_text_datasets(
    path: &Path,
    block_size: usize,
) -> anyhow::Result<(accel::data::TextDataset, accel::data::TextDataset)> {
    use accel::data::{CharVocab, TextDataset};
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let vocab = CharVocab::from_text(&text);
    let chars: Vec<char> = text.chars().collect();
    let cut = chars.len() * 95 / 100;
    let (train, val): (String, String) = (chars[..cut].iter().collect(), chars[cut..].iter().collect());
    let s = block_size;
    Ok((TextDataset::with_vocab(&train, vocab.clone(), s, s)?, TextDataset::with_vocab(&val, vocab, s, s)?))
}

/// Rows `indices` of `t` along dimension 0 (`index_select` with a u32 index on `t`'s device).
pub fn select_rows(t: &Tensor, indices: &[usize]) -> candle_core::Result<Tensor> {
    let idx: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
    let idx = Tensor::from_vec(idx, indices.len(), t.device())?;
    t.index_select(&idx, 0)
}

/// How many rows of `logits` (`[b, classes]`) have their arg-max equal to `labels` (`[b]`, u32).
pub fn correct_count(logits: &Tensor, labels: &Tensor) -> candle_core::Result<usize> {
    let predicted = logits.argmax(1)?;
    let hits = predicted.eq(&labels.to_dtype(predicted.dtype())?)?.to_dtype(DType::U32)?.sum_all()?;
    Ok(hits.to_scalar::<u32>()? as usize)
}

/// mimalloc's `mi_option_purge_delay` (mimalloc 3.x's `mi_option_e`, `include/mimalloc.h`; libmimalloc-sys binds
/// the enum but not this member). Checked by this crate's tests: its default reads back as 1000 (ms).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc (the global allocator of the examples and benches) to keep the memory a training step frees
/// for the next step instead of ever handing it back to the kernel. With mimalloc's default (`purge_delay`
/// 1000 ms) a char-GPT step still took 105–216 page faults, each zero-filling a page the step had used before;
/// with this, none after the first steps (docs/benchmarks.md, "Allocator"). The price: resident memory stays at
/// its peak until the process exits (as PyTorch's caching allocator keeps GPU memory).
///
/// `MIMALLOC_PURGE_DELAY` in the environment still wins (this only changes the default), and the launcher sets
/// `MIMALLOC_PURGE_DELAY=-1` for its workers unless the user does ([`ddp_core::launcher::LaunchConfig::worker_env`]).
/// Has no effect in a binary whose global allocator is not mimalloc. Call it first thing in `main`, before any
/// other thread starts; [`run_main`] does.
pub fn keep_freed_memory() {
    // SAFETY: writes one `long` of mimalloc's options, which other threads read without synchronisation: sound
    // when no other thread runs yet, which is why it is called first thing in `main` (run_main does).
    unsafe { libmimalloc_sys::mi_option_set_default(MI_OPTION_PURGE_DELAY, -1) }
}

/// Runs an example's body: first gives this process what the launcher gives its workers — mimalloc keeping freed
/// memory ([`keep_freed_memory`]) and, unless set, `CANDLE_NUM_THREADS=1` (candle's own elementwise pool, whose
/// workers spin after every op and take the cores from rayon's: see
/// [`ddp_core::launcher::LaunchConfig::worker_env`]) — so that a run that trains in this process (`--nproc 1`)
/// runs as a launched worker would; then installs a `tracing` subscriber on stderr, so library warnings reach the
/// user (level `warn` by default, `RUST_LOG` overrides, e.g. `RUST_LOG=accel=debug`), and reports an error as its
/// chain of causes with exit status 1 ([`ddp_core::launcher::report_error`]: a launched worker's report is printed
/// once by its launcher) — no backtrace, even under `RUST_BACKTRACE=1`: those are for panics, not for a wrong flag
/// or a missing file.
/// Ends the program after its command line failed to parse (the binary passes clap's rendered message, its exit
/// code and whether it is an error rather than `--help` / `--version`): help goes to stdout; an error goes,
/// under a launcher, into the report file it prints once ([`ddp_core::launcher::report_error`]) — not once per
/// rank — else to stderr.
pub fn exit_on_bad_command_line(text: String, code: i32, is_error: bool) -> ! {
    if is_error {
        ddp_core::launcher::report_text(&text);
    } else {
        print!("{text}");
    }
    std::process::exit(code)
}

/// This process's peak resident set size (`VmHWM` of `/proc/self/status`) in MiB; NaN where it cannot be read
/// (not Linux).
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// `Cli::parse()` for the examples' binaries (the parser trait in scope at the call site), a bad command line
/// reported with [`exit_on_bad_command_line`]: once, not once per rank, under a launcher.
#[macro_export]
macro_rules! parse_args {
    ($cli:ty) => {
        <$cli>::try_parse()
            .unwrap_or_else(|e| $crate::exit_on_bad_command_line(e.render().to_string(), e.exit_code(), e.use_stderr()))
    };
}

/// The Trainer examples default to `save_strategy: no` (a short run writes no checkpoint): a `--save-steps` given
/// without `--save-strategy steps` would save nothing without a word, so it is refused, naming the flag to add.
pub fn check_save_steps(
    args: &trainer::TrainingArguments,
    example_defaults: &trainer::TrainingArguments,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.save_strategy != trainer::SaveStrategy::No || args.save_steps == example_defaults.save_steps,
        "--save-steps {} saves nothing with save_strategy `no` (this example's default): add --save-strategy steps",
        args.save_steps
    );
    Ok(())
}

pub fn run_main(body: impl FnOnce() -> anyhow::Result<()>) -> std::process::ExitCode {
    keep_freed_memory();
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // First thing in `main`, before any thread starts (candle reads it when its pool starts, at the first
        // elementwise op): setting the environment is sound here.
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    // Warnings to stderr (RUST_LOG sets the level); a second call (several mains in one process) keeps the first.
    accel::logging::init_default();
    match body() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Under a launcher, into the report file it prints once (not from every rank); else on stderr.
            ddp_core::launcher::report_error(e.as_ref());
            // 130 / 143 when Ctrl-C or SIGTERM stopped the workers, as for a process the signal ended.
            std::process::ExitCode::from(ddp_core::launcher::exit_code(e.as_ref()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::VarMap;

    #[test]
    fn keep_freed_memory_sets_mimallocs_purge_delay() {
        // Nothing else in this test binary touches the option, so it still holds mimalloc's default here: 1000 ms
        // is purge_delay's default in mimalloc 3 (`src/options.c`; no other option has it), which pins the index.
        let read = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        match std::env::var("MIMALLOC_PURGE_DELAY") {
            Err(_) => {
                assert_eq!(read(), 1000, "mimalloc's purge_delay default (ms) at index {MI_OPTION_PURGE_DELAY}");
                keep_freed_memory();
                assert_eq!(read(), -1, "never purge");
            }
            Ok(_) => {
                // The index cannot be pinned from here (the default is gone); what must hold is that the
                // environment's value wins over ours.
                let before = read();
                keep_freed_memory();
                assert_eq!(read(), before, "MIMALLOC_PURGE_DELAY from the environment wins over the default");
            }
        }
    }

    #[test]
    fn mlp_names_and_shapes() {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let mlp = Mlp::with_hidden(vb, &[32, 16]).unwrap();
        let out = mlp.forward(&Tensor::zeros((5, MNIST_PIXELS), DType::F32, &Device::Cpu).unwrap()).unwrap();
        assert_eq!(out.dims(), &[5, MNIST_CLASSES]);
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.dims().to_vec())).collect();
        names.sort();
        assert_eq!(
            names,
            vec![
                ("fc1.bias".to_string(), vec![32]),
                ("fc1.weight".to_string(), vec![32, 784]),
                ("fc2.bias".to_string(), vec![16]),
                ("fc2.weight".to_string(), vec![16, 32]),
                ("fc3.bias".to_string(), vec![10]),
                ("fc3.weight".to_string(), vec![10, 16]),
            ]
        );
    }

    #[test]
    fn seeded_parameters_are_reproducible_and_bounded() {
        let build = |seed| {
            let varmap = VarMap::new();
            Mlp::with_hidden(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &[16]).unwrap();
            seed_parameters(&varmap, seed).unwrap();
            let data = varmap.data().lock().unwrap();
            let w = data["fc1.weight"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = data["fc2.bias"].to_vec1::<f32>().unwrap();
            (w, b)
        };
        let (w, b) = build(7);
        assert_eq!((w.clone(), b.clone()), build(7));
        assert_ne!(w, build(8).0);
        let bound = 1.0 / (MNIST_PIXELS as f32).sqrt();
        assert!(w.iter().all(|v| v.abs() <= bound) && w.iter().any(|v| v.abs() > bound / 2.0));
        assert!(b.iter().all(|v| v.abs() <= 0.25), "fc2's fan_in is 16");
    }

    #[test]
    fn loads_the_shipped_test_split() {
        let test = load_mnist(&default_data_dir(), "t10k", &Device::Cpu).unwrap();
        assert_eq!(test.len(), 10_000);
        assert_eq!(test.images.dims(), &[10_000, MNIST_PIXELS]);
        let (x, y) = test.batch(&[0, 1, 2, 3, 4]).unwrap();
        // The first MNIST test labels are 7, 2, 1, 0, 4.
        assert_eq!(y.to_vec1::<u32>().unwrap(), vec![7, 2, 1, 0, 4]);
        let max = x.max_all().unwrap().to_scalar::<f32>().unwrap();
        let min = x.min_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(min == 0.0 && max == 1.0, "pixels scaled to [0, 1], got [{min}, {max}]");
    }

    #[test]
    fn missing_split_names_the_file() {
        let err = load_mnist(&default_data_dir(), "nope", &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("nope-images-idx3-ubyte.gz"), "{err}");
    }

    #[test]
    fn counts_correct_predictions() {
        let logits = Tensor::new(&[[0.0f32, 1.0, 0.0], [2.0, 0.0, 1.0], [0.0, 0.0, 3.0]], &Device::Cpu).unwrap();
        let labels = Tensor::new(&[1u32, 2, 2], &Device::Cpu).unwrap();
        assert_eq!(correct_count(&logits, &labels).unwrap(), 2);
    }
}

/// The guides and the docs pages, compiled (and, where a block is not `no_run`, run) as doc tests of this crate, so
/// a guide cannot drift from the API: `cargo test --workspace --doc`. Non-Rust blocks carry their language (`sh`,
/// `yaml`, `text`), which rustdoc skips; `# ` lines are the hidden set-up of a fragment.
#[cfg(doctest)]
pub mod docs {
    #[doc = include_str!("../../README.md")]
    pub struct Readme;
    #[doc = include_str!("../../docs/guide/00-levels.md")]
    pub struct Guide00Levels;
    #[doc = include_str!("../../docs/guide/01-ddp.md")]
    pub struct Guide01Ddp;
    #[doc = include_str!("../../docs/guide/01-ddp-zero.md")]
    pub struct Guide01DdpZero;
    #[doc = include_str!("../../docs/guide/02-accel.md")]
    pub struct Guide02Accel;
    #[doc = include_str!("../../docs/guide/03-trainer.md")]
    pub struct Guide03Trainer;
    #[doc = include_str!("../../docs/guide/03-trainer-checkpoints.md")]
    pub struct Guide03TrainerCheckpoints;
    #[doc = include_str!("../../docs/guide/03-trainer-hpsearch.md")]
    pub struct Guide03TrainerHpsearch;
    #[doc = include_str!("../../docs/guide/04-nd-parallel.md")]
    pub struct Guide04NdParallel;
    #[doc = include_str!("../../docs/guide/04-nd-parallel-sharded.md")]
    pub struct Guide04NdParallelSharded;
    #[doc = include_str!("../../docs/guide/04-nd-parallel-auto-layout.md")]
    pub struct Guide04NdParallelAutoLayout;
    #[doc = include_str!("../../docs/guide/05-your-model.md")]
    pub struct Guide05YourModel;
    #[doc = include_str!("../../docs/guide/cli.md")]
    pub struct GuideCli;
    #[doc = include_str!("../../docs/guide/topics/mixed-precision.md")]
    pub struct TopicMixedPrecision;
    #[doc = include_str!("../../docs/guide/topics/gradient-accumulation.md")]
    pub struct TopicGradientAccumulation;
    #[doc = include_str!("../../docs/guide/topics/checkpointing.md")]
    pub struct TopicCheckpointing;
    #[doc = include_str!("../../docs/guide/topics/early-stopping.md")]
    pub struct TopicEarlyStopping;
    #[doc = include_str!("../../docs/ARCHITECTURE.md")]
    pub struct Architecture;
    #[doc = include_str!("../../docs/benchmarks.md")]
    pub struct Benchmarks;
    #[doc = include_str!("../../docs/faults.md")]
    pub struct Faults;
    #[doc = include_str!("../../docs/gpu-and-clusters.md")]
    pub struct GpuAndClusters;
}
