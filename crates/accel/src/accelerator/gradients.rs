//! `backward`, the gradient-accumulation window, `no_sync` and gradient clipping.
//!
//! Accumulation follows Accelerate: every micro-step divides the loss by `gradient_accumulation_steps`; gradients
//! are summed locally (in fp32) and all-reduced (averaged) only on the last micro-step of a window or on the last
//! batch of a prepared data loader; in between, optimizer `step` and `zero_grad` are no-ops.

use super::prepared_model::{GradAccumulator, PreparedModel};
use super::{lock, Accelerator, StepState};
use crate::Result;
use candle_core::{DType, Tensor};

/// Resets `flag` when dropped, so a panic or an early `?` inside `accumulate` / `no_sync` does not leave it set.
struct Restore<'a> {
    acc: &'a Accelerator,
    undo: fn(&mut StepState),
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        (self.undo)(&mut lock(&self.acc.inner.steps));
    }
}

impl Accelerator {
    /// Backward pass of one micro-batch: divides `loss` by the gradient accumulation steps, multiplies it by the
    /// fp16 loss scale, computes gradients, adds them (as fp32) to every prepared model's accumulator, and on a
    /// sync step all-reduces (averages) them across ranks through DDP.
    ///
    /// `loss` is a scalar (any float dtype; compute it in F32 under fp16 so scaling cannot overflow the loss
    /// itself). Call it once per micro-batch. Errors: no prepared model, parameters without a gradient (unless
    /// `DdpOptions::find_unused_parameters`), collective failures.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let models = self.require_models("backward")?;
        let sync = {
            let mut st = lock(&self.inner.steps);
            if !st.in_accumulate {
                self.advance_window(&mut st);
            }
            st.total_micro_steps += 1;
            st.sync_gradients && st.no_sync_depth == 0
        };
        let ga = self.inner.config.gradient_accumulation_steps;
        let mut loss = loss.clone();
        if ga > 1 {
            loss = loss.affine(1.0 / ga as f64, 0.0)?;
        }
        if let Some(scaler) = &self.inner.scaler {
            let scale = lock(scaler).scale();
            loss = loss.to_dtype(DType::F32)?.affine(scale, 0.0)?;
        }
        let grads = loss.backward()?;
        for m in &models {
            m.accumulate(&grads)?;
        }
        drop(grads);
        if sync {
            for m in &models {
                m.sync()?;
            }
        }
        Ok(())
    }

    /// Whether the current micro-step syncs gradients (and the optimizer will step): true on the last micro-step
    /// of an accumulation window and on the last batch of a prepared data loader, false inside `no_sync`.
    /// Inside [`Accelerator::accumulate`] it is known before `backward`; outside, it is updated by `backward`.
    pub fn sync_gradients(&self) -> bool {
        let st = lock(&self.inner.steps);
        st.sync_gradients && st.no_sync_depth == 0
    }

    /// Runs one micro-step (forward + `backward`) in `f`, Accelerate's `with accelerator.accumulate(model)`:
    /// advances the accumulation window on entry, so [`Accelerator::sync_gradients`] tells inside `f` whether this
    /// micro-step will sync. `backward` advances the window itself when called outside `accumulate`, so using it
    /// is optional.
    pub fn accumulate<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        {
            let mut st = lock(&self.inner.steps);
            if st.in_accumulate {
                return Err(crate::AccelError::Usage("accumulate: calls cannot be nested".into()));
            }
            self.advance_window(&mut st);
            st.in_accumulate = true;
        }
        let _restore = Restore { acc: self, undo: |st| st.in_accumulate = false };
        f()
    }

    /// Runs `f` with gradient sync turned off (like DDP's `no_sync()`): gradients of `backward` calls inside are
    /// accumulated locally; the first syncing `backward` after it all-reduces the accumulated sum. The optimizer
    /// does not step on gradients that were not synced.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        lock(&self.inner.steps).no_sync_depth += 1;
        let _restore = Restore { acc: self, undo: |st| st.no_sync_depth -= 1 };
        f()
    }

    /// Clips the accumulated gradients of all prepared models so their global L2 norm is at most `max_norm`
    /// (`torch.nn.utils.clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)` when below 1). Under fp16 the
    /// gradients are unscaled first (once per optimizer step). Returns the total norm before clipping (f64; inf or
    /// NaN when an fp16 step overflowed — that step will be skipped and nothing is clipped).
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        let models = self.require_models("clip_grad_norm")?;
        let mut guards: Vec<_> = models.iter().map(|m| lock(&m.inner.grads)).collect();
        for g in guards.iter_mut() {
            self.unscale(g)?;
        }
        let mut sq_sums = Vec::new();
        for acc in &guards {
            for g in acc.grads.iter().flatten() {
                sq_sums.push(g.sqr()?.sum_all()?);
            }
        }
        if sq_sums.is_empty() {
            return Ok(0.0);
        }
        let total: f64 = Tensor::stack(&sq_sums, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?.iter().sum();
        let norm = total.sqrt();
        if !norm.is_finite() {
            return Ok(norm);
        }
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for acc in guards.iter_mut() {
                for g in acc.grads.iter_mut().flatten() {
                    *g = g.affine(coef, 0.0)?;
                }
            }
        }
        Ok(norm)
    }

    /// Clamps every accumulated gradient element into `[-clip_value, clip_value]`
    /// (`torch.nn.utils.clip_grad_value_`), after unscaling under fp16.
    pub fn clip_grad_value(&self, clip_value: f64) -> Result<()> {
        if clip_value.is_nan() || clip_value < 0.0 {
            return Err(crate::AccelError::InvalidArgument(format!(
                "clip_grad_value: clip_value must be ≥ 0, got {clip_value}"
            )));
        }
        let models = self.require_models("clip_grad_value")?;
        for m in &models {
            let mut acc = lock(&m.inner.grads);
            self.unscale(&mut acc)?;
            for g in acc.grads.iter_mut().flatten() {
                *g = g.clamp(-clip_value, clip_value)?;
            }
        }
        Ok(())
    }

    /// Advances the accumulation window by one micro-step (Accelerate's `_do_sync`).
    fn advance_window(&self, st: &mut StepState) {
        let ga = self.inner.config.gradient_accumulation_steps as u64;
        if self.inner.gradient_state.end_of_dataloader() {
            st.micro_step = 0;
            st.sync_gradients = true;
        } else {
            st.micro_step += 1;
            st.sync_gradients = st.micro_step % ga == 0;
        }
    }

    /// fp16: divides the accumulated gradients by the loss scale once per optimizer step and records whether they
    /// hold inf/NaN. No-op without a scaler or when already unscaled.
    pub(crate) fn unscale(&self, acc: &mut GradAccumulator) -> Result<()> {
        let Some(scaler) = &self.inner.scaler else { return Ok(()) };
        if acc.unscaled {
            return Ok(());
        }
        let inv = 1.0 / lock(scaler).scale();
        for g in acc.grads.iter_mut().flatten() {
            *g = g.affine(inv, 0.0)?;
        }
        let present: Vec<Tensor> = acc.grads.iter().flatten().cloned().collect();
        acc.found_inf = !crate::mixed_precision::all_finite(&present)?;
        acc.unscaled = true;
        Ok(())
    }

    /// Applies an optimizer step's bookkeeping for `model`: returns the gradients to apply, or `None` when the
    /// step must not happen (not synced) or was skipped (fp16 overflow; the scale is backed off).
    pub(crate) fn take_step_gradients(&self, model: &PreparedModel) -> Result<StepGradients> {
        let mut acc = lock(&model.inner.grads);
        if !acc.synced {
            return Ok(StepGradients::NotSynced);
        }
        self.unscale(&mut acc)?;
        if let Some(scaler) = &self.inner.scaler {
            lock(scaler).update(acc.found_inf);
        }
        if acc.found_inf {
            acc.clear();
            lock(&self.inner.steps).skipped_steps += 1;
            return Ok(StepGradients::Overflow);
        }
        let grads = acc
            .grads
            .iter()
            .zip(model.master_weights())
            .map(|(g, m)| match g {
                Some(g) => Ok(g.clone()),
                None => m.as_tensor().zeros_like(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        acc.clear();
        Ok(StepGradients::Apply(grads))
    }

    /// Counts a real optimizer step.
    pub(crate) fn record_optimizer_step(&self) {
        lock(&self.inner.steps).optimizer_steps += 1;
    }
}

/// Outcome of [`Accelerator::take_step_gradients`].
pub(crate) enum StepGradients {
    /// Between syncs: do nothing.
    NotSynced,
    /// fp16 overflow: the step is skipped.
    Overflow,
    /// Apply these fp32 gradients (aligned with the master weights).
    Apply(Vec<Tensor>),
}
