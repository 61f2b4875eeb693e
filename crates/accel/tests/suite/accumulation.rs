//! Gradient accumulation: k micro-batches of b == one batch of k·b; gradients sync (and the optimizer steps) only
//! on the last micro-step of a window or at the end of the data loader; `no_sync` and `accumulate`.

use crate::ranks::*;
use accel::data::BatchInfo;
use accel::{AcceleratorConfig, Sgd, SgdConfig};
use std::collections::BTreeMap;

const ROWS: usize = 48;

/// Trains over ROWS rows in global batches of `global` rows, each split into `ga` micro-batches per rank over
/// `world` ranks; returns rank 0's final weights (checked equal on all ranks).
fn train(world: usize, ga: usize, global: usize) -> BTreeMap<String, Vec<f32>> {
    let cfg = AcceleratorConfig { gradient_accumulation_steps: ga, ..Default::default() };
    let out = run_ranks(world, cfg, move |acc| {
        let (model, varmap) = tiny_model(&acc, 3)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt =
            acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig { momentum: 0.9, ..SgdConfig::new(0.2) })?)?;
        let (x, y) = dataset(ROWS, 5);
        let micro = global / world / ga;
        let mut steps = 0;
        for g in 0..ROWS / global {
            for m in 0..ga {
                // Global batch g is cut into ga micro-batches of world·micro rows; rank r takes its slice of each.
                let start = g * global + m * world * micro + acc.rank() * micro;
                let l = loss(&acc, &model, &x.narrow(0, start, micro)?, &y.narrow(0, start, micro)?)?;
                acc.backward(&l)?;
                let stepped = opt.step()?;
                assert_eq!(stepped, m == ga - 1, "micro-step {m} of window {g}: step only at the end of the window");
                steps += usize::from(stepped);
            }
        }
        assert_eq!(steps, ROWS / global);
        Ok(to_f32_map(&prepared.state_dict()?))
    });
    for w in &out[1..] {
        assert_eq!(w, &out[0]);
    }
    out.into_iter().next().unwrap()
}

#[test]
fn k_micro_batches_equal_one_big_batch_single_process() {
    let reference = train(1, 1, 8);
    for ga in [2, 4, 8] {
        let d = max_rel_diff(&train(1, ga, 8), &reference);
        assert!(d <= 1e-5, "GA {ga} × {} vs 1 × 8: max relative difference {d:e}", 8 / ga);
    }
}

#[test]
fn accumulation_on_two_ranks_equals_one_big_batch() {
    let reference = train(1, 1, 8);
    let d = max_rel_diff(&train(2, 2, 8), &reference);
    assert!(d <= 1e-5, "2 ranks × GA 2 × 2 rows vs 1 × 8: max relative difference {d:e}");
}

/// Between syncs each rank keeps its own local sum (different data → different gradients on the two ranks), the
/// weights do not move and `step`/`zero_grad` are no-ops; on the sync step the gradients are identical on both
/// ranks and equal to the average of the ranks' sums.
#[test]
fn gradients_sync_only_on_sync_steps() {
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 3, ..Default::default() };
    let out = run_ranks(2, cfg, |acc| {
        let (model, varmap) = tiny_model(&acc, 3)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.1))?)?;
        let (x, y) = dataset(12, 9);
        let w0 = to_f32_map(&prepared.state_dict()?);
        let mut local = Vec::new(); // this rank's accumulated gradients after each micro-step (before any sync)
        let mut synced_flags = Vec::new();
        for m in 0..3 {
            let start = acc.rank() * 6 + m * 2;
            let l = loss(&acc, &model, &x.narrow(0, start, 2)?, &y.narrow(0, start, 2)?)?;
            acc.backward(&l)?;
            synced_flags.push((acc.sync_gradients(), acc.gradients(&prepared).1));
            let grads: Vec<Vec<f32>> = acc
                .gradients(&prepared)
                .0
                .iter()
                .map(|g| g.as_ref().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect();
            local.push(grads);
            if m < 2 {
                opt.zero_grad(); // must not drop the window's gradients
                assert!(!opt.step()?);
                assert_eq!(to_f32_map(&prepared.state_dict()?), w0, "weights moved between syncs");
            }
        }
        assert_eq!(synced_flags, vec![(false, false), (false, false), (true, true)]);
        // Reference: the gradient of the mean of all six micro-batch losses (both ranks' data), straight from candle.
        let mut total = loss(&acc, &model, &x.narrow(0, 0, 2)?, &y.narrow(0, 0, 2)?)?;
        for i in 1..6 {
            total = (total + loss(&acc, &model, &x.narrow(0, i * 2, 2)?, &y.narrow(0, i * 2, 2)?)?)?;
        }
        let reference = (total / 6.0)?.backward()?;
        for (i, (p, synced)) in prepared.parameters().iter().zip(&local[2]).enumerate() {
            let r = reference.get(p).unwrap().flatten_all()?.to_vec1::<f32>()?;
            let d = r.iter().zip(synced).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d <= 1e-6, "parameter {i}: synced gradient differs from the reference by {d:e}");
        }
        assert!(opt.step()?);
        assert_ne!(to_f32_map(&prepared.state_dict()?), w0);
        Ok(local)
    });
    let (r0, r1) = (&out[0], &out[1]);
    assert_ne!(r0[1], r1[1], "between syncs the ranks hold their own local sums");
    assert_eq!(r0[2], r1[2], "after the sync both ranks hold the same average");
}

