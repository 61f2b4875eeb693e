//! Adam with decoupled weight decay, as `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization", ICLR 2019; Adam: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015).

use super::{buffers_from, check_buffer, check_grads, Optimizer};
use crate::state::StateDict;
use crate::{AccelError, Result};
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

/// `torch.optim.AdamW`. At step `t` (from 1), with gradient `g`, parameter `p`, moments `m`, `v` (per parameter):
///
/// ```text
/// p ← p·(1 − lr·λ)
/// m ← β₁·m + (1 − β₁)·g
/// v ← β₂·v + (1 − β₂)·g²
/// p ← p − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + ε)
/// ```
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    exp_avg: Vec<Option<Tensor>>,
    exp_avg_sq: Vec<Option<Tensor>>,
    steps: u64,
}

impl AdamW {
    /// A new optimizer. Errors: negative lr/eps/weight decay, betas outside `[0, 1)`.
    pub fn new(cfg: AdamWConfig) -> Result<Self> {
        let bad = |what: &str, v: f64, reason: &str| AccelError::Config {
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
        Ok(AdamW { cfg, exp_avg: Vec::new(), exp_avg_sq: Vec::new(), steps: 0 })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Optimizer steps taken (`t` of the bias correction).
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[Var], grads: &[Tensor]) -> Result<()> {
        check_grads("AdamW", params, grads)?;
        if self.exp_avg.len() != params.len() {
            if self.steps > 0 {
                return Err(AccelError::InvalidArgument(format!(
                    "AdamW.step: state has moments for {} parameters but {} were given",
                    self.exp_avg.len(),
                    params.len()
                )));
            }
            self.exp_avg = vec![None; params.len()];
            self.exp_avg_sq = vec![None; params.len()];
        }
        let c = self.cfg;
        let t = (self.steps + 1) as i32;
        let bias_correction1 = 1.0 - c.beta1.powi(t);
        let bias_correction2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        let step_size = c.lr / bias_correction1;
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let m = match self.exp_avg[i].take() {
                Some(m) => {
                    check_buffer("AdamW", "exp_avg", i, &m, p)?;
                    (m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?
                }
                None => g.affine(1.0 - c.beta1, 0.0)?,
            };
            let v = match self.exp_avg_sq[i].take() {
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
            self.exp_avg[i] = Some(m);
            self.exp_avg_sq[i] = Some(v);
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
            "optimizer": "adamw",
            "config": self.cfg,
            "steps": self.steps,
            "num_params": self.exp_avg.len(),
        }));
        for (i, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            if let (Some(m), Some(v)) = (m, v) {
                sd.tensors.insert(format!("{i}.exp_avg"), m.clone());
                sd.tensors.insert(format!("{i}.exp_avg_sq"), v.clone());
            }
        }
        Ok(sd)
    }

    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        let kind: String = sd.meta_field("optimizer")?;
        if kind != "adamw" {
            return Err(AccelError::InvalidArgument(format!(
                "AdamW.load_state_dict: the state was written by optimizer {kind:?}, not \"adamw\""
            )));
        }
        self.cfg = sd.meta_field("config")?;
        self.steps = sd.meta_field("steps")?;
        let n: usize = sd.meta_field("num_params")?;
        self.exp_avg = buffers_from(sd, "exp_avg", n);
        self.exp_avg_sq = buffers_from(sd, "exp_avg_sq", n);
        if self.steps > 0 && self.exp_avg.iter().chain(&self.exp_avg_sq).any(Option::is_none) {
            return Err(AccelError::InvalidArgument(format!(
                "AdamW.load_state_dict: state at step {} lacks some of the {n} parameters' exp_avg/exp_avg_sq tensors",
                self.steps
            )));
        }
        Ok(())
    }
}
