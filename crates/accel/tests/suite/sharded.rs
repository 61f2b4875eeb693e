//! Sharded data parallelism on an MLP (the stages' equivalence on 2 and 4 ranks for the
//! MLP as for the char-GPT, whose tests are in `examples/tests/suite/sharded_layouts.rs`): an MLP whose weights
//! come from a `ParamBuilder` — 6 → 16 → 3 with a 1-element bias, so one parameter has fewer elements than the
//! group has ranks — trained 5 AdamW steps with clipping under ZeRO-1, ZeRO-2 and FULL_SHARD on 2 and 4 ranks gives
//! the losses, clipped norms and weights of plain DDP over the same ranks (relative 1e-5 on losses and norms, 1e-5
//! on weights: a reduce-scatter adds the ranks' gradients in another order than DDP's all-reduce).

use crate::ranks::*;
use accel::tensor_parallel::{ParamBuilder, ParamInit};
use accel::{AcceleratorConfig, AdamW, AdamWConfig, ParallelismConfig, ShardingStrategy};
use candle_core::{Module, Tensor};
use std::collections::BTreeMap;

/// `x → tanh(x·W1ᵀ + b1)·W2ᵀ + b2 → · w3 + b3` with a `[1]` bias `b3`. Built from a prepared model's gathering
/// builder, it keeps only the builder and gathers its weights in each forward (FULL_SHARD); otherwise it keeps
/// them.
struct ShardMlp {
    weights: Option<[Tensor; 6]>,
    pb: ParamBuilder,
}

fn weights(pb: &ParamBuilder) -> accel::Result<[Tensor; 6]> {
    let u = |fan_in: usize| ParamInit::Uniform { bound: 1.0 / (fan_in as f64).sqrt() };
    Ok([
        pb.replicated("l1.weight", (HIDDEN, IN), u(IN))?,
        pb.replicated("l1.bias", HIDDEN, u(IN))?,
        pb.replicated("l2.weight", (OUT, HIDDEN), u(HIDDEN))?,
        pb.replicated("l2.bias", OUT, u(HIDDEN))?,
        pb.replicated("l3.weight", (1, OUT), u(OUT))?,
        pb.replicated("l3.bias", 1, u(OUT))?,
    ])
}

impl ShardMlp {
    fn new(pb: &ParamBuilder) -> accel::Result<Self> {
        let weights = if pb.gathers() { None } else { Some(weights(pb)?) };
        Ok(ShardMlp { weights, pb: pb.clone() })
    }
}

impl Module for ShardMlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gathered;
        let w = match &self.weights {
            Some(w) => w,
            None => {
                gathered = weights(&self.pb).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                &gathered
            }
        };
        let h = x.matmul(&w[0].t()?)?.broadcast_add(&w[1])?.tanh()?;
        let h = h.matmul(&w[2].t()?)?.broadcast_add(&w[3])?;
        h.matmul(&w[4].t()?)?.broadcast_add(&w[5])
    }
}

/// Each step's loss and clipped norm, and the final weights, on this rank.
type Trace = (Vec<f64>, Vec<f64>, BTreeMap<String, Tensor>);

fn train(cfg: AcceleratorConfig, world: usize) -> Vec<Trace> {
    run_ranks(world, cfg, move |acc| {
        let varmap = candle_nn::VarMap::new();
        ShardMlp::new(&acc.param_builder(&varmap))?;
        let model = acc.prepare_model(&varmap)?;
        let mlp = ShardMlp::new(&model.param_builder())?;
        let mut opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 1e-2, ..AdamWConfig::default() })?)?;
        let (x, y) = dataset(8 * world, 3);
        let (dp, rank) = (acc.data_parallel_size(), acc.data_parallel_rank());
        let rows = x.dim(0)? / dp;
        let (x, y) = (x.narrow(0, rank * rows, rows)?, y.narrow(0, rank * rows, rows)?);
        let y = y.to_dtype(candle_core::DType::F32)?.unsqueeze(1)?;
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let loss = (mlp.forward(&x)? - &y)?.sqr()?.mean_all()?;
            losses.push(loss.to_scalar::<f32>()? as f64);
            acc.backward(&loss)?;
            norms.push(acc.clip_grad_norm(0.5)?.expect("every backward syncs"));
            opt.step()?;
            opt.zero_grad();
        }
        Ok((losses, norms, model.state_dict()?))
    })
}

#[test]
fn every_stage_trains_an_mlp_like_ddp_on_2_and_4_ranks() {
    use ShardingStrategy::{FullShard, ShardGradOp, ShardOptim};
    for world in [2, 4] {
        let ddp = train(AcceleratorConfig::default().with_seed(7), world);
        assert!(ddp[0].0[4] < ddp[0].0[0], "DDP's loss goes down: {:?}", ddp[0].0);
        for strategy in [ShardOptim, ShardGradOp, FullShard] {
            let mut cfg = AcceleratorConfig::default().with_seed(7);
            cfg.parallelism = ParallelismConfig::default().with_dp_shard_size(world).with_sharding_strategy(strategy);
            for (rank, (got, want)) in train(cfg, world).iter().zip(&ddp).enumerate() {
                let what = format!("{strategy} on {world} ranks, rank {rank}");
                for (k, (g, w)) in got.0.iter().chain(&got.1).zip(want.0.iter().chain(&want.1)).enumerate() {
                    assert!((g - w).abs() <= 1e-5 * w.abs().max(1e-12), "{what}: value {k}: {g} vs DDP's {w}");
                }
                for (name, w) in &want.2 {
                    let d = (&got.2[name] - w).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                    assert!(d <= 1e-5, "{what}: {name} differs from DDP's by {d:e}");
                }
            }
        }
    }
}
