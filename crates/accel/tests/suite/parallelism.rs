//! The Accelerator's device mesh: built from `AcceleratorConfig::parallelism`, data loaders sharded by the
//! data-parallel rank only (tp peers see the same batches, accelerate#3092), `gather` / `reduce` over the dp group,
//! and the layouts it refuses, with their messages.

use crate::ranks::run_ranks;
use accel::data::{DataLoader, DataLoaderConfig, TensorDataset};
use accel::{Accelerator, AcceleratorConfig, ParallelismConfig, ReduceKind};
use candle_core::{Device, Tensor};
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

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

/// What one rank saw: its mesh coordinates, the sample ids of each batch, the gathered ids, a dp-reduced sum.
#[derive(Debug)]
struct Seen {
    coord: (usize, usize, usize, usize),
    dp: (usize, usize),
    tp: (usize, usize),
    batches: Vec<Vec<u32>>,
    gathered: Vec<u32>,
    reduced: f32,
}

fn epoch_under(cfg: AcceleratorConfig, world: usize, n: usize, shuffle: bool) -> Vec<Seen> {
    run_ranks(world, cfg, move |acc: Accelerator| {
        let dl_cfg = DataLoaderConfig { batch_size: 2, shuffle, seed: 5, ..DataLoaderConfig::default() };
        let loader = acc.prepare_data_loader(DataLoader::new(index_dataset(n), dl_cfg))?;
        let mut batches = Vec::new();
        let mut gathered = Vec::new();
        for b in &loader {
            let b = b?;
            batches.push(b.targets.to_vec1::<u32>()?);
            gathered.extend(acc.gather_for_metrics(&b.targets)?.to_vec1::<u32>()?);
        }
        let mine = Tensor::new(&[batches.iter().flatten().map(|&i| i as f32).sum::<f32>()], acc.device())?;
        let reduced = acc.reduce(&mine, ReduceKind::Sum)?.to_vec1::<f32>()?[0];
        let c = acc.mesh().coord();
        Ok(Seen {
            coord: (c.pp, c.dp_replicate, c.dp_shard, c.tp),
            dp: (acc.data_parallel_rank(), acc.data_parallel_size()),
            tp: (acc.tensor_parallel().rank(), acc.tensor_parallel().size()),
            batches,
            gathered,
            reduced,
        })
    })
}

#[test]
fn tp_peers_get_identical_batches_and_dp_ranks_disjoint_ones() {
    let n = 16;
    let cfg = AcceleratorConfig::default()
        .with_parallelism(ParallelismConfig::default().with_tp_size(2).with_dp_replicate_size(2));
    for shuffle in [false, true] {
        let seen = epoch_under(cfg.clone(), 4, n, shuffle);
        // Layout [pp 1, dp_replicate 2, dp_shard 1, tp 2]: tp innermost, so ranks {0,1} and {2,3} are tp peers.
        let coords: Vec<_> = seen.iter().map(|s| s.coord).collect();
        assert_eq!(coords, [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)]);
        let dp: Vec<_> = seen.iter().map(|s| s.dp).collect();
        assert_eq!(dp, [(0, 2), (0, 2), (1, 2), (1, 2)]);
        let tp: Vec<_> = seen.iter().map(|s| s.tp).collect();
        assert_eq!(tp, [(0, 2), (1, 2), (0, 2), (1, 2)]);
        // tp peers: the same batches, batch for batch.
        assert_eq!(seen[0].batches, seen[1].batches, "shuffle {shuffle}");
        assert_eq!(seen[2].batches, seen[3].batches, "shuffle {shuffle}");
        // dp ranks: disjoint halves of the data set, each sample once (n / (2 · batch 2) = 4 batches each).
        assert_eq!(seen[0].batches.len(), 4);
        let a: BTreeSet<u32> = seen[0].batches.iter().flatten().copied().collect();
        let b: BTreeSet<u32> = seen[2].batches.iter().flatten().copied().collect();
        assert!(a.is_disjoint(&b), "{a:?} {b:?}");
        assert_eq!(a.len() + b.len(), n);
        assert_eq!(a.union(&b).copied().collect::<Vec<_>>(), (0..n as u32).collect::<Vec<_>>());
        // gather_for_metrics over the dp group: every sample exactly once per epoch (not once per tp peer).
        for s in &seen {
            let mut g = s.gathered.clone();
            g.sort_unstable();
            assert_eq!(g, (0..n as u32).collect::<Vec<_>>(), "rank {:?}", s.coord);
            // reduce over the dp group: Σ 0..16 = 120 exactly (f32 holds these integers exactly).
            assert_eq!(s.reduced, 120.0);
        }
    }
}

