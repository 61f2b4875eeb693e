//! Accelerate's `parallelism_config` block of a config file: its keys (Accelerate's, our `parallelism_config_pp_size`
//! and `pipeline_parallel_*` keys, the aliases Axolotl and vLLM use) and how each is read and written, converted to
//! and from the library's [`ParallelismConfig`] with `From`. Only the CLI knows this format; the library knows the
//! sizes, their rules and the `PARALLELISM_CONFIG_*` variables.
//!
//! Written with keys in alphabetical order, as PyYAML writes them; `parallelism_config_pp_size` only when it is not
//! 1 and the `pipeline_parallel_*` keys only when set, so a file without a pipeline stays loadable by Python
//! Accelerate. Unknown keys are refused. A size is a whole number ≥ 1 or `auto`.

use accel::parallelism::ParallelismConfig;
use accel::pipeline::ScheduleKind;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The block's keys ([`ParallelismBlock`]'s fields; sorted), then the aliases it also reads.
pub const PARALLELISM_KEYS: &[&str] = &[
    "parallelism_config_cp_comm_strategy",
    "parallelism_config_cp_size",
    "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_pp_size",
    "parallelism_config_tp_plan",
    "parallelism_config_tp_size",
    "pipeline_parallel_microbatches",
    "pipeline_parallel_schedule",
    "pipeline_parallel_virtual_stages",
    "data_parallel_size",
    "pipeline_parallel_size",
    "tensor_parallel_size",
];

/// The `parallelism_config` block as the file has it (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelismBlock {
    #[serde(rename = "parallelism_config_cp_comm_strategy", default, skip_serializing_if = "Option::is_none")]
    cp_comm_strategy: Option<String>,
    #[serde(rename = "parallelism_config_cp_size", default = "one")]
    cp_size: usize,
    #[serde(
        rename = "parallelism_config_dp_replicate_size",
        alias = "data_parallel_size",
        default = "one",
        deserialize_with = "size_or_auto",
        serialize_with = "write_size"
    )]
    dp_replicate_size: usize,
    #[serde(
        rename = "parallelism_config_dp_shard_size",
        default = "one",
        deserialize_with = "size_or_auto",
        serialize_with = "write_size"
    )]
    dp_shard_size: usize,
    #[serde(
        rename = "parallelism_config_pp_size",
        alias = "pipeline_parallel_size",
        default = "one",
        skip_serializing_if = "is_one",
        deserialize_with = "size_or_auto",
        serialize_with = "write_size"
    )]
    pp_size: usize,
    #[serde(
        rename = "parallelism_config_tp_size",
        alias = "tensor_parallel_size",
        default = "one",
        deserialize_with = "size_or_auto",
        serialize_with = "write_size"
    )]
    tp_size: usize,
    #[serde(rename = "pipeline_parallel_microbatches", default, skip_serializing_if = "Option::is_none")]
    pp_microbatches: Option<usize>,
    #[serde(rename = "pipeline_parallel_schedule", default, skip_serializing_if = "is_default_schedule")]
    pp_schedule: ScheduleKind,
    #[serde(rename = "pipeline_parallel_virtual_stages", default, skip_serializing_if = "Option::is_none")]
    pp_virtual_stages: Option<usize>,
    #[serde(rename = "parallelism_config_tp_plan", default, skip_serializing_if = "Option::is_none")]
    tp_plan: Option<accel::plan::ParallelPlan>,
}

/// The block's settings; the sharding strategy is not among them (Accelerate keeps it in `fsdp_config`): the
/// default until the caller sets it.
impl From<ParallelismBlock> for ParallelismConfig {
    fn from(b: ParallelismBlock) -> Self {
        ParallelismConfig {
            cp_comm_strategy: b.cp_comm_strategy,
            cp_size: b.cp_size,
            dp_replicate_size: b.dp_replicate_size,
            dp_shard_size: b.dp_shard_size,
            pp_size: b.pp_size,
            tp_size: b.tp_size,
            pp_microbatches: b.pp_microbatches,
            pp_schedule: b.pp_schedule,
            pp_virtual_stages: b.pp_virtual_stages,
            tp_plan: b.tp_plan,
            ..ParallelismConfig::default()
        }
    }
}

impl From<&ParallelismConfig> for ParallelismBlock {
    fn from(p: &ParallelismConfig) -> Self {
        ParallelismBlock {
            cp_comm_strategy: p.cp_comm_strategy.clone(),
            cp_size: p.cp_size,
            dp_replicate_size: p.dp_replicate_size,
            dp_shard_size: p.dp_shard_size,
            pp_size: p.pp_size,
            tp_size: p.tp_size,
            pp_microbatches: p.pp_microbatches,
            pp_schedule: p.pp_schedule,
            pp_virtual_stages: p.pp_virtual_stages,
            tp_plan: p.tp_plan.clone(),
        }
    }
}

/// `#[serde(with = "…")]` for an optional [`ParallelismConfig`] field written as the block.
pub mod optional {
    use super::*;

