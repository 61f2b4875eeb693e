//! DataLoader behaviour: sharding counts for many (N, P, batch) layouts, seeded order, skip/resume, prefetch,
//! end-of-loader signalling; and the file readers (CSV, text, IDX) end to end, error messages included.
//!
//! Every rank's loader is built in this one process (sharding needs no communication), so each layout can be
//! checked against the single-process reference: the epoch order cut into global batches.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use accel::data::{
    epoch_order, read_csv, BatchInfo, CsvOptions, DataLoader, DataLoaderConfig, Dataset, LabelColumn, TensorDataset,
    TextDataset,
};
use accel::state::Stateful;
use accel::{AccelError, Result};
use candle_core::{Device, Tensor};
use proptest::prelude::*;

/// `n` samples whose input and target are their own index, so a batch tells which samples it holds.
fn index_dataset(n: usize) -> TensorDataset {
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let y: Vec<u32> = (0..n as u32).collect();
    TensorDataset::new(
        Tensor::from_vec(x, (n, 1), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, n, &Device::Cpu).unwrap(),
    )
    .unwrap()
}

#[derive(Debug, Clone, Copy)]
struct Layout {
    n: usize,
    p: usize,
    b: usize,
    split: bool,
    even: bool,
    drop_last: bool,
    shuffle: bool,
    prefetch: bool,
}

fn loader(l: Layout, rank: usize) -> Result<DataLoader<TensorDataset>> {
    let cfg = DataLoaderConfig {
        batch_size: l.b,
        shuffle: l.shuffle,
        seed: 17,
        drop_last: l.drop_last,
        split_batches: l.split,
        even_batches: l.even,
        prefetch: l.prefetch,
    };
    DataLoader::new(index_dataset(l.n), cfg).with_sharding(rank, l.p)
}

/// Every rank's batches (sample ids) and the BatchInfo reported for each.
fn run_epoch(dl: &DataLoader<TensorDataset>) -> (Vec<Vec<u32>>, Vec<BatchInfo>) {
    let infos = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&infos);
    let dl2 = DataLoader::from_arc(Arc::clone(dl.dataset()), dl.config().clone())
        .with_sharding(dl.rank(), dl.world_size())
        .unwrap()
        .with_batch_observer(Arc::new(move |i: &BatchInfo| sink.lock().unwrap().push(*i)));
    let batches: Vec<Vec<u32>> = dl2.iter().map(|b| b.unwrap().targets.to_vec1::<u32>().unwrap()).collect();
    let infos = infos.lock().unwrap().clone();
    (batches, infos)
}

