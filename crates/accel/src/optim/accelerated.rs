//! [`AcceleratedOptimizer`]: what `Accelerator::prepare_optimizer` returns.

use super::Optimizer;
use crate::model::PreparedModel;
use crate::step::{StepController, StepOutcome};
use crate::{lock, Result};
use std::sync::{Arc, Mutex, MutexGuard};

/// An optimizer bound to a prepared model and the Accelerator's accumulation window.
///
/// `step` applies the window's averaged fp32 gradients to the master weights only on sync steps (it returns
/// `false` and does nothing in between), skips the step when fp16 gradients overflowed (returns `false`,
/// [`AcceleratedOptimizer::step_was_skipped`] is then true, the loss scale is halved), and copies the updated
/// masters into the model's compute-dtype `Var`s. It receives the gradients from the Accelerator's step owner,
/// which drops them after the step, so a candle loop needs no `zero_grad`; it is there for PyTorch-shaped loops
/// and is a no-op between syncs.
pub struct AcceleratedOptimizer<O: Optimizer> {
    /// The Accelerator's step owner (shared with it): where the gradients come from.
    step: Arc<StepController>,
    model: PreparedModel,
    opt: Arc<Mutex<O>>,
    skipped: bool,
}

impl<O: Optimizer> std::fmt::Debug for AcceleratedOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceleratedOptimizer")
            .field("learning_rate", &self.learning_rate())
            .field("step_was_skipped", &self.skipped)
            .finish()
    }
}

impl<O: Optimizer> AcceleratedOptimizer<O> {
    pub(crate) fn new(step: Arc<StepController>, model: PreparedModel, opt: Arc<Mutex<O>>) -> Self {
        AcceleratedOptimizer { step, model, opt, skipped: false }
    }

    /// Takes an optimizer step if this micro-step synced gradients. Returns `true` when the parameters were
    /// updated; `false` between syncs and when an fp16 overflow skipped the step (do not step the LR scheduler
    /// then).
    pub fn step(&mut self) -> Result<bool> {
        let (opt, model) = (&self.opt, &self.model);
        let outcome = self.step.optimizer_step(model, |grads| Ok(lock(opt).step(model.optimizer_params(), grads)?))?;
        match outcome {
            StepOutcome::NotSynced => Ok(false),
            StepOutcome::Overflow => {
                self.skipped = true;
                tracing::debug!("fp16 gradients overflowed: optimizer step skipped, loss scale backed off");
                Ok(false)
            }
            StepOutcome::Applied => {
                // The groups' strategies follow up (a sharded group gathers its slices), then the compute copies.
                self.model.after_optimizer_step()?;
                self.skipped = false;
                Ok(true)
            }
        }
    }

    /// Drops the window's gradients on a sync step; a no-op between syncs (as Accelerate's).
    pub fn zero_grad(&mut self) {
        self.step.zero_grad(&self.model);
    }

    /// The current learning rate.
    pub fn learning_rate(&self) -> f64 {
        lock(&self.opt).learning_rate()
    }

    /// Sets the learning rate (what an LR scheduler does after each real step).
    pub fn set_learning_rate(&mut self, lr: f64) {
        lock(&self.opt).set_learning_rate(lr)
    }

    /// Whether the last sync step was skipped because fp16 gradients held inf/NaN.
    pub fn step_was_skipped(&self) -> bool {
        self.skipped
    }

    /// The wrapped optimizer (e.g. to read its state).
    pub fn optimizer(&self) -> MutexGuard<'_, O> {
        lock(&self.opt)
    }

    /// The model this optimizer updates.
    pub fn model(&self) -> &PreparedModel {
        &self.model
    }
}
