//! Bit-exact resume: train to step k, save, keep training to step n; a fresh Accelerator that loads the step-k
//! checkpoint and trains to step n must end with the same parameters, byte for byte.
//!
//! The loop draws input noise from the Accelerator's RNG (as dropout or augmentation would), shuffles its data,
//! crosses epoch boundaries with an uneven last batch, and uses AdamW — so the resumed run only matches when the
//! weights, the optimizer moments and step, the RNG stream, the data-loader position (mid-epoch) and the
//! accumulation window are all restored exactly.

use std::path::{Path, PathBuf};

use crate::ranks::*;
use accel::data::{DataLoader, DataLoaderConfig, TensorDataset};
use accel::{AcceleratedOptimizer, Accelerator, AcceleratorConfig, AdamW, AdamWConfig, MixedPrecision, PreparedModel};
use candle_core::Tensor;
use ddp_core::ProcessGroup;
use rand::Rng;

struct Run {
    acc: Accelerator,
    model: TinyMlp,
    prepared: PreparedModel,
    opt: AcceleratedOptimizer<AdamW>,
    loader: DataLoader<TensorDataset>,
}

/// 37 samples, batch 4, shuffled: 10 batches per epoch on one process (the last one of 1 row).
fn build(acc: Accelerator, init_seed: u64) -> anyhow::Result<Run> {
    let (model, varmap) = tiny_model(&acc, init_seed)?;
    let prepared = acc.prepare_model(&varmap)?;
    let cfg = AdamWConfig { weight_decay: 0.01, ..AdamWConfig::new(5e-3) };
    let opt = acc.prepare_optimizer(&prepared, AdamW::new(cfg)?)?;
    let (x, y) = dataset(37, 21);
    let dl = DataLoaderConfig { batch_size: 4, shuffle: true, seed: 5, ..DataLoaderConfig::default() };
    let loader = acc.prepare_data_loader(DataLoader::new(TensorDataset::new(x, y)?, dl))?;
    Ok(Run { acc, model, prepared, opt, loader })
}