fn check_layout(l: Layout) {
    let g = if l.split { l.b } else { l.b * l.p };
    let s = g / l.p;
    let order = epoch_order(l.n, l.shuffle, 17, 0);
    let per_rank: Vec<(Vec<Vec<u32>>, Vec<BatchInfo>)> = (0..l.p).map(|r| run_epoch(&loader(l, r).unwrap())).collect();
    for (r, (batches, infos)) in per_rank.iter().enumerate() {
        assert_eq!(batches.len(), loader(l, r).unwrap().len(), "{l:?} rank {r}: len() vs yielded");
        assert_eq!(infos.len(), batches.len());
        for (k, info) in infos.iter().enumerate() {
            assert_eq!(info.step, k);
            assert_eq!(info.is_last, k + 1 == batches.len(), "{l:?} rank {r}: is_last at {k}");
            assert_eq!(info.rows, batches[k].len());
        }
    }
    let counts: Vec<usize> = per_rank.iter().map(|(b, _)| b.len()).collect();
    if l.drop_last {
        let steps = l.n / g;
        assert!(counts.iter().all(|&c| c == steps), "{l:?}: drop_last counts {counts:?}");
        assert!(per_rank.iter().all(|(bs, _)| bs.iter().all(|b| b.len() == s)));
    } else if l.even && l.p > 1 {
        let steps = l.n.div_ceil(g);
        assert!(counts.iter().all(|&c| c == steps), "{l:?}: even_batches counts {counts:?}");
        assert!(per_rank.iter().all(|(bs, _)| bs.iter().all(|b| b.len() == s)), "{l:?}: short batch");
    } else {
        let max = *counts.iter().max().unwrap_or(&0);
        assert!(counts.iter().all(|&c| c + 1 >= max), "{l:?}: uneven counts {counts:?}");
    }
    // Concatenating the ranks' step-k batches in rank order and trimming the global padding gives back the
    // single-process epoch in order: the P × b = 1 × P·b property, and gather_for_metrics' row count.
    let steps = counts.iter().copied().max().unwrap_or(0);
    let mut seen: Vec<u32> = Vec::new();
    for k in 0..steps {
        let mut global: Vec<u32> = Vec::new();
        let mut global_padding = None;
        for (r, (batches, infos)) in per_rank.iter().enumerate() {
            if let Some(b) = batches.get(k) {
                global.extend(b);
                let gp = infos[k].global_padding;
                assert!(global_padding.is_none_or(|x| x == gp), "{l:?} rank {r}: global padding disagrees");
                global_padding = Some(gp);
            }
        }
        let padding = global_padding.unwrap_or(0);
        assert!(padding <= global.len());
        global.truncate(global.len() - padding);
        seen.extend(global);
    }
    let expected: Vec<u32> = order.iter().map(|&i| i as u32).collect();
    let kept = if l.drop_last { (l.n / g) * g } else { l.n };
    assert_eq!(seen, expected[..kept].to_vec(), "{l:?}: epoch reassembled from the shards");
    // Padding rows per rank add up to the global padding of the last step.
    let pad_total: usize = per_rank.iter().filter_map(|(_, i)| i.last()).map(|i| i.padding).sum();
    let last_global = per_rank.iter().filter_map(|(_, i)| i.last()).map(|i| i.global_padding).max().unwrap_or(0);
    assert_eq!(pad_total, last_global, "{l:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn sharding_counts_and_reassembly(
        n in 0usize..50, p in 1usize..5, b in 1usize..7,
        split in any::<bool>(), even in any::<bool>(), drop_last in any::<bool>(),
        shuffle in any::<bool>(), prefetch in any::<bool>(),
    ) {
        let b = if split { b * p } else { b };   // split_batches needs a divisible global batch
        check_layout(Layout { n, p, b, split, even, drop_last, shuffle, prefetch });
    }
}

#[test]
fn accelerate_reference_layout_ten_samples_two_ranks_batch_four() {
    let l = Layout { n: 10, p: 2, b: 4, split: false, even: true, drop_last: false, shuffle: false, prefetch: true };
    let (r0, i0) = run_epoch(&loader(l, 0).unwrap());
    let (r1, i1) = run_epoch(&loader(l, 1).unwrap());
    assert_eq!(r0, vec![vec![0, 1, 2, 3], vec![8, 9, 0, 1]]);
    assert_eq!(r1, vec![vec![4, 5, 6, 7], vec![2, 3, 4, 5]]);
    assert_eq!((i0[1].padding, i1[1].padding, i0[1].global_padding), (2, 4, 6));
    assert!(!i0[0].is_last && i0[1].is_last);
}

#[test]
fn split_batches_not_divisible_is_an_error_naming_the_fix() {
    let cfg = DataLoaderConfig { batch_size: 5, split_batches: true, ..DataLoaderConfig::default() };
    let err = DataLoader::new(index_dataset(20), cfg).with_sharding(0, 2).unwrap_err().to_string();
    assert!(err.contains("batch_size 5 is not divisible by the 2 processes"), "{err}");
    let err = DataLoader::new(index_dataset(20), DataLoaderConfig::with_batch_size(0)).iter().next().unwrap();
    assert!(err.unwrap_err().to_string().contains("batch_size must be at least 1"));
}

fn ids(dl: &DataLoader<TensorDataset>) -> Vec<Vec<u32>> {
    dl.iter().map(|b| b.unwrap().targets.to_vec1::<u32>().unwrap()).collect()
}

fn shuffled(seed: u64, prefetch: bool) -> DataLoader<TensorDataset> {
    let cfg = DataLoaderConfig { batch_size: 4, shuffle: true, seed, prefetch, ..DataLoaderConfig::default() };
    DataLoader::new(index_dataset(23), cfg)
}

#[test]
fn same_seed_same_order_and_a_new_order_each_epoch() {
    let a = shuffled(3, true);
    let b = shuffled(3, false);
    let e0 = ids(&a);
    assert_eq!(e0, ids(&b), "prefetch must not change the order");
    assert_ne!(e0, ids(&shuffled(4, true)), "another seed, another order");
    // Finishing an epoch advances to the next, which is shuffled differently; set_epoch goes back.
    assert_eq!(a.epoch(), 1);
    let e1 = ids(&a);
    assert_ne!(e0, e1);
    let mut a = a;
    a.set_epoch(0);
    assert_eq!(ids(&a), e0);
    let mut sorted: Vec<u32> = e1.concat();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..23).collect::<Vec<u32>>());
}