/// The last batch of a data loader closes the window early (Accelerate's end-of-dataloader sync), and the next
/// window starts afresh.
#[test]
fn end_of_dataloader_forces_a_sync() {
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 4, ..Default::default() };
    run_ranks(2, cfg, |acc| {
        let (model, varmap) = tiny_model(&acc, 3)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.1))?)?;
        let (x, y) = dataset(32, 9);
        let mut pattern = Vec::new();
        // Epoch of 6 micro-batches: window of 4, then a short window of 2 closed by the end of the loader.
        for epoch in 0..2 {
            for m in 0..6 {
                acc.note_batch(&BatchInfo { is_last: m == 5, ..BatchInfo::default() });
                let start = (epoch * 6 + m) * 2 % 30;
                let l = loss(&acc, &model, &x.narrow(0, start, 2)?, &y.narrow(0, start, 2)?)?;
                acc.backward(&l)?;
                pattern.push(opt.step()?);
            }
        }
        let expect = [false, false, false, true, false, true];
        assert_eq!(pattern, [expect, expect].concat());
        assert_eq!(acc.optimizer_step_count(), 4);
        Ok(())
    });
}

#[test]
fn no_sync_keeps_gradients_local_and_the_next_backward_syncs_the_sum() {
    let out = run_ranks(2, AcceleratorConfig::default(), |acc| {
        let (model, varmap) = tiny_model(&acc, 3)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.1))?)?;
        let (x, y) = dataset(8, 4);
        let r = acc.rank();
        acc.no_sync(|| {
            let l = loss(&acc, &model, &x.narrow(0, r * 2, 2)?, &y.narrow(0, r * 2, 2)?)?;
            acc.backward(&l)?;
            assert!(!acc.sync_gradients());
            Ok(())
        })?;
        assert!(!acc.gradients(&prepared).1);
        assert!(!opt.step()?, "no step on unsynced gradients");
        let local = acc.gradients(&prepared).0[0].as_ref().unwrap().flatten_all()?.to_vec1::<f32>()?;
        let l = loss(&acc, &model, &x.narrow(0, 4 + r * 2, 2)?, &y.narrow(0, 4 + r * 2, 2)?)?;
        acc.backward(&l)?;
        assert!(acc.gradients(&prepared).1);
        let synced = acc.gradients(&prepared).0[0].as_ref().unwrap().flatten_all()?.to_vec1::<f32>()?;
        assert!(opt.step()?);
        Ok((local, synced))
    });
    assert_ne!(out[0].0, out[1].0, "inside no_sync the ranks keep their own gradients");
    assert_eq!(out[0].1, out[1].1, "the next backward all-reduces");
}

#[test]
fn accumulate_tells_sync_before_backward() {
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 2, ..Default::default() };
    run_ranks(1, cfg, |acc| {
        let (model, varmap) = tiny_model(&acc, 3)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.1))?)?;
        let (x, y) = dataset(8, 4);
        let mut seen = Vec::new();
        for m in 0..4 {
            let stepped = acc.accumulate(|| {
                seen.push(acc.sync_gradients());
                let l = loss(&acc, &model, &x.narrow(0, m * 2, 2)?, &y.narrow(0, m * 2, 2)?)?;
                acc.backward(&l)?;
                opt.step()
            })?;
            assert_eq!(stepped, m % 2 == 1);
        }
        assert_eq!(seen, vec![false, true, false, true]);
        assert_eq!(acc.step_counters().total_micro_steps, 4);
        Ok(())
    });
}

/// With a prepared loader the end of each epoch closes the window: 5 batches with GA 2 step after batches 2, 4
/// and 5, every epoch.
#[test]
fn prepared_loader_end_of_epoch_syncs() {
    use accel::{DataLoader, DataLoaderConfig, TensorDataset};
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 2, ..Default::default() };
    run_ranks(2, cfg, |acc| {
        let (model, varmap) = tiny_model(&acc, 3)?;
        let (x, y) = dataset(20, 2);
        let loader = DataLoader::new(TensorDataset::new(x, y)?, DataLoaderConfig::with_batch_size(2));
        let (_prepared, mut opt, loader) = acc.prepare(&varmap, Sgd::new(SgdConfig::new(0.1))?, loader)?;
        assert_eq!(loader.len(), 5);
        for _epoch in 0..2 {
            let mut pattern = Vec::new();
            for b in &loader {
                let b = b?;
                acc.backward(&loss(&acc, &model, &b.inputs, &b.targets)?)?;
                pattern.push(opt.step()?);
            }
            assert_eq!(pattern, vec![false, true, false, true, true]);
        }
        assert_eq!(acc.optimizer_step_count(), 6);
        Ok(())
    });
}
