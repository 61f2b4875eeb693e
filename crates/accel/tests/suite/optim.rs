//! Optimizer math against hand-computed values (torch.optim.SGD / torch.optim.AdamW formulas), exact state
//! save/restore, and gradient clipping.

use crate::ranks::*;
use accel::state::StateDict;
use accel::{AcceleratorConfig, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use candle_core::{Device, Tensor, Var};

fn param(v: &[f32]) -> Var {
    Var::new(v, &Device::Cpu).unwrap()
}
fn grad(v: &[f32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}
fn values(p: &Var) -> Vec<f32> {
    p.as_tensor().to_vec1::<f32>().unwrap()
}
fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}");
    }
}

// p = [1, -2], g = [0.5, 0.25] on every step, lr 0.1, momentum 0.9, weight decay 0.01:
//   step 1: g' = g + 0.01·p = [0.51, 0.23]; b = g' ; p = [0.949, -2.023]
//   step 2: g' = [0.50949, 0.22977]; b = 0.9·[0.51, 0.23] + g' = [0.96849, 0.43677]; p = [0.852151, -2.066677]
#[test]
fn sgd_momentum_weight_decay_matches_hand_computed() {
    let cfg = SgdConfig { momentum: 0.9, weight_decay: 0.01, ..SgdConfig::new(0.1) };
    let mut opt = Sgd::new(cfg).unwrap();
    let p = param(&[1.0, -2.0]);
    opt.step(std::slice::from_ref(&p), &[Some(grad(&[0.5, 0.25]))]).unwrap();
    assert_close(&values(&p), &[0.949, -2.023], 1e-6, "step 1");
    opt.step(std::slice::from_ref(&p), &[Some(grad(&[0.5, 0.25]))]).unwrap();
    assert_close(&values(&p), &[0.852151, -2.066677], 1e-6, "step 2");
}

// Nesterov (Sutskever et al. 2013, torch form): g'' = g' + μ·b.
//   step 1: b = [0.51, 0.23]; g'' = [0.969, 0.437]; p = [0.9031, -2.0437]
//   step 2: g' = [0.509031, 0.229563]; b = [0.968031, 0.436563]; g'' = [1.3802589, 0.6224697];
//           p = [0.76507411, -2.10594697]
#[test]
fn sgd_nesterov_matches_hand_computed() {
    let cfg = SgdConfig { momentum: 0.9, weight_decay: 0.01, nesterov: true, ..SgdConfig::new(0.1) };
    let mut opt = Sgd::new(cfg).unwrap();
    let p = param(&[1.0, -2.0]);
    opt.step(std::slice::from_ref(&p), &[Some(grad(&[0.5, 0.25]))]).unwrap();
    assert_close(&values(&p), &[0.9031, -2.0437], 1e-6, "step 1");
    opt.step(std::slice::from_ref(&p), &[Some(grad(&[0.5, 0.25]))]).unwrap();
    assert_close(&values(&p), &[0.76507411, -2.10594697], 1e-6, "step 2");
}

// Dampening 0.5 (first step takes the gradient undampened, as torch):
//   step 1: b = [0.5, 0.25]; p = [0.95, -2.025];  step 2: b = 0.9·b + 0.5·g = [0.7, 0.35]; p = [0.88, -2.06]
#[test]
fn sgd_dampening_and_plain_sgd() {
    let mut opt = Sgd::new(SgdConfig { momentum: 0.9, dampening: 0.5, ..SgdConfig::new(0.1) }).unwrap();
    let p = param(&[1.0, -2.0]);
    for _ in 0..2 {
        opt.step(std::slice::from_ref(&p), &[Some(grad(&[0.5, 0.25]))]).unwrap();
    }
    assert_close(&values(&p), &[0.88, -2.06], 1e-6, "dampened");
    let mut plain = Sgd::new(SgdConfig::new(0.5)).unwrap();
    let q = param(&[1.0, 1.0]);
    plain.step(std::slice::from_ref(&q), &[Some(grad(&[2.0, -4.0]))]).unwrap();
    assert_close(&values(&q), &[0.0, 3.0], 0.0, "plain SGD p − lr·g");
}

