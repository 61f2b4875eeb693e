//! [`StateDict`]: what every checkpointed object (optimizer, and in `accel` the scheduler, GradScaler, data-loader
//! position, user objects) hands to `save_state`, like PyTorch's `state_dict()` / `load_state_dict()`.
//!
//! A state dict has two halves: named tensors (written to `{stem}.safetensors`, readable by Python's
//! `safetensors`) and JSON metadata (counters, hyper-parameters, written to `{stem}.json`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::error::{NnError, Result};

/// Named tensors plus JSON metadata: the saveable state of one object.
#[derive(Debug, Clone, Default)]
pub struct StateDict {
    /// Tensors by name (any dtype/shape/device; saved as they are, loaded on the device asked for).
    pub tensors: BTreeMap<String, Tensor>,
    /// Everything that is not a tensor (counters, scalars, configuration); `Value::Null` when empty.
    pub meta: serde_json::Value,
}

impl StateDict {
    /// An empty state dict.
    pub fn new() -> Self {
        Self::default()
    }

    /// A state dict with metadata only.
    pub fn from_meta(meta: serde_json::Value) -> Self {
        StateDict { tensors: BTreeMap::new(), meta }
    }

    /// Adds a tensor (builder style).
    pub fn with_tensor(mut self, name: impl Into<String>, t: Tensor) -> Self {
        self.tensors.insert(name.into(), t);
        self
    }

    /// The tensor `name`, or an error naming it and the names that exist.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.tensors.keys().map(String::as_str).take(8).collect();
            NnError::InvalidArgument(format!(
                "state dict has no tensor {name:?} (it has {} tensors{}{})",
                self.tensors.len(),
                if known.is_empty() { "" } else { ", e.g. " },
                known.join(", ")
            ))
        })
    }

    /// The metadata field `key` deserialised as `T`, or an error naming the field.
    pub fn meta_field<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<T> {
        let v = self
            .meta
            .get(key)
            .ok_or_else(|| NnError::InvalidArgument(format!("state dict metadata has no field {key:?}")))?;
        serde_json::from_value(v.clone()).map_err(|e| NnError::json(format!("state dict metadata field {key:?}"), e))
    }

    /// Writes `{dir}/{stem}.json` (always) and `{dir}/{stem}.safetensors` (when there are tensors).
    /// Returns the files written.
    pub fn save(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
        let mut written = Vec::new();
        let json_path = dir.join(format!("{stem}.json"));
        write_json(&json_path, &self.meta)?;
        written.push(json_path);
        if !self.tensors.is_empty() {
            let st_path = dir.join(format!("{stem}.safetensors"));
            save_safetensors(&self.tensors, &st_path)?;
            written.push(st_path);
        }
        Ok(written)
    }

    /// Reads what [`StateDict::save`] wrote; tensors are placed on `device`.
    ///
    /// Errors: `{stem}.json` missing (names the file and the checkpoint), unreadable files.
    pub fn load(dir: &Path, stem: &str, device: &Device) -> Result<Self> {
        let json_path = dir.join(format!("{stem}.json"));
        if !json_path.is_file() {
            return Err(NnError::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!("missing {stem}.json — was this checkpoint written with the same registered objects?"),
            });
        }
        let meta = read_json(&json_path)?;
        let st_path = dir.join(format!("{stem}.safetensors"));
        let tensors = if st_path.is_file() { load_safetensors(&st_path, device)? } else { BTreeMap::new() };
        Ok(StateDict { tensors, meta })
    }
}

/// Writes tensors as one safetensors file (little-endian, row-major; Python's `safetensors.torch.load_file`
/// reads it). Tensors are made contiguous and copied to the CPU first.
pub fn save_safetensors(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<Result<_>>()?;
    let bytes = safetensors::tensor::serialize(map, None)
        .map_err(|e| NnError::Checkpoint { path: path.to_path_buf(), reason: format!("cannot write tensors: {e}") })?;
    super::write_atomic(path, bytes)
}

/// Reads every tensor of a safetensors file onto `device`.
pub fn load_safetensors(path: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let map = candle_core::safetensors::load(path, device)
        .map_err(|e| NnError::Checkpoint { path: path.to_path_buf(), reason: format!("cannot read tensors: {e}") })?;
    Ok(map.into_iter().collect())
}

/// Writes pretty JSON to `path`.
fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| NnError::json(format!("encoding {}", path.display()), e))?;
    std::fs::write(path, text + "\n").map_err(|e| NnError::io(format!("writing {}", path.display()), e))
}

/// Reads JSON from `path`.
fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| NnError::io(format!("reading {}", path.display()), e))?;
    serde_json::from_str(&text).map_err(|e| NnError::json(format!("parsing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_and_load_round_trip_keeps_bytes_and_meta() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tensor::new(&[[1.5f32, -2.0], [0.25, 3.0]], &Device::Cpu).unwrap();
        let sd = StateDict::from_meta(serde_json::json!({"step": 7})).with_tensor("w", t.clone());
        let files = sd.save(dir.path(), "opt").unwrap();
        assert_eq!(files.len(), 2);
        let back = StateDict::load(dir.path(), "opt", &Device::Cpu).unwrap();
        assert_eq!(back.meta_field::<u64>("step").unwrap(), 7);
        assert_eq!(back.tensor("w").unwrap().to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
        let err = back.tensor("v").unwrap_err().to_string();
        assert!(err.contains("\"v\"") && err.contains("w"), "{err}");
    }

    #[test]
    fn missing_json_is_a_checkpoint_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = StateDict::load(dir.path(), "scheduler", &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("scheduler.json"), "{err}");
    }
}
