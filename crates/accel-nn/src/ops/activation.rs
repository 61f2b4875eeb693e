//! GELU, the tanh approximation (Hendrycks & Gimpel 2016, eq. in §2; GPT-2's activation), with a one-pass
//! backward.
//!
//! `gelu(x) = 0.5·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)` — the formula of candle's `Tensor::gelu` and of
//! PyTorch's `GELU(approximate="tanh")`. The kernel evaluates it through the identity `0.5·(1 + tanh(u)) = σ(2u)`
//! (`σ` the logistic function) as `x / (1 + exp(−2u))`: the same function, one `exp` instead of one `tanhf` (glibc's
//! `tanhf` costs about 15 `expf`s here; the `exp` is this crate's inlined one, so the loop vectorises), and no cancellation in `1 + tanh(u)` for negative `x`. The backward
//! recomputes `σ = σ(2u)` from `x` (nothing saved) and writes, in one pass,
//!
//! ```text
//! dx = g · (σ + 2·x·σ·(1 − σ)·√(2/π)·(1 + 3·0.044715·x²))
//! ```
//!
//! (`= 0.5·(1 + t) + 0.5·x·(1 − t²)·u'` with `t = tanh(u)`), where candle's own backward chains eight elementwise
//! ops (each allocating a tensor of the size of `x`).
//! Fast path: CPU f32 with [`super::fused_ops_enabled`]; elsewhere `Tensor::gelu`.

use super::cpu_f32::{exp, fast_path, for_row_blocks, simd_fn, storage_f32, tensor_f32};
use crate::Result;
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};

/// `√(2/π)` in f32 (candle's constant).
const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of the approximation.
const COEF: f32 = 0.044715;

/// GELU (tanh approximation) elementwise: any shape and float dtype → the same shape and dtype. Differentiable.
/// Fused forward and backward for CPU f32; candle's `Tensor::gelu` elsewhere.
///
/// Errors: those of candle for a non-float dtype.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if fast_path(&[x]) {
        Ok(x.contiguous()?.apply_op1(GeluOp)?)
    } else {
        Ok(x.gelu()?)
    }
}

/// The fused op on contiguous f32 data.
struct GeluOp;

/// Elements per block handed to [`for_row_blocks`] (an elementwise op has no rows; blocks only split the work).
const BLOCK: usize = 1024;

/// `σ(2u) = 0.5·(1 + tanh(u))` at `x = v`. For `u < −44`, `exp` overflows to +∞ and the result is 0, as it should.
/// [`exp`] is inlined, so the loops over it vectorise.
#[inline(always)]
fn sigma_2u(v: f32) -> f32 {
    let u = SQRT_TWO_OVER_PI * v * (1.0 + COEF * v * v);
    1.0 / (1.0 + exp(-2.0 * u))
}

simd_fn! {
    /// `y = gelu(x)` elementwise (`x`, `y` of one length).
    fn gelu_forward(x: &[f32], y: &mut [f32]) {
        for (o, &v) in y.iter_mut().zip(x) {
            *o = v * sigma_2u(v);
        }
    }
}

simd_fn! {
    /// `dx = g · gelu'(x)` elementwise (`x`, `g`, `dx` of one length).
    fn gelu_backward(x: &[f32], g: &[f32], dx: &mut [f32]) {
        for ((o, &v), &gv) in dx.iter_mut().zip(x).zip(g) {
            let s = sigma_2u(v);
            let du = SQRT_TWO_OVER_PI * (1.0 + 3.0 * COEF * v * v);
            *o = gv * (s + 2.0 * v * s * (1.0 - s) * du);
        }
    }
}

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = storage_f32(s, l, self.name())?;
        let mut y = vec![0f32; x.len()];
        for_row_blocks(&mut y, BLOCK, |row0, block| gelu_forward(&x[row0 * BLOCK..][..block.len()], block));
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let (xs, xl) = arg.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let x = tensor_f32(&xs, xl, self.name())?;
        let g = tensor_f32(&gs, gl, self.name())?;
        let mut dx = vec![0f32; x.len()];
        for_row_blocks(&mut dx, BLOCK, |row0, block| {
            let range = row0 * BLOCK..row0 * BLOCK + block.len();
            gelu_backward(&x[range.clone()], &g[range], block)
        });
        Ok(Some(Tensor::from_vec(dx, arg.shape(), &Device::Cpu)?))
    }
}
