//! Sharded data parallelism through the Accelerator (issue "ND-parallel III", ZeRO-1: `dp_shard_size > 1`): the
//! char-GPT at dp_shard 2 and 4, HSDP (dp_replicate 2 × dp_shard 2) and dp_shard 2 × tp 2, with and without
//! gradient accumulation, trains like plain DDP over the same data-parallel size — the same losses, clipped
//! gradient norms and weights after 5 AdamW steps — with 1/dp_shard of DDP's optimizer state per rank; its
//! checkpoints hold the optimizer state as one process would, so a sharded run resumes replicated and back.
//!
//! Method: as `nd_equivalence` (f32, the same seed on the full model, the global batch fixed: each data-parallel
//! rank takes its contiguous share and splits it into `ga` micro-batches). Tolerance: relative 1e-5 on losses and
//! norms, 1e-5 absolute on the weights (a reduce-scatter adds the ranks' gradients in another order than DDP's
//! all-reduce; AdamW divides by √v, so tiny differences in small gradients move a weight by at most ~lr × 1e-3).

use super::nd_equivalence::{
    assert_close, build, corpus, global_batch, max_abs_diff, micro_batches, model_config, run, to_tensors, SEED,
};
use accel::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, Optimizer, ParallelismConfig};
use accel_examples::gpt::{CharGpt, GptConfig};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::collections::BTreeMap;
use std::sync::Arc;

const STEPS: usize = 5;

/// `(dp_replicate, dp_shard, tp, gradient accumulation)`.
type Layout = (usize, usize, usize, usize);

fn config((replicate, shard, tp, ga): Layout) -> AcceleratorConfig {
    let mut cfg = AcceleratorConfig::default().with_seed(SEED).with_gradient_accumulation_steps(ga);
    cfg.parallelism =
        ParallelismConfig::default().with_dp_replicate_size(replicate).with_dp_shard_size(shard).with_tp_size(tp);
    cfg
}

fn world((replicate, shard, tp, _): Layout) -> usize {
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
    let optimizer_bytes =
        built.2.optimizer().state_dict()?.tensors.values().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum();
    Ok(Trained { losses, grad_norms, weights: built.1.state_dict()?, optimizer_bytes })
}

