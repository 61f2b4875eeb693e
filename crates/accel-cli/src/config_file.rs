//! Python Accelerate's YAML config file (`accelerate config` writes it, `accelerate launch` reads it), read and
//! written by `accel`.
//!
//! Format reference: Accelerate's `ClusterConfig` (`src/accelerate/commands/config/config_args.py`). Python writes
//! it with `yaml.safe_dump` (keys sorted, `None` and empty mappings dropped), so this model serialises its fields in
//! alphabetical order and skips unset ones; a file `accel config` writes loads in Python Accelerate unchanged.
//!
//! Reading is lenient where Python's YAML 1.1 reader is: a bare `mixed_precision: no` arrives as the boolean `false`
//! and means `"no"`; `downcast_bf16` may be a boolean or `'no'`/`'yes'`; `gpu_ids` may be `all`, `0,1`, a number or a
//! list. As strict as Accelerate (which refuses unknown keys): a key neither Accelerate nor accel knows is an error
//! naming the key, the file and the closest known key (`num_proceses` → did you mean `num_processes`?), never a
//! silent default. Keys Accelerate knows but accel has no use for (DeepSpeed, TPU, dynamo, ...) are accepted, with a
//! warning when they ask for a feature accel lacks. Malformed YAML, and a value of the wrong kind, are errors with
//! the file, the line and column once, and what the key expects ([`CliError::ConfigSyntax`]).
//!
//! FSDP: `distributed_type: FSDP` is sharded data parallelism over the data-parallel processes (`accel launch`
//! makes them dp_shard unless the `parallelism_config` block splits them itself), and the `fsdp_config` block's
//! `fsdp_sharding_strategy` (or FSDP2's `fsdp_reshard_after_forward`) says what is sharded
//! ([`AccelerateConfig::sharding_strategy`]); its other keys are kept verbatim and warned about when they ask for
//! something. `accel config` writes `fsdp_config: {fsdp_sharding_strategy: ...}` when it asks for dp_shard > 1.
//!
//! Writing always quotes `"no"`, because a YAML 1.1 reader (PyYAML) would read a bare `no` as `false`.

use crate::error::{CliError, CliResult};
use accel::config::MixedPrecision;
use accel::pipeline::ScheduleKind;
use accel::ShardingStrategy;
use config_errors::{clean_parser_message, key_position, unclosed_bracket_hint, unknown_key};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Environment variable naming the Hugging Face cache root (default `~/.cache/huggingface`).
pub const HF_HOME_ENV: &str = "HF_HOME";

/// Accelerate's `compute_environment` for a local machine or cluster (the only one accel launches on).
pub const LOCAL_MACHINE: &str = "LOCAL_MACHINE";

/// Keys of Accelerate's format that accel reads but has no use for (other parallelism plugins, TPU pods, dynamo).
/// They never cause an "unknown key" warning; a non-empty / `true` value gets a "not supported, ignored" warning.
pub const ACCELERATE_ONLY_KEYS: &[&str] = &[
    "command_file",
    "commands",
    "deepspeed_config",
    "dynamo_backend",
    "dynamo_config",
    "fp16",
    "fp8_config",
    "ipex_config",
    "megatron_lm_config",
    "mpirun_config",
    "tp_config",
    "tpu_name",
    "tpu_vm",
    "tpu_zone",
];

/// Every `distributed_type` Accelerate writes (its `DistributedType` enum, plus the older `TPU`); accel's own four
/// first. Any other value is a typo, refused with this list.
const ACCELERATE_DISTRIBUTED_TYPES: &[&str] = &[
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "FSDP",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_HPU",
    "DEEPSPEED",
    "XLA",
    "TPU",
    "MEGATRON_LM",
];

/// Accelerate's `distributed_type`: what the file asked for. accel runs `NO`, `MULTI_CPU`, `MULTI_GPU` (data
/// parallelism, laid out by the `parallelism_config` block) and `FSDP` (the same, with the data-parallel processes
/// sharding: see [`AccelerateConfig::sharding_strategy`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DistributedType {
    /// One process (`NO`).
    #[default]
    No,
    /// Several CPU processes (`MULTI_CPU`).
    MultiCpu,
    /// Several GPU processes (`MULTI_GPU`).
    MultiGpu,
    /// Sharded data parallelism (`FSDP`): `accel launch` makes the data-parallel processes dp_shard unless the
    /// `parallelism_config` block sets dp_shard or dp_replicate itself; the `fsdp_config` block says what they
    /// shard.
    Fsdp,
    /// Any other value Accelerate knows (`DEEPSPEED`, `XLA`, `MULTI_NPU`, ...), kept verbatim; `accel launch`
    /// refuses it, naming the fix.
    Other(String),
}

impl DistributedType {
    /// Accelerate's spelling.
    pub fn as_str(&self) -> &str {
        match self {
            DistributedType::No => "NO",
            DistributedType::MultiCpu => "MULTI_CPU",
            DistributedType::MultiGpu => "MULTI_GPU",
            DistributedType::Fsdp => "FSDP",
            DistributedType::Other(s) => s,
        }
    }

    /// Parses Accelerate's spelling (case-insensitive); anything unknown becomes [`DistributedType::Other`].
    pub fn parse(s: &str) -> Self {
        match s.trim().to_ascii_uppercase().as_str() {
            "NO" | "FALSE" => DistributedType::No,
            "MULTI_CPU" => DistributedType::MultiCpu,
            "MULTI_GPU" => DistributedType::MultiGpu,
            "FSDP" => DistributedType::Fsdp,
            other => DistributedType::Other(other.to_string()),
        }
    }

    /// The natural type for a job: `NO` for one process, else `MULTI_CPU` or `MULTI_GPU`.
    pub fn for_job(num_processes: usize, use_cpu: bool) -> Self {
        match (num_processes > 1, use_cpu) {
            (false, _) => DistributedType::No,
            (true, true) => DistributedType::MultiCpu,
            (true, false) => DistributedType::MultiGpu,
        }
    }
}

impl Serialize for DistributedType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for DistributedType {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // `distributed_type: NO` written bare is the boolean false to a YAML 1.1 reader.
        Ok(DistributedType::parse(&d.deserialize_any(ScalarText("distributed_type"))?))
    }
}

pub use crate::parallelism_block::PARALLELISM_KEYS;
/// Accelerate's `parallelism_config` block (Accelerate ≥ 1.10, plus our `parallelism_config_pp_size`), read into
/// the library's type ([`crate::parallelism_block`]), so the file, `accel launch`'s flags and the workers'
/// [`accel::AcceleratorConfig`] agree on the rules.
pub use accel::ParallelismConfig;

fn one() -> usize {
    1
}

