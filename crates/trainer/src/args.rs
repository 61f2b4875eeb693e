//! [`TrainingArguments`]: every knob of a training run, with Hugging Face `transformers.TrainingArguments` names
//! and defaults, loadable from a YAML or JSON file and overridable from the command line
//! ([`TrainingArgumentsCli`]: `--learning-rate 3e-4`, `--learning_rate 3e-4` also accepted).
//!
//! Precedence: CLI flags > file > the program's defaults (> HF's defaults). [`TrainingArguments::finalize`] fills
//! the derived values HF computes in `__post_init__` (metric_for_best_model = "loss" under
//! load_best_model_at_end, greater_is_better from the metric name, eval_steps = logging_steps) and validates;
//! every error names the field and the fix.
//!
//! Sharded data parallelism is HF's `fsdp` (its words: `shard_grad_op`, `full_shard`, `hybrid_shard`, `no_shard`,
//! ... plus our `shard_optim`; [`TrainingArguments::fsdp_plan`], [`FsdpPlan::apply`]); `fsdp_config` is not read.
//!
//! Differences from HF on purpose: `mixed_precision` ("no" | "fp16" | "bf16") replaces the `fp16`/`bf16` booleans;
//! `optim` is "adamw" (alias "adamw_torch") or "sgd" (with `sgd_momentum`); early stopping can be configured here
//! (`early_stopping_patience`, `early_stopping_threshold`) instead of only through a callback; `report_to` knows
//! "jsonl" and "tensorboard"; `save_plots` writes the loss/metric curves at the end of training.
//!
//! Optional parts need cargo features of this crate: `tensorboard` (report_to "tensorboard"), `plots`
//! (`save_plots`), `progress` (the bar `disable_tqdm` controls). Their defaults follow the build (on when the feature
//! is), and asking for one explicitly in a build without it is an error at validation naming the feature.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use accel::config::MixedPrecision;
use accel::scheduler::SchedulerKind;
use accel::{ParallelismConfig, ShardingStrategy};
use serde::{Deserialize, Deserializer, Serialize};

use crate::config_file;
use crate::error::{Result, TrainerError};

/// When something happens during training (HF's `IntervalStrategy`): never, every `*_steps` optimizer steps, or at
/// the end of every epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IntervalStrategy {
    /// Never.
    #[default]
    No,
    /// Every `*_steps` optimizer steps.
    Steps,
    /// At the end of every epoch.
    Epoch,
}

/// When checkpoints are written (HF's `SaveStrategy`): like [`IntervalStrategy`] plus `best` (whenever an
/// evaluation gives a new best `metric_for_best_model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SaveStrategy {
    /// Never (save_model can still be called).
    No,
    /// Every `save_steps` optimizer steps (and at the last step).
    #[default]
    Steps,
    /// At the end of every epoch.
    Epoch,
    /// After every evaluation that improves `metric_for_best_model`.
    Best,
}

/// The optimizer (HF's `optim`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// torch.optim.AdamW (decoupled weight decay; Loshchilov & Hutter 2019) with `adam_beta1/2`, `adam_epsilon`.
    #[default]
    #[serde(alias = "adamw_torch", alias = "adam_w")]
    AdamW,
    /// torch.optim.SGD with `sgd_momentum` and `weight_decay`.
    Sgd,
}

macro_rules! impl_enum_text {
    ($ty:ty, $field:literal, [$(($variant:expr, $name:literal)),*]) => {
        impl $ty {
            /// The accepted spellings, for error messages.
            pub const CHOICES: &'static [&'static str] = &[$($name),*];
            /// The canonical spelling.
            pub fn as_str(self) -> &'static str {
                match self { $(v if v == $variant => $name,)* _ => unreachable!() }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.as_str()) }
        }
        impl FromStr for $ty {
            type Err = TrainerError;
            fn from_str(s: &str) -> Result<Self> {
                let norm = s.trim().to_ascii_lowercase();
                $(if norm == $name { return Ok($variant); })*
                Err(TrainerError::invalid($field, format!("unknown value {s:?}; choose one of {}", Self::CHOICES.join(", "))))
            }
        }
    };
}
impl_enum_text!(
    IntervalStrategy,
    "strategy",
    [(IntervalStrategy::No, "no"), (IntervalStrategy::Steps, "steps"), (IntervalStrategy::Epoch, "epoch")]
);
impl_enum_text!(
    SaveStrategy,
    "save_strategy",
    [
        (SaveStrategy::No, "no"),
        (SaveStrategy::Steps, "steps"),
        (SaveStrategy::Epoch, "epoch"),
        (SaveStrategy::Best, "best")
    ]
);
impl_enum_text!(OptimizerKind, "optim", [(OptimizerKind::AdamW, "adamw"), (OptimizerKind::Sgd, "sgd")]);

/// What a non-finite training loss or gradient norm does (`on_nonfinite_loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NonFiniteLoss {
    /// Stop training with an error naming the global step, the rank(s) and the last finite loss.
    #[default]
    Error,
    /// Skip that optimizer step on every rank (its gradients are dropped, the schedule does not move), as fp16 loss
    /// scaling skips an overflowing step, and warn; the global step still advances (its batches were consumed).
    SkipStep,
}
impl_enum_text!(
    NonFiniteLoss,
    "on_nonfinite_loss",
    [(NonFiniteLoss::Error, "error"), (NonFiniteLoss::SkipStep, "skip_step")]
);

/// Where logs go besides the console (HF's `report_to`): any of "jsonl" (`logging_dir/<project>.jsonl`...),
/// "tensorboard" (event files, feature `tensorboard`), or "all" (every tracker this build has) / "none". Accepts a
/// list or a comma-separated string. Default: "all".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReportTo(pub Vec<String>);

impl ReportTo {
    /// Known tracker names.
    pub const CHOICES: &'static [&'static str] = &["jsonl", "tensorboard", "all", "none"];

    /// Whether `name` ("jsonl" or "tensorboard") is selected: named, or "all" and in this build.
    pub fn contains(&self, name: &str) -> bool {
        let built = name != "tensorboard" || cfg!(feature = "tensorboard");
        self.0.iter().any(|n| n == name || (n == "all" && built))
    }

    fn parse_list(items: impl IntoIterator<Item = String>) -> ReportTo {
        ReportTo(
            items
                .into_iter()
                .flat_map(|s| s.split(',').map(|p| p.trim().to_ascii_lowercase()).collect::<Vec<_>>())
                .filter(|s| !s.is_empty())
                .collect(),
        )
    }
}

impl Default for ReportTo {
    /// Every tracker this build has: jsonl, plus tensorboard with the feature `tensorboard`.
    fn default() -> Self {
        let mut names = vec!["jsonl".to_string()];
        if cfg!(feature = "tensorboard") {
            names.push("tensorboard".into());
        }
        ReportTo(names)
    }
}

impl<'de> Deserialize<'de> for ReportTo {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(String),
            Many(Vec<String>),
        }
        Ok(match Raw::deserialize(d)? {
            Raw::One(s) => ReportTo::parse_list([s]),
            Raw::Many(v) => ReportTo::parse_list(v),
        })
    }
}

/// `fsdp`: HF's string of words, or a list of them (joined by spaces); null is unset.
fn de_fsdp<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Option::<Raw>::deserialize(d)? {
        None => None,
        Some(Raw::One(s)) => Some(s),
        Some(Raw::Many(words)) => Some(words.join(" ")),
    })
}

fn de_scheduler<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<SchedulerKind, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(|e: accel::AccelError| serde::de::Error::custom(e.to_string()))
}

