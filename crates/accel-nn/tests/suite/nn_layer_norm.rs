//! `accel_nn::ops::layer_norm`: values and gradients (x, weight, bias) against candle-nn's composed
//! `layer_norm_slow`, for 2-D/3-D/4-D and strided inputs; the fallback dtypes; bad arguments.

use super::nn_check::{assert_close, assert_fused_on, uniform, value_and_grads};
use accel_nn::ops::layer_norm::layer_norm;
use candle_core::{DType, Tensor};

/// Fused (f32) against candle's composed op (f32), value and the three gradients at rel 1e-5.
fn check(x: &Tensor, eps: f64, seed: u64) {
    assert_fused_on();
    let d = *x.dims().last().unwrap();
    // Weight and bias away from 1 and 0 so that their gradients and their effect on dx are visible.
    let w = (uniform(&[d], 1.0, seed + 1) + 1.5).unwrap();
    let b = uniform(&[d], 1.0, seed + 2);
    let probe = uniform(x.dims(), 1.0, seed + 3);
    let (y, g) = value_and_grads(&[x, &w, &b], DType::F32, &probe, |t| layer_norm(&t[0], &t[1], &t[2], eps).unwrap());
    let (y_ref, g_ref) = value_and_grads(&[x, &w, &b], DType::F32, &probe, |t| {
        candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], eps as f32).unwrap()
    });
    let shape = format!("{:?} eps {eps}", x.dims());
    assert_close(&y, &y_ref, 1e-5, &format!("value {shape}"));
    for (i, name) in ["dx", "dweight", "dbias"].iter().enumerate() {
        assert_close(&g[i], &g_ref[i], 1e-5, &format!("{name} {shape}"));
    }
}

#[test]
fn matches_candle_on_several_shapes_and_eps() {
    // Offsets on the inputs: layer norm must not depend on the mean (two-pass variance).
    check(&(uniform(&[7, 16], 2.0, 1) + 3.0).unwrap(), 1e-5, 10);
    check(&uniform(&[3, 5, 128], 3.0, 2), 1e-5, 20);
    check(&uniform(&[2, 3, 4, 13], 1.0, 3), 1e-3, 30);
    // Rows shorter than the kernels' 8-wide accumulators, and a large eps.
    check(&uniform(&[5, 3], 1.0, 4), 0.1, 40);
    // Large enough for several row blocks on rayon's pool (when it has more than one thread).
    check(&uniform(&[16, 64, 128], 2.0, 5), 1e-5, 50);
}

#[test]
fn strided_input_matches() {
    // x is the transpose of a contiguous [d, rows] tensor: the gradient goes back through the transpose.
    assert_fused_on();
    let base = uniform(&[24, 6], 2.0, 7);
    let w = (uniform(&[24], 1.0, 8) + 1.0).unwrap();
    let b = uniform(&[24], 1.0, 9);
    let probe = uniform(&[6, 24], 1.0, 10);
    let f = |fused: bool| {
        value_and_grads(&[&base, &w, &b], DType::F32, &probe, |t| {
            let x = t[0].t().unwrap();
            assert!(!x.is_contiguous());
            if fused {
                layer_norm(&x, &t[1], &t[2], 1e-5).unwrap()
            } else {
                candle_nn::ops::layer_norm_slow(&x, &t[1], &t[2], 1e-5).unwrap()
            }
        })
    };
    let ((y, g), (y_ref, g_ref)) = (f(true), f(false));
    assert_close(&y, &y_ref, 1e-5, "strided value");
    for i in 0..3 {
        assert_close(&g[i], &g_ref[i], 1e-5, &format!("strided grad {i}"));
    }
}

#[test]
fn constant_rows_normalise_to_the_bias() {
    // Variance 0: x − μ = 0 exactly, so y = b exactly (rstd = 1/√eps stays finite).
    let x = Tensor::new(&[[2.5f32, 2.5, 2.5, 2.5]], &candle_core::Device::Cpu).unwrap();
    let w = Tensor::new(&[1f32, 2., 3., 4.], &candle_core::Device::Cpu).unwrap();
    let b = Tensor::new(&[0.5f32, -1., 0., 7.], &candle_core::Device::Cpu).unwrap();
    let y = layer_norm(&x, &w, &b, 1e-5).unwrap();
    assert_eq!(y.to_vec2::<f32>().unwrap(), vec![vec![0.5, -1., 0., 7.]]);
}

#[test]
fn fallback_dtypes_agree_with_the_fused_path() {
    // f64 takes candle's composed ops: the fused f32 result is within f32 rounding of it.
    let x = uniform(&[4, 6, 32], 2.0, 11);
    let w = (uniform(&[32], 1.0, 12) + 1.0).unwrap();
    let b = uniform(&[32], 1.0, 13);
    let probe = uniform(&[4, 6, 32], 1.0, 14);
    let ln = |t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap();
    let (y32, g32) = value_and_grads(&[&x, &w, &b], DType::F32, &probe, ln);
    let (y64, g64) = value_and_grads(&[&x, &w, &b], DType::F64, &probe, ln);
    assert_close(&y32, &y64, 1e-5, "f32 vs f64 value");
    for i in 0..3 {
        assert_close(&g32[i], &g64[i], 1e-5, &format!("f32 vs f64 grad {i}"));
    }
    // bf16 keeps working (computed in f32 inside layer_norm_slow, rounded to bf16) and stays bf16.
    let yb = layer_norm(
        &x.to_dtype(DType::BF16).unwrap(),
        &w.to_dtype(DType::BF16).unwrap(),
        &b.to_dtype(DType::BF16).unwrap(),
        1e-5,
    )
    .unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
    assert_close(&yb, &y64, 2e-2, "bf16 value");
}

#[test]
fn bad_arguments_are_named() {
    let x = uniform(&[3, 8], 1.0, 0);
    let w = uniform(&[8], 1.0, 1);
    let err = |r: accel_nn::Result<Tensor>| r.unwrap_err().to_string();
    let e = err(layer_norm(&x, &uniform(&[7], 1.0, 1), &w, 1e-5));
    assert!(e.contains("weight has shape [7], expected [8]"), "{e}");
    let e = err(layer_norm(&x, &w, &uniform(&[1, 8], 1.0, 1), 1e-5));
    assert!(e.contains("bias has shape [1, 8], expected [8]"), "{e}");
    let e = err(layer_norm(&x, &w.to_dtype(DType::F64).unwrap(), &w, 1e-5));
    assert!(e.contains("weight is F64 but x is F32"), "{e}");
    let e = err(layer_norm(&x, &w, &w, -1.0));
    assert!(e.contains("eps = -1") && e.contains("finite number ≥ 0"), "{e}");
    let e = err(layer_norm(&x, &w, &w, f64::NAN));
    assert!(e.contains("eps = NaN"), "{e}");
    let scalar = Tensor::new(1f32, &candle_core::Device::Cpu).unwrap();
    let e = err(layer_norm(&scalar, &w, &w, 1e-5));
    assert!(e.contains("non-empty last dimension"), "{e}");
    let empty = Tensor::zeros((3, 0), DType::F32, &candle_core::Device::Cpu).unwrap();
    let e = err(layer_norm(&empty, &w, &w, 1e-5));
    assert!(e.contains("shape [3, 0]"), "{e}");
}