/// One Accelerate config file (`ClusterConfig`). Field names are Accelerate's keys; fields are declared in
/// alphabetical order so the YAML comes out sorted like PyYAML's `safe_dump`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccelerateConfig {
    /// `LOCAL_MACHINE` (cloud values such as `AMAZON_SAGEMAKER` are kept, and warned about at launch).
    #[serde(default = "local_machine")]
    pub compute_environment: String,
    /// Accelerate's debug mode (collective shape checks): passed to workers as `ACCELERATE_DEBUG_MODE=true`.
    #[serde(default)]
    pub debug: bool,
    /// `NO`, `MULTI_CPU`, `MULTI_GPU`, ...
    #[serde(default)]
    pub distributed_type: DistributedType,
    /// TPU-only flag Accelerate writes as `'no'` / `'yes'`; accel keeps it for round trips.
    #[serde(default = "no_string", deserialize_with = "yes_no")]
    pub downcast_bf16: String,
    /// Pin each worker to its CPU cores (`ACCELERATE_CPU_AFFINITY=1`).
    #[serde(default)]
    pub enable_cpu_affinity: bool,
    /// Accelerate's FSDP settings, kept verbatim (keys sorted). accel reads `fsdp_sharding_strategy` and
    /// `fsdp_reshard_after_forward` (what dp_shard shards: [`Self::sharding_strategy`]) and `fsdp_offload_params`
    /// (`true` is refused by `accel launch`); the other keys are warned about when they ask for something.
    /// `accel config` writes `fsdp_sharding_strategy` here when dp_shard > 1 ([`Self::set_sharding_strategy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_config: Option<FsdpConfig>,
    /// `all` or a comma-separated list of GPU indices (`CUDA_VISIBLE_DEVICES` of the workers).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "gpu_ids")]
    pub gpu_ids: Option<String>,
    /// accel extension (Accelerate keeps it in its gradient accumulation plugin): micro-batches per optimizer step.
    /// Never written by `accel config`, so files stay loadable by Python Accelerate, which rejects unknown keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<usize>,
    /// Rank of this machine, `0..num_machines`.
    #[serde(default)]
    pub machine_rank: usize,
    /// Address of the machine of rank 0 (required with several machines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Store port on the machine of rank 0 (0 = pick a free one, single machine only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// Python entry point name; unused by accel, kept for round trips.
    #[serde(default = "main_string")]
    pub main_training_function: String,
    /// `"no"`, `"fp16"` or `"bf16"` (a bare `no`, i.e. `false`, is read as `"no"`: [`MixedPrecision`]'s serde).
    #[serde(default)]
    pub mixed_precision: MixedPrecision,
    /// Machines in the job.
    #[serde(default = "one")]
    pub num_machines: usize,
    /// Processes in the job, TOTAL over all machines (Accelerate writes -1 for "unset").
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "num_processes")]
    pub num_processes: Option<usize>,
    /// Layout over data / tensor / pipeline / context parallelism (Accelerate ≥ 1.10; pp is ours).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "crate::parallelism_block::optional")]
    pub parallelism_config: Option<ParallelismConfig>,
    /// torchrun rendezvous backend (`static`, `c10d`); accel's launcher always uses its own TCP store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdzv_backend: Option<String>,
    /// All machines share a network (Accelerate asks this for multi-node jobs).
    #[serde(default)]
    pub same_network: bool,
    /// TPU pod environment; written empty for compatibility.
    #[serde(default)]
    pub tpu_env: Vec<String>,
    /// TPU pod flag; written for compatibility.
    #[serde(default)]
    pub tpu_use_cluster: bool,
    /// TPU pod flag; written for compatibility.
    #[serde(default)]
    pub tpu_use_sudo: bool,
    /// Run on the CPU even when GPUs exist.
    #[serde(default)]
    pub use_cpu: bool,
}

fn local_machine() -> String {
    LOCAL_MACHINE.to_string()
}
fn no_string() -> String {
    "no".to_string()
}
fn main_string() -> String {
    "main".to_string()
}

impl Default for AccelerateConfig {
    fn default() -> Self {
        AccelerateConfig {
            compute_environment: local_machine(),
            debug: false,
            distributed_type: DistributedType::No,
            downcast_bf16: no_string(),
            enable_cpu_affinity: false,
            fsdp_config: None,
            gpu_ids: None,
            gradient_accumulation_steps: None,
            machine_rank: 0,
            main_process_ip: None,
            main_process_port: None,
            main_training_function: main_string(),
            mixed_precision: MixedPrecision::No,
            num_machines: 1,
            num_processes: Some(1),
            parallelism_config: None,
            rdzv_backend: Some("static".to_string()),
            same_network: true,
            tpu_env: Vec::new(),
            tpu_use_cluster: false,
            tpu_use_sudo: false,
            use_cpu: false,
        }
    }
}

/// Keys of [`AccelerateConfig`] (kept in sync with its fields by a unit test).
pub const TYPED_KEYS: &[&str] = &[
    "compute_environment",
    "debug",
    "distributed_type",
    "downcast_bf16",
    "enable_cpu_affinity",
    "fsdp_config",
    "gpu_ids",
    "gradient_accumulation_steps",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "main_training_function",
    "mixed_precision",
    "num_machines",
    "num_processes",
    "parallelism_config",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "use_cpu",
];

/// Accelerate's `fsdp_config` block, key by key as the file has it (sorted when written, as PyYAML's `safe_dump`).
pub type FsdpConfig = BTreeMap<String, serde_json::Value>;

/// The `fsdp_config` key accel reads for what dp_shard shards (FSDP's names, `SHARD_OPTIM`, or torch's numbers).
pub const FSDP_SHARDING_STRATEGY_KEY: &str = "fsdp_sharding_strategy";
/// FSDP2's spelling of the strategy (Accelerate ≥ 1.6): `true` = FULL_SHARD, `false` = SHARD_GRAD_OP; FSDP1 files
/// may hold a strategy name here instead.
pub const FSDP_RESHARD_AFTER_FORWARD_KEY: &str = "fsdp_reshard_after_forward";
/// `true` asks for CPU offload of the parameters, which accel refuses.
pub const FSDP_OFFLOAD_PARAMS_KEY: &str = "fsdp_offload_params";
/// The `fsdp_config` keys accel reads (sorted); the block's other keys are kept and warned about.
pub const FSDP_READ_KEYS: &[&str] =
    &[FSDP_OFFLOAD_PARAMS_KEY, FSDP_RESHARD_AFTER_FORWARD_KEY, FSDP_SHARDING_STRATEGY_KEY];

/// A config file as read from disk: the model, its source text and the warnings reading it produced.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    /// Where it was read from.
    pub path: PathBuf,
    /// The parsed values.
    pub config: AccelerateConfig,
    /// The file's text, verbatim (`accel env` prints it).
    pub text: String,
    /// Human-readable warnings (ignored Accelerate features, other compute environments), one per line.
    pub warnings: Vec<String>,
}

/// `$HF_HOME/accelerate/default_config.yaml`, with `HF_HOME` defaulting to `$XDG_CACHE_HOME/huggingface` and then
/// `~/.cache/huggingface` (as Python Accelerate). `None` when neither HF_HOME, XDG_CACHE_HOME nor HOME is set.
pub fn default_config_path() -> Option<PathBuf> {
    default_config_path_from(|k| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from))
}

/// [`default_config_path`] with any lookup function (tests pass a map).
pub fn default_config_path_from(get: impl Fn(&str) -> Option<PathBuf>) -> Option<PathBuf> {
    let hf_home = match get(HF_HOME_ENV) {
        Some(p) => p,
        None => match get("XDG_CACHE_HOME") {
            Some(cache) => cache.join("huggingface"),
            None => get("HOME")?.join(".cache").join("huggingface"),
        },
    };
    Some(hf_home.join("accelerate").join("default_config.yaml"))
}

/// Which config file a command uses: the `--config-file` given (which must exist), else the default path when a
/// file is there, else none (built-in defaults).
pub fn resolve_config_path(explicit: Option<&Path>) -> CliResult<Option<PathBuf>> {
    match explicit {
        Some(p) if p.is_file() => Ok(Some(p.to_path_buf())),
        Some(p) => Err(CliError::ConfigMissing { path: p.to_path_buf() }),
        None => Ok(default_config_path().filter(|p| p.is_file())),
    }
}

