//! [`AcceleratorConfig`]: everything the Accelerator needs to know that is not code — mixed precision, gradient
//! accumulation, seed, device choice, data-loader sharding policy, checkpoint naming, DDP options.
//!
//! It is filled from code (struct literal / builder methods) or from the environment `accel launch` sets, with the
//! same variable names as Python Accelerate's launcher (`ACCELERATE_MIXED_PRECISION`, ...), so a program that calls
//! [`AcceleratorConfig::from_env`] runs unchanged on one CPU or under a launcher.

use crate::{AccelError, ParallelismConfig, Result};
use candle_core::DType;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Environment variable: `no` | `fp16` | `bf16`.
pub const MIXED_PRECISION_ENV: &str = "ACCELERATE_MIXED_PRECISION";
/// Environment variable: gradient accumulation steps (integer ≥ 1).
pub const GRADIENT_ACCUMULATION_STEPS_ENV: &str = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";
/// Environment variable: `true`/`1` forces the CPU even when CUDA is built in.
pub const USE_CPU_ENV: &str = "ACCELERATE_USE_CPU";
/// Environment variable: global seed (u64).
pub const SEED_ENV: &str = "ACCELERATE_SEED";
/// Environment variable: DDP's gradient compression hook, `no`, `fp16` or `bf16` (ours; Accelerate sets it in code
/// with `DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)`).
pub const DDP_COMM_HOOK_ENV: &str = "ACCEL_DDP_COMM_HOOK";
/// Environment variable: activation checkpointing per block, `true` / `false` (ours).
pub const ACTIVATION_CHECKPOINTING_ENV: &str = "ACCEL_ACTIVATION_CHECKPOINTING";

/// Compute precision of the model (Accelerate's `mixed_precision`).
///
/// `Bf16`/`Fp16`: the model's `Var`s live in the 16-bit type (forward and backward run there), the optimizer
/// updates fp32 master copies which are cast back after each step. `Fp16` adds dynamic loss scaling
/// ([`crate::GradScaler`]); `Bf16` has fp32's exponent range and needs none.
///
/// Serialised as the string `"no"`, `"fp16"` or `"bf16"`. Deserialised leniently, as Accelerate's YAML 1.1 reader
/// does: any spelling [`FromStr`] takes, a boolean `false` or null (what a bare `no` / an empty value become) for
/// `No`; a boolean `true` is refused as ambiguous. Errors name the value and the accepted choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MixedPrecision {
    /// Full fp32.
    #[default]
    No,
    /// IEEE half precision with loss scaling.
    Fp16,
    /// bfloat16.
    Bf16,
}

impl MixedPrecision {
    /// All accepted spellings, for error messages.
    pub const CHOICES: &'static str = "\"no\", \"fp16\", \"bf16\"";

    /// The dtype model parameters and activations live in.
    pub fn compute_dtype(self) -> DType {
        match self {
            MixedPrecision::No => DType::F32,
            MixedPrecision::Fp16 => DType::F16,
            MixedPrecision::Bf16 => DType::BF16,
        }
    }

    /// The canonical spelling (`"no"`, `"fp16"`, `"bf16"`).
    pub fn as_str(self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Fp16 => "fp16",
            MixedPrecision::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MixedPrecision {
    type Err = AccelError;

    /// Parses `no` / `fp16` / `bf16` (case-insensitive; `false`/`none`/`fp32` also mean no, as a YAML 1.1 reader
    /// turns a bare `no` into `false`).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "no" | "false" | "none" | "fp32" | "" => Ok(MixedPrecision::No),
            "fp16" | "f16" | "half" => Ok(MixedPrecision::Fp16),
            "bf16" | "bfloat16" => Ok(MixedPrecision::Bf16),
            _ => Err(AccelError::Config {
                key: "mixed_precision".into(),
                value: s.to_string(),
                reason: format!("unknown mixed precision; choose one of {}", MixedPrecision::CHOICES),
            }),
        }
    }
}

