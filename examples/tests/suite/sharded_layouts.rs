//! Sharded data parallelism through the Accelerator (`dp_shard_size > 1` with
//! SHARD_OPTIM = ZeRO-1, SHARD_GRAD_OP = ZeRO-2, NO_SHARD): the char-GPT at dp_shard 2 and 4, HSDP (dp_replicate 2
//! × dp_shard 2) and dp_shard 2 × tp 2, with and without gradient accumulation, trains like plain DDP over the
//! same data-parallel size — the same losses, clipped gradient norms and weights after 5 AdamW steps — with
//! 1/dp_shard of DDP's optimizer state per rank (and under ZeRO-2 of its gradients between micro-batches); its
//! checkpoints hold the optimizer state as one process would, so a sharded run resumes replicated and back.
//!
//! Method: as `nd_equivalence` (f32, the same seed on the full model, the global batch fixed: each data-parallel
//! rank takes its contiguous share and splits it into `ga` micro-batches). Tolerance: relative 1e-5 on losses and
//! norms, 1e-5 absolute on the weights (a reduce-scatter adds the ranks' gradients in another order than DDP's
//! all-reduce; AdamW divides by √v, so tiny differences in small gradients move a weight by at most ~lr × 1e-3).

use super::nd_equivalence::{
    assert_close, build, corpus, global_batch, max_abs_diff, micro_batches, model_config, run, to_tensors, SEED,
};
use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, Optimizer, ParallelismConfig, ShardingStrategy};
use accel_examples::gpt::{CharGpt, GptConfig};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::sync::Arc;

const STEPS: usize = 5;

/// `(dp_replicate, dp_shard, tp, gradient accumulation)`.
pub(super) type Layout = (usize, usize, usize, usize);

/// The layout with the default sharding strategy (SHARD_GRAD_OP, ZeRO-2).
fn config(layout: Layout) -> AcceleratorConfig {
    config_with(layout, ShardingStrategy::default())
}

pub(super) fn config_with((replicate, shard, tp, ga): Layout, strategy: ShardingStrategy) -> AcceleratorConfig {
    let mut cfg = AcceleratorConfig::default().with_seed(SEED).with_gradient_accumulation_steps(ga);
    cfg.parallelism = ParallelismConfig::default()
        .with_dp_replicate_size(replicate)
        .with_dp_shard_size(shard)
        .with_tp_size(tp)
        .with_sharding_strategy(strategy);
    cfg
}

pub(super) fn world((replicate, shard, tp, _): Layout) -> usize {
    replicate * shard * tp
}

struct Trained {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    weights: BTreeMap<String, Tensor>,
    /// Bytes of the optimizer state this rank holds (its AdamW moments).
    optimizer_bytes: usize,
}

type Built = (CharGpt, accel::PreparedModel, accel::AcceleratedOptimizer<AdamW>);

/// Bytes of the optimizer state this rank holds (its AdamW moments).
fn optimizer_bytes(opt: &accel::AcceleratedOptimizer<AdamW>) -> anyhow::Result<usize> {
    Ok(opt.optimizer().state_dict()?.tensors.values().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum())
}

/// The model built once on the Accelerator's builder (drawn whole from `SEED`; under FULL_SHARD its layers gather
/// their weights at each use), prepared, with its optimizer.
fn build_prepared(acc: &Accelerator, vocab: usize) -> anyhow::Result<Built> {
    let varmap = VarMap::new();
    let cfg = model_config(vocab);
    let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let model = acc.prepare_model(&varmap)?;
    let opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
    Ok((gpt, model, opt))
}

/// One optimizer step (clipped to norm 1); the mean loss over the data-parallel ranks and the norm.
fn one_step(acc: &Accelerator, built: &mut Built, ids: &[u32], step: usize) -> anyhow::Result<(f64, f64)> {
    let (gpt, _model, opt) = built;
    let micro = micro_batches(acc, ids, step);
    let (mut loss_sum, mut norm) = (0.0, None);
    acc.accumulate_window(micro.len(), |i| -> accel::Result<()> {
        let (x, y) = &micro[i];
        let loss = gpt.loss(x, y)?;
        loss_sum += loss.to_scalar::<f32>()? as f64;
        acc.backward(&loss)?;
        if acc.sync_gradients() {
            norm = acc.clip_grad_norm(1.0)?;
            opt.step()?;
            opt.zero_grad();
        }
        Ok(())
    })?;
    let mean = acc.reduce(&Tensor::new(loss_sum / micro.len() as f64, &Device::Cpu)?, accel::ReduceKind::Mean)?;
    Ok((mean.to_scalar::<f64>()?, norm.expect("the window's last micro-batch syncs")))
}

fn train(acc: &Accelerator, ids: &[u32], vocab: usize) -> anyhow::Result<Trained> {
    let mut built = build(acc, vocab)?;
    let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (loss, norm) = one_step(acc, &mut built, ids, step)?;
        losses.push(loss);
        grad_norms.push(norm);
    }
    let optimizer_bytes = optimizer_bytes(&built.2)?;
    Ok(Trained { losses, grad_norms, weights: built.1.state_dict()?, optimizer_bytes })
}