impl AccelerateConfig {
    /// Reads and parses a config file (YAML, or JSON, which is YAML too).
    pub fn load(path: &Path) -> CliResult<LoadedConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::io(format!("cannot read config file {}", path.display()), e))?;
        Self::parse(&text, path)
    }

    /// Parses config text; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> CliResult<LoadedConfig> {
        if text.trim().is_empty() {
            return Err(CliError::ConfigValue {
                path: path.to_path_buf(),
                message: "the file is empty; write one with `accel config` or `accel config default`".into(),
            });
        }
        // First pass: the YAML itself (a whole-document parse, so an unclosed `[` is reported as such rather than
        // as a value of the wrong type), then unknown keys, then each known key's value, then the typed model.
        let raw: serde_json::Value = serde_saphyr::from_str(text).map_err(|e| syntax_error(path, text, &e))?;
        let serde_json::Value::Object(raw) = raw else {
            return Err(CliError::ConfigValue {
                path: path.to_path_buf(),
                message: format!(
                    "expected a mapping of Accelerate's keys (`num_processes: 2`, ...), got {}",
                    describe(&raw)
                ),
            });
        };
        check_keys(&raw, text, path)?;
        for (key, value) in &raw {
            if let Err(expected) = check_value(key, value) {
                return Err(value_error(path, text, key, &format!("{key}: expected {expected}")));
            }
        }
        let config: AccelerateConfig = serde_saphyr::from_str(text).map_err(|e| syntax_error(path, text, &e))?;
        let mut warnings = Vec::new();
        for (key, value) in &raw {
            if ACCELERATE_ONLY_KEYS.contains(&key.as_str()) && requests_feature(key, value) {
                warnings.push(format!(
                    "{}: `{key}` asks for an Accelerate feature accel does not implement (accel's parallelism is \
                     set by the `parallelism_config` block); it is ignored",
                    path.display()
                ));
            }
        }
        warnings
            .extend(config.fsdp_config.as_ref().and_then(unused_fsdp_keys).map(|w| format!("{}: {w}", path.display())));
        if config.compute_environment != LOCAL_MACHINE {
            warnings.push(format!(
                "{}: compute_environment {} is not supported; accel launches on this machine as LOCAL_MACHINE",
                path.display(),
                config.compute_environment
            ));
        }
        // A `distributed_type` accel does not run (DEEPSPEED, XLA, ...), and `fsdp_offload_params: true`, are
        // refused by `accel launch`, not warned about here: `accel env` reads the same file and only reports it.
        // The warnings go back to the caller, which prints them once (`load_and_warn`).
        Ok(LoadedConfig { path: path.to_path_buf(), config, text: text.to_string(), warnings })
    }

    /// What the dp_shard processes shard under this file: the `fsdp_config` block's `fsdp_sharding_strategy`,
    /// else its `fsdp_reshard_after_forward` (`true` FULL_SHARD, `false` SHARD_GRAD_OP, or a strategy name), else
    /// FULL_SHARD for `distributed_type: FSDP` (Accelerate's default) and [`ShardingStrategy::default`]
    /// (SHARD_GRAD_OP, ZeRO-2) for any other type. Only read when the layout has dp_shard > 1.
    ///
    /// Errors: a value that is no strategy, or the two keys disagreeing ([`Self::parse`] refuses both already,
    /// at their line; this is for configs built in code).
    pub fn sharding_strategy(&self) -> CliResult<ShardingStrategy> {
        let set = match &self.fsdp_config {
            Some(block) => fsdp_strategy(|k| block.get(k))
                .map_err(|why| CliError::invalid("fsdp_config", format!("{block:?}"), why))?,
            None => None,
        };
        Ok(set.unwrap_or(match self.distributed_type {
            DistributedType::Fsdp => ShardingStrategy::FullShard,
            _ => ShardingStrategy::default(),
        }))
    }

    /// Whether the `fsdp_config` block sets the sharding strategy (`fsdp_sharding_strategy` or
    /// `fsdp_reshard_after_forward`).
    pub fn sets_sharding_strategy(&self) -> bool {
        self.fsdp_config.as_ref().is_some_and(|b| {
            [FSDP_SHARDING_STRATEGY_KEY, FSDP_RESHARD_AFTER_FORWARD_KEY]
                .iter()
                .any(|k| b.get(*k).is_some_and(|v| !v.is_null()))
        })
    }

    /// Whether the file asks for CPU offload of the parameters (`fsdp_offload_params: true`).
    pub fn fsdp_offload_params(&self) -> bool {
        self.fsdp_config.as_ref().and_then(|b| b.get(FSDP_OFFLOAD_PARAMS_KEY)).is_some_and(is_true)
    }

    /// Records `s` as `fsdp_config.fsdp_sharding_strategy` (what `accel config` writes when dp_shard > 1),
    /// keeping the block's other keys and dropping `fsdp_reshard_after_forward`, which could disagree with it.
    pub fn set_sharding_strategy(&mut self, s: ShardingStrategy) {
        let block = self.fsdp_config.get_or_insert_with(FsdpConfig::new);
        block.remove(FSDP_RESHARD_AFTER_FORWARD_KEY);
        block.insert(FSDP_SHARDING_STRATEGY_KEY.to_string(), serde_json::Value::String(s.name().to_string()));
    }

    /// The YAML text of this config (sorted keys, `"no"` quoted).
    pub fn to_yaml(&self) -> CliResult<String> {
        serde_saphyr::to_string(self).map_err(|e| CliError::invalid("config", format!("{self:?}"), e.to_string()))
    }

    /// Writes the config atomically: the YAML goes to a temporary file in the same directory, which is renamed
    /// over `path` only once complete, so an error never leaves a partial file. Creates missing parent
    /// directories.
    pub fn save(&self, path: &Path) -> CliResult<()> {
        let yaml = self.to_yaml()?;
        write_atomically(path, yaml.as_bytes())
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename (atomic on POSIX).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> CliResult<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(|e| CliError::io(format!("cannot create directory {}", dir.display()), e))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".accel-config-")
        .suffix(".tmp")
        .tempfile_in(&dir)
        .map_err(|e| CliError::io(format!("cannot create a temporary file in {}", dir.display()), e))?;
    tmp.write_all(bytes)
        .and_then(|_| tmp.as_file().sync_all())
        .map_err(|e| CliError::io(format!("cannot write {}", tmp.path().display()), e))?;
    // On error the NamedTempFile is dropped and deletes itself.
    tmp.persist(path)
        .map_err(|e| CliError::io(format!("cannot rename the new config into {}", path.display()), e.error))?;
    Ok(())
}

fn syntax_error(path: &Path, text: &str, e: &serde_saphyr::Error) -> CliError {
    use serde_saphyr::MessageFormatter;
    // The bare message: no snippet (it would name the source `<input>`) and no position (given once, below).
    let mut message = clean_parser_message(&serde_saphyr::DefaultMessageFormatter.format_message(e.without_snippet()));
    let error_line = e.location().map_or(usize::MAX, |l| l.line() as usize);
    message.push_str(&unclosed_bracket_hint(text, error_line).unwrap_or_default());
    match e.location().filter(|l| l.line() > 0) {
        Some(loc) => {
            CliError::ConfigSyntax { path: path.to_path_buf(), line: loc.line(), column: loc.column(), message }
        }
        None => CliError::ConfigValue { path: path.to_path_buf(), message },
    }
}