/// Declares the argument struct, its defaults and its CLI-override twin from one list of fields, so the three
/// can never drift apart.
macro_rules! training_arguments {
    ($(
        $(#[doc = $doc:literal])*
        $(#[serde($($serde:tt)*)])*
        $(#[cli_alias = $alias:literal])?
        $field:ident : $ty:ty = $default:expr;
    )*) => {
        /// Arguments of a training run (HF `TrainingArguments` names). Build with `Default` + struct update, from
        /// a file ([`TrainingArguments::from_file`]), or from a file and the command line
        /// ([`TrainingArgumentsCli::resolve`]).
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct TrainingArguments {
            $( $(#[doc = $doc])* $(#[serde($($serde)*)])* pub $field: $ty, )*
        }

        impl Default for TrainingArguments {
            fn default() -> Self {
                TrainingArguments { $( $field: $default, )* }
            }
        }

        /// Command-line overrides of [`TrainingArguments`]: one `--kebab-case` flag per field (the HF
        /// `--snake_case` spelling is an alias), plus `--config FILE` (YAML or JSON). Flatten it into your clap
        /// parser (`#[command(flatten)]`) and call [`TrainingArgumentsCli::resolve`].
        #[derive(Debug, Clone, Default, clap::Args)]
        pub struct TrainingArgumentsCli {
            /// YAML or JSON file with training arguments (HF names); flags given here override it.
            #[arg(long = "config", value_name = "FILE", help_heading = "Training arguments")]
            pub config: Option<PathBuf>,
            $(
                $(#[doc = $doc])*
                #[arg(
                    long, alias = stringify!($field), $(visible_alias = $alias,)? value_name = "VALUE",
                    help_heading = "Training arguments"
                )]
                pub $field: Option<String>,
            )*
        }

        impl TrainingArgumentsCli {
            /// The flags given, as (field name, raw value).
            pub fn overrides(&self) -> Vec<(&'static str, &str)> {
                let mut out = Vec::new();
                $( if let Some(v) = &self.$field { out.push((stringify!($field), v.as_str())); } )*
                out
            }
        }

        /// Converts a raw CLI value to the JSON value of `field`'s type: the value read as a number / bool / null
        /// when that fits the type, else as a string.
        fn typed_cli_value(field: &str, raw: &str) -> Result<serde_json::Value> {
            match field {
                $( stringify!($field) => {
                    let mut last_err = String::new();
                    for candidate in scalar_candidates(raw) {
                        match serde_json::from_value::<$ty>(candidate.clone()) {
                            Ok(_) => return Ok(candidate),
                            Err(e) => last_err = e.to_string(),
                        }
                    }
                    Err(TrainerError::invalid(field, format!(
                        "cannot use {raw:?} from --{}: {last_err}", field.replace('_', "-")
                    )))
                } )*
                _ => Err(TrainerError::invalid(field, "no such training argument")),
            }
        }

        /// What `field` accepts, in words, when its type is a number or a boolean (whose parser messages, such as
        /// "invalid floating point", do not say it); `None` otherwise.
        fn field_expects(field: &str) -> Option<&'static str> {
            match field {
                $( stringify!($field) => scalar_expects(stringify!($ty)), )*
                _ => None,
            }
        }
    };
}

/// A scalar type's accepted values in words (`f64` → "a number …"), for file errors.
fn scalar_expects(ty: &str) -> Option<&'static str> {
    Some(match ty.replace(' ', "").as_str() {
        "f64" => "a number (such as 3, 0.5 or 2e-4)",
        "Option<f64>" => "a number (such as 3, 0.5 or 2e-4) or null",
        "i64" => "a whole number",
        "u64" | "usize" => "a whole number ≥ 0",
        "Option<u64>" | "Option<usize>" => "a whole number ≥ 0 or null",
        "bool" => "`true` or `false`",
        "Option<bool>" => "`true`, `false` or null",
        _ => return None,
    })
}

/// Interpretations of a raw CLI string, most specific first.
fn scalar_candidates(raw: &str) -> Vec<serde_json::Value> {
    use serde_json::Value;
    let mut out = Vec::new();
    let t = raw.trim();
    if let Ok(i) = t.parse::<i64>() {
        out.push(Value::from(i));
    }
    if let Ok(f) = t.parse::<f64>() {
        if f.is_finite() {
            out.push(Value::from(f));
        }
    }
    match t.to_ascii_lowercase().as_str() {
        "true" => out.push(Value::Bool(true)),
        "false" => out.push(Value::Bool(false)),
        "null" | "none" | "~" => out.push(Value::Null),
        _ => {}
    }
    out.push(Value::String(raw.to_string()));
    out
}

training_arguments! {
    /// Where checkpoints, the final model, logs and plots go.
    output_dir: PathBuf = PathBuf::from("trainer_output");
    /// Start over in an output_dir that holds another run's checkpoints, deleting them first (otherwise such a
    /// directory is refused unless the run resumes from it).
    overwrite_output_dir: bool = false;
    /// Epochs to train (a fraction trains part of the last epoch). Ignored when max_steps > 0.
    #[cli_alias = "epochs"]
    num_train_epochs: f64 = 3.0;
    /// Total optimizer steps; when > 0 it wins over num_train_epochs.
    max_steps: i64 = -1;
    /// Samples per process per micro-batch for training.
    per_device_train_batch_size: usize = 8;
    /// Samples per process per batch for evaluation and prediction.
    per_device_eval_batch_size: usize = 8;
    /// Micro-batches per optimizer step.
    gradient_accumulation_steps: usize = 1;
    /// Recompute each model block's activations in the backward pass instead of keeping them (the model's
    /// accel::nn units, or the blocks it wraps in accel::activation_checkpoint::block; HF's gradient_checkpointing).
    gradient_checkpointing: bool = false;
    /// Sharded data parallelism (HF's fsdp): words separated by spaces (or a list). One sharding word:
    /// shard_grad_op (ZeRO-2: gradients and optimizer state), shard_optim (ZeRO-1: optimizer state), no_shard
    /// (plain DDP), full_shard (ZeRO-3: the parameters too; the model must be built on accel::nn's builder, as
    /// Trainer::with_plan models are, not from Trainer::new's candle VarBuilder), hybrid_shard /
    /// hybrid_shard_zero2 (full_shard / shard_grad_op within dp_shard, replicated over dp_replicate: the layout
    /// must set both above 1); none = full_shard, as HF. auto_wrap is accepted and ignored (there is no wrapping
    /// policy to choose: the units are the model's own blocks); offload is refused. Unless the layout already has
    /// dp_shard above 1, every data-parallel process shards (dp_shard = the data-parallel size, dp_replicate 1).
    #[serde(deserialize_with = "de_fsdp")]
    fsdp: Option<String> = None;
    /// Peak learning rate (after warmup).
    learning_rate: f64 = 5e-5;
    /// Weight decay (decoupled for AdamW, L2 for SGD).
    weight_decay: f64 = 0.0;
    /// AdamW beta1.
    adam_beta1: f64 = 0.9;
    /// AdamW beta2.
    adam_beta2: f64 = 0.999;
    /// AdamW epsilon.
    adam_epsilon: f64 = 1e-8;
    /// SGD momentum (0 = plain SGD).
    sgd_momentum: f64 = 0.0;
    /// Optimizer: adamw | sgd.
    optim: OptimizerKind = OptimizerKind::AdamW;
    /// A non-finite loss or gradient norm: error (stop, naming the step) | skip_step (drop that step and go on).
    on_nonfinite_loss: NonFiniteLoss = NonFiniteLoss::Error;
    /// Learning-rate schedule: constant | constant_with_warmup | linear | cosine.
    #[serde(deserialize_with = "de_scheduler")]
    lr_scheduler_type: SchedulerKind = SchedulerKind::Linear;
    /// Warmup optimizer steps (wins over warmup_ratio when > 0).
    warmup_steps: u64 = 0;
    /// Warmup as a fraction of the total optimizer steps (rounded up).
    warmup_ratio: f64 = 0.0;
    /// Gradient clipping by total L2 norm; 0 disables clipping.
    max_grad_norm: f64 = 1.0;
    /// Compute precision: no | fp16 | bf16 (a YAML 1.1 `false`, what a bare `no` becomes, means no).
    mixed_precision: MixedPrecision = MixedPrecision::No;
    /// When to evaluate: no | steps | epoch.
    eval_strategy: IntervalStrategy = IntervalStrategy::No;
    /// Evaluate every N optimizer steps (a value < 1 is a fraction of the total steps); default logging_steps.
    eval_steps: Option<f64> = None;
    /// When to checkpoint: no | steps | epoch | best.
    save_strategy: SaveStrategy = SaveStrategy::Steps;
    /// Checkpoint every N optimizer steps (a value < 1 is a fraction of the total steps).
    save_steps: f64 = 500.0;
    /// Keep at most this many checkpoints (the best one is never deleted); null keeps all.
    save_total_limit: Option<usize> = None;
    /// Write checkpoints in the background (torchtitan's asynchronous checkpointing): a save returns once the state
    /// is copied in memory (the model's fp32 weights and the optimizer's state on the main process, about 12 bytes
    /// per parameter with AdamW) and training goes on while a writer thread writes, checksums and commits it; the
    /// next save and the end of training wait for it.
    async_checkpointing: bool = false;
    /// Load the best checkpoint's weights when training ends (needs matching eval/save strategies).
    load_best_model_at_end: bool = false;
    /// Metric that decides the best checkpoint and early stopping, e.g. "loss" or "accuracy" ("eval_" optional).
    metric_for_best_model: Option<String> = None;
    /// Whether a larger metric is better; default false for names ending in "loss", true otherwise.
    greater_is_better: Option<bool> = None;
    /// When to log: no | steps | epoch.
    logging_strategy: IntervalStrategy = IntervalStrategy::Steps;
    /// Log every N optimizer steps (a value < 1 is a fraction of the total steps).
    logging_steps: f64 = 500.0;
    /// Also log after the first optimizer step.
    logging_first_step: bool = false;
    /// Tracker output directory (default output_dir/runs).
    logging_dir: Option<PathBuf> = None;
    /// Trackers: jsonl, tensorboard, all, none (list or comma-separated).
    report_to: ReportTo = ReportTo::default();
    /// Name of the run in the trackers (default: the output_dir's name).
    run_name: Option<String> = None;
    /// Seed of model initialisation and of everything random in training.
    seed: u64 = 42;
    /// Seed of the data order (default: seed).
    data_seed: Option<u64> = None;
    /// Drop the last incomplete training batch of each epoch.
    dataloader_drop_last: bool = false;
    /// Resume from this checkpoint directory, or "latest" for the newest under output_dir.
    resume_from_checkpoint: Option<String> = None;
    /// Stop after this many evaluations without improvement of metric_for_best_model (null: no early stopping).
    early_stopping_patience: Option<usize> = None;
    /// Minimum improvement over the best metric that resets the early-stopping patience.
    early_stopping_threshold: f64 = 0.0;
    /// Hide the progress bar (it is also hidden when stderr is not a terminal and on ranks other than 0). The bar
    /// needs the feature `progress`; without it the default is true and false is an error.
    disable_tqdm: bool = !cfg!(feature = "progress");
    /// Normalise token-level losses by the item count summed over all processes (exact GA/DP equivalence).
    average_tokens_across_devices: bool = true;
    /// Write loss and eval-metric curves (PNG and SVG) to output_dir when training ends. Needs the feature
    /// `plots`; without it the default is false and true is an error.
    save_plots: bool = cfg!(feature = "plots");
}

impl TrainingArguments {
    /// Reads a YAML (`.yaml`/`.yml`) or JSON (`.json`) file; keys absent from the file keep HF's defaults.
    /// Unknown keys are errors naming the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::default().overlay_file(path)
    }

    /// Parses YAML text (all keys optional); errors as [`Self::from_file`]'s, with the source named `<yaml>`.
    pub fn from_yaml_str(text: &str) -> Result<Self> {
        config_file::parse(Path::new("<yaml>"), text, &field_expects).map(|(args, _)| args)
    }

    /// The HF-style entry point: `file` (if any) over the defaults, then the process's command-line flags
    /// (`--learning-rate 3e-4`, `--config other.yaml`), then [`Self::finalize`]. Exits with clap's message on
    /// `--help` or an unknown flag.
    pub fn from_yaml_and_cli(file: impl AsRef<Path>) -> Result<Self> {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: TrainingArgumentsCli,
        }
        let cli = Cli::parse();
        let mut base = Self::default();
        let file = file.as_ref();
        if !file.as_os_str().is_empty() && cli.args.config.is_none() {
            base = base.overlay_file(file)?;
        }
        cli.args.resolve(base)
    }

    /// `self` with the keys present in the YAML/JSON file `path` replaced. Errors name the file and the position:
    /// an unknown key with the closest known one, a value of the wrong kind with what the key expects.
    pub fn overlay_file(self, path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TrainerError::ConfigFile { path: path.to_path_buf(), reason: e.to_string() })?;
        // The typed struct checks every key and value; only the keys the file actually set are taken from it.
        let (from_file, keys): (TrainingArguments, _) = config_file::parse(path, &text, &field_expects)?;
        let file_json = serde_json::to_value(&from_file).map_err(|e| TrainerError::json("encoding arguments", e))?;
        let mut merged = serde_json::to_value(&self).map_err(|e| TrainerError::json("encoding arguments", e))?;
        for k in keys {
            if let Some(v) = file_json.get(&k) {
                merged[k.as_str()] = v.clone();
            }
        }
        serde_json::from_value(merged)
            .map_err(|e| TrainerError::ConfigFile { path: path.to_path_buf(), reason: e.to_string() })
    }

    /// Writes the arguments as YAML (what a run used; the trainer saves it as `output_dir/training_args.yaml`).
    pub fn to_yaml(&self) -> Result<String> {
        serde_saphyr::to_string(self)
            .map_err(|e| TrainerError::Usage(format!("cannot encode training arguments as YAML: {e}")))
    }

    /// The run's name in the trackers: `run_name`, else the output_dir's last component (else "trainer").
    pub fn run_name_resolved(&self) -> String {
        self.run_name.clone().unwrap_or_else(|| {
            self.output_dir
                .file_name()
                .and_then(|n| n.to_str())
                .filter(|n| !n.is_empty() && *n != "." && *n != "..")
                .unwrap_or("trainer")
                .to_string()
        })
    }

    /// Where the trackers (`report_to`) write: `logging_dir` (default `output_dir/runs`) / run name. One
    /// subdirectory per run, as HF's `runs/<run>` layout: runs with different `run_name`s sit side by side under
    /// one `tensorboard --logdir output_dir/runs`.
    pub fn tracker_dir(&self) -> PathBuf {
        self.logging_dir.clone().unwrap_or_else(|| self.output_dir.join("runs")).join(self.run_name_resolved())
    }

    /// The metric name used for the best model and early stopping, with the "eval_" prefix (after finalize).
    pub fn best_metric_key(&self) -> Option<String> {
        self.metric_for_best_model
            .as_ref()
            .map(|m| if m.starts_with("eval_") { m.clone() } else { format!("eval_{m}") })
    }

    /// Whether a larger best-model metric is better (HF's default: false for names ending in "loss").
    pub fn greater_is_better_resolved(&self) -> bool {
        self.greater_is_better
            .unwrap_or_else(|| self.metric_for_best_model.as_deref().is_some_and(|m| !m.ends_with("loss")))
    }

    /// Seed of the data order (`data_seed`, else `seed`).
    pub fn data_seed_resolved(&self) -> u64 {
        self.data_seed.unwrap_or(self.seed)
    }

    /// HF's `__post_init__`: fills derived values (metric_for_best_model = "loss" under load_best_model_at_end
    /// or early stopping, greater_is_better from the metric's name, eval_steps = logging_steps), then
    /// [`Self::validate`]s.
    pub fn finalize(&mut self) -> Result<()> {
        if self.metric_for_best_model.is_none()
            && (self.load_best_model_at_end || self.early_stopping_patience.is_some())
        {
            self.metric_for_best_model = Some("loss".into());
        }
        if self.greater_is_better.is_none() && self.metric_for_best_model.is_some() {
            self.greater_is_better = Some(self.greater_is_better_resolved());
        }
        if self.eval_strategy == IntervalStrategy::Steps && self.eval_steps.is_none() {
            self.eval_steps = Some(self.logging_steps);
        }
        self.validate()
    }

    /// Checks the arguments; every error names the field and the fix. Call after [`Self::finalize`] (the trainer
    /// does both). The checks run in this order and the first failure is returned.
    pub fn validate(&self) -> Result<()> {
        self.check_run_length()?;
        self.check_hyperparameters()?;
        self.check_intervals()?;
        self.check_best_model()?;
        self.check_save_best()?;
        self.check_early_stopping()?;
        self.check_outputs()?;
        self.check_resume()?;
        self.fsdp_plan().map(|_| ())
    }

    /// Batch sizes and accumulation of at least 1; some training to do (epochs or `max_steps`).
    fn check_run_length(&self) -> Result<()> {
        for (field, v) in [
            ("per_device_train_batch_size", self.per_device_train_batch_size),
            ("per_device_eval_batch_size", self.per_device_eval_batch_size),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
        ] {
            if v == 0 {
                return Err(err(field, "must be at least 1"));
            }
        }
        if self.max_steps <= 0 && !(self.num_train_epochs > 0.0 && self.num_train_epochs.is_finite()) {
            return Err(err(
                "num_train_epochs",
                format!(
                    "is {} and max_steps is {}: set num_train_epochs > 0 or max_steps > 0",
                    self.num_train_epochs, self.max_steps
                ),
            ));
        }
        Ok(())
    }

    /// The optimizer's numbers in range: rates and thresholds finite and ≥ 0, betas and momentum in [0, 1),
    /// `warmup_ratio` in [0, 1].
    fn check_hyperparameters(&self) -> Result<()> {
        for (field, v) in [
            ("learning_rate", self.learning_rate),
            ("weight_decay", self.weight_decay),
            ("max_grad_norm", self.max_grad_norm),
            ("adam_epsilon", self.adam_epsilon),
            ("early_stopping_threshold", self.early_stopping_threshold),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(err(field, format!("is {v}; it must be a finite number ≥ 0")));
            }
        }
        for (field, v) in
            [("adam_beta1", self.adam_beta1), ("adam_beta2", self.adam_beta2), ("sgd_momentum", self.sgd_momentum)]
        {
            if !(0.0..1.0).contains(&v) {
                return Err(err(field, format!("is {v}; it must be in [0, 1)")));
            }
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return Err(err(
                "warmup_ratio",
                format!(
                    "is {}; it is a fraction of the training steps in [0, 1] (or use warmup_steps)",
                    self.warmup_ratio
                ),
            ));
        }
        Ok(())
    }

    /// The intervals of the "steps" strategies in use, and a `save_total_limit` that keeps something.
    fn check_intervals(&self) -> Result<()> {
        if self.logging_strategy == IntervalStrategy::Steps {
            check_interval("logging_steps", self.logging_steps)?;
        }
        if self.eval_strategy == IntervalStrategy::Steps {
            let eval_steps = self.eval_steps.unwrap_or(self.logging_steps);
            check_interval("eval_steps", eval_steps)?;
        }
        if self.save_strategy == SaveStrategy::Steps {
            check_interval("save_steps", self.save_steps)?;
        }
        if self.save_total_limit == Some(0) {
            return Err(err("save_total_limit", "is 0; keep at least 1 checkpoint, or remove it to keep all"));
        }
        Ok(())
    }

    /// A named best-model metric, and what `load_best_model_at_end` needs: evaluations, and checkpoints saved
    /// where evaluations happen.
    fn check_best_model(&self) -> Result<()> {
        if let Some(m) = &self.metric_for_best_model {
            if m.trim().is_empty() || m == "eval_" {
                return Err(err("metric_for_best_model", "is empty; name a metric such as \"loss\" or \"accuracy\""));
            }
        }
        if !self.load_best_model_at_end {
            return Ok(());
        }
        if self.eval_strategy == IntervalStrategy::No {
            return Err(err(
                "load_best_model_at_end",
                "needs evaluations to pick the best model: set eval_strategy to \"steps\" or \"epoch\" (and an \
                 eval dataset)",
            ));
        }
        if self.save_strategy != SaveStrategy::Best {
            let same = matches!(
                (self.eval_strategy, self.save_strategy),
                (IntervalStrategy::Steps, SaveStrategy::Steps) | (IntervalStrategy::Epoch, SaveStrategy::Epoch)
            );
            if !same {
                return Err(err(
                    "load_best_model_at_end",
                    format!(
                        "requires the save and eval strategies to match, but eval_strategy is {} and save_strategy \
                         is {}; set save_strategy to \"{}\"",
                        self.eval_strategy, self.save_strategy, self.eval_strategy
                    ),
                ));
            }
            if self.eval_strategy == IntervalStrategy::Steps {
                self.check_saves_at_evaluations()?;
            }
        }
        Ok(())
    }

    /// Under `load_best_model_at_end` with "steps" strategies: every save falls on an evaluation (`save_steps` a
    /// round multiple of `eval_steps`).
    fn check_saves_at_evaluations(&self) -> Result<()> {
        let eval_steps = self.eval_steps.unwrap_or(self.logging_steps);
        let multiple = if eval_steps < 1.0 || self.save_steps < 1.0 {
            // Both fractions of max_steps: HF requires save_steps / eval_steps to be a whole number.
            let r = self.save_steps / eval_steps;
            (r - r.round()).abs() < 1e-9
        } else {
            (self.save_steps as u64).is_multiple_of(eval_steps as u64)
        };
        if !multiple {
            return Err(err(
                "save_steps",
                format!(
                    "load_best_model_at_end requires save_steps to be a round multiple of eval_steps, but \
                     save_steps is {} and eval_steps is {}; set save_steps to {}",
                    self.save_steps,
                    eval_steps,
                    ((self.save_steps / eval_steps).ceil().max(1.0) * eval_steps)
                ),
            ));
        }
        Ok(())
    }

    /// `save_strategy` "best" needs a metric and evaluations.
    fn check_save_best(&self) -> Result<()> {
        if self.save_strategy != SaveStrategy::Best {
            return Ok(());
        }
        if self.metric_for_best_model.is_none() {
            return Err(err(
                "metric_for_best_model",
                "save_strategy \"best\" needs a metric to compare; set metric_for_best_model (e.g. \"loss\")",
            ));
        }
        if self.eval_strategy == IntervalStrategy::No {
            return Err(err("save_strategy", "\"best\" saves after evaluations: set eval_strategy to steps or epoch"));
        }
        Ok(())
    }

    /// Early stopping needs a patience ≥ 1, a metric to watch and evaluations.
    fn check_early_stopping(&self) -> Result<()> {
        let Some(p) = self.early_stopping_patience else { return Ok(()) };
        if p == 0 {
            return Err(err(
                "early_stopping_patience",
                "is 0; it counts evaluations without improvement before stopping, use ≥ 1",
            ));
        }
        if self.metric_for_best_model.is_none() {
            return Err(err(
                "metric_for_best_model",
                "early stopping needs a metric to watch; set metric_for_best_model (e.g. \"loss\")",
            ));
        }
        if self.eval_strategy == IntervalStrategy::No {
            return Err(err(
                "early_stopping_patience",
                "early stopping needs evaluations: set eval_strategy to \"steps\" or \"epoch\"",
            ));
        }
        Ok(())
    }

    /// Known trackers, and no output (tracker, plots, progress bar) this build left out: an error naming the
    /// feature, never a silently missing output.
    fn check_outputs(&self) -> Result<()> {
        for name in &self.report_to.0 {
            if !ReportTo::CHOICES.contains(&name.as_str()) {
                return Err(err(
                    "report_to",
                    format!("unknown tracker {name:?}; choose from {}", ReportTo::CHOICES.join(", ")),
                ));
            }
        }
        let missing =
            |feature: &str| format!("built without feature `{feature}` of crate trainer: enable it in Cargo.toml");
        if !cfg!(feature = "tensorboard") && self.report_to.0.iter().any(|n| n == "tensorboard") {
            return Err(err("report_to", missing("tensorboard")));
        }
        if !cfg!(feature = "plots") && self.save_plots {
            return Err(err("save_plots", missing("plots")));
        }
        if !cfg!(feature = "progress") && !self.disable_tqdm {
            return Err(err("disable_tqdm", missing("progress")));
        }
        Ok(())
    }

    /// A `resume_from_checkpoint` that names something.
    fn check_resume(&self) -> Result<()> {
        if let Some(r) = &self.resume_from_checkpoint {
            if r.trim().is_empty() {
                return Err(err("resume_from_checkpoint", "is empty; give a checkpoint directory or \"latest\""));
            }
        }
        Ok(())
    }

    /// An interval given as steps or as a fraction of `max_steps` (HF: values < 1 are ratios, rounded up).
    pub fn steps_from(value: f64, max_steps: u64) -> u64 {
        if value < 1.0 {
            ((max_steps as f64) * value).ceil().max(1.0) as u64
        } else {
            value as u64
        }
    }

    /// The optimizer-step interval of logging / evaluation / saving for a run of `max_steps` steps.
    pub fn logging_interval(&self, max_steps: u64) -> u64 {
        Self::steps_from(self.logging_steps, max_steps)
    }
    /// See [`Self::logging_interval`].
    pub fn eval_interval(&self, max_steps: u64) -> u64 {
        Self::steps_from(self.eval_steps.unwrap_or(self.logging_steps), max_steps)
    }
    /// See [`Self::logging_interval`].
    pub fn save_interval(&self, max_steps: u64) -> u64 {
        Self::steps_from(self.save_steps, max_steps)
    }

    /// Whether `resume_from_checkpoint` asks for the newest checkpoint ("latest" or "true").
    pub fn resume_latest(&self) -> bool {
        self.resume_from_checkpoint.as_deref().is_some_and(|r| matches!(r.trim(), "latest" | "true" | "True"))
    }
}

