//! Adam with decoupled weight decay, as `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization", ICLR 2019; Adam: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015).

use super::{adamw_cpu, check_buffer, check_grads, Optimizer, OptimizerState};
use crate::ops::fused_ops_enabled;
use crate::state::StateDict;
use crate::{NnError, Result};
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
        let bad = |what: &str, v: f64, reason: &str| NnError::Config {
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
            let m_old = st.buffers[EXP_AVG][i].take();
            let v_old = st.buffers[EXP_AVG_SQ][i].take();
            if let Some(m) = &m_old {
                check_buffer("AdamW", "exp_avg", i, m, p)?;
            }
            if let Some(v) = &v_old {
                check_buffer("AdamW", "exp_avg_sq", i, v, p)?;
            }
            let (m, v) = if fused_ops_enabled() && adamw_cpu::applies(p.as_tensor(), g) {
                // One in-place pass, bit-identical to the composed ops. The moments start at zero, which the
                // composed path's first step (`(1−β)·g`) equals exactly. The optimizer owns its buffers'
                // storage (state_dict and load_state_dict copy), so writing them in place touches nothing else.
                let g = g.contiguous()?;
                let m = adamw_cpu::owned_buffer(m_old, p.as_tensor())?;
                let v = adamw_cpu::owned_buffer(v_old, p.as_tensor())?;
                let coefficients = adamw_cpu::Coefficients::new(&c, step_size, bias_correction2_sqrt);
                adamw_cpu::step_in_place(p.as_tensor(), &g, &m, &v, coefficients)?;
                (m, v)
            } else {
                composed_update(p, g, m_old, v_old, &c, step_size, bias_correction2_sqrt)?
            };
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
            return Err(NnError::InvalidArgument(format!(
                "AdamW.load_state_dict: parameter {i} was updated {} time(s) but the state lacks its \
                 exp_avg/exp_avg_sq tensors",
                state.param_steps[i]
            )));
        }
        self.state = state;
        Ok(())
    }
}

/// The update in candle's composed ops (any device and dtype): sets `p` and returns the new `(m, v)`.
fn composed_update(
    p: &Var,
    g: &Tensor,
    m: Option<Tensor>,
    v: Option<Tensor>,
    c: &AdamWConfig,
    step_size: f64,
    bias_correction2_sqrt: f64,
) -> Result<(Tensor, Tensor)> {
    let m = match m {
        Some(m) => (m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?,
        None => g.affine(1.0 - c.beta1, 0.0)?,
    };
    let v = match v {
        Some(v) => (v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?,
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
    Ok((m, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Deterministic values with both signs, zeros (−0 and +0) and a spread of magnitudes.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(97)) % 2001) as f32;
                match i % 17 {
                    0 => 0.0,
                    1 => -0.0,
                    _ => (x - 1000.0) * 1e-3 * (1 + i % 5) as f32,
                }
            })
            .collect()
    }

    /// The in-place pass and the composed ops give the same bits for p, m and v over several steps, with and
    /// without weight decay (`adamw_cpu`'s promise), from the pass's AVX2 build and from its baseline build (on a
    /// CPU without AVX2 both take the baseline).
    #[test]
    fn in_place_pass_is_bit_identical_to_the_composed_ops() {
        in_place_pass_matches_composed_ops();
        crate::ops::cpu_f32::baseline_only(in_place_pass_matches_composed_ops);
    }

    fn in_place_pass_matches_composed_ops() {
        for weight_decay in [0.0, 1e-2] {
            let c = AdamWConfig { lr: 3e-3, weight_decay, ..Default::default() };
            let n = 1031;
            let init = Tensor::from_vec(values(n, 1), n, &Device::Cpu).unwrap();
            let (p_fused, p_composed) = (Var::from_tensor(&init).unwrap(), Var::from_tensor(&init).unwrap());
            type Moments = Option<(Tensor, Tensor)>;
            let (mut mv_fused, mut mv_composed): (Moments, Moments) = (None, None);
            for t in 1..=4 {
                let g = Tensor::from_vec(values(n, 10 + t), n, &Device::Cpu).unwrap();
                let bias_correction2_sqrt = (1.0 - c.beta2.powi(t as i32)).sqrt();
                let step_size = c.lr / (1.0 - c.beta1.powi(t as i32));
                let (m, v) = mv_composed.take().unzip();
                mv_composed =
                    Some(composed_update(&p_composed, &g, m, v, &c, step_size, bias_correction2_sqrt).unwrap());
                let (m, v) = mv_fused.take().unzip();
                let m = adamw_cpu::owned_buffer(m, p_fused.as_tensor()).unwrap();
                let v = adamw_cpu::owned_buffer(v, p_fused.as_tensor()).unwrap();
                let coefficients = adamw_cpu::Coefficients::new(&c, step_size, bias_correction2_sqrt);
                assert!(adamw_cpu::applies(p_fused.as_tensor(), &g));
                adamw_cpu::step_in_place(p_fused.as_tensor(), &g, &m, &v, coefficients).unwrap();
                mv_fused = Some((m, v));
                let bits = |t: &Tensor| t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let (mf, vf) = mv_fused.as_ref().unwrap();
                let (mc, vc) = mv_composed.as_ref().unwrap();
                assert_eq!(bits(p_fused.as_tensor()), bits(p_composed.as_tensor()), "p, step {t}, λ {weight_decay}");
                assert_eq!(bits(mf), bits(mc), "m, step {t}");
                assert_eq!(bits(vf), bits(vc), "v, step {t}");
                assert_ne!(bits(p_fused.as_tensor()), bits(&init), "the update moved nothing");
            }
        }
    }
}
