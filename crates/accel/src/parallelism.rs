//! [`ParallelismConfig`]: how many ways a job splits along each parallel dimension (Accelerate's
//! `ParallelismConfig`, `src/accelerate/parallelism_config.py`, plus a pipeline size of our own).
//!
//! The sizes are `dp_replicate` (data-parallel replicas, DDP), `dp_shard` (sharded data parallelism, ZeRO/FSDP),
//! `tp` (tensor parallelism), `pp` (pipeline stages, not in Accelerate) and `cp` (context parallelism, refused
//! until it exists). They come from code (a struct literal or the `with_*` builders), from Accelerate's YAML block
//!
//! ```yaml
//! parallelism_config:
//!   parallelism_config_dp_replicate_size: 2
//!   parallelism_config_tp_size: 2
//! ```
//!
//! (also spelled `data_parallel_size`, `tensor_parallel_size`, `pipeline_parallel_size`, as Axolotl and vLLM name
//! them), or from the `PARALLELISM_CONFIG_*_SIZE` variables `accelerate launch` / `accel launch` set
//! ([`ParallelismConfig::from_env`]).
//!
//! Rules (Accelerate's `_validate_accelerator`, minus its FSDP requirement): every size is at least 1; if every size
//! is 1 the job is data parallel over all its processes (dp_replicate = world size); otherwise the product must be
//! the world size. [`ParallelismConfig::mesh_shape`] applies them and gives the [`ddp_core::MeshShape`] the
//! Accelerator lays its [`ddp_core::DeviceMesh`] out with (`[pp, dp_replicate, dp_shard, tp]`, tp innermost).

use crate::{AccelError, Result};
use ddp_core::MeshShape;
use serde::{Deserialize, Serialize};

/// Environment variable: data-parallel replicas (Accelerate's name).
pub const DP_REPLICATE_SIZE_ENV: &str = "PARALLELISM_CONFIG_DP_REPLICATE_SIZE";
/// Environment variable: sharded data-parallel size (Accelerate's name).
pub const DP_SHARD_SIZE_ENV: &str = "PARALLELISM_CONFIG_DP_SHARD_SIZE";
/// Environment variable: tensor-parallel size (Accelerate's name).
pub const TP_SIZE_ENV: &str = "PARALLELISM_CONFIG_TP_SIZE";
/// Environment variable: context-parallel size (Accelerate's name).
pub const CP_SIZE_ENV: &str = "PARALLELISM_CONFIG_CP_SIZE";
/// Environment variable: pipeline-parallel size (ours, in Accelerate's naming scheme).
pub const PP_SIZE_ENV: &str = "PARALLELISM_CONFIG_PP_SIZE";
/// Environment variable: context-parallel communication strategy (kept verbatim).
pub const CP_COMM_STRATEGY_ENV: &str = "PARALLELISM_CONFIG_CP_COMM_STRATEGY";

/// Keys of the YAML `parallelism_config` block, Accelerate's and ours (the aliases are in [`ALIAS_KEYS`]).
pub const YAML_KEYS: &[&str] = &[
    "parallelism_config_cp_comm_strategy",
    "parallelism_config_cp_size",
    "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_pp_size",
    "parallelism_config_tp_size",
];

/// Other spellings accepted in the YAML block: `data_parallel_size` (= dp_replicate), `tensor_parallel_size`,
/// `pipeline_parallel_size`.
pub const ALIAS_KEYS: &[&str] = &["data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size"];