/// What HF's `fsdp` words ask for ([`TrainingArguments::fsdp_plan`]): the sharding strategy, and whether the
/// shards are hybrid (sharded within dp_shard groups, replicated over dp_replicate: `hybrid_shard*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpPlan {
    /// What the dp_shard processes shard.
    pub strategy: ShardingStrategy,
    /// `hybrid_shard` / `hybrid_shard_zero2`: the layout must already give dp_shard and dp_replicate above 1.
    pub hybrid: bool,
}

/// `fsdp`'s sharding words (HF's `FSDPOption`s and our `shard_optim`), their strategy and whether they are hybrid.
const FSDP_SHARDING_WORDS: [(&str, ShardingStrategy, bool); 6] = [
    ("full_shard", ShardingStrategy::FullShard, false),
    ("shard_grad_op", ShardingStrategy::ShardGradOp, false),
    ("shard_optim", ShardingStrategy::ShardOptim, false),
    ("no_shard", ShardingStrategy::NoShard, false),
    ("hybrid_shard", ShardingStrategy::FullShard, true),
    ("hybrid_shard_zero2", ShardingStrategy::ShardGradOp, true),
];

impl TrainingArguments {
    /// `fsdp` read: `None` when unset or empty; else the strategy of its one sharding word (FULL_SHARD without
    /// one, HF's default), `auto_wrap` ignored.
    ///
    /// Errors ([`TrainerError::InvalidArgument`] on `fsdp`): an unknown word, `offload`, two sharding words.
    pub fn fsdp_plan(&self) -> Result<Option<FsdpPlan>> {
        let Some(text) = self.fsdp.as_deref().filter(|t| !t.trim().is_empty()) else { return Ok(None) };
        let mut chosen: Option<(&str, FsdpPlan)> = None;
        for word in text.split_whitespace() {
            let w = word.to_ascii_lowercase();
            if w == "auto_wrap" {
                continue;
            }
            if w == "offload" {
                return Err(err(
                    "fsdp",
                    "\"offload\" (CPU offload of the parameters) is not implemented: each rank keeps its shards on \
                     the device it trains on (on the CPU it would be the same memory); remove it",
                ));
            }
            let Some(&(name, strategy, hybrid)) = FSDP_SHARDING_WORDS.iter().find(|(n, ..)| *n == w) else {
                let known: Vec<&str> = FSDP_SHARDING_WORDS.iter().map(|(n, ..)| *n).collect();
                return Err(err(
                    "fsdp",
                    format!("unknown word {word:?} in {text:?}; use one of {}, plus auto_wrap", known.join(", ")),
                ));
            };
            if let Some((first, _)) = chosen.filter(|(first, _)| *first != name) {
                return Err(err(
                    "fsdp",
                    format!("{text:?} names two sharding strategies, {first} and {name}; keep one"),
                ));
            }
            chosen = Some((name, FsdpPlan { strategy, hybrid }));
        }
        Ok(Some(chosen.map_or(FsdpPlan { strategy: ShardingStrategy::FullShard, hybrid: false }, |(_, p)| p)))
    }
}