/// The error for `key`'s value, at the line of `key` when it can be found in `text`.
fn value_error(path: &Path, text: &str, key: &str, message: &str) -> CliError {
    match key_position(text, key) {
        Some((line, column)) => CliError::ConfigSyntax {
            path: path.to_path_buf(),
            line: line as u64,
            column: column as u64,
            message: message.to_string(),
        },
        None => CliError::ConfigValue { path: path.to_path_buf(), message: message.to_string() },
    }
}

/// A value as the user wrote it, for messages: a string verbatim, anything else as compact JSON.
fn describe(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => format!("`{s}`"),
        serde_json::Value::Null => "nothing (null)".to_string(),
        serde_json::Value::Array(_) => format!("the list `{value}`"),
        serde_json::Value::Object(_) => format!("the mapping `{value}`"),
        other => format!("`{other}`"),
    }
}

/// Refuses keys neither Accelerate nor accel knows (Accelerate's `ClusterConfig(**dict)` raises on them too),
/// at top level and in the `parallelism_config` block, naming the closest known key.
fn check_keys(raw: &serde_json::Map<String, serde_json::Value>, text: &str, path: &Path) -> CliResult<()> {
    let known: Vec<&str> = TYPED_KEYS.iter().chain(ACCELERATE_ONLY_KEYS).copied().collect();
    let mut problems = Vec::new();
    let mut unknown = |key: &str, candidates: &[&str]| problems.push(unknown_key(text, key, candidates));
    for key in raw.keys() {
        if !known.contains(&key.as_str()) {
            unknown(key, &known);
        }
    }
    if let Some(serde_json::Value::Object(block)) = raw.get("parallelism_config") {
        for key in block.keys() {
            if !PARALLELISM_KEYS.contains(&key.as_str()) {
                unknown(key, PARALLELISM_KEYS);
            }
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(CliError::ConfigValue {
        path: path.to_path_buf(),
        message: format!(
            "{}; Accelerate's config format has no such key, and a misspelled setting would otherwise be silently \
             replaced by its default",
            problems.join("; ")
        ),
    })
}

/// What `key` accepts and what it got, in words (`a whole number ≥ 1, got `two``), when `value` does not fit it;
/// `Ok` for keys the typed model does not read.
fn check_value(key: &str, value: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    let whole = |v: &Value, min: u64| v.as_u64().is_some_and(|n| n >= min);
    let fits = match key {
        "debug" | "enable_cpu_affinity" | "same_network" | "tpu_use_cluster" | "tpu_use_sudo" | "use_cpu" => {
            matches!(value, Value::Bool(_) | Value::Null)
        }
        "compute_environment" | "main_training_function" => value.is_string(),
        "main_process_ip" | "rdzv_backend" => matches!(value, Value::String(_) | Value::Null),
        "distributed_type" => match value {
            Value::String(t) => ACCELERATE_DISTRIBUTED_TYPES.contains(&t.trim().to_ascii_uppercase().as_str()),
            other => matches!(other, Value::Bool(false)),
        },
        "downcast_bf16" => matches!(value, Value::String(_) | Value::Bool(_) | Value::Null),
        "gpu_ids" => match value {
            Value::String(_) | Value::Null => true,
            Value::Number(_) => whole(value, 0),
            Value::Array(ids) => ids.iter().all(|id| whole(id, 0)),
            _ => false,
        },
        "gradient_accumulation_steps" => value.is_null() || whole(value, 1),
        "machine_rank" => whole(value, 0),
        "main_process_port" => value.is_null() || value.as_u64().is_some_and(|p| p <= u16::MAX as u64),
        "mixed_precision" => serde_json::from_value::<MixedPrecision>(value.clone()).is_ok(),
        "num_machines" => whole(value, 1),
        "num_processes" => value.is_null() || value.as_i64().is_some_and(|n| n >= 1 || n == -1),
        "parallelism_config" => {
            return match value {
                Value::Null => Ok(()),
                Value::Object(block) => {
                    for (k, v) in block {
                        let ok = match k.as_str() {
                            "parallelism_config_cp_comm_strategy" => v.is_string() || v.is_null(),
                            "pipeline_parallel_schedule" => {
                                v.as_str().is_some_and(|s| s.parse::<ScheduleKind>().is_ok())
                            }
                            "pipeline_parallel_microbatches" | "pipeline_parallel_virtual_stages" => {
                                v.is_null() || whole(v, 1)
                            }
                            "parallelism_config_cp_size" => whole(v, 1),
                            "parallelism_config_tp_plan" => {
                                if let Err(e) = serde_json::from_value::<accel::plan::ParallelPlan>(v.clone()) {
                                    return Err(format!(
                                        "a mapping from module-path patterns to parallel styles for `{k}` ({e})"
                                    ));
                                }
                                true
                            }
                            // Any other key is a size: a number, or `auto` (chosen at start-up).
                            _ => whole(v, 1) || v.as_str().is_some_and(|s| s.trim().eq_ignore_ascii_case("auto")),
                        };
                        if !ok {
                            let what = match k.as_str() {
                                "pipeline_parallel_schedule" => format!("one of {}", ScheduleKind::CHOICES),
                                "parallelism_config_cp_comm_strategy" => "a string".to_string(),
                                "parallelism_config_cp_size"
                                | "pipeline_parallel_microbatches"
                                | "pipeline_parallel_virtual_stages" => "a whole number ≥ 1".to_string(),
                                _ => "a whole number ≥ 1 or `auto` (chosen at start-up)".to_string(),
                            };
                            return Err(format!("{what} for `{k}`, got {}", describe(v)));
                        }
                    }
                    Ok(())
                }
                _ => Err("a mapping of `parallelism_config_*` sizes".to_string()),
            };
        }
        "fsdp_config" => {
            return match value {
                Value::Null => Ok(()),
                Value::Object(block) => {
                    if let Some(v) = block.get(FSDP_OFFLOAD_PARAMS_KEY) {
                        if !matches!(v, Value::Bool(_) | Value::Null) && !v.as_str().is_some_and(is_bool_word) {
                            return Err(format!(
                                "`true` or `false` for `{FSDP_OFFLOAD_PARAMS_KEY}`, got {}",
                                describe(v)
                            ));
                        }
                    }
                    fsdp_strategy(|k| block.get(k)).map(|_| ())
                }
                _ => Err(format!(
                    "a mapping of `fsdp_*` settings (such as `fsdp_sharding_strategy: SHARD_GRAD_OP`), got {}",
                    describe(value)
                )),
            };
        }
        "tpu_env" => match value {
            Value::Array(items) => items.iter().all(Value::is_string),
            Value::Null => true,
            _ => false,
        },
        _ => true,
    };
    if fits {
        return Ok(());
    }
    let expected = match key {
        "debug" | "enable_cpu_affinity" | "same_network" | "tpu_use_cluster" | "tpu_use_sudo" | "use_cpu" => {
            "`true` or `false`".to_string()
        }
        "distributed_type" => format!(
            "one of NO, MULTI_CPU, MULTI_GPU, FSDP (accel's), or another of Accelerate's names ({}), which `accel \
             launch` refuses",
            ACCELERATE_DISTRIBUTED_TYPES[4..].join(", ")
        ),
        "downcast_bf16" => "`yes` or `no`".to_string(),
        "gpu_ids" => "`all`, a comma-separated list of GPU indices such as `0,1`, or a list of indices".to_string(),
        "gradient_accumulation_steps" | "num_machines" => "a whole number ≥ 1".to_string(),
        "machine_rank" => "a whole number ≥ 0".to_string(),
        "main_process_port" => "a port number (0 to 65535)".to_string(),
        "mixed_precision" => format!("one of {}", MixedPrecision::CHOICES),
        "num_processes" => "a whole number ≥ 1 (or -1: decided at launch)".to_string(),
        "tpu_env" => "a list of strings".to_string(),
        _ => "a string".to_string(),
    };
    Err(format!("{expected}, got {}", describe(value)))
}

/// Whether an Accelerate-only key's value turns on something (non-empty mapping/list/string, `true`, a dynamo
/// backend other than NO).
fn requests_feature(key: &str, value: &serde_json::Value) -> bool {
    use serde_json::Value;
    // A bare `NO` is the boolean false to a YAML 1.1 reader.
    let is_off = |v: &Value| match v {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty() || s.eq_ignore_ascii_case("no"),
        _ => false,
    };
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(_) => true,
        Value::String(s) => !(s.is_empty() || (key == "dynamo_backend" && is_off(value))),
        Value::Array(a) => !a.is_empty(),
        // dynamo_config: {dynamo_backend: NO} is Accelerate's "off".
        Value::Object(o) => !(o.is_empty() || (key == "dynamo_config" && o.get("dynamo_backend").is_some_and(is_off))),
    }
}

/// What an `fsdp_config` block (read through `get`) asks dp_shard to shard: `fsdp_sharding_strategy` (a name
/// [`ShardingStrategy`] reads, or torch's number), else `fsdp_reshard_after_forward` (`true` = FULL_SHARD, `false`
/// = SHARD_GRAD_OP, FSDP2's meaning; a strategy name, as Accelerate's FSDP1 files may hold); `None` when neither
/// is set. Errors (what the key expects, as [`check_value`] words it): a value that is no strategy, or both keys
/// set to different strategies.
fn fsdp_strategy<'a>(get: impl Fn(&str) -> Option<&'a serde_json::Value>) -> Result<Option<ShardingStrategy>, String> {
    use serde_json::Value;
    let named = |v: &Value| match v {
        Value::String(s) => s.parse::<ShardingStrategy>().ok(),
        Value::Number(n) => n.to_string().parse::<ShardingStrategy>().ok(),
        _ => None,
    };
    let strategy = match get(FSDP_SHARDING_STRATEGY_KEY).filter(|v| !v.is_null()) {
        None => None,
        Some(v) => Some(named(v).ok_or_else(|| {
            format!("one of {} for `{FSDP_SHARDING_STRATEGY_KEY}`, got {}", ShardingStrategy::NAMES, describe(v))
        })?),
    };
    let reshard = match get(FSDP_RESHARD_AFTER_FORWARD_KEY).filter(|v| !v.is_null()) {
        None => None,
        Some(v) => {
            let read = match v {
                Value::Bool(b) => Some(*b),
                Value::String(s) if is_bool_word(s) => Some(s.trim().eq_ignore_ascii_case("true")),
                _ => None,
            };
            let s = match read {
                Some(true) => Some(ShardingStrategy::FullShard),
                Some(false) => Some(ShardingStrategy::ShardGradOp),
                None => named(v),
            };
            Some((
                s.ok_or_else(|| {
                    format!(
                        "`true` (FULL_SHARD), `false` (SHARD_GRAD_OP) or a sharding strategy name for \
                         `{FSDP_RESHARD_AFTER_FORWARD_KEY}`, got {}",
                        describe(v)
                    )
                })?,
                v,
            ))
        }
    };
    match (strategy, reshard) {
        (Some(s), Some((r, v))) if s != r => Err(format!(
            "`{FSDP_SHARDING_STRATEGY_KEY}` and `{FSDP_RESHARD_AFTER_FORWARD_KEY}` to agree, got {s} and {} ({r}); \
             keep one of them",
            describe(v)
        )),
        (Some(s), _) => Ok(Some(s)),
        (None, r) => Ok(r.map(|(r, _)| r)),
    }
}

