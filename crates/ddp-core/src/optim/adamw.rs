//! Adam with decoupled weight decay, as `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization", ICLR 2019; Adam: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015).

use super::{check_buffer, check_grads, Optimizer, OptimizerState};
use crate::state::StateDict;
use crate::{DdpError, Result};
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

/// Hyper-parameters of [`AdamW`]; `Default` is PyTorch's (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate `lr`.
    pub lr: f64,
    /// Decay β₁ of the first-moment (mean) estimate.
    pub beta1: f64,
    /// Decay β₂ of the second-moment (uncentred variance) estimate.
    pub beta2: f64,
    /// ε added to the denominator for numerical stability.
    pub eps: f64,
    /// Decoupled weight decay λ: `p ← p·(1 − lr·λ)` before the Adam update.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 }
    }
}

impl AdamWConfig {
    /// PyTorch's defaults with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        AdamWConfig { lr, ..Default::default() }
    }
}

/// `torch.optim.AdamW`. At parameter `p`'s update `t` (from 1; counted per parameter, as PyTorch's
/// `state[p]["step"]`), with gradient `g` and moments `m`, `v`:
///
/// ```text
/// p ← p·(1 − lr·λ)
/// m ← β₁·m + (1 − β₁)·g
/// v ← β₂·v + (1 − β₂)·g²
/// p ← p − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + ε)
/// ```
///
/// A parameter whose gradient slot is `None` is skipped entirely (no decay, no moment update, `t` unchanged).
#[derive(Debug)]
pub struct AdamW {
    /// Hyper-parameters, step counts and the buffers `exp_avg` (`m`) and `exp_avg_sq` (`v`).
    state: OptimizerState<AdamWConfig>,
}

/// Names of AdamW's per-parameter buffers, in `OptimizerState::buffers` order (PyTorch's names).
const BUFFERS: [&str; 2] = ["exp_avg", "exp_avg_sq"];
const EXP_AVG: usize = 0;
const EXP_AVG_SQ: usize = 1;

impl AdamW {
    /// A new optimizer. Errors: negative lr/eps/weight decay, betas outside `[0, 1)`.
    pub fn new(cfg: AdamWConfig) -> Result<Self> {
        let bad = |what: &str, v: f64, reason: &str| DdpError::Config {
            key: format!("AdamWConfig.{what}"),
            value: v.to_string(),
            reason: reason.into(),
        };
        for (what, v) in [("lr", cfg.lr), ("eps", cfg.eps), ("weight_decay", cfg.weight_decay)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(what, v, "must be a finite number ≥ 0"));
            }
        }
        for (what, v) in [("beta1", cfg.beta1), ("beta2", cfg.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(bad(what, v, "must be in [0, 1)"));
            }
        }
        Ok(AdamW { state: OptimizerState::new(cfg, BUFFERS.len()) })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.state.config
    }

    /// `step` calls so far.
    pub fn steps(&self) -> u64 {
        self.state.steps
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[Var], grads: &[Option<Tensor>]) -> Result<()> {
        check_grads("AdamW", params, grads)?;
        self.state.ensure_params("AdamW", params.len())?;
        let c = self.state.config;
        let st = &mut self.state;
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let t = (st.param_steps[i] + 1) as i32;
            let bias_correction1 = 1.0 - c.beta1.powi(t);
            let bias_correction2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
            let step_size = c.lr / bias_correction1;
            let m = match st.buffers[EXP_AVG][i].take() {
                Some(m) => {
                    check_buffer("AdamW", "exp_avg", i, &m, p)?;
                    (m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?
                }
                None => g.affine(1.0 - c.beta1, 0.0)?,
            };
            let v = match st.buffers[EXP_AVG_SQ][i].take() {
                Some(v) => {
                    check_buffer("AdamW", "exp_avg_sq", i, &v, p)?;
                    (v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?
                }
                None => g.sqr()?.affine(1.0 - c.beta2, 0.0)?,
            };
            let decayed = if c.weight_decay != 0.0 {
                p.as_tensor().affine(1.0 - c.lr * c.weight_decay, 0.0)?
            } else {
                p.as_tensor().clone()
            };
            let denom = v.sqrt()?.affine(1.0 / bias_correction2_sqrt, c.eps)?;
            let update = m.div(&denom)?.affine(step_size, 0.0)?;
            p.set(&(decayed - update)?)?;
            st.buffers[EXP_AVG][i] = Some(m);
            st.buffers[EXP_AVG_SQ][i] = Some(v);
            st.param_steps[i] += 1;
        }
        st.steps += 1;
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.state.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.state.config.lr = lr;
    }

    fn state_dict(&self) -> Result<StateDict> {
        self.state.to_state_dict("adamw", &BUFFERS)
    }

    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        let state = OptimizerState::<AdamWConfig>::from_state_dict(sd, "adamw", "AdamW", &BUFFERS)?;
        if let Some(i) = (0..state.param_steps.len())
            .find(|&i| state.param_steps[i] > 0 && state.buffers.iter().any(|b| b[i].is_none()))
        {
            return Err(DdpError::InvalidArgument(format!(
                "AdamW.load_state_dict: parameter {i} was updated {} time(s) but the state lacks its \
                 exp_avg/exp_avg_sq tensors",
                state.param_steps[i]
            )));
        }
        self.state = state;
        Ok(())
    }
}
