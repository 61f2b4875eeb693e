//! The optimizers at level 1: a `GradStore` from candle's backward → `grads_for` → `AdamW::step`, unused
//! parameters left alone, state saved to disk and restored bit for bit, typed errors. (The update formulas against
//! hand-computed torch.optim values are in accel's suite, through the re-exports.)

use accel_nn::optim::{grads_for, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use accel_nn::{NnError, StateDict};
use candle_core::{Device, Tensor, Var};

fn var(v: &[f32]) -> Var {
    Var::new(v, &Device::Cpu).unwrap()
}

fn values(v: &Var) -> Vec<f32> {
    v.as_tensor().to_vec1::<f32>().unwrap()
}

/// loss = Σ (w ⊙ x); `unused` takes no part, so backward gives it no gradient (∂loss/∂w = x).
fn grads(w: &Var, x: &[f32]) -> candle_core::backprop::GradStore {
    let x = Tensor::new(x, &Device::Cpu).unwrap();
    w.as_tensor().mul(&x).unwrap().sum_all().unwrap().backward().unwrap()
}

// First AdamW step, weight decay 0: m̂ = g, v̂ = g², so p ← p − lr·g / (|g| + ε) = p − lr·sign(g) (to ~1e-8).
#[test]
fn adamw_steps_the_vars_with_a_gradient_and_leaves_the_others() {
    let (w, unused) = (var(&[1.0, -2.0]), var(&[3.0]));
    let vars = vec![w.clone(), unused.clone()];
    let mut opt = AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::new(0.1) }).unwrap();
    let g = grads(&w, &[0.5, -0.25]);
    let slots = grads_for(&vars, &g);
    assert!(slots[0].is_some() && slots[1].is_none());
    opt.step(&vars, &slots).unwrap();
    let got = values(&w);
    for (g, want) in got.iter().zip([0.9f32, -1.9]) {
        assert!((g - want).abs() <= 1e-6, "w: got {got:?}, want [0.9, -1.9]");
    }
    assert_eq!(values(&unused), [3.0]);
    let sd = opt.state_dict().unwrap();
    let keys: Vec<&str> = sd.tensors.keys().map(String::as_str).collect();
    assert_eq!(keys, ["0.exp_avg", "0.exp_avg_sq"], "no state for the parameter without a gradient");
    assert_eq!(sd.meta_field::<Vec<u64>>("param_steps").unwrap(), [1, 0]);
}

// Two optimizers, one restored from the other's saved files, take bit-identical steps from there on.
#[test]
fn adamw_state_saved_to_disk_resumes_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = AdamWConfig::new(0.05);
    let (w, mut opt) = (var(&[0.3, -0.7, 1.1]), AdamW::new(cfg).unwrap());
    let x = [[0.5f32, -1.0, 0.25], [0.1, 0.2, -0.3], [-0.4, 0.6, 0.9]];
    for xi in &x[..2] {
        opt.step(std::slice::from_ref(&w), &grads_for(std::slice::from_ref(&w), &grads(&w, xi))).unwrap();
    }
    opt.state_dict().unwrap().save(dir.path(), "optimizer").unwrap();
    let w2 = var(&values(&w));
    let mut restored = AdamW::new(cfg).unwrap();
    restored.load_state_dict(&StateDict::load(dir.path(), "optimizer", &Device::Cpu).unwrap()).unwrap();
    assert_eq!(restored.steps(), 2);
    for (p, o) in [(&w, &mut opt), (&w2, &mut restored)] {
        o.step(std::slice::from_ref(p), &grads_for(std::slice::from_ref(p), &grads(p, &x[2]))).unwrap();
    }
    let (a, b) = (values(&w), values(&w2));
    assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
}

#[test]
fn bad_settings_and_foreign_state_are_typed_errors() {
    let e = AdamW::new(AdamWConfig { beta2: 1.5, ..Default::default() }).unwrap_err();
    assert!(matches!(&e, NnError::Config { key, .. } if key == "AdamWConfig.beta2"), "{e}");
    let e = Sgd::new(SgdConfig { lr: -1.0, ..SgdConfig::new(0.1) }).unwrap_err();
    assert!(matches!(&e, NnError::Config { key, .. } if key == "SgdConfig.lr"), "{e}");
    let sgd_state = Sgd::new(SgdConfig::new(0.1)).unwrap().state_dict().unwrap();
    let e = AdamW::new(AdamWConfig::default()).unwrap().load_state_dict(&sgd_state).unwrap_err();
    assert!(matches!(e, NnError::InvalidArgument(_)) && e.to_string().contains("\"sgd\""), "{e}");
    let e = StateDict::load(std::path::Path::new("/nonexistent-accel-rs"), "optimizer", &Device::Cpu).unwrap_err();
    assert!(matches!(e, NnError::Checkpoint { .. }) && e.to_string().contains("optimizer.json"), "{e}");
}
