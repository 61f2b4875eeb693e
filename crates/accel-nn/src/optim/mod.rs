//! Optimizers whose state can be saved and restored exactly (candle-nn's `AdamW` keeps its moments private, so a
//! resumed run could not continue bit for bit), usable at every level: a level-1 loop steps them with the
//! gradients `ddp_core::DistributedDataParallel::sync_gradients` averaged,
//! the `accel` crate wraps them in its `AcceleratedOptimizer` (sync steps only, fp16 overflow skips, fp32 master
//! weights) and re-exports them as `accel::optim::*`.
//!
//! [`AdamW`] is also fast on the CPU: it updates a CPU f32 parameter in one in-place pass (compiled for AVX2 where
//! the CPU has it), where candle-nn's `AdamW` allocates several parameter-sized temporaries per parameter and
//! step; the measured times, against PyTorch's AdamW, are in `docs/benchmarks.md` ("One training step vs
//! PyTorch", "Allocator").
//!
//! - [`Sgd`]: `torch.optim.SGD` (momentum, dampening, Nesterov momentum after Sutskever et al., "On the importance
//!   of initialization and momentum in deep learning", ICML 2013, weight decay as L2 added to the gradient).
//! - [`AdamW`]: `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, on
//!   Adam by Kingma & Ba 2015, with bias correction).

mod adamw;
mod adamw_cpu;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use sgd::{Sgd, SgdConfig};

use crate::state::StateDict;
use crate::{NnError, Result};
use candle_core::{Tensor, Var};

/// An optimizer that updates parameters in place from their gradients and whose state can be checkpointed.
///
/// A level-1 loop calls [`Optimizer::step`] after `DistributedDataParallel::sync_gradients`; the Accelerator
/// calls it with the fp32 master weights and their averaged fp32 gradients (same order, same shapes). A `None`
/// gradient means the parameter got none (no rank used it under `find_unused_parameters`): the optimizer leaves
/// that parameter and its state alone — no update, no weight decay, no step count — as PyTorch's optimizers skip a
/// parameter whose `.grad` is `None`. Per-parameter state is keyed by the parameter's position in `params`, which
/// must be the same on every call (the prepared model's sorted `VarMap` names; at level 1, keep one `Vec<Var>`).
///
/// Level 1 builds the slots from candle's `GradStore` with [`grads_for`]:
/// `opt.step(&vars, &grads_for(&vars, &grads))`.
///
/// Errors are [`NnError`]s (`accel` turns them into its `AccelError`, keeping the variant for configuration,
/// checkpoint and JSON errors).
pub trait Optimizer: Send + 'static {
    /// One update: `params[i]` moves along `grads[i]` (same shape and dtype) unless `grads[i]` is `None`. Errors
    /// on length or shape mismatch (naming the parameter index).
    fn step(&mut self, params: &[Var], grads: &[Option<Tensor>]) -> Result<()>;
    /// The current learning rate.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate (schedulers call this before each step).
    fn set_learning_rate(&mut self, lr: f64);
    /// Hyper-parameters, step counters and per-parameter buffers (tensors named `{index}.{buffer}`).
    fn state_dict(&self) -> Result<StateDict>;
    /// Restores [`Optimizer::state_dict`]'s output; buffers are checked against the parameters on the next step.
    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()>;
}

/// One gradient slot per parameter, in `vars` order, from candle's `GradStore` (what [`Optimizer::step`] takes):
/// `None` where backward gave the parameter no gradient.
pub fn grads_for(vars: &[Var], grads: &candle_core::backprop::GradStore) -> Vec<Option<Tensor>> {
    vars.iter().map(|v| grads.get(v.as_tensor()).cloned()).collect()
}

/// Checks that `grads` matches `params` one to one (count, and shapes where a gradient is present).
pub(crate) fn check_grads(who: &str, params: &[Var], grads: &[Option<Tensor>]) -> Result<()> {
    if params.len() != grads.len() {
        return Err(NnError::InvalidArgument(format!(
            "{who}.step: {} parameters but {} gradients; pass one gradient slot per parameter, in the same order",
            params.len(),
            grads.len()
        )));
    }
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        if let Some(g) = g {
            if p.shape() != g.shape() {
                return Err(NnError::InvalidArgument(format!(
                    "{who}.step: parameter {i} has shape {:?} but its gradient has shape {:?}",
                    p.shape(),
                    g.shape()
                )));
            }
        }
    }
    Ok(())
}

/// Checks a restored buffer against its parameter (shape) before first use.
pub(crate) fn check_buffer(who: &str, name: &str, i: usize, buf: &Tensor, p: &Var) -> Result<()> {
    if buf.shape() != p.shape() {
        return Err(NnError::InvalidArgument(format!(
            "{who}: restored buffer {i}.{name} has shape {:?} but parameter {i} has shape {:?}; the checkpoint was \
             written for a different model",
            buf.shape(),
            p.shape()
        )));
    }
    Ok(())
}