/// Trains until the optimizer has taken `until` steps, saving a checkpoint into `save.1` right after step
/// `save.0`. Resumes wherever the loader and the Accelerator stand.
fn train_to(r: &mut Run, until: u64, save: Option<(u64, &Path)>) -> anyhow::Result<()> {
    while r.acc.optimizer_step_count() < until {
        for batch in r.loader.iter() {
            let b = batch?;
            let noise: Vec<f32> = {
                let mut rng = r.acc.rng();
                (0..b.inputs.elem_count()).map(|_| rng.random_range(-0.1f32..0.1)).collect()
            };
            let x = (&b.inputs + Tensor::from_vec(noise, b.inputs.shape(), b.inputs.device())?)?;
            let l = loss(&r.acc, &r.model, &x, &b.targets)?;
            r.acc.backward(&l)?;
            if r.opt.step()? {
                let step = r.acc.optimizer_step_count();
                if let Some((at, dir)) = save {
                    if step == at {
                        r.acc.save_state(Some(dir))?;
                    }
                }
                if step == until {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// The raw bytes of every fp32 master weight and of every compute-dtype parameter.
fn raw(p: &PreparedModel) -> Vec<Vec<u32>> {
    let masters = p.master_weights().iter().map(|v| var_values(v).iter().map(|x| x.to_bits()).collect());
    let params = p.parameters().iter().map(|v| {
        let t = v.as_tensor().flatten_all().unwrap();
        match t.dtype() {
            candle_core::DType::BF16 => {
                t.to_vec1::<half::bf16>().unwrap().iter().map(|x| u32::from(x.to_bits())).collect()
            }
            _ => t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect(),
        }
    });
    masters.chain(params).collect()
}

fn single(cfg: &AcceleratorConfig) -> Accelerator {
    Accelerator::with_process_group(cfg.clone(), ProcessGroup::single_process().unwrap()).unwrap()
}

/// Uninterrupted run to `n` (checkpoint at `k`) vs. a fresh run resumed from that checkpoint.
fn check_resume(cfg: AcceleratorConfig, k: u64, n: u64) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir: PathBuf = tmp.path().join("ckpt");
    let mut a = build(single(&cfg), 1)?;
    train_to(&mut a, n, Some((k, &dir)))?;
    let expected = raw(&a.prepared);

    let mut b = build(single(&cfg), 2)?;
    b.acc.load_state(Some(&dir))?;
    assert_eq!(b.acc.optimizer_step_count(), k);
    assert_ne!(raw(&b.prepared), expected, "the checkpoint is not the end state");
    train_to(&mut b, n, None)?;
    assert_eq!(raw(&b.prepared), expected, "{cfg:?}: resumed at {k}, compared at {n}");
    assert_eq!(b.loader.position(), a.loader.position());
    assert_eq!(b.acc.step_counters(), a.acc.step_counters());
    Ok(())
}

#[test]
fn resume_mid_epoch_without_accumulation() -> anyhow::Result<()> {
    // 10 steps per epoch: step 13 is batch 3 of epoch 1.
    check_resume(AcceleratorConfig { seed: Some(1), ..Default::default() }, 13, 24)
}

#[test]
fn resume_mid_epoch_with_gradient_accumulation() -> anyhow::Result<()> {
    // GA = 3 over 10 batches: windows end at batches 3, 6, 9 and at the end of the loader (batch 10), so 4 steps
    // per epoch; step 5 is batch 3 of epoch 1, and the windows of the resumed run must keep that alignment.
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 3, seed: Some(2), ..Default::default() };
    check_resume(cfg.clone(), 5, 11)?;
    // Step 4 is the last batch of epoch 0: the resumed run starts a fresh epoch.
    check_resume(cfg, 4, 9)
}

#[test]
fn resume_in_bf16_restores_masters_and_compute_weights() -> anyhow::Result<()> {
    let cfg = AcceleratorConfig {
        mixed_precision: MixedPrecision::Bf16,
        gradient_accumulation_steps: 2,
        seed: Some(3),
        ..Default::default()
    };
    check_resume(cfg, 7, 15)
}

#[test]
fn resume_on_two_ranks_with_gradient_accumulation() {
    // Two ranks, batch 4 each: 5 global steps per epoch (even_batches pads the last); GA = 2 syncs at micro-steps
    // 2, 4 and 5 (end of loader), so 3 optimizer steps per epoch; step 4 is mid-epoch 1.
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 2, ..Default::default() };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (d, k, n) = (dir.clone(), 4, 8);
    let expected = run_ranks(2, cfg.clone(), move |acc| {
        acc.set_seed(9, true); // per-rank noise streams
        let mut a = build(acc, 1)?;
        train_to(&mut a, n, Some((k, &d)))?;
        Ok(raw(&a.prepared))
    });
    assert_eq!(expected[0], expected[1]);
    let d = dir.clone();
    let resumed = run_ranks(2, cfg, move |acc| {
        let mut b = build(acc, 2)?;
        b.acc.load_state(Some(&d))?;
        train_to(&mut b, n, None)?;
        Ok(raw(&b.prepared))
    });
    assert_eq!(resumed, expected);
}

/// Trains until `until` optimizer steps; with `save = (m, dir)`, saves right after the backward of micro-batch
/// `m` (counted over the run), which with GA > 1 may be inside an accumulation window.
fn train_saving_after_micro_batch(r: &mut Run, until: u64, save: Option<(u64, &Path)>) -> anyhow::Result<()> {
    while r.acc.optimizer_step_count() < until {
        for batch in r.loader.iter() {
            let b = batch?;
            let l = loss(&r.acc, &r.model, &b.inputs, &b.targets)?;
            r.acc.backward(&l)?;
            if let Some((m, dir)) = save {
                if r.acc.step_counters().total_micro_steps == m {
                    r.acc.save_state(Some(dir))?;
                }
            }
            if r.opt.step()? && r.acc.optimizer_step_count() == until {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// A checkpoint taken inside an accumulation window (after micro-batch 8 with GA = 2, on 2 ranks whose partial
/// sums differ; epoch 0 has 5 micro-batches, so this is the first half of epoch 1's second window) carries each rank's partial gradients, so the resumed run ends bit-identical to the
/// uninterrupted one (dropping them would change every parameter).
#[test]
fn resume_from_a_checkpoint_inside_an_accumulation_window() {
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 2, ..Default::default() };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (d, n) = (dir.clone(), 8);
    let expected = run_ranks(2, cfg.clone(), move |acc| {
        let mut a = build(acc, 1)?;
        train_saving_after_micro_batch(&mut a, n, Some((8, &d)))?;
        Ok(raw(&a.prepared))
    });
    assert_eq!(expected[0], expected[1]);
    for rank in 0..2 {
        assert!(dir.join(format!("gradients_{rank}.safetensors")).is_file(), "rank {rank}'s partial gradients");
    }
    let d = dir.clone();
    let resumed = run_ranks(2, cfg, move |acc| {
        let mut b = build(acc, 2)?;
        b.acc.load_state(Some(&d))?;
        assert_eq!(b.acc.step_counters().micro_step, 3, "resumed inside the window");
        assert!(!b.acc.gradients(&b.prepared).1, "the partial gradients are not synced yet");
        assert!(b.acc.gradients(&b.prepared).0.iter().all(Option::is_some));
        train_saving_after_micro_batch(&mut b, n, None)?;
        Ok(raw(&b.prepared))
    });
    assert_eq!(resumed, expected);
}