// AdamW, lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.1, p = [1, -2], constant g = [0.5, 0.25]:
//   step 1: p·(1 − 0.01) = [0.99, -1.98]; m = [0.05, 0.025]; v = [2.5e-4, 6.25e-5];
//           m̂ = g, √v̂ = |g| → update lr·sign(g) = 0.1 → p = [0.89, -2.08]
//   step 2: p·0.99 = [0.8811, -2.0592]; again m̂ = g, √v̂ = |g| → p = [0.7811, -2.1592]
//   step 3 with g = [-1, 0.5]: m = [0.0355, 0.06775]... (computed below in f64 from the formulas)
#[test]
fn adamw_matches_hand_computed() {
    let cfg = AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
    let mut opt = AdamW::new(cfg).unwrap();
    let p = param(&[1.0, -2.0]);
    opt.step(std::slice::from_ref(&p), &[Some(grad(&[0.5, 0.25]))]).unwrap();
    assert_close(&values(&p), &[0.89, -2.08], 1e-6, "step 1");
    opt.step(std::slice::from_ref(&p), &[Some(grad(&[0.5, 0.25]))]).unwrap();
    assert_close(&values(&p), &[0.7811, -2.1592], 1e-6, "step 2");
    opt.step(std::slice::from_ref(&p), &[Some(grad(&[-1.0, 0.5]))]).unwrap();
    // Step 3 by hand (f64): m = 0.9·m₂ + 0.1·g, v = 0.999·v₂ + 0.001·g², with m₂ = [0.095, 0.0475],
    // v₂ = [4.9975e-4, 1.249375e-4].
    let (b1, b2): (f64, f64) = (0.9, 0.999);
    let want: Vec<f64> = [(0.7811f64, 0.095f64, 4.9975e-4f64, -1.0f64), (-2.1592, 0.0475, 1.249375e-4, 0.5)]
        .iter()
        .map(|&(p, m2, v2, g)| {
            let p = p * (1.0 - 0.1 * 0.1);
            let m = b1 * m2 + (1.0 - b1) * g;
            let v = b2 * v2 + (1.0 - b2) * g * g;
            let (bc1, bc2) = (1.0 - b1.powi(3), 1.0 - b2.powi(3));
            p - (0.1 / bc1) * m / (v.sqrt() / bc2.sqrt() + 1e-8)
        })
        .collect();
    assert_close(&values(&p), &want, 1e-5, "step 3");
    assert_eq!(opt.steps(), 3);
}