impl FsdpPlan {
    /// The layout `layout` becomes on `world_size` processes with this plan: its sharding strategy set, and,
    /// unless it already has dp_shard above 1, every data-parallel process made dp_shard (dp_shard = the resolved
    /// dp_replicate, dp_replicate 1: HF's FSDP over all ranks). A hybrid plan keeps the layout, which must give
    /// dp_shard and dp_replicate above 1. A layout that does not fit `world_size` is returned with only the
    /// strategy set (the Accelerator names what fits).
    ///
    /// Errors ([`TrainerError::InvalidArgument`] on `fsdp`): a hybrid plan on a layout without both.
    pub fn apply(self, layout: &ParallelismConfig, world_size: usize, fsdp: &str) -> Result<ParallelismConfig> {
        let set = layout.clone().with_sharding_strategy(self.strategy);
        let Ok(resolved) = set.resolve(world_size) else { return Ok(set) };
        let p = if self.hybrid {
            if resolved.dp_shard_size < 2 || resolved.dp_replicate_size < 2 {
                return Err(err(
                    "fsdp",
                    format!(
                        "{fsdp:?} shards within dp_shard groups replicated over dp_replicate, so the layout must set \
                         both above 1 (PARALLELISM_CONFIG_DP_SHARD_SIZE and PARALLELISM_CONFIG_DP_REPLICATE_SIZE: \
                         accel launch --parallelism-config-dp-shard-size and --parallelism-config-dp-replicate-size, \
                         or Trainer::parallelism_config); it is {} on {world_size} processes",
                        resolved.layout_string()
                    ),
                ));
            }
            resolved
        } else if resolved.dp_shard_size == 1 {
            ParallelismConfig { dp_shard_size: resolved.dp_replicate_size, dp_replicate_size: 1, ..resolved }
        } else {
            resolved
        };
        Ok(p)
    }
}

