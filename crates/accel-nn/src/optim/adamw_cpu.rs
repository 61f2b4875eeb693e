//! AdamW's update as one in-place pass over CPU f32 memory.
//!
//! The composed form (one candle op per term: ≈ 12 tensor ops, each allocating its output and walking the whole
//! parameter) is memory-bound: it moves ≈ 30 parameter-sized arrays per step (measured in `docs/benchmarks.md`,
//! "One training step vs PyTorch"). This pass reads `p, g, m, v` once and writes `p, m, v` in place — 7 array walks, no allocation.
//!
//! It performs the *same f32 operations in the same order* as the composed path in `adamw.rs` (including
//! candle's `affine`, `v·mul + add` with `add = 0`, which turns −0 into +0), so both paths give bit-identical
//! results; a test checks that. Candle has no in-place op that writes three tensors, so the kernel nests three
//! in-place ops (`m`, then `v`, then `p` reading `g`), each lending its storage to the next through a `RefCell`.

use super::AdamWConfig;
use crate::ops::cpu_f32::simd_fn;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, InplaceOp2, Layout, Tensor};
use rayon::prelude::*;
use std::cell::RefCell;

/// The per-parameter scalars of one AdamW update, already in f32 exactly as candle's `affine` converts them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Coefficients {
    pub(super) beta1: f32,
    pub(super) one_minus_beta1: f32,
    pub(super) beta2: f32,
    pub(super) one_minus_beta2: f32,
    /// `1 − lr·λ`, or `None` without weight decay (the parameter is then read as is).
    pub(super) decay: Option<f32>,
    /// `1 / √(1 − β₂ᵗ)`.
    pub(super) inv_bias_correction2_sqrt: f32,
    pub(super) eps: f32,
    /// `lr / (1 − β₁ᵗ)`.
    pub(super) step_size: f32,
}

impl Coefficients {
    /// From the hyper-parameters and this update's `lr / (1 − β₁ᵗ)` and `√(1 − β₂ᵗ)`, converted to f32 as
    /// candle's `affine` converts its scalars.
    pub(super) fn new(c: &AdamWConfig, step_size: f64, bias_correction2_sqrt: f64) -> Self {
        Coefficients {
            beta1: c.beta1 as f32,
            one_minus_beta1: (1.0 - c.beta1) as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: (1.0 - c.beta2) as f32,
            decay: (c.weight_decay != 0.0).then_some((1.0 - c.lr * c.weight_decay) as f32),
            inv_bias_correction2_sqrt: (1.0 / bias_correction2_sqrt) as f32,
            eps: c.eps as f32,
            step_size: step_size as f32,
        }
    }
}

/// Whether the in-place pass applies: the parameter a contiguous f32 CPU tensor, the gradient f32 on the CPU with
/// as many elements (it is made contiguous by the caller).
pub(super) fn applies(p: &Tensor, g: &Tensor) -> bool {
    let on_cpu_f32 = |t: &Tensor| matches!(t.device(), Device::Cpu) && t.dtype() == DType::F32;
    on_cpu_f32(p) && p.is_contiguous() && on_cpu_f32(g) && g.elem_count() == p.elem_count()
}

/// A moment buffer for the in-place pass: zeros on the first update, else the stored buffer as a contiguous f32
/// CPU tensor (converted only if a checkpoint restored it otherwise).
pub(super) fn owned_buffer(buf: Option<Tensor>, p: &Tensor) -> candle_core::Result<Tensor> {
    match buf {
        None => p.zeros_like(),
        Some(b) => b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.contiguous(),
    }
}

/// `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`, `p ← p·(1−lrλ) − step_size·m / (√v/√(1−β₂ᵗ) + ε)`, in place.
/// Callers check [`applies`] first; `g`, `m` and `v` are contiguous.
pub(super) fn step_in_place(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    c: Coefficients,
) -> candle_core::Result<()> {
    m.inplace_op1(&OnM { p, g, v, c })
}

