//! The shared conformance suite (`conformance/mod.rs`) on the CPU backend: ranks are threads of this process
//! over one MemoryStore, world sizes 1–4. The same suite runs on MPI (`conformance_mpi.rs`) and on NCCL
//! (the `gpu_check` binary).

use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::sync::Arc;
use std::time::Duration;

fn run_world(world: usize, opts: crate::conformance::SuiteOptions) -> crate::conformance::Outcome {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(120)));
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, opts) = (store.clone(), opts.clone());
            std::thread::spawn(move || {
                let group = GroupOptions { timeout: Duration::from_secs(120), ..GroupOptions::default() };
                let pg = ProcessGroup::from_store(store, rank, world, group).expect("group formation");
                crate::conformance::run(&pg, &opts)
            })
        })
        .collect();
    let mut total = crate::conformance::Outcome::default();
    for h in handles {
        total.merge(h.join().expect("rank thread panicked"));
    }
    total
}

#[test]
fn cpu_backend_passes_the_conformance_suite_on_1_to_4_ranks() {
    for world in 1..=4 {
        let opts = crate::conformance::SuiteOptions {
            large: if world <= 2 { 3 * (1 << 20) / 4 + 3 } else { 0 },
            ..Default::default()
        };
        let out = run_world(world, opts);
        println!("CPU backend, world {world}: {}", out.summary());
        assert!(out.failed.is_empty(), "world {world}: {}\n{}", out.summary(), out.failed.join("\n"));
        assert!(out.passed > 100, "world {world}: only {} cases ran", out.passed);
    }
}
