//! fp16 dynamic loss scaling ([`GradScaler`], as `torch.cuda.amp.GradScaler`; Micikevicius et al., "Mixed
//! Precision Training", ICLR 2018).
//!
//! fp16's smallest normal value is 6.1e-5, so small gradients underflow to zero. The loss is multiplied by a large
//! scale before backward and the gradients divided by it before the optimizer step. When the scaled gradients
//! overflow (inf/NaN) the step is skipped and the scale halved; after `growth_interval` clean steps it doubles.

use crate::state::{StateDict, Stateful};
use crate::{AccelError, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

/// Parameters of [`GradScaler`]; `Default` is PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScalerConfig {
    /// Initial scale (default 65536 = 2¹⁶).
    pub init_scale: f64,
    /// Scale multiplier after `growth_interval` consecutive clean steps (default 2).
    pub growth_factor: f64,
    /// Scale multiplier on an overflow (default 0.5).
    pub backoff_factor: f64,
    /// Clean steps before growing (default 2000).
    pub growth_interval: u64,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

/// Dynamic loss scale state: the current scale and the number of clean steps since it last changed.
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    cfg: GradScalerConfig,
    scale: f64,
    growth_tracker: u64,
}

impl GradScaler {
    /// A scaler at `cfg.init_scale`. Errors on a non-positive scale, growth ≤ 1, backoff outside (0, 1), or a zero
    /// growth interval.
    pub fn new(cfg: GradScalerConfig) -> Result<Self> {
        let bad = |key: &str, v: String, reason: &str| AccelError::Config {
            key: format!("GradScalerConfig.{key}"),
            value: v,
            reason: reason.into(),
        };
        if !(cfg.init_scale > 0.0 && cfg.init_scale.is_finite()) {
            return Err(bad("init_scale", cfg.init_scale.to_string(), "must be a finite number > 0"));
        }
        if cfg.growth_factor.is_nan() || cfg.growth_factor <= 1.0 {
            return Err(bad("growth_factor", cfg.growth_factor.to_string(), "must be > 1"));
        }
        if !(cfg.backoff_factor > 0.0 && cfg.backoff_factor < 1.0) {
            return Err(bad("backoff_factor", cfg.backoff_factor.to_string(), "must be in (0, 1)"));
        }
        if cfg.growth_interval == 0 {
            return Err(bad("growth_interval", "0".into(), "must be ≥ 1"));
        }
        Ok(GradScaler { cfg, scale: cfg.init_scale, growth_tracker: 0 })
    }

    /// The current scale the loss is multiplied by.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Clean steps since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// The configuration.
    pub fn config(&self) -> &GradScalerConfig {
        &self.cfg
    }

    /// Updates the scale after an optimizer step attempt (`torch._amp_update_scale_`): on overflow multiply by
    /// the backoff factor and reset the tracker; otherwise count a clean step and grow the scale every
    /// `growth_interval` of them.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.cfg.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.cfg.growth_interval {
                self.scale *= self.cfg.growth_factor;
                self.growth_tracker = 0;
            }
        }
    }
}

impl Stateful for GradScaler {
    fn state_dict(&self) -> Result<StateDict> {
        Ok(StateDict::from_meta(serde_json::json!({
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "config": self.cfg,
        })))
    }

    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        self.scale = sd.meta_field("scale")?;
        self.growth_tracker = sd.meta_field("growth_tracker")?;
        if let Some(cfg) = sd.meta.get("config") {
            self.cfg = serde_json::from_value(cfg.clone()).map_err(|e| AccelError::json("scaler config", e))?;
        }
        Ok(())
    }
}

/// Whether every element of every tensor is finite. One reduction per tensor: a sum is finite iff no element is
/// inf/NaN, unless finite values overflow the sum — then the tensors are checked element by element.
pub fn all_finite(tensors: &[Tensor]) -> Result<bool> {
    if tensors.is_empty() {
        return Ok(true);
    }
    let sums = tensors.iter().map(|t| t.to_dtype(DType::F32)?.sum_all()).collect::<candle_core::Result<Vec<_>>>()?;
    let sums = Tensor::stack(&sums, 0)?.to_vec1::<f32>()?;
    if sums.iter().all(|s| s.is_finite()) {
        return Ok(true);
    }
    for t in tensors {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        if v.iter().any(|x| !x.is_finite()) {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn scale_halves_on_overflow_and_doubles_after_interval() {
        let mut s = GradScaler::new(GradScalerConfig { growth_interval: 3, ..Default::default() }).unwrap();
        assert_eq!(s.scale(), 65536.0);
        s.update(true);
        assert_eq!((s.scale(), s.growth_tracker()), (32768.0, 0));
        s.update(false);
        s.update(false);
        assert_eq!((s.scale(), s.growth_tracker()), (32768.0, 2));
        s.update(false);
        assert_eq!((s.scale(), s.growth_tracker()), (65536.0, 0));
    }

    #[test]
    fn state_round_trip() {
        let mut s = GradScaler::new(GradScalerConfig::default()).unwrap();
        s.update(true);
        s.update(false);
        let sd = s.state_dict().unwrap();
        let mut t = GradScaler::new(GradScalerConfig::default()).unwrap();
        t.load_state_dict(&sd).unwrap();
        assert_eq!(s, t);
    }

    #[test]
    fn finiteness_check() {
        let d = Device::Cpu;
        let ok = Tensor::new(&[1f32, -2.0, 3e38], &d).unwrap();
        let big = Tensor::new(&[3e38f32, 3e38], &d).unwrap(); // sum overflows, elements are finite
        let inf = Tensor::new(&[1f32, f32::INFINITY], &d).unwrap();
        let nan = Tensor::new(&[f32::NAN, 1.0], &d).unwrap();
        assert!(all_finite(&[ok.clone(), big]).unwrap());
        assert!(!all_finite(&[ok.clone(), inf]).unwrap());
        assert!(!all_finite(&[nan, ok]).unwrap());
    }
}
