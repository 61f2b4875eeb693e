//! Optimizers whose state can be saved and restored exactly (candle-nn's `AdamW` keeps its moments private, so a
//! resumed run could not continue bit for bit), and [`AcceleratedOptimizer`], the wrapper `prepare_optimizer`
//! returns: it steps only on gradient-sync steps, unscales and skips fp16 overflow steps, and copies updated fp32
//! master weights back into the model's compute-dtype `Var`s.
//!
//! - [`Sgd`]: `torch.optim.SGD` (momentum, dampening, Nesterov momentum after Sutskever et al., "On the importance
//!   of initialization and momentum in deep learning", ICML 2013, weight decay as L2 added to the gradient).
//! - [`AdamW`]: `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, on
//!   Adam by Kingma & Ba 2015, with bias correction).

mod accelerated;
mod adamw;
mod sgd;

pub use accelerated::AcceleratedOptimizer;
pub use adamw::{AdamW, AdamWConfig};
pub use sgd::{Sgd, SgdConfig};

use crate::state::StateDict;
use crate::Result;
use candle_core::{Tensor, Var};

/// An optimizer that updates parameters in place from their gradients and whose state can be checkpointed.
///
/// The Accelerator calls [`Optimizer::step`] with the fp32 master weights and the averaged fp32 gradients (same
/// order, same shapes). Per-parameter state is keyed by the parameter's position in `params`, which is the same on
/// every call (the prepared model's sorted `VarMap` names).
pub trait Optimizer: Send + 'static {
    /// One update: `params[i]` moves along `grads[i]` (same shape and dtype). Errors on length or shape mismatch
    /// (naming the parameter index).
    fn step(&mut self, params: &[Var], grads: &[Tensor]) -> Result<()>;
    /// The current learning rate.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate (schedulers call this before each step).
    fn set_learning_rate(&mut self, lr: f64);
    /// Hyper-parameters, step counter and per-parameter buffers (tensors named `{index}.{buffer}`).
    fn state_dict(&self) -> Result<StateDict>;
    /// Restores [`Optimizer::state_dict`]'s output; buffers are checked against the parameters on the next step.
    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()>;
}

/// Checks that `grads` matches `params` one to one (count and shapes).
pub(crate) fn check_grads(who: &str, params: &[Var], grads: &[Tensor]) -> Result<()> {
    if params.len() != grads.len() {
        return Err(crate::AccelError::InvalidArgument(format!(
            "{who}.step: {} parameters but {} gradients; pass one gradient per parameter, in the same order",
            params.len(),
            grads.len()
        )));
    }
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        if p.shape() != g.shape() {
            return Err(crate::AccelError::InvalidArgument(format!(
                "{who}.step: parameter {i} has shape {:?} but its gradient has shape {:?}",
                p.shape(),
                g.shape()
            )));
        }
    }
    Ok(())
}

/// Reads per-parameter buffers `{index}.{name}` back from a state dict (`None` where absent).
pub(crate) fn buffers_from(sd: &StateDict, name: &str, count: usize) -> Vec<Option<Tensor>> {
    (0..count).map(|i| sd.tensors.get(&format!("{i}.{name}")).cloned()).collect()
}

/// Checks a restored buffer against its parameter (shape) before first use.
pub(crate) fn check_buffer(who: &str, name: &str, i: usize, buf: &Tensor, p: &Var) -> Result<()> {
    if buf.shape() != p.shape() {
        return Err(crate::AccelError::InvalidArgument(format!(
            "{who}: restored buffer {i}.{name} has shape {:?} but parameter {i} has shape {:?}; the checkpoint was \
             written for a different model",
            buf.shape(),
            p.shape()
        )));
    }
    Ok(())
}
