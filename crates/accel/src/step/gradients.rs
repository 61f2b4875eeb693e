//! [`Gradients`]: one model's fp32 gradient slots for the current window — the single gradient representation
//! from backward to the optimizer.

use crate::Result;
use candle_core::{DType, Tensor};

/// A slot per parameter (the prepared model's sorted parameter order), fp32, on the model's device.
#[derive(Debug, Default)]
pub(crate) struct Gradients {
    /// `None` until a micro-batch produced a gradient for the parameter (and, after a sync with
    /// `find_unused_parameters`, for a parameter no rank used).
    pub(crate) slots: Vec<Option<Tensor>>,
    /// The window's gradients were reduced across ranks: the optimizer may step.
    pub(crate) synced: bool,
    /// fp16: already divided by the loss scale in this step.
    pub(crate) unscaled: bool,
    /// fp16: the unscaled gradients hold inf/NaN.
    pub(crate) found_inf: bool,
}

impl Gradients {
    pub(crate) fn new(num_params: usize) -> Self {
        Gradients { slots: vec![None; num_params], ..Gradients::default() }
    }

    /// Empty slots, flags reset (after an optimizer step, `zero_grad` or a skipped step).
    pub(crate) fn clear(&mut self) {
        self.slots.iter_mut().for_each(|g| *g = None);
        self.synced = false;
        self.unscaled = false;
        self.found_inf = false;
    }

    /// Adds a micro-batch's gradient of parameter `i` (cast to fp32); the old sum and `grad` are freed here.
    pub(crate) fn add(&mut self, i: usize, grad: Tensor) -> Result<()> {
        Ok(add_into(&mut self.slots[i], grad)?)
    }
}

/// Adds `grad` (cast to fp32) to the sum in `slot`.
pub(crate) fn add_into(slot: &mut Option<Tensor>, grad: Tensor) -> candle_core::Result<()> {
    let g = grad.to_dtype(DType::F32)?;
    *slot = Some(match slot.take() {
        None => g,
        Some(acc) => (acc + g)?,
    });
    Ok(())
}

impl Gradients {
    /// Multiplies every gradient by `factor`.
    pub(crate) fn scale(&mut self, factor: f64) -> Result<()> {
        for g in self.slots.iter_mut().flatten() {
            *g = g.affine(factor, 0.0)?;
        }
        Ok(())
    }

    /// Clamps every element into `[-limit, limit]`.
    pub(crate) fn clamp(&mut self, limit: f64) -> Result<()> {
        for g in self.slots.iter_mut().flatten() {
            *g = g.clamp(-limit, limit)?;
        }
        Ok(())
    }

    /// Each slot's sum of squares (0 for an empty slot), computed in fp32 on the device, read back as f64.
    pub(crate) fn squared_norms(&self) -> Result<Vec<f64>> {
        let sums = self.slots.iter().flatten().map(|g| g.sqr()?.sum_all()).collect::<candle_core::Result<Vec<_>>>()?;
        let mut present = if sums.is_empty() {
            Vec::new()
        } else {
            Tensor::stack(&sums, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?
        }
        .into_iter();
        Ok(self.slots.iter().map(|s| if s.is_some() { present.next().unwrap_or(0.0) } else { 0.0 }).collect())
    }

    /// Whether every present gradient is finite.
    pub(crate) fn all_finite(&self) -> Result<bool> {
        let present: Vec<Tensor> = self.slots.iter().flatten().cloned().collect();
        crate::mixed_precision::all_finite(&present)
    }
}