    pub fn serialize<S: Serializer>(p: &Option<ParallelismConfig>, s: S) -> Result<S::Ok, S::Error> {
        p.as_ref().map(ParallelismBlock::from).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ParallelismConfig>, D::Error> {
        Ok(Option::<ParallelismBlock>::deserialize(d)?.map(ParallelismConfig::from))
    }
}

/// A size from a config file: a whole number ≥ 1, or `auto` ([`ParallelismConfig::AUTO`]).
fn size_or_auto<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Number(u64),
        Word(String),
    }
    let invalid = |v: &dyn std::fmt::Display| {
        serde::de::Error::custom(format!(
            "invalid size {v}: expected a whole number ≥ 1 (1 = that dimension is off) or `auto` (chosen at start-up)"
        ))
    };
    match Size::deserialize(d)? {
        Size::Number(n) if n >= 1 => usize::try_from(n).map_err(|_| invalid(&n)),
        Size::Number(n) => Err(invalid(&n)),
        Size::Word(w) if w.trim().eq_ignore_ascii_case("auto") => Ok(ParallelismConfig::AUTO),
        Size::Word(w) => match w.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(invalid(&format!("{w:?}"))),
        },
    }
}

/// Writes a size as [`size_or_auto`] reads it: the number, or `auto`.
fn write_size<S: Serializer>(n: &usize, s: S) -> Result<S::Ok, S::Error> {
    match *n {
        ParallelismConfig::AUTO => s.serialize_str("auto"),
        n => s.serialize_u64(n as u64),
    }
}

fn is_default_schedule(s: &ScheduleKind) -> bool {
    *s == ScheduleKind::default()
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{from_value, json, to_value};

    fn read(v: serde_json::Value) -> Result<ParallelismConfig, serde_json::Error> {
        from_value::<ParallelismBlock>(v).map(ParallelismConfig::from)
    }

    fn write(p: &ParallelismConfig) -> serde_json::Value {
        to_value(ParallelismBlock::from(p)).unwrap()
    }

    #[test]
    fn accelerates_keys_and_the_aliases() {
        let p = read(json!({"parallelism_config_dp_replicate_size": 2, "parallelism_config_tp_size": 2})).unwrap();
        assert_eq!(p, ParallelismConfig::data_parallel(2).with_tp_size(2));
        let p = read(json!({"data_parallel_size": 2, "tensor_parallel_size": 4, "pipeline_parallel_size": 3})).unwrap();
        assert_eq!((p.dp_replicate_size, p.tp_size, p.pp_size, p.dp_shard_size, p.cp_size), (2, 4, 3, 1, 1));
        let e = read(json!({"parallelism_config_tp_sise": 2})).unwrap_err().to_string();
        assert!(e.contains("unknown field `parallelism_config_tp_sise`"), "{e}");
        // pp is written only when it is not 1, so Python Accelerate can read what we write.
        assert_eq!(
            write(&ParallelismConfig::data_parallel(2)),
            json!({"parallelism_config_cp_size": 1, "parallelism_config_dp_replicate_size": 2,
                   "parallelism_config_dp_shard_size": 1, "parallelism_config_tp_size": 1})
        );
        let v = write(&ParallelismConfig::default().with_pp_size(2));
        assert_eq!(v["parallelism_config_pp_size"], json!(2));
        assert!(v.get("pipeline_parallel_schedule").is_none(), "the default 1F1B is not written: {v}");
    }

    #[test]
    fn the_pipeline_keys_in_alphabetical_order() {
        let p = read(json!({
            "parallelism_config_pp_size": 2,
            "pipeline_parallel_schedule": "interleaved1f1b",
            "pipeline_parallel_microbatches": 8,
            "pipeline_parallel_virtual_stages": 2,
        }))
        .unwrap();
        let want = ParallelismConfig::default()
            .with_pp_size(2)
            .with_pp_schedule(ScheduleKind::Interleaved1F1B)
            .with_pp_microbatches(8)
            .with_pp_virtual_stages(2);
        assert_eq!(p, want);
        assert_eq!(
            serde_json::to_string(&ParallelismBlock::from(&p)).unwrap(),
            "{\"parallelism_config_cp_size\":1,\"parallelism_config_dp_replicate_size\":1,\
             \"parallelism_config_dp_shard_size\":1,\"parallelism_config_pp_size\":2,\"parallelism_config_tp_size\":1,\
             \"pipeline_parallel_microbatches\":8,\"pipeline_parallel_schedule\":\"Interleaved1F1B\",\
             \"pipeline_parallel_virtual_stages\":2}"
        );
        let keys = &PARALLELISM_KEYS[..10];
        let mut sorted = keys.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, keys, "the block's keys are kept sorted");
        let e = read(json!({"pipeline_parallel_schedule": "zigzag"})).unwrap_err();
        assert!(e.to_string().contains("expected one of GPipe, 1F1B, Interleaved1F1B"), "{e}");
    }

    #[test]
    fn auto_sizes_numbers_and_numbers_as_words() {
        let auto = write(&ParallelismConfig::auto());
        assert_eq!(auto["parallelism_config_tp_size"], json!("auto"));
        assert_eq!(read(auto).unwrap(), ParallelismConfig::auto());
        let p = read(json!({"parallelism_config_tp_size": "auto", "parallelism_config_pp_size": "2"})).unwrap();
        assert_eq!(p.fixed_sizes(), [Some(1), Some(1), None, Some(2)]);
        for bad in [json!({"parallelism_config_tp_size": 0}), json!({"parallelism_config_tp_size": "some"})] {
            let e = read(bad).unwrap_err().to_string();
            assert!(e.contains("expected a whole number ≥ 1 (1 = that dimension is off) or `auto`"), "{e}");
        }
    }
}
