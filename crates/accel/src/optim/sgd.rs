//! Stochastic gradient descent with momentum, as `torch.optim.SGD`.

use super::{buffers_from, check_buffer, check_grads, Optimizer};
use crate::state::StateDict;
use crate::{AccelError, Result};
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
    cfg: SgdConfig,
    momentum_buffers: Vec<Option<Tensor>>,
    steps: u64,
}

impl Sgd {
    /// A new optimizer. Errors: negative lr/momentum/weight decay, Nesterov without momentum or with dampening.
    pub fn new(cfg: SgdConfig) -> Result<Self> {
        let bad = |what: &str, v: f64| AccelError::Config {
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
            return Err(AccelError::Config {
                key: "SgdConfig.nesterov".into(),
                value: "true".into(),
                reason: format!(
                    "Nesterov momentum requires momentum > 0 and dampening = 0 (got momentum {}, dampening {})",
                    cfg.momentum, cfg.dampening
                ),
            });
        }
        Ok(Sgd { cfg, momentum_buffers: Vec::new(), steps: 0 })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[Var], grads: &[Tensor]) -> Result<()> {
        check_grads("Sgd", params, grads)?;
        let c = self.cfg;
        if self.momentum_buffers.len() != params.len() {
            if self.momentum_buffers.iter().any(Option::is_some) {
                return Err(AccelError::InvalidArgument(format!(
                    "Sgd.step: state has {} momentum buffers but {} parameters were given",
                    self.momentum_buffers.len(),
                    params.len()
                )));
            }
            self.momentum_buffers = vec![None; params.len()];
        }
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let mut g = g.clone();
            if c.weight_decay != 0.0 {
                g = (g + p.as_tensor().affine(c.weight_decay, 0.0)?)?;
            }
            if c.momentum != 0.0 {
                let buf = match self.momentum_buffers[i].take() {
                    None => g.clone(),
                    Some(b) => {
                        check_buffer("Sgd", "momentum_buffer", i, &b, p)?;
                        (b.affine(c.momentum, 0.0)? + g.affine(1.0 - c.dampening, 0.0)?)?
                    }
                };
                g = if c.nesterov { (g + buf.affine(c.momentum, 0.0)?)? } else { buf.clone() };
                self.momentum_buffers[i] = Some(buf);
            }
            p.set(&(p.as_tensor() - g.affine(c.lr, 0.0)?)?)?;
        }
        self.steps += 1;
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.cfg.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    fn state_dict(&self) -> Result<StateDict> {
        let mut sd = StateDict::from_meta(serde_json::json!({
            "optimizer": "sgd",
            "config": self.cfg,
            "steps": self.steps,
            "num_params": self.momentum_buffers.len(),
        }));
        for (i, b) in self.momentum_buffers.iter().enumerate() {
            if let Some(b) = b {
                sd.tensors.insert(format!("{i}.momentum_buffer"), b.clone());
            }
        }
        Ok(sd)
    }

    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        let kind: String = sd.meta_field("optimizer")?;
        if kind != "sgd" {
            return Err(AccelError::InvalidArgument(format!(
                "Sgd.load_state_dict: the state was written by optimizer {kind:?}, not \"sgd\""
            )));
        }
        self.cfg = sd.meta_field("config")?;
        self.steps = sd.meta_field("steps")?;
        let n: usize = sd.meta_field("num_params")?;
        self.momentum_buffers = buffers_from(sd, "momentum_buffer", n);
        Ok(())
    }
}