/// A validation error on `field` (shorthand of [`TrainerError::invalid`]).
fn err(field: &str, reason: impl Into<String>) -> TrainerError {
    TrainerError::invalid(field, reason)
}

/// A "steps" strategy's interval: positive and finite, whole when larger than 1.
fn check_interval(field: &str, v: f64) -> Result<()> {
    if !(v > 0.0 && v.is_finite()) {
        return Err(TrainerError::invalid(
            field,
            format!("is {v}; the \"steps\" strategy needs a positive interval (steps, or a fraction < 1 of the run)"),
        ));
    }
    if v > 1.0 && v.fract() != 0.0 {
        return Err(TrainerError::invalid(
            field,
            format!("is {v}; it must be an integer when larger than 1 (values < 1 are fractions of the run)"),
        ));
    }
    Ok(())
}

impl TrainingArgumentsCli {
    /// `base`, then the `--config` file's keys (if given), then each flag; then [`TrainingArguments::finalize`].
    /// Errors name the flag and the expected type.
    pub fn resolve(&self, base: TrainingArguments) -> Result<TrainingArguments> {
        let mut args = match &self.config {
            Some(path) => base.overlay_file(path)?,
            None => base,
        };
        let overrides = self.overrides();
        if !overrides.is_empty() {
            let mut merged = serde_json::to_value(&args).map_err(|e| TrainerError::json("encoding arguments", e))?;
            for (field, raw) in overrides {
                merged[field] = typed_cli_value(field, raw)?;
            }
            args = serde_json::from_value(merged)
                .map_err(|e| TrainerError::Usage(format!("invalid command-line training arguments: {e}")))?;
        }
        args.finalize()?;
        Ok(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainingArgumentsCli,
    }

    fn cli(argv: &[&str]) -> TrainingArgumentsCli {
        Cli::try_parse_from(std::iter::once("prog").chain(argv.iter().copied())).unwrap().args
    }

    fn field_of(e: TrainerError) -> String {
        match e {
            TrainerError::InvalidArgument { field, .. } => field,
            other => panic!("expected InvalidArgument, got {other}"),
        }
    }

    #[test]
    fn defaults_are_hf_defaults() {
        let a = TrainingArguments::default();
        assert_eq!(a.learning_rate, 5e-5);
        assert_eq!(a.num_train_epochs, 3.0);
        assert_eq!(a.max_steps, -1);
        assert_eq!(a.per_device_train_batch_size, 8);
        assert_eq!(a.lr_scheduler_type, SchedulerKind::Linear);
        assert_eq!(a.save_steps, 500.0);
        assert_eq!(a.seed, 42);
        a.validate().unwrap();
    }

    #[test]
    fn yaml_then_cli_precedence_and_both_flag_spellings() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.yaml");
        std::fs::write(
            &file,
            "learning_rate: 0.001\nnum_train_epochs: 5\nmixed_precision: no\nlr_scheduler_type: cosine\n\
             report_to: jsonl\nmetric_for_best_model: accuracy\n",
        )
        .unwrap();
        let base = TrainingArguments { per_device_train_batch_size: 64, ..Default::default() };
        let c = cli(&[
            "--config",
            file.to_str().unwrap(),
            "--learning-rate",
            "3e-4",
            "--save_total_limit",
            "2",
            "--output-dir",
            "1234",
        ]);
        let a = c.resolve(base).unwrap();
        assert_eq!(a.learning_rate, 3e-4); // CLI beats file
        assert_eq!(a.num_train_epochs, 5.0); // file beats defaults
        assert_eq!(a.per_device_train_batch_size, 64); // program default kept
        assert_eq!(a.mixed_precision, MixedPrecision::No);
        assert_eq!(a.lr_scheduler_type, SchedulerKind::Cosine);
        assert_eq!(a.save_total_limit, Some(2));
        assert_eq!(a.output_dir, PathBuf::from("1234")); // a number-looking string stays a path
        assert_eq!(a.report_to, ReportTo(vec!["jsonl".into()]));
        assert_eq!(a.greater_is_better, Some(true)); // "accuracy" does not end in "loss"
    }