/// `true` / `false` in any case, as a YAML 1.1 reader may leave them quoted.
fn is_bool_word(s: &str) -> bool {
    matches!(s.trim().to_ascii_lowercase().as_str(), "true" | "false")
}

/// A boolean `true` (or the string `true`).
fn is_true(v: &serde_json::Value) -> bool {
    v.as_bool().unwrap_or_else(|| v.as_str().is_some_and(|s| s.trim().eq_ignore_ascii_case("true")))
}

/// The warning for the `fsdp_config` keys accel does not read that ask for something (FSDP's wrapping policy,
/// state-dict type, version, ...); `None` when there are none.
fn unused_fsdp_keys(block: &FsdpConfig) -> Option<String> {
    let keys: Vec<String> = block
        .iter()
        .filter(|(k, v)| !FSDP_READ_KEYS.contains(&k.as_str()) && requests_feature(k, v))
        .map(|(k, _)| format!("`{k}`"))
        .collect();
    (!keys.is_empty()).then(|| {
        format!(
            "fsdp_config: {} {} for FSDP features accel does not implement (it reads only `{FSDP_OFFLOAD_PARAMS_KEY}`, \
             `{FSDP_RESHARD_AFTER_FORWARD_KEY}` and `{FSDP_SHARDING_STRATEGY_KEY}`, and has no wrapping policy to \
             set: the model's own blocks are the units); ignored",
            keys.join(", "),
            if keys.len() == 1 { "asks" } else { "ask" },
        )
    })
}

/// Visitor that turns any YAML scalar into its text (booleans as `true`/`false`, null as empty).
struct ScalarText(&'static str);

impl<'de> Visitor<'de> for ScalarText {
    type Value = String;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a string, number or boolean for `{}`", self.0)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<String, E> {
        Ok(v)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_unit<E: de::Error>(self) -> Result<String, E> {
        Ok(String::new())
    }
    fn visit_none<E: de::Error>(self) -> Result<String, E> {
        Ok(String::new())
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_any(self)
    }
}

fn yes_no<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let text = d.deserialize_any(ScalarText("downcast_bf16"))?;
    Ok(match text.to_ascii_lowercase().as_str() {
        "false" | "no" | "" => "no".to_string(),
        "true" | "yes" => "yes".to_string(),
        _ => text,
    })
}

fn gpu_ids<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct Ids;
    impl<'de> Visitor<'de> for Ids {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("`all`, a comma-separated list of GPU indices, a number or a list of numbers for `gpu_ids`")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.trim().to_string()).filter(|s| !s.is_empty()))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut ids = Vec::new();
            while let Some(id) = seq.next_element::<u64>()? {
                ids.push(id.to_string());
            }
            Ok(Some(ids.join(",")))
        }
    }
    d.deserialize_any(Ids)
}

