//! User collectives (gather, gather_for_metrics, reduce, pad_across_processes, broadcast) and process control
//! (split_between_processes, main_process_first, wait_for_everyone), on threads-as-ranks.

use crate::ranks::*;
use accel::data::BatchInfo;
use accel::{AcceleratorConfig, ReduceKind};
use candle_core::{DType, Device, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn t2(v: &[f32], rows: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), (rows, v.len() / rows), &Device::Cpu).unwrap()
}

#[test]
fn reduce_sum_mean_max_min_match_the_reference_values() {
    // Two ranks holding [1, 2] and [3, 4]: sum [4, 6], mean [2, 3], max [3, 4], min [1, 2].
    let out = run_ranks(2, AcceleratorConfig::default(), |acc| {
        let t = Tensor::new(&[1f32 + 2.0 * acc.rank() as f32, 2.0 + 2.0 * acc.rank() as f32], acc.device())?;
        let get = |k| acc.reduce(&t, k).and_then(|t| Ok(t.to_vec1::<f32>()?));
        Ok([get(ReduceKind::Sum)?, get(ReduceKind::Mean)?, get(ReduceKind::Max)?, get(ReduceKind::Min)?])
    });
    for r in &out {
        assert_eq!(r, &[vec![4.0, 6.0], vec![2.0, 3.0], vec![3.0, 4.0], vec![1.0, 2.0]]);
    }
}

#[test]
fn gather_concatenates_in_rank_order_even_with_unequal_rows() {
    let out = run_ranks(3, AcceleratorConfig::default(), |acc| {
        let r = acc.rank();
        // Rank r holds r + 1 rows of [r, r].
        let t = Tensor::full(r as f32, (r + 1, 2), acc.device())?;
        let g = acc.gather(&t)?;
        let scalar = acc.gather(&Tensor::new(10f32 * r as f32, acc.device())?)?;
        Ok((g.dims().to_vec(), g.to_vec2::<f32>()?, scalar.to_vec1::<f32>()?))
    });
    for (dims, rows, scalars) in &out {
        assert_eq!(dims, &vec![6, 2]);
        let firsts: Vec<f32> = rows.iter().map(|r| r[0]).collect();
        assert_eq!(firsts, vec![0.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
        assert_eq!(scalars, &vec![0.0, 10.0, 20.0]);
    }
}

/// gather_for_metrics drops each rank's trailing even_batches duplicates as the data loader reports them.
#[test]
fn gather_for_metrics_trims_padding_rows() {
    let out = run_ranks(2, AcceleratorConfig::default(), |acc| {
        // Last global step of N = 7 with batch 4 per rank: rank 0 has rows 4..8 → [4, 5, 6, 0*] (1 duplicate),
        // rank 1 has [1*, 2*, 3*, 4*] (4 duplicates).
        let (rows, padding): (Vec<f32>, usize) =
            if acc.rank() == 0 { (vec![4.0, 5.0, 6.0, 0.0], 1) } else { (vec![1.0, 2.0, 3.0, 4.0], 4) };
        acc.note_batch(&BatchInfo { is_last: true, rows: 4, padding, ..BatchInfo::default() });
        let g = acc.gather_for_metrics(&t2(&rows, 4))?;
        acc.note_batch(&BatchInfo { rows: 4, ..BatchInfo::default() });
        let full = acc.gather_for_metrics(&t2(&rows, 4))?;
        Ok((g.flatten_all()?.to_vec1::<f32>()?, full.dims()[0]))
    });
    for (trimmed, full_rows) in &out {
        assert_eq!(trimmed, &vec![4.0, 5.0, 6.0]);
        assert_eq!(*full_rows, 8);
    }
}

#[test]
fn pad_across_processes_pads_to_the_longest() {
    let out = run_ranks(2, AcceleratorConfig::default(), |acc| {
        let len = if acc.rank() == 0 { 2 } else { 4 };
        let t = Tensor::ones((2, len), DType::U32, acc.device())?;
        let end = acc.pad_across_processes(&t, 1, 7.0, false)?;
        let first = acc.pad_across_processes(&t, 1, 0.0, true)?;
        Ok((end.to_vec2::<u32>()?[0].clone(), first.to_vec2::<u32>()?[0].clone()))
    });
    assert_eq!(out[0], (vec![1, 1, 7, 7], vec![0, 0, 1, 1]));
    assert_eq!(out[1], (vec![1, 1, 1, 1], vec![1, 1, 1, 1]));
}

#[test]
fn broadcast_from_any_root() {
    let out = run_ranks(3, AcceleratorConfig::default(), |acc| {
        let t = Tensor::new(&[acc.rank() as f32; 3], acc.device())?;
        Ok((acc.broadcast(&t, 2)?.to_vec1::<f32>()?, acc.broadcast(&t, 7).is_err()))
    });
    for (v, err) in out {
        assert_eq!(v, vec![2.0; 3]);
        assert!(err, "root out of range must be an error");
    }
}

#[test]
fn split_between_processes_and_main_process_first() {
    let order = Arc::new(AtomicUsize::new(0));
    let out = run_ranks(3, AcceleratorConfig::default(), move |acc| {
        let share = acc.split_between_processes(&(0..8).collect::<Vec<_>>());
        // The main process runs first: it sees order 0, the others 1 and 2 (in some order).
        let seen = acc.main_process_first(|| Ok(order.fetch_add(1, Ordering::SeqCst)))?;
        acc.wait_for_everyone()?;
        Ok((share, seen, acc.is_main_process()))
    });
    assert_eq!(out[0].0, vec![0, 1, 2]);
    assert_eq!(out[1].0, vec![3, 4, 5]);
    assert_eq!(out[2].0, vec![6, 7]);
    assert_eq!(out[0].1, 0);
    assert!(out[1].1 >= 1 && out[2].1 >= 1);
    assert!(out[0].2 && !out[1].2);
}

/// Accelerate's names for the process's place in the job, which a migrating program types, answer as ours do.
#[test]
fn accelerates_process_names_are_there() {
    let out = run_ranks(3, AcceleratorConfig::default(), |acc| {
        Ok((acc.process_index(), acc.local_process_index(), acc.num_processes(), acc.rank(), acc.local_rank()))
    });
    for (rank, (index, local_index, n, r, local)) in out.into_iter().enumerate() {
        assert_eq!((index, local_index, n), (r, local, 3), "rank {rank}");
        assert_eq!(index, rank);
    }
}

#[test]
fn single_process_collectives_are_identities() {
    run_ranks(1, AcceleratorConfig::default(), |acc| {
        let t = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], acc.device())?;
        assert_eq!(acc.gather(&t)?.to_vec2::<f32>()?, t.to_vec2::<f32>()?);
        assert_eq!(acc.reduce(&t, ReduceKind::Mean)?.to_vec2::<f32>()?, t.to_vec2::<f32>()?);
        assert_eq!(acc.broadcast(&t, 0)?.to_vec2::<f32>()?, t.to_vec2::<f32>()?);
        assert_eq!(acc.split_between_processes(&[1, 2, 3]), vec![1, 2, 3]);
        acc.wait_for_everyone()?;
        Ok(())
    });
}