#[test]
fn every_sharded_layout_trains_like_ddp_with_a_shard_of_the_optimizer_state() {
    use ShardingStrategy::{ShardGradOp, ShardOptim};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let params = model_config(vocab).num_parameters();
    let every = [(1, 2, 1, 1), (1, 4, 1, 1), (1, 2, 1, 2), (2, 2, 1, 1), (1, 2, 2, 1), (1, 4, 1, 2)];
    let cases = every
        .iter()
        .map(|&l| (l, ShardGradOp))
        .chain([(1, 2, 1, 2), (2, 2, 1, 1), (1, 2, 2, 1)].map(|l| (l, ShardOptim)));
    let mut ddp_runs: BTreeMap<Layout, Trained> = BTreeMap::new();
    for (layout, strategy) in cases {
        let (replicate, shard, tp, ga) = layout;
        // Plain DDP over the same data-parallel size (and tp).
        let ddp_layout = (replicate * shard, 1, tp, ga);
        let want = ddp_runs.entry(ddp_layout).or_insert_with(|| {
            let i = ids.clone();
            run(world(ddp_layout), config(ddp_layout), move |acc| train(&acc, &i, vocab)).remove(0)
        });
        assert!(want.losses[STEPS - 1] < want.losses[0] - 0.05, "DDP losses {:?}", want.losses);
        let i = ids.clone();
        let got = run(world(layout), config_with(layout, strategy), move |acc| train(&acc, &i, vocab));
        for (rank, t) in got.iter().enumerate() {
            let what =
                format!("{strategy} dp_replicate {replicate} × dp_shard {shard} × tp {tp}, ga {ga}, rank {rank}");
            assert_close(&format!("{what}: loss"), &t.losses, &want.losses);
            assert_close(&format!("{what}: grad norm"), &t.grad_norms, &want.grad_norms);
            let d = max_abs_diff(&t.weights, &want.weights);
            assert!(d <= 1e-5, "{what}: weights after {STEPS} steps differ from DDP's by {d:e}");
            // The AdamW moments of 1/dp_shard of the parameters (each parameter's chunk padded to a whole share).
            let (mine, all) = (t.optimizer_bytes, want.optimizer_bytes);
            assert!(
                mine * shard >= all && mine * shard <= all + 2 * 4 * shard * 40,
                "{what}: {mine} B of optimizer state per rank, DDP holds {all} B ({params} parameters)"
            );
        }
    }
}

/// NO_SHARD on dp_shard 2 is DDP over the two ranks: bit for bit the run at dp_replicate 2.
#[test]
fn no_shard_is_ddp_bit_for_bit() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let bits = |cfg: AcceleratorConfig| {
        let i = ids.clone();
        run(2, cfg, move |acc| {
            let t = train(&acc, &i, vocab)?;
            let w: Vec<u32> = t
                .weights
                .values()
                .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .map(f32::to_bits)
                .collect();
            Ok((t.losses.iter().chain(&t.grad_norms).map(|v| v.to_bits()).collect::<Vec<u64>>(), w, t.optimizer_bytes))
        })
    };
    let want = bits(config((2, 1, 1, 2)));
    let got = bits(config_with((1, 2, 1, 2), ShardingStrategy::NoShard));
    assert!(got == want, "NO_SHARD at dp_shard 2 differs from DDP at dp_replicate 2");
}

/// What each stage keeps between micro-batches and sends per optimizer step (dp_shard 2, 2 micro-batches): ZeRO-1
/// holds the whole gradients until the window's reduce-scatter; ZeRO-2 holds only its chunks after each
/// micro-batch's backward, at the price of a reduce-scatter per micro-batch (twice ZeRO-1's reduce-scatter bytes
/// at GA 2, the same all-gather).
#[test]
fn zero_2_keeps_only_its_gradient_chunks_between_micro_batches() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let params = model_config(vocab).num_parameters();
    let measured = |strategy: ShardingStrategy| {
        let i = ids.clone();
        run(2, config_with((1, 2, 1, 2), strategy), move |acc| {
            let (gpt, model, mut opt) = build(&acc, vocab)?;
            let shard = acc.mesh().group(ddp_core::MeshDim::DpShard).clone();
            let before = shard.traffic();
            let mut resting = Vec::new();
            for step in 0..2 {
                for (x, y) in micro_batches(&acc, &i, step) {
                    acc.accumulate(|| acc.backward(&gpt.loss(&x, &y)?))?;
                    let (slots, synced) = acc.gradients(&model);
                    if !synced {
                        resting.push(slots.iter().flatten().map(|t| t.elem_count()).sum::<usize>());
                    }
                    opt.step()?;
                    opt.zero_grad();
                }
            }
            let after = shard.traffic();
            Ok((
                resting,
                after.reduce_scatter.bytes - before.reduce_scatter.bytes,
                after.all_gather.bytes - before.all_gather.bytes,
            ))
        })
        .remove(0)
    };
    let (z1_resting, z1_scatter, z1_gather) = measured(ShardingStrategy::ShardOptim);
    let (z2_resting, z2_scatter, z2_gather) = measured(ShardingStrategy::ShardGradOp);
    assert_eq!(z1_resting, vec![params, params], "ZeRO-1 keeps whole gradients between micro-batches");
    for r in &z2_resting {
        assert!(*r * 2 >= params && *r * 2 <= params + 2 * 40, "ZeRO-2 keeps {r} of {params} gradient elements");
    }
    assert_eq!(z2_scatter, 2 * z1_scatter, "a reduce-scatter per micro-batch");
    assert_eq!(z2_gather, z1_gather);
}