/// Rewrites every per-parameter tensor of an optimizer state (the `{param index}.{buffer}` keys
/// `OptimizerState::to_state_dict` writes) with `f(param index, tensor)`; other entries are kept. Checkpoints
/// of tensor-parallel runs gather the buffers of sharded parameters this way, and slice them on load.
///
/// Errors: the first error `f` returns (its own error type, so callers keep theirs).
pub fn map_param_tensors<E>(
    mut sd: StateDict,
    mut f: impl FnMut(usize, Tensor) -> std::result::Result<Tensor, E>,
) -> std::result::Result<StateDict, E> {
    let tensors = std::mem::take(&mut sd.tensors);
    for (key, t) in tensors {
        let param = key.split_once('.').and_then(|(i, _)| i.parse::<usize>().ok());
        let t = match param {
            Some(i) => f(i, t)?,
            None => t,
        };
        sd.tensors.insert(key, t);
    }
    Ok(sd)
}

/// The state every optimizer here checkpoints: which optimizer, its hyper-parameters, `step` calls, each
/// parameter's update count (PyTorch's `state[p]["step"]`), and named per-parameter buffers (`buffers[b][i]` =
/// buffer `BUFFERS[b]` of parameter `i`). One format and one reader for all of them.
#[derive(Debug, Clone)]
pub(crate) struct OptimizerState<C> {
    pub(crate) config: C,
    pub(crate) steps: u64,
    pub(crate) param_steps: Vec<u64>,
    pub(crate) buffers: Vec<Vec<Option<Tensor>>>,
}

impl<C: serde::Serialize + serde::de::DeserializeOwned> OptimizerState<C> {
    /// Fresh state for `config`.
    pub(crate) fn new(config: C, num_buffers: usize) -> Self {
        OptimizerState { config, steps: 0, param_steps: Vec::new(), buffers: vec![Vec::new(); num_buffers] }
    }

    /// Sizes the per-parameter state for `n` parameters on the first step; later a different `n` is an error.
    pub(crate) fn ensure_params(&mut self, who: &str, n: usize) -> Result<()> {
        if self.param_steps.len() == n {
            return Ok(());
        }
        if self.param_steps.iter().any(|&s| s > 0) {
            return Err(NnError::InvalidArgument(format!(
                "{who}.step: state is for {} parameters but {n} were given",
                self.param_steps.len()
            )));
        }
        self.param_steps = vec![0; n];
        self.buffers.iter_mut().for_each(|b| *b = vec![None; n]);
        Ok(())
    }

    /// The state dict: meta `{optimizer: kind, config, steps, num_params, param_steps}` and tensors
    /// `{i}.{buffer}`.
    pub(crate) fn to_state_dict(&self, kind: &str, names: &[&str]) -> Result<StateDict> {
        let mut sd = StateDict::from_meta(serde_json::json!({
            "optimizer": kind,
            "config": self.config,
            "steps": self.steps,
            "num_params": self.param_steps.len(),
            "param_steps": self.param_steps,
        }));
        for (name, bufs) in names.iter().zip(&self.buffers) {
            for (i, b) in bufs.iter().enumerate() {
                if let Some(b) = b {
                    // A copy: optimizers update their buffers in place, which must not reach a saved state.
                    sd.tensors.insert(format!("{i}.{name}"), b.copy()?);
                }
            }
        }
        Ok(sd)
    }

    /// Reads [`Self::to_state_dict`]'s output back. A checkpoint from before per-parameter counts existed counts
    /// `steps` for every parameter that has buffers. Errors: another optimizer's state, missing fields.
    pub(crate) fn from_state_dict(sd: &StateDict, kind: &str, who: &str, names: &[&str]) -> Result<Self> {
        let written_by: String = sd.meta_field("optimizer")?;
        if written_by != kind {
            return Err(NnError::InvalidArgument(format!(
                "{who}.load_state_dict: the state was written by optimizer {written_by:?}, not {kind:?}"
            )));
        }
        let config: C = sd.meta_field("config")?;
        let steps: u64 = sd.meta_field("steps")?;
        let n: usize = sd.meta_field("num_params")?;
        // Copies: the optimizers update their buffers in place, which must not reach the caller's state dict.
        let buffers: Vec<Vec<Option<Tensor>>> = names
            .iter()
            .map(|name| {
                (0..n)
                    .map(|i| sd.tensors.get(&format!("{i}.{name}")).map(Tensor::copy).transpose())
                    .collect::<candle_core::Result<Vec<_>>>()
            })
            .collect::<candle_core::Result<_>>()?;
        let param_steps = match sd.meta.get("param_steps") {
            Some(_) => sd.meta_field("param_steps")?,
            None => (0..n).map(|i| if buffers.iter().any(|b| b[i].is_some()) { steps } else { 0 }).collect(),
        };
        Ok(OptimizerState { config, steps, param_steps, buffers })
    }
}