/// The contiguous f32 slice a layout views, mutable.
fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> candle_core::Result<&'a mut [f32]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("adamw: tensor is not contiguous".into()))?;
    match s {
        CpuStorage::F32(data) => Ok(&mut data[start..end]),
        _ => Err(candle_core::Error::Msg("adamw: expected f32 storage".into())),
    }
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("adamw: tensor is not contiguous".into()))?;
    match s {
        CpuStorage::F32(data) => Ok(&data[start..end]),
        _ => Err(candle_core::Error::Msg("adamw: expected f32 storage".into())),
    }
}

/// Holds `m`'s storage, then takes `v`'s.
struct OnM<'t> {
    p: &'t Tensor,
    g: &'t Tensor,
    v: &'t Tensor,
    c: Coefficients,
}

impl InplaceOp1 for OnM<'_> {
    fn name(&self) -> &'static str {
        "adamw-m"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let m = RefCell::new(slice_mut(storage, layout)?);
        self.v.inplace_op1(&OnV { p: self.p, g: self.g, m: &m, c: self.c })
    }
}

/// Holds `v`'s storage (and `m`'s), then takes `p`'s and reads `g`.
struct OnV<'t, 'r, 's> {
    p: &'t Tensor,
    g: &'t Tensor,
    m: &'r RefCell<&'s mut [f32]>,
    c: Coefficients,
}

impl InplaceOp1 for OnV<'_, '_, '_> {
    fn name(&self) -> &'static str {
        "adamw-v"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let v = RefCell::new(slice_mut(storage, layout)?);
        self.p.inplace_op2(self.g, &OnP { m: self.m, v: &v, c: self.c })
    }
}

/// The update itself, with `p` as the destination and `g` as the source.
struct OnP<'r, 's, 'u, 'w> {
    m: &'r RefCell<&'s mut [f32]>,
    v: &'u RefCell<&'w mut [f32]>,
    c: Coefficients,
}

impl InplaceOp2 for OnP<'_, '_, '_, '_> {
    fn name(&self) -> &'static str {
        "adamw-p"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, g: &CpuStorage, g_l: &Layout) -> candle_core::Result<()> {
        let p = slice_mut(dst, dst_l)?;
        let g = slice(g, g_l)?;
        let mut m = self.m.borrow_mut();
        let mut v = self.v.borrow_mut();
        let c = self.c;
        // Chunks of the four arrays go to rayon's threads when there are several (candle's thread count) and the
        // parameter is large enough to pay for the hand-off; every element is updated the same way either way.
        let (m, v): (&mut [f32], &mut [f32]) = (&mut m, &mut v);
        if p.len() >= 2 * CHUNK && rayon::current_num_threads() > 1 {
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK))
                .zip(v.par_chunks_mut(CHUNK))
                .for_each(|(((p, g), m), v)| update(p, g, m, v, c));
        } else {
            update(p, g, m, v, c);
        }
        Ok(())
    }
}

/// Elements per rayon task of the update (256 KiB of each array).
const CHUNK: usize = 64 * 1024;

simd_fn! {
    /// The update of one stretch of the arrays, compiled for AVX2 too (`simd_fn!`): the loop is bound by its
    /// square root and division per element, which 8-lane vectors do twice as fast as the baseline's 4 lanes,
    /// with the same correctly rounded results.
    fn update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: Coefficients) {
        // Each line is one composed candle op of adamw.rs, in its order (see the module docs).
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let m_new = (*m * c.beta1 + 0.0) + (g * c.one_minus_beta1 + 0.0);
            let v_new = (*v * c.beta2 + 0.0) + ((g * g) * c.one_minus_beta2 + 0.0);
            let decayed = match c.decay {
                Some(d) => *p * d + 0.0,
                None => *p,
            };
            let denom = v_new.sqrt() * c.inv_bias_correction2_sqrt + c.eps;
            let update = (m_new / denom) * c.step_size + 0.0;
            *p = decayed - update;
            *m = m_new;
            *v = v_new;
        }
    }
}
