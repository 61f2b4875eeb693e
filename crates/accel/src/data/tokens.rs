//! [`TokenDataset`]: fixed-length windows of a tokenized corpus for causal language modelling — the inputs a
//! window of ids, the targets the same window shifted by one token (what transformers' `labels` shift inside the
//! loss).

use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::dataset::{Batch, Dataset};
use crate::error::{AccelError, Result};

/// Windows of `seq_len` token ids every `stride` tokens: sample `i` has inputs `tokens[i·stride ..][..seq_len]`
/// and targets one token further; `[rows, seq_len]` u32 each in a batch. Cheap to clone (the ids are shared).
#[derive(Debug, Clone)]
pub struct TokenDataset {
    tokens: Arc<Vec<u32>>,
    seq_len: usize,
    stride: usize,
}

impl TokenDataset {
    /// Windows of `tokens`. Errors: `seq_len` or `stride` 0.
    pub fn new(tokens: Vec<u32>, seq_len: usize, stride: usize) -> Result<Self> {
        if seq_len == 0 || stride == 0 {
            return Err(AccelError::Data(format!(
                "token windows: seq_len ({seq_len}) and stride ({stride}) must be at least 1"
            )));
        }
        Ok(TokenDataset { tokens: Arc::new(tokens), seq_len, stride })
    }

    /// All token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens per window.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
}

impl Dataset for TokenDataset {
    fn len(&self) -> usize {
        let t = self.tokens.len();
        if t <= self.seq_len {
            0
        } else {
            (t - self.seq_len - 1) / self.stride + 1
        }
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        let (n, s) = (self.len(), self.seq_len);
        let mut inputs = Vec::with_capacity(indices.len() * s);
        let mut targets = Vec::with_capacity(indices.len() * s);
        for &i in indices {
            if i >= n {
                return Err(AccelError::Data(format!("sample index {i} is out of range for {n} windows of tokens")));
            }
            let start = i * self.stride;
            inputs.extend_from_slice(&self.tokens[start..start + s]);
            targets.extend_from_slice(&self.tokens[start + 1..start + s + 1]);
        }
        let rows = indices.len();
        Ok(Batch {
            inputs: Tensor::from_vec(inputs, (rows, s), &Device::Cpu)?,
            targets: Tensor::from_vec(targets, (rows, s), &Device::Cpu)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_and_shifted_targets() {
        let d = TokenDataset::new((0..10).collect(), 3, 3).unwrap();
        // Windows at 0, 3, 6 (the last needs tokens 6..=9).
        assert_eq!(d.len(), 3);
        let b = d.get_batch(&[2, 0]).unwrap();
        assert_eq!(b.inputs.to_vec2::<u32>().unwrap(), vec![vec![6, 7, 8], vec![0, 1, 2]]);
        assert_eq!(b.targets.to_vec2::<u32>().unwrap(), vec![vec![7, 8, 9], vec![1, 2, 3]]);
        assert!(d.get_batch(&[3]).unwrap_err().to_string().contains("out of range for 3 windows"));
        assert!(TokenDataset::new(vec![1], 0, 1).is_err());
    }
}