/// A checkpoint of a sharded run holds the weights and the optimizer state whole (one process's layout): saved at
/// step 3 by FULL_SHARD, ZeRO-2 or DDP on 2 processes, it resumes at FULL_SHARD, ZeRO-1, ZeRO-2, dp 2 (plain DDP)
/// and tp 2 — the same 2 processes — with the next step the saving run takes.
#[test]
fn sharded_checkpoints_resume_at_other_layouts() {
    use ShardingStrategy::{FullShard, ShardGradOp, ShardOptim};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let layouts = [
        ((1, 2, 1, 1), FullShard),
        ((1, 2, 1, 1), ShardOptim),
        ((1, 2, 1, 1), ShardGradOp),
        ((2, 1, 1, 1), ShardGradOp),
        ((1, 1, 2, 1), ShardGradOp),
    ];
    for (saver, strategy) in [layouts[0], layouts[2], layouts[3]] {
        let dir = Arc::new(tmp.path().join(format!("{saver:?}-{strategy}")));
        let (i, d) = (ids.clone(), dir.clone());
        let reference = run(2, config_with(saver, strategy), move |acc| {
            let mut built = build_prepared(&acc, vocab)?;
            for step in 0..3 {
                one_step(&acc, &mut built, &i, step)?;
            }
            acc.save_state(Some(&d))?;
            let (loss, norm) = one_step(&acc, &mut built, &i, 3)?;
            Ok((loss, norm, built.1.state_dict()?))
        })
        .remove(0);
        for (layout, resumed) in layouts {
            let (i, d) = (ids.clone(), dir.clone());
            let got = run(2, config_with(layout, resumed), move |acc| {
                let mut built = build_prepared(&acc, vocab)?;
                acc.load_state(Some(&d))?;
                let (loss, norm) = one_step(&acc, &mut built, &i, 3)?;
                Ok((loss, norm, built.1.state_dict()?))
            });
            for (rank, (loss, norm, weights)) in got.iter().enumerate() {
                let what = format!("saved at {saver:?} {strategy}, resumed at {layout:?} {resumed}, rank {rank}");
                assert_close(&format!("{what}: loss"), &[*loss], &[reference.0]);
                assert_close(&format!("{what}: grad norm"), &[*norm], &[reference.1]);
                let d = max_abs_diff(weights, &reference.2);
                assert!(d <= 1e-5, "{what}: weights after the resumed step differ by {d:e}");
            }
        }
    }
}

/// A ZeRO-2 checkpoint taken inside an accumulation window (each rank holding its chunks of the first
/// micro-batch's reduced gradients) resumes at the same layout and finishes the window bit for bit as the run that
/// went on; at another sharding it is refused, naming the layout.
#[test]
fn a_zero_2_checkpoint_inside_an_accumulation_window_resumes_exactly() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let dir = Arc::new(tmp.path().join("mid-window"));
    let layout = (1, 2, 1, 2);
    // Finishes step 1's window from its second micro-batch; the weights' bits.
    fn finish(acc: &Accelerator, built: &mut Built, ids: &[u32]) -> anyhow::Result<Vec<u32>> {
        let (gpt, model, opt) = built;
        let (x, y) = &micro_batches(acc, ids, 1)[1];
        acc.accumulate(|| acc.backward(&gpt.loss(x, y)?))?;
        assert!(acc.sync_gradients());
        acc.clip_grad_norm(1.0)?;
        opt.step()?;
        let w = model.state_dict()?;
        Ok(w.values().flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).map(f32::to_bits).collect())
    }
    let (i, d) = (ids.clone(), dir.clone());
    let want = run(2, config(layout), move |acc| {
        let mut built = build(&acc, vocab)?;
        one_step(&acc, &mut built, &i, 0)?;
        let (x, y) = &micro_batches(&acc, &i, 1)[0];
        acc.accumulate(|| acc.backward(&built.0.loss(x, y)?))?;
        acc.save_state(Some(&d))?;
        finish(&acc, &mut built, &i)
    });
    let (i, d) = (ids.clone(), dir.clone());
    let got = run(2, config(layout), move |acc| {
        let mut built = build(&acc, vocab)?;
        acc.load_state(Some(&d))?;
        finish(&acc, &mut built, &i)
    });
    assert!(got == want, "the resumed window's weights differ from the run that went on");
    let d = dir.clone();
    let e = std::panic::catch_unwind(move || {
        run(2, config_with(layout, ShardingStrategy::ShardOptim), move |acc| {
            let _built = build(&acc, vocab)?;
            acc.load_state(Some(&d))?;
            Ok(())
        })
    })
    .unwrap_err();
    let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("this run keeps it as") && msg.contains("ZeRO-2 keeps a rank's chunk"), "{msg}");
}

/// fp16 (its loss scaler's overflow verdict agreed over the shards) and bf16 at dp_shard 2 (ZeRO-2, and FULL_SHARD
/// gathering its fp32 chunks into bf16 / fp16 weights) train like DDP at dp 2
/// within the half-precision tolerance (relative 2e-2), and the loss goes down.
#[test]
fn mixed_precision_trains_sharded_like_ddp() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    for mp in [accel::MixedPrecision::Bf16, accel::MixedPrecision::Fp16] {
        let i = ids.clone();
        let want = run(2, config((2, 1, 1, 1)).with_mixed_precision(mp), move |acc| train(&acc, &i, vocab)).remove(0);
        for strategy in [ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
            let i = ids.clone();
            let cfg = config_with((1, 2, 1, 1), strategy).with_mixed_precision(mp);
            let got = run(2, cfg, move |acc| train_prepared(&acc, &i, vocab, Backward::Segmented));
            for (rank, t) in got.iter().enumerate() {
                for (step, (g, w)) in t.losses.iter().zip(&want.losses).enumerate() {
                    let rel = (g - w).abs() / w.abs();
                    assert!(
                        rel <= 2e-2,
                        "{mp:?} {strategy} rank {rank} step {step}: loss {g} vs DDP's {w} ({rel:.2e})"
                    );
                }
                assert!(
                    t.losses[STEPS - 1] < t.losses[0],
                    "{mp:?} {strategy}: the loss does not go down: {:?}",
                    t.losses
                );
            }
        }
    }
}

