//! Softmax over the last dimension, plain ([`softmax_last_dim`]) or scaled and causally masked for attention
//! ([`causal_softmax`]), each with its own backward.
//!
//! Fast path (CPU f32, [`super::fused_ops_enabled`]): one custom op per call. Forward per row: `m = max(x)`,
//! `y = exp(x − m) / Σ exp(x − m)` (the max-subtracted form, as candle-nn's `softmax` and PyTorch's kernel). The
//! backward uses only the output `y` (no saved intermediates): `dx = y · (g − Σ g·y)` per row, times `scale` for
//! the scaled variant. The causal variant never builds a mask tensor: row `i` of each `[s, s]` score matrix reads
//! only keys `0..=i` and writes exact zeros (probability and gradient) for the keys after the query.
//!
//! Elsewhere: candle-nn's differentiable `ops::softmax`, and for the causal variant `scale · scores` plus a
//! cached `[s, s]` mask of 0 / −∞ (so the masked probabilities are `exp(−∞) = 0` there too).

use super::cpu_f32::{dot, exp, fast_path, for_row_blocks, simd_fn, storage_f32, sum, tensor_f32};
use crate::{NnError, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Device, DeviceLocation, Layout, Shape, Tensor, D};
use std::sync::Mutex;

/// `softmax(x)` over the last dimension: `x` `[.., n]` (any float dtype) → the same shape and dtype, each row
/// summing to 1. Differentiable. Fused for CPU f32; candle-nn's composed `ops::softmax` elsewhere.
///
/// Errors ([`NnError::InvalidArgument`]): `x` a scalar (no last dimension).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.rank() == 0 {
        return Err(NnError::InvalidArgument(
            "softmax_last_dim: x is a scalar; it needs at least one dimension to normalise over".into(),
        ));
    }
    if fast_path(&[x]) {
        let n = x.dim(D::Minus1)?;
        Ok(x.contiguous()?.apply_op1(SoftmaxOp { scale: 1.0, row_len: n, causal: false })?)
    } else {
        Ok(candle_nn::ops::softmax(x, D::Minus1)?)
    }
}

/// Causal attention probabilities: `softmax(scale · scores + mask)` over the last dimension, where `scores`
/// `[.., s, s]` holds query rows and key columns and the mask is −∞ strictly above the diagonal (key `j` > query
/// `i`), 0 elsewhere — GPT's decoder self-attention (Radford et al. 2018), with `scale = 1/√head_dim` (Vaswani et
/// al. 2017). The result has the shape and dtype of `scores`; its masked entries are exactly 0. Differentiable.
/// Fused for CPU f32 (no mask tensor, masked entries never read); elsewhere `scale · scores`, a cached mask and
/// candle-nn's `ops::softmax`.
///
/// Errors ([`NnError::InvalidArgument`]): `scores` of rank < 2 or whose last two dimensions differ (this is the
/// square self-attention mask, no key/value cache); `scale` not finite.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = scores.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        return Err(NnError::InvalidArgument(format!(
            "causal_softmax: scores has shape {dims:?}; expected [.., s, s] (queries × keys of one sequence)"
        )));
    }
    if !scale.is_finite() {
        return Err(NnError::InvalidArgument(format!(
            "causal_softmax: scale = {scale}; it must be finite (attention uses 1/√head_dim)"
        )));
    }
    let s = dims[dims.len() - 1];
    if fast_path(&[scores]) {
        Ok(scores.contiguous()?.apply_op1(SoftmaxOp { scale: scale as f32, row_len: s, causal: true })?)
    } else {
        let masked = (scores * scale)?.broadcast_add(&causal_mask(s, scores.dtype(), scores.device())?)?;
        Ok(candle_nn::ops::softmax(&masked, D::Minus1)?)
    }
}

/// Most masks kept by [`causal_mask`] (one per sequence length, dtype and device in use; a training run needs one
/// or two).
const MASK_CACHE: usize = 8;

