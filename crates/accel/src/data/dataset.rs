//! The [`Dataset`] trait (random access by index, batched) and [`TensorDataset`], a data set held in memory.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::error::{AccelError, Result};

/// One batch: row `i` of `inputs` goes with row `i` of `targets`.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `[rows, ...]`, e.g. `[b, 784]` f32 for MNIST, `[b, seq_len]` u32 token ids for text.
    pub inputs: Tensor,
    /// `[rows, ...]`, e.g. `[b]` u32 class labels, `[b, seq_len]` u32 next tokens.
    pub targets: Tensor,
}

impl Batch {
    /// Number of rows (dimension 0 of `inputs`).
    pub fn len(&self) -> usize {
        self.inputs.dims().first().copied().unwrap_or(0)
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Both tensors moved to `device` (a no-op when already there).
    pub fn to_device(&self, device: &Device) -> Result<Batch> {
        Ok(Batch { inputs: self.inputs.to_device(device)?, targets: self.targets.to_device(device)? })
    }
}

/// A map-style data set (PyTorch's `Dataset` with `__len__` / batched `__getitem__`).
///
/// `get_batch` must be deterministic (same indices → same tensors): bit-exact resume and the P × b = 1 × P·b
/// equivalence rely on it. It is called from the loader's prefetch thread, hence `Send + Sync`.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The samples `indices` (each `< len()`, repeats allowed) as one batch with `indices.len()` rows.
    fn get_batch(&self, indices: &[usize]) -> Result<Batch>;
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        (**self).get_batch(indices)
    }
}

impl<D: Dataset + ?Sized> Dataset for Box<D> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        (**self).get_batch(indices)
    }
}

/// A data set of two tensors with the same first dimension (PyTorch's `TensorDataset`), kept in memory.
#[derive(Debug, Clone)]
pub struct TensorDataset {
    inputs: Tensor,
    targets: Tensor,
}

impl TensorDataset {
    /// Pairs `inputs` `[N, ...]` with `targets` `[N, ...]`.
    ///
    /// Errors: a 0-d tensor, or different first dimensions (both sizes named).
    pub fn new(inputs: Tensor, targets: Tensor) -> Result<Self> {
        let (Some(&n_in), Some(&n_t)) = (inputs.dims().first(), targets.dims().first()) else {
            return Err(AccelError::Data(format!(
                "TensorDataset needs tensors with a first (sample) dimension, got shapes {:?} and {:?}",
                inputs.dims(),
                targets.dims()
            )));
        };
        if n_in != n_t {
            return Err(AccelError::Data(format!(
                "TensorDataset: inputs have {n_in} rows but targets have {n_t}; both need one row per sample"
            )));
        }
        Ok(TensorDataset { inputs, targets })
    }

    /// All inputs, `[N, ...]`.
    pub fn inputs(&self) -> &Tensor {
        &self.inputs
    }

    /// All targets, `[N, ...]`.
    pub fn targets(&self) -> &Tensor {
        &self.targets
    }

    /// The rows `start..start + len` as a new data set (views, no copy).
    pub fn narrow(&self, start: usize, len: usize) -> Result<TensorDataset> {
        Ok(TensorDataset { inputs: self.inputs.narrow(0, start, len)?, targets: self.targets.narrow(0, start, len)? })
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.inputs.dims()[0]
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        let n = self.len();
        if let Some(&bad) = indices.iter().find(|&&i| i >= n) {
            return Err(AccelError::Data(format!("sample index {bad} is out of range for a data set of {n} samples")));
        }
        let ids: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        let ids = Tensor::from_vec(ids, indices.len(), self.inputs.device())?;
        Ok(Batch { inputs: self.inputs.index_select(&ids, 0)?, targets: self.targets.index_select(&ids, 0)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_batch_selects_rows_in_order_with_repeats() {
        let x = Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((6, 2)).unwrap();
        let y = Tensor::arange(0u32, 6, &Device::Cpu).unwrap();
        let ds = TensorDataset::new(x, y).unwrap();
        let b = ds.get_batch(&[4, 1, 4]).unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(b.inputs.to_vec2::<f32>().unwrap(), vec![vec![8., 9.], vec![2., 3.], vec![8., 9.]]);
        assert_eq!(b.targets.to_vec1::<u32>().unwrap(), vec![4, 1, 4]);
        assert!(ds.get_batch(&[6]).unwrap_err().to_string().contains("index 6 is out of range"));
    }

    #[test]
    fn mismatched_rows_are_rejected() {
        let x = Tensor::zeros((3, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let y = Tensor::zeros(4, candle_core::DType::U32, &Device::Cpu).unwrap();
        let err = TensorDataset::new(x, y).unwrap_err().to_string();
        assert!(err.contains("3 rows") && err.contains("4"), "{err}");
    }
}