/// Gradient compression (`DdpOptions::comm_hook`, `ACCEL_DDP_COMM_HOOK`; PyTorch's bf16 / fp16 compress hooks) on
/// DDP (dp 2) and on the sharded reduce-scatters (dp_shard 2: ZeRO-2's per segment, FULL_SHARD's in the gathered
/// weights' backward): the losses stay within 2e-2 of the uncompressed run
/// over 5 steps and fall, and the data-parallel group carries half the bytes.
#[test]
fn compression_hooks_halve_the_bytes_and_train_like_the_uncompressed_run() {
    use ddp_core::CommHook;
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    // (losses, bytes the dp group moved in gradient collectives)
    let traced = |layout: Layout, strategy: ShardingStrategy, hook: CommHook| {
        let i = ids.clone();
        let mut cfg = config_with(layout, strategy);
        cfg.ddp.comm_hook = hook;
        run(world(layout), cfg, move |acc| {
            let before = acc.mesh().dp().traffic();
            let t = train_prepared(&acc, &i, vocab, Backward::Segmented)?;
            let after = acc.mesh().dp().traffic();
            let bytes = (after.all_reduce.bytes - before.all_reduce.bytes)
                + (after.reduce_scatter.bytes - before.reduce_scatter.bytes);
            Ok((t.losses, bytes))
        })
        .remove(0)
    };
    for (layout, strategy) in [
        ((2, 1, 1, 1), ShardingStrategy::NoShard),
        ((1, 2, 1, 1), ShardingStrategy::ShardGradOp),
        ((1, 2, 1, 1), ShardingStrategy::FullShard),
    ] {
        let (want, full_bytes) = traced(layout, strategy, CommHook::None);
        for hook in [CommHook::Bf16, CommHook::Fp16] {
            let (got, bytes) = traced(layout, strategy, hook);
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                let rel = (g - w).abs() / w.abs();
                assert!(rel <= 2e-2, "{hook:?} {layout:?} step {step}: loss {g} vs uncompressed {w} ({rel:.2e})");
            }
            assert!(got[STEPS - 1] < got[0] - 0.05, "{hook:?} {layout:?}: {got:?}");
            let ratio = bytes as f64 / full_bytes as f64;
            assert!((0.49..=0.51).contains(&ratio), "{hook:?} {layout:?}: {bytes} B vs {full_bytes} B uncompressed");
        }
    }
}

/// 3 optimizer steps of the char-GPT (dropout `dropout`) through `pipeline_backward` at pp 1: a recorded forward
/// and a segmented backward (a cut after each block). Returns each micro-batch's loss and each step's clipped norm
/// (in that order) and the weights.
fn train_segmented(
    acc: &Accelerator,
    ids: &[u32],
    vocab: usize,
    dropout: f64,
) -> anyhow::Result<(Vec<f64>, BTreeMap<String, Tensor>)> {
    let cfg = GptConfig { dropout, ..model_config(vocab) };
    let varmap = VarMap::new();
    let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let model = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
    let mut values = Vec::new();
    for step in 0..3 {
        for (x, y) in micro_batches(acc, ids, step) {
            let loss = acc.accumulate(|| acc.pipeline_backward(&gpt, &x, &y, |l, t| gpt.loss_of(l, t)))?;
            values.push(loss.to_scalar::<f32>()? as f64);
            if acc.sync_gradients() {
                values.push(acc.clip_grad_norm(1.0)?.expect("synced"));
                opt.step()?;
                opt.zero_grad();
            }
        }
    }
    Ok((values, model.state_dict()?))
}

/// ZeRO-2 under a segmented backward reduce-scatters each segment's gradients as the segment finishes (one
/// bucket per segment: the char-GPT's 2 blocks make 3 segments) and trains like DDP on the same data.
#[test]
fn zero_2_reduce_scatters_each_backward_segment_and_trains_like_ddp() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let trained = |layout: Layout| {
        let i = ids.clone();
        run(world(layout), config(layout), move |acc| {
            let before = acc.mesh().group(ddp_core::MeshDim::DpShard).traffic();
            let (values, weights) = train_segmented(&acc, &i, vocab, 0.0)?;
            let after = acc.mesh().group(ddp_core::MeshDim::DpShard).traffic();
            Ok((values, weights, after.reduce_scatter.calls - before.reduce_scatter.calls))
        })
    };
    // Each rank's own micro-batch losses: the DDP rank with the same data-parallel rank.
    let want = trained((2, 1, 1, 2));
    for (rank, ((values, weights, scatters), want)) in trained((1, 2, 1, 2)).into_iter().zip(&want).enumerate() {
        // 3 steps × 2 micro-batches × 3 segments.
        assert_eq!(scatters, 3 * 2 * 3, "rank {rank}: reduce-scatters");
        assert_close(&format!("rank {rank}: losses and norms"), &values, &want.0);
        let d = max_abs_diff(&weights, &want.1);
        assert!(d <= 1e-5, "rank {rank}: weights differ from DDP's by {d:e}");
    }
}