/// The parallel sizes of a job (see the module documentation). `Default`: every size 1, i.e. data parallelism
/// over all processes.
///
/// Serialised as Accelerate's `parallelism_config` block (keys in alphabetical order, as PyYAML writes them;
/// `parallelism_config_pp_size` only when it is not 1, so a file stays loadable by Python Accelerate). Unknown keys
/// are refused.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelismConfig {
    /// Context-parallel communication strategy (`allgather` / `alltoall`), kept verbatim for round trips.
    #[serde(rename = "parallelism_config_cp_comm_strategy", default, skip_serializing_if = "Option::is_none")]
    pub cp_comm_strategy: Option<String>,
    /// Context-parallel size. Only 1 is accepted: context parallelism is not implemented.
    #[serde(rename = "parallelism_config_cp_size", default = "one")]
    pub cp_size: usize,
    /// Data-parallel replicas (DDP): ranks holding the same model piece and seeing different data.
    #[serde(rename = "parallelism_config_dp_replicate_size", alias = "data_parallel_size", default = "one")]
    pub dp_replicate_size: usize,
    /// Sharded data parallelism (ZeRO / FSDP's shard dimension). A valid mesh layout; the Accelerator refuses
    /// it until sharded data parallelism is implemented.
    #[serde(rename = "parallelism_config_dp_shard_size", default = "one")]
    pub dp_shard_size: usize,
    /// Pipeline stages (ours; Accelerate has none). A valid mesh layout; the Accelerator refuses it until
    /// pipeline parallelism is implemented.
    #[serde(
        rename = "parallelism_config_pp_size",
        alias = "pipeline_parallel_size",
        default = "one",
        skip_serializing_if = "is_one"
    )]
    pub pp_size: usize,
    /// Tensor-parallel size (Megatron-style layers split over neighbouring ranks).
    #[serde(rename = "parallelism_config_tp_size", alias = "tensor_parallel_size", default = "one")]
    pub tp_size: usize,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        ParallelismConfig {
            cp_comm_strategy: None,
            cp_size: 1,
            dp_replicate_size: 1,
            dp_shard_size: 1,
            pp_size: 1,
            tp_size: 1,
        }
    }
}

impl std::fmt::Display for ParallelismConfig {
    /// `dp_replicate 2 × dp_shard 1 × tp 2 × pp 1 × cp 1`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.sizes().iter().map(|(name, n)| format!("{name} {n}")).collect();
        f.write_str(&parts.join(" × "))
    }
}

impl ParallelismConfig {
    /// Pure data parallelism over `n` processes (dp_replicate = n, every other size 1).
    pub fn data_parallel(n: usize) -> Self {
        ParallelismConfig { dp_replicate_size: n, ..Self::default() }
    }

    /// Builder: sets the data-parallel replicas.
    pub fn with_dp_replicate_size(mut self, n: usize) -> Self {
        self.dp_replicate_size = n;
        self
    }

    /// Builder: sets the sharded data-parallel size.
    pub fn with_dp_shard_size(mut self, n: usize) -> Self {
        self.dp_shard_size = n;
        self
    }

    /// Builder: sets the tensor-parallel size.
    pub fn with_tp_size(mut self, n: usize) -> Self {
        self.tp_size = n;
        self
    }

    /// Builder: sets the pipeline-parallel size.
    pub fn with_pp_size(mut self, n: usize) -> Self {
        self.pp_size = n;
        self
    }

    /// Builder: sets the context-parallel size (only 1 validates).
    pub fn with_cp_size(mut self, n: usize) -> Self {
        self.cp_size = n;
        self
    }

    /// The defaults overridden by the `PARALLELISM_CONFIG_*` variables (see [`Self::with_overrides_from`]).
    pub fn from_env() -> Result<Self> {
        Self::default().with_overrides_from(|k| std::env::var(k).ok())
    }

