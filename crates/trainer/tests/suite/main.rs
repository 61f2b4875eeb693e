//! One integration-test binary for the crate (each test binary links candle: one link instead of one per file).

mod common;
mod grad_accumulation;
mod layout_free_resume;
mod resume;
mod run_folders;
mod safety;
mod tensor_parallel;
mod trainer_loop;
