//! Layer normalisation over the last dimension (Ba, Kiros & Hinton 2016, "Layer Normalization";
//! `torch.nn.functional.layer_norm` with a `[d]` weight and bias) with its analytic backward.
//!
//! Fast path (CPU f32, [`super::fused_ops_enabled`]): one custom op. The forward makes two passes per row (mean,
//! then the variance of the centred values, as candle-nn's `layer_norm_slow`) and writes
//! `y = (x − μ)·rstd·w + b`, `rstd = 1/√(σ² + eps)`; nothing is saved for the backward, which recomputes μ and rstd
//! from `x` (one cheap pass) and writes, with `x̂ = (x − μ)·rstd` and `ĝ = g·w`:
//!
//! ```text
//! dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂))      (per row)
//! dw = Σ_rows g · x̂                                 db = Σ_rows g
//! ```
//!
//! (the standard derivation, e.g. PyTorch's `layer_norm_backward_cpu` kernel). Elsewhere:
//! `candle_nn::ops::layer_norm_slow`, differentiable composed ops, which computes in f32 for bf16/f16 inputs.

use super::cpu_f32::{dot, fast_path, for_row_blocks, map_row_blocks, storage_f32, sum, tensor_f32};
use crate::{NnError, Result};
use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor};

/// `LayerNorm` over the last dimension: `x` `[.., d]`, `weight` and `bias` `[d]`, all of one float dtype →
/// `[.., d]` in that dtype; `eps` is added to the variance (PyTorch's default is 1e-5). The biased variance
/// (divided by `d`) is used, as in PyTorch.
///
/// Differentiable in `x`, `weight` and `bias`. Fused (one forward and one backward kernel) for CPU f32; candle's
/// composed `layer_norm_slow` elsewhere (see the module documentation).
///
/// Errors ([`NnError::InvalidArgument`]): `x` a scalar or with an empty last dimension; `weight` or `bias` not
/// of shape `[d]`; dtypes that differ; `eps` negative or not finite.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let d = match x.dims().last() {
        Some(&d) if d > 0 => d,
        _ => {
            return Err(NnError::InvalidArgument(format!(
                "layer_norm: x has shape {:?}; it needs a non-empty last dimension to normalise over",
                x.dims()
            )))
        }
    };
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if t.dims() != [d] {
            return Err(NnError::InvalidArgument(format!(
                "layer_norm: {name} has shape {:?}, expected [{d}] (the last dimension of x {:?})",
                t.dims(),
                x.dims()
            )));
        }
        if t.dtype() != x.dtype() {
            return Err(NnError::InvalidArgument(format!(
                "layer_norm: {name} is {:?} but x is {:?}; convert them to one dtype",
                t.dtype(),
                x.dtype()
            )));
        }
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(NnError::InvalidArgument(format!(
            "layer_norm: eps = {eps}; it must be a finite number ≥ 0 (PyTorch's default is 1e-5)"
        )));
    }
    if fast_path(&[x, weight, bias]) {
        let op = LayerNormOp { eps: eps as f32, d };
        Ok(x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)?)
    } else {
        Ok(candle_nn::ops::layer_norm_slow(x, weight, bias, eps as f32)?)
    }
}

/// The fused op: arguments `x` `[.., d]`, `weight` `[d]`, `bias` `[d]` (contiguous f32).
struct LayerNormOp {
    eps: f32,
    d: usize,
}

/// Mean and `1/√(var + eps)` of one row (two passes: the centred second pass avoids the cancellation of
/// `E[x²] − E[x]²`).
#[inline]
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = sum(row) / n;
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let mut tail = 0f32;
    for v in chunks.remainder() {
        tail += (v - mean) * (v - mean);
    }
    for c in chunks {
        for k in 0..8 {
            let v = c[k] - mean;
            acc[k] += v * v;
        }
    }
    let var = (acc.iter().sum::<f32>() + tail) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = storage_f32(s1, l1, self.name())?;
        let w = storage_f32(s2, l2, self.name())?;
        let b = storage_f32(s3, l3, self.name())?;
        let d = self.d;
        let mut y = vec![0f32; x.len()];
        for_row_blocks(&mut y, d, |row0, block| {
            for (r, out) in block.chunks_mut(d).enumerate() {
                let xr = &x[(row0 + r) * d..][..d];
                let (mean, rstd) = moments(xr, self.eps);
                for (((o, &v), &wk), &bk) in out.iter_mut().zip(xr).zip(w).zip(b) {
                    *o = (v - mean) * rstd * wk + bk;
                }
            }
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = weight.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let xd = tensor_f32(&xs, xl, self.name())?;
        let w = tensor_f32(&ws, wl, self.name())?;
        let g = tensor_f32(&gs, gl, self.name())?;
        let d = self.d;
        let eps = self.eps;
        let mut dx = vec![0f32; xd.len()];
        // Each block of rows returns its partial dw and db; they are summed below in block order (deterministic
        // for a given thread count).
        let partials = map_row_blocks(&mut dx, d, |row0, block| {
            let mut dw = vec![0f32; d];
            let mut db = vec![0f32; d];
            let mut xhat = vec![0f32; d];
            let mut gw = vec![0f32; d];
            for (r, dxr) in block.chunks_mut(d).enumerate() {
                let xr = &xd[(row0 + r) * d..][..d];
                let gr = &g[(row0 + r) * d..][..d];
                let (mean, rstd) = moments(xr, eps);
                for k in 0..d {
                    xhat[k] = (xr[k] - mean) * rstd;
                    gw[k] = gr[k] * w[k];
                    dw[k] += gr[k] * xhat[k];
                    db[k] += gr[k];
                }
                let mean_gw = sum(&gw) / d as f32;
                let mean_gw_xhat = dot(&gw, &xhat) / d as f32;
                for k in 0..d {
                    dxr[k] = rstd * (gw[k] - mean_gw - xhat[k] * mean_gw_xhat);
                }
            }
            (dw, db)
        });
        let mut dw = vec![0f32; d];
        let mut db = vec![0f32; d];
        for (pw, pb) in partials {
            for k in 0..d {
                dw[k] += pw[k];
                db[k] += pb[k];
            }
        }
        let dx = Tensor::from_vec(dx, x.shape(), &Device::Cpu)?;
        let dw = Tensor::from_vec(dw, d, &Device::Cpu)?;
        let db = Tensor::from_vec(db, d, &Device::Cpu)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}