fn num_processes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    let n: Option<i64> = Option::deserialize(d)?;
    match n {
        None => Ok(None),
        Some(n) if n <= 0 => Ok(None), // Accelerate's -1: "not set, decided by the launcher"
        Some(n) => Ok(Some(n as usize)),
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use config_errors::did_you_mean;

    #[test]
    fn an_unclosed_bracket_names_the_line_that_opens_it() {
        let text = "compute_environment: LOCAL_MACHINE\nnum_processes: [2\nmixed_precision: 'no'\n";
        let e = AccelerateConfig::parse(text, Path::new("bad.yaml")).unwrap_err().to_string();
        assert!(e.contains("bad.yaml") && e.contains("line 2 opens a `[` that is never closed"), "{e}");
    }

    #[test]
    fn typed_keys_match_the_struct() {
        let value = serde_json::to_value(AccelerateConfig {
            fsdp_config: Some(FsdpConfig::new()),
            gpu_ids: Some("all".into()),
            gradient_accumulation_steps: Some(2),
            main_process_ip: Some("h".into()),
            main_process_port: Some(1),
            parallelism_config: Some(ParallelismConfig::data_parallel(1)),
            ..AccelerateConfig::default()
        })
        .unwrap();
        let keys: Vec<&str> = value.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, TYPED_KEYS);
    }

    #[test]
    fn default_path_follows_hf_home_then_xdg_then_home() {
        let p = default_config_path_from(|k| (k == "HF_HOME").then(|| PathBuf::from("/hf")));
        assert_eq!(p.unwrap(), Path::new("/hf/accelerate/default_config.yaml"));
        let p = default_config_path_from(|k| (k == "XDG_CACHE_HOME").then(|| PathBuf::from("/c")));
        assert_eq!(p.unwrap(), Path::new("/c/huggingface/accelerate/default_config.yaml"));
        let p = default_config_path_from(|k| (k == "HOME").then(|| PathBuf::from("/home/u")));
        assert_eq!(p.unwrap(), Path::new("/home/u/.cache/huggingface/accelerate/default_config.yaml"));
        assert_eq!(default_config_path_from(|_| None), None);
    }

    #[test]
    fn bare_no_is_read_as_no_and_written_quoted() {
        let loaded = AccelerateConfig::parse("distributed_type: NO\nmixed_precision: no\n", Path::new("x")).unwrap();
        assert_eq!(loaded.config.mixed_precision, MixedPrecision::No);
        let yaml = loaded.config.to_yaml().unwrap();
        assert!(yaml.contains("mixed_precision: \"no\"") || yaml.contains("mixed_precision: 'no'"), "{yaml}");
        assert!(yaml.contains("downcast_bf16: \"no\"") || yaml.contains("downcast_bf16: 'no'"), "{yaml}");
    }

    #[test]
    fn accelerate_value_variants_are_accepted() {
        let text = "distributed_type: MULTI_GPU\ngpu_ids: 1,3\nnum_processes: -1\ndowncast_bf16: false\n";
        let c = AccelerateConfig::parse(text, Path::new("x")).unwrap().config;
        assert_eq!(c.gpu_ids.as_deref(), Some("1,3"));
        assert_eq!(c.num_processes, None);
        assert_eq!(c.downcast_bf16, "no");
        let c = AccelerateConfig::parse("gpu_ids: [0, 2]\n", Path::new("x")).unwrap().config;
        assert_eq!(c.gpu_ids.as_deref(), Some("0,2"));
        let c = AccelerateConfig::parse("gpu_ids: 0\n", Path::new("x")).unwrap().config;
        assert_eq!(c.gpu_ids.as_deref(), Some("0"));
    }

    #[test]
    fn bad_mixed_precision_is_an_error_with_a_location() {
        let e = AccelerateConfig::parse("num_machines: 1\nmixed_precision: fp8\n", Path::new("c.yaml")).unwrap_err();
        match &e {
            CliError::ConfigSyntax { line, .. } => assert_eq!(*line, 2, "{e}"),
            other => panic!("{other}"),
        }
        assert!(e.to_string().contains("fp8") && e.to_string().contains("bf16"), "{e}");
    }

    #[test]
    fn feature_keys_are_warned_only_when_they_ask_for_something() {
        let l =
            AccelerateConfig::parse("fsdp_config: {}\ndynamo_config:\n  dynamo_backend: NO\n", Path::new("x")).unwrap();
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        let l = AccelerateConfig::parse("fsdp_config:\n  fsdp_version: 2\n", Path::new("x")).unwrap();
        assert_eq!(l.warnings.len(), 1);
        assert!(l.warnings[0].contains("fsdp_config"), "{:?}", l.warnings);
    }

    #[test]
    fn the_fsdp_block_says_what_dp_shard_shards() {
        let strategy = |text: &str| {
            AccelerateConfig::parse(text, Path::new("f.yaml")).unwrap().config.sharding_strategy().unwrap().name()
        };
        // No block: FULL_SHARD under FSDP (Accelerate's default), SHARD_GRAD_OP (ZeRO-2) otherwise.
        assert_eq!(strategy("distributed_type: FSDP\n"), "FULL_SHARD");
        assert_eq!(strategy("distributed_type: MULTI_CPU\n"), "SHARD_GRAD_OP");
        assert_eq!(
            strategy("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"),
            "SHARD_GRAD_OP"
        );
        assert_eq!(strategy("fsdp_config:\n  fsdp_sharding_strategy: shard_optim\n"), "SHARD_OPTIM");
        // Torch's numbers (older Accelerate), and HYBRID_SHARD read as FULL_SHARD over dp_shard.
        assert_eq!(strategy("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 3\n"), "NO_SHARD");
        assert_eq!(strategy("fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"), "FULL_SHARD");
        // FSDP2's spelling: reshard after forward = FULL_SHARD, not = SHARD_GRAD_OP; FSDP1's strategy names.
        assert_eq!(
            strategy("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: false\n"),
            "SHARD_GRAD_OP"
        );
        assert_eq!(
            strategy("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: true\n"),
            "FULL_SHARD"
        );
        assert_eq!(strategy("fsdp_config:\n  fsdp_reshard_after_forward: 'false'\n"), "SHARD_GRAD_OP");
        assert_eq!(strategy("fsdp_config:\n  fsdp_reshard_after_forward: NO_SHARD\n"), "NO_SHARD");
        // Both keys: they must agree.
        let both = "fsdp_config:\n  fsdp_reshard_after_forward: false\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n";
        assert_eq!(strategy(both), "SHARD_GRAD_OP");
        let l = AccelerateConfig::parse(both, Path::new("f.yaml")).unwrap();
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        assert!(l.config.sets_sharding_strategy());
        assert!(!AccelerateConfig::parse("distributed_type: FSDP\n", Path::new("f.yaml"))
            .unwrap()
            .config
            .sets_sharding_strategy());
    }

    #[test]
    fn a_bad_fsdp_setting_is_an_error_at_its_block_saying_what_it_expects() {
        let err = |text: &str| AccelerateConfig::parse(text, Path::new("f.yaml")).unwrap_err().to_string();
        assert_eq!(
            err("num_machines: 1\nfsdp_config:\n  fsdp_sharding_strategy: ZERO3\n"),
            "config file f.yaml: line 2, column 1: fsdp_config: expected one of NO_SHARD, SHARD_OPTIM (ZeRO-1), \
             SHARD_GRAD_OP (ZeRO-2), FULL_SHARD (ZeRO-3), HYBRID_SHARD, _HYBRID_SHARD_ZERO2, or torch's numbers 1-5 \
             for `fsdp_sharding_strategy`, got `ZERO3`"
        );
        assert_eq!(
            err("fsdp_config:\n  fsdp_reshard_after_forward: sometimes\n"),
            "config file f.yaml: line 1, column 1: fsdp_config: expected `true` (FULL_SHARD), `false` \
             (SHARD_GRAD_OP) or a sharding strategy name for `fsdp_reshard_after_forward`, got `sometimes`"
        );
        assert_eq!(
            err("fsdp_config:\n  fsdp_reshard_after_forward: true\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"),
            "config file f.yaml: line 1, column 1: fsdp_config: expected `fsdp_sharding_strategy` and \
             `fsdp_reshard_after_forward` to agree, got SHARD_GRAD_OP and `true` (FULL_SHARD); keep one of them"
        );
        assert_eq!(
            err("fsdp_config:\n  fsdp_offload_params: 2\n"),
            "config file f.yaml: line 1, column 1: fsdp_config: expected `true` or `false` for \
             `fsdp_offload_params`, got `2`"
        );
        assert_eq!(
            err("fsdp_config: FULL_SHARD\n"),
            "config file f.yaml: line 1, column 1: fsdp_config: expected a mapping of `fsdp_*` settings (such as \
             `fsdp_sharding_strategy: SHARD_GRAD_OP`), got `FULL_SHARD`"
        );
        // CPU offload parses (`accel launch` refuses it).
        let c = AccelerateConfig::parse("fsdp_config:\n  fsdp_offload_params: true\n", Path::new("f.yaml")).unwrap();
        assert!(c.config.fsdp_offload_params() && c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn fsdp_keys_accel_does_not_read_are_kept_and_warned_about() {
        let text = "distributed_type: FSDP\nfsdp_config:\n  fsdp_activation_checkpointing: false\n  \
                    fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_offload_params: false\n  \
                    fsdp_reshard_after_forward: false\n  fsdp_version: 2\n";
        let l = AccelerateConfig::parse(text, Path::new("f.yaml")).unwrap();
        assert_eq!(
            l.warnings,
            ["f.yaml: fsdp_config: `fsdp_auto_wrap_policy`, `fsdp_version` ask for FSDP features accel does not \
              implement (it reads only `fsdp_offload_params`, `fsdp_reshard_after_forward` and \
              `fsdp_sharding_strategy`, and has no wrapping policy to set: the model's own blocks are the units); \
              ignored"]
        );
        // Written back sorted and verbatim; setting the strategy keeps the other keys and drops the FSDP2 spelling.
        let mut c = l.config;
        c.set_sharding_strategy(ShardingStrategy::ShardOptim);
        let yaml = c.to_yaml().unwrap();
        let block: Vec<&str> = yaml
            .lines()
            .skip_while(|l| !l.starts_with("fsdp_config:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .collect();
        assert_eq!(
            block,
            [
                "  fsdp_activation_checkpointing: false",
                "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
                "  fsdp_offload_params: false",
                "  fsdp_sharding_strategy: SHARD_OPTIM",
                "  fsdp_version: 2",
            ],
            "{yaml}"
        );
        let back = AccelerateConfig::parse(&yaml, Path::new("g.yaml")).unwrap().config;
        assert_eq!(back, c);
        assert_eq!(back.sharding_strategy().unwrap(), ShardingStrategy::ShardOptim);
    }

    #[test]
    fn parallelism_keys_are_the_ones_the_block_reads() {
        for key in PARALLELISM_KEYS {
            let value = match *key {
                k if k.ends_with("comm_strategy") => "allgather",
                k if k.ends_with("tp_plan") => "{}",
                k if k.ends_with("schedule") => "1F1B",
                _ => "1",
            };
            let text = format!("parallelism_config:\n  {key}: {value}\n");
            AccelerateConfig::parse(&text, Path::new("x.yaml")).unwrap_or_else(|e| panic!("{key}: {e}"));
        }
        let e = AccelerateConfig::parse("parallelism_config:\n  parallelism_config_xp_size: 1\n", Path::new("x.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("parallelism_config_xp_size"), "{e}");
    }

    #[test]
    fn the_parallelism_block_carries_a_tp_plan_to_the_workers() {
        let text = "num_processes: 2\nparallelism_config:\n  parallelism_config_tp_size: 2\n  \
                    parallelism_config_tp_plan:\n    fc1: colwise\n    fc2: rowwise\n";
        let p = AccelerateConfig::parse(text, Path::new("x.yaml")).unwrap().config.parallelism_config.unwrap();
        let plan = p.tp_plan.clone().unwrap();
        let rules: Vec<(String, String)> = plan.rules().map(|(p, s)| (p.to_string(), s.to_string())).collect();
        assert_eq!(rules, [("fc1".to_string(), "colwise".to_string()), ("fc2".to_string(), "rowwise".to_string())]);
        let env = p.env_vars();
        let carried = env.iter().find(|(k, _)| k == accel::parallelism::TP_PLAN_ENV).unwrap();
        assert_eq!(carried.1, r#"{"fc1":"colwise","fc2":"rowwise"}"#);
        let yaml = AccelerateConfig { parallelism_config: Some(p), ..AccelerateConfig::default() }.to_yaml().unwrap();
        assert!(yaml.contains("parallelism_config_tp_plan:"), "{yaml}");
        let bad = "parallelism_config:\n  parallelism_config_tp_plan:\n    fc1: sideways\n";
        let e = AccelerateConfig::parse(bad, Path::new("x.yaml")).unwrap_err().to_string();
        assert!(
            e.contains("a mapping from module-path patterns to parallel styles for `parallelism_config_tp_plan`"),
            "{e}"
        );
        assert!(e.contains("\"sideways\""), "{e}");
    }

    #[test]
    fn the_parallelism_block_reads_accelerates_keys_ours_and_the_aliases() {
        let text = "num_processes: 8\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  \
                    parallelism_config_tp_size: 2\n  parallelism_config_pp_size: 2\n";
        let c = AccelerateConfig::parse(text, Path::new("x.yaml")).unwrap().config;
        let p = c.parallelism_config.unwrap();
        assert_eq!((p.dp_replicate_size, p.tp_size, p.pp_size, p.dp_shard_size, p.cp_size), (2, 2, 2, 1, 1));
        let text = "parallelism_config:\n  data_parallel_size: 2\n  tensor_parallel_size: 4\n  \
                    pipeline_parallel_size: 1\n";
        let c = AccelerateConfig::parse(text, Path::new("x.yaml")).unwrap().config;
        assert_eq!(c.parallelism_config, Some(ParallelismConfig::data_parallel(2).with_tp_size(4)));
        // `auto` for a size: chosen at start-up (accel::auto_layout), written back as `auto`.
        let text = "num_processes: 4\nparallelism_config:\n  parallelism_config_tp_size: auto\n  \
                    parallelism_config_pp_size: 1\n";
        let p = AccelerateConfig::parse(text, Path::new("x.yaml")).unwrap().config.parallelism_config.unwrap();
        assert_eq!(p.fixed_sizes(), [Some(1), Some(1), None, Some(1)]);
        let yaml = AccelerateConfig { parallelism_config: Some(p), ..AccelerateConfig::default() }.to_yaml().unwrap();
        assert!(yaml.contains("parallelism_config_tp_size: auto"), "{yaml}");
        // A key and its alias together are one setting given twice.
        let text = "parallelism_config:\n  tensor_parallel_size: 4\n  parallelism_config_tp_size: 2\n";
        let e = AccelerateConfig::parse(text, Path::new("x.yaml")).unwrap_err().to_string();
        assert!(e.contains("`parallelism_config_tp_size` is set twice (by its name or an alias)"), "{e}");
        let e = AccelerateConfig::parse("parallelism_config:\n  tensor_parallel_size: 0\n", Path::new("x.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with(
                "line 1, column 1: parallelism_config: expected a whole number ≥ 1 or `auto` (chosen at start-up) \
                 for `tensor_parallel_size`, got `0`"
            ),
            "{e}"
        );
        // pp is written only when it is not 1 (Python Accelerate refuses keys it does not know).
        let yaml =
            AccelerateConfig { parallelism_config: Some(ParallelismConfig::data_parallel(2)), ..Default::default() }
                .to_yaml()
                .unwrap();
        assert!(yaml.contains("parallelism_config_tp_size: 1") && !yaml.contains("pp_size"), "{yaml}");
        assert!(!yaml.contains("pipeline_parallel"), "no pipeline keys without a pipeline: {yaml}");
    }

    #[test]
    fn the_parallelism_block_reads_and_writes_the_pipeline_keys() {
        let text = "num_processes: 4\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  \
                    parallelism_config_pp_size: 2\n  pipeline_parallel_schedule: gpipe\n  \
                    pipeline_parallel_microbatches: 8\n  pipeline_parallel_virtual_stages: 1\n";
        let c = AccelerateConfig::parse(text, Path::new("x.yaml")).unwrap().config;
        let want = ParallelismConfig::data_parallel(2)
            .with_pp_size(2)
            .with_pp_schedule(ScheduleKind::GPipe)
            .with_pp_microbatches(8)
            .with_pp_virtual_stages(1);
        assert_eq!(c.parallelism_config, Some(want.clone()));
        // Written in alphabetical order, the schedule in torchtitan's spelling, and read back the same.
        let yaml = c.to_yaml().unwrap();
        let block: Vec<&str> = yaml
            .lines()
            .skip_while(|l| !l.starts_with("parallelism_config:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .collect();
        assert_eq!(
            block,
            [
                "  parallelism_config_cp_size: 1",
                "  parallelism_config_dp_replicate_size: 2",
                "  parallelism_config_dp_shard_size: 1",
                "  parallelism_config_pp_size: 2",
                "  parallelism_config_tp_size: 1",
                "  pipeline_parallel_microbatches: 8",
                "  pipeline_parallel_schedule: GPipe",
                "  pipeline_parallel_virtual_stages: 1",
            ],
            "{yaml}"
        );
        assert_eq!(AccelerateConfig::parse(&yaml, Path::new("y.yaml")).unwrap().config.parallelism_config, Some(want));
        // The default schedule, 1F1B, is left out (as pp 1 is).
        let c = AccelerateConfig {
            parallelism_config: Some(ParallelismConfig::default().with_pp_size(2)),
            ..AccelerateConfig::default()
        };
        assert!(!c.to_yaml().unwrap().contains("pipeline_parallel"));
        // Values of the wrong kind say what the key expects, at its line.
        let e = AccelerateConfig::parse(
            "parallelism_config:\n  parallelism_config_pp_size: 2\n  pipeline_parallel_schedule: zigzag\n",
            Path::new("x.yaml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.ends_with(
                "parallelism_config: expected one of GPipe, 1F1B, Interleaved1F1B for `pipeline_parallel_schedule`, \
                 got `zigzag`"
            ),
            "{e}"
        );
        for key in ["pipeline_parallel_microbatches", "pipeline_parallel_virtual_stages"] {
            let e = AccelerateConfig::parse(&format!("parallelism_config:\n  {key}: 0\n"), Path::new("x.yaml"))
                .unwrap_err()
                .to_string();
            assert!(e.ends_with(&format!("expected a whole number ≥ 1 for `{key}`, got `0`")), "{e}");
        }
        let e =
            AccelerateConfig::parse("parallelism_config:\n  pipeline_parallel_microbatch: 4\n", Path::new("x.yaml"))
                .unwrap_err()
                .to_string();
        assert!(e.contains("(did you mean `pipeline_parallel_microbatches`?)"), "{e}");
    }

    #[test]
    fn a_misspelled_key_is_an_error_naming_the_file_and_the_closest_key() {
        let text = "distributed_type: MULTI_CPU\nnum_proceses: 2\nuse_cpu: true\n";
        let e = AccelerateConfig::parse(text, Path::new("/tmp/cfg.yaml")).unwrap_err().to_string();
        assert_eq!(
            e,
            "config file /tmp/cfg.yaml: line 2: unknown key `num_proceses` (did you mean `num_processes`?); \
             Accelerate's config format has no such key, and a misspelled setting would otherwise be silently \
             replaced by its default"
        );
        // Dashes for underscores, keys of the parallelism block, and keys close to nothing.
        assert_eq!(did_you_mean("mixed-precision", TYPED_KEYS), Some("mixed_precision"));
        assert_eq!(did_you_mean("my_team_setting", TYPED_KEYS), None);
        let e = AccelerateConfig::parse(
            "parallelism_config:\n  parallelism_config_tp_sise: 1\nmy_team_setting: 3\n",
            Path::new("p.yaml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("line 3: unknown key `my_team_setting`;"), "{e}");
        assert!(
            e.contains("line 2: unknown key `parallelism_config_tp_sise` (did you mean `parallelism_config_tp_size`?)"),
            "{e}"
        );
    }

    #[test]
    fn a_value_of_the_wrong_kind_says_what_the_key_expects() {
        let e = AccelerateConfig::parse("num_machines: 1\nnum_processes: two\n", Path::new("t.yaml")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "config file t.yaml: line 2, column 1: num_processes: expected a whole number ≥ 1 (or -1: decided at \
             launch), got `two`"
        );
        let e = AccelerateConfig::parse("use_cpu: maybe\n", Path::new("t.yaml")).unwrap_err().to_string();
        assert!(e.ends_with("line 1, column 1: use_cpu: expected `true` or `false`, got `maybe`"), "{e}");
        let e = AccelerateConfig::parse("{\"main_process_port\": 70000}", Path::new("c.json")).unwrap_err().to_string();
        assert!(e.ends_with("main_process_port: expected a port number (0 to 65535), got `70000`"), "{e}");
        let e = AccelerateConfig::parse("mixed_precision: true\n", Path::new("t.yaml")).unwrap_err().to_string();
        assert!(e.contains("mixed_precision: expected one of \"no\", \"fp16\", \"bf16\", got `true`"), "{e}");
        // A misspelled distributed_type is refused; Accelerate's other names are launched as DDP (with a warning).
        let e = AccelerateConfig::parse("distributed_type: MULTI_GUP\n", Path::new("t.yaml")).unwrap_err().to_string();
        assert!(e.contains("distributed_type: expected one of NO, MULTI_CPU, MULTI_GPU, FSDP (accel's), or"), "{e}");
        assert!(
            e.contains("(MULTI_NPU, MULTI_MLU,") && e.ends_with("which `accel launch` refuses, got `MULTI_GUP`"),
            "{e}"
        );
        for known in ["fsdp", "DEEPSPEED", "multi_npu"] {
            AccelerateConfig::parse(&format!("distributed_type: {known}\n"), Path::new("t.yaml")).unwrap();
        }
        let c = AccelerateConfig::parse("distributed_type: fsdp\n", Path::new("t.yaml")).unwrap().config;
        assert_eq!(c.distributed_type, DistributedType::Fsdp);
        assert_eq!(c.distributed_type.as_str(), "FSDP");
    }
}