#[test]
fn skip_first_batches_yields_the_rest_of_the_epoch_once() {
    let mut dl = shuffled(9, true);
    let full = ids(&dl);
    dl.set_epoch(0);
    dl.skip_first_batches(4);
    assert_eq!(ids(&dl), full[4..].to_vec());
    // The skip applied to one iteration only: epoch 0 again from the start.
    dl.set_epoch(0);
    assert_eq!(ids(&dl), full);
    dl.set_epoch(0);
    dl.skip_first_batches(100);
    assert!(ids(&dl).is_empty());
}

#[test]
fn position_state_resumes_mid_epoch_in_a_fresh_loader() {
    let dl = shuffled(5, true);
    let e0 = ids(&dl);
    let e1_full = ids(&dl);
    // Consume 2 batches of epoch 1 again, then break off (as a run that checkpoints mid-epoch).
    let mut dl = dl;
    dl.set_epoch(1);
    let mut it = dl.iter();
    let head: Vec<Vec<u32>> = (0..2).map(|_| it.next().unwrap().unwrap().targets.to_vec1().unwrap()).collect();
    drop(it);
    assert_eq!(head, e1_full[..2].to_vec());
    let sd = dl.state_handle().state_dict().unwrap();
    assert_eq!(sd.meta["epoch"], 1);
    assert_eq!(sd.meta["batches_consumed"], 2);

    let mut fresh = shuffled(5, false);
    fresh.state_handle().load_state_dict(&sd).unwrap();
    assert_eq!(fresh.epoch(), 1);
    fresh.set_epoch(1); // a resumed loop's set_epoch of the same epoch keeps the skip
    assert_eq!(ids(&fresh), e1_full[2..].to_vec());
    assert_eq!(fresh.epoch(), 2);
    assert_ne!(e0, e1_full);

    // The position is 8 samples of epoch 1's order: a loader of batches of 2 (another per-process batch or
    // data-parallel size) continues after the same samples, 4 of its batches in.
    let halves = DataLoaderConfig { batch_size: 2, shuffle: true, seed: 5, ..DataLoaderConfig::default() };
    let mut halves = DataLoader::new(index_dataset(23), halves);
    halves.state_handle().load_state_dict(&sd).unwrap();
    halves.set_epoch(1);
    let rest: Vec<u32> = ids(&halves).concat();
    assert_eq!(rest[..12], e1_full[2..5].concat()[..], "the same samples follow, in the same order");
    // A batch of 5 does not divide the 8 samples consumed (nor does another data set or order continue): refused
    // instead of yielding other samples.
    let other = DataLoaderConfig { batch_size: 5, shuffle: true, seed: 5, ..DataLoaderConfig::default() };
    let err = DataLoader::new(index_dataset(23), other).state_handle().load_state_dict(&sd).unwrap_err().to_string();
    assert!(
        err.contains(
            "cannot continue here: it is 8 samples into epoch 1 (2 batches of 4 samples), which is not a \
                      whole number of this run's batches of 5 samples"
        ),
        "{err}"
    );
    let other = DataLoader::new(index_dataset(23), DataLoaderConfig::with_batch_size(4));
    let err = other.state_handle().load_state_dict(&sd).unwrap_err().to_string();
    assert!(err.contains("the data order differs"), "{err}");
}

/// A data set that fails on one index, to check that errors come through the prefetch thread.
struct Faulty(TensorDataset, usize);
impl Dataset for Faulty {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get_batch(&self, indices: &[usize]) -> Result<accel::data::Batch> {
        if indices.contains(&self.1) {
            return Err(AccelError::Data(format!("sample {} is corrupt", self.1)));
        }
        self.0.get_batch(indices)
    }
}

#[test]
fn dataset_errors_surface_once_then_the_iteration_ends() {
    for prefetch in [true, false] {
        let cfg = DataLoaderConfig { batch_size: 3, prefetch, ..DataLoaderConfig::default() };
        let dl = DataLoader::new(Faulty(index_dataset(12), 7), cfg);
        let items: Vec<Result<accel::data::Batch>> = dl.iter().collect();
        assert_eq!(items.len(), 3, "prefetch={prefetch}");
        assert!(items[0].is_ok() && items[1].is_ok());
        assert!(items[2].as_ref().unwrap_err().to_string().contains("sample 7 is corrupt"));
    }
}

