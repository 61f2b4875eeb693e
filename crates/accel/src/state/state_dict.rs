//! [`Stateful`]: what every checkpointed object (optimizer, scheduler, GradScaler, data-loader position, user
//! objects) hands to `save_state` as a [`StateDict`], like PyTorch's `state_dict()` / `load_state_dict()`.
//!
//! [`StateDict`] itself lives in ddp-core (the optimizers there save it); a state dict has two halves: named
//! tensors (written to `{stem}.safetensors`, readable by Python's `safetensors`) and JSON metadata (counters,
//! hyper-parameters, written to `{stem}.json`).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::{AccelError, Result};

pub use accel_nn::state::StateDict;

/// A checkpointed object shared between the training loop and the Accelerator.
pub type SharedStateful = std::sync::Arc<std::sync::Mutex<dyn Stateful + Send>>;

/// An object whose state goes into checkpoints (`Accelerator::register_for_checkpointing`, `save_state`).
pub trait Stateful {
    /// The current state.
    fn state_dict(&self) -> Result<StateDict>;
    /// Restores a state produced by [`Stateful::state_dict`] (possibly by another process).
    ///
    /// Errors should name the missing or mismatched entry.
    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()>;
}

impl<T: Stateful + ?Sized> Stateful for Box<T> {
    fn state_dict(&self) -> Result<StateDict> {
        (**self).state_dict()
    }
    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        (**self).load_state_dict(sd)
    }
}

/// Writes tensors as one safetensors file (little-endian, row-major; Python's `safetensors.torch.load_file`
/// reads it). Tensors are made contiguous and copied to the CPU first; the write is atomic.
pub fn save_safetensors(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    Ok(accel_nn::state::save_safetensors(tensors, path)?)
}

/// Reads every tensor of a safetensors file onto `device`.
pub fn load_safetensors(path: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    Ok(accel_nn::state::load_safetensors(path, device)?)
}

/// Writes pretty JSON to `path`.
pub(crate) fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text =
        serde_json::to_string_pretty(v).map_err(|e| AccelError::json(format!("encoding {}", path.display()), e))?;
    std::fs::write(path, text + "\n").map_err(|e| AccelError::io(format!("writing {}", path.display()), e))
}

/// Reads JSON from `path`.
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| AccelError::io(format!("reading {}", path.display()), e))?;
    serde_json::from_str(&text).map_err(|e| AccelError::json(format!("parsing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(dir: &Path, stem: &str) -> Result<StateDict> {
        Ok(StateDict::load(dir, stem, &Device::Cpu)?)
    }

    #[test]
    fn state_dict_errors_keep_their_accel_variant() {
        let dir = tempfile::tempdir().unwrap();
        let err = load(dir.path(), "scheduler").unwrap_err();
        assert!(matches!(err, AccelError::Checkpoint { .. }), "{err:?}");
        assert!(err.to_string().contains("scheduler.json"), "{err}");
        StateDict::from_meta(serde_json::json!({"step": "seven"})).save(dir.path(), "opt").unwrap();
        let err = (|| -> Result<u64> { Ok(load(dir.path(), "opt")?.meta_field("step")?) })().unwrap_err();
        assert!(matches!(err, AccelError::Json { .. }), "{err:?}");
    }
}