/// Save after 2 steps, restore into a fresh optimizer, take step 3 on both: bit-identical parameters.
#[test]
fn optimizer_state_round_trip_is_exact() {
    fn check(mut a: Box<dyn Optimizer>, mut b: Box<dyn Optimizer>) {
        let pa = param(&[0.3, -0.7, 1.1]);
        let grads = [Some(grad(&[0.1, -0.2, 0.3])), Some(grad(&[-0.4, 0.5, 0.05])), Some(grad(&[0.2, 0.2, -0.9]))];
        a.step(std::slice::from_ref(&pa), std::slice::from_ref(&grads[0])).unwrap();
        a.step(std::slice::from_ref(&pa), std::slice::from_ref(&grads[1])).unwrap();
        let sd: StateDict = a.state_dict().unwrap();
        // Through the on-disk format too.
        let dir = tempfile::tempdir().unwrap();
        sd.save(dir.path(), "optimizer").unwrap();
        let sd = StateDict::load(dir.path(), "optimizer", &Device::Cpu).unwrap();
        let pb = param(&values(&pa));
        b.load_state_dict(&sd).unwrap();
        assert_eq!(b.learning_rate(), a.learning_rate());
        a.step(std::slice::from_ref(&pa), std::slice::from_ref(&grads[2])).unwrap();
        b.step(std::slice::from_ref(&pb), std::slice::from_ref(&grads[2])).unwrap();
        let (va, vb) = (values(&pa), values(&pb));
        assert_eq!(
            va.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            vb.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
    let sgd = || Sgd::new(SgdConfig { momentum: 0.9, nesterov: true, ..SgdConfig::new(0.05) }).unwrap();
    check(Box::new(sgd()), Box::new(sgd()));
    let adamw = || AdamW::new(AdamWConfig::new(0.01)).unwrap();
    check(Box::new(adamw()), Box::new(adamw()));
    // Loading another optimizer's state is refused, naming both.
    let sd = sgd().state_dict().unwrap();
    let err = adamw().load_state_dict(&sd).unwrap_err().to_string();
    assert!(err.contains("sgd") && err.contains("adamw"), "{err}");
}

#[test]
fn bad_hyper_parameters_and_mismatched_gradients_are_errors() {
    let e = Sgd::new(SgdConfig { nesterov: true, ..SgdConfig::new(0.1) }).unwrap_err().to_string();
    assert!(e.contains("momentum"), "{e}");
    let e = AdamW::new(AdamWConfig { beta1: 1.0, ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("beta1"), "{e}");
    let mut opt = Sgd::new(SgdConfig::new(0.1)).unwrap();
    let e = opt.step(&[param(&[1.0, 2.0])], &[Some(grad(&[1.0]))]).unwrap_err().to_string();
    assert!(e.contains("shape"), "{e}");
    let e = opt.step(&[param(&[1.0])], &[]).unwrap_err().to_string();
    assert!(e.contains("1 parameters but 0 gradients"), "{e}");
}

#[test]
fn learning_rate_is_settable_through_the_accelerated_optimizer() {
    run_ranks(1, AcceleratorConfig::default(), |acc| {
        let (_m, varmap) = tiny_model(&acc, 1)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(0.01))?)?;
        opt.set_learning_rate(0.5);
        assert_eq!(opt.learning_rate(), 0.5);
        assert_eq!(opt.optimizer().learning_rate(), 0.5);
        Ok(())
    });
}

/// clip_grad_norm returns the global L2 norm and scales gradients down to max_norm (torch's coefficient
/// max_norm / (norm + 1e-6)); a max_norm above the norm leaves them alone. clip_grad_value clamps.
#[test]
fn clipping_by_norm_and_by_value() {
    run_ranks(1, AcceleratorConfig::default(), |acc| {
        let (model, varmap) = tiny_model(&acc, 2)?;
        let prepared = acc.prepare_model(&varmap)?;
        let (x, y) = dataset(8, 3);
        acc.backward(&loss(&acc, &model, &x, &y)?)?;
        let flat = |gs: Vec<Option<Tensor>>| -> Vec<f32> {
            gs.into_iter().flat_map(|g| g.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
        };
        let before = flat(acc.gradients(&prepared).0);
        let norm: f64 = before.iter().map(|g| (*g as f64).powi(2)).sum::<f64>().sqrt();
        let got = acc.clip_grad_norm(norm * 10.0)?.expect("a sync step");
        assert!((got - norm).abs() <= 1e-6 * norm, "norm {got} vs {norm}");
        assert_eq!(flat(acc.gradients(&prepared).0), before, "max_norm above the norm must not change gradients");
        let max_norm = norm / 4.0;
        acc.clip_grad_norm(max_norm)?;
        let after = flat(acc.gradients(&prepared).0);
        let new_norm: f64 = after.iter().map(|g| (*g as f64).powi(2)).sum::<f64>().sqrt();
        assert!((new_norm - max_norm).abs() <= 1e-5 * max_norm, "clipped norm {new_norm}, wanted {max_norm}");
        let v = after.iter().fold(0f32, |a, g| a.max(g.abs())) / 2.0;
        acc.clip_grad_value(v as f64)?;
        let clamped = flat(acc.gradients(&prepared).0);
        assert!(clamped.iter().all(|g| g.abs() <= v));
        assert!(clamped.iter().any(|g| g.abs() == v));
        Ok(())
    });
}

/// Under `find_unused_parameters`, a parameter no rank ever uses gets no gradient and the optimizer leaves it
/// alone — not even AdamW's weight decay moves it (PyTorch skips a parameter whose `.grad` is `None`); the used
/// parameters train. (It used to receive zero gradients and decay: −0.009060722 → −0.009058003 after 3 steps.)
#[test]
fn a_parameter_no_rank_uses_is_never_updated() {
    let mut cfg = AcceleratorConfig::default();
    cfg.ddp.find_unused_parameters = true;
    let out = run_ranks(2, cfg, |acc| {
        let (model, varmap) = tiny_model(&acc, 4)?;
        let unused = acc.var_builder(&varmap).get_with_hints((3, 2), "unused", candle_nn::Init::Const(-0.009060722))?;
        let prepared = acc.prepare_model(&varmap)?;
        let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::new(1e-2) };
        let mut opt = acc.prepare_optimizer(&prepared, AdamW::new(cfg)?)?;
        let (x, y) = dataset(24, 3);
        let before = to_f32_map(&prepared.state_dict()?);
        for s in 0..3 {
            let start = s * 8 + acc.rank() * 4;
            acc.backward(&loss(&acc, &model, &x.narrow(0, start, 4)?, &y.narrow(0, start, 4)?)?)?;
            let (grads, synced) = acc.gradients(&prepared);
            assert!(synced);
            let i = prepared.names().iter().position(|n| n == "unused").unwrap();
            assert!(grads[i].is_none(), "no rank used it: no gradient after the reduction");
            assert!(opt.step()?);
        }
        let after = to_f32_map(&prepared.state_dict()?);
        Ok((before, after, unused.flatten_all()?.to_vec1::<f32>()?))
    });
    for (before, after, unused) in out {
        assert_eq!(after["unused"], before["unused"], "the unused parameter moved");
        assert_eq!(unused, vec![-0.009060722f32; 6]);
        assert_ne!(after["l1.weight"], before["l1.weight"], "the used parameters train");
    }
}