/// Over a whole epoch of a prepared loader, gather_for_metrics returns exactly len(dataset) rows — every sample
/// once, in epoch order — for many (N, P, batch, split_batches) combinations with even_batches; plain gather
/// returns the padded count (a multiple of the global batch when P > 1).
#[test]
fn gather_for_metrics_returns_exactly_the_dataset_over_an_epoch() {
    use accel::{DataLoader, DataLoaderConfig, TensorDataset};
    let mut cases = Vec::new();
    for world in [1usize, 2, 3, 4] {
        for n in [1usize, 5, 7, 8, 13, 16] {
            for batch in [1usize, 2, 4] {
                for split in [false, true] {
                    if split && batch % world != 0 {
                        continue;
                    }
                    cases.push((world, n, batch, split));
                }
            }
        }
    }
    for (world, n, batch, split) in cases {
        let cfg = AcceleratorConfig { split_batches: split, ..Default::default() };
        let out = run_ranks(world, cfg, move |acc| {
            let idx: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let inputs = Tensor::from_vec(idx, (n, 1), &Device::Cpu)?;
            let targets = Tensor::arange(0u32, n as u32, &Device::Cpu)?;
            let ds = TensorDataset::new(inputs, targets)?;
            let loader_cfg = DataLoaderConfig { batch_size: batch, shuffle: true, seed: 3, ..Default::default() };
            let loader = acc.prepare_data_loader(DataLoader::new(ds, loader_cfg))?;
            let (mut metrics, mut plain) = (Vec::new(), 0usize);
            for b in &loader {
                let b = b?;
                metrics.extend(acc.gather_for_metrics(&b.targets)?.to_vec1::<u32>()?);
                plain += acc.gather(&b.targets)?.dims()[0];
            }
            Ok((metrics, plain, loader.epoch_order(0)))
        });
        let ctx = format!("N {n}, P {world}, batch {batch}, split_batches {split}");
        for (metrics, plain, order) in &out {
            assert_eq!(metrics.len(), n, "{ctx}: gather_for_metrics rows");
            let expect: Vec<u32> = order.iter().map(|&i| i as u32).collect();
            assert_eq!(metrics, &expect, "{ctx}: every sample once, in epoch order");
            let global = if split { batch } else { batch * world };
            // One process needs no padding (its last batch is just short); several pad to whole global batches.
            let padded = if world == 1 { n } else { n.div_ceil(global) * global };
            assert_eq!(*plain, padded, "{ctx}: plain gather keeps the padding");
        }
    }
}
