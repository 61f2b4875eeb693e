//! fp16 / bf16 compute with fp32 master weights, and fp16 dynamic loss scaling: an overflowing step is skipped
//! (on every rank), reported, and halves the scale; clean steps grow it; clipping unscales exactly once.

use crate::ranks::*;
use accel::{AcceleratorConfig, GradScaler, GradScalerConfig, MixedPrecision, Sgd, SgdConfig};
use candle_core::DType;

fn fp16() -> AcceleratorConfig {
    AcceleratorConfig { mixed_precision: MixedPrecision::Fp16, ..Default::default() }
}

/// Replaces the Accelerator's scaler with one starting at `init` and growing every 2 clean steps.
fn small_scaler(acc: &accel::Accelerator, init: f64) {
    let cfg = GradScalerConfig { init_scale: init, growth_interval: 2, ..Default::default() };
    *acc.grad_scaler().expect("fp16 has a scaler").lock().unwrap() = GradScaler::new(cfg).unwrap();
}

#[test]
fn fp16_model_vars_are_half_and_masters_fp32() {
    run_ranks(1, fp16(), |acc| {
        assert_eq!(acc.compute_dtype(), DType::F16);
        let (_m, varmap) = tiny_model(&acc, 1)?;
        let prepared = acc.prepare_model(&varmap)?;
        assert!(prepared.parameters().iter().all(|v| v.dtype() == DType::F16));
        assert!(prepared.master_weights().iter().all(|v| v.dtype() == DType::F32));
        assert_eq!(acc.grad_scaler().unwrap().lock().unwrap().scale(), 65536.0);
        Ok(())
    });
}

/// bf16 on the CPU is autocast, as PyTorch's and Accelerate's: f32 parameters (no separate masters), and the
/// linear layers of `accel::ops` multiply bf16-rounded operands into bf16 results on the thread that built the
/// Accelerator, until it is dropped.
#[test]
fn bf16_on_the_cpu_keeps_f32_tensors_and_rounds_the_products() {
    use accel::ops::{autocast, linear};
    // 1 + 2⁻¹⁰ is not a bf16 value: autocast rounds it to 1 before the product (f32 gives 2 + 2⁻¹⁰).
    fn product() -> f32 {
        let dev = candle_core::Device::Cpu;
        let x = candle_core::Tensor::new(&[[1.0f32 + 2f32.powi(-10), 1.0]], &dev).unwrap();
        let w = candle_core::Tensor::new(&[[1.0f32, 1.0]], &dev).unwrap();
        linear::linear(&x, &w, None, linear::Activation::None).unwrap().to_vec2::<f32>().unwrap()[0][0]
    }
    assert!(!autocast::bf16_enabled());
    run_ranks(1, AcceleratorConfig { mixed_precision: MixedPrecision::Bf16, ..Default::default() }, |acc| {
        assert!(acc.grad_scaler().is_none(), "bf16 needs no loss scaling");
        assert_eq!(acc.compute_dtype(), DType::F32);
        let (_m, varmap) = tiny_model(&acc, 1)?;
        let prepared = acc.prepare_model(&varmap)?;
        assert!(prepared.parameters().iter().all(|v| v.dtype() == DType::F32));
        for (p, m) in prepared.parameters().iter().zip(prepared.master_weights()) {
            assert_eq!(p.as_tensor().id(), m.as_tensor().id(), "the parameters are their own masters");
        }
        assert!(autocast::bf16_enabled());
        assert_eq!(product(), 2.0);
        Ok(())
    });
    assert!(!autocast::bf16_enabled(), "dropping the Accelerator turns autocast off again");
    assert_eq!(product(), 2.0 + 2f32.powi(-10));
}

/// Steps 1–2 clean (the scale doubles after 2), step 3 overflows on rank 1 only (its loss × 1e9): both ranks
/// skip it, the weights stay, the scale halves; step 4 is clean again. The result equals a run without step 3.
#[test]
fn fp16_overflow_skips_exactly_the_bad_step_on_every_rank() {
    let run = |with_bad_step: bool| {
        run_ranks(2, fp16(), move |acc| {
            small_scaler(&acc, 1024.0);
            let (model, varmap) = tiny_model(&acc, 5)?;
            let prepared = acc.prepare_model(&varmap)?;
            let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.05))?)?;
            let (x, y) = dataset(64, 8);
            let scaler = acc.grad_scaler().unwrap();
            let mut log = Vec::new();
            let steps: Vec<usize> = if with_bad_step { vec![0, 1, 2, 3] } else { vec![0, 1, 3] };
            for s in steps {
                let start = s * 16 + acc.rank() * 8;
                let mut l = loss(&acc, &model, &x.narrow(0, start, 8)?, &y.narrow(0, start, 8)?)?;
                if s == 2 && acc.rank() == 1 {
                    l = (l * 1e9)?; // fp16 gradients overflow to inf on this rank only
                }
                let before = to_f32_map(&prepared.state_dict()?);
                acc.backward(&l)?;
                let stepped = opt.step()?;
                let after = to_f32_map(&prepared.state_dict()?);
                let scale = scaler.lock().unwrap().scale();
                log.push((s, stepped, opt.step_was_skipped(), scale, before != after));
            }
            Ok((log, acc.optimizer_step_count(), to_f32_map(&prepared.state_dict()?)))
        })
    };
    let with = run(true);
    for (log, count, _) in &with {
        assert_eq!(
            log,
            &vec![
                (0, true, false, 1024.0, true),
                (1, true, false, 2048.0, true),
                (2, false, true, 1024.0, false),
                (3, true, false, 1024.0, true),
            ]
        );
        assert_eq!(*count, 3);
    }
    assert_eq!(with[0].2, with[1].2);
    let without = run(false);
    let d = max_rel_diff(&with[0].2, &without[0].2);
    assert!(d <= 1e-6, "skipping the bad step must leave no trace: difference {d:e}");
}

