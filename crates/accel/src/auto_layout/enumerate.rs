//! Every layout a world size allows for a model and a batch ([`enumerate`]), and why the others are not
//! ([`Rejections`]).
//!
//! A layout is `(dp_replicate, dp_shard, tp, pp)` with product the world size, and:
//! - tp divides `n_head`, `d_model` and `d_ff` (the vocabulary is padded), and is 1 unless the program has
//!   tensor-parallel layers; pp is at most the number of blocks, and 1 unless the program has stages;
//! - dp_shard 1 shards nothing (NO_SHARD); dp_shard > 1 takes each allowed strategy but NO_SHARD (which would be
//!   dp_replicate by another name);
//! - at pp > 1 each allowed schedule: GPipe and 1F1B with 1 stage per rank, interleaved 1F1B with `v` from 2 to
//!   `n_layer / pp` (every stage holds a block);
//! - each allowed micro-batch size `b` with the global batch a multiple of `dp · b`; the `B / (dp · b)`
//!   micro-batches are accumulation steps at pp 1 (only one without accumulation), the pipeline's micro-batches at
//!   pp > 1 — at least `pp · v` of them, a multiple of pp when interleaved (`ParallelismConfig::validate_pipeline`);
//! - the sizes the user fixed (`TrainSpec::fixed`) as given;
//! - activation checkpointing on and/or off as [`Checkpointing`] says (at any pp: accel records each stage's
//!   forward), except under FULL_SHARD, which recomputes its units anyway.
//!
//! The layers per stage are not chosen here: evaluation splits them ([`super::evaluate`]).

use super::layout::Layout;
use super::model::ModelSpec;
use super::train::{Checkpointing, TrainSpec};
use crate::pipeline::ScheduleKind;
use crate::sharding::ShardingStrategy;
use std::collections::BTreeMap;

/// Why layouts of the world size were not enumerated: per rule, how many shapes it ruled out and one example.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rejections {
    rules: BTreeMap<&'static str, (usize, String)>,
}

impl Rejections {
    fn add(&mut self, rule: &'static str, example: impl FnOnce() -> String) {
        self.rules.entry(rule).or_insert_with(|| (0, example())).0 += 1;
    }

    /// Each rule that ruled something out, with how many candidates it ruled out and an example: `"global batch
    /// does not split (7 candidates, e.g. 6 sequences over dp 4 × micro-batch 1)"`.
    pub fn lines(&self) -> Vec<String> {
        self.rules
            .iter()
            .map(|(rule, (n, example))| {
                format!("{rule} ({}, e.g. {example})", super::units::plural(*n, "candidate", "candidates"))
            })
            .collect()
    }

    /// Whether nothing was ruled out.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
}