    #[test]
    fn tracker_dir_is_logging_dir_slash_run_name() {
        let a = TrainingArguments { output_dir: "runs/train_mnist".into(), ..Default::default() };
        assert_eq!(a.tracker_dir(), PathBuf::from("runs/train_mnist/runs/train_mnist"));
        let a = TrainingArguments { logging_dir: Some("tb".into()), run_name: Some("lr3e-4".into()), ..a };
        assert_eq!(a.tracker_dir(), PathBuf::from("tb/lr3e-4"));
        let a = TrainingArguments { output_dir: ".".into(), ..Default::default() };
        assert_eq!(a.tracker_dir(), PathBuf::from("./runs/trainer"));
    }

    #[test]
    fn epochs_is_an_alias_of_num_train_epochs() {
        let a = cli(&["--epochs", "7"]).resolve(TrainingArguments::default()).unwrap();
        assert_eq!(a.num_train_epochs, 7.0);
        let a = cli(&["--num_train_epochs", "2.5"]).resolve(TrainingArguments::default()).unwrap();
        assert_eq!(a.num_train_epochs, 2.5);
    }

    #[test]
    fn json_files_and_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.json");
        std::fs::write(&file, r#"{"max_steps": 10, "optim": "adamw_torch", "report_to": ["none"]}"#).unwrap();
        let a = TrainingArguments::from_file(&file).unwrap();
        assert_eq!((a.max_steps, a.optim), (10, OptimizerKind::AdamW));
        let bad = dir.path().join("b.yaml");
        std::fs::write(&bad, "learning_rate: 1e-3\nlerning_rate: 2\n").unwrap();
        let e = TrainingArguments::from_file(&bad).unwrap_err().to_string();
        assert!(e.contains("b.yaml: line 2: unknown key `lerning_rate` (did you mean `learning_rate`?)"), "{e}");
    }