/// Masks built so far, newest last.
static MASKS: Mutex<Vec<(usize, DType, DeviceLocation, Tensor)>> = Mutex::new(Vec::new());

/// The `[s, s]` mask of the fallback: 0 where key `j ≤` query `i`, −∞ above the diagonal; built once per
/// `(s, dtype, device)` and cached.
fn causal_mask(s: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let key = (s, dtype, device.location());
    // A poisoned lock only means another thread panicked while holding it; the cache itself stays valid.
    let mut masks = MASKS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((.., mask)) = masks.iter().find(|(a, b, c, _)| (*a, *b, *c) == key) {
        return Ok(mask.clone());
    }
    let values: Vec<f32> =
        (0..s).flat_map(|i| (0..s).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
    let mask = Tensor::from_vec(values, (s, s), device)?.to_dtype(dtype)?;
    if masks.len() >= MASK_CACHE {
        masks.remove(0);
    }
    masks.push((key.0, key.1, key.2, mask.clone()));
    Ok(mask)
}

simd_fn! {
    /// `row ← softmax(scale · row)`, max-subtracted: the forward of one row (of the visible keys only, for the
    /// causal variant). Shared with the fused attention. The exponentials and their sum are separate passes, so
    /// that both vectorise.
    pub(super) fn softmax_in_place(row: &mut [f32], scale: f32) {
        let m = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
        for v in row.iter_mut() {
            *v = exp(*v * scale - m);
        }
        let inv = 1.0 / sum(row);
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// `g ← scale · y ⊙ (g − Σ g·y)`: the backward of one row of [`softmax_in_place`], from its output `y` and the
/// incoming gradient `g` (overwritten with the input's gradient). Shared with the fused attention.
pub(super) fn softmax_backward_in_place(g: &mut [f32], y: &[f32], scale: f32) {
    let gy = dot(g, y);
    for (v, &yv) in g.iter_mut().zip(y) {
        *v = scale * yv * (*v - gy);
    }
}

/// The fused op on contiguous f32 rows of `row_len`: `softmax(scale · x)` per row, keys after the query masked
/// when `causal` (row `r` is query `r mod row_len` of its `[s, s]` matrix).
struct SoftmaxOp {
    scale: f32,
    row_len: usize,
    causal: bool,
}

impl SoftmaxOp {
    /// How many leading entries of row `r` take part (the rest are masked).
    #[inline]
    fn visible(&self, r: usize) -> usize {
        if self.causal {
            r % self.row_len + 1
        } else {
            self.row_len
        }
    }
}

impl CustomOp1 for SoftmaxOp {
    fn name(&self) -> &'static str {
        if self.causal {
            "fused-causal-softmax"
        } else {
            "fused-softmax"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = storage_f32(s, l, self.name())?;
        let n = self.row_len;
        let scale = self.scale;
        let mut y = vec![0f32; x.len()];
        for_row_blocks(&mut y, n, |row0, block| {
            for (r, yr) in block.chunks_mut(n).enumerate() {
                let row = row0 + r;
                let k = self.visible(row);
                yr[..k].copy_from_slice(&x[row * n..][..k]);
                softmax_in_place(&mut yr[..k], scale);
                // yr[k..] stays 0: the masked keys.
            }
        });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let (ys, yl) = res.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let y = tensor_f32(&ys, yl, self.name())?;
        let g = tensor_f32(&gs, gl, self.name())?;
        let n = self.row_len;
        let scale = self.scale;
        let mut dx = vec![0f32; y.len()];
        for_row_blocks(&mut dx, n, |row0, block| {
            for (r, dxr) in block.chunks_mut(n).enumerate() {
                let row = row0 + r;
                let k = self.visible(row);
                dxr[..k].copy_from_slice(&g[row * n..][..k]);
                softmax_backward_in_place(&mut dxr[..k], &y[row * n..][..k], scale);
            }
        });
        Ok(Some(Tensor::from_vec(dx, res.shape(), &Device::Cpu)?))
    }
}
