//! Saveable state: [`StateDict`] (named tensors + JSON metadata, what the optimizers of [`crate::optim`] save and
//! restore, like PyTorch's `state_dict()`), safetensors files, and atomic file writes.
//!
//! The `accel` crate builds its checkpoint directories on these (`accel::state` re-exports them); the on-disk
//! format of one state dict is `{stem}.json` (metadata) plus `{stem}.safetensors` (tensors, when there are any).

mod atomic;
mod state_dict;

pub use atomic::{sync_dir, write_atomic};
pub use state_dict::{load_safetensors, save_safetensors, StateDict};
