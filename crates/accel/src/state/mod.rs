//! Checkpoint state: [`StateDict`] / [`Stateful`] (what each object saves), the checkpoint directory format,
//! atomic writes, automatic naming with a total limit, and per-rank RNG state. The save/load protocol behind
//! `Accelerator::save_state` and `load_state` is the Accelerator's (`accelerator/checkpointing.rs`).
//!
//! Directory layout written by `Accelerator::save_state` (Accelerate's names where one exists; the `_{i}`
//! suffix appears from the second object of a kind on):
//!
//! | file                              | content                                                        | written by |
//! |-----------------------------------|----------------------------------------------------------------|------------|
//! | `model[_i].safetensors`           | fp32 master weights, names = `VarMap` names                    | rank 0     |
//! | `optimizer[_i].safetensors/.json` | optimizer buffers (moments, momentum) + hyper-parameters, step | rank 0     |
//! | `scaler.json`                     | fp16 GradScaler (scale, growth tracker)                        | rank 0     |
//! | `scheduler[_i].json`              | LR schedulers given to `register_scheduler`                    | rank 0     |
//! | `data_loader[_i].json`            | prepared data-loader positions (epoch, batches consumed)       | rank 0     |
//! | `custom_checkpoint_{i}.json/.safetensors` | objects given to `register_for_checkpointing`          | rank 0     |
//! | `random_states_{rank}.json`       | the ChaCha8 state of the rank's Accelerator RNG                | each rank  |
//! | `gradients_{rank}.json/.safetensors` | partial gradients, only when saved inside an accumulation window | each rank |
//! | `accelerator.json`                | format, world size, precision, GA, step counters, contents     | rank 0     |
//!
//! Automatic naming: `project_dir/checkpoints/checkpoint_{i}`, `i` one past the highest existing index.

mod atomic;
pub mod checkpoint_dir;
pub mod rng;
mod state_dict;

pub use atomic::write_atomic;
pub use checkpoint_dir::{checkpoint_name, list_checkpoints, newest_checkpoint, ACCELERATOR_FILE, CHECKPOINTS_SUBDIR};
pub use rng::RngState;
pub use state_dict::{load_safetensors, save_safetensors, SharedStateful, StateDict, Stateful};
pub(crate) use state_dict::{read_json, write_json};
