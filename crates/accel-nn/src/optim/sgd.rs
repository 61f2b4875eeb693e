//! Stochastic gradient descent with momentum, as `torch.optim.SGD`.

use super::{check_buffer, check_grads, Optimizer, OptimizerState};
use crate::state::StateDict;
use crate::{NnError, Result};
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

/// Hyper-parameters of [`Sgd`] (defaults: momentum 0, dampening 0, weight decay 0, no Nesterov).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate `lr`.
    pub lr: f64,
    /// Momentum factor μ (0 = plain SGD).
    pub momentum: f64,
    /// Dampening τ of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty λ added to the gradient (`g + λ·p`, coupled weight decay).
    pub weight_decay: f64,
    /// Nesterov momentum (Sutskever et al. 2013); needs momentum > 0 and dampening 0.
    pub nesterov: bool,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        SgdConfig { lr, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

/// `torch.optim.SGD`. With gradient `g`, parameter `p` and momentum buffer `b` (per parameter):
///
/// ```text
/// g ← g + λ·p                                  (weight_decay λ ≠ 0)
/// b ← g on the first step, else μ·b + (1 − τ)·g (momentum μ ≠ 0)
/// g ← g + μ·b if nesterov, else b
/// p ← p − lr·g
/// ```
#[derive(Debug)]
pub struct Sgd {
    /// Hyper-parameters, step counts and the `momentum_buffer` of each parameter.
    state: OptimizerState<SgdConfig>,
}

/// Names of SGD's per-parameter buffers (PyTorch's).
const BUFFERS: [&str; 1] = ["momentum_buffer"];
const MOMENTUM: usize = 0;

impl Sgd {
    /// A new optimizer. Errors: negative lr/momentum/weight decay, Nesterov without momentum or with dampening.
    pub fn new(cfg: SgdConfig) -> Result<Self> {
        let bad = |what: &str, v: f64| NnError::Config {
            key: format!("SgdConfig.{what}"),
            value: v.to_string(),
            reason: "must be a finite number ≥ 0".into(),
        };
        for (what, v) in [("lr", cfg.lr), ("momentum", cfg.momentum), ("weight_decay", cfg.weight_decay)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(what, v));
            }
        }
        if cfg.nesterov && (cfg.momentum <= 0.0 || cfg.dampening != 0.0) {
            return Err(NnError::Config {
                key: "SgdConfig.nesterov".into(),
                value: "true".into(),
                reason: format!(
                    "Nesterov momentum requires momentum > 0 and dampening = 0 (got momentum {}, dampening {})",
                    cfg.momentum, cfg.dampening
                ),
            });
        }
        Ok(Sgd { state: OptimizerState::new(cfg, BUFFERS.len()) })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.state.config
    }

    /// `step` calls so far.
    pub fn steps(&self) -> u64 {
        self.state.steps
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[Var], grads: &[Option<Tensor>]) -> Result<()> {
        check_grads("Sgd", params, grads)?;
        self.state.ensure_params("Sgd", params.len())?;
        let c = self.state.config;
        let st = &mut self.state;
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let mut g = g.clone();
            if c.weight_decay != 0.0 {
                g = (g + p.as_tensor().affine(c.weight_decay, 0.0)?)?;
            }
            if c.momentum != 0.0 {
                let buf = match st.buffers[MOMENTUM][i].take() {
                    None => g.clone(),
                    Some(b) => {
                        check_buffer("Sgd", "momentum_buffer", i, &b, p)?;
                        (b.affine(c.momentum, 0.0)? + g.affine(1.0 - c.dampening, 0.0)?)?
                    }
                };
                g = if c.nesterov { (g + buf.affine(c.momentum, 0.0)?)? } else { buf.clone() };
                st.buffers[MOMENTUM][i] = Some(buf);
            }
            p.set(&(p.as_tensor() - g.affine(c.lr, 0.0)?)?)?;
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
        self.state.to_state_dict("sgd", &BUFFERS)
    }

    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        self.state = OptimizerState::from_state_dict(sd, "sgd", "Sgd", &BUFFERS)?;
        Ok(())
    }
}