/// Activation checkpointing (`AcceleratorConfig::activation_checkpointing`, the Trainer's
/// `gradient_checkpointing`): every char-GPT block recomputed in the backward pass trains exactly as without it —
/// the same losses, norms and weights bit for bit at 1 process, dp 2, tp 2, dp_shard 2, pp 2 and dp_shard 2 × pp 2,
/// with dropout on (the recomputed blocks draw the forward's masks) — through `pipeline_backward` (at pp 1 a
/// recorded, segmented backward; under pp each stage's forward recorded and its backward segmented).
#[test]
fn activation_checkpointing_trains_bit_for_bit_like_keeping_the_activations() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    // `pp` pipeline stages (1F1B over 2 micro-batches) on top of the layout.
    let trained = |layout: Layout, pp: usize, checkpointing: bool| {
        let i = ids.clone();
        let mut c = config(layout);
        if pp > 1 {
            c.parallelism = c.parallelism.with_pp_size(pp).with_pp_microbatches(2);
        }
        c.activation_checkpointing = checkpointing;
        run(world(layout) * pp, c, move |acc| {
            let recomputed_before = accel::activation_checkpoint::blocks_recomputed();
            let (values, weights) = train_segmented(&acc, &i, vocab, 0.1)?;
            let bits: Vec<u64> = values.iter().map(|v| v.to_bits()).collect();
            let w: Vec<u32> = weights
                .values()
                .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .map(f32::to_bits)
                .collect();
            Ok((bits, w, accel::activation_checkpoint::blocks_recomputed() - recomputed_before))
        })
    };
    for (layout, pp) in [
        ((1, 1, 1, 1), 1),
        ((2, 1, 1, 1), 1),
        ((1, 1, 2, 1), 1),
        ((1, 2, 1, 2), 1),
        ((1, 1, 1, 1), 2),
        ((1, 2, 1, 1), 2),
    ] {
        let (with, without) = (trained(layout, pp, true), trained(layout, pp, false));
        for (rank, (w, wo)) in with.iter().zip(&without).enumerate() {
            // Every block a rank holds (2 / pp) × every micro-step (3 steps × GA) × the pipeline's micro-batches
            // (2 under pp): the blocks really were checkpointed; off means off.
            let per_step = if pp > 1 { 2 / pp * 2 } else { 2 };
            let want = (per_step * 3 * layout.3) as u64;
            assert_eq!((w.2, wo.2), (want, 0), "{layout:?} × pp {pp} rank {rank}: blocks recomputed");
        }
        for (rank, (a, b)) in with.iter().zip(&without).enumerate() {
            assert!(a.0 == b.0, "{layout:?} × pp {pp} rank {rank}: losses and norms differ with checkpointing");
            assert!(a.1 == b.1, "{layout:?} × pp {pp} rank {rank}: weights differ with checkpointing");
        }
    }
}

/// The Trainer's `gradient_checkpointing` turns activation checkpointing on (blocks recomputed) and logs exactly
/// what the run without it logs.
#[test]
fn the_trainers_gradient_checkpointing_recomputes_the_blocks_and_logs_the_same_losses() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let logged = |checkpointing: bool| {
        let i = ids.clone();
        super::nd_equivalence::run_groups(1, move |pg| {
            let dir = tempfile::tempdir()?;
            let args = trainer::TrainingArguments {
                output_dir: dir.path().to_path_buf(),
                max_steps: 4,
                per_device_train_batch_size: 8,
                logging_steps: 1.0,
                gradient_checkpointing: checkpointing,
                report_to: trainer::ReportTo(vec!["none".into()]),
                save_plots: false,
                disable_tqdm: true,
                seed: SEED,
                ..Default::default()
            };
            let (x, y) = to_tensors(&global_batch(&i, 0), &Device::Cpu);
            let cfg = model_config(vocab);
            let mut t = trainer::Trainer::with_plan(
                args,
                CharGpt::plan(&cfg),
                move |vb| CharGpt::new(cfg, &vb).map_err(accel_examples::gpt::to_candle),
                accel::TensorDataset::new(x, y)?,
                None,
                trainer::losses::VocabParallelCrossEntropy { vocab_size: vocab },
            )
            .process_group(pg);
            let before = accel::activation_checkpoint::blocks_recomputed();
            t.train()?;
            let recomputed = accel::activation_checkpoint::blocks_recomputed() - before;
            let losses: Vec<f64> = t.state().log_history.iter().filter_map(|e| e.get("loss")).collect();
            Ok((losses, recomputed))
        })
        .remove(0)
    };
    let (with, without) = (logged(true), logged(false));
    assert_eq!((with.1, without.1), (2 * 4, 0), "2 blocks × 4 steps recomputed, and none without");
    assert_eq!(with.0, without.0);
    assert_eq!(with.0.len(), 4);
}

// ---- FULL_SHARD (ZeRO-3) ------------------------------------------------------------------------------------------

/// How a training micro-batch runs its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backward {
    /// `acc.backward(&loss)`: one backward pass (a FULL_SHARD model's gathered weights live until it).
    Plain,
    /// A recorded forward and `backward_segments` (FULL_SHARD units checkpointed: gathered per use).
    Segmented,
}