impl serde::Serialize for MixedPrecision {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        // Always a string: a YAML writer then quotes "no", which a YAML 1.1 reader would otherwise take for false.
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for MixedPrecision {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Lenient;
        impl<'de> serde::de::Visitor<'de> for Lenient {
            type Value = MixedPrecision;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "one of {} for mixed_precision", MixedPrecision::CHOICES)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<MixedPrecision, E> {
                v.parse().map_err(|_| {
                    E::custom(format!("unknown mixed_precision {v:?}; choose one of {}", MixedPrecision::CHOICES))
                })
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<MixedPrecision, E> {
                if v {
                    return Err(E::custom(format!(
                        "mixed_precision: true is ambiguous; choose one of {}",
                        MixedPrecision::CHOICES
                    )));
                }
                Ok(MixedPrecision::No)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<MixedPrecision, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<MixedPrecision, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<MixedPrecision, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<MixedPrecision, E> {
                Ok(MixedPrecision::No)
            }
            fn visit_none<E: serde::de::Error>(self) -> std::result::Result<MixedPrecision, E> {
                Ok(MixedPrecision::No)
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<MixedPrecision, D::Error> {
                d.deserialize_any(self)
            }
        }
        d.deserialize_any(Lenient)
    }
}

/// Configuration of an [`crate::Accelerator`]. `Default` is fp32, no accumulation, no seed, sharded data with
/// `even_batches`, no automatic checkpoint naming and PyTorch's DDP defaults.
#[derive(Debug, Clone)]
pub struct AcceleratorConfig {
    /// Compute precision (default [`MixedPrecision::No`]).
    pub mixed_precision: MixedPrecision,
    /// Micro-batches per optimizer step (default 1). `backward` divides the loss by this.
    pub gradient_accumulation_steps: usize,
    /// Seed applied by [`crate::Accelerator::new`] through `set_seed` when set.
    pub seed: Option<u64>,
    /// Force the CPU even if CUDA is built in (default false).
    pub cpu: bool,
    /// Data loaders split the global batch across ranks instead of each rank yielding `batch_size` (default false).
    pub split_batches: bool,
    /// Data loaders pad the tail with samples from the epoch start so every rank yields as many batches (default true).
    pub even_batches: bool,
    /// Root for automatic checkpoint naming (`project_dir/checkpoints/checkpoint_{i}`) and trackers.
    pub project_dir: Option<PathBuf>,
    /// Name checkpoints automatically under `project_dir` when `save_state(None)` is called (default false).
    pub automatic_checkpoint_naming: bool,
    /// Keep at most this many automatically named checkpoints (oldest deleted first).
    pub total_limit: Option<usize>,
    /// `save_state` returns once the checkpoint's state is copied in memory and a writer thread writes it while
    /// training goes on (torchtitan's asynchronous checkpointing; default false). See `Accelerator::save_state`.
    pub async_checkpointing: bool,
    /// Options of the DDP wrapper (bucket sizes, unused parameters, initial broadcast).
    pub ddp: ddp_core::DdpOptions,
    /// The parallel sizes (default every size 1: data parallelism over all processes). The Accelerator lays its
    /// [`ddp_core::DeviceMesh`] out from them; see [`ParallelismConfig`].
    pub parallelism: ParallelismConfig,
    /// Recompute each model block's activations in the backward pass instead of keeping them (default false;
    /// blocks the model wraps in [`crate::activation_checkpoint::block`]; HF's `gradient_checkpointing`).
    pub activation_checkpointing: bool,
    /// The program's model and training, for the automatic layout: read when a size of [`Self::parallelism`] is
    /// `auto` ([`ParallelismConfig::AUTO`]; `accel launch --parallelism auto`, `parallelism_config_tp_size: auto`),
    /// when the Accelerator probes the machines and chooses the layout before laying out its mesh
    /// ([`crate::auto_layout`]; the decision is [`crate::Accelerator::auto_layout`]). Default `None`.
    pub auto_layout: Option<crate::auto_layout::AutoLayoutRequest>,
}

impl Default for AcceleratorConfig {
    fn default() -> Self {
        AcceleratorConfig {
            mixed_precision: MixedPrecision::No,
            gradient_accumulation_steps: 1,
            seed: None,
            cpu: false,
            split_batches: false,
            even_batches: true,
            project_dir: None,
            automatic_checkpoint_naming: false,
            total_limit: None,
            async_checkpointing: false,
            ddp: ddp_core::DdpOptions::default(),
            parallelism: ParallelismConfig::default(),
            activation_checkpointing: false,
            auto_layout: None,
        }
    }
}

impl AcceleratorConfig {
    /// Defaults overridden by the variables `accel launch` sets (`ACCELERATE_MIXED_PRECISION`,
    /// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, `ACCELERATE_USE_CPU`, `ACCELERATE_SEED`, our `ACCEL_DDP_COMM_HOOK`, and the
    /// `PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,TP,CP,PP}_SIZE` sizes, the pipeline's
    /// `PARALLELISM_CONFIG_PP_{SCHEDULE,MICROBATCHES,VIRTUAL_STAGES}` and the sharding strategy
    /// `FSDP_SHARDING_STRATEGY`). A malformed value is an error naming the variable and the accepted values.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`Self::from_env`] with any lookup function (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        Self::default().with_overrides_from(get)
    }

    /// Overrides this config's fields with the variables present in `get` (absent variables keep the field).
    pub fn with_overrides_from(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        if let Some(v) = get(MIXED_PRECISION_ENV) {
            self.mixed_precision = v.parse().map_err(|_| AccelError::Config {
                key: MIXED_PRECISION_ENV.into(),
                value: v.clone(),
                reason: format!("unknown mixed precision; choose one of {}", MixedPrecision::CHOICES),
            })?;
        }
        if let Some(v) = get(GRADIENT_ACCUMULATION_STEPS_ENV) {
            self.gradient_accumulation_steps = match v.trim().parse::<usize>() {
                Ok(n) if n >= 1 => n,
                _ => {
                    return Err(AccelError::Config {
                        key: GRADIENT_ACCUMULATION_STEPS_ENV.into(),
                        value: v,
                        reason: "expected an integer ≥ 1".into(),
                    })
                }
            };
        }
        if let Some(v) = get(USE_CPU_ENV) {
            self.cpu = parse_bool(USE_CPU_ENV, &v)?;
        }
        if let Some(v) = get(SEED_ENV) {
            self.seed = Some(v.trim().parse::<u64>().map_err(|_| AccelError::Config {
                key: SEED_ENV.into(),
                value: v.clone(),
                reason: "expected an unsigned 64-bit integer".into(),
            })?);
        }
        if let Some(v) = get(ACTIVATION_CHECKPOINTING_ENV) {
            self.activation_checkpointing = parse_bool(ACTIVATION_CHECKPOINTING_ENV, &v)?;
        }
        if let Some(v) = get(DDP_COMM_HOOK_ENV).filter(|v| !v.trim().is_empty()) {
            self.ddp.comm_hook = v.parse().map_err(|_| AccelError::Config {
                key: DDP_COMM_HOOK_ENV.into(),
                value: v.clone(),
                reason: format!("expected one of {}", ddp_core::CommHook::CHOICES),
            })?;
        }
        self.parallelism = self.parallelism.with_overrides_from(&get)?;
        Ok(self)
    }

    /// Checks the values that cannot work (gradient accumulation 0, total_limit 0, automatic naming without a
    /// project_dir, a parallel size of 0, context parallelism). The parallel sizes' product is checked against
    /// the world size when the Accelerator is built ([`ParallelismConfig::resolve`]).
    pub fn validate(&self) -> Result<()> {
        self.parallelism.validate_sizes()?;
        if self.gradient_accumulation_steps == 0 {
            return Err(AccelError::Config {
                key: "gradient_accumulation_steps".into(),
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        if self.total_limit == Some(0) {
            return Err(AccelError::Config {
                key: "total_limit".into(),
                value: "0".into(),
                reason: "keep at least 1 checkpoint, or use None for no limit".into(),
            });
        }
        if self.automatic_checkpoint_naming && self.project_dir.is_none() {
            return Err(AccelError::Config {
                key: "automatic_checkpoint_naming".into(),
                value: "true".into(),
                reason: "needs project_dir to be set (checkpoints go to project_dir/checkpoints/checkpoint_{i})".into(),
            });
        }
        Ok(())
    }

    /// Builder: sets the mixed precision.
    pub fn with_mixed_precision(mut self, mp: MixedPrecision) -> Self {
        self.mixed_precision = mp;
        self
    }

    /// Builder: sets the gradient accumulation steps.
    pub fn with_gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.gradient_accumulation_steps = steps;
        self
    }

    /// Builder: sets the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Builder: sets the parallel sizes.
    pub fn with_parallelism(mut self, parallelism: ParallelismConfig) -> Self {
        self.parallelism = parallelism;
        self
    }

    /// Builder: describes the program's model and training for the automatic layout (used when a parallel size
    /// is `auto`; [`Self::auto_layout`]).
    pub fn with_auto_layout(mut self, request: crate::auto_layout::AutoLayoutRequest) -> Self {
        self.auto_layout = Some(request);
        self
    }

    /// Builder: sets the project directory (and turns on automatic checkpoint naming).
    pub fn with_project_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.project_dir = Some(dir.into());
        self.automatic_checkpoint_naming = true;
        self
    }
}

/// Parses a boolean setting as the launchers write them: `1`/`true`/`yes`/`on` and `0`/`false`/`no`/`off`/empty,
/// any case, surrounding blanks ignored (ddp-core's table, so every layer agrees).
///
/// Errors: [`AccelError::Config`] naming `key` and the value.
pub fn parse_bool(key: &str, v: &str) -> Result<bool> {
    ddp_core::env::parse_bool(key, v).map_err(|_| AccelError::Config {
        key: key.into(),
        value: v.to_string(),
        reason: "expected true/false (or 1/0)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn mixed_precision_parses_and_rejects() {
        assert_eq!("bf16".parse::<MixedPrecision>().unwrap(), MixedPrecision::Bf16);
        assert_eq!("FP16".parse::<MixedPrecision>().unwrap(), MixedPrecision::Fp16);
        assert_eq!("no".parse::<MixedPrecision>().unwrap(), MixedPrecision::No);
        let e = "fp8".parse::<MixedPrecision>().unwrap_err().to_string();
        assert!(e.contains("fp8") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn env_overrides_defaults() {
        let cfg = AcceleratorConfig::from_lookup(lookup(&[
            (MIXED_PRECISION_ENV, "bf16"),
            (GRADIENT_ACCUMULATION_STEPS_ENV, "4"),
            (USE_CPU_ENV, "true"),
            (SEED_ENV, "42"),
            (DDP_COMM_HOOK_ENV, "BF16"),
            (ACTIVATION_CHECKPOINTING_ENV, "true"),
        ]))
        .unwrap();
        assert!(cfg.activation_checkpointing);
        assert_eq!(cfg.ddp.comm_hook, ddp_core::CommHook::Bf16);
        assert_eq!(cfg.mixed_precision, MixedPrecision::Bf16);
        assert_eq!(cfg.gradient_accumulation_steps, 4);
        assert!(cfg.cpu);
        assert_eq!(cfg.seed, Some(42));
        let cfg = AcceleratorConfig::from_lookup(lookup(&[])).unwrap();
        assert_eq!(cfg.mixed_precision, MixedPrecision::No);
        assert_eq!(cfg.gradient_accumulation_steps, 1);
        assert_eq!(cfg.parallelism, ParallelismConfig::default());
    }

    #[test]
    fn parallelism_comes_from_accelerates_variables() {
        let cfg = AcceleratorConfig::from_lookup(lookup(&[
            ("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2"),
            ("PARALLELISM_CONFIG_TP_SIZE", "2"),
            ("PARALLELISM_CONFIG_PP_SIZE", "1"),
        ]))
        .unwrap();
        assert_eq!(cfg.parallelism, ParallelismConfig::data_parallel(2).with_tp_size(2));
        // Overrides keep what code set unless the variable is there.
        let cfg = AcceleratorConfig::default()
            .with_parallelism(ParallelismConfig::default().with_tp_size(4))
            .with_overrides_from(lookup(&[("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")]))
            .unwrap();
        assert_eq!((cfg.parallelism.tp_size, cfg.parallelism.dp_replicate_size), (4, 2));
        let e = AcceleratorConfig::from_lookup(lookup(&[("PARALLELISM_CONFIG_PP_SIZE", "x")])).unwrap_err();
        assert!(e.to_string().starts_with("invalid configuration PARALLELISM_CONFIG_PP_SIZE = \"x\""), "{e}");
        let cfg = AcceleratorConfig { parallelism: ParallelismConfig::default().with_cp_size(2), ..Default::default() };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("context parallelism is not implemented yet; set cp_size to 1"), "{e}");
    }

    #[test]
    fn bad_env_names_the_variable() {
        let e = AcceleratorConfig::from_lookup(lookup(&[(GRADIENT_ACCUMULATION_STEPS_ENV, "0")])).unwrap_err();
        assert!(e.to_string().contains(GRADIENT_ACCUMULATION_STEPS_ENV), "{e}");
        let e = AcceleratorConfig::from_lookup(lookup(&[(MIXED_PRECISION_ENV, "int8")])).unwrap_err();
        assert!(e.to_string().contains(MIXED_PRECISION_ENV) && e.to_string().contains("int8"), "{e}");
        // Empty is unset.
        let cfg = AcceleratorConfig::from_lookup(lookup(&[(DDP_COMM_HOOK_ENV, " ")])).unwrap();
        assert_eq!(cfg.ddp.comm_hook, ddp_core::CommHook::None);
        let e = AcceleratorConfig::from_lookup(lookup(&[(DDP_COMM_HOOK_ENV, "power_sgd")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration ACCEL_DDP_COMM_HOOK = \"power_sgd\": expected one of no, fp16, bf16"
        );
    }

    #[test]
    fn mixed_precision_deserializes_leniently_and_serializes_as_a_string() {
        use serde_json::{from_value, json};
        assert_eq!(from_value::<MixedPrecision>(json!("no")).unwrap(), MixedPrecision::No);
        assert_eq!(from_value::<MixedPrecision>(json!(false)).unwrap(), MixedPrecision::No, "YAML 1.1 bare no");
        assert_eq!(from_value::<MixedPrecision>(json!(null)).unwrap(), MixedPrecision::No);
        assert_eq!(from_value::<MixedPrecision>(json!("BF16")).unwrap(), MixedPrecision::Bf16);
        assert_eq!(from_value::<MixedPrecision>(json!("fp16")).unwrap(), MixedPrecision::Fp16);
        let e = from_value::<MixedPrecision>(json!(true)).unwrap_err().to_string();
        assert!(e.contains("ambiguous") && e.contains("bf16"), "{e}");
        let e = from_value::<MixedPrecision>(json!("fp8")).unwrap_err().to_string();
        assert!(e.contains("\"fp8\"") && e.contains("\"fp16\", \"bf16\""), "{e}");
        assert_eq!(serde_json::to_string(&MixedPrecision::No).unwrap(), "\"no\"");
    }

    #[test]
    fn parse_bool_takes_the_launchers_spellings() {
        for t in ["1", "true", "Yes", " on "] {
            assert!(parse_bool("K", t).unwrap(), "{t}");
        }
        for f in ["0", "FALSE", "no", "off", ""] {
            assert!(!parse_bool("K", f).unwrap(), "{f}");
        }
        let e = parse_bool(USE_CPU_ENV, "maybe").unwrap_err().to_string();
        assert!(e.contains(USE_CPU_ENV) && e.contains("maybe") && e.contains("true/false"), "{e}");
    }
}
