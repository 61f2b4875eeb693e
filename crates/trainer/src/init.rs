//! Reproducible model initialisation: a `VarBuilder` over a `VarMap` whose new parameters are drawn from a
//! ChaCha8 stream seeded by `(seed, parameter name)`, instead of candle's unseedable CPU RNG.
//!
//! HF's Trainer calls `set_seed(args.seed)` before building the model so two runs with the same seed start from
//! the same weights; candle's CPU `randn`/`rand` cannot be seeded, so the trainer builds the model through
//! [`seeded_var_builder`]. Each parameter's values depend only on the seed and its name (not on creation order),
//! following the distribution candle-nn asked for (`Init::Const`, `Randn`, `Uniform`, `Kaiming` — the latter with
//! candle-nn's fan and gain, He et al. 2015). Normal samples use the Box–Muller transform.

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::{FanInOut, Init, NonLinearity, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A `VarBuilder` over `varmap` creating parameters in `dtype` on `device` with values determined by `seed` and
/// each parameter's name. Existing entries of `varmap` are returned unchanged (shape-checked).
pub fn seeded_var_builder(varmap: &VarMap, seed: u64, dtype: DType, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(SeededVarMap { varmap: varmap.clone(), seed }), dtype, device.clone())
}

/// The values of a fresh parameter `name` of `shape` under `init` (f32, CPU), as [`seeded_var_builder`] draws
/// them.
pub fn seeded_init(seed: u64, name: &str, shape: &Shape, init: Init) -> candle_core::Result<Tensor> {
    let n = shape.elem_count();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ fnv1a(name.as_bytes()));
    let uniform = |rng: &mut ChaCha8Rng, lo: f64, up: f64| -> Vec<f32> {
        (0..n).map(|_| (lo + (up - lo) * rng.random::<f64>()) as f32).collect()
    };
    let normal = |rng: &mut ChaCha8Rng, mean: f64, std: f64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                // Box–Muller: u1 in (0, 1] so the log is finite.
                let u1 = 1.0 - rng.random::<f64>();
                let u2 = rng.random::<f64>();
                (mean + std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            })
            .collect()
    };
    let values = match init {
        Init::Const(c) => vec![c as f32; n],
        Init::Uniform { lo, up } => uniform(&mut rng, lo, up),
        Init::Randn { mean, stdev } => normal(&mut rng, mean, stdev),
        Init::Kaiming { dist, fan, non_linearity } => {
            let fan = kaiming_fan(fan, shape);
            let std = gain(non_linearity) / (fan.max(1) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(&mut rng, -bound, bound)
                }
                NormalOrUniform::Normal => normal(&mut rng, 0.0, std),
            }
        }
    };
    Tensor::from_vec(values, shape.clone(), &Device::Cpu)
}

fn kaiming_fan(fan: FanInOut, shape: &Shape) -> usize {
    fan.for_shape(shape)
}

fn gain(nl: NonLinearity) -> f64 {
    nl.gain()
}

/// FNV-1a, to turn a parameter name into a seed offset that does not depend on the platform's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

struct SeededVarMap {
    varmap: VarMap,
    seed: u64,
}

impl SimpleBackend for SeededVarMap {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let mut data = accel::lock(self.varmap.data());
        if let Some(v) = data.get(name) {
            if v.shape() != &s {
                candle_core::bail!("shape mismatch on {name}: {s:?} <> {:?}", v.shape())
            }
            return Ok(v.as_tensor().clone());
        }
        let values = seeded_init(self.seed, name, &s, h)?.to_dtype(dtype)?.to_device(dev)?;
        let var = Var::from_tensor(&values)?;
        let t = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("seeded VarMap: parameter {name:?} needs a shape; use `get` instead of `get_unchecked`")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        accel::lock(self.varmap.data()).contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_weights_any_order() {
        let build = |seed: u64, order: &[&str], param: &str| {
            let vm = VarMap::new();
            let vb = seeded_var_builder(&vm, seed, DType::F32, &Device::Cpu);
            for name in order {
                candle_nn::linear(8, 4, vb.pp(*name)).unwrap();
            }
            let data = vm.data().lock().unwrap();
            data[param].as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let w = build(7, &["a", "b"], "b.weight");
        assert_eq!(w, build(7, &["b", "a"], "b.weight"));
        assert_ne!(w, build(8, &["a", "b"], "b.weight"));
        // candle_nn::linear: bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) = U(-0.3536, 0.3536).
        let b = build(7, &["a", "b"], "b.bias");
        assert!(b.iter().all(|v| v.abs() <= 0.3536) && b.iter().any(|v| v.abs() > 0.05), "{b:?}");
    }

    #[test]
    fn normal_init_has_the_requested_moments() {
        let t = seeded_init(1, "w", &Shape::from(20_000), Init::Randn { mean: 1.0, stdev: 2.0 }).unwrap();
        let v = t.to_vec1::<f32>().unwrap();
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.05 && (var.sqrt() - 2.0).abs() < 0.05, "{mean} {var}");
    }
}
