//! The run banner in accel's words: ddp-core's [`RunBanner`] (config, processes × machines, layout, backend) with
//! what a level-2 run adds — the sharding strategy after dp_shard and the pipeline schedule after the layout (or
//! which sizes the automatic layout chooses at start-up), mixed precision, gradient accumulation. The one builder of
//! it: the Accelerator's banner and `accel launch`'s are the same line when nothing changed in between.

use crate::config::MixedPrecision;
use crate::parallelism::ParallelismConfig;
use ddp_core::launcher::RunBanner;

/// The banner of a run of `processes` over `machines` laid out by `parallelism` (its sizes resolved against
/// `processes`, or left to the automatic layout), in `mixed_precision` with `accumulation` micro-batches per
/// optimizer step, on `backend`; `config` is the config file read, as [`RunBanner::config`] says it.
pub fn run_banner(
    config: String,
    processes: usize,
    machines: usize,
    parallelism: &ParallelismConfig,
    mixed_precision: MixedPrecision,
    accumulation: usize,
    backend: &str,
) -> RunBanner {
    let layout = if parallelism.is_auto() {
        format!("{} (chosen at start-up)", parallelism.layout_string())
    } else {
        let shape = parallelism
            .mesh_shape(processes)
            .unwrap_or_else(|_| ddp_core::MeshShape::new(1, processes.max(1), 1, 1).expect("at least one process"));
        let resolved = ParallelismConfig {
            dp_replicate_size: shape.dp_replicate,
            dp_shard_size: shape.dp_shard,
            tp_size: shape.tp,
            pp_size: shape.pp,
            ..parallelism.clone()
        };
        resolved.layout_with_pipeline()
    };
    RunBanner {
        config,
        processes,
        machines,
        layout,
        details: vec![format!("mixed precision {mixed_precision}"), format!("gradient accumulation {accumulation}")],
        backend: backend.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::ShardingStrategy;

    #[test]
    fn the_sharding_and_the_pipeline_go_into_the_layout() {
        let banner = |p: &ParallelismConfig, n| run_banner("x".into(), n, 2, p, MixedPrecision::Bf16, 2, "cpu");
        assert_eq!(
            banner(&ParallelismConfig::data_parallel(2).with_tp_size(2), 4).settings(),
            "4 processes × 2 machines | dp_replicate 2 × dp_shard 1 × tp 2 × pp 1 | mixed precision bf16 | gradient \
             accumulation 2 | backend cpu"
        );
        let pp = ParallelismConfig::default().with_pp_size(2).with_tp_size(2).with_pp_microbatches(4);
        assert!(banner(&pp, 4)
            .settings()
            .contains("| dp_replicate 1 × dp_shard 1 × tp 2 × pp 2 (1F1B, 4 micro-batches) |"));
        let sharded = ParallelismConfig::default()
            .with_dp_shard_size(2)
            .with_tp_size(2)
            .with_sharding_strategy(ShardingStrategy::FullShard);
        assert!(banner(&sharded, 4).settings().contains("| dp_replicate 1 × dp_shard 2 (FULL_SHARD) × tp 2 × pp 1 |"));
        let auto = banner(&ParallelismConfig::auto(), 4).settings();
        assert!(
            auto.contains("| dp_replicate auto × dp_shard auto × tp auto × pp auto (chosen at start-up) |"),
            "{auto}"
        );
    }
}