/// Clipping under fp16 unscales first, once per optimizer step: calling it twice returns the same norm, and the
/// norm does not depend on the loss scale.
#[test]
fn fp16_clip_grad_norm_unscales_once() {
    let norms = |init: f64| {
        run_ranks(1, fp16(), move |acc| {
            small_scaler(&acc, init);
            let (model, varmap) = tiny_model(&acc, 5)?;
            let prepared = acc.prepare_model(&varmap)?;
            let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.05))?)?;
            let (x, y) = dataset(8, 8);
            acc.backward(&loss(&acc, &model, &x, &y)?)?;
            let n1 = acc.clip_grad_norm(1e9)?.expect("a sync step");
            let n2 = acc.clip_grad_norm(1e9)?.expect("a sync step");
            assert!(opt.step()?);
            Ok((n1, n2))
        })
        .remove(0)
    };
    let (a1, a2) = norms(1024.0);
    let (b1, _) = norms(4096.0);
    assert_eq!(a1, a2, "second clip must not unscale again");
    assert!(a1 > 0.0 && a1 < 100.0, "unscaled norm expected, got {a1}");
    assert!((a1 - b1).abs() <= 1e-3 * a1, "norm depends on the loss scale: {a1} vs {b1}");
}

/// With the default scale 65536 and an fp16 loss graph, the first steps may overflow: the scaler backs off until
/// steps go through, and training proceeds (the scale never reaches zero).
#[test]
fn fp16_default_scaler_recovers_from_initial_overflows() {
    run_ranks(1, fp16(), |acc| {
        let (model, varmap) = tiny_model(&acc, 5)?;
        let prepared = acc.prepare_model(&varmap)?;
        let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.05))?)?;
        let (x, y) = dataset(256, 8);
        let mut taken = 0;
        for s in 0..16 {
            let l = loss(&acc, &model, &x.narrow(0, s * 16, 16)?, &y.narrow(0, s * 16, 16)?)?;
            acc.backward(&l)?;
            taken += usize::from(opt.step()?);
        }
        let c = acc.step_counters();
        assert_eq!(c.optimizer_steps + c.skipped_steps, 16);
        assert_eq!(c.optimizer_steps as usize, taken);
        assert!(taken >= 8, "only {taken} of 16 steps went through");
        let scale = acc.grad_scaler().unwrap().lock().unwrap().scale();
        assert_eq!(scale, 65536.0 * 0.5f64.powi(c.skipped_steps as i32));
        Ok(())
    });
}

/// fp16, 2 ranks, GA = 2, `clip_grad_norm` called after every `backward` (accelerate#641's pattern) with a
/// max_norm that never clips: the result equals clipping on sync steps only — no skipped steps, the same loss scale,
/// the same parameters. (It used to unscale the partial sum on the first micro-step, so the window mixed scaled and
/// unscaled gradients: norms of 7e4 instead of 6, most steps skipped, the scale collapsing.)
#[test]
fn fp16_clipping_on_every_micro_step_equals_clipping_on_sync_steps() {
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 2, ..fp16() };
    let run = |clip_every_micro_step: bool| {
        run_ranks(2, cfg.clone(), move |acc| {
            let (model, varmap) = tiny_model(&acc, 5)?;
            let prepared = acc.prepare_model(&varmap)?;
            let mut opt = acc.prepare_optimizer(&prepared, Sgd::new(SgdConfig::new(0.05))?)?;
            let (x, y) = dataset(64, 8);
            let mut norms = Vec::new();
            for m in 0..8 {
                let start = m * 8 + acc.rank() * 4;
                acc.backward(&loss(&acc, &model, &x.narrow(0, start, 4)?, &y.narrow(0, start, 4)?)?)?;
                if clip_every_micro_step || acc.sync_gradients() {
                    let norm = acc.clip_grad_norm(1e6)?;
                    assert_eq!(norm.is_some(), acc.sync_gradients(), "clipping only acts on sync steps");
                    norms.extend(norm);
                }
                opt.step()?;
            }
            let c = acc.step_counters();
            let scale = acc.grad_scaler().unwrap().lock().unwrap().scale();
            Ok((norms, c.optimizer_steps, c.skipped_steps, scale, to_f32_map(&prepared.state_dict()?)))
        })
    };
    let every = run(true);
    let sync_only = run(false);
    for (e, s) in every.iter().zip(&sync_only) {
        assert_eq!((e.1, e.2), (4, 0), "four clean optimizer steps");
        assert_eq!(e.0, s.0, "the same norms");
        assert!(e.0.iter().all(|n| *n < 100.0), "norms of unscaled gradients: {:?}", e.0);
        assert_eq!(e.3, s.3, "the same loss scale");
        assert_eq!(e.4, s.4, "the same parameters");
    }
}