#[test]
fn every_sharded_layout_trains_like_ddp_with_a_shard_of_the_optimizer_state() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let params = model_config(vocab).num_parameters();
    for layout in [(1, 2, 1, 1), (1, 4, 1, 1), (1, 2, 1, 2), (2, 2, 1, 1), (1, 2, 2, 1), (1, 4, 1, 2)] {
        let (replicate, shard, tp, ga) = layout;
        // Plain DDP over the same data-parallel size (and tp).
        let ddp_layout = (replicate * shard, 1, tp, ga);
        let i = ids.clone();
        let want = run(world(ddp_layout), config(ddp_layout), move |acc| train(&acc, &i, vocab)).remove(0);
        assert!(want.losses[STEPS - 1] < want.losses[0] - 0.05, "DDP losses {:?}", want.losses);
        let i = ids.clone();
        let got = run(world(layout), config(layout), move |acc| train(&acc, &i, vocab));
        for (rank, t) in got.iter().enumerate() {
            let what = format!("dp_replicate {replicate} × dp_shard {shard} × tp {tp}, ga {ga}, rank {rank}");
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

/// A checkpoint of a sharded run holds the optimizer state whole (one process's layout): a dp_shard 2 run saved at
/// step 3 resumes at dp_shard 2, at dp 2 (plain DDP) and at tp 2 — the same 2 processes — with the next step the
/// sharded run takes; and a DDP checkpoint resumes sharded.
#[test]
fn sharded_checkpoints_resume_at_other_layouts() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let tmp = tempfile::tempdir().unwrap();
    for saver in [(1, 2, 1, 1), (2, 1, 1, 1)] {
        let dir = Arc::new(tmp.path().join(format!("{saver:?}")));
        let (i, d) = (ids.clone(), dir.clone());
        let reference = run(2, config(saver), move |acc| {
            let mut built = build(&acc, vocab)?;
            for step in 0..3 {
                one_step(&acc, &mut built, &i, step)?;
            }
            acc.save_state(Some(&d))?;
            let (loss, norm) = one_step(&acc, &mut built, &i, 3)?;
            Ok((loss, norm, built.1.state_dict()?))
        })
        .remove(0);
        for layout in [(1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1)] {
            let (i, d) = (ids.clone(), dir.clone());
            let got = run(2, config(layout), move |acc| {
                let mut built = build(&acc, vocab)?;
                acc.load_state(Some(&d))?;
                let (loss, norm) = one_step(&acc, &mut built, &i, 3)?;
                Ok((loss, norm, built.1.state_dict()?))
            });
            for (rank, (loss, norm, weights)) in got.iter().enumerate() {
                let what = format!("saved at {saver:?}, resumed at {layout:?}, rank {rank}");
                assert_close(&format!("{what}: loss"), &[*loss], &[reference.0]);
                assert_close(&format!("{what}: grad norm"), &[*norm], &[reference.1]);
                let d = max_abs_diff(weights, &reference.2);
                assert!(d <= 1e-5, "{what}: weights after the resumed step differ by {d:e}");
            }
        }
    }
}

/// fp16 (its loss scaler's overflow verdict agreed over the shards) and bf16 at dp_shard 2 train like DDP at dp 2
/// within the half-precision tolerance (relative 2e-2), and the loss goes down.
#[test]
fn mixed_precision_trains_sharded_like_ddp() {
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    for mp in [accel::MixedPrecision::Bf16, accel::MixedPrecision::Fp16] {
        let i = ids.clone();
        let want = run(2, config((2, 1, 1, 1)).with_mixed_precision(mp), move |acc| train(&acc, &i, vocab)).remove(0);
        let i = ids.clone();
        let got = run(2, config((1, 2, 1, 1)).with_mixed_precision(mp), move |acc| train(&acc, &i, vocab));
        for (rank, t) in got.iter().enumerate() {
            for (step, (g, w)) in t.losses.iter().zip(&want.losses).enumerate() {
                let rel = (g - w).abs() / w.abs();
                assert!(rel <= 2e-2, "{mp:?} dp_shard 2 rank {rank} step {step}: loss {g} vs DDP's {w} ({rel:.2e})");
            }
            assert!(t.losses[STEPS - 1] < t.losses[0], "{mp:?}: the loss does not go down: {:?}", t.losses);
        }
    }
}

/// Gradient compression (`DdpOptions::comm_hook`, `ACCEL_DDP_COMM_HOOK`; PyTorch's bf16 / fp16 compress hooks) on
/// DDP (dp 2) and on the sharded reduce-scatter (dp_shard 2): the losses stay within 2e-2 of the uncompressed run
/// over 5 steps and fall, and the data-parallel group carries half the bytes.
#[test]
fn compression_hooks_halve_the_bytes_and_train_like_the_uncompressed_run() {
    use ddp_core::CommHook;
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    // (losses, bytes the dp group moved in gradient collectives)
    let traced = |layout: Layout, hook: CommHook| {
        let i = ids.clone();
        let mut cfg = config(layout);
        cfg.ddp.comm_hook = hook;
        run(world(layout), cfg, move |acc| {
            let before = acc.mesh().dp().traffic();
            let t = train(&acc, &i, vocab)?;
            let after = acc.mesh().dp().traffic();
            let bytes = (after.all_reduce.bytes - before.all_reduce.bytes)
                + (after.reduce_scatter.bytes - before.reduce_scatter.bytes);
            Ok((t.losses, bytes))
        })
        .remove(0)
    };
    for layout in [(2, 1, 1, 1), (1, 2, 1, 1)] {
        let (want, full_bytes) = traced(layout, CommHook::None);
        for hook in [CommHook::Bf16, CommHook::Fp16] {
            let (got, bytes) = traced(layout, hook);
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

/// Activation checkpointing (`AcceleratorConfig::activation_checkpointing`, the Trainer's
/// `gradient_checkpointing`): every char-GPT block recomputed in the backward pass trains exactly as without it —
/// the same losses, norms and weights bit for bit at 1 process, dp 2, tp 2 and dp_shard 2, with dropout on (the
/// recomputed blocks draw the forward's masks) — through `pipeline_backward` (recorded, segmented backward).
#[test]
fn activation_checkpointing_trains_bit_for_bit_like_keeping_the_activations() {
    use accel_examples::gpt::GptStages;
    let (ids, vocab) = corpus();
    let ids = Arc::new(ids);
    let cfg = GptConfig { dropout: 0.1, ..model_config(vocab) };
    let trained = |layout: Layout, checkpointing: bool| {
        let i = ids.clone();
        let mut c = config(layout);
        c.activation_checkpointing = checkpointing;
        run(world(layout), c, move |acc| -> anyhow::Result<(Vec<u64>, Vec<u32>, u64)> {
            let recomputed_before = accel::activation_checkpoint::blocks_recomputed();
            let stages = acc.pipeline_stages(cfg.n_layer, None)?;
            let varmap = VarMap::new();
            let gpt = GptStages::new(cfg, &acc.param_builder(&varmap), &stages)?;
            let model = acc.prepare_model(&varmap)?;
            let mut opt =
                acc.prepare_optimizer(&model, AdamW::new(AdamWConfig { lr: 3e-3, ..AdamWConfig::default() })?)?;
            let mut bits = Vec::new();
            for step in 0..3 {
                for (x, y) in micro_batches(&acc, &i, step) {
                    let loss = acc.accumulate(|| acc.pipeline_backward(&gpt, &x, &y, |l, t| gpt.loss_of(l, t)))?;
                    bits.push(loss.to_scalar::<f32>()?.to_bits() as u64);
                    if acc.sync_gradients() {
                        bits.push(acc.clip_grad_norm(1.0)?.expect("synced").to_bits());
                        opt.step()?;
                        opt.zero_grad();
                    }
                }
            }
            let weights = model.state_dict()?;
            let w: Vec<u32> = weights
                .values()
                .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .map(f32::to_bits)
                .collect();
            Ok((bits, w, accel::activation_checkpoint::blocks_recomputed() - recomputed_before))
        })
    };
    for layout in [(1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1), (1, 2, 1, 2)] {
        let (with, without) = (trained(layout, true), trained(layout, false));
        for (rank, (w, wo)) in with.iter().zip(&without).enumerate() {
            // 2 blocks × every micro-step (3 steps × GA): the blocks really were checkpointed; off means off.
            assert_eq!((w.2, wo.2), ((2 * 3 * layout.3) as u64, 0), "{layout:?} rank {rank}: blocks recomputed");
        }
        for (rank, (a, b)) in with.iter().zip(&without).enumerate() {
            assert!(a.0 == b.0, "{layout:?} rank {rank}: losses and norms differ with checkpointing");
            assert!(a.1 == b.1, "{layout:?} rank {rank}: weights differ with checkpointing");
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
            let mut t = trainer::Trainer::new_parallel(
                args,
                move |pb| CharGpt::new(cfg, pb).map_err(accel_examples::gpt::to_candle),
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