    /// Overrides the sizes with the variables present in `get` ([`DP_REPLICATE_SIZE_ENV`], [`DP_SHARD_SIZE_ENV`],
    /// [`TP_SIZE_ENV`], [`CP_SIZE_ENV`], [`PP_SIZE_ENV`], and [`CP_COMM_STRATEGY_ENV`] verbatim); absent variables
    /// keep the field.
    ///
    /// Errors: [`AccelError::Config`] naming the variable when a size is not a whole number ≥ 1.
    pub fn with_overrides_from(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        for (var, slot) in [
            (DP_REPLICATE_SIZE_ENV, &mut self.dp_replicate_size),
            (DP_SHARD_SIZE_ENV, &mut self.dp_shard_size),
            (TP_SIZE_ENV, &mut self.tp_size),
            (CP_SIZE_ENV, &mut self.cp_size),
            (PP_SIZE_ENV, &mut self.pp_size),
        ] {
            if let Some(v) = get(var) {
                *slot = match v.trim().parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => {
                        return Err(AccelError::Config {
                            key: var.into(),
                            value: v,
                            reason: "expected a whole number ≥ 1 (1 = that dimension is off)".into(),
                        })
                    }
                };
            }
        }
        if let Some(v) = get(CP_COMM_STRATEGY_ENV) {
            self.cp_comm_strategy = Some(v).filter(|s| !s.trim().is_empty());
        }
        Ok(self)
    }

    /// The variables that carry this config to the workers of a launcher (`PARALLELISM_CONFIG_*`, what
    /// [`Self::from_env`] reads): every size, and the cp strategy when set.
    pub fn env_vars(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            (DP_REPLICATE_SIZE_ENV, self.dp_replicate_size),
            (DP_SHARD_SIZE_ENV, self.dp_shard_size),
            (TP_SIZE_ENV, self.tp_size),
            (CP_SIZE_ENV, self.cp_size),
            (PP_SIZE_ENV, self.pp_size),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        if let Some(s) = &self.cp_comm_strategy {
            env.push((CP_COMM_STRATEGY_ENV.to_string(), s.clone()));
        }
        env
    }

    /// `(name, size)` in the order dp_replicate, dp_shard, tp, pp, cp.
    pub fn sizes(&self) -> [(&'static str, usize); 5] {
        [
            ("dp_replicate", self.dp_replicate_size),
            ("dp_shard", self.dp_shard_size),
            ("tp", self.tp_size),
            ("pp", self.pp_size),
            ("cp", self.cp_size),
        ]
    }

    /// The product of the sizes: the number of processes the layout needs (when not every size is 1).
    pub fn total_size(&self) -> usize {
        self.sizes().iter().map(|(_, n)| n).product()
    }

    /// Whether every size is 1 (data parallelism over however many processes the job has).
    pub fn is_default_layout(&self) -> bool {
        self.sizes().iter().all(|&(_, n)| n == 1)
    }

    /// Checks what does not depend on the world size: every size ≥ 1, cp = 1.
    ///
    /// Errors: [`AccelError::Config`] naming the key (`parallelism_config_tp_size`, ...), the value and the fix.
    pub fn validate_sizes(&self) -> Result<()> {
        for (name, n) in self.sizes() {
            if n == 0 {
                return Err(AccelError::Config {
                    key: format!("parallelism_config_{name}_size"),
                    value: "0".into(),
                    reason: "every size is at least 1 (1 = that dimension is off)".into(),
                });
            }
        }
        if self.cp_size > 1 {
            return Err(AccelError::Config {
                key: "parallelism_config_cp_size".into(),
                value: self.cp_size.to_string(),
                reason: "context parallelism is not implemented yet; set cp_size to 1".into(),
            });
        }
        Ok(())
    }

    /// The layout for a job of `world_size` processes: this config validated, with the all-ones rule applied
    /// (every size 1 → dp_replicate = `world_size`, as Accelerate).
    ///
    /// Errors ([`AccelError::Config`]): a size of 0, cp > 1, or a product ≠ `world_size` — the message names the
    /// sizes, their product, the world size and the dp_replicate_size that would fit (e.g. `with tp 2 and 4
    /// processes set dp_replicate_size 2`) or, when none does, what would.
    pub fn resolve(&self, world_size: usize) -> Result<ParallelismConfig> {
        self.validate_sizes()?;
        if world_size == 0 {
            return Err(AccelError::InvalidArgument("ParallelismConfig::resolve: a job has at least 1 process".into()));
        }
        if self.is_default_layout() {
            return Ok(ParallelismConfig { dp_replicate_size: world_size, ..self.clone() });
        }
        let total = self.total_size();
        if total == world_size {
            return Ok(self.clone());
        }
        // Everything but dp_replicate is what the model layout asks for; dp_replicate is what is usually adjusted.
        let model = total / self.dp_replicate_size;
        let named: Vec<String> =
            self.sizes().iter().skip(1).filter(|&&(_, n)| n > 1).map(|(name, n)| format!("{name} {n}")).collect();
        let fix = if named.is_empty() {
            format!(
                "set dp_replicate_size {world_size} (or leave every size 1: data parallelism over all {world_size} \
                 processes)"
            )
        } else if world_size.is_multiple_of(model) {
            let mut with = named;
            with.push(format!("{world_size} processes"));
            format!("with {} set dp_replicate_size {}", join_and(&with), world_size / model)
        } else {
            format!(
                "the model layout ({}) needs a multiple of {model} processes and {world_size} is not one: launch {} \
                 processes (dp replicas × {model}), or choose sizes whose product divides {world_size}",
                named.join(", "),
                model * world_size.div_ceil(model)
            )
        };
        Err(AccelError::Config {
            key: "parallelism_config".into(),
            value: self.to_string(),
            reason: format!("the sizes multiply to {total} but the job has {world_size} processes; {fix}"),
        })
    }

    /// The [`MeshShape`] `[pp, dp_replicate, dp_shard, tp]` of this config on `world_size` processes
    /// ([`Self::resolve`]'s rules and errors).
    pub fn mesh_shape(&self, world_size: usize) -> Result<MeshShape> {
        let r = self.resolve(world_size)?;
        Ok(MeshShape::new(r.pp_size, r.dp_replicate_size, r.dp_shard_size, r.tp_size)?)
    }

    /// Checks that the [`crate::Accelerator`] can train this layout: pp > 1 and dp_shard > 1 are valid
    /// [`ddp_core::DeviceMesh`] layouts (level-1 code may use them) but the Accelerator has neither pipeline
    /// schedules nor sharded optimizer state yet.
    ///
    /// Errors: [`AccelError::Config`] naming the size and what to use instead.
    pub fn check_accelerator_support(&self) -> Result<()> {
        self.check_accelerator_support_on(self.total_size())
    }

    /// [`Self::check_accelerator_support`] for a job of `world_size` processes, checked before the sizes are
    /// matched to it (so that a launcher refuses pp or dp_shard first, in one message): what would run on
    /// `world_size` processes instead.
    pub fn check_accelerator_support_on(&self, world_size: usize) -> Result<()> {
        let (key, size, what) = if self.pp_size > 1 {
            ("pp", self.pp_size, "pipeline parallelism (accel has no pipeline schedule yet)")
        } else if self.dp_shard_size > 1 {
            ("dp_shard", self.dp_shard_size, "sharded data parallelism (ZeRO / FSDP: accel does not shard yet)")
        } else {
            return Ok(());
        };
        let mut set: Vec<String> = [("pp", self.pp_size), ("dp_shard", self.dp_shard_size)]
            .iter()
            .filter(|(_, n)| *n > 1)
            .map(|(name, _)| format!("{name}_size 1"))
            .collect();
        // What runs on the same processes: the unsupported dimensions folded into replicated data parallelism.
        let model = self.tp_size * self.cp_size;
        let fix = if world_size.is_multiple_of(model) {
            let dp = world_size / model;
            set.push(format!("dp_replicate_size {dp}"));
            let runnable = ParallelismConfig { dp_replicate_size: dp, dp_shard_size: 1, pp_size: 1, ..self.clone() };
            format!("set {} ({} runs)", join_and(&set), runnable.layout_string())
        } else {
            format!("set {} and a tp_size that divides {world_size}", join_and(&set))
        };
        Err(AccelError::Config {
            key: format!("parallelism_config_{key}_size"),
            value: size.to_string(),
            reason: format!("the Accelerator cannot train with {what}; on the same {world_size} processes {fix}"),
        })
    }

    /// The four sizes a mesh lays out, `dp_replicate 2 × dp_shard 1 × tp 2 × pp 1` (cp, always 1 here, left out).
    pub fn layout_string(&self) -> String {
        format!(
            "dp_replicate {} × dp_shard {} × tp {} × pp {}",
            self.dp_replicate_size, self.dp_shard_size, self.tp_size, self.pp_size
        )
    }
}