/// `STEPS` optimizer steps of the char-GPT built once on the Accelerator's builder (any layout trains the same
/// way), clipped to norm 1.
fn train_prepared(acc: &Accelerator, ids: &[u32], vocab: usize, backward: Backward) -> anyhow::Result<Trained> {
    let cfg = model_config(vocab);
    let varmap = VarMap::new();
    // Drawn whole once (the same weights as every layout), then handed to prepare_model: under FULL_SHARD the
    // VarMap keeps only this rank's chunks, and the layers gather their weights at each use.
    let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let model = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
    let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let micro = micro_batches(acc, ids, step);
        let (mut loss_sum, mut norm) = (0.0, None);
        acc.accumulate_window(micro.len(), |i| -> accel::Result<()> {
            let (x, y) = &micro[i];
            match backward {
                Backward::Plain => {
                    let loss = gpt.loss(x, y).map_err(|e| accel::AccelError::Usage(e.to_string()))?;
                    loss_sum += loss.to_scalar::<f32>()? as f64;
                    acc.backward(&loss)?;
                }
                Backward::Segmented => {
                    let (loss, cuts) = accel::segments::record(|| gpt.loss(x, y))
                        .map_err(|e| accel::AccelError::Usage(e.to_string()))?;
                    loss_sum += loss.to_scalar::<f32>()? as f64;
                    acc.backward_segments(&loss, cuts)?;
                }
            }
            if acc.sync_gradients() {
                norm = acc.clip_grad_norm(1.0)?;
                opt.step()?;
                opt.zero_grad();
            }
            Ok(())
        })?;
        let mean = acc.reduce(&Tensor::new(loss_sum / micro.len() as f64, &Device::Cpu)?, accel::ReduceKind::Mean)?;
        losses.push(mean.to_scalar::<f64>()?);
        grad_norms.push(norm.expect("the window's last micro-batch syncs"));
    }
    let optimizer_bytes = optimizer_bytes(&opt)?;
    Ok(Trained { losses, grad_norms, weights: model.state_dict()?, optimizer_bytes })
}

/// FULL_SHARD trains like DDP over the same data-parallel size — at dp_shard 2 and 4, HSDP 2 × 2, dp_shard 2 × tp
/// 2, with gradient accumulation, through a plain and a segmented backward — with 1/dp_shard of DDP's optimizer
/// state, and its parameters resting as chunks: the VarMap holds 1/dp_shard of the model.
#[test]
fn full_shard_trains_like_ddp_with_parameters_resting_as_chunks() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let params = model_config(vocab).num_parameters();
    let mut ddp_runs: BTreeMap<Layout, Trained> = BTreeMap::new();
    for (layout, backward) in [
        ((1, 2, 1, 1), Backward::Plain),
        ((1, 2, 1, 1), Backward::Segmented),
        ((1, 4, 1, 2), Backward::Segmented),
        ((2, 2, 1, 1), Backward::Segmented),
        ((1, 2, 2, 2), Backward::Plain),
        ((1, 2, 2, 1), Backward::Segmented),
    ] {
        let (replicate, shard, tp, ga) = layout;
        let ddp_layout = (replicate * shard, 1, tp, ga);
        let want = ddp_runs.entry(ddp_layout).or_insert_with(|| {
            let i = ids.clone();
            run(world(ddp_layout), config(ddp_layout), move |acc| train(&acc, &i, vocab)).remove(0)
        });
        let i = ids.clone();
        let got = run(world(layout), config_with(layout, ShardingStrategy::FullShard), move |acc| {
            let t = train_prepared(&acc, &i, vocab, backward)?;
            Ok(t)
        });
        for (rank, t) in got.iter().enumerate() {
            let what = format!("FULL_SHARD {layout:?} {backward:?}, rank {rank}");
            assert_close(&format!("{what}: loss"), &t.losses, &want.losses);
            assert_close(&format!("{what}: grad norm"), &t.grad_norms, &want.grad_norms);
            let d = max_abs_diff(&t.weights, &want.weights);
            assert!(d <= 1e-5, "{what}: weights after {STEPS} steps differ from DDP's by {d:e}");
            let (mine, all) = (t.optimizer_bytes, want.optimizer_bytes);
            assert!(mine * shard >= all && mine * shard <= all + 2 * 4 * shard * 40, "{what}: {mine} B vs {all} B");
        }
    }
    // What rests between steps: the VarMap's Vars are this rank's chunks (1/dp_shard of the tp piece).
    let i = ids.clone();
    let resting = run(2, config_with((1, 2, 1, 1), ShardingStrategy::FullShard), move |acc| {
        let varmap = VarMap::new();
        let cfg = model_config(vocab);
        let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
        let model = acc.prepare_model(&varmap)?;
        let shard = acc.mesh().group(ddp_core::MeshDim::DpShard).clone();
        let (x, y) = &micro_batches(&acc, &i, 0)[0];
        // Gathers per micro-batch: a plain backward gathers each parameter once; a segmented one gathers each
        // block's 16 parameters again for its backward (the unit recomputed), the 5 others once; the next unit's
        // are prefetched (FSDP's forward and backward prefetch).
        let mut gathers = Vec::new();
        for segmented in [false, true] {
            let (before, prefetched, recomputed) = (
                shard.traffic().all_gather.calls,
                model.prefetched_gathers(),
                accel::activation_checkpoint::blocks_recomputed(),
            );
            if segmented {
                let (loss, cuts) = accel::segments::record(|| gpt.loss(x, y))?;
                acc.backward_segments(&loss, cuts)?;
            } else {
                acc.backward(&gpt.loss(x, y)?)?;
            }
            gathers.push((
                shard.traffic().all_gather.calls - before,
                model.prefetched_gathers() - prefetched,
                accel::activation_checkpoint::blocks_recomputed() - recomputed,
            ));
        }
        let elems: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
        Ok((elems, model.is_fully_sharded(), model.num_parameters(), gathers))
    });
    for (rank, (elems, sharded, n, gathers)) in resting.into_iter().enumerate() {
        assert!(sharded && n == params, "rank {rank}: {n} parameters");
        // (gathered when asked for, served by a prefetch, recomputed units). Plain backward: the 5 weights outside
        // the units and block 0 gathered on the spot, block 1 prefetched while block 0 ran. Segmented: the same
        // forward, then block 1 recomputed first (gathered on the spot; block 0 prefetched meanwhile) and block 0.
        assert_eq!(
            gathers,
            vec![(5 + 16, 16, 0), (5 + 16 + 16, 16 + 16, 2)],
            "rank {rank}: (gathered when asked, prefetched, recomputed units)"
        );
        assert!(
            elems * 2 >= params && elems * 2 <= params + 2 * 40,
            "rank {rank}: the VarMap holds {elems} of {params}"
        );
    }
}

