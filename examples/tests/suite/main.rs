//! One integration-test binary for the crate (each test binary links candle: one link instead of one per file).

mod accel_gpt_resume;
mod architecture;
mod auto_layout;
mod bad_inputs;
mod ddp_mnist;
mod elastic;
mod gpt_tp;
mod guide_diffs;
mod hp_search;
mod llama_examples;
mod nd_equivalence;
mod pipeline_gpt;
mod pipeline_layouts;
mod run_folders;
mod sharded_faults;
mod sharded_layouts;