/// `a`, `a and b`, `a, b and c`.
fn join_and(parts: &[String]) -> String {
    match parts {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
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
    fn from_env_reads_accelerates_variables() {
        let p = ParallelismConfig::default()
            .with_overrides_from(lookup(&[
                (DP_REPLICATE_SIZE_ENV, "2"),
                (TP_SIZE_ENV, " 4 "),
                (PP_SIZE_ENV, "1"),
                (DP_SHARD_SIZE_ENV, "1"),
                (CP_SIZE_ENV, "1"),
                (CP_COMM_STRATEGY_ENV, "alltoall"),
            ]))
            .unwrap();
        assert_eq!((p.dp_replicate_size, p.tp_size, p.pp_size, p.dp_shard_size, p.cp_size), (2, 4, 1, 1, 1));
        assert_eq!(p.cp_comm_strategy.as_deref(), Some("alltoall"));
        let back = ParallelismConfig::default().with_overrides_from(lookup(&[])).unwrap();
        assert_eq!(back, ParallelismConfig::default());
        // The launcher's variables read back into the same config.
        let env = p.env_vars();
        let again = ParallelismConfig::default()
            .with_overrides_from(|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
            .unwrap();
        assert_eq!(again, p);
    }

    #[test]
    fn a_bad_variable_is_named() {
        for bad in ["0", "two", "-1", ""] {
            let e = ParallelismConfig::default().with_overrides_from(lookup(&[(TP_SIZE_ENV, bad)])).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "invalid configuration PARALLELISM_CONFIG_TP_SIZE = {bad:?}: expected a whole number ≥ 1 (1 = \
                     that dimension is off)"
                )
            );
        }
    }

    #[test]
    fn every_size_one_is_data_parallel_over_the_world() {
        let r = ParallelismConfig::default().resolve(4).unwrap();
        assert_eq!(r, ParallelismConfig::data_parallel(4));
        assert_eq!(ParallelismConfig::default().mesh_shape(3).unwrap(), MeshShape::data_parallel(3));
        let s = ParallelismConfig::default().with_tp_size(2).mesh_shape(2).unwrap();
        assert_eq!((s.pp, s.dp_replicate, s.dp_shard, s.tp), (1, 1, 1, 2));
        let s = ParallelismConfig::default().with_tp_size(2).with_dp_replicate_size(2).mesh_shape(4).unwrap();
        assert_eq!((s.pp, s.dp_replicate, s.dp_shard, s.tp), (1, 2, 1, 2));
        let s = ParallelismConfig::default().with_pp_size(2).with_dp_shard_size(2).mesh_shape(4).unwrap();
        assert_eq!((s.pp, s.dp_replicate, s.dp_shard, s.tp), (2, 1, 2, 1));
    }

    #[test]
    fn a_product_other_than_the_world_size_says_what_fits() {
        let e = ParallelismConfig::default().with_tp_size(2).resolve(4).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid configuration parallelism_config = \"dp_replicate 1 × dp_shard 1 × tp 2 × pp 1 × cp 1\": the \
             sizes multiply to 2 but the job has 4 processes; with tp 2 and 4 processes set dp_replicate_size 2"
        );
        let e = ParallelismConfig::default().with_tp_size(2).with_pp_size(2).resolve(8).unwrap_err().to_string();
        assert!(e.ends_with("with tp 2, pp 2 and 8 processes set dp_replicate_size 2"), "{e}");
        let e = ParallelismConfig::default().with_tp_size(3).resolve(4).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "the sizes multiply to 3 but the job has 4 processes; the model layout (tp 3) needs a multiple of 3 \
                 processes and 4 is not one: launch 6 processes (dp replicas × 3), or choose sizes whose product \
                 divides 4"
            ),
            "{e}"
        );
        let e = ParallelismConfig::data_parallel(2).resolve(4).unwrap_err().to_string();
        assert!(e.ends_with("set dp_replicate_size 4 (or leave every size 1: data parallelism over all 4 processes)"));
        let e = ParallelismConfig::data_parallel(2).with_tp_size(2).resolve(8).unwrap_err().to_string();
        assert!(e.contains("multiply to 4 but the job has 8") && e.ends_with("set dp_replicate_size 4"), "{e}");
    }

    #[test]
    fn zero_sizes_and_context_parallelism_are_refused() {
        let e = ParallelismConfig::default().with_dp_shard_size(0).resolve(1).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid configuration parallelism_config_dp_shard_size = \"0\": every size is at least 1 (1 = that \
             dimension is off)"
        );
        let e = ParallelismConfig::default().with_cp_size(2).with_dp_replicate_size(2).resolve(4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration parallelism_config_cp_size = \"2\": context parallelism is not implemented yet; \
             set cp_size to 1"
        );
    }

    #[test]
    fn the_accelerator_refuses_pp_and_dp_shard_saying_what_to_use() {
        ParallelismConfig::default().with_tp_size(4).check_accelerator_support().unwrap();
        // pp 2 × tp 2 on 4 processes: what runs there is dp_replicate 2 × tp 2.
        let e = ParallelismConfig::default().with_pp_size(2).with_tp_size(2).check_accelerator_support().unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration parallelism_config_pp_size = \"2\": the Accelerator cannot train with pipeline \
             parallelism (accel has no pipeline schedule yet); on the same 4 processes set pp_size 1 and \
             dp_replicate_size 2 (dp_replicate 2 × dp_shard 1 × tp 2 × pp 1 runs)"
        );
        let e = ParallelismConfig::data_parallel(2).with_dp_shard_size(2).with_pp_size(2).check_accelerator_support();
        assert!(e.unwrap_err().to_string().ends_with(
            "on the same 8 processes set pp_size 1, dp_shard_size 1 and dp_replicate_size 8 (dp_replicate 8 × \
             dp_shard 1 × tp 1 × pp 1 runs)"
        ));
        let e = ParallelismConfig::default().with_dp_shard_size(2).check_accelerator_support().unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration parallelism_config_dp_shard_size = \"2\": the Accelerator cannot train with \
             sharded data parallelism (ZeRO / FSDP: accel does not shard yet); on the same 2 processes set \
             dp_shard_size 1 and dp_replicate_size 2 (dp_replicate 2 × dp_shard 1 × tp 1 × pp 1 runs)"
        );
    }

    #[test]
    fn serde_uses_accelerates_keys_and_the_aliases() {
        use serde_json::{from_value, json, to_value};
        let p: ParallelismConfig = from_value(json!({
            "parallelism_config_dp_replicate_size": 2,
            "parallelism_config_tp_size": 2,
        }))
        .unwrap();
        assert_eq!(p, ParallelismConfig::data_parallel(2).with_tp_size(2));
        let p: ParallelismConfig =
            from_value(json!({"data_parallel_size": 2, "tensor_parallel_size": 4, "pipeline_parallel_size": 3}))
                .unwrap();
        assert_eq!((p.dp_replicate_size, p.tp_size, p.pp_size, p.dp_shard_size, p.cp_size), (2, 4, 3, 1, 1));
        let e = from_value::<ParallelismConfig>(json!({"parallelism_config_tp_sise": 2})).unwrap_err().to_string();
        assert!(e.contains("unknown field `parallelism_config_tp_sise`"), "{e}");
        // pp is written only when it is not 1, so Python Accelerate can read what we write.
        let v = to_value(ParallelismConfig::data_parallel(2)).unwrap();
        assert_eq!(
            v,
            json!({"parallelism_config_cp_size": 1, "parallelism_config_dp_replicate_size": 2,
                   "parallelism_config_dp_shard_size": 1, "parallelism_config_tp_size": 1})
        );
        let v = to_value(ParallelismConfig::default().with_pp_size(2)).unwrap();
        assert_eq!(v["parallelism_config_pp_size"], json!(2));
    }
}