#[test]
fn pure_data_parallelism_is_unchanged_and_tp_alone_shares_every_batch() {
    // 16 samples: 4 ranks × batch 2 divides them, so no padding rows (which would count twice in the sums).
    let n = 16;
    // Every size 1 → data parallel over the world: 4 disjoint shards, each a dp rank of 4.
    let seen = epoch_under(AcceleratorConfig::default(), 4, n, false);
    let dp: Vec<_> = seen.iter().map(|s| s.dp).collect();
    assert_eq!(dp, [(0, 4), (1, 4), (2, 4), (3, 4)]);
    assert!(seen.iter().all(|s| s.tp == (0, 1)));
    let all: BTreeSet<u32> = seen.iter().flat_map(|s| s.batches.iter().flatten().copied()).collect();
    assert_eq!(all.len(), n);
    assert!(seen.iter().all(|s| s.reduced == 120.0));
    // tp 4 on 4 ranks: one dp rank, so every rank iterates the whole data set, identically.
    let cfg = AcceleratorConfig::default().with_parallelism(ParallelismConfig::default().with_tp_size(4));
    let seen = epoch_under(cfg, 4, n, true);
    assert!(seen.iter().all(|s| s.dp == (0, 1) && s.batches == seen[0].batches));
    assert_eq!(seen.iter().map(|s| s.tp.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(seen[0].batches.iter().flatten().count(), n);
    assert!(seen.iter().all(|s| s.reduced == 120.0 && s.gathered.len() == n));
}

#[test]
fn the_accelerator_hands_out_the_mesh_tp_and_a_param_builder() {
    let cfg = AcceleratorConfig::default()
        .with_seed(3)
        .with_parallelism(ParallelismConfig::default().with_tp_size(2).with_dp_replicate_size(2));
    let out = run_ranks(4, cfg, |acc| {
        let mesh = acc.mesh();
        assert_eq!(acc.process_group().world_size(), 4, "process_group() stays the world");
        assert_eq!(acc.parallelism_config(), &ParallelismConfig::data_parallel(2).with_tp_size(2));
        // The tp group of the TensorParallel is the mesh's: an all_reduce over it sums the two peers' ranks.
        let mut v = [acc.rank() as f32];
        acc.tensor_parallel().group().all_reduce(&mut v, ddp_core::ReduceOp::Sum)?;
        let pb = acc.param_builder(&candle_nn::VarMap::new());
        assert_eq!((pb.tp().size(), pb.dtype()), (2, candle_core::DType::F32));
        Ok((mesh.tp().members().to_vec(), mesh.dp().members().to_vec(), v[0]))
    });
    assert_eq!(out[0], (vec![0, 1], vec![0, 2], 1.0));
    assert_eq!(out[1], (vec![0, 1], vec![1, 3], 1.0));
    assert_eq!(out[2], (vec![2, 3], vec![0, 2], 5.0));
    assert_eq!(out[3], (vec![2, 3], vec![1, 3], 5.0));
    // A single process: the every-size-1 mesh.
    let out = run_ranks(1, AcceleratorConfig::default(), |acc| Ok(acc.mesh().shape()));
    assert_eq!(out[0], ddp_core::MeshShape::data_parallel(1));
}

/// The run banner names the sharding strategy after dp_shard (from `ParallelismConfig::sharding_string`, as
/// `accel launch`'s does, so a launched worker finds the settings its launcher printed), and none without dp_shard.
#[test]
fn the_run_banner_names_the_sharding_strategy_after_dp_shard() {
    use accel::ShardingStrategy::{FullShard, ShardOptim};
    let settings = |world: usize, p: ParallelismConfig| {
        let cfg = AcceleratorConfig::default().with_parallelism(p);
        run_ranks(world, cfg, |acc| Ok(acc.run_banner().settings()))
    };
    let full = settings(2, ParallelismConfig::default().with_dp_shard_size(2).with_sharding_strategy(FullShard));
    let want = "2 processes × 1 machine | dp_replicate 1 × dp_shard 2 (FULL_SHARD) × tp 1 × pp 1 | mixed precision no \
                | gradient accumulation 1 | backend cpu";
    assert_eq!(full, [want; 2]);
    let hsdp = ParallelismConfig::data_parallel(2).with_dp_shard_size(2).with_sharding_strategy(ShardOptim);
    assert!(settings(4, hsdp)[3].contains("| dp_replicate 2 × dp_shard 2 (SHARD_OPTIM) × tp 1 × pp 1 |"));
    // dp_shard 1: the strategy is not read, and not printed.
    let dp = settings(2, ParallelismConfig::data_parallel(2).with_sharding_strategy(FullShard));
    assert!(dp[0].contains("| dp_replicate 2 × dp_shard 1 × tp 1 × pp 1 |"), "{}", dp[0]);
}

/// Each of `world` ranks builds an Accelerator with `cfg`; returns each rank's error message.
fn errors_on(world: usize, cfg: AcceleratorConfig) -> Vec<String> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, cfg) = (store.clone(), cfg.clone());
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(60), ..Default::default() };
                let pg = ProcessGroup::from_store(store, rank, world, opts).unwrap();
                Accelerator::with_process_group(cfg, pg).map(|_| ()).unwrap_err().to_string()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn layouts_the_accelerator_cannot_run_are_refused_on_every_rank() {
    let with = |p: ParallelismConfig| AcceleratorConfig::default().with_parallelism(p);
    let e = errors_on(4, with(ParallelismConfig::default().with_tp_size(2)));
    assert_eq!(
        e[0],
        "invalid configuration parallelism_config = \"dp_replicate 1 × dp_shard 1 × tp 2 × pp 1 × cp 1\": the sizes \
         multiply to 2 but the job has 4 processes; with tp 2 and 4 processes set dp_replicate_size 2"
    );
    assert!(e.iter().all(|m| *m == e[0]));
    // A pipeline schedule that cannot run: fewer micro-batches than stages (every rank, before any step).
    let e = errors_on(4, with(ParallelismConfig::default().with_pp_size(2).with_tp_size(2).with_pp_microbatches(1)));
    assert!(e[3].contains("pipeline_parallel_microbatches") && e[3].contains("at least 2"), "{}", e[3]);
    assert!(e.iter().all(|m| *m == e[0]));
    let e = errors_on(2, with(ParallelismConfig::default().with_cp_size(2)));
    assert_eq!(
        e[0],
        "invalid configuration parallelism_config_cp_size = \"2\": context parallelism is not implemented yet; set \
         cp_size to 1"
    );
    // A size of 0 is `auto`: without the program's model description, every rank refuses it, naming the fix.
    let e = errors_on(2, with(ParallelismConfig::default().with_tp_size(ParallelismConfig::AUTO)));
    assert!(e[0].contains("some sizes are `auto`") && e[0].contains("AcceleratorConfig::auto_layout"), "{}", e[0]);
    assert!(e.iter().all(|m| *m == e[0]));
}