/// What FULL_SHARD refuses, each with the fix: a weight gathered once and used after an optimizer step (stale),
/// a candle VarBuilder over the gathering builder, and a forward through weights built before prepare_model.
#[test]
fn full_shard_refuses_stale_weights_and_models_that_keep_them() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let cfg = config_with((1, 2, 1, 1), ShardingStrategy::FullShard);
    let errors = run(2, cfg, move |acc| {
        let (gpt, model, mut opt) = build_prepared(&acc, vocab)?;
        let (x, y) = &micro_batches(&acc, &ids, 0)[0];
        // A weight gathered once (a model that keeps what the builder hands out), added to the loss times 1e-9
        // (candle prunes a branch multiplied by 0 from the backward pass).
        let c = model_config(vocab);
        let kept =
            model.param_builder().pp("wpe").replicated("weight", (c.block_size, c.d_model), accel::ParamInit::Zeros)?;
        let with_kept = |gpt: &CharGpt| -> accel::Result<Tensor> {
            Ok((gpt.loss(x, y).map_err(|e| accel::AccelError::Usage(e.to_string()))?
                + kept.sum_all()?.affine(1e-9, 0.0)?)?)
        };
        acc.backward(&with_kept(&gpt)?)?; // step 1: current
        opt.step()?;
        opt.zero_grad();
        let stale = acc.backward(&with_kept(&gpt)?).unwrap_err().to_string();
        let vb = model.param_builder().var_builder();
        let var_builder = vb.get((c.block_size, c.d_model), "wpe.weight").unwrap_err().to_string();
        Ok((stale, var_builder))
    });
    let (stale, var_builder) = &errors[0];
    assert!(
        stale.contains("FULL_SHARD: parameter `wpe.weight` was gathered before optimizer step 1 and used after it"),
        "{stale}"
    );
    assert!(var_builder.contains("requested through a candle VarBuilder from a FULL_SHARD model"), "{var_builder}");
    let cfg = config_with((1, 2, 1, 1), ShardingStrategy::FullShard);
    let ids2 = Arc::new(corpus().0);
    let unbuilt = run(2, cfg, move |acc| {
        // A layer of the lower-level ParamBuilder, built before prepare_model and kept: its weight is the whole
        // tensor prepare_model replaced by this rank's chunk.
        let varmap = VarMap::new();
        let fc = accel::tensor_parallel::ColumnParallelLinear::new(
            &acc.param_builder(&varmap).pp("fc"),
            8,
            8,
            accel::tensor_parallel::ParallelLinearConfig::default(),
        )?;
        acc.prepare_model(&varmap)?;
        let _ = &ids2;
        let x = Tensor::ones((2, 8), candle_core::DType::F32, &Device::Cpu)?;
        Ok(acc.backward(&fc.forward(&x)?.sum_all()?).unwrap_err().to_string())
    });
    assert!(
        unbuilt[0]
            .contains("build the model with accelerator.builder (accel::nn's layers gather their weights at each use)"),
        "{}",
        unbuilt[0]
    );
}

/// Under fp16 (half-precision parameters; bf16 on the CPU computes over f32 parameters, which are the masters),
/// ZeRO-1 and ZeRO-2 keep the fp32 masters as this rank's chunks only (what the optimizer steps), the whole
/// parameters in fp16; FULL_SHARD keeps only fp32 chunks.
#[test]
fn sharded_mixed_precision_keeps_fp32_masters_as_chunks() {
    let vocab = corpus().1;
    let params = model_config(vocab).num_parameters();
    for strategy in [ShardingStrategy::ShardOptim, ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
        let cfg = config_with((1, 2, 1, 1), strategy).with_mixed_precision(accel::MixedPrecision::Fp16);
        let held = run(2, cfg, move |acc| {
            let (_gpt, model, _opt) = build_prepared(&acc, vocab)?;
            let count = |vars: &[candle_core::Var], dtype| -> usize {
                vars.iter().filter(|v| v.dtype() == dtype).map(|v| v.elem_count()).sum()
            };
            use candle_core::DType::{F16, F32};
            Ok((count(model.master_weights(), F32), count(model.parameters(), F16), count(model.parameters(), F32)))
        });
        for (rank, (masters, half, f32)) in held.into_iter().enumerate() {
            assert!(
                masters * 2 >= params && masters * 2 <= params + 2 * 40,
                "{strategy} rank {rank}: {masters} fp32 of {params}"
            );
            match strategy {
                ShardingStrategy::FullShard => assert_eq!((half, f32), (0, masters), "{strategy} rank {rank}"),
                _ => assert_eq!((half, f32), (params, 0), "{strategy} rank {rank}"),
            }
        }
    }
}