/// The divisors of `n`, ascending.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every layout of `world` processes for `model` and `train` (module documentation), in a fixed order, and the
/// rules that ruled others out.
pub fn enumerate(model: &ModelSpec, world: usize, train: &TrainSpec) -> (Vec<Layout>, Rejections) {
    let mut out = Vec::new();
    let mut why = Rejections::default();
    let mut sizes = train.micro_batch_sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let mut strategies: Vec<ShardingStrategy> =
        train.strategies.iter().copied().filter(|s| *s != ShardingStrategy::NoShard).collect();
    strategies.sort_by_key(|s| s.zero_stage());
    strategies.dedup();
    let mut schedules = train.schedules.clone();
    schedules.sort_by_key(|k| k.as_str());
    schedules.dedup();

    for pp in divisors(world) {
        if !pp_fits(model, train, pp, &mut why) {
            continue;
        }
        for tp in divisors(world / pp) {
            if !tp_fits(model, train, tp, &mut why) {
                continue;
            }
            let dp = world / (pp * tp);
            for shard in divisors(dp) {
                let rep = dp / shard;
                if !sizes_fit_the_config(train, [rep, shard, tp, pp], &mut why) {
                    continue;
                }
                let stage_options: Vec<ShardingStrategy> =
                    if shard == 1 { vec![ShardingStrategy::NoShard] } else { strategies.clone() };
                if stage_options.is_empty() {
                    why.add("no sharding strategy allowed", || format!("dp_shard {shard}"));
                }
                for &sharding in &stage_options {
                    for (schedule, v) in pipeline_options(&schedules, pp, model.n_layer) {
                        for &b in &sizes {
                            let Some((microbatches, accumulation_steps)) =
                                split_batch(train, dp, b, pp, (schedule, v), &mut why)
                            else {
                                continue;
                            };
                            for &activation_checkpointing in checkpointing_options(train, sharding) {
                                out.push(Layout {
                                    dp_replicate: rep,
                                    dp_shard: shard,
                                    tp,
                                    pp,
                                    sharding,
                                    schedule,
                                    virtual_stages: v,
                                    microbatches,
                                    accumulation_steps,
                                    micro_batch_size: b,
                                    activation_checkpointing,
                                    layers_per_stage: None,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    (out, why)
}

/// Whether `pp` pipeline ranks are possible for the model and the program (else the reason is recorded).
fn pp_fits(model: &ModelSpec, train: &TrainSpec, pp: usize, why: &mut Rejections) -> bool {
    if pp > 1 && !train.pipeline {
        why.add("pipeline not allowed", || format!("pp {pp}: the program has no pipeline stages"));
        return false;
    }
    if pp > 1 && !model.has_stages() {
        why.add("the model has no pipeline blocks", || {
            format!("pp {pp}: the model is not declared as blocks (accel::nn::staged)")
        });
        return false;
    }
    if pp > model.n_layer {
        why.add("more pp ranks than blocks", || format!("pp {pp} > {} blocks", model.n_layer));
        return false;
    }
    true
}

/// Whether `tp` tensor-parallel ranks are possible for the model and the program (else the reason is recorded).
fn tp_fits(model: &ModelSpec, train: &TrainSpec, tp: usize, why: &mut Rejections) -> bool {
    if tp > 1 && !train.tensor_parallel {
        why.add("tensor parallelism not allowed", || format!("tp {tp}: the program has no tp layers"));
        return false;
    }
    if let Some(misfit) = model.tp_misfit(tp) {
        why.add("tp does not split the model", || misfit);
        return false;
    }
    true
}

/// Whether `[dp_replicate, dp_shard, tp, pp]` keeps every size the config fixed (else the reason is recorded).
fn sizes_fit_the_config(train: &TrainSpec, sizes: [usize; 4], why: &mut Rejections) -> bool {
    let Some(k) = (0..4).find(|&k| train.fixed[k].is_some_and(|n| n != sizes[k])) else { return true };
    why.add("a size is fixed by the config", || {
        let names = ["dp_replicate", "dp_shard", "tp", "pp"];
        format!("{} {} where the config sets {}", names[k], sizes[k], train.fixed[k].unwrap_or(0))
    });
    false
}

/// The pipeline schedules to try at `pp` and their stages per rank: none at pp 1; `Interleaved1F1B` with every
/// stage count from 2 to the blocks per pp rank.
fn pipeline_options(schedules: &[ScheduleKind], pp: usize, n_layer: usize) -> Vec<(Option<ScheduleKind>, usize)> {
    if pp == 1 {
        return vec![(None, 1)];
    }
    schedules
        .iter()
        .flat_map(|&kind| match kind {
            ScheduleKind::Interleaved1F1B => (2..=n_layer / pp).map(|v| (Some(kind), v)).collect(),
            _ => vec![(Some(kind), 1)],
        })
        .collect()
}

/// The global batch split over `dp` replicas in micro-batches of `b`: (pipeline micro-batches, accumulation
/// steps), or `None` (the reason recorded) when it does not split, needs accumulation the program does not do, or
/// leaves the pipeline's stages idle.
fn split_batch(
    train: &TrainSpec,
    dp: usize,
    b: usize,
    pp: usize,
    (schedule, v): (Option<ScheduleKind>, usize),
    why: &mut Rejections,
) -> Option<(usize, usize)> {
    let b_global = train.global_batch;
    if !b_global.is_multiple_of(dp * b) {
        why.add("global batch does not split", || format!("{b_global} sequences over dp {dp} × micro-batch {b}"));
        return None;
    }
    let n = b_global / (dp * b);
    if pp == 1 && n > 1 && !train.gradient_accumulation {
        why.add("accumulation not allowed", || format!("dp {dp} × micro-batch {b} needs {n} accumulation steps"));
        return None;
    }
    if pp > 1 && n < pp * v {
        why.add("fewer micro-batches than stages", || {
            format!("{n} micro-batches of {b} for pp {pp} × {v} stages per rank")
        });
        return None;
    }
    if schedule == Some(ScheduleKind::Interleaved1F1B) && !n.is_multiple_of(pp) {
        why.add("interleaving needs a multiple of pp micro-batches", || format!("{n} micro-batches at pp {pp}"));
        return None;
    }
    Some(if pp == 1 { (1, n) } else { (n, 1) })
}

/// Activation checkpointing off, on, or both to compare, as the training asks; never under FULL_SHARD.
fn checkpointing_options(train: &TrainSpec, sharding: ShardingStrategy) -> &'static [bool] {
    match (train.checkpointing, sharding != ShardingStrategy::FullShard) {
        (Checkpointing::Off, _) | (_, false) => &[false],
        (Checkpointing::On, true) => &[true],
        (Checkpointing::Auto, true) => &[false, true],
    }
}