#[test]
fn abandoning_an_iteration_stops_the_prefetch_thread() {
    let dl = shuffled(1, true);
    for _ in 0..50 {
        let mut it = dl.iter();
        it.next().unwrap().unwrap();
    } // each drop joins its worker: no hang, no thread pile-up
    let mut dl = dl;
    dl.set_epoch(0);
    assert_eq!(ids(&dl).len(), 6);
}

#[test]
fn for_loop_over_a_reference_and_batches_on_the_device() {
    let dl = DataLoader::new(index_dataset(5), DataLoaderConfig::with_batch_size(2)).with_device(Device::Cpu);
    let mut rows = 0;
    for batch in &dl {
        let batch = batch.unwrap();
        assert!(batch.inputs.device().same_device(&Device::Cpu));
        rows += batch.len();
    }
    assert_eq!(rows, 5);
}

// ---- readers, from files on disk ----

#[test]
fn csv_from_a_gzip_file_with_a_header_and_label_by_index() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toy.csv.gz");
    let mut gz = flate2::write::GzEncoder::new(std::fs::File::create(&path).unwrap(), flate2::Compression::fast());
    gz.write_all(b"label,x1,x2\r\n1,0.5,2\r\n\r\n0,-1,3e2\r\n").unwrap();
    gz.finish().unwrap();
    let opts = CsvOptions { label: LabelColumn::Index(0), ..CsvOptions::default() };
    let ds = read_csv(&path, &opts).unwrap();
    assert_eq!(ds.inputs().to_vec2::<f32>().unwrap(), vec![vec![0.5, 2.0], vec![-1.0, 300.0]]);
    assert_eq!(ds.targets().to_vec1::<u32>().unwrap(), vec![1, 0]);

    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "1,2,3\n4,5,6\n7,x8,9\n").unwrap();
    let err = read_csv(&bad, &CsvOptions::default()).unwrap_err().to_string();
    assert!(err.contains("bad.csv:3:2") && err.contains("\"x8\""), "{err}");
    let err = read_csv(&dir.path().join("missing.csv"), &CsvOptions::default()).unwrap_err().to_string();
    assert!(err.contains("missing.csv"), "{err}");
}

#[test]
fn text_file_windows_feed_a_loader() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.txt");
    std::fs::write(&path, "to be or not to be").unwrap();
    let ds = TextDataset::from_file(&path, 4).unwrap();
    assert_eq!(ds.len(), 4); // 18 chars: windows at 0, 4, 8, 12
    let vocab = ds.vocab().clone();
    let dl = DataLoader::new(ds, DataLoaderConfig::with_batch_size(2));
    let first = dl.iter().next().unwrap().unwrap();
    let x = first.inputs.to_vec2::<u32>().unwrap();
    let y = first.targets.to_vec2::<u32>().unwrap();
    assert_eq!((vocab.decode(&x[1]), vocab.decode(&y[1])), ("e or".to_string(), " or ".to_string()));
    let err = TextDataset::from_file(&dir.path().join("nope.txt"), 4).unwrap_err().to_string();
    assert!(err.contains("nope.txt"), "{err}");
}

#[test]
fn mnist_loader_batches_match_the_idx_files() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/mnist");
    let ds = accel::data::load_mnist(&dir, "t10k").unwrap();
    let labels = accel::data::idx::read_idx(&dir.join("t10k-labels-idx1-ubyte.gz")).unwrap();
    let dl = DataLoader::new(ds, DataLoaderConfig::with_batch_size(1000)).with_sharding(1, 2).unwrap();
    assert_eq!(dl.len(), 5);
    let mut got: BTreeMap<usize, u32> = BTreeMap::new();
    for (k, b) in dl.iter().enumerate() {
        let b = b.unwrap();
        assert_eq!(b.inputs.dims(), &[1000, 784]);
        for (j, l) in b.targets.to_vec1::<u32>().unwrap().into_iter().enumerate() {
            got.insert(k * 2000 + 1000 + j, l);
        }
    }
    assert!(got.iter().all(|(&i, &l)| u32::from(labels.data[i]) == l));
    assert_eq!(got.len(), 5000);
}