/// A checkpoint reshards across process counts: saved at step 3 by FULL_SHARD on 4 processes (dp_shard 4), it
/// resumes on 2 (dp_shard 2 FULL_SHARD, dp 2), on 4 as tp 2 × dp_shard 2 (ZeRO-2), and on 1 process, each taking the
/// step the saving run takes next (the global batch fixed: every data-parallel rank reads its share of it).
#[test]
fn a_full_shard_checkpoint_resumes_at_other_process_counts() {
    use ShardingStrategy::{FullShard, ShardGradOp};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    let dir = Arc::new(tmp.path().join("dp_shard4"));
    let (i, d) = (ids.clone(), dir.clone());
    let reference = run(4, config_with((1, 4, 1, 1), FullShard), move |acc| {
        let mut built = build_prepared(&acc, vocab)?;
        for step in 0..3 {
            one_step(&acc, &mut built, &i, step)?;
        }
        acc.save_state(Some(&d))?;
        let (loss, norm) = one_step(&acc, &mut built, &i, 3)?;
        Ok((loss, norm, built.1.state_dict()?))
    })
    .remove(0);
    for (layout, strategy) in
        [((1, 2, 1, 1), FullShard), ((2, 1, 1, 1), ShardGradOp), ((1, 2, 2, 1), ShardGradOp), ((1, 1, 1, 1), FullShard)]
    {
        let (i, d) = (ids.clone(), dir.clone());
        let got = run(world(layout), config_with(layout, strategy), move |acc| {
            let mut built = build_prepared(&acc, vocab)?;
            acc.load_state(Some(&d))?;
            let (loss, norm) = one_step(&acc, &mut built, &i, 3)?;
            Ok((loss, norm, built.1.state_dict()?))
        });
        for (rank, (loss, norm, weights)) in got.iter().enumerate() {
            let what = format!("saved at dp_shard 4 FULL_SHARD, resumed at {layout:?} {strategy}, rank {rank}");
            assert_close(&format!("{what}: loss"), &[*loss], &[reference.0]);
            assert_close(&format!("{what}: grad norm"), &[*norm], &[reference.1]);
            let d = max_abs_diff(weights, &reference.2);
            assert!(d <= 1e-5, "{what}: weights after the resumed step differ by {d:e}");
        }
    }
}

/// 3 optimizer steps of the char-GPT cut into `pp` stages (`tie` its embeddings), each rank building its stages on
/// the Accelerator's builder, every batch through `pipeline_backward` (1F1B over 2 micro-batches); returns each
/// step's clipped norm and the whole model's weights.
fn train_pipelined(acc: &Accelerator, ids: &[u32], vocab: usize, tie: bool) -> anyhow::Result<Trained> {
    let cfg = GptConfig { tie_embeddings: tie, ..model_config(vocab) };
    let varmap = VarMap::new();
    let gpt = CharGpt::new(cfg, &acc.builder(&varmap, CharGpt::plan(&cfg)))?;
    let model = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
    let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
    for step in 0..3 {
        for (x, y) in micro_batches(acc, ids, step) {
            let loss = acc.accumulate(|| acc.pipeline_backward(&gpt, &x, &y, |l, t| gpt.loss_of(l, t)))?;
            losses.push(loss.to_scalar::<f32>()? as f64);
            if acc.sync_gradients() {
                grad_norms.push(acc.clip_grad_norm(1.0)?.expect("synced"));
                opt.step()?;
                opt.zero_grad();
            }
        }
    }
    let optimizer_bytes = optimizer_bytes(&opt)?;
    Ok(Trained { losses, grad_norms, weights: model.state_dict()?, optimizer_bytes })
}

/// dp_shard × pp: every stage's parameters sharded over its dp_shard group (ZeRO-1, ZeRO-2, FULL_SHARD), with
/// tied embeddings summed over the first and last stage chunk by chunk, train like DDP × pp on the same 4
/// processes (dp_replicate 2 × pp 2): the same losses, clipped norms (each element once over dp_shard × pp) and
/// weights, with half the optimizer state per rank.
#[test]
fn sharded_data_parallelism_trains_with_pipeline_stages() {
    use ShardingStrategy::{FullShard, ShardGradOp, ShardOptim};
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let pipelined = |shard: usize, strategy: ShardingStrategy, tie: bool| {
        let i = ids.clone();
        let mut cfg = AcceleratorConfig::default().with_seed(SEED);
        cfg.parallelism = ParallelismConfig::default()
            .with_dp_replicate_size(2 / shard)
            .with_dp_shard_size(shard)
            .with_pp_size(2)
            .with_pp_microbatches(2)
            .with_sharding_strategy(strategy);
        run(4, cfg, move |acc| train_pipelined(&acc, &i, vocab, tie))
    };
    for tie in [false, true] {
        let want = pipelined(1, ShardGradOp, tie);
        for strategy in [ShardOptim, ShardGradOp, FullShard] {
            for (rank, (t, w)) in pipelined(2, strategy, tie).iter().zip(&want).enumerate() {
                let what = format!("dp_shard 2 × pp 2 {strategy}, tied {tie}, rank {rank}");
                assert_close(&format!("{what}: loss"), &t.losses, &w.losses);
                assert_close(&format!("{what}: grad norm"), &t.grad_norms, &w.grad_norms);
                let d = max_abs_diff(&t.weights, &w.weights);
                assert!(d <= 1e-5, "{what}: weights differ from DDP × pp's by {d:e}");
                let (mine, all) = (t.optimizer_bytes, w.optimizer_bytes);
                assert!(mine * 2 >= all && mine * 2 <= all + 2 * 4 * 2 * 40, "{what}: {mine} B vs {all} B");
            }
        }
    }
}