    #[test]
    fn a_file_value_of_the_wrong_kind_says_what_the_key_expects() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.yaml");
        std::fs::write(&file, "learning_rate: 1e-3\nnum_train_epochs: two\n").unwrap();
        let e = TrainingArguments::from_file(&file).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "t.yaml: line 2, column 19: num_train_epochs: expected a number (such as 3, 0.5 or 2e-4), got `two`"
            ),
            "{e}"
        );
        let json = dir.path().join("t.json");
        std::fs::write(&json, r#"{"logging_first_step": "often"}"#).unwrap();
        let e = TrainingArguments::from_file(&json).unwrap_err().to_string();
        assert!(e.contains("logging_first_step: expected `true` or `false`, got `\"often\"`"), "{e}");
        // Enums: the key and the parser's message, which lists the choices.
        std::fs::write(&file, "eval_strategy: sometimes\n").unwrap();
        let e = TrainingArguments::from_file(&file).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "line 1, column 16: eval_strategy: unknown variant `sometimes`, expected one of no, steps, epoch"
            ),
            "{e}"
        );
    }

    #[test]
    fn bad_cli_value_names_the_flag() {
        let e = cli(&["--learning-rate", "fast"]).resolve(TrainingArguments::default()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("learning_rate") && msg.contains("--learning-rate") && msg.contains("fast"), "{msg}");
        let e = cli(&["--lr-scheduler-type", "exp"]).resolve(TrainingArguments::default()).unwrap_err().to_string();
        assert!(e.contains("exp") && e.contains("cosine"), "{e}");
    }

    #[test]
    fn finalize_fills_hf_derived_values() {
        let mut a = TrainingArguments {
            load_best_model_at_end: true,
            eval_strategy: IntervalStrategy::Steps,
            logging_steps: 50.0,
            save_steps: 100.0,
            ..Default::default()
        };
        a.finalize().unwrap();
        assert_eq!(a.metric_for_best_model.as_deref(), Some("loss"));
        assert_eq!(a.greater_is_better, Some(false));
        assert_eq!(a.eval_steps, Some(50.0));
        assert_eq!(a.best_metric_key().as_deref(), Some("eval_loss"));
        assert_eq!(TrainingArguments::steps_from(0.25, 10), 3);
        assert_eq!(TrainingArguments::steps_from(7.0, 10), 7);
    }

    #[test]
    fn validation_errors_name_field_and_fix() {
        let check = |a: TrainingArguments, field: &str, words: &[&str]| {
            let mut a = a;
            let e = a.finalize().unwrap_err();
            let msg = e.to_string();
            for w in words {
                assert!(msg.contains(w), "{msg:?} should contain {w:?}");
            }
            assert_eq!(field_of(e), field, "{msg}");
        };
        let d = TrainingArguments::default;
        check(
            TrainingArguments { per_device_train_batch_size: 0, ..d() },
            "per_device_train_batch_size",
            &["at least 1"],
        );
        check(
            TrainingArguments { per_device_eval_batch_size: 0, ..d() },
            "per_device_eval_batch_size",
            &["at least 1"],
        );
        check(TrainingArguments { gradient_accumulation_steps: 0, ..d() }, "gradient_accumulation_steps", &["1"]);
        check(
            TrainingArguments { load_best_model_at_end: true, eval_strategy: IntervalStrategy::Epoch, ..d() },
            "load_best_model_at_end",
            &["eval_strategy is epoch", "save_strategy is steps", "set save_strategy to \"epoch\""],
        );
        check(
            TrainingArguments {
                load_best_model_at_end: true,
                eval_strategy: IntervalStrategy::Steps,
                eval_steps: Some(300.0),
                save_steps: 500.0,
                ..d()
            },
            "save_steps",
            &["round multiple", "set save_steps to 600"],
        );
        check(TrainingArguments { load_best_model_at_end: true, ..d() }, "load_best_model_at_end", &["eval_strategy"]);
        check(
            TrainingArguments { save_strategy: SaveStrategy::Best, eval_strategy: IntervalStrategy::Epoch, ..d() },
            "metric_for_best_model",
            &["set metric_for_best_model"],
        );
        check(
            TrainingArguments { early_stopping_patience: Some(3), ..d() },
            "early_stopping_patience",
            &["eval_strategy"],
        );
        check(TrainingArguments { save_total_limit: Some(0), ..d() }, "save_total_limit", &["at least 1"]);
        check(TrainingArguments { num_train_epochs: 0.0, ..d() }, "num_train_epochs", &["max_steps > 0"]);
        check(TrainingArguments { warmup_ratio: 1.5, ..d() }, "warmup_ratio", &["[0, 1]"]);
        check(TrainingArguments { logging_steps: 2.5, ..d() }, "logging_steps", &["integer"]);
        check(TrainingArguments { learning_rate: -1.0, ..d() }, "learning_rate", &["≥ 0"]);
        check(
            TrainingArguments { report_to: ReportTo(vec!["wandb".into()]), ..d() },
            "report_to",
            &["wandb", "tensorboard"],
        );
        check(
            TrainingArguments { metric_for_best_model: Some(" ".into()), ..d() },
            "metric_for_best_model",
            &["empty"],
        );
    }

    fn plan(fsdp: &str) -> Result<Option<FsdpPlan>> {
        TrainingArguments { fsdp: Some(fsdp.into()), ..Default::default() }.fsdp_plan()
    }

    #[test]
    fn fsdp_words_pick_the_sharding_strategy_as_hf_names_them() {
        use ShardingStrategy::*;
        let p = |strategy, hybrid| Some(FsdpPlan { strategy, hybrid });
        assert_eq!(plan("full_shard auto_wrap").unwrap(), p(FullShard, false));
        assert_eq!(plan("shard_grad_op").unwrap(), p(ShardGradOp, false));
        assert_eq!(plan(" auto_wrap  SHARD_OPTIM ").unwrap(), p(ShardOptim, false));
        assert_eq!(plan("no_shard").unwrap(), p(NoShard, false));
        assert_eq!(plan("hybrid_shard").unwrap(), p(FullShard, true));
        assert_eq!(plan("hybrid_shard_zero2 auto_wrap").unwrap(), p(ShardGradOp, true));
        // No sharding word: FULL_SHARD, HF's default; the same word twice is one.
        assert_eq!(plan("auto_wrap").unwrap(), p(FullShard, false));
        assert_eq!(plan("shard_grad_op shard_grad_op").unwrap(), p(ShardGradOp, false));
        // Unset or empty: no FSDP.
        assert_eq!(plan("  ").unwrap(), None);
        assert_eq!(TrainingArguments::default().fsdp_plan().unwrap(), None);
        assert_eq!(TrainingArguments::default().fsdp, None);
    }

    #[test]
    fn fsdp_refuses_offload_unknown_words_and_two_strategies_naming_the_argument() {
        let msg = |fsdp: &str| plan(fsdp).unwrap_err().to_string();
        assert_eq!(
            msg("full_shard offload"),
            "invalid training argument `fsdp`: \"offload\" (CPU offload of the parameters) is not implemented: each \
             rank keeps its shards on the device it trains on (on the CPU it would be the same memory); remove it"
        );
        assert_eq!(
            msg("shard_grad_op zero2"),
            "invalid training argument `fsdp`: unknown word \"zero2\" in \"shard_grad_op zero2\"; use one of \
             full_shard, shard_grad_op, shard_optim, no_shard, hybrid_shard, hybrid_shard_zero2, plus auto_wrap"
        );
        assert_eq!(
            msg("full_shard shard_grad_op"),
            "invalid training argument `fsdp`: \"full_shard shard_grad_op\" names two sharding strategies, \
             full_shard and shard_grad_op; keep one"
        );
        // validate() (and so finalize) checks it, naming the field.
        let mut a = TrainingArguments { fsdp: Some("offload".into()), ..Default::default() };
        assert_eq!(field_of(a.finalize().unwrap_err()), "fsdp");
    }

    #[test]
    fn fsdp_comes_from_files_as_a_string_or_a_list_and_from_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.yaml");
        std::fs::write(&file, "fsdp: shard_grad_op auto_wrap\n").unwrap();
        assert_eq!(TrainingArguments::from_file(&file).unwrap().fsdp.as_deref(), Some("shard_grad_op auto_wrap"));
        std::fs::write(&file, "fsdp: [shard_optim, auto_wrap]\n").unwrap();
        let a = TrainingArguments::from_file(&file).unwrap();
        assert_eq!(a.fsdp.as_deref(), Some("shard_optim auto_wrap"));
        // Written back as one string, read back the same.
        let yaml = a.to_yaml().unwrap();
        assert!(yaml.contains("fsdp: shard_optim auto_wrap\n"), "{yaml}");
        assert_eq!(TrainingArguments::from_yaml_str(&yaml).unwrap(), a);
        let json = dir.path().join("t.json");
        std::fs::write(&json, r#"{"fsdp": ["no_shard"]}"#).unwrap();
        assert_eq!(TrainingArguments::from_file(&json).unwrap().fsdp.as_deref(), Some("no_shard"));
        std::fs::write(&file, "fsdp_strategy: shard_grad_op\n").unwrap();
        let e = TrainingArguments::from_file(&file).unwrap_err().to_string();
        assert!(e.contains("unknown key `fsdp_strategy`"), "{e}");
        // Both flag spellings; the flag beats the file; a bad word is refused when resolved.
        std::fs::write(&file, "fsdp: full_shard\n").unwrap();
        let a = cli(&["--config", file.to_str().unwrap(), "--fsdp", "shard_grad_op auto_wrap"])
            .resolve(TrainingArguments::default())
            .unwrap();
        assert_eq!(a.fsdp.as_deref(), Some("shard_grad_op auto_wrap"));
        let a = cli(&["--fsdp", "no_shard"]).resolve(TrainingArguments::default()).unwrap();
        assert_eq!(a.fsdp.as_deref(), Some("no_shard"));
        let e = cli(&["--fsdp", "offload"]).resolve(TrainingArguments::default()).unwrap_err();
        assert_eq!(field_of(e), "fsdp");
    }

    #[test]
    fn fsdp_makes_every_data_parallel_process_shard_unless_the_layout_shards_already() {
        use ShardingStrategy::*;
        let zero2 = FsdpPlan { strategy: ShardGradOp, hybrid: false };
        let zero1 = FsdpPlan { strategy: ShardOptim, hybrid: false };
        let default = ParallelismConfig::default();
        // Every size 1 on 4 processes: data parallel over all four, which become dp_shard.
        assert_eq!(zero2.apply(&default, 4, "shard_grad_op").unwrap(), default.clone().with_dp_shard_size(4));
        // dp 2 × tp 2: the 2 data-parallel processes shard.
        let p = zero1.apply(&ParallelismConfig::data_parallel(2).with_tp_size(2), 4, "shard_optim").unwrap();
        assert_eq!(p, default.clone().with_tp_size(2).with_dp_shard_size(2).with_sharding_strategy(ShardOptim));
        assert_eq!(p.layout_string(), "dp_replicate 1 × dp_shard 2 (SHARD_OPTIM) × tp 2 × pp 1");
        // dp_replicate 2 × dp_shard 2 from the layout is kept; only the strategy is set.
        let hsdp = ParallelismConfig::data_parallel(2).with_dp_shard_size(2);
        assert_eq!(zero1.apply(&hsdp, 4, "shard_optim").unwrap(), hsdp.clone().with_sharding_strategy(ShardOptim));
        // One process: nothing to shard; the strategy is set, and not read.
        let full = FsdpPlan { strategy: FullShard, hybrid: false };
        assert_eq!(
            full.apply(&default, 1, "full_shard").unwrap(),
            ParallelismConfig::data_parallel(1).with_sharding_strategy(FullShard)
        );
        // A layout that does not fit the job is left to the Accelerator, which names what fits.
        let misfit = default.clone().with_tp_size(3);
        assert_eq!(zero2.apply(&misfit, 4, "shard_grad_op").unwrap(), misfit);
    }

    #[test]
    fn fsdp_hybrid_needs_both_data_parallel_sizes_and_full_shard_is_accepted_with_pp_too() {
        use ShardingStrategy::*;
        let hybrid2 = FsdpPlan { strategy: ShardGradOp, hybrid: true };
        let hsdp = ParallelismConfig::data_parallel(2).with_dp_shard_size(2);
        assert_eq!(hybrid2.apply(&hsdp, 4, "hybrid_shard_zero2").unwrap(), hsdp);
        let e = hybrid2.apply(&ParallelismConfig::default(), 4, "hybrid_shard_zero2").unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid training argument `fsdp`: \"hybrid_shard_zero2\" shards within dp_shard groups replicated over \
             dp_replicate, so the layout must set both above 1 (PARALLELISM_CONFIG_DP_SHARD_SIZE and \
             PARALLELISM_CONFIG_DP_REPLICATE_SIZE: accel launch --parallelism-config-dp-shard-size and \
             --parallelism-config-dp-replicate-size, or Trainer::parallelism_config); it is dp_replicate 4 × dp_shard \
             1 × tp 1 × pp 1 on 4 processes"
        );
        let e = hybrid2.apply(&ParallelismConfig::default().with_dp_shard_size(4), 4, "hybrid_shard_zero2");
        assert!(e.unwrap_err().to_string().contains("it is dp_replicate 1 × dp_shard 4 (SHARD_GRAD_OP) × tp 1"));
        // FULL_SHARD (ZeRO-3): every data-parallel process shards; hybrid_shard keeps the HSDP layout.
        let full = FsdpPlan { strategy: FullShard, hybrid: false };
        let p = full.apply(&ParallelismConfig::default(), 2, "full_shard auto_wrap").unwrap();
        assert_eq!(p, ParallelismConfig::default().with_dp_shard_size(2).with_sharding_strategy(FullShard));
        assert_eq!(p.layout_string(), "dp_replicate 1 × dp_shard 2 (FULL_SHARD) × tp 1 × pp 1");
        let hybrid = FsdpPlan { strategy: FullShard, hybrid: true };
        assert_eq!(hybrid.apply(&hsdp, 4, "hybrid_shard").unwrap(), hsdp.clone().with_sharding_strategy(FullShard));
        // With pipeline stages: the data-parallel processes of every stage shard.
        let zero2 = FsdpPlan { strategy: ShardGradOp, hybrid: false };
        let p = zero2.apply(&ParallelismConfig::data_parallel(2).with_pp_size(2), 4, "shard_grad_op").unwrap();
        assert_eq!(p.layout_string(), "dp_replicate 1 × dp_shard 2 (SHARD_GRAD_OP) × tp 1 × pp 2");
        let p = full.apply(&ParallelismConfig::data_parallel(2).with_pp_size(2), 4, "full_shard").unwrap();
        assert_eq!(p.layout_string(), "dp_replicate 1 × dp_shard 2 (FULL_SHARD) × tp 1 × pp 2");
    }

    #[test]
    fn features_left_out_of_the_build_are_named_and_defaults_still_validate() {
        let d = TrainingArguments::default;
        d().validate().unwrap();
        let cases = [
            (
                "tensorboard",
                cfg!(feature = "tensorboard"),
                TrainingArguments { report_to: ReportTo(vec!["tensorboard".into()]), ..d() },
            ),
            ("plots", cfg!(feature = "plots"), TrainingArguments { save_plots: true, ..d() }),
            ("progress", cfg!(feature = "progress"), TrainingArguments { disable_tqdm: false, ..d() }),
        ];
        for (feature, built, args) in cases {
            match args.validate() {
                Ok(()) => assert!(built, "{feature} is off but was accepted"),
                Err(e) => {
                    assert!(!built, "{feature} is on but was refused: {e}");
                    let want = format!("built without feature `{feature}` of crate trainer: enable it in Cargo.toml");
                    assert!(e.to_string().ends_with(&want), "{e}");
                }
            }
        }
        assert_eq!(d().report_to.contains("tensorboard"), cfg!(feature = "tensorboard"));
        assert_eq!(d().save_plots, cfg!(feature = "plots"));
    }
}
