//! The automatic layout through the Accelerator: a config with `auto` sizes and the program's model description
//! is probed, chosen and laid out at start-up — the same on every rank, the fixed sizes kept, the chooser's
//! settings run (mesh, sharding, accumulation) — and an impossible request fails every rank with what would fit.

use crate::ranks::run_ranks;
use accel::auto_layout::{Assumptions, AutoLayoutRequest, Checkpointing, ModelSpec, Precision, TrainSpec};
use accel::{Accelerator, AcceleratorConfig, ParallelismConfig};
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::sync::Arc;
use std::time::Duration;

/// A small GPT (2 blocks, h 32, 2 heads) with a global batch of 8 in micro-batches of 1, 2, 4 or 8, planned for
/// `memory` bytes per process with no runtime overhead (the test's threads share one process, whose resident
/// memory is not a rank's).
fn request(memory: u64) -> AutoLayoutRequest {
    let model = ModelSpec::gpt(2, 32, 2, 64, 16, 8);
    let train = TrainSpec::new(8, &[1, 2, 4, 8], Precision::Fp32).with_checkpointing(Checkpointing::Auto);
    AutoLayoutRequest::new(model, train)
        .with_assumptions(Assumptions { runtime_overhead_bytes: 0, ..Assumptions::default() })
        .with_memory_per_process(memory)
}

fn auto_config(parallelism: ParallelismConfig, memory: u64) -> AcceleratorConfig {
    AcceleratorConfig { parallelism, ..AcceleratorConfig::default() }.with_auto_layout(request(memory))
}

/// What a rank ran: the layout it chose, its resolved sizes and accumulation, its mesh's shape.
#[derive(Debug, PartialEq)]
struct Ran {
    chosen: String,
    sizes: [usize; 4],
    accumulation: usize,
    mesh: [usize; 4],
    printed: String,
}

fn run_auto(world: usize, cfg: AcceleratorConfig) -> Vec<Ran> {
    run_ranks(world, cfg, |acc: Accelerator| {
        let decision = acc.auto_layout().expect("an auto size makes the Accelerator choose");
        let p = acc.parallelism_config();
        let shape = acc.mesh().shape();
        Ok(Ran {
            chosen: decision.layout().to_string(),
            sizes: [p.dp_replicate_size, p.dp_shard_size, p.tp_size, p.pp_size],
            accumulation: acc.gradient_accumulation_steps(),
            mesh: [shape.dp_replicate, shape.dp_shard, shape.tp, shape.pp],
            printed: decision.choice.to_string(),
        })
    })
}

#[test]
fn every_rank_chooses_the_same_layout_and_runs_it() {
    let ran = run_auto(4, auto_config(ParallelismConfig::auto(), 1 << 30));
    assert!(ran.iter().all(|r| *r == ran[0]), "{ran:#?}");
    let r = &ran[0];
    assert_eq!(r.sizes.iter().product::<usize>(), 4, "{r:?}");
    assert_eq!(r.mesh, r.sizes, "the mesh is laid out from the chosen sizes");
    assert!(r.printed.contains("auto layout for 4 processes (1 machine × 4 processes)"), "{}", r.printed);
    assert!(r.printed.starts_with("auto layout") && r.printed.contains("chosen: "), "{}", r.printed);
}

#[test]
fn the_accelerator_runs_what_the_chooser_picks_for_the_measured_cluster() {
    let cfg = auto_config(ParallelismConfig::auto(), 1 << 30);
    let checked = run_ranks(2, cfg, |acc: Accelerator| {
        let d = acc.auto_layout().unwrap();
        // The pure chooser on the probe's cluster and the completed request gives the same layout.
        let r = acc.completed_auto_layout_request(&request(1 << 30));
        let again = accel::auto_layout::choose(&r.model, &d.probe.spec, &r.train, &r.assumptions).unwrap();
        assert_eq!(again.best.layout, *d.layout());
        let l = d.layout();
        assert_eq!(*acc.parallelism_config(), l.parallelism_config().resolve(2).unwrap());
        assert_eq!(acc.gradient_accumulation_steps(), l.accumulation_steps);
        assert_eq!(acc.config().activation_checkpointing, l.activation_checkpointing);
        assert_eq!(l.per_process_batch() * l.accumulation_steps * l.dp(), 8, "the global batch is kept");
        Ok(d.probe.spec.machines.len())
    });
    assert_eq!(checked, vec![1, 1]);
}

#[test]
fn fixed_sizes_are_kept_and_the_rest_chosen() {
    // `tp_size: auto` with dp_replicate 2 fixed (and dp_shard, pp 1): the chooser picks tp from {1, 2}.
    let p = ParallelismConfig { tp_size: ParallelismConfig::AUTO, ..ParallelismConfig::data_parallel(2) };
    let ran = run_auto(4, auto_config(p, 1 << 30));
    assert!(ran.iter().all(|r| *r == ran[0]), "{ran:#?}");
    assert_eq!(ran[0].sizes, [2, 1, 2, 1], "{}", ran[0].printed);
}

#[test]
fn too_little_memory_shards_the_model() {
    // 2 ranks with just enough for FULL_SHARD's chunks (the chooser's own figure for the smallest layout), and
    // less than any replicated layout needs.
    let model = request(1).model;
    // Data parallelism only (tp and pp fixed to 1): the smallest layout shards everything.
    let dp_only = ParallelismConfig { dp_replicate_size: ParallelismConfig::AUTO, ..ParallelismConfig::auto() };
    let dp_only = ParallelismConfig { tp_size: 1, pp_size: 1, ..dp_only };
    let least = {
        let cluster = accel::auto_layout::ClusterSpec::uniform(
            1,
            2,
            1 << 40,
            1e9,
            accel::auto_layout::Link::new(1e-6, 1e9),
            accel::auto_layout::Link::new(1e-6, 1e9),
        );
        let train = request(1).train.with_fixed_sizes(dp_only.fixed_sizes());
        let a = Assumptions { runtime_overhead_bytes: 0, ..Assumptions::default() };
        let (layouts, _) = accel::auto_layout::enumerate(&model, 2, &train);
        layouts
            .iter()
            .map(|l| accel::auto_layout::evaluate(&model, &cluster, &train, &a, l).unwrap())
            .map(|c| (a.needed(c.peak_memory()), c.layout.zero_stage()))
            .min()
            .unwrap()
    };
    assert_eq!(least.1, 3, "the smallest layout is FULL_SHARD's");
    let ran = run_auto(2, auto_config(dp_only, least.0));
    assert_eq!(ran[0].sizes[1], 2, "{}", ran[0].printed);
    assert!(ran[0].chosen.contains("FULL_SHARD"), "{}", ran[0].printed);
}

#[test]
fn nothing_fits_fails_every_rank_with_what_would() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let errors: Vec<String> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let pg = ProcessGroup::from_store(store, rank, 2, GroupOptions::default()).unwrap();
                Accelerator::with_process_group(auto_config(ParallelismConfig::auto(), 1024), pg)
                    .unwrap_err()
                    .to_string()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    assert_eq!(errors[0], errors[1]);
    assert!(errors[0].contains("The smallest memory per process that would fit is"), "{}", errors[0]);
    // Without the program's description, auto cannot be chosen: said before any collective.
    let e = Accelerator::with_process_group(
        AcceleratorConfig { parallelism: ParallelismConfig::auto(), ..AcceleratorConfig::default() },
        ProcessGroup::single_process().unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("did not describe its model") && e.contains("AcceleratorConfig::auto_layout"), "{e}");
}
