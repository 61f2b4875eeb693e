//! Reproducible model initialisation. HF's Trainer calls `set_seed(args.seed)` before building the model so two
//! runs with the same seed start from the same weights; candle's CPU `randn`/`rand` cannot be seeded, so the
//! Trainer builds a model written the candle way through accel's seeded `VarBuilder` (the Accelerator's
//! `var_builder`, over [`seeded_var_builder`]): each parameter drawn from `(seed, name)` with the distribution
//! candle asked for, the same draw accel's tensor-parallel builders make for the same name, so every constructor
//! and every layout starts from the same weights.

pub use accel::nn::seeded_var_builder;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::VarMap;

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
        let vm = VarMap::new();
        let vb = seeded_var_builder(&vm, 1, DType::F32, &Device::Cpu);
        let t = vb.get_with_hints(20_000, "w", candle_nn::Init::Randn { mean: 1.0, stdev: 2.0 }).unwrap();
        let v = t.to_vec1::<f32>().unwrap();
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.05 && (var.sqrt() - 2.0).abs() < 0.05, "{mean} {var}");
    }
}
